/*
 * slab.c -- small storages packed into slabs that share one memfd each.
 *
 * Sharing a small storage in place with a memfd of its own costs one fd and one mapping per
 * storage, and a process runs out of both long before it runs out of memory (ulimit -n is often
 * 1,024; vm.max_map_count 65,530). So the default allocator places storages of at most
 * LSHM_SLAB_MAX_BYTES (64 KiB) that are not resizable in slabs: LSHM__SLAB_BYTES (4 MiB) of private anonymous memory,
 * handed out in whole pages. A storage still owns whole pages, so it is still shared in place
 * at the same address, but into its slab's memfd:
 *   - a slab has no memfd until the first of its storages is shared; then one memfd of the
 *     slab's size, sealed against shrink and grow, whose page at offset X backs the slab's page
 *     at offset X;
 *   - sharing a storage pwrites its pages into the memfd at its offset and maps that range over
 *     the storage's own pages (MAP_FIXED). Neighbours shared one after the other are contiguous
 *     in both address and file offset, so the kernel merges them into one mapping;
 *   - the memfd holds only the bytes of storages that were shared (the rest of it is holes), so
 *     a process that receives the memfd can read what was shared into it and nothing else; a
 *     share that fails punches its range out again.
 * A storage shared read-only (lshm_storage_share_readonly) gets a memfd of its own over its
 * slab pages instead (share.c), sealed alone; freeing it maps private pages back over them.
 * Page reuse is what keeps receivers from seeing later storages: pages of a storage that was
 * never shared go back to the slab at once (zeroed before reuse: they are private memory), but
 * pages that were shared into the memfd are *retired*: no other storage gets them while that
 * memfd is the slab's, since a receiver may still map it. When the last storage of a slab is
 * gone, the slab drops its memfd (receivers keep theirs; the kernel frees it when the last one
 * goes), maps fresh private pages over its whole range, and starts over.
 *
 * fork(): a child inherits the slabs and their memfds. Storages shared before the fork stay
 * shared with the parent (as for any shared storage); storages not shared stay private
 * (copy-on-write). A share in the child must not write into the parent's memfd at an offset the
 * parent may use for another storage, so the child drops every slab's memfd reference at fork
 * (lshm__slab_after_fork_child) and makes new ones as it shares.
 *
 * Locking: slabs_lock guards the slab list, every slab's bitmaps, counters and owner[], and
 * the storages' slab_memfd while lshm_slab_find may read it; memfd objects
 * are refcounted (the slab's current reference plus one per storage shared into them) so a
 * storage keeps its memfd's fd valid after its slab moved on. The copy and the mmap of a share
 * run outside slabs_lock (the storage's own lock serialises shares of one storage).
 */
#include "internal.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Pages per slab on the smallest page size; larger pages mean fewer, the bitmaps stay. */
#define SLAB_MAX_PAGES (LSHM__SLAB_BYTES / 4096)
#define SLAB_WORDS (SLAB_MAX_PAGES / 64)

struct lshm__slab_memfd {
    _Atomic size_t refcount; /* the slab's (while current) + one per storage shared into it */
    int fd;                  /* memfd of LSHM__SLAB_BYTES, sealed against shrink/grow */
    uint64_t dev, ino;       /* its identity (fstat), for lshm_slab_find */
    _Atomic unsigned char seal_sealed; /* lshm__slab_fd added F_SEAL_SEAL (fd handed out) */
    uint64_t next_share; /* where the last share into it ended (slabs_lock) */
    uint64_t ready_end;  /* pages below this were allocated ahead of their shares (slabs_lock) */
};

/* Shares that walk up a slab one storage after the other (create many, then share each: the
 * usual pattern) get the memfd's pages allocated READY_AHEAD bytes at a time, in one fallocate
 * each, instead of one page allocation inside every pwrite (on a 2-CPU VM that allocation is
 * 0.8 us of the 8.8 us of a 4 KiB share's pwrite and mmap, 0.6 us when allocated ahead: min
 * times of `bench_pages ahead 500`, tools/bench_pages.c). Pages allocated ahead and never
 * shared into are zero-filled: a receiver of the memfd reads zeros there, never a private
 * storage's bytes. At most READY_AHEAD bytes per memfd are allocated that no share used, when a
 * walk stops. */
