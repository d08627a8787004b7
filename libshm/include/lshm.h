/*
 * lshm.h -- the one public header of libshm (library file liblshm, pkg-config name lshm).
 *
 * Concepts
 * --------
 * storage   A refcounted struct that owns (or views) a byte buffer. Its address is its identity:
 *           once initialised it is never moved or copied. It can live in memory the caller
 *           provides (lshm_storage_init / lshm_storage_fini) or on the heap
 *           (lshm_storage_create / lshm_storage_release).
 * allocator Where a storage's bytes come from. The default allocator hands out whole pages
 *           (page-aligned, size rounded up to a page) that the storage owns, which is what lets a
 *           storage be turned into shared memory *in place* (same data pointer). From 2 MiB on
 *           they start at a 2 MiB boundary (also after a resize that grows them) and are
 *           advised MADV_HUGEPAGE, so that transparent huge pages back every whole 2 MiB where
 *           the kernel allows it (THP "madvise" or "always"); a refusal leaves small pages and
 *           is never an error. LSHM_HUGE=0 in the environment (read at the first such storage
 *           of the process) makes libshm neither align them nor ask for huge pages (the kernel
 *           may still do either by itself: THP "always", large mappings it aligns).
 * segment   A refcounted memfd (anonymous shared memory, never named) plus one mapping of it.
 *           Sealed against shrink and grow, pages reserved up front, fd opened O_CLOEXEC. A
 *           new one of 2 MiB or more is mapped 2 MiB-aligned with each whole 2 MiB of the memfd
 *           in a huge page (MADV_COLLAPSE, Linux 6.1+: whatever shmem_enabled says unless it is
 *           "deny"; a refusal leaves small pages, never an error; LSHM_HUGE=0 turns it off).
 *           Many storages may view slices of one segment (one fd, one mapping for all of them).
 * share     lshm_storage_share() replaces a storage's memory by shared memory without changing
 *           the storage's identity and, where the storage owns whole pages, without changing its
 *           data pointer either. From 2 MiB on (pages at a 2 MiB boundary) the memfd gets huge
 *           pages too, copied through a second mapping of it (no room for that mapping, ENOMEM:
 *           small pages, as below 2 MiB).
 * planner   lshm_plan() places tensors with known lifetimes into one arena.
 * arena     lshm_arena_* keeps the storages of a planned set in one slab and backs them with
 *           slices of one buffer (optionally one segment).
 *
 * Conventions
 * -----------
 * Every function that can fail returns 0 or a negative errno value (-EINVAL, -ENOMEM, ...) and
 * writes results through out-parameters, which are left untouched on failure. The global errno
 * is never the channel. After a failure, lshm_last_error() returns a thread-local message
 * "file:line: what failed" for the calling thread. Every destroy/release function accepts NULL.
 * Functions that only read a storage are safe to call from any thread; the exceptions are said
 * on each declaration.
 */
#ifndef LSHM_H
#define LSHM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(LSHM_BUILDING) && defined(__GNUC__)
#define LSHM_API __attribute__((visibility("default")))
#else
#define LSHM_API
#endif

/* ------------------------------------------------------------------------------------------ */
/* Version and errors                                                                          */
/* ------------------------------------------------------------------------------------------ */

#define LSHM_VERSION_MAJOR 0
#define LSHM_VERSION_MINOR 4
#define LSHM_VERSION_PATCH 0
/* Encoded as major * 10000 + minor * 100 + patch. */
#define LSHM_VERSION_NUMBER (LSHM_VERSION_MAJOR * 10000 + LSHM_VERSION_MINOR * 100 + LSHM_VERSION_PATCH)

/* The version number of the library actually loaded (compare with LSHM_VERSION_NUMBER). */
LSHM_API int lshm_version(void);
/* The same as a "major.minor.patch" string with static lifetime. */
LSHM_API const char *lshm_version_string(void);
/* The layout of the public structs and the values of the public constants as this library
 * was built, for bindings that mirror them: `name` is a struct ("lshm_plan_options": its
 * sizeof; "lshm_plan_options#fields": its number of fields), a field
 * ("lshm_plan_options.alignment": its offsetof; "lshm_plan_options.alignment#size": its
 * sizeof) or a constant ("LSHM_STORAGE_SHARED"). Writes *value. Thread-safe.
 * Errors: -EINVAL (NULL), -ENOENT (no such name). A struct or constant added to this header
 * gets its lines in libshm/src/abi.c too (the field counts there are written by hand: a field
 * added into padding changes no sizeof). */
LSHM_API int lshm_abi_value(const char *name, uint64_t *value);

/* Name and description of an error code (negative errno values as returned by this library;
 * a positive value is treated as its negation). Never returns NULL; the string is static. */
LSHM_API const char *lshm_strerror(int err);
/* Short symbolic name of an error code, e.g. "EINVAL"; "UNKNOWN" for codes not in the table. */
LSHM_API const char *lshm_err_name(int err);

/* The message of the last failure in the calling thread, "file:line: message", or "" when no
 * call has failed in this thread yet. Valid until the next failing call in the same thread. */
LSHM_API const char *lshm_last_error(void);

/* The system page size in bytes (what "whole pages" means below). */
LSHM_API size_t lshm_page_size(void);

/* ------------------------------------------------------------------------------------------ */
/* Allocators                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* A caller-supplied allocator. `alloc` returns a buffer of at least `nbytes` bytes or NULL;
 * `free` gets back exactly the pointer and nbytes that alloc was called with. `ctx` is passed
 * through. The struct is copied into each storage, so it may live on the caller's stack.
 * If `flags` has LSHM_ALLOCATOR_WHOLE_PAGES, alloc promises page-aligned memory of at least
 * nbytes rounded up to a page, all owned by the caller of alloc: such storages are shared in
 * place at the same address (the library restores private anonymous pages over the range
 * before handing it back to `free`). Both functions must be thread-safe. During
 * lshm_storage_resize, `alloc` runs under the storage's lock: a resize or share of that same
 * storage from inside it is refused with -EDEADLK (any other call is fine). */
#define LSHM_ALLOCATOR_WHOLE_PAGES 0x1u
typedef struct lshm_allocator {
    void *(*alloc)(void *ctx, size_t nbytes);
    void (*free)(void *ctx, void *ptr, size_t nbytes);
    void *ctx;
    unsigned flags;
} lshm_allocator;

