/*
 * test_share.c -- lshm_storage_share in one process: same address, raw pointers keep
 * aliasing, idempotence, 8 threads at once, WHOLE_PAGES and foreign storages, zero bytes,
 * and failure atomicity (every fault point, and real RLIMIT_NOFILE and RLIMIT_FSIZE limits).
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
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t page;

static void fill(void *p, size_t n, unsigned seed) {
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(i * 31 + seed);
}

static int check(const void *p, size_t n, unsigned seed) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != (unsigned char)(i * 31 + seed))
            return 0;
    return 1;
}

static void assert_sealed_memfd(int fd, uint64_t size) {
    ASSERT_GE(fd, 0);
    ASSERT(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    int seals = fcntl(fd, F_GET_SEALS);
    ASSERT((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW));
    struct stat st;
    ASSERT_OK(fstat(fd, &st));
    ASSERT_UINT_EQ(st.st_size, size);
}

static void test_same_address(void) {
    const size_t n = 3 * page + 100;
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, LSHM_STORAGE_RESIZABLE, &s));
    unsigned char *raw = lshm_storage_data(s); /* a raw pointer taken before the share */
    fill(raw, n, 1);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_PTR_EQ(lshm_storage_data(s), raw);
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_SHARED); /* RESIZABLE cleared */
    ASSERT_ERR(lshm_storage_resize(s, 10), -EPERM);
    ASSERT(check(raw, n, 1));
    ASSERT(lshm_storage_segment(s) == NULL); /* shared in place: its own memfd */
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    ASSERT_UINT_EQ(off, 0);
    assert_sealed_memfd(fd, 4 * page);
    ASSERT_EQ(ftruncate(fd, 0), -1); /* no holder can shrink it under our mapping */
    /* A write through the old pointer is in the memfd ... */
    raw[5] = 0xee;
    unsigned char b = 0;
    ASSERT_EQ(pread(fd, &b, 1, 5), 1);
    ASSERT_EQ(b, 0xee);
    /* ... and a write to the memfd shows through the old pointer and the accessor. */
    b = 0x11;
    ASSERT_EQ(pwrite(fd, &b, 1, n - 1), 1);
    ASSERT_EQ(raw[n - 1], 0x11);
    ASSERT_EQ(((unsigned char *)lshm_storage_data(s))[n - 1], 0x11);
    /* Idempotent: the same fd, nothing copied again. */
    ASSERT_OK(lshm_storage_share(s));
    int fd2;
    ASSERT_OK(lshm_storage_fd(s, &fd2, &off));
    ASSERT_EQ(fd2, fd);
    lshm_storage_release(s);
}

static void test_in_place_struct(void) {
    void *mem = aligned_alloc(lshm_storage_alignof(), lshm_storage_sizeof());
    lshm_storage *s;
    ASSERT_OK(lshm_storage_init(mem, page, NULL, 0, &s));
    fill(lshm_storage_data(s), page, 2);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_EQ(lshm_storage_flags(s), LSHM_STORAGE_SHARED | LSHM_STORAGE_INPLACE);
    ASSERT(check(lshm_storage_data(s), page, 2));
    ASSERT_OK(lshm_storage_fini(s)); /* unmaps and closes the memfd */
    free(mem);
}

