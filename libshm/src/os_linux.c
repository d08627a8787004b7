/*
 * os_linux.c -- the OS layer: every memory and fd syscall of libshm lives here.
 *
 * The rest of the library speaks in terms of "make a sealed memfd", "map this fd here",
 * "reserve its pages"; this file turns those into memfd_create, ftruncate, fcntl seals,
 * fallocate, pwrite, mmap/mremap/munmap, fstat and sysconf (mimalloc keeps its OS calls
 * behind src/prim/ for the same reason). Each wrapper:
 *   - captures errno on the spot and returns it negated (errno is never the channel),
 *   - records a message with the syscall and its sizes through LSHM_FAIL,
 *   - passes an LSHM_FAULT point first, so tests can fail every step of every operation.
 */
#include "internal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#if __has_include(<sys/single_threaded.h>)
#include <sys/single_threaded.h> /* glibc 2.32 */
#define LSHM_HAVE_SINGLE_THREADED 1
#endif

#if __has_include(<linux/userfaultfd.h>)
#include <linux/userfaultfd.h>
#define LSHM_HAVE_UFFD 1
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1 /* Linux 5.11 */
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13) /* Linux 6.4; older headers lack the name */
#endif
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1; older libc headers lack the name */
#endif

/* An injected fault behaves like the syscall failing with the armed code. */
#define LSHM_OS_FAULT(site)                                                                   \
    do {                                                                                      \
        int fault_ = LSHM_FAULT(site);                                                        \
        if (fault_ != 0)                                                                      \
            return LSHM_FAIL(fault_, "%s: injected fault (%s)", site, lshm_strerror(fault_)); \
    } while (0)

/* sysconf is cheap but not free, and the page size and CPU count do not change while we run
 * (CPU hotplug aside, which only tunes a heuristic): ask once. */
static long cached_sysconf(_Atomic long *cache, int name, long fallback) {
    long v = atomic_load_explicit(cache, memory_order_relaxed);
    if (v == 0) {
        v = sysconf(name);
        if (v <= 0)
            v = fallback;
        atomic_store_explicit(cache, v, memory_order_relaxed);
    }
    return v;
}

size_t lshm__os_page_size(void) {
    static _Atomic long cached;
    return (size_t)cached_sysconf(&cached, _SC_PAGESIZE, 4096);
}

unsigned lshm__os_ncpu(void) {
    static _Atomic long cached;
    return (unsigned)cached_sysconf(&cached, _SC_NPROCESSORS_ONLN, 1);
}

/* This machine's RAM and swap in bytes, from one sysinfo read once (*ram 0: unknown): what it
 * could ever give a memfd is their sum. (memory_room asks at every memfd; sysconf's
 * _SC_PHYS_PAGES is a sysinfo call each time.) */
static void machine_memory(uint64_t *ram, uint64_t *swap) {
    static _Atomic uint64_t cached_ram, cached_swap; /* cached_ram 0: not read yet */
    uint64_t r = atomic_load_explicit(&cached_ram, memory_order_acquire);
    if (r == 0) {
        struct sysinfo si;
        if (sysinfo(&si) != 0) {
            *ram = *swap = 0;
            return;
        }
        uint64_t unit = si.mem_unit ? si.mem_unit : 1;
        atomic_store_explicit(&cached_swap, (uint64_t)si.totalswap * unit, memory_order_relaxed);
        r = (uint64_t)si.totalram * unit;
        atomic_store_explicit(&cached_ram, r, memory_order_release); /* (after the swap) */
    }
    *ram = r;
    *swap = atomic_load_explicit(&cached_swap, memory_order_relaxed);
}

/* The number in a cgroup limit file (digits, or "max": UINT64_MAX); 0 when it cannot be read. */
static uint64_t read_limit(const char *path) {
    char buf[32];
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0)
        return 0;
    ssize_t n = read(f, buf, sizeof buf - 1);
    close(f);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    if (strncmp(buf, "max", 3) == 0)
        return UINT64_MAX;
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(buf, &end, 10);
    return errno == 0 && end != buf ? (uint64_t)v : 0;
}

/* The smallest memory limit of the cgroup `path` (as /proc/self/cgroup names it) under the
 * hierarchy mounted at `root` and of every cgroup above it: each one caps all below it. Where
 * the path is not there (a container that sees its own cgroup as the mount's root) the root's
 * limit still counts. UINT64_MAX: none. */
static uint64_t smallest_limit(const char *root, const char *path, size_t path_len,
                               const char *file) {
    uint64_t least = UINT64_MAX;
    char full[4096];
    for (;;) {
        while (path_len > 0 && path[path_len - 1] == '/')
            path_len--;
        int n = snprintf(full, sizeof full, "%s%.*s/%s", root, (int)path_len, path, file);
        uint64_t limit = n > 0 && (size_t)n < sizeof full ? read_limit(full) : 0;
        if (limit > 0 && limit < least)
            least = limit;
        if (path_len == 0)
            return least;
        while (path_len > 0 && path[path_len - 1] != '/')
            path_len--;
    }
}

/* This process's memory cgroup limit (cgroup v1's memory.limit_in_bytes, or v2's memory.max,
 * the smallest of its cgroup and those above), read once, as machine_memory (a process moved to
 * another cgroup later keeps the first answer). UINT64_MAX: no limit, or none could be read. */
static uint64_t cgroup_limit(void) {
    static _Atomic uint64_t cached; /* 0: not read yet */
    uint64_t r = atomic_load_explicit(&cached, memory_order_relaxed);
    if (r != 0)
        return r;
    char buf[8192];
    int f = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    ssize_t len = f < 0 ? -1 : read(f, buf, sizeof buf - 1);
    if (f >= 0)
        close(f);
    uint64_t limit = UINT64_MAX;
    for (char *line = buf; len > 0 && line < buf + len;) {
        /* "hierarchy-id:controllers:path"; v1's memory controller, else v2's "0::path" */
        char *eol = memchr(line, '\n', (size_t)(buf + len - line));
        char *next = eol != NULL ? eol + 1 : buf + len;
        char *c1 = memchr(line, ':', (size_t)(next - line));
        char *c2 = c1 != NULL ? memchr(c1 + 1, ':', (size_t)(next - c1 - 1)) : NULL;
        if (c2 != NULL) {
            const char *path = c2 + 1;
            size_t path_len = (size_t)((eol != NULL ? eol : next) - path);
            int v1 = 0;
            for (const char *item = c1 + 1; item < c2;) { /* "cpu,memory": items */
                const char *comma = memchr(item, ',', (size_t)(c2 - item));
                const char *item_end = comma != NULL ? comma : c2;
                if (item_end - item == 6 && memcmp(item, "memory", 6) == 0)
                    v1 = 1;
                item = item_end + 1;
            }
            if (v1) {
                limit = smallest_limit("/sys/fs/cgroup/memory", path, path_len,
                                       "memory.limit_in_bytes");
                break;
            }
            if (c2 == c1 + 1 && line[0] == '0' && c1 == line + 1 &&
                access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0)
                limit = smallest_limit("/sys/fs/cgroup", path, path_len, "memory.max");
        }
        line = next;
    }
    atomic_store_explicit(&cached, limit, memory_order_relaxed);
    return limit;
}

/* What this process's memory cgroup lets it hold: its limit plus the machine's swap (shared
 * memory can be swapped out; a cgroup's own swap limit is left out, so this never says less
 * than there is). UINT64_MAX: no limit. */