/* Callback that releases foreign memory wrapped by lshm_storage_init_foreign. */
typedef void (*lshm_release_fn)(void *ctx, void *data, size_t nbytes);

/* ------------------------------------------------------------------------------------------ */
/* Storages                                                                                    */
/* ------------------------------------------------------------------------------------------ */

typedef struct lshm_storage lshm_storage;

/* Small storages live in slabs. The default allocator (allocator NULL) places every storage
 * that is not resizable and whose capacity (nbytes rounded up to whole pages) is at most
 * LSHM_SLAB_MAX_BYTES in a slab: 4 MiB of private memory handed out in whole pages, so many
 * small storages cost one mapping instead of one each. Such a storage still owns whole pages
 * and is shared in place at the same address, but into its slab's one memfd (created when the
 * first storage of the slab is shared): sharing 100,000 small storages costs about one fd per
 * 4 MiB of them, not one per storage. What that means for the processes the fd is sent to:
 * - the memfd holds the bytes of the slab's storages that are shared, and nothing else (a
 *   storage that was never shared is not in it), so a receiver of one storage of a slab can
 *   read and write every storage of that slab that is, or was, shared while that memfd was
 *   the slab's, including ones shared after it received the fd;
 * - pages that were shared are not given to another storage while the memfd is the slab's;
 *   when the last storage of a slab is released the slab drops its memfd (receivers keep
 *   theirs) and starts over with fresh private pages, so no receiver ever sees a later
 *   storage's bytes;
 * - storages of a slab that are not shared stay private across fork() (copy-on-write).
 * Mappings: storages of one slab shared one after the other merge into one mapping of the
 * memfd; in the worst case (every other page shared) a slab costs one mapping per page it
 * holds, i.e. at most 1,024 per 4 MiB slab. Running into vm.max_map_count makes the share
 * fail with -ENOMEM and leaves the storage as it was.
 * Resizable storages and storages of caller allocators never live in slabs. */
#define LSHM_SLAB_MAX_BYTES ((size_t)64 << 10)

/* What the slabs of this process hold right now (lshm_slab_stats). */
typedef struct lshm_slab_counters {
    uint64_t slabs;    /* slabs mapped (LSHM_SLAB_BYTES each) */
    uint64_t memfds;   /* slabs that have a memfd (one fd each) */
    uint64_t storages; /* storages living in slabs */
} lshm_slab_counters;
/* Bytes of one slab and of its memfd. */
#define LSHM_SLAB_BYTES ((size_t)4 << 20)
/* Copy the counters into *out. Thread-safe. Errors: -EINVAL (NULL). */
LSHM_API int lshm_slab_stats(lshm_slab_counters *out);
/* Find the live storage of this process that was shared into the slab memfd identified by
 * (st_dev, st_ino) = (dev, ino) and lies at `offset` of it with `nbytes` bytes: how memory that
 * comes back from another process (e.g. a forked child that inherited it) is recognised as the
 * same storage. Only storages shared into a slab's memfd are found (not one that got a memfd
 * of its own from lshm_storage_share_readonly, nor one that is released); offset is the
 * storage's first byte, page-aligned. *out gets a new reference. Thread-safe.
 * Errors: -EINVAL (NULL out), -ENOENT (no such storage, or offset not page-aligned). */
LSHM_API int lshm_slab_find(uint64_t dev, uint64_t ino, uint64_t offset, size_t nbytes,
                            lshm_storage **out);
/* 1 if the memfd identified by (dev, ino) is a slab memfd of this process (a slab's current
 * one, or one a live storage was shared into), else 0. While the memfd stays open anywhere in
 * this process, the answer 0 stays true: new slab memfds are new files. So a receiver that maps
 * a memfd and gets 0 needs no lshm_slab_find for it while it keeps the mapping. O(pages of all
 * slabs); thread-safe; never fails. */
LSHM_API int lshm_slab_knows(uint64_t dev, uint64_t ino);

/* Storage flags (lshm_storage_flags reports them; creators accept those marked "in"). */
#define LSHM_STORAGE_RESIZABLE 0x1u /* in: lshm_storage_resize may change nbytes */
#define LSHM_STORAGE_SHARED 0x2u    /* the bytes live in a memfd (lshm_storage_fd works) */
#define LSHM_STORAGE_READONLY 0x4u  /* in (attach, views): mapped without write permission */
#define LSHM_STORAGE_INPLACE 0x8u   /* the struct lives in caller memory (init, not create) */

/* Size and alignment that caller memory passed to the *_init functions must have. */
LSHM_API size_t lshm_storage_sizeof(void);
LSHM_API size_t lshm_storage_alignof(void);

/* Initialise a storage in place in `mem` (lshm_storage_sizeof() bytes, aligned to
 * lshm_storage_alignof()) owning `nbytes` bytes from `allocator` (NULL: the default page
 * allocator, memory zero-filled). flags: 0 or LSHM_STORAGE_RESIZABLE. The caller holds the one
 * reference; *out is set to the storage (== mem). nbytes == 0 is valid: data is NULL.
 * Errors: -EINVAL (NULL mem or out, misaligned mem, unknown flags, allocator without both
 * functions), -EOVERFLOW (nbytes too large to round to pages), -ENOMEM. */
LSHM_API int lshm_storage_init(void *mem, size_t nbytes, const lshm_allocator *allocator,
                               unsigned flags, lshm_storage **out);

/* Initialise a storage in place that wraps foreign memory `data` of `nbytes`; `release` (may be
 * NULL: memory is borrowed) is called with (ctx, data, nbytes) when the last reference goes.
 * Such a storage does not own whole pages: sharing it swaps its data pointer.
 * Errors: -EINVAL (NULL mem/out, data NULL with nbytes > 0, misaligned mem, unknown flags). */
LSHM_API int lshm_storage_init_foreign(void *mem, void *data, size_t nbytes,
                                       lshm_release_fn release, void *ctx, unsigned flags,
                                       lshm_storage **out);

/* Finalise a storage initialised in place: drops the caller's reference, frees the bytes, and
 * leaves `mem` free for reuse. Refuses with -EBUSY (changing nothing) while other references
 * exist. -EINVAL for a heap storage (use lshm_storage_release), for one finalised already
 * (until `mem` is initialised again) and for an arena's storage (lshm_arena_storage,
 * lshm_arena_alloc: the arena finalises it). NULL is accepted (returns 0). */
LSHM_API int lshm_storage_fini(lshm_storage *s);

