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
 *           storage be turned into shared memory *in place* (same data pointer).
 * segment   A refcounted memfd (anonymous shared memory, never named) plus one mapping of it.
 *           Sealed against shrink and grow, pages reserved up front, fd opened O_CLOEXEC.
 *           Many storages may view slices of one segment (one fd, one mapping for all of them).
 * share     lshm_storage_share() replaces a storage's memory by shared memory without changing
 *           the storage's identity and, where the storage owns whole pages, without changing its
 *           data pointer either.
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
#define LSHM_VERSION_MINOR 1
#define LSHM_VERSION_PATCH 0
/* Encoded as major * 10000 + minor * 100 + patch. */
#define LSHM_VERSION_NUMBER (LSHM_VERSION_MAJOR * 10000 + LSHM_VERSION_MINOR * 100 + LSHM_VERSION_PATCH)

/* The version number of the library actually loaded (compare with LSHM_VERSION_NUMBER). */
LSHM_API int lshm_version(void);
/* The same as a "major.minor.patch" string with static lifetime. */
LSHM_API const char *lshm_version_string(void);

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
 * before handing it back to `free`). Both functions must be thread-safe. */
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
 * exist. -EINVAL for a heap storage (use lshm_storage_release). NULL is accepted (returns 0). */
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
 * Errors: -EINVAL (NULL arguments), -ENODATA (not shared), -EBADF (the segment's fd was
 * closed with lshm_segment_close_fd). */
LSHM_API int lshm_storage_fd(const lshm_storage *s, int *fd, uint64_t *offset);

/* Change the size of a resizable, unshared storage (bytes kept up to the smaller size, new
 * bytes zero). The data pointer may change. Not thread-safe against other users of the bytes.
 * Errors: -EINVAL, -EPERM (not resizable, shared, or foreign), -ENOMEM, -EOVERFLOW. */
LSHM_API int lshm_storage_resize(lshm_storage *s, size_t nbytes);

/* Copy all bytes of src into dst. Errors: -EINVAL (NULL, different nbytes), -EPERM (dst is
 * read-only). Copying a storage onto itself is a no-op. */
LSHM_API int lshm_storage_copy(lshm_storage *dst, const lshm_storage *src);

/* ------------------------------------------------------------------------------------------ */
/* Sharing                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Create a storage of nbytes whose bytes live in a fresh segment (zero-filled, pages reserved
 * so running out of memory is -ENOMEM/-ENOSPC here and never SIGBUS later). flags: 0.
 * Errors: -EINVAL, -EOVERFLOW, -ENOMEM, -ENOSPC, -EMFILE/-ENFILE (no fd left). */
LSHM_API int lshm_storage_create_shared(size_t nbytes, unsigned flags, lshm_storage **out);

/* Share in place: replace the storage's memory with a fresh memfd holding the same bytes.
 * - Storage owning whole pages (default or WHOLE_PAGES allocator): the memfd is mapped over the
 *   storage's own pages (MAP_FIXED), so the data pointer and every raw pointer into it now see
 *   the shared memory.
 * - Other storages (foreign memory): the data pointer is swapped to a new mapping and the old
 *   memory is released through its release callback. The caller must ensure no views of the
 *   old memory remain (pyshm refuses for memory it does not own).
 * Idempotent: an already shared storage returns 0 at once. Thread-safe: concurrent calls on one
 * storage serialise and copy once; all return 0. Atomic: on failure the bytes, data pointer and
 * flags are exactly as before. Clears LSHM_STORAGE_RESIZABLE. A zero-byte storage becomes shared
 * with a zero-length memfd (data stays NULL, the fd can be sent).
 * The bytes must not be written by other threads during the call (their writes may be lost).
 * Errors: -EINVAL (NULL), -ENOMEM, -ENOSPC, -EMFILE, -ENFILE, other -errno from the kernel. */
LSHM_API int lshm_storage_share(lshm_storage *s);

/* Build a storage that views nbytes at `offset` of a shared-memory fd received from elsewhere.
 * The fd is validated (a memfd/shmem file, at least offset + nbytes long, sealed or sealable
 * against shrink and grow, writable unless LSHM_STORAGE_READONLY) and duplicated: the caller
 * keeps ownership of `fd`. flags: 0 or LSHM_STORAGE_READONLY (map read-only; required when the
 * fd is sealed against writes). The new storage is heap-allocated with one reference.
 * Errors: -EBADF (not an open fd), -EINVAL (not a memfd, too small, bad offset, NULL out),
 * -EPERM (write-sealed without READONLY, or unsealed and not sealable), -EACCES (fd opened
 * read-only without READONLY), -ENOMEM, -EMFILE. */
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

