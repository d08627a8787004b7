/*
 * task.h -- the tiny assertion kit of the C tests (in the spirit of libuv's test/task.h).
 *
 * Every ASSERT_* prints file:line, the expression and both values, then aborts the process, so a
 * failing check is one line in `meson test` output and a non-zero exit. RUN_TEST runs one test
 * function, prints its name and fails if the test left an fd open; fd_count() counts entries of
 * /proc/self/fd for leak checks.
 */
#ifndef LSHM_TEST_TASK_H
#define LSHM_TEST_TASK_H

#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lshm.h"

#define TEST_FAIL(...)                                                                        \
    do {                                                                                      \
        fprintf(stderr, "%s:%d: FAIL: ", __FILE__, __LINE__);                                 \
        fprintf(stderr, __VA_ARGS__);                                                         \
        fprintf(stderr, " (last error: %s)\n", lshm_last_error());                            \
        fflush(stderr);                                                                       \
        abort();                                                                              \
    } while (0)

#define ASSERT(expr)                                                                          \
    do {                                                                                      \
        if (!(expr))                                                                          \
            TEST_FAIL("%s", #expr);                                                           \
    } while (0)

#define ASSERT_INT_OP(a, op, b)                                                               \
    do {                                                                                      \
        long long a_ = (long long)(a), b_ = (long long)(b);                                   \
        if (!(a_ op b_))                                                                      \
            TEST_FAIL("%s %s %s (%lld vs %lld)", #a, #op, #b, a_, b_);                        \
    } while (0)
#define ASSERT_EQ(a, b) ASSERT_INT_OP(a, ==, b)
#define ASSERT_NE(a, b) ASSERT_INT_OP(a, !=, b)
#define ASSERT_LT(a, b) ASSERT_INT_OP(a, <, b)
#define ASSERT_LE(a, b) ASSERT_INT_OP(a, <=, b)
#define ASSERT_GT(a, b) ASSERT_INT_OP(a, >, b)
#define ASSERT_GE(a, b) ASSERT_INT_OP(a, >=, b)

#define ASSERT_UINT_EQ(a, b)                                                                  \
    do {                                                                                      \
        unsigned long long a_ = (unsigned long long)(a), b_ = (unsigned long long)(b);        \
        if (a_ != b_)                                                                         \
            TEST_FAIL("%s == %s (%llu vs %llu)", #a, #b, a_, b_);                             \
    } while (0)

#define ASSERT_PTR_EQ(a, b)                                                                   \
    do {                                                                                      \
        const void *a_ = (const void *)(a), *b_ = (const void *)(b);                          \
        if (a_ != b_)                                                                         \
            TEST_FAIL("%s == %s (%p vs %p)", #a, #b, a_, b_);                                 \
    } while (0)

#define ASSERT_OK(call)                                                                       \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_ != 0)                                                                         \
            TEST_FAIL("%s returned %d (%s)", #call, rc_, lshm_strerror(rc_));                 \
    } while (0)

#define ASSERT_ERR(call, err)                                                                 \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_ != (err))                                                                     \
            TEST_FAIL("%s returned %d (%s), expected %d (%s)", #call, rc_, lshm_strerror(rc_), \
                      (int)(err), lshm_strerror(err));                                        \
    } while (0)

/* Runs one test and checks it left no fd open. The memfds libshm keeps for reuse (its pool)
 * are given back first: they are the library's cache, not a leak. */
#define RUN_TEST(fn)                                                                          \
    do {                                                                                      \
        fprintf(stderr, "-- %s\n", #fn);                                                      \
        int fds_before_ = fd_count();                                                         \
        fn();                                                                                 \
        lshm_pool_trim();                                                                     \
        int fds_after_ = fd_count();                                                          \
        if (fds_after_ != fds_before_)                                                        \
            TEST_FAIL("%s left %d fds open", #fn, fds_after_ - fds_before_);                  \
    } while (0)

/* The fd of a segment (lshm_segment_fd), failing the test when there is none. */
static inline int segment_fd(lshm_segment *seg) {
    int fd = -1;
    ASSERT_OK(lshm_segment_fd(seg, &fd));
    return fd;
}

/* One byte over a pipe or socket between parent and child (a step of a handshake). */
static inline void send_byte(int sock, char b) {
    ASSERT_EQ(write(sock, &b, 1), 1);
}

static inline char recv_byte(int sock) {
    char b = 0;
    ASSERT_EQ(read(sock, &b, 1), 1);
    return b;
}

/* 1 when all n bytes at p equal v. */
static inline int all_bytes(const void *p, size_t n, unsigned char v) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v)
            return 0;
    return 1;
}

/* Number of open fds of this process (entries of /proc/self/fd, minus the directory's own). */
static inline int fd_count(void) {
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1;
}

/* Is fd a userfaultfd (what /proc/self/fd says it links to)? */
static inline int is_userfaultfd(int fd) {
    char path[64], target[64] = {0};
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    return readlink(path, target, sizeof target - 1) > 0 &&
           strcmp(target, "anon_inode:[userfaultfd]") == 0;
}

/* The lowest fd number below 1024 that is a userfaultfd (libshm's, in these programs), or -1. */
static inline int userfaultfd_number(void) {
    for (int fd = 0; fd < 1024; fd++)
        if (is_userfaultfd(fd))
            return fd;
    return -1;
}

/* Mappings of /proc/self/maps that overlap [p, p + n); with `shared` set, only the shared ones
 * ('s' in their permissions; private ones have 'p'). */
static inline int count_mappings(const void *p, size_t n, int shared) {
    FILE *f = fopen("/proc/self/maps", "r");
    ASSERT(f != NULL);
    uintptr_t lo = (uintptr_t)p, hi = lo + n, a, b;
    char perms[8];
    int count = 0;
    char line[8192]; /* longer than any path, so every line is read whole */
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "%lx-%lx %4s", &a, &b, perms) == 3 && a < hi && b > lo &&
            (!shared || perms[3] == 's'))
            count++;
    fclose(f);
    return count;
}

#endif
