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
    e->ps = malloc(m * sizeof *e->ps);
    e->pe = malloc(m * sizeof *e->pe);
    e->pmax = malloc(m * sizeof *e->pmax);
    e->plo = malloc(m * sizeof *e->plo);
    e->phi = malloc(m * sizeof *e->phi);
    e->blocks = malloc(m * sizeof *e->blocks);
    if (!e->pos || !e->ps || !e->pe || !e->pmax || !e->plo || !e->phi || !e->blocks) {
        lshm__plan_engine_free(e);
        return -ENOMEM;
    }
    uint32_t *by_start = e->ps; /* borrow as the item array */
    for (size_t i = 0; i < m; i++) {
        by_start[i] = (uint32_t)i;
        key[i] = in->start[i];
    }
    lshm__plan_sort_by_key(by_start, m, key, tmp);
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
            lshm__plan_engine_free(e);
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