static uint64_t cgroup_bytes(void) {
    uint64_t limit = cgroup_limit(), ram, swap;
    machine_memory(&ram, &swap);
    if (limit == UINT64_MAX || ram == 0)
        return UINT64_MAX; /* (no limit, or the swap unknown: no limit from here) */
    return limit > UINT64_MAX - swap ? UINT64_MAX : limit + swap;
}

uint64_t lshm__os_memory_bytes(void) {
    uint64_t limit = cgroup_limit(), ram, swap;
    machine_memory(&ram, &swap);
    if (ram == 0 || limit < ram)
        return limit == UINT64_MAX ? 0 : limit;
    return ram;
}

/* Every page of our memfds is allocated before anyone maps them (no SIGBUS later), and an
 * allocation beyond what the process can hold does not fail: it ends in an OOM killer, the
 * machine's (which picks its victims among all processes) or its memory cgroup's (which
 * SIGKILLs this process or another one of its container). So a memfd of more than either is
 * -ENOMEM at once. */
static int memory_room(uint64_t size) {
    uint64_t ram, swap;
    machine_memory(&ram, &swap);
    uint64_t machine = ram + swap;
    if (ram > 0 && size > machine)
        return LSHM_FAIL(-ENOMEM, "a memfd of %llu bytes: more than this machine's memory "
                         "(RAM and swap: %llu bytes)", (unsigned long long)size,
                         (unsigned long long)machine);
    uint64_t cgroup = cgroup_bytes();
    if (size > cgroup)
        return LSHM_FAIL(-ENOMEM, "a memfd of %llu bytes: more than this process's memory "
                         "cgroup lets it hold (its memory limit, and swap: %llu bytes)",
                         (unsigned long long)size, (unsigned long long)cgroup);
    return 0;
}

int lshm__os_memfd_create(size_t nbytes, int *fd) {
    LSHM_OS_FAULT("memfd_create");
    int rc = memory_room(nbytes);
    if (rc != 0)
        return rc;
    int r = memfd_create("lshm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (r < 0) {
        int e = errno;
        return LSHM_FAIL(-e, "memfd_create for %zu bytes: %s", nbytes, strerror(e));
    }
    *fd = r;
    return 0;
}

/* RLIMIT_FSIZE holds for memfds too, and a write or ftruncate that would take a file past it
 * does not just fail (EFBIG): the kernel sends SIGXFSZ first, whose default action kills the
 * process (Python ignores it; a C program dies). So what would end past it is -EFBIG here,
 * without the signal. Whether [0, end) goes past the limit (then in *limit). */
static int past_file_size_limit(uint64_t end, uint64_t *limit) {
    struct rlimit lim;
    if (getrlimit(RLIMIT_FSIZE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY ||
        end <= (uint64_t)lim.rlim_cur)
        return 0;
    *limit = (uint64_t)lim.rlim_cur;
    return 1;
}

/* -EFBIG, with a message naming the call (`what`) on fd, where [0, end) goes past the limit. */
static int file_size_room(uint64_t end, const char *what, int fd) {
    uint64_t limit;
    if (!past_file_size_limit(end, &limit))
        return 0;
    return LSHM_FAIL(-EFBIG, "%s(fd %d) up to %llu bytes: past RLIMIT_FSIZE (%llu bytes)", what,
                     fd, (unsigned long long)end, (unsigned long long)limit);
}

int lshm__os_ftruncate(int fd, uint64_t size) {
    LSHM_OS_FAULT("ftruncate");
    if (size > (uint64_t)INT64_MAX)
        return LSHM_FAIL(-EOVERFLOW, "ftruncate to %llu bytes: too large",
                         (unsigned long long)size);
    int rc = file_size_room(size, "ftruncate", fd);
    if (rc != 0)
        return rc;
    if (ftruncate(fd, (off_t)size) != 0) {
        int e = errno;
        return LSHM_FAIL(-e, "ftruncate(fd %d, %llu bytes): %s", fd, (unsigned long long)size,
                         strerror(e));
    }
    return 0;
}

int lshm__os_memfd_sized(uint64_t size, int *fd) {
    if (size > SIZE_MAX) /* (a 32-bit size_t, which memory_room is given: no such memfd) */
        return LSHM_FAIL(-ENOMEM, "a memfd of %llu bytes: more than this process can address",
                         (unsigned long long)size);
    int rc = lshm__os_memfd_create((size_t)size, fd);
    if (rc != 0)
        return rc;
    if ((rc = lshm__os_ftruncate(*fd, size)) != 0 || (rc = lshm__os_seal_size(*fd)) != 0) {
        lshm__os_close(*fd);
        *fd = -1;
    }
    return rc;
}

static int add_seals(int fd, int seals, const char *what) {
    if (fcntl(fd, F_ADD_SEALS, seals) != 0) {
        int e = errno;
        return LSHM_FAIL(-e, "fcntl(fd %d, F_ADD_SEALS, %s): %s", fd, what, strerror(e));
    }
    return 0;
}

int lshm__os_seal_size(int fd) {
    LSHM_OS_FAULT("seal_size");
    return add_seals(fd, F_SEAL_SHRINK | F_SEAL_GROW, "F_SEAL_SHRINK|F_SEAL_GROW");
}

static int get_seals(int fd, int *seals) {
    int r = fcntl(fd, F_GET_SEALS);
    if (r < 0) {
        int e = errno;
        return LSHM_FAIL(-e, "fcntl(fd %d, F_GET_SEALS): %s", fd, strerror(e));
    }
    *seals = r;
    return 0;
}

/* Add F_SEAL_SEAL to fd, which lacks it. */
static int add_seal_seal(int fd) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) {
        int e = errno;
        return LSHM_FAIL(-e, "fcntl(fd %d, F_GETFL): %s", fd, strerror(e));
    }
    /* The kernel lets only a writable open file add seals: holders of a read-only fd never can,
     * and we cannot either (nor need to). */
    if ((fl & O_ACCMODE) == O_RDONLY)
        return 0;
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SEAL) == 0)
        return 0;
    int e = errno, seals = 0;
    /* EPERM: F_SEAL_SEAL is there already, added meanwhile by another thread (two threads
     * handing out the fd at once) or another holder of the memfd: what we wanted. */
    if (e == EPERM && get_seals(fd, &seals) == 0 && (seals & F_SEAL_SEAL) != 0)
        return 0;
    return LSHM_FAIL(-e, "fcntl(fd %d, F_ADD_SEALS, F_SEAL_SEAL): %s", fd, strerror(e));
}

int lshm__os_seal_seal(int fd) {
    LSHM_OS_FAULT("seal_seal");
    int seals = 0;
    int rc = get_seals(fd, &seals);
    if (rc != 0)
        return rc;
    return (seals & F_SEAL_SEAL) != 0 ? 0 : add_seal_seal(fd);
}

