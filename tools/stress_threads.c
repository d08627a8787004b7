/*
 * stress_threads.c -- hammer what lshm.h documents as thread-safe, from several threads at once,
 * on the same storages, for ThreadSanitizer (or AddressSanitizer) to watch. Not a test of the
 * suite: a maintainer's tool, which meson builds (so it keeps compiling) but never runs. Built
 * in a build directory configured for a sanitizer, the library it links is instrumented too:
 *
 *   CC=clang meson setup build-tsan -Db_sanitize=thread -Db_lundef=false
 *   ninja -C build-tsan && build-tsan/tests/c/stress_threads [rounds [part]]
 *
 * (default: 4 rounds of every part, about 15 s under ThreadSanitizer on 2 CPUs).
 *
 * What it runs (each part in rounds, THREADS threads started together at a barrier):
 *   share      one storage shared by every thread at once (slab pages, default pages below
 *              and above the chunk threshold, a WHOLE_PAGES allocator, foreign memory), while
 *              the same threads read data/flags/nbytes/refcount/segment, take fd and export
 *              as soon as it is shared, and retain/release; lshm_storage_share_fenced mixed in
 *   big        a 96 MiB share made alone (the library's helper threads copy beside it) while
 *              the other threads read the storage
 *   slab       many small storages of a few slabs, each shared by one thread while others
 *              share their neighbours, ask lshm_slab_find/knows/stats, then release them from
 *              other threads (the slab empties and starts over under them)
 *   pool       shares and releases of pool-sized storages from every thread (memfds go to the
 *              pool and come back), lshm_pool_trim beside them
 *   readonly   lshm_storage_share_readonly of one storage from every thread at once
 *   lifetime   the last release of a shared storage on any thread; segments and views
 *              retained and released across threads; create_shared, attach
 *   resize     one thread resizes a storage (it holds the one reference) while the others
 *              read its accessors through the same pointer
 *   arena      storages of a shared arena used from other threads, buffers retained and
 *              released after the arena is gone; lshm_arena_interrupt beside end_iteration
 *   planner    lshm_plan on every thread, lshm_plan_interrupt beside them
 *   uffd       the program closes libshm's userfaultfd while threads share (it reopens one)
 * Prints one line per part; exits 1 at the first wrong result.
 */
#include <lshm.h>

#include "task.h" /* (tests/c: userfaultfd_number) */

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define THREADS 4

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: FAIL: %s (last error: %s)\n", __FILE__, __LINE__, #cond,  \
                    lshm_last_error());                                                       \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)
#define CHECK_OK(call)                                                                        \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_ != 0) {                                                                       \
            fprintf(stderr, "%s:%d: FAIL: %s returned %s (%s)\n", __FILE__, __LINE__, #call,  \
                    lshm_err_name(rc_), lshm_last_error());                                   \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static pthread_barrier_t barrier;
static size_t page;

/* Run fn(arg, index) on THREADS threads that start together. */
static void run_threads(void *(*fn)(void *), void *args, size_t arg_size) {
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, fn, (char *)args + (size_t)i * arg_size) == 0);
    for (int i = 0; i < THREADS; i++)
        CHECK(pthread_join(t[i], NULL) == 0);
}

/* ---- share: one storage, every thread ------------------------------------------------------ */

typedef struct share_arg {
    lshm_storage *s;
    void *data;  /* before the share */
    int moves;   /* foreign memory: the data pointer changes */
    int index;
} share_arg;

