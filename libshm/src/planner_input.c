/*
 * planner_input.c -- the planner's first stages: the caller's input checked and compressed
 * (times sorted to 0..T, both interval modes made half-open, zero-size and empty tensors set
 * aside), the lower bound (the most bytes live at once, with alignment padding where it is
 * forced), and the validator every plan passes before it is returned (a sweep over time with
 * a treap of live blocks keyed by offset, O(n log n)). Also the radix sort every stage uses.
 */
#include "internal.h"
#include "planner_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- stable LSD radix sort of item ids by a 64-bit key ------------------------------------- */

/* Sort items[0..m) ascending by key[items[i]], stable. tmp has room for m items. Byte passes in
 * which every key has the same byte are skipped, so small keys cost one or two passes. */
void lshm__plan_sort_by_key(uint32_t *items, size_t m, const uint64_t *key, uint32_t *tmp) {
    size_t count[256];
    uint64_t all_or = 0, all_and = ~(uint64_t)0;
    for (size_t i = 0; i < m; i++) {
        all_or |= key[items[i]];
        all_and &= key[items[i]];
    }
    uint64_t varying = all_or ^ all_and;
    uint32_t *src = items, *dst = tmp;
    for (int shift = 0; shift < 64; shift += 8) {
        if (((varying >> shift) & 0xff) == 0)
            continue;
        memset(count, 0, sizeof count);
        for (size_t i = 0; i < m; i++)
            count[(key[src[i]] >> shift) & 0xff]++;
        size_t sum = 0;
        for (int b = 0; b < 256; b++) {
            size_t c = count[b];
            count[b] = sum;
            sum += c;
        }
        for (size_t i = 0; i < m; i++)
            dst[count[(key[src[i]] >> shift) & 0xff]++] = src[i];
        uint32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != items)
        memcpy(items, src, m * sizeof *items);
}

void lshm__plan_input_free(plan_input *in) {
    free(in->orig);
    free(in->start);
    free(in->end);
    free(in->size);
    free(in->fixed);
    memset(in, 0, sizeof *in);
}

static int check_options(const lshm_plan_options *opts, uint64_t *alignment, unsigned *flags) {
    lshm_plan_options defaults;
    if (!opts) {
        lshm_plan_options_init(&defaults);
        opts = &defaults;
    }
    uint64_t a = opts->alignment ? opts->alignment : 1;
    if (a & (a - 1))
        return LSHM_FAIL(-EINVAL, "alignment %llu is not a power of two", (unsigned long long)a);
    if (opts->flags & ~LSHM_PLAN_INCLUSIVE)
        return LSHM_FAIL(-EINVAL, "unknown plan flags 0x%x", opts->flags & ~LSHM_PLAN_INCLUSIVE);
    if (!(opts->time_limit >= 0.0)) /* also rejects NaN */
        return LSHM_FAIL(-EINVAL, "time_limit %g is negative or not a number", opts->time_limit);
    *alignment = a;
    *flags = opts->flags;
    return 0;
}

/* The caller's arrays as lshm__plan_input_build got them (see there). */
typedef struct caller_input {
    size_t n;
    const uint64_t *sizes;
    const int64_t *firsts, *lasts;
    const int64_t *fixed;   /* planning: pinned offsets (-1: free), or NULL */
    const uint64_t *given;  /* validation: the offsets to check, or NULL */
    int inclusive;          /* LSHM_PLAN_INCLUSIVE: lifetimes are [first, last] */
} caller_input;

/* 1 when tensor i occupies memory: size > 0 and a non-empty lifetime (inclusive lifetimes
 * never are empty). */
static inline int occupies_memory(const caller_input *c, size_t i) {
    return c->sizes[i] > 0 && (c->inclusive || c->firsts[i] < c->lasts[i]);
}

/* The offset tensor i is proposed at (validation) or pinned at (planning), else UINT64_MAX. */
static inline uint64_t pinned_offset(const caller_input *c, size_t i) {
    if (c->given)
        return c->given[i];
    return c->fixed && c->fixed[i] >= 0 ? (uint64_t)c->fixed[i] : UINT64_MAX;
}

/* Pass 1 of lshm__plan_input_build: every tensor checked (lifetime; when planning, its aligned
 * size and the sum of them; its pinned or proposed offset), then in->total (planning) and
 * in->m, the number of tensors that occupy memory. */