int lshm__os_seal_readonly(int fd) {
    LSHM_OS_FAULT("seal_future_write");
    int seals = 0;
    int rc = get_seals(fd, &seals);
    if (rc != 0)
        return rc;
    if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) {
        /* Already read-only for new mappings (idempotent); close it for good if not yet. */
        return (seals & F_SEAL_SEAL) != 0 ? 0 : add_seal_seal(fd);
    }
    if ((seals & F_SEAL_SEAL) != 0)
        return LSHM_FAIL(-EPERM,
                         "fd %d was already handed out writable (F_SEAL_SEAL is set, so it can "
                         "never be sealed read-only); make a copy to share read-only",
                         fd);
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) == 0)
        return 0;
    int e = errno;
    /* EPERM: someone sealed it meanwhile; read-only is fine (as above), only F_SEAL_SEAL
     * alone (handed out writable) is a refusal. */
    if (e == EPERM && get_seals(fd, &seals) == 0) {
        if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0)
            return 0;
        if ((seals & F_SEAL_SEAL) != 0)
            return LSHM_FAIL(-EPERM,
                             "fd %d was handed out writable meanwhile (F_SEAL_SEAL is set, so it "
                             "can never be sealed read-only); make a copy to share read-only",
                             fd);
    }
    return LSHM_FAIL(-e, "fcntl(fd %d, F_ADD_SEALS, F_SEAL_FUTURE_WRITE|F_SEAL_SEAL): %s", fd,
                     strerror(e));
}

/* pwrite's loop; a short write is checked against RLIMIT_FSIZE before the next one (the
 * kernel shortens a write that straddles the limit, then signals at it). */
static int pwrite_loop(int fd, const char *p, size_t n, uint64_t offset) {
    while (n > 0) {
        /* Linux writes at most 0x7ffff000 bytes per call; the loop also covers short writes. */
        ssize_t w = pwrite(fd, p, n, (off_t)offset);
        if (w < 0) {
            int e = errno;
            if (e == EINTR)
                continue;
            if (e == EFBIG) /* (the limit came down since the file was sized) */
                return LSHM_FAIL(-e, "pwrite(fd %d, %zu bytes at %llu): past RLIMIT_FSIZE", fd,
                                 n, (unsigned long long)offset);
            return LSHM_FAIL(-e, "pwrite(fd %d, %zu bytes at %llu): %s", fd, n,
                             (unsigned long long)offset, strerror(e));
        }
        if (w == 0) /* cannot happen on shmem; never spin */
            return LSHM_FAIL(-EIO, "pwrite(fd %d) wrote nothing with %zu bytes left", fd, n);
        p += w;
        n -= (size_t)w;
        offset += (uint64_t)w;
        int rc = n > 0 ? file_size_room(offset + n, "pwrite", fd) : 0;
        if (rc != 0)
            return rc;
    }
    return 0;
}

int lshm__os_pwrite_all(int fd, const void *buf, size_t n, uint64_t offset) {
    LSHM_OS_FAULT("pwrite");
    int rc = n > 0 ? file_size_room(offset + n, "pwrite", fd) : 0;
    return rc != 0 ? rc : pwrite_loop(fd, buf, n, offset);
}

int lshm__os_pwrite_inside(int fd, const void *buf, size_t n, uint64_t offset) {
    LSHM_OS_FAULT("pwrite");
    return pwrite_loop(fd, buf, n, offset);
}

static void signal_set_of(sigset_t *set, int sig) {
    sigemptyset(set);
    sigaddset(set, sig);
}

void lshm__os_file_size_signal_hold(sigset_t *old) {
    sigset_t xfsz;
    signal_set_of(&xfsz, SIGXFSZ);
    (void)pthread_sigmask(SIG_BLOCK, &xfsz, old); /* (fails only for a bad `how`) */
}

void lshm__os_file_size_signal_release(const sigset_t *old, int rc) {
    if (rc == -EFBIG && !sigismember(old, SIGXFSZ)) {
        /* The write that failed raised it for this thread (the kernel sends it to the
         * writer); none was pending before, since it was not held back. */
        sigset_t xfsz;
        signal_set_of(&xfsz, SIGXFSZ);
        const struct timespec now = {0, 0};
        while (sigtimedwait(&xfsz, NULL, &now) < 0 && errno == EINTR)
            ;
    }
    (void)pthread_sigmask(SIG_SETMASK, old, NULL);
}

/* Allocate [offset, offset + len) of fd's pages now; a file system without fallocate is not an
 * error (its pages then arrive on first touch). No fault point: the callers have theirs. */
static int fallocate_range(int fd, uint64_t offset, uint64_t len) {
    if (len == 0 || fallocate(fd, 0, (off_t)offset, (off_t)len) == 0)
        return 0;
    int e = errno;
    if (e == EOPNOTSUPP)
        return 0;
    return LSHM_FAIL(-e, "fallocate(fd %d, %llu bytes at %llu): %s", fd, (unsigned long long)len,
                     (unsigned long long)offset, strerror(e));
}

int lshm__os_punch_hole(int fd, uint64_t offset, uint64_t len) {
    if (len == 0 || fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset,
                              (off_t)len) == 0)
        return 0;
    return -errno;
}

void lshm__os_allocate_ahead(int fd, uint64_t offset, uint64_t len) {
    if (len > 0)
        (void)fallocate(fd, 0, (off_t)offset, (off_t)len);
}

int lshm__os_reserve(int fd, uint64_t size) {
    LSHM_OS_FAULT("fallocate");
    return fallocate_range(fd, 0, size);
}

int lshm__os_populate_write(int fd, uint64_t offset, void *addr, size_t len) {
    LSHM_OS_FAULT("populate");
    if (len == 0)
        return 0;
    for (;;) {
        if (madvise(addr, len, MADV_POPULATE_WRITE) == 0)
            return 0;
        int e = errno;
        if (e == EINTR)
            continue;
        if (e == EINVAL) /* kernel older than 5.14: reserve the range instead */
            return fallocate_range(fd, offset, len);
        /* EFAULT is what populating reports where a plain write would have raised SIGBUS. */
        if (e == EFAULT)
            e = ENOMEM;
        return LSHM_FAIL(-e, "madvise(%p, %zu bytes, MADV_POPULATE_WRITE): %s", addr, len,
                         strerror(e));
    }
}

int lshm__os_check_mapped(const void *p, size_t len) {
    if (len == 0)
        return 0;
    size_t page = lshm__os_page_size();
    uintptr_t at = (uintptr_t)lshm__page_floor((uintptr_t)p);
    uintptr_t end = (uintptr_t)p + len;
    unsigned char resident[4096]; /* mincore's answer, unused: 16 MiB of pages per call */
    while (at < end) {
        size_t pages = (end - at + page - 1) / page;
        if (pages > sizeof resident)
            pages = sizeof resident;
        if (mincore((void *)at, pages * page, resident) != 0) {
            int e = errno;
            if (e != ENOMEM) /* (EAGAIN, EINVAL: not what a hole looks like; let it be) */
                return 0;
            return LSHM_FAIL(-EFAULT, "source bytes in [%p, %p) are not mapped (mincore: %s)",
                             (void *)at, (void *)(at + pages * page), strerror(e));
        }
        at += pages * page;
    }
    return 0;
}

int lshm__round_pages(size_t nbytes, size_t *out) {
    size_t page = lshm__os_page_size();
    if (nbytes > SIZE_MAX - (page - 1))
        return LSHM_FAIL(-EOVERFLOW, "%zu bytes cannot be rounded up to whole pages", nbytes);
    *out = (nbytes + page - 1) & ~(page - 1);
    return 0;
}

uint64_t lshm__page_floor(uint64_t x) {
    return x & ~(uint64_t)(lshm__os_page_size() - 1);
}

