/*
 * share.c -- turning a storage's memory into shared memory without changing the storage.
 *
 * lshm_storage_share follows PyTorch's share_memory_() (make a memfd of the same size, copy,
 * swap the storage's memory in place) but fixes its flaw (PyTorch #51849: views of the old
 * buffer dangle): where the storage owns whole pages, the memfd is mapped with MAP_FIXED over
 * those very pages, so the data pointer and every raw pointer into the storage keep working
 * and now see the shared memory.
 *
 * The order of steps is what makes a failure harmless: memfd_create, pwrite the bytes (which
 * sizes the file), seal against shrink/grow (big shares of other memory: memfd_create,
 * ftruncate, seal, a copy split over two threads). None of these touches the storage, so a
 * failure at any of them closes the memfd (after unmapping any temporary mapping) and leaves
 * the storage exactly as it was. Only the last mmap replaces the storage's pages.
 * (That last step is atomic only as far as the kernel makes it: since Linux 6.12 a MAP_FIXED
 * mmap that fails, e.g. at vm.max_map_count, restores the old mapping; older kernels may have
 * unmapped it already. The fault tests cover every step before it.)
 * Storages of default pages that are not resizable (>= lshm__share_chunk_threshold, 1 MiB) are
 * shared chunk by chunk instead (memfd_create, ftruncate, seal, then per chunk: pwrite that
 * range of the memfd, mmap(MAP_FIXED) it over the same range of the storage), so the old pages
 * are freed as we go and the next chunk reuses them while they are still in the CPU cache (memory
 * new to the process arrives slowly on these VMs: tools/bench_chunks.c). Adjacent chunks merge
 * into one mapping. A failure at a later chunk maps the chunks already swapped again as a private
 * (copy-on-write) mapping of the same byte-identical memfd pages: bytes, data pointer, flags and
 * refcount are unchanged, writes stay private and a fork() copies them on write, as before; a
 * release or a retry works.
 * A storage of 2 MiB or more at a 2 MiB boundary (the default allocator puts them there) takes
 * the same steps with huge pages instead (share_chunked_huge): 32 MiB chunks, each collapsed
 * into huge pages through a second, aligned mapping of the memfd, populated, filled with
 * memcpy, then mapped over the storage; the tail short of 2 MiB goes in with pwrite.
 * The copy uses pwrite rather than writing through a fresh mapping: it is the fastest way in
 * (no page faults: the ceiling rows of `python -m pyshm bench`) and it allocates every page of
 * the memfd, so there is no later SIGBUS and no need for a separate fallocate on this path.
 * The fd stays in this process (and this call) until it is sealed.
 * Writes of other threads: before the first copy the storage's pages are write-protected
 * (lshm__os_fence_begin, a userfaultfd: os_linux.c), so a write between a page's copy and its
 * remap waits in its page fault instead of landing in the page the remap drops; each chunk's
 * writers are let go once it is mapped, the rest when the share ends, and a failure lifts the
 * protection from what is still private.
 *
 * Storages in a slab (slab.c) are shared the same way, in place, but into their range of the
 * slab's one memfd (lshm__slab_share) rather than a memfd of their own, so they never use the
 * pool; lshm_storage_share_readonly gives one a memfd of its own instead (the in-place path
 * below, pool skipped), since a read-only seal would cover every storage of the slab.
 *
 * Storages that do not own whole pages (foreign memory, plain caller allocators) get a new
 * mapping at a new address; the old memory goes back through its release callback/free once
 * the locks are released. Because the memory moves, that is refused (-EBUSY) while the storage
 * has other references: an array over the old memory would silently stop aliasing it.
 *
 * Concurrency: one mutex per storage serialises shares (PyTorch #95606/#96664), so threads
 * sharing one storage at once copy it once and all return 0. A storage already shared returns
 * at once, without the lock. fork() waits for the shares in flight (fork.c). Memfds of released
 * storages come back from the pool (pool.c) when refilling one pays.
 *
 * Seals: our memfds carry F_SEAL_SHRINK|F_SEAL_GROW from the start; F_SEAL_SEAL is added when
 * the fd is first handed out (lshm_storage_fd, lshm_segment_fd), or with F_SEAL_FUTURE_WRITE by
 * seal_readonly. A pooled memfd was never handed out or sealed (both mark it exported), so it
 * has neither and can be refilled.
 */