static void test_zero_bytes(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(0, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    ASSERT(lshm_storage_data(s) == NULL);
    ASSERT(lshm_storage_flags(s) & LSHM_STORAGE_SHARED);
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    assert_sealed_memfd(fd, 0);
    /* The fd attaches as a zero-byte storage elsewhere. */
    lshm_storage *t;
    ASSERT_OK(lshm_storage_attach(fd, 0, 0, 0, &t));
    ASSERT(lshm_storage_data(t) == NULL);
    ASSERT_UINT_EQ(lshm_storage_nbytes(t), 0);
    lshm_storage_release(t);
    lshm_storage_release(s);
    /* zero-byte foreign memory too */
    ASSERT_OK(lshm_storage_create_foreign(NULL, 0, NULL, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    ASSERT(lshm_storage_data(s) == NULL);
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    assert_sealed_memfd(fd, 0);
    lshm_storage_release(s);
}

typedef struct pages_ctx {
    int allocs, frees;
    void *ptr;
    int shared_fd; /* a dup of the memfd, to prove the freed range is private again */
} pages_ctx;

static void *pages_alloc(void *ctx, size_t nbytes) {
    pages_ctx *c = ctx;
    c->allocs++;
    size_t len = (nbytes + page - 1) / page * page;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT(p != MAP_FAILED);
    return c->ptr = p;
}

static void pages_free(void *ctx, void *ptr, size_t nbytes) {
    pages_ctx *c = ctx;
    c->frees++;
    ASSERT_PTR_EQ(ptr, c->ptr);
    /* The library put private pages back: writing here must not reach the memfd. */
    memset(ptr, 0x77, nbytes);
    unsigned char b = 0;
    ASSERT_EQ(pread(c->shared_fd, &b, 1, 0), 1);
    ASSERT_NE(b, 0x77);
    size_t len = (nbytes + page - 1) / page * page;
    ASSERT_OK(munmap(ptr, len));
}

static void test_whole_pages_allocator(void) {
    pages_ctx c = {0};
    lshm_allocator a = {pages_alloc, pages_free, &c, LSHM_ALLOCATOR_WHOLE_PAGES};
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(2 * page + 1, &a, 0, &s));
    void *raw = lshm_storage_data(s);
    fill(raw, 2 * page + 1, 3);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_PTR_EQ(lshm_storage_data(s), raw); /* in place */
    ASSERT(check(raw, 2 * page + 1, 3));
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    c.shared_fd = dup(fd);
    lshm_storage_release(s);
    ASSERT_EQ(c.allocs, 1);
    ASSERT_EQ(c.frees, 1);
    close(c.shared_fd);
}

typedef struct heap_ctx {
    int frees;
    void *freed;
} heap_ctx;

static void *heap_alloc(void *ctx, size_t nbytes) {
    (void)ctx;
    return malloc(nbytes);
}

static void heap_free(void *ctx, void *ptr, size_t nbytes) {
    heap_ctx *c = ctx;
    c->frees++;
    c->freed = ptr;
    free(ptr);
}

static void test_plain_allocator_swaps(void) {
    heap_ctx c = {0};
    lshm_allocator a = {heap_alloc, heap_free, &c, 0};
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(1000, &a, 0, &s));
    void *old = lshm_storage_data(s);
    fill(old, 1000, 4);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_EQ(c.frees, 1); /* the old block went back at once */
    ASSERT_PTR_EQ(c.freed, old);
    ASSERT(lshm_storage_data(s) != old);
    ASSERT(check(lshm_storage_data(s), 1000, 4));
    lshm_storage_release(s);
    ASSERT_EQ(c.frees, 1); /* and never again */
}

static int release_calls;
static void count_release(void *ctx, void *data, size_t nbytes) {
    (void)nbytes;
    release_calls++;
    free(data);
    ASSERT(ctx == &release_calls);
}

static void test_foreign_swaps(void) {
    release_calls = 0;
    char *buf = malloc(5000);
    fill(buf, 5000, 5);
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create_foreign(buf, 5000, count_release, &release_calls, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_EQ(release_calls, 1);
    ASSERT(lshm_storage_data(s) != buf);
    ASSERT(check(lshm_storage_data(s), 5000, 5));
    ASSERT_OK(lshm_storage_share(s));
    lshm_storage_release(s);
    ASSERT_EQ(release_calls, 1); /* exactly once */
}

/* ---- concurrency --------------------------------------------------------------------------- */

enum { THREADS = 8 };
static pthread_barrier_t barrier;
typedef struct share_job {
    lshm_storage *s;
    int rc, fd;
    char error[256]; /* the thread's message when rc < 0 (last errors are per thread) */
} share_job;

static void *share_thread(void *arg) {
    share_job *job = arg;
    pthread_barrier_wait(&barrier);
    job->rc = lshm_storage_share(job->s);
    uint64_t off;
    if (job->rc == 0)
        job->rc = lshm_storage_fd(job->s, &job->fd, &off);
    if (job->rc < 0)
        snprintf(job->error, sizeof job->error, "%s", lshm_last_error());
    return NULL;
}

/* THREADS threads running fn on jobs[0..THREADS) (each `size` bytes), released together by
 * the barrier, all joined. */
static void run_together(void *(*fn)(void *), void *jobs, size_t size) {
    pthread_t t[THREADS];
    ASSERT_OK(pthread_barrier_init(&barrier, NULL, THREADS));
    for (int i = 0; i < THREADS; i++)
        ASSERT_OK(pthread_create(&t[i], NULL, fn, (char *)jobs + (size_t)i * size));
    for (int i = 0; i < THREADS; i++)
        ASSERT_OK(pthread_join(t[i], NULL));
    pthread_barrier_destroy(&barrier);
}

static void test_concurrent_shares(void) {
    int fds = fd_count();
    for (int round = 0; round < 20; round++) {
        lshm_storage *s;
        size_t n = (size_t)(round + 1) * page * 4;
        ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
        void *raw = lshm_storage_data(s);
        fill(raw, n, (unsigned)round);
        share_job jobs[THREADS];
        for (int i = 0; i < THREADS; i++)
            jobs[i] = (share_job){s, -1, -1, ""};
        run_together(share_thread, jobs, sizeof jobs[0]);
        for (int i = 0; i < THREADS; i++) {
            if (jobs[i].rc != 0)
                fprintf(stderr, "thread %d: %s\n", i, jobs[i].error);
            ASSERT_OK(jobs[i].rc);
            ASSERT_EQ(jobs[i].fd, jobs[0].fd); /* one memfd: copied once */
        }
        ASSERT_EQ(fd_count(), fds + 1);
        ASSERT_PTR_EQ(lshm_storage_data(s), raw);
        ASSERT(check(raw, n, (unsigned)round));
        lshm_storage_release(s);
    }
    ASSERT_EQ(fd_count(), fds);
}

/* Threads handing out the fd of one storage (which seals it with F_SEAL_SEAL), or sealing it
 * read-only, at the same moment: every one succeeds (two F_ADD_SEALS racing used to give the
 * second EPERM, once in about 25 runs of test_concurrent_shares under load). */
typedef struct seal_job {
    lshm_storage *s;
    int readonly, rc;
    char error[256];
} seal_job;

static void *seal_thread(void *arg) {
    seal_job *job = arg;
    int fd;
    uint64_t off;
    pthread_barrier_wait(&barrier);
    job->rc = job->readonly ? lshm_storage_share_readonly(job->s)
                            : lshm_storage_fd(job->s, &fd, &off);
    if (job->rc < 0)
        snprintf(job->error, sizeof job->error, "%s", lshm_last_error());
    return NULL;
}

static void test_concurrent_seals(void) {
    for (int round = 0; round < 200; round++) {
        int readonly = round % 2;
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create((size_t)1 << 17, NULL, 0, &s)); /* (a memfd of its own) */
        if (!readonly)
            ASSERT_OK(lshm_storage_share(s));
        seal_job jobs[THREADS];
        for (int i = 0; i < THREADS; i++)
            jobs[i] = (seal_job){s, readonly, -1, ""};
        run_together(seal_thread, jobs, sizeof jobs[0]);
        for (int i = 0; i < THREADS; i++) {
            if (jobs[i].rc != 0)
                fprintf(stderr, "round %d, thread %d: %s\n", round, i, jobs[i].error);
            ASSERT_OK(jobs[i].rc);
        }
        int fd;
        uint64_t off;
        ASSERT_OK(lshm_storage_fd(s, &fd, &off));
        int seals = fcntl(fd, F_GET_SEALS);
        ASSERT((seals & F_SEAL_SEAL) != 0);
        ASSERT_EQ((seals & F_SEAL_FUTURE_WRITE) != 0, readonly);
        lshm_storage_release(s);
    }
}

/* ---- failure atomicity --------------------------------------------------------------------- */

typedef int (*make_fn)(lshm_storage **s, size_t n);

static int make_pages(lshm_storage **s, size_t n) {
    return lshm_storage_create(n, NULL, LSHM_STORAGE_RESIZABLE, s);
}

static int make_foreign(lshm_storage **s, size_t n) {
    release_calls = 0;
    void *buf = n > 0 ? malloc(n) : NULL; /* count_release frees it (free(NULL) for 0 bytes) */
    return lshm_storage_create_foreign(buf, n, count_release, &release_calls, 0, s);
}

/* Fail each fault point of a share in turn; the storage must come out exactly as it went in
 * and a later share must work. */
static void share_fault_loop(make_fn make, size_t n, int err) {
    lshm_storage *s;
    lshm_pool_trim(); /* a pooled memfd would be taken (and closed on failure): counts differ */
    int all_maps = count_mappings(NULL, SIZE_MAX, 1);
    ASSERT_OK(make(&s, n));
    void *data = lshm_storage_data(s);
    fill(data, n, 9);
    unsigned flags = lshm_storage_flags(s);
    int fds = fd_count();
    int points = 0;
    for (int nth = 1;; nth++) {
        lshm__fault_arm(nth, err);
        int rc = lshm_storage_share(s);
        int hit = lshm__fault_points_hit();
        lshm__fault_arm(0, 0);
        if (hit < nth) { /* ran past every point: this was the successful share */
            ASSERT_OK(rc);
            break;
        }
        points++;
        ASSERT_ERR(rc, err);
        ASSERT(strstr(lshm_last_error(), "injected") != NULL);
        ASSERT_PTR_EQ(lshm_storage_data(s), data);
        ASSERT_EQ(lshm_storage_flags(s), flags);
        ASSERT_EQ(lshm_storage_refcount(s), 1);
        ASSERT_EQ(fd_count(), fds);
        ASSERT(check(lshm_storage_data(s), n, 9));
        int fd;
        uint64_t off;
        ASSERT_ERR(lshm_storage_fd(s, &fd, &off), -ENODATA);
    }
    /* memfd, pwrite, seal, mmap; 0: memfd, seal; split: memfd, ftruncate, seal, copy_thread,
     * pwrite, mmap */
    ASSERT_GE(points, n >= lshm__share_split_threshold ? 6 : n > 0 ? 4 : 2);
    ASSERT(lshm_storage_flags(s) & LSHM_STORAGE_SHARED);
    ASSERT(check(lshm_storage_data(s), n, 9));
    ASSERT_EQ(fd_count(), fds + 1);
    lshm_storage_release(s);
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds - 0);
    /* no temporary mapping left (shared ones are counted: the sanitizers map private memory
     * of their own meanwhile) */
    ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 1), all_maps);
}

static void test_fault_atomicity(void) {
    share_fault_loop(make_pages, 3 * page + 7, -ENOMEM);
    share_fault_loop(make_pages, 3 * page + 7, -ENOSPC);
    share_fault_loop(make_pages, 0, -EMFILE);
    share_fault_loop(make_foreign, 1234, -ENOMEM);
    share_fault_loop(make_foreign, 0, -ENOMEM);
    /* foreign memory of 2 MiB or more moves into huge pages: every step of that fails cleanly */
    share_fault_loop(make_foreign, ((size_t)5 << 20) + 123, -ENOMEM);
}

/* The big path (copy split over two threads), forced at a small size: same bytes, same
 * pointer, sealed fd; and every fault point, including the helper thread's, leaves the storage
 * untouched with no fd or temporary mapping left behind. */
