/*
 * bench_receiver.c -- why does a receiver's first read of small-page shared memory cost more
 * after pyshm's share than after torch's?
 *
 * The raw kernel calls, without the library: an array of `mib` MiB of private anonymous pages
 * (touched) is copied into a fresh memfd one of four ways, then a forked child maps the memfd
 * and reads one byte per 4 KiB page (its first touch of every page; the `receiver` case of
 * `python -m pyshm bench` with LSHM_HUGE=0). Methods, interleaved round by round:
 *   chunked    per 256 KiB: pwrite that range, mmap(MAP_FIXED) it over the same range of the
 *              array (libshm's small-page in-place share: each chunk's pages are the ones the
 *              previous chunk's mmap just freed; nobody maps them until a reader does);
 *   populated  as chunked, then MADV_POPULATE_READ over the array (the sender maps every
 *              page before the reader comes);
 *   whole      one pwrite of the whole array (pages new to the memfd), then one mmap over it;
 *   mapped     mmap the memfd, memcpy into it (torch's share_memory_: the sender maps every
 *              page as it writes it);
 *   uffdcopy   per 256 KiB: a second mapping of that range of the memfd, registered with a
 *              userfaultfd, filled with UFFDIO_COPY from the array (each page allocated,
 *              filled and mapped in one step: no zero-fill, no fault), then mremap'd over the
 *              array's range (its page tables move with it; the private pages are freed):
 *              an in-place share whose pages the sender has mapped, as torch's are (two
 *              runs, 2026-12-04, 512 MiB, 7 and 9 rounds, min/median ms: share 226/235 and
 *              220/230 against chunked's 207/210 and 204/212; read 33.7/35.3 and 33.3/36.9
 *              against chunked's 37.0/38.5 and 36.1/41.7 and torch's way's 30.2/33.9 and
 *              32.1/34.5: half the reader's gap for 7-9% more share, where populating
 *              costs 25%; libshm does not do it yet).
 * Prints min and median milliseconds of the share and of the child's read per method, and (run
 * as root, where /proc/self/pagemap shows page frame numbers) how many of the memfd's pages
 * lie next to the previous page in physical memory: the reader's kernel walks the pages'
 * struct page in file order as it maps them, and pages out of order miss the cache there.
 * With the word `huge`, the memfd is filled in huge pages instead (mapped at a 2 MiB
 * boundary, a byte per 2 MiB, MADV_COLLAPSE, memcpy: the huge ceiling of the bench) and the
 * child, mapping at a 2 MiB boundary too, times its first read and then a second one, every
 * page mapped by then: the cost of the reads themselves, what no sharing scheme can avoid.
 *
 * Build: cc -O2 -o bench_receiver tools/bench_receiver.c (meson builds it with the tests).
 * Usage: bench_receiver [mib [rounds [huge]]]   (defaults 512 5)
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
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif

enum { METHODS = 5, MAX_ROUNDS = 100, CHUNK = 256 << 10, PAGE = 4096, HUGE = 2 << 20 };
static const char *const names[METHODS] = {"chunked", "populated", "whole", "mapped",
                                           "uffdcopy"};

/* A userfaultfd that can fill shared memory (UFFDIO_COPY into a memfd's mapping), or -1
 * (no userfaultfd here, or none for shared memory: uffdcopy is skipped). */
static int open_uffd(void) {
    int uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC);
#ifdef UFFD_USER_MODE_ONLY
    if (uffd < 0)
        uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
#endif
    struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_MISSING_SHMEM};
    if (uffd >= 0 && ioctl(uffd, UFFDIO_API, &api) != 0) {
        close(uffd);
        uffd = -1;
    }
    return uffd;
}

/* [src, src + n) into [off, off + n) of memfd fd through a userfaultfd, then that mapping
 * moved over [src, src + n) (see the header: uffdcopy). */
static void uffd_copy_over(int uffd, int fd, char *src, size_t n, off_t off) {
    char *stage = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off);
    if (stage == MAP_FAILED)
        die("mmap a staging range");
    struct uffdio_register reg = {{(uintptr_t)stage, n}, UFFDIO_REGISTER_MODE_MISSING, 0};
    if (ioctl(uffd, UFFDIO_REGISTER, &reg) != 0)
        die("UFFDIO_REGISTER");
    struct uffdio_copy copy = {(uintptr_t)stage, (uintptr_t)src, n, 0, 0};
    if (ioctl(uffd, UFFDIO_COPY, &copy) != 0 || copy.copy != (int64_t)n)
        die("UFFDIO_COPY");
    if (mremap(stage, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, src) == MAP_FAILED)
        die("mremap over the array");
}

/* Share `bytes` of fresh touched pages into a new memfd by `method`; *fd_out: the memfd,
 * *mem_out: the sender's mapping of it. Returns the seconds the share took. */
