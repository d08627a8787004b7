/*
 * test_slab.c -- small storages in slabs: one memfd per slab, in-place shares at the same
 * address that merge into one mapping, what a receiver of the memfd can read, page reuse,
 * slab retirement, fork, read-only shares and atomic failure.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* the fault-injection hooks of internal.h */
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t page;

static ino_t inode_of(int fd) {
    struct stat st;
    ASSERT_EQ(fstat(fd, &st), 0);
    return st.st_ino;
}

static int fd_and_offset(lshm_storage *s, uint64_t *offset) {
    int fd;
    ASSERT_OK(lshm_storage_fd(s, &fd, offset));
    return fd;
}

/* Mapped bytes of [p, p + n) in /proc/self/maps lines (how many lines cover it). */
static int lines_over(const void *p, size_t n) {
    return count_mappings(p, n, 0);
}

/* 2,000 storages of one page shared one by one: same pointers, one memfd per slab, and the
 * shared ranges of a slab merge into one mapping. */
static void test_many_small_shares(void) {
    enum { N = 2000 };
    static lshm_storage *s[N];
    int fds = fd_count();
    for (int i = 0; i < N; i++) {
        ASSERT_OK(lshm_storage_create(page, NULL, 0, &s[i]));
        memset(lshm_storage_data(s[i]), i & 0xff, page);
    }
    ASSERT_EQ(fd_count(), fds); /* no fd before a share */
    for (int i = 0; i < N; i++) {
        void *before = lshm_storage_data(s[i]);
        ASSERT_OK(lshm_storage_share(s[i]));
        ASSERT_PTR_EQ(lshm_storage_data(s[i]), before);
        ASSERT(all_bytes(before, page, (unsigned char)(i & 0xff)));
        ASSERT(lshm_storage_flags(s[i]) & LSHM_STORAGE_SHARED);
    }
    size_t per_slab = LSHM__SLAB_BYTES / page;
    int slabs = (int)((N + per_slab - 1) / per_slab);
    ASSERT_LE(fd_count(), fds + slabs);
    /* Storages of one slab: one fd, offsets = their place in the slab, one mapping. */
    uint64_t off0, off1;
    int fd0 = fd_and_offset(s[0], &off0), fd1 = fd_and_offset(s[1], &off1);
    ASSERT_EQ(fd0, fd1);
    ASSERT_UINT_EQ(off1 - off0,
                   (uint64_t)((char *)lshm_storage_data(s[1]) - (char *)lshm_storage_data(s[0])));
    char *lo = lshm_storage_data(s[0]);
    ASSERT_EQ(lines_over(lo, (size_t)(per_slab < N ? per_slab : N) * page), 1);
    ASSERT_EQ(count_mappings(lo, page, 1), 1);
    for (int i = 0; i < N; i++)
        lshm_storage_release(s[i]);
    ASSERT_EQ(fd_count(), fds); /* every slab retired its memfd */
}

/* A receiver of the memfd sees the shared storages and nothing of the unshared ones. */
static void test_receiver_sees_only_shared(void) {
    lshm_storage *a, *b, *c;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &a));
    ASSERT_OK(lshm_storage_create(2 * page, NULL, 0, &b));
    ASSERT_OK(lshm_storage_create(100, NULL, 0, &c));
    memset(lshm_storage_data(a), 'a', page);
    memset(lshm_storage_data(b), 'b', 2 * page);
    memset(lshm_storage_data(c), 'c', 100);
    ASSERT_OK(lshm_storage_share(a));
    uint64_t off_a;
    int fd = fd_and_offset(a, &off_a);
    struct stat st;
    ASSERT_EQ(fstat(fd, &st), 0);
    ASSERT_UINT_EQ((uint64_t)st.st_size, LSHM__SLAB_BYTES);
    /* What another process gets: the whole memfd. */
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_attach(fd, 0, &seg));
    char *view = lshm_segment_data(seg);
    ASSERT(all_bytes(view + off_a, page, 'a'));
    uint64_t off_b = off_a + (uint64_t)((char *)lshm_storage_data(b) - (char *)lshm_storage_data(a));
    uint64_t off_c = off_a + (uint64_t)((char *)lshm_storage_data(c) - (char *)lshm_storage_data(a));
    ASSERT(all_bytes(view + off_b, 2 * page, 0)); /* not shared: not there */
    ASSERT(all_bytes(view + off_c, page, 0));
    /* Writes go both ways for the shared one only. */
    view[off_a] = 'X';
    ASSERT_EQ(((char *)lshm_storage_data(a))[0], 'X');
    view[off_b] = 'Y';
    ASSERT_EQ(((char *)lshm_storage_data(b))[0], 'b');
    /* Shared later: its bytes arrive in the same memfd, at its offset. */
    ASSERT_OK(lshm_storage_share(b));
    uint64_t off;
    ASSERT_EQ(fd_and_offset(b, &off), fd);
    ASSERT_UINT_EQ(off, off_b);
    ASSERT(all_bytes(view + off_b, 2 * page, 'b'));
    lshm_storage_release(a);
    lshm_storage_release(b);
    lshm_storage_release(c);
    /* The receiver keeps what it mapped, after the sender let go of everything. */
    ASSERT_EQ(view[off_a], 'X');
    ASSERT(all_bytes(view + off_b, 2 * page, 'b'));
    lshm_segment_release(seg);
}