#include "internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Does the storage own the pages at its data pointer, so the memfd can go over them? */
static int owns_whole_pages(const lshm_storage *s) {
    return s->origin == LSHM__ORIGIN_PAGES || s->origin == LSHM__ORIGIN_SLAB ||
           (s->origin == LSHM__ORIGIN_ALLOCATOR &&
            (s->allocator.flags & LSHM_ALLOCATOR_WHOLE_PAGES) != 0);
}

_Atomic size_t lshm__share_split_threshold = (size_t)64 << 20;
_Atomic unsigned long lshm__share_splits;

/* Shares running in this process right now: a big copy splits over two threads only when it is
 * alone, so concurrent shares (a ThreadPool) are not slowed down by helper threads, and a
 * chunked share picks its chunk size from it (next_chunk). */
static _Atomic int active_shares;

#ifdef LSHM_TESTING
void lshm__share_pretend_busy(int delta) {
    atomic_fetch_add_explicit(&active_shares, delta, memory_order_relaxed);
}
#endif

/* pthread_create for a share's helper thread: 0 if it runs; nonzero (do it all on this
 * thread) when it cannot be started or this process is a forked child. */
static int start_helper(pthread_t *t, void *(*fn)(void *), void *arg) {
    if (lshm__forked_child())
        return -1;
    return pthread_create(t, NULL, fn, arg);
}

/* The second half of a split copy, done by a helper thread through a temporary mapping. */
typedef struct copy_half {
    int fd;
    uint64_t offset; /* page-aligned */
    size_t len;
    const char *src; /* the bytes for [offset, offset + len) */
    int injected;    /* a fault the calling thread took on the helper's behalf (tests) */
    int rc;
    char msg[400];   /* the helper's error message (or the injected fault's) */
} copy_half;

static void *copy_half_thread(void *arg) {
    copy_half *h = arg;
    void *m = NULL;
    int rc = lshm__os_map_fd(h->fd, h->offset, h->len, 0, NULL, &m);
    if (rc == 0) {
        rc = h->injected;
        if (rc == 0)
            rc = lshm__os_populate_write(h->fd, h->offset, m, h->len);
        if (rc == 0) /* (foreign bytes may have a hole: an error, as pwrite's EFAULT is) */
            rc = lshm__os_check_mapped(h->src, h->len);
        if (rc == 0)
            memcpy(m, h->src, h->len);
        lshm__os_unmap(m, h->len);
    }
    h->rc = rc;
    if (rc != 0 && h->injected == 0)
        snprintf(h->msg, sizeof h->msg, "%s", lshm_last_error());
    return NULL;
}

/* Fill [0, size) of fd (already `size` bytes long) from data with two threads: this one
 * pwrites the first half while a helper populates and memcpys the second half through a
 * mapping (two pwrites into one memfd do not scale, they take the inode lock in turn; this mix
 * does: the "one 1 GiB array" row of `python -m pyshm bench`).
 * When no thread can be started, one pwrite does it all. */
static int split_fill(int fd, const void *data, size_t size) {
    size_t first = (size_t)lshm__page_floor(size / 2);
    copy_half h = {fd, first, size - first, (const char *)data + first, 0, 0, {0}};
    /* The helper's fault point is taken here: fault injection is per thread. */
    h.injected = lshm__os_fault_point("copy_thread");
    if (h.injected != 0)
        snprintf(h.msg, sizeof h.msg, "%s", lshm_last_error());
    pthread_t t;
    if (start_helper(&t, copy_half_thread, &h) != 0)
        return lshm__os_pwrite_all(fd, data, size, 0);
    int rc = lshm__os_pwrite_all(fd, data, first, 0);
    pthread_join(t, NULL);
    if (rc != 0)
        return rc;
    if (h.rc != 0)
        return LSHM_FAIL(h.rc, "copy thread: %s", h.msg);
    atomic_fetch_add_explicit(&lshm__share_splits, 1, memory_order_relaxed);
    return 0;
}

static int want_split(size_t size) {
    return size >= atomic_load_explicit(&lshm__share_split_threshold, memory_order_relaxed) &&
           atomic_load_explicit(&active_shares, memory_order_relaxed) == 1 &&
           lshm__os_ncpu() >= 2;
}

/* A memfd of `size` bytes holding the `size` bytes at `data`, sealed against shrink and grow
 * before anyone else can see it, every page allocated (no SIGBUS later).
 * Small and medium sizes: memfd_create, pwrite (which extends the file to exactly `size` and
 * allocates every page), then seal: three syscalls, no ftruncate. Big sizes with the process
 * otherwise idle: ftruncate, seal, then split_fill over two threads. */