static void *share_one(void *p) {
    share_arg *a = p;
    lshm_storage *s = a->s;
    pthread_barrier_wait(&barrier);
    int rc = 0;
    if (a->moves) {
        /* Memory that moves is refused (EBUSY) while other references exist: only thread 0
         * shares; the others only read, borrowing the caller's reference. */
        if (a->index == 0)
            rc = lshm_storage_share(s);
    } else {
        lshm_storage *mine = lshm_storage_retain(s);
        rc = a->index % 2 ? lshm_storage_share_fenced(s) : lshm_storage_share(s);
        if (rc == -EOPNOTSUPP) /* (no fence in this process: the ordinary share) */
            rc = lshm_storage_share(s);
        lshm_storage_release(mine);
    }
    CHECK_OK(rc);
    for (int k = 0; k < 50; k++) {
        unsigned flags = lshm_storage_flags(s);
        void *data = lshm_storage_data(s);
        size_t n = lshm_storage_nbytes(s);
        (void)lshm_storage_refcount(s);
        (void)lshm_storage_segment(s);
        if (!a->moves)
            CHECK(data == a->data);
        if ((flags & LSHM_STORAGE_SHARED) != 0) {
            int fd;
            uint64_t off;
            lshm_export_info info;
            CHECK_OK(lshm_storage_fd(s, &fd, &off));
            CHECK_OK(lshm_storage_export(s, &info));
            CHECK(info.fd == fd && info.offset == off && info.nbytes == n);
            CHECK(info.data == data || a->moves);
            if (n > 0) {
                volatile unsigned char *b = info.data;
                CHECK(b[0] == 0x5a && b[n - 1] == 0x5a);
            }
        }
    }
    return NULL;
}

static void *alloc_pages(void *ctx, size_t nbytes) {
    (void)ctx;
    size_t len = (nbytes + page - 1) / page * page;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void free_pages(void *ctx, void *p, size_t nbytes) {
    (void)ctx;
    munmap(p, (nbytes + page - 1) / page * page);
}

static void release_malloc(void *ctx, void *data, size_t nbytes) {
    (void)ctx;
    (void)nbytes;
    free(data);
}

static void part_share(int rounds) {
    static const size_t sizes[] = {100, 4096, 40000, 65536, 300000, 1536 << 10, 4 << 20};
    lshm_allocator whole = {alloc_pages, free_pages, NULL, LSHM_ALLOCATOR_WHOLE_PAGES};
    int kinds = 0;
    for (int r = 0; r < rounds; r++) {
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            for (int kind = 0; kind < 3; kind++) { /* default, WHOLE_PAGES, foreign */
                size_t n = sizes[k];
                lshm_storage *s;
                if (kind == 0) {
                    CHECK_OK(lshm_storage_create(n, NULL, 0, &s));
                } else if (kind == 1) {
                    CHECK_OK(lshm_storage_create(n, &whole, 0, &s));
                } else {
                    void *mem = malloc(n);
                    CHECK(mem != NULL);
                    CHECK_OK(lshm_storage_create_foreign(mem, n, release_malloc, NULL, 0, &s));
                }
                memset(lshm_storage_data(s), 0x5a, n);
                share_arg args[THREADS];
                for (int i = 0; i < THREADS; i++)
                    args[i] = (share_arg){s, lshm_storage_data(s), kind == 2, i};
                run_threads(share_one, args, sizeof args[0]);
                CHECK(lshm_storage_flags(s) & LSHM_STORAGE_SHARED);
                CHECK(lshm_storage_refcount(s) == 1);
                lshm_storage_release(s);
                kinds++;
            }
        }
    }
    printf("share:    %d storages shared by %d threads at once\n", kinds, THREADS);
}

/* ---- big: one share alone (the library's helper threads) while the others read ------------ */

static void *big_one(void *p) {
    share_arg *a = p;
    pthread_barrier_wait(&barrier);
    if (a->index == 0) {
        CHECK_OK(lshm_storage_share(a->s));
        return NULL;
    }
    /* Readers that borrow the sharer's reference: accessors, and fd/export once shared. */
    while ((lshm_storage_flags(a->s) & LSHM_STORAGE_SHARED) == 0) {
        CHECK(lshm_storage_nbytes(a->s) == (size_t)96 << 20);
        CHECK(a->moves || lshm_storage_data(a->s) == a->data);
    }
    lshm_export_info info;
    CHECK_OK(lshm_storage_export(a->s, &info));
    CHECK(info.nbytes == (size_t)96 << 20 && info.data == lshm_storage_data(a->s));
    return NULL;
}