/* Pages that were shared are not handed to another storage while the memfd may be mapped
 * elsewhere; pages never shared are. */
static void test_reuse(void) {
    lshm_storage *keep, *a, *b, *u, *v;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &keep)); /* keeps the slab alive */
    ASSERT_OK(lshm_storage_share(keep));
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &a));
    memset(lshm_storage_data(a), 'a', page);
    ASSERT_OK(lshm_storage_share(a));
    uint64_t off_a;
    int fd = fd_and_offset(a, &off_a);
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_attach(fd, 0, &seg));
    char *view = lshm_segment_data(seg);
    char *pa = lshm_storage_data(a);
    lshm_storage_release(a);
    /* Many new storages, shared or not: none lands on a's retired page. */
    enum { M = 64 };
    lshm_storage *more[M];
    for (int i = 0; i < M; i++) {
        ASSERT_OK(lshm_storage_create(page, NULL, 0, &more[i]));
        ASSERT(lshm_storage_data(more[i]) != (void *)pa);
        ASSERT(all_bytes(lshm_storage_data(more[i]), page, 0));
        memset(lshm_storage_data(more[i]), 'm', page);
        if (i % 2 == 0)
            ASSERT_OK(lshm_storage_share(more[i]));
    }
    ASSERT(all_bytes(view + off_a, page, 'a'));
    for (int i = 0; i < M; i++)
        lshm_storage_release(more[i]);
    ASSERT(all_bytes(view + off_a, page, 'a'));
    /* An unshared storage's page is reused at once, zero-filled. */
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &u));
    char *pu = lshm_storage_data(u);
    memset(pu, 'u', page);
    lshm_storage_release(u);
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &v));
    ASSERT_PTR_EQ(lshm_storage_data(v), pu);
    ASSERT(all_bytes(pu, page, 0));
    lshm_storage_release(v);
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &b));
    lshm_storage_release(b);
    lshm_storage_release(keep);
    /* The slab started over: the receiver still has a's bytes, new shares go elsewhere. */
    ASSERT(all_bytes(view + off_a, page, 'a'));
    lshm_storage *w;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &w));
    memset(lshm_storage_data(w), 'w', page);
    ASSERT_OK(lshm_storage_share(w));
    uint64_t off_w;
    int fd_w = fd_and_offset(w, &off_w);
    ASSERT(inode_of(fd_w) != inode_of(segment_fd(seg)));
    ASSERT(all_bytes(view + off_a, page, 'a'));
    lshm_storage_release(w);
    lshm_segment_release(seg);
}

/* create_shared of small sizes takes slab pages already shared: no fd per storage. */
static void test_create_shared_small(void) {
    enum { N = 500 };
    lshm_storage *s[N];
    int fds = fd_count();
    for (int i = 0; i < N; i++) {
        ASSERT_OK(lshm_storage_create_shared(1 + (size_t)i * 97 % (64 << 10), 0, &s[i]));
        ASSERT(lshm_storage_flags(s[i]) & LSHM_STORAGE_SHARED);
        ASSERT(all_bytes(lshm_storage_data(s[i]), lshm_storage_nbytes(s[i]), 0));
        ASSERT(lshm_storage_segment(s[i]) == NULL);
    }
    ASSERT_LE(fd_count(), fds + 10);
    for (int i = 0; i < N; i++)
        lshm_storage_release(s[i]);
    ASSERT_EQ(fd_count(), fds);
    /* Above the threshold: a segment of its own, as before. */
    lshm_storage *big;
    ASSERT_OK(lshm_storage_create_shared(LSHM_SLAB_MAX_BYTES + 1, 0, &big));
    ASSERT(lshm_storage_segment(big) != NULL);
    lshm_storage_release(big);
}

