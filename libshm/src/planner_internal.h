/*
 * planner_internal.h -- what planner.c and planner_exact.c share; never installed.
 *
 * The planner works on a "compressed" problem: only the tensors that occupy memory (size > 0,
 * non-empty lifetime, not pinned), each with a half-open live range [start, end) of compressed
 * time points (0 <= start < end < 2^31) and its size padded up to the alignment where that
 * matters. Two tensors conflict iff start_a < end_b && start_b < end_a.
 */
#ifndef LSHM_PLANNER_INTERNAL_H
#define LSHM_PLANNER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

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

#endif
