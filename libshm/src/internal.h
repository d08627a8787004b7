/*
 * internal.h -- declarations shared between the .c files of libshm; never installed.
 *
 * Cross-file internals use the lshm__ prefix (two underscores) and are hidden from the shared
 * library's symbol table by -fvisibility=hidden; only LSHM_API declarations in lshm.h export.
 */
#ifndef LSHM_INTERNAL_H
#define LSHM_INTERNAL_H

#include "lshm.h"

#include <stdarg.h>
#include <stddef.h>

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
#define LSHM_FAULT(site) lshm__fault_check(site)
#else
#define LSHM_FAULT(site) 0
#endif

#endif
