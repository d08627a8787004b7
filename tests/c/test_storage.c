/*
 * test_storage.c -- storage lifetime: init/fini in caller memory (one buffer, and a slab of
 * many), refcounts, heap create/release, caller and WHOLE_PAGES allocators, foreign memory,
 * bad input, resize and copy. Sharing has its own test programs.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* the fault-injection hooks of internal.h */
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static size_t page;

static void *storage_mem(void) {
    void *mem = aligned_alloc(lshm_storage_alignof(),
                              (lshm_storage_sizeof() + lshm_storage_alignof() - 1) /
                                  lshm_storage_alignof() * lshm_storage_alignof());
    ASSERT(mem != NULL);
    return mem;
}

static void test_init_in_caller_buffer(void) {
    void *mem = storage_mem();
    lshm_storage *s = NULL;
    ASSERT_OK(lshm_storage_init(mem, 10000, NULL, 0, &s));
    ASSERT_PTR_EQ(s, mem);
    ASSERT_EQ(lshm_storage_refcount(s), 1);
    ASSERT_UINT_EQ(lshm_storage_nbytes(s), 10000);
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_INPLACE);
    unsigned char *p = lshm_storage_data(s);
    ASSERT(p != NULL);
    ASSERT_EQ((uintptr_t)p % page, 0); /* the default allocator owns whole pages */
    ASSERT(all_bytes(p, 3 * page, 0)); /* zero-filled, including the tail of the last page */
    memset(p, 0x5a, 10000);
    ASSERT_OK(lshm_storage_fini(s));
    /* The same memory is free for a new storage. */
    ASSERT_OK(lshm_storage_init(mem, 0, NULL, LSHM_STORAGE_RESIZABLE, &s));
    ASSERT(lshm_storage_data(s) == NULL); /* zero bytes: no memory */
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_INPLACE | LSHM_STORAGE_RESIZABLE);
    ASSERT_OK(lshm_storage_fini(s));
    /* finalised twice: said as it is (not "still has 0 references") */
    ASSERT_ERR(lshm_storage_fini(s), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "finalised already") != NULL);
    ASSERT_OK(lshm_storage_fini(NULL));
    free(mem);
}

static void test_slab_of_many(void) {
    /* PyTorch's static runtime: all storage structs in one malloced slab, init in place. */
    enum { N = 1000 };
    size_t stride = lshm_storage_sizeof();
    ASSERT_EQ(stride % lshm_storage_alignof(), 0);
    char *slab = aligned_alloc(lshm_storage_alignof(), N * stride);
    ASSERT(slab != NULL);
    lshm_storage *s[N];
    for (size_t i = 0; i < N; i++) {
        ASSERT_OK(lshm_storage_init(slab + i * stride, i * 13, NULL, 0, &s[i]));
        ASSERT_PTR_EQ(s[i], slab + i * stride);
        if (i > 0)
            memset(lshm_storage_data(s[i]), (int)(i & 0xff), i * 13);
    }
    for (size_t i = 1; i < N; i++) {
        ASSERT_UINT_EQ(lshm_storage_nbytes(s[i]), i * 13);
        ASSERT(all_bytes(lshm_storage_data(s[i]), i * 13, (unsigned char)(i & 0xff)));
    }
    for (size_t i = 0; i < N; i++)
        ASSERT_OK(lshm_storage_fini(s[i]));
    free(slab);
}

static void test_refcount(void) {
    void *mem = storage_mem();
    lshm_storage *s;
    ASSERT_OK(lshm_storage_init(mem, 100, NULL, 0, &s));
    ASSERT_PTR_EQ(lshm_storage_retain(s), s);
    ASSERT_EQ(lshm_storage_refcount(s), 2);
    void *data = lshm_storage_data(s);
    ASSERT_ERR(lshm_storage_fini(s), -EBUSY); /* another reference exists: nothing changes */
    ASSERT(strstr(lshm_last_error(), "2 references") != NULL);
    ASSERT_EQ(lshm_storage_refcount(s), 2);
    ASSERT_PTR_EQ(lshm_storage_data(s), data);
    lshm_storage_release(s);
    ASSERT_EQ(lshm_storage_refcount(s), 1);
    ASSERT_OK(lshm_storage_fini(s));
    /* The last release of an in-place storage leaves it finalised, struct untouched. */
    ASSERT_OK(lshm_storage_init(mem, 100, NULL, 0, &s));
    lshm_storage_release(s);
    ASSERT_EQ(lshm_storage_refcount(s), 0);
    ASSERT(lshm_storage_retain(NULL) == NULL);
    lshm_storage_release(NULL);
    ASSERT_EQ(lshm_storage_refcount(NULL), 0);
    free(mem);
}

