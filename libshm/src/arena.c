/*
 * arena.c -- the arena: a slab of storage structs backed by slices of one buffer.
 *
 * This is PyTorch's static-runtime MemoryPlanner done in C: the storages of a planned set live
 * in one malloced slab and are initialised and finalised in place (they never move, so their
 * addresses can be handed out as identities), and their bytes are slices of one buffer whose
 * layout lshm_plan computed. Unlike the anchor:
 *   - the buffer is placed by the planner (gaps are filled), not laid end to end per group;
 *   - the buffer is kept between iterations instead of being freed every time, so a steady
 *     state costs no mmap at all (lshm_arena_trim gives it back);
 *   - the buffer can be one segment (memfd): the whole set crosses to another process as one
 *     fd, each storage being a view of it;
 *   - a recording arena learns the lifetimes itself: it serves the first iteration with
 *     ordinary allocations while numbering (alloc, free) events as ticks, plans them, and
 *     replays the plan afterwards, re-planning when a request outgrows its slice.
 *
 * Invariants:
 *   - slot i of the slab is initialised iff live_pos[i] != 0 (then live_list[live_pos[i] - 1]
 *     is i); the slab is only reallocated when no slot is live, so no initialised storage ever
 *     moves;
 *   - an initialised slot's bytes lie in [buffer, buffer + plan.arena_size) at offsets[i];
 *   - the buffer is only freed or replaced when no slot is live;
 *   - the buffer is refcounted (lshm_arena_buffer): "freed or replaced" drops the arena's
 *     reference only, and its memory stays mapped while anyone else holds one (pyshm's arrays
 *     over a slice each hold one, so an array whose tensor was freed before a re-plan or a
 *     trim still sees mapped memory, never a hole).
 * Everything touching the OS (mmap, memfd) goes through os_linux.c or segment.c.
 */
#include "internal.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* An ordinary storage of the current iteration and its record (see ordinary_find). */
typedef struct ordinary_entry {
    const lshm_storage *storage; /* NULL: empty */
    size_t k;
} ordinary_entry;

/* One allocation of the current iteration of a recording arena. */
typedef struct arena_record {
    uint64_t size;        /* bytes asked for */
    int64_t first;        /* tick of the alloc */
    int64_t last;         /* tick of the free; -1 while live */
    lshm_storage *storage;/* the storage handed out while live, NULL once freed */
    int in_slot;          /* served by slot (same index) on the buffer, else ordinary */
} arena_record;

struct lshm_arena {
    int recording;            /* created by lshm_arena_create_recording */
    unsigned flags;           /* LSHM_ARENA_* */
    lshm_plan_options opts;   /* alignment and time limit of every plan */

    /* The current plan (count == 0 and have_plan == 0 before a recording arena's first). */
    int have_plan;
    size_t count;             /* tensors planned */
    uint64_t *sizes;          /* planned bytes per tensor (count entries) */
    uint64_t *offsets;        /* planned offsets (count entries) */
    lshm_plan_result plan;
    uint64_t need;            /* buffer bytes: max over tensors of offset + size (at least
                                 plan.arena_size; a tensor never live still gets its slice) */

    /* The slab: capacity slots of stride bytes, aligned to lshm_storage_alignof(). */
    char *slab;
    size_t capacity;          /* slots in the slab (>= count) */
    size_t stride;            /* lshm_storage_sizeof() */
    size_t *live_pos;         /* slot i is initialised iff live_pos[i] != 0: its place in
                                 live_list, plus 1 (capacity entries) */
    size_t *live_list;        /* indices of live slots, in no order (live_count entries) */
    size_t live_count;
    int allocated;            /* planned arenas: allocate succeeded, deallocate not yet */

    /* The buffer (have_buffer: it exists, even when it has zero bytes). */
    int have_buffer;
    lshm_arena_buffer *buf;   /* the arena's reference to it (NULL without a buffer) */
    void *buffer;             /* buf->data: first byte, NULL for zero bytes */
    size_t buffer_size;       /* buf->size: usable bytes (>= plan.arena_size) */
    lshm_segment *segment;    /* buf->segment (borrowed): shared buffers' memfd, else NULL */

