/*
 * planner_internal.h -- what the planner's files (planner*.c) share; never installed.
 *
 * The planner works on a "compressed" problem: only the tensors that occupy memory (size > 0,
 * non-empty lifetime, not pinned), each with a half-open live range [start, end) of compressed
 * time points (0 <= start < end < 2^31) and its size padded up to the alignment where that
 * matters. Two tensors conflict iff start_a < end_b && start_b < end_a.
 */
#ifndef LSHM_PLANNER_INTERNAL_H
#define LSHM_PLANNER_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef LSHM_TESTING
/* Tests: every allocation of the planner is a fault point too (see internal.h), so a test can
 * fail each one in turn. Needs internal.h included first, as every planner file does. */
static inline void *lshm__plan_malloc(size_t n) {
    return LSHM_FAULT("planner: malloc") ? NULL : malloc(n);
}
static inline void *lshm__plan_calloc(size_t n, size_t size) {
    return LSHM_FAULT("planner: calloc") ? NULL : calloc(n, size);
}
static inline void *lshm__plan_realloc(void *p, size_t n) {
    return LSHM_FAULT("planner: realloc") ? NULL : realloc(p, n);
}
#define malloc(n) lshm__plan_malloc(n)
#define calloc(n, size) lshm__plan_calloc(n, size)
#define realloc(p, n) lshm__plan_realloc(p, n)
#endif

typedef struct lshm__plan_problem {
    size_t n;              /* tensors to place */
    const uint32_t *start; /* compressed start, per tensor */
    const uint32_t *end;   /* compressed end (exclusive), per tensor */
    const uint64_t *size;  /* bytes, > 0 */
    uint64_t alignment;    /* power of two >= 1 */
    uint32_t times;        /* every end <= times */
    const uint64_t *width; /* lifetime length in the caller's time units (preorder keys), or
                            * NULL to use the compressed lengths */
} lshm__plan_problem;

/* Exact search (planner_exact.c): MiniMalloc-style canonical DFS as a decision procedure.
 * Looks for a placement of `p` with every offset + size <= capacity. Returns 1 and writes
 * offsets when found, 0 when proven infeasible, -1 when the deadline (CLOCK_MONOTONIC seconds)
 * or the node budget ran out, -ENOMEM on allocation failure. */
int lshm__plan_exact(const lshm__plan_problem *p, uint64_t capacity, double deadline,
                     uint64_t *offsets);

/* Seconds on CLOCK_MONOTONIC. */
double lshm__plan_now(void);

/* The flag lshm_plan_interrupt sets for the lshm_plan call running on this thread (NULL
 * outside one, or for a call without options of the caller's): every stage stops soon after
 * it is set (the placement engine every 256 tensors, the searches where they look at the
 * clock). */
extern _Thread_local _Atomic int *lshm__plan_cancel;
static inline int lshm__plan_cancelled(void) {
    _Atomic int *flag = lshm__plan_cancel;
    return flag != NULL && atomic_load_explicit(flag, memory_order_relaxed);
}

/* ---- shared by the planner's files (planner.c and its stages) ------------------------------ */

#include "lshm.h"

#define PLAN_MAX_TENSORS ((size_t)1 << 28) /* compressed times must fit in 31 bits */

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

/* Sort items[0..m) ascending by key[items[i]], stable (planner_input.c). */
void lshm__plan_sort_by_key(uint32_t *items, size_t m, const uint64_t *key, uint32_t *tmp);

/* The caller's input, checked and compressed (planner_input.c). */
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
                               * to wrap), or with `saturated` the cap every end is checked
                               * against; validation: 0 (unused) */
    int saturated;            /* planning: the padded sizes (+ pinned top) sum past 64 bits */
} plan_input;
void lshm__plan_input_free(plan_input *in);
int lshm__plan_input_build(plan_input *in, size_t n, const uint64_t *sizes,
                           const int64_t *firsts, const int64_t *lasts,
                           const int64_t *fixed_offsets, const uint64_t *offsets,
                           const lshm_plan_options *opts);
/* The lower bound: the most bytes live at one time (with forced alignment padding). */
int lshm__plan_lower_bound(const plan_input *in, uint64_t *out);
/* 1 and two overlapping tensors (a, b) if the offsets overlap in space and time; *nomem. */
int lshm__plan_find_overlap(const plan_input *in, const uint64_t *off, uint32_t *tensor_a,
                            uint32_t *tensor_b, int *nomem);

/* The placement engine (planner_engine.c). */
enum { FIT_BEST = 0, FIT_FIRST = 1 };

typedef struct block {
    uint64_t lo, hi;
} block;

typedef struct engine {
    size_t m;
    const uint32_t *start, *end;
    const uint64_t *size;
    uint64_t alignment;
    uint32_t *pos;          /* [m] tensor -> position in start order */
    uint32_t *start_by_pos, *end_by_pos; /* [m] start/end of the tensor at each position */
    uint32_t *max_end_below; /* [m] max end of the placed tensors in the subtree of this node;
                              * 0 none */
    uint64_t *placed_lo, *placed_hi; /* [m] placed block by position; placed_hi == 0: not
                                      * placed */
    block *blocks;          /* [m] scratch: placed blocks overlapping in time */
    /* Dense mode (dense != 0): a segment tree over the time slots (intervals between
     * consecutive lifetime boundaries). Node v keeps two coalesced, offset-sorted sets of
     * occupied offset ranges: here[v], the blocks whose canonical cover includes v (live over
     * all of v), and sub[v], every block stored at v or below (sub[parent] contains
     * sub[child]). The placed blocks meeting [l, r) are then the union of sub[] over the
     * canonical nodes of [l, r) and here[] over the ancestors of those nodes, i.e. over the
     * paths from leaves l and r - 1 to the root. A query costs the size of these coalesced
     * sets, not the number of overlapping blocks, which on dense traces (thousands of live
     * tensors) is far larger: compare the engines with LSHM_PLAN_ENGINE=sparse and =dense
     * under tools/bench_planner.py. */
    int dense;
    uint32_t leaves;        /* leaves of the segment tree (power of two) */
    uint32_t *slot_lo, *slot_hi; /* [m] slot range [slot_lo, slot_hi) per tensor */
    struct interval_set *here, *sub; /* [2 leaves] */
    size_t blocks_cap;      /* capacity of blocks in dense mode (grows) */
    int nomem;
} engine;

typedef struct interval_set {
    block *ranges; /* [len] coalesced, sorted by offset; room for cap */
    uint32_t len, cap;
} interval_set;
void lshm__plan_engine_free(engine *e);
int lshm__plan_engine_init(engine *e, const plan_input *in, uint32_t *tmp, uint64_t *key,
                           int dense);
uint64_t lshm__plan_engine_run(engine *e, const plan_input *in, const uint32_t *order,
                               size_t count, int fit, uint64_t *off, uint64_t cutoff);

/* The orders (planner_order.c). */
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
extern const char *const lshm__plan_order_names[ORDER_COUNT];
typedef struct order_ctx {
    const plan_input *in;
    const int64_t *firsts, *lasts; /* caller's times, for lifetimes in real units */
    uint32_t *items;               /* [m] tensors that are not pinned */
    size_t count;
    uint64_t *key;                 /* [max(m, T)] */
    uint32_t *tmp;                 /* [max(m, T)] */
} order_ctx;
int lshm__plan_make_order(order_ctx *c, int which, uint32_t *out);

#endif