/* Heap-allocating conveniences: the struct is malloced, the caller holds one reference, and the
 * last lshm_storage_release frees both bytes and struct. Same flags and errors as _init. */
LSHM_API int lshm_storage_create(size_t nbytes, const lshm_allocator *allocator, unsigned flags,
                                 lshm_storage **out);
LSHM_API int lshm_storage_create_foreign(void *data, size_t nbytes, lshm_release_fn release,
                                         void *ctx, unsigned flags, lshm_storage **out);

/* Atomic refcounting, safe from any thread. retain returns its argument (NULL stays NULL).
 * The last release frees the bytes through the allocator that made them (and the struct, for
 * heap storages; an in-place struct is left finalised). release(NULL) does nothing. */
LSHM_API lshm_storage *lshm_storage_retain(lshm_storage *s);
LSHM_API void lshm_storage_release(lshm_storage *s);
LSHM_API size_t lshm_storage_refcount(const lshm_storage *s);

/* Accessors. data is NULL for zero-byte storages. */
LSHM_API void *lshm_storage_data(const lshm_storage *s);
LSHM_API size_t lshm_storage_nbytes(const lshm_storage *s);
LSHM_API unsigned lshm_storage_flags(const lshm_storage *s);

/* The fd behind a shared storage (borrowed: valid while the storage lives; dup it to keep it)
 * and the byte offset of the storage's data within that fd.
 * Handing the fd out closes its seals: the first call adds F_SEAL_SEAL to the memfd (unless
 * the fd is open read-only; for a slab storage, the first call through any storage of that
 * slab memfd), so no holder of the fd can add seals afterwards (e.g.
 * F_SEAL_FUTURE_WRITE, which would make every later receiver's memory read-only). From then on
 * lshm_storage_seal_readonly refuses: seal first, then hand out. Marks the memfd exported
 * (never pooled, see lshm_pool_trim).
 * Errors: -EINVAL (NULL arguments), -ENODATA (not shared), -EBADF (the segment's fd was
 * closed with lshm_segment_close_fd), other -errno from fcntl (F_SEAL_SEAL). */
LSHM_API int lshm_storage_fd(lshm_storage *s, int *fd, uint64_t *offset);

/* What another process needs to map a shared storage (lshm_storage_export). */
typedef struct lshm_export_info {
    int fd;             /* the memfd (borrowed, as from lshm_storage_fd) */
    uint64_t offset;    /* of the storage's data within the memfd */
    uint64_t dev, ino;  /* the memfd's st_dev and st_ino: its identity */
    uint64_t file_size; /* the memfd's size in bytes */
    int readonly;       /* the memfd is sealed against writes (receivers map it read-only) */
    /* since 0.2 (the struct grew: code built against 0.1 must not use a 0.2 library) */
    unsigned flags;     /* the storage's flags, data and nbytes, as the accessors return them */
    void *data;         /* (one call instead of four for a binding that pays per call) */
    size_t nbytes;
} lshm_export_info;

/* lshm_storage_fd plus the memfd's identity, size and write seal in one call. For a storage
 * shared into its slab's memfd they come from the slab's record (file_size LSHM_SLAB_BYTES,
 * readonly 0), with no syscall beyond the F_SEAL_SEAL that the memfd's first hand-out adds;
 * any other storage (a slab storage with a memfd of its own included) costs an fstat and
 * fcntl calls. Marks the memfd as handed out, as lshm_storage_fd does. Thread-safe.
 * Errors: those of lshm_storage_fd; -EBADF when fstat fails. */
LSHM_API int lshm_storage_export(lshm_storage *s, lshm_export_info *out);

/* Change the size of a resizable, unshared storage (bytes kept up to the smaller size, new
 * bytes zero). The data pointer may change, and the old range may be unmapped or freed.
 * Resize never frees memory under a live user: it refuses with -EBUSY, changing nothing, while
 * other references exist (every array or view over the bytes retains the storage; retain the
 * storage to pin its memory). Raw pointers into the old range that were not backed by a
 * reference are invalid after a successful resize. A fork() waits for a resize in flight.
 * The caller allocator's alloc runs during the call (a fork() from inside it does not wait,
 * as for lshm_storage_share); its free runs after the storage's lock is released.
 * Errors: -EINVAL, -EPERM (not resizable, shared, or foreign), -EBUSY (other references
 * exist), -ENOMEM, -EOVERFLOW. */
LSHM_API int lshm_storage_resize(lshm_storage *s, size_t nbytes);

/* Copy all bytes of src into dst. Errors: -EINVAL (NULL, different nbytes), -EPERM (dst is
 * read-only). Copying a storage onto itself is a no-op. */
LSHM_API int lshm_storage_copy(lshm_storage *dst, const lshm_storage *src);

/* ------------------------------------------------------------------------------------------ */
/* Sharing                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Create a storage of nbytes, shared from the start (zero-filled, its pages in the memfd so
 * running out of memory is -ENOMEM/-ENOSPC here and never SIGBUS later). At most
 * LSHM_SLAB_MAX_BYTES: a slab storage shared at once (lshm_storage_create, then
 * lshm_storage_share: a range of its slab's memfd); larger: a fresh segment of its own.
 * flags: 0. Errors: -EINVAL, -EOVERFLOW, -ENOMEM (also: more than the machine, or the process's
 * memory cgroup, can hold), -ENOSPC, -EMFILE/-ENFILE (no fd left), -EFBIG (past RLIMIT_FSIZE,
 * which holds for memfds too; no SIGXFSZ). */
LSHM_API int lshm_storage_create_shared(size_t nbytes, unsigned flags, lshm_storage **out);

