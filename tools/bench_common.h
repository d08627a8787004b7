/*
 * bench_common.h -- what the C benchmarks in tools/ share: the error exit, the clock, a
 * whole pwrite and the order their timings are sorted in for min and median. Each program
 * sets bench_name first.
 */
#ifndef LSHM_TOOLS_BENCH_COMMON_H
#define LSHM_TOOLS_BENCH_COMMON_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

static const char *bench_name = "bench"; /* the program, before each error message */

/* Print "<bench_name>: <what>: <strerror(errno)>" and exit(1). */
static inline void die(const char *what) {
    fprintf(stderr, "%s: %s: %s\n", bench_name, what, strerror(errno));
    exit(1);
}

/* CLOCK_MONOTONIC in seconds. */
static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* pwrite all `n` bytes at `p` to fd at `off` (retrying short writes and EINTR), or die. */
static inline void pwrite_all(int fd, const char *p, size_t n, off_t off) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            die("pwrite");
        p += w;
        off += w;
        n -= (size_t)w;
    }
}

/* qsort order of doubles, smallest first. */
static inline int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
