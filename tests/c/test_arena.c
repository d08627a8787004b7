/*
 * test_arena.c -- the arena: slab of storages initialised and finalised in place, slices of one
 * buffer (private or one memfd), allocate/deallocate cycles without fd or mapping leaks, buffer
 * reuse and trim, -EBUSY on live references, a shared arena seen from a forked child,
 * record-then-replay with a grown request that re-plans, stats, and bad input.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* the fault-injection hooks of internal.h (a re-plan that fails) */
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Built with ASan or TSan, whose runtimes map and unmap memory of their own at any time: a
 * count of this process's mappings after a long loop of injected faults is then no measure
 * of ours (test_failed_replan_keeps_the_plan checks it in plain builds only). */
#if defined(LSHM__TSAN) || defined(__SANITIZE_ADDRESS__)
#define SANITIZER_MAPPINGS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SANITIZER_MAPPINGS 1
#endif
#endif

/* The number of mappings of this process. */
static int map_count(void) {
    return count_mappings(NULL, SIZE_MAX, 0);
}

/* A small network: 6 tensors, a chain with one skip connection (half-open lifetimes). */
enum { N = 6 };
static const uint64_t sizes[N] = {4096, 10000, 3000, 10000, 64, 0};
static const int64_t firsts[N] = {0, 1, 2, 3, 4, 2};
static const int64_t lasts[N] = {2, 4, 4, 5, 6, 3};

static lshm_arena *make(unsigned flags) {
    lshm_arena *a = NULL;
    ASSERT_OK(lshm_arena_create(N, sizes, firsts, lasts, NULL, flags, &a));
    ASSERT(a != NULL);
    return a;
}

static void test_slab_in_place(void) {
    lshm_arena *a = make(0);
    ASSERT_EQ(lshm_arena_count(a), N);
    ASSERT(lshm_arena_data(a) == NULL); /* no buffer before the first allocate */
    lshm_plan_result plan;
    ASSERT_OK(lshm_arena_plan_result(a, &plan));
    ASSERT_UINT_EQ(lshm_arena_size(a), plan.arena_size);
    ASSERT(plan.arena_size >= plan.lower_bound);
    uint64_t offsets[N];
    for (size_t i = 0; i < N; i++)
        ASSERT_OK(lshm_arena_offset(a, i, &offsets[i]));
    lshm_plan_options opts;
    lshm_plan_options_init(&opts);
    ASSERT_OK(lshm_plan_validate(N, sizes, firsts, lasts, offsets, &opts, plan.arena_size));

    ASSERT_OK(lshm_arena_allocate(a));
    char *base = lshm_arena_data(a);
    ASSERT(base != NULL);
    ASSERT_EQ((uintptr_t)base % lshm_page_size(), 0);
    lshm_storage *s[N];
    for (size_t i = 0; i < N; i++) {
        ASSERT_OK(lshm_arena_storage(a, i, &s[i]));
        /* The slab: consecutive slots of lshm_storage_sizeof() bytes, suitably aligned. */
        ASSERT_EQ((uintptr_t)s[i] % lshm_storage_alignof(), 0);
        if (i > 0)
            ASSERT_EQ((uintptr_t)s[i] - (uintptr_t)s[i - 1], lshm_storage_sizeof());
        ASSERT_EQ(lshm_storage_refcount(s[i]), 1);
        ASSERT_UINT_EQ(lshm_storage_nbytes(s[i]), sizes[i]);
        ASSERT(lshm_storage_flags(s[i]) & LSHM_STORAGE_INPLACE);
        ASSERT_EQ(lshm_storage_flags(s[i]) & LSHM_STORAGE_SHARED, 0);
        if (sizes[i] > 0)
            ASSERT_PTR_EQ(lshm_storage_data(s[i]), base + offsets[i]);
        else
            ASSERT(lshm_storage_data(s[i]) == NULL);
    }
    /* Fresh buffer: zero. Tensors alive at once do not share bytes: write each with its own
     * value when its life begins and check, at every time, that every live one keeps its value. */
    for (size_t i = 0; i < N; i++) {
        unsigned char *p = lshm_storage_data(s[i]);
        for (size_t b = 0; b < sizes[i]; b++)
            ASSERT_EQ(p[b], 0);
    }
    for (int64_t t = 0; t < 6; t++) {
        for (size_t i = 0; i < N; i++)
            if (firsts[i] == t && sizes[i] > 0)
                memset(lshm_storage_data(s[i]), (int)(i + 1), sizes[i]);
        for (size_t j = 0; j < N; j++) {
            if (firsts[j] > t || lasts[j] <= t || sizes[j] == 0)
                continue;
            const unsigned char *q = lshm_storage_data(s[j]);
            for (size_t b = 0; b < sizes[j]; b++)
                ASSERT_EQ(q[b], j + 1);
        }
    }
    ASSERT_ERR(lshm_arena_allocate(a), -EBUSY); /* allocated already */
    ASSERT_OK(lshm_arena_deallocate(a));
    for (size_t i = 0; i < N; i++)
        ASSERT_EQ(lshm_storage_refcount(s[i]), 0); /* finalised in place */
    lshm_storage *t = NULL;
    ASSERT_ERR(lshm_arena_storage(a, 0, &t), -ENODATA);
    ASSERT_OK(lshm_arena_deallocate(a)); /* not allocated: nothing to do */
    ASSERT_OK(lshm_arena_destroy(a));
    ASSERT_OK(lshm_arena_destroy(NULL));
}