static void test_split_copy(void) {
    if (lshm__os_ncpu() < 2)
        return; /* the split needs a second CPU */
    size_t saved = lshm__share_split_threshold;
    lshm__share_split_threshold = 8 * page;
    for (size_t n = 8 * page; n <= 21 * page + 5; n += 13 * page + 5) {
        unsigned long splits = lshm__share_splits;
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
        unsigned char *raw = lshm_storage_data(s);
        fill(raw, n, 21);
        ASSERT_OK(lshm_storage_share(s));
        ASSERT_EQ(lshm__share_splits, splits + 1);
        ASSERT_PTR_EQ(lshm_storage_data(s), raw);
        ASSERT(check(raw, n, 21));
        int fd;
        uint64_t off;
        ASSERT_OK(lshm_storage_fd(s, &fd, &off));
        size_t cap = (n + page - 1) / page * page;
        assert_sealed_memfd(fd, cap);
        unsigned char b = 0;
        ASSERT_EQ(pread(fd, &b, 1, cap / 2 + 1), 1); /* the helper's half is in the memfd */
        ASSERT_EQ(b, raw[cap / 2 + 1]);
        lshm_storage_release(s);
    }
    /* a foreign storage (not whole pages) takes the split path too */
    unsigned long splits = lshm__share_splits;
    share_fault_loop(make_pages, 13 * page + 7, -ENOMEM);
    share_fault_loop(make_foreign, 11 * page + 3, -ENOSPC);
    ASSERT_GE(lshm__share_splits, splits + 2);
    lshm__share_split_threshold = saved;
}

static int make_fixed_pages(lshm_storage **s, size_t n) {
    return lshm_storage_create(n, NULL, 0, s);
}

static int mappings_over(const void *p, size_t n) {
    return count_mappings(p, n, 0);
}

/* Is every mapping over [p, p + n) private? */
static int mappings_private(const void *p, size_t n) {
    return count_mappings(p, n, 1) == 0;
}

/* After a failed share: a forked child writing to the storage must not change the parent's
 * bytes (the pages are private, copy-on-write, as they were before the call). */
static void assert_private_across_fork(unsigned char *raw, size_t n) {
    unsigned char first = raw[0], last = raw[n - 1];
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        raw[0] = (unsigned char)(first + 1);
        raw[n - 1] = (unsigned char)(last + 1);
        _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ASSERT_EQ(raw[0], first);
    ASSERT_EQ(raw[n - 1], last);
}

/* The length of the mapping that starts at p. */
static size_t mapping_length_at(const void *p) {
    FILE *f = fopen("/proc/self/maps", "r");
    ASSERT(f != NULL);
    uintptr_t a, b, found = 0;
    char line[8192];
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "%lx-%lx", &a, &b) == 2 && a == (uintptr_t)p) {
            found = b;
            break;
        }
    fclose(f);
    ASSERT(found != 0);
    return found - (uintptr_t)p;
}

/* A chunked share of a fresh n-byte storage, failed at fault point nth: the storage is as it
 * was (pointer, flags, bytes, private across fork, writable: bytes 0 and n - 1 are now 7), and
 * `restored` says whether chunks were swapped back. Returns it for the caller to release. */
static lshm_storage *fail_chunked_share_at(int nth, size_t n, int restored) {
    lshm_storage *s;
    ASSERT_OK(make_fixed_pages(&s, n));
    unsigned char *raw = lshm_storage_data(s);
    fill(raw, n, 42);
    unsigned long restores = lshm__share_restores;
    lshm__fault_arm(nth, -ENOSPC);
    int rc = lshm_storage_share(s);
    lshm__fault_arm(0, 0);
    ASSERT_ERR(rc, -ENOSPC);
    ASSERT(strstr(lshm_last_error(), "injected") != NULL);
    ASSERT_PTR_EQ(lshm_storage_data(s), raw);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    ASSERT(check(raw, n, 42));
    ASSERT_EQ(lshm__share_restores, restores + (restored ? 1 : 0));
    ASSERT(mappings_private(raw, n));
    if (restored) { /* the memfd keeps only the chunks swapped back (none prepared ahead) */
        long long kept = lshm__share_failed_memfd_bytes;
        ASSERT(kept >= 0 && (size_t)kept <= mapping_length_at(raw));
    }
    assert_private_across_fork(raw, n);
    raw[0] = 7;
    raw[n - 1] = 7;
    return s;
}

/* The chunked path (non-resizable default pages), forced at a small size with 2-page chunks:
 * same bytes and pointer, one mapping at the end; every fault point (each chunk's pwrite and
 * mmap) leaves bytes, pointer, flags, refcount and fds as they were, the chunks already swapped
 * are private again (across fork too), a retry works, and a storage released right after a
 * failure mid-way leaks nothing. With other shares running, chunks are bigger. */
static void test_chunked(void) {
    size_t saved_threshold = lshm__share_chunk_threshold;
    size_t saved_chunk = lshm__share_chunk_bytes;
    lshm__share_chunk_threshold = 8 * page;
    lshm__share_chunk_bytes = 2 * page + 5; /* rounded down to 2 pages */
    lshm_pool_trim();
    int base = fd_count();
    size_t n = 9 * page + 5;
    lshm_storage *s;
    ASSERT_OK(make_fixed_pages(&s, n));
    unsigned char *raw = lshm_storage_data(s);
    fill(raw, n, 33);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_PTR_EQ(lshm_storage_data(s), raw);
    ASSERT(check(raw, n, 33));
    ASSERT_EQ(mappings_over(raw, 10 * page), 1);
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    assert_sealed_memfd(fd, 10 * page);
    unsigned char b = 0;
    ASSERT_EQ(pread(fd, &b, 1, 7 * page + 3), 1);
    ASSERT_EQ(b, raw[7 * page + 3]);
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base);

    share_fault_loop(make_fixed_pages, n, -ENOMEM);

    /* fail mid-way (points: memfd, ftruncate, seal, the spare mapping, then pwrite and mmap per
     * chunk) */
    for (int nth = 4; nth <= 10; nth++) {
        s = fail_chunked_share_at(nth, n, nth >= 7); /* from 7 on, a chunk was swapped */
        raw = lshm_storage_data(s);
        if (nth == 7) /* failed at chunk 2's pwrite: chunk 1 swapped back privately, rest not */
            ASSERT_EQ(mappings_over(raw, 10 * page), 2);
        ASSERT(mappings_private(raw, 10 * page));
        ASSERT_EQ(fd_count(), base);
        if (nth == 9) { /* a retry shares every byte, the ones written since included */
            ASSERT_OK(lshm_storage_share(s));
            ASSERT_PTR_EQ(lshm_storage_data(s), raw);
            ASSERT_EQ(mappings_over(raw, 10 * page), 1);
            ASSERT(!mappings_private(raw, 10 * page));
            ASSERT_OK(lshm_storage_fd(s, &fd, &off));
            ASSERT_EQ(pread(fd, &b, 1, 0), 1);
            ASSERT_EQ(b, 7);
            ASSERT_EQ(pread(fd, &b, 1, n - 1), 1);
            ASSERT_EQ(b, 7);
        }
        lshm_storage_release(s);
        lshm_pool_trim();
        ASSERT_EQ(fd_count(), base);
    }

    /* with another share running, chunks are lshm__share_chunk_busy_bytes: here 4 pages, so a
     * failure at the second pwrite (point 7) leaves 4 pages swapped back, not 2 */
    size_t saved_busy = lshm__share_chunk_busy_bytes;
    lshm__share_chunk_busy_bytes = 4 * page;
    ASSERT_OK(make_fixed_pages(&s, n));
    raw = lshm_storage_data(s);
    fill(raw, n, 35);
    lshm__share_pretend_busy(1);
    lshm__fault_arm(7, -ENOSPC);
    int rc = lshm_storage_share(s);
    lshm__fault_arm(0, 0);
    lshm__share_pretend_busy(-1);
    ASSERT_ERR(rc, -ENOSPC);
    ASSERT(check(raw, n, 35));
    ASSERT_EQ(mappings_over(raw, 4 * page), 1);
    ASSERT_EQ(mappings_over(raw, 5 * page), 2);
    ASSERT(mappings_private(raw, 10 * page));
    lshm_storage_release(s);
    lshm__share_chunk_busy_bytes = saved_busy;

    /* resizable storages keep the one-mapping path */
    share_fault_loop(make_pages, 9 * page + 5, -ENOMEM);
    lshm__share_chunk_threshold = saved_threshold;
    lshm__share_chunk_bytes = saved_chunk;
    ASSERT_EQ(fd_count(), base);
}