static void test_heap(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(5000, NULL, LSHM_STORAGE_RESIZABLE, &s));
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_RESIZABLE); /* not INPLACE */
    ASSERT(all_bytes(lshm_storage_data(s), 5000, 0));
    ASSERT_ERR(lshm_storage_fini(s), -EINVAL); /* heap storages are released, not finalised */
    lshm_storage_retain(s);
    lshm_storage_release(s);
    ASSERT_EQ(lshm_storage_refcount(s), 1);
    lshm_storage_release(s);
    ASSERT_OK(lshm_storage_create(0, NULL, 0, &s));
    ASSERT(lshm_storage_data(s) == NULL);
    lshm_storage_release(s);
}

/* A counting malloc allocator. */
typedef struct counts {
    int allocs, frees;
    void *last_ptr;
    size_t last_nbytes;
    size_t freed_nbytes; /* nbytes of the last free */
    int fail;
    int misalign;
} counts;

static void *count_alloc(void *ctx, size_t nbytes) {
    counts *c = ctx;
    if (c->fail)
        return NULL;
    c->allocs++;
    c->last_nbytes = nbytes;
    return c->last_ptr = malloc(nbytes);
}

static void count_free(void *ctx, void *ptr, size_t nbytes) {
    counts *c = ctx;
    c->frees++;
    c->freed_nbytes = nbytes;
    free(ptr);
}

static void *pages_alloc(void *ctx, size_t nbytes) {
    counts *c = ctx;
    c->allocs++;
    c->last_nbytes = nbytes;
    size_t len = (nbytes + page - 1) / page * page + page;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT(p != MAP_FAILED);
    return c->last_ptr = p + (c->misalign ? 16 : 0);
}

static void pages_free(void *ctx, void *ptr, size_t nbytes) {
    counts *c = ctx;
    c->frees++;
    ASSERT_UINT_EQ(nbytes, c->last_nbytes);
    ASSERT_PTR_EQ(ptr, c->last_ptr);
    size_t len = (nbytes + page - 1) / page * page + page;
    ASSERT_OK(munmap((char *)ptr - ((uintptr_t)ptr % page), len));
}

static void test_caller_allocator(void) {
    counts c = {0};
    lshm_allocator a = {count_alloc, count_free, &c, 0};
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(777, &a, 0, &s));
    ASSERT_EQ(c.allocs, 1);
    ASSERT_PTR_EQ(lshm_storage_data(s), c.last_ptr);
    ASSERT_UINT_EQ(c.last_nbytes, 777);
    memset(lshm_storage_data(s), 1, 777);
    lshm_storage_release(s);
    ASSERT_EQ(c.frees, 1);
    ASSERT_UINT_EQ(c.freed_nbytes, 777); /* free gets exactly what alloc was asked for */
    /* zero bytes: the allocator is not called */
    ASSERT_OK(lshm_storage_create(0, &a, 0, &s));
    lshm_storage_release(s);
    ASSERT_EQ(c.allocs, 1);
    ASSERT_EQ(c.frees, 1);
    /* an allocator out of memory */
    c.fail = 1;
    s = NULL;
    ASSERT_ERR(lshm_storage_create(10, &a, 0, &s), -ENOMEM);
    ASSERT(s == NULL);
    c.fail = 0;
    /* an allocator without both functions */
    lshm_allocator half = {count_alloc, NULL, &c, 0};
    ASSERT_ERR(lshm_storage_create(10, &half, 0, &s), -EINVAL);
    ASSERT_EQ(c.allocs, 1);
}

/* An allocator whose alloc, run inside a resize, resizes or shares that same storage: refused
 * with -EDEADLK there (the resize holds its lock), never a hang; the outer resize works. */
typedef struct reentrant {
    lshm_storage *s;
    int nested_resize, nested_share;
} reentrant;

static void *reentrant_alloc(void *ctx, size_t nbytes) {
    reentrant *r = ctx;
    if (r->s != NULL) {
        r->nested_resize = lshm_storage_resize(r->s, 10);
        r->nested_share = lshm_storage_share(r->s);
    }
    return malloc(nbytes);
}

