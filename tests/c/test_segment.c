/*
 * test_segment.c -- segments (create, views, close_fd, seal_readonly), attaching received fds
 * with every validation error, read-only attach, zero-length fds, lshm_storage_create_shared,
 * fault injection over create and attach, and a real RLIMIT_FSIZE failure.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* the fault-injection hooks of internal.h */
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static size_t page;

static void test_create(void) {
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(10000, 0, &seg));
    ASSERT_UINT_EQ(lshm_segment_size(seg), 10000);
    ASSERT_EQ(lshm_segment_flags(seg), 0);
    ASSERT(all_bytes(lshm_segment_data(seg), 10000, 0));
    int fd = segment_fd(seg);
    ASSERT_GE(fd, 0);
    ASSERT(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    int seals = fcntl(fd, F_GET_SEALS);
    ASSERT((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW));
    struct stat st;
    ASSERT_OK(fstat(fd, &st));
    ASSERT_UINT_EQ(st.st_size, 10000);
    ASSERT_GE((uint64_t)st.st_blocks * 512, 10000); /* pages reserved up front */
    ASSERT_PTR_EQ(lshm_segment_retain(seg), seg);
    lshm_segment_release(seg);
    lshm_segment_release(seg);
    lshm_segment_release(NULL);
    ASSERT(lshm_segment_retain(NULL) == NULL);
    /* bad input */
    seg = NULL;
    ASSERT_ERR(lshm_segment_create(10, 1, &seg), -EINVAL);
    ASSERT_ERR(lshm_segment_create(10, 0, NULL), -EINVAL);
    ASSERT_ERR(lshm_segment_create(SIZE_MAX, 0, &seg), -EOVERFLOW);
    ASSERT(seg == NULL);
    {
        int nofd = -1;
        ASSERT_ERR(lshm_segment_fd(NULL, &nofd), -EINVAL);
        ASSERT_ERR(lshm_segment_fd(seg, NULL), -EINVAL);
        ASSERT_EQ(nofd, -1); /* untouched on failure */
    }
    ASSERT(lshm_segment_data(NULL) == NULL);
    ASSERT_UINT_EQ(lshm_segment_size(NULL), 0);
}

/* A segment large enough for huge pages: 2 MiB-aligned mapping, collapsed, then reserved. */
#define HUGE_SEGMENT ((size_t)(5 << 20) + 100)

/* From 2 MiB on a new segment is mapped at a 2 MiB boundary (huge pages map whole), reads
 * zeros, and has every page reserved (no SIGBUS later), huge pages or not. */
static void test_create_huge(void) {
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(HUGE_SEGMENT, 0, &seg));
    unsigned char *p = lshm_segment_data(seg);
    if (lshm__os_huge_wanted()) /* (LSHM_HUGE=0: anywhere) */
        ASSERT_EQ((uintptr_t)p % ((size_t)2 << 20), 0);
    ASSERT(all_bytes(p, HUGE_SEGMENT, 0));
    struct stat st;
    ASSERT_OK(fstat(segment_fd(seg), &st));
    ASSERT_GE((uint64_t)st.st_blocks * 512, HUGE_SEGMENT);
    ASSERT_EQ(count_mappings(p, HUGE_SEGMENT, 1), 1);
    memset(p, 0xab, HUGE_SEGMENT);
    ASSERT(all_bytes(p + HUGE_SEGMENT - 100, 100, 0xab));
    /* a receiver's mapping of it is aligned too, read-only or not */
    for (unsigned flags = 0; flags <= LSHM_STORAGE_READONLY; flags += LSHM_STORAGE_READONLY) {
        lshm_segment *got;
        ASSERT_OK(lshm_segment_attach(segment_fd(seg), flags, &got));
        unsigned char *q = lshm_segment_data(got);
        if (lshm__os_huge_wanted())
            ASSERT_EQ((uintptr_t)q % ((size_t)2 << 20), 0);
        ASSERT(q != p && all_bytes(q, HUGE_SEGMENT, 0xab));
        lshm_segment_release(got);
    }
    lshm_segment_release(seg);
}

