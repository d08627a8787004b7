/*
 * fuzz_arena.c -- libFuzzer target for arena operations: a recording arena and a planned arena
 * driven by up to 96 operations decoded from the input (alloc of up to 64 KiB, free in any
 * order, end_iteration, trim, extra references retained and released, writes into the
 * storages' bytes, allocate/deallocate, destroy and re-create), some with a fault injected.
 *
 * Properties (abort on the first that breaks):
 *  - every call returns 0 or a documented negative errno; out-parameters untouched on failure;
 *    the documented refusals happen exactly when expected (end_iteration/destroy with storages
 *    not freed: -EBUSY; free of a slab storage with extra references: -EBUSY; ...);
 *  - every storage we hold has the size asked for, and the bytes we last wrote into it (each
 *    storage gets its own pattern, rewritten after each step that may move it);
 *  - no two storages we hold overlap in memory (recording arena: every live storage, including
 *    freed ordinary ones kept alive by an extra reference; planned arena: tensors live together
 *    by the plan) and a planned storage sits at lshm_arena_data + lshm_arena_offset;
 *  - destroy succeeds once everything is given back, and ASan's leak check finds nothing.
 */
#include "lshm.h"

#include "fuzz_common.h"

#include <errno.h>

void lshm__fault_arm(int nth, int err); /* LSHM_TESTING */

#define MAX_OPS 96
#define MAX_LIVE 24
#define MAX_PLANNED 12
#define MAX_BYTES (64u << 10)

typedef struct held {
    lshm_storage *s;
    size_t nbytes;
    uint8_t pattern;
    int allocated; /* from lshm_arena_alloc and not yet freed */
    int extra;     /* extra references we hold */
} held;

static held live[MAX_LIVE];
static size_t nlive;
static uint8_t next_pattern;

static int documented(int rc) {
    switch (-rc) {
    case 0:
    case EINVAL:
    case EBUSY:
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EOVERFLOW:
    case ENODATA:
        return 1;
    default:
        return 0;
    }
}

static void fill(lshm_storage *s, size_t n, uint8_t pattern) {
    unsigned char *p = lshm_storage_data(s);
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(pattern + i * 7);
}

static void verify(lshm_storage *s, size_t n, uint8_t pattern, const char *what) {
    FUZZ_CHECK(lshm_storage_nbytes(s) == n, "%s: nbytes %zu, expected %zu", what,
               lshm_storage_nbytes(s), n);
    const unsigned char *p = lshm_storage_data(s);
    FUZZ_CHECK((p == NULL) == (n == 0), "%s: data %p for %zu bytes", what, (const void *)p, n);
    for (size_t i = 0; i < n; i++)
        FUZZ_CHECK(p[i] == (unsigned char)(pattern + i * 7),
                   "%s: byte %zu of %zu is 0x%02x, wrote 0x%02x (storage %p)", what, i, n, p[i],
                   (unsigned char)(pattern + i * 7), (void *)s);
}

static int overlap(const void *a, size_t na, const void *b, size_t nb) {
    if (na == 0 || nb == 0)
        return 0;
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + nb && y < x + na;
}

static void verify_live(void) {
    for (size_t i = 0; i < nlive; i++)
        verify(live[i].s, live[i].nbytes, live[i].pattern, "recording storage");
    for (size_t i = 0; i < nlive; i++)
        for (size_t j = i + 1; j < nlive; j++)
            FUZZ_CHECK(!overlap(lshm_storage_data(live[i].s), live[i].nbytes,
                                lshm_storage_data(live[j].s), live[j].nbytes),
                       "live storages %p (%zu bytes) and %p (%zu bytes) overlap",
                       (void *)live[i].s, live[i].nbytes, (void *)live[j].s, live[j].nbytes);
}

static void drop(size_t k) {
    live[k] = live[--nlive];
}

/* ---- planned arena ---------------------------------------------------------------------- */

typedef struct planned {
    lshm_arena *a;
    size_t n;
    uint64_t sizes[MAX_PLANNED];
    int64_t firsts[MAX_PLANNED], lasts[MAX_PLANNED];
    int inclusive;
    int allocated;
    int extra[MAX_PLANNED];
} planned;

static int live_together(const planned *p, size_t i, size_t j) {
    if (p->inclusive)
        return p->firsts[i] <= p->lasts[j] && p->firsts[j] <= p->lasts[i];
    return p->firsts[i] < p->lasts[j] && p->firsts[j] < p->lasts[i] &&
           p->firsts[i] < p->lasts[i] && p->firsts[j] < p->lasts[j];
}