static void test_cycles_reuse_and_trim(void) {
    for (unsigned flags = 0; flags <= LSHM_ARENA_SHARED; flags += LSHM_ARENA_SHARED) {
        lshm_arena *a = make(flags);
        ASSERT_OK(lshm_arena_allocate(a));
        void *base = lshm_arena_data(a);
        ASSERT_OK(lshm_arena_deallocate(a));
        int fds = fd_count(), maps = map_count();
        enum { CYCLES = 300 };
        for (int c = 0; c < CYCLES; c++) {
            ASSERT_OK(lshm_arena_allocate(a));
            ASSERT_PTR_EQ(lshm_arena_data(a), base); /* the kept buffer, no new mmap */
            lshm_storage *s;
            ASSERT_OK(lshm_arena_storage(a, 1, &s));
            memset(lshm_storage_data(s), c & 0xff, sizes[1]);
            ASSERT_OK(lshm_arena_deallocate(a));
        }
        ASSERT_EQ(fd_count(), fds);
        ASSERT_EQ(map_count(), maps);
        lshm_arena_counters st;
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.reuse_count, (uint64_t)CYCLES * N); /* the first allocate: 0 */
        ASSERT_UINT_EQ(st.iterations, CYCLES + 1);
        ASSERT_UINT_EQ(st.storages, N);
        ASSERT_UINT_EQ(st.managed_bytes, 4096 + 10000 + 3000 + 10000 + 64);
        ASSERT_UINT_EQ(st.arena_bytes, lshm_arena_size(a));
        ASSERT(st.lower_bound <= st.arena_bytes);
        ASSERT(st.arena_bytes < st.managed_bytes); /* the plan reuses memory */
        ASSERT_UINT_EQ(st.replans, 0);

        /* trim gives the buffer back; the next allocate makes a new one (zero-filled). */
        ASSERT_OK(lshm_arena_allocate(a));
        ASSERT_ERR(lshm_arena_trim(a), -EBUSY);
        ASSERT_OK(lshm_arena_deallocate(a));
        ASSERT_OK(lshm_arena_trim(a));
        ASSERT(lshm_arena_data(a) == NULL);
        if (flags & LSHM_ARENA_SHARED)
            ASSERT_EQ(fd_count(), fds - 1);
        ASSERT_OK(lshm_arena_allocate(a));
        lshm_storage *s;
        ASSERT_OK(lshm_arena_storage(a, 1, &s));
        const unsigned char *p = lshm_storage_data(s);
        for (size_t b = 0; b < sizes[1]; b++)
            ASSERT_EQ(p[b], 0);
        ASSERT_OK(lshm_arena_storage(a, 0, &s));
        ASSERT_OK(lshm_arena_destroy(a)); /* deallocates and frees everything */
        ASSERT_EQ(fd_count(), fds - ((flags & LSHM_ARENA_SHARED) ? 1 : 0));
    }
}

static void test_busy_while_referenced(void) {
    lshm_arena *a = make(0);
    ASSERT_OK(lshm_arena_allocate(a));
    lshm_storage *s[N];
    for (size_t i = 0; i < N; i++)
        ASSERT_OK(lshm_arena_storage(a, i, &s[i]));
    void *data3 = lshm_storage_data(s[3]);
    lshm_storage_retain(s[3]); /* e.g. a numpy array over tensor 3 */
    ASSERT_ERR(lshm_arena_deallocate(a), -EBUSY);
    ASSERT(strstr(lshm_last_error(), "storage 3") != NULL);
    ASSERT_ERR(lshm_arena_destroy(a), -EBUSY);
    ASSERT_ERR(lshm_arena_trim(a), -EBUSY);
    /* Nothing changed: every storage is still initialised with its bytes. */
    for (size_t i = 0; i < N; i++)
        ASSERT_EQ(lshm_storage_refcount(s[i]), i == 3 ? 2 : 1);
    ASSERT_PTR_EQ(lshm_storage_data(s[3]), data3);
    lshm_storage_release(s[3]);
    ASSERT_OK(lshm_arena_deallocate(a));
    ASSERT_OK(lshm_arena_destroy(a));
}

static void test_shared_fork(void) {
    lshm_arena *a = make(LSHM_ARENA_SHARED);
    int fd = -1;
    ASSERT_ERR(lshm_arena_fd(a, &fd), -ENODATA); /* no buffer yet */
    ASSERT_OK(lshm_arena_allocate(a));
    ASSERT_OK(lshm_arena_fd(a, &fd));
    ASSERT_GE(fd, 0);
    lshm_storage *s[N];
    for (size_t i = 0; i < N; i++) {
        ASSERT_OK(lshm_arena_storage(a, i, &s[i]));
        ASSERT(lshm_storage_flags(s[i]) & LSHM_STORAGE_SHARED);
        ASSERT(lshm_storage_segment(s[i]) != NULL);
        if (sizes[i] == 0)
            continue;
        int sfd = -1;
        uint64_t off = 0, planned = 0;
        ASSERT_OK(lshm_storage_fd(s[i], &sfd, &off));
        ASSERT_OK(lshm_arena_offset(a, i, &planned));
        ASSERT_EQ(sfd, fd); /* one fd for the whole set */
        ASSERT_UINT_EQ(off, planned);
    }
    memset(lshm_storage_data(s[3]), 0xab, sizes[3]);
    uint64_t off3 = 0, off4 = 0;
    ASSERT_OK(lshm_arena_offset(a, 3, &off3));
    ASSERT_OK(lshm_arena_offset(a, 4, &off4));
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        /* The child maps the fd afresh, as a receiver of the fd would. */
        lshm_segment *seg = NULL;
        if (lshm_segment_attach(fd, 0, &seg) != 0)
            _exit(2);
        if (lshm_segment_size(seg) < lshm_arena_size(a))
            _exit(3);
        const unsigned char *p = (const unsigned char *)lshm_segment_data(seg) + off3;
        for (size_t b = 0; b < sizes[3]; b++)
            if (p[b] != 0xab)
                _exit(4);
        memset((char *)lshm_segment_data(seg) + off4, 0x77, sizes[4]);
        lshm_segment_release(seg);
        _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status));
    ASSERT_EQ(WEXITSTATUS(status), 0);
    const unsigned char *q = lshm_storage_data(s[4]);
    for (size_t b = 0; b < sizes[4]; b++)
        ASSERT_EQ(q[b], 0x77); /* the child's write, through the same memfd */
    ASSERT_OK(lshm_arena_destroy(a));
}