static void test_views(void) {
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(3 * page, 0, &seg));
    char *base = lshm_segment_data(seg);
    void *mem = aligned_alloc(lshm_storage_alignof(), lshm_storage_sizeof());
    lshm_storage *a, *b;
    ASSERT_OK(lshm_storage_init_view(mem, seg, 100, 200, 0, &a));
    ASSERT_OK(lshm_storage_create_view(seg, page, 2 * page, 0, &b));
    ASSERT_PTR_EQ(lshm_storage_data(a), base + 100);
    ASSERT_PTR_EQ(lshm_storage_data(b), base + page);
    ASSERT_EQ(lshm_storage_flags(a), LSHM_STORAGE_SHARED | LSHM_STORAGE_INPLACE);
    ASSERT_EQ(lshm_storage_flags(b), LSHM_STORAGE_SHARED);
    ASSERT_PTR_EQ(lshm_storage_segment(a), seg);
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(b, &fd, &off));
    ASSERT_EQ(fd, segment_fd(seg)); /* one fd for every storage on the segment */
    ASSERT_UINT_EQ(off, page);
    ASSERT_OK(lshm_storage_share(b)); /* already shared */
    /* Views keep the segment alive after the creator lets go. */
    lshm_segment_release(seg);
    memset(lshm_storage_data(b), 3, 2 * page);
    ASSERT_EQ(base[page], 3);
    /* bad views */
    lshm_storage *c = NULL;
    ASSERT_ERR(lshm_storage_create_view(seg, 3 * page, 1, 0, &c), -EINVAL);
    ASSERT_ERR(lshm_storage_create_view(seg, UINT64_MAX, 1, 0, &c), -EINVAL);
    ASSERT_ERR(lshm_storage_create_view(seg, 1, SIZE_MAX, 0, &c), -EINVAL);
    ASSERT_ERR(lshm_storage_create_view(seg, 0, 1, LSHM_STORAGE_RESIZABLE, &c), -EINVAL);
    ASSERT_ERR(lshm_storage_create_view(NULL, 0, 1, 0, &c), -EINVAL);
    ASSERT_ERR(lshm_storage_create_view(seg, 0, 1, 0, NULL), -EINVAL);
    ASSERT_ERR(lshm_storage_init_view((char *)mem + 1, seg, 0, 1, 0, &c), -EINVAL);
    ASSERT(c == NULL);
    /* a zero-byte view at the very end */
    ASSERT_OK(lshm_storage_create_view(seg, 3 * page, 0, LSHM_STORAGE_READONLY, &c));
    ASSERT(lshm_storage_data(c) == NULL);
    ASSERT_EQ(lshm_storage_flags(c), LSHM_STORAGE_SHARED | LSHM_STORAGE_READONLY);
    lshm_storage_release(c);
    ASSERT_OK(lshm_storage_fini(a));
    lshm_storage_release(b); /* the last reference: the segment goes */
    free(mem);
}

static void test_close_fd(void) {
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(page, 0, &seg));
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create_view(seg, 0, page, 0, &s));
    int fds = fd_count();
    ASSERT_OK(lshm_segment_close_fd(seg));
    ASSERT_EQ(fd_count(), fds - 1);
    ASSERT_OK(lshm_segment_close_fd(seg)); /* idempotent */
    {
        int closed = -1;
        ASSERT_ERR(lshm_segment_fd(seg, &closed), -EBADF);
        ASSERT_EQ(closed, -1);
    }
    int fd;
    uint64_t off;
    ASSERT_ERR(lshm_storage_fd(s, &fd, &off), -EBADF);
    ASSERT_ERR(lshm_segment_seal_readonly(seg), -EBADF);
    memset(lshm_storage_data(s), 9, page); /* the mapping lives on */
    ASSERT(all_bytes(lshm_segment_data(seg), page, 9));
    lshm_segment_release(seg);
    lshm_storage_release(s);
    ASSERT_ERR(lshm_segment_close_fd(NULL), -EINVAL);
    ASSERT_ERR(lshm_segment_seal_readonly(NULL), -EINVAL);
}

