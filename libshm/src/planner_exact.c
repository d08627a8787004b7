/*
 * planner_exact.c -- exact decision search for the arena planner: "do all tensors fit under
 * this capacity?", in the spirit of MiniMalloc (Moffitt, ASPLOS'23).
 *
 * Ideas (our own code, same principles as the paper):
 *  - Canonical solutions. Every tensor is placed at its *minimum offset*: the aligned top of
 *    the placed tensors it conflicts with (0 if none). Tensors are placed in non-decreasing
 *    (min offset, preorder rank) order, so each packing is generated once.
 *  - Dominance. A tensor whose min offset is at or above the lowest possible top of another
 *    unplaced tensor would leave a hole that one could fill: skip it (and all later ones).
 *  - Inference on sections (time slices between consecutive lifetime boundaries): each has a
 *    floor (highest placed top, raised to the lowest min offset of its unplaced tensors) and
 *    the bytes of its unplaced tensors; floor + bytes > capacity prunes the node.
 *  - Dynamic decomposition: a count of unplaced tensors crossing each section boundary; when
 *    placing a tensor brings one to zero, the two sides are solved as independent subproblems
 *    (each with a fresh canonical search; one failing fails the node). Also done at the root.
 *  - Static preorders (by section total, width in sections, area) tried round robin with a
 *    doubling node limit, as MiniMalloc does.
 */
#include "internal.h"
#include "planner_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct change {
    uint32_t idx;
    uint64_t value;
} change;

typedef struct exact {
    size_t n;
    const lshm__plan_problem *p;
    uint64_t capacity, alignment;
    uint32_t nsec;
    uint32_t *sec_lo, *sec_hi;      /* [n] sections [lo, hi) covered by each tensor */
    uint32_t *ov_start, *ov;        /* CSR: conflicting tensors of each tensor */
    uint32_t *sb_start, *sb;        /* CSR: tensors of each section */
    uint64_t *floor, *total;        /* [nsec] */
    uint32_t *cuts;                 /* [nsec] unplaced tensors crossing the boundary s | s + 1 */
    uint64_t *min_off;              /* [n] */
    uint64_t *off;                  /* [n] UINT64_MAX while unplaced */
    uint32_t *rank;                 /* [n] preorder rank */
    uint32_t *pool;                 /* ordering lists of every depth, n (n + 1) / 2 */
    uint8_t *affected;              /* [nsec] marks */
    uint32_t *aff_list;             /* [nsec] */
    change *undo;                   /* undo log */
    size_t undo_len, undo_cap;
    int64_t nodes_left;
    double deadline;
    int timed_out, nomem;
} exact;

static int push_change(exact *x, uint32_t idx, uint64_t value)
{
    if (x->undo_len == x->undo_cap) {
        size_t cap = x->undo_cap ? 2 * x->undo_cap : 1024;
        change *u = realloc(x->undo, cap * sizeof *u);
        if (!u) {
            x->nomem = 1;
            return -1;
        }
        x->undo = u;
        x->undo_cap = cap;
    }
    x->undo[x->undo_len].idx = idx;
    x->undo[x->undo_len].value = value;
    x->undo_len++;
    return 0;
}

static inline uint64_t up(uint64_t v, uint64_t a) { return (v + a - 1) & ~(a - 1); }

/* ordering: unplaced tensors sorted by (min_off, rank); insertion sort from the parent's
 * (already nearly sorted) list. */
static size_t build_ordering(exact *x, const uint32_t *parent, size_t pn, uint32_t *out)
{
    size_t k = 0;
    for (size_t j = 0; j < pn; j++) {
        uint32_t b = parent[j];
        if (x->off[b] != UINT64_MAX)
            continue;
        size_t q = k++;
        while (q > 0) {
            uint32_t c = out[q - 1];
            if (x->min_off[c] < x->min_off[b] ||
                (x->min_off[c] == x->min_off[b] && x->rank[c] < x->rank[b]))
                break;
            out[q] = c;
            q--;
        }
        out[q] = b;
    }
    return k;
}

static int solve_split(exact *x, const uint32_t *list, size_t k, uint32_t plo, uint32_t phi,
                       uint32_t *pool);

/* Searches the unplaced tensors of parent[0..pn), all within sections [plo, phi).
 * Undo log entries: idx < n: min_off of a tensor; idx >= n: floor of section idx - n. */
