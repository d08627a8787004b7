/*
 * planner_exact.c -- exact decision search for the arena planner: "do all tensors fit under
 * this capacity?", in the spirit of MiniMalloc (Moffitt, ASPLOS'23).
 *
 * Ideas (our own code, same principles as the paper and google/minimalloc's solver):
 *  - Canonical solutions. Every tensor is placed at its *minimum offset*: the aligned top of
 *    the placed tensors it conflicts with (0 if none). Tensors are placed in non-decreasing
 *    (min offset, preorder rank) order, so each packing is generated once.
 *  - Dominance. A tensor whose min offset is at or above the lowest possible top of another
 *    unplaced tensor would leave a hole that one could fill: skip it (and all later ones).
 *  - "Hatless" pruning. When the tensor just placed conflicts with no unplaced tensor, its
 *    placement cannot hinder any other; if the rest fails with it there, every alternative at
 *    this node fails too.
 *  - Inference on sections (time slices between consecutive lifetime boundaries): each has a
 *    floor (highest placed top, raised to the lowest min offset of its unplaced tensors) and
 *    the bytes of its unplaced tensors; max(floor, current offset) + bytes > capacity prunes.
 *  - Dynamic decomposition: a count of unplaced tensors crossing each section boundary; when
 *    placing a tensor brings one to zero, the two sides are independent subproblems, each
 *    solved by a fresh canonical search with its own preorder (one failing fails the node).
 *    Also done at the root.
 *  - Static preorders, MiniMalloc's three: (W, A, T), (T, A, W), (T, W, A), all descending,
 *    with W = lifetime length, A = size x W, T = the largest unplaced-bytes total over the
 *    tensor's sections when the (sub)problem starts. They are tried round robin under a node
 *    limit that starts at 2n and doubles every round.
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
    uint32_t *conflict_start, *conflicts;      /* CSR: conflicting tensors of each tensor */
    uint32_t *section_start, *section_tensors; /* CSR: tensors of each section */
    uint64_t *floor, *total;        /* [nsec] */
    uint32_t *cuts;                 /* [nsec] unplaced tensors crossing the boundary s | s + 1 */
    uint64_t *min_off;              /* [n] */
    uint64_t *off;                  /* [n] UINT64_MAX while unplaced */
    uint32_t *rank;                 /* [n] preorder rank within the current (sub)problem */
    uint64_t *key_width, *key_area, *key_time; /* [n] preorder keys */
    int heuristic;                  /* 0: WAT, 1: TAW, 2: TWA */
    uint32_t *pool;                 /* stack of ordering lists, parts and saved ranks */
    uint32_t *sort_tmp;             /* [n] */
    change *undo;                   /* undo log */
    size_t undo_len, undo_cap;
    int64_t nodes_left;
    double deadline;
    int timed_out, nomem;
} exact;

static int grow_undo(exact *x) {
    size_t cap = x->undo_cap ? 2 * x->undo_cap : 1024;
    change *u = realloc(x->undo, cap * sizeof *u);
    if (!u) {
        x->nomem = 1;
        return -1;
    }
    x->undo = u;
    x->undo_cap = cap;
    return 0;
}

static inline int push_change(exact *x, uint32_t idx, uint64_t value) {
    if (x->undo_len == x->undo_cap && grow_undo(x))
        return -1;
    x->undo[x->undo_len].idx = idx;
    x->undo[x->undo_len].value = value;
    x->undo_len++;
    return 0;
}

/* Preorder comparison: 1 when a goes before b under the current heuristic. */
static int preorder_before(const exact *x, uint32_t a, uint32_t b) {
    static const int keys[3][3] = {{0, 1, 2}, {2, 1, 0}, {2, 0, 1}}; /* WAT, TAW, TWA */
    for (int q = 0; q < 3; q++) {
        const uint64_t *key = keys[x->heuristic][q] == 0 ? x->key_width
                              : keys[x->heuristic][q] == 1 ? x->key_area : x->key_time;
        if (key[a] != key[b])
            return key[a] > key[b];
    }
    return a < b;
}

/* Sorts a[0..n) by preorder: insertion sort up to 16 items, else merge sort through
 * x->sort_tmp. */