    /* The current iteration of a recording arena. */
    arena_record *records;    /* one per alloc of this iteration */
    size_t nrecords, records_cap;
    ordinary_entry *ordinary; /* records served ordinarily, by storage address: open addressing,
                                 a power of two of entries, at most half full; never deleted
                                 from within an iteration (a reused address overwrites) */
    size_t ordinary_cap, ordinary_used;
    size_t outstanding;       /* allocs not freed yet */
    int64_t tick;             /* next event's tick */
    int misfit;               /* a request did not fit this iteration: re-plan at its end */
    int64_t *firsts, *lasts;  /* the ticks the current plan was made from (count entries) */
    int in_order;             /* every event of this iteration came at its planned tick */

    lshm_arena_counters stats;
};

/* A buffer: private anonymous pages or one segment, refcounted so that memory handed out
 * over it can outlive the arena's use of it. */
struct lshm_arena_buffer {
    _Atomic size_t refcount;
    void *data;            /* first byte, NULL for zero bytes */
    size_t size;           /* usable bytes */
    size_t map_len;        /* private buffers: bytes mapped (whole pages), else 0 */
    lshm_segment *segment; /* shared buffers: the buffer's reference to the segment */
};

/* ---- the slab ------------------------------------------------------------------------------ */

/* Make room for n slots; only called while no slot is live (the slab may move). */
static int slab_reserve(lshm_arena *a, size_t n) {
    assert(a->live_count == 0);
    if (n <= a->capacity)
        return 0;
    if (n > SIZE_MAX / a->stride)
        return LSHM_FAIL(-EOVERFLOW, "a slab of %zu storages is too large", n);
    char *slab = aligned_alloc(lshm_storage_alignof(), n * a->stride);
    size_t *pos = calloc(n, sizeof *pos);
    size_t *list = malloc(n * sizeof *list);
    if (slab == NULL || pos == NULL || list == NULL) {
        free(slab);
        free(pos);
        free(list);
        return LSHM_FAIL(-ENOMEM, "malloc of a slab of %zu storages failed", n);
    }
    free(a->slab);
    free(a->live_pos);
    free(a->live_list);
    a->slab = slab;
    a->live_pos = pos;
    a->live_list = list;
    a->capacity = n;
    return 0;
}

static lshm_storage *slot_storage(const lshm_arena *a, size_t i) {
    return (lshm_storage *)(void *)(a->slab + i * a->stride);
}

/* The slot index of s, or -1 when s is not in the slab. Compared as integers: pointers into
 * different objects may not be compared with < in C. */
static ptrdiff_t slot_index(const lshm_arena *a, const lshm_storage *s) {
    uintptr_t p = (uintptr_t)s, base = (uintptr_t)a->slab;
    if (a->slab == NULL || p < base || p >= base + a->capacity * a->stride)
        return -1;
    if ((p - base) % a->stride != 0)
        return -1;
    return (ptrdiff_t)((p - base) / a->stride);
}

/* Initialise slot i in place on its slice (nbytes <= sizes[i]). */
static int slot_init(lshm_arena *a, size_t i, size_t nbytes) {
    assert(i < a->count && a->live_pos[i] == 0 && a->have_buffer);
    assert(nbytes <= a->sizes[i]);
    lshm_storage *s = NULL;
    int rc;
    if (a->segment != NULL)
        rc = lshm_storage_init_view(slot_storage(a, i), a->segment, a->offsets[i], nbytes, 0, &s);
    else
        rc = lshm_storage_init_foreign(slot_storage(a, i),
                                       nbytes > 0 ? (char *)a->buffer + a->offsets[i] : NULL,
                                       nbytes, NULL, NULL, 0, &s);
    if (rc != 0)
        return rc;
    s->in_arena = 1; /* (lshm_storage_fini refuses it: the arena's bookkeeping would be stale) */
    a->live_list[a->live_count++] = i;
    a->live_pos[i] = a->live_count;
    return 0;
}

