/*
 * test_fork_share.c -- fork() while another thread is inside lshm_storage_share.
 *
 * A thread shares a 256 MiB storage of default pages (the chunked path, with small chunks so the
 * share takes a while) and the main thread forks after 0, 1, 5 and 20 ms. fork() waits for the
 * shares in flight, so the child finds the storage either shared completely or not at all:
 *   - its flags say SHARED exactly when it sees a write the parent makes after the fork;
 *   - /proc/self/maps agrees: every mapping over the range is shared, or none is;
 *   - no storage mutex is held by a thread the child does not have: its own share of the
 *     storage returns (under alarm(), so a hang kills the child and fails the test).
 * And the guard fork() waits on is never taken twice by one thread: a share from inside a
 * resize's allocator callback, while a fork waits, does not deadlock. And fork() while another
 * thread holds the lock of the deferred unmaps (os_linux.c) leaves the child a free lock, and so
 * does fork() from inside a callback while another thread reopens the write fence's userfaultfd.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* lshm__share_chunk_bytes */
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static size_t page;

enum { MIB = 1 << 20, NBYTES = 256 * MIB, MARK = 0xA5 };

typedef struct share_job {
    lshm_storage *s;
    _Atomic int started, done;
    int rc;
} share_job;

static void *share_thread(void *arg) {
    share_job *job = arg;
    atomic_store(&job->started, 1);
    job->rc = lshm_storage_share(job->s);
    atomic_store(&job->done, 1);
    return NULL;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Byte 0 of page i holds its stamp; byte 1 of every MiB gets the parent's post-fork mark. */
static unsigned char stamp(int round, size_t i) {
    return (unsigned char)(round * 7 + i * 13 + 1);
}

static int marks_seen(const unsigned char *p) {
    int seen = 0;
    for (size_t k = 0; k < NBYTES / MIB; k++)
        seen += p[k * MIB + 1] == MARK;
    return seen;
}

/* In the child: check consistency, then share it ourselves within a bounded time. */
static void child(int sock, lshm_storage *s, int round) {
    unsigned char *p = lshm_storage_data(s);
    int shared = (lshm_storage_flags(s) & LSHM_STORAGE_SHARED) != 0;
    int maps = count_mappings(p, NBYTES, 0);
    int shared_maps = count_mappings(p, NBYTES, 1);
    if (shared)
        ASSERT_EQ(shared_maps, maps); /* all of it shared with the parent */
    else
        ASSERT_EQ(shared_maps, 0); /* none of it: no chunk of an unfinished share */
    send_byte(sock, shared ? 'S' : 'P');
    ASSERT_EQ(recv_byte(sock), 'w'); /* the parent has written its marks */
    int seen = marks_seen(p);
    ASSERT_EQ(seen, shared ? (int)(NBYTES / MIB) : 0);
    for (size_t i = 0; i < NBYTES / page; i += 97)
        ASSERT_EQ(p[i * page], stamp(round, i));
    alarm(10); /* a storage mutex held by a thread that is gone would hang here */
    unsigned long splits = lshm__share_splits;
    ASSERT_OK(lshm_storage_share(s));
    alarm(0);
    /* no helper thread in a forked child (one hung there in a lock held at the fork) */
    ASSERT_EQ(lshm__share_splits, splits);
    ASSERT(lshm_storage_flags(s) & LSHM_STORAGE_SHARED);
    ASSERT_PTR_EQ(lshm_storage_data(s), p);
    for (size_t i = 0; i < NBYTES / page; i += 97)
        ASSERT_EQ(p[i * page], stamp(round, i));
    ASSERT_EQ(marks_seen(p), seen);
    lshm_storage_release(s);
    _exit(0);
}

static void test_fork_during_share(void) {
    static const int delays_ms[] = {0, 1, 5, 20, 0, 2, 10, 40};
    size_t saved_chunk = lshm__share_chunk_bytes;
    lshm__share_chunk_bytes = 16 * page; /* ~16k chunks: the share lasts long enough to fork in */
    int mid = 0, shared_children = 0;
    int rounds = (int)(sizeof delays_ms / sizeof delays_ms[0]);
    for (int round = 0; round < rounds; round++) {
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(NBYTES, NULL, 0, &s));
        unsigned char *p = lshm_storage_data(s);
        for (size_t i = 0; i < NBYTES / page; i++)
            p[i * page] = stamp(round, i);
        share_job job = {s, 0, 0, -1};
        pthread_t t;
        ASSERT_OK(pthread_create(&t, NULL, share_thread, &job));
        /* Detached, and waited for through job.done: a thread that had ended but was not yet
         * joined when the fork ran would be, in the child, one that is never joined
         * (ThreadSanitizer reports a thread leak when the child exits). */
        ASSERT_OK(pthread_detach(t));
        sleep_ms(delays_ms[round]);
        int sv[2];
        ASSERT_OK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv));
        int in_flight = atomic_load(&job.started) && !atomic_load(&job.done);
        pid_t pid = fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            close(sv[0]);
            child(sv[1], s, round);
        }
        close(sv[1]);
        mid += in_flight;
        char seen = recv_byte(sv[0]);
        ASSERT(seen == 'S' || seen == 'P');
        shared_children += seen == 'S';
        while (!atomic_load(&job.done))
            sleep_ms(1);
        ASSERT_OK(job.rc);
        for (size_t k = 0; k < NBYTES / MIB; k++)
            p[k * MIB + 1] = MARK; /* after the fork: the child sees it iff it shares with us */
        send_byte(sv[0], 'w');
        int status;
        ASSERT_EQ(waitpid(pid, &status, 0), pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            TEST_FAIL("round %d (fork after %d ms): child status 0x%x", round, delays_ms[round],
                      status);
        close(sv[0]);
        lshm_storage_release(s);
    }
    fprintf(stderr, "   %d of %d forks issued while the share ran; %d children found it shared\n",
            mid, rounds, shared_children);
    lshm__share_chunk_bytes = saved_chunk;
}