#define READY_AHEAD ((uint64_t)64 << 10)

struct lshm__slab {
    char *base;                 /* LSHM__SLAB_BYTES of memory, page-aligned */
    struct lshm__slab *next;    /* all slabs, newest first */
    uint64_t busy[SLAB_WORDS];  /* page holds a live storage or is retired */
    uint64_t dirty[SLAB_WORDS]; /* page was handed out since it was last known zero */
    lshm_storage *owner[SLAB_MAX_PAGES]; /* the live storage whose first page this is */
    size_t pages;               /* pages in the slab */
    size_t free_pages;          /* pages not busy */
    size_t live;                /* storages on the slab */
    size_t cursor;              /* where the next search for free pages starts */
    lshm__slab_memfd *memfd;    /* the memfd shares go into now; NULL until the first share */
    int shared_pages;           /* some pages are mapped from a memfd (this one or, after a
                                   fork, the parent's): only fresh private pages undo that */
    /* The generation of the userfaultfd its private pages are all registered with (the
     * write fence's: lshm__os_fence_prepare), or 0: its shares' fences register as for any
     * memory. */
    _Atomic unsigned long fence_generation;
};

_Atomic size_t lshm__slab_max_bytes = LSHM_SLAB_MAX_BYTES;

static pthread_mutex_t slabs_lock = PTHREAD_MUTEX_INITIALIZER;
static lshm__slab *slabs;   /* every slab */
static lshm__slab *current; /* where allocation looks first */

/* ---- bitmaps ------------------------------------------------------------------------------- */

static int bit(const uint64_t *map, size_t i) {
    return (int)((map[i / 64] >> (i % 64)) & 1u);
}

static void set_bits(uint64_t *map, size_t first, size_t n, int value) {
    for (size_t i = first; i < first + n; i++) {
        if (value)
            map[i / 64] |= (uint64_t)1 << (i % 64);
        else
            map[i / 64] &= ~((uint64_t)1 << (i % 64));
    }
}

static int any_bit(const uint64_t *map, size_t first, size_t n) {
    for (size_t i = first; i < first + n; i++)
        if (bit(map, i))
            return 1;
    return 0;
}

/* First run of n free pages at or after `from`, wrapping around once; -1 if none. */
static ptrdiff_t find_run(const lshm__slab *slab, size_t n, size_t from) {
    if (slab->free_pages < n)
        return -1;
    for (size_t pass = 0; pass < 2; pass++) {
        size_t start = pass == 0 ? from : 0, end = pass == 0 ? slab->pages : from + n - 1;
        if (end > slab->pages)
            end = slab->pages;
        size_t run = 0;
        for (size_t i = start; i < end; i++) {
            /* Skip whole busy words quickly: most of a full slab is. */
            if (run == 0 && i % 64 == 0 && slab->busy[i / 64] == UINT64_MAX) {
                i += 63;
                continue;
            }
            run = bit(slab->busy, i) ? 0 : run + 1;
            if (run == n)
                return (ptrdiff_t)(i + 1 - n);
        }
    }
    return -1;
}

/* ---- memfds -------------------------------------------------------------------------------- */

static void memfd_release(lshm__slab_memfd *m) {
    if (m != NULL && lshm__ref_release(&m->refcount)) {
        lshm__os_close(m->fd);
        free(m);
    }
}

/* A new memfd for a slab, sized and sealed; lock held. */
static int memfd_new(lshm__slab_memfd **out) {
    lshm__slab_memfd *m = malloc(sizeof *m);
    if (m == NULL)
        return LSHM_FAIL(-ENOMEM, "malloc of a slab memfd record failed");
    int fd = -1;
    lshm__fd_info info;
    int rc = lshm__os_memfd_sized(LSHM__SLAB_BYTES, &fd);
    if (rc != 0 || (rc = lshm__os_fd_info(fd, &info)) != 0)
        goto fail;
    atomic_init(&m->refcount, 1);
    atomic_init(&m->seal_sealed, 0);
    m->fd = fd;
    m->dev = info.dev;
    m->ino = info.ino;
    m->next_share = UINT64_MAX; /* a walk needs two shares in a row */
    m->ready_end = 0;
    *out = m;
    return 0;

fail:
    lshm__os_close(fd);
    free(m);
    return rc;
}

/* ---- slabs --------------------------------------------------------------------------------- */