static int check_tensors(plan_input *in, const caller_input *c) {
    const uint64_t alignment = in->alignment;
    const int planning = c->given == NULL;
    /* total starts at 1: every arena we build is then below in->total <= UINT64_MAX, so
     * UINT64_MAX never is one (it means "no plan" / "cut off" in lshm_plan and
     * lshm__plan_engine_run). A sum past 64 bits is no error by itself (tensors never live
     * together need not fit at once): it saturates, and in->total becomes the cap below. */
    uint64_t total = 1, fixed_top = 0;
    int saturated = 0;
    size_t m = 0;
    for (size_t i = 0; i < c->n; i++) {
        const uint64_t size = c->sizes[i];
        if (c->firsts[i] > c->lasts[i])
            return LSHM_FAIL(-EINVAL, "tensor %zu: first %lld > last %lld", i,
                             (long long)c->firsts[i], (long long)c->lasts[i]);
        if (planning) {
            /* (not an overflow of the alignment itself, which is fine up to UINT64_MAX -
             * alignment + 1: an arena must end below UINT64_MAX, which means "no plan") */
            if (size > UINT64_MAX - alignment)
                return LSHM_FAIL(-EOVERFLOW,
                                 "tensor %zu: size %llu is too large: at alignment %llu a size "
                                 "is at most %llu (the arena must end below 2^64 - 1)", i,
                                 (unsigned long long)size, (unsigned long long)alignment,
                                 (unsigned long long)(UINT64_MAX - alignment));
            uint64_t padded = align_up(size, alignment);
            if (total > UINT64_MAX - padded)
                saturated = 1;
            else
                total += padded;
        }
        if (c->fixed && c->fixed[i] != -1 && c->fixed[i] < 0)
            return LSHM_FAIL(-EINVAL, "tensor %zu: fixed offset %lld (use -1 for none)", i,
                             (long long)c->fixed[i]);
        uint64_t pin = pinned_offset(c, i);
        if (c->given || pin != UINT64_MAX) {
            if (pin & (alignment - 1))
                return LSHM_FAIL(-EINVAL, "tensor %zu: offset %llu not aligned to %llu", i,
                                 (unsigned long long)pin, (unsigned long long)alignment);
            if (pin > UINT64_MAX - size)
                return LSHM_FAIL(-EOVERFLOW, "tensor %zu: offset %llu + size %llu overflows", i,
                                 (unsigned long long)pin, (unsigned long long)size);
            fixed_top = max_u64(fixed_top, pin + size);
        }
        if (occupies_memory(c, i))
            m++;
    }
    if (planning) {
        /* free tensors go above the pinned ones at worst: from align_up(fixed_top), at most
         * alignment - 1 above fixed_top (whose align_up must not wrap either), each one adding
         * at most its padded size */
        uint64_t slack = fixed_top ? alignment - 1 : 0;
        if (saturated || total > UINT64_MAX - fixed_top ||
            total + fixed_top > UINT64_MAX - slack) {
            /* No bound below 2^64 holds for every placement: the engine then checks each end
             * against the cap, the highest aligned offset below UINT64_MAX (rounding an end up
             * to the alignment cannot wrap, and no arena is UINT64_MAX, "no plan"), and gives
             * up a placement that passes it. */
            uint64_t cap = (UINT64_MAX - 1) & ~(alignment - 1);
            if (fixed_top > cap)
                return LSHM_FAIL(-EOVERFLOW, "pinned tensors end at %llu, past the highest "
                                 "aligned offset", (unsigned long long)fixed_top);
            in->total = cap;
            in->saturated = 1;
        } else {
            in->total = total + fixed_top + slack;
        }
    }
    in->m = m;
    return 0;
}

/* Ranks the distinct values of key[0..2m) (tensor j's first at 2j, its last at 2j + 1), through
 * slot[] (their indices, sorted by key) and tmp[]: start = 2 rank(first), end = 2 rank(last)
 * (+1 if inclusive), so that both interval modes become half-open. */