static int search(exact *x, const uint32_t *parent, size_t pn, uint32_t *mine, uint64_t last_off,
                  uint32_t last_rank, uint32_t plo, uint32_t phi)
{
    if (--x->nodes_left < 0)
        return -1;
    if ((x->nodes_left & 255) == 0 && lshm__plan_now() > x->deadline) {
        x->timed_out = 1;
        return -1;
    }
    size_t k = build_ordering(x, parent, pn, mine);
    if (k == 0)
        return 1;
    uint64_t min_height = UINT64_MAX;
    for (size_t j = 0; j < k; j++) {
        uint64_t h = x->min_off[mine[j]] + x->p->size[mine[j]];
        if (h < min_height)
            min_height = h;
    }
    const size_t n = x->n;
    for (size_t j = 0; j < k; j++) {
        uint32_t b = mine[j];
        uint64_t o = x->min_off[b];
        if (o < last_off || (o == last_off && x->rank[b] < last_rank))
            continue; /* not canonical */
        if (o >= min_height)
            break; /* dominated; the rest are higher still */
        uint64_t height = o + x->p->size[b];
        if (height > x->capacity)
            continue;
        size_t mark = x->undo_len;
        x->off[b] = o;
        size_t naff = 0;
        for (uint32_t e = x->ov_start[b]; e < x->ov_start[b + 1]; e++) {
            uint32_t c = x->ov[e];
            if (x->off[c] != UINT64_MAX || x->min_off[c] >= height)
                continue;
            if (push_change(x, c, x->min_off[c]))
                return -2;
            x->min_off[c] = up(height, x->alignment);
            for (uint32_t s = x->sec_lo[c]; s < x->sec_hi[c]; s++)
                if (!x->affected[s]) {
                    x->affected[s] = 1;
                    x->aff_list[naff++] = s;
                }
        }
        for (uint32_t s = x->sec_lo[b]; s < x->sec_hi[b]; s++) {
            if (push_change(x, (uint32_t)n + s, x->floor[s]))
                return -2;
            x->floor[s] = height;
            x->total[s] -= x->p->size[b];
        }
        for (size_t a = 0; a < naff; a++) {
            uint32_t s = x->aff_list[a];
            x->affected[s] = 0;
            uint64_t lo = UINT64_MAX;
            for (uint32_t e = x->sb_start[s]; e < x->sb_start[s + 1]; e++) {
                uint32_t c = x->sb[e];
                if (x->off[c] == UINT64_MAX && x->min_off[c] < lo)
                    lo = x->min_off[c];
            }
            if (lo != UINT64_MAX && x->floor[s] < lo) {
                if (push_change(x, (uint32_t)n + s, x->floor[s]))
                    return -2;
                x->floor[s] = lo;
            }
        }
        int ok = 1;
        for (uint32_t s = plo; s < phi && ok; s++) {
            uint64_t f = x->floor[s] > o ? x->floor[s] : o;
            if (x->total[s] && f + x->total[s] > x->capacity)
                ok = 0;
        }
        /* Dynamic decomposition: when no unplaced tensor crosses a boundary any more, the two
         * sides are independent subproblems (solved one after the other; one failing fails
         * this node, with no retrying of the others). */
        int split = 0;
        for (uint32_t s = x->sec_lo[b]; s + 1 < x->sec_hi[b]; s++)
            if (--x->cuts[s] == 0 && s + 1 > plo && s + 1 < phi)
                split = 1;
        int r = 0;
        if (ok)
            r = split ? solve_split(x, mine, k, plo, phi, mine + k)
                      : search(x, mine, k, mine + k, o, x->rank[b], plo, phi);
        for (uint32_t s = x->sec_lo[b]; s + 1 < x->sec_hi[b]; s++)
            x->cuts[s]++;
        for (uint32_t s = x->sec_lo[b]; s < x->sec_hi[b]; s++)
            x->total[s] += x->p->size[b];
        while (x->undo_len > mark) {
            change *c = &x->undo[--x->undo_len];
            if (c->idx < n)
                x->min_off[c->idx] = c->value;
            else
                x->floor[c->idx - n] = c->value;
        }
        if (r == 1)
            return 1; /* keep x->off of this branch? it was filled below; restore only ours */
        x->off[b] = UINT64_MAX;
        if (r < 0)
            return r;
    }
    return 0;
}

/* Splits the unplaced tensors of list[0..k) (within sections [plo, phi)) at the boundaries no
 * unplaced tensor crosses and solves each part with a fresh canonical search. pool holds the
 * parts, then the search lists. On failure every tensor of the parts is unplaced again. */