static int make_filled_memfd(const void *data, size_t size, int *out) {
    int fd;
    int rc;
    if (size > 0 && want_split(size)) {
        if ((rc = lshm__os_memfd_sized(size, &fd)) != 0)
            return rc;
        rc = split_fill(fd, data, size);
    } else {
        if ((rc = lshm__os_memfd_create(size, &fd)) != 0)
            return rc;
        if (size == 0 || (rc = lshm__os_pwrite_all(fd, data, size, 0)) == 0)
            rc = lshm__os_seal_size(fd);
    }
    if (rc != 0) {
        lshm__os_close(fd);
        return rc;
    }
    *out = fd;
    return 0;
}

/* ---- chunked in-place share (storages of default pages) ------------------------------------ */

_Atomic size_t lshm__share_chunk_threshold = (size_t)1 << 20;
_Atomic size_t lshm__share_chunk_bytes = (size_t)256 << 10;
_Atomic size_t lshm__share_chunk_busy_bytes = (size_t)4 << 20;
_Atomic unsigned long lshm__share_restores;
#ifdef LSHM_TESTING
void (*lshm__share_after_chunk)(size_t swapped);
#endif

static int want_chunks(const lshm_storage *s) {
    /* Not for resizable storages: after a failed chunked share their range would be several
     * mappings, which mremap (resize) cannot move. */
    return s->origin == LSHM__ORIGIN_PAGES && s->capacity > 0 &&
           (atomic_load_explicit(&s->flags, memory_order_relaxed) & LSHM_STORAGE_RESIZABLE) == 0 &&
           s->capacity >= atomic_load_explicit(&lshm__share_chunk_threshold, memory_order_relaxed);
}

/* The next chunk's size: small while this is the only share running (each chunk is filled from
 * pages the previous chunk's mmap just freed, still in the CPU cache), bigger while other shares
 * run (every mmap then also interrupts the other CPUs running this process to flush their TLBs,
 * which costs more than the cache saves). Whole pages, at least one. */
static size_t next_chunk(size_t page) {
    size_t chunk = atomic_load_explicit(&active_shares, memory_order_relaxed) > 1
                       ? atomic_load_explicit(&lshm__share_chunk_busy_bytes, memory_order_relaxed)
                       : atomic_load_explicit(&lshm__share_chunk_bytes, memory_order_relaxed);
    return chunk < page ? page : (size_t)lshm__page_floor(chunk);
}

/* A chunked share under way: its memfd, the storage's pages, its fence, and a spare mapping
 * (a page of the memfd, a mapping of its own that no neighbour merges with) held from the
 * start: the first chunk's mmap splits the storage's mapping in two, so at vm.max_map_count
 * the next chunk fails, and so would the restore of the first (an mmap too) if the spare did
 * not give its place back first. */
typedef struct chunked {
    int fd;
    char *data;
    lshm__fence *fence;
    void *spare;
} chunked;

/* Start a chunked share into the new memfd fd (sized already, whole pages): take the spare
 * mapping. Fails (fd closed; the caller lifts the fence) when not even that can be mapped. */
static int chunks_begin(chunked *c, int fd, char *data, lshm__fence *fence) {
    *c = (chunked){fd, data, fence, NULL};
    int rc = lshm__os_map_fd(fd, 0, lshm__os_page_size(), 1, NULL, &c->spare);
    if (rc != 0)
        lshm__os_close(fd);
    return rc;
}

/* The end of a chunked share that swapped [data, data + swapped) of `capacity` bytes and
 * returned rc: the spare goes; on failure map the swapped chunks back privately (the memfd
 * pages hold the very bytes), free the memfd's pages that no chunk maps (prepared ahead, or
 * half-filled), lift the fence from the rest and close fd. */
static int chunks_done(chunked *c, size_t swapped, size_t capacity, int rc) {
    lshm__os_unmap(c->spare, lshm__os_page_size());
    if (rc != 0) {
        /* (the spare made room for it: what could still fail is the kernel's own allocation
         * of the mapping, under a memory cgroup at its limit) */
        if (swapped > 0 && lshm__os_map_fd_private_fixed(c->fd, 0, swapped, c->data) == 0)
            atomic_fetch_add_explicit(&lshm__share_restores, 1, memory_order_relaxed);
        (void)lshm__os_punch_hole(c->fd, swapped, capacity - swapped);
#ifdef LSHM_TESTING
        struct stat st;
        atomic_store_explicit(&lshm__share_failed_memfd_bytes,
                              fstat(c->fd, &st) == 0 ? (long long)st.st_blocks * 512 : -1,
                              memory_order_relaxed);
#endif
        lshm__os_fence_lift(c->fence, c->data + swapped);
        lshm__os_close(c->fd);
    }
    return rc;
}