/* Finalise slot i in place; the caller checked that only the arena's reference is left. */
static void slot_fini(lshm_arena *a, size_t i) {
    assert(a->live_pos[i] != 0);
    slot_storage(a, i)->in_arena = 0;
    int rc = lshm_storage_fini(slot_storage(a, i));
    assert(rc == 0);
    (void)rc;
    /* O(1): the last live slot takes i's place in the list. */
    size_t j = a->live_pos[i] - 1, last = a->live_list[--a->live_count];
    a->live_list[j] = last;
    a->live_pos[last] = j + 1;
    a->live_pos[i] = 0;
}

/* ---- the buffer ---------------------------------------------------------------------------- */

lshm_arena_buffer *lshm_arena_buffer_retain(lshm_arena_buffer *buf) {
    if (buf != NULL)
        lshm__ref_retain(&buf->refcount);
    return buf;
}

void lshm_arena_buffer_release(lshm_arena_buffer *buf) {
    if (buf == NULL || !lshm__ref_release(&buf->refcount))
        return;
    if (buf->segment != NULL)
        lshm_segment_release(buf->segment);
    else if (buf->map_len > 0)
        lshm__os_unmap(buf->data, buf->map_len);
    free(buf);
}

void *lshm_arena_buffer_data(const lshm_arena_buffer *buf) {
    return buf == NULL ? NULL : buf->data;
}

size_t lshm_arena_buffer_size(const lshm_arena_buffer *buf) {
    return buf == NULL ? 0 : buf->size;
}

/* Drop the arena's reference to its buffer (the memory goes with the last reference). */
static void buffer_free(lshm_arena *a) {
    assert(a->live_count == 0);
    lshm_arena_buffer_release(a->buf);
    a->buf = NULL;
    a->segment = NULL;
    a->buffer = NULL;
    a->buffer_size = 0;
    a->have_buffer = 0;
}

/* A new buffer of `size` bytes in *out; the arena is not changed. */
static int buffer_make(const lshm_arena *a, uint64_t size, lshm_arena_buffer **out) {
    if (size > SIZE_MAX)
        return LSHM_FAIL(-EOVERFLOW, "an arena of %llu bytes does not fit in memory",
                         (unsigned long long)size);
    lshm_arena_buffer *buf = calloc(1, sizeof *buf);
    if (buf == NULL)
        return LSHM_FAIL(-ENOMEM, "malloc of an arena buffer struct failed");
    int rc;
    if ((a->flags & LSHM_ARENA_SHARED) != 0) {
        lshm_segment *seg = NULL;
        if ((rc = lshm_segment_create((size_t)size, 0, &seg)) != 0)
            goto fail;
        buf->segment = seg;
        buf->data = lshm_segment_data(seg);
    } else {
        size_t len = 0;
        if ((rc = lshm__round_pages((size_t)size, &len)) != 0)
            goto fail;
        void *p = NULL;
        if (len > 0 && (rc = lshm__os_map_anon_pages(len, &p)) != 0)
            goto fail;
        buf->data = p;
        buf->map_len = len;
    }
    atomic_init(&buf->refcount, 1);
    buf->size = (size_t)size;
    *out = buf;
    return 0;

fail:
    free(buf);
    return rc;
}

/* Replace the arena's buffer by `buf` (its reference is taken over). */
static void buffer_set(lshm_arena *a, lshm_arena_buffer *buf) {
    buffer_free(a);
    a->buf = buf;
    a->segment = buf->segment;
    a->buffer = buf->data;
    a->buffer_size = buf->size;
    a->have_buffer = 1;
}

/* Does the arena's buffer hold `size` bytes already? */
static int buffer_fits(const lshm_arena *a, uint64_t size) {
    return a->have_buffer && a->buffer_size >= size;
}

/* Make sure a buffer of at least `size` bytes exists; *reused says it existed already. The old
 * buffer goes first (a planned arena's buffer is only too small after a trim anyway). */
