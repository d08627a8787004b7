/*
 * fuzz_plan.c -- libFuzzer target for the planner's input: lshm_plan, lshm_plan_validate and
 * lshm_plan_lower_bound on up to 256 tensors decoded from the input (sizes, firsts, lasts,
 * optional fixed offsets, alignment, interval flag, capacity, engine), extremes included.
 *
 * Properties (abort on the first that breaks):
 *  - every call returns 0 or a documented negative errno, and a failure leaves a message and
 *    leaves the out-parameters untouched;
 *  - when lshm_plan returns 0: lshm_plan_validate accepts the plan; an independent O(n^2) check
 *    finds no two tensors live together that overlap, every offset aligned, every end within
 *    arena_size; pinned tensors sit at their fixed offsets, zero-size free tensors at 0;
 *    lower_bound == lshm_plan_lower_bound <= arena_size; a second call gives the same plan;
 *  - lshm_plan_lower_bound failing implies lshm_plan fails too;
 *  - lshm_plan_validate returning 0 on fuzzed offsets implies the independent check agrees.
 */
#include "lshm.h"

#include "fuzz_common.h"

#include <errno.h>

#define MAX_TENSORS 256

static int live_together(int inclusive, int64_t fa, int64_t la, int64_t fb, int64_t lb) {
    if (inclusive)
        return fa <= lb && fb <= la;
    return fa < lb && fb < la && fa < la && fb < lb;
}

/* 1 when offsets are a valid plan in the documented sense (ignoring the 64-bit overflow of
 * offset + size, which validate reports on its own). */
static int oracle_valid(size_t n, const uint64_t *sizes, const int64_t *firsts,
                        const int64_t *lasts, const uint64_t *offsets, uint64_t align,
                        int inclusive, uint64_t arena_size, size_t *bad_a, size_t *bad_b) {
    for (size_t i = 0; i < n; i++) {
        *bad_a = *bad_b = i;
        if (firsts[i] > lasts[i] || (offsets[i] & (align - 1)) != 0)
            return 0;
        if (offsets[i] > UINT64_MAX - sizes[i])
            return 0;
        int occupies = sizes[i] > 0 && (inclusive || firsts[i] < lasts[i]);
        if (occupies && offsets[i] + sizes[i] > arena_size)
            return 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (sizes[i] == 0)
            continue;
        for (size_t j = i + 1; j < n; j++) {
            if (sizes[j] == 0)
                continue;
            if (!live_together(inclusive, firsts[i], lasts[i], firsts[j], lasts[j]))
                continue;
            if (offsets[i] < offsets[j] + sizes[j] && offsets[j] < offsets[i] + sizes[i]) {
                *bad_a = i;
                *bad_b = j;
                return 0;
            }
        }
    }
    return 1;
}