static void sort_by_preorder(exact *x, uint32_t *a, size_t n) {
    if (n < 2)
        return;
    if (n <= 16) {
        for (size_t i = 1; i < n; i++) {
            uint32_t v = a[i];
            size_t j = i;
            while (j > 0 && preorder_before(x, v, a[j - 1])) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = v;
        }
        return;
    }
    size_t half = n / 2;
    sort_by_preorder(x, a, half);
    sort_by_preorder(x, a + half, n - half);
    uint32_t *merged = x->sort_tmp;
    size_t i = 0, j = half, k = 0;
    while (i < half && j < n)
        merged[k++] = preorder_before(x, a[j], a[i]) ? a[j++] : a[i++];
    while (i < half)
        merged[k++] = a[i++];
    while (j < n)
        merged[k++] = a[j++];
    memcpy(a, merged, n * sizeof *a);
}

/* ordering: unplaced tensors sorted by (min_off, rank); insertion sort from the parent's
 * (already nearly sorted) list. */
static size_t build_ordering(exact *x, const uint32_t *parent, size_t parent_count,
                             uint32_t *out) {
    size_t k = 0;
    const uint64_t *min_offs = x->min_off;
    for (size_t j = 0; j < parent_count; j++) {
        uint32_t b = parent[j];
        if (x->off[b] != UINT64_MAX)
            continue;
        size_t q = k++;
        uint64_t b_min_off = min_offs[b];
        while (q > 0) {
            uint32_t c = out[q - 1];
            if (min_offs[c] < b_min_off || (min_offs[c] == b_min_off && x->rank[c] < x->rank[b]))
                break;
            out[q] = c;
            q--;
        }
        out[q] = b;
    }
    return k;
}

static int search(exact *x, const uint32_t *parent, size_t parent_count, uint32_t *ordering,
                  uint64_t last_off, uint32_t last_rank, uint32_t sec_from, uint32_t sec_to,
                  uint64_t max_total);
static int solve_split(exact *x, const uint32_t *list, size_t k, uint32_t sec_from,
                       uint32_t sec_to, uint32_t *pool);

/* The lowest top any tensor of list[0..k) can reach (its min offset + size): a tensor whose
 * min offset is at or above it is dominated. */
static uint64_t lowest_top(const exact *x, const uint32_t *list, size_t k) {
    uint64_t lowest = UINT64_MAX;
    for (size_t j = 0; j < k; j++) {
        uint64_t top = x->min_off[list[j]] + x->p->size[list[j]];
        if (top < lowest)
            lowest = top;
    }
    return lowest;
}

/* Places tensor b at offset (its min offset), every change undo-logged: b's min offset becomes
 * UINT64_MAX (so the loops of the search skip placed tensors with one load; a placed tensor that
 * shares a section or a conflict with an unplaced one of this subproblem was placed on the
 * current path), the min offsets of the unplaced tensors it conflicts with rise to its aligned
 * top, and its own sections get its top as floor and lose its size from their totals.
 * *affected_from, *affected_to: the sections whose floor may rise, those of the tensors whose
 * min offset rose (each overlaps b, so with b's own sections they form one range). *hatless:
 * b conflicts with no unplaced tensor. Returns 0, or -2 (no memory). */
static int place_tensor(exact *x, uint32_t b, uint64_t offset, uint32_t *affected_from,
                        uint32_t *affected_to, int *hatless) {
    const uint64_t top = offset + x->p->size[b];
    uint32_t from = x->sec_lo[b], to = x->sec_hi[b];
    *hatless = 1;
    x->off[b] = offset;
    if (push_change(x, b, offset))
        return -2;
    x->min_off[b] = UINT64_MAX;
    for (uint32_t e = x->conflict_start[b]; e < x->conflict_start[b + 1]; e++) {
        uint32_t c = x->conflicts[e];
        uint64_t other_min_off = x->min_off[c];
        if (other_min_off == UINT64_MAX)
            continue;
        *hatless = 0;
        if (other_min_off >= top)
            continue;
        if (push_change(x, c, x->min_off[c]))
            return -2;
        x->min_off[c] = align_up(top, x->alignment);
        if (x->sec_lo[c] < from)
            from = x->sec_lo[c];
        if (x->sec_hi[c] > to)
            to = x->sec_hi[c];
    }
    for (uint32_t s = x->sec_lo[b]; s < x->sec_hi[b]; s++) {
        if (push_change(x, (uint32_t)x->n + s, x->floor[s]))
            return -2;
        x->floor[s] = top;
        x->total[s] -= x->p->size[b];
    }
    *affected_from = from;
    *affected_to = to;
    return 0;
}

/* A section's floor rises to the lowest min offset of its unplaced tensors; the scan stops at
 * the first one at or below the floor (then nothing changes). Raises the floors of sections
 * [from, to), undo-logged, and returns 1 when every raised floor + total fits the capacity, 0
 * as soon as one does not, -2 when out of memory. */