static void part_big(int rounds) {
    const size_t n = (size_t)96 << 20; /* (64 MiB and up: copies split over two threads) */
    for (int r = 0; r < rounds; r++) {
        for (int kind = 0; kind < 2; kind++) { /* default pages (2 MiB-aligned), foreign */
            lshm_storage *s;
            if (kind == 0) {
                CHECK_OK(lshm_storage_create(n, NULL, 0, &s));
            } else {
                void *mem = malloc(n);
                CHECK(mem != NULL);
                CHECK_OK(lshm_storage_create_foreign(mem, n, release_malloc, NULL, 0, &s));
            }
            unsigned char *b = lshm_storage_data(s);
            for (size_t i = 0; i < n; i += page)
                b[i] = (unsigned char)(i / page);
            share_arg args[THREADS];
            for (int i = 0; i < THREADS; i++)
                args[i] = (share_arg){s, b, kind == 1, i};
            run_threads(big_one, args, sizeof args[0]);
            b = lshm_storage_data(s);
            for (size_t i = 0; i < n; i += page)
                CHECK(b[i] == (unsigned char)(i / page));
            lshm_storage_release(s);
        }
    }
    printf("big:      %d rounds of a 96 MiB share beside readers\n", rounds);
}

/* ---- slab: neighbours shared and released on different threads ---------------------------- */

enum { SLAB_STORAGES = 48 };

typedef struct slab_arg {
    lshm_storage **s; /* SLAB_STORAGES storages, one reference each, for the releasers */
    int index;
} slab_arg;

static void *slab_work(void *p) {
    slab_arg *a = p;
    pthread_barrier_wait(&barrier);
    /* Share every THREADS-th storage (neighbours go to other threads), then look the others
     * up as a receiver would. */
    for (int i = a->index; i < SLAB_STORAGES; i += THREADS)
        CHECK_OK(lshm_storage_share(a->s[i]));
    lshm_slab_counters c;
    CHECK_OK(lshm_slab_stats(&c));
    for (int i = (a->index + 1) % THREADS; i < SLAB_STORAGES; i += THREADS) {
        lshm_storage *s = a->s[i];
        lshm_export_info info;
        if ((lshm_storage_flags(s) & LSHM_STORAGE_SHARED) == 0)
            continue; /* (its thread has not got there yet) */
        CHECK_OK(lshm_storage_export(s, &info));
        CHECK(lshm_slab_knows(info.dev, info.ino) == 1);
        lshm_storage *found = NULL;
        CHECK_OK(lshm_slab_find(info.dev, info.ino, info.offset, info.nbytes, &found));
        CHECK(found == s);
        lshm_storage_release(found);
    }
    pthread_barrier_wait(&barrier);
    /* Release the storages of the next thread (another thread's slab pages go back). */
    for (int i = (a->index + 1) % THREADS; i < SLAB_STORAGES; i += THREADS)
        lshm_storage_release(a->s[i]);
    return NULL;
}

static void part_slab(int rounds) {
    for (int r = 0; r < rounds; r++) {
        lshm_storage *s[SLAB_STORAGES];
        for (int i = 0; i < SLAB_STORAGES; i++) {
            size_t n = (size_t)(1 + (i * 7 + r) % 16) * page - (size_t)(i % 3) * 100;
            CHECK_OK(lshm_storage_create(n, NULL, 0, &s[i]));
            memset(lshm_storage_data(s[i]), i, n);
        }
        slab_arg args[THREADS];
        for (int i = 0; i < THREADS; i++)
            args[i] = (slab_arg){s, i};
        run_threads(slab_work, args, sizeof args[0]);
    }
    lshm_slab_counters c;
    CHECK_OK(lshm_slab_stats(&c));
    CHECK(c.storages == 0);
    printf("slab:     %d rounds of %d neighbours shared and released across threads\n", rounds,
           SLAB_STORAGES);
}

