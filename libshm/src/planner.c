/*
 * planner.c -- arena planning: offsets for tensors with known lifetimes (lshm_plan).
 *
 * The problem is dynamic storage allocation (NP-complete). The plan is built in three phases:
 *
 *  1. A portfolio of greedy placements, the ones production planners use (TFLite/XNNPACK/XLA
 *     size order, XLA temporal order, Pisarchyk greedy-by-breadth, TVM conflict order, area,
 *     ONNX Runtime/ggml execution order), each with best fit and first fit. The smallest arena
 *     wins; the portfolio stops as soon as a plan reaches the lower bound (LB) or fits
 *     opts->capacity.
 *  2. With a time budget: a local search on the winning order (move a tensor that touches the
 *     top earlier in the order, re-place, keep it when the arena does not grow).
 *  3. With a time budget and n small enough: an exact decision search (planner_exact.c, in the
 *     spirit of MiniMalloc). With opts->capacity > 0 it decides that capacity alone (when no
 *     heuristic plan fits; phase 2 is skipped then); with capacity 0 it tries LB, then bisects
 *     the capacity between LB and the best arena found (see phase 3 below).
 *
 * Data structures. Times are compressed once (sort) to 0..T so that both interval modes become
 * half-open. Two placement engines give the same placements (best/first fit over the gaps
 * between the placed tensors live with the new one); which one runs depends on the density:
 *  - sparse (fewer than DENSE_PAIRS_PER_TENSOR tensors overlap a tensor on average): placed
 *    tensors live in a static "interval tree" over the tensors sorted by start (implicit
 *    balanced tree whose nodes keep the maximum end of the placed tensors below them), so the
 *    k placed tensors that overlap a lifetime are listed in O((k + 1) log n) and sorted;
 *  - dense: a segment tree over time slots whose nodes keep *coalesced* offset ranges (see
 *    struct engine), so a query merges a few short sorted lists instead of listing thousands of
 *    live tensors (S_1, Y_1: 1500-2900 live-together tensors per tensor, 20-40x fewer ranges).
 * No n x n conflict matrix anywhere. LSHM_PLAN_DEBUG=1 prints per-strategy times;
 * LSHM_PLAN_ENGINE=sparse|dense forces an engine (for benchmarks and tests).
 *
 * Portfolio size: above PORTFOLIO_LARGE tensors only the strategies that win on the larger
 * traces run (see portfolio_large).
 *
 * Every plan is checked by the validator (a sweep over time with a treap of live blocks keyed
 * by offset, O(n log n)) before it is returned.
 */
#include "internal.h"
#include "planner_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PLAN_MAX_TENSORS ((size_t)1 << 28) /* compressed times must fit in 31 bits */

double lshm__plan_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }
static inline uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* xorshift64*: deterministic pseudo-random numbers for the local search. */
static inline uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* ---- stable LSD radix sort of item ids by a 64-bit key ------------------------------------- */

/* Sort items[0..m) ascending by key[items[i]], stable. tmp has room for m items. Byte passes in
 * which every key has the same byte are skipped, so small keys cost one or two passes. */