int lshm__page_aligned(uint64_t x) {
    return (x & (uint64_t)(lshm__os_page_size() - 1)) == 0;
}

int lshm__os_fault_point(const char *site) {
    LSHM_OS_FAULT(site);
    return 0;
}

/* What an ENOMEM from a call that may split a mapping can also mean: each split adds one to
 * the process's mappings, which the kernel bounds (vm.max_map_count, 65,530 by default). */
#define MAP_LIMIT_HINT " (out of memory, or this process is at its limit of mappings: " \
                       "vm.max_map_count)"

int lshm__os_map_fd(int fd, uint64_t offset, size_t len, int readonly, void *fixed, void **out) {
    LSHM_OS_FAULT("mmap_fd");
    int prot = readonly ? PROT_READ : PROT_READ | PROT_WRITE;
    int flags = MAP_SHARED | (fixed != NULL ? MAP_FIXED : 0);
    void *p = mmap(fixed, len, prot, flags, fd, (off_t)offset);
    if (p == MAP_FAILED) {
        int e = errno;
        return LSHM_FAIL(-e, "mmap(fd %d, %zu bytes at offset %llu%s%s): %s%s", fd, len,
                         (unsigned long long)offset, readonly ? ", read-only" : "",
                         fixed != NULL ? ", fixed" : "", strerror(e),
                         e == ENOMEM ? MAP_LIMIT_HINT : "");
    }
    assert(fixed == NULL || p == fixed);
    *out = p;
    return 0;
}

/* Not a fault point and no error message: it only undoes part of a share that failed, whose
 * message must stay the one the caller reads. */
int lshm__os_map_fd_private_fixed(int fd, uint64_t offset, size_t len, void *addr) {
    void *p = mmap(addr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, (off_t)offset);
    return p == MAP_FAILED ? -errno : 0;
}

int lshm__os_map_anon(size_t len, void **out) {
    LSHM_OS_FAULT("mmap_anon");
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        return LSHM_FAIL(-e, "mmap(anonymous, %zu bytes): %s", len, strerror(e));
    }
    *out = p;
    return 0;
}

int lshm__os_map_anon_fixed(void *addr, size_t len) {
    LSHM_OS_FAULT("mmap_anon_fixed");
    void *p = mmap(addr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                   -1, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        return LSHM_FAIL(-e, "mmap(anonymous, fixed at %p, %zu bytes): %s%s", addr, len,
                         strerror(e), e == ENOMEM ? MAP_LIMIT_HINT : "");
    }
    assert(p == addr);
    return 0;
}

int lshm__os_huge_wanted(void) {
    static _Atomic int wanted = -1; /* -1: not read yet */
    int w = atomic_load_explicit(&wanted, memory_order_relaxed);
    if (w < 0) {
        const char *env = getenv("LSHM_HUGE");
        w = !(env != NULL && strcmp(env, "0") == 0);
        atomic_store_explicit(&wanted, w, memory_order_relaxed);
    }
    return w;
}

/* Best effort: THP "never", prctl(PR_SET_THP_DISABLE) or an old kernel make this a no-op or
 * EINVAL, and small pages are what the range then gets. */
static void advise_huge(void *addr, size_t len) {
    (void)madvise(addr, len, MADV_HUGEPAGE);
}

/* Of a fresh mapping [p, p + over), over = len + 2 MiB - 1 page: unmap what lies before its
 * first 2 MiB boundary and after len bytes from there; returns that boundary, or NULL (all
 * of it given back, or as much as can be) when a trim fails: the kernel merged the mapping
 * with a neighbour, and cutting it out needs one more mapping than vm.max_map_count allows. */
static void *trim_to_aligned(void *p, size_t over, size_t len) {
    const size_t huge = LSHM__HUGE_BYTES;
    uintptr_t start = (uintptr_t)p, aligned = (start + huge - 1) & ~(uintptr_t)(huge - 1);
    if (aligned > start && munmap(p, aligned - start) != 0) {
        lshm__os_unmap(p, over);
        return NULL;
    }
    if (start + over > aligned + len &&
        munmap((void *)(aligned + len), start + over - (aligned + len)) != 0) {
        lshm__os_unmap((void *)aligned, start + over - aligned);
        return NULL;
    }
    return (void *)aligned;
}

/* An anonymous mapping of len bytes wherever the kernel puts it: see map_aligned. */
static int map_anywhere(size_t len, int placeholder, void **out) {
    void *p = mmap(NULL, len, placeholder ? PROT_NONE : PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | (placeholder ? MAP_NORESERVE : 0), -1, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        return LSHM_FAIL(-e, "mmap(anonymous%s, %zu bytes): %s",
                         placeholder ? " placeholder" : "", len, strerror(e));
    }
    *out = p;
    return 0;
}

/* An anonymous mapping of exactly len bytes at a 2 MiB-aligned address: a huge page more than
 * needed is mapped, then trimmed (where the trim cannot be made, at vm.max_map_count: len
 * bytes anywhere, small pages then). `placeholder`: PROT_NONE and MAP_NORESERVE, for a mapping
 * about to replace it (MAP_FIXED, mremap MREMAP_FIXED), so it commits no memory meanwhile;
 * else private read-write zero pages. */
static int map_aligned(size_t len, int placeholder, void **out) {
    const size_t huge = LSHM__HUGE_BYTES;
    LSHM_OS_FAULT(placeholder ? "mmap_reserve" : "mmap_anon");
    if (len > SIZE_MAX - huge)
        return LSHM_FAIL(-ENOMEM, "no %zu-byte range to map", len);
    size_t over = len + huge - lshm__os_page_size();
    void *p = NULL;
    int rc = map_anywhere(over, placeholder, &p);
    if (rc != 0)
        return rc;
    if ((*out = trim_to_aligned(p, over, len)) == NULL)
        return map_anywhere(len, placeholder, out);
    return 0;
}

int lshm__os_map_anon_pages(size_t len, void **out) {
    if (len < LSHM__HUGE_BYTES || !lshm__os_huge_wanted())
        return lshm__os_map_anon(len, out);
    int rc = map_aligned(len, 0, out);
    if (rc == 0)
        advise_huge(*out, len);
    return rc;
}

/* Set once MADV_COLLAPSE was refused for good (EINVAL, EPERM): THP disabled for the process
 * (prctl(PR_SET_THP_DISABLE)), shmem_enabled "deny", a kernel before 6.1 or without THP. */
static _Atomic int collapse_refused;

int lshm__os_collapse_wanted(void) {
    return lshm__os_huge_wanted() && !atomic_load_explicit(&collapse_refused, memory_order_relaxed);
}

int lshm__os_collapse(int fd, uint64_t offset, void *addr, size_t len) {
    static const char zero = 0;
    if (atomic_load_explicit(&collapse_refused, memory_order_relaxed))
        return -EINVAL;
    uint64_t limit, last = offset + (len - 1) / LSHM__HUGE_BYTES * LSHM__HUGE_BYTES;
    if (len > 0 && past_file_size_limit(last + 1, &limit)) /* (its byte written below) */
        return -EFBIG;
    for (size_t off = 0; off < len; off += LSHM__HUGE_BYTES)
        if (pwrite(fd, &zero, 1, (off_t)(offset + off)) != 1)
            return -errno;
    if (len == 0 || madvise(addr, len, MADV_COLLAPSE) == 0)
        return 0;
    int e = errno;
    if (e == EINVAL || e == EPERM)
        atomic_store_explicit(&collapse_refused, 1, memory_order_relaxed);
    return -e;
}