/* ---- pool ---------------------------------------------------------------------------------- */

typedef struct pool_arg {
    int rounds, index;
} pool_arg;

static void *pool_work(void *p) {
    pool_arg *a = p;
    pthread_barrier_wait(&barrier);
    for (int r = 0; r < a->rounds; r++) {
        if (a->index == 0 && r % 4 == 3) {
            (void)lshm_pool_trim();
            continue;
        }
        lshm_storage *s;
        size_t n = (size_t)(256 + 64 * (r % 2)) << 10; /* two capacities below 1 MiB */
        CHECK_OK(lshm_storage_create(n, NULL, 0, &s));
        unsigned char *b = lshm_storage_data(s);
        b[0] = (unsigned char)r;
        b[n - 1] = (unsigned char)a->index;
        CHECK_OK(lshm_storage_share(s));
        CHECK(b[0] == (unsigned char)r && b[n - 1] == (unsigned char)a->index);
        lshm_storage_release(s); /* its memfd goes to the pool */
    }
    return NULL;
}

static void part_pool(int rounds) {
    pool_arg args[THREADS];
    for (int i = 0; i < THREADS; i++)
        args[i] = (pool_arg){rounds * 8, i};
    run_threads(pool_work, args, sizeof args[0]);
    printf("pool:     %d shares and releases per thread, lshm_pool_trim beside them (%d kept)\n",
           rounds * 8, lshm_pool_trim());
}

/* ---- readonly ------------------------------------------------------------------------------ */

static void *readonly_one(void *p) {
    share_arg *a = p;
    pthread_barrier_wait(&barrier);
    CHECK_OK(lshm_storage_share_readonly(a->s));
    lshm_export_info info;
    CHECK_OK(lshm_storage_export(a->s, &info));
    CHECK(info.readonly == 1 && info.data == a->data);
    return NULL;
}

static void part_readonly(int rounds) {
    for (int r = 0; r < rounds; r++) {
        static const size_t sizes[] = {4096, 65536, 300000};
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            lshm_storage *s;
            CHECK_OK(lshm_storage_create(sizes[k], NULL, 0, &s));
            share_arg args[THREADS];
            for (int i = 0; i < THREADS; i++)
                args[i] = (share_arg){s, lshm_storage_data(s), 0, i};
            run_threads(readonly_one, args, sizeof args[0]);
            lshm_storage_release(s);
        }
    }
    printf("readonly: %d storages shared read-only by %d threads at once\n", rounds * 3,
           THREADS);
}

/* ---- lifetime: last release anywhere, segments and views across threads -------------------- */

typedef struct life_arg {
    lshm_storage *s;
    lshm_segment *seg;
    lshm_storage *views[THREADS];
    int index;
} life_arg;

static void *life_work(void *p) {
    life_arg *a = p;
    pthread_barrier_wait(&barrier);
    /* Each thread holds one reference of s and of seg, and one view of another thread's. */
    for (int k = 0; k < 100; k++) {
        lshm_storage_release(lshm_storage_retain(a->s));
        lshm_segment_release(lshm_segment_retain(a->seg));
    }
    int fd;
    CHECK_OK(lshm_segment_fd(a->seg, &fd));
    CHECK(lshm_segment_data(a->seg) != NULL && lshm_segment_size(a->seg) == 3 * page);
    lshm_storage *att;
    CHECK_OK(lshm_storage_attach(fd, page, page, 0, &att));
    lshm_storage *view = a->views[(a->index + 1) % THREADS];
    CHECK(lshm_storage_data(att) != lshm_storage_data(view) || a->index == 0);
    lshm_storage_release(att);
    lshm_storage_release(view);
    lshm_storage *made;
    CHECK_OK(lshm_storage_create_shared(a->index % 2 ? 5000 : 100000, 0, &made));
    lshm_storage_release(made);
    lshm_segment_release(a->seg);
    lshm_storage_release(a->s); /* one of these is the last */
    return NULL;
}

