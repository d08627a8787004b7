/*
 * segment.c -- segments (one memfd + one mapping, refcounted) and the checks of received fds
 * (lshm__attach_fd). Storages that view a slice of a segment are built in storage.c, through
 * the segment's accessors.
 *
 * A segment is the unit that crosses process boundaries: one fd, however many storages view
 * it, which is how a process shares many small arrays without one fd (and one mapping) each.
 * The memfd is never named, so nothing leaks after a crash: the kernel frees the pages when
 * the last fd and mapping go. It is sealed against shrink and grow, so no holder can truncate
 * it under another holder's mapping (that would be SIGBUS), and its pages are reserved with
 * fallocate at creation, so running out of memory is an error code here rather than a SIGBUS
 * on some later first write.
 *
 * A received fd is checked before it is mapped (lshm__attach_fd): it must be a memfd, sealed
 * (or sealable) against size changes, long enough once sealed (the size is read after the seal
 * is in place, so a sender resizing it meanwhile cannot make us map past its end), and its
 * write permission must agree with the flags asked for. It is duplicated, so the caller keeps
 * its own. An fd is handed out with F_SEAL_SEAL (lshm_segment_fd), so its holders cannot add
 * seals; received fds without it (older senders) are still accepted.
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* The last step of create and attach: wrap fd and its mapping [data, data + map_len) in a
 * segment, or, if that fails, unmap and close them (the caller's cleanup is done either way). */
static int segment_new(int fd, void *data, size_t size, size_t map_len, unsigned flags,
                       lshm_segment **out) {
    lshm_segment *seg = malloc(sizeof *seg);
    if (seg == NULL) {
        lshm__os_unmap(data, map_len);
        lshm__os_close(fd);
        return LSHM_FAIL(-ENOMEM, "malloc of a segment struct failed");
    }
    atomic_init(&seg->refcount, 1);
    atomic_init(&seg->fd, fd);
    atomic_init(&seg->fd_sealed, 0);
    seg->data = data;
    seg->size = size;
    seg->map_len = map_len;
    seg->flags = flags;
    *out = seg;
    return 0;
}

int lshm_segment_create(size_t nbytes, unsigned flags, lshm_segment **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    if (flags != 0)
        return LSHM_FAIL(-EINVAL, "unknown segment flags 0x%x", flags);
    size_t map_len = 0;
    int rc = lshm__round_pages(nbytes, &map_len);
    if (rc != 0)
        return rc;
    if ((uint64_t)nbytes > (uint64_t)INT64_MAX)
        return LSHM_FAIL(-EOVERFLOW, "%zu bytes is larger than any file", nbytes);
    int fd = -1;
    void *data = NULL;
    if ((rc = lshm__os_memfd_sized(nbytes, &fd)) != 0)
        return rc;
    if ((rc = lshm__os_map_new_memfd(fd, nbytes, map_len, &data)) != 0)
        goto fail_close;
    return segment_new(fd, data, nbytes, map_len, 0, out);

fail_close:
    lshm__os_close(fd);
    return rc;
}

/* The checks of an attach of [offset, offset + nbytes) of fd against what the fd says. */
static int check_attach(int fd, const lshm__fd_info *info, uint64_t offset, size_t nbytes,
                        int readonly) {
    if (offset > info->size || nbytes > info->size - offset)
        return LSHM_FAIL(-EINVAL,
                         "fd %d smaller than claimed: %llu bytes, asked for %zu at offset %llu",
                         fd, (unsigned long long)info->size, nbytes,
                         (unsigned long long)offset);
    if (!info->readable)
        return LSHM_FAIL(-EACCES, "fd %d was opened write-only: a mapping needs read access",
                         fd);
    if (info->write_sealed && !readonly)
        return LSHM_FAIL(-EPERM, "fd %d is sealed against writes: attach it read-only", fd);
    if (!info->writable && !readonly)
        return LSHM_FAIL(-EACCES, "fd %d was opened read-only: attach it read-only", fd);
    return 0;
}