/* The chunked share with huge pages (a storage of 2 MiB or more at a 2 MiB boundary): same
 * bytes and pointer, one shared mapping, the tail short of 2 MiB too; every fault point leaves
 * the storage as it was (no fd, no temporary mapping), and a failure after a chunk was swapped
 * maps it back privately (copy-on-write across fork, still writable). */
static void chunked_huge(void) {
    const size_t huge = (size_t)2 << 20;
    size_t saved_chunk = lshm__share_huge_chunk_bytes;
    lshm__share_huge_chunk_bytes = 2 * huge;
    lshm_pool_trim();
    int base = fd_count();
    size_t n = 5 * huge + 3 * page + 5; /* chunks of 4, 4 and 2 MiB, then a small tail */
    lshm_storage *s;
    ASSERT_OK(make_fixed_pages(&s, n));
    unsigned char *raw = lshm_storage_data(s);
    ASSERT_EQ((uintptr_t)raw % huge, 0);
    fill(raw, n, 41);
    int maps = count_mappings(NULL, SIZE_MAX, 1);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_PTR_EQ(lshm_storage_data(s), raw);
    ASSERT(check(raw, n, 41));
    ASSERT_EQ(mappings_over(raw, n), 1);
    ASSERT(!mappings_private(raw, n));
    /* the storage's own range, now shared; the copy mapping is gone */
    ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 1), maps + 1);
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    unsigned char b = 0;
    ASSERT_EQ(pread(fd, &b, 1, n - 1), 1);
    ASSERT_EQ(b, raw[n - 1]);
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base);

    /* (ENOSPC: an ENOMEM at the copy mapping is no failure, see below) */
    share_fault_loop(make_fixed_pages, n, -ENOSPC);

    /* points: memfd, ftruncate, seal, the spare mapping, reserve, mmap (the copy), then per
     * 4 MiB chunk populate and mmap, then the tail's pwrite and mmap: a failure at 9 (the
     * second populate) leaves the first chunk swapped back privately; no fd and no mapping is
     * left either way */
    for (int nth = 4; nth <= 12; nth++) {
        if (nth == 5 || nth == 6)
            continue; /* (ENOMEM there is no failure: below) */
        int all_maps = count_mappings(NULL, SIZE_MAX, 1);
        lshm_storage_release(fail_chunked_share_at(nth, n, nth >= 9));
        lshm_pool_trim();
        ASSERT_EQ(fd_count(), base);
        ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 1), all_maps);
    }

    /* no room for the copy mapping (address space, vm.max_map_count: ENOMEM at its placeholder
     * or at the mmap): shared all the same, with small pages */
    for (int nth = 5; nth <= 6; nth++) {
        ASSERT_OK(make_fixed_pages(&s, n));
        raw = lshm_storage_data(s);
        fill(raw, n, 43);
        lshm__fault_arm(nth, -ENOMEM);
        int rc = lshm_storage_share(s);
        lshm__fault_arm(0, 0);
        ASSERT_OK(rc);
        ASSERT_PTR_EQ(lshm_storage_data(s), raw);
        ASSERT(check(raw, n, 43));
        ASSERT_EQ(mappings_over(raw, n), 1);
        ASSERT(!mappings_private(raw, n));
        lshm_storage_release(s);
        lshm_pool_trim();
        ASSERT_EQ(fd_count(), base);
    }
    lshm__share_huge_chunk_bytes = saved_chunk;
}

/* The helper thread's own failure (at its second chunk; faults armed here stay on this thread):
 * the share fails with its message, the first chunk is swapped back privately, and nothing is
 * left behind. */
static void chunked_huge_helper_fails(void) {
    const size_t huge = (size_t)2 << 20;
    size_t saved_chunk = lshm__share_huge_chunk_bytes;
    lshm__share_huge_chunk_bytes = 2 * huge;
    int base = fd_count(), all_maps = count_mappings(NULL, SIZE_MAX, 1);
    size_t n = 5 * huge + 3 * page + 5;
    lshm_storage *s;
    ASSERT_OK(make_fixed_pages(&s, n));
    unsigned char *raw = lshm_storage_data(s);
    fill(raw, n, 44);
    unsigned long restores = lshm__share_restores;
    lshm__share_helper_fails_at = 2;
    int rc = lshm_storage_share(s);
    lshm__share_helper_fails_at = 0;
    ASSERT_ERR(rc, -ENOMEM);
    ASSERT(strstr(lshm_last_error(), "helper: injected") != NULL);
    ASSERT_PTR_EQ(lshm_storage_data(s), raw);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    ASSERT(check(raw, n, 44));
    ASSERT_EQ(lshm__share_restores, restores + 1);
    ASSERT(mappings_private(raw, n));
    assert_private_across_fork(raw, n);
    ASSERT_OK(lshm_storage_share(s)); /* a retry works */
    ASSERT(check(raw, n, 44));
    lshm_storage_release(s);
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), base);
    ASSERT_EQ(count_mappings(NULL, SIZE_MAX, 1), all_maps);
    lshm__share_huge_chunk_bytes = saved_chunk;
}

/* THP disabled for the process (prctl(PR_SET_THP_DISABLE), in a child): the first chunk's
 * refused collapse switches the rest of the share to small pages filled with pwrite (faster
 * than populating them through the copy mapping), and later shares go that way at once; every
 * byte and the address are kept either way. Alone and with the helper thread. */
static void huge_refused_for_good(void) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        const size_t huge = (size_t)2 << 20;
        lshm__share_huge_chunk_bytes = 2 * huge;
        ASSERT_OK(prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0));
        for (int round = 0; round < 2; round++) {
            size_t n = 7 * huge + 3 * page + 5;
            lshm_storage *s;
            ASSERT_OK(make_fixed_pages(&s, n));
            unsigned char *raw = lshm_storage_data(s);
            fill(raw, n, 46 + round);
            unsigned long chunks = lshm__share_huge_chunks;
            ASSERT_OK(lshm_storage_share(s));
            ASSERT_EQ(lshm__share_huge_chunks - chunks, round == 0 ? 1u : 0u);
            ASSERT_PTR_EQ(lshm_storage_data(s), raw);
            ASSERT(check(raw, n, 46 + round));
            ASSERT_EQ(mappings_over(raw, n), 1);
            ASSERT(!mappings_private(raw, n));
            lshm_storage_release(s);
        }
        _exit(0);
    }
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* ShmemPmdMapped (kB) of the mapping holding p, from /proc/self/smaps; -1 if none holds it. */
static long pmd_mapped_kib(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    ASSERT(f != NULL);
    char line[512];
    int inside = 0;
    long kib = -1;
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long lo, hi;
        long value;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, ':') > strchr(line, ' '))
            inside = lo <= (uintptr_t)p && (uintptr_t)p < hi;
        else if (inside && sscanf(line, "ShmemPmdMapped: %ld kB", &value) == 1)
            kib = value;
    }
    fclose(f);
    return kib;
}

/* Memory that moves when shared (foreign), of 2 MiB or more: it lands at a 2 MiB boundary with
 * its whole 2 MiB ranges in huge pages of the memfd (smaps: ShmemPmdMapped after a read of
 * each), the bytes intact; smaller memory moves as before. */
static void test_foreign_moves_into_huge_pages(void) {
    const size_t huge = (size_t)2 << 20;
    size_t n = 3 * huge + 4 * page + 9;
    lshm_storage *s;
    ASSERT_OK(make_foreign(&s, n));
    fill(lshm_storage_data(s), n, 47);
    ASSERT_OK(lshm_storage_share(s));
    unsigned char *data = lshm_storage_data(s);
    if (lshm__os_huge_wanted()) /* (LSHM_HUGE=0: anywhere, in small pages) */
        ASSERT_EQ((uintptr_t)data % huge, 0);
    ASSERT(check(data, n, 47));
    unsigned long sum = 0;
    for (size_t off = 0; off < n; off += page)
        sum += data[off];
    (void)sum;
    ASSERT_EQ(pmd_mapped_kib(data), lshm__os_collapse_wanted() ? 3 * (huge >> 10) : 0);
    lshm_storage_release(s);
}

