/*
 * bench_chunks.c -- how big should the chunks of an in-place share be on this machine?
 *
 * The raw kernel calls of libshm's in-place share, without the library: `count` arrays of
 * `bytes` bytes (private anonymous pages, touched), copied into one fresh memfd each by
 * `threads` threads, every source freed as it goes. Methods, interleaved round by round:
 *   ceiling   one pwrite per array into a fresh memfd, mmap it anywhere, munmap the source
 *             (the ceiling row of `python -m pyshm bench`);
 *   whole     one pwrite, then one mmap(MAP_FIXED) of the memfd over the source;
 *   chunk K   per K KiB: pwrite that range, mmap(MAP_FIXED) it over the same range;
 *   refill    (asked for by the word `refill` among the chunk sizes) as whole, into a memfd
 *             of the array's size written once before the clock started (its pages allocated,
 *             and cold by then), as share.c refills one of the pool's (pool.c).
 * Prints min and median seconds, GB/s and each method's time over the ceiling's.
 * libshm's defaults (256 KiB alone, 4 MiB with other shares running) come from this program:
 *   bench_chunks 1 1073741824 1 5 128 256 1024 4096 32768    (one big array, one thread)
 *   bench_chunks 64 39321600 2 5 256 1024 4096 8192          (the seed workload, 2 threads)
 * and share.c's pool_pays (a fresh chunked share against a refill, in between the sizes):
 *   bench_chunks 64 39321600 1 3 256 refill                  (the seed workload, 1 thread)
 *
 * Build: cc -O2 -o bench_chunks tools/bench_chunks.c -lpthread (meson builds it with the tests).
 * Usage: bench_chunks [count [bytes [threads [rounds [chunk_KiB | refill ...]]]]]
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench_common.h"

enum { MAX_METHODS = 16, MAX_ROUNDS = 100, MAX_THREADS = 64 };

static size_t count, bytes;
static char **sources;
static int *refill_fds; /* refill: each array's memfd, its pages allocated */
static atomic_size_t next_index;
#define REFILL (SIZE_MAX - 1)
static size_t chunk; /* 0: ceiling, SIZE_MAX: whole, REFILL: refill, else chunk bytes */

static void share_one(size_t i) {
    char *src = sources[i];
    int fd = chunk == REFILL ? refill_fds[i] : memfd_create("bench_chunks", MFD_CLOEXEC);
    if (fd < 0 || (chunk != REFILL && ftruncate(fd, (off_t)bytes) != 0))
        die("memfd_create/ftruncate");
    if (chunk == 0) {
        pwrite_all(fd, src, bytes, 0);
        void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            die("mmap");
        munmap(src, bytes);
        sources[i] = m;
    } else {
        size_t step = chunk == REFILL ? SIZE_MAX : chunk; /* (a refill: one pwrite, one mmap) */
        for (size_t off = 0; off < bytes;) {
            size_t n = bytes - off < step ? bytes - off : step;
            pwrite_all(fd, src + off, n, (off_t)off);
            if (mmap(src + off, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                     (off_t)off) == MAP_FAILED)
                die("mmap(MAP_FIXED)");
            off += n;
        }
    }
    close(fd);
}

static void *worker(void *arg) {
    (void)arg;
    for (size_t i; (i = atomic_fetch_add(&next_index, 1)) < count;)
        share_one(i);
    return NULL;
}