static int raise_section_floors(exact *x, uint32_t from, uint32_t to) {
    for (uint32_t s = from; s < to; s++) {
        uint64_t lowest = UINT64_MAX, floor = x->floor[s];
        for (uint32_t e = x->section_start[s]; e < x->section_start[s + 1]; e++) {
            uint32_t c = x->section_tensors[e];
            if (x->min_off[c] < lowest) {
                lowest = x->min_off[c];
                if (lowest <= floor)
                    break;
            }
        }
        if (lowest != UINT64_MAX && floor < lowest) {
            if (push_change(x, (uint32_t)x->n + s, x->floor[s]))
                return -2;
            x->floor[s] = lowest;
            if (lowest + x->total[s] > x->capacity)
                return 0;
        }
    }
    return 1;
}

/* The full pass: 1 when max(floor, offset) + total fits the capacity on every section of
 * [sec_from, sec_to), with *max_total the largest total there; else 0. */
static int sections_fit(const exact *x, uint32_t sec_from, uint32_t sec_to, uint64_t offset,
                        uint64_t *max_total) {
    uint64_t largest = 0;
    for (uint32_t s = sec_from; s < sec_to; s++) {
        uint64_t base = x->floor[s] > offset ? x->floor[s] : offset;
        if (base + x->total[s] > x->capacity)
            return 0;
        if (x->total[s] > largest)
            largest = x->total[s];
    }
    *max_total = largest;
    return 1;
}

/* Takes placed tensor b off the boundary counts of dynamic decomposition; 1 when a boundary
 * strictly inside [sec_from, sec_to) is crossed by no unplaced tensor any more. */
static int release_boundaries(exact *x, uint32_t b, uint32_t sec_from, uint32_t sec_to) {
    int split = 0;
    for (uint32_t s = x->sec_lo[b]; s + 1 < x->sec_hi[b]; s++)
        if (--x->cuts[s] == 0 && s + 1 > sec_from && s + 1 < sec_to)
            split = 1;
    return split;
}

/* Undoes place_tensor and release_boundaries for b, back to undo log length `mark` (b's offset
 * stays written). */
static void unplace_tensor(exact *x, uint32_t b, size_t mark) {
    for (uint32_t s = x->sec_lo[b]; s + 1 < x->sec_hi[b]; s++)
        x->cuts[s]++;
    for (uint32_t s = x->sec_lo[b]; s < x->sec_hi[b]; s++)
        x->total[s] += x->p->size[b];
    while (x->undo_len > mark) {
        change *c = &x->undo[--x->undo_len];
        if (c->idx < x->n)
            x->min_off[c->idx] = c->value;
        else
            x->floor[c->idx - x->n] = c->value;
    }
}

/* One branch of the search: tensor b of ordering[0..k) placed at its min offset, the rest
 * searched below (as one subproblem, or as the independent parts it splits into), then the
 * placement undone but for the offsets, which stay written on success. Returns as search. */
static int try_placement(exact *x, uint32_t *ordering, size_t k, uint32_t b, uint64_t last_off,
                         uint32_t sec_from, uint32_t sec_to, uint64_t max_total, int *hatless) {
    const uint64_t offset = x->min_off[b];
    size_t mark = x->undo_len;
    uint32_t affected_from, affected_to;
    if (place_tensor(x, b, offset, &affected_from, &affected_to, hatless))
        return -2;
    int ok = raise_section_floors(x, affected_from, affected_to);
    if (ok < 0)
        return -2;
    /* Every section of [sec_from, sec_to) passed this check with offset last_off when this
     * search began; placing b at offset leaves max(floor, offset) + total unchanged on b's own
     * sections (floor <= offset there before, its top after, total down by b's size), and raised
     * floors were checked above. So only a higher offset needs the full pass. */
    /* max_total bounds the totals of [sec_from, sec_to) (they only fall on the way down):
     * when offset + max_total fits, no section can fail; else a full pass also renews the
     * bound. */
    uint64_t bound_total = max_total;
    if (ok && offset > last_off && offset + max_total > x->capacity)
        ok = sections_fit(x, sec_from, sec_to, offset, &bound_total);
    /* Dynamic decomposition: when no unplaced tensor crosses a boundary any more, the two
     * sides are independent subproblems (solved one after the other; one failing fails
     * this node, with no retrying of the others). */
    int split = release_boundaries(x, b, sec_from, sec_to);
    int r = 0;
    if (ok)
        r = split ? solve_split(x, ordering, k, sec_from, sec_to, ordering + k)
                  : search(x, ordering, k, ordering + k, offset, x->rank[b], sec_from, sec_to,
                           bound_total);
    unplace_tensor(x, b, mark);
    return r;
}