static int live_at(const planned *p, size_t i, int64_t now) {
    return p->inclusive ? (p->firsts[i] <= now && now <= p->lasts[i])
                        : (p->firsts[i] <= now && now < p->lasts[i]);
}

/* Play the plan's timeline: at each first, write the tensors starting there, then check every
 * tensor live at that time still holds its bytes; check addresses against the offsets. */
static void run_planned(planned *p) {
    if (!p->allocated)
        return;
    lshm_storage *st[MAX_PLANNED];
    unsigned char *base = lshm_arena_data(p->a);
    for (size_t i = 0; i < p->n; i++) {
        FUZZ_CHECK(lshm_arena_storage(p->a, i, &st[i]) == 0, "lshm_arena_storage(%zu)", i);
        FUZZ_CHECK(lshm_storage_nbytes(st[i]) == p->sizes[i], "planned nbytes");
        uint64_t off = 0;
        FUZZ_CHECK(lshm_arena_offset(p->a, i, &off) == 0, "lshm_arena_offset(%zu)", i);
        if (p->sizes[i] > 0) {
            FUZZ_CHECK(base != NULL && (unsigned char *)lshm_storage_data(st[i]) == base + off,
                       "tensor %zu at %p, buffer %p + offset %llu", i, lshm_storage_data(st[i]),
                       (void *)base, (unsigned long long)off);
            FUZZ_CHECK(off + p->sizes[i] <= lshm_arena_size(p->a), "tensor %zu beyond the arena",
                       i);
        }
    }
    int64_t times[MAX_PLANNED];
    for (size_t t = 0; t < p->n; t++) { /* the firsts in increasing order */
        size_t k = t;
        for (; k > 0 && times[k - 1] > p->firsts[t]; k--)
            times[k] = times[k - 1];
        times[k] = p->firsts[t];
    }
    for (size_t t = 0; t < p->n; t++) {
        int64_t now = times[t];
        for (size_t i = 0; i < p->n; i++)
            if (p->firsts[i] == now && live_at(p, i, now))
                fill(st[i], p->sizes[i], (uint8_t)(0x40 + i));
        for (size_t i = 0; i < p->n; i++)
            if (live_at(p, i, now))
                verify(st[i], p->sizes[i], (uint8_t)(0x40 + i), "planned tensor");
    }
    for (size_t i = 0; i < p->n; i++)
        for (size_t j = i + 1; j < p->n; j++)
            if (live_together(p, i, j))
                FUZZ_CHECK(!overlap(lshm_storage_data(st[i]), p->sizes[i],
                                    lshm_storage_data(st[j]), p->sizes[j]),
                           "planned tensors %zu and %zu are live together and overlap", i, j);
}

static void planned_create(fuzz_in *in, planned *p) {
    memset(p, 0, sizeof *p);
    p->n = take_u8(in) % (MAX_PLANNED + 1);
    for (size_t i = 0; i < p->n; i++) {
        p->sizes[i] = take_raw(in, 2) % (MAX_BYTES + 1);
        p->firsts[i] = take_u8(in) % 16;
        p->lasts[i] = p->firsts[i] + take_u8(in) % 8;
    }
    uint8_t o = take_u8(in);
    lshm_plan_options opts;
    lshm_plan_options_init(&opts);
    opts.alignment = (uint64_t)1 << (o % 13);
    p->inclusive = (o & 0x10) != 0;
    opts.flags = p->inclusive ? LSHM_PLAN_INCLUSIVE : 0;
    lshm_arena *a = (lshm_arena *)(uintptr_t)0x1234;
    int rc = lshm_arena_create(p->n, p->sizes, p->firsts, p->lasts, &opts,
                               (o & 0x20) ? LSHM_ARENA_SHARED : 0, &a);
    FUZZ_CHECK(rc == 0, "lshm_arena_create of %zu small tensors returned %d", p->n, rc);
    p->a = a;
}

static void planned_destroy(planned *p) {
    for (size_t i = 0; i < p->n; i++) {
        while (p->extra[i] > 0) {
            lshm_storage *s = NULL;
            FUZZ_CHECK(lshm_arena_storage(p->a, i, &s) == 0, "storage");
            lshm_storage_release(s);
            p->extra[i]--;
        }
    }
    FUZZ_CHECK(lshm_arena_destroy(p->a) == 0, "destroy of a planned arena with no extra refs");
    p->a = NULL;
}

