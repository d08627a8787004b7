/*
 * test_share_process.c -- shared storages seen from other processes: a forked child writes
 * and the parent sees it (and back), an fd sent over a Unix socket (SCM_RIGHTS) attaches in
 * another process, read-only sealing holds across processes, and a child killed with SIGKILL
 * while attached leaves the parent's bytes intact.
 */
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t page;

static void send_fd(int sock, int fd, uint64_t word) {
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct iovec iov = {&word, sizeof word};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    ASSERT_EQ(sendmsg(sock, &msg, 0), (ssize_t)sizeof word);
}

static int recv_fd(int sock, uint64_t *word) {
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {word, sizeof *word};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ASSERT_EQ(recvmsg(sock, &msg, MSG_CMSG_CLOEXEC), (ssize_t)sizeof *word);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    ASSERT(c != NULL && c->cmsg_type == SCM_RIGHTS);
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

static void wait_child(pid_t pid, int expect_signal) {
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (expect_signal) {
        ASSERT(WIFSIGNALED(status));
        ASSERT_EQ(WTERMSIG(status), expect_signal);
    } else {
        ASSERT(WIFEXITED(status));
        ASSERT_EQ(WEXITSTATUS(status), 0);
    }
}

/* A child sees the shared pages of its parent (MAP_SHARED survives fork), both ways. */
/* fork() with a connected socket pair: returns the pid and, in *own, this side's end of the
 * pair (the other end is closed on each side). */
static pid_t fork_with_socket(int *own) {
    int sv[2];
    ASSERT_OK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv));
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    close(pid == 0 ? sv[0] : sv[1]);
    *own = pid == 0 ? sv[1] : sv[0];
    return pid;
}

static void test_fork(void) {
    const size_t n = 2 * page + 10;
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
    unsigned char *raw = lshm_storage_data(s);
    memset(raw, 1, n);
    ASSERT_OK(lshm_storage_share(s));
    int sock;
    pid_t pid = fork_with_socket(&sock);
    if (pid == 0) {
        ASSERT_EQ(raw[0], 1);
        memset(raw, 2, n); /* child writes through the parent's old pointer */
        send_byte(sock, 'w');
        ASSERT_EQ(recv_byte(sock), 'p');
        for (size_t i = 0; i < n; i++)
            ASSERT_EQ(raw[i], 3); /* and sees what the parent wrote after */
        _exit(0);
    }
    ASSERT_EQ(recv_byte(sock), 'w');
    for (size_t i = 0; i < n; i++)
        ASSERT_EQ(raw[i], 2);
    memset(lshm_storage_data(s), 3, n);
    send_byte(sock, 'p');
    wait_child(pid, 0);
    close(sock);
    lshm_storage_release(s);
}

/* Parent shares after the fork, so the child holds nothing until the fd arrives. */
static void test_scm_rights(void) {
    const size_t n = 5 * page + 123;
    int sock;
    pid_t pid = fork_with_socket(&sock);
    if (pid == 0) {
        uint64_t nbytes;
        int fd = recv_fd(sock, &nbytes);
        lshm_storage *t;
        ASSERT_OK(lshm_storage_attach(fd, 0, (size_t)nbytes, 0, &t));
        close(fd); /* the storage holds its own dup */
        unsigned char *p = lshm_storage_data(t);
        for (size_t i = 0; i < nbytes; i++)
            ASSERT_EQ(p[i], (unsigned char)(i % 253));
        for (size_t i = 0; i < nbytes; i++)
            p[i] = (unsigned char)(i % 13);
        lshm_storage_release(t);
        send_byte(sock, 'd');
        _exit(0);
    }
    int fds = fd_count();
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
    unsigned char *raw = lshm_storage_data(s);
    for (size_t i = 0; i < n; i++)
        raw[i] = (unsigned char)(i % 253);
    ASSERT_OK(lshm_storage_share(s));
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    send_fd(sock, fd, n);
    ASSERT_EQ(recv_byte(sock), 'd');
    wait_child(pid, 0);
    for (size_t i = 0; i < n; i++)
        ASSERT_EQ(raw[i], (unsigned char)(i % 13));
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), fds);
    close(sock);
}

/* After seal_readonly, another process can only attach read-only. */
static void test_readonly_across(void) {
    int sock;
    pid_t pid = fork_with_socket(&sock);
    if (pid == 0) {
        uint64_t nbytes;
        int fd = recv_fd(sock, &nbytes);
        lshm_segment *seg = NULL;
        ASSERT_ERR(lshm_segment_attach(fd, 0, &seg), -EPERM);
        ASSERT_OK(lshm_segment_attach(fd, LSHM_STORAGE_READONLY, &seg));
        ASSERT_EQ(((char *)lshm_segment_data(seg))[0], 'r');
        lshm_segment_release(seg);
        close(fd);
        send_byte(sock, 'd');
        _exit(0);
    }
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(page, 0, &seg));
    ((char *)lshm_segment_data(seg))[0] = 'r';
    ASSERT_OK(lshm_segment_seal_readonly(seg));
    send_fd(sock, segment_fd(seg), page);
    ASSERT_EQ(recv_byte(sock), 'd');
    wait_child(pid, 0);
    lshm_segment_release(seg);
    close(sock);
}

/* A child that attaches and dies by SIGKILL takes nothing with it. */
static void test_child_crash(void) {
    const size_t n = 4 * page;
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
    memset(lshm_storage_data(s), 0x3c, n);
    ASSERT_OK(lshm_storage_share(s));
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    int sock;
    pid_t pid = fork_with_socket(&sock);
    if (pid == 0) {
        lshm_storage *t;
        ASSERT_OK(lshm_storage_attach(fd, 0, n, 0, &t));
        send_byte(sock, 'a');
        for (;;)
            pause(); /* killed here, holding the mapping and an fd */
    }
    ASSERT_EQ(recv_byte(sock), 'a');
    ASSERT_OK(kill(pid, SIGKILL));
    wait_child(pid, SIGKILL);
    const unsigned char *p = lshm_storage_data(s);
    for (size_t i = 0; i < n; i++)
        ASSERT_EQ(p[i], 0x3c);
    /* still a working shared storage */
    lshm_storage *t;
    ASSERT_OK(lshm_storage_attach(fd, 0, n, LSHM_STORAGE_READONLY, &t));
    ASSERT(memcmp(lshm_storage_data(t), p, n) == 0);
    lshm_storage_release(t);
    lshm_storage_release(s);
    close(sock);
}

/* Read-only really means read-only: a write through such a storage kills the writer. */
static void test_readonly_write_faults(void) {
    lshm_storage *s, *ro;
    ASSERT_OK(lshm_storage_create_shared(page, 0, &s));
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    ASSERT_OK(lshm_storage_attach(fd, 0, page, LSHM_STORAGE_READONLY, &ro));
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL);
        ((volatile char *)lshm_storage_data(ro))[0] = 1;
        _exit(0); /* not reached */
    }
    wait_child(pid, SIGSEGV);
    ASSERT_EQ(((char *)lshm_storage_data(s))[0], 0);
    lshm_storage_release(ro);
    lshm_storage_release(s);
}

int main(void) {
    page = lshm_page_size();
    /* These tests are about storages with a memfd of their own; test_slab covers slabs. */
    lshm__slab_max_bytes = 0;
    RUN_TEST(test_fork);
    RUN_TEST(test_scm_rights);
    RUN_TEST(test_readonly_across);
    RUN_TEST(test_child_crash);
    RUN_TEST(test_readonly_write_faults);
    return 0;
}