static void test_seal_readonly(void) {
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(2 * page, 0, &seg));
    /* Sealed before its fd is handed out (issue 9: once handed out writable it cannot be). */
    ASSERT_OK(lshm_segment_seal_readonly(seg));
    ASSERT_OK(lshm_segment_seal_readonly(seg)); /* adding the same seal again is fine */
    int fd = segment_fd(seg);
    ASSERT_EQ(fcntl(fd, F_GET_SEALS) & (F_SEAL_FUTURE_WRITE | F_SEAL_SEAL),
              F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
    lshm_segment *ro = NULL;
    lshm_storage *s = NULL;
    ASSERT_ERR(lshm_segment_attach(fd, 0, &ro), -EPERM);
    ASSERT_ERR(lshm_storage_attach(fd, 0, page, 0, &s), -EPERM);
    ASSERT(strstr(lshm_last_error(), "sealed against writes") != NULL);
    ASSERT_OK(lshm_segment_attach(fd, LSHM_STORAGE_READONLY, &ro));
    ASSERT_OK(lshm_storage_attach(fd, 10, page, LSHM_STORAGE_READONLY, &s));
    ASSERT_EQ(lshm_segment_flags(ro), LSHM_STORAGE_READONLY);
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_SHARED | LSHM_STORAGE_READONLY);
    /* The creator's mapping keeps writing; readers see it. */
    char *w = lshm_segment_data(seg);
    w[10] = 42;
    ASSERT_EQ(((char *)lshm_segment_data(ro))[10], 42);
    ASSERT_EQ(((char *)lshm_storage_data(s))[0], 42);
    /* No new writable mapping is possible, from anyone. */
    void *p = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ASSERT(p == MAP_FAILED);
    ASSERT_EQ(errno, EPERM);
    ASSERT_EQ(pwrite(fd, "x", 1, 0), -1);
    /* Views of a read-only segment are read-only, and copies into them are refused. */
    lshm_storage *v, *src;
    ASSERT_OK(lshm_storage_create_view(ro, 0, page, 0, &v));
    ASSERT(lshm_storage_flags(v) & LSHM_STORAGE_READONLY);
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &src));
    ASSERT_ERR(lshm_storage_copy(v, src), -EPERM);
    lshm_storage_release(src);
    lshm_storage_release(v);
    lshm_storage_release(s);
    lshm_segment_release(ro);
    lshm_segment_release(seg);
}

static void test_attach(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create_shared(3 * page, 0, &s));
    ASSERT(lshm_storage_segment(s) != NULL);
    ASSERT(all_bytes(lshm_storage_data(s), 3 * page, 0));
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    ASSERT_UINT_EQ(off, 0);
    char *p = lshm_storage_data(s);
    for (size_t i = 0; i < 3 * page; i++)
        p[i] = (char)(i % 251);
    /* an unaligned window */
    lshm_storage *t;
    ASSERT_OK(lshm_storage_attach(fd, page + 100, page, 0, &t));
    ASSERT(memcmp(lshm_storage_data(t), p + page + 100, page) == 0);
    ASSERT(lshm_storage_segment(t) == NULL);
    int tfd;
    ASSERT_OK(lshm_storage_fd(t, &tfd, &off));
    ASSERT(tfd != fd); /* duplicated: the caller keeps its own */
    ASSERT(fcntl(tfd, F_GETFD) & FD_CLOEXEC);
    ASSERT_UINT_EQ(off, page + 100);
    ((char *)lshm_storage_data(t))[0] = 'A';
    ASSERT_EQ(p[page + 100], 'A');
    lshm_storage_release(t);
    /* the whole fd as a segment */
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_attach(fd, 0, &seg));
    ASSERT_UINT_EQ(lshm_segment_size(seg), 3 * page);
    ASSERT(memcmp(lshm_segment_data(seg), p, 3 * page) == 0);
    lshm_segment_release(seg);
    /* exactly to the end */
    ASSERT_OK(lshm_storage_attach(fd, 3 * page - 1, 1, 0, &t));
    lshm_storage_release(t);
    lshm_storage_release(s);
}