static int slab_new(lshm__slab **out) {
    lshm__slab *slab = calloc(1, sizeof *slab);
    if (slab == NULL)
        return LSHM_FAIL(-ENOMEM, "malloc of a slab record failed");
    void *base = NULL;
    int rc = lshm__os_map_anon(LSHM__SLAB_BYTES, &base);
    if (rc != 0) {
        free(slab);
        return rc;
    }
    slab->base = base;
    /* (its shares' fences: protect only) */
    atomic_store(&slab->fence_generation, lshm__os_fence_prepare(base, LSHM__SLAB_BYTES));
    slab->pages = LSHM__SLAB_BYTES / lshm__os_page_size();
    assert(slab->pages <= SLAB_MAX_PAGES);
    slab->free_pages = slab->pages;
    slab->next = slabs;
    slabs = slab;
    *out = slab;
    return 0;
}

static void slab_unlink_free(lshm__slab *slab) {
    for (lshm__slab **p = &slabs; *p != NULL; p = &(*p)->next) {
        if (*p == slab) {
            *p = slab->next;
            break;
        }
    }
    if (current == slab)
        current = NULL;
    lshm__os_unmap(slab->base, LSHM__SLAB_BYTES);
    memfd_release(slab->memfd);
    free(slab);
}

/* The last storage of a slab is gone (lock held). Retired pages become usable again only with
 * a new memfd: drop the current one and put private zero pages over the whole range. An empty
 * slab that is not the current one is unmapped altogether. */
static void slab_empty(lshm__slab *slab) {
    assert(slab->live == 0);
    if (slab != current) {
        slab_unlink_free(slab);
        return;
    }
    if (slab->shared_pages) {
        if (lshm__os_map_anon_fixed(slab->base, LSHM__SLAB_BYTES) != 0) {
            /* Out of mappings: the retired pages stay mapped to the old memfd, so they must
             * stay retired (busy); the slab, no longer the current one, keeps serving its
             * other pages and is unmapped whole the next time it empties. */
            current = NULL;
            return;
        }
        slab->shared_pages = 0;
        memset(slab->dirty, 0, sizeof slab->dirty);
        atomic_store(&slab->fence_generation,
                     lshm__os_fence_prepare(slab->base, LSHM__SLAB_BYTES));
    }
    memfd_release(slab->memfd);
    slab->memfd = NULL;
    memset(slab->busy, 0, sizeof slab->busy);
    slab->free_pages = slab->pages;
    slab->cursor = 0;
}

int lshm__slab_alloc(size_t capacity, lshm__slab **slab_out, void **data_out) {
    size_t page = lshm__os_page_size();
    assert(capacity > 0 && capacity <= LSHM_SLAB_MAX_BYTES && lshm__page_aligned(capacity));
    size_t n = capacity / page;
    pthread_mutex_lock(&slabs_lock);
    lshm__slab *slab = current;
    ptrdiff_t at = slab != NULL ? find_run(slab, n, slab->cursor) : -1;
    if (at < 0) {
        /* Another slab with room (freed pages), else a new one. */
        for (slab = slabs; slab != NULL; slab = slab->next) {
            if (slab != current && (at = find_run(slab, n, 0)) >= 0)
                break;
        }
        if (slab == NULL) {
            int rc = slab_new(&slab);
            if (rc != 0) {
                pthread_mutex_unlock(&slabs_lock);
                return rc;
            }
            at = 0;
        }
        current = slab;
    }
    set_bits(slab->busy, (size_t)at, n, 1);
    int was_dirty = any_bit(slab->dirty, (size_t)at, n);
    set_bits(slab->dirty, (size_t)at, n, 1);
    slab->free_pages -= n;
    slab->live++;
    slab->cursor = (size_t)at + n;
    char *data = slab->base + (size_t)at * page;
    pthread_mutex_unlock(&slabs_lock);
    /* The storage owns these pages from here on, so zeroing them needs no lock. */
    if (was_dirty)
        memset(data, 0, capacity);
    *slab_out = slab;
    *data_out = data;
    return 0;
}