int lshm__os_map_fd_aligned(int fd, size_t len, int readonly, void **out) {
    if (len < LSHM__HUGE_BYTES || !lshm__os_huge_wanted())
        return lshm__os_map_fd(fd, 0, len, readonly, NULL, out);
    void *at = NULL, *p = NULL;
    int rc = map_aligned(len, 1, &at);
    if (rc != 0)
        return rc;
    if ((rc = lshm__os_map_fd(fd, 0, len, readonly, at, &p)) != 0) {
        lshm__os_unmap(at, len);
        return rc;
    }
    *out = p;
    return 0;
}

int lshm__os_map_new_memfd(int fd, uint64_t size, size_t map_len, void **out) {
    const size_t huge = LSHM__HUGE_BYTES;
    int rc;
    if (map_len < huge || !lshm__os_huge_wanted()) {
        if ((rc = lshm__os_reserve(fd, size)) == 0 && map_len > 0)
            rc = lshm__os_map_fd(fd, 0, map_len, 0, NULL, out);
        return rc;
    }
    void *p = NULL;
    if ((rc = lshm__os_map_fd_aligned(fd, map_len, 0, &p)) != 0)
        return rc;
    (void)lshm__os_collapse(fd, 0, p, (size_t)(size / huge * huge)); /* (refused: small pages) */
    if ((rc = lshm__os_reserve(fd, size)) != 0) { /* the rest, in small pages */
        lshm__os_unmap(p, map_len);
        return rc;
    }
    *out = p;
    return 0;
}

int lshm__os_remap_pages(void *old, size_t old_len, size_t new_len, void **out) {
    if (new_len <= old_len || new_len < LSHM__HUGE_BYTES || !lshm__os_huge_wanted())
        return lshm__os_remap(old, old_len, new_len, out); /* shrinking never moves */
    LSHM_OS_FAULT("mremap");
    /* Aligned already: grow where it is if the range after it is free (the pages keep their
     * MADV_HUGEPAGE when they had 2 MiB already). */
    if ((uintptr_t)old % LSHM__HUGE_BYTES == 0 &&
        mremap(old, old_len, new_len, 0) != MAP_FAILED) {
        if (old_len < LSHM__HUGE_BYTES)
            advise_huge(old, new_len);
        *out = old;
        return 0;
    }
    /* Else move the pages onto a fresh aligned range (mremap MREMAP_FIXED replaces it), so the
     * storage stays aligned wherever the kernel would have put it. */
    void *q = NULL;
    int rc = map_aligned(new_len, 1, &q);
    if (rc != 0)
        return rc;
    void *p = mremap(old, old_len, new_len, MREMAP_MAYMOVE | MREMAP_FIXED, q);
    if (p == MAP_FAILED) {
        int e = errno;
        lshm__os_unmap(q, new_len);
        return LSHM_FAIL(-e, "mremap(%p, %zu -> %zu bytes, to %p): %s", old, old_len, new_len,
                         q, strerror(e));
    }
    advise_huge(p, new_len); /* (the moved pages keep the flags of their old mapping) */
    *out = p;
    return 0;
}

int lshm__os_remap(void *old, size_t old_len, size_t new_len, void **out) {
    LSHM_OS_FAULT("mremap");
    void *p = mremap(old, old_len, new_len, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) {
        int e = errno;
        return LSHM_FAIL(-e, "mremap(%p, %zu -> %zu bytes): %s", old, old_len, new_len,
                         strerror(e));
    }
    *out = p;
    return 0;
}

/* Ranges whose munmap failed, unmapped again at each later lshm__os_unmap. munmap fails with
 * ENOMEM when the range lies inside a mapping the kernel merged with its neighbours (storages
 * made one after the other are such neighbours) and cutting it out needs one more mapping than
 * vm.max_map_count allows. A range stays ours while it is mapped, so unmapping it later never
 * touches anyone else's memory. fork() takes the lock in its prepare handler (fork.c), so a
 * child finds the list whole. The list grows as needed; a range that finds no memory for it
 * stays mapped (its memory freed, see lshm__os_unmap). */
static pthread_mutex_t deferred_lock = PTHREAD_MUTEX_INITIALIZER;
struct deferred_range {
    void *addr;
    size_t len;
};
static struct deferred_range *deferred;
static size_t deferred_room;
static _Atomic size_t deferred_count;

void lshm__os_prepare_fork(void) {
    pthread_mutex_lock(&deferred_lock);
}

void lshm__os_after_fork(void) {
    pthread_mutex_unlock(&deferred_lock);
}

/* At most this many ranges fail per try: a free at the limit costs a few failed munmaps, not
 * one per range waiting. The ranges that failed go last, so that the others come first next
 * time (a range cut out of a mapping fails while the one next to it, a whole mapping once its
 * neighbours went, may not). */
#define DEFERRED_FAILS_PER_TRY 4

static void unmap_deferred(void) {
    if (atomic_load_explicit(&deferred_count, memory_order_relaxed) == 0)
        return;
    pthread_mutex_lock(&deferred_lock);
    size_t n = atomic_load_explicit(&deferred_count, memory_order_relaxed);
    struct deferred_range failed[DEFERRED_FAILS_PER_TRY];
    size_t fails = 0, kept = 0, i = 0;
    for (; i < n && fails < DEFERRED_FAILS_PER_TRY; i++)
        if (munmap(deferred[i].addr, deferred[i].len) != 0)
            failed[fails++] = deferred[i];
    for (; i < n; i++) /* (not tried) */
        deferred[kept++] = deferred[i];
    for (size_t f = 0; f < fails; f++)
        deferred[kept++] = failed[f];
    atomic_store_explicit(&deferred_count, kept, memory_order_relaxed);
    pthread_mutex_unlock(&deferred_lock);
}

#ifdef LSHM_TESTING
_Thread_local int lshm__unmap_enomem; /* tests: this thread's munmaps fail (ENOMEM) */
#endif