static void test_attach_errors(void) {
    int fds = fd_count();
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(page, 0, &seg));
    int fd = segment_fd(seg);
    lshm_storage *s = NULL;
    lshm_segment *other = NULL;
    /* not an fd */
    ASSERT_ERR(lshm_storage_attach(-1, 0, 1, 0, &s), -EBADF);
    int closed = dup(fd);
    close(closed);
    ASSERT_ERR(lshm_storage_attach(closed, 0, 1, 0, &s), -EBADF);
    ASSERT_ERR(lshm_segment_attach(closed, 0, &other), -EBADF);
    /* not a memfd: a regular file, a pipe */
    FILE *f = tmpfile();
    ASSERT(f != NULL);
    ASSERT_OK(ftruncate(fileno(f), (off_t)page));
    ASSERT_ERR(lshm_storage_attach(fileno(f), 0, 1, 0, &s), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "not a memfd") != NULL);
    fclose(f);
    int pipefd[2];
    ASSERT_OK(pipe(pipefd));
    ASSERT_ERR(lshm_storage_attach(pipefd[0], 0, 1, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_segment_attach(pipefd[1], 0, &other), -EINVAL);
    close(pipefd[0]);
    close(pipefd[1]);
    /* a hugetlbfs memfd answers F_GET_SEALS and can be sealed, but maps in whole huge pages:
     * a 4 KiB view of it could not be unmapped at release (munmap EINVAL). Refused before any
     * mapping (no huge page needs to be reserved for that). */
    int huge = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
    if (huge >= 0) {
        ASSERT_OK(ftruncate(huge, 2 << 20));
        ASSERT_ERR(lshm_storage_attach(huge, 0, page, 0, &s), -EINVAL);
        ASSERT(strstr(lshm_last_error(), "hugetlbfs") != NULL);
        ASSERT_ERR(lshm_segment_attach(huge, 0, &other), -EINVAL);
        ASSERT_ERR(lshm_segment_attach(huge, LSHM_STORAGE_READONLY, &other), -EINVAL);
        ASSERT(s == NULL && other == NULL);
        ASSERT_EQ(fcntl(huge, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW), 0);
        close(huge);
    } else {
        printf("  (no hugetlbfs memfds here: %s)\n", strerror(errno));
    }
    /* smaller than claimed, bad offsets */
    ASSERT_ERR(lshm_storage_attach(fd, 0, page + 1, 0, &s), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "smaller than claimed") != NULL);
    ASSERT_ERR(lshm_storage_attach(fd, page, 1, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_attach(fd, UINT64_MAX, 1, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_attach(fd, 1, SIZE_MAX, 0, &s), -EINVAL);
    /* flags, NULL out */
    ASSERT_ERR(lshm_storage_attach(fd, 0, 1, LSHM_STORAGE_RESIZABLE, &s), -EINVAL);
    ASSERT_ERR(lshm_segment_attach(fd, 0x100, &other), -EINVAL);
    ASSERT_ERR(lshm_storage_attach(fd, 0, 1, 0, NULL), -EINVAL);
    ASSERT_ERR(lshm_segment_attach(fd, 0, NULL), -EINVAL);
    /* an fd opened read-only needs READONLY */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rdonly = open(path, O_RDONLY | O_CLOEXEC);
    ASSERT_GE(rdonly, 0);
    ASSERT_ERR(lshm_storage_attach(rdonly, 0, 1, 0, &s), -EACCES);
    ASSERT_ERR(lshm_segment_attach(rdonly, 0, &other), -EACCES);
    ASSERT(s == NULL && other == NULL);
    ASSERT_OK(lshm_storage_attach(rdonly, 0, page, LSHM_STORAGE_READONLY, &s));
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_SHARED | LSHM_STORAGE_READONLY);
    /* Through a read-only fd, not even mprotect can make the mapping writable. */
    void *page_start = (void *)((uintptr_t)lshm_storage_data(s) & ~(uintptr_t)(page - 1));
    ASSERT_EQ(mprotect(page_start, page, PROT_READ | PROT_WRITE), -1);
    ASSERT_EQ(errno, EACCES);
    lshm_storage_release(s);
    close(rdonly);
    lshm_segment_release(seg);

    /* An attach refused for what the fd says (too small, write-only, read-only without
     * READONLY) leaves an unsealed fd unsealed: the caller may still resize it. */
    int loose = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_OK(ftruncate(loose, (off_t)page));
    ASSERT_ERR(lshm_storage_attach(loose, 0, 2 * page, 0, &s), -EINVAL);
    snprintf(path, sizeof path, "/proc/self/fd/%d", loose);
    int wronly = open(path, O_WRONLY | O_CLOEXEC);
    rdonly = open(path, O_RDONLY | O_CLOEXEC);
    ASSERT(wronly >= 0 && rdonly >= 0);
    ASSERT_ERR(lshm_storage_attach(wronly, 0, page, 0, &s), -EACCES);
    ASSERT(strstr(lshm_last_error(), "write-only") != NULL);
    ASSERT_ERR(lshm_storage_attach(rdonly, 0, page, 0, &s), -EACCES);
    ASSERT_EQ(fcntl(loose, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW), 0);
    ASSERT_OK(ftruncate(loose, (off_t)(2 * page)));
    close(wronly);
    close(rdonly);
    close(loose);

    /* An unsealed memfd is sealed on attach; one that cannot be sealed is refused. */
    int raw = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_OK(ftruncate(raw, (off_t)page));
    ASSERT_OK(lshm_storage_attach(raw, 0, page, 0, &s));
    int seals = fcntl(raw, F_GET_SEALS);
    ASSERT((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW));
    lshm_storage_release(s);
    close(raw);
    raw = memfd_create("test", MFD_CLOEXEC); /* no sealing allowed: F_SEAL_SEAL is set */
    ASSERT_OK(ftruncate(raw, (off_t)page));
    s = NULL;
    ASSERT_ERR(lshm_storage_attach(raw, 0, page, 0, &s), -EPERM);
    ASSERT_ERR(lshm_segment_attach(raw, LSHM_STORAGE_READONLY, &other), -EPERM);
    ASSERT(s == NULL && other == NULL);
    close(raw);
    ASSERT_EQ(fd_count(), fds);
}