/* One iteration of a recorded program: t0 = alloc(a0); t1 = alloc(a1); free t0;
 * t2 = alloc(a2); free t1; t3 = alloc(a3); free t2; free t3. */
static void run_iteration(lshm_arena *a, const size_t req[4], lshm_storage *seen[4]) {
    lshm_storage *t[4];
    ASSERT_OK(lshm_arena_alloc(a, req[0], &t[0]));
    ASSERT_OK(lshm_arena_alloc(a, req[1], &t[1]));
    memset(lshm_storage_data(t[0]), 1, req[0]);
    memset(lshm_storage_data(t[1]), 2, req[1]);
    ASSERT_OK(lshm_arena_free(a, t[0]));
    ASSERT_OK(lshm_arena_alloc(a, req[2], &t[2]));
    memset(lshm_storage_data(t[2]), 3, req[2]);
    for (size_t b = 0; b < req[1]; b++)
        ASSERT_EQ(((unsigned char *)lshm_storage_data(t[1]))[b], 2);
    ASSERT_OK(lshm_arena_free(a, t[1]));
    ASSERT_OK(lshm_arena_alloc(a, req[3], &t[3]));
    memset(lshm_storage_data(t[3]), 4, req[3]);
    for (size_t b = 0; b < req[2]; b++)
        ASSERT_EQ(((unsigned char *)lshm_storage_data(t[2]))[b], 3);
    ASSERT_OK(lshm_arena_free(a, t[2]));
    for (size_t b = 0; b < req[3]; b++)
        ASSERT_EQ(((unsigned char *)lshm_storage_data(t[3]))[b], 4);
    ASSERT_OK(lshm_arena_free(a, t[3]));
    for (int i = 0; i < 4; i++)
        seen[i] = t[i];
}

static void test_record_replay(void) {
    for (unsigned flags = 0; flags <= LSHM_ARENA_SHARED; flags += LSHM_ARENA_SHARED) {
        lshm_arena *a = NULL;
        ASSERT_OK(lshm_arena_create_recording(NULL, flags, &a));
        lshm_plan_result plan;
        ASSERT_ERR(lshm_arena_plan_result(a, &plan), -ENODATA);
        ASSERT_UINT_EQ(lshm_arena_size(a), 0);
        const size_t req[4] = {1000, 2000, 3000, 500};
        lshm_storage *seen[4];
        lshm_arena_counters st;

        /* Iteration 1: recording, ordinary allocations (heap storages, not in the slab). */
        run_iteration(a, req, seen);
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.fallback_count, 4);
        ASSERT_UINT_EQ(st.reuse_count, 0);
        ASSERT_OK(lshm_arena_end_iteration(a));
        ASSERT_OK(lshm_arena_plan_result(a, &plan));
        ASSERT_EQ(lshm_arena_count(a), 4);
        /* Live sets: {0,1}, {1,2}, {2,3}: LB = the pair {1,2}, give or take alignment. */
        ASSERT_GE(plan.lower_bound, 2000 + 3000);
        ASSERT_LE(plan.lower_bound, 2048 + 3008);
        ASSERT(plan.arena_size >= plan.lower_bound);
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.iterations, 1);
        ASSERT_UINT_EQ(st.replans, 0);
        ASSERT_UINT_EQ(st.storages, 4);
        ASSERT_UINT_EQ(st.managed_bytes, 1000 + 2000 + 3000 + 500);
        ASSERT_UINT_EQ(st.arena_bytes, plan.arena_size);
        ASSERT_UINT_EQ(st.lower_bound, plan.lower_bound);

        /* Iterations 2-4: replayed from the buffer, same slots each time, no new mappings. */
        int fds = fd_count(), maps = map_count();
        char *base = lshm_arena_data(a);
        lshm_storage *first[4];
        for (int it = 0; it < 3; it++) {
            run_iteration(a, req, seen);
            for (int i = 0; i < 4; i++) {
                uint64_t off;
                ASSERT_OK(lshm_arena_offset(a, (size_t)i, &off));
                if (it == 0)
                    first[i] = seen[i];
                ASSERT_PTR_EQ(seen[i], first[i]); /* slot i of the slab, every time */
            }
            ASSERT_OK(lshm_arena_end_iteration(a));
        }
        ASSERT_EQ(fd_count(), fds);
        ASSERT_EQ(map_count(), maps);
        ASSERT_PTR_EQ(lshm_arena_data(a), base);
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.reuse_count, 12);
        ASSERT_UINT_EQ(st.fallback_count, 4);
        ASSERT_UINT_EQ(st.iterations, 4);
        ASSERT_UINT_EQ(st.replans, 0);

        /* Iteration 5: request 2 grew: served by ordinary allocation, then re-planned. */
        const size_t grown[4] = {1000, 2000, 9000, 500};
        run_iteration(a, grown, seen);
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.fallback_count, 5);
        ASSERT_UINT_EQ(st.reuse_count, 15);
        ASSERT_UINT_EQ(st.replans, 0);
        ASSERT_OK(lshm_arena_end_iteration(a));
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.replans, 1);
        ASSERT_UINT_EQ(st.managed_bytes, 1000 + 2000 + 9000 + 500);
        ASSERT_GE(st.lower_bound, 9000 + 2000);
        ASSERT_LE(st.lower_bound, 9024 + 2048);
        ASSERT(lshm_arena_size(a) >= st.lower_bound);

        /* Iteration 6: the grown sequence fits; iteration 7: the old sizes still fit (sizes
         * never shrink), so neither re-plans. */
        run_iteration(a, grown, seen);
        ASSERT_OK(lshm_arena_end_iteration(a));
        run_iteration(a, req, seen);
        ASSERT_OK(lshm_arena_end_iteration(a));
        ASSERT_OK(lshm_arena_stats(a, &st));
        ASSERT_UINT_EQ(st.replans, 1);
        ASSERT_UINT_EQ(st.fallback_count, 5);
        ASSERT_UINT_EQ(st.reuse_count, 23);
        ASSERT_UINT_EQ(st.iterations, 7);
        ASSERT_OK(lshm_arena_destroy(a));
    }
}