/* share_chunked's steps over [*off, end) (whole pages but maybe the storage's last): pwrite
 * each chunk, map it over the storage and let the writers that waited for it go on. *off: how
 * far it got. */
static int pwrite_chunks(int fd, char *data, size_t *off, size_t end, const lshm__fence *fence) {
    size_t page = lshm__os_page_size();
    int rc = 0;
    /* fd was sized by this share (lshm__os_memfd_sized: its ftruncate checked RLIMIT_FSIZE),
     * so no getrlimit per chunk; a limit another thread lowers meanwhile must still be -EFBIG
     * and not the kernel's SIGXFSZ, which killed the process: held back over the chunks. */
    sigset_t mask;
    lshm__os_file_size_signal_hold(&mask);
    while (*off < end) {
        size_t chunk = next_chunk(page);
        size_t n = end - *off < chunk ? end - *off : chunk;
        void *m;
        if ((rc = lshm__os_pwrite_inside(fd, data + *off, n, *off)) != 0 ||
            (rc = lshm__os_map_fd(fd, *off, n, 0, data + *off, &m)) != 0)
            break;
        lshm__os_fence_wake(fence, data + *off, n);
        *off += n;
#ifdef LSHM_TESTING
        if (lshm__share_after_chunk != NULL)
            lshm__share_after_chunk(*off);
#endif
    }
    lshm__os_file_size_signal_release(&mask, rc);
    return rc;
}

/* Share the default pages [data, data + capacity) in place chunk by chunk: fill a chunk of the
 * memfd with pwrite, then mmap(MAP_FIXED) that chunk of the memfd over the same chunk of the
 * storage. The old private pages go back to the kernel as we go and the next chunk's pwrite
 * allocates them again while they are still cached (memory new to the process arrives slowly
 * on these VMs; for 1 GiB on one thread, 0.52 s against 0.59 s for one pwrite: the chunk 256 KiB
 * and whole rows of `bench_chunks 1 1073741824 1 3 256`, tools/bench_chunks.c), and the extra
 * memory in use at any time is one chunk. Adjacent chunks merge into one mapping.
 * On failure the chunks already swapped are mapped again, privately (MAP_PRIVATE of the same
 * memfd pages, which hold the very bytes): copy-on-write across fork() and writes that stay in
 * this process, as before the call. Closing the memfd leaves those mappings alive.
 * fd: a new memfd of `capacity` bytes (lshm__os_memfd_sized), closed on failure. */
static int share_chunked(lshm_storage *s, chunked *c) {
    size_t off = 0;
    int rc = pwrite_chunks(c->fd, c->data, &off, s->capacity, c->fence);
    return chunks_done(c, off, s->capacity, rc);
}

/* Huge pages for the chunked share: a storage of 2 MiB or more whose pages start at a 2 MiB
 * boundary (the default allocator puts them there, see lshm__os_map_anon_pages). */
_Atomic size_t lshm__share_huge_chunk_bytes = (size_t)32 << 20;
_Atomic unsigned long lshm__share_huge_chunks;

static int want_huge(const lshm_storage *s, const char *data) {
    return s->capacity >= LSHM__HUGE_BYTES && (uintptr_t)data % LSHM__HUGE_BYTES == 0 &&
           lshm__os_collapse_wanted();
}

/* Preparing chunks (collapse, populate) ahead of the copy, on a helper thread, while a big
 * share runs alone: the kernel's zero-filling of the next chunk's huge pages then overlaps the
 * memcpy of this one. `ready` is how far the helper got, `done` how far the copy got: the
 * helper stays at most two chunks ahead (memory in use beyond the storage's: three chunks, and
 * the pages it gets are the ones the copy just freed). It stops at the first error (rc) or
 * when told to (stop). */
typedef struct huge_ahead {
    int fd;
    char *copy;
    size_t whole, chunk;
    pthread_mutex_t lock;
    pthread_cond_t moved;
    size_t ready, done;
    int rc, stop;
    char msg[400];
} huge_ahead;

#ifdef LSHM_TESTING
_Atomic int lshm__share_helper_fails_at;
_Atomic long long lshm__share_failed_memfd_bytes;
#endif

/* Collapse (unless the process was refused for good) and populate [off, off + n) of the memfd
 * through the copy mapping: afterwards every page of it is there, huge where the kernel gave
 * one. */