/* ---- callbacks inside the fork guard -------------------------------------------------------- */

/* An allocator whose alloc runs inside a resize, i.e. inside the section fork() waits for. */
typedef struct nested_ctx {
    lshm_storage *other;        /* shared from inside alloc (nested share) */
    _Atomic int in_alloc;       /* alloc is running: the forking thread may go */
    int fork_inside;            /* alloc forks itself instead */
    int share_rc;
} nested_ctx;

/* fork() a child that exits at once, and check it did (the fork itself is what is tested). */
static void fork_and_reap(void) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0)
        _exit(0);
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void *nested_alloc(void *ctx, size_t nbytes) {
    nested_ctx *c = ctx;
    if (c->other != NULL) {
        atomic_store(&c->in_alloc, 1);
        sleep_ms(100); /* by now the other thread's fork() waits for us, as a writer */
        /* A second read lock here would queue behind that writer and deadlock. */
        c->share_rc = lshm_storage_share(c->other);
    }
    if (c->fork_inside) {
        fork_and_reap(); /* cannot wait for itself: goes ahead */
    }
    return malloc(nbytes);
}

static void nested_free(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    (void)nbytes;
    free(ptr);
}

static void *fork_when_in_alloc(void *arg) {
    nested_ctx *c = arg;
    while (!atomic_load(&c->in_alloc))
        sleep_ms(1);
    fork_and_reap(); /* waits for the resize in flight */
    return NULL;
}

/* A thread never takes the guard twice: a share from inside a resize's allocator callback does
 * not deadlock behind a fork() that waits for the resize; and a fork from inside the callback
 * goes ahead (the child still works). */
static void test_nested_guard(void) {
    nested_ctx c = {0};
    lshm_allocator a = {nested_alloc, nested_free, &c, 0};
    lshm_storage *s, *other;
    ASSERT_OK(lshm_storage_create(100, &a, LSHM_STORAGE_RESIZABLE, &s));
    ASSERT_OK(lshm_storage_create(3 * page, NULL, 0, &other));
    c.other = other;
    c.share_rc = -1;
    pthread_t t;
    ASSERT_OK(pthread_create(&t, NULL, fork_when_in_alloc, &c));
    alarm(10); /* a deadlock kills the test */
    ASSERT_OK(lshm_storage_resize(s, 200));
    ASSERT_OK(pthread_join(t, NULL));
    alarm(0);
    ASSERT_OK(c.share_rc);
    ASSERT(lshm_storage_flags(other) & LSHM_STORAGE_SHARED);
    c.other = NULL;
    c.fork_inside = 1;
    alarm(10);
    ASSERT_OK(lshm_storage_resize(s, 300));
    alarm(0);
    c.fork_inside = 0;
    lshm_storage_release(other);
    lshm_storage_release(s);
}

/* A forked child starts no helper threads but shares as its parent does otherwise: a big
 * memfd it releases is pooled and taken again by its next share of that size (one pooled
 * memfd after three rounds, not three). */
static void test_pool_in_a_forked_child(void) {
    if (lshm__os_ncpu() < 2)
        return; /* (big shares are refilled from the pool only where they could split) */
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        lshm_pool_trim();
        lshm__share_split_threshold = 4 * MIB;
        unsigned long splits = lshm__share_splits;
        for (int round = 0; round < 3; round++) {
            lshm_storage *s;
            ASSERT_OK(lshm_storage_create(8 * MIB, NULL, 0, &s));
            unsigned char *p = lshm_storage_data(s);
            p[0] = (unsigned char)round;
            ASSERT_OK(lshm_storage_share(s));
            ASSERT_EQ(p[0], round);
            lshm_storage_release(s);
        }
        ASSERT_EQ(lshm__share_splits, splits); /* all on this thread */
        ASSERT_EQ(lshm_pool_trim(), 1);
        _exit(0);
    }
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* fork() while another thread works on the ranges whose munmap failed (at vm.max_map_count;
 * made to fail here): it holds their list's lock while it adds one, grows the list or unmaps
 * them. The prepare handler waits for that lock, so the child finds it free and the list whole:
 * its own unmaps, deferred or not, return (under alarm(): a hang kills the child). */
