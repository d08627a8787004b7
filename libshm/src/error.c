/*
 * error.c -- error codes, the thread-local "last error" message, version, fault injection.
 *
 * Every failure path of the library returns a negative errno and, through LSHM_FAIL, records
 * "file:line: message" in a per-thread buffer, so a caller (the Python binding in particular)
 * can attach the context to its exception without a global errno channel. Names and
 * descriptions of the codes come from one X-macro table (libuv's UV_ERRNO_MAP) so the two
 * lookups can never disagree.
 *
 * Fault injection (compiled only with -DLSHM_TESTING): every OS wrapper passes a fault point
 * first; a test arms a per-thread countdown so the n-th point fails, and loops n over all the
 * points of an operation to prove each failure path leaves things as they were.
 */
#include "internal.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

/* errno name and description, the codes this library can return (plus a few neighbours that
 * the kernel may report through the syscalls we make). */
#define LSHM_ERRNO_MAP(XX)                                                                    \
    XX(EPERM, "operation not permitted")                                                      \
    XX(ENOENT, "no such file or directory")                                                   \
    XX(EINTR, "interrupted system call")                                                      \
    XX(EIO, "i/o error")                                                                      \
    XX(EBADF, "bad file descriptor")                                                          \
    XX(EAGAIN, "resource temporarily unavailable")                                            \
    XX(ENOMEM, "out of memory")                                                               \
    XX(EACCES, "permission denied")                                                           \
    XX(EFAULT, "bad address")                                                                 \
    XX(EBUSY, "resource busy (still referenced)")                                             \
    XX(EEXIST, "already exists")                                                              \
    XX(ENODEV, "no such device")                                                              \
    XX(EINVAL, "invalid argument")                                                            \
    XX(ENFILE, "too many open files in system")                                               \
    XX(EMFILE, "too many open files")                                                         \
    XX(EFBIG, "file too large")                                                               \
    XX(ENOSPC, "no space left on device")                                                     \
    XX(ESPIPE, "illegal seek")                                                                \
    XX(ERANGE, "result out of range")                                                         \
    XX(ENOSYS, "function not implemented")                                                    \
    XX(ENODATA, "no data (storage not shared)")                                               \
    XX(EOVERFLOW, "value too large (size overflow)")                                          \
    XX(EOPNOTSUPP, "operation not supported")                                                 \
    XX(ETXTBSY, "text file busy")

const char *lshm_strerror(int err) {
    if (err > 0)
        err = -err;
    if (err == 0)
        return "success";
    if (err == INT_MIN) /* no errno; and -INT_MIN would overflow */
        return "unknown error";
    switch (-err) {
#define LSHM_STRERROR_CASE(name, text)                                                        \
    case name:                                                                                \
        return text;
        LSHM_ERRNO_MAP(LSHM_STRERROR_CASE)
#undef LSHM_STRERROR_CASE
    default:
        return "unknown error";
    }
}

const char *lshm_err_name(int err) {
    if (err > 0)
        err = -err;
    if (err == 0)
        return "OK";
    if (err == INT_MIN)
        return "UNKNOWN";
    switch (-err) {
#define LSHM_ERR_NAME_CASE(name, text)                                                        \
    case name:                                                                                \
        return #name;
        LSHM_ERRNO_MAP(LSHM_ERR_NAME_CASE)
#undef LSHM_ERR_NAME_CASE
    default:
        return "UNKNOWN";
    }
}

/* ---- last error ---------------------------------------------------------------------------- */

/* Long enough for a path, a line number and a sentence with a few numbers; longer messages
 * are truncated (vsnprintf), never overflowed. */
static _Thread_local char last_error[512];

const char *lshm_last_error(void) {
    return last_error;
}

int lshm__fail(int err, const char *file, int line, const char *fmt, ...) {
    if (err >= 0)
        err = -EINVAL; /* our bug; still never report success from a failure path */
    /* __FILE__ carries the build's relative path; keep only the base name so messages are
     * the same wherever the library was built. */
    const char *base = strrchr(file, '/');
    base = base != NULL ? base + 1 : file;
    int n = snprintf(last_error, sizeof last_error, "%s:%d: ", base, line);
    if (n < 0 || (size_t)n >= sizeof last_error)
        return err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    return err;
}

/* ---- version ------------------------------------------------------------------------------- */

#define LSHM_STRINGIFY_(x) #x
#define LSHM_STRINGIFY(x) LSHM_STRINGIFY_(x)

int lshm_version(void) {
    return LSHM_VERSION_NUMBER;
}

const char *lshm_version_string(void) {
    return LSHM_STRINGIFY(LSHM_VERSION_MAJOR) "." LSHM_STRINGIFY(
        LSHM_VERSION_MINOR) "." LSHM_STRINGIFY(LSHM_VERSION_PATCH);
}

/* ---- fault injection ----------------------------------------------------------------------- */

#ifdef LSHM_TESTING
/* Per thread, so tests running threads of their own are not disturbed by each other. */
static _Thread_local int fault_countdown; /* fault points left before the one that fails; 0: off */
static _Thread_local int fault_err;       /* negative errno the failing point returns */
static _Thread_local int fault_hits;      /* fault points passed since the last arm */

void lshm__fault_arm(int nth, int err) {
    fault_countdown = nth > 0 ? nth : 0;
    fault_err = err < 0 ? err : -err;
    fault_hits = 0;
}

int lshm__fault_points_hit(void) {
    return fault_hits;
}

int lshm__fault_check(const char *site) {
    (void)site;
    fault_hits++;
    if (fault_countdown > 0 && --fault_countdown == 0)
        return fault_err;
    return 0;
}
#endif
