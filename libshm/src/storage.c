/*
 * storage.c -- storage lifetime: every constructor (init/fini in place, heap create/release,
 * shared from the start, views of a segment, attach of a received fd), refcount, allocators,
 * accessors, resize and copy. Segments (segment.c) and the share (share.c) are used through
 * their own functions; the memfd pool (pool.c) takes a released storage's memfd.
 *
 * A storage's address is its identity (PyTorch keeps its static-runtime storages in one slab
 * and never moves them), so everything here works on a struct the caller placed: _init fills
 * it, _fini empties it, and the heap _create/_release pair is only a convenience on top.
 *
 * The default allocator hands out whole anonymous pages (page-aligned, nbytes rounded up to a
 * page, zero-filled) that the storage alone owns. That is what lets share.c map a memfd over
 * the very same pages later, so the data pointer, and every raw pointer into it, stays valid.
 * Those pages come from a slab (slab.c) when the storage is not resizable and its capacity is
 * at most lshm__slab_max_bytes (LSHM_SLAB_MAX_BYTES); resizable ones get a mapping of their own,
 * since resize moves or grows whole mappings.
 *
 * How bytes go back depends on where they came from (enum lshm__origin in internal.h):
 *   PAGES      munmap [data, data + capacity) (a memfd mapped over it goes the same way)
 *   ALLOCATOR  free(ctx, data, nbytes); a WHOLE_PAGES range that was shared in place first
 *              gets private anonymous pages back, so the allocator recovers ordinary memory
 *   FOREIGN    release(ctx, data, nbytes) if given
 *   MAPPED     munmap the mapping of our memfd
 *   VIEW       release the segment
 *   SLAB       lshm__slab_free: the pages go back to their slab (retired while they are in
 *              the slab's memfd, see slab.c)
 * and the storage's own memfd, if any, is closed.
 */
#include "internal.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define KNOWN_INIT_FLAGS LSHM_STORAGE_RESIZABLE

size_t lshm_page_size(void) {
    return lshm__os_page_size();
}

size_t lshm_storage_sizeof(void) {
    return sizeof(lshm_storage);
}

size_t lshm_storage_alignof(void) {
    return _Alignof(lshm_storage);
}