static void reentrant_free(void *ctx, void *ptr, size_t nbytes) {
    (void)ctx;
    (void)nbytes;
    free(ptr);
}

static void test_allocator_calling_back_on_its_storage(void) {
    reentrant r = {NULL, 0, 0};
    lshm_allocator a = {reentrant_alloc, reentrant_free, &r, 0};
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(100, &a, LSHM_STORAGE_RESIZABLE, &s));
    r.s = s;
    ASSERT_OK(lshm_storage_resize(s, 1000));
    ASSERT_EQ(r.nested_resize, -EDEADLK);
    ASSERT_EQ(r.nested_share, -EDEADLK);
    ASSERT_UINT_EQ(lshm_storage_nbytes(s), 1000);
    r.s = NULL;
    lshm_storage_release(s);
}

static void test_whole_pages_allocator(void) {
    counts c = {0};
    lshm_allocator a = {pages_alloc, pages_free, &c, LSHM_ALLOCATOR_WHOLE_PAGES};
    void *mem = storage_mem();
    lshm_storage *s;
    ASSERT_OK(lshm_storage_init(mem, 3 * page + 5, &a, 0, &s));
    ASSERT_PTR_EQ(lshm_storage_data(s), c.last_ptr);
    ASSERT_OK(lshm_storage_fini(s));
    ASSERT_EQ(c.frees, 1);
    /* An allocator that breaks its WHOLE_PAGES promise is refused, its block given back. */
    c.misalign = 1;
    ASSERT_ERR(lshm_storage_init(mem, 100, &a, 0, &s), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "page-aligned") != NULL);
    ASSERT_EQ(c.allocs, 2);
    ASSERT_EQ(c.frees, 2);
    free(mem);
}

typedef struct release_log {
    int calls;
    void *data;
    size_t nbytes;
} release_log;

static void log_release(void *ctx, void *data, size_t nbytes) {
    release_log *log = ctx;
    log->calls++;
    log->data = data;
    log->nbytes = nbytes;
}