static int buffer_ensure(lshm_arena *a, uint64_t size, int *reused) {
    *reused = buffer_fits(a, size);
    if (*reused)
        return 0;
    buffer_free(a);
    lshm_arena_buffer *buf = NULL;
    int rc = buffer_make(a, size, &buf);
    if (rc != 0)
        return rc;
    buffer_set(a, buf);
    return 0;
}

/* ---- plans --------------------------------------------------------------------------------- */

/* Plan n tensors and install the plan (sizes are taken over: the arena frees them). With
 * `with_buffer`, a buffer the plan fits in is made too, before anything is installed: a
 * failure (the planner's, or no memory for the buffer) leaves the plan and buffer as they
 * were. */
static int install_plan(lshm_arena *a, size_t n, uint64_t *sizes, const int64_t *firsts,
                        const int64_t *lasts, const lshm_plan_options *opts, int with_buffer) {
    uint64_t *offsets = n > 0 ? malloc(n * sizeof *offsets) : NULL;
    if (n > 0 && offsets == NULL) {
        free(sizes);
        return LSHM_FAIL(-ENOMEM, "malloc of %zu offsets failed", n);
    }
    lshm_plan_result result;
    int rc = lshm_plan(n, sizes, firsts, lasts, NULL, opts, offsets, &result);
    uint64_t managed = 0, need = result.arena_size;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        /* (saturated: tensors never live together may sum past 64 bits) */
        managed = sizes[i] > UINT64_MAX - managed ? UINT64_MAX : managed + sizes[i];
        if (sizes[i] > 0 && offsets[i] + sizes[i] > need)
            need = offsets[i] + sizes[i];
    }
    lshm_arena_buffer *buf = NULL;
    if (rc == 0 && with_buffer && !buffer_fits(a, need))
        rc = buffer_make(a, need, &buf);
    if (rc == 0)
        rc = slab_reserve(a, n); /* (only grows: harmless if kept with the old plan) */
    if (rc != 0) {
        lshm_arena_buffer_release(buf);
        free(sizes);
        free(offsets);
        return rc;
    }
    free(a->sizes);
    free(a->offsets);
    a->sizes = sizes;
    a->offsets = offsets;
    a->count = n;
    a->plan = result;
    a->have_plan = 1;
    a->need = need;
    a->stats.managed_bytes = managed;
    a->stats.arena_bytes = need;
    a->stats.lower_bound = result.lower_bound;
    a->stats.storages = n;
    if (buf != NULL)
        buffer_set(a, buf);
    return 0;
}

static int arena_new(const lshm_plan_options *opts, unsigned flags, int recording,
                     lshm_arena **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    if ((flags & ~LSHM_ARENA_SHARED) != 0)
        return LSHM_FAIL(-EINVAL, "unknown arena flags 0x%x", flags & ~LSHM_ARENA_SHARED);
    lshm_arena *a = calloc(1, sizeof *a);
    if (a == NULL)
        return LSHM_FAIL(-ENOMEM, "malloc of an arena failed");
    a->recording = recording;
    a->flags = flags;
    a->stride = lshm_storage_sizeof();
    assert(a->stride % lshm_storage_alignof() == 0);
    if (opts != NULL)
        a->opts = *opts;
    else
        lshm_plan_options_init(&a->opts);
    *out = a;
    return 0;
}

static void arena_free(lshm_arena *a) {
    buffer_free(a);
    free(a->slab);
    free(a->live_pos);
    free(a->live_list);
    free(a->sizes);
    free(a->offsets);
    free(a->records);
    free(a->ordinary);
    free(a->firsts);
    free(a->lasts);
    free(a);
}