/* Resizable storages and storages above the threshold own their pages alone. */
static void test_who_goes_in_slabs(void) {
    lshm_storage *r, *big, *small;
    ASSERT_OK(lshm_storage_create(page, NULL, LSHM_STORAGE_RESIZABLE, &r));
    ASSERT_OK(lshm_storage_create(LSHM_SLAB_MAX_BYTES + page, NULL, 0, &big));
    ASSERT_OK(lshm_storage_create(LSHM_SLAB_MAX_BYTES, NULL, 0, &small));
    ASSERT_EQ(((lshm_storage *)r)->origin, LSHM__ORIGIN_PAGES);
    ASSERT_EQ(((lshm_storage *)big)->origin, LSHM__ORIGIN_PAGES);
    ASSERT_EQ(((lshm_storage *)small)->origin, LSHM__ORIGIN_SLAB);
    ASSERT_OK(lshm_storage_resize(r, 3 * page)); /* still works */
    lshm_storage_release(r);
    lshm_storage_release(big);
    lshm_storage_release(small);
}

/* Fork after a slab is partly shared: the shared storage is shared with the child, the
 * unshared one is private, and the child's own shares go into a memfd of its own. */
static void test_fork_partly_shared(void) {
    lshm_storage *a, *b;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &a));
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &b));
    ASSERT_OK(lshm_storage_share(a));
    uint64_t off_a;
    int fd = fd_and_offset(a, &off_a);
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_attach(fd, 0, &seg)); /* what the parent's receivers see */
    char *view = lshm_segment_data(seg);
    uint64_t off_b = off_a + (uint64_t)((char *)lshm_storage_data(b) - (char *)lshm_storage_data(a));
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        close(pipefd[0]);
        memset(lshm_storage_data(a), 'A', page); /* reaches the parent */
        memset(lshm_storage_data(b), 'B', page); /* does not */
        int ok = lshm_storage_share(b) == 0;
        uint64_t off;
        int child_fd;
        ok = ok && lshm_storage_fd(b, &child_fd, &off) == 0 && inode_of(child_fd) != inode_of(fd);
        ok = ok && all_bytes(view + off_b, page, 0); /* not in the parent's memfd */
        lshm_storage_release(b);
        char c = ok ? 'y' : 'n';
        (void)!write(pipefd[1], &c, 1);
        _exit(0);
    }
    close(pipefd[1]);
    char c = 0;
    ASSERT_EQ(read(pipefd[0], &c, 1), 1);
    close(pipefd[0]);
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ASSERT_EQ(c, 'y');
    ASSERT(all_bytes(lshm_storage_data(a), page, 'A'));
    ASSERT(all_bytes(lshm_storage_data(b), page, 0));
    ASSERT(all_bytes(view + off_b, page, 0));
    /* The parent can still share b, into its own memfd. */
    ASSERT_OK(lshm_storage_share(b));
    uint64_t off;
    ASSERT_EQ(fd_and_offset(b, &off), fd);
    ASSERT(all_bytes(view + off_b, page, 0) == 1);
    lshm_storage_release(a);
    lshm_storage_release(b);
    lshm_segment_release(seg);
}

static void identity_of(int fd, uint64_t *dev, uint64_t *ino) {
    struct stat st;
    ASSERT_EQ(fstat(fd, &st), 0);
    *dev = st.st_dev;
    *ino = st.st_ino;
}

/* lshm_slab_find gives back the very storage at a byte range of a slab memfd, and nothing
 * else; lshm_slab_knows tells a slab memfd of this process from any other memfd, also in a
 * forked child (whose inherited storages still live in the parent's memfd). */