/* Share in place: replace the storage's memory with a fresh memfd holding the same bytes.
 * - Storage owning whole pages (default or WHOLE_PAGES allocator): the memfd is mapped over the
 *   storage's own pages (MAP_FIXED), so the data pointer and every raw pointer into it now see
 *   the shared memory.
 * - Other storages (foreign memory, plain caller allocators, slots of private arenas): the
 *   data pointer is swapped to a new mapping and the old memory is released through its
 *   release callback (or the allocator's free), after the call's locks are released. Since the
 *   memory moves, this is refused with -EBUSY, changing nothing, while the storage has other
 *   references (an array over the old memory would silently stop aliasing it): copy the bytes
 *   into a shared storage instead. With the caller's reference only it proceeds. Raw pointers
 *   into the old memory that hold no reference must not be used afterwards.
 * Idempotent: an already shared storage returns 0 at once. Thread-safe: concurrent calls on one
 * storage serialise and copy once; all return 0. Atomic: on failure the bytes, data pointer,
 * flags and reference count are exactly as before. (Non-resizable storages of the default
 * allocator of 1 MiB or more are swapped chunk by chunk: after a failure part of their pages
 * may be copy-on-write pages of a closed, never exported memfd holding the same bytes, which
 * behave as private memory, across fork() too. Should even that remap fail, those pages stay
 * shared with nobody but a child forked before the next successful share.)
 * Clears LSHM_STORAGE_RESIZABLE. A zero-byte storage becomes shared with a zero-length memfd
 * (data stays NULL, the fd can be sent).
 * Other threads may go on reading and writing the bytes during the call: no write made through
 * this process's page tables is lost. While the pages are copied and remapped they are
 * write-protected through a userfaultfd (one per process, O_CLOEXEC, opened at load time); a
 * thread that writes there meanwhile waits in its page fault until its range is in the shared
 * memory, then its write lands there. A write the kernel makes for another thread (read(2) into
 * the bytes) waits the same way, except where the process may only use a user-mode-only
 * userfaultfd (no CAP_SYS_PTRACE and vm.unprivileged_userfaultfd=0): there it fails with EFAULT
 * (a UDP socket then drops the datagram, as it does for any EFAULT). Not fenced, so such writes
 * may be lost: writes into pages the kernel pinned before the call (O_DIRECT reads in flight,
 * io_uring fixed buffers, RDMA); no userfaultfd write protection (kernels before 6.4,
 * CONFIG_USERFAULTFD off, a seccomp filter); memory it cannot protect (an allocator's file
 * mappings, ranges another userfaultfd watches); LSHM_FENCE=0 in the environment (read at load
 * time); a child forked without the atfork handlers (_Fork, a raw clone); storages whose memory
 * moves (see above). A process that never started a second thread sets up none (nobody could
 * write). A signal handler that writes the bytes on the sharing thread itself would wait for
 * ever: don't. -ENOMEM when the protection cannot be set up (vm.max_map_count), changing
 * nothing. The default allocator's slabs (storages up to LSHM_SLAB_MAX_BYTES) are registered
 * with libshm's userfaultfd from the moment they are made, so that their shares only
 * write-protect: a program's own UFFDIO_REGISTER over slab memory fails with EBUSY (in a fork's
 * child, whose copy is not registered, it works, and libshm then shares that memory
 * unfenced).
 * fork() waits for shares (and resizes) in flight, and no share starts while a fork runs (a
 * pthread_atfork handler), so a child sees every storage shared completely or not at all, and
 * no storage lock held. A fork() from inside a callback the library calls during a share or
 * resize (an allocator's alloc) does not wait.
 * Errors: -EINVAL (NULL), -EBUSY (memory that would move, with other references), -ENOMEM
 * (also: a memfd of more than the machine, or the process's memory cgroup, can hold), -ENOSPC,
 * -EMFILE, -ENFILE, -EFBIG (a memfd written past RLIMIT_FSIZE, which holds for memfds too: the
 * kernel's SIGXFSZ, which would kill the process, is not raised; except in a slab's 4 MiB memfd
 * made before the limit came down, where the limit is not read at every share, and for a limit
 * another thread lowers between the check and the write of a share made in one write; a chunked
 * share, 1 MiB and up, holds SIGXFSZ back in its thread and gets -EFBIG), other -errno from the
 * kernel. */
LSHM_API int lshm_storage_share(lshm_storage *s);

/* lshm_storage_share, but never unfenced: memory shared in place whose pages cannot be
 * write-protected during the copy (no userfaultfd write protection in this process, LSHM_FENCE=0,
 * a child forked without the atfork handlers, ranges another userfaultfd watches) is refused
 * with -EOPNOTSUPP and nothing changes; lshm_storage_share would share it unfenced. For a
 * share made while other threads may be writing the bytes and that must lose none of their
 * writes (pyshm uses it when multiprocessing pickles an array on a thread of its own). A
 * process that never started a second thread (glibc's __libc_single_threaded; without it
 * every process counts as threaded) needs no fence and is not refused; nor is an already
 * shared storage (0, nothing copied). The reason for a refusal is in lshm_last_error(). The limits of the fence are lshm_storage_share's: writes into
 * pages the kernel pinned before the call are not covered, kernel writes fail with EFAULT where
 * only a user-mode-only userfaultfd is allowed, storages whose memory moves are shared as
 * lshm_storage_share shares them (refused with -EBUSY while other references exist).
 * Errors: those of lshm_storage_share, and -EOPNOTSUPP (no fence). Since 0.4. */
LSHM_API int lshm_storage_share_fenced(lshm_storage *s);

/* The pool of recycled memfds. When a storage that lshm_storage_share shared in place (default
 * allocator pages) is released, its range is unmapped at once as before, but its memfd (sized,
 * sealed against shrink/grow, every page allocated) may be kept in a per-process pool instead
 * of being closed; the next lshm_storage_share of a storage with the same capacity (nbytes
 * rounded up to a page) overwrites every byte of it instead of making a new memfd, which is
 * faster than filling fresh pages. Only capacities where that holds are kept: below 1 MiB,
 * and from 64 MiB up (taken only by a share running alone, which refills with two threads);
 * in between, a fresh share swapped in chunks is faster. What is kept holds memory (and one fd
 * per entry) after the release: at most 256 memfds and at most LSHM_POOL_BYTES bytes in total
 * (environment variable, read once at the first share, decimal bytes; default 1/8 of
 * physical memory, or of the process's memory cgroup limit where that is less; 0 disables the
 * pool).
 * Safety: a memfd is pooled only if nobody else can still reach it: never exported (no
 * lshm_storage_fd call on the storage, hence never sent to another process), never sealed
 * read-only (lshm_storage_seal_readonly), and no fork() since its share began (a child
 * inherits fds and mappings); a fork also empties the pool in parent and child. Storages
 * that are views of segments, use a caller allocator or foreign memory never pool.
 *
 * lshm_pool_trim closes every pooled memfd and returns how many it closed (never fails).
 * Thread-safe. */
LSHM_API int lshm_pool_trim(void);

