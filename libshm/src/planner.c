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
 *    live tensors (as on the dense traces S_1 and Y_1 of ../shared/traces/idealloc/iopddl).
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
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double lshm__plan_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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
    int err = lshm__plan_input_build(&in, n, sizes, firsts, lasts, NULL, NULL, opts);
    if (err)
        return err;
    uint64_t lower_bound;
    err = lshm__plan_lower_bound(&in, &lower_bound);
    lshm__plan_input_free(&in);
    if (err)
        return err;
    *lower_bound_out = lower_bound;
    return 0;
}

int lshm_plan_validate(size_t n, const uint64_t *sizes, const int64_t *firsts,
                       const int64_t *lasts, const uint64_t *offsets,
                       const lshm_plan_options *opts, uint64_t arena_size) {
    if (n > 0 && !offsets)
        return LSHM_FAIL(-EINVAL, "offsets is NULL with n = %zu", n);
    plan_input in;
    /* lshm__plan_input_build refuses misaligned offsets and offset + size beyond 64 bits
     * (UINT64_MAX itself is then only accepted for a zero-size tensor, which occupies nothing) */
    int err = lshm__plan_input_build(&in, n, sizes, firsts, lasts, NULL, offsets, opts);
    if (err)
        return err;
    for (size_t j = 0; j < in.m; j++) { /* tensors that occupy memory */
        size_t i = in.orig[j];
        if (offsets[i] + sizes[i] > arena_size) {
            lshm__plan_input_free(&in);
            return LSHM_FAIL(-EINVAL, "tensor %zu: end %llu beyond arena_size %llu", i,
                             (unsigned long long)(offsets[i] + sizes[i]),
                             (unsigned long long)arena_size);
        }
    }
    uint64_t *off = in.m ? malloc(in.m * sizeof *off) : NULL;
    if (in.m && !off) {
        lshm__plan_input_free(&in);
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    }
    for (size_t j = 0; j < in.m; j++)
        off[j] = offsets[in.orig[j]];
    uint32_t a, b;
    int nomem;
    int bad = lshm__plan_find_overlap(&in, off, &a, &b, &nomem);
    uint32_t first = 0, second = 0; /* the offending pair's caller indices, lower first */
    if (bad) {
        first = in.orig[a] < in.orig[b] ? in.orig[a] : in.orig[b];
        second = in.orig[a] < in.orig[b] ? in.orig[b] : in.orig[a];
    }
    free(off);
    lshm__plan_input_free(&in);
    if (nomem)
        return LSHM_FAIL(-ENOMEM, "planner: out of memory");
    if (bad)
        return LSHM_FAIL(-EINVAL,
                         "tensors %u [%llu, +%llu) and %u [%llu, +%llu) are live together and "
                         "overlap",
                         first, (unsigned long long)offsets[first],
                         (unsigned long long)sizes[first], second,
                         (unsigned long long)offsets[second], (unsigned long long)sizes[second]);
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
 * lshm__plan_input_build keeps <= UINT64_MAX, or at most in.total < UINT64_MAX when the sizes
 * sum past 64 bits (and lshm__plan_engine_run's cutoff never fires at NO_PLAN). */
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
    int bad = lshm__plan_find_overlap(&pinned, offset, &a, &b, &nomem);
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
#define CANCELLED (-ECANCELED) /* (lshm_plan_interrupt; its message is set at the end) */
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
        lshm__plan_engine_free(&r->engine);
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
        if (lshm__plan_engine_init(&r->engine, in, r->scratch_ids, r->scratch_keys, dense))
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
                       !meets_capacity(r->best, r->target) && !lshm__plan_cancelled();
         s++) {
        const strategy *candidate = &portfolio_used[s];
        double began = lshm__plan_now();
        if (lshm__plan_make_order(&orders, candidate->order, r->order))
            return OUT_OF_MEMORY;
        uint64_t arena = lshm__plan_engine_run(&r->engine, in, r->order, r->placed_count,
                                               candidate->fit, r->offsets, r->best);
        if (r->engine.nomem)
            return OUT_OF_MEMORY;
        if (r->debug)
            fprintf(stderr, "lshm_plan: %s/%s %s in %.3f ms (%s engine)\n",
                    lshm__plan_order_names[candidate->order],
                    candidate->fit == FIT_BEST ? "best" : "first",
                    arena == UINT64_MAX ? "cut off" : "done", (lshm__plan_now() - began) * 1e3,
                    r->engine.dense ? "dense" : "sparse");
        if (arena < r->best) {
            r->best = arena;
            r->best_fit = candidate->fit;
            memcpy(r->best_offsets, r->offsets, m * sizeof *r->best_offsets);
            memcpy(r->best_order, r->order, r->placed_count * sizeof *r->order);
            snprintf(r->name, sizeof r->name, "%s/%s", lshm__plan_order_names[candidate->order],
                     candidate->fit == FIT_BEST ? "best-fit" : "first-fit");
        }
    }
    if (m && r->best == NO_PLAN && !lshm__plan_cancelled())
        return LSHM_FAIL(-EOVERFLOW, "no placement of the %zu tensors ends below %llu bytes "
                         "(their sizes sum past 64 bits)", m, (unsigned long long)in->total);
    if (m && r->best <= r->lower_bound)
        r->optimal = 1;
    return 0;
}