static void test_zero_length(void) {
    lshm_segment *seg, *other;
    ASSERT_OK(lshm_segment_create(0, 0, &seg));
    ASSERT(lshm_segment_data(seg) == NULL);
    ASSERT_UINT_EQ(lshm_segment_size(seg), 0);
    int fd = segment_fd(seg);
    ASSERT_GE(fd, 0);
    ASSERT_OK(lshm_segment_attach(fd, 0, &other));
    ASSERT(lshm_segment_data(other) == NULL);
    ASSERT_UINT_EQ(lshm_segment_size(other), 0);
    lshm_storage *s;
    ASSERT_OK(lshm_storage_attach(fd, 0, 0, 0, &s));
    ASSERT(lshm_storage_data(s) == NULL);
    lshm_storage_release(s);
    ASSERT_ERR(lshm_storage_attach(fd, 1, 0, 0, &s), -EINVAL);
    lshm_segment_release(other);
    lshm_segment_release(seg);
    ASSERT_OK(lshm_storage_create_shared(0, 0, &s));
    ASSERT(lshm_storage_data(s) == NULL);
    ASSERT(lshm_storage_flags(s) & LSHM_STORAGE_SHARED);
    lshm_storage_release(s);
    s = NULL;
    ASSERT_ERR(lshm_storage_create_shared(10, 1, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_create_shared(10, 0, NULL), -EINVAL);
    ASSERT_ERR(lshm_storage_create_shared(SIZE_MAX, 0, &s), -EOVERFLOW);
    ASSERT(s == NULL);
}

/* Loop a fault over every point of an operation: it fails with the injected code, nothing
 * leaks, nothing is written to *out; once past every point it succeeds. */
typedef int (*op_fn)(int fd, void **out);
static int op_segment_create(int fd, void **out) {
    (void)fd;
    return lshm_segment_create(5 * page, 0, (lshm_segment **)out);
}
static int op_segment_attach(int fd, void **out) {
    return lshm_segment_attach(fd, 0, (lshm_segment **)out);
}
static int op_storage_attach(int fd, void **out) {
    return lshm_storage_attach(fd, 100, page, 0, (lshm_storage **)out);
}
static int op_create_shared(int fd, void **out) {
    (void)fd;
    return lshm_storage_create_shared(page, 0, (lshm_storage **)out);
}

static int op_segment_create_huge(int fd, void **out) {
    (void)fd;
    return lshm_segment_create(HUGE_SEGMENT, 0, (lshm_segment **)out);
}

static int op_segment_attach_huge(int fd, void **out) {
    return lshm_segment_attach(fd, 0, (lshm_segment **)out);
}

static void free_segment(void *p) {
    lshm_segment_release(p);
}
static void free_storage(void *p) {
    lshm_storage_release(p);
}

/* Returns how many fault points the operation passed. */
static int fault_loop(op_fn op, void (*free_out)(void *), int fd, int err) {
    int fds = fd_count();
    void *out = NULL;
    for (int nth = 1;; nth++) {
        lshm__fault_arm(nth, err);
        int rc = op(fd, &out);
        int hit = lshm__fault_points_hit();
        lshm__fault_arm(0, 0);
        if (hit < nth) {
            ASSERT_OK(rc);
            ASSERT(out != NULL);
            free_out(out);
            ASSERT_EQ(fd_count(), fds);
            return nth - 1;
        }
        ASSERT_ERR(rc, err);
        ASSERT(strstr(lshm_last_error(), "injected") != NULL);
        ASSERT(out == NULL);
        ASSERT_EQ(fd_count(), fds);
    }
}

static void test_faults(void) {
    lshm_segment *seg;
    ASSERT_OK(lshm_segment_create(5 * page, 0, &seg));
    int fd = segment_fd(seg);
    /* memfd, ftruncate, seal, fallocate, mmap */
    ASSERT_GE(fault_loop(op_segment_create, free_segment, -1, -ENOSPC), 5);
    ASSERT_GE(fault_loop(op_create_shared, free_storage, -1, -ENOMEM), 5);
    /* the same at a huge-page size (one more point: the aligned range), no mapping left */
    int maps = count_mappings(NULL, SIZE_MAX, 0);
    ASSERT_GE(fault_loop(op_segment_create_huge, free_segment, -1, -ENOMEM),
              lshm__os_huge_wanted() ? 6 : 5);
    ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 0), maps);
    lshm_segment *huge_seg;
    ASSERT_OK(lshm_segment_create(HUGE_SEGMENT, 0, &huge_seg));
    maps = count_mappings(NULL, SIZE_MAX, 0);
    ASSERT_GE(fault_loop(op_segment_attach_huge, free_segment, segment_fd(huge_seg),
                         -ENOMEM),
              lshm__os_huge_wanted() ? 6 : 5);
    ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 0), maps);
    lshm_segment_release(huge_seg);
    /* fstat, get_seals, getfl, dup, mmap */
    ASSERT_GE(fault_loop(op_segment_attach, free_segment, fd, -ENOMEM), 5);
    ASSERT_GE(fault_loop(op_storage_attach, free_storage, fd, -EMFILE), 5);
    lshm_segment_release(seg);
}