static void part_lifetime(int rounds) {
    for (int r = 0; r < rounds; r++) {
        lshm_storage *s;
        lshm_segment *seg;
        CHECK_OK(lshm_storage_create(r % 2 ? 8192 : 200000, NULL, 0, &s));
        CHECK_OK(lshm_storage_share(s));
        CHECK_OK(lshm_segment_create(3 * page, 0, &seg));
        life_arg args[THREADS];
        lshm_storage *views[THREADS];
        for (int i = 0; i < THREADS; i++)
            CHECK_OK(lshm_storage_create_view(seg, (uint64_t)(i % 3) * page, page, 0,
                                              &views[i]));
        for (int i = 0; i < THREADS; i++) {
            args[i] = (life_arg){lshm_storage_retain(s), lshm_segment_retain(seg), {0}, i};
            memcpy(args[i].views, views, sizeof views);
        }
        lshm_storage_release(s);
        lshm_segment_release(seg);
        run_threads(life_work, args, sizeof args[0]);
    }
    printf("lifetime: %d rounds of last releases on any thread\n", rounds);
}

/* ---- resize beside the accessors ----------------------------------------------------------- */

typedef struct resize_arg {
    lshm_storage *s;
    _Atomic int *stop;
    int index;
} resize_arg;

static void *resize_work(void *p) {
    resize_arg *a = p;
    pthread_barrier_wait(&barrier);
    if (a->index == 0) {
        for (int k = 0; k < 400; k++)
            CHECK_OK(lshm_storage_resize(a->s, (size_t)(1 + k % 7) * 3000));
        atomic_store(a->stop, 1);
        return NULL;
    }
    /* Borrowing the resizer's reference (a Python thread reading Storage.nbytes while another
     * runs resize_ on the same handle: lshm.h says reading is safe from any thread). */
    size_t seen = 0;
    while (!atomic_load(a->stop)) {
        seen += lshm_storage_nbytes(a->s);
        (void)lshm_storage_data(a->s);
        (void)lshm_storage_flags(a->s);
        (void)lshm_storage_refcount(a->s);
    }
    return (void *)seen;
}

static void part_resize(int rounds) {
    for (int r = 0; r < rounds; r++) {
        lshm_storage *s;
        CHECK_OK(lshm_storage_create(1000, NULL, LSHM_STORAGE_RESIZABLE, &s));
        _Atomic int stop = 0;
        resize_arg args[THREADS];
        for (int i = 0; i < THREADS; i++)
            args[i] = (resize_arg){s, &stop, i};
        run_threads(resize_work, args, sizeof args[0]);
        lshm_storage_release(s);
    }
    printf("resize:   %d rounds of resizes beside readers of the accessors\n", rounds);
}

/* ---- arena --------------------------------------------------------------------------------- */

typedef struct arena_arg {
    lshm_arena *arena;
    lshm_storage *slots[THREADS];
    lshm_arena_buffer *buf;
    int index;
} arena_arg;

static void *arena_work(void *p) {
    arena_arg *a = p;
    pthread_barrier_wait(&barrier);
    lshm_storage *s = a->slots[a->index];
    for (int k = 0; k < 50; k++) {
        lshm_export_info info;
        CHECK_OK(lshm_storage_export(s, &info));
        memset(info.data, a->index, info.nbytes);
        lshm_storage_release(lshm_storage_retain(s));
        lshm_arena_buffer_release(lshm_arena_buffer_retain(a->buf));
    }
    lshm_storage_release(s); /* (the reference main took for us) */
    pthread_barrier_wait(&barrier); /* main deallocates and destroys the arena */
    pthread_barrier_wait(&barrier);
    CHECK(lshm_arena_buffer_size(a->buf) > 0 && lshm_arena_buffer_data(a->buf) != NULL);
    lshm_arena_buffer_release(a->buf); /* one of these unmaps it */
    return NULL;
}