/* Searches the unplaced tensors of parent[0..parent_count), all within sections
 * [sec_from, sec_to), with ordering[] for this node's list and the nodes below. Undo log
 * entries: idx < n: min_off of a tensor; idx >= n: floor of section idx - n. Returns 1 (all
 * placed), 0 (no placement), -1 (node limit or deadline), -2 (no memory). */
static int search(exact *x, const uint32_t *parent, size_t parent_count, uint32_t *ordering,
                  uint64_t last_off, uint32_t last_rank, uint32_t sec_from, uint32_t sec_to,
                  uint64_t max_total) {
    if (--x->nodes_left < 0)
        return -1;
    if ((x->nodes_left & 255) == 0 &&
        (lshm__plan_now() > x->deadline || lshm__plan_cancelled())) {
        x->timed_out = 1;
        return -1;
    }
    size_t k = build_ordering(x, parent, parent_count, ordering);
    if (k == 0)
        return 1;
    const uint64_t lowest = lowest_top(x, ordering, k);
    for (size_t j = 0; j < k; j++) {
        uint32_t b = ordering[j];
        uint64_t offset = x->min_off[b];
        if (offset < last_off || (offset == last_off && x->rank[b] < last_rank))
            continue; /* not canonical */
        if (offset >= lowest)
            break; /* dominated; the rest are higher still */
        if (offset + x->p->size[b] > x->capacity)
            continue;
        int hatless;
        int r = try_placement(x, ordering, k, b, last_off, sec_from, sec_to, max_total,
                              &hatless);
        if (r == 1)
            return 1; /* the offsets below stay written */
        x->off[b] = UINT64_MAX;
        if (r < 0)
            return r;
        if (hatless)
            break; /* b hinders nobody: no other choice here can do better */
    }
    return 0;
}

/* Splits the unplaced tensors of list[0..k) (within sections [sec_from, sec_to)) at the
 * boundaries no unplaced tensor crosses and solves each part with a fresh canonical search and
 * preorder. pool holds the saved ranks, the parts, then the search lists. On failure every
 * tensor of the parts is unplaced again; the ranks of the parent's search are restored in
 * every case. */
static int solve_split(exact *x, const uint32_t *list, size_t k, uint32_t sec_from,
                       uint32_t sec_to, uint32_t *pool) {
    uint32_t *ids = pool;
    size_t unplaced = 0;
    for (size_t j = 0; j < k; j++)
        if (x->off[list[j]] == UINT64_MAX)
            ids[unplaced++] = list[j];
    uint32_t *saved_rank = ids + unplaced;
    for (size_t j = 0; j < unplaced; j++)
        saved_rank[j] = x->rank[ids[j]];
    size_t used = 2 * unplaced;
    int r = 1;
    uint32_t part_from = sec_from;
    while (part_from < sec_to && r == 1) {
        uint32_t part_to = part_from + 1;
        while (part_to < sec_to && x->cuts[part_to - 1] != 0)
            part_to++;
        uint32_t *part = pool + used;
        size_t part_count = 0;
        for (size_t j = 0; j < unplaced; j++) {
            uint32_t c = ids[j];
            if (x->sec_lo[c] >= part_from && x->sec_lo[c] < part_to)
                part[part_count++] = c;
        }
        used += part_count;
        if (part_count) {
            for (size_t j = 0; j < part_count; j++) {
                uint32_t c = part[j];
                uint64_t largest = 0;
                for (uint32_t s = x->sec_lo[c]; s < x->sec_hi[c]; s++)
                    if (x->total[s] > largest)
                        largest = x->total[s];
                x->key_time[c] = largest;
            }
            sort_by_preorder(x, part, part_count);
            for (size_t j = 0; j < part_count; j++)
                x->rank[part[j]] = (uint32_t)j;
            uint64_t bound_total = 0;
            for (uint32_t s = part_from; s < part_to; s++)
                if (x->total[s] > bound_total)
                    bound_total = x->total[s];
            r = search(x, part, part_count, pool + used, 0, 0, part_from, part_to, bound_total);
        }
        part_from = part_to;
    }
    for (size_t j = 0; j < unplaced; j++) {
        x->rank[ids[j]] = saved_rank[j];
        if (r != 1)
            x->off[ids[j]] = UINT64_MAX;
    }
    return r;
}

