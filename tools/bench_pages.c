/*
 * bench_pages.c -- what the page-level kernel calls behind two of libshm's choices cost here.
 *
 * The raw kernel calls, without the library (as tools/bench_chunks.c does for big shares):
 *   ahead [rounds]
 *       the share of 4 KiB storages walking up a slab (slab.c): per page, a pwrite into a
 *       4 MiB memfd (LSHM_SLAB_BYTES) and an mmap(MAP_FIXED) of that page over the storage's
 *       touched private page. The memfd's pages are allocated inside each pwrite ("in pwrite"),
 *       64 KiB at a time by one fallocate ahead of the walk ("ahead 64 KiB": slab.c's
 *       READY_AHEAD), or before the clock starts ("allocated": the calls without allocation).
 *       Prints min and median us per 4 KiB share over `rounds` fresh memfds (default 50).
 *   mincore [MiB [rounds]]
 *       lshm__os_check_mapped's loop (os_linux.c: mincore over 16 MiB of pages per call) over
 *       MiB (default 1024) of touched anonymous memory; prints min and median ms per GiB.
 *
 * Build: cc -O2 -o bench_pages tools/bench_pages.c (meson builds it with the tests).
 * Usage: bench_pages ahead [rounds] | bench_pages mincore [MiB [rounds]]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench_common.h"

enum { MAX_ROUNDS = 1000 };

#define SLAB_BYTES ((size_t)4 << 20)  /* LSHM_SLAB_BYTES */
#define AHEAD_BYTES ((size_t)64 << 10) /* slab.c's READY_AHEAD */

/* ---- ahead ---------------------------------------------------------------------------------- */

enum { IN_PWRITE, AHEAD, ALLOCATED, METHODS };
static const char *const method_names[METHODS] = {"in pwrite", "ahead 64 KiB", "allocated"};

/* Seconds to share each page of a fresh slab (storages of one page each) into a fresh memfd. */
static double slab_walk(int method, size_t page) {
    char *slab = mmap(NULL, SLAB_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (slab == MAP_FAILED)
        die("mmap(slab)");
    memset(slab, 7, SLAB_BYTES);
    int fd = memfd_create("bench_pages", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)SLAB_BYTES) != 0)
        die("memfd_create/ftruncate");
    if (method == ALLOCATED && fallocate(fd, 0, 0, (off_t)SLAB_BYTES) != 0)
        die("fallocate");
    double t0 = now();
    for (size_t off = 0; off < SLAB_BYTES; off += page) {
        if (method == AHEAD && off % AHEAD_BYTES == 0 &&
            fallocate(fd, 0, (off_t)off, (off_t)AHEAD_BYTES) != 0)
            die("fallocate");
        if (pwrite(fd, slab + off, page, (off_t)off) != (ssize_t)page)
            die("pwrite");
        if (mmap(slab + off, page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                 (off_t)off) == MAP_FAILED)
            die("mmap(MAP_FIXED)");
    }
    double elapsed = now() - t0;
    if (slab[0] != 7 || slab[SLAB_BYTES - 1] != 7) {
        fprintf(stderr, "bench_pages: wrong bytes in the slab\n");
        exit(1);
    }
    munmap(slab, SLAB_BYTES);
    close(fd);
    return elapsed;
}

static int bench_ahead(int rounds) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    static double times[METHODS][MAX_ROUNDS];
    for (int r = 0; r < rounds; r++)
        for (int m = 0; m < METHODS; m++)
            times[m][r] = slab_walk(m, page) / (double)(SLAB_BYTES / page) * 1e6;
    printf("%zu-byte shares walking up a %zu MiB memfd, %d rounds\n", page, SLAB_BYTES >> 20,
           rounds);
    printf("%-14s %12s %12s\n", "pages", "min us", "median us");
    for (int m = 0; m < METHODS; m++) {
        qsort(times[m], (size_t)rounds, sizeof times[m][0], by_value);
        printf("%-14s %12.2f %12.2f\n", method_names[m], times[m][0], times[m][rounds / 2]);
    }
    return 0;
}

/* ---- mincore -------------------------------------------------------------------------------- */

/* os_linux.c's lshm__os_check_mapped without its error messages: 0 if all of [p, p + len) is
 * mapped. */
static int check_mapped(const void *p, size_t len, size_t page) {
    uintptr_t at = (uintptr_t)p & ~(uintptr_t)(page - 1), end = (uintptr_t)p + len;
    unsigned char resident[4096];
    while (at < end) {
        size_t pages = (end - at + page - 1) / page;
        if (pages > sizeof resident)
            pages = sizeof resident;
        if (mincore((void *)at, pages * page, resident) != 0)
            return -errno;
        at += pages * page;
    }
    return 0;
}

static int bench_mincore(size_t mib, int rounds) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), len = mib << 20;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        die("mmap");
    memset(p, 1, len);
    static double times[MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
        double t0 = now();
        if (check_mapped(p, len, page) != 0)
            die("mincore");
        times[r] = (now() - t0) * 1e3 / ((double)len / (double)(1 << 30));
    }
    qsort(times, (size_t)rounds, sizeof times[0], by_value);
    printf("mincore over %zu MiB of touched anonymous memory, %d rounds\n", mib, rounds);
    printf("%12s %12s\n", "min ms/GiB", "median ms/GiB");
    printf("%12.3f %12.3f\n", times[0], times[rounds / 2]);
    munmap(p, len);
    return 0;
}

int main(int argc, char **argv) {
    bench_name = "bench_pages";
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "ahead") == 0) {
        int rounds = argc > 2 ? atoi(argv[2]) : 50;
        if (rounds >= 1 && rounds <= MAX_ROUNDS)
            return bench_ahead(rounds);
    } else if (strcmp(mode, "mincore") == 0) {
        size_t mib = argc > 2 ? strtoull(argv[2], NULL, 10) : 1024;
        int rounds = argc > 3 ? atoi(argv[3]) : 10;
        if (mib >= 1 && rounds >= 1 && rounds <= MAX_ROUNDS)
            return bench_mincore(mib, rounds);
    }
    fprintf(stderr, "usage: bench_pages ahead [rounds (1-%d)] | "
                    "bench_pages mincore [MiB [rounds (1-%d)]]\n", MAX_ROUNDS, MAX_ROUNDS);
    return 2;
}