/* Both ways: on this thread alone, and (a big share running alone, forced here at a small
 * size) with the next chunk prepared on a helper thread while this one copies; the fault
 * points are the same (the helper's populate is taken on this thread). */
static void test_chunked_huge(void) {
    /* LSHM_HUGE=0, or THP disabled for this process (inherited from who started it): no huge
     * pages to test (test_chunked is the small-page way; huge_refused_for_good the refusal) */
    if (!lshm__os_huge_wanted() || prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1) {
        fprintf(stderr, "   (huge pages off: LSHM_HUGE=0 or PR_SET_THP_DISABLE)\n");
        return;
    }
    chunked_huge();
    huge_refused_for_good();
    if (lshm__os_ncpu() < 2)
        return;
    size_t saved = lshm__share_split_threshold;
    unsigned long splits = lshm__share_splits;
    lshm__share_split_threshold = page;
    chunked_huge();
    chunked_huge_helper_fails();
    huge_refused_for_good();
    lshm__share_split_threshold = saved;
    ASSERT_GE(lshm__share_splits, splits + 1); /* the helper did run */
}

/* Where the huge-page share has no room for its second mapping of the memfd (the address space
 * limit leaves less than the storage's size), it shares with small pages instead: in a child
 * with RLIMIT_AS at what it uses plus 8 MiB, a 64 MiB storage still shares, bytes intact. */
static void test_huge_share_under_rlimit_as(void) {
#if defined(__SANITIZE_ADDRESS__)
    return; /* (AddressSanitizer's shadow memory does not live with a tight RLIMIT_AS) */
#endif
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        size_t n = (size_t)64 << 20;
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
        unsigned char *raw = lshm_storage_data(s);
        fill(raw, n, 45);
        FILE *f = fopen("/proc/self/statm", "r");
        unsigned long pages_used = 0;
        ASSERT(f != NULL && fscanf(f, "%lu", &pages_used) == 1);
        fclose(f);
        struct rlimit lim = {pages_used * page + ((size_t)8 << 20),
                             pages_used * page + ((size_t)8 << 20)};
        ASSERT_OK(setrlimit(RLIMIT_AS, &lim));
        ASSERT_OK(lshm_storage_share(s));
        ASSERT_PTR_EQ(lshm_storage_data(s), raw);
        ASSERT(check(raw, n, 45));
        ASSERT_EQ(mappings_over(raw, n), 1);
        _exit(0);
    }
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void test_rlimit_nofile(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    void *data = lshm_storage_data(s);
    fill(data, page, 11);
    int fds = fd_count();
    struct rlimit saved, low;
    ASSERT_OK(getrlimit(RLIMIT_NOFILE, &saved));
    int lowest_free = dup(0);
    ASSERT_GE(lowest_free, 0);
    close(lowest_free);
    low = saved;
    low.rlim_cur = (rlim_t)lowest_free; /* the next fd would be at the limit */
    ASSERT_OK(setrlimit(RLIMIT_NOFILE, &low));
    int rc = lshm_storage_share(s);
    ASSERT_OK(setrlimit(RLIMIT_NOFILE, &saved));
    ASSERT_ERR(rc, -EMFILE);
    ASSERT(strstr(lshm_last_error(), "memfd_create") != NULL);
    ASSERT_PTR_EQ(lshm_storage_data(s), data);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    ASSERT(check(data, page, 11));
    ASSERT_EQ(fd_count(), fds);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT(check(data, page, 11));
    lshm_storage_release(s);
}

/* The child `pid` ended with _exit(0), not killed by a signal (SIGXFSZ: 25). */
static void child_exited_well(pid_t pid) {
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status))
        TEST_FAIL("the child was killed by signal %d", WTERMSIG(status));
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* RLIMIT_FSIZE holds for memfds too, and a write or ftruncate past it does not just fail: the
 * kernel sends SIGXFSZ first, whose default action kills the process. So every share that would
 * go past it must be -EFBIG, the storage as it was: a memfd sized past it (chunked, a storage
 * created shared), one filled with pwrite (a resizable storage), a pooled one made while the
 * limit was higher; a slab's memfd made then refuses too, but only once SIGXFSZ is ignored (see
 * below). In a child, with SIGXFSZ at its default until then. */
static void test_rlimit_fsize(void) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_DFL);
        const size_t big = (size_t)4 << 20, pooled = 32 * page; /* (above the slabs) */
        lshm_storage *s, *t, *slab[40];
        for (int i = 0; i < 40; i++) {
            ASSERT_OK(lshm_storage_create(page, NULL, 0, &slab[i]));
            fill(lshm_storage_data(slab[i]), page, (unsigned)i);
        }
        ASSERT_OK(lshm_storage_share(slab[0])); /* the slab's memfd, made without a limit */
        ASSERT_OK(lshm_storage_create(pooled, NULL, 0, &t));
        ASSERT_OK(lshm_storage_share(t));
        lshm_storage_release(t); /* its memfd goes to the pool */
        struct rlimit lim = {(rlim_t)8 * page, (rlim_t)8 * page};
        ASSERT_OK(setrlimit(RLIMIT_FSIZE, &lim));
        for (int resizable = 0; resizable < 2; resizable++) {
            ASSERT_OK(lshm_storage_create(big, NULL, resizable ? LSHM_STORAGE_RESIZABLE : 0, &s));
            void *data = lshm_storage_data(s);
            fill(data, big, 50);
            ASSERT_ERR(lshm_storage_share(s), -EFBIG);
            ASSERT(strstr(lshm_last_error(), "RLIMIT_FSIZE") != NULL);
            ASSERT_PTR_EQ(lshm_storage_data(s), data);
            ASSERT_EQ(lshm_storage_flags(s), resizable ? LSHM_STORAGE_RESIZABLE : 0);
            ASSERT(check(data, big, 50));
            lshm_storage_release(s);
        }
        ASSERT_ERR(lshm_storage_create_shared(big, 0, &s), -EFBIG);
        ASSERT_OK(lshm_storage_create(pooled, NULL, 0, &t));
        fill(lshm_storage_data(t), pooled, 51);
        ASSERT_ERR(lshm_storage_share(t), -EFBIG); /* (the pooled memfd, refilled) */
        ASSERT_EQ(lshm_storage_flags(t), 0);
        ASSERT(check(lshm_storage_data(t), pooled, 51));
        /* A slab's memfd, sized before the limit came down, is written without reading the
         * limit at each share (lshm__os_pwrite_inside: it would cost 5% of a 4 KiB share), so
         * there, as for the program's own files, the kernel's SIGXFSZ comes first: ignored
         * here, each share past the limit is refused with the storage unchanged (in a slab of
         * the parent's, each gets a memfd of its own instead: a page, which fits). */
        signal(SIGXFSZ, SIG_IGN);
        for (int i = 1; i < 40; i++) {
            int rc = lshm_storage_share(slab[i]);
            ASSERT(rc == 0 || rc == -EFBIG);
            ASSERT_EQ(lshm_storage_flags(slab[i]), rc == 0 ? LSHM_STORAGE_SHARED : 0);
            ASSERT(check(lshm_storage_data(slab[i]), page, (unsigned)i));
        }
        _exit(0);
    }
    child_exited_well(pid);
}

/* RLIMIT_FSIZE lowered (by another thread, here by the share's own step between two chunks)
 * while a chunked share runs: the next chunk's pwrite starts at or past the limit, where the
 * kernel sends SIGXFSZ. That killed the process (a chunked share checked the limit once, when
 * it sized the memfd); now it is -EFBIG, the storage as it was, no fd left. */
static void lower_file_size_limit(size_t swapped) {
    struct rlimit lim = {(rlim_t)swapped, (rlim_t)swapped};
    ASSERT_OK(setrlimit(RLIMIT_FSIZE, &lim));
    lshm__share_after_chunk = NULL;
}