/* Make a shared storage read-only for everyone it is sent to from now on (F_SEAL_FUTURE_WRITE
 * and F_SEAL_SEAL on its memfd): later mappings of the fd can only be read, writes through the
 * fd fail, and nobody can change the seals again. This process's own mapping keeps writing.
 * Works for any storage that owns its memfd (shared in place, whatever its size, or attached);
 * a storage viewing a segment seals the whole segment (every storage on it). Irreversible;
 * idempotent. Must come before the fd is handed out: once lshm_storage_fd (or lshm_segment_fd,
 * lshm_arena_fd) gave it out writable, holders may have mapped it writable, so this refuses
 * with -EPERM ("already handed out writable; make a copy to share read-only"). On any failure
 * nothing changes (no seal, the memfd is not marked exported).
 * Errors: -EINVAL (NULL; a slab storage sharing its slab's memfd with others: use
 * lshm_storage_share_readonly before its first share), -ENODATA (not shared), -EBADF (fd
 * closed), -EPERM (handed out writable already, or sealing refused). */
LSHM_API int lshm_storage_seal_readonly(lshm_storage *s);

/* Share a storage read-only for every process it is sent to: lshm_storage_share, except that a
 * slab storage (LSHM_SLAB_MAX_BYTES) gets a memfd of its own instead of a range of its slab's,
 * then lshm_storage_seal_readonly. On an already shared storage it only seals (and refuses
 * with -EINVAL for a storage that shares its slab's memfd with others, since the seal would
 * make them read-only too; nothing changes then).
 * Errors: those of lshm_storage_share and lshm_storage_seal_readonly. */
LSHM_API int lshm_storage_share_readonly(lshm_storage *s);

/* Build a storage that views nbytes at `offset` of a shared-memory fd received from elsewhere.
 * The fd is validated (a memfd/shmem file, at least offset + nbytes long, sealed or sealable
 * against shrink and grow, writable unless LSHM_STORAGE_READONLY) and duplicated: the caller
 * keeps ownership of `fd`. An unsealed fd is sealed against shrink and grow and its size read
 * after that, so a sender that resizes it meanwhile cannot make us map more than it holds (no
 * SIGBUS); an attach refused for what the fd says before that (too small, opened read-only or
 * write-only) leaves it unsealed. An fd without F_SEAL_SEAL (from an older sender) is
 * accepted; its holders could still add F_SEAL_FUTURE_WRITE, which only affects later attaches
 * (-EPERM unless READONLY).
 * flags: 0 or LSHM_STORAGE_READONLY (map read-only; required when the fd is sealed against
 * writes). The new storage is heap-allocated with one reference.
 * Errors: -EBADF (not an open fd), -EINVAL (not a memfd, a hugetlbfs memfd (MFD_HUGETLB: only
 * ordinary shmem memfds are mapped), too small, bad offset, NULL out),
 * -EPERM (write-sealed without READONLY, or unsealed and not sealable), -EACCES (fd opened
 * read-only without READONLY, or write-only), -ENOMEM, -EMFILE. */
LSHM_API int lshm_storage_attach(int fd, uint64_t offset, size_t nbytes, unsigned flags,
                                 lshm_storage **out);

/* ------------------------------------------------------------------------------------------ */
/* Segments: one memfd + one mapping, shared by many storages                                  */
/* ------------------------------------------------------------------------------------------ */

typedef struct lshm_segment lshm_segment;

/* Create a segment of nbytes (zero-filled, sealed against shrink/grow, pages reserved, mapped
 * read-write, fd O_CLOEXEC). One reference. Errors as lshm_storage_create_shared. */
LSHM_API int lshm_segment_create(size_t nbytes, unsigned flags, lshm_segment **out);

/* Map the whole of a received memfd (validated as in lshm_storage_attach; the fd is duplicated,
 * the caller keeps its own). flags: 0 or LSHM_STORAGE_READONLY. */
LSHM_API int lshm_segment_attach(int fd, unsigned flags, lshm_segment **out);

/* Take one more reference on a segment; returns `seg` (NULL stays NULL). Thread-safe. */
LSHM_API lshm_segment *lshm_segment_retain(lshm_segment *seg);
/* Give one reference back; the last release unmaps and closes. NULL does nothing.
 * Thread-safe. */
LSHM_API void lshm_segment_release(lshm_segment *seg);
/* The start of the segment's mapping (at a 2 MiB boundary from 2 MiB on), or NULL for NULL.
 * Valid while the caller holds a reference. */
LSHM_API void *lshm_segment_data(const lshm_segment *seg);
/* The segment's size in bytes (the memfd's size), or 0 for NULL. */
LSHM_API size_t lshm_segment_size(const lshm_segment *seg);
/* Write the segment's fd (borrowed: the segment closes it) to *fd. The first call adds
 * F_SEAL_SEAL (as lshm_storage_fd does): from then on nobody can add seals and
 * lshm_segment_seal_readonly refuses with -EPERM. Thread-safe.
 * Errors: -EINVAL (NULL), -EBADF (closed by lshm_segment_close_fd), other -errno from fcntl. */
LSHM_API int lshm_segment_fd(lshm_segment *seg, int *fd);
/* LSHM_STORAGE_READONLY for a segment mapped read-only, else 0 (also for NULL). */
LSHM_API unsigned lshm_segment_flags(const lshm_segment *seg);

/* Close the segment's fd while keeping its mapping (and every storage on it) alive, so a
 * process holding many segments does not hold as many fds. Afterwards the segment can no
 * longer be sent (lshm_segment_fd returns -EBADF). Idempotent. Not thread-safe against a
 * concurrent lshm_segment_fd on the same segment. */
LSHM_API int lshm_segment_close_fd(lshm_segment *seg);

/* Forbid new writable mappings and writes through the fd (F_SEAL_FUTURE_WRITE, with
 * F_SEAL_SEAL): every process that attaches afterwards gets read-only memory. Mappings that
 * exist already, including this process's, keep their permissions. Irreversible; idempotent.
 * Errors: -EBADF (fd closed), -EPERM (the fd was already handed out writable by
 * lshm_segment_fd: make a copy to share read-only; or sealing refused). */
LSHM_API int lshm_segment_seal_readonly(lshm_segment *seg);

/* Initialise in place / create a storage viewing [offset, offset + nbytes) of a segment. The
 * storage retains the segment. flags: 0 or LSHM_STORAGE_READONLY (a read-only segment forces
 * it). Errors: -EINVAL (NULL, range outside the segment, misaligned mem). */
LSHM_API int lshm_storage_init_view(void *mem, lshm_segment *seg, uint64_t offset, size_t nbytes,
                                    unsigned flags, lshm_storage **out);