void lshm__slab_free(lshm_storage *s) {
    lshm__slab *slab = s->slab;
    char *data = atomic_load_explicit(&s->data, memory_order_relaxed);
    size_t page = lshm__os_page_size();
    size_t first = (size_t)(data - slab->base) / page, n = s->capacity / page;
    lshm__slab_memfd *shared_into = s->slab_memfd;
    int own_fd = s->fd >= 0; /* shared read-only into a memfd of its own */
    if (own_fd) {
        /* Its pages are a mapping of its own memfd, which no other storage will ever use:
         * put private zero pages back and the pages are free again. If that fails, keep them
         * busy (retired) for good rather than hand out memory another process can read. */
        if (lshm__os_map_anon_fixed(data, s->capacity) == 0) {
            own_fd = 0;
            /* The new pages are registered with the write fence's userfaultfd again (which
             * merges them back into the slab's mapping), or the slab is no longer taken as
             * registered whole. */
            unsigned long generation = atomic_load(&slab->fence_generation);
            if (generation != 0 && lshm__os_fence_prepare(data, s->capacity) != generation)
                atomic_store(&slab->fence_generation, 0);
        }
        shared_into = NULL;
    }
    pthread_mutex_lock(&slabs_lock);
    slab->owner[first] = NULL;
    if (own_fd)
        slab->shared_pages = 1; /* retired until the slab starts over */
    if (shared_into == NULL && !own_fd) {
        set_bits(slab->busy, first, n, 0);
        slab->free_pages += n;
        if (first < slab->cursor)
            slab->cursor = first;
    }
    assert(slab->live > 0);
    slab->live--;
    if (slab->live == 0)
        slab_empty(slab);
    pthread_mutex_unlock(&slabs_lock);
    memfd_release(shared_into);
    s->slab_memfd = NULL;
    s->slab = NULL;
}

int lshm__slab_share(lshm_storage *s) {
    lshm__slab *slab = s->slab;
    char *data = atomic_load_explicit(&s->data, memory_order_relaxed);
    uint64_t offset = (uint64_t)(data - slab->base);
    pthread_mutex_lock(&slabs_lock);
    int rc = 0, created = slab->memfd == NULL;
    if (created)
        rc = memfd_new(&slab->memfd);
    lshm__slab_memfd *m = slab->memfd;
    uint64_t end = offset + s->capacity, ahead_from = 0, ahead_to = 0;
    if (rc == 0) {
        lshm__ref_retain(&m->refcount);
        if (offset == m->next_share && end > m->ready_end) {
            ahead_from = offset > m->ready_end ? offset : m->ready_end;
            ahead_to = offset + READY_AHEAD;
            if (ahead_to > LSHM__SLAB_BYTES)
                ahead_to = LSHM__SLAB_BYTES;
            if (ahead_to < end)
                ahead_to = end;
            m->ready_end = ahead_to;
        }
        m->next_share = end;
    }
    pthread_mutex_unlock(&slabs_lock);
    if (rc != 0)
        return rc;
    lshm__os_allocate_ahead(m->fd, ahead_from, ahead_to - ahead_from);
    void *mapped = NULL;
    rc = lshm__os_pwrite_inside(m->fd, data, s->capacity, offset); /* (sized: memfd_new) */
    if (rc == 0)
        rc = lshm__os_map_fd(m->fd, offset, s->capacity, 0, data, &mapped);
    if (rc != 0) {
        /* Nobody may read bytes of a storage that is not shared: take them out again. */
        lshm__os_punch_hole(m->fd, offset, s->capacity);
        /* A memfd this share made and nobody else took is dropped again: a failed share
         * leaves no fd behind. */
        pthread_mutex_lock(&slabs_lock);
        if (created && slab->memfd == m &&
            atomic_load_explicit(&m->refcount, memory_order_relaxed) == 2) {
            slab->memfd = NULL;
            memfd_release(m);
        }
        pthread_mutex_unlock(&slabs_lock);
        memfd_release(m);
        return rc;
    }
    pthread_mutex_lock(&slabs_lock); /* lshm_slab_find reads slab_memfd under it */
    slab->shared_pages = 1;
    s->slab_memfd = m;
    s->fd_offset = offset;
    pthread_mutex_unlock(&slabs_lock);
    return 0;
}

_Atomic unsigned long *lshm__slab_fence_generation(lshm_storage *s) {
    return &s->slab->fence_generation;
}