static void test_rlimit_fsize_lowered_mid_share(void) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_DFL);
        const size_t size = (size_t)3 << 19; /* 1.5 MiB: chunked (not huge), 6 chunks */
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(size, NULL, 0, &s));
        void *data = lshm_storage_data(s);
        fill(data, size, 60);
        int fds = fd_count();
        unsigned long restores = lshm__share_restores;
        lshm__share_after_chunk = lower_file_size_limit;
        ASSERT_ERR(lshm_storage_share(s), -EFBIG);
        ASSERT(lshm__share_after_chunk == NULL); /* (lowered after the first chunk) */
        ASSERT(strstr(lshm_last_error(), "RLIMIT_FSIZE") != NULL);
        ASSERT_UINT_EQ(lshm__share_restores, restores + 1);
        ASSERT_PTR_EQ(lshm_storage_data(s), data);
        ASSERT_EQ(lshm_storage_flags(s), 0);
        ASSERT(check(data, size, 60));
        ASSERT_EQ(fd_count(), fds);
        sigset_t pending;
        ASSERT_OK(sigpending(&pending));
        ASSERT(!sigismember(&pending, SIGXFSZ));
        struct rlimit none = {RLIM_INFINITY, RLIM_INFINITY};
        if (setrlimit(RLIMIT_FSIZE, &none) == 0) /* (raising the hard limit needs privilege) */
            ASSERT_OK(lshm_storage_share(s));
        lshm_storage_release(s);
        _exit(0);
    }
    child_exited_well(pid);
}

static void test_large(void) {
    const size_t n = (64u << 20) + 3;
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
    unsigned char *p = lshm_storage_data(s);
    for (size_t i = 0; i < n; i += 4093)
        p[i] = (unsigned char)(i >> 12);
    p[n - 1] = 0xfe;
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_PTR_EQ(lshm_storage_data(s), p);
    for (size_t i = 0; i < n; i += 4093)
        ASSERT_EQ(p[i], (unsigned char)(i >> 12));
    ASSERT_EQ(p[n - 1], 0xfe);
    lshm_storage_release(s);
}

static void test_copy_between_shared(void) {
    lshm_storage *a, *b;
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &a));
    ASSERT_OK(lshm_storage_create_shared(1000, 0, &b));
    fill(lshm_storage_data(a), 1000, 12);
    ASSERT_OK(lshm_storage_share(a));
    ASSERT_OK(lshm_storage_copy(b, a));
    ASSERT(check(lshm_storage_data(b), 1000, 12));
    ASSERT_OK(lshm_storage_share(b)); /* already shared: a no-op */
    lshm_storage_release(a);
    lshm_storage_release(b);
    ASSERT_ERR(lshm_storage_share(NULL), -EINVAL);
}

/* seal_readonly: the owner keeps writing; new mappings of the fd are read-only; views seal
 * their segment; unshared storages and NULL are refused. */
static void test_seal_readonly(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(2 * page, NULL, 0, &s));
    ASSERT_ERR(lshm_storage_seal_readonly(s), -ENODATA);
    ASSERT_ERR(lshm_storage_seal_readonly(NULL), -EINVAL);
    fill(lshm_storage_data(s), 2 * page, 3);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_OK(lshm_storage_seal_readonly(s));
    ASSERT_OK(lshm_storage_seal_readonly(s)); /* idempotent */
    int fd;
    uint64_t offset;
    ASSERT_OK(lshm_storage_fd(s, &fd, &offset));
    ASSERT(fcntl(fd, F_GET_SEALS) & F_SEAL_FUTURE_WRITE);
    unsigned char *owner = lshm_storage_data(s);
    owner[0] = 0xEE; /* the owner's mapping still writes */
    ASSERT(mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED);
    ASSERT_EQ(errno, EPERM);
    ASSERT_EQ(pwrite(fd, "x", 1, 0), -1);
    lshm_storage *reader;
    ASSERT_ERR(lshm_storage_attach(fd, 0, 2 * page, 0, &reader), -EPERM);
    ASSERT_OK(lshm_storage_attach(fd, 0, 2 * page, LSHM_STORAGE_READONLY, &reader));
    ASSERT_EQ(((unsigned char *)lshm_storage_data(reader))[0], 0xEE);
    ASSERT(lshm_storage_flags(reader) & LSHM_STORAGE_READONLY);
    lshm_storage_release(reader);
    lshm_storage_release(s);

    /* a view seals its segment */
    lshm_segment *seg;
    lshm_storage *view;
    ASSERT_OK(lshm_segment_create(4 * page, 0, &seg));
    ASSERT_OK(lshm_storage_create_view(seg, page, page, 0, &view));
    ASSERT_OK(lshm_storage_seal_readonly(view));
    ASSERT(fcntl(segment_fd(seg), F_GET_SEALS) & F_SEAL_FUTURE_WRITE);
    lshm_storage_release(view);
    lshm_segment_release(seg);
}

/* ---- sharing never silently stops aliasing (issue 9) ---------------------------------------- */

/* A storage that does not own whole pages moves when shared: with other references (an array
 * over the old memory) that would leave them on memory the storage no longer uses (and that
 * was given back), so the share is refused with -EBUSY and nothing changes. With the caller's
 * reference only it moves as before. Storages that own whole pages share in place whatever
 * their references. */
static void test_share_refused_while_moving(void) {
    int fds = fd_count();
    release_calls = 0;
    char *buf = malloc(5000);
    fill(buf, 5000, 21);
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create_foreign(buf, 5000, count_release, &release_calls, 0, &s));
    lshm_storage_retain(s);
    ASSERT_ERR(lshm_storage_share(s), -EBUSY);
    const char *msg = lshm_last_error();
    ASSERT(strstr(msg, "not whole pages it owns") != NULL);
    ASSERT(strstr(msg, "its 1 other references") != NULL);
    ASSERT(strstr(msg, "copy it into a shared storage instead") != NULL);
    ASSERT_PTR_EQ(lshm_storage_data(s), buf);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    ASSERT_EQ(lshm_storage_refcount(s), 2);
    ASSERT_EQ(release_calls, 0);
    ASSERT(check(buf, 5000, 21));
    ASSERT_EQ(fd_count(), fds);
    int fd;
    uint64_t off;
    ASSERT_ERR(lshm_storage_fd(s, &fd, &off), -ENODATA);
    lshm_storage_retain(s); /* three references: still refused */
    ASSERT_ERR(lshm_storage_share(s), -EBUSY);
    ASSERT(strstr(lshm_last_error(), "its 2 other references") != NULL);
    lshm_storage_release(s);
    lshm_storage_release(s);
    ASSERT_OK(lshm_storage_share(s)); /* the caller's reference alone: moves as before */
    ASSERT_EQ(release_calls, 1);
    ASSERT(check(lshm_storage_data(s), 5000, 21));
    lshm_storage_release(s);

    /* a plain caller allocator: the same */
    heap_ctx c = {0};
    lshm_allocator a = {heap_alloc, heap_free, &c, 0};
    ASSERT_OK(lshm_storage_create(1000, &a, 0, &s));
    void *old = lshm_storage_data(s);
    fill(old, 1000, 22);
    lshm_storage_retain(s);
    ASSERT_ERR(lshm_storage_share(s), -EBUSY);
    ASSERT_EQ(c.frees, 0);
    ASSERT_PTR_EQ(lshm_storage_data(s), old);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    lshm_storage_release(s);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_EQ(c.frees, 1);
    lshm_storage_release(s);

    /* default pages: in place, so other references keep aliasing */
    ASSERT_OK(lshm_storage_create(3000, NULL, 0, &s));
    unsigned char *raw = lshm_storage_data(s);
    lshm_storage_retain(s);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_PTR_EQ(lshm_storage_data(s), raw);
    lshm_storage_release(s);
    lshm_storage_release(s);

    /* a slot of a private arena wraps the arena's buffer: with an array alive (a second
     * reference) its share is refused instead of leaving the array on the arena buffer */
    uint64_t sizes[] = {page, page};
    int64_t firsts[] = {0, 0}, lasts[] = {1, 1};
    lshm_arena *ar;
    ASSERT_OK(lshm_arena_create(2, sizes, firsts, lasts, NULL, 0, &ar));
    ASSERT_OK(lshm_arena_allocate(ar));
    lshm_storage *slot;
    ASSERT_OK(lshm_arena_storage(ar, 0, &slot));
    void *slot_data = lshm_storage_data(slot);
    lshm_storage_retain(slot);
    ASSERT_ERR(lshm_storage_share(slot), -EBUSY);
    ASSERT_PTR_EQ(lshm_storage_data(slot), slot_data);
    ASSERT_EQ(lshm_storage_flags(slot) & LSHM_STORAGE_SHARED, 0);
    lshm_storage_release(slot);
    ASSERT_OK(lshm_arena_destroy(ar));
    lshm_pool_trim(); /* the default-pages storage's memfd went to the pool */
    ASSERT_EQ(fd_count(), fds);
}