static void rank_times(plan_input *in, const uint64_t *key, uint32_t *slot, uint32_t *tmp,
                       int inclusive) {
    const size_t m = in->m;
    for (size_t s = 0; s < 2 * m; s++)
        slot[s] = (uint32_t)s;
    lshm__plan_sort_by_key(slot, 2 * m, key, tmp);
    uint32_t rank = 0;
    for (size_t s = 0; s < 2 * m; s++) {
        if (s > 0 && key[slot[s]] != key[slot[s - 1]])
            rank++;
        uint32_t k = slot[s];
        if (k & 1)
            in->end[k >> 1] = 2 * rank + (uint32_t)inclusive;
        else
            in->start[k >> 1] = 2 * rank;
    }
    in->times = 2 * rank + 2;
}

/* Pass 2: the in->m tensors that occupy memory copied into `in` (caller index, size, pin),
 * their times compressed. */
static int compress_tensors(plan_input *in, const caller_input *c) {
    const size_t m = in->m;
    in->orig = malloc(m * sizeof *in->orig);
    in->start = malloc(m * sizeof *in->start);
    in->end = malloc(m * sizeof *in->end);
    in->size = malloc(m * sizeof *in->size);
    in->fixed = malloc(m * sizeof *in->fixed);
    uint64_t *key = malloc(2 * m * sizeof *key);
    uint32_t *slot = malloc(2 * m * sizeof *slot), *tmp = malloc(2 * m * sizeof *tmp);
    if (!in->orig || !in->start || !in->end || !in->size || !in->fixed || !key || !slot || !tmp) {
        free(key);
        free(slot);
        free(tmp);
        lshm__plan_input_free(in);
        return LSHM_FAIL(-ENOMEM, "planner: out of memory for %zu tensors", c->n);
    }
    size_t j = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (!occupies_memory(c, i))
            continue;
        in->orig[j] = (uint32_t)i;
        in->size[j] = c->sizes[i];
        in->fixed[j] = pinned_offset(c, i);
        if (in->fixed[j] != UINT64_MAX)
            in->n_fixed++;
        /* order-preserving map of int64 to uint64 */
        key[2 * j] = (uint64_t)c->firsts[i] ^ ((uint64_t)1 << 63);
        key[2 * j + 1] = (uint64_t)c->lasts[i] ^ ((uint64_t)1 << 63);
        j++;
    }
    rank_times(in, key, slot, tmp, c->inclusive);
    free(key);
    free(slot);
    free(tmp);
    return 0;
}

/* Checks the caller's arrays and builds the compressed problem. `offsets` (validation) or
 * `fixed` (planning) may be given to check pinned/proposed offsets for alignment and overflow.
 * Only planning needs the bound `total` (sum of the padded sizes + the highest pinned end, the
 * most any plan we build can use), so only planning refuses inputs where it wraps; validation
 * refuses nothing but an offset + size that really overflows 64 bits. */
int lshm__plan_input_build(plan_input *in, size_t n, const uint64_t *sizes,
                           const int64_t *firsts, const int64_t *lasts, const int64_t *fixed,
                           const uint64_t *given, const lshm_plan_options *opts) {
    memset(in, 0, sizeof *in);
    unsigned flags = 0;
    int err = check_options(opts, &in->alignment, &flags);
    if (err)
        return err;
    in->n_all = n;
    if (n == 0)
        return 0;
    if (!sizes || !firsts || !lasts)
        return LSHM_FAIL(-EINVAL, "NULL sizes/firsts/lasts with n = %zu", n);
    if (n > PLAN_MAX_TENSORS)
        return LSHM_FAIL(-EINVAL, "n = %zu exceeds the planner limit %zu", n, PLAN_MAX_TENSORS);
    const caller_input caller = {n, sizes, firsts, lasts, fixed, given,
                                 (flags & LSHM_PLAN_INCLUSIVE) != 0};
    err = check_tensors(in, &caller);
    if (err || in->m == 0)
        return err;
    return compress_tensors(in, &caller);
}

/* ---- lower bound --------------------------------------------------------------------------- */

/* Entry of the lower bound's max-heap of live paddings: the padding (any value below the
 * alignment, so up to 63 bits) and the compressed end, kept apart (no packing that would cut
 * the padding's high bits). Ordered by padding alone; a dead entry is dropped when it reaches
 * the top. */
typedef struct pad_entry {
    uint64_t pad;
    uint32_t end;
} pad_entry;