static void test_find_and_knows(void) {
    lshm_storage *a, *b, *c, *found = NULL;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &a));
    ASSERT_OK(lshm_storage_create(2 * page, NULL, 0, &b));
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &c)); /* never shared */
    ASSERT_OK(lshm_storage_share(a));
    ASSERT_OK(lshm_storage_share(b));
    uint64_t off_a, off_b, dev, ino;
    int fd = fd_and_offset(a, &off_a);
    ASSERT_EQ(fd_and_offset(b, &off_b), fd);
    identity_of(fd, &dev, &ino);
    ASSERT_EQ(lshm_slab_knows(dev, ino), 1);
    ASSERT_OK(lshm_slab_find(dev, ino, off_a, page, &found));
    ASSERT_EQ(found, a);
    ASSERT_EQ(lshm_storage_refcount(a), 2); /* a new reference */
    lshm_storage_release(found);
    ASSERT_OK(lshm_slab_find(dev, ino, off_b, 2 * page, &found));
    ASSERT_EQ(found, b);
    lshm_storage_release(found);
    found = NULL; /* (a failed find leaves *out alone) */
    /* wrong size, a page inside b, an unaligned offset, c's unshared pages, past the end */
    uint64_t off_c = off_a + (uint64_t)((char *)lshm_storage_data(c) - (char *)lshm_storage_data(a));
    ASSERT_EQ(lshm_slab_find(dev, ino, off_b, page, &found), -ENOENT);
    ASSERT_EQ(lshm_slab_find(dev, ino, off_b + page, page, &found), -ENOENT);
    ASSERT_EQ(lshm_slab_find(dev, ino, off_a + 1, page, &found), -ENOENT);
    ASSERT_EQ(lshm_slab_find(dev, ino, off_c, page, &found), -ENOENT);
    ASSERT_EQ(lshm_slab_find(dev, ino, LSHM_SLAB_BYTES, page, &found), -ENOENT);
    ASSERT_EQ(lshm_slab_find(dev, ino, off_a, page, NULL), -EINVAL);
    ASSERT_EQ(found, NULL);
    /* another memfd, of this process but not a slab's: unknown */
    lshm_storage *big;
    ASSERT_OK(lshm_storage_create(LSHM_SLAB_MAX_BYTES + page, NULL, 0, &big));
    ASSERT_OK(lshm_storage_share(big));
    uint64_t off_big, dev2, ino2;
    identity_of(fd_and_offset(big, &off_big), &dev2, &ino2);
    ASSERT_EQ(lshm_slab_knows(dev2, ino2), 0);
    ASSERT_EQ(lshm_slab_find(dev2, ino2, 0, LSHM_SLAB_MAX_BYTES + page, &found), -ENOENT);
    lshm_storage_release(big);
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        /* the child shares into memfds of its own, but still finds a in the parent's */
        lshm_storage *f = NULL;
        int ok = lshm_slab_knows(dev, ino) == 1 && lshm_slab_find(dev, ino, off_a, page, &f) == 0 &&
                 f == a && lshm_storage_share(c) == 0;
        uint64_t off, cdev, cino;
        int cfd = -1;
        ok = ok && lshm_storage_fd(c, &cfd, &off) == 0;
        if (ok) {
            identity_of(cfd, &cdev, &cino);
            ok = cino != ino && lshm_slab_knows(cdev, cino) == 1;
        }
        _exit(ok ? 0 : 1);
    }
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    lshm_storage_release(a);
    lshm_storage_release(b);
    lshm_storage_release(c);
    ASSERT_EQ(lshm_slab_find(dev, ino, off_a, page, &found), -ENOENT); /* released */
}

/* Every fault point of a slab share leaves the storage as it was, no fd behind, and its bytes
 * nowhere in the memfd. */
