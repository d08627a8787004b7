/*
 * planner_engine.c -- the placement engine: places tensors in a given order, each at the best
 * or first fitting gap among the placed tensors live with it (see the data structures in
 * planner.c's header comment: a sparse interval tree, or a dense segment tree of coalesced
 * offset ranges).
 */
#include "internal.h"
#include "planner_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the placement engine ------------------------------------------------------------------ */


void lshm__plan_engine_free(engine *e) {
    free(e->pos), free(e->start_by_pos), free(e->end_by_pos), free(e->max_end_below);
    free(e->placed_lo), free(e->placed_hi);
    free(e->blocks);
    for (size_t v = 0; v < 2 * (size_t)e->leaves; v++) { /* (either may have failed) */
        if (e->here)
            free(e->here[v].ranges);
        if (e->sub)
            free(e->sub[v].ranges);
    }
    free(e->here), free(e->sub), free(e->slot_lo), free(e->slot_hi);
}

/* Dense mode setup: slots between consecutive distinct boundaries. */
static int engine_init_dense(engine *e, const plan_input *in) {
    uint32_t T = in->times;
    uint32_t *slot = calloc((size_t)T + 1, sizeof *slot);
    e->slot_lo = malloc(e->m * sizeof *e->slot_lo);
    e->slot_hi = malloc(e->m * sizeof *e->slot_hi);
    if (!slot || !e->slot_lo || !e->slot_hi) {
        free(slot);
        return -ENOMEM;
    }
    for (size_t i = 0; i < e->m; i++)
        slot[in->start[i]] = slot[in->end[i]] = 1;
    uint32_t boundaries = 0; /* slot[t] = number of boundaries < t */
    for (uint32_t t = 0; t <= T; t++) {
        uint32_t is_boundary = slot[t];
        slot[t] = boundaries;
        boundaries += is_boundary;
    }
    for (size_t i = 0; i < e->m; i++) {
        e->slot_lo[i] = slot[in->start[i]];
        e->slot_hi[i] = slot[in->end[i]];
    }
    free(slot);
    uint32_t leaves = 1;
    while (leaves < boundaries)
        leaves <<= 1;
    e->leaves = leaves;
    e->here = calloc(2 * (size_t)leaves, sizeof *e->here);
    e->sub = calloc(2 * (size_t)leaves, sizeof *e->sub);
    if (!e->here || !e->sub)
        return -ENOMEM;
    e->dense = 1;
    return 0;
}

/* Adds [lo, hi) to the coalesced set; returns 0 if it was already covered, 1 if the set
 * changed. Touching ranges merge (a gap of 0 bytes holds nothing). */
static int interval_set_add(engine *e, interval_set *s, uint64_t lo, uint64_t hi) {
    block *ranges = s->ranges;
    uint32_t first = 0, search_end = s->len;
    while (first < search_end) { /* first range with ranges.hi >= lo */
        uint32_t mid = first + (search_end - first) / 2;
        if (ranges[mid].hi < lo)
            first = mid + 1;
        else
            search_end = mid;
    }
    if (first < s->len && ranges[first].lo <= lo && ranges[first].hi >= hi)
        return 0;
    uint32_t end = first; /* ranges[first..end) touch [lo, hi) */
    while (end < s->len && ranges[end].lo <= hi)
        end++;
    if (end > first) { /* merge ranges[first..end) and [lo, hi) into ranges[first] */
        if (ranges[first].lo < lo)
            lo = ranges[first].lo;
        if (ranges[end - 1].hi > hi)
            hi = ranges[end - 1].hi;
        ranges[first].lo = lo;
        ranges[first].hi = hi;
        if (end > first + 1) {
            memmove(ranges + first + 1, ranges + end, (s->len - end) * sizeof *ranges);
            s->len -= end - first - 1;
        }
        return 1;
    }
    if (s->len == s->cap) {
        uint32_t cap = s->cap ? 2 * s->cap : 4;
        block *grown = realloc(s->ranges, cap * sizeof *grown);
        if (!grown) {
            e->nomem = 1;
            return 0;
        }
        s->ranges = ranges = grown;
        s->cap = cap;
    }
    memmove(ranges + first + 1, ranges + first, (s->len - first) * sizeof *ranges);
    ranges[first].lo = lo;
    ranges[first].hi = hi;
    s->len++;
    return 1;
}

