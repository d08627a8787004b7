/*
 * bench_common.h -- what the C benchmarks in tools/ share: the error exit, the clock and the
 * order their timings are sorted in for min and median. Each program sets bench_name first.
 */
#ifndef LSHM_TOOLS_BENCH_COMMON_H
#define LSHM_TOOLS_BENCH_COMMON_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* qsort order of doubles, smallest first. */
static inline int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