static int prepare_chunk(huge_ahead *h, size_t off, size_t n) {
    (void)lshm__os_collapse(h->fd, off, h->copy + off, n); /* (refused: small pages) */
    return lshm__os_populate_write(h->fd, off, h->copy + off, n);
}

static void *huge_ahead_thread(void *arg) {
    huge_ahead *h = arg;
    for (size_t off = 0; off < h->whole;) {
        pthread_mutex_lock(&h->lock);
        while (!h->stop && off >= h->done + 2 * h->chunk)
            pthread_cond_wait(&h->moved, &h->lock);
        int stop = h->stop;
        pthread_mutex_unlock(&h->lock);
        if (stop)
            break;
        size_t n = h->whole - off < h->chunk ? h->whole - off : h->chunk;
        int rc = prepare_chunk(h, off, n);
#ifdef LSHM_TESTING
        /* (the helper's own failure path: fault points are per thread, see the caller) */
        int fails_at = atomic_load_explicit(&lshm__share_helper_fails_at, memory_order_relaxed);
        if (rc == 0 && fails_at > 0 && off / h->chunk + 1 == (size_t)fails_at)
            rc = LSHM_FAIL(-ENOMEM, "helper: injected fault at chunk %d", fails_at);
#endif
        pthread_mutex_lock(&h->lock);
        if (rc != 0) {
            h->rc = rc;
            snprintf(h->msg, sizeof h->msg, "%s", lshm_last_error());
        } else {
            h->ready = off + n;
        }
        pthread_cond_broadcast(&h->moved);
        pthread_mutex_unlock(&h->lock);
        if (rc != 0)
            break;
        off += n;
    }
    return NULL;
}

/* Wait until the helper prepared [0, end), or failed (its error, as this thread's). */
static int wait_ready(huge_ahead *h, size_t end) {
    pthread_mutex_lock(&h->lock);
    while (h->ready < end && h->rc == 0)
        pthread_cond_wait(&h->moved, &h->lock);
    int rc = h->ready >= end ? 0 : h->rc;
    pthread_mutex_unlock(&h->lock);
    return rc == 0 ? 0 : LSHM_FAIL(rc, "preparing huge pages: %s", h->msg);
}

/* Tell the helper where the copy got (or to stop), under its lock. */
static void tell_helper(huge_ahead *h, size_t done, int stop) {
    pthread_mutex_lock(&h->lock);
    h->done = done;
    h->stop = stop;
    pthread_cond_broadcast(&h->moved);
    pthread_mutex_unlock(&h->lock);
}

/* share_chunked with huge pages for every whole 2 MiB of the storage: the memfd is also mapped
 * at a 2 MiB-aligned address of its own, and per chunk (a multiple of 2 MiB) that range of it
 * is collapsed into huge pages (lshm__os_collapse), populated (so that a page the kernel cannot
 * give is an error, never a SIGBUS in the copy), filled with memcpy and mapped over the same
 * range of the storage. Pages the collapse refused are small ones, filled the same way; once
 * it is refused for good (THP disabled: the first chunk tells) the rest goes as in
 * share_chunked, which fills fresh small pages faster. So does the tail short of 2 MiB. No
 * room for the second mapping (ENOMEM: address space, vm.max_map_count) shares with small
 * pages instead (share_chunked). Failure: as share_chunked. */