static void planned_op(fuzz_in *in, planned *p, uint8_t op) {
    int extras = 0;
    for (size_t i = 0; i < p->n; i++)
        extras += p->extra[i];
    switch (op % 6) {
    case 0: {
        uint8_t f = take_u8(in);
        if (f & 0x80)
            lshm__fault_arm(1 + (f & 7), (f & 8) ? -ENOMEM : -EMFILE);
        int rc = lshm_arena_allocate(p->a);
        lshm__fault_arm(0, 0);
        FUZZ_CHECK(documented(rc), "allocate returned %d", rc);
        if (p->allocated)
            FUZZ_CHECK(rc == -EBUSY, "allocate twice returned %d", rc);
        else if (rc == 0)
            p->allocated = 1;
        else
            FUZZ_CHECK((f & 0x80) && rc != -EBUSY, "allocate failed (%d) without a fault", rc);
        if (rc != 0 && p->allocated == 0) {
            lshm_storage *s = (lshm_storage *)(uintptr_t)0x1;
            FUZZ_CHECK(p->n == 0 || lshm_arena_storage(p->a, 0, &s) == -ENODATA,
                       "a failed allocate left storages");
        }
        break;
    }
    case 1: {
        int rc = lshm_arena_deallocate(p->a);
        FUZZ_CHECK(rc == (extras > 0 && p->allocated ? -EBUSY : 0),
                   "deallocate with %d extra refs returned %d", extras, rc);
        if (rc == 0)
            p->allocated = 0;
        break;
    }
    case 2: {
        int rc = lshm_arena_trim(p->a);
        FUZZ_CHECK(rc == (p->allocated && p->n > 0 ? -EBUSY : 0), "planned trim returned %d",
                   rc);
        break;
    }
    case 3: /* retain or release one storage */
        if (p->allocated && p->n > 0) {
            size_t i = take_u8(in) % p->n;
            lshm_storage *s = NULL;
            FUZZ_CHECK(lshm_arena_storage(p->a, i, &s) == 0, "storage");
            if (take_bool(in) && p->extra[i] < 3) {
                lshm_storage_retain(s);
                p->extra[i]++;
            } else if (p->extra[i] > 0) {
                lshm_storage_release(s);
                p->extra[i]--;
            }
        }
        break;
    case 4:
        run_planned(p);
        break;
    default: { /* destroy (refused while referenced) and re-create */
        int rc = lshm_arena_destroy(p->a);
        FUZZ_CHECK(rc == (extras > 0 ? -EBUSY : 0), "destroy with %d extra refs returned %d",
                   extras, rc);
        if (rc == 0) {
            p->a = NULL;
            planned_create(in, p);
        }
        break;
    }
    }
}

/* ---- recording arena ---------------------------------------------------------------------- */