static void sort_by_key(uint32_t *items, size_t m, const uint64_t *key, uint32_t *tmp) {
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

/* ---- input checking and time compression --------------------------------------------------- */

typedef struct plan_input {
    size_t n_all;             /* n given by the caller */
    size_t m;                 /* tensors that occupy memory: size > 0 and non-empty lifetime */
    uint32_t *orig;           /* [m] caller index */
    uint32_t *start, *end;    /* [m] compressed half-open lifetime */
    uint64_t *size;           /* [m] bytes */
    uint64_t *fixed;          /* [m] pinned offset or UINT64_MAX */
    size_t n_fixed;
    uint64_t alignment;
    uint32_t times;           /* T: all ends <= T */
    uint64_t total;           /* planning: an upper bound of any end we may produce (checked not
                               * to wrap); validation: 0 (unused) */
} plan_input;

static void input_free(plan_input *in) {
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
static int input_build(plan_input *in, size_t n, const uint64_t *sizes, const int64_t *firsts,
                       const int64_t *lasts, const int64_t *fixed, const uint64_t *given,
                       const lshm_plan_options *opts) {
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
     * UINT64_MAX never is one (it means "no plan" / "cut off" in lshm_plan and engine_run) */
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
        input_free(in);
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
    sort_by_key(slot, 2 * m, key, tmp);
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
static int lower_bound(const plan_input *in, uint64_t *out) {
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
    sort_by_key(by_start, m, key, tmp);
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
static int find_overlap(const plan_input *in, const uint64_t *off, uint32_t *pa, uint32_t *pb,
                        int *nomem) {
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
    sort_by_key(by_start, m, key, tmp);
    for (size_t i = 0; i < m; i++)
        key[i] = in->end[i];
    sort_by_key(by_end, m, key, tmp);
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

/* ---- the placement engine ------------------------------------------------------------------ */

typedef struct block {
    uint64_t lo, hi;
} block;

typedef struct engine {
    size_t m;
    const uint32_t *start, *end;
    const uint64_t *size;
    uint64_t alignment;
    uint32_t *pos;      /* [m] tensor -> position in start order */
    uint32_t *ps, *pe;  /* [m] start/end by position */
    uint32_t *pmax;     /* [m] max end of the placed tensors in the subtree of this node; 0 none */
    uint64_t *plo, *phi; /* [m] placed block by position; phi == 0: not placed */
    block *blocks;      /* [m] scratch: placed blocks overlapping in time */
    /* Dense mode (seg != 0): a segment tree over the time slots (intervals between consecutive
     * lifetime boundaries). Node v keeps two coalesced, offset-sorted sets of occupied offset
     * ranges: here[v], the blocks whose canonical cover includes v (live over all of v), and
     * sub[v], every block stored at v or below (sub[parent] contains sub[child]). The placed
     * blocks meeting [l, r) are then the union of sub[] over the canonical nodes of [l, r) and
     * here[] over the ancestors of those nodes, i.e. over the paths from leaves l and r - 1 to
     * the root. A query costs the size of these coalesced sets, not the number of overlapping
     * blocks: on dense traces (thousands of live tensors) that is 20-40x fewer. */
    int seg;
    uint32_t W;             /* leaves (power of two) */
    uint32_t *slo, *shi;    /* [m] slot range [slo, shi) per tensor */
    struct interval_set *here, *sub; /* [2W] */
    size_t blocks_cap;      /* capacity of blocks in dense mode (grows) */
    int nomem;
} engine;

typedef struct interval_set {
    block *v;
    uint32_t len, cap;
} interval_set;

static void engine_free(engine *e) {
    free(e->pos), free(e->ps), free(e->pe), free(e->pmax), free(e->plo), free(e->phi);
    free(e->blocks);
    if (e->here)
        for (size_t v = 0; v < 2 * (size_t)e->W; v++)
            free(e->here[v].v), free(e->sub[v].v);
    free(e->here), free(e->sub), free(e->slo), free(e->shi);
}

/* Dense mode setup: slots between consecutive distinct boundaries. */
static int engine_init_seg(engine *e, const plan_input *in) {
    uint32_t T = in->times;
    uint32_t *slot = calloc((size_t)T + 1, sizeof *slot);
    e->slo = malloc(e->m * sizeof *e->slo);
    e->shi = malloc(e->m * sizeof *e->shi);
    if (!slot || !e->slo || !e->shi) {
        free(slot);
        return -ENOMEM;
    }
    for (size_t i = 0; i < e->m; i++)
        slot[in->start[i]] = slot[in->end[i]] = 1;
    uint32_t boundaries = 0; /* slot[t] = number of boundaries < t */
    for (uint32_t t = 0; t <= T; t++) {
        uint32_t b = slot[t];
        slot[t] = boundaries;
        boundaries += b;
    }
    for (size_t i = 0; i < e->m; i++) {
        e->slo[i] = slot[in->start[i]];
        e->shi[i] = slot[in->end[i]];
    }
    free(slot);
    uint32_t W = 1;
    while (W < boundaries)
        W <<= 1;
    e->W = W;
    e->here = calloc(2 * (size_t)W, sizeof *e->here);
    e->sub = calloc(2 * (size_t)W, sizeof *e->sub);
    if (!e->here || !e->sub)
        return -ENOMEM;
    e->seg = 1;
    return 0;
}

/* Adds [lo, hi) to the coalesced set; returns 0 if it was already covered, 1 if the set
 * changed. Touching ranges merge (a gap of 0 bytes holds nothing). */
static int iset_add(engine *e, interval_set *s, uint64_t lo, uint64_t hi) {
    block *v = s->v;
    uint32_t a = 0, b = s->len;
    while (a < b) { /* first range with v.hi >= lo */
        uint32_t mid = a + (b - a) / 2;
        if (v[mid].hi < lo)
            a = mid + 1;
        else
            b = mid;
    }
    if (a < s->len && v[a].lo <= lo && v[a].hi >= hi)
        return 0;
    uint32_t j = a;
    while (j < s->len && v[j].lo <= hi)
        j++;
    if (j > a) { /* merge v[a..j) and [lo, hi) into v[a] */
        if (v[a].lo < lo)
            lo = v[a].lo;
        if (v[j - 1].hi > hi)
            hi = v[j - 1].hi;
        v[a].lo = lo;
        v[a].hi = hi;
        if (j > a + 1) {
            memmove(v + a + 1, v + j, (s->len - j) * sizeof *v);
            s->len -= j - a - 1;
        }
        return 1;
    }
    if (s->len == s->cap) {
        uint32_t cap = s->cap ? 2 * s->cap : 4;
        block *nv = realloc(s->v, cap * sizeof *nv);
        if (!nv) {
            e->nomem = 1;
            return 0;
        }
        s->v = v = nv;
        s->cap = cap;
    }
    memmove(v + a + 1, v + a, (s->len - a) * sizeof *v);
    v[a].lo = lo;
    v[a].hi = hi;
    s->len++;
    return 1;
}

static void seg_insert(engine *e, uint32_t i, uint64_t lo, uint64_t hi) {
    uint32_t l = e->slo[i] + e->W, r = e->shi[i] + e->W;
    for (; l < r; l >>= 1, r >>= 1) {
        if (l & 1) {
            iset_add(e, &e->here[l], lo, hi);
            for (uint32_t v = l; v >= 1 && iset_add(e, &e->sub[v], lo, hi); v >>= 1)
                ;
            l++;
        }
        if (r & 1) {
            r--;
            iset_add(e, &e->here[r], lo, hi);
            for (uint32_t v = r; v >= 1 && iset_add(e, &e->sub[v], lo, hi); v >>= 1)
                ;
        }
    }
}

/* Merges the coalesced set s into the coalesced, sorted e->blocks[0..*k) (scratch after it). */
static int seg_merge(engine *e, size_t *k, const interval_set *s) {
    if (!s->len)
        return 0;
    size_t need = 2 * (*k + s->len);
    if (need > e->blocks_cap) {
        block *nb = realloc(e->blocks, 2 * need * sizeof *nb);
        if (!nb) {
            e->nomem = 1;
            return -1;
        }
        e->blocks = nb;
        e->blocks_cap = 2 * need;
    }
    const block *a = e->blocks, *b = s->v;
    size_t na = *k, nb = s->len, i = 0, j = 0, o = 0;
    block *out = e->blocks + na;
    while (i < na || j < nb) {
        block x = (j == nb || (i < na && a[i].lo <= b[j].lo)) ? a[i++] : b[j++];
        if (o && x.lo <= out[o - 1].hi) {
            if (x.hi > out[o - 1].hi)
                out[o - 1].hi = x.hi;
        } else {
            out[o++] = x;
        }
    }
    memmove(e->blocks, out, o * sizeof *out);
    *k = o;
    return 0;
}

/* Collects into e->blocks the union (coalesced, sorted) of the occupied ranges meeting tensor
 * i's slots; returns how many ranges. */
static size_t seg_query(engine *e, uint32_t i) {
    size_t k = 0;
    const uint32_t l0 = e->slo[i], r0 = e->shi[i];
    uint32_t l = l0 + e->W, r = r0 + e->W;
    for (; l < r; l >>= 1, r >>= 1) {
        if (l & 1)
            seg_merge(e, &k, &e->sub[l++]);
        if (r & 1)
            seg_merge(e, &k, &e->sub[--r]);
    }
    /* here[] of the nodes on the two leaf-to-root paths that stick out of [l0, r0) (nodes
     * inside it are below a canonical node, whose sub[] already holds them) */
    uint32_t pa = l0 + e->W, pb = r0 - 1 + e->W, h = 0;
    for (; pa >= 1; pa >>= 1, pb >>= 1, h++) {
        uint32_t lo_a = (pa << h) - e->W, lo_b = (pb << h) - e->W;
        if (lo_a < l0 || lo_a + (1u << h) > r0)
            seg_merge(e, &k, &e->here[pa]);
        if (pb != pa && (lo_b < l0 || lo_b + (1u << h) > r0))
            seg_merge(e, &k, &e->here[pb]);
    }
    return e->nomem ? 0 : k;
}

static int engine_init(engine *e, const plan_input *in, uint32_t *tmp, uint64_t *key, int dense) {
    size_t m = in->m;
    memset(e, 0, sizeof *e);
    e->m = m;
    e->start = in->start;
    e->end = in->end;
    e->size = in->size;
    e->alignment = in->alignment;
    e->pos = malloc(m * sizeof *e->pos);
    e->ps = malloc(m * sizeof *e->ps);
    e->pe = malloc(m * sizeof *e->pe);
    e->pmax = malloc(m * sizeof *e->pmax);
    e->plo = malloc(m * sizeof *e->plo);
    e->phi = malloc(m * sizeof *e->phi);
    e->blocks = malloc(m * sizeof *e->blocks);
    if (!e->pos || !e->ps || !e->pe || !e->pmax || !e->plo || !e->phi || !e->blocks) {
        engine_free(e);
        return -ENOMEM;
    }
    uint32_t *by_start = e->ps; /* borrow as the item array */
    for (size_t i = 0; i < m; i++) {
        by_start[i] = (uint32_t)i;
        key[i] = in->start[i];
    }
    sort_by_key(by_start, m, key, tmp);
    for (size_t p = 0; p < m; p++)
        e->pos[by_start[p]] = (uint32_t)p;
    for (size_t i = 0; i < m; i++) {
        e->ps[e->pos[i]] = in->start[i];
        e->pe[e->pos[i]] = in->end[i];
    }
    e->blocks_cap = m;
    if (dense) {
        int err = engine_init_seg(e, in);
        if (err) {
            engine_free(e);
            return err;
        }
    }
    return 0;
}

static void engine_reset(engine *e) {
    if (e->seg) {
        for (size_t v = 0; v < 2 * (size_t)e->W; v++)
            e->here[v].len = e->sub[v].len = 0;
        return;
    }
    memset(e->pmax, 0, e->m * sizeof *e->pmax);
    memset(e->phi, 0, e->m * sizeof *e->phi);
}

static void sort_blocks(block *b, size_t k) {
    while (k > 16) {
        /* median of three, Hoare partition; recurse on the smaller side */
        uint64_t x = b[0].lo, y = b[k / 2].lo, z = b[k - 1].lo;
        uint64_t piv = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        size_t i = 0, j = k - 1;
        for (;;) {
            while (b[i].lo < piv)
                i++;
            while (b[j].lo > piv)
                j--;
            if (i >= j)
                break;
            block t = b[i];
            b[i] = b[j];
            b[j] = t;
            i++;
            j--;
        }
        size_t left = j + 1;
        if (left < k - left) {
            sort_blocks(b, left);
            b += left;
            k -= left;
        } else {
            sort_blocks(b + left, k - left);
            k = left;
        }
    }
    for (size_t i = 1; i < k; i++) {
        block t = b[i];
        size_t j = i;
        while (j > 0 && b[j - 1].lo > t.lo) {
            b[j] = b[j - 1];
            j--;
        }
        b[j] = t;
    }
}

/* Collects into e->blocks the placed tensors whose lifetime meets [a, b); returns how many. */
static size_t engine_query(engine *e, uint32_t a, uint32_t b) {
    uint32_t stack_lo[128], stack_hi[128];
    size_t sp = 0, k = 0;
    stack_lo[sp] = 0;
    stack_hi[sp++] = (uint32_t)e->m;
    while (sp) {
        sp--;
        uint32_t lo = stack_lo[sp], hi = stack_hi[sp];
        if (lo >= hi)
            continue;
        uint32_t mid = lo + (hi - lo) / 2;
        if (e->pmax[mid] <= a)
            continue;
        if (e->ps[mid] < b) {
            if (e->phi[mid] && e->pe[mid] > a) {
                e->blocks[k].lo = e->plo[mid];
                e->blocks[k].hi = e->phi[mid];
                k++;
            }
            stack_lo[sp] = mid + 1;
            stack_hi[sp++] = hi;
        }
        stack_lo[sp] = lo;
        stack_hi[sp++] = mid;
    }
    return k;
}

static void engine_insert(engine *e, uint32_t i, uint64_t offset) {
    if (e->seg) {
        seg_insert(e, i, offset, offset + e->size[i]);
        return;
    }
    uint32_t p = e->pos[i], lo = 0, hi = (uint32_t)e->m, end = e->end[i];
    e->plo[p] = offset;
    e->phi[p] = offset + e->size[i];
    for (;;) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (e->pmax[mid] < end)
            e->pmax[mid] = end;
        if (p == mid)
            break;
        if (p < mid)
            hi = mid;
        else
            lo = mid + 1;
    }
}

enum { FIT_BEST = 0, FIT_FIRST = 1 };

/* The offset for tensor i given the placed ones: best fit (smallest gap that holds it, lowest
 * on ties) or first fit (lowest gap that holds it); else the aligned top of the overlapping
 * blocks. */
static uint64_t engine_choose(engine *e, uint32_t i, int fit) {
    size_t k = e->seg ? seg_query(e, i) : engine_query(e, e->start[i], e->end[i]);
    block *bl = e->blocks;
    if (!e->seg)
        sort_blocks(bl, k);
    const uint64_t a = e->alignment, sz = e->size[i];
    uint64_t cur = 0, best = UINT64_MAX, best_waste = UINT64_MAX;
    for (size_t j = 0; j < k; j++) {
        if (bl[j].lo > cur) {
            uint64_t o = align_up(cur, a);
            if (o + sz <= bl[j].lo) {
                uint64_t waste = bl[j].lo - o - sz;
                if (fit == FIT_FIRST)
                    return o;
                if (waste < best_waste) {
                    best_waste = waste;
                    best = o;
                    if (waste == 0)
                        return o;
                }
            }
        }
        if (bl[j].hi > cur)
            cur = bl[j].hi;
    }
    return best != UINT64_MAX ? best : align_up(cur, a);
}

/* Places the pinned tensors, then order[0..count) with `fit`. Writes off[] (by tensor) and
 * returns the arena, or UINT64_MAX as soon as the arena reaches `cutoff`. */
static uint64_t engine_run(engine *e, const plan_input *in, const uint32_t *order, size_t count,
                           int fit, uint64_t *off, uint64_t cutoff) {
    engine_reset(e);
    uint64_t arena = 0;
    if (in->n_fixed) {
        for (size_t i = 0; i < in->m; i++) {
            if (in->fixed[i] == UINT64_MAX)
                continue;
            off[i] = in->fixed[i];
            engine_insert(e, (uint32_t)i, off[i]);
            arena = max_u64(arena, off[i] + in->size[i]);
        }
        if (arena >= cutoff)
            return UINT64_MAX;
    }
    for (size_t j = 0; j < count; j++) {
        uint32_t i = order[j];
        uint64_t o = engine_choose(e, i, fit);
        off[i] = o;
        engine_insert(e, i, o);
        if (o + in->size[i] > arena) {
            arena = o + in->size[i];
            if (arena >= cutoff)
                return UINT64_MAX;
        }
    }
    return arena;
}

/* ---- tensor orders ------------------------------------------------------------------------- */

enum {
    ORDER_SIZE,      /* size desc, lifetime desc, start: TFLite, XNNPACK, XLA spatial, nativert */
    ORDER_BREADTH,   /* Pisarchyk & Lee greedy by breadth */
    ORDER_START,     /* execution order: ONNX Runtime, ggml, IREE (online best fit) */
    ORDER_LIFETIME,  /* lifetime desc, size desc: XLA temporal, Levental greedy by longest */
    ORDER_CONFLICTS, /* number of conflicts desc, size desc: TVM greedy_by_conflicts */
    ORDER_AREA,      /* size x lifetime desc */
    ORDER_START_SIZE, /* start, larger first on equal start */
    ORDER_COUNT
};

static const char *const order_names[ORDER_COUNT] = {
    "size", "breadth", "start", "lifetime", "conflicts", "area", "start-size",
};

typedef struct order_ctx {
    const plan_input *in;
    const int64_t *firsts, *lasts; /* caller's times, for lifetimes in real units */
    uint32_t *items;               /* [m] tensors that are not pinned */
    size_t count;
    uint64_t *key;                 /* [max(m, T)] */
    uint32_t *tmp;                 /* [max(m, T)] */
} order_ctx;

static uint64_t duration_of(const order_ctx *c, uint32_t i) {
    uint32_t o = c->in->orig[i];
    return (uint64_t)c->lasts[o] - (uint64_t)c->firsts[o];
}

/* Fills out[0..count) with the non-pinned tensors in the given order. */
static int make_order(order_ctx *c, int which, uint32_t *out) {
    const plan_input *in = c->in;
    size_t count = c->count, m = in->m;
    uint64_t *key = c->key;
    memcpy(out, c->items, count * sizeof *out);
    switch (which) {
    case ORDER_SIZE:
        for (size_t i = 0; i < m; i++)
            key[i] = in->start[i];
        sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~duration_of(c, (uint32_t)i);
        sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~in->size[i];
        sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_LIFETIME:
        for (size_t i = 0; i < m; i++)
            key[i] = ~in->size[i];
        sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~duration_of(c, (uint32_t)i);
        sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_START:
    case ORDER_START_SIZE:
        if (which == ORDER_START_SIZE) {
            for (size_t i = 0; i < m; i++)
                key[i] = ~in->size[i];
            sort_by_key(out, count, key, c->tmp);
        }
        for (size_t i = 0; i < m; i++)
            key[i] = in->start[i];
        sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_AREA:
        for (size_t i = 0; i < m; i++) {
            /* duration + 1 in 128 bits: INT64_MIN..INT64_MAX lasts UINT64_MAX units */
            unsigned __int128 area = (unsigned __int128)in->size[i] *
                                     ((unsigned __int128)duration_of(c, (uint32_t)i) + 1);
            key[i] = ~(area >> 64 ? UINT64_MAX : (uint64_t)area);
        }
        sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_CONFLICTS: {
        uint32_t T = in->times;
        uint32_t *starts_before = calloc((size_t)T + 2, sizeof *starts_before);
        uint32_t *ends_by = calloc((size_t)T + 2, sizeof *ends_by);
        if (!starts_before || !ends_by) {
            free(starts_before), free(ends_by);
            return -ENOMEM;
        }
        for (size_t i = 0; i < m; i++) {
            starts_before[in->start[i] + 1]++; /* starts_before[t] = starts < t */
            ends_by[in->end[i]]++;       /* ends_by[t] = ends <= t */
        }
        for (uint32_t t = 1; t <= T + 1; t++) {
            starts_before[t] += starts_before[t - 1];
            ends_by[t] += ends_by[t - 1];
        }
        for (size_t i = 0; i < m; i++)
            key[i] = ~in->size[i];
        sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~(uint64_t)(starts_before[in->end[i]] - ends_by[in->start[i]]);
        sort_by_key(out, count, key, c->tmp);
        free(starts_before), free(ends_by);
        return 0;
    }
    case ORDER_BREADTH: {
        /* breadth(t) = bytes live at t; tasks visited by breadth desc (then time); a tensor is
         * placed at the first visited task it is live at, larger tensors first within a task */
        uint32_t T = in->times;
        uint64_t *live_bytes = calloc((size_t)T + 1, sizeof *live_bytes);
        uint32_t *rank = malloc(((size_t)T + 1) * sizeof *rank);
        uint32_t *tasks = malloc(((size_t)T + 1) * sizeof *tasks);
        uint32_t *sort_scratch = malloc(((size_t)T + 1) * sizeof *sort_scratch);
        size_t w = 1;
        while (w < T)
            w <<= 1;
        uint32_t *seg = malloc(2 * w * sizeof *seg);
        if (!live_bytes || !rank || !tasks || !sort_scratch || !seg) {
            free(live_bytes), free(rank), free(tasks), free(sort_scratch), free(seg);
            return -ENOMEM;
        }
        for (size_t i = 0; i < m; i++) {
            live_bytes[in->start[i]] += in->size[i];
            live_bytes[in->end[i]] -= in->size[i];
        }
        for (uint32_t t = 1; t < T; t++)
            live_bytes[t] += live_bytes[t - 1];
        for (uint32_t t = 0; t < T; t++) {
            tasks[t] = t;
            live_bytes[t] = ~live_bytes[t];
        }
        sort_by_key(tasks, T, live_bytes, sort_scratch);
        for (uint32_t r = 0; r < T; r++)
            rank[tasks[r]] = r;
        for (size_t x = 0; x < 2 * w; x++)
            seg[x] = UINT32_MAX;
        for (uint32_t t = 0; t < T; t++)
            seg[w + t] = rank[t];
        for (size_t x = w - 1; x >= 1; x--)
            seg[x] = seg[2 * x] < seg[2 * x + 1] ? seg[2 * x] : seg[2 * x + 1];
        for (size_t i = 0; i < m; i++)
            key[i] = ~in->size[i];
        sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++) {
            uint32_t best = UINT32_MAX;
            size_t l = w + in->start[i], r = w + in->end[i]; /* [l, r) */
            while (l < r) {
                if (l & 1) {
                    if (seg[l] < best)
                        best = seg[l];
                    l++;
                }
                if (r & 1) {
                    r--;
                    if (seg[r] < best)
                        best = seg[r];
                }
                l >>= 1;
                r >>= 1;
            }
            key[i] = best;
        }
        sort_by_key(out, count, key, c->tmp);
        free(live_bytes), free(rank), free(tasks), free(sort_scratch), free(seg);
        return 0;
    }
    }
    return -EINVAL;
}

/* ---- public API ---------------------------------------------------------------------------- */

void lshm_plan_options_init(lshm_plan_options *opts) {
    if (!opts)
        return;
    memset(opts, 0, sizeof *opts);
    opts->alignment = 64;
    opts->flags = 0;
    opts->time_limit = 0.0;
}

int lshm_plan_lower_bound(size_t n, const uint64_t *sizes, const int64_t *firsts,
                          const int64_t *lasts, const lshm_plan_options *opts,
                          uint64_t *lower_bound_out) {
    if (!lower_bound_out)
        return LSHM_FAIL(-EINVAL, "lower_bound is NULL");
    plan_input in;
    int err = input_build(&in, n, sizes, firsts, lasts, NULL, NULL, opts);
    if (err)
        return err;
    uint64_t lb;
    err = lower_bound(&in, &lb);
    input_free(&in);
    if (err)
        return err;
    *lower_bound_out = lb;
    return 0;
}

int lshm_plan_validate(size_t n, const uint64_t *sizes, const int64_t *firsts,
                       const int64_t *lasts, const uint64_t *offsets,
                       const lshm_plan_options *opts, uint64_t arena_size) {
    if (n > 0 && !offsets)
        return LSHM_FAIL(-EINVAL, "offsets is NULL with n = %zu", n);
    plan_input in;
    /* input_build refuses misaligned offsets and offset + size beyond 64 bits (UINT64_MAX
     * itself is then only accepted for a zero-size tensor, which occupies nothing) */
    int err = input_build(&in, n, sizes, firsts, lasts, NULL, offsets, opts);
    if (err)
        return err;
    for (size_t j = 0; j < in.m; j++) { /* tensors that occupy memory */
        size_t i = in.orig[j];
        if (offsets[i] + sizes[i] > arena_size) {
            input_free(&in);
            return LSHM_FAIL(-EINVAL, "tensor %zu: end %llu beyond arena_size %llu", i,
                             (unsigned long long)(offsets[i] + sizes[i]),
                             (unsigned long long)arena_size);
        }
    }
    uint64_t *off = in.m ? malloc(in.m * sizeof *off) : NULL;
    if (in.m && !off) {
        input_free(&in);
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    }
    for (size_t j = 0; j < in.m; j++)
        off[j] = offsets[in.orig[j]];
    uint32_t a, b;
    int nomem;
    int bad = find_overlap(&in, off, &a, &b, &nomem);
    uint32_t oa = bad ? in.orig[a] : 0, ob = bad ? in.orig[b] : 0;
    free(off);
    input_free(&in);
    if (nomem)
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    if (bad)
        return LSHM_FAIL(-EINVAL,
                         "tensors %u [%llu, +%llu) and %u [%llu, +%llu) are live together and "
                         "overlap",
                         oa < ob ? oa : ob, (unsigned long long)offsets[oa < ob ? oa : ob],
                         (unsigned long long)sizes[oa < ob ? oa : ob], oa < ob ? ob : oa,
                         (unsigned long long)offsets[oa < ob ? ob : oa],
                         (unsigned long long)sizes[oa < ob ? ob : oa]);
    return 0;
}

/* Average number of tensors overlapping a tensor's lifetime above which the dense engine wins. */
#define DENSE_PAIRS_PER_TENSOR 64

/* Number of pairs of tensors live together: sum over i of (starts before end_i) - (ends at or
 * before start_i) - 1, halved. 0 if out of memory (the sparse engine is then used). */
static uint64_t live_pairs(const plan_input *in) {
    uint32_t T = in->times;
    uint32_t *starts_before = calloc((size_t)T + 2, sizeof *starts_before);
    uint32_t *ends_by = calloc((size_t)T + 2, sizeof *ends_by);
    uint64_t sum = 0;
    if (!starts_before || !ends_by) {
        free(starts_before), free(ends_by);
        return 0;
    }
    for (size_t i = 0; i < in->m; i++) {
        starts_before[in->start[i] + 1]++; /* starts_before[t] = starts < t */
        ends_by[in->end[i]]++;       /* ends_by[t] = ends <= t */
    }
    for (uint32_t t = 1; t <= T + 1; t++) {
        starts_before[t] += starts_before[t - 1];
        ends_by[t] += ends_by[t - 1];
    }
    for (size_t i = 0; i < in->m; i++)
        sum += starts_before[in->end[i]] - ends_by[in->start[i]] - 1;
    free(starts_before), free(ends_by);
    return sum / 2;
}

typedef struct strategy {
    int order, fit;
} strategy;

/* Ordered so that the usual winners come first (early exit at LB). */
static const strategy portfolio[] = {
    {ORDER_SIZE, FIT_BEST},       {ORDER_BREADTH, FIT_BEST},   {ORDER_START, FIT_BEST},
    {ORDER_SIZE, FIT_FIRST},      {ORDER_LIFETIME, FIT_BEST},  {ORDER_CONFLICTS, FIT_BEST},
    {ORDER_AREA, FIT_BEST},       {ORDER_START_SIZE, FIT_BEST}, {ORDER_BREADTH, FIT_FIRST},
    {ORDER_LIFETIME, FIT_FIRST},  {ORDER_CONFLICTS, FIT_FIRST}, {ORDER_AREA, FIT_FIRST},
    {ORDER_START, FIT_FIRST},
};
#define PORTFOLIO_SIZE (sizeof portfolio / sizeof portfolio[0])

/* Above PORTFOLIO_LARGE tensors only the strategies that won (or tied the best) on some trace
 * of shared/traces with more than a few hundred tensors are run: breadth (G_1, tiny_bert,
 * bert_*, pangu_2.6B, Y_1), size (pangu_13B), start (resnet50), conflicts (S_1), size/first
 * and area (random DNN-like traces). Breadth goes first: it reaches LB most often there. */
#define PORTFOLIO_LARGE 512
static const strategy portfolio_large[] = {
    {ORDER_BREADTH, FIT_BEST}, {ORDER_SIZE, FIT_BEST},      {ORDER_START, FIT_BEST},
    {ORDER_CONFLICTS, FIT_BEST}, {ORDER_SIZE, FIT_FIRST},   {ORDER_AREA, FIT_BEST},
};
#define PORTFOLIO_LARGE_SIZE (sizeof portfolio_large / sizeof portfolio_large[0])

/* Exact search is tried up to this many tensors (its data is O(conflicting pairs)). */
#define EXACT_MAX_TENSORS 2000

/* `best` before any plan is found. No plan reaches it: every arena is below in.total, which
 * input_build keeps <= UINT64_MAX (and engine_run's cutoff never fires at NO_PLAN). */
#define NO_PLAN UINT64_MAX

/* 1 when capacity mode (target > 0) has a plan (best != NO_PLAN) that fits: a capacity of
 * UINT64_MAX is met by the first plan, not by the absence of one. */
static inline int meets_capacity(uint64_t best, uint64_t target) {
    return target && best != NO_PLAN && best <= target;
}

/* One exact decision: a plan within `cap` before `until`? On success it becomes the best plan.
 * Returns what lshm__plan_exact returns. */
static int exact_probe(const lshm__plan_problem *prob, uint64_t cap, double until,
                       uint64_t *cur_off, uint64_t *best_off, uint64_t *best, int debug) {
    double now = lshm__plan_now();
    int r = lshm__plan_exact(prob, cap, until, cur_off);
    if (debug)
        fprintf(stderr, "lshm_plan: exact: cap %llu -> %d after %.3f s\n",
                (unsigned long long)cap, r, lshm__plan_now() - now);
    if (r == 1) {
        uint64_t arena = 0;
        for (size_t i = 0; i < prob->n; i++)
            arena = max_u64(arena, cur_off[i] + prob->size[i]);
        assert(arena <= cap);
        if (arena < *best) {
            *best = arena;
            memcpy(best_off, cur_off, prob->n * sizeof *best_off);
        }
    }
    return r;
}

/* Pinned tensors must not collide with each other: 0, -EINVAL naming two that do, or
 * -ENOMEM. */
static int check_pinned(const plan_input *in) {
    const size_t m = in->m;
    plan_input pinned = *in;
    uint64_t *offset = malloc(m * sizeof *offset);
    uint32_t *id = malloc(m * sizeof *id);
    uint32_t *start = malloc(m * sizeof *start), *end = malloc(m * sizeof *end);
    uint64_t *size = malloc(m * sizeof *size);
    if (!offset || !id || !start || !end || !size) {
        free(offset), free(id), free(start), free(end), free(size);
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    }
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        if (in->fixed[i] == UINT64_MAX)
            continue;
        id[k] = (uint32_t)i, offset[k] = in->fixed[i], start[k] = in->start[i];
        end[k] = in->end[i], size[k] = in->size[i];
        k++;
    }
    pinned.m = k, pinned.start = start, pinned.end = end, pinned.size = size;
    uint32_t a, b;
    int nomem;
    int bad = find_overlap(&pinned, offset, &a, &b, &nomem);
    uint32_t first = bad ? in->orig[id[a]] : 0, second = bad ? in->orig[id[b]] : 0;
    free(offset), free(id), free(start), free(end), free(size);
    if (nomem)
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    if (bad)
        return LSHM_FAIL(-EINVAL, "fixed offsets of tensors %u and %u collide",
                         first < second ? first : second, first < second ? second : first);
    return 0;
}

/* One lshm_plan call: its input, the best plan so far and the scratch every stage shares.
 * The stages (portfolio, exact set-up, local search, exact bisection, self-check) return 0, or
 * OUT_OF_MEMORY (lshm_plan turns it into the error), or another -errno with its message. */
#define OUT_OF_MEMORY (-ENOMEM)
typedef struct plan_run {
    const plan_input *in;
    const lshm_plan_options *opts;
    const int64_t *firsts, *lasts; /* the caller's times (the exact search's preorder keys) */
    double started, deadline;      /* when the call began; started + time_limit */
    int debug;                     /* LSHM_PLAN_DEBUG: each stage's outcome on stderr */
    uint64_t lower_bound;
    uint64_t target; /* opts->capacity: 0 minimises, > 0 looks for a plan that fits */
    /* the best plan so far */
    uint64_t best; /* its arena size, NO_PLAN before the first */
    uint64_t *best_offsets;
    uint32_t *best_order;
    int best_fit;
    char name[48]; /* the strategy that made it */
    int optimal;   /* proven minimal */
    int used_exact;
    /* the tensors the planner places (those not pinned), and scratch */
    uint32_t *placed;
    size_t placed_count;
    uint32_t *order;
    uint64_t *offsets;
    uint32_t *scratch_ids;
    uint64_t *scratch_keys;
    engine engine;
    int have_engine;
    /* the exact search (planner_exact.c) */
    int exact_allowed; /* no pinned tensors, at most EXACT_MAX_TENSORS */
    int exact_phase;   /* it runs: a time budget, no proof yet, something left to decide */
    int fits;          /* capacity mode, and the portfolio's plan fits already */
    int hopeless;      /* capacity mode below the lower bound: nothing fits */
    lshm__plan_problem problem;
    uint64_t *widths;    /* lifetime lengths in the caller's units */
    uint64_t granule;    /* every canonical plan's arena is a multiple of it */
    uint64_t lb_rounded; /* the lower bound rounded up to the granule: no plan is smaller */
    int lb_disproven;    /* the exact search proved no plan of lb_rounded exists */
} plan_run;

static void run_free(plan_run *r) {
    if (r->have_engine)
        engine_free(&r->engine);
    free(r->widths), free(r->best_offsets), free(r->offsets), free(r->order);
    free(r->best_order), free(r->placed), free(r->scratch_ids), free(r->scratch_keys);
}

static int run_start(plan_run *r, const plan_input *in, const lshm_plan_options *opts,
                     const int64_t *firsts, const int64_t *lasts, double started, int debug,
                     uint64_t lower_bound) {
    const size_t m = in->m, one = m ? m : 1;
    size_t scratch = m > in->times ? m : (size_t)in->times;
    memset(r, 0, sizeof *r);
    r->in = in, r->opts = opts, r->firsts = firsts, r->lasts = lasts, r->debug = debug;
    r->started = started;
    r->deadline = started + opts->time_limit;
    r->lower_bound = lower_bound;
    r->target = opts->capacity;
    r->best = NO_PLAN;
    r->best_fit = FIT_BEST;
    snprintf(r->name, sizeof r->name, "empty");
    r->best_offsets = malloc(one * sizeof *r->best_offsets);
    r->offsets = malloc(one * sizeof *r->offsets);
    r->order = malloc(one * sizeof *r->order);
    r->best_order = malloc(one * sizeof *r->best_order);
    r->placed = malloc(one * sizeof *r->placed);
    r->scratch_ids = malloc((scratch + 1) * sizeof *r->scratch_ids);
    r->scratch_keys = malloc((scratch + 1) * sizeof *r->scratch_keys);
    if (!r->best_offsets || !r->offsets || !r->order || !r->best_order || !r->placed ||
        !r->scratch_ids || !r->scratch_keys)
        return OUT_OF_MEMORY;
    if (m) {
        /* Dense traces (many tensors live together) use the segment-tree engine. */
        uint64_t pairs = live_pairs(in);
        const char *forced = getenv("LSHM_PLAN_ENGINE");
        int dense = forced && *forced ? forced[0] == 'd'
                                      : pairs > DENSE_PAIRS_PER_TENSOR * (uint64_t)m;
        if (engine_init(&r->engine, in, r->scratch_ids, r->scratch_keys, dense))
            return OUT_OF_MEMORY;
        r->have_engine = 1;
    }
    for (size_t i = 0; i < m; i++)
        if (in->fixed[i] == UINT64_MAX)
            r->placed[r->placed_count++] = (uint32_t)i;
    if (m == 0) {
        r->best = 0;
        r->optimal = 1;
    }
    return 0;
}

/* Stage 1: the portfolio of orders and fits, until one reaches the lower bound (or, in
 * capacity mode, fits). */
static int run_portfolio(plan_run *r) {
    const plan_input *in = r->in;
    const size_t m = in->m;
    order_ctx orders = {in, r->firsts, r->lasts, r->placed, r->placed_count, r->scratch_keys,
                        r->scratch_ids};
    const strategy *portfolio_used = m > PORTFOLIO_LARGE ? portfolio_large : portfolio;
    size_t strategies = m > PORTFOLIO_LARGE ? PORTFOLIO_LARGE_SIZE : PORTFOLIO_SIZE;
    for (size_t s = 0; s < strategies && m && r->best > r->lower_bound &&
                       !meets_capacity(r->best, r->target);
         s++) {
        const strategy *st = &portfolio_used[s];
        double began = lshm__plan_now();
        if (make_order(&orders, st->order, r->order))
            return OUT_OF_MEMORY;
        uint64_t arena = engine_run(&r->engine, in, r->order, r->placed_count, st->fit,
                                    r->offsets, r->best);
        if (r->engine.nomem)
            return OUT_OF_MEMORY;
        if (r->debug)
            fprintf(stderr, "lshm_plan: %s/%s %s in %.3f ms (%s engine)\n",
                    order_names[st->order], st->fit == FIT_BEST ? "best" : "first",
                    arena == UINT64_MAX ? "cut off" : "done", (lshm__plan_now() - began) * 1e3,
                    r->engine.seg ? "dense" : "sparse");
        if (arena < r->best) {
            r->best = arena;
            r->best_fit = st->fit;
            memcpy(r->best_offsets, r->offsets, m * sizeof *r->best_offsets);
            memcpy(r->best_order, r->order, r->placed_count * sizeof *r->order);
            snprintf(r->name, sizeof r->name, "%s/%s", order_names[st->order],
                     st->fit == FIT_BEST ? "best-fit" : "first-fit");
        }
    }
    if (m && r->best <= r->lower_bound)
        r->optimal = 1;
    return 0;
}

/* Stage 2: whether the exact search runs, its granule and rounded lower bound, and, in
 * minimise mode, one decision at the lower bound first (OPT = LB on most real traces, and a
 * tight capacity is where the search's inference is strongest). */
static int exact_prepare(plan_run *r) {
    const plan_input *in = r->in;
    const size_t m = in->m;
    r->exact_allowed = m && in->n_fixed == 0 && m <= EXACT_MAX_TENSORS;
    r->fits = meets_capacity(r->best, r->target);
    r->hopeless = r->target && r->target < r->lower_bound;
    r->exact_phase = !r->optimal && r->opts->time_limit > 0 && r->exact_allowed && !r->fits &&
                     !r->hopeless;
    r->problem = (lshm__plan_problem){m, in->start, in->end, in->size, in->alignment,
                                      in->times, NULL};
    r->granule = 1;
    r->lb_rounded = r->lower_bound;
    if (!r->exact_phase)
        return 0;
    r->widths = malloc(m * sizeof *r->widths);
    if (!r->widths)
        return OUT_OF_MEMORY;
    uint64_t g = 0; /* gcd of the sizes */
    for (size_t i = 0; i < m; i++) {
        uint32_t o = in->orig[i];
        /* lasts - firsts in uint64 (as int64 it overflows beyond INT64_MAX), + 1 when
         * inclusive saturating (INT64_MIN..INT64_MAX inclusive is 2^64 units) */
        r->widths[i] = (uint64_t)r->lasts[o] - (uint64_t)r->firsts[o];
        if ((r->opts->flags & LSHM_PLAN_INCLUSIVE) && r->widths[i] != UINT64_MAX)
            r->widths[i]++;
        for (uint64_t a = in->size[i], t; a; t = g % a, g = a, a = t)
            ;
    }
    if (g % in->alignment) /* offsets: multiples of the alignment, arenas of gcd(a, g) */
        for (uint64_t a = in->alignment, t; a; t = g % a, g = a, a = t)
            ;
    /* else every offset is a sum of sizes (rounding to the alignment changes nothing) */
    r->granule = g;
    r->problem.width = r->widths;
    r->lb_rounded = r->lower_bound / g * g; /* rounded up without lb + g - 1 (which may wrap);
                                             * no overflow: best >= lb is a multiple of g */
    if (r->lb_rounded < r->lower_bound)
        r->lb_rounded += g;
    if (r->best <= r->lb_rounded)
        r->optimal = 1; /* OPT is a multiple of g too */
    if (!r->target && r->lb_rounded < r->best) {
        int found = exact_probe(&r->problem, r->lb_rounded, r->started + r->opts->time_limit / 5,
                                r->offsets, r->best_offsets, &r->best, r->debug);
        if (found < 0 && found != -1)
            return OUT_OF_MEMORY;
        if (found == 1)
            r->optimal = r->used_exact = 1;
        r->lb_disproven = found == 0;
    }
    return 0;
}

/* Stage 3: local search on the best order. Moves a tensor that touches the top to an earlier
 * place in the order; keeps moves that do not grow the arena (plateaus let the search drift).
 * With an exact tail coming, it only gets a share of the budget; in capacity mode the exact
 * search decides right away when it can run. */
static int local_search(plan_run *r) {
    const plan_input *in = r->in;
    const size_t m = in->m, count = r->placed_count;
    if (r->optimal || r->fits || r->hopeless || r->opts->time_limit <= 0 || count <= 1 ||
        (r->target && r->exact_allowed))
        return 0;
    double until = r->exact_allowed ? lshm__plan_now() + r->opts->time_limit * 0.05
                                    : r->deadline;
    uint64_t current = r->best, seed = 0x5DEECE66Dull ^ m;
    uint32_t *order = r->order;
    memcpy(order, r->best_order, count * sizeof *order);
    memcpy(r->offsets, r->best_offsets, m * sizeof *r->offsets);
    uint64_t *tried = malloc(m * sizeof *tried);
    uint32_t *at_top = malloc(m * sizeof *at_top);
    if (!tried || !at_top) {
        free(tried), free(at_top);
        return OUT_OF_MEMORY;
    }
    int improved = 0;
    for (unsigned iter = 0; r->best > r->lower_bound && !meets_capacity(r->best, r->target);
         iter++) {
        if ((iter & 7) == 0 && lshm__plan_now() > until)
            break;
        size_t top_count = 0; /* positions in order of tensors whose block touches the top */
        for (size_t j = 0; j < count; j++)
            if (r->offsets[order[j]] + in->size[order[j]] == current)
                at_top[top_count++] = (uint32_t)j;
        size_t from = top_count ? at_top[rng_next(&seed) % top_count] : rng_next(&seed) % count;
        size_t to = from == 0 ? 1 + rng_next(&seed) % (count - 1) : rng_next(&seed) % from;
        /* move order[from] to `to` (to < from: earlier; to > from: swap down) */
        uint32_t moved = order[from];
        if (to < from) {
            memmove(order + to + 1, order + to, (from - to) * sizeof *order);
            order[to] = moved;
        } else {
            order[from] = order[to];
            order[to] = moved;
        }
        uint64_t arena = engine_run(&r->engine, in, order, count, r->best_fit, tried,
                                    current + 1);
        if (r->engine.nomem) {
            free(tried), free(at_top);
            return OUT_OF_MEMORY;
        }
        if (arena <= current) {
            current = arena;
            memcpy(r->offsets, tried, m * sizeof *r->offsets);
            if (arena < r->best) {
                r->best = arena;
                memcpy(r->best_offsets, tried, m * sizeof *r->best_offsets);
                memcpy(r->best_order, order, count * sizeof *order);
                improved = 1;
            }
        } else if (to < from) { /* undo */
            memmove(order + to, order + to + 1, (from - to) * sizeof *order);
            order[from] = moved;
        } else {
            order[to] = order[from];
            order[from] = moved;
        }
    }
    free(tried), free(at_top);
    if (improved)
        snprintf(r->name + strlen(r->name), sizeof r->name - strlen(r->name), "+local");
    if (r->best <= r->lower_bound)
        r->optimal = 1;
    return 0;
}

/* Stage 4: exact decision search (planner_exact.c).
 *  - capacity mode: one decision at the target with the whole remaining budget;
 *  - minimise mode (after the lower-bound probe of exact_prepare): rounds of bisection between
 *    the lowest capacity not disproven and the best plan, every decision with the same time
 *    slice, the slice doubling each round; a round begins with LB again while LB is not
 *    disproven. How long a decision takes varies a lot from one capacity to the next (a
 *    capacity a little above one solved in 0.1 s may take seconds), so a capacity that timed
 *    out is only skipped for the rest of its round. Capacities are multiples of the granule:
 *    the gcd of the sizes when the alignment divides it (every canonical offset is a sum of
 *    sizes then), else the gcd of that and the alignment. */
static int exact_bisection(plan_run *r) {
    if (!r->exact_phase || r->optimal || meets_capacity(r->best, r->target))
        return 0;
    const uint64_t g = r->granule;
    uint64_t high = r->best;                                        /* best plan found */
    uint64_t low = r->lb_disproven ? r->lb_rounded + g : r->lb_rounded; /* below: infeasible */
    uint64_t round_low = high; /* ... or timed out in this round */
    /* resolution: a round stops bisecting when the gap left is below 1/64 of the first */
    uint64_t resolution = low < high ? ((high - low) / 64 + g - 1) / g * g : 0;
    int first = 1, rounds = 0;
    double slice = 0;
    while (low < high) {
        double now = lshm__plan_now();
        if (now >= r->deadline)
            break;
        uint64_t capacity;
        double until;
        if (r->target) {
            if (!first)
                break;
            capacity = r->target;
            until = r->deadline;
        } else {
            int new_round = round_low + resolution >= high;
            if (new_round) {
                round_low = low;
                slice = slice ? 2 * slice : (r->deadline - now) / 16;
                rounds++;
            }
            capacity = round_low + (high - round_low) / g / 2 * g;
            if (new_round && rounds > 1 && round_low == r->lb_rounded) /* LB again, longer */
                capacity = round_low;
            until = now + slice;
        }
        first = 0;
        int found = exact_probe(&r->problem, capacity, until < r->deadline ? until : r->deadline,
                                r->offsets, r->best_offsets, &r->best, r->debug);
        if (found < 0 && found != -1)
            return OUT_OF_MEMORY;
        if (found == 1) {
            high = r->best;
            r->used_exact = 1;
        } else {
            if (found == 0 && capacity >= low)
                low = capacity + g;
            if (capacity >= round_low)
                round_low = capacity + g;
            if (round_low < low)
                round_low = low;
        }
    }
    if (!r->target && low >= high)
        r->optimal = 1;
    return 0;
}

/* Stage 5, before anything is written back: the plan is valid (no live overlap, aligned,
 * within the arena, pins kept). */
static int self_check(plan_run *r) {
    const plan_input *in = r->in;
    if (in->m == 0)
        return 0;
    uint32_t a, b;
    int nomem;
    int bad = find_overlap(in, r->best_offsets, &a, &b, &nomem);
    if (nomem)
        return OUT_OF_MEMORY;
    for (size_t i = 0; i < in->m && !bad; i++)
        bad = (r->best_offsets[i] & (in->alignment - 1)) != 0 ||
              r->best_offsets[i] + in->size[i] > r->best ||
              (in->fixed[i] != UINT64_MAX && in->fixed[i] != r->best_offsets[i]);
    assert(!bad);
    if (bad)
        return LSHM_FAIL(-EFAULT, "planner bug: strategy %s produced an invalid plan", r->name);
    return 0;
}

int lshm_plan(size_t n, const uint64_t *sizes, const int64_t *firsts, const int64_t *lasts,
              const int64_t *fixed_offsets, const lshm_plan_options *opts, uint64_t *offsets,
              lshm_plan_result *result) {
    double started = lshm__plan_now();
    const int debug = getenv("LSHM_PLAN_DEBUG") != NULL;
    if (n > 0 && !offsets)
        return LSHM_FAIL(-EINVAL, "offsets is NULL with n = %zu", n);
    lshm_plan_options defaults;
    if (!opts) {
        lshm_plan_options_init(&defaults);
        opts = &defaults;
    }
    plan_input in;
    int err = input_build(&in, n, sizes, firsts, lasts, fixed_offsets, NULL, opts);
    if (err)
        return err;
    uint64_t lb = 0;
    err = lower_bound(&in, &lb);
    if (!err && in.n_fixed)
        err = check_pinned(&in);
    if (err) {
        input_free(&in);
        return err;
    }
    plan_run run;
    err = run_start(&run, &in, opts, firsts, lasts, started, debug, lb);
    if (!err)
        err = run_portfolio(&run);
    if (!err)
        err = exact_prepare(&run);
    if (!err)
        err = local_search(&run);
    if (!err)
        err = exact_bisection(&run);
    if (!err) {
        if (run.used_exact)
            snprintf(run.name, sizeof run.name, "exact");
        if (in.m && run.best <= lb)
            run.optimal = 1;
        err = self_check(&run);
    }
    if (err == OUT_OF_MEMORY)
        err = LSHM_FAIL(-ENOMEM, "planner: out of memory for %zu tensors", n);
    if (!err) {
        for (size_t i = 0; i < n; i++)
            offsets[i] = (fixed_offsets && fixed_offsets[i] >= 0) ? (uint64_t)fixed_offsets[i]
                                                                   : 0;
        for (size_t j = 0; j < in.m; j++)
            offsets[in.orig[j]] = run.best_offsets[j];
        if (result) {
            memset(result, 0, sizeof *result);
            result->arena_size = run.best;
            result->lower_bound = lb;
            result->optimal = run.optimal;
            snprintf(result->strategy, sizeof result->strategy, "%s", run.name);
            result->seconds = lshm__plan_now() - started;
        }
    }
    run_free(&run);
    input_free(&in);
    return err;
}
