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
        return LSHM_FAIL(-EINVAL, "time_limit %g is negative", opts->time_limit);
    *alignment = a;
    *flags = opts->flags;
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
    const int inclusive = (flags & LSHM_PLAN_INCLUSIVE) != 0;
    const uint64_t a = in->alignment;
    const int planning = given == NULL;
    /* total starts at 1: every arena we build is then below in->total <= UINT64_MAX, so
     * UINT64_MAX never is one (it means "no plan" / "cut off" in lshm_plan and
     * lshm__plan_engine_run) */
    uint64_t total = 1, fixed_top = 0;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (firsts[i] > lasts[i])
            return LSHM_FAIL(-EINVAL, "tensor %zu: first %lld > last %lld", i,
                             (long long)firsts[i], (long long)lasts[i]);
        if (planning) {
            if (sizes[i] > UINT64_MAX - a)
                return LSHM_FAIL(-EOVERFLOW, "tensor %zu: size %llu overflows when aligned", i,
                                 (unsigned long long)sizes[i]);
            uint64_t padded = align_up(sizes[i], a);
            if (total > UINT64_MAX - padded)
                return LSHM_FAIL(-EOVERFLOW, "sum of tensor sizes overflows 64 bits");
            total += padded;
        }
        uint64_t pin = UINT64_MAX;
        if (fixed && fixed[i] != -1) {
            if (fixed[i] < 0)
                return LSHM_FAIL(-EINVAL, "tensor %zu: fixed offset %lld (use -1 for none)", i,
                                 (long long)fixed[i]);
            pin = (uint64_t)fixed[i];
        }
        if (given)
            pin = given[i];
        if (given || pin != UINT64_MAX) {
            if (pin & (a - 1))
                return LSHM_FAIL(-EINVAL, "tensor %zu: offset %llu not aligned to %llu", i,
                                 (unsigned long long)pin, (unsigned long long)a);
            if (pin > UINT64_MAX - sizes[i])
                return LSHM_FAIL(-EOVERFLOW, "tensor %zu: offset %llu + size %llu overflows", i,
                                 (unsigned long long)pin, (unsigned long long)sizes[i]);
            fixed_top = max_u64(fixed_top, pin + sizes[i]);
        }
        if (sizes[i] > 0 && (inclusive || firsts[i] < lasts[i]))
            m++;
    }
    if (planning) {
        /* free tensors go above the pinned ones at worst: from align_up(fixed_top), at most
         * a - 1 above fixed_top (whose align_up must not wrap either), each one adding at
         * most its padded size */
        uint64_t slack = fixed_top ? a - 1 : 0;
        if (total > UINT64_MAX - fixed_top || total + fixed_top > UINT64_MAX - slack)
            return LSHM_FAIL(-EOVERFLOW, "arena size could overflow 64 bits");
        in->total = total + fixed_top + slack;
    }
    in->m = m;
    if (m == 0)
        return 0;

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
        return LSHM_FAIL(-ENOMEM, "planner: out of memory for %zu tensors", n);
    }
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(sizes[i] > 0 && (inclusive || firsts[i] < lasts[i])))
            continue;
        in->orig[j] = (uint32_t)i;
        in->size[j] = sizes[i];
        uint64_t pin = UINT64_MAX;
        if (given)
            pin = given[i];
        else if (fixed && fixed[i] >= 0)
            pin = (uint64_t)fixed[i];
        in->fixed[j] = pin;
        if (pin != UINT64_MAX)
            in->n_fixed++;
        /* order-preserving map of int64 to uint64 */
        key[2 * j] = (uint64_t)firsts[i] ^ ((uint64_t)1 << 63);
        key[2 * j + 1] = (uint64_t)lasts[i] ^ ((uint64_t)1 << 63);
        j++;
    }
    for (size_t s = 0; s < 2 * m; s++)
        slot[s] = (uint32_t)s;
    lshm__plan_sort_by_key(slot, 2 * m, key, tmp);
    /* Rank distinct values; start = 2 rank(first); end = 2 rank(last) (+1 if inclusive). */
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
    free(key);
    free(slot);
    free(tmp);
    return 0;
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

/* max over t of (sum of padded sizes live at t) - (largest padding among them): all but the
 * topmost live tensor occupy at least their padded size, the topmost at least its size. */
