/*
 * fuzz_common.h -- a tiny reader of fuzzer bytes shared by the libFuzzer targets in tests/fuzz.
 *
 * Every value is taken from the front of the input; once the bytes run out every read returns 0,
 * so each input (even the empty one) decodes to one well-defined scenario. Numbers come through
 * take_u64(), which mixes small raw values with the extremes that break arithmetic (0, 1, powers
 * of two and their neighbours, INT64_MIN/MAX, UINT64_MAX), so the fuzzer reaches them at once.
 *
 * FUZZ_CHECK(cond, fmt, ...) reports a broken property and aborts: libFuzzer then saves the
 * input as crash-<sha1> and the harness fails.
 */
#ifndef LSHM_FUZZ_COMMON_H
#define LSHM_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fuzz_in {
    const uint8_t *p;
    size_t n;
} fuzz_in;

static inline uint8_t take_u8(fuzz_in *in) {
    if (in->n == 0)
        return 0;
    in->n--;
    return *in->p++;
}

static inline uint64_t take_raw(fuzz_in *in, size_t bytes) {
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; i++)
        v |= (uint64_t)take_u8(in) << (8 * i);
    return v;
}

static inline int take_bool(fuzz_in *in) { return take_u8(in) & 1; }

/* One tag byte: its low 3 bits choose 1, 2, 4 or 8 raw bytes, or one of the extremes. */
static inline uint64_t take_u64(fuzz_in *in) {
    static const uint64_t extremes[] = {
        0,
        1,
        2,
        3,
        4095,
        4096,
        4097,
        65536,
        (uint64_t)1 << 31,
        (uint64_t)1 << 32,
        ((uint64_t)1 << 32) + 3,
        ((uint64_t)1 << 62),
        ((uint64_t)1 << 63) - 1, /* INT64_MAX */
        (uint64_t)1 << 63,       /* INT64_MIN */
        ((uint64_t)1 << 63) + 1,
        UINT64_MAX - 4095,
        UINT64_MAX - 1,
        UINT64_MAX, /* -1 as int64 */
        UINT64_MAX - 63,
        ((uint64_t)1 << 48),
    };
    uint8_t tag = take_u8(in);
    switch (tag & 7) {
    case 0:
    case 1:
        return take_raw(in, 1);
    case 2:
        return take_raw(in, 2);
    case 3:
        return take_raw(in, 4);
    case 4:
        return take_raw(in, 8);
    default:
        return extremes[(tag >> 3) % (sizeof extremes / sizeof extremes[0])];
    }
}

static inline int64_t take_i64(fuzz_in *in) {
    uint64_t v = take_u64(in);
    int64_t r;
    memcpy(&r, &v, sizeof r);
    return r;
}

#define FUZZ_CHECK(cond, ...)                                                                 \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n  ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n  lshm_last_error: %s\n", lshm_last_error());                \
            abort();                                                                          \
        }                                                                                     \
    } while (0)

#endif /* LSHM_FUZZ_COMMON_H */