/* Pushes an entry onto the max-heap heap[0..*len). */
static void pad_heap_push(pad_entry *heap, size_t *len, pad_entry entry) {
    size_t hole = (*len)++; /* sift up */
    while (hole > 0 && heap[(hole - 1) / 2].pad < entry.pad) {
        heap[hole] = heap[(hole - 1) / 2];
        hole = (hole - 1) / 2;
    }
    heap[hole] = entry;
}

/* Removes the top of the max-heap heap[0..*len) (*len > 0). */
static void pad_heap_pop(pad_entry *heap, size_t *len) {
    pad_entry last = heap[--*len];
    size_t hole = 0; /* sift down */
    for (;;) {
        size_t left = 2 * hole + 1, right = left + 1, larger = hole;
        uint64_t larger_pad = last.pad;
        if (left < *len && heap[left].pad > larger_pad)
            larger = left, larger_pad = heap[left].pad;
        if (right < *len && heap[right].pad > larger_pad)
            larger = right;
        if (larger == hole)
            break;
        heap[hole] = heap[larger];
        hole = larger;
    }
    if (*len > 0)
        heap[hole] = last;
}

/* max over t of (sum of padded sizes live at t) - (largest padding among them): all but the
 * topmost live tensor occupy at least their padded size, the topmost at least its size.
 * Summed in 128 bits (the sizes may sum past 64 bits: see check_tensors); -EOVERFLOW when the
 * bound itself passes 64 bits. */
int lshm__plan_lower_bound(const plan_input *in, uint64_t *out) {
    size_t m = in->m;
    uint32_t T = in->times;
    *out = 0;
    if (m == 0)
        return 0;
    const uint64_t alignment = in->alignment;
    unsigned __int128 *diff = calloc((size_t)T + 1, sizeof *diff); /* (modulo 2^128) */
    uint32_t *by_start = malloc(m * sizeof *by_start), *tmp = malloc(m * sizeof *tmp);
    uint64_t *key = malloc(m * sizeof *key);
    /* max-heap by padding */
    pad_entry *heap = alignment > 1 ? malloc(m * sizeof *heap) : NULL;
    if (!diff || !by_start || !tmp || !key || (alignment > 1 && !heap)) {
        free(diff), free(by_start), free(tmp), free(key), free(heap);
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    }
    for (size_t i = 0; i < m; i++) {
        uint64_t padded = align_up(in->size[i], alignment);
        diff[in->start[i]] += padded;
        diff[in->end[i]] -= padded;
        by_start[i] = (uint32_t)i;
        key[i] = in->start[i];
    }
    lshm__plan_sort_by_key(by_start, m, key, tmp);
    size_t heap_len = 0, k = 0;
    unsigned __int128 live = 0, best = 0;
    for (uint32_t t = 0; t < T && k < m; t++) {
        live += diff[t];
        if (in->start[by_start[k]] != t)
            continue;
        uint64_t max_pad = 0;
        if (heap) {
            while (k < m && in->start[by_start[k]] == t) {
                uint32_t i = by_start[k++];
                pad_entry entry = {align_up(in->size[i], alignment) - in->size[i], in->end[i]};
                pad_heap_push(heap, &heap_len, entry);
            }
            while (heap_len > 0 && heap[0].end <= t) /* pop dead tops */
                pad_heap_pop(heap, &heap_len);
            max_pad = heap_len ? heap[0].pad : 0;
        } else {
            while (k < m && in->start[by_start[k]] == t)
                k++;
        }
        if (live - max_pad > best)
            best = live - max_pad;
    }
    free(diff), free(by_start), free(tmp), free(key), free(heap);
    if (best > UINT64_MAX)
        return LSHM_FAIL(-EOVERFLOW, "tensors live at the same time need 2^64 bytes or more");
    *out = (uint64_t)best;
    return 0;
}

/* ---- validation: sweep over time, treap of live blocks keyed by offset --------------------- */

typedef struct treap {
    uint32_t *left, *right, *prio; /* node = tensor index + 1; 0 = nil */
    const uint64_t *off;
    uint32_t root;
} treap;

static inline int treap_key_less(const treap *t, uint32_t a, uint32_t b) {
    return t->off[a - 1] < t->off[b - 1] || (t->off[a - 1] == t->off[b - 1] && a < b);
}