static void test_foreign(void) {
    char buf[100];
    release_log log = {0};
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create_foreign(buf, sizeof buf, log_release, &log, 0, &s));
    ASSERT_PTR_EQ(lshm_storage_data(s), buf);
    ASSERT_UINT_EQ(lshm_storage_nbytes(s), sizeof buf);
    lshm_storage_retain(s);
    lshm_storage_release(s);
    ASSERT_EQ(log.calls, 0);
    lshm_storage_release(s);
    ASSERT_EQ(log.calls, 1); /* exactly once, with what we gave */
    ASSERT_PTR_EQ(log.data, buf);
    ASSERT_UINT_EQ(log.nbytes, sizeof buf);
    /* borrowed memory (no release callback), in place */
    void *mem = storage_mem();
    ASSERT_OK(lshm_storage_init_foreign(mem, buf, sizeof buf, NULL, NULL, 0, &s));
    ASSERT_OK(lshm_storage_fini(s));
    /* NULL data is fine for zero bytes, an error otherwise */
    ASSERT_OK(lshm_storage_init_foreign(mem, NULL, 0, log_release, &log, 0, &s));
    ASSERT_OK(lshm_storage_fini(s));
    ASSERT_EQ(log.calls, 2);
    ASSERT_ERR(lshm_storage_init_foreign(mem, NULL, 1, NULL, NULL, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_init_foreign(mem, buf, 1, NULL, NULL, 0x80, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_init_foreign(NULL, buf, 1, NULL, NULL, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_create_foreign(buf, 1, NULL, NULL, 0, NULL), -EINVAL);
    free(mem);
}

static void test_bad_input(void) {
    unsigned char *mem = storage_mem();
    memset(mem, 0xab, lshm_storage_sizeof());
    lshm_storage *s = (lshm_storage *)(uintptr_t)0x1; /* must stay untouched */
    lshm_storage *const sentinel = s;
    ASSERT_ERR(lshm_storage_init(NULL, 10, NULL, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_init(mem, 10, NULL, 0, NULL), -EINVAL);
    ASSERT_ERR(lshm_storage_init(mem + 1, 10, NULL, 0, &s), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "aligned") != NULL);
    ASSERT_ERR(lshm_storage_init(mem, 10, NULL, 0x100, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_init(mem, 10, NULL, LSHM_STORAGE_SHARED, &s), -EINVAL);
    ASSERT_ERR(lshm_storage_init(mem, SIZE_MAX, NULL, 0, &s), -EOVERFLOW);
    ASSERT_ERR(lshm_storage_init(mem, SIZE_MAX - page, NULL, 0, &s), -ENOMEM);
    ASSERT_ERR(lshm_storage_create(SIZE_MAX / 2, NULL, 0, &s), -ENOMEM);
    ASSERT_ERR(lshm_storage_create(10, NULL, 0, NULL), -EINVAL);
    ASSERT_PTR_EQ(s, sentinel);
    ASSERT(all_bytes(mem, lshm_storage_sizeof(), 0xab)); /* nothing written on failure */
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_init(mem, 10, NULL, 0, &s));
    ASSERT_ERR(lshm_storage_fd(s, &fd, &off), -ENODATA);
    ASSERT_ERR(lshm_storage_fd(s, NULL, &off), -EINVAL);
    ASSERT_ERR(lshm_storage_fd(NULL, &fd, &off), -EINVAL);
    ASSERT(lshm_storage_segment(s) == NULL);
    ASSERT_OK(lshm_storage_fini(s));
    ASSERT(lshm_storage_data(NULL) == NULL);
    ASSERT_UINT_EQ(lshm_storage_nbytes(NULL), 0);
    ASSERT_EQ(lshm_storage_flags(NULL), 0);
    free(mem);
}

static void test_resize(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(100, NULL, LSHM_STORAGE_RESIZABLE, &s));
    memset(lshm_storage_data(s), 7, 100);
    ASSERT_OK(lshm_storage_resize(s, 10 * page));
    ASSERT_UINT_EQ(lshm_storage_nbytes(s), 10 * page);
    unsigned char *p = lshm_storage_data(s);
    ASSERT(all_bytes(p, 100, 7));
    ASSERT(all_bytes(p + 100, 10 * page - 100, 0));
    ASSERT_OK(lshm_storage_resize(s, 50)); /* shrink inside one page */
    ASSERT(all_bytes(lshm_storage_data(s), 50, 7));
    ASSERT_OK(lshm_storage_resize(s, 100)); /* grow again: bytes 50..100 are new, so zero */
    p = lshm_storage_data(s);
    ASSERT(all_bytes(p, 50, 7));
    ASSERT(all_bytes(p + 50, 50, 0));
    ASSERT_ERR(lshm_storage_resize(s, SIZE_MAX), -EOVERFLOW);
    ASSERT_UINT_EQ(lshm_storage_nbytes(s), 100);
    ASSERT_OK(lshm_storage_resize(s, 0));
    ASSERT(lshm_storage_data(s) == NULL);
    ASSERT_OK(lshm_storage_resize(s, 3));
    ASSERT(all_bytes(lshm_storage_data(s), 3, 0));
    lshm_storage_release(s);

    counts c = {0};
    lshm_allocator a = {count_alloc, count_free, &c, 0};
    ASSERT_OK(lshm_storage_create(10, &a, LSHM_STORAGE_RESIZABLE, &s));
    memset(lshm_storage_data(s), 3, 10);
    ASSERT_OK(lshm_storage_resize(s, 20));
    ASSERT(all_bytes(lshm_storage_data(s), 10, 3));
    ASSERT(all_bytes((char *)lshm_storage_data(s) + 10, 10, 0));
    ASSERT_EQ(c.allocs, 2);
    ASSERT_EQ(c.frees, 1);
    ASSERT_UINT_EQ(c.freed_nbytes, 10);
    lshm_storage_release(s);
    ASSERT_UINT_EQ(c.freed_nbytes, 20);
    ASSERT_EQ(c.frees, 2);

    ASSERT_OK(lshm_storage_create(10, NULL, 0, &s));
    ASSERT_ERR(lshm_storage_resize(s, 20), -EPERM); /* not resizable */
    lshm_storage_release(s);
    char buf[10];
    ASSERT_OK(lshm_storage_create_foreign(buf, 10, NULL, NULL, LSHM_STORAGE_RESIZABLE, &s));
    ASSERT_ERR(lshm_storage_resize(s, 20), -EPERM); /* foreign */
    lshm_storage_release(s);
    ASSERT_ERR(lshm_storage_resize(NULL, 20), -EINVAL);
}

/* From 2 MiB on, default-allocator pages start at a 2 MiB boundary (so that transparent huge
 * pages can back them whole) and stay aligned when a resize grows them; a failure on the way
 * (the aligned range cannot be mapped, the pages cannot move) changes nothing. */
static void test_huge_alignment(void) {
    const size_t huge = (size_t)2 << 20;
    if (!lshm__os_huge_wanted()) { /* LSHM_HUGE=0: the rest of the suite is the small-page one */
        fprintf(stderr, "   (huge pages off: LSHM_HUGE=0)\n");
        return;
    }
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(4 * huge + 100, NULL, 0, &s));
    ASSERT_EQ((uintptr_t)lshm_storage_data(s) % huge, 0);
    ASSERT(all_bytes(lshm_storage_data(s), 4 * huge + 100, 0));
    lshm_storage_release(s);

    int all_maps = count_mappings(NULL, SIZE_MAX, 0);
    ASSERT_OK(lshm_storage_create(3 * page, NULL, LSHM_STORAGE_RESIZABLE, &s));
    memset(lshm_storage_data(s), 9, 3 * page);
    int maps = count_mappings(NULL, SIZE_MAX, 0);
    /* every point of the growth (the move; the aligned range it moves to, unless the pages
     * were aligned already and could grow in place) fails cleanly */
    int points = 0;
    for (int point = 1;; point++) {
        void *before = lshm_storage_data(s);
        lshm__fault_arm(point, -ENOMEM);
        int rc = lshm_storage_resize(s, 3 * huge);
        int hit = lshm__fault_points_hit();
        lshm__fault_arm(0, 0);
        if (hit < point) { /* past every point: the resize went through */
            ASSERT_OK(rc);
            break;
        }
        points++;
        ASSERT_ERR(rc, -ENOMEM);
        ASSERT_PTR_EQ(lshm_storage_data(s), before);
        ASSERT_UINT_EQ(lshm_storage_nbytes(s), 3 * page);
        ASSERT(all_bytes(before, 3 * page, 9));
        ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 0), maps);
    }
    ASSERT_GE(points, 1);
    unsigned char *p = lshm_storage_data(s);
    ASSERT_EQ((uintptr_t)p % huge, 0);
    ASSERT(all_bytes(p, 3 * page, 9));
    ASSERT(all_bytes(p + 3 * page, 3 * huge - 3 * page, 0));
    ASSERT_OK(lshm_storage_resize(s, huge + page)); /* shrinking stays in place */
    ASSERT_PTR_EQ(lshm_storage_data(s), p);
    ASSERT(all_bytes(p, 3 * page, 9));
    /* growing an aligned storage: aligned again, in place when the range after it is free */
    ASSERT_OK(lshm_storage_resize(s, 4 * huge));
    p = lshm_storage_data(s);
    ASSERT_EQ((uintptr_t)p % huge, 0);
    ASSERT(all_bytes(p, 3 * page, 9));
    ASSERT(all_bytes(p + 3 * page, 4 * huge - 3 * page, 0));
    lshm_storage_release(s);
    ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 0), all_maps); /* no placeholder left */
}

