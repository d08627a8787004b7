/*
 * fuzz_attach.c -- libFuzzer target for lshm_segment_attach / lshm_storage_attach with hostile
 * fds and sizes.
 *
 * Each input decodes to up to four scenarios. A scenario makes one fd: a memfd (sizes up to
 * 256 KiB, with or without MFD_ALLOW_SEALING, some of F_SEAL_SHRINK/GROW/WRITE/FUTURE_WRITE/
 * SEAL, truncated after creation, reopened read-only or read-write through /proc/self/fd), a
 * pipe end, /dev/null, /dev/zero, an O_TMPFILE regular file, a closed fd number, a negative or
 * huge fd number; then attaches it with fuzzed offset, nbytes and flags, optionally with a fault
 * injected at the k-th OS call.
 *
 * Properties (abort on the first that breaks):
 *  - return codes are 0 or a documented negative errno; out is untouched on failure;
 *  - on success every page of the mapping can be read (SIGBUS or an ASan report is a crash),
 *    the bytes are the file's bytes, a writable attach writes through to the file, the storage
 *    reports the asked nbytes and flags, and the fd can no longer change size (sealed);
 *  - after each input, no more fds are open than before it.
 */
#include "lshm.h"

#include "fuzz_common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

void lshm__fault_arm(int nth, int err); /* LSHM_TESTING */

#define MAX_FILE (256u << 10)

static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    int n = 0;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

static int documented(int rc) {
    switch (-rc) {
    case 0:
    case EBADF:
    case EINVAL:
    case EPERM:
    case EACCES:
    case ENOMEM:
    case EMFILE:
    case EOVERFLOW:
    case ENODEV: /* mmap of a file without mmap support */
    case ENOSPC:
        return 1;
    default:
        return 0;
    }
}

/* Bytes of the file at [off, off + n) compared with mem (pread; 1 when equal). */
static int same_as_file(int fd, uint64_t off, const unsigned char *mem, size_t n) {
    unsigned char buf[4096];
    while (n > 0) {
        size_t k = n < sizeof buf ? n : sizeof buf;
        ssize_t r = pread(fd, buf, k, (off_t)off);
        if (r != (ssize_t)k || memcmp(buf, mem, k) != 0)
            return 0;
        mem += k;
        off += k;
        n -= k;
    }
    return 1;
}

/* 1 when fd's size can no longer change (F_SEAL_SHRINK and F_SEAL_GROW, and growing fails). */
static int size_sealed(int fd) {
    int seals = fcntl(fd, F_GET_SEALS);
    off_t end = lseek(fd, 0, SEEK_END);
    return seals >= 0 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW) &&
           end >= 0 && ftruncate(fd, end + 4096) != 0;
}

static unsigned read_all(const unsigned char *p, size_t n) {
    unsigned sum = 0;
    for (size_t i = 0; i < n; i += 4096)
        sum += ((const volatile unsigned char *)p)[i];
    if (n > 0)
        sum += ((const volatile unsigned char *)p)[n - 1];
    return sum;
}

typedef struct made {
    int fd;      /* what is passed to attach */
    int close1;  /* fds to close afterwards (-1: none) */
    int close2;
    int memfd;   /* the fd holding the bytes, for pread checks (-1: not a file with bytes) */
} made;