static int documented(int rc) { return rc == 0 || rc == -EINVAL || rc == -EOVERFLOW || rc == -ENOMEM; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static uint64_t sizes[MAX_TENSORS], offsets[MAX_TENSORS], again[MAX_TENSORS];
    static int64_t firsts[MAX_TENSORS], lasts[MAX_TENSORS], fixed[MAX_TENSORS];
    fuzz_in in = {data, size};

    uint8_t mode = take_u8(&in);
    uint8_t align_sel = take_u8(&in);
    size_t n = take_u8(&in);
    if (take_bool(&in))
        n += 128; /* up to 255 + 128 would exceed the bound: clamp below */
    if (n > MAX_TENSORS)
        n = MAX_TENSORS;

    lshm_plan_options opts;
    lshm_plan_options_init(&opts);
    opts.flags = mode & 1 ? LSHM_PLAN_INCLUSIVE : 0;
    if (mode & 0x40)
        opts.flags |= 0x80u; /* an unknown flag: must be -EINVAL */
    /* alignment: 0 (means 1), a power of two up to 2^20, or occasionally garbage */
    if (align_sel == 0xff)
        opts.alignment = take_u64(&in);
    else if (align_sel % 23 == 22)
        opts.alignment = 0;
    else
        opts.alignment = (uint64_t)1 << (align_sel % 23 > 20 ? 63 : align_sel % 23);
    opts.time_limit = 0;
    opts.capacity = mode & 4 ? take_u64(&in) : 0;
    const int use_fixed = (mode & 2) != 0;
    switch ((mode >> 3) & 3) {
    case 1:
        setenv("LSHM_PLAN_ENGINE", "dense", 1);
        break;
    case 2:
        setenv("LSHM_PLAN_ENGINE", "sparse", 1);
        break;
    default:
        unsetenv("LSHM_PLAN_ENGINE");
    }
    const int small_times = (mode & 0x20) != 0; /* many tensors live together */

    for (size_t i = 0; i < n; i++) {
        sizes[i] = take_u64(&in);
        if (small_times) {
            firsts[i] = (int8_t)take_u8(&in) / 8;
            lasts[i] = firsts[i] + take_u8(&in) % 16;
        } else {
            firsts[i] = take_i64(&in);
            lasts[i] = take_i64(&in);
        }
        fixed[i] = -1;
        if (use_fixed && take_bool(&in))
            fixed[i] = take_i64(&in);
    }

    const int inclusive = (opts.flags & LSHM_PLAN_INCLUSIVE) != 0;
    const uint64_t align = opts.alignment ? opts.alignment : 1;

    uint64_t lb = 12345;
    int rc_lb = lshm_plan_lower_bound(n, sizes, firsts, lasts, &opts, &lb);
    FUZZ_CHECK(documented(rc_lb), "lower_bound returned %d", rc_lb);
    if (rc_lb != 0)
        FUZZ_CHECK(lb == 12345, "lower_bound wrote its output on failure (%d)", rc_lb);

    memset(offsets, 0xab, n * sizeof offsets[0]);
    lshm_plan_result res, res2;
    memset(&res, 0xcd, sizeof res);
    int rc = lshm_plan(n, sizes, firsts, lasts, use_fixed ? fixed : NULL, &opts, offsets, &res);
    FUZZ_CHECK(documented(rc), "lshm_plan returned %d", rc);
    if (rc != 0) {
        FUZZ_CHECK(lshm_last_error()[0] != '\0', "lshm_plan failed (%d) without a message", rc);
        for (size_t i = 0; i < n; i++)
            FUZZ_CHECK(offsets[i] == 0xababababababababull,
                       "lshm_plan (%d) changed offsets[%zu] on failure", rc, i);
        unsigned char cd[sizeof res];
        memset(cd, 0xcd, sizeof cd);
        FUZZ_CHECK(memcmp(&res, cd, sizeof res) == 0, "lshm_plan (%d) wrote result on failure", rc);
    }
    if (rc_lb != 0)
        FUZZ_CHECK(rc != 0, "lower_bound failed (%d) but lshm_plan succeeded", rc_lb);

    if (rc == 0) {
        FUZZ_CHECK(rc_lb == 0, "lshm_plan succeeded but lower_bound failed (%d)", rc_lb);
        FUZZ_CHECK(res.lower_bound == lb, "result.lower_bound %llu != lshm_plan_lower_bound %llu",
                   (unsigned long long)res.lower_bound, (unsigned long long)lb);
        FUZZ_CHECK(res.arena_size >= res.lower_bound,
                   "arena_size %llu < lower_bound %llu",
                   (unsigned long long)res.arena_size, (unsigned long long)res.lower_bound);
        FUZZ_CHECK(memchr(res.strategy, '\0', sizeof res.strategy) != NULL,
                   "strategy not NUL-terminated");
        int vrc = lshm_plan_validate(n, sizes, firsts, lasts, offsets, &opts, res.arena_size);
        FUZZ_CHECK(vrc == 0, "lshm_plan_validate refused lshm_plan's own plan (%d), n=%zu "
                   "arena_size=%llu", vrc, n, (unsigned long long)res.arena_size);
        size_t a = 0, b = 0;
        FUZZ_CHECK(oracle_valid(n, sizes, firsts, lasts, offsets, align, inclusive,
                                res.arena_size, &a, &b),
                   "plan invalid: tensors %zu [%llu,+%llu) t[%lld,%lld] and %zu [%llu,+%llu) "
                   "t[%lld,%lld]", a, (unsigned long long)offsets[a],
                   (unsigned long long)sizes[a], (long long)firsts[a], (long long)lasts[a], b,
                   (unsigned long long)offsets[b], (unsigned long long)sizes[b],
                   (long long)firsts[b], (long long)lasts[b]);
        for (size_t i = 0; i < n; i++) {
            if (use_fixed && fixed[i] >= 0 && sizes[i] > 0 && (inclusive || firsts[i] < lasts[i]))
                FUZZ_CHECK(offsets[i] == (uint64_t)fixed[i],
                           "tensor %zu pinned at %lld placed at %llu", i, (long long)fixed[i],
                           (unsigned long long)offsets[i]);
            if (sizes[i] == 0 && !(use_fixed && fixed[i] >= 0))
                FUZZ_CHECK(offsets[i] == 0, "zero-size tensor %zu at %llu", i,
                           (unsigned long long)offsets[i]);
        }
        /* Deterministic with time_limit 0. */
        int rc2 = lshm_plan(n, sizes, firsts, lasts, use_fixed ? fixed : NULL, &opts, again, &res2);
        FUZZ_CHECK(rc2 == 0, "second lshm_plan returned %d", rc2);
        FUZZ_CHECK(res2.arena_size == res.arena_size && memcmp(again, offsets, n * sizeof *again) == 0,
                   "lshm_plan not deterministic (arena %llu then %llu)",
                   (unsigned long long)res.arena_size, (unsigned long long)res2.arena_size);
        /* One tensor moved, or the arena cut short: validate must agree with the oracle. */
        if (n > 0) {
            size_t k = take_u8(&in) % n;
            offsets[k] = take_u64(&in) & ~(align - 1);
            uint64_t arena = take_bool(&in) ? res.arena_size - (res.arena_size > 0) : res.arena_size;
            vrc = lshm_plan_validate(n, sizes, firsts, lasts, offsets, &opts, arena);
            FUZZ_CHECK(documented(vrc), "lshm_plan_validate returned %d", vrc);
            if (vrc == 0)
                FUZZ_CHECK(oracle_valid(n, sizes, firsts, lasts, offsets, align, inclusive, arena,
                                        &a, &b),
                           "validate accepted an invalid plan (tensors %zu and %zu)", a, b);
        }
    }

    /* validate on fully fuzzed offsets (the fixed column, -1 read as UINT64_MAX). */
    if (use_fixed) {
        uint64_t arena = take_u64(&in);
        int vrc = lshm_plan_validate(n, sizes, firsts, lasts, (const uint64_t *)fixed, &opts, arena);
        FUZZ_CHECK(documented(vrc), "lshm_plan_validate returned %d", vrc);
        size_t a = 0, b = 0;
        if (vrc == 0)
            FUZZ_CHECK(oracle_valid(n, sizes, firsts, lasts, (const uint64_t *)fixed, align,
                                    inclusive, arena, &a, &b),
                       "validate accepted an invalid plan (tensors %zu and %zu)", a, b);
    }
    return 0;
}