static void test_replay_out_of_order_never_aliases(void) {
    /* Recorded: x = alloc; free x; y = alloc; free y: the plan gives both the same slice.
     * Replayed with y allocated before x is freed: y must not alias x. */
    lshm_arena *a = NULL;
    ASSERT_OK(lshm_arena_create_recording(NULL, 0, &a));
    lshm_storage *x, *y;
    ASSERT_OK(lshm_arena_alloc(a, 4096, &x));
    ASSERT_OK(lshm_arena_free(a, x));
    ASSERT_OK(lshm_arena_alloc(a, 4096, &y));
    ASSERT_OK(lshm_arena_free(a, y));
    ASSERT_OK(lshm_arena_end_iteration(a));
    ASSERT_UINT_EQ(lshm_arena_size(a), 4096);
    ASSERT_OK(lshm_arena_alloc(a, 4096, &x));
    ASSERT_OK(lshm_arena_alloc(a, 4096, &y));
    char *px = lshm_storage_data(x), *py = lshm_storage_data(y);
    ASSERT(px + 4096 <= py || py + 4096 <= px);
    ASSERT_OK(lshm_arena_free(a, y));
    ASSERT_OK(lshm_arena_free(a, x));
    ASSERT_OK(lshm_arena_end_iteration(a)); /* re-plans for the new order */
    lshm_arena_counters st;
    ASSERT_OK(lshm_arena_stats(a, &st));
    ASSERT_UINT_EQ(st.replans, 1);
    ASSERT_UINT_EQ(lshm_arena_size(a), 8192);
    ASSERT_OK(lshm_arena_destroy(a));
}