int lshm__attach_fd(int fd, uint64_t offset, size_t nbytes, unsigned flags, int *dup_out,
                    uint64_t *size_out) {
    if ((flags & ~LSHM_STORAGE_READONLY) != 0)
        return LSHM_FAIL(-EINVAL, "unknown attach flags 0x%x", flags & ~LSHM_STORAGE_READONLY);
    int readonly = (flags & LSHM_STORAGE_READONLY) != 0;
    lshm__fd_info info;
    int rc = lshm__os_fd_info(fd, &info);
    if (rc != 0)
        return rc;
    /* What can be refused before the fd is sealed is refused first: a failed attach leaves
     * the caller's fd as it was. (The size is checked again once sealed.) */
    if ((rc = check_attach(fd, &info, offset, nbytes, readonly)) != 0)
        return rc;
    if (!info.size_sealed) {
        /* An unsealed memfd could be truncated under our mapping by its other holders: seal
         * it now (needs a writable fd and no F_SEAL_SEAL), or refuse. The size read above may
         * already be stale (a sender may resize until the seal is in place), so everything
         * below uses what the fd says once sealed. */
        if (!info.sealable || !info.writable)
            return LSHM_FAIL(-EPERM, "fd %d is not sealed against shrink/grow and cannot be", fd);
        rc = lshm__os_seal_size(fd);
        if (rc != 0)
            return rc == -EPERM ? rc : LSHM_FAIL(rc, "fd %d: cannot seal against shrink/grow", fd);
        if ((rc = lshm__os_fd_info(fd, &info)) != 0)
            return rc;
        if (!info.size_sealed) /* cannot happen: seals are never removed */
            return LSHM_FAIL(-EPERM, "fd %d is still not sealed against shrink/grow", fd);
    }
    /* From here on the size cannot change: what we check is what we map. */
    if ((rc = check_attach(fd, &info, offset, nbytes, readonly)) != 0)
        return rc;
    rc = lshm__os_dup_cloexec(fd, dup_out);
    if (rc != 0)
        return rc;
    *size_out = info.size;
    return 0;
}

int lshm_segment_attach(int fd, unsigned flags, lshm_segment **out) {
    if (out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL out pointer");
    int own = -1;
    uint64_t size;
    int rc = lshm__attach_fd(fd, 0, 0, flags, &own, &size);
    if (rc != 0)
        return rc;
    size_t map_len = 0;
    void *data = NULL;
    if (size > (uint64_t)SIZE_MAX || (rc = lshm__round_pages((size_t)size, &map_len)) != 0) {
        rc = LSHM_FAIL(-EOVERFLOW, "fd %d of %llu bytes cannot be mapped", fd,
                       (unsigned long long)size);
        goto fail_close;
    }
    int readonly = (flags & LSHM_STORAGE_READONLY) != 0;
    /* (from 2 MiB on at a 2 MiB boundary: the memfd's huge pages then map whole) */
    if (size > 0 && (rc = lshm__os_map_fd_aligned(own, map_len, readonly, &data)) != 0)
        goto fail_close;
    return segment_new(own, data, (size_t)size, map_len, flags & LSHM_STORAGE_READONLY, out);

fail_close:
    lshm__os_close(own);
    return rc;
}

lshm_segment *lshm_segment_retain(lshm_segment *seg) {
    if (seg != NULL)
        lshm__ref_retain(&seg->refcount);
    return seg;
}

void lshm_segment_release(lshm_segment *seg) {
    if (seg == NULL || !lshm__ref_release(&seg->refcount))
        return;
    if (seg->size > 0)
        lshm__os_unmap(seg->data, seg->map_len);
    lshm__os_close(atomic_load(&seg->fd));
    free(seg);
}

void *lshm_segment_data(const lshm_segment *seg) {
    return seg == NULL ? NULL : seg->data;
}

size_t lshm_segment_size(const lshm_segment *seg) {
    return seg == NULL ? 0 : seg->size;
}

int lshm_segment_fd(lshm_segment *seg, int *fd_out) {
    if (seg == NULL || fd_out == NULL)
        return LSHM_FAIL(-EINVAL, "NULL argument");
    int fd = atomic_load(&seg->fd);
    if (fd < 0)
        return LSHM_FAIL(-EBADF, "the segment's fd was closed");
    /* Whoever gets the fd from now on must not be able to add seals (F_SEAL_FUTURE_WRITE
     * would make every later receiver's mapping read-only): F_SEAL_SEAL, once. The flag is
     * only a shortcut; two racing first calls both add it, which is harmless. */
    if (!atomic_load_explicit(&seg->fd_sealed, memory_order_acquire)) {
        int rc = lshm__os_seal_seal(fd);
        if (rc != 0)
            return rc;
        atomic_store_explicit(&seg->fd_sealed, 1, memory_order_release);
    }
    *fd_out = fd;
    return 0;
}

unsigned lshm_segment_flags(const lshm_segment *seg) {
    return seg == NULL ? 0 : seg->flags;
}

int lshm_segment_close_fd(lshm_segment *seg) {
    if (seg == NULL)
        return LSHM_FAIL(-EINVAL, "NULL segment");
    /* exchange: two racing calls close the fd once. */
    lshm__os_close(atomic_exchange(&seg->fd, -1));
    return 0;
}

int lshm_segment_seal_readonly(lshm_segment *seg) {
    if (seg == NULL)
        return LSHM_FAIL(-EINVAL, "NULL segment");
    int fd = atomic_load(&seg->fd);
    if (fd < 0)
        return LSHM_FAIL(-EBADF, "the segment's fd was closed");
    return lshm__os_seal_readonly(fd);
}