int lshm__check_mem(const void *mem, lshm_storage **out) {
    if (mem == NULL || out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL %s", mem == NULL ? "storage memory" : "out pointer");
    if ((uintptr_t)mem % _Alignof(lshm_storage) != 0)
        return LSHM_FAIL(-EINVAL, "storage memory %p is not aligned to %zu bytes", mem,
                         (size_t)_Alignof(lshm_storage));
    return 0;
}

void lshm__storage_prepare(lshm_storage *s, unsigned origin, unsigned flags) {
    memset(s, 0, sizeof *s);
    atomic_init(&s->refcount, 1);
    atomic_init(&s->data, NULL);
    atomic_init(&s->flags, flags | LSHM_STORAGE_INPLACE);
    s->origin = (unsigned char)origin;
    s->fd = -1;
    /* Default attributes: glibc cannot fail here (no allocation), so no error path. */
    int r = pthread_mutex_init(&s->lock, NULL);
    assert(r == 0);
    (void)r;
}

int lshm__storage_malloc(lshm_storage *const *out, lshm_storage **s_out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    lshm_storage *s = aligned_alloc(_Alignof(lshm_storage), sizeof(lshm_storage));
    if (s == NULL)
        return LSHM_FAIL(-ENOMEM, "malloc of a %zu-byte storage struct failed",
                         sizeof(lshm_storage));
    *s_out = s;
    return 0;
}

int lshm__storage_heap_done(lshm_storage *s, int rc) {
    if (rc != 0) {
        free(s);
        return rc;
    }
    atomic_fetch_and(&s->flags, ~LSHM_STORAGE_INPLACE); /* the struct is ours to free */
    return 0;
}

/* ---- allocation of the bytes --------------------------------------------------------------- */

/* Get nbytes for a storage that is not initialised yet; writes data and capacity, and the slab
 * when the default allocator placed it in one (slab non-NULL: small, not resizable). */
static int alloc_bytes(const lshm_allocator *allocator, size_t nbytes, void **data,
                       size_t *capacity, lshm__slab **slab) {
    size_t cap = 0;
    int rc = lshm__round_pages(nbytes, &cap);
    if (rc != 0)
        return rc;
    if (nbytes == 0) { /* no memory at all: data NULL, nothing to free */
        *data = NULL;
        *capacity = 0;
        return 0;
    }
    if (allocator == NULL && slab != NULL &&
        cap <= atomic_load_explicit(&lshm__slab_max_bytes, memory_order_relaxed)) {
        rc = lshm__slab_alloc(cap, slab, data);
        if (rc != 0)
            return rc;
        *capacity = cap;
        return 0;
    }
    if (allocator == NULL) {
        rc = lshm__os_map_anon_pages(cap, data);
        if (rc != 0)
            return rc;
        *capacity = cap;
        return 0;
    }
    void *p = allocator->alloc(allocator->ctx, nbytes);
    if (p == NULL)
        return LSHM_FAIL(-ENOMEM, "allocator returned NULL for %zu bytes", nbytes);
    if ((allocator->flags & LSHM_ALLOCATOR_WHOLE_PAGES) != 0 &&
        !lshm__page_aligned((uintptr_t)p)) {
        allocator->free(allocator->ctx, p, nbytes);
        return LSHM_FAIL(-EINVAL, "WHOLE_PAGES allocator returned %p, not page-aligned", p);
    }
    *data = p;
    *capacity = (allocator->flags & LSHM_ALLOCATOR_WHOLE_PAGES) != 0 ? cap : nbytes;
    return 0;
}

/* Give the bytes back; the storage is dead afterwards. Also closes its own memfd. */
static void free_bytes(lshm_storage *s) {
    void *data = atomic_load_explicit(&s->data, memory_order_acquire);
    size_t nbytes = atomic_load_explicit(&s->nbytes, memory_order_relaxed);
    switch ((enum lshm__origin)s->origin) {
    case LSHM__ORIGIN_PAGES:
        /* Private pages or the memfd mapped over them: one munmap either way. The memfd itself
         * may go to the pool (pool.c) instead of being closed. */
        lshm__os_unmap(data, s->capacity);
        if (s->fd >= 0)
            lshm__pool_put(s);
        break;
    case LSHM__ORIGIN_ALLOCATOR:
        if (data == NULL)
            break;
        if (s->fd >= 0) {
            /* Shared in place: the range is a mapping of our memfd. Put private pages back
             * so the allocator gets ordinary memory. If even that fails (out of mappings),
             * leaking the range is the only safe choice: the allocator must not reuse
             * memory another process can write. */
            assert((s->allocator.flags & LSHM_ALLOCATOR_WHOLE_PAGES) != 0);
            if (lshm__os_map_anon_fixed(data, s->capacity) != 0)
                break;
        }
        s->allocator.free(s->allocator.ctx, data, nbytes);
        break;
    case LSHM__ORIGIN_FOREIGN:
        if (s->release != NULL)
            s->release(s->release_ctx, data, nbytes);
        break;
    case LSHM__ORIGIN_MAPPED:
        lshm__os_unmap(s->map_base, s->map_len);
        break;
    case LSHM__ORIGIN_VIEW:
        lshm_segment_release(s->segment);
        break;
    case LSHM__ORIGIN_SLAB:
        lshm__slab_free(s);
        break;
    }
    lshm__os_close(s->fd);
    s->fd = -1;
    atomic_store_explicit(&s->data, NULL, memory_order_release);
}

/* ---- init / fini / create / release -------------------------------------------------------- */

int lshm_storage_init(void *mem, size_t nbytes, const lshm_allocator *allocator,
                      unsigned flags, lshm_storage **out) {
    int rc = lshm__check_mem(mem, out);
    if (rc != 0)
        return rc;
    if ((flags & ~KNOWN_INIT_FLAGS) != 0)
        return LSHM_FAIL(-EINVAL, "unknown storage flags 0x%x", flags & ~KNOWN_INIT_FLAGS);
    if (allocator != NULL && (allocator->alloc == NULL || allocator->free == NULL))
        return LSHM_FAIL(-EINVAL, "allocator needs both alloc and free");
    void *data;
    size_t capacity;
    lshm__slab *slab = NULL;
    /* Resizable storages get pages of their own: mremap moves whole mappings. */
    rc = alloc_bytes(allocator, nbytes, &data, &capacity,
                     (flags & LSHM_STORAGE_RESIZABLE) != 0 ? NULL : &slab);
    if (rc != 0)
        return rc;
    lshm_storage *s = mem;
    lshm__storage_prepare(s,
                          slab != NULL        ? LSHM__ORIGIN_SLAB
                          : allocator == NULL ? LSHM__ORIGIN_PAGES
                                              : LSHM__ORIGIN_ALLOCATOR,
                          flags);
    s->slab = slab;
    if (allocator != NULL)
        s->allocator = *allocator;
    atomic_store_explicit(&s->data, data, memory_order_relaxed);
    atomic_store_explicit(&s->nbytes, nbytes, memory_order_relaxed);
    s->capacity = capacity;
    if (slab != NULL)
        lshm__slab_set_owner(s);
    *out = s;
    return 0;
}

int lshm_storage_init_foreign(void *mem, void *data, size_t nbytes, lshm_release_fn release,
                              void *ctx, unsigned flags, lshm_storage **out) {
    int rc = lshm__check_mem(mem, out);
    if (rc != 0)
        return rc;
    if ((flags & ~KNOWN_INIT_FLAGS) != 0)
        return LSHM_FAIL(-EINVAL, "unknown storage flags 0x%x", flags & ~KNOWN_INIT_FLAGS);
    if (data == NULL && nbytes > 0)
        return LSHM_FAIL(-EINVAL, "NULL data for %zu foreign bytes", nbytes);
    lshm_storage *s = mem;
    lshm__storage_prepare(s, LSHM__ORIGIN_FOREIGN, flags);
    atomic_store_explicit(&s->data, nbytes > 0 ? data : NULL, memory_order_relaxed);
    atomic_store_explicit(&s->nbytes, nbytes, memory_order_relaxed);
    s->capacity = nbytes;
    s->release = release;
    s->release_ctx = ctx;
    *out = s;
    return 0;
}

/* Was the struct malloced by lshm_storage_create* (not initialised in caller memory)? */
static int on_heap(const lshm_storage *s) {
    return (atomic_load_explicit(&s->flags, memory_order_relaxed) & LSHM_STORAGE_INPLACE) == 0;
}

/* The last reference is gone: free the bytes, and the struct when it is ours. */
static void destroy(lshm_storage *s) {
    free_bytes(s);
    int r = pthread_mutex_destroy(&s->lock);
    assert(r == 0); /* EBUSY would mean a share is running on a dead storage: our bug */
    (void)r;
    if (on_heap(s))
        free(s);
}

int lshm_storage_fini(lshm_storage *s) {
    if (s == NULL)
        return 0;
    if (on_heap(s))
        return LSHM_FAIL(-EINVAL, "storage %p was created on the heap: use lshm_storage_release",
                         (void *)s);
    if (s->in_arena)
        return LSHM_FAIL(-EINVAL, "storage %p belongs to an arena: lshm_arena_free, "
                         "lshm_arena_deallocate or lshm_arena_destroy finalises it", (void *)s);
    size_t expected = 1;
    /* Only the caller's reference may be left; taking it to 0 atomically means a concurrent
     * retain cannot slip in between the check and the teardown. */
    if (!atomic_compare_exchange_strong(&s->refcount, &expected, 0))
        return expected == 0
                   ? LSHM_FAIL(-EINVAL, "storage %p was finalised already", (void *)s)
                   : LSHM_FAIL(-EBUSY, "storage %p still has %zu references", (void *)s,
                               expected);
    destroy(s);
    return 0;
}

int lshm_storage_create(size_t nbytes, const lshm_allocator *allocator, unsigned flags,
                        lshm_storage **out) {
    lshm_storage *s = NULL;
    int rc = lshm__storage_malloc(out, &s);
    if (rc != 0)
        return rc;
    return lshm__storage_heap_done(s, lshm_storage_init(s, nbytes, allocator, flags, out));
}

int lshm_storage_create_foreign(void *data, size_t nbytes, lshm_release_fn release, void *ctx,
                                unsigned flags, lshm_storage **out) {
    lshm_storage *s = NULL;
    int rc = lshm__storage_malloc(out, &s);
    if (rc != 0)
        return rc;
    return lshm__storage_heap_done(
        s, lshm_storage_init_foreign(s, data, nbytes, release, ctx, flags, out));
}

lshm_storage *lshm_storage_retain(lshm_storage *s) {
    if (s != NULL)
        lshm__ref_retain(&s->refcount);
    return s;
}

void lshm_storage_release(lshm_storage *s) {
    if (s != NULL && lshm__ref_release(&s->refcount))
        destroy(s);
}

size_t lshm_storage_refcount(const lshm_storage *s) {
    return s == NULL ? 0 : atomic_load_explicit(&s->refcount, memory_order_relaxed);
}

/* ---- accessors ----------------------------------------------------------------------------- */

void *lshm_storage_data(const lshm_storage *s) {
    return s == NULL ? NULL : atomic_load_explicit(&s->data, memory_order_acquire);
}

size_t lshm_storage_nbytes(const lshm_storage *s) {
    /* (relaxed: a size alone, which a resize may change meanwhile; it publishes nothing) */
    return s == NULL ? 0 : atomic_load_explicit(&s->nbytes, memory_order_relaxed);
}

unsigned lshm_storage_flags(const lshm_storage *s) {
    return s == NULL ? 0 : atomic_load_explicit(&s->flags, memory_order_acquire);
}

int lshm_storage_fd(lshm_storage *s, int *fd, uint64_t *offset) {
    if (s == NULL || fd == NULL || offset == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    if ((lshm_storage_flags(s) & LSHM_STORAGE_SHARED) == 0)
        return LSHM_FAIL(-ENODATA, "storage %p is not shared", (const void *)s);
    int f;
    if (s->segment != NULL) {
        int rc = lshm_segment_fd(s->segment, &f); /* adds F_SEAL_SEAL to the segment's fd */
        if (rc != 0)
            return rc == -EBADF ? LSHM_FAIL(-EBADF, "the fd of storage %p's segment was closed",
                                            (const void *)s)
                                : rc;
    } else if (s->slab_memfd != NULL) {
        /* A slab storage shared into its slab's memfd (F_SEAL_SEAL once per memfd). */
        int rc = lshm__slab_fd(s, &f);
        if (rc != 0)
            return rc;
    } else {
        /* Its own memfd (a slab storage's too, after a read-only share). */
        f = s->fd;
        if (f < 0) /* cannot happen: a shared storage that is no view has a memfd */
            return LSHM_FAIL(-EBADF, "storage %p has no fd", (const void *)s);
        /* Whoever gets the fd from now on must not be able to add seals: F_SEAL_SEAL first
         * (the exported mark says it is there already). */
        if (!atomic_load_explicit(&s->exported, memory_order_acquire)) {
            int rc = lshm__os_seal_seal(f);
            if (rc != 0)
                return rc;
        }
    }
    /* Someone else may hold this fd from now on: its memfd must never be recycled. */
    atomic_store_explicit(&s->exported, 1, memory_order_release);
    *fd = f;
    *offset = s->fd_offset;
    return 0;
}

int lshm_storage_export(lshm_storage *s, lshm_export_info *out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    int fd;
    uint64_t offset;
    int rc = lshm_storage_fd(s, &fd, &offset);
    if (rc != 0)
        return rc;
    lshm_export_info info = {fd, offset, 0, 0, LSHM_SLAB_BYTES, 0,
                             lshm_storage_flags(s), lshm_storage_data(s),
                             lshm_storage_nbytes(s)};
    if (s->origin != LSHM__ORIGIN_SLAB || !lshm__slab_identity(s, &info.dev, &info.ino)) {
        lshm__fd_info fi; /* one memfd of its own, a segment's, or a slab storage's own */
        if ((rc = lshm__os_fd_info(fd, &fi)) != 0)
            return rc;
        info.dev = fi.dev;
        info.ino = fi.ino;
        info.file_size = fi.size;
        info.readonly = fi.write_sealed;
    }
    *out = info;
    return 0;
}

lshm_segment *lshm_storage_segment(const lshm_storage *s) {
    return s == NULL ? NULL : s->segment;
}

/* ---- resize and copy ----------------------------------------------------------------------- */

/* Default pages: mremap keeps the bytes and may move (from 2 MiB on, to a 2 MiB-aligned range);
 * new pages are zero already. */
static int resize_pages(lshm_storage *s, void *data, size_t nbytes, size_t cap) {
    void *p = NULL;
    int rc = 0;
    if (cap == s->capacity)
        p = data;
    else if (cap == 0)
        lshm__os_unmap(data, s->capacity);
    else if (s->capacity == 0)
        rc = lshm__os_map_anon_pages(cap, &p);
    else
        rc = lshm__os_remap_pages(data, s->capacity, cap, &p);
    if (rc != 0)
        return rc;
    /* Bytes past the old size inside the old last page may hold what an earlier, larger size
     * left there: the contract says new bytes are zero. */
    size_t old = atomic_load_explicit(&s->nbytes, memory_order_relaxed);
    if (p != NULL && nbytes > old) {
        size_t end = nbytes < s->capacity ? nbytes : s->capacity;
        if (end > old)
            memset((char *)p + old, 0, end - old);
    }
    atomic_store_explicit(&s->data, p, memory_order_release);
    s->capacity = cap;
    return 0;
}

/* The storage whose allocator's alloc callback this thread is running, under its lock (a
 * resize): a resize or share of it from inside the callback would wait for that lock for
 * ever, so it is refused (lshm__storage_in_callback). */
static _Thread_local const lshm_storage *in_callback_of;

int lshm__storage_in_callback(const lshm_storage *s) {
    if (in_callback_of != s)
        return 0;
    return LSHM_FAIL(-EDEADLK, "storage %p is being resized and this is its allocator's callback "
                     "(it runs under the storage's lock)", (void *)s);
}

/* Caller allocator: a new block, copy, zero the tail; the old one goes to *old_block for the
 * caller to free once the locks are released. */
static int resize_allocator(lshm_storage *s, void *data, size_t nbytes, void **old_block) {
    void *p = NULL;
    size_t cap = 0;
    const lshm_storage *outer = in_callback_of;
    in_callback_of = s;
    int rc = alloc_bytes(&s->allocator, nbytes, &p, &cap, NULL);
    in_callback_of = outer;
    if (rc != 0)
        return rc;
    size_t old = atomic_load_explicit(&s->nbytes, memory_order_relaxed);
    size_t keep = nbytes < old ? nbytes : old;
    if (keep > 0)
        memcpy(p, data, keep);
    if (nbytes > keep)
        memset((char *)p + keep, 0, nbytes - keep);
    *old_block = data;
    atomic_store_explicit(&s->data, p, memory_order_release);
    s->capacity = cap;
    return 0;
}

int lshm_storage_resize(lshm_storage *s, size_t nbytes) {
    if (s == NULL)
        return LSHM_FAIL(-EINVAL, "NULL storage");
    size_t cap = 0;
    int rc = lshm__round_pages(nbytes, &cap);
    if (rc != 0)
        return rc;
    if ((rc = lshm__storage_in_callback(s)) != 0)
        return rc;
    void *old_block = NULL;
    size_t old_nbytes = 0;
    lshm__fork_guard_enter(); /* fork() waits until we are done */
    pthread_mutex_lock(&s->lock);
    unsigned flags = atomic_load(&s->flags);
    void *data = atomic_load(&s->data);
    size_t refs = atomic_load_explicit(&s->refcount, memory_order_acquire);
    if ((flags & LSHM_STORAGE_RESIZABLE) == 0)
        rc = LSHM_FAIL(-EPERM, "storage %p is not resizable", (void *)s);
    else if ((flags & LSHM_STORAGE_SHARED) != 0)
        rc = LSHM_FAIL(-EPERM, "storage %p is shared", (void *)s);
    else if (s->origin != LSHM__ORIGIN_PAGES && s->origin != LSHM__ORIGIN_ALLOCATOR)
        rc = LSHM_FAIL(-EPERM, "storage %p wraps foreign memory", (void *)s);
    else if (refs > 1)
        /* Every other reference may be an array or view over the bytes: moving or unmapping
         * them would leave it on freed memory (or someone else's). */
        rc = LSHM_FAIL(-EBUSY,
                       "storage %p is in use: %zu other references (arrays, views or "
                       "exports of its memory): resizing would free or move the memory under "
                       "them; release them first",
                       (void *)s, refs - 1);
    else if (s->origin == LSHM__ORIGIN_PAGES)
        rc = resize_pages(s, data, nbytes, cap);
    else {
        old_nbytes = atomic_load_explicit(&s->nbytes, memory_order_relaxed);
        rc = resize_allocator(s, data, nbytes, &old_block);
    }
    if (rc == 0)
        atomic_store_explicit(&s->nbytes, nbytes, memory_order_relaxed);
    pthread_mutex_unlock(&s->lock);
    lshm__fork_guard_leave();
    /* The allocator and its ctx never change (only a share changes a storage's origin, and a
     * shared storage is not resizable), so reading them after the unlock is fine. */
    if (old_block != NULL)
        s->allocator.free(s->allocator.ctx, old_block, old_nbytes);
    return rc;
}

int lshm_storage_copy(lshm_storage *dst, const lshm_storage *src) {
    if (dst == NULL || src == NULL)
        return LSHM_FAIL(-EINVAL, "NULL storage");
    if (dst == src)
        return 0;
    size_t n = lshm_storage_nbytes(dst), from = lshm_storage_nbytes(src);
    if (n != from)
        return LSHM_FAIL(-EINVAL, "sizes differ: %zu bytes into %zu", from, n);
    if ((lshm_storage_flags(dst) & LSHM_STORAGE_READONLY) != 0)
        return LSHM_FAIL(-EPERM, "destination storage %p is read-only", (void *)dst);
    if (n > 0)
        memmove(lshm_storage_data(dst), lshm_storage_data(src), n);
    return 0;
}

/* ---- storages in shared memory from the start: a slab range, or a segment of their own ---- */

int lshm_storage_create_shared(size_t nbytes, unsigned flags, lshm_storage **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    if (flags != 0)
        return LSHM_FAIL(-EINVAL, "unknown flags 0x%x for a shared storage", flags);
    if (nbytes > 0 && nbytes <= atomic_load_explicit(&lshm__slab_max_bytes,
                                                       memory_order_relaxed)) {
        /* Small: a slab storage shared at once (its range of the slab memfd). */
        lshm_storage *small = NULL;
        int rc = lshm_storage_create(nbytes, NULL, 0, &small);
        if (rc == 0 && (rc = lshm_storage_share(small)) != 0)
            lshm_storage_release(small);
        if (rc == 0)
            *out = small;
        return rc;
    }
    lshm_storage *s = NULL;
    int rc = lshm__storage_malloc(out, &s);
    if (rc != 0)
        return rc;
    lshm_segment *seg = NULL;
    rc = lshm_segment_create(nbytes, 0, &seg);
    if (rc != 0)
        return lshm__storage_heap_done(s, rc); /* frees the struct */
    rc = lshm_storage_init_view(s, seg, 0, nbytes, 0, out);
    assert(rc == 0); /* the whole of a fresh segment is always a valid view */
    lshm_segment_release(seg); /* the storage holds the segment now (or nothing does) */
    return lshm__storage_heap_done(s, rc);
}

/* ---- storages viewing a segment ------------------------------------------------------------ */

int lshm_storage_init_view(void *mem, lshm_segment *seg, uint64_t offset, size_t nbytes,
                           unsigned flags, lshm_storage **out) {
    int rc = lshm__check_mem(mem, out);
    if (rc != 0)
        return rc;
    if (seg == NULL)
        return LSHM_FAIL(-EINVAL, "NULL segment");
    if ((flags & ~LSHM_STORAGE_READONLY) != 0)
        return LSHM_FAIL(-EINVAL, "unknown view flags 0x%x", flags & ~LSHM_STORAGE_READONLY);
    size_t size = lshm_segment_size(seg);
    if (offset > size || nbytes > size - offset)
        return LSHM_FAIL(-EINVAL, "view of %zu bytes at %llu outside a %zu-byte segment", nbytes,
                         (unsigned long long)offset, size);
    lshm_storage *s = mem;
    lshm__storage_prepare(s, LSHM__ORIGIN_VIEW,
                          LSHM_STORAGE_SHARED | (flags | lshm_segment_flags(seg)));
    s->segment = lshm_segment_retain(seg);
    atomic_store_explicit(&s->nbytes, nbytes, memory_order_relaxed);
    s->capacity = nbytes;
    s->fd_offset = offset;
    atomic_store_explicit(&s->data, nbytes > 0 ? (char *)lshm_segment_data(seg) + offset : NULL,
                          memory_order_relaxed);
    *out = s;
    return 0;
}

int lshm_storage_create_view(lshm_segment *seg, uint64_t offset, size_t nbytes, unsigned flags,
                             lshm_storage **out) {
    lshm_storage *s = NULL;
    int rc = lshm__storage_malloc(out, &s);
    if (rc != 0)
        return rc;
    return lshm__storage_heap_done(s, lshm_storage_init_view(s, seg, offset, nbytes, flags, out));
}

/* ---- a storage attached to a received fd --------------------------------------------------- */

int lshm_storage_attach(int fd, uint64_t offset, size_t nbytes, unsigned flags,
                        lshm_storage **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    int own = -1;
    uint64_t size;
    int rc = lshm__attach_fd(fd, offset, nbytes, flags, &own, &size);
    if (rc != 0)
        return rc;
    (void)size;
    /* Map only the pages that hold [offset, offset + nbytes): mmap wants a page-aligned file
     * offset, so start at the page below and point data into it. */
    uint64_t map_offset = lshm__page_floor(offset);
    size_t lead = (size_t)(offset - map_offset);
    size_t map_len = 0;
    void *base = NULL;
    lshm_storage *s = NULL;
    if (nbytes > 0) {
        if (nbytes > SIZE_MAX - lead || (rc = lshm__round_pages(lead + nbytes, &map_len)) != 0) {
            rc = LSHM_FAIL(-EOVERFLOW, "%zu bytes at offset %llu cannot be mapped", nbytes,
                           (unsigned long long)offset);
            goto fail_close;
        }
        rc = lshm__os_map_fd(own, map_offset, map_len, (flags & LSHM_STORAGE_READONLY) != 0,
                             NULL, &base);
        if (rc != 0)
            goto fail_close;
    }
    if ((rc = lshm__storage_malloc(out, &s)) != 0)
        goto fail_unmap;
    lshm__storage_prepare(s, LSHM__ORIGIN_MAPPED, LSHM_STORAGE_SHARED | flags);
    atomic_store_explicit(&s->nbytes, nbytes, memory_order_relaxed);
    s->capacity = nbytes;
    s->map_base = base;
    s->map_len = map_len;
    s->fd = own;
    s->fd_offset = offset;
    atomic_store_explicit(&s->data, nbytes > 0 ? (char *)base + lead : NULL,
                          memory_order_relaxed);
    *out = s;
    return lshm__storage_heap_done(s, 0);

fail_unmap:
    lshm__os_unmap(base, map_len);
fail_close:
    lshm__os_close(own);
    return rc;
}