LSHM_API int lshm_storage_create_view(lshm_segment *seg, uint64_t offset, size_t nbytes,
                                      unsigned flags, lshm_storage **out);

/* The segment a shared storage views (borrowed), or NULL for storages shared in place (they
 * own their memfd alone) and for unshared storages. */
LSHM_API lshm_segment *lshm_storage_segment(const lshm_storage *s);

/* ------------------------------------------------------------------------------------------ */
/* Planner                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Interval mode: by default a tensor is live on the half-open range [first, last); with
 * LSHM_PLAN_INCLUSIVE on [first, last]. */
#define LSHM_PLAN_INCLUSIVE 0x1u

typedef struct lshm_plan_options {
    uint64_t alignment; /* every offset is a multiple of this power of two; 0 means 1 */
    unsigned flags;     /* LSHM_PLAN_INCLUSIVE or 0 */
    double time_limit;  /* seconds for improvement + exact search after the heuristics; 0: none */
    uint64_t capacity;  /* 0: minimise the arena (default). > 0: see below */
} lshm_plan_options;

/* capacity: with capacity > 0 the planner's goal is a plan that fits in capacity bytes. The
 * heuristics run first; if none fits, the exact search decides feasibility at that capacity
 * within time_limit (no exact search with time_limit 0). If no plan fits (infeasible, or not
 * decided in time), lshm_plan returns the best plan found with result->arena_size > capacity;
 * that is not an error, the caller checks arena_size. A plan that fits is not minimised further.
 * With capacity 0 the time budget goes to finding smaller and smaller arenas.
 *
 * Fill `opts` with the defaults: alignment 64, half-open, time_limit 0, capacity 0. */
LSHM_API void lshm_plan_options_init(lshm_plan_options *opts);

typedef struct lshm_plan_result {
    uint64_t arena_size;  /* max of offset + size over tensors that are ever live (a tensor with
                             first == last in half-open mode conflicts with nothing and may
                             lie anywhere; aligned sizes are not added) */
    uint64_t lower_bound; /* no plan can be smaller; see lshm_plan_lower_bound */
    int optimal;          /* 1 when arena_size is proven minimal (== lower bound or exact search) */
    char strategy[48];    /* name of the strategy that produced the plan */
    double seconds;       /* wall time spent */
} lshm_plan_result;

/* Place n tensors. sizes[i] bytes, live from firsts[i] to lasts[i] (see LSHM_PLAN_INCLUSIVE);
 * fixed_offsets may be NULL, else fixed_offsets[i] >= 0 pins tensor i at that offset and -1
 * lets the planner choose. Writes offsets[i] and *result. Deterministic for equal input when
 * time_limit is 0 (the search under a time budget depends on how fast the machine runs).
 * Zero-size tensors get offset 0. Thread-safe (no shared state).
 * Errors: -EINVAL (NULL arrays with n > 0, first > last, alignment not a power of two, a fixed
 * offset misaligned or colliding with another fixed tensor, unknown flags), -EOVERFLOW (a size
 * or pinned end that overflows 64 bits when aligned, tensors live at the same time whose sizes
 * sum past 64 bits, or, only when all the sizes sum past 64 bits, no placement found that ends
 * at or below the highest aligned offset under 2^64), -ENOMEM. Sizes that are never live
 * together may sum past 2^64. n == 0 is valid: arena_size 0. */
LSHM_API int lshm_plan(size_t n, const uint64_t *sizes, const int64_t *firsts,
                       const int64_t *lasts, const int64_t *fixed_offsets,
                       const lshm_plan_options *opts, uint64_t *offsets,
                       lshm_plan_result *result);

/* Interrupt the lshm_plan calls running (on other threads) with these very options (the same
 * address): each stops soon (the placement engine looks every 256 tensors, the searches
 * where they look at the clock) and returns -ECANCELED, writing neither offsets nor result.
 * Returns how many calls it interrupted (0: none runs with `opts`; a call that ends meanwhile
 * may still return its plan). Only calls given options of the caller's can be interrupted
 * (NULL options: -EINVAL). Thread-safe; async-signal-unsafe (it takes a lock). */
LSHM_API int lshm_plan_interrupt(const lshm_plan_options *opts);

/* Check a plan: no two tensors live at the same time overlap, every offset aligned, and
 * arena_size >= every end. Returns 0, -EINVAL with lshm_last_error() naming the first
 * offending pair (or bad input, as lshm_plan), or -EOVERFLOW when an offset + size passes
 * 2^64. */
LSHM_API int lshm_plan_validate(size_t n, const uint64_t *sizes, const int64_t *firsts,
                                const int64_t *lasts, const uint64_t *offsets,
                                const lshm_plan_options *opts, uint64_t arena_size);

/* Lower bound alone: the maximum over time t of (the sum of the sizes of the tensors live at t,
 * each rounded up to the alignment, minus the largest of those roundings): every live tensor
 * but the topmost one occupies at least its rounded-up size, the topmost at least its size.
 * With alignment 1 this is the maximum of the live bytes. Tensors that occupy no memory are
 * left out: zero-size tensors and, in the default half-open mode, tensors with first == last
 * (never live). -EOVERFLOW when the bound does not fit in 64 bits. */
LSHM_API int lshm_plan_lower_bound(size_t n, const uint64_t *sizes, const int64_t *firsts,
                                   const int64_t *lasts, const lshm_plan_options *opts,
                                   uint64_t *lower_bound);