static void dense_insert(engine *e, uint32_t i, uint64_t lo, uint64_t hi) {
    uint32_t l = e->slot_lo[i] + e->leaves, r = e->slot_hi[i] + e->leaves;
    for (; l < r; l >>= 1, r >>= 1) {
        if (l & 1) {
            interval_set_add(e, &e->here[l], lo, hi);
            for (uint32_t v = l; v >= 1 && interval_set_add(e, &e->sub[v], lo, hi); v >>= 1)
                ;
            l++;
        }
        if (r & 1) {
            r--;
            interval_set_add(e, &e->here[r], lo, hi);
            for (uint32_t v = r; v >= 1 && interval_set_add(e, &e->sub[v], lo, hi); v >>= 1)
                ;
        }
    }
}

/* Whether one of the coalesced, sorted blocks b[0..k) covers [lo, hi). */
static int covered_by(const block *b, size_t k, uint64_t lo, uint64_t hi) {
    size_t first = 0, end = k; /* the first block starting after lo */
    while (first < end) {
        size_t mid = first + (end - first) / 2;
        if (b[mid].lo <= lo)
            first = mid + 1;
        else
            end = mid;
    }
    return first > 0 && b[first - 1].hi >= hi;
}

/* Merges the coalesced set s into the coalesced, sorted e->blocks[0..*k) (scratch after it).
 * A set within one block already (its first range's start to its last range's end) adds
 * nothing and is not walked: where lifetimes nest, the ranges of a node high in the tree are
 * many and scattered, but all inside the stack the query has collected already. */
static int dense_merge(engine *e, size_t *k, const interval_set *s) {
    if (!s->len || (*k && covered_by(e->blocks, *k, s->ranges[0].lo, s->ranges[s->len - 1].hi)))
        return 0;
    size_t need = 2 * (*k + s->len);
    if (need > e->blocks_cap) {
        block *grown = realloc(e->blocks, 2 * need * sizeof *grown);
        if (!grown) {
            e->nomem = 1;
            return -1;
        }
        e->blocks = grown;
        e->blocks_cap = 2 * need;
    }
    const block *have = e->blocks, *add = s->ranges;
    size_t have_len = *k, add_len = s->len, i = 0, j = 0, out_len = 0;
    block *out = e->blocks + have_len;
    while (i < have_len || j < add_len) {
        block next = (j == add_len || (i < have_len && have[i].lo <= add[j].lo)) ? have[i++]
                                                                                 : add[j++];
        if (out_len && next.lo <= out[out_len - 1].hi) {
            if (next.hi > out[out_len - 1].hi)
                out[out_len - 1].hi = next.hi;
        } else {
            out[out_len++] = next;
        }
    }
    memmove(e->blocks, out, out_len * sizeof *out);
    *k = out_len;
    return 0;
}

/* The span of a non-empty set: from its first range's start to its last range's end. */
static uint64_t set_span(const interval_set *s) {
    return s->ranges[s->len - 1].hi - s->ranges[0].lo;
}

/* Collects into e->blocks the union (coalesced, sorted) of the occupied ranges meeting tensor
 * i's slots; returns how many ranges. The sets are merged widest first: a set inside what
 * the query holds already is skipped without a walk (dense_merge), and where lifetimes nest,
 * the set of the node holding the time they all share spans the whole stack in one range,
 * while the others are many scattered ranges inside it. */