LSHM_API lshm_segment *lshm_segment_retain(lshm_segment *seg);
/* The last release unmaps and closes. NULL does nothing. */
LSHM_API void lshm_segment_release(lshm_segment *seg);
LSHM_API void *lshm_segment_data(const lshm_segment *seg);
LSHM_API size_t lshm_segment_size(const lshm_segment *seg);
/* The segment's fd (borrowed), or -EBADF after lshm_segment_close_fd. */
LSHM_API int lshm_segment_fd(const lshm_segment *seg);
LSHM_API unsigned lshm_segment_flags(const lshm_segment *seg); /* LSHM_STORAGE_READONLY or 0 */

/* Close the segment's fd while keeping its mapping (and every storage on it) alive, so a
 * process holding many segments does not hold as many fds. Afterwards the segment can no
 * longer be sent (lshm_segment_fd returns -EBADF). Idempotent. Not thread-safe against a
 * concurrent lshm_segment_fd on the same segment. */
LSHM_API int lshm_segment_close_fd(lshm_segment *seg);

/* Forbid new writable mappings and writes through the fd (F_SEAL_FUTURE_WRITE): every process
 * that attaches afterwards gets read-only memory. Mappings that exist already, including this
 * process's, keep their permissions. Irreversible. Errors: -EBADF (fd closed), -EPERM. */
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
} lshm_plan_options;

/* Fill `opts` with the defaults: alignment 64, half-open, time_limit 0. */
LSHM_API void lshm_plan_options_init(lshm_plan_options *opts);

typedef struct lshm_plan_result {
    uint64_t arena_size;  /* max over tensors of offset + size (aligned sizes not added) */
    uint64_t lower_bound; /* max over time of live bytes (each size rounded up to alignment) */
    int optimal;          /* 1 when arena_size is proven minimal (== lower bound or exact search) */
    char strategy[48];    /* name of the strategy that produced the plan */
    double seconds;       /* wall time spent */
} lshm_plan_result;

/* Place n tensors. sizes[i] bytes, live from firsts[i] to lasts[i] (see LSHM_PLAN_INCLUSIVE);
 * fixed_offsets may be NULL, else fixed_offsets[i] >= 0 pins tensor i at that offset and -1
 * lets the planner choose. Writes offsets[i] and *result. Deterministic for equal input.
 * Zero-size tensors get offset 0. Thread-safe (no shared state).
 * Errors: -EINVAL (NULL arrays with n > 0, first > last, alignment not a power of two, a fixed
 * offset misaligned or colliding with another fixed tensor, unknown flags), -EOVERFLOW (sizes
 * whose sum or aligned end overflows 64 bits), -ENOMEM. n == 0 is valid: arena_size 0. */
LSHM_API int lshm_plan(size_t n, const uint64_t *sizes, const int64_t *firsts,
                       const int64_t *lasts, const int64_t *fixed_offsets,
                       const lshm_plan_options *opts, uint64_t *offsets,
                       lshm_plan_result *result);

/* Check a plan: no two tensors live at the same time overlap, every offset aligned, and
 * arena_size >= every end. Returns 0 or -EINVAL with lshm_last_error() naming the first
 * offending pair. */
LSHM_API int lshm_plan_validate(size_t n, const uint64_t *sizes, const int64_t *firsts,
                                const int64_t *lasts, const uint64_t *offsets,
                                const lshm_plan_options *opts, uint64_t arena_size);

/* Lower bound alone (max over time of live bytes, sizes rounded up to the alignment). */
LSHM_API int lshm_plan_lower_bound(size_t n, const uint64_t *sizes, const int64_t *firsts,
                                   const int64_t *lasts, const lshm_plan_options *opts,
                                   uint64_t *lower_bound);

/* ------------------------------------------------------------------------------------------ */
/* Arena                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* (declared by the arena work; see below this line) */

#ifdef __cplusplus
}
#endif

#endif /* LSHM_H */