static void test_rlimit_fsize(void) {
    /* A real limit: files may not grow past 1 page, so ftruncate fails with EFBIG (the
     * kernel would also send SIGXFSZ, which we ignore as any library user may). */
    int fds = fd_count();
    struct rlimit saved, low;
    ASSERT_OK(getrlimit(RLIMIT_FSIZE, &saved));
    void (*old)(int) = signal(SIGXFSZ, SIG_IGN);
    low = saved;
    low.rlim_cur = page;
    ASSERT_OK(setrlimit(RLIMIT_FSIZE, &low));
    lshm_segment *seg = NULL;
    int rc = lshm_segment_create(4 * page, 0, &seg);
    ASSERT(strstr(lshm_last_error(), "ftruncate") != NULL);
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(4 * page, NULL, 0, &s));
    void *data = lshm_storage_data(s);
    memset(data, 1, 4 * page);
    int rc2 = lshm_storage_share(s);
    ASSERT_OK(setrlimit(RLIMIT_FSIZE, &saved));
    signal(SIGXFSZ, old);
    ASSERT_ERR(rc, -EFBIG);
    ASSERT(seg == NULL);
    ASSERT_ERR(rc2, -EFBIG);
    /* The share sizes its memfd by writing it: the last error names pwrite. */
    ASSERT(strstr(lshm_last_error(), "pwrite") != NULL);
    ASSERT_PTR_EQ(lshm_storage_data(s), data);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    ASSERT(all_bytes(data, 4 * page, 1));
    ASSERT_EQ(fd_count(), fds);
    lshm_storage_release(s);
}

/* ---- attach against a sender that resizes the fd ----------------------------------------- */

/* A hostile sender shrinks and grows an unsealed memfd while we attach it. Attach seals the
 * size and must map the size it sealed: every successful attach maps no more than the file
 * holds, so touching every page never raises SIGBUS (no handler: a SIGBUS kills the test). */
enum { RACE_SMALL = 4096, RACE_BIG = 1 << 20 };
static _Atomic int race_fd = -1;
static _Atomic int race_stop;
static _Atomic unsigned race_gen; /* bumped with each new fd: fd numbers are reused */
static _Atomic unsigned long race_truncates;