static void make_fd(fuzz_in *in, made *m) {
    m->fd = m->close1 = m->close2 = m->memfd = -1;
    uint8_t kind = take_u8(in);
    switch (kind % 10) {
    case 0:
    case 1:
    case 2:
    case 3: { /* a memfd */
        uint8_t how = take_u8(in);
        unsigned mflags = MFD_CLOEXEC | ((how & 1) ? 0 : MFD_ALLOW_SEALING);
        int fd = memfd_create("fuzz", mflags);
        if (fd < 0)
            return;
        m->close1 = fd;
        m->fd = fd;
        m->memfd = fd;
        uint64_t size = take_u64(in) % (MAX_FILE + 1);
        if (ftruncate(fd, (off_t)size) != 0)
            return;
        uint8_t fill = take_u8(in);
        if (fill != 0 && size > 0) {
            unsigned char buf[512];
            for (size_t i = 0; i < sizeof buf; i++)
                buf[i] = (unsigned char)(fill + i);
            uint64_t at = take_u64(in) % size;
            size_t k = size - at < sizeof buf ? (size_t)(size - at) : sizeof buf;
            if (pwrite(fd, buf, k, (off_t)at) != (ssize_t)k)
                return;
        }
        int seals = 0;
        uint8_t s = take_u8(in);
        if (s & 1)
            seals |= F_SEAL_SHRINK;
        if (s & 2)
            seals |= F_SEAL_GROW;
        if (s & 4)
            seals |= F_SEAL_WRITE;
        if (s & 8)
            seals |= F_SEAL_FUTURE_WRITE;
        if (s & 0x10)
            seals |= F_SEAL_SEAL;
        if (s & 0x20) { /* truncate before sealing */
            uint64_t t = take_u64(in) % (MAX_FILE + 1);
            if (ftruncate(fd, (off_t)t) != 0)
                return;
        }
        if (seals)
            (void)fcntl(fd, F_ADD_SEALS, seals); /* may fail: MFD_ALLOW_SEALING missing */
        if (s & 0x40) { /* truncate after sealing (refused by SHRINK/GROW seals) */
            uint64_t t = take_u64(in) % (MAX_FILE + 1);
            (void)ftruncate(fd, (off_t)t);
        }
        if (how & 4) { /* reopen through /proc, read-only or read-write */
            char path[64];
            snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
            int re = open(path, ((how & 8) ? O_RDWR : O_RDONLY) | O_CLOEXEC);
            if (re >= 0) {
                m->close2 = re;
                m->fd = re;
            }
        }
        return;
    }
    case 4: { /* a pipe end */
        int p[2];
        if (pipe2(p, O_CLOEXEC) != 0)
            return;
        m->close1 = p[0];
        m->close2 = p[1];
        m->fd = p[take_u8(in) & 1];
        return;
    }
    case 5: { /* a device */
        int fd = open(take_bool(in) ? "/dev/zero" : "/dev/null", O_RDWR | O_CLOEXEC);
        m->fd = m->close1 = fd;
        return;
    }
    case 6: { /* a regular file that is not shmem */
        int fd = open("/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        if (fd < 0)
            fd = open("/var/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        m->fd = m->close1 = fd;
        if (fd >= 0) {
            m->memfd = fd;
            (void)ftruncate(fd, (off_t)(take_u64(in) % (MAX_FILE + 1)));
        }
        return;
    }
    case 7: { /* a closed fd number */
        int fd = memfd_create("closed", MFD_CLOEXEC);
        if (fd >= 0)
            close(fd);
        m->fd = fd;
        return;
    }
    case 8: { /* negative */
        static const int neg[] = {-1, -2, -EBADF, INT_MIN, -4096};
        m->fd = neg[take_u8(in) % 5];
        return;
    }
    default: { /* huge */
        static const int big[] = {INT_MAX, 1 << 20, 65535, 1023};
        m->fd = big[take_u8(in) % 4];
        return;
    }
    }
}

static void check_mapping(const made *m, unsigned char *p, size_t n, uint64_t off, int writable,
                          uint8_t pattern) {
    (void)read_all(p, n);
    if (m->memfd >= 0 && n > 0) {
        FUZZ_CHECK(same_as_file(m->memfd, off, p, n), "mapping differs from the file at %llu",
                   (unsigned long long)off);
        if (writable && pattern) {
            p[0] = pattern;
            p[n - 1] = (unsigned char)(pattern + 1);
            FUZZ_CHECK(same_as_file(m->memfd, off, p, n), "a write did not reach the file");
        }
    }
}

static void one_scenario(fuzz_in *in) {
    made m;
    make_fd(in, &m);
    uint8_t op = take_u8(in);
    unsigned flags = (op & 2) ? LSHM_STORAGE_READONLY : 0;
    if (op & 4)
        flags |= 1u << (take_u8(in) % 32); /* maybe an unknown flag */
    uint8_t fault = take_u8(in);
    static const int fault_errs[] = {-ENOMEM, -EMFILE, -ENOSPC, -EPERM, -EBADF};
    uint8_t pattern = take_u8(in);

    if (op & 1) {
        uint64_t offset = take_u64(in);
        uint64_t nbytes = take_u64(in);
        if (take_bool(in)) { /* keep them plausible half of the time */
            offset %= MAX_FILE + 4096;
            nbytes %= MAX_FILE + 4096;
        }
        lshm_storage *s = (lshm_storage *)(uintptr_t)0x1234;
        if (fault & 0x80)
            lshm__fault_arm(1 + (fault & 7), fault_errs[(fault >> 3) % 5]);
        int rc = lshm_storage_attach(m.fd, offset, (size_t)nbytes, flags, &s);
        lshm__fault_arm(0, 0);
        FUZZ_CHECK(documented(rc), "lshm_storage_attach(fd %d, %llu, %llu, 0x%x) returned %d",
                   m.fd, (unsigned long long)offset, (unsigned long long)nbytes, flags, rc);
        if (rc != 0) {
            FUZZ_CHECK(s == (lshm_storage *)(uintptr_t)0x1234, "out written on failure");
        } else {
            FUZZ_CHECK(lshm_storage_nbytes(s) == nbytes, "nbytes %zu, asked %llu",
                       lshm_storage_nbytes(s), (unsigned long long)nbytes);
            unsigned sf = lshm_storage_flags(s);
            FUZZ_CHECK((sf & LSHM_STORAGE_SHARED) && (sf & LSHM_STORAGE_READONLY) == (flags & LSHM_STORAGE_READONLY),
                       "flags 0x%x for attach flags 0x%x", sf, flags);
            unsigned char *p = lshm_storage_data(s);
            FUZZ_CHECK((p == NULL) == (nbytes == 0), "data %p for %llu bytes", (void *)p,
                       (unsigned long long)nbytes);
            int sfd = -1;
            uint64_t soff = 1;
            FUZZ_CHECK(lshm_storage_fd(s, &sfd, &soff) == 0 && sfd >= 0 && soff == offset,
                       "lshm_storage_fd: fd %d offset %llu", sfd, (unsigned long long)soff);
            if (m.memfd >= 0)
                FUZZ_CHECK(size_sealed(m.memfd), "an attached fd can still change size");
            check_mapping(&m, p, (size_t)nbytes, offset, !(flags & LSHM_STORAGE_READONLY),
                          pattern);
            lshm_storage_release(s);
        }
    } else {
        lshm_segment *seg = (lshm_segment *)(uintptr_t)0x1234;
        if (fault & 0x80)
            lshm__fault_arm(1 + (fault & 7), fault_errs[(fault >> 3) % 5]);
        int rc = lshm_segment_attach(m.fd, flags, &seg);
        lshm__fault_arm(0, 0);
        FUZZ_CHECK(documented(rc), "lshm_segment_attach(fd %d, 0x%x) returned %d", m.fd, flags,
                   rc);
        if (rc != 0) {
            FUZZ_CHECK(seg == (lshm_segment *)(uintptr_t)0x1234, "out written on failure");
        } else {
            size_t n = lshm_segment_size(seg);
            unsigned char *p = lshm_segment_data(seg);
            FUZZ_CHECK((p == NULL) == (n == 0), "data %p for %zu bytes", (void *)p, n);
            FUZZ_CHECK(lshm_segment_flags(seg) == (flags & LSHM_STORAGE_READONLY),
                       "segment flags 0x%x", lshm_segment_flags(seg));
            if (m.memfd >= 0) {
                FUZZ_CHECK(size_sealed(m.memfd), "an attached fd can still change size");
                FUZZ_CHECK(lseek(m.memfd, 0, SEEK_END) == (off_t)n, "size %zu != file size", n);
            }
            check_mapping(&m, p, n, 0, !(flags & LSHM_STORAGE_READONLY), pattern);
            /* a view of the segment with fuzzed bounds */
            uint64_t voff = take_u64(in), vn = take_u64(in);
            lshm_storage *v = NULL;
            int vrc = lshm_storage_create_view(seg, voff, (size_t)vn, 0, &v);
            FUZZ_CHECK(vrc == 0 || vrc == -EINVAL || vrc == -ENOMEM, "create_view returned %d",
                       vrc);
            if (vrc == 0) {
                FUZZ_CHECK(voff <= n && vn <= n - voff, "view [%llu,+%llu) of %zu bytes accepted",
                           (unsigned long long)voff, (unsigned long long)vn, n);
                (void)read_all(lshm_storage_data(v), (size_t)vn);
            }
            if (take_bool(in))
                (void)lshm_segment_close_fd(seg);
            lshm_segment_release(seg);
            lshm_storage_release(v);
        }
    }
    if (m.close1 >= 0)
        close(m.close1);
    if (m.close2 >= 0)
        close(m.close2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_in in = {data, size};
    int before = count_fds();
    int scenarios = 1 + take_u8(&in) % 4;
    for (int i = 0; i < scenarios; i++)
        one_scenario(&in);
    int after = count_fds();
    FUZZ_CHECK(after <= before, "fd leak: %d fds open before the input, %d after", before, after);
    return 0;
}