static size_t dense_query(engine *e, uint32_t i) {
    const interval_set *sets[4 * 32 + 4]; /* (at most 2 per level on each of two walks) */
    size_t count = 0, k = 0;
    const uint32_t first_slot = e->slot_lo[i], end_slot = e->slot_hi[i];
    uint32_t l = first_slot + e->leaves, r = end_slot + e->leaves;
    for (; l < r; l >>= 1, r >>= 1) {
        if (l & 1)
            sets[count++] = &e->sub[l++];
        if (r & 1)
            sets[count++] = &e->sub[--r];
    }
    /* here[] of the nodes on the two leaf-to-root paths that stick out of
     * [first_slot, end_slot) (nodes inside it are below a canonical node, whose sub[] already
     * holds them) */
    uint32_t left_node = first_slot + e->leaves, right_node = end_slot - 1 + e->leaves;
    uint32_t height = 0;
    for (; left_node >= 1; left_node >>= 1, right_node >>= 1, height++) {
        /* the first slot below each node */
        uint32_t left_first = (left_node << height) - e->leaves;
        uint32_t right_first = (right_node << height) - e->leaves;
        if (left_first < first_slot || left_first + (1u << height) > end_slot)
            sets[count++] = &e->here[left_node];
        if (right_node != left_node &&
            (right_first < first_slot || right_first + (1u << height) > end_slot))
            sets[count++] = &e->here[right_node];
    }
    size_t kept = 0; /* the non-empty ones, then widest first (insertion sort: a few dozen) */
    for (size_t j = 0; j < count; j++)
        if (sets[j]->len)
            sets[kept++] = sets[j];
    for (size_t j = 1; j < kept; j++) {
        const interval_set *t = sets[j];
        uint64_t span = set_span(t);
        size_t h = j;
        for (; h > 0 && set_span(sets[h - 1]) < span; h--)
            sets[h] = sets[h - 1];
        sets[h] = t;
    }
    for (size_t j = 0; j < kept; j++)
        dense_merge(e, &k, sets[j]);
    return e->nomem ? 0 : k;
}

int lshm__plan_engine_init(engine *e, const plan_input *in, uint32_t *tmp, uint64_t *key,
                           int dense) {
    size_t m = in->m;
    memset(e, 0, sizeof *e);
    e->m = m;
    e->start = in->start;
    e->end = in->end;
    e->size = in->size;
    e->alignment = in->alignment;
    e->pos = malloc(m * sizeof *e->pos);
    e->start_by_pos = malloc(m * sizeof *e->start_by_pos);
    e->end_by_pos = malloc(m * sizeof *e->end_by_pos);
    e->max_end_below = malloc(m * sizeof *e->max_end_below);
    e->placed_lo = malloc(m * sizeof *e->placed_lo);
    e->placed_hi = malloc(m * sizeof *e->placed_hi);
    e->blocks = malloc(m * sizeof *e->blocks);
    if (!e->pos || !e->start_by_pos || !e->end_by_pos || !e->max_end_below || !e->placed_lo ||
        !e->placed_hi || !e->blocks) {
        lshm__plan_engine_free(e);
        return -ENOMEM;
    }
    uint32_t *by_start = e->start_by_pos; /* borrow as the item array */
    for (size_t i = 0; i < m; i++) {
        by_start[i] = (uint32_t)i;
        key[i] = in->start[i];
    }
    lshm__plan_sort_by_key(by_start, m, key, tmp);
    for (size_t p = 0; p < m; p++)
        e->pos[by_start[p]] = (uint32_t)p;
    for (size_t i = 0; i < m; i++) {
        e->start_by_pos[e->pos[i]] = in->start[i];
        e->end_by_pos[e->pos[i]] = in->end[i];
    }
    e->blocks_cap = m;
    if (dense) {
        int err = engine_init_dense(e, in);
        if (err) {
            lshm__plan_engine_free(e);
            return err;
        }
    }
    return 0;
}

