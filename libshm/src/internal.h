/*
 * internal.h -- declarations shared between the .c files of libshm; never installed.
 *
 * Cross-file internals use the lshm__ prefix (two underscores) and are hidden from the shared
 * library's symbol table by -fvisibility=hidden; only LSHM_API declarations in lshm.h export.
 */
#ifndef LSHM_INTERNAL_H
#define LSHM_INTERNAL_H

#include "lshm.h"

#include <signal.h>
#include <stdarg.h>
#include <stddef.h>

/* Defined when built with ThreadSanitizer (-fsanitize=thread: GCC says __SANITIZE_THREAD__,
 * clang __has_feature), for the few places that tell it about synchronisation it cannot see
 * (fork.c). */
#if defined(__SANITIZE_THREAD__)
#define LSHM__TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LSHM__TSAN 1
#endif
#endif

/* ---- errors (error.c) ---------------------------------------------------------------------- */

/* Record "file:line: message" as the calling thread's last error and return `err` (a negative
 * errno), so error paths read `return LSHM_FAIL(-EINVAL, "nbytes %zu too large", n);`. */
int lshm__fail(int err, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define LSHM_FAIL(err, ...) lshm__fail((err), __FILE__, __LINE__, __VA_ARGS__)

/* ---- fault injection (tests only) ---------------------------------------------------------- */

#ifdef LSHM_TESTING
/* Fail the n-th (1-based) fault point reached from now on in this thread with `err`; 0 disarms.
 * lshm__fault_points_hit() says how many fault points were passed since the last arm, so a test
 * can loop over every point of an operation. */
void lshm__fault_arm(int nth, int err);
int lshm__fault_points_hit(void);
int lshm__fault_check(const char *site);
/* Count `delta` more (or fewer) shares as running, so one thread sees the busy chunk size. */
void lshm__share_pretend_busy(int delta);
#define LSHM_FAULT(site) lshm__fault_check(site)
#else
#define LSHM_FAULT(site) 0
#endif

/* ---- OS layer (os_linux.c): the only file that makes memory and fd syscalls ---------------- */
/* Each wrapper returns 0 or a negative errno and has already recorded the message (with the
 * syscall's name and sizes) through LSHM_FAIL, so callers just propagate the code. Each one
 * that can fail passes an LSHM_FAULT point first. */

#include <stdint.h>

size_t lshm__os_page_size(void);
/* Round up to whole pages, -EOVERFLOW (with message) if it wraps. */
int lshm__round_pages(size_t nbytes, size_t *out);
/* x (a file offset, length or address) rounded down to a whole number of pages. */
uint64_t lshm__page_floor(uint64_t x);
/* Whether x (a file offset, length or address) is a whole number of pages. */
int lshm__page_aligned(uint64_t x);
/* memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING) for a memfd that will hold `nbytes`: -ENOMEM
 * at once when that is more than this machine's RAM and swap, or than its memory cgroup lets
 * the process hold (its pages would end in an OOM killer, not in an error). */
int lshm__os_memfd_create(size_t nbytes, int *fd);
int lshm__os_ftruncate(int fd, uint64_t size);
/* memfd_create, ftruncate to `size`, seal_size: a new memfd of `size` bytes no holder can
 * resize (its pages not allocated yet); closed again on failure. */
int lshm__os_memfd_sized(uint64_t size, int *fd);
/* Add F_SEAL_SHRINK | F_SEAL_GROW (the size can never change again, so no SIGBUS from a peer). */
int lshm__os_seal_size(int fd);
/* Make fd read-only for everyone who maps it from now on: add F_SEAL_FUTURE_WRITE (no new
 * writable mappings, no write(2)) and F_SEAL_SEAL (no holder can change the seals again).
 * Idempotent: 0 when a write seal is there already. -EPERM (with a message that says to make a
 * copy) when F_SEAL_SEAL is set without a write seal: the fd was handed out writable. */
int lshm__os_seal_readonly(int fd);
/* Add F_SEAL_SEAL, so no holder of fd can add seals (e.g. F_SEAL_FUTURE_WRITE, which would
 * turn every later receiver's mapping read-only) once it is handed out writable. 0 when it is
 * set already or fd is open read-only (whose holders cannot add seals anyway). */
int lshm__os_seal_seal(int fd);
/* pwrite all n bytes, looping on short writes and EINTR; -EFBIG (no SIGXFSZ) past
 * RLIMIT_FSIZE. */
int lshm__os_pwrite_all(int fd, const void *buf, size_t n, uint64_t offset);
/* lshm__os_pwrite_all inside a memfd sized already (lshm__os_ftruncate checked the limit
 * then), without reading RLIMIT_FSIZE first: that syscall would add 0.45 us to a 9 us slab
 * share, and one per chunk to a chunked share. Only a program that lowers its limit below the
 * memfd's size afterwards gets the kernel's SIGXFSZ there, as it does for its own files, unless
 * the caller holds it back (lshm__os_file_size_signal_hold: a chunked share does). */
int lshm__os_pwrite_inside(int fd, const void *buf, size_t n, uint64_t offset);
/* SIGXFSZ held back in this thread (pthread_sigmask; *old: the mask before) around writes
 * into a memfd sized already, so that a limit another thread lowers meanwhile is -EFBIG from
 * the write and not the kernel's signal, which kills a C program. Release gives the mask
 * back; after -EFBIG (rc) it first takes the SIGXFSZ the write raised, unless the thread held
 * SIGXFSZ back itself before (then what is pending stays, as it chose). Two syscalls: for a
 * chunked share, once per share. */
void lshm__os_file_size_signal_hold(sigset_t *old);
void lshm__os_file_size_signal_release(const sigset_t *old, int rc);
/* Reserve the pages of [0, size) (fallocate), so exhaustion is an error here and not a SIGBUS
 * later; a file system without fallocate (EOPNOTSUPP) is accepted as is. */
int lshm__os_reserve(int fd, uint64_t size);
/* Best effort: allocate [offset, offset + len) of fd's pages now, in one call, ignoring every
 * error (a later write of those pages reports the real one). An optimisation only. */
void lshm__os_allocate_ahead(int fd, uint64_t offset, uint64_t len);
/* Allocate every page of the mapping [addr, addr + len) of fd at `offset` (MADV_POPULATE_WRITE;
 * fallocate of the range on kernels without it), so a copy into it cannot SIGBUS. */
int lshm__os_populate_write(int fd, uint64_t offset, void *addr, size_t len);
/* 0 if every page of [p, p + len) is mapped (mincore); -EFAULT if one is not, where a memcpy
 * from it would crash. Mapped but unreadable pages (PROT_NONE) pass: that a read would still
 * crash on. About 0.6 ms per GiB of touched small pages on a 2-CPU VM (`bench_pages mincore`,
 * tools/bench_pages.c). */
int lshm__os_check_mapped(const void *p, size_t len);
/* A bare fault point named `site`: 0, or the injected error with its message (tests only).
 * Lets a thread take the fault points of work it hands to another thread. */
int lshm__os_fault_point(const char *site);
/* The memory this process may use: physical memory, or its memory cgroup's limit where that is
 * less (each read once; 0 when unknown). */
uint64_t lshm__os_memory_bytes(void);
/* Online CPUs (sysconf, cached; at least 1). */
unsigned lshm__os_ncpu(void);
/* mmap(MAP_SHARED) len bytes of fd at a page-aligned offset, PROT_READ (readonly) or
 * PROT_READ|PROT_WRITE; at `fixed` with MAP_FIXED when it is not NULL. */
int lshm__os_map_fd(int fd, uint64_t offset, size_t len, int readonly, void *fixed, void **out);
/* [offset, offset + len) of fd mapped MAP_PRIVATE (copy-on-write) and writable over
 * [addr, addr + len) (MAP_FIXED). Returns 0 or -errno and leaves lshm_last_error alone. */
int lshm__os_map_fd_private_fixed(int fd, uint64_t offset, size_t len, void *addr);
/* The write fence of an in-place share (os_linux.c): [base, base + len) of private pages
 * write-protected through the process's userfaultfd while they are copied and remapped, so a
 * concurrent write waits instead of landing in a page the remap drops. len 0: no fence. */
typedef struct lshm__fence {
    char *base;
    size_t len;
    int fd;         /* the userfaultfd it was set up with */
    int registered; /* registered by lshm__os_fence_begin (else by lshm__os_fence_prepare) */
} lshm__fence;
/* At load time and in a fork's child (fork.c): the process's userfaultfd, if it can have one
 * (1: opened; 0: none can be; -1: each one opened was taken from under us by the program). */
int lshm__os_fence_open(void);
void lshm__os_fence_after_fork_child(void);
/* fork() handlers of the lock a reopen of the userfaultfd holds (fork.c): a fork from inside a
 * callback does not wait for the shares in flight, one of which may hold it. */
void lshm__os_fence_prepare_fork(void);
void lshm__os_fence_after_fork(void);
/* Protect [addr, addr + len) (whole pages) before the copy. 0 with f->len 0 where it cannot
 * (no userfaultfd, memory it cannot protect): the share goes on unfenced; with `required`
 * (lshm_storage_share_fenced) -EOPNOTSUPP instead. 0 with f->len 0, required or not, where no
 * fence is needed: len 0, a process with one thread. An error (-ENOMEM: the mapping could not
 * be split; -EOPNOTSUPP) changes nothing. */
int lshm__os_fence_begin(void *addr, size_t len, int required, _Atomic unsigned long *prepared,
                         lshm__fence *f);
/* Register [addr, addr + len) (fresh private memory: a slab) with the userfaultfd ahead of its
 * shares, so that each fence there only write-protects (one ioctl less, no mapping split).
 * Returns the generation of the userfaultfd it is now registered with, which the memory's
 * fences pass as *prepared (0: not registered; a fence registers the range then, as for any
 * memory). Kept by the memory's owner only while all of it stays registered: anything that maps
 * part of it anew stores 0 there unless that part is registered again with the same
 * generation (the fences never unregister it). A generation that is not the current one (a
 * fork's child, a reopened userfaultfd) makes the fence register as for other memory. */
unsigned long lshm__os_fence_prepare(void *addr, size_t len);
/* [addr, addr + len) of the fence was mapped anew: let the writers blocked there retry. */
void lshm__os_fence_wake(const lshm__fence *f, void *addr, size_t len);
/* A failed share: [from, end of the fence) is still the private memory: writable again,
 * unregistered; every writer woken. */
void lshm__os_fence_lift(lshm__fence *f, void *from);
/* A share that succeeded (the whole range mapped anew): every writer woken. */
void lshm__os_fence_end(lshm__fence *f);
#ifdef LSHM_TESTING
extern _Atomic int lshm__fence_off;            /* share unfenced */
extern _Atomic int lshm__fence_fails;          /* UFFDIO_REGISTER fails with this -errno */
extern _Atomic int lshm__fence_wp_fails;       /* UFFDIO_WRITEPROTECT "fails" after it worked */
extern _Thread_local int lshm__unmap_enomem;   /* this thread's munmaps fail with ENOMEM */
#endif
extern _Atomic unsigned long lshm__fences_set; /* fences set up */
/* fallocate(PUNCH_HOLE | KEEP_SIZE): give back [offset, offset + len) of fd (reads see zeros).
 * Not a fault point and no message: it only undoes part of a failed share. */
int lshm__os_punch_hole(int fd, uint64_t offset, uint64_t len);
/* Anonymous private zero pages, anywhere (map_anon) or over [addr, addr + len) (MAP_FIXED). */
int lshm__os_map_anon(size_t len, void **out);
int lshm__os_map_anon_fixed(void *addr, size_t len);
/* mremap(MREMAP_MAYMOVE) of an anonymous private mapping. */
int lshm__os_remap(void *old, size_t old_len, size_t new_len, void **out);
/* A huge page: the size transparent huge pages come in on x86-64 and arm64 (4 KiB base). */
#define LSHM__HUGE_BYTES ((size_t)2 << 20)
/* Whether libshm asks for huge pages: yes unless the environment says LSHM_HUGE=0 (read once). */
int lshm__os_huge_wanted(void);
/* A storage's private pages (len a multiple of the page size): map_anon, except that from
 * LSHM__HUGE_BYTES on the range starts 2 MiB-aligned and is advised MADV_HUGEPAGE, so that
 * the kernel backs it with huge pages where THP allows (a refusal leaves small pages, never
 * an error). remap_pages grows or shrinks such a range keeping both (the bytes move along). */
int lshm__os_map_anon_pages(size_t len, void **out);
/* A fresh memfd of `size` bytes (size sealed), its pages reserved (no SIGBUS later) and mapped
 * whole (map_len: size rounded up to pages; nothing mapped for 0) read-write into *out. From
 * 2 MiB on the mapping is 2 MiB-aligned and each whole 2 MiB of the file gets a huge page where
 * the kernel allows it (MADV_COLLAPSE; refusals leave small pages, never an error). */
int lshm__os_map_new_memfd(int fd, uint64_t size, size_t map_len, void **out);
/* Best effort: give each whole 2 MiB of [offset, offset + len) of a memfd, mapped at addr
 * (2 MiB-aligned, offset and len multiples of 2 MiB), a huge page. MADV_COLLAPSE needs one
 * page present per 2 MiB (a 1-byte write of a zero) and works whatever shmem_enabled says but
 * "deny"; THP disabled, an old kernel or fragmentation (EINVAL, EAGAIN, ENOMEM) leave the
 * range empty but for those bytes, for the caller to reserve or populate. Returns 0 or the
 * refusal (-errno, no message). -EINVAL and -EPERM mean no later collapse will work either:
 * from then on the process tries none (it returns -EINVAL at once, without the writes) and
 * collapse_wanted says no. */
int lshm__os_collapse(int fd, uint64_t offset, void *addr, size_t len);
/* Whether collapsing memfd ranges into huge pages is worth trying: huge_wanted, and no
 * collapse of this process was refused for good yet. */
int lshm__os_collapse_wanted(void);
/* [0, len) of fd mapped shared (read-only or writable); from 2 MiB on (unless LSHM_HUGE=0) at a
 * 2 MiB-aligned address, so that its huge pages map whole. */
int lshm__os_map_fd_aligned(int fd, size_t len, int readonly, void **out);
int lshm__os_remap_pages(void *old, size_t old_len, size_t new_len, void **out);
/* munmap and close cannot fail in a way a caller can act on; they assert in debug builds. */
void lshm__os_unmap(void *addr, size_t len);
/* -EDEADLK (with a message) when this thread runs s's allocator callback inside a resize of
 * s, which holds s's lock: a resize or share of s from there would wait for ever; else 0. */
int lshm__storage_in_callback(const lshm_storage *s);
/* fork() handlers of the list of ranges lshm__os_unmap could not unmap yet (fork.c). */
void lshm__os_prepare_fork(void);
void lshm__os_after_fork(void);
void lshm__plan_prepare_fork(void); /* (planner.c: the list of calls to interrupt) */
void lshm__plan_after_fork(int child);
void lshm__os_close(int fd);
int lshm__os_dup_cloexec(int fd, int *out);

/* What attach (and export, and a new slab memfd) needs to know about an fd. */
typedef struct lshm__fd_info {
    uint64_t size;     /* st_size in bytes */
    uint64_t dev, ino; /* st_dev, st_ino */
    int size_sealed;   /* F_SEAL_SHRINK and F_SEAL_GROW both present */
    int sealable;      /* F_SEAL_SEAL absent: more seals can be added */
    int write_sealed;  /* F_SEAL_WRITE or F_SEAL_FUTURE_WRITE present */
    int writable;      /* opened O_RDWR (or O_WRONLY) */
    int readable;      /* opened O_RDWR or O_RDONLY (a mapping needs it) */
} lshm__fd_info;
/* fstat (-EBADF when it fails), S_ISREG and F_GET_SEALS (-EINVAL "not a memfd" otherwise),
 * F_GETFL. */
int lshm__os_fd_info(int fd, lshm__fd_info *info);

/* ---- storages and segments (storage.c, segment.c, share.c) -------------------------------- */

#include <pthread.h>
#include <stdatomic.h>

/* Where a storage's bytes come from, which says how to give them back. */
enum lshm__origin {
    LSHM__ORIGIN_PAGES,     /* default allocator: anonymous pages [data, data + capacity) */
    LSHM__ORIGIN_ALLOCATOR, /* caller allocator: alloc(ctx, nbytes) returned data */
    LSHM__ORIGIN_FOREIGN,   /* foreign memory: release(ctx, data, nbytes) when done */
    LSHM__ORIGIN_MAPPED,    /* a mapping of our own fd: [map_base, map_base + map_len) */
    LSHM__ORIGIN_VIEW,      /* a slice of `segment`, which the storage retains */
    LSHM__ORIGIN_SLAB,      /* default allocator, small: whole pages of `slab` (slab.c) */
};

typedef struct lshm__slab lshm__slab;
typedef struct lshm__slab_memfd lshm__slab_memfd;

struct lshm_storage {
    _Atomic size_t refcount;  /* references; 0 once finalised */
    _Atomic(void *) data;     /* first byte, NULL when nbytes == 0; atomic: share may swap it */
    _Atomic unsigned flags;   /* LSHM_STORAGE_* */
    _Atomic size_t nbytes;    /* bytes visible to users; atomic: lshm_storage_nbytes reads it
                                 from any thread while a resize may change it */
    size_t capacity;          /* PAGES / WHOLE_PAGES allocator: nbytes rounded up to a page
                                 (the range owned, and shared in place); else nbytes */
    unsigned char origin;     /* enum lshm__origin */
    unsigned char in_arena;   /* a slot of an arena's slab: only the arena finalises it */
    lshm_allocator allocator; /* ORIGIN_ALLOCATOR: copy of the caller's allocator */
    lshm_release_fn release;  /* ORIGIN_FOREIGN: may be NULL (borrowed memory) */
    void *release_ctx;
    void *map_base;           /* ORIGIN_MAPPED: the page-aligned mapping to munmap */
    size_t map_len;           /* its length in bytes (0: nothing mapped) */
    int fd;                   /* own memfd once shared (in place or MAPPED), else -1 */
    uint64_t fd_offset;       /* offset of data within fd (or within the segment's fd) */
    lshm_segment *segment;    /* ORIGIN_VIEW: retained segment */
    lshm__slab *slab;         /* ORIGIN_SLAB: the slab its pages belong to */
    lshm__slab_memfd *slab_memfd; /* ORIGIN_SLAB, shared: the slab memfd it was shared into
                                 (retained); NULL while unshared or when it has its own fd */
    _Atomic unsigned char exported; /* its fd was handed out or sealed read-only: never pooled */
    unsigned long fork_epoch; /* the fork epoch (lshm__pool_epoch) when the share began, 0
                                 if never shared (see lshm__pool_put) */
    pthread_mutex_t lock;     /* serialises share and resize of this storage */
};

struct lshm_segment {
    _Atomic size_t refcount;
    _Atomic int fd;           /* memfd O_CLOEXEC, -1 after lshm_segment_close_fd */
    void *data;               /* mapping of the whole fd; NULL when size == 0 */
    size_t size;              /* bytes of the fd (and of the mapping) */
    size_t map_len;           /* bytes mapped: size rounded up to whole pages */
    unsigned flags;           /* LSHM_STORAGE_READONLY or 0 */
    _Atomic unsigned char fd_sealed; /* lshm_segment_fd added F_SEAL_SEAL (fd handed out) */
};

/* Atomic reference counts of storages and segments: a retain needs a live object, and
 * release says whether it dropped the last reference (acq_rel, so the one that frees sees
 * every write made under the other references). */
static inline void lshm__ref_retain(_Atomic size_t *refcount) {
    size_t old = atomic_fetch_add_explicit(refcount, 1, memory_order_relaxed);
    (void)old;
#ifndef NDEBUG
    if (old == 0)
        __builtin_trap(); /* retaining a dead object: the caller's use-after-free */
#endif
}
static inline int lshm__ref_release(_Atomic size_t *refcount) {
    size_t old = atomic_fetch_sub_explicit(refcount, 1, memory_order_acq_rel);
#ifndef NDEBUG
    if (old == 0)
        __builtin_trap(); /* one release too many */
#endif
    return old == 1;
}

/* share.c: a copy of at least this many bytes (default 64 MiB) into a new memfd for a storage
 * that does not own whole pages, or into a recycled memfd, splits over two threads when it is
 * the only share in progress in the process and there are 2+ CPUs (shares of default pages that
 * need a fresh memfd are chunked instead, on one thread). Tests lower it; lshm__share_splits
 * counts the copies that did split. */
extern _Atomic size_t lshm__share_split_threshold;
extern _Atomic unsigned long lshm__share_splits;
/* share.c: a non-resizable storage of default pages of at least lshm__share_chunk_threshold
 * bytes (default 1 MiB) is shared in place chunk by chunk, lshm__share_chunk_bytes at a time
 * (default 256 KiB) while it is the only share running, lshm__share_chunk_busy_bytes (4 MiB)
 * while others run; rounded down to whole pages. Tests lower them. lshm__share_restores counts
 * the failed chunked shares whose swapped chunks were mapped back privately. */
extern _Atomic size_t lshm__share_chunk_threshold;
extern _Atomic size_t lshm__share_chunk_bytes;
extern _Atomic size_t lshm__share_chunk_busy_bytes;
extern _Atomic unsigned long lshm__share_restores;
/* A chunked share of a storage of at least 2 MiB at a 2 MiB-aligned address (unless
 * LSHM_HUGE=0) gives every whole 2 MiB a huge page, lshm__share_huge_chunk_bytes at a time
 * (default 32 MiB, rounded down to a multiple of 2 MiB). Tests lower it; lshm__share_huge_chunks
 * counts the chunks copied that way. */
extern _Atomic size_t lshm__share_huge_chunk_bytes;
extern _Atomic unsigned long lshm__share_huge_chunks;
#ifdef LSHM_TESTING
/* The huge-page share's helper thread fails (-ENOMEM) when it has prepared chunk N (1-based;
 * 0: never), so that its own error path runs. */
extern _Atomic int lshm__share_helper_fails_at;
/* The bytes of memory the memfd of the latest failed chunked share kept (its st_blocks), taken
 * just before it was closed: only the chunks mapped back, none prepared ahead. */
extern _Atomic long long lshm__share_failed_memfd_bytes;
/* Called by a chunked share (on its thread) after each chunk it swapped, with the bytes
 * swapped so far: a test's step between two chunks. NULL: none. */
extern void (*lshm__share_after_chunk)(size_t swapped);
#endif

/* fork.c: fork() waits for shares and resizes in flight. A share or resize calls enter before
 * it takes the storage's lock and leave after releasing it (a process-wide read lock, which a
 * pthread_atfork prepare handler takes for writing); nested calls in one thread take it once.
 * No callback that may block on another thread's progress (a Python callback wanting the
 * GIL) may run in between. */
void lshm__fork_guard_enter(void);
void lshm__fork_guard_leave(void);
/* 1 in the child of a fork() (fork.c): no helper threads there. */
int lshm__forked_child(void);
/* Whether the fork handlers are registered (they are, at load time, unless pthread_atfork ran
 * out of memory: then nothing is pooled and nothing goes in slabs). */
int lshm__fork_handlers_ok(void);

/* ---- the pool of recycled memfds (pool.c) --------------------------------------------------- */

/* Called by free_bytes after the storage's own range was unmapped: keeps s->fd (and clears it)
 * when the memfd can be reused safely (shared in place by lshm_storage_share, never exported,
 * no fork since: s->fork_epoch is the current lshm__pool_epoch) and the pool has room;
 * otherwise s->fd is left for the caller to close. ORIGIN_PAGES only. */
void lshm__pool_put(lshm_storage *s);
/* A pooled memfd of exactly `capacity` bytes (the newest one; the caller owns it), or -1. */
int lshm__pool_take(size_t capacity);
/* The current fork epoch (bumped by every fork), which a share records in s->fork_epoch. The
 * first call reads LSHM_POOL_BYTES. */
unsigned long lshm__pool_epoch(void);
/* The fork handlers' part (fork.c): lock the pool before a fork; after it, in parent and
 * child, forget every pooled memfd (close them), bump the epoch and unlock. */
void lshm__pool_prepare_fork(void);
void lshm__pool_after_fork(void);
/* The pool's byte bound, set at the first use from LSHM_POOL_BYTES (tests change it). */
extern size_t lshm__pool_limit;

/* ---- slabs (slab.c) ------------------------------------------------------------------------ */

/* Bytes of one slab (and of its memfd). */
#define LSHM__SLAB_BYTES LSHM_SLAB_BYTES
/* Storages of the default allocator whose capacity is at most this (default
 * LSHM_SLAB_MAX_BYTES; tests set 0 to give every storage pages of its own) live in slabs. */
extern _Atomic size_t lshm__slab_max_bytes;
/* Whole pages for a new storage of `capacity` bytes (a multiple of the page size, at most
 * LSHM_SLAB_MAX_BYTES), zero-filled. */
int lshm__slab_alloc(size_t capacity, lshm__slab **slab, void **data);
/* Give s's pages back to its slab (shared or not); s->fd (own memfd) is left to the caller. */
void lshm__slab_free(lshm_storage *s);
/* Record s as the storage on its slab pages (after lshm_storage_init, for lshm_slab_find). */
void lshm__slab_set_owner(lshm_storage *s);
/* The generation of the userfaultfd the storage's slab is registered with (see
 * lshm__os_fence_prepare), for its share's fence. */
_Atomic unsigned long *lshm__slab_fence_generation(lshm_storage *s);
/* Share s in place into its slab's memfd (s->lock held, s not shared). */
int lshm__slab_share(lshm_storage *s);
/* The slab memfd behind s (s->slab_memfd non-NULL), for handing out: adds F_SEAL_SEAL to it
 * the first time it is handed out through any of its storages. */
int lshm__slab_fd(const lshm_storage *s, int *fd);
/* A slab storage shared into its slab's memfd: that memfd's st_dev and st_ino (returns 1),
 * else 0. */
int lshm__slab_identity(const lshm_storage *s, uint64_t *dev, uint64_t *ino);
/* fork handlers: prepare takes the slab lock, the others release it; the child also stops
 * sharing into the parent's memfds. */
void lshm__slab_prepare_fork(void);
void lshm__slab_after_fork_parent(void);
void lshm__slab_after_fork_child(void);

/* Fill the common fields of a fresh storage (refcount 1, fd -1, lock initialised). */
void lshm__storage_prepare(lshm_storage *s, unsigned origin, unsigned flags);
/* NULL/alignment checks of caller memory for the *_init functions. */
int lshm__check_mem(const void *mem, lshm_storage **out);
/* For lshm_storage_create*: check the caller's out pointer (-EINVAL if NULL) and malloc an
 * aligned struct into *s (-ENOMEM). */
int lshm__storage_malloc(lshm_storage *const *out, lshm_storage **s);
/* After an *_init into lshm__storage_malloc memory returned rc: on success mark the storage
 * as a heap storage, on failure free the struct. Returns rc. */
int lshm__storage_heap_done(lshm_storage *s, int rc);
/* Validate a received fd for [offset, offset + nbytes) and duplicate it (O_CLOEXEC). */
int lshm__attach_fd(int fd, uint64_t offset, size_t nbytes, unsigned flags, int *dup_out,
                    uint64_t *size_out);

#endif