static void exact_free(exact *x) {
    free(x->cuts);
    free(x->sec_lo), free(x->sec_hi), free(x->conflict_start), free(x->conflicts);
    free(x->section_start), free(x->section_tensors), free(x->floor), free(x->total);
    free(x->min_off), free(x->off), free(x->rank);
    free(x->key_width), free(x->key_area), free(x->key_time), free(x->sort_tmp);
    free(x->pool), free(x->undo);
}

/* The arrays of one tensor each, and the search stack. 0 or -ENOMEM (exact_free frees what
 * was allocated). */
static int exact_alloc(exact *x) {
    x->key_width = malloc(x->n * sizeof *x->key_width);
    x->key_area = malloc(x->n * sizeof *x->key_area);
    x->key_time = malloc(x->n * sizeof *x->key_time);
    x->sort_tmp = malloc(x->n * sizeof *x->sort_tmp);
    x->sec_lo = malloc(x->n * sizeof *x->sec_lo);
    x->sec_hi = malloc(x->n * sizeof *x->sec_hi);
    x->min_off = calloc(x->n, sizeof *x->min_off);
    x->off = malloc(x->n * sizeof *x->off);
    x->rank = calloc(x->n, sizeof *x->rank);
    x->conflict_start = calloc(x->n + 1, sizeof *x->conflict_start);
    /* stack: a search on k tensors uses k entries, a split below it at most 3 (k - 1) before
     * its own searches, so 2 n (n + 1) plus the root's split bound it */
    x->pool = malloc((2 * x->n * (x->n + 1) + 4 * x->n + 16) * sizeof *x->pool);
    if (!x->key_width || !x->key_area || !x->key_time || !x->sort_tmp || !x->sec_lo ||
        !x->sec_hi || !x->min_off || !x->off || !x->rank || !x->conflict_start || !x->pool)
        return -ENOMEM;
    return 0;
}

/* Sections: between consecutive distinct boundaries. Sets x->nsec and each tensor's sections
 * [sec_lo, sec_hi). 0 or -ENOMEM. */
static int find_sections(exact *x) {
    const lshm__plan_problem *p = x->p;
    const uint32_t T = p->times;
    uint32_t *sec_of = calloc((size_t)T + 2, sizeof *sec_of);
    uint8_t *is_boundary = calloc((size_t)T + 2, 1);
    if (!sec_of || !is_boundary) {
        free(sec_of), free(is_boundary);
        return -ENOMEM;
    }
    for (size_t i = 0; i < x->n; i++)
        is_boundary[p->start[i]] = is_boundary[p->end[i]] = 1;
    uint32_t s = 0;
    int started = 0;
    for (uint32_t t = 0; t <= T; t++) {
        if (is_boundary[t] && started)
            s++;
        if (is_boundary[t])
            started = 1;
        sec_of[t] = s; /* section that begins at the last boundary <= t */
    }
    x->nsec = s;
    /* a tensor [a, b) covers sections sec_of[a] .. sec_of[b] (exclusive) */
    for (size_t i = 0; i < x->n; i++) {
        x->sec_lo[i] = sec_of[p->start[i]];
        x->sec_hi[i] = sec_of[p->end[i]];
    }
    free(sec_of), free(is_boundary);
    return 0;
}

/* Per section: the bytes of its tensors (total), the tensors crossing the boundary after it
 * (cuts) and the list of its tensors (CSR). Returns 1, 0 when the bytes of one section alone
 * exceed the capacity (no placement), or -ENOMEM. */
static int build_section_tables(exact *x) {
    const size_t n = x->n;
    const uint32_t nsec = x->nsec;
    x->floor = calloc(nsec + 1, sizeof *x->floor);
    x->total = calloc(nsec + 1, sizeof *x->total);
    x->section_start = calloc(nsec + 2, sizeof *x->section_start);
    x->cuts = calloc(nsec + 1, sizeof *x->cuts);
    if (!x->floor || !x->total || !x->section_start || !x->cuts)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        for (uint32_t q = x->sec_lo[i]; q + 1 < x->sec_hi[i]; q++)
            x->cuts[q]++;
    size_t cover = 0;
    for (size_t i = 0; i < n; i++) {
        for (uint32_t q = x->sec_lo[i]; q < x->sec_hi[i]; q++) {
            x->total[q] += x->p->size[i];
            x->section_start[q + 1]++;
        }
        cover += x->sec_hi[i] - x->sec_lo[i];
    }
    for (uint32_t q = 0; q < nsec; q++) {
        x->section_start[q + 1] += x->section_start[q];
        if (x->total[q] > x->capacity) /* the search relies on every section passing at first */
            return 0;
    }
    x->section_tensors = malloc((cover + 1) * sizeof *x->section_tensors);
    uint32_t *next = malloc((nsec + 1) * sizeof *next); /* next free entry of each section */
    if (!x->section_tensors || !next) {
        free(next);
        return -ENOMEM;
    }
    memcpy(next, x->section_start, (nsec + 1) * sizeof *next);
    for (size_t i = 0; i < n; i++)
        for (uint32_t q = x->sec_lo[i]; q < x->sec_hi[i]; q++)
            x->section_tensors[next[q]++] = (uint32_t)i;
    free(next);
    return 1;
}