static _Atomic int unmapper_stop;

static void *unmapper(void *arg) {
    size_t nbytes = *(size_t *)arg;
    for (unsigned i = 0; !atomic_load(&unmapper_stop); i++) {
        lshm_storage *s;
        if (lshm_storage_create(nbytes, NULL, 0, &s) != 0)
            continue;
        lshm__unmap_enomem = i % 100 != 99; /* 99 deferred, then an unmap that takes them */
        lshm_storage_release(s);
        lshm__unmap_enomem = 0;
    }
    return NULL;
}

static void test_fork_while_unmaps_are_deferred(void) {
    size_t nbytes = ((size_t)2 << 20) + page;
    pthread_t thread;
    atomic_store(&unmapper_stop, 0);
    ASSERT_EQ(pthread_create(&thread, NULL, unmapper, &nbytes), 0);
    for (int round = 0; round < 300; round++) {
        pid_t pid = fork();
        ASSERT(pid >= 0);
        if (pid == 0) {
            alarm(10);
            lshm_storage *s;
            if (lshm_storage_create(nbytes, NULL, 0, &s) != 0)
                _exit(2);
            lshm__unmap_enomem = 1;
            lshm_storage_release(s); /* deferred */
            lshm__unmap_enomem = 0;
            if (lshm_storage_create(nbytes, NULL, 0, &s) != 0)
                _exit(3);
            lshm_storage_release(s); /* unmapped, and the deferred ones with it */
            _exit(0);
        }
        int status;
        ASSERT_EQ(waitpid(pid, &status, 0), pid);
        ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    atomic_store(&unmapper_stop, 1);
    ASSERT_EQ(pthread_join(thread, NULL), 0);
}

/* fork() from inside a resize's allocator callback does not wait for the shares in flight (it
 * cannot wait for itself), so another thread may be inside one, reopening the write fence's
 * userfaultfd (the program closed it) under os_linux.c's fence_lock. The child must find that
 * lock free: every failed ioctl of its fences takes it (here an injected EBUSY), and a lock held
 * by a thread the child does not have would hang its share for ever (alarm() kills it). */
static _Atomic int closer_stop;

static void *close_userfaultfd_and_share(void *arg) {
    (void)arg;
    int ufd = -1;
    while (!atomic_load(&closer_stop)) {
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
        if (ufd < 0 || !is_userfaultfd(ufd)) /* (the reopen takes the lowest free number) */
            ufd = userfaultfd_number();
        ASSERT_GE(ufd, 0);
        close(ufd);
        ASSERT_OK(lshm_storage_share(s)); /* reopens it, under fence_lock */
        lshm_storage_release(s);
    }
    return NULL;
}

static void *fork_sharing_child(void *ctx, size_t nbytes) {
    (void)ctx;
    pid_t pid = fork(); /* (inside the resize: does not wait for the other thread's share) */
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        alarm(10); /* (forked from two threads: not single-threaded, it sets up fences) */
        lshm_storage *s;
        if (lshm_storage_create(page, NULL, 0, &s) != 0)
            _exit(3);
        atomic_store(&lshm__fence_fails, -EBUSY); /* (decided under fence_lock) */
        int rc = lshm_storage_share(s);
        _exit(rc != 0 ? 4 : 0);
    }
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    return malloc(nbytes);
}

static void test_fork_in_callback_while_userfaultfd_reopens(void) {
    lshm_allocator a = {fork_sharing_child, nested_free, NULL, 0};
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(100, &a, LSHM_STORAGE_RESIZABLE, &s));
    pthread_t thread;
    atomic_store(&closer_stop, 0);
    ASSERT_OK(pthread_create(&thread, NULL, close_userfaultfd_and_share, NULL));
    for (int round = 0; round < 1000; round++) /* (a held lock hangs a child in a few hundred) */
        ASSERT_OK(lshm_storage_resize(s, 100 + (size_t)(round % 2)));
    atomic_store(&closer_stop, 1);
    ASSERT_OK(pthread_join(thread, NULL));
    lshm_storage_release(s);
}

int main(void) {
    page = lshm_page_size();
    RUN_TEST(test_pool_in_a_forked_child);
    RUN_TEST(test_fork_during_share);
    RUN_TEST(test_nested_guard);
    RUN_TEST(test_fork_while_unmaps_are_deferred);
    RUN_TEST(test_fork_in_callback_while_userfaultfd_reopens);
    return 0;
}