static int solve_split(exact *x, const uint32_t *list, size_t k, uint32_t plo, uint32_t phi,
                       uint32_t *pool)
{
    size_t used = 0;
    int r = 1;
    uint32_t lo = plo;
    while (lo < phi && r == 1) {
        uint32_t hi = lo + 1;
        while (hi < phi && x->cuts[hi - 1] != 0)
            hi++;
        uint32_t *part = pool + used;
        size_t pk = 0;
        for (size_t j = 0; j < k; j++) {
            uint32_t c = list[j];
            if (x->off[c] == UINT64_MAX && x->sec_lo[c] >= lo && x->sec_lo[c] < hi)
                part[pk++] = c;
        }
        used += pk;
        if (pk)
            r = search(x, part, pk, pool + used, 0, 0, lo, hi);
        lo = hi;
    }
    if (r != 1)
        for (size_t j = 0; j < used; j++)
            x->off[pool[j]] = UINT64_MAX;
    return r;
}

static void exact_free(exact *x)
{
    free(x->cuts);
    free(x->sec_lo), free(x->sec_hi), free(x->ov_start), free(x->ov), free(x->sb_start);
    free(x->sb), free(x->floor), free(x->total), free(x->min_off), free(x->off), free(x->rank);
    free(x->pool), free(x->affected), free(x->aff_list), free(x->undo);
}

/* qsort context-free comparators need globals; use a simple merge sort on keys instead. */
static void sort_idx(uint32_t *a, size_t n, const uint64_t *k1, const uint64_t *k2,
                     const uint64_t *k3, uint32_t *tmp)
{
    if (n < 2)
        return;
    size_t h = n / 2;
    sort_idx(a, h, k1, k2, k3, tmp);
    sort_idx(a + h, n - h, k1, k2, k3, tmp);
    size_t i = 0, j = h, o = 0;
    while (i < h || j < n) {
        int take_left;
        if (i == h)
            take_left = 0;
        else if (j == n)
            take_left = 1;
        else {
            uint32_t l = a[i], r = a[j];
            /* descending keys, then index */
            if (k1[l] != k1[r])
                take_left = k1[l] > k1[r];
            else if (k2[l] != k2[r])
                take_left = k2[l] > k2[r];
            else if (k3[l] != k3[r])
                take_left = k3[l] > k3[r];
            else
                take_left = l < r;
        }
        tmp[o++] = take_left ? a[i++] : a[j++];
    }
    memcpy(a, tmp, n * sizeof *a);
}