void lshm__os_unmap(void *addr, size_t len) {
    if (addr == NULL || len == 0)
        return;
    int rc;
#ifdef LSHM_TESTING
    if (lshm__unmap_enomem)
        rc = -1, errno = ENOMEM;
    else
#endif
        rc = munmap(addr, len);
    if (rc == 0) {
        unmap_deferred(); /* (room for them now, maybe) */
        return;
    }
    int e = errno;
    assert(e == ENOMEM); /* anything else is a bad range: our bug */
    /* vm.max_map_count: the memory goes now (private pages; a file's pages stay while it is
     * mapped), the range itself once a later unmap makes room */
    (void)madvise(addr, len, MADV_DONTNEED);
    pthread_mutex_lock(&deferred_lock);
    size_t n = atomic_load_explicit(&deferred_count, memory_order_relaxed);
    if (n == deferred_room) {
        size_t room = deferred_room ? 2 * deferred_room : 64;
        struct deferred_range *grown = realloc(deferred, room * sizeof *grown);
        if (grown != NULL) {
            deferred = grown;
            deferred_room = room;
        }
    }
    if (n < deferred_room) {
        deferred[n] = (struct deferred_range){addr, len};
        atomic_store_explicit(&deferred_count, n + 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&deferred_lock);
    (void)e;
}

/* ---- the write fence of an in-place share ---------------------------------------------------
 * A share copies a storage's private pages into a memfd and then maps the memfd over them: a
 * write another thread makes to a page after it was copied and before it was remapped would go
 * to the old page, which the mmap throws away. So the range is write-protected through a
 * userfaultfd first (UFFDIO_REGISTER_MODE_WP, then UFFDIO_WRITEPROTECT; with
 * UFFD_FEATURE_WP_UNPOPULATED pages never touched are protected too). Reads go on as before. A
 * thread that writes there meanwhile blocks in its page fault; the mmap replaces the protected
 * range by a new, unregistered mapping, and UFFDIO_WAKE lets the writer retry its write, which
 * now lands in the shared page. Nobody reads the userfaultfd: a write fault waits on it until
 * the wake (or until the fd is closed). A failed share lifts the protection over what is still
 * the private range and unregisters it. Writes into pages the kernel pinned before (O_DIRECT in
 * flight, io_uring fixed buffers, RDMA) go through the kernel's own mapping and never fault:
 * no fence sees them.
 * One userfaultfd per process (opening one per share would cost 9 us, as much as a 4 KiB
 * share), opened at load time with O_CLOEXEC. Slabs (slab.c) are registered with it when they
 * are made (lshm__os_fence_prepare), so the fence of a slab storage only write-protects: one
 * ioctl and no split of the slab's mapping less per share (a 4 KiB share in a C loop: 10.3 to
 * 9.3 us, 7.3 unfenced). Registered memory with no page protected behaves as any other, but
 * for what the kernel does not do in memory a userfaultfd watches: no other userfaultfd may
 * register it (EBUSY), and no transparent huge pages (none wanted in slabs: their storages are
 * remapped page by page). Only memory all registered with the current userfaultfd is
 * protected that way (a slab keeps the userfaultfd's generation while that holds): a fork's
 * child does not inherit the registration, a userfaultfd the program closed took it along,
 * and mapping pages anew over part of a slab (a read-only share freed) must register them
 * again; elsewhere the fence registers as for other memory, so memory another userfaultfd
 * watches is never protected through ours (its writers would wait for a wake from us that
 * never reaches them). One case is not seen: a program that closes our userfaultfd without
 * our knowing, whose own userfaultfd then gets the same number, has our fences go through
 * its userfaultfd (protecting only what it registered, and waking through it too: no hang)
 * until a call fails there; telling would cost an fstat per share.
 * Without CAP_SYS_PTRACE and with the default vm.unprivileged_userfaultfd=0 only
 * UFFD_USER_MODE_ONLY is allowed: a write the kernel makes for another thread during the share
 * (read(2) into the array) then fails with EFAULT instead of blocking, which still loses
 * nothing silently. Kernels before 6.4 (no
 * UFFD_FEATURE_WP_UNPOPULATED), no userfaultfd (seccomp, CONFIG_USERFAULTFD=n) and memory it
 * cannot protect (file mappings, memory another userfaultfd already watches) share unfenced,
 * as before: concurrent writes may then be lost. A fork()'s child opens one of its own: the
 * inherited one belongs to the parent's address space. A process that never started a second
 * thread (glibc's __libc_single_threaded) has nobody to fence against and skips it. LSHM_FENCE=0
 * in the environment (read at load time) opens no userfaultfd at all: for sandboxes that kill a
 * process on the syscall, or programs that never write an array while another thread shares it
 * and want the 3 us a small share saves. */
/* The process's userfaultfd: its number, the process that opened it (a child forked without
 * the atfork handlers, by _Fork() or a raw clone, must not use it: its ioctls would act on the
 * parent's address space) and its identity (a program that closes every fd it does not know
 * may have the number reused: then it is not ours to use or to close). The three are written
 * before fence_fd publishes them and read without a lock while a reopen (another thread's
 * share) rewrites them: atomic, relaxed (fence_fd's seq_cst store and load order them). */
static _Atomic int fence_fd = -1;
static _Atomic pid_t fence_pid;
static _Atomic dev_t fence_dev;
static _Atomic ino_t fence_ino;
static pthread_mutex_t fence_lock = PTHREAD_MUTEX_INITIALIZER; /* reopening it */
/* Which userfaultfd fence_fd is: a new number for each one opened (a fork's child, a reopen),
 * so memory registered with an earlier one (lshm__os_fence_prepare) is known not to be
 * registered with this one. */
static _Atomic unsigned long fence_generation;
_Atomic int lshm__fence_off;               /* tests: share unfenced */
_Atomic int lshm__fence_fails;             /* tests: UFFDIO_REGISTER fails with this -errno */
_Atomic int lshm__fence_wp_fails;          /* tests: UFFDIO_WRITEPROTECT "fails" after it worked */
_Atomic unsigned long lshm__fences_set;   /* fences set up (tests read it) */

#ifdef LSHM_HAVE_UFFD
/* Open a userfaultfd with write protection: 1 (in *out, its identity in *st), 0 where this
 * process can have none, -1 when the number was taken from under us before it was set up (a
 * program closing fds it does not know, or dup2-ing over them, as it may do to the one before):
 * then the number is not ours to close, and the caller tries again. The identity is read before
 * UFFDIO_API, whose success says the number was still the userfaultfd opened here: read after
 * it, it could be that of a file the program put there meanwhile (ours then for fence_is_ours,
 * closed in a fork's child). */
static int fence_open_once(int *out, struct stat *st) {
    int flags = O_CLOEXEC | O_NONBLOCK;
    int fd = (int)syscall(SYS_userfaultfd, flags);
    if (fd < 0 && errno == EPERM)
        fd = (int)syscall(SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY);
    if (fd < 0)
        return 0;
    if (fstat(fd, st) != 0) {
        if (errno == EBADF) /* (closed already) */
            return -1;
        close(fd);
        return 0;
    }
    struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_WP_UNPOPULATED};
    if (ioctl(fd, UFFDIO_API, &api) != 0) {
        if (errno == EBADF || errno == ENOTTY) /* (none at the number, or not a userfaultfd) */
            return -1;
        close(fd);
        return 0;
    }
    if ((api.features & UFFD_FEATURE_PAGEFAULT_FLAG_WP) == 0) {
        close(fd);
        return 0;
    }
    *out = fd;
    return 1;
}
#endif

int lshm__os_fence_open(void) {
#ifdef LSHM_HAVE_UFFD
    /* LSHM_FENCE is read once, at load time: later opens (a fork's child, a reopen) follow */
    static int disabled = -1;
    if (disabled < 0) {
        const char *env = getenv("LSHM_FENCE");
        disabled = env != NULL && strcmp(env, "0") == 0;
    }
    if (disabled)
        return 0;
    int fd = -1, opened = -1;
    struct stat st;
    for (int tries = 0; opened < 0 && tries < 4; tries++) /* (the program must take each one) */
        opened = fence_open_once(&fd, &st);
    if (opened <= 0)
        return opened;
    atomic_store_explicit(&fence_dev, st.st_dev, memory_order_relaxed);
    atomic_store_explicit(&fence_ino, st.st_ino, memory_order_relaxed);
    atomic_store_explicit(&fence_pid, getpid(), memory_order_relaxed);
    atomic_fetch_add(&fence_generation, 1);
    atomic_store(&fence_fd, fd);
    return 1;
#else
    return 0;
#endif
}