/* ---- seals (issue 9) ------------------------------------------------------------------------ */

static int seals_of(int fd) {
    int seals = fcntl(fd, F_GET_SEALS);
    ASSERT_GE(seals, 0);
    return seals;
}

/* A holder of a dup of fd cannot add F_SEAL_FUTURE_WRITE (nor any seal). */
static void assert_seals_closed(int fd) {
    ASSERT(seals_of(fd) & F_SEAL_SEAL);
    int d = dup(fd);
    ASSERT_GE(d, 0);
    ASSERT_EQ(fcntl(d, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1);
    ASSERT_EQ(errno, EPERM);
    ASSERT_EQ(seals_of(d) & F_SEAL_FUTURE_WRITE, 0);
    close(d);
}

/* Once an fd was handed out writable, its holders cannot add seals, and seal_readonly refuses
 * with -EPERM changing nothing. */
static void test_fd_handed_out_writable(void) {
    int fds = fd_count();
    int fd;
    uint64_t off;
    /* shared in place */
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(2 * page, NULL, 0, &s));
    fill(lshm_storage_data(s), 2 * page, 41);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT_EQ(seals_of(s->fd) & F_SEAL_SEAL, 0); /* not handed out yet */
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    assert_seals_closed(fd);
    unsigned flags = lshm_storage_flags(s);
    ASSERT_ERR(lshm_storage_seal_readonly(s), -EPERM);
    ASSERT(strstr(lshm_last_error(), "already handed out writable") != NULL);
    ASSERT(strstr(lshm_last_error(), "make a copy to share read-only") != NULL);
    ASSERT_EQ(lshm_storage_flags(s), flags);
    ASSERT_EQ(seals_of(fd) & F_SEAL_FUTURE_WRITE, 0);
    lshm_storage *t; /* receivers still get writable memory */
    ASSERT_OK(lshm_storage_attach(fd, 0, 2 * page, 0, &t));
    ((unsigned char *)lshm_storage_data(t))[0] = 0x99;
    ASSERT_EQ(((unsigned char *)lshm_storage_data(s))[0], 0x99);
    /* the attached storage hands out the same (already closed) fd again */
    int tfd;
    ASSERT_OK(lshm_storage_fd(t, &tfd, &off));
    assert_seals_closed(tfd);
    ASSERT_ERR(lshm_storage_seal_readonly(t), -EPERM);
    lshm_storage_release(t);
    lshm_storage_release(s);

    /* an fd received from an older sender, without F_SEAL_SEAL: still accepted, and closed
     * when this process hands it out */
    int raw = memfd_create("old-sender", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(raw, 0);
    ASSERT_OK(ftruncate(raw, page));
    ASSERT_OK(fcntl(raw, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW));
    ASSERT_OK(lshm_storage_attach(raw, 0, page, 0, &t));
    ASSERT_EQ(seals_of(raw) & F_SEAL_SEAL, 0);
    ASSERT_OK(lshm_storage_fd(t, &tfd, &off));
    assert_seals_closed(raw);
    lshm_storage_release(t);
    close(raw);

    /* a segment view (lshm_storage_create_shared) and the segment itself */
    ASSERT_OK(lshm_storage_create_shared(page, 0, &s));
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    assert_seals_closed(fd);
    ASSERT_ERR(lshm_storage_seal_readonly(s), -EPERM);
    ASSERT(strstr(lshm_last_error(), "already handed out writable") != NULL);
    ASSERT_ERR(lshm_segment_seal_readonly(lshm_storage_segment(s)), -EPERM);
    ASSERT_EQ(seals_of(fd) & F_SEAL_FUTURE_WRITE, 0);
    lshm_storage_release(s);

    /* a shared arena's fd */
    uint64_t sizes[] = {page};
    int64_t firsts[] = {0}, lasts[] = {1};
    lshm_arena *ar;
    ASSERT_OK(lshm_arena_create(1, sizes, firsts, lasts, NULL, LSHM_ARENA_SHARED, &ar));
    ASSERT_OK(lshm_arena_allocate(ar));
    ASSERT_OK(lshm_arena_fd(ar, &fd));
    assert_seals_closed(fd);
    ASSERT_OK(lshm_arena_destroy(ar));
    ASSERT_EQ(fd_count(), fds);
}

/* seal_readonly before any export works for storages of any size that own their memfd, adds
 * F_SEAL_FUTURE_WRITE and F_SEAL_SEAL together, and receivers can then only attach read-only.
 * A refused seal_readonly marks nothing exported (the memfd may still be pooled). */
static void test_seal_readonly_sizes(void) {
    lshm_pool_trim();
    int fds = fd_count();
    size_t sizes[] = {1000, 100000, 3 * page, 2 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
        fill(lshm_storage_data(s), n, (unsigned)i);
        ASSERT_OK(lshm_storage_share(s));
        ASSERT_OK(lshm_storage_seal_readonly(s));
        ASSERT_OK(lshm_storage_seal_readonly(s)); /* idempotent */
        int fd;
        uint64_t off;
        ASSERT_OK(lshm_storage_fd(s, &fd, &off)); /* handing it out after sealing is fine */
        ASSERT_EQ(seals_of(fd) & (F_SEAL_FUTURE_WRITE | F_SEAL_SEAL),
                  F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
        lshm_storage *t = NULL;
        ASSERT_ERR(lshm_storage_attach(fd, 0, n, 0, &t), -EPERM);
        ASSERT(t == NULL);
        ASSERT_OK(lshm_storage_attach(fd, 0, n, LSHM_STORAGE_READONLY, &t));
        ASSERT(check(lshm_storage_data(t), n, (unsigned)i));
        lshm_storage_release(t);
        lshm_storage_release(s);
        ASSERT_EQ(lshm_pool_trim(), 0); /* sealed: never pooled */
    }
    /* a refused seal (here an injected failure) changes nothing: no seal, not exported */
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(1000, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    lshm__fault_arm(1, -EPERM);
    int rc = lshm_storage_seal_readonly(s);
    lshm__fault_arm(0, 0);
    ASSERT_ERR(rc, -EPERM);
    ASSERT_EQ(atomic_load(&s->exported), 0);
    ASSERT_EQ(seals_of(s->fd) & (F_SEAL_FUTURE_WRITE | F_SEAL_SEAL), 0);
    lshm_storage_release(s);
    ASSERT_EQ(lshm_pool_trim(), lshm__pool_limit > 0 ? 1 : 0); /* it was pooled */
    ASSERT_EQ(fd_count(), fds);
}

/* ---- the pool of recycled memfds ---------------------------------------------------------- */

static int is_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != 0)
            return 0;
    return 1;
}

static lshm_storage *shared_storage(size_t n, unsigned seed) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
    fill(lshm_storage_data(s), n, seed);
    ASSERT_OK(lshm_storage_share(s));
    ASSERT(check(lshm_storage_data(s), n, seed));
    return s;
}