/* Resize never frees or moves memory under another reference (issue 9): while the storage is
 * retained (an array over it holds a reference) resize refuses with -EBUSY and changes
 * nothing, for growth past the mapping (mremap would move it), shrinking (would unmap) and
 * caller allocators (a new block); once released, resize works. */
static void test_resize_busy(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(3 * page, NULL, LSHM_STORAGE_RESIZABLE, &s));
    unsigned char *p = lshm_storage_data(s);
    memset(p, 0x6b, 3 * page);
    lshm_storage_retain(s); /* e.g. a numpy array over it */
    size_t sizes[] = {64 * page, page, 0, 3 * page, 3 * page - 1};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        ASSERT_ERR(lshm_storage_resize(s, sizes[i]), -EBUSY);
        ASSERT(strstr(lshm_last_error(), "1 other references") != NULL);
        ASSERT(strstr(lshm_last_error(), "release them first") != NULL);
        ASSERT_PTR_EQ(lshm_storage_data(s), p);
        ASSERT_UINT_EQ(lshm_storage_nbytes(s), 3 * page);
        ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_RESIZABLE);
        ASSERT(all_bytes(p, 3 * page, 0x6b)); /* still mapped, still the same bytes */
    }
    ASSERT_EQ(lshm_storage_refcount(s), 2);
    lshm_storage_release(s);
    ASSERT_OK(lshm_storage_resize(s, 64 * page));
    p = lshm_storage_data(s);
    ASSERT(all_bytes(p, 3 * page, 0x6b));
    ASSERT(all_bytes(p + 3 * page, 61 * page, 0));
    lshm_storage_release(s);

    counts c = {0};
    lshm_allocator a = {count_alloc, count_free, &c, 0};
    ASSERT_OK(lshm_storage_create(10, &a, LSHM_STORAGE_RESIZABLE, &s));
    memset(lshm_storage_data(s), 3, 10);
    void *old = lshm_storage_data(s);
    lshm_storage_retain(s);
    ASSERT_ERR(lshm_storage_resize(s, 20), -EBUSY);
    ASSERT_EQ(c.allocs, 1); /* nothing allocated, nothing freed */
    ASSERT_EQ(c.frees, 0);
    ASSERT_PTR_EQ(lshm_storage_data(s), old);
    ASSERT_UINT_EQ(lshm_storage_nbytes(s), 10);
    lshm_storage_release(s);
    ASSERT_OK(lshm_storage_resize(s, 20));
    ASSERT_EQ(c.frees, 1);
    ASSERT(all_bytes(lshm_storage_data(s), 10, 3));
    lshm_storage_release(s);
}