static void test_bad_input(void) {
    lshm_arena *a = NULL;
    int64_t bad_last[N];
    memcpy(bad_last, lasts, sizeof bad_last);
    bad_last[2] = -1; /* first > last */
    ASSERT_ERR(lshm_arena_create(N, sizes, firsts, bad_last, NULL, 0, &a), -EINVAL);
    ASSERT(a == NULL);
    ASSERT_ERR(lshm_arena_create(N, NULL, firsts, lasts, NULL, 0, &a), -EINVAL);
    ASSERT_ERR(lshm_arena_create(N, sizes, firsts, lasts, NULL, 0x100, &a), -EINVAL);
    ASSERT_ERR(lshm_arena_create(N, sizes, firsts, lasts, NULL, 0, NULL), -EINVAL);
    lshm_plan_options opts;
    lshm_plan_options_init(&opts);
    opts.alignment = 48; /* not a power of two */
    ASSERT_ERR(lshm_arena_create(N, sizes, firsts, lasts, &opts, 0, &a), -EINVAL);
    ASSERT_ERR(lshm_arena_create_recording(NULL, 0x100, &a), -EINVAL);
    ASSERT_ERR(lshm_arena_create_recording(NULL, 0, NULL), -EINVAL);

    /* n == 0: an arena of nothing. */
    ASSERT_OK(lshm_arena_create(0, NULL, NULL, NULL, NULL, 0, &a));
    ASSERT_OK(lshm_arena_allocate(a));
    ASSERT_UINT_EQ(lshm_arena_size(a), 0);
    ASSERT_OK(lshm_arena_deallocate(a));
    ASSERT_OK(lshm_arena_destroy(a));

    /* NULL arenas. */
    lshm_storage *s = NULL;
    uint64_t off;
    int fd;
    lshm_arena_counters st;
    ASSERT_ERR(lshm_arena_allocate(NULL), -EINVAL);
    ASSERT_ERR(lshm_arena_deallocate(NULL), -EINVAL);
    ASSERT_ERR(lshm_arena_trim(NULL), -EINVAL);
    ASSERT_ERR(lshm_arena_storage(NULL, 0, &s), -EINVAL);
    ASSERT_ERR(lshm_arena_offset(NULL, 0, &off), -EINVAL);
    ASSERT_ERR(lshm_arena_fd(NULL, &fd), -EINVAL);
    ASSERT_ERR(lshm_arena_stats(NULL, &st), -EINVAL);
    ASSERT_ERR(lshm_arena_alloc(NULL, 1, &s), -EINVAL);
    ASSERT_ERR(lshm_arena_free(NULL, s), -EINVAL);
    ASSERT_ERR(lshm_arena_end_iteration(NULL), -EINVAL);
    ASSERT_EQ(lshm_arena_count(NULL), 0);
    ASSERT(lshm_arena_data(NULL) == NULL);
    ASSERT_UINT_EQ(lshm_arena_size(NULL), 0);

    /* The wrong kind of arena, out-of-range indices, a private arena's fd. */
    a = make(0);
    ASSERT_ERR(lshm_arena_alloc(a, 10, &s), -EINVAL);
    ASSERT_ERR(lshm_arena_end_iteration(a), -EINVAL);
    ASSERT_ERR(lshm_arena_offset(a, N, &off), -EINVAL);
    ASSERT_OK(lshm_arena_allocate(a));
    ASSERT_ERR(lshm_arena_storage(a, N, &s), -EINVAL);
    ASSERT_ERR(lshm_arena_storage(a, 0, NULL), -EINVAL);
    ASSERT_ERR(lshm_arena_fd(a, &fd), -ENODATA);
    ASSERT_OK(lshm_arena_destroy(a));

    lshm_arena *r = NULL;
    ASSERT_OK(lshm_arena_create_recording(NULL, 0, &r));
    ASSERT_ERR(lshm_arena_allocate(r), -EINVAL);
    ASSERT_ERR(lshm_arena_storage(r, 0, &s), -EINVAL);
    lshm_storage *t = NULL, *other = NULL;
    ASSERT_OK(lshm_arena_alloc(r, 100, &t));
    ASSERT_OK(lshm_storage_create(100, NULL, 0, &other));
    ASSERT_ERR(lshm_arena_free(r, other), -EINVAL); /* not from this arena */
    ASSERT_ERR(lshm_arena_free(r, NULL), -EINVAL);
    lshm_storage_release(other);
    ASSERT_ERR(lshm_arena_end_iteration(r), -EBUSY); /* t not freed */
    ASSERT_ERR(lshm_arena_destroy(r), -EBUSY);
    /* An ordinary storage: another reference keeps its memory after the free. */
    ASSERT_EQ(lshm_storage_flags(t) & LSHM_STORAGE_INPLACE, 0);
    lshm_storage_retain(t);
    ASSERT_OK(lshm_arena_free(r, t));
    ASSERT_EQ(lshm_storage_refcount(t), 1);
    memset(lshm_storage_data(t), 1, 100);
    lshm_storage_release(t);
    ASSERT_OK(lshm_arena_end_iteration(r));
    /* Replay: the slot storage refuses while referenced; freeing it twice is refused. */
    ASSERT_OK(lshm_arena_alloc(r, 100, &t));
    ASSERT(lshm_storage_flags(t) & LSHM_STORAGE_INPLACE);
    lshm_storage_retain(t);
    ASSERT_ERR(lshm_arena_free(r, t), -EBUSY); /* another reference: nothing recorded */
    ASSERT_ERR(lshm_arena_end_iteration(r), -EBUSY);
    lshm_storage_release(t);
    ASSERT_OK(lshm_arena_free(r, t));
    ASSERT_ERR(lshm_arena_free(r, t), -EINVAL);
    ASSERT_OK(lshm_arena_end_iteration(r));
    ASSERT_OK(lshm_arena_end_iteration(r)); /* an empty iteration is fine */
    ASSERT_OK(lshm_arena_destroy(r));
}

static void test_tensor_never_live(void) {
    /* [3, 3) is empty (half-open): such a tensor still gets a slice inside the buffer. */
    const uint64_t sz[2] = {100, 5000};
    const int64_t f[2] = {3, 0}, l[2] = {3, 9};
    for (unsigned flags = 0; flags <= LSHM_ARENA_SHARED; flags += LSHM_ARENA_SHARED) {
        lshm_arena *a = NULL;
        ASSERT_OK(lshm_arena_create(2, sz, f, l, NULL, flags, &a));
        ASSERT_OK(lshm_arena_allocate(a));
        for (size_t i = 0; i < 2; i++) {
            uint64_t off;
            lshm_storage *s;
            ASSERT_OK(lshm_arena_offset(a, i, &off));
            ASSERT(off + sz[i] <= lshm_arena_size(a));
            ASSERT_OK(lshm_arena_storage(a, i, &s));
            memset(lshm_storage_data(s), 1, sz[i]);
        }
        ASSERT_OK(lshm_arena_destroy(a));
    }
}

/* Ordinary (unplanned) storages of a recording arena are found again by address: freed in
 * any order, an address reused by a later alloc of the same iteration frees the new storage,
 * and a second free of the same storage is refused. */