static void engine_reset(engine *e) {
    if (e->dense) {
        for (size_t v = 0; v < 2 * (size_t)e->leaves; v++)
            e->here[v].len = e->sub[v].len = 0;
        return;
    }
    memset(e->max_end_below, 0, e->m * sizeof *e->max_end_below);
    memset(e->placed_hi, 0, e->m * sizeof *e->placed_hi);
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

/* Collects into e->blocks the placed tensors whose lifetime meets [from, to); returns how
 * many. */
static size_t engine_query(engine *e, uint32_t from, uint32_t to) {
    uint32_t stack_lo[128], stack_hi[128]; /* subtrees [lo, hi) of positions left to visit */
    size_t depth = 0, k = 0;
    stack_lo[depth] = 0;
    stack_hi[depth++] = (uint32_t)e->m;
    while (depth) {
        depth--;
        uint32_t lo = stack_lo[depth], hi = stack_hi[depth];
        if (lo >= hi)
            continue;
        uint32_t mid = lo + (hi - lo) / 2;
        if (e->max_end_below[mid] <= from)
            continue;
        if (e->start_by_pos[mid] < to) {
            if (e->placed_hi[mid] && e->end_by_pos[mid] > from) {
                e->blocks[k].lo = e->placed_lo[mid];
                e->blocks[k].hi = e->placed_hi[mid];
                k++;
            }
            stack_lo[depth] = mid + 1;
            stack_hi[depth++] = hi;
        }
        stack_lo[depth] = lo;
        stack_hi[depth++] = mid;
    }
    return k;
}

static void engine_insert(engine *e, uint32_t i, uint64_t offset) {
    if (e->dense) {
        /* (its end rounded up to the alignment: the bytes up to the next aligned offset can
         * hold no tensor, every offset being aligned, so the ranges of tensors packed one
         * after the other coalesce into one, which keeps dense queries short where lifetimes
         * nest; every gap and choice in engine_choose stays the same) */
        dense_insert(e, i, offset, align_up(offset + e->size[i], e->alignment));
        return;
    }
    uint32_t position = e->pos[i], lo = 0, hi = (uint32_t)e->m, end = e->end[i];
    e->placed_lo[position] = offset;
    e->placed_hi[position] = offset + e->size[i];
    for (;;) { /* down the implicit tree from the root to position */
        uint32_t mid = lo + (hi - lo) / 2;
        if (e->max_end_below[mid] < end)
            e->max_end_below[mid] = end;
        if (position == mid)
            break;
        if (position < mid)
            hi = mid;
        else
            lo = mid + 1;
    }
}


/* The offset for tensor i given the placed ones: best fit (smallest gap that holds it, lowest
 * on ties) or first fit (lowest gap that holds it); else the aligned top of the overlapping
 * blocks. */
static uint64_t engine_choose(engine *e, uint32_t i, int fit) {
    size_t k = e->dense ? dense_query(e, i) : engine_query(e, e->start[i], e->end[i]);
    block *blocks = e->blocks;
    if (!e->dense)
        sort_blocks(blocks, k);
    const uint64_t alignment = e->alignment, size = e->size[i];
    /* covered: the highest end of blocks[0..j), so a gap runs from it to blocks[j].lo */
    uint64_t covered = 0, best = UINT64_MAX, best_waste = UINT64_MAX;
    for (size_t j = 0; j < k; j++) {
        if (blocks[j].lo > covered) {
            uint64_t offset = align_up(covered, alignment);
            /* (offset + size may wrap when the sizes sum past 64 bits) */
            if (offset <= blocks[j].lo && size <= blocks[j].lo - offset) {
                uint64_t waste = blocks[j].lo - offset - size;
                if (fit == FIT_FIRST)
                    return offset;
                if (waste < best_waste) {
                    best_waste = waste;
                    best = offset;
                    if (waste == 0)
                        return offset;
                }
            }
        }
        if (blocks[j].hi > covered)
            covered = blocks[j].hi;
    }
    return best != UINT64_MAX ? best : align_up(covered, alignment);
}

/* Places the pinned tensors, then order[0..count) with `fit`. Writes off[] (by tensor) and
 * returns the arena, or UINT64_MAX as soon as the arena reaches `cutoff` or a tensor would end
 * past in->total (only possible when the sizes sum past 64 bits: in->saturated). */
uint64_t lshm__plan_engine_run(engine *e, const plan_input *in, const uint32_t *order,
                               size_t count, int fit, uint64_t *off, uint64_t cutoff) {
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
        if ((j & 255) == 255 && lshm__plan_cancelled())
            return UINT64_MAX; /* (interrupted: lshm_plan says so) */
        uint32_t i = order[j];
        uint64_t offset = engine_choose(e, i, fit);
        if (offset > in->total || in->size[i] > in->total - offset)
            return UINT64_MAX;
        off[i] = offset;
        engine_insert(e, i, offset);
        if (offset + in->size[i] > arena) {
            arena = offset + in->size[i];
            if (arena >= cutoff)
                return UINT64_MAX;
        }
    }
    return arena;
}