int lshm_arena_create(size_t n, const uint64_t *sizes, const int64_t *firsts,
                      const int64_t *lasts, const lshm_plan_options *opts, unsigned flags,
                      lshm_arena **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    if (n > 0 && (sizes == NULL || firsts == NULL || lasts == NULL))
        return LSHM_FAIL(-EINVAL, "NULL sizes, firsts or lasts for %zu tensors", n);
    if (n > SIZE_MAX / sizeof(uint64_t))
        return LSHM_FAIL(-EOVERFLOW, "%zu tensors are too many", n);
    for (size_t i = 0; i < n; i++)
        if (sizes[i] > SIZE_MAX)
            return LSHM_FAIL(-EOVERFLOW, "tensor %zu: %llu bytes do not fit in memory", i,
                             (unsigned long long)sizes[i]);
    lshm_arena *a = NULL;
    int rc = arena_new(opts, flags, 0, &a);
    if (rc != 0)
        return rc;
    uint64_t *copy = n > 0 ? malloc(n * sizeof *copy) : NULL;
    if (n > 0 && copy == NULL) {
        arena_free(a);
        return LSHM_FAIL(-ENOMEM, "malloc of %zu sizes failed", n);
    }
    if (n > 0)
        memcpy(copy, sizes, n * sizeof *copy);
    /* (the caller's options, so that lshm_plan_interrupt(opts) reaches this plan) */
    if ((rc = install_plan(a, n, copy, firsts, lasts, opts != NULL ? opts : &a->opts, 0)) != 0) {
        arena_free(a);
        return rc;
    }
    *out = a;
    return 0;
}

int lshm_arena_interrupt(const lshm_arena *a) {
    if (a == NULL)
        return LSHM_FAIL(-EINVAL, "lshm_arena_interrupt: NULL arena");
    return lshm_plan_interrupt(&a->opts);
}

int lshm_arena_create_recording(const lshm_plan_options *opts, unsigned flags,
                                lshm_arena **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    lshm_arena *a = NULL;
    int rc = arena_new(opts, flags, 1, &a);
    if (rc != 0)
        return rc;
    /* The arena numbers its own ticks half-open: alloc at t, free at u, live on [t, u). */
    a->opts.flags &= ~LSHM_PLAN_INCLUSIVE;
    *out = a;
    return 0;
}

/* ---- planned arenas ------------------------------------------------------------------------ */

static int check_planned(const lshm_arena *a, const char *what) {
    if (a == NULL)
        return LSHM_FAIL(-EINVAL, "%s: NULL arena", what);
    if (a->recording)
        return LSHM_FAIL(-EINVAL, "%s: a recording arena serves lshm_arena_alloc instead", what);
    return 0;
}

int lshm_arena_allocate(lshm_arena *a) {
    int rc = check_planned(a, "allocate");
    if (rc != 0)
        return rc;
    if (a->allocated)
        return LSHM_FAIL(-EBUSY, "arena %p is allocated already: deallocate first", (void *)a);
    int reused = 0;
    if ((rc = buffer_ensure(a, a->need, &reused)) != 0)
        return rc;
    for (size_t i = 0; i < a->count; i++) {
        if ((rc = slot_init(a, i, (size_t)a->sizes[i])) != 0) {
            while (a->live_count > 0) /* fresh storages: only the arena's reference */
                slot_fini(a, a->live_list[a->live_count - 1]);
            return rc;
        }
    }
    a->allocated = 1;
    if (reused)
        a->stats.reuse_count += a->count;
    return 0;
}

/* -EBUSY unless every live slot holds only the arena's reference. */
static int check_unreferenced(const lshm_arena *a, const char *what) {
    for (size_t j = 0; j < a->live_count; j++) {
        size_t i = a->live_list[j];
        size_t refs = lshm_storage_refcount(slot_storage(a, i));
        if (refs != 1)
            return LSHM_FAIL(-EBUSY,
                             "%s: storage %zu of arena %p still has %zu references "
                             "beyond the arena's own",
                             what, i, (const void *)a, refs - 1);
    }
    return 0;
}

int lshm_arena_deallocate(lshm_arena *a) {
    int rc = check_planned(a, "deallocate");
    if (rc != 0)
        return rc;
    if (!a->allocated)
        return 0;
    /* Check everything before touching anything, so a refusal changes nothing. No other
     * thread can add a reference meanwhile: that needs one already, and the refcounts are 1. */
    if ((rc = check_unreferenced(a, "deallocate")) != 0)
        return rc;
    while (a->live_count > 0)
        slot_fini(a, a->live_list[a->live_count - 1]);
    a->allocated = 0;
    a->stats.iterations++;
    return 0;
}