static void test_ordinary_frees_any_order(void) {
    enum { M = 3000 };
    lshm_arena *a = NULL;
    ASSERT_OK(lshm_arena_create_recording(NULL, 0, &a));
    static lshm_storage *v[M];
    for (int i = 0; i < M; i++)
        ASSERT_OK(lshm_arena_alloc(a, 64 + (size_t)i % 7, &v[i]));
    for (int i = 0; i < M; i++) { /* a fixed permutation: 7 is prime to M */
        int j = (int)((7u * (unsigned)i + 11u) % M);
        ASSERT_OK(lshm_arena_free(a, v[j]));
        ASSERT_ERR(lshm_arena_free(a, v[j]), -EINVAL);
    }
    lshm_storage *x, *y;
    ASSERT_OK(lshm_arena_alloc(a, 100, &x));
    ASSERT_OK(lshm_arena_free(a, x));
    ASSERT_OK(lshm_arena_alloc(a, 100, &y)); /* very likely x's address again */
    ASSERT_OK(lshm_arena_free(a, y));
    ASSERT_ERR(lshm_arena_free(a, y), -EINVAL);
    ASSERT_OK(lshm_arena_end_iteration(a));
    lshm_arena_counters st;
    ASSERT_OK(lshm_arena_stats(a, &st));
    ASSERT_UINT_EQ(st.fallback_count, M + 2);
    ASSERT_OK(lshm_arena_destroy(a));
}

/* A reference to the buffer keeps its bytes mapped after the arena drops it (re-plan, trim,
 * destroy), and the last release unmaps it (and closes a shared buffer's memfd): no leak. */
static void test_buffer_reference_outlives_replan_and_trim(void) {
    for (unsigned flags = 0; flags <= LSHM_ARENA_SHARED; flags += LSHM_ARENA_SHARED) {
        int fds = fd_count();
        lshm_arena *a = NULL;
        lshm_arena_buffer *buf = NULL;
        lshm_storage *t = NULL, *u = NULL;
        ASSERT_OK(lshm_arena_create_recording(NULL, flags, &a));
        ASSERT_ERR(lshm_arena_current_buffer(a, &buf), -ENODATA);
        ASSERT_ERR(lshm_arena_current_buffer(NULL, &buf), -EINVAL);
        ASSERT_ERR(lshm_arena_current_buffer(a, NULL), -EINVAL);
        ASSERT(buf == NULL);
        ASSERT_OK(lshm_arena_alloc(a, 4096, &t));
        ASSERT_OK(lshm_arena_free(a, t));
        ASSERT_OK(lshm_arena_end_iteration(a)); /* first plan: a buffer of 4096 bytes */

        /* A slot, freed, then a larger request that re-plans. */
        ASSERT_OK(lshm_arena_alloc(a, 4096, &t));
        ASSERT(lshm_storage_flags(t) & LSHM_STORAGE_INPLACE);
        ASSERT_OK(lshm_arena_current_buffer(a, &buf));
        ASSERT_PTR_EQ(lshm_arena_buffer_retain(buf), buf);
        unsigned char *old = lshm_storage_data(t);
        ASSERT_PTR_EQ(lshm_arena_buffer_data(buf), lshm_arena_data(a));
        ASSERT(old >= (unsigned char *)lshm_arena_buffer_data(buf));
        ASSERT_GE(lshm_arena_buffer_size(buf), 4096);
        memset(old, 0x5A, 4096);
        ASSERT_OK(lshm_arena_free(a, t));
        ASSERT_OK(lshm_arena_alloc(a, (size_t)1 << 24, &u));
        ASSERT_OK(lshm_arena_free(a, u));
        ASSERT_OK(lshm_arena_end_iteration(a)); /* re-plan: a new, larger buffer */
        ASSERT(lshm_arena_data(a) != lshm_arena_buffer_data(buf));
        ASSERT_GE(count_mappings(old, 4096, 0), 1); /* still mapped, bytes intact */
        ASSERT(all_bytes(old, 4096, 0x5A));
        old[0] = 1; /* and writable */
        lshm_arena_buffer_release(buf);
        ASSERT_EQ(count_mappings(old, 4096, 0), 0); /* the last reference unmapped it */

        /* The same with trim, and with destroy. */
        ASSERT_OK(lshm_arena_alloc(a, 4096, &t));
        ASSERT_OK(lshm_arena_current_buffer(a, &buf));
        lshm_arena_buffer_retain(buf);
        old = lshm_storage_data(t);
        memset(old, 0x33, 4096);
        ASSERT_OK(lshm_arena_free(a, t));
        ASSERT_OK(lshm_arena_alloc(a, (size_t)1 << 24, &u));
        ASSERT_OK(lshm_arena_free(a, u));
        ASSERT_OK(lshm_arena_end_iteration(a));
        ASSERT_OK(lshm_arena_trim(a));
        ASSERT(lshm_arena_data(a) == NULL);
        ASSERT_GE(count_mappings(old, 4096, 0), 1);
        ASSERT(all_bytes(old, 4096, 0x33));
        ASSERT_OK(lshm_arena_destroy(a));
        ASSERT(all_bytes(old, 4096, 0x33));
        lshm_arena_buffer_release(buf);
        ASSERT_EQ(count_mappings(old, 4096, 0), 0);
        ASSERT_EQ(fd_count(), fds); /* a shared buffer's memfd closed with it */
        lshm_arena_buffer_release(NULL);
        ASSERT(lshm_arena_buffer_retain(NULL) == NULL);
        ASSERT(lshm_arena_buffer_data(NULL) == NULL);
        ASSERT_EQ(lshm_arena_buffer_size(NULL), 0);
    }
    /* A planned arena: the buffer outlives deallocate, trim and destroy while referenced. */
    lshm_arena *a = make(0);
    lshm_arena_buffer *buf = NULL;
    ASSERT_OK(lshm_arena_allocate(a));
    ASSERT_OK(lshm_arena_current_buffer(a, &buf));
    lshm_arena_buffer_retain(buf);
    unsigned char *base = lshm_arena_data(a);
    size_t size = lshm_arena_buffer_size(buf);
    ASSERT_OK(lshm_arena_deallocate(a));
    ASSERT_OK(lshm_arena_trim(a));
    ASSERT_OK(lshm_arena_destroy(a));
    memset(base, 7, size);
    lshm_arena_buffer_release(buf);
    ASSERT_EQ(count_mappings(base, size, 0), 0);
}