/* The accessors read a storage from any thread (lshm.h), also while the holder of its one
 * reference resizes it (pyshm: Storage.nbytes on one thread, resize_ of the same handle on
 * another, both without the GIL). Each sees a size the storage had; under ThreadSanitizer
 * this is where a plain nbytes field was a data race. */
typedef struct resize_reader {
    lshm_storage *s;
    _Atomic int started, stop;
    int bad;
} resize_reader;

static void *read_while_resized(void *arg) {
    resize_reader *r = arg;
    atomic_store(&r->started, 1);
    while (!atomic_load(&r->stop)) {
        size_t n = lshm_storage_nbytes(r->s);
        r->bad += n != 1000 && n != 5 * page && n != 0;
        r->bad += (lshm_storage_flags(r->s) & ~LSHM_STORAGE_RESIZABLE) != 0;
        (void)lshm_storage_data(r->s);
    }
    return NULL;
}

static void test_accessors_while_resized(void) {
    resize_reader r = {0};
    ASSERT_OK(lshm_storage_create(1000, NULL, LSHM_STORAGE_RESIZABLE, &r.s));
    pthread_t t;
    ASSERT_OK(pthread_create(&t, NULL, read_while_resized, &r));
    while (!atomic_load(&r.started))
        ;
    const size_t sizes[] = {1000, 0, 5 * page};
    for (int k = 0; k < 300; k++)
        ASSERT_OK(lshm_storage_resize(r.s, sizes[k % 3]));
    atomic_store(&r.stop, 1);
    ASSERT_OK(pthread_join(t, NULL));
    ASSERT_EQ(r.bad, 0);
    lshm_storage_release(r.s);
}

static void test_copy(void) {
    lshm_storage *a, *b, *c;
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &a));
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &b));
    ASSERT_OK(lshm_storage_create(999, NULL, 0, &c));
    memset(lshm_storage_data(a), 9, 1000);
    ASSERT_OK(lshm_storage_copy(b, a));
    ASSERT(all_bytes(lshm_storage_data(b), 1000, 9));
    ASSERT_OK(lshm_storage_copy(a, a));
    ASSERT_ERR(lshm_storage_copy(c, a), -EINVAL);
    ASSERT_ERR(lshm_storage_copy(NULL, a), -EINVAL);
    ASSERT_ERR(lshm_storage_copy(a, NULL), -EINVAL);
    lshm_storage_release(a);
    lshm_storage_release(b);
    lshm_storage_release(c);
}

int main(void) {
    page = lshm_page_size();
    ASSERT_EQ(page, (size_t)sysconf(_SC_PAGESIZE));
    RUN_TEST(test_init_in_caller_buffer);
    RUN_TEST(test_slab_of_many);
    RUN_TEST(test_refcount);
    RUN_TEST(test_heap);
    RUN_TEST(test_caller_allocator);
    RUN_TEST(test_whole_pages_allocator);
    RUN_TEST(test_allocator_calling_back_on_its_storage);
    RUN_TEST(test_foreign);
    RUN_TEST(test_bad_input);
    RUN_TEST(test_resize);
    RUN_TEST(test_huge_alignment);
    RUN_TEST(test_resize_busy);
    RUN_TEST(test_accessors_while_resized);
    RUN_TEST(test_copy);
    return 0;
}
