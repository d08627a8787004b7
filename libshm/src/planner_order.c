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
    uint32_t o = c->in->orig[i];
    return (uint64_t)c->lasts[o] - (uint64_t)c->firsts[o];
}

/* Fills out[0..count) with the non-pinned tensors in the given order. */
int lshm__plan_make_order(order_ctx *c, int which, uint32_t *out) {
    const plan_input *in = c->in;
    size_t count = c->count, m = in->m;
    uint64_t *key = c->key;
    memcpy(out, c->items, count * sizeof *out);
    switch (which) {
    case ORDER_SIZE:
        for (size_t i = 0; i < m; i++)
            key[i] = in->start[i];
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~duration_of(c, (uint32_t)i);
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~in->size[i];
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_LIFETIME:
        for (size_t i = 0; i < m; i++)
            key[i] = ~in->size[i];
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~duration_of(c, (uint32_t)i);
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_START:
    case ORDER_START_SIZE:
        if (which == ORDER_START_SIZE) {
            for (size_t i = 0; i < m; i++)
                key[i] = ~in->size[i];
            lshm__plan_sort_by_key(out, count, key, c->tmp);
        }
        for (size_t i = 0; i < m; i++)
            key[i] = in->start[i];
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        return 0;
    case ORDER_AREA:
        for (size_t i = 0; i < m; i++) {
            /* duration + 1 in 128 bits: INT64_MIN..INT64_MAX lasts UINT64_MAX units */
            unsigned __int128 area = (unsigned __int128)in->size[i] *
                                     ((unsigned __int128)duration_of(c, (uint32_t)i) + 1);
            key[i] = ~(area >> 64 ? UINT64_MAX : (uint64_t)area);
        }
        lshm__plan_sort_by_key(out, count, key, c->tmp);
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
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        for (size_t i = 0; i < m; i++)
            key[i] = ~(uint64_t)(starts_before[in->end[i]] - ends_by[in->start[i]]);
        lshm__plan_sort_by_key(out, count, key, c->tmp);
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
        lshm__plan_sort_by_key(tasks, T, live_bytes, sort_scratch);
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
        lshm__plan_sort_by_key(out, count, key, c->tmp);
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
        lshm__plan_sort_by_key(out, count, key, c->tmp);
        free(live_bytes), free(rank), free(tasks), free(sort_scratch), free(seg);
        return 0;
    }
    }
    return -EINVAL;
}