/* lshm_storage_fini of an arena's storage (a slot of its slab, lshm_storage_init'ed in place
 * like a caller's) finalised it behind the arena's back: the arena's own finalisation at
 * deallocate (or free) then found it finalised already (an assert, or in a release build a
 * slot counted live whose storage was gone). Now refused, changing nothing. */
static void test_fini_of_an_arena_storage_is_refused(void) {
    lshm_arena *a = make(0);
    ASSERT_OK(lshm_arena_allocate(a));
    lshm_storage *s = NULL;
    ASSERT_OK(lshm_arena_storage(a, 1, &s));
    void *data = lshm_storage_data(s);
    ASSERT_ERR(lshm_storage_fini(s), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "belongs to an arena") != NULL);
    ASSERT_EQ(lshm_storage_refcount(s), 1);
    ASSERT_PTR_EQ(lshm_storage_data(s), data);
    ASSERT_OK(lshm_arena_deallocate(a));
    ASSERT_OK(lshm_arena_allocate(a)); /* (slot 1 initialised again: refused again) */
    ASSERT_OK(lshm_arena_storage(a, 1, &s));
    ASSERT_ERR(lshm_storage_fini(s), -EINVAL);
    ASSERT_OK(lshm_arena_destroy(a));

    /* a recording arena's storage on its buffer (the second iteration replays the plan) */
    ASSERT_OK(lshm_arena_create_recording(NULL, 0, &a));
    for (int it = 0; it < 2; it++) {
        ASSERT_OK(lshm_arena_alloc(a, 4096, &s));
        ASSERT_ERR(lshm_storage_fini(s), -EINVAL); /* (the first: an ordinary heap storage) */
        ASSERT(strstr(lshm_last_error(), it == 0 ? "heap" : "belongs to an arena") != NULL);
        ASSERT_OK(lshm_arena_free(a, s));
        ASSERT_OK(lshm_arena_end_iteration(a));
    }
    lshm_arena_counters st;
    ASSERT_OK(lshm_arena_stats(a, &st));
    ASSERT_UINT_EQ(st.reuse_count, 1);
    ASSERT_OK(lshm_arena_destroy(a));
}

/* Planning 40,000 tensors whose lifetimes overlap at random, long (many others each:
 * seconds to tens of seconds), on another thread, interrupted: arena creation by
 * lshm_plan_interrupt of its options, a recording arena's plan by lshm_arena_interrupt. */
enum { BIG = 40000 };
typedef struct {
    uint64_t *sizes;
    int64_t *firsts, *lasts;
    lshm_plan_options opts;
    lshm_arena *arena;
    int rc;
} big_plan;

static uint64_t scramble(uint64_t i) { return (i * 2654435761u) % BIG; } /* (a permutation) */

static void *create_big(void *arg) {
    big_plan *b = arg;
    b->rc = lshm_arena_create(BIG, b->sizes, b->firsts, b->lasts, &b->opts, 0, &b->arena);
    return NULL;
}

static void *end_big_iteration(void *arg) {
    big_plan *b = arg;
    b->rc = lshm_arena_end_iteration(b->arena);
    return NULL;
}