/* Is fd still the userfaultfd we opened? */
static int fence_is_ours(int fd) {
    struct stat st;
    return fd >= 0 && fstat(fd, &st) == 0 &&
           st.st_dev == atomic_load_explicit(&fence_dev, memory_order_relaxed) &&
           st.st_ino == atomic_load_explicit(&fence_ino, memory_order_relaxed);
}

/* fence_lock is held only for a few syscalls and never with another lock taken inside it: the
 * prepare handler can wait for it behind any lock of a share, and the child finds it free (a
 * fork from inside an allocator callback goes ahead beside other threads' shares, and every
 * failed ioctl of a fence takes it: held by a thread the child does not have, a share there
 * would wait for ever). */
void lshm__os_fence_prepare_fork(void) {
    pthread_mutex_lock(&fence_lock);
}

void lshm__os_fence_after_fork(void) {
    pthread_mutex_unlock(&fence_lock);
}

void lshm__os_fence_after_fork_child(void) {
    int fd = atomic_exchange(&fence_fd, -1);
    if (fence_is_ours(fd))
        close(fd);
    (void)lshm__os_fence_open();
}

/* A fence's ioctl on fd, read with `generation`, failed with rc. Decided under fence_lock, so
 * that a reopen by another thread is either done or not begun: 1 when the fence is to be set
 * up again with the userfaultfd open now (another thread opened it since fd was read; or fd
 * answered as no userfaultfd does, EBADF or ENOTTY: the program closed it, and this call
 * opened another, once for every thread that saw it); -1 when it was closed and no other
 * could be opened; 0 when the failure stands (fd is still ours). fence_fd keeps the old number
 * until the new one is open: a share that used it meanwhile fails and waits here, where an fd
 * of -1 would have sent it on unfenced. It keeps it too when every new one was taken from
 * under us before it was set up (see fence_open_once): the next share tries again, where -1
 * would have given the fence up for good. */
static int fence_reopened(int fd, unsigned long generation, int rc) {
    int again = 0;
    pthread_mutex_lock(&fence_lock);
    if (atomic_load(&fence_generation) != generation) {
        again = 1;
    } else if ((rc == -EBADF || rc == -ENOTTY) && !fence_is_ours(fd)) {
        int opened = lshm__os_fence_open(); /* (a new generation when it works) */
        again = atomic_load(&fence_generation) != generation ? 1 : -1;
        if (again < 0 && opened == 0)
            atomic_store(&fence_fd, -1);
    }
    pthread_mutex_unlock(&fence_lock);
    return again > 0 && atomic_load(&fence_fd) < 0 ? -1 : again;
}

#ifdef LSHM_HAVE_UFFD
static int fence_ioctl(int fd, unsigned long request, void *arg) {
    int rc;
    do
        rc = ioctl(fd, request, arg);
    while (rc != 0 && errno == EINTR);
    return rc == 0 ? 0 : -errno;
}
#endif

/* No fence for this share: fine for lshm_storage_share (it goes on unfenced: 0), refused for
 * lshm_storage_share_fenced (-EOPNOTSUPP, nothing changed yet). */
static int unfenced(int required, const char *why) {
    if (!required)
        return 0;
    return LSHM_FAIL(-EOPNOTSUPP, "no write fence for this share (%s): another thread's write "
                                  "during it could be lost", why);
}

#ifdef LSHM_HAVE_UFFD
/* The fence could not be set up over [base, base + len) (rc): undo what the ioctls did
 * (`undo`: as lshm__os_fence_lift does, the range unregistered where `registered` by this
 * fence: REGISTER worked and WRITEPROTECT failed, or REGISTER failed part-way with ENOMEM,
 * every mapping of the range being ours or nobody's; else, memory registered ahead, only its
 * protection lifted, so it stays registered and its mapping whole; every writer woken: one may
 * already wait on pages a partial WRITEPROTECT protected), and say so where that is an error
 * (ENOMEM); anything else leaves the share unfenced (or refuses it: `required`, see
 * unfenced). Any other REGISTER failure (EBUSY: another userfaultfd watches it) made nothing
 * of ours to undo, and the watcher's registration is not ours to touch. */
static int fence_refused(char *base, size_t len, int fd, int rc, int undo, int registered,
                         int required) {
    if (undo) {
        lshm__fence made = {base, len, fd, registered};
        lshm__os_fence_lift(&made, base);
    }
    if (rc != -ENOMEM) /* (-ENOMEM: splitting the mapping, vm.max_map_count) */
        return unfenced(required, rc == -EBUSY ? "another userfaultfd watches this memory"
                                               : "this memory cannot be write-protected");
    return LSHM_FAIL(rc, "userfaultfd: write-protecting %zu bytes at %p: %s%s", len,
                     (void *)base, strerror(-rc), MAP_LIMIT_HINT);
}
#endif

/* lshm__os_fence_begin; `reopened`: the userfaultfd was opened again for this call already. */
static int fence_begin(void *addr, size_t len, int required, _Atomic unsigned long *prepared,
                       lshm__fence *f, int reopened) {
    f->base = addr;
    f->len = 0;
    f->registered = 0;
    if (len == 0)
        return 0;
#ifdef LSHM_HAVE_SINGLE_THREADED
    if (__libc_single_threaded) /* (no other thread to write meanwhile) */
        return 0;
#endif
    /* (the generation before the fd and once more after it: the pair read belongs together
     * only if both reads give the same; see `ahead` below) */
    unsigned long current = atomic_load(&fence_generation);
    int fd = atomic_load(&fence_fd);
    if (fd < 0 || atomic_load_explicit(&lshm__fence_off, memory_order_relaxed))
        return unfenced(required, "this process has no userfaultfd write protection: the "
                                  "kernel has none, or LSHM_FENCE=0");
    /* (a syscall: after the free checks) */
    if (atomic_load_explicit(&fence_pid, memory_order_relaxed) != getpid())
        return unfenced(required, "a child forked without the atfork handlers");
    if (lshm__round_pages(len, &len) != 0)
        return unfenced(required, "a range that does not round to pages");
#ifdef LSHM_HAVE_UFFD
    struct uffdio_range range = {(uintptr_t)addr, len};
    struct uffdio_writeprotect wp = {range, UFFDIO_WRITEPROTECT_MODE_WP};
    /* (not an LSHM_FAULT point, which would renumber every share's points: tests set
     * lshm__fence_fails instead) */
    int rc = atomic_load_explicit(&lshm__fence_fails, memory_order_relaxed);
    /* Memory registered ahead with this very userfaultfd (a slab: *prepared is the generation
     * it was registered with, see lshm__os_fence_prepare) needs protecting only; all of it is
     * registered, so a failure there is a failure (nothing to register, nothing to undo but
     * the protection). Memory registered with another userfaultfd (an earlier one of ours, a
     * fork's parent's, the program's) is never protected this way: a writer would wait on a
     * userfaultfd nobody wakes. */
    unsigned long generation = prepared != NULL ? atomic_load(prepared) : 0;
    int ahead = generation != 0 && generation == current &&
                atomic_load(&fence_generation) == current; /* (fd is this generation's) */
    struct uffdio_register reg = {range, UFFDIO_REGISTER_MODE_WP, 0};
    if (rc == 0)
        rc = ahead ? fence_ioctl(fd, UFFDIO_WRITEPROTECT, &wp)
                   : fence_ioctl(fd, UFFDIO_REGISTER, &reg);
    /* (the new one often gets the same number: closed, it is the lowest free one) */
    int again = rc == 0 ? 0
                : !reopened ? fence_reopened(fd, current, rc)
                : (rc == -EBADF || rc == -ENOTTY) && !fence_is_ours(fd) ? -1 : 0;
    if (again > 0)
        return fence_begin(addr, len, required, prepared, f, 1);
    if (again < 0)
        return unfenced(required, "the program closed or replaced its userfaultfd, and no new "
                                  "one could be set up in time (none opens, or each was taken "
                                  "again at once)");
    if (ahead)
        goto protected;
    if (rc != 0) /* (the mappings REGISTER got to stay registered) */
        return fence_refused(addr, len, fd, rc, rc == -ENOMEM, 1, required);
    f->registered = 1;
    rc = fence_ioctl(fd, UFFDIO_WRITEPROTECT, &wp);
protected:
#ifdef LSHM_TESTING
    if (rc == 0 && (rc = atomic_load_explicit(&lshm__fence_wp_fails, memory_order_relaxed)))
        usleep(50000); /* (protected: a writer waits by now, for the failure path to wake) */
#endif
    if (rc != 0) /* (`ahead`: lifted, still registered) */
        return fence_refused(addr, len, fd, rc, 1, !ahead, required);
    f->fd = fd;
    f->len = len;
    atomic_fetch_add_explicit(&lshm__fences_set, 1, memory_order_relaxed);
    return 0;
#else
    (void)reopened, (void)prepared;
    return unfenced(required, "built without userfaultfd");
#endif
}