static void test_fault_atomicity(void) {
    lshm_storage *keep, *s;
    for (int with_memfd = 0; with_memfd < 2; with_memfd++) {
        keep = NULL;
        if (with_memfd) {
            ASSERT_OK(lshm_storage_create(page, NULL, 0, &keep));
            ASSERT_OK(lshm_storage_share(keep));
        }
        ASSERT_OK(lshm_storage_create(3 * page, NULL, 0, &s));
        char *data = lshm_storage_data(s);
        memset(data, 's', 3 * page);
        unsigned flags = lshm_storage_flags(s);
        int fds = fd_count();
        int points = 0;
        for (int nth = 1;; nth++) {
            lshm__fault_arm(nth, -ENOMEM);
            int rc = lshm_storage_share(s);
            int hit = lshm__fault_points_hit();
            lshm__fault_arm(0, 0);
            if (hit < nth) {
                ASSERT_OK(rc);
                break;
            }
            points++;
            ASSERT_ERR(rc, -ENOMEM);
            ASSERT_PTR_EQ(lshm_storage_data(s), data);
            ASSERT_EQ(lshm_storage_flags(s), flags);
            ASSERT_EQ(fd_count(), fds);
            ASSERT(all_bytes(data, 3 * page, 's'));
            ASSERT_EQ(count_mappings(data, 3 * page, 1), 0);
            if (keep != NULL) { /* the slab's memfd holds nothing of s */
                uint64_t off_k;
                int fd = fd_and_offset(keep, &off_k);
                char buf[4096];
                uint64_t off_s = off_k + (uint64_t)(data - (char *)lshm_storage_data(keep));
                ASSERT_EQ(pread(fd, buf, sizeof buf, (off_t)off_s), (ssize_t)sizeof buf);
                ASSERT(all_bytes(buf, sizeof buf, 0));
            }
        }
        ASSERT_GE(points, with_memfd ? 2 : 5); /* pwrite, mmap (+ memfd_create, ftruncate, seal) */
        ASSERT(all_bytes(data, 3 * page, 's'));
        lshm_storage_release(s);
        lshm_storage_release(keep);
    }
}

/* Read-only: a slab storage gets a memfd of its own; sealing a slab range is refused. */
static void test_readonly(void) {
    lshm_storage *a, *b;
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &a));
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &b));
    memset(lshm_storage_data(a), 'r', 1000);
    void *pa = lshm_storage_data(a);
    ASSERT_OK(lshm_storage_share(b));
    unsigned flags_b = lshm_storage_flags(b);
    ASSERT_ERR(lshm_storage_seal_readonly(b), -EINVAL);
    ASSERT_ERR(lshm_storage_share_readonly(b), -EINVAL);
    ASSERT_EQ(lshm_storage_flags(b), flags_b);
    uint64_t off_b;
    int fd_b = fd_and_offset(b, &off_b);
    ASSERT_EQ(fcntl(fd_b, F_GET_SEALS) & F_SEAL_FUTURE_WRITE, 0);
    ASSERT_OK(lshm_storage_share_readonly(a));
    ASSERT_PTR_EQ(lshm_storage_data(a), pa);
    uint64_t off_a;
    int fd_a = fd_and_offset(a, &off_a);
    ASSERT(fd_a != fd_b);
    ASSERT_UINT_EQ(off_a, 0);
    ASSERT(fcntl(fd_a, F_GET_SEALS) & F_SEAL_FUTURE_WRITE);
    ASSERT(all_bytes(lshm_storage_data(a), 1000, 'r'));
    lshm_segment *seg;
    ASSERT_ERR(lshm_segment_attach(fd_a, 0, &seg), -EPERM);
    ASSERT_OK(lshm_segment_attach(fd_a, LSHM_STORAGE_READONLY, &seg));
    ASSERT(all_bytes(lshm_segment_data(seg), 1000, 'r'));
    lshm_storage_release(a);
    /* Its page is back in the slab, private and zero. */
    lshm_storage *c;
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &c));
    ASSERT(all_bytes(lshm_storage_data(c), 1000, 0));
    ASSERT(all_bytes(lshm_segment_data(seg), 1000, 'r'));
    lshm_storage_release(c);
    lshm_storage_release(b);
    lshm_segment_release(seg);
}

int main(void) {
    page = lshm_page_size();
    RUN_TEST(test_many_small_shares);
    RUN_TEST(test_receiver_sees_only_shared);
    RUN_TEST(test_reuse);
    RUN_TEST(test_create_shared_small);
    RUN_TEST(test_who_goes_in_slabs);
    RUN_TEST(test_fork_partly_shared);
    RUN_TEST(test_fault_atomicity);
    RUN_TEST(test_readonly);
    RUN_TEST(test_find_and_knows);
    lshm_slab_counters counters;
    ASSERT_OK(lshm_slab_stats(&counters));
    ASSERT_EQ(counters.slabs, 1); /* only the current slab is kept when empty */
    printf("OK\n");
    return 0;
}