/* ------------------------------------------------------------------------------------------ */
/* Arena                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* An arena keeps the storages of a planned set in one slab and backs them with slices of one
 * buffer, as PyTorch's static-runtime MemoryPlanner does:
 * - the storage structs live in one malloced slab of lshm_storage_sizeof()-byte slots (aligned
 *   to lshm_storage_alignof()); each is initialised in place and finalised in place, and the
 *   slab never moves while any slot is initialised;
 * - the bytes come from one buffer: private anonymous pages, or with LSHM_ARENA_SHARED one
 *   segment (one memfd), so the whole set crosses to another process as one fd.
 * The arena owns one reference to each storage it initialises (the "arena's own reference").
 * Storages of a private arena wrap borrowed memory (lshm_storage_init_foreign, release NULL);
 * those of a shared arena view the segment (lshm_storage_init_view). A buffer is zero-filled
 * when it is created; a buffer that is reused keeps whatever bytes were left in it.
 *
 * Two kinds of arena:
 * - planned (lshm_arena_create): n tensors with known sizes and lifetimes are planned once
 *   (lshm_plan); lshm_arena_allocate initialises all n storages on their slices,
 *   lshm_arena_deallocate finalises them. The buffer is kept between iterations (allocate
 *   after deallocate reuses it, no new mmap or memfd) until lshm_arena_trim or destroy.
 * - recording (lshm_arena_create_recording): record-then-replay. The first iteration serves
 *   every lshm_arena_alloc with an ordinary allocation while recording (size, alloc, free)
 *   events, each event one tick; lshm_arena_end_iteration plans the recorded lifetimes. The
 *   next iterations serve the k-th alloc of the iteration from the k-th planned slice when the
 *   request fits it (size <= planned size, and no storage still live overlaps the slice);
 *   a request that does not fit is served by ordinary allocation (so alloc never fails for
 *   that reason) and the plan is recomputed at the end of that iteration, each tensor's size
 *   being the largest seen for it (sizes never shrink, as in PyTorch).
 *
 * Thread safety: an arena is NOT thread-safe; one thread at a time may call lshm_arena_*
 * on a given arena. The storages it hands out are ordinary storages: retaining, releasing and
 * reading them from other threads is fine.
 *
 * The buffer is refcounted (lshm_arena_current_buffer, lshm_arena_buffer_retain/_release):
 * when the arena frees or replaces it, memory someone else still references stays mapped. */
typedef struct lshm_arena lshm_arena;

/* Arena flags. */
#define LSHM_ARENA_SHARED 0x1u /* the buffer is one segment (memfd); storages are shared */

/* Counters of an arena (lshm_arena_stats). "Current plan" is the plan of a planned arena, or
 * the latest plan of a recording arena (all zero before its first lshm_arena_end_iteration). */
typedef struct lshm_arena_counters {
    uint64_t managed_bytes;  /* sum of the sizes of the current plan's tensors (UINT64_MAX
                                when it passes 64 bits) */
    uint64_t arena_bytes;    /* bytes of the current plan's buffer (lshm_arena_size) */
    uint64_t lower_bound;    /* the current plan's lower bound (no plan can use fewer bytes) */
    uint64_t storages;       /* number of tensors in the current plan (slab slots) */
    uint64_t reuse_count;    /* storages initialised on a slice of an arena buffer that already
                                existed when the call began, i.e. served with no new system
                                allocation (no mmap, memfd or malloc for their bytes). A planned
                                arena's first allocate adds 0 (it creates the buffer), each later
                                allocate adds n; each replayed alloc served by a slice adds 1. */
    uint64_t fallback_count; /* recording arenas: allocs served by ordinary allocation because
                                no plan existed yet or the request did not fit its slice */
    uint64_t iterations;     /* completed iterations: successful deallocate calls (planned) or
                                end_iteration calls (recording) */
    uint64_t replans;        /* plans recomputed because a request did not fit (the first plan
                                of a recording arena is not counted) */
} lshm_arena_counters;

/* Plan n tensors (as lshm_plan: sizes[i] bytes live from firsts[i] to lasts[i]; opts NULL means
 * the defaults of lshm_plan_options_init) and create a planned arena for them. The slab is
 * allocated here; no buffer yet (lshm_arena_allocate makes it). flags: 0 or LSHM_ARENA_SHARED.
 * The caller owns *out and frees it with lshm_arena_destroy. Thread-safe (no shared state).
 * lshm_plan_interrupt(opts) from another thread stops its planning: -ECANCELED, no arena.
 * Errors: -EINVAL (NULL arrays with n > 0, NULL out, bad plan input as lshm_plan, unknown
 * flags), -EOVERFLOW, -ENOMEM, -ECANCELED. n == 0 is valid (an arena of nothing). */
LSHM_API int lshm_arena_create(size_t n, const uint64_t *sizes, const int64_t *firsts,
                               const int64_t *lasts, const lshm_plan_options *opts,
                               unsigned flags, lshm_arena **out);

/* Create a recording arena (record-then-replay, see above). opts: the alignment and
 * time_limit used for every plan (NULL: defaults); its interval flag is ignored, since the
 * arena numbers the ticks itself. flags: 0 or LSHM_ARENA_SHARED (every storage it hands out,
 * ordinary or planned, is shared memory). Errors: -EINVAL, -ENOMEM. */
LSHM_API int lshm_arena_create_recording(const lshm_plan_options *opts, unsigned flags,
                                         lshm_arena **out);

/* Destroy an arena: finalises any storages it still holds (deallocate), then frees the slab
 * and the buffer. Refuses with -EBUSY, changing nothing, while any of its storages has
 * references beyond the arena's own (a numpy array alive, a retained pointer) or, for a
 * recording arena, while storages from lshm_arena_alloc are not yet freed. NULL: returns 0. */
LSHM_API int lshm_arena_destroy(lshm_arena *arena);

/* Planned arenas: initialise all n storages in place on their slices of the buffer. The
 * buffer is created on the first call (zero-filled) and reused afterwards. Each storage has
 * one reference, the arena's own: borrow it with lshm_arena_storage, retain it to keep it.
 * Errors: -EINVAL (NULL, recording arena), -EBUSY (already allocated), -EOVERFLOW (a plan's
 * arena larger than this process can map), -ENOMEM, -ENOSPC, -EMFILE (creating the buffer).
 * On failure no storage is initialised. */
LSHM_API int lshm_arena_allocate(lshm_arena *arena);

/* Planned arenas: finalise every storage in place (their slices become free; the buffer is
 * kept for the next allocate). Refuses with -EBUSY, changing nothing, if any storage still has
 * references beyond the arena's own. Not allocated: returns 0. Errors: -EINVAL (NULL,
 * recording arena), -EBUSY. */
LSHM_API int lshm_arena_deallocate(lshm_arena *arena);

/* Free the kept buffer (the next allocate or replay makes a new one): drops the arena's
 * reference, the memory goes with the last one (see lshm_arena_current_buffer). Errors:
 * -EINVAL (NULL), -EBUSY (storages are initialised on it: deallocate, or free them, first). */
LSHM_API int lshm_arena_trim(lshm_arena *arena);

/* Number of tensors of the current plan (0 for NULL). */
LSHM_API size_t lshm_arena_count(const lshm_arena *arena);

/* Planned arenas: the storage of tensor i (borrowed; valid until deallocate or destroy;
 * retain it to keep it, which makes deallocate refuse until released).
 * Errors: -EINVAL (NULL, i >= count, recording arena), -ENODATA (not allocated). */