static int share_chunked_huge(lshm_storage *s, chunked *c) {
    const size_t huge = LSHM__HUGE_BYTES;
    size_t cap = s->capacity, whole = cap / huge * huge;
    int fd = c->fd;
    char *data = c->data, *copy = NULL;
    lshm__fence *fence = c->fence;
    int rc = lshm__os_map_fd_aligned(fd, whole, 0, (void **)&copy);
    if (rc == -ENOMEM)
        return share_chunked(s, c);
    if (rc != 0)
        return chunks_done(c, 0, cap, rc);
    size_t chunk = atomic_load_explicit(&lshm__share_huge_chunk_bytes, memory_order_relaxed);
    chunk = chunk < huge ? huge : chunk / huge * huge;
    huge_ahead h = {fd, copy, whole, chunk, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                    0, 0, 0, 0, {0}};
    pthread_t helper;
    int ahead = whole > chunk && want_split(whole) &&
                start_helper(&helper, huge_ahead_thread, &h) == 0;
    if (ahead) /* (counted with the split copies: two threads at work) */
        atomic_fetch_add_explicit(&lshm__share_splits, 1, memory_order_relaxed);
    size_t off = 0;
    void *m;
    while (off < whole) {
        size_t n = whole - off < chunk ? whole - off : chunk;
        if (!ahead)
            rc = prepare_chunk(&h, off, n);
        else if ((rc = lshm__os_fault_point("populate")) == 0) /* (the helper's, taken here:
                                                                 * faults are per thread) */
            rc = wait_ready(&h, off + n);
        if (rc != 0)
            break;
        memcpy(copy + off, data + off, n);
        atomic_fetch_add_explicit(&lshm__share_huge_chunks, 1, memory_order_relaxed);
        if ((rc = lshm__os_map_fd(fd, off, n, 0, data + off, &m)) != 0)
            break;
        lshm__os_fence_wake(fence, data + off, n);
        off += n;
        if (!lshm__os_collapse_wanted())
            break; /* refused for good (the first chunk tells): the rest as share_chunked */
        if (ahead)
            tell_helper(&h, off, 0);
    }
    if (ahead) {
        tell_helper(&h, off, 1);
        pthread_join(helper, NULL); /* (before the copy mapping it writes through goes) */
    }
    lshm__os_unmap(copy, whole);
    if (rc == 0)
        rc = pwrite_chunks(fd, data, &off, cap, fence);
    return chunks_done(c, off, cap, rc);
}

/* Refilling a pooled memfd beats a fresh share only below the chunk threshold (it saves the
 * memfd's syscalls) and for big shares the process makes alone (the refill is split over two
 * threads). In between, a fresh chunked share is faster: its new pages are the old ones, still
 * cached, while a pooled memfd's pages are cold (64 x 39 MB from one thread on a 2-CPU VM:
 * 0.66 s fresh, the pyshm row of `python -m pyshm bench --cases seed --threads 1`; 0.77 s for
 * the refill's kernel calls alone, the refill row of `bench_chunks 64 39321600 1 1 256 refill`,
 * tools/bench_chunks.c). */
static int pool_pays(size_t capacity) {
    if (capacity < atomic_load_explicit(&lshm__share_chunk_threshold, memory_order_relaxed))
        return 1;
    return want_split(capacity);
}

/* Overwrite every byte of a pooled memfd of `size` bytes; closes it on failure. */
static int refill_memfd(int fd, const void *data, size_t size) {
    int rc = want_split(size) ? split_fill(fd, data, size)
                              : lshm__os_pwrite_all(fd, data, size, 0);
    if (rc != 0)
        lshm__os_close(fd);
    return rc;
}

/* The memory of a storage that moves when shared (it does not own whole pages: foreign memory,
 * pyshm.copy(shared=True) of an array) of 2 MiB or more: a new memfd mapped at a 2 MiB
 * boundary with its whole 2 MiB ranges in huge pages (lshm__os_map_new_memfd, as storages
 * created shared: the rest reserved, so no SIGBUS), then the bytes written with pwrite, on two
 * threads where a split copy pays (source bytes not mapped are EFAULT, never a crash: pwrite
 * says so, and the helper's memcpy is checked first; unreadable mapped pages would still
 * crash, as any read of them). On failure nothing is left (fd closed, mapping gone). */
static int moved_into_huge_pages(const void *data, size_t nbytes, size_t map_len, int *fd_out,
                                 void **mapped_out) {
    int fd;
    void *mapped = NULL;
    int rc = lshm__os_memfd_sized(nbytes, &fd);
    if (rc != 0)
        return rc;
    if ((rc = lshm__os_map_new_memfd(fd, nbytes, map_len, &mapped)) != 0) {
        lshm__os_close(fd);
        return rc;
    }
    rc = want_split(nbytes) ? split_fill(fd, data, nbytes)
                            : lshm__os_pwrite_all(fd, data, nbytes, 0);
    if (rc != 0) {
        lshm__os_unmap(mapped, map_len);
        lshm__os_close(fd);
        return rc;
    }
    *fd_out = fd;
    *mapped_out = mapped;
    return 0;
}

/* Memory a share swapped out, given back once the locks are released (its callbacks may take
 * their time, or take locks of their own, e.g. a Python callback the GIL, which a thread that
 * forks holds while it waits for the shares in flight). */
typedef struct old_memory {
    enum lshm__origin origin; /* ALLOCATOR or FOREIGN; PAGES: nothing to give back */
    void *data;
    size_t nbytes;
    lshm_allocator allocator;
    lshm_release_fn release;
    void *release_ctx;
} old_memory;