int lshm__plan_lower_bound(const plan_input *in, uint64_t *out) {
    size_t m = in->m;
    uint32_t T = in->times;
    *out = 0;
    if (m == 0)
        return 0;
    uint64_t a = in->alignment;
    uint64_t *diff = calloc((size_t)T + 1, sizeof *diff);
    uint32_t *by_start = malloc(m * sizeof *by_start), *tmp = malloc(m * sizeof *tmp);
    uint64_t *key = malloc(m * sizeof *key);
    pad_entry *heap = a > 1 ? malloc(m * sizeof *heap) : NULL; /* max-heap by padding */
    if (!diff || !by_start || !tmp || !key || (a > 1 && !heap)) {
        free(diff), free(by_start), free(tmp), free(key), free(heap);
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    }
    for (size_t i = 0; i < m; i++) {
        uint64_t p = align_up(in->size[i], a);
        diff[in->start[i]] += p;
        diff[in->end[i]] -= p;
        by_start[i] = (uint32_t)i;
        key[i] = in->start[i];
    }
    lshm__plan_sort_by_key(by_start, m, key, tmp);
    size_t hn = 0, k = 0;
    uint64_t live = 0, best = 0;
    for (uint32_t t = 0; t < T && k < m; t++) {
        live += diff[t];
        if (in->start[by_start[k]] != t)
            continue;
        uint64_t maxpad = 0;
        if (heap) {
            while (k < m && in->start[by_start[k]] == t) {
                uint32_t i = by_start[k++];
                pad_entry e = {align_up(in->size[i], a) - in->size[i], in->end[i]};
                size_t c = hn++; /* sift up */
                while (c > 0 && heap[(c - 1) / 2].pad < e.pad) {
                    heap[c] = heap[(c - 1) / 2];
                    c = (c - 1) / 2;
                }
                heap[c] = e;
            }
            while (hn > 0 && heap[0].end <= t) { /* pop dead tops */
                pad_entry last = heap[--hn];
                size_t c = 0;
                for (;;) {
                    size_t l = 2 * c + 1, r = l + 1, b = c;
                    uint64_t vb = last.pad;
                    if (l < hn && heap[l].pad > vb)
                        b = l, vb = heap[l].pad;
                    if (r < hn && heap[r].pad > vb)
                        b = r;
                    if (b == c)
                        break;
                    heap[c] = heap[b];
                    c = b;
                }
                if (hn > 0)
                    heap[c] = last;
            }
            maxpad = hn ? heap[0].pad : 0;
        } else {
            while (k < m && in->start[by_start[k]] == t)
                k++;
        }
        if (live - maxpad > best)
            best = live - maxpad;
    }
    free(diff), free(by_start), free(tmp), free(key), free(heap);
    *out = best;
    return 0;
}

/* ---- validation: sweep over time, treap of live blocks keyed by offset --------------------- */

typedef struct treap {
    uint32_t *left, *right, *prio; /* node = tensor index + 1; 0 = nil */
    const uint64_t *off;
    uint32_t root;
} treap;

static inline int tkey_less(const treap *t, uint32_t a, uint32_t b) {
    return t->off[a - 1] < t->off[b - 1] || (t->off[a - 1] == t->off[b - 1] && a < b);
}

static uint32_t treap_insert(treap *t, uint32_t root, uint32_t x) {
    if (!root)
        return x;
    if (tkey_less(t, x, root)) {
        t->left[root] = treap_insert(t, t->left[root], x);
        uint32_t l = t->left[root];
        if (t->prio[l] > t->prio[root]) {
            t->left[root] = t->right[l];
            t->right[l] = root;
            return l;
        }
    } else {
        t->right[root] = treap_insert(t, t->right[root], x);
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

static uint32_t treap_erase(treap *t, uint32_t root, uint32_t x) {
    if (!root)
        return 0;
    if (root == x)
        return treap_merge(t, t->left[x], t->right[x]);
    if (tkey_less(t, x, root))
        t->left[root] = treap_erase(t, t->left[root], x);
    else
        t->right[root] = treap_erase(t, t->right[root], x);
    return root;
}

/* Checks that no two tensors of `in` that are live together overlap with offsets `off` (indexed
 * like in). Returns 0, or 1 and the offending pair. */
int lshm__plan_find_overlap(const plan_input *in, const uint64_t *off, uint32_t *pa,
                            uint32_t *pb, int *nomem) {
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
    size_t ks = 0, ke = 0;
    while (ks < m) {
        uint32_t s = by_start[ks];
        /* ends at or before this start free their blocks first (half-open) */
        while (ke < m && in->end[by_end[ke]] <= in->start[s]) {
            t.root = treap_erase(&t, t.root, by_end[ke] + 1);
            ke++;
        }
        /* neighbours by offset: predecessor (largest key < s) and successor */
        uint32_t x = s + 1, pred = 0, succ = 0, cur = t.root;
        while (cur) {
            if (tkey_less(&t, cur, x)) {
                pred = cur;
                cur = t.right[cur];
            } else {
                succ = cur;
                cur = t.left[cur];
            }
        }
        if (pred && off[pred - 1] + in->size[pred - 1] > off[s]) {
            *pa = pred - 1, *pb = s, found = 1;
            goto out;
        }
        if (succ && off[succ - 1] < off[s] + in->size[s]) {
            *pa = succ - 1, *pb = s, found = 1;
            goto out;
        }
        t.root = treap_insert(&t, t.root, x);
        ks++;
    }
out:
    free(t.left), free(t.right), free(t.prio), free(by_start), free(by_end), free(tmp), free(key);
    return found;
}