/* Starts fn(b) on a thread, interrupts it with interrupt(target) as soon as it plans, joins. */
static void interrupt_on_thread(void *(*fn)(void *), big_plan *b, int (*interrupt)(const void *),
                                const void *target) {
    pthread_t thread;
    ASSERT_EQ(pthread_create(&thread, NULL, fn, b), 0);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int found = 0;
    do {
        usleep(1000);
        found = interrupt(target);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (!found && now.tv_sec - start.tv_sec < 20);
    ASSERT_EQ(found, 1);
    ASSERT_EQ(pthread_join(thread, NULL), 0);
    clock_gettime(CLOCK_MONOTONIC, &now);
    ASSERT_LT(now.tv_sec - start.tv_sec, 5); /* (uninterrupted: many seconds) */
}

static int interrupt_plan(const void *opts) { return lshm_plan_interrupt(opts); }
static int interrupt_arena(const void *arena) { return lshm_arena_interrupt(arena); }

static void test_interrupt_plans(void) {
    big_plan b = {0};
    b.sizes = malloc(BIG * sizeof *b.sizes);
    b.firsts = malloc(BIG * sizeof *b.firsts);
    b.lasts = malloc(BIG * sizeof *b.lasts);
    ASSERT(b.sizes && b.firsts && b.lasts);
    for (uint64_t i = 0; i < BIG; i++) {
        b.sizes[i] = 1 + (i * 7919) % 5000;
        b.firsts[i] = (int64_t)scramble(i);
        b.lasts[i] = b.firsts[i] + 1 + (int64_t)scramble(i * 31 + 7);
    }
    lshm_plan_options_init(&b.opts);
    int fds = fd_count();
    b.arena = (lshm_arena *)&b; /* (must stay untouched) */
    interrupt_on_thread(create_big, &b, interrupt_plan, &b.opts);
    ASSERT_EQ(b.rc, -ECANCELED);
    ASSERT_PTR_EQ(b.arena, (lshm_arena *)&b);
    ASSERT_EQ(fd_count(), fds);

    /* a recording arena's first plan, at the end of an iteration of BIG allocations */
    ASSERT_OK(lshm_arena_create_recording(NULL, 0, &b.arena));
    ASSERT_ERR(lshm_arena_interrupt(NULL), -EINVAL);
    ASSERT_EQ(lshm_arena_interrupt(b.arena), 0); /* (nothing planning) */
    /* each allocation, then every other time a random live one freed: long, random lives */
    lshm_storage **live = malloc(BIG * sizeof *live);
    ASSERT(live != NULL);
    for (int it = 0; it < 2; it++) {
        size_t count = 0;
        for (uint64_t i = 0; i < BIG; i++) {
            ASSERT_OK(lshm_arena_alloc(b.arena, b.sizes[i], &live[count++]));
            if (i & 1) {
                size_t k = scramble(i) % count;
                ASSERT_OK(lshm_arena_free(b.arena, live[k]));
                live[k] = live[--count];
            }
        }
        while (count > 0)
            ASSERT_OK(lshm_arena_free(b.arena, live[--count]));
        if (it == 0) {
            interrupt_on_thread(end_big_iteration, &b, interrupt_arena, b.arena);
            ASSERT_EQ(b.rc, -ECANCELED); /* (the iteration ended, with no plan) */
            lshm_plan_result plan;
            ASSERT_ERR(lshm_arena_plan_result(b.arena, &plan), -ENODATA);
        }
    }
    ASSERT_OK(lshm_arena_destroy(b.arena)); /* (its second iteration not ended: tens of s) */
    free(live), free(b.sizes), free(b.firsts), free(b.lasts);
}

/* A re-plan that fails (no memory for the planner or for the grown buffer: each fault point
 * of end_iteration in turn) keeps the plan and buffer it had, and they serve the next
 * iterations that fit them; it used to install the new plan with no buffer, so every later
 * iteration fell back to ordinary memory and failed to re-plan again, for good. */
static void test_failed_replan_keeps_the_plan(void) {
    const size_t req[4] = {1000, 2000, 3000, 500}, grown[4] = {1000, 2000, 90000, 500};
    lshm_storage *seen[4];
    for (unsigned flags = 0; flags <= LSHM_ARENA_SHARED; flags += LSHM_ARENA_SHARED) {
        int failures = 0, fds = fd_count(), maps = map_count();
        for (int nth = 1;; nth++) {
            lshm_arena *a = NULL;
            ASSERT_OK(lshm_arena_create_recording(NULL, flags, &a));
            run_iteration(a, req, seen);
            ASSERT_OK(lshm_arena_end_iteration(a)); /* the plan of req, and its buffer */
            uint64_t size = lshm_arena_size(a);
            void *data = lshm_arena_data(a);
            ASSERT(data != NULL);
            run_iteration(a, grown, seen); /* request 2 misfits */
            lshm__fault_arm(nth, -ENOMEM);
            int rc = lshm_arena_end_iteration(a);
            int hit = lshm__fault_points_hit();
            lshm__fault_arm(0, 0);
            if (rc == 0) { /* the fault was absorbed (the planner can do without), or none */
                ASSERT_GE(lshm_arena_size(a), 90000);
                ASSERT_OK(lshm_arena_destroy(a));
                if (hit < nth)
                    break; /* every fault point was tried */
                continue;
            }
            failures++;
            ASSERT_EQ(rc, -ENOMEM);
            ASSERT_UINT_EQ(lshm_arena_size(a), size);
            ASSERT_PTR_EQ(lshm_arena_data(a), data);
            lshm_arena_counters before, after;
            ASSERT_OK(lshm_arena_stats(a, &before));
            ASSERT_UINT_EQ(before.arena_bytes, size);
            run_iteration(a, req, seen); /* fits the old plan: served from its buffer */
            ASSERT_OK(lshm_arena_stats(a, &after));
            ASSERT_UINT_EQ(after.fallback_count, before.fallback_count);
            ASSERT_UINT_EQ(after.reuse_count, before.reuse_count + 4);
            ASSERT_OK(lshm_arena_end_iteration(a));
            ASSERT_PTR_EQ(lshm_arena_data(a), data);
            run_iteration(a, grown, seen); /* and the grown one re-plans now */
            ASSERT_OK(lshm_arena_end_iteration(a));
            ASSERT_GE(lshm_arena_size(a), 90000);
            ASSERT_OK(lshm_arena_destroy(a));
        }
        ASSERT_GE(failures, 2); /* the planner's and the buffer's */
        ASSERT_EQ(fd_count(), fds); /* (no buffer made for a failed plan is left behind) */
#ifndef SANITIZER_MAPPINGS /* (their runtime's own come and go: 191 for 192, 379 for 378) */
        ASSERT_EQ(map_count(), maps);
#else
        (void)maps;
#endif
    }
}

int main(void) {
    RUN_TEST(test_slab_in_place);
    RUN_TEST(test_cycles_reuse_and_trim);
    RUN_TEST(test_busy_while_referenced);
    RUN_TEST(test_shared_fork);
    RUN_TEST(test_record_replay);
    RUN_TEST(test_replay_out_of_order_never_aliases);
    RUN_TEST(test_tensor_never_live);
    RUN_TEST(test_bad_input);
    RUN_TEST(test_ordinary_frees_any_order);
    RUN_TEST(test_buffer_reference_outlives_replan_and_trim);
    RUN_TEST(test_fini_of_an_arena_storage_is_refused);
    RUN_TEST(test_interrupt_plans);
    RUN_TEST(test_failed_replan_keeps_the_plan);
    return 0;
}