static void give_back(const old_memory *old) {
    if (old->origin == LSHM__ORIGIN_ALLOCATOR && old->data != NULL)
        old->allocator.free(old->allocator.ctx, old->data, old->nbytes);
    else if (old->origin == LSHM__ORIGIN_FOREIGN && old->release != NULL)
        old->release(old->release_ctx, old->data, old->nbytes);
}

/* Called with s->lock held on a storage that is not shared. Memory to give back after the
 * locks go is left in *old. `own_memfd`: a slab storage gets a memfd of its own instead of a
 * range of its slab's (to be sealed read-only alone). `fenced`: memory shared in place only
 * under the write fence (-EOPNOTSUPP where it cannot be set up). */
static int share_locked(lshm_storage *s, int own_memfd, int fenced, old_memory *old) {
    void *data = atomic_load_explicit(&s->data, memory_order_relaxed);
    int fd = -1;
    void *mapped = NULL;
    int rc;
    /* Memory shared in place: no other thread's write may land in a page the remap drops. */
    lshm__fence fence = {NULL, 0, -1, 0};
    if (owns_whole_pages(s) &&
        (rc = lshm__os_fence_begin(data, s->capacity, fenced,
                                   s->origin == LSHM__ORIGIN_SLAB ? lshm__slab_fence_generation(s)
                                                                  : NULL,
                                   &fence)) != 0)
        return rc;

    if (s->origin == LSHM__ORIGIN_SLAB && !own_memfd) {
        /* The fork handlers are in place: registered at load, and by share()'s
         * lshm__fork_guard_enter before it got here. */
        if ((rc = lshm__slab_share(s)) != 0) {
            lshm__os_fence_lift(&fence, data);
            return rc;
        }
    } else if (owns_whole_pages(s)) {
        /* Copy whole pages: the tail of the last page goes along, so a raw pointer sees the
         * same bytes anywhere in the range it owns. */
        /* The epoch is read before any memfd exists: a fork from here on makes it stale,
         * and the memfd is then never pooled on release. */
        unsigned long epoch = lshm__pool_epoch();
        fd = s->origin == LSHM__ORIGIN_PAGES && s->capacity > 0 && pool_pays(s->capacity)
                 ? lshm__pool_take(s->capacity)
                 : -1;
        int swapped = 0;
        if (fd >= 0) { /* sized, sealed, populated: only the bytes to write (all of them) */
            rc = refill_memfd(fd, data, s->capacity);
        } else if (want_chunks(s)) {
            /* (on failure the chunked paths have closed fd) */
            chunked c;
            if ((rc = lshm__os_memfd_sized(s->capacity, &fd)) == 0 &&
                (rc = chunks_begin(&c, fd, data, &fence)) == 0)
                rc = want_huge(s, data) ? share_chunked_huge(s, &c) : share_chunked(s, &c);
            swapped = 1;
        } else {
            rc = make_filled_memfd(data, s->capacity, &fd);
        }
        if (rc != 0) {
            lshm__os_fence_lift(&fence, data); /* (the chunked paths lifted it already) */
            return rc;
        }
        s->fork_epoch = epoch;
        if (s->capacity > 0 && !swapped) {
            rc = lshm__os_map_fd(fd, 0, s->capacity, 0, data, &mapped);
            if (rc != 0) {
                lshm__os_fence_lift(&fence, data);
                lshm__os_close(fd);
                return rc;
            }
        }
        s->fd = fd;
        s->fd_offset = 0;
    } else {
        /* The memory moves to a new address: whoever holds a pointer into the old memory
         * (every reference beyond the caller's may be an array over it) would silently stop
         * aliasing the storage, and the old memory is given back. Refuse while they exist. */
        size_t refs = atomic_load_explicit(&s->refcount, memory_order_acquire);
        if (refs > 1)
            return LSHM_FAIL(-EBUSY,
                             "storage %p's memory is not whole pages it owns: sharing would move "
                             "it under its %zu other references; copy it into a shared storage "
                             "instead",
                             (void *)s, refs - 1);
        size_t map_len, nbytes = atomic_load_explicit(&s->nbytes, memory_order_relaxed);
        rc = lshm__round_pages(nbytes, &map_len);
        assert(rc == 0); /* nbytes of existing memory always rounds */
        if (map_len >= LSHM__HUGE_BYTES && lshm__os_collapse_wanted()) {
            rc = moved_into_huge_pages(data, nbytes, map_len, &fd, &mapped);
        } else if ((rc = make_filled_memfd(data, nbytes, &fd)) == 0 && nbytes > 0 &&
                   (rc = lshm__os_map_fd(fd, 0, map_len, 0, NULL, &mapped)) != 0) {
            lshm__os_close(fd);
        }
        if (rc != 0)
            return rc;
        /* Swap first; the caller gives the old memory back: nothing can fail from here on. */
        *old = (old_memory){(enum lshm__origin)s->origin, data, nbytes, s->allocator,
                            s->release, s->release_ctx};
        assert(old->origin == LSHM__ORIGIN_ALLOCATOR || old->origin == LSHM__ORIGIN_FOREIGN);
        s->origin = LSHM__ORIGIN_MAPPED;
        s->map_base = mapped;
        s->map_len = nbytes > 0 ? map_len : 0;
        s->fd = fd;
        s->fd_offset = 0;
        s->release = NULL;
        atomic_store_explicit(&s->data, mapped, memory_order_release);
    }
    lshm__os_fence_end(&fence); /* (the writers that waited write into the shared pages) */
    /* Publish last: a thread that sees SHARED without the lock also sees fd and data. */
    unsigned flags = atomic_load_explicit(&s->flags, memory_order_relaxed);
    atomic_store_explicit(&s->flags, (flags | LSHM_STORAGE_SHARED) & ~LSHM_STORAGE_RESIZABLE,
                          memory_order_release);
    return 0;
}