static void *arena_main(void *p) {
    arena_arg *a = p;
    if (a->index != 0)
        return arena_work(p);
    /* Thread 0 is the arena's owner: it also works on its own slot. */
    pthread_barrier_wait(&barrier);
    lshm_storage *s = a->slots[0];
    memset(lshm_storage_data(s), 1, lshm_storage_nbytes(s));
    lshm_storage_release(s);
    pthread_barrier_wait(&barrier);
    CHECK_OK(lshm_arena_deallocate(a->arena));
    CHECK_OK(lshm_arena_destroy(a->arena));
    pthread_barrier_wait(&barrier);
    lshm_arena_buffer_release(a->buf);
    return NULL;
}

typedef struct interrupt_arg {
    lshm_arena *arena;
    _Atomic int *stop;
    int index;
} interrupt_arg;

static void *interrupt_work(void *p) {
    interrupt_arg *a = p;
    pthread_barrier_wait(&barrier);
    if (a->index != 0) {
        while (!atomic_load(a->stop))
            (void)lshm_arena_interrupt(a->arena);
        return NULL;
    }
    for (int it = 0; it < 4; it++) {
        lshm_storage *st[64];
        for (int i = 0; i < 64; i++)
            CHECK_OK(lshm_arena_alloc(a->arena, (size_t)(64 + (i * 37 + it) % 900), &st[i]));
        for (int i = 0; i < 64; i++)
            CHECK_OK(lshm_arena_free(a->arena, st[(i * 29) % 64]));
        int rc = lshm_arena_end_iteration(a->arena);
        CHECK(rc == 0 || rc == -ECANCELED);
    }
    atomic_store(a->stop, 1);
    return NULL;
}

static void part_arena(int rounds) {
    enum { N = THREADS };
    uint64_t sizes[N] = {5000, 100, 64 << 10, 12345};
    int64_t firsts[N] = {0, 0, 1, 1}, lasts[N] = {2, 2, 3, 3};
    for (int r = 0; r < rounds; r++) {
        lshm_arena *arena;
        CHECK_OK(lshm_arena_create(N, sizes, firsts, lasts, NULL, LSHM_ARENA_SHARED, &arena));
        CHECK_OK(lshm_arena_allocate(arena));
        lshm_arena_buffer *buf;
        CHECK_OK(lshm_arena_current_buffer(arena, &buf));
        arena_arg args[THREADS];
        for (int i = 0; i < THREADS; i++) {
            args[i] = (arena_arg){arena, {0}, lshm_arena_buffer_retain(buf), i};
            for (int j = 0; j < N; j++)
                CHECK_OK(lshm_arena_storage(arena, (size_t)j, &args[i].slots[j]));
            lshm_storage_retain(args[i].slots[i]); /* (released by thread i) */
        }
        run_threads(arena_main, args, sizeof args[0]);

        lshm_plan_options opts;
        lshm_plan_options_init(&opts);
        opts.time_limit = 0.05;
        CHECK_OK(lshm_arena_create_recording(&opts, r % 2 ? LSHM_ARENA_SHARED : 0, &arena));
        _Atomic int stop = 0;
        interrupt_arg iargs[THREADS];
        for (int i = 0; i < THREADS; i++)
            iargs[i] = (interrupt_arg){arena, &stop, i};
        run_threads(interrupt_work, iargs, sizeof iargs[0]);
        CHECK_OK(lshm_arena_destroy(arena));
    }
    printf("arena:    %d rounds of slots and buffers across threads, interrupts\n", rounds);
}

/* ---- planner ------------------------------------------------------------------------------- */

typedef struct plan_arg {
    lshm_plan_options *shared_opts;
    _Atomic int *stop;
    int index;
} plan_arg;