int lshm__os_fence_begin(void *addr, size_t len, int required, _Atomic unsigned long *prepared,
                         lshm__fence *f) {
    return fence_begin(addr, len, required, prepared, f, 0);
}

unsigned long lshm__os_fence_prepare(void *addr, size_t len) {
#ifdef LSHM_HAVE_UFFD
    /* (as fence_begin: the generation, then the fd, then the generation again below) */
    unsigned long generation = atomic_load(&fence_generation);
    int fd = atomic_load(&fence_fd);
    if (fd < 0 || atomic_load_explicit(&lshm__fence_off, memory_order_relaxed) ||
        lshm__round_pages(len, &len) != 0 ||
        atomic_load_explicit(&fence_pid, memory_order_relaxed) != getpid() || !fence_is_ours(fd))
        return 0;
    struct uffdio_register reg = {{(uintptr_t)addr, len}, UFFDIO_REGISTER_MODE_WP, 0};
    if (fence_ioctl(fd, UFFDIO_REGISTER, &reg) != 0)
        return 0; /* (EBUSY: another userfaultfd watches part of it) */
    /* (a reopen meanwhile: registered with a userfaultfd that is not the current one) */
    return atomic_load(&fence_generation) == generation ? generation : 0;
#else
    (void)addr, (void)len;
    return 0;
#endif
}

void lshm__os_fence_wake(const lshm__fence *f, void *addr, size_t len) {
#ifdef LSHM_HAVE_UFFD
    if (f->len == 0 || len == 0)
        return;
    struct uffdio_range range = {(uintptr_t)addr, lshm__round_pages(len, &len) == 0 ? len : 0};
    (void)fence_ioctl(f->fd, UFFDIO_WAKE, &range);
#else
    (void)f, (void)addr, (void)len;
#endif
}

void lshm__os_fence_lift(lshm__fence *f, void *from) {
#ifdef LSHM_HAVE_UFFD
    if (f->len == 0)
        return;
    char *end = f->base + f->len, *start = from;
    if (start < end) { /* still the private pages: writable again, unregistered (unless
                          * registered before the fence: then ready for the next one) */
        struct uffdio_writeprotect wp = {{(uintptr_t)start, (size_t)(end - start)}, 0};
        (void)fence_ioctl(f->fd, UFFDIO_WRITEPROTECT, &wp);
        struct uffdio_range range = {(uintptr_t)start, (size_t)(end - start)};
        if (f->registered)
            (void)fence_ioctl(f->fd, UFFDIO_UNREGISTER, &range);
    }
    lshm__os_fence_wake(f, f->base, f->len);
    f->len = 0;
#else
    (void)f, (void)from;
#endif
}

void lshm__os_fence_end(lshm__fence *f) {
    lshm__os_fence_lift(f, f->base + f->len);
}

void lshm__os_close(int fd) {
    if (fd < 0)
        return;
    /* Linux releases the fd even when close reports EINTR/EIO: never retry. */
    (void)close(fd);
}

int lshm__os_dup_cloexec(int fd, int *out) {
    LSHM_OS_FAULT("dup");
    int r = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (r < 0) {
        int e = errno;
        return LSHM_FAIL(-e, "fcntl(fd %d, F_DUPFD_CLOEXEC): %s", fd, strerror(e));
    }
    *out = r;
    return 0;
}

#define LSHM__TMPFS_MAGIC 0x01021994 /* (linux/magic.h) */

int lshm__os_fd_info(int fd, lshm__fd_info *info) {
    LSHM_OS_FAULT("fstat");
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = fd < 0 ? EBADF : errno;
        return LSHM_FAIL(-EBADF, "fstat(fd %d): %s", fd, strerror(e));
    }
    /* memfds (and other shmem files) are regular files that answer F_GET_SEALS; pipes,
     * sockets, ordinary files and devices do not. */
    if (!S_ISREG(st.st_mode))
        return LSHM_FAIL(-EINVAL, "fd %d is not a memfd (not a regular file)", fd);
    LSHM_OS_FAULT("get_seals");
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        int e = errno;
        return LSHM_FAIL(-EINVAL, "fd %d is not a memfd (F_GET_SEALS: %s)", fd, strerror(e));
    }
    /* hugetlbfs files (memfd_create with MFD_HUGETLB) answer F_GET_SEALS too, but the kernel
     * maps and unmaps them only in whole huge pages: a range of such a file in 4 KiB pages
     * could not be unmapped again. Only shmem's tmpfs is a memfd here. (After F_GET_SEALS,
     * so that a file of another kind is refused without asking its file system.) */
    struct statfs fs;
    if (fstatfs(fd, &fs) != 0) {
        int e = errno;
        return LSHM_FAIL(-EINVAL, "fd %d is not a memfd (fstatfs: %s)", fd, strerror(e));
    }
    if (fs.f_type != LSHM__TMPFS_MAGIC)
        return LSHM_FAIL(-EINVAL,
                         "fd %d is not a memfd of ordinary pages (file system 0x%llx: hugetlbfs "
                         "memfds are not supported)",
                         fd, (unsigned long long)fs.f_type);
    LSHM_OS_FAULT("getfl");
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) {
        int e = errno;
        return LSHM_FAIL(-e, "fcntl(fd %d, F_GETFL): %s", fd, strerror(e));
    }
    info->size = (uint64_t)st.st_size;
    info->dev = (uint64_t)st.st_dev;
    info->ino = (uint64_t)st.st_ino;
    info->size_sealed = (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) == (F_SEAL_SHRINK | F_SEAL_GROW);
    info->sealable = (seals & F_SEAL_SEAL) == 0;
    info->write_sealed = (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0;
    info->writable = (fl & O_ACCMODE) != O_RDONLY;
    info->readable = (fl & O_ACCMODE) != O_WRONLY;
    return 0;
}