static int share(lshm_storage *s, int own_memfd, int fenced) {
    if (s == NULL)
        return LSHM_FAIL(-EINVAL, "NULL storage");
    if ((atomic_load_explicit(&s->flags, memory_order_acquire) & LSHM_STORAGE_SHARED) != 0)
        return 0;
    int refused = lshm__storage_in_callback(s);
    if (refused != 0)
        return refused;
    old_memory old = {LSHM__ORIGIN_PAGES, NULL, 0, {0}, NULL, NULL};
    lshm__fork_guard_enter(); /* fork() waits until we are done */
    pthread_mutex_lock(&s->lock);
    int rc = 0;
    /* Another thread may have shared it while we waited for the lock. */
    if ((atomic_load_explicit(&s->flags, memory_order_acquire) & LSHM_STORAGE_SHARED) == 0) {
        atomic_fetch_add_explicit(&active_shares, 1, memory_order_relaxed);
        rc = share_locked(s, own_memfd, fenced, &old);
        atomic_fetch_sub_explicit(&active_shares, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&s->lock);
    lshm__fork_guard_leave();
    give_back(&old);
    return rc;
}

int lshm_storage_share(lshm_storage *s) {
    return share(s, 0, 0);
}

int lshm_storage_share_fenced(lshm_storage *s) {
    return share(s, 0, 1);
}

int lshm_storage_seal_readonly(lshm_storage *s) {
    if (s == NULL)
        return LSHM_FAIL(-EINVAL, "NULL storage");
    if ((atomic_load_explicit(&s->flags, memory_order_acquire) & LSHM_STORAGE_SHARED) == 0)
        return LSHM_FAIL(-ENODATA, "the storage is not shared: share it before sealing");
    /* A view seals its whole segment: every storage on it becomes read-only for receivers. */
    if (s->segment != NULL)
        return lshm_segment_seal_readonly(s->segment);
    if (s->origin == LSHM__ORIGIN_SLAB && s->fd < 0)
        return LSHM_FAIL(-EINVAL,
                         "the storage shares its slab's memfd with other storages: sealing it "
                         "would make them read-only too (lshm_storage_share_readonly before "
                         "the first share gives it a memfd of its own)");
    if (s->fd < 0)
        return LSHM_FAIL(-EBADF, "the storage has no fd to seal");
    /* The storage owns this memfd alone (shared in place, or attached), whatever its size. */
    int rc = lshm__os_seal_readonly(s->fd);
    if (rc != 0)
        return rc == -EPERM ? LSHM_FAIL(-EPERM,
                                        "storage %p: its fd was already handed out writable "
                                        "(lshm_storage_fd); make a copy to share read-only",
                                        (void *)s)
                            : rc;
    /* A write-sealed memfd can never be refilled: keep it out of the pool. Marked only once
     * sealed, so a refusal changes nothing. The caller's reference keeps the storage alive
     * meanwhile, so no release can pool the memfd in between. */
    atomic_store_explicit(&s->exported, 1, memory_order_release);
    return 0;
}

int lshm_storage_share_readonly(lshm_storage *s) {
    if (s == NULL)
        return LSHM_FAIL(-EINVAL, "NULL storage");
    int rc = share(s, 1, 0);
    return rc != 0 ? rc : lshm_storage_seal_readonly(s);
}