static uint32_t treap_insert(treap *t, uint32_t root, uint32_t node) {
    if (!root)
        return node;
    if (treap_key_less(t, node, root)) {
        t->left[root] = treap_insert(t, t->left[root], node);
        uint32_t l = t->left[root];
        if (t->prio[l] > t->prio[root]) {
            t->left[root] = t->right[l];
            t->right[l] = root;
            return l;
        }
    } else {
        t->right[root] = treap_insert(t, t->right[root], node);
        uint32_t r = t->right[root];
        if (t->prio[r] > t->prio[root]) {
            t->right[root] = t->left[r];
            t->left[r] = root;
            return r;
        }
    }
    return root;
}

static uint32_t treap_merge(treap *t, uint32_t a, uint32_t b) {
    if (!a || !b)
        return a ? a : b;
    if (t->prio[a] > t->prio[b]) {
        t->right[a] = treap_merge(t, t->right[a], b);
        return a;
    }
    t->left[b] = treap_merge(t, a, t->left[b]);
    return b;
}

static uint32_t treap_erase(treap *t, uint32_t root, uint32_t node) {
    if (!root)
        return 0;
    if (root == node)
        return treap_merge(t, t->left[node], t->right[node]);
    if (treap_key_less(t, node, root))
        t->left[root] = treap_erase(t, t->left[root], node);
    else
        t->right[root] = treap_erase(t, t->right[root], node);
    return root;
}

/* Checks that no two tensors of `in` that are live together overlap with offsets `off` (indexed
 * like in). Returns 0, or 1 and the offending pair. */
int lshm__plan_find_overlap(const plan_input *in, const uint64_t *off, uint32_t *tensor_a,
                            uint32_t *tensor_b, int *nomem) {
    size_t m = in->m;
    *nomem = 0;
    if (m == 0)
        return 0;
    treap t;
    t.left = calloc(m + 1, sizeof(uint32_t));
    t.right = calloc(m + 1, sizeof(uint32_t));
    t.prio = malloc((m + 1) * sizeof(uint32_t));
    uint32_t *by_start = malloc(m * sizeof(uint32_t)), *by_end = malloc(m * sizeof(uint32_t));
    uint32_t *tmp = malloc(m * sizeof(uint32_t));
    uint64_t *key = malloc(m * sizeof(uint64_t));
    int found = 0;
    if (!t.left || !t.right || !t.prio || !by_start || !by_end || !tmp || !key) {
        *nomem = 1;
        goto out;
    }
    t.off = off;
    t.root = 0;
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < m; i++) {
        t.prio[i + 1] = (uint32_t)(rng_next(&seed) >> 32);
        by_start[i] = by_end[i] = (uint32_t)i;
        key[i] = in->start[i];
    }
    lshm__plan_sort_by_key(by_start, m, key, tmp);
    for (size_t i = 0; i < m; i++)
        key[i] = in->end[i];
    lshm__plan_sort_by_key(by_end, m, key, tmp);
    size_t next_start = 0, next_end = 0; /* positions in by_start and by_end */
    while (next_start < m) {
        uint32_t s = by_start[next_start];
        /* ends at or before this start free their blocks first (half-open) */
        while (next_end < m && in->end[by_end[next_end]] <= in->start[s]) {
            t.root = treap_erase(&t, t.root, by_end[next_end] + 1);
            next_end++;
        }
        /* neighbours by offset: predecessor (largest key < s) and successor */
        uint32_t node = s + 1, pred = 0, succ = 0, cur = t.root;
        while (cur) {
            if (treap_key_less(&t, cur, node)) {
                pred = cur;
                cur = t.right[cur];
            } else {
                succ = cur;
                cur = t.left[cur];
            }
        }
        if (pred && off[pred - 1] + in->size[pred - 1] > off[s]) {
            *tensor_a = pred - 1, *tensor_b = s, found = 1;
            goto out;
        }
        if (succ && off[succ - 1] < off[s] + in->size[s]) {
            *tensor_a = succ - 1, *tensor_b = s, found = 1;
            goto out;
        }
        t.root = treap_insert(&t, t.root, node);
        next_start++;
    }
out:
    free(t.left), free(t.right), free(t.prio), free(by_start), free(by_end), free(tmp), free(key);
    return found;
}