/* Greatest common divisor (Euclid); gcd(0, b) = b. */
static uint64_t gcd_u64(uint64_t a, uint64_t b) {
    while (b) {
        uint64_t rest = a % b;
        a = b;
        b = rest;
    }
    return a;
}

/* Stage 2: whether the exact search runs, its granule and rounded lower bound, and, in
 * minimise mode, one decision at the lower bound first (OPT = LB on most real traces, and a
 * tight capacity is where the search's inference is strongest). */
static int exact_prepare(plan_run *r) {
    const plan_input *in = r->in;
    const size_t m = in->m;
    /* (not when the sizes sum past 64 bits: its sums of placed tops and section bytes rely
     * on that bound not to wrap) */
    r->exact_allowed = m && in->n_fixed == 0 && m <= EXACT_MAX_TENSORS && !in->saturated;
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
    uint64_t granule = 0; /* gcd of the sizes */
    for (size_t i = 0; i < m; i++) {
        uint32_t caller = in->orig[i];
        /* lasts - firsts in uint64 (as int64 it overflows beyond INT64_MAX), + 1 when
         * inclusive saturating (INT64_MIN..INT64_MAX inclusive is 2^64 units) */
        r->widths[i] = (uint64_t)r->lasts[caller] - (uint64_t)r->firsts[caller];
        if ((r->opts->flags & LSHM_PLAN_INCLUSIVE) && r->widths[i] != UINT64_MAX)
            r->widths[i]++;
        granule = gcd_u64(granule, in->size[i]);
    }
    if (granule % in->alignment) /* offsets: multiples of the alignment, arenas of the gcd of
                                  * both */
        granule = gcd_u64(granule, in->alignment);
    /* else every offset is a sum of sizes (rounding to the alignment changes nothing) */
    r->granule = granule;
    r->problem.width = r->widths;
    /* rounded up without lower_bound + granule - 1 (which may wrap); no overflow: best >=
     * lower_bound is a multiple of the granule */
    r->lb_rounded = r->lower_bound / granule * granule;
    if (r->lb_rounded < r->lower_bound)
        r->lb_rounded += granule;
    if (r->best <= r->lb_rounded)
        r->optimal = 1; /* OPT is a multiple of the granule too */
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
        if ((iter & 7) == 0 && (lshm__plan_now() > until || lshm__plan_cancelled()))
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
        uint64_t arena = lshm__plan_engine_run(&r->engine, in, order, count, r->best_fit, tried,
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
 *    disproven. How long a decision takes varies a lot from one capacity to the next (one a
 *    little above a capacity decided at once may not be decided within its slice), so a
 *    capacity that timed out is only skipped for the rest of its round. Capacities are multiples of the granule:
 *    the gcd of the sizes when the alignment divides it (every canonical offset is a sum of
 *    sizes then), else the gcd of that and the alignment. */
static int exact_bisection(plan_run *r) {
    if (!r->exact_phase || r->optimal || meets_capacity(r->best, r->target))
        return 0;
    const uint64_t granule = r->granule;
    uint64_t high = r->best; /* best plan found */
    /* below: infeasible */
    uint64_t low = r->lb_disproven ? r->lb_rounded + granule : r->lb_rounded;
    uint64_t round_low = high; /* ... or timed out in this round */
    /* resolution: a round stops bisecting when the gap left is below 1/64 of the first */
    uint64_t resolution = low < high ? ((high - low) / 64 + granule - 1) / granule * granule : 0;
    int first = 1, rounds = 0;
    double slice = 0;
    while (low < high) {
        double now = lshm__plan_now();
        if (now >= r->deadline || lshm__plan_cancelled())
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
            capacity = round_low + (high - round_low) / granule / 2 * granule;
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
                low = capacity + granule;
            if (capacity >= round_low)
                round_low = capacity + granule;
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
    int bad = lshm__plan_find_overlap(in, r->best_offsets, &a, &b, &nomem);
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

/* ---- interruption (lshm_plan_interrupt) ---------------------------------------------------- */

/* The lshm_plan calls running now that were given the caller's options, each with the flag
 * lshm_plan_interrupt sets (a node on the call's stack). running_lock is held around fork()
 * (lshm__plan_prepare_fork), so a child never inherits it held; the child's list is empty
 * (the threads of the calls are not there, and the forking thread is in none). */
typedef struct running_call {
    const lshm_plan_options *opts;
    _Atomic int cancel;
    struct running_call *next;
} running_call;
static pthread_mutex_t running_lock = PTHREAD_MUTEX_INITIALIZER;
static running_call *running;
_Thread_local _Atomic int *lshm__plan_cancel;

void lshm__plan_prepare_fork(void) { pthread_mutex_lock(&running_lock); }

void lshm__plan_after_fork(int child) {
    if (child)
        running = NULL;
    pthread_mutex_unlock(&running_lock); /* (a normal mutex: any thread may, the child's too) */
}

static void running_add(running_call *call, const lshm_plan_options *opts) {
    call->opts = opts;
    atomic_init(&call->cancel, 0);
    pthread_mutex_lock(&running_lock);
    call->next = running;
    running = call;
    pthread_mutex_unlock(&running_lock);
    lshm__plan_cancel = &call->cancel;
}

static void running_remove(running_call *call) {
    lshm__plan_cancel = NULL;
    pthread_mutex_lock(&running_lock);
    for (running_call **at = &running; *at; at = &(*at)->next)
        if (*at == call) {
            *at = call->next;
            break;
        }
    pthread_mutex_unlock(&running_lock);
}

int lshm_plan_interrupt(const lshm_plan_options *opts) {
    if (opts == NULL)
        return LSHM_FAIL(-EINVAL, "lshm_plan_interrupt: NULL options (a call made with NULL "
                                  "options cannot be interrupted)");
    int found = 0;
    pthread_mutex_lock(&running_lock);
    for (running_call *call = running; call; call = call->next)
        if (call->opts == opts) {
            atomic_store_explicit(&call->cancel, 1, memory_order_relaxed);
            found++;
        }
    pthread_mutex_unlock(&running_lock);
    return found;
}

static int plan_call(size_t n, const uint64_t *sizes, const int64_t *firsts,
                     const int64_t *lasts, const int64_t *fixed_offsets,
                     const lshm_plan_options *opts, uint64_t *offsets,
                     lshm_plan_result *result);

int lshm_plan(size_t n, const uint64_t *sizes, const int64_t *firsts, const int64_t *lasts,
              const int64_t *fixed_offsets, const lshm_plan_options *opts, uint64_t *offsets,
              lshm_plan_result *result) {
    if (opts == NULL || lshm__plan_cancel != NULL) /* (none to interrupt it by; nested) */
        return plan_call(n, sizes, firsts, lasts, fixed_offsets, opts, offsets, result);
    running_call call;
    running_add(&call, opts);
    int rc = plan_call(n, sizes, firsts, lasts, fixed_offsets, opts, offsets, result);
    running_remove(&call);
    return rc;
}

static int plan_call(size_t n, const uint64_t *sizes, const int64_t *firsts,
                     const int64_t *lasts, const int64_t *fixed_offsets,
                     const lshm_plan_options *opts, uint64_t *offsets,
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
    int err = lshm__plan_input_build(&in, n, sizes, firsts, lasts, fixed_offsets, NULL, opts);
    if (err)
        return err;
    uint64_t lower_bound = 0;
    err = lshm__plan_lower_bound(&in, &lower_bound);
    if (!err && in.saturated && lower_bound > in.total)
        err = LSHM_FAIL(-EOVERFLOW, "tensors live at the same time need %llu bytes, past the "
                        "highest aligned offset below 2^64, %llu",
                        (unsigned long long)lower_bound, (unsigned long long)in.total);
    if (!err && in.n_fixed)
        err = check_pinned(&in);
    if (err) {
        lshm__plan_input_free(&in);
        return err;
    }
    plan_run run;
    err = run_start(&run, &in, opts, firsts, lasts, started, debug, lower_bound);
    /* (each stage only if the call was not interrupted, nor the self-check after the last: a
     * stage stopped short may leave no plan at all, e.g. the portfolio's first strategy cut
     * off) */
    int (*const stages[])(plan_run *) = {run_portfolio, exact_prepare, local_search,
                                         exact_bisection};
    for (size_t s = 0; s < sizeof stages / sizeof stages[0] && !err; s++)
        err = lshm__plan_cancelled() ? CANCELLED : stages[s](&run);
    if (!err && lshm__plan_cancelled())
        err = CANCELLED;
    if (!err) {
        if (run.used_exact)
            snprintf(run.name, sizeof run.name, "exact");
        if (in.m && run.best <= lower_bound)
            run.optimal = 1;
        err = self_check(&run);
    }
    if (err == CANCELLED) /* (nothing written: offsets and result untouched) */
        err = LSHM_FAIL(-ECANCELED, "lshm_plan: interrupted (lshm_plan_interrupt)");
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
            result->lower_bound = lower_bound;
            result->optimal = run.optimal;
            snprintf(result->strategy, sizeof result->strategy, "%s", run.name);
            result->seconds = lshm__plan_now() - started;
        }
    }
    run_free(&run);
    lshm__plan_input_free(&in);
    return err;
}