int lshm_arena_trim(lshm_arena *a) {
    if (a == NULL)
        return LSHM_FAIL(-EINVAL, "trim: NULL arena");
    if (a->live_count > 0)
        return LSHM_FAIL(-EBUSY, "trim: %zu storages of arena %p still use the buffer",
                         a->live_count, (void *)a);
    buffer_free(a);
    return 0;
}

int lshm_arena_destroy(lshm_arena *a) {
    if (a == NULL)
        return 0;
    if (a->recording && a->outstanding > 0)
        return LSHM_FAIL(-EBUSY, "destroy: %zu storages of arena %p are not freed yet",
                         a->outstanding, (void *)a);
    int rc = check_unreferenced(a, "destroy");
    if (rc != 0)
        return rc;
    while (a->live_count > 0)
        slot_fini(a, a->live_list[a->live_count - 1]);
    arena_free(a);
    return 0;
}

/* ---- accessors ----------------------------------------------------------------------------- */

size_t lshm_arena_count(const lshm_arena *a) {
    return a == NULL ? 0 : a->count;
}

int lshm_arena_storage(const lshm_arena *a, size_t i, lshm_storage **out) {
    int rc = check_planned(a, "storage");
    if (rc != 0)
        return rc;
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    if (i >= a->count)
        return LSHM_FAIL(-EINVAL, "tensor %zu of an arena of %zu", i, a->count);
    if (!a->allocated)
        return LSHM_FAIL(-ENODATA, "arena %p is not allocated", (const void *)a);
    *out = slot_storage(a, i);
    return 0;
}