/* Conflicts (CSR): the tensors whose lifetimes overlap each tensor's. 0 or -ENOMEM. */
static int build_conflicts(exact *x) {
    const lshm__plan_problem *p = x->p;
    const size_t n = x->n;
    size_t pairs = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < n; j++)
            if (i != j && p->start[i] < p->end[j] && p->start[j] < p->end[i])
                x->conflict_start[i + 1]++, pairs++;
    for (size_t i = 0; i < n; i++)
        x->conflict_start[i + 1] += x->conflict_start[i];
    x->conflicts = malloc((pairs + 1) * sizeof *x->conflicts);
    if (!x->conflicts)
        return -ENOMEM;
    for (size_t i = 0, e = 0; i < n; i++)
        for (size_t j = 0; j < n; j++)
            if (i != j && p->start[i] < p->end[j] && p->start[j] < p->end[i])
                x->conflicts[e++] = (uint32_t)j;
    return 0;
}

/* The static preorder keys W (lifetime length) and A (size x W, saturated); T is set per
 * (sub)problem by solve_split. */
static void set_preorder_keys(exact *x) {
    const lshm__plan_problem *p = x->p;
    for (size_t i = 0; i < x->n; i++) {
        x->key_width[i] = p->width ? p->width[i] : (uint64_t)(p->end[i] - p->start[i]);
        unsigned __int128 area = (unsigned __int128)p->size[i] * x->key_width[i]; /* saturated */
        x->key_area[i] = area >> 64 ? UINT64_MAX : (uint64_t)area;
    }
}

/* The three preorders round robin, from the root, under a node limit that starts at 2n and
 * doubles every round. Returns as lshm__plan_exact; writes offsets when a placement is found. */
static int search_rounds(exact *x, uint64_t *offsets) {
    const size_t n = x->n;
    uint32_t *all = malloc(n * sizeof *all); /* the root's list: every tensor */
    if (!all)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        all[i] = (uint32_t)i;
    int ret;
    for (int64_t limit = 2 * (int64_t)n;; limit *= 2) {
        for (int heuristic = 0; heuristic < 3; heuristic++) {
            x->heuristic = heuristic;
            for (size_t i = 0; i < n; i++) {
                x->off[i] = UINT64_MAX;
                x->min_off[i] = 0;
            }
            memset(x->floor, 0, (x->nsec + 1) * sizeof *x->floor);
            x->nodes_left = limit;
            x->undo_len = 0;
            int r = solve_split(x, all, n, 0, x->nsec, x->pool);
            if (r == 1) {
                memcpy(offsets, x->off, n * sizeof *offsets);
                ret = 1;
                goto out;
            }
            if (r == -2 || x->nomem) {
                ret = -ENOMEM;
                goto out;
            }
            if (r == 0) {
                ret = 0;
                goto out;
            }
            if (x->timed_out) {
                ret = -1;
                goto out;
            }
            /* node limit: the section totals were restored by the search unwinding */
        }
    }
out:
    free(all);
    return ret;
}

int lshm__plan_exact(const lshm__plan_problem *p, uint64_t capacity, double deadline,
                     uint64_t *offsets) {
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
    for (size_t i = 0; i < n; i++)
        if (p->size[i] > capacity)
            return 0;
    int ret = -ENOMEM;
    if (exact_alloc(&x) || find_sections(&x))
        goto out;
    ret = build_section_tables(&x);
    if (ret != 1)
        goto out;
    ret = -ENOMEM;
    if (build_conflicts(&x))
        goto out;
    set_preorder_keys(&x);
    ret = search_rounds(&x, offsets);
out:
    exact_free(&x);
    return ret;
}