static double share(int method, size_t bytes, int *fd_out, char **mem_out) {
    char *src = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED)
        die("mmap source");
    for (size_t i = 0; i < bytes; i += PAGE)
        src[i] = (char)(i / PAGE);
    int fd = memfd_create("bench_receiver", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
        die("memfd");
    double start = now();
    if (method == 3) {
        char *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            die("mmap memfd");
        memcpy(m, src, bytes);
        munmap(src, bytes);
        src = m;
    } else if (method == 4) {
        int uffd = open_uffd();
        if (uffd < 0)
            die("userfaultfd for shared memory");
        for (size_t off = 0; off < bytes; off += CHUNK) {
            size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
            uffd_copy_over(uffd, fd, src + off, n, (off_t)off);
        }
        close(uffd);
    } else if (method == 2) {
        pwrite_all(fd, src, bytes, 0);
        if (mmap(src, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED)
            die("mmap over the array");
    } else {
        for (size_t off = 0; off < bytes; off += CHUNK) {
            size_t n = bytes - off < CHUNK ? bytes - off : CHUNK;
            pwrite_all(fd, src + off, n, (off_t)off);
            if (mmap(src + off, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                     (off_t)off) == MAP_FAILED)
                die("mmap a chunk over the array");
        }
        if (method == 1 && madvise(src, bytes, MADV_POPULATE_READ) != 0)
            perror("bench_receiver: MADV_POPULATE_READ (before Linux 5.14: as chunked, then)");
    }
    double seconds = now() - start;
    *fd_out = fd;
    *mem_out = src;
    return seconds;
}

/* `bytes` (a multiple of the page size) of fd mapped at a 2 MiB boundary, through a
 * reservation of 2 MiB more whose head and tail are given back. */
static char *map_aligned(int fd, size_t bytes, int prot) {
    char *reserved = mmap(NULL, bytes + HUGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (reserved == MAP_FAILED)
        return MAP_FAILED;
    char *at = (char *)(((uintptr_t)reserved + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    char *m = mmap(at, bytes, prot, MAP_SHARED | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED) {
        munmap(reserved, bytes + HUGE);
        return MAP_FAILED;
    }
    if (at > reserved)
        munmap(reserved, (size_t)(at - reserved));
    if (reserved + bytes + HUGE > at + bytes)
        munmap(at + bytes, (size_t)(reserved + bytes + HUGE - (at + bytes)));
    return m;
}

/* The huge ceiling's share: a new memfd in huge pages (where the kernel gives them), filled
 * from touched private pages; *fd_out: the memfd. Returns the seconds the copy took. */
static double share_huge(size_t bytes, int *fd_out) {
    char *src = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int fd = memfd_create("bench_receiver", MFD_CLOEXEC);
    if (src == MAP_FAILED || fd < 0 || ftruncate(fd, (off_t)bytes) != 0)
        die("memfd");
    memset(src, 1, bytes);
    char *m = map_aligned(fd, bytes, PROT_READ | PROT_WRITE);
    if (m == MAP_FAILED)
        die("mmap memfd");
    for (size_t i = 0; i < bytes; i += HUGE)
        m[i] = 0;
    if (madvise(m, bytes, MADV_COLLAPSE) != 0)
        perror("bench_receiver: MADV_COLLAPSE (small pages, then)");
    double start = now();
    memcpy(m, src, bytes);
    double seconds = now() - start;
    munmap(m, bytes);
    munmap(src, bytes);
    *fd_out = fd;
    return seconds;
}

/* Of the pages of [m, m + bytes) (mapped), the fraction whose physical page is next to the
 * previous page's (right after or right before it), from /proc/self/pagemap; -1 where it
 * shows no page frame numbers (they read as 0 without CAP_SYS_ADMIN). As it maps them, the
 * reader's kernel reads each page's struct page in file order (fault-around): pages next to
 * each other in physical memory have their struct pages next to each other too. */
static double physically_in_order(const volatile char *m, size_t bytes) {
    size_t pages = bytes / PAGE, in_order = 0, nonzero = 0;
    uint64_t *entries = malloc(pages * sizeof(uint64_t));
    int pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    off_t at = (off_t)((uintptr_t)m / PAGE * sizeof(uint64_t));
    size_t want = pages * sizeof(uint64_t);
    int ok = entries != NULL && pagemap >= 0 && pread(pagemap, entries, want, at) == (ssize_t)want;
    for (size_t p = 0; ok && p < pages; p++) {
        uint64_t pfn = entries[p] & (((uint64_t)1 << 55) - 1);
        nonzero += pfn != 0;
        uint64_t before = p > 0 ? entries[p - 1] & (((uint64_t)1 << 55) - 1) : 0;
        in_order += p > 0 && pfn != 0 && (pfn == before + 1 || pfn + 1 == before);
    }
    if (pagemap >= 0)
        close(pagemap);
    free(entries);
    return ok && nonzero == pages && pages > 1 ? (double)in_order / (double)(pages - 1) : -1;
}

/* A forked child maps the memfd (at a 2 MiB boundary if `aligned`) and reads a byte per page,
 * `reads` times; times[i]: the seconds the i-th read took (the first with the mmap), then
 * times[reads]: physically_in_order of its pages (after the reads, untimed). */
#define MAX_READS 2

static void child_reads_times(int fd, size_t bytes, int aligned, int reads, double *times) {
    if (reads < 1 || reads > MAX_READS)
        die("child_reads_times: reads out of range");
    int pipe_fds[2];
    if (pipe(pipe_fds) != 0)
        die("pipe");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        close(pipe_fds[0]);
        double seconds[MAX_READS + 1], start = now();
        const volatile char *m =
            aligned ? map_aligned(fd, bytes, PROT_READ) : mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            _exit(1);
        for (int r = 0; r < reads; r++) {
            for (size_t i = 0; i < bytes; i += PAGE)
                (void)m[i]; /* (volatile: every read happens) */
            double end = now();
            seconds[r] = end - start;
            start = end;
        }
        seconds[reads] = physically_in_order(m, bytes);
        size_t n = (size_t)(reads + 1) * sizeof(double);
        _exit(write(pipe_fds[1], seconds, n) == (ssize_t)n ? 0 : 1);
    }
    close(pipe_fds[1]); /* (so that a child that dies before writing gives EOF, not a hang) */
    size_t want = (size_t)(reads + 1) * sizeof(double), got = 0;
    while (got < want) {
        ssize_t n = read(pipe_fds[0], (char *)times + got, want - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    int status = 0;
    waitpid(pid, &status, 0);
    close(pipe_fds[0]);
    if (got != want || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        errno = EIO;
        die("the reading child");
    }
}

static int huge_rounds(size_t bytes, int rounds) {
    static double copies[MAX_ROUNDS], first[MAX_ROUNDS], second[MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
        int fd;
        double times[MAX_READS + 1];
        copies[r] = share_huge(bytes, &fd);
        child_reads_times(fd, bytes, 1, 2, times);
        first[r] = times[0];
        second[r] = times[1];
        close(fd);
    }
    qsort(copies, (size_t)rounds, sizeof(double), by_value);
    qsort(first, (size_t)rounds, sizeof(double), by_value);
    qsort(second, (size_t)rounds, sizeof(double), by_value);
    printf("%zu MiB in huge pages, %d rounds, ms (min, median): copy %.1f %.1f; a forked "
           "reader's first read %.2f %.2f, its second read %.2f %.2f\n", bytes >> 20, rounds,
           copies[0] * 1e3, copies[rounds / 2] * 1e3, first[0] * 1e3, first[rounds / 2] * 1e3,
           second[0] * 1e3, second[rounds / 2] * 1e3);
    return 0;
}

/* A forked child maps the memfd and reads a byte per page; returns the seconds it took, and
 * in *in_order physically_in_order of its pages. */
static double child_reads(int fd, size_t bytes, double *in_order) {
    double times[2];
    child_reads_times(fd, bytes, 0, 1, times);
    *in_order = times[1];
    return times[0];
}

int main(int argc, char **argv) {
    bench_name = "bench_receiver";
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 512;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    int huge = argc > 3 && strcmp(argv[3], "huge") == 0;
    if (mib == 0 || rounds < 1 || rounds > MAX_ROUNDS || (argc > 3 && !huge)) {
        fprintf(stderr, "usage: bench_receiver [mib [rounds (1..%d) [huge]]]\n", MAX_ROUNDS);
        return 2;
    }
    size_t bytes = mib << 20;
    if (huge)
        return huge_rounds(bytes, rounds);
    static double shares[METHODS][MAX_ROUNDS], reads[METHODS][MAX_ROUNDS];
    static double in_order[METHODS][MAX_ROUNDS];
    int uffd = open_uffd();
    int methods = uffd >= 0 ? METHODS : METHODS - 1; /* (uffdcopy last) */
    if (uffd >= 0)
        close(uffd);
    for (int r = 0; r < rounds; r++)
        for (int method = 0; method < methods; method++) {
            int fd;
            char *mem;
            shares[method][r] = share(method, bytes, &fd, &mem);
            reads[method][r] = child_reads(fd, bytes, &in_order[method][r]);
            munmap(mem, bytes);
            close(fd);
        }
    printf("%zu MiB, %d rounds: share ms (min, median), a forked reader's first read ms "
           "(min, median), %% of the memfd's pages next to the previous one in physical "
           "memory (median; root only)\n", mib, rounds);
    if (methods < METHODS)
        printf("(uffdcopy: no userfaultfd for shared memory here)\n");
    for (int method = 0; method < methods; method++) {
        qsort(shares[method], (size_t)rounds, sizeof(double), by_value);
        qsort(reads[method], (size_t)rounds, sizeof(double), by_value);
        qsort(in_order[method], (size_t)rounds, sizeof(double), by_value);
        double order = in_order[method][rounds / 2];
        printf("%-10s share %8.1f %8.1f   read %7.1f %7.1f   in order ", names[method],
               shares[method][0] * 1e3, shares[method][rounds / 2] * 1e3,
               reads[method][0] * 1e3, reads[method][rounds / 2] * 1e3);
        if (order < 0)
            printf("n/a\n");
        else
            printf("%5.1f%%\n", order * 100);
    }
    return 0;
}