int lshm_arena_offset(const lshm_arena *a, size_t i, uint64_t *offset) {
    if (a == NULL || offset == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    if (i >= a->count)
        return LSHM_FAIL(-EINVAL, "tensor %zu of an arena of %zu", i, a->count);
    *offset = a->offsets[i];
    return 0;
}

void *lshm_arena_data(const lshm_arena *a) {
    return a == NULL ? NULL : a->buffer;
}

uint64_t lshm_arena_size(const lshm_arena *a) {
    return a == NULL || !a->have_plan ? 0 : a->need;
}

int lshm_arena_fd(lshm_arena *a, int *fd) {
    if (a == NULL || fd == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    if ((a->flags & LSHM_ARENA_SHARED) == 0)
        return LSHM_FAIL(-ENODATA, "arena %p is private (no LSHM_ARENA_SHARED)", (const void *)a);
    if (a->segment == NULL)
        return LSHM_FAIL(-ENODATA, "arena %p has no buffer yet", (const void *)a);
    int f;
    if (lshm_segment_fd(a->segment, &f) != 0)
        return LSHM_FAIL(-ENODATA, "the fd of arena %p's segment was closed", (const void *)a);
    *fd = f;
    return 0;
}

int lshm_arena_stats(const lshm_arena *a, lshm_arena_counters *out) {
    if (a == NULL || out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    *out = a->stats;
    return 0;
}

int lshm_arena_plan_result(const lshm_arena *a, lshm_plan_result *out) {
    if (a == NULL || out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    if (!a->have_plan)
        return LSHM_FAIL(-ENODATA, "recording arena %p has no plan yet", (const void *)a);
    *out = a->plan;
    return 0;
}

int lshm_arena_current_buffer(const lshm_arena *a, lshm_arena_buffer **out) {
    if (a == NULL || out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    if (a->buf == NULL)
        return LSHM_FAIL(-ENODATA, "arena %p has no buffer", (const void *)a);
    *out = a->buf;
    return 0;
}

/* ---- recording arenas ---------------------------------------------------------------------- */

static int check_recording(const lshm_arena *a, const char *what) {
    if (a == NULL)
        return LSHM_FAIL(-EINVAL, "%s: NULL arena", what);
    if (!a->recording)
        return LSHM_FAIL(-EINVAL, "%s: a planned arena serves lshm_arena_allocate instead", what);
    return 0;
}

/* Does slot k's slice overlap the slice of a slot that is still live? The plan guarantees it
 * does not while the events come at their planned ticks (a->in_order), so only other orders
 * pay for this scan. */
static int overlaps_live(const lshm_arena *a, size_t k) {
    uint64_t lo = a->offsets[k], hi = lo + a->sizes[k];
    if (a->sizes[k] == 0)
        return 0;
    for (size_t j = 0; j < a->live_count; j++) {
        size_t i = a->live_list[j];
        uint64_t l = a->offsets[i], h = l + a->sizes[i];
        if (a->sizes[i] > 0 && l < hi && lo < h)
            return 1;
    }
    return 0;
}

static size_t ordinary_slot(const ordinary_entry *table, size_t cap, const lshm_storage *s) {
    size_t h = (size_t)(((uint64_t)(uintptr_t)s >> 4) * 0x9e3779b97f4a7c15ull) & (cap - 1);
    while (table[h].storage != NULL && table[h].storage != s)
        h = (h + 1) & (cap - 1);
    return h;
}

/* Room for one more entry (a failure changes nothing). */
static int ordinary_reserve(lshm_arena *a) {
    if (2 * (a->ordinary_used + 1) <= a->ordinary_cap)
        return 0;
    size_t cap = a->ordinary_cap ? 2 * a->ordinary_cap : 64;
    ordinary_entry *table = calloc(cap, sizeof *table);
    if (table == NULL)
        return LSHM_FAIL(-ENOMEM, "malloc of a table of %zu storages failed", cap);
    for (size_t i = 0; i < a->ordinary_cap; i++)
        if (a->ordinary[i].storage != NULL)
            table[ordinary_slot(table, cap, a->ordinary[i].storage)] = a->ordinary[i];
    free(a->ordinary);
    a->ordinary = table;
    a->ordinary_cap = cap;
    return 0;
}

/* The record of ordinary storage s in this iteration, or a->nrecords. */
static size_t ordinary_find(const lshm_arena *a, const lshm_storage *s) {
    if (a->ordinary_cap == 0)
        return a->nrecords;
    const ordinary_entry *e = &a->ordinary[ordinary_slot(a->ordinary, a->ordinary_cap, s)];
    return e->storage == s && a->records[e->k].storage == s ? e->k : a->nrecords;
}

int lshm_arena_alloc(lshm_arena *a, size_t nbytes, lshm_storage **out) {
    int rc = check_recording(a, "alloc");
    if (rc != 0)
        return rc;
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    if (a->nrecords == a->records_cap) {
        size_t cap = a->records_cap ? 2 * a->records_cap : 64;
        arena_record *r = realloc(a->records, cap * sizeof *r);
        if (r == NULL)
            return LSHM_FAIL(-ENOMEM, "malloc of %zu event records failed", cap);
        a->records = r;
        a->records_cap = cap;
    }
    size_t k = a->nrecords;
    lshm_storage *s = NULL;
    int in_slot = 0;
    if (k >= a->count || a->firsts[k] != a->tick)
        a->in_order = 0;
    if (a->have_plan && a->have_buffer && k < a->count && nbytes <= a->sizes[k] &&
        (a->in_order || !overlaps_live(a, k))) {
        if ((rc = slot_init(a, k, nbytes)) != 0)
            return rc;
        s = slot_storage(a, k);
        in_slot = 1;
        a->stats.reuse_count++;
    } else {
        if ((rc = ordinary_reserve(a)) != 0)
            return rc;
        rc = (a->flags & LSHM_ARENA_SHARED) != 0 ? lshm_storage_create_shared(nbytes, 0, &s)
                                                 : lshm_storage_create(nbytes, NULL, 0, &s);
        if (rc != 0)
            return rc;
        ordinary_entry *e = &a->ordinary[ordinary_slot(a->ordinary, a->ordinary_cap, s)];
        a->ordinary_used += e->storage == NULL;
        *e = (ordinary_entry){s, k};
        if (a->have_plan)
            a->misfit = 1;
        a->stats.fallback_count++;
    }
    a->records[k] = (arena_record){.size = nbytes, .first = a->tick++, .last = -1,
                                   .storage = s, .in_slot = in_slot};
    a->nrecords++;
    a->outstanding++;
    *out = s;
    return 0;
}

int lshm_arena_free(lshm_arena *a, lshm_storage *s) {
    int rc = check_recording(a, "free");
    if (rc != 0)
        return rc;
    if (s == NULL)
        return LSHM_FAIL(-EINVAL, "free: NULL storage");
    ptrdiff_t slot = slot_index(a, s);
    size_t k = slot >= 0 && (size_t)slot < a->nrecords && a->records[slot].storage == s
                   ? (size_t)slot
                   : ordinary_find(a, s);
    if (k == a->nrecords)
        return LSHM_FAIL(-EINVAL, "free: storage %p was not allocated by arena %p in this "
                         "iteration, or was freed already", (void *)s, (void *)a);
    /* A slice of the buffer goes to later allocs, so nobody else may still hold it; an
     * ordinary storage's memory is never handed out again, so other references just keep it
     * alive as usual. */
    size_t refs = lshm_storage_refcount(s);
    if (a->records[k].in_slot && refs != 1)
        return LSHM_FAIL(-EBUSY, "free: storage %p on the arena's buffer still has %zu "
                         "references beyond the caller's", (void *)s, refs - 1);
    if (a->records[k].in_slot)
        slot_fini(a, k);
    else
        lshm_storage_release(s);
    if (k >= a->count || a->lasts[k] != a->tick)
        a->in_order = 0;
    a->records[k].storage = NULL;
    a->records[k].last = a->tick++;
    a->outstanding--;
    return 0;
}

int lshm_arena_end_iteration(lshm_arena *a) {
    int rc = check_recording(a, "end_iteration");
    if (rc != 0)
        return rc;
    if (a->outstanding > 0)
        return LSHM_FAIL(-EBUSY, "end_iteration: %zu storages of this iteration are not freed",
                         a->outstanding);
    size_t n = a->nrecords;
    int replan = n > 0 && (!a->have_plan || a->misfit);
    int had_plan = a->have_plan;
    a->stats.iterations++;
    a->nrecords = 0;
    a->tick = 0;
    a->misfit = 0;
    a->in_order = 1;
    if (a->ordinary_used > 0) {
        memset(a->ordinary, 0, a->ordinary_cap * sizeof *a->ordinary);
        a->ordinary_used = 0;
    }
    if (!replan)
        return 0;
    uint64_t *sizes = malloc(n * sizeof *sizes);
    int64_t *firsts = malloc(n * sizeof *firsts);
    int64_t *lasts = malloc(n * sizeof *lasts);
    if (sizes == NULL || firsts == NULL || lasts == NULL) {
        free(sizes);
        free(firsts);
        free(lasts);
        a->misfit = 1; /* try again at the end of the next iteration */
        return LSHM_FAIL(-ENOMEM, "malloc of a plan input of %zu tensors failed", n);
    }
    for (size_t k = 0; k < n; k++) {
        /* A tensor's size never shrinks, so sizes that alternate do not re-plan forever. */
        uint64_t size = a->records[k].size;
        if (had_plan && k < a->count && a->sizes[k] > size)
            size = a->sizes[k];
        sizes[k] = size;
        firsts[k] = a->records[k].first;
        lasts[k] = a->records[k].last;
    }
    /* (with its buffer: when there is no memory for it, the old plan and buffer stay, and
     * serve the next iterations that fit them) */
    rc = install_plan(a, n, sizes, firsts, lasts, &a->opts, 1); /* takes sizes */
    if (rc != 0) {
        free(firsts);
        free(lasts);
        a->misfit = 1;
        return rc;
    }
    free(a->firsts);
    free(a->lasts);
    a->firsts = firsts;
    a->lasts = lasts;
    if (had_plan)
        a->stats.replans++;
    return 0;
}