static void recording_op(fuzz_in *in, lshm_arena *a, uint8_t op) {
    size_t outstanding = 0;
    for (size_t i = 0; i < nlive; i++)
        outstanding += live[i].allocated;
    switch (op % 8) {
    case 0:
    case 1: { /* alloc */
        if (nlive == MAX_LIVE)
            break;
        size_t nbytes = take_raw(in, 2) % (MAX_BYTES + 1);
        if (op & 0x80)
            nbytes = take_u8(in); /* small sizes, so slices get reused */
        uint8_t f = take_u8(in);
        if ((f & 0xc0) == 0xc0)
            lshm__fault_arm(1 + (f & 7), (f & 8) ? -ENOMEM : -EMFILE);
        lshm_storage *s = (lshm_storage *)(uintptr_t)0x1234;
        int rc = lshm_arena_alloc(a, nbytes, &s);
        lshm__fault_arm(0, 0);
        FUZZ_CHECK(documented(rc), "alloc(%zu) returned %d", nbytes, rc);
        FUZZ_CHECK(rc == 0 || (f & 0xc0) == 0xc0, "alloc(%zu) failed (%d) without a fault",
                   nbytes, rc);
        if (rc != 0) {
            FUZZ_CHECK(s == (lshm_storage *)(uintptr_t)0x1234, "alloc wrote out on failure");
            break;
        }
        held h = {s, nbytes, next_pattern++, 1, 0};
        fill(s, nbytes, h.pattern);
        live[nlive++] = h;
        verify_live();
        break;
    }
    case 2: { /* free one, in any order */
        if (nlive == 0)
            break;
        size_t k = take_u8(in) % nlive;
        if (!live[k].allocated)
            break;
        verify(live[k].s, live[k].nbytes, live[k].pattern, "before free");
        int in_slot = (lshm_storage_flags(live[k].s) & LSHM_STORAGE_INPLACE) != 0;
        int rc = lshm_arena_free(a, live[k].s);
        if (in_slot && live[k].extra > 0) {
            FUZZ_CHECK(rc == -EBUSY, "free of a slab storage with extra refs returned %d", rc);
            break;
        }
        FUZZ_CHECK(rc == 0, "free returned %d", rc);
        live[k].allocated = 0;
        if (live[k].extra == 0)
            drop(k);
        /* a second free of the same pointer would be a use-after-free for slab storages; an
         * ordinary one kept alive by us must be refused */
        else {
            rc = lshm_arena_free(a, live[k].s);
            FUZZ_CHECK(rc == -EINVAL, "second free returned %d", rc);
        }
        break;
    }
    case 3: { /* end_iteration */
        uint8_t f = take_u8(in);
        if ((f & 0xc0) == 0xc0)
            lshm__fault_arm(1 + (f & 7), (f & 8) ? -ENOMEM : -EMFILE);
        int rc = lshm_arena_end_iteration(a);
        lshm__fault_arm(0, 0);
        FUZZ_CHECK(documented(rc), "end_iteration returned %d", rc);
        if (outstanding > 0)
            FUZZ_CHECK(rc == -EBUSY, "end_iteration with %zu outstanding returned %d",
                       outstanding, rc);
        else
            FUZZ_CHECK(rc == 0 || (f & 0xc0) == 0xc0, "end_iteration failed (%d)", rc);
        verify_live();
        break;
    }
    case 4: { /* trim */
        int rc = lshm_arena_trim(a);
        FUZZ_CHECK(rc == 0 || rc == -EBUSY, "trim returned %d", rc);
        size_t in_slots = 0;
        for (size_t i = 0; i < nlive; i++)
            in_slots += (lshm_storage_flags(live[i].s) & LSHM_STORAGE_INPLACE) != 0;
        FUZZ_CHECK((rc == -EBUSY) == (in_slots > 0), "trim %d with %zu slab storages", rc,
                   in_slots);
        verify_live();
        break;
    }
    case 5: { /* retain an extra reference */
        if (nlive == 0)
            break;
        size_t k = take_u8(in) % nlive;
        if (live[k].extra < 3) {
            FUZZ_CHECK(lshm_storage_retain(live[k].s) == live[k].s, "retain");
            live[k].extra++;
        }
        break;
    }
    case 6: { /* release an extra reference */
        if (nlive == 0)
            break;
        size_t k = take_u8(in) % nlive;
        if (live[k].extra > 0) {
            lshm_storage_release(live[k].s);
            live[k].extra--;
            if (live[k].extra == 0 && !live[k].allocated)
                drop(k);
        }
        break;
    }
    default: { /* rewrite one storage's bytes, then check everyone */
        if (nlive == 0)
            break;
        size_t k = take_u8(in) % nlive;
        live[k].pattern = next_pattern++;
        fill(live[k].s, live[k].nbytes, live[k].pattern);
        verify_live();
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_in in = {data, size};
    nlive = 0;
    next_pattern = 1;
    uint8_t cfg = take_u8(&in);
    lshm_plan_options opts;
    lshm_plan_options_init(&opts);
    opts.alignment = (uint64_t)1 << (cfg % 8 * 2);
    lshm_arena *rec = NULL;
    int rc = lshm_arena_create_recording(&opts, (cfg & 0x80) ? LSHM_ARENA_SHARED : 0, &rec);
    FUZZ_CHECK(rc == 0, "create_recording returned %d", rc);
    planned p;
    planned_create(&in, &p);

    for (int i = 0; i < MAX_OPS && in.n > 0; i++) {
        uint8_t op = take_u8(&in);
        if (op & 0x40)
            planned_op(&in, &p, op);
        else
            recording_op(&in, rec, op);
    }

    /* Give everything back: destroy must refuse while storages are out, then succeed. */
    verify_live();
    run_planned(&p);
    if (nlive > 0) {
        int outstanding = 0;
        for (size_t i = 0; i < nlive; i++)
            outstanding += live[i].allocated;
        if (outstanding)
            FUZZ_CHECK(lshm_arena_destroy(rec) == -EBUSY, "destroy with storages not freed");
    }
    while (nlive > 0) {
        held *h = &live[nlive - 1];
        if (h->allocated) {
            while ((lshm_storage_flags(h->s) & LSHM_STORAGE_INPLACE) && h->extra > 0) {
                lshm_storage_release(h->s);
                h->extra--;
            }
            FUZZ_CHECK(lshm_arena_free(rec, h->s) == 0, "final free");
        }
        while (h->extra > 0) {
            lshm_storage_release(h->s);
            h->extra--;
        }
        nlive--;
    }
    FUZZ_CHECK(lshm_arena_destroy(rec) == 0, "destroy of an idle recording arena");
    planned_destroy(&p);
    return 0;
}