LSHM_API int lshm_arena_storage(const lshm_arena *arena, size_t i, lshm_storage **out);

/* Offset of tensor i in the buffer, by the current plan. Errors: -EINVAL (NULL, i >= count). */
LSHM_API int lshm_arena_offset(const lshm_arena *arena, size_t i, uint64_t *offset);

/* First byte of the buffer, or NULL when there is none (not created yet, trimmed, or of
 * zero bytes). Borrowed. */
LSHM_API void *lshm_arena_data(const lshm_arena *arena);

/* Bytes of buffer the current plan needs: its arena_size, or more if a tensor that is never
 * live (first == last, half-open) was placed beyond it, since every tensor gets its slice.
 * 0 for NULL or before a first plan. */
LSHM_API uint64_t lshm_arena_size(const lshm_arena *arena);

/* The memfd of a shared arena's buffer (borrowed: dup it to keep it; valid until the buffer
 * is trimmed, replaced by a re-plan, or the arena destroyed). Another process maps it with
 * lshm_segment_attach and finds tensor i at lshm_arena_offset(i). Adds F_SEAL_SEAL to it as
 * lshm_segment_fd does.
 * Errors: -EINVAL (NULL), -ENODATA (private arena, or no buffer yet). */
LSHM_API int lshm_arena_fd(lshm_arena *arena, int *fd);

/* The arena's buffer as a refcounted object, so that memory handed out over it can outlive
 * the arena's own use of the buffer. Trim, destroy and a re-plan that needs a larger buffer
 * only drop the arena's reference: the bytes stay mapped (private pages) or the segment stays
 * alive (shared arenas; its fd too) until the last reference is released, and are unmapped
 * then. A storage on the buffer (a slot, LSHM_STORAGE_INPLACE) always lies in the arena's
 * current buffer, so a caller that wants a pointer into a slot to stay valid after the slot is
 * freed or deallocated retains the current buffer while the slot is live and releases it when
 * done with the pointer (pyshm does this for every array over a slot: after lshm_arena_free
 * such an array may see another tensor's bytes, never unmapped memory).
 *
 * lshm_arena_current_buffer: the current buffer (borrowed: valid until the arena replaces or
 * frees it; retain it to keep it). Errors: -EINVAL (NULL), -ENODATA (no buffer: not allocated
 * yet, trimmed, or a recording arena before its first plan).
 * lshm_arena_buffer_retain returns its argument; lshm_arena_buffer_release drops a reference
 * (the last one unmaps; NULL does nothing). Both are atomic and safe from any thread, also
 * after the arena was destroyed.
 * lshm_arena_buffer_data: first byte (NULL for zero bytes); lshm_arena_buffer_size: usable
 * bytes (0 for NULL). */
typedef struct lshm_arena_buffer lshm_arena_buffer;
LSHM_API int lshm_arena_current_buffer(const lshm_arena *arena, lshm_arena_buffer **out);
LSHM_API lshm_arena_buffer *lshm_arena_buffer_retain(lshm_arena_buffer *buf);
LSHM_API void lshm_arena_buffer_release(lshm_arena_buffer *buf);
LSHM_API void *lshm_arena_buffer_data(const lshm_arena_buffer *buf);
LSHM_API size_t lshm_arena_buffer_size(const lshm_arena_buffer *buf);

/* Copy the counters into *out. Errors: -EINVAL (NULL). */
LSHM_API int lshm_arena_stats(const lshm_arena *arena, lshm_arena_counters *out);

/* The current plan's result (arena size, lower bound, strategy, time). Errors: -EINVAL (NULL),
 * -ENODATA (recording arena before its first plan). */
LSHM_API int lshm_arena_plan_result(const lshm_arena *arena, lshm_plan_result *out);

/* Recording arenas: one allocation event. *out gets a storage of nbytes with one reference,
 * owned by the caller and given back with lshm_arena_free: a slot of the slab on the planned
 * slice, or an ordinary storage (heap, whole pages or a memfd) while recording or when the
 * request does not fit. Zero-filled only when freshly allocated (a reused slice keeps old
 * bytes). Errors: -EINVAL (NULL, planned arena), -ENOMEM, -ENOSPC, -EMFILE, -EOVERFLOW. */
LSHM_API int lshm_arena_alloc(lshm_arena *arena, size_t nbytes, lshm_storage **out);

/* Recording arenas: one free event; drops the caller's reference to a storage returned by
 * lshm_arena_alloc of this iteration. A storage on the arena's buffer (a slab slot, flag
 * LSHM_STORAGE_INPLACE) has its slice handed to later allocs, so the caller's reference must
 * be its last one: -EBUSY (nothing recorded) while others exist. An ordinary storage
 * (recording iteration or fallback) just loses the caller's reference; other references keep
 * its memory alive as for any storage.
 * Errors: -EINVAL (NULL, planned arena, storage not from this iteration's allocs), -EBUSY. */
LSHM_API int lshm_arena_free(lshm_arena *arena, lshm_storage *s);

/* Recording arenas: end the iteration. Plans the recorded events if there is no plan yet or a
 * request did not fit, creating a buffer for the new plan (a shared arena gets a new memfd)
 * before the old buffer goes (for a moment the process holds both), and resets the alloc
 * counter so the next alloc is the iteration's first. Every storage allocated in the iteration
 * must have been freed. Errors: -EINVAL (NULL, planned arena), -EBUSY (storages not freed;
 * nothing changes), -ENOMEM, -ENOSPC, -EMFILE, -EOVERFLOW (planning or the new buffer failed),
 * -ECANCELED (lshm_arena_interrupt stopped the plan); after any of these the iteration is ended
 * anyway, the plan and buffer the arena had stay and serve the next iterations' allocs that fit
 * them, and the next end_iteration plans again. */
LSHM_API int lshm_arena_end_iteration(lshm_arena *arena);

/* Interrupt the plan an lshm_arena_end_iteration of `arena` is making on another thread (as
 * lshm_plan_interrupt: that call returns -ECANCELED, the iteration ends anyway and the next
 * end_iteration plans again). Returns how many plans it interrupted (0: none running); the
 * only call on an arena that may run beside another. Errors: -EINVAL (NULL). */
LSHM_API int lshm_arena_interrupt(const lshm_arena *arena);

#ifdef __cplusplus
}
#endif

#endif /* LSHM_H */