int lshm__plan_exact(const lshm__plan_problem *p, uint64_t capacity, double deadline,
                     uint64_t *offsets)
{
    exact x;
    memset(&x, 0, sizeof x);
    const size_t n = p->n;
    x.n = n;
    x.p = p;
    x.capacity = capacity;
    x.alignment = p->alignment;
    x.deadline = deadline;
    if (n == 0)
        return 1;
    int ret = -ENOMEM;
    /* sections: between consecutive distinct boundaries */
    uint32_t T = p->times;
    uint32_t *sec_of = calloc((size_t)T + 2, sizeof *sec_of);
    uint8_t *isb = calloc((size_t)T + 2, 1);
    uint64_t *kt = malloc(n * sizeof *kt), *kw = malloc(n * sizeof *kw), *ka = malloc(n * sizeof *ka);
    uint32_t *pre = malloc(n * sizeof *pre), *tmp = malloc(n * sizeof *tmp);
    x.sec_lo = malloc(n * sizeof *x.sec_lo);
    x.sec_hi = malloc(n * sizeof *x.sec_hi);
    x.min_off = calloc(n, sizeof *x.min_off);
    x.off = malloc(n * sizeof *x.off);
    x.rank = malloc(n * sizeof *x.rank);
    x.ov_start = calloc(n + 1, sizeof *x.ov_start);
    x.pool = malloc((n * (n + 1) + 2 * n) * sizeof *x.pool); /* lists and parts per depth */
    if (!sec_of || !isb || !kt || !kw || !ka || !pre || !tmp || !x.sec_lo || !x.sec_hi ||
        !x.min_off || !x.off || !x.rank || !x.ov_start || !x.pool)
        goto out;
    for (size_t i = 0; i < n; i++)
        isb[p->start[i]] = isb[p->end[i]] = 1;
    uint32_t s = 0;
    int started = 0;
    for (uint32_t t = 0; t <= T; t++) {
        if (isb[t] && started)
            s++;
        if (isb[t])
            started = 1;
        sec_of[t] = s; /* section that begins at the last boundary <= t */
    }
    x.nsec = s;
    /* section index of time t is sec_of[t] for t in a section; a tensor [a, b) covers
     * sections sec_of[a] .. sec_of[b] (exclusive) */
    for (size_t i = 0; i < n; i++) {
        x.sec_lo[i] = sec_of[p->start[i]];
        x.sec_hi[i] = sec_of[p->end[i]];
    }
    x.floor = calloc(x.nsec + 1, sizeof *x.floor);
    x.total = calloc(x.nsec + 1, sizeof *x.total);
    x.affected = calloc(x.nsec + 1, 1);
    x.aff_list = malloc((x.nsec + 1) * sizeof *x.aff_list);
    x.sb_start = calloc(x.nsec + 2, sizeof *x.sb_start);
    x.cuts = calloc(x.nsec + 1, sizeof *x.cuts);
    if (!x.floor || !x.total || !x.affected || !x.aff_list || !x.sb_start || !x.cuts)
        goto out;
    for (size_t i = 0; i < n; i++)
        for (uint32_t q = x.sec_lo[i]; q + 1 < x.sec_hi[i]; q++)
            x.cuts[q]++;
    size_t cover = 0;
    for (size_t i = 0; i < n; i++) {
        for (uint32_t q = x.sec_lo[i]; q < x.sec_hi[i]; q++) {
            x.total[q] += p->size[i];
            x.sb_start[q + 1]++;
        }
        cover += x.sec_hi[i] - x.sec_lo[i];
    }
    for (uint32_t q = 0; q < x.nsec; q++)
        x.sb_start[q + 1] += x.sb_start[q];
    x.sb = malloc((cover + 1) * sizeof *x.sb);
    if (!x.sb)
        goto out;
    {
        uint32_t *fill = tmp; /* reuse as cursor needs nsec entries: allocate separately */
        uint32_t *cur = malloc((x.nsec + 1) * sizeof *cur);
        if (!cur)
            goto out;
        memcpy(cur, x.sb_start, (x.nsec + 1) * sizeof *cur);
        for (size_t i = 0; i < n; i++)
            for (uint32_t q = x.sec_lo[i]; q < x.sec_hi[i]; q++)
                x.sb[cur[q]++] = (uint32_t)i;
        free(cur);
        (void)fill;
    }
    /* conflicts: tensors sharing a section */
    size_t pairs = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < n; j++)
            if (i != j && p->start[i] < p->end[j] && p->start[j] < p->end[i])
                x.ov_start[i + 1]++, pairs++;
    for (size_t i = 0; i < n; i++)
        x.ov_start[i + 1] += x.ov_start[i];
    x.ov = malloc((pairs + 1) * sizeof *x.ov);
    if (!x.ov)
        goto out;
    for (size_t i = 0, e = 0; i < n; i++)
        for (size_t j = 0; j < n; j++)
            if (i != j && p->start[i] < p->end[j] && p->start[j] < p->end[i])
                x.ov[e++] = (uint32_t)j;
    /* preorder keys: T = max section total over the tensor's sections, W = width in sections,
     * A = area (size x width) */
    for (size_t i = 0; i < n; i++) {
        uint64_t t = 0;
        for (uint32_t q = x.sec_lo[i]; q < x.sec_hi[i]; q++)
            if (x.total[q] > t)
                t = x.total[q];
        kt[i] = t;
        kw[i] = x.sec_hi[i] - x.sec_lo[i];
        ka[i] = p->size[i] * (uint64_t)(p->end[i] - p->start[i]);
    }
    const uint64_t *orders[3][3] = {{kt, kw, ka}, {kw, ka, kt}, {ka, kw, kt}};
    int64_t limit = (int64_t)n;
    for (;;) {
        int any_aborted = 0;
        for (int h = 0; h < 3; h++) {
            for (size_t i = 0; i < n; i++)
                pre[i] = (uint32_t)i;
            sort_idx(pre, n, orders[h][0], orders[h][1], orders[h][2], tmp);
            for (size_t r = 0; r < n; r++)
                x.rank[pre[r]] = (uint32_t)r;
            for (size_t i = 0; i < n; i++) {
                x.off[i] = UINT64_MAX;
                x.min_off[i] = 0;
            }
            memset(x.floor, 0, (x.nsec + 1) * sizeof *x.floor);
            x.nodes_left = limit;
            x.undo_len = 0;
            int r = solve_split(&x, pre, n, 0, x.nsec, x.pool);
            if (r == 1) {
                memcpy(offsets, x.off, n * sizeof *offsets);
                ret = 1;
                goto out;
            }
            if (r == -2)
                goto out;
            if (r == 0) {
                ret = 0;
                goto out;
            }
            if (x.timed_out) {
                ret = -1;
                goto out;
            }
            any_aborted = 1;
            /* the section totals were restored by the search unwinding */
        }
        if (!any_aborted)
            break;
        limit *= 2;
    }
    ret = 0;
out:
    free(sec_of), free(isb), free(kt), free(kw), free(ka), free(pre), free(tmp);
    exact_free(&x);
    return ret;
}