/* One timed run: build the sources, share them all from `threads` threads, check, free. */
static double run_once(int threads, size_t method_chunk) {
    chunk = method_chunk;
    for (size_t i = 0; i < count; i++) {
        sources[i] = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (sources[i] == MAP_FAILED)
            die("mmap(source)");
        memset(sources[i], (int)(i % 251) + 1, bytes);
    }
    for (size_t i = 0; chunk == REFILL && i < count; i++) {
        /* (as a pooled memfd: every page written once, by the share that made it) */
        refill_fds[i] = memfd_create("bench_chunks_pool", MFD_CLOEXEC);
        if (refill_fds[i] < 0 || ftruncate(refill_fds[i], (off_t)bytes) != 0)
            die("memfd_create/ftruncate (refill)");
        pwrite_all(refill_fds[i], sources[(i + 1) % count], bytes, 0);
    }
    atomic_store(&next_index, 0);
    pthread_t t[MAX_THREADS];
    double t0 = now();
    for (int k = 1; k < threads; k++)
        if (pthread_create(&t[k], NULL, worker, NULL) != 0)
            die("pthread_create");
    worker(NULL);
    for (int k = 1; k < threads; k++)
        pthread_join(t[k], NULL);
    double elapsed = now() - t0;
    for (size_t i = 0; i < count; i++) {
        if (sources[i][0] != (char)(i % 251 + 1) || sources[i][bytes - 1] != (char)(i % 251 + 1)) {
            fprintf(stderr, "bench_chunks: wrong bytes in array %zu\n", i);
            exit(1);
        }
        munmap(sources[i], bytes);
    }
    return elapsed;
}

int main(int argc, char **argv) {
    bench_name = "bench_chunks";
    count = argc > 1 ? strtoull(argv[1], NULL, 10) : 64;
    bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : 39321600;
    int threads = argc > 3 ? atoi(argv[3]) : 2;
    int rounds = argc > 4 ? atoi(argv[4]) : 5;
    size_t chunks[MAX_METHODS] = {0, SIZE_MAX};
    int methods = 2;
    for (int a = 5; a < argc && methods < MAX_METHODS; a++)
        chunks[methods++] = strcmp(argv[a], "refill") == 0 ? REFILL
                                                           : strtoull(argv[a], NULL, 10) << 10;
    if (argc <= 5) {
        chunks[methods++] = (size_t)256 << 10;
        chunks[methods++] = (size_t)4 << 20;
    }
    long page = sysconf(_SC_PAGESIZE);
    if (count == 0 || bytes == 0 || threads < 1 || threads > MAX_THREADS || rounds < 1 ||
        rounds > MAX_ROUNDS || bytes % (size_t)page != 0) {
        fprintf(stderr, "usage: bench_chunks [count [bytes (whole pages) [threads (1-%d) "
                        "[rounds (1-%d) [chunk_KiB | refill ...]]]]]\n", MAX_THREADS, MAX_ROUNDS);
        return 2;
    }
    for (int m = 2; m < methods; m++)
        if (chunks[m] == 0 || (chunks[m] != REFILL && chunks[m] % (size_t)page != 0)) {
            fprintf(stderr, "bench_chunks: chunks must be whole pages\n");
            return 2;
        }
    sources = calloc(count, sizeof *sources);
    refill_fds = calloc(count, sizeof *refill_fds);
    if (sources == NULL || refill_fds == NULL)
        die("calloc");
    static double times[MAX_METHODS][MAX_ROUNDS];
    for (int r = 0; r < rounds; r++)
        for (int m = 0; m < methods; m++)
            times[m][r] = run_once(threads, chunks[m]);
    printf("%zu arrays of %zu bytes, %d thread(s), %d rounds\n", count, bytes, threads, rounds);
    printf("%-14s %9s %9s %8s %12s\n", "method", "min s", "median s", "GB/s", "vs ceiling");
    double ceiling = 0;
    for (int m = 0; m < methods; m++) {
        qsort(times[m], (size_t)rounds, sizeof times[m][0], by_value);
        double best = times[m][0], median = times[m][rounds / 2];
        if (m == 0)
            ceiling = best;
        char name[32];
        if (chunks[m] == 0)
            snprintf(name, sizeof name, "ceiling");
        else if (chunks[m] == SIZE_MAX)
            snprintf(name, sizeof name, "whole");
        else if (chunks[m] == REFILL)
            snprintf(name, sizeof name, "refill");
        else
            snprintf(name, sizeof name, "chunk %zu KiB", chunks[m] >> 10);
        printf("%-14s %9.3f %9.3f %8.2f %12.2f\n", name, best, median,
               (double)count * (double)bytes / best / 1e9, best / ceiling);
    }
    free(sources);
    free(refill_fds);
    return 0;
}