void lshm__slab_set_owner(lshm_storage *s) {
    char *data = atomic_load_explicit(&s->data, memory_order_relaxed);
    pthread_mutex_lock(&slabs_lock);
    s->slab->owner[(size_t)(data - s->slab->base) / lshm__os_page_size()] = s;
    pthread_mutex_unlock(&slabs_lock);
}

int lshm_slab_knows(uint64_t dev, uint64_t ino) {
    int known = 0;
    pthread_mutex_lock(&slabs_lock);
    for (lshm__slab *slab = slabs; slab != NULL && !known; slab = slab->next) {
        const lshm__slab_memfd *m = slab->memfd;
        known = m != NULL && m->dev == dev && m->ino == ino;
        for (size_t i = 0; i < slab->pages && !known; i++) {
            const lshm_storage *s = slab->owner[i];
            m = s != NULL ? s->slab_memfd : NULL;
            known = m != NULL && m->dev == dev && m->ino == ino;
        }
    }
    pthread_mutex_unlock(&slabs_lock);
    return known;
}

int lshm_slab_find(uint64_t dev, uint64_t ino, uint64_t offset, size_t nbytes,
                   lshm_storage **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    size_t page = lshm__os_page_size();
    lshm_storage *found = NULL;
    pthread_mutex_lock(&slabs_lock);
    if (lshm__page_aligned(offset) && offset < LSHM__SLAB_BYTES) {
        for (lshm__slab *slab = slabs; slab != NULL && found == NULL; slab = slab->next) {
            lshm_storage *s = slab->owner[offset / page];
            lshm__slab_memfd *m = s != NULL ? s->slab_memfd : NULL;
            if (m == NULL || m->dev != dev || m->ino != ino || lshm_storage_nbytes(s) != nbytes)
                continue;
            /* Retain only a storage that is still alive: a release that reached 0 frees it
             * (and clears owner[] under this lock) without waiting for us. */
            size_t refs = atomic_load_explicit(&s->refcount, memory_order_relaxed);
            while (refs > 0 && !atomic_compare_exchange_weak(&s->refcount, &refs, refs + 1)) {
            }
            if (refs > 0)
                found = s;
        }
    }
    pthread_mutex_unlock(&slabs_lock);
    if (found == NULL)
        return LSHM_FAIL(-ENOENT, "no storage of this process at offset %llu of that memfd",
                         (unsigned long long)offset);
    *out = found;
    return 0;
}

int lshm__slab_identity(const lshm_storage *s, uint64_t *dev, uint64_t *ino) {
    const lshm__slab_memfd *m = s->slab_memfd; /* set once by the share, before SHARED */
    if (m == NULL)
        return 0;
    *dev = m->dev;
    *ino = m->ino;
    return 1;
}

int lshm__slab_fd(const lshm_storage *s, int *fd) {
    lshm__slab_memfd *m = s->slab_memfd;
    /* One F_SEAL_SEAL per memfd, not per storage shared into it. The flag is only a shortcut;
     * two racing first calls both add it, which is harmless. */
    if (!atomic_load_explicit(&m->seal_sealed, memory_order_acquire)) {
        int rc = lshm__os_seal_seal(m->fd);
        if (rc != 0)
            return rc;
        atomic_store_explicit(&m->seal_sealed, 1, memory_order_release);
    }
    *fd = m->fd;
    return 0;
}

int lshm_slab_stats(lshm_slab_counters *out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    lshm_slab_counters c = {0, 0, 0};
    pthread_mutex_lock(&slabs_lock);
    for (const lshm__slab *slab = slabs; slab != NULL; slab = slab->next) {
        c.slabs++;
        c.memfds += slab->memfd != NULL;
        c.storages += slab->live;
    }
    pthread_mutex_unlock(&slabs_lock);
    *out = c;
    return 0;
}

void lshm__slab_prepare_fork(void) {
    pthread_mutex_lock(&slabs_lock);
}

void lshm__slab_after_fork_parent(void) {
    pthread_mutex_unlock(&slabs_lock);
}

void lshm__slab_after_fork_child(void) {
    /* The parent goes on sharing into these memfds at offsets it may give to other storages:
     * the child shares into memfds of its own from now on. */
    for (lshm__slab *slab = slabs; slab != NULL; slab = slab->next) {
        memfd_release(slab->memfd);
        slab->memfd = NULL;
    }
    pthread_mutex_unlock(&slabs_lock);
}