static void test_pool(void) {
    lshm_pool_trim();
    int base = fd_count();
    /* a released memfd is kept ... */
    lshm_storage *s = shared_storage(3 * page + 100, 1);
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base + 1);
    /* ... and reused by the next share of the same capacity, with no stale bytes: nbytes
     * smaller than before, the tail up to the page end is the new storage's zeros. */
    const size_t n = 3 * page + 50;
    s = shared_storage(n, 2);
    ASSERT_EQ(fd_count(), base + 1); /* the pooled memfd, not a new one */
    unsigned char *raw = lshm_storage_data(s);
    ASSERT(is_zero(raw + n, 4 * page - n));
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base + 1);
    /* another capacity makes a new memfd */
    s = shared_storage(page, 3);
    ASSERT_EQ(fd_count(), base + 2);
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base + 2);
    ASSERT_EQ(lshm_pool_trim(), 2);
    ASSERT_EQ(fd_count(), base);

    /* never pooled: exported fd, read-only seal, a fork since the share */
    s = shared_storage(5 * page, 4);
    int fd;
    uint64_t off;
    ASSERT_OK(lshm_storage_fd(s, &fd, &off));
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base);
    s = shared_storage(5 * page, 5);
    ASSERT_OK(lshm_storage_seal_readonly(s));
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base);
    s = shared_storage(5 * page, 6);
    lshm_storage *kept = shared_storage(7 * page, 7);
    lshm_storage_release(kept); /* pooled before the fork */
    ASSERT_EQ(fd_count(), base + 2);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0)
        _exit(fd_count() == base + 1 ? 0 : 1); /* the child's pool was emptied too */
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ASSERT_EQ(fd_count(), base + 1); /* the fork emptied the pool */
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base); /* shared before the fork: closed */
    /* a share after the fork pools again */
    s = shared_storage(5 * page, 8);
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base + 1);
    ASSERT_EQ(lshm_pool_trim(), 1);

    /* bounds: at most 256 entries ... */
    enum { MANY = 300 };
    lshm_storage *many[MANY];
    for (int i = 0; i < MANY; i++)
        many[i] = shared_storage(page, (unsigned)i);
    for (int i = 0; i < MANY; i++)
        lshm_storage_release(many[i]);
    ASSERT_EQ(fd_count(), base + 256);
    ASSERT_EQ(lshm_pool_trim(), 256);
    ASSERT_EQ(fd_count(), base);
    /* ... and at most lshm__pool_limit bytes; 0 disables the pool */
    size_t saved = lshm__pool_limit;
    lshm__pool_limit = 3 * page;
    for (int i = 0; i < 4; i++)
        many[i] = shared_storage(page, (unsigned)i);
    for (int i = 0; i < 4; i++)
        lshm_storage_release(many[i]);
    ASSERT_EQ(fd_count(), base + 3);
    lshm__pool_limit = 0;
    s = shared_storage(2 * page, 9);
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), base + 3);
    ASSERT_EQ(lshm_pool_trim(), 3);
    lshm__pool_limit = saved;
    ASSERT_EQ(fd_count(), base);
}

/* A failure while refilling a pooled memfd leaves the storage untouched and closes that memfd
 * (it may hold part of the new bytes); the next share works. */
/* The pool holds only the sizes whose refill beats a fresh share: below the chunk threshold,
 * and from the split threshold up; a big pooled memfd is taken only by a share running alone
 * (split refill), while other shares run a fresh chunked share is faster. */
static void test_pool_sizes(void) {
    size_t saved_chunk = lshm__share_chunk_threshold, saved_split = lshm__share_split_threshold;
    lshm__share_chunk_threshold = 8 * page;
    lshm__share_split_threshold = 16 * page;
    lshm_pool_trim();
    int base = fd_count();
    lshm_storage_release(shared_storage(10 * page, 1)); /* chunked, below the split: not kept */
    ASSERT_EQ(fd_count(), base);
    lshm_storage_release(shared_storage(3 * page, 2)); /* small: kept */
    ASSERT_EQ(fd_count(), base + 1);
    lshm_storage_release(shared_storage(20 * page, 3)); /* big: kept */
    ASSERT_EQ(fd_count(), base + 2);
    lshm__share_pretend_busy(1);
    lshm_storage *s = shared_storage(20 * page, 4); /* busy: a fresh memfd, the pool untouched */
    lshm__share_pretend_busy(-1);
    ASSERT_EQ(fd_count(), base + 3);
    lshm_storage_release(s); /* pooled too: two of 20 pages now */
    ASSERT_EQ(fd_count(), base + 3);
    if (lshm__os_ncpu() >= 2) { /* alone: takes a pooled one */
        s = shared_storage(20 * page, 5);
        ASSERT_EQ(fd_count(), base + 3);
        lshm_storage_release(s);
    }
    ASSERT_EQ(lshm_pool_trim(), 3);
    ASSERT_EQ(fd_count(), base);
    lshm__share_chunk_threshold = saved_chunk;
    lshm__share_split_threshold = saved_split;
}

static void test_pool_refill_faults(void) {
    lshm_pool_trim();
    int base = fd_count();
    size_t saved = lshm__share_split_threshold;
    for (int split = 0; split < 2; split++) {
        lshm__share_split_threshold = split ? 4 * page : saved;
        for (int nth = 1;; nth++) {
            lshm_storage *p = shared_storage(6 * page, 1);
            lshm_storage_release(p); /* pooled */
            ASSERT_EQ(fd_count(), base + 1);
            lshm_storage *s;
            ASSERT_OK(lshm_storage_create(6 * page, NULL, 0, &s));
            void *data = lshm_storage_data(s);
            fill(data, 6 * page, 2);
            lshm__fault_arm(nth, -ENOMEM);
            int rc = lshm_storage_share(s);
            int hit = lshm__fault_points_hit();
            lshm__fault_arm(0, 0);
            if (hit < nth) {
                ASSERT_OK(rc);
                ASSERT_EQ(fd_count(), base + 1); /* the pooled memfd, now the storage's */
                lshm_storage_release(s);
                break;
            }
            ASSERT_ERR(rc, -ENOMEM);
            ASSERT_PTR_EQ(lshm_storage_data(s), data);
            ASSERT_EQ(lshm_storage_flags(s), 0);
            ASSERT(check(data, 6 * page, 2));
            ASSERT_EQ(fd_count(), base);
            lshm_storage_release(s);
        }
        ASSERT_EQ(lshm_pool_trim(), 1);
    }
    lshm__share_split_threshold = saved;
    ASSERT_EQ(fd_count(), base);
}

int main(void) {
    page = lshm_page_size();
    /* These tests are about storages with a memfd of their own; test_slab covers slabs. */
    lshm__slab_max_bytes = 0;
    RUN_TEST(test_same_address);
    RUN_TEST(test_in_place_struct);
    RUN_TEST(test_zero_bytes);
    RUN_TEST(test_whole_pages_allocator);
    RUN_TEST(test_plain_allocator_swaps);
    RUN_TEST(test_foreign_swaps);
    RUN_TEST(test_concurrent_shares);
    RUN_TEST(test_concurrent_seals);
    RUN_TEST(test_foreign_moves_into_huge_pages);
    RUN_TEST(test_fault_atomicity);
    RUN_TEST(test_split_copy);
    RUN_TEST(test_chunked);
    RUN_TEST(test_chunked_huge);
    RUN_TEST(test_huge_share_under_rlimit_as);
    RUN_TEST(test_rlimit_nofile);
    RUN_TEST(test_rlimit_fsize);
    RUN_TEST(test_rlimit_fsize_lowered_mid_share);
    RUN_TEST(test_large);
    RUN_TEST(test_copy_between_shared);
    RUN_TEST(test_seal_readonly);
    RUN_TEST(test_share_refused_while_moving);
    RUN_TEST(test_fd_handed_out_writable);
    RUN_TEST(test_seal_readonly_sizes);
    RUN_TEST(test_pool);
    RUN_TEST(test_pool_sizes);
    RUN_TEST(test_pool_refill_faults);
    return 0;
}