static void *plan_work(void *p) {
    plan_arg *a = p;
    enum { N = 300 };
    uint64_t sizes[N], offsets[N];
    int64_t firsts[N], lasts[N];
    for (int i = 0; i < N; i++) {
        sizes[i] = (uint64_t)(1 + (i * 7919 + a->index) % 5000);
        firsts[i] = (i * 13) % 200;
        lasts[i] = firsts[i] + 1 + (i * 31) % 50;
    }
    pthread_barrier_wait(&barrier);
    if (a->index == THREADS - 1) {
        while (!atomic_load(a->stop))
            (void)lshm_plan_interrupt(a->shared_opts);
        return NULL;
    }
    for (int k = 0; k < 3; k++) {
        lshm_plan_result res;
        lshm_plan_options own;
        lshm_plan_options_init(&own);
        lshm_plan_options *opts = k == 1 ? a->shared_opts : &own;
        int rc = lshm_plan(N, sizes, firsts, lasts, NULL, opts, offsets, &res);
        CHECK(rc == 0 || (rc == -ECANCELED && opts == a->shared_opts));
        if (rc == 0)
            CHECK_OK(lshm_plan_validate(N, sizes, firsts, lasts, offsets, opts, res.arena_size));
    }
    return NULL;
}

static void part_planner(int rounds) {
    for (int r = 0; r < rounds; r++) {
        lshm_plan_options opts;
        lshm_plan_options_init(&opts);
        opts.time_limit = 0.02;
        _Atomic int stop = 0;
        plan_arg args[THREADS];
        for (int i = 0; i < THREADS; i++)
            args[i] = (plan_arg){&opts, &stop, i};
        pthread_t t[THREADS];
        for (int i = 0; i < THREADS; i++)
            CHECK(pthread_create(&t[i], NULL, plan_work, &args[i]) == 0);
        for (int i = 0; i < THREADS - 1; i++)
            CHECK(pthread_join(t[i], NULL) == 0);
        atomic_store(&stop, 1);
        CHECK(pthread_join(t[THREADS - 1], NULL) == 0);
    }
    printf("planner:  %d rounds of plans on %d threads, interrupts beside them\n", rounds,
           THREADS - 1);
}

/* ---- uffd: the program closes libshm's userfaultfd while threads share --------------------- */

typedef struct uffd_arg {
    int index;
} uffd_arg;

static void *uffd_work(void *p) {
    uffd_arg *a = p;
    pthread_barrier_wait(&barrier);
    for (int k = 0; k < 20; k++) {
        if (a->index == 0 && k % 5 == 0) {
            int fd = userfaultfd_number();
            if (fd >= 0)
                close(fd);
        }
        lshm_storage *s;
        CHECK_OK(lshm_storage_create((size_t)(1 + k % 3) * 100000, NULL, 0, &s));
        CHECK_OK(lshm_storage_share(s));
        lshm_storage_release(s);
    }
    return NULL;
}

static void part_uffd(int rounds) {
    if (userfaultfd_number() < 0) {
        printf("uffd:     skipped (this process has no userfaultfd)\n");
        return;
    }
    for (int r = 0; r < rounds; r++) {
        uffd_arg args[THREADS];
        for (int i = 0; i < THREADS; i++)
            args[i] = (uffd_arg){i};
        run_threads(uffd_work, args, sizeof args[0]);
    }
    printf("uffd:     %d rounds of shares while the userfaultfd is closed under them (%s)\n",
           rounds, userfaultfd_number() >= 0 ? "reopened" : "none now");
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 4;
    const char *only = argc > 2 ? argv[2] : "";
    page = lshm_page_size();
    CHECK(pthread_barrier_init(&barrier, NULL, THREADS) == 0);
    static const struct {
        const char *name;
        void (*fn)(int);
    } parts[] = {{"share", part_share},     {"big", part_big},         {"slab", part_slab},
                 {"pool", part_pool},
                 {"readonly", part_readonly}, {"lifetime", part_lifetime}, {"resize", part_resize},
                 {"arena", part_arena},     {"planner", part_planner}, {"uffd", part_uffd}};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        if (*only == '\0' || strcmp(only, parts[i].name) == 0)
            parts[i].fn(rounds);
    pthread_barrier_destroy(&barrier);
    printf("OK\n");
    return 0;
}