static void *truncate_thread(void *arg) {
    (void)arg;
    unsigned last = 0;
    while (!atomic_load(&race_stop)) {
        unsigned gen = atomic_load(&race_gen);
        int fd = atomic_load(&race_fd);
        if (fd < 0 || gen == last)
            continue;
        /* toggle until the attach seals the size (ftruncate then fails with EPERM) or the
         * main thread moves on */
        for (int i = 0; atomic_load(&race_fd) == fd; i++) {
            if (ftruncate(fd, (i & 1) ? RACE_BIG : RACE_SMALL) != 0)
                break;
            atomic_fetch_add(&race_truncates, 1);
        }
        last = gen;
    }
    return NULL;
}

static void touch_pages(const void *p, size_t n) {
    const volatile unsigned char *b = p;
    unsigned sum = 0;
    for (size_t i = 0; i < n; i += page)
        sum += b[i];
    if (n > 0)
        sum += b[n - 1];
    ASSERT_EQ(sum, 0); /* nobody wrote: all zero */
}

static void test_attach_race(void) {
    int fds = fd_count();
    pthread_t t;
    atomic_store(&race_stop, 0);
    ASSERT_OK(pthread_create(&t, NULL, truncate_thread, NULL));
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int attached = 0, refused = 0, iterations = 0;
    for (; iterations < 20000; iterations++) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (iterations >= 2000 &&
            (double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) * 1e-9 > 3.0)
            break;
        int fd = memfd_create("race", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        ASSERT_GE(fd, 0);
        ASSERT_OK(ftruncate(fd, RACE_BIG));
        atomic_fetch_add(&race_gen, 1);
        atomic_store(&race_fd, fd);
        for (volatile int spin = 0; spin < (iterations % 64) * 16; spin++) {
        }
        int rc;
        struct stat st;
        if (iterations % 2 == 0) {
            lshm_segment *seg = NULL;
            rc = lshm_segment_attach(fd, 0, &seg);
            if (rc == 0) {
                ASSERT_OK(fstat(fd, &st));
                ASSERT_UINT_EQ(lshm_segment_size(seg), st.st_size); /* the sealed size */
                ASSERT((fcntl(fd, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW)) ==
                       (F_SEAL_SHRINK | F_SEAL_GROW));
                touch_pages(lshm_segment_data(seg), lshm_segment_size(seg));
                lshm_segment_release(seg);
            }
        } else {
            lshm_storage *s = NULL;
            rc = lshm_storage_attach(fd, 0, RACE_BIG, 0, &s);
            if (rc == 0) {
                ASSERT_OK(fstat(fd, &st));
                ASSERT_UINT_EQ(st.st_size, RACE_BIG); /* sealed at a size that holds it */
                touch_pages(lshm_storage_data(s), RACE_BIG);
                lshm_storage_release(s);
            } else {
                ASSERT_ERR(rc, -EINVAL); /* sealed too small: refused, nothing mapped */
                ASSERT(strstr(lshm_last_error(), "smaller than claimed") != NULL);
            }
        }
        attached += rc == 0;
        refused += rc != 0;
        atomic_store(&race_fd, -1); /* the thread stops touching fd before we close it... */
        close(fd); /* ...at worst its ftruncate on a closed or reused number fails: harmless */
    }
    atomic_store(&race_stop, 1);
    ASSERT_OK(pthread_join(t, NULL));
    fprintf(stderr, "   %d attaches, %d refused, %lu truncates\n", attached, refused,
            (unsigned long)race_truncates);
    ASSERT_GT(attached, 0);
    ASSERT_EQ(fd_count(), fds);
}

int main(void) {
    page = lshm_page_size();
    /* These tests are about storages with a memfd of their own; test_slab covers slabs. */
    lshm__slab_max_bytes = 0;
    RUN_TEST(test_create);
    RUN_TEST(test_create_huge);
    RUN_TEST(test_views);
    RUN_TEST(test_close_fd);
    RUN_TEST(test_seal_readonly);
    RUN_TEST(test_attach);
    RUN_TEST(test_attach_errors);
    RUN_TEST(test_zero_length);
    RUN_TEST(test_faults);
    RUN_TEST(test_rlimit_fsize);
    RUN_TEST(test_attach_race);
    return 0;
}
