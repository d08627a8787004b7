/*
 * planner_order.c -- the orders the portfolio places tensors in: the ones production planners
 * use (size, breadth, start, lifetime, conflicts, area, start then size).
 */
#include "internal.h"
#include "planner_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- tensor orders ------------------------------------------------------------------------- */


const char *const lshm__plan_order_names[ORDER_COUNT] = {
    "size", "breadth", "start", "lifetime", "conflicts", "area", "start-size",
};


static uint64_t duration_of(const order_ctx *c, uint32_t i) {
    uint32_t caller = c->in->orig[i];
    return (uint64_t)c->lasts[caller] - (uint64_t)c->firsts[caller];
}

/* Stable sorts of out[0..count): each one keeps the order of the previous sort among equal
 * keys, so a sequence of them sorts by the last key, then the one before, and so on. */
static void sort_by_start(order_ctx *c, uint32_t *out) {
    for (size_t i = 0; i < c->in->m; i++)
        c->key[i] = c->in->start[i];
    lshm__plan_sort_by_key(out, c->count, c->key, c->tmp);
}

static void sort_by_size_desc(order_ctx *c, uint32_t *out) {
    for (size_t i = 0; i < c->in->m; i++)
        c->key[i] = ~c->in->size[i];
    lshm__plan_sort_by_key(out, c->count, c->key, c->tmp);
}

static void sort_by_duration_desc(order_ctx *c, uint32_t *out) {
    for (size_t i = 0; i < c->in->m; i++)
        c->key[i] = ~duration_of(c, (uint32_t)i);
    lshm__plan_sort_by_key(out, c->count, c->key, c->tmp);
}

static void sort_by_area_desc(order_ctx *c, uint32_t *out) {
    for (size_t i = 0; i < c->in->m; i++) {
        /* duration + 1 in 128 bits: INT64_MIN..INT64_MAX lasts UINT64_MAX units */
        unsigned __int128 area = (unsigned __int128)c->in->size[i] *
                                 ((unsigned __int128)duration_of(c, (uint32_t)i) + 1);
        c->key[i] = ~(area >> 64 ? UINT64_MAX : (uint64_t)area);
    }
    lshm__plan_sort_by_key(out, c->count, c->key, c->tmp);
}

/* TVM greedy_by_conflicts: number of tensors live together desc, then size desc. */
static int order_by_conflicts(order_ctx *c, uint32_t *out) {
    const plan_input *in = c->in;
    const size_t m = in->m;
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
    sort_by_size_desc(c, out);
    for (size_t i = 0; i < m; i++)
        c->key[i] = ~(uint64_t)(starts_before[in->end[i]] - ends_by[in->start[i]]);
    lshm__plan_sort_by_key(out, c->count, c->key, c->tmp);
    free(starts_before), free(ends_by);
    return 0;
}

/* The rank of each task t < T when tasks are visited by breadth desc (breadth(t) = bytes live
 * at t), then by time. live_bytes, tasks, sort_scratch: T + 1 entries of scratch. */
static void rank_tasks_by_breadth(const plan_input *in, uint64_t *live_bytes, uint32_t *tasks,
                                  uint32_t *sort_scratch, uint32_t *rank) {
    uint32_t T = in->times;
    for (size_t i = 0; i < in->m; i++) {
        live_bytes[in->start[i]] += in->size[i];
        live_bytes[in->end[i]] -= in->size[i];
    }
    for (uint32_t t = 1; t < T; t++)
        live_bytes[t] += live_bytes[t - 1];
    for (uint32_t t = 0; t < T; t++) {
        tasks[t] = t;
        live_bytes[t] = ~live_bytes[t];
    }
    lshm__plan_sort_by_key(tasks, T, live_bytes, sort_scratch);
    for (uint32_t r = 0; r < T; r++)
        rank[tasks[r]] = r;
}

/* The smallest of min_tree[leaves + first .. leaves + end) in a bottom-up minimum segment tree
 * (node x holds the minimum of nodes 2x and 2x + 1). */
static uint32_t range_min(const uint32_t *min_tree, size_t leaves, uint32_t first, uint32_t end) {
    uint32_t best = UINT32_MAX;
    size_t l = leaves + first, r = leaves + end; /* [l, r) */
    while (l < r) {
        if (l & 1) {
            if (min_tree[l] < best)
                best = min_tree[l];
            l++;
        }
        if (r & 1) {
            r--;
            if (min_tree[r] < best)
                best = min_tree[r];
        }
        l >>= 1;
        r >>= 1;
    }
    return best;
}

/* Pisarchyk & Lee greedy by breadth: tasks visited by breadth desc (then time); a tensor is
 * placed at the first visited task it is live at, larger tensors first within a task. */
static int order_by_breadth(order_ctx *c, uint32_t *out) {
    const plan_input *in = c->in;
    uint32_t T = in->times;
    uint64_t *live_bytes = calloc((size_t)T + 1, sizeof *live_bytes);
    uint32_t *rank = malloc(((size_t)T + 1) * sizeof *rank);
    uint32_t *tasks = malloc(((size_t)T + 1) * sizeof *tasks);
    uint32_t *sort_scratch = malloc(((size_t)T + 1) * sizeof *sort_scratch);
    size_t leaves = 1;
    while (leaves < T)
        leaves <<= 1;
    uint32_t *min_tree = malloc(2 * leaves * sizeof *min_tree); /* min rank over time ranges */
    if (!live_bytes || !rank || !tasks || !sort_scratch || !min_tree) {
        free(live_bytes), free(rank), free(tasks), free(sort_scratch), free(min_tree);
        return -ENOMEM;
    }
    rank_tasks_by_breadth(in, live_bytes, tasks, sort_scratch, rank);
    for (size_t x = 0; x < 2 * leaves; x++)
        min_tree[x] = UINT32_MAX;
    for (uint32_t t = 0; t < T; t++)
        min_tree[leaves + t] = rank[t];
    for (size_t x = leaves - 1; x >= 1; x--)
        min_tree[x] = min_tree[2 * x] < min_tree[2 * x + 1] ? min_tree[2 * x] : min_tree[2 * x + 1];
    sort_by_size_desc(c, out);
    for (size_t i = 0; i < in->m; i++)
        c->key[i] = range_min(min_tree, leaves, in->start[i], in->end[i]);
    lshm__plan_sort_by_key(out, c->count, c->key, c->tmp);
    free(live_bytes), free(rank), free(tasks), free(sort_scratch), free(min_tree);
    return 0;
}

/* Fills out[0..count) with the non-pinned tensors in the given order. */
int lshm__plan_make_order(order_ctx *c, int which, uint32_t *out) {
    memcpy(out, c->items, c->count * sizeof *out);
    switch (which) {
    case ORDER_SIZE:
        sort_by_start(c, out);
        sort_by_duration_desc(c, out);
        sort_by_size_desc(c, out);
        return 0;
    case ORDER_LIFETIME:
        sort_by_size_desc(c, out);
        sort_by_duration_desc(c, out);
        return 0;
    case ORDER_START:
        sort_by_start(c, out);
        return 0;
    case ORDER_START_SIZE:
        sort_by_size_desc(c, out);
        sort_by_start(c, out);
        return 0;
    case ORDER_AREA:
        sort_by_area_desc(c, out);
        return 0;
    case ORDER_CONFLICTS:
        return order_by_conflicts(c, out);
    case ORDER_BREADTH:
        return order_by_breadth(c, out);
    }
    return -EINVAL;
}
