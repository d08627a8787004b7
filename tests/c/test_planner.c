/*
 * test_planner.c -- lshm_plan / lshm_plan_validate / lshm_plan_lower_bound.
 *
 * 1. Framework test facts (inputs embedded below, transcribed half-open from shared/traces/small):
 *    TFLite GPU 96 / 96 / 160 at alignment 128, TFLM 90 -> 80 and 120, XNNPACK 192 / 124,
 *    XLA 140 / 100, nativert 124, TVM hill-climb lower bounds 67 600 / 216 096 / 100 352 /
 *    176 923, TFLM person detection 64 512.
 * 2. Validity on random traces (seeds x sizes x alignments x interval modes x pinned and
 *    zero-size tensors): lshm_plan_validate and an independent O(n^2) overlap check.
 * 3. Bad input: each error returns its errno and leaves offsets and result untouched.
 * 4. Determinism, n = 0, and a short exact-search run.
 * 5. Capacity mode on a perfect packing the heuristics miss.
 * 6. Fuzzer findings (tests/fuzz/corpus/plan): validate of plans near 2^64, capacity
 *    UINT64_MAX, the lower bound at alignments above 2^32, lifetimes longer than INT64_MAX.
 * 7. Out of memory: each allocation of lshm_plan (dense and sparse engines, pins, the exact
 *    search, capacity mode) and of lshm_plan_lower_bound failed in turn: -ENOMEM with offsets
 *    and result untouched, or a valid plan; never a crash (nor a leak: the sanitizer build).
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* the fault-injection hooks of internal.h (the planner's allocations) */
#endif
#include "internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "task.h"

static const int64_t tflite_gpu_chain_data[][3] = { /* lower, upper (half-open), size */
    {0, 2, 16}, {1, 3, 8}, {2, 4, 64}, {3, 5, 32}, {4, 6, 8},
};
static const int64_t tflite_gpu_complex_data[][3] = { /* lower, upper (half-open), size */
    {0, 2, 32}, {1, 5, 32}, {2, 6, 8}, {3, 6, 16}, {4, 6, 8}, {5, 8, 64}, {6, 9, 8}, {7, 9, 8},
    {8, 10, 16},
};
static const int64_t pisarchyk_fig6_data[][3] = { /* lower, upper (half-open), size */
    {0, 2, 32}, {1, 5, 28}, {2, 6, 36}, {3, 6, 16}, {4, 6, 8}, {5, 8, 64}, {6, 9, 10},
    {7, 9, 40},
};
static const int64_t xnnpack_coalescing_data[][3] = { /* lower, upper (half-open), size */
    {1, 2, 56}, {0, 2, 40}, {1, 2, 64}, {0, 1, 152}, {1, 2, 20},
};
static const int64_t tflm_greedy_medium_data[][3] = { /* lower, upper (half-open), size */
    {0, 2, 10}, {1, 3, 20}, {2, 4, 30}, {3, 5, 40}, {0, 2, 50},
};
static const int64_t tflm_overlap_case_data[][3] = { /* lower, upper (half-open), size */
    {0, 2, 100}, {2, 4, 50}, {1, 3, 20},
};
static const int64_t tflm_person_detection_data[][3] = { /* lower, upper (half-open), size */
    {0, 30, 9216}, {28, 30, 3}, {27, 29, 256}, {26, 28, 2304}, {25, 27, 2304}, {24, 26, 2304},
    {23, 25, 1152}, {22, 24, 4608}, {21, 23, 4608}, {20, 22, 4608}, {19, 21, 4608},
    {18, 20, 4608}, {17, 19, 4608}, {16, 18, 4608}, {15, 17, 4608}, {14, 16, 4608},
    {13, 15, 4608}, {12, 14, 4608}, {11, 13, 2304}, {10, 12, 9216}, {9, 11, 9216},
    {8, 10, 9216}, {7, 9, 4608}, {6, 8, 18432}, {5, 7, 18432}, {4, 6, 18432}, {3, 5, 9216},
    {2, 4, 36864}, {1, 3, 18432}, {0, 2, 18432},
};
static const int64_t xla_bestfit_data[][3] = { /* lower, upper (half-open), size */
    {0, 4, 10}, {1, 7, 20}, {2, 8, 40}, {4, 9, 30}, {5, 10, 50},
};
static const int64_t levental_lstm_data[][3] = { /* lower, upper (half-open), size */
    {0, 4, 1024}, {1, 4, 1024}, {3, 5, 1024}, {5, 11, 256}, {6, 15, 256}, {7, 11, 256},
    {8, 10, 256}, {9, 13, 256}, {10, 13, 256}, {13, 15, 256},
};
static const int64_t tvm_simple_data[][3] = { /* lower, upper (half-open), size */
    {0, 24, 131072}, {4, 6, 65568}, {4, 10, 8192}, {8, 31, 15360}, {10, 12, 65568},
    {10, 16, 4096}, {16, 18, 65552}, {16, 22, 2048}, {22, 24, 32784}, {22, 28, 1024},
};
static const int64_t tvm_five_data[][3] = { /* lower, upper (half-open), size */
    {4, 6, 95}, {1, 5, 52135}, {3, 5, 12136}, {3, 6, 62099}, {4, 6, 50458},
};
static const int64_t tvm_alloc_max_data[][3] = { /* lower, upper (half-open), size */
    {0, 160, 2048}, {0, 14, 7904}, {4, 36, 16}, {12, 18, 32768}, {16, 22, 32768},
};
static const int64_t tvm_deep_speech_data[][3] = { /* lower, upper (half-open), size */
    {0, 160, 2048}, {0, 152, 2048}, {0, 14, 7904}, {2, 50, 16}, {4, 36, 16}, {6, 22, 16},
    {12, 18, 32768}, {16, 22, 32768}, {20, 28, 32768}, {26, 32, 32768}, {30, 36, 32768},
    {34, 42, 32768}, {40, 46, 32768}, {44, 50, 32768}, {48, 146, 32768}, {54, 60, 2048},
    {58, 484, 4096}, {60, 66, 2048}, {64, 462, 4096}, {66, 72, 2048}, {70, 440, 4096},
    {72, 78, 2048}, {76, 418, 4096}, {78, 84, 2048}, {82, 396, 4096}, {84, 90, 2048},
    {88, 374, 4096}, {90, 96, 2048}, {94, 352, 4096}, {96, 102, 2048}, {100, 330, 4096},
    {102, 108, 2048}, {106, 308, 4096}, {108, 114, 2048}, {112, 286, 4096}, {114, 120, 2048},
    {118, 264, 4096}, {120, 126, 2048}, {124, 242, 4096}, {126, 132, 2048}, {130, 220, 4096},
    {132, 138, 2048}, {136, 198, 4096}, {138, 144, 2048}, {142, 176, 4096}, {144, 150, 2048},
    {148, 154, 4096}, {152, 164, 8192}, {154, 172, 2048}, {156, 182, 2048}, {160, 168, 2048},
    {162, 166, 2048}, {168, 172, 2048}, {170, 510, 2048}, {174, 186, 8192}, {176, 194, 2048},
    {178, 204, 2048}, {182, 190, 2048}, {184, 188, 2048}, {190, 194, 2048}, {192, 512, 2048},
    {196, 208, 8192}, {198, 216, 2048}, {200, 226, 2048}, {204, 212, 2048}, {206, 210, 2048},
    {212, 216, 2048}, {214, 514, 2048}, {218, 230, 8192}, {220, 238, 2048}, {222, 248, 2048},
    {226, 234, 2048}, {228, 232, 2048}, {234, 238, 2048}, {236, 516, 2048}, {240, 252, 8192},
    {242, 260, 2048}, {244, 270, 2048}, {248, 256, 2048}, {250, 254, 2048}, {256, 260, 2048},
    {258, 518, 2048}, {262, 274, 8192}, {264, 282, 2048}, {266, 292, 2048}, {270, 278, 2048},
    {272, 276, 2048}, {278, 282, 2048}, {280, 520, 2048}, {284, 296, 8192}, {286, 304, 2048},
    {288, 314, 2048}, {292, 300, 2048}, {294, 298, 2048}, {300, 304, 2048}, {302, 522, 2048},
    {306, 318, 8192}, {308, 326, 2048}, {310, 336, 2048}, {314, 322, 2048}, {316, 320, 2048},
    {322, 326, 2048}, {324, 524, 2048}, {328, 340, 8192}, {330, 348, 2048}, {332, 358, 2048},
    {336, 344, 2048}, {338, 342, 2048}, {344, 348, 2048}, {346, 526, 2048}, {350, 362, 8192},
    {352, 370, 2048}, {354, 380, 2048}, {358, 366, 2048}, {360, 364, 2048}, {366, 370, 2048},
    {368, 528, 2048}, {372, 384, 8192}, {374, 392, 2048}, {376, 402, 2048}, {380, 388, 2048},
    {382, 386, 2048}, {388, 392, 2048}, {390, 530, 2048}, {394, 406, 8192}, {396, 414, 2048},
    {398, 424, 2048}, {402, 410, 2048}, {404, 408, 2048}, {410, 414, 2048}, {412, 532, 2048},
    {416, 428, 8192}, {418, 436, 2048}, {420, 446, 2048}, {424, 432, 2048}, {426, 430, 2048},
    {432, 436, 2048}, {434, 534, 2048}, {438, 450, 8192}, {440, 458, 2048}, {442, 468, 2048},
    {446, 454, 2048}, {448, 452, 2048}, {454, 458, 2048}, {456, 536, 2048}, {460, 472, 8192},
    {462, 480, 2048}, {464, 490, 2048}, {468, 476, 2048}, {470, 474, 2048}, {476, 480, 2048},
    {478, 538, 2048}, {482, 494, 8192}, {484, 502, 2048}, {486, 498, 2048}, {490, 498, 2048},
    {492, 496, 2048}, {496, 627, 2048}, {498, 502, 2048}, {500, 627, 2048}, {504, 550, 16},
    {508, 544, 32768}, {542, 550, 32768}, {548, 556, 32768}, {554, 564, 464}, {560, 564, 256},
    {562, 618, 2048}, {564, 568, 1856}, {566, 574, 1024}, {568, 620, 1024}, {570, 574, 1024},
    {572, 578, 1024}, {576, 580, 1024}, {578, 606, 1024}, {580, 594, 1024}, {584, 588, 1024},
    {586, 604, 1024}, {594, 598, 1024}, {596, 614, 1024}, {604, 608, 1024}, {606, 618, 1024},
    {616, 622, 2048}, {618, 622, 1024}, {620, 627, 464},
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

typedef struct trace {
    size_t n;
    uint64_t *size;
    int64_t *first, *last;
} trace;

static trace trace_from(const int64_t (*rows)[3], size_t n)
{
    trace t = {n, calloc(n + 1, 8), calloc(n + 1, 8), calloc(n + 1, 8)};
    ASSERT(t.size && t.first && t.last);
    for (size_t i = 0; i < n; i++) {
        t.first[i] = rows[i][0];
        t.last[i] = rows[i][1];
        t.size[i] = (uint64_t)rows[i][2];
    }
    return t;
}

static void trace_free(trace *t)
{
    free(t->size), free(t->first), free(t->last);
}

/* Independent check: every pair live together is disjoint, offsets aligned, ends <= arena. */
static void brute_check(const trace *t, const uint64_t *off, uint64_t alignment, int inclusive,
                        uint64_t arena, const int64_t *fixed)
{
    uint64_t top = 0;
    for (size_t i = 0; i < t->n; i++) {
        if (t->size[i] == 0) {
            if (!fixed || fixed[i] < 0)
                ASSERT_UINT_EQ(off[i], 0);
            continue;
        }
        ASSERT_UINT_EQ(off[i] % alignment, 0);
        if (fixed && fixed[i] >= 0)
            ASSERT_UINT_EQ(off[i], (uint64_t)fixed[i]);
        if (off[i] + t->size[i] > top && (inclusive || t->first[i] < t->last[i]))
            top = off[i] + t->size[i];
        for (size_t j = 0; j < i; j++) {
            if (t->size[j] == 0 || (!inclusive && (t->first[j] == t->last[j] ||
                                                   t->first[i] == t->last[i])))
                continue; /* occupies no memory, or is never live */
            int live_together = inclusive
                                    ? (t->first[i] <= t->last[j] && t->first[j] <= t->last[i])
                                    : (t->first[i] < t->last[j] && t->first[j] < t->last[i]);
            if (!live_together)
                continue;
            int overlap = off[i] < off[j] + t->size[j] && off[j] < off[i] + t->size[i];
            if (overlap)
                TEST_FAIL("tensors %zu and %zu overlap", j, i);
        }
    }
    ASSERT_UINT_EQ(top, arena);
}

static uint64_t plan_trace_cap(const trace *t, uint64_t alignment, unsigned flags,
                               double time_limit, uint64_t capacity, uint64_t *offsets,
                               lshm_plan_result *res)
{
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    ASSERT_UINT_EQ(o.capacity, 0);
    o.alignment = alignment;
    o.flags = flags;
    o.time_limit = time_limit;
    o.capacity = capacity;
    ASSERT_EQ(lshm_plan(t->n, t->size, t->first, t->last, NULL, &o, offsets, res), 0);
    ASSERT_EQ(lshm_plan_validate(t->n, t->size, t->first, t->last, offsets, &o, res->arena_size),
              0);
    brute_check(t, offsets, alignment, (flags & LSHM_PLAN_INCLUSIVE) != 0, res->arena_size, NULL);
    uint64_t lb = 0;
    ASSERT_EQ(lshm_plan_lower_bound(t->n, t->size, t->first, t->last, &o, &lb), 0);
    ASSERT_UINT_EQ(lb, res->lower_bound);
    ASSERT_LE(res->lower_bound, res->arena_size);
    return res->arena_size;
}

static uint64_t plan_trace(const trace *t, uint64_t alignment, unsigned flags, double time_limit,
                           uint64_t *offsets, lshm_plan_result *res)
{
    return plan_trace_cap(t, alignment, flags, time_limit, 0, offsets, res);
}

#define EXPECT_ARENA(rows, alignment, expected_arena, expected_lb)                            \
    do {                                                                                      \
        trace t_ = trace_from(rows, COUNT(rows));                                             \
        uint64_t off_[256];                                                                   \
        lshm_plan_result r_;                                                                  \
        ASSERT(COUNT(rows) <= 256);                                                           \
        plan_trace(&t_, alignment, 0, 0.0, off_, &r_);                                        \
        if (r_.arena_size != (uint64_t)(expected_arena) ||                                    \
            r_.lower_bound != (uint64_t)(expected_lb))                                        \
            TEST_FAIL("%s: arena %llu lb %llu, expected %llu / %llu", #rows,                  \
                      (unsigned long long)r_.arena_size, (unsigned long long)r_.lower_bound,  \
                      (unsigned long long)(expected_arena), (unsigned long long)(expected_lb)); \
        trace_free(&t_);                                                                      \
    } while (0)

static void test_framework_facts(void)
{
    EXPECT_ARENA(tflite_gpu_chain_data, 1, 96, 96);       /* TFLite GPU GREEDY_BY_SIZE offsets */
    EXPECT_ARENA(tflite_gpu_chain_data, 128, 160, 160);   /* OffsetAssignmentWithAlignment */
    EXPECT_ARENA(tflite_gpu_complex_data, 1, 96, 96);
    EXPECT_ARENA(pisarchyk_fig6_data, 1, 124, 124);       /* XNNPACK GeneralPlanning, nativert */
    EXPECT_ARENA(xnnpack_coalescing_data, 1, 192, 192);   /* XNNPACK MemoryBlocksCoalescing */
    EXPECT_ARENA(tflm_greedy_medium_data, 1, 80, 80);     /* TFLM expects 90; OPT is 80 */
    EXPECT_ARENA(tflm_overlap_case_data, 1, 120, 120);
    EXPECT_ARENA(tflm_person_detection_data, 1, 64512, 64512);
    EXPECT_ARENA(xla_bestfit_data, 1, 140, 140);          /* XLA heap simulator BestFit */
    EXPECT_ARENA(levental_lstm_data, 1, 3072, 3072);
    EXPECT_ARENA(tvm_alloc_max_data, 1, 67600, 67600);    /* TVM hill climb reaches LB */
    EXPECT_ARENA(tvm_simple_data, 1, 216096, 216096);
    EXPECT_ARENA(tvm_deep_speech_data, 1, 100352, 100352);
    EXPECT_ARENA(tvm_five_data, 1, 176923, 176923);

    /* XLA DecreasingSize: four buffers all live together -> heap = sum = 100. */
    static const int64_t xla_decreasing[][3] = {{0, 4, 10}, {0, 4, 20}, {0, 4, 30}, {0, 4, 40}};
    EXPECT_ARENA(xla_decreasing, 1, 100, 100);

    /* The same chain in the sources' inclusive form gives the same plan. */
    trace t = trace_from(tflite_gpu_chain_data, COUNT(tflite_gpu_chain_data));
    for (size_t i = 0; i < t.n; i++)
        t.last[i] -= 1;
    uint64_t off[8];
    lshm_plan_result r;
    ASSERT_UINT_EQ(plan_trace(&t, 1, LSHM_PLAN_INCLUSIVE, 0.0, off, &r), 96);
    ASSERT_UINT_EQ(plan_trace(&t, 128, LSHM_PLAN_INCLUSIVE, 0.0, off, &r), 160);
    ASSERT_EQ(r.optimal, 1);
    trace_free(&t);
}

static uint64_t rng_state;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static trace random_trace(size_t n, int64_t horizon, uint64_t max_size, int zero_sizes)
{
    trace t = {n, calloc(n + 1, 8), calloc(n + 1, 8), calloc(n + 1, 8)};
    ASSERT(t.size && t.first && t.last);
    for (size_t i = 0; i < n; i++) {
        int64_t a = (int64_t)(rnd() % (uint64_t)horizon) - horizon / 3;
        int64_t len = (int64_t)(rnd() % (uint64_t)(1 + horizon / 4));
        t.first[i] = a;
        t.last[i] = a + len;
        t.size[i] = 1 + rnd() % max_size;
        if (zero_sizes && rnd() % 7 == 0)
            t.size[i] = 0;
    }
    return t;
}

static void test_random_validity(void)
{
    static const uint64_t alignments[] = {1, 8, 64, 4096};
    static const size_t sizes_n[] = {1, 2, 5, 17, 60, 200};
    size_t cases = 0;
    for (uint64_t seed = 1; seed <= 8; seed++) {
        for (size_t ni = 0; ni < COUNT(sizes_n); ni++) {
            for (size_t ai = 0; ai < COUNT(alignments); ai++) {
                for (unsigned flags = 0; flags <= LSHM_PLAN_INCLUSIVE; flags++) {
                    rng_state = seed * 0x9E3779B97F4A7C15ull + ni * 131 + ai * 7 + flags;
                    size_t n = sizes_n[ni];
                    trace t = random_trace(n, 2 + (int64_t)(rnd() % 100),
                                           1 + rnd() % 10000, (int)(seed & 1));
                    uint64_t *off = calloc(n, 8);
                    int64_t *fixed = malloc(n * 8);
                    ASSERT(off && fixed);
                    lshm_plan_result r;
                    plan_trace(&t, alignments[ai], flags, 0.0, off, &r);
                    /* pin a few tensors where this plan put them (a consistent pinned set),
                     * then re-plan the others around them */
                    lshm_plan_options o;
                    lshm_plan_options_init(&o);
                    o.alignment = alignments[ai];
                    o.flags = flags;
                    for (size_t i = 0; i < n; i++)
                        fixed[i] = (rnd() % 4 == 0) ? (int64_t)off[i] : -1;
                    ASSERT_EQ(lshm_plan(n, t.size, t.first, t.last, fixed, &o, off, &r), 0);
                    ASSERT_EQ(lshm_plan_validate(n, t.size, t.first, t.last, off, &o,
                                                 r.arena_size), 0);
                    brute_check(&t, off, alignments[ai], flags != 0, r.arena_size, fixed);
                    ASSERT_LE(r.lower_bound, r.arena_size);
                    free(off), free(fixed);
                    trace_free(&t);
                    cases++;
                }
            }
        }
    }
    printf("  %zu random cases valid\n", cases);
}

static void test_bad_input(void)
{
    uint64_t size[3] = {8, 16, 8};
    int64_t first[3] = {0, 1, 2}, last[3] = {2, 3, 4};
    uint64_t off[3] = {111, 222, 333};
    lshm_plan_result r;
    memset(&r, 0x5a, sizeof r);
    lshm_plan_result r0 = r;
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    ASSERT_UINT_EQ(o.alignment, 64);
    ASSERT_EQ(o.flags, 0);
    ASSERT(o.time_limit == 0.0);

#define EXPECT_ERR(call, code)                                                                \
    do {                                                                                      \
        ASSERT_EQ((call), (code));                                                            \
        ASSERT_UINT_EQ(off[0], 111);                                                          \
        ASSERT_UINT_EQ(off[1], 222);                                                          \
        ASSERT_UINT_EQ(off[2], 333);                                                          \
        ASSERT(memcmp(&r, &r0, sizeof r) == 0);                                               \
        ASSERT(strlen(lshm_last_error()) > 0);                                                \
    } while (0)

    EXPECT_ERR(lshm_plan(3, NULL, first, last, NULL, &o, off, &r), -EINVAL);
    EXPECT_ERR(lshm_plan(3, size, NULL, last, NULL, &o, off, &r), -EINVAL);
    EXPECT_ERR(lshm_plan(3, size, first, NULL, NULL, &o, off, &r), -EINVAL);
    EXPECT_ERR(lshm_plan(3, size, first, last, NULL, &o, NULL, &r), -EINVAL);
    int64_t bad_last[3] = {2, 0, 4}; /* first 1 > last 0 */
    EXPECT_ERR(lshm_plan(3, size, first, bad_last, NULL, &o, off, &r), -EINVAL);
    o.alignment = 48;
    EXPECT_ERR(lshm_plan(3, size, first, last, NULL, &o, off, &r), -EINVAL);
    o.alignment = 64;
    o.flags = 0x80;
    EXPECT_ERR(lshm_plan(3, size, first, last, NULL, &o, off, &r), -EINVAL);
    o.flags = 0;
    o.time_limit = -1.0;
    EXPECT_ERR(lshm_plan(3, size, first, last, NULL, &o, off, &r), -EINVAL);
    o.time_limit = 0.0;
    int64_t misaligned[3] = {-1, 32, -1};
    EXPECT_ERR(lshm_plan(3, size, first, last, misaligned, &o, off, &r), -EINVAL);
    int64_t colliding[3] = {0, 0, -1}; /* tensors 0 and 1 are live together at t = 1 */
    EXPECT_ERR(lshm_plan(3, size, first, last, colliding, &o, off, &r), -EINVAL);
    int64_t negative[3] = {-5, -1, -1};
    EXPECT_ERR(lshm_plan(3, size, first, last, negative, &o, off, &r), -EINVAL);
    uint64_t huge[3] = {UINT64_MAX - 10, 16, 8};
    EXPECT_ERR(lshm_plan(3, huge, first, last, NULL, &o, off, &r), -EOVERFLOW);
    uint64_t big[3] = {UINT64_MAX / 2, UINT64_MAX / 2, 4096};
    EXPECT_ERR(lshm_plan(3, big, first, last, NULL, &o, off, &r), -EOVERFLOW);
    int64_t far_fixed[3] = {INT64_MAX - 63, -1, -1}; /* pinned offset + size wraps */
    uint64_t large[3] = {UINT64_MAX / 2 + 200, 16, 8};
    o.alignment = 1;
    EXPECT_ERR(lshm_plan(3, large, first, last, far_fixed, &o, off, &r), -EOVERFLOW);
    o.alignment = 64;

    /* lower bound and validate reject the same inputs */
    uint64_t lb = 77;
    ASSERT_EQ(lshm_plan_lower_bound(3, size, first, bad_last, &o, &lb), -EINVAL);
    ASSERT_EQ(lshm_plan_lower_bound(3, size, first, last, &o, NULL), -EINVAL);
    ASSERT_UINT_EQ(lb, 77);
    uint64_t good[3] = {0, 64, 0};
    ASSERT_EQ(lshm_plan_validate(3, size, first, last, good, &o, 80), 0);
    ASSERT_EQ(lshm_plan_validate(3, size, first, last, good, &o, 79), -EINVAL);
    uint64_t clash[3] = {0, 0, 64};
    ASSERT_EQ(lshm_plan_validate(3, size, first, last, clash, &o, 1000), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "overlap") != NULL);
    uint64_t unaligned[3] = {0, 64, 8};
    ASSERT_EQ(lshm_plan_validate(3, size, first, last, unaligned, &o, 1000), -EINVAL);
    ASSERT_EQ(lshm_plan_validate(3, size, first, last, NULL, &o, 1000), -EINVAL);

    /* n == 0 is valid; NULL arrays are fine then */
    ASSERT_EQ(lshm_plan(0, NULL, NULL, NULL, NULL, &o, NULL, &r), 0);
    ASSERT_UINT_EQ(r.arena_size, 0);
    ASSERT_UINT_EQ(r.lower_bound, 0);
    ASSERT_EQ(lshm_plan_lower_bound(0, NULL, NULL, NULL, &o, &lb), 0);
    ASSERT_UINT_EQ(lb, 0);
    ASSERT_EQ(lshm_plan_validate(0, NULL, NULL, NULL, NULL, &o, 0), 0);
}

static void test_edge_cases(void)
{
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    lshm_plan_result r;
    /* zero sizes and empty half-open lifetimes never conflict and get offset 0 */
    uint64_t size[4] = {0, 100, 0, 50};
    int64_t first[4] = {0, 0, 0, 3}, last[4] = {9, 9, 9, 3};
    uint64_t off[4] = {9, 9, 9, 9};
    ASSERT_EQ(lshm_plan(4, size, first, last, NULL, &o, off, &r), 0);
    for (int i = 0; i < 4; i++)
        ASSERT_UINT_EQ(off[i], 0);
    ASSERT_UINT_EQ(r.arena_size, 100);
    ASSERT_EQ(r.optimal, 1);
    /* inclusive: [3, 3] is live and meets [0, 9] */
    o.flags = LSHM_PLAN_INCLUSIVE;
    ASSERT_EQ(lshm_plan(4, size, first, last, NULL, &o, off, &r), 0);
    ASSERT_LE(r.arena_size, 128 + 50);
    ASSERT_UINT_EQ(r.lower_bound, 64 + 100); /* 50 at 0, 100 at 64: padding only below the top */
    /* extreme time values */
    int64_t f2[2] = {INT64_MIN, INT64_MAX}, l2[2] = {INT64_MAX, INT64_MAX};
    uint64_t s2[2] = {10, 10}, o2[2];
    ASSERT_EQ(lshm_plan(2, s2, f2, l2, NULL, &o, o2, &r), 0);
    ASSERT_UINT_EQ(r.arena_size, 64 + 10);
    o.flags = 0;
    ASSERT_EQ(lshm_plan(2, s2, f2, l2, NULL, &o, o2, &r), 0);
    ASSERT_UINT_EQ(r.arena_size, 10);
    /* a pinned tensor that the others must avoid */
    uint64_t s3[3] = {64, 64, 64};
    int64_t f3[3] = {0, 0, 0}, l3[3] = {5, 5, 5}, fx[3] = {-1, 64, -1};
    uint64_t o3[3];
    ASSERT_EQ(lshm_plan(3, s3, f3, l3, fx, &o, o3, &r), 0);
    ASSERT_UINT_EQ(o3[1], 64);
    ASSERT_UINT_EQ(r.arena_size, 192);
    ASSERT_EQ(lshm_plan_validate(3, s3, f3, l3, o3, &o, r.arena_size), 0);
    /* NULL options mean the defaults; NULL result is allowed */
    ASSERT_EQ(lshm_plan(3, s3, f3, l3, NULL, NULL, o3, NULL), 0);
    ASSERT_EQ(lshm_plan_validate(3, s3, f3, l3, o3, NULL, 192), 0);
}

static void test_determinism(void)
{
    rng_state = 42;
    trace t = random_trace(3000, 5000, 1 << 20, 1);
    uint64_t *a = malloc(t.n * 8), *b = malloc(t.n * 8);
    lshm_plan_result ra, rb;
    plan_trace(&t, 64, 0, 0.0, a, &ra);
    plan_trace(&t, 64, 0, 0.0, b, &rb);
    ASSERT(memcmp(a, b, t.n * 8) == 0);
    ASSERT_UINT_EQ(ra.arena_size, rb.arena_size);
    ASSERT(strcmp(ra.strategy, rb.strategy) == 0);
    printf("  3000 tensors: arena/LB %.4f by %s in %.2f ms\n",
           (double)ra.arena_size / (double)ra.lower_bound, ra.strategy, ra.seconds * 1e3);
    free(a), free(b);
    trace_free(&t);
}

/* Reference best fit (O(n^2)): tensors in the given order, each at the smallest gap between the
 * placed tensors live with it (lowest on ties), else on top. Half-open lifetimes, alignment 1. */
static uint64_t reference_best_fit(const trace *t, const size_t *order)
{
    uint64_t *off = malloc(t->n * 8), arena = 0;
    uint8_t *placed = calloc(t->n, 1);
    ASSERT(off && placed);
    for (size_t k = 0; k < t->n; k++) {
        size_t i = order[k];
        if (t->size[i] == 0 || t->first[i] >= t->last[i])
            continue;
        uint64_t best = UINT64_MAX, best_gap = UINT64_MAX, cand = 0;
        for (;;) { /* candidate offsets: 0 and the ends of live-together placed tensors */
            uint64_t next_lo = UINT64_MAX, cover = cand;
            int moved = 1;
            while (moved) { /* raise cand past every block covering it */
                moved = 0;
                for (size_t j = 0; j < t->n; j++)
                    if (placed[j] && t->first[j] < t->last[i] && t->first[i] < t->last[j] &&
                        off[j] <= cover && off[j] + t->size[j] > cover) {
                        cover = off[j] + t->size[j];
                        moved = 1;
                    }
            }
            cand = cover;
            for (size_t j = 0; j < t->n; j++)
                if (placed[j] && t->first[j] < t->last[i] && t->first[i] < t->last[j] &&
                    off[j] > cand && off[j] < next_lo)
                    next_lo = off[j];
            if (next_lo == UINT64_MAX) { /* top */
                if (best == UINT64_MAX)
                    best = cand;
                break;
            }
            if (next_lo - cand >= t->size[i] && next_lo - cand < best_gap) {
                best_gap = next_lo - cand;
                best = cand;
            }
            cand = next_lo;
        }
        off[i] = best;
        placed[i] = 1;
        if (best + t->size[i] > arena)
            arena = best + t->size[i];
    }
    free(off), free(placed);
    return arena;
}

static const trace *cmp_trace;
static int by_size_desc(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    const trace *t = cmp_trace;
    if (t->size[i] != t->size[j])
        return t->size[i] > t->size[j] ? -1 : 1;
    int64_t li = t->last[i] - t->first[i], lj = t->last[j] - t->first[j];
    if (li != lj)
        return li > lj ? -1 : 1;
    if (t->first[i] != t->first[j])
        return t->first[i] < t->first[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}
static int by_start(const void *a, const void *b)
{
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    if (cmp_trace->first[i] != cmp_trace->first[j])
        return cmp_trace->first[i] < cmp_trace->first[j] ? -1 : 1;
    return i < j ? -1 : (i > j);
}

/* Dense traces (hundreds of tensors live together) take the segment-tree engine and the large
 * portfolio: plans must be valid, deterministic, and no worse than plain best fit in size order
 * (TFLite) or in execution order (ONNX Runtime), computed here by brute force. */
static void test_dense(void)
{
    static const size_t ns[] = {300, 800, 1500};
    for (size_t c = 0; c < COUNT(ns); c++) {
        rng_state = 0xD15EA5Eull + c;
        size_t n = ns[c];
        trace t = random_trace(n, 40 + (int64_t)(rnd() % 40), 1 + rnd() % 5000, 0);
        uint64_t *off = malloc(n * 8), *off2 = malloc(n * 8);
        size_t *order = malloc(n * sizeof *order);
        ASSERT(off && off2 && order);
        lshm_plan_result r, r2;
        uint64_t arena = plan_trace(&t, 1, 0, 0.0, off, &r);
        plan_trace(&t, 1, 0, 0.0, off2, &r2);
        ASSERT(memcmp(off, off2, n * 8) == 0);
        cmp_trace = &t;
        for (size_t i = 0; i < n; i++)
            order[i] = i;
        qsort(order, n, sizeof *order, by_size_desc);
        uint64_t tflite = reference_best_fit(&t, order);
        qsort(order, n, sizeof *order, by_start);
        uint64_t online = reference_best_fit(&t, order);
        ASSERT_LE(arena, tflite);
        ASSERT_LE(arena, online);
        printf("  n %zu: arena/LB %.4f (size best fit %.4f, online %.4f) by %s in %.2f ms\n", n,
               (double)arena / (double)r.lower_bound, (double)tflite / (double)r.lower_bound,
               (double)online / (double)r.lower_bound, r.strategy, r.seconds * 1e3);
        /* alignment, inclusive lifetimes and pinned tensors on the same dense trace */
        plan_trace(&t, 64, LSHM_PLAN_INCLUSIVE, 0.0, off, &r);
        int64_t *fixed = malloc(n * 8);
        ASSERT(fixed);
        for (size_t i = 0; i < n; i++)
            fixed[i] = (rnd() % 5 == 0) ? (int64_t)off[i] : -1;
        lshm_plan_options o;
        lshm_plan_options_init(&o);
        o.alignment = 64;
        o.flags = LSHM_PLAN_INCLUSIVE;
        ASSERT_EQ(lshm_plan(n, t.size, t.first, t.last, fixed, &o, off2, &r2), 0);
        brute_check(&t, off2, 64, 1, r2.arena_size, fixed);
        free(off), free(off2), free(order), free(fixed);
        trace_free(&t);
    }
}

/* With a time budget, the improvement and exact phases must keep plans valid and never worse. */
static void test_time_budget(void)
{
    for (uint64_t seed = 1; seed <= 6; seed++) {
        rng_state = seed * 7919;
        trace t = random_trace(40 + seed * 10, 60, 1000, 0);
        uint64_t *a = malloc(t.n * 8), *b = malloc(t.n * 8);
        lshm_plan_result ra, rb;
        uint64_t h = plan_trace(&t, 1, 0, 0.0, a, &ra);
        uint64_t e = plan_trace(&t, 1, 0, 0.2, b, &rb);
        ASSERT_LE(e, h);
        if (rb.optimal && e > rb.lower_bound)
            printf("  seed %llu: proven optimum %llu above LB %llu\n", (unsigned long long)seed,
                   (unsigned long long)e, (unsigned long long)rb.lower_bound);
        free(a), free(b);
        trace_free(&t);
    }
    /* TFLM medium: the size order gives 90 (TFLM's value); with a budget the result is OPT */
    trace t = trace_from(tflm_greedy_medium_data, COUNT(tflm_greedy_medium_data));
    uint64_t off[8];
    lshm_plan_result r;
    ASSERT_UINT_EQ(plan_trace(&t, 1, 0, 0.1, off, &r), 80);
    trace_free(&t);

    /* Decomposition: two copies of TFLM medium apart in time (independent at the root), then
     * the same joined by one long tensor (independent once it is placed). Both reach LB. */
    for (int joined = 0; joined <= 1; joined++) {
        int64_t rows[11][3];
        size_t k = 0;
        for (int copy = 0; copy < 2; copy++)
            for (size_t i = 0; i < COUNT(tflm_greedy_medium_data); i++, k++) {
                rows[k][0] = tflm_greedy_medium_data[i][0] + 10 * copy;
                rows[k][1] = tflm_greedy_medium_data[i][1] + 10 * copy;
                rows[k][2] = tflm_greedy_medium_data[i][2];
            }
        if (joined) {
            rows[k][0] = 0, rows[k][1] = 15, rows[k][2] = 16;
            k++;
        }
        trace d = trace_from((const int64_t(*)[3])rows, k);
        uint64_t o2[11];
        ASSERT_UINT_EQ(plan_trace(&d, 1, 0, 1.0, o2, &r), joined ? 96 : 80);
        ASSERT(r.optimal);
        trace_free(&d);
    }
}

/* A perfect packing: the box [0, T) x [0, capacity) cut recursively (guillotine cuts, in time
 * or in space at multiples of 256 bytes) into n rectangles, each one a tensor. Every time point
 * holds exactly `capacity` bytes, so LB = OPT = capacity; the greedy orders miss it. */
static trace guillotine_trace(uint64_t seed, size_t n, int64_t T, uint64_t capacity)
{
    int64_t(*rows)[3] = calloc(n, sizeof *rows);
    uint64_t *lo = calloc(n, sizeof *lo);
    ASSERT(rows && lo);
    rng_state = seed * 0x9E3779B97F4A7C15ull;
    size_t k = 1;
    rows[0][0] = 0, rows[0][1] = T, rows[0][2] = (int64_t)capacity, lo[0] = 0;
    for (unsigned guard = 0; k < n && guard < 100000; guard++) {
        size_t i = rnd() % k;
        if (rnd() % 2) { /* cut in time */
            int64_t t0 = rows[i][0], t1 = rows[i][1];
            if (t1 - t0 < 2)
                continue;
            int64_t t = t0 + 1 + (int64_t)(rnd() % (uint64_t)(t1 - t0 - 1));
            rows[i][1] = t;
            rows[k][0] = t, rows[k][1] = t1, rows[k][2] = rows[i][2], lo[k] = lo[i];
        } else { /* cut in space */
            uint64_t units = (uint64_t)rows[i][2] / 256;
            if (units < 2)
                continue;
            uint64_t cut = 256 * (1 + rnd() % (units - 1));
            rows[k][0] = rows[i][0], rows[k][1] = rows[i][1];
            rows[k][2] = rows[i][2] - (int64_t)cut, lo[k] = lo[i] + cut;
            rows[i][2] = (int64_t)cut;
        }
        k++;
    }
    trace t = trace_from((const int64_t(*)[3])rows, k);
    free(rows), free(lo);
    return t;
}

/* Capacity mode: the heuristics miss a perfect packing; the exact search fits it at its
 * capacity (= LB, so proven optimal); an impossible capacity returns the best plan, above it;
 * a loose one is met by the heuristics alone; time_limit 0 never runs the exact search. */
static void test_capacity(void)
{
    const uint64_t C = 65536;
    trace t = guillotine_trace(1, 100, 60, C);
    uint64_t *off = malloc(t.n * sizeof *off);
    ASSERT(off);
    lshm_plan_result r;
    uint64_t h = plan_trace(&t, 1, 0, 0.0, off, &r);
    ASSERT_UINT_EQ(r.lower_bound, C);
    ASSERT(h > C);
    ASSERT_UINT_EQ(plan_trace_cap(&t, 1, 0, 0.0, C, off, &r), h); /* no exact search */
    ASSERT_UINT_EQ(plan_trace_cap(&t, 1, 0, 10.0, C, off, &r), C);
    ASSERT(r.optimal);
    ASSERT(strcmp(r.strategy, "exact") == 0);
    printf("  guillotine n %zu: heuristics %.4f x LB, capacity %llu met in %.3f s\n", t.n,
           (double)h / C, (unsigned long long)C, r.seconds);
    ASSERT(r.seconds < 5.0);
    ASSERT_UINT_EQ(plan_trace_cap(&t, 1, 0, 10.0, C - 1, off, &r), h); /* below LB: no search */
    ASSERT(r.seconds < 1.0);
    ASSERT_LE(plan_trace_cap(&t, 1, 0, 10.0, h, off, &r), h); /* the heuristics meet it */
    ASSERT(strcmp(r.strategy, "exact") != 0);
    ASSERT(r.seconds < 1.0);
    ASSERT_UINT_EQ(plan_trace(&t, 1, 0, 5.0, off, &r), C); /* minimise mode: LB first */
    ASSERT(r.optimal);
    free(off);
    trace_free(&t);
}

/* Fuzzer finding tests/fuzz/corpus/plan/validate-eoverflow-*: lshm_plan_validate refused valid
 * plans with -EOVERFLOW because it also checked the planning bound (sum of padded sizes + the
 * highest end). It now refuses only an offset + size that overflows 64 bits. */
static void test_validate_large_plans(void)
{
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    o.alignment = 1;
    lshm_plan_result r;
    const uint64_t half = (uint64_t)1 << 63;
    /* one tensor of 2^63 bytes: plan [0, 2^63), and validate accepts it */
    uint64_t s1[1] = {half}, o1[1] = {77};
    int64_t f1[1] = {0}, l1[1] = {1};
    ASSERT_EQ(lshm_plan(1, s1, f1, l1, NULL, &o, o1, &r), 0);
    ASSERT_UINT_EQ(o1[0], 0);
    ASSERT_UINT_EQ(r.arena_size, half);
    ASSERT_EQ(lshm_plan_validate(1, s1, f1, l1, o1, &o, half), 0);
    ASSERT_EQ(lshm_plan_validate(1, s1, f1, l1, o1, &o, half - 1), -EINVAL);
    /* two 2^63-byte tensors one after the other share [0, 2^63) (their sum is 2^64: lshm_plan
     * refuses to plan them, but the plan is valid) */
    uint64_t s2[2] = {half, half}, o2[2] = {0, 0};
    int64_t f2[2] = {0, 1}, l2[2] = {1, 2};
    ASSERT_EQ(lshm_plan_validate(2, s2, f2, l2, o2, &o, half), 0);
    /* the second at 2^63 ends at 2^64: real overflow */
    o2[1] = half;
    ASSERT_EQ(lshm_plan_validate(2, s2, f2, l2, o2, &o, UINT64_MAX), -EOVERFLOW);
    /* a size that overflows when aligned, at offset 0, ends below 2^64 */
    o.alignment = 64;
    uint64_t s3[1] = {UINT64_MAX - 10}, o3[1] = {0};
    ASSERT_EQ(lshm_plan_validate(1, s3, f1, l1, o3, &o, UINT64_MAX - 10), 0);
    /* a zero-size tensor ends at its offset, UINT64_MAX included (alignment 1) */
    o.alignment = 1;
    uint64_t s4[2] = {0, 5}, o4[2] = {UINT64_MAX, 0};
    ASSERT_EQ(lshm_plan_validate(2, s4, f2, l2, o4, &o, 5), 0);
    o4[1] = UINT64_MAX - 4; /* ends at 2^64 */
    ASSERT_EQ(lshm_plan_validate(2, s4, f2, l2, o4, &o, UINT64_MAX), -EOVERFLOW);
    /* an INT64_MIN..INT64_MAX lifetime next to one at INT64_MAX, sizes near 2^62 */
    uint64_t s5[2] = {(uint64_t)1 << 62, ((uint64_t)1 << 62) + 1}, o5[2] = {77, 77};
    int64_t f5[2] = {INT64_MIN, INT64_MAX - 1}, l5[2] = {INT64_MAX, INT64_MAX};
    o.flags = LSHM_PLAN_INCLUSIVE;
    ASSERT_EQ(lshm_plan(2, s5, f5, l5, NULL, &o, o5, &r), 0);
    ASSERT_UINT_EQ(r.arena_size, s5[0] + s5[1]);
    ASSERT_EQ(lshm_plan_validate(2, s5, f5, l5, o5, &o, r.arena_size), 0);
}

/* Fuzzer finding tests/fuzz/corpus/plan/capacity-max-*: with capacity UINT64_MAX the
 * portfolio's "capacity met" test was true before any plan (best started at UINT64_MAX), so no
 * strategy ran and lshm_plan returned uninitialised offsets (strategy "empty"). */
static void test_capacity_max(void)
{
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    lshm_plan_result r, r0;
    uint64_t size[3] = {100, 200, 300};
    int64_t first[3] = {0, 1, 2}, last[3] = {3, 4, 5};
    ASSERT_EQ(lshm_plan(3, size, first, last, NULL, &o, (uint64_t[3]){0}, &r0), 0);
    const uint64_t caps[3] = {UINT64_MAX, UINT64_MAX - 1, r0.arena_size};
    for (int c = 0; c < 3; c++) {
        for (int tl = 0; tl < 2; tl++) {
            o.capacity = caps[c];
            o.time_limit = tl ? 0.05 : 0.0;
            uint64_t off[3];
            memset(off, 0xab, sizeof off);
            ASSERT_EQ(lshm_plan(3, size, first, last, NULL, &o, off, &r), 0);
            ASSERT(strcmp(r.strategy, "empty") != 0);
            ASSERT(r.arena_size <= caps[c]);
            ASSERT_LE(r.lower_bound, r.arena_size);
            ASSERT_LE(r.arena_size, 128 + 256 + 320); /* the padded sizes */
            ASSERT_EQ(lshm_plan_validate(3, size, first, last, off, &o, r.arena_size), 0);
        }
    }
    /* the fuzzer's input: one tensor of 100 bytes live [0, 1), alignment 256 */
    uint64_t z[1] = {100}, zo[1] = {0xabababababababab};
    int64_t zf[1] = {0}, zl[1] = {1};
    o.alignment = 256;
    o.capacity = UINT64_MAX;
    o.time_limit = 0;
    ASSERT_EQ(lshm_plan(1, z, zf, zl, NULL, &o, zo, &r), 0);
    ASSERT_UINT_EQ(zo[0], 0);
    ASSERT_UINT_EQ(r.arena_size, 100);
    ASSERT_EQ(r.optimal, 1);
}

/* Fuzzer finding tests/fuzz/corpus/plan/lower-bound-pad32-*: the lower bound's heap packed
 * (padding << 32 | end) in 64 bits, so with an alignment above 2^32 the padding lost its high
 * bits: the bound exceeded the plan (and `optimal` was wrong). */
static void test_lower_bound_huge_alignment(void)
{
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    lshm_plan_result r;
    const uint64_t a33 = (uint64_t)1 << 33;
    uint64_t lb = 0, off[2];
    /* one byte at alignment 2^33 (padding 2^33 - 1) and at 2^63 (padding 2^63 - 1) */
    uint64_t s1[1] = {1};
    int64_t f1[1] = {0}, l1[1] = {1};
    for (int k = 0; k < 2; k++) {
        o.alignment = k ? (uint64_t)1 << 63 : a33;
        ASSERT_EQ(lshm_plan_lower_bound(1, s1, f1, l1, &o, &lb), 0);
        ASSERT_UINT_EQ(lb, 1);
        ASSERT_EQ(lshm_plan(1, s1, f1, l1, NULL, &o, off, &r), 0);
        ASSERT_UINT_EQ(r.arena_size, 1);
        ASSERT_UINT_EQ(r.lower_bound, 1);
        ASSERT_EQ(r.optimal, 1);
    }
    /* two live together, sizes 1 and 2^32 + 1 at 2^33: both pad to 2^33, the larger padding
     * (2^33 - 1) goes on top: LB = 2^33 + 1, met by the larger one below */
    o.alignment = a33;
    uint64_t s2[2] = {1, ((uint64_t)1 << 32) + 1};
    int64_t f2[2] = {0, 0}, l2[2] = {1, 1};
    ASSERT_EQ(lshm_plan_lower_bound(2, s2, f2, l2, &o, &lb), 0);
    ASSERT_UINT_EQ(lb, a33 + 1);
    ASSERT_EQ(lshm_plan(2, s2, f2, l2, NULL, &o, off, &r), 0);
    ASSERT_UINT_EQ(r.arena_size, a33 + 1);
    ASSERT_UINT_EQ(r.lower_bound, a33 + 1);
    ASSERT_EQ(r.optimal, 1);
    ASSERT_UINT_EQ(off[0], a33);
    ASSERT_UINT_EQ(off[1], 0);
}

/* Audit of the input path: lifetimes longer than INT64_MAX (INT64_MIN..INT64_MAX) reach the
 * exact search's preorder keys (width = last - first was an int64 overflow; size x width
 * wrapped) and the area order (duration + 1 wrapped to 0). The guillotine packing with its
 * times spread over the whole int64 range is the same problem: the capacity is still met. */
static void test_extreme_lifetimes_exact(void)
{
    const uint64_t C = 65536;
    trace t = guillotine_trace(1, 100, 60, C);
    uint64_t *off = malloc((t.n + 1) * sizeof *off);
    ASSERT(off);
    for (size_t i = 0; i < t.n; i++) { /* t -> INT64_MIN + t 2^58 (60 2^58 > INT64_MAX) */
        t.first[i] = (int64_t)((uint64_t)INT64_MIN + ((uint64_t)t.first[i] << 58));
        t.last[i] = t.last[i] == 60 ? INT64_MAX
                                    : (int64_t)((uint64_t)INT64_MIN + ((uint64_t)t.last[i] << 58));
    }
    lshm_plan_result r;
    uint64_t h = plan_trace(&t, 1, 0, 0.0, off, &r);
    ASSERT(h > C);
    ASSERT_UINT_EQ(plan_trace_cap(&t, 1, 0, 10.0, C, off, &r), C);
    ASSERT(strcmp(r.strategy, "exact") == 0);
    plan_trace(&t, 1, LSHM_PLAN_INCLUSIVE, 0.2, off, &r); /* + 1 saturates at INT64_MAX */
    free(off);
    trace_free(&t);
}

/* Runs call(ctx) with its nth allocation failing (-ENOMEM), for nth = 1, 2, ... until a run
   in which none failed (that one must succeed), check(ctx, rc, failed) judging each outcome
   (failed: an allocation of this run failed). Returns how many allocations the call makes. */
static int failing_each_allocation(int (*call)(void *), void (*check)(void *, int, int),
                                   void *ctx)
{
    for (int nth = 1;; nth++) {
        lshm__fault_arm(nth, -ENOMEM);
        int rc = call(ctx);
        int hit = lshm__fault_points_hit();
        lshm__fault_arm(0, 0);
        check(ctx, rc, hit >= nth);
        if (hit < nth) { /* no allocation failed: the result is whole */
            ASSERT_EQ(rc, 0);
            return nth - 1;
        }
        ASSERT(nth < 100000);
    }
}

typedef struct {
    const trace *t;
    const int64_t *fixed;
    const lshm_plan_options *o;
    uint64_t *off;
    lshm_plan_result r;
} plan_call;

static int run_plan(void *ctx)
{
    plan_call *c = ctx;
    memset(c->off, 0xAB, (c->t->n + 1) * 8);
    memset(&c->r, 0xCD, sizeof c->r);
    return lshm_plan(c->t->n, c->t->size, c->t->first, c->t->last, c->fixed, c->o, c->off,
                     &c->r);
}

/* a valid plan (the planner may fall back from a failed allocation), or -ENOMEM with the
   offsets and the result untouched */
static void check_plan(void *ctx, int rc, int failed)
{
    plan_call *c = ctx;
    (void)failed;
    if (rc == 0) {
        brute_check(c->t, c->off, c->o->alignment, (c->o->flags & LSHM_PLAN_INCLUSIVE) != 0,
                    c->r.arena_size, c->fixed);
        return;
    }
    ASSERT_EQ(rc, -ENOMEM);
    for (size_t i = 0; i < c->t->n; i++)
        ASSERT_UINT_EQ(c->off[i], 0xABABABABABABABABull);
    ASSERT_UINT_EQ(c->r.arena_size, 0xCDCDCDCDCDCDCDCDull);
}

static int plan_failing_each_allocation(const trace *t, const int64_t *fixed,
                                        const lshm_plan_options *o)
{
    plan_call c = {t, fixed, o, malloc((t->n + 1) * 8), {0}};
    ASSERT(c.off);
    int count = failing_each_allocation(run_plan, check_plan, &c);
    free(c.off);
    return count;
}

typedef struct {
    const trace *t;
    const lshm_plan_options *o;
    uint64_t lb, expected;
} bound_call;

static int run_lower_bound(void *ctx)
{
    bound_call *c = ctx;
    c->lb = 12345;
    return lshm_plan_lower_bound(c->t->n, c->t->size, c->t->first, c->t->last, c->o, &c->lb);
}

/* the bound, or, if an allocation failed (the bound has no fallback), -ENOMEM with it
   untouched */
static void check_lower_bound(void *ctx, int rc, int failed)
{
    bound_call *c = ctx;
    if (!failed) {
        ASSERT_UINT_EQ(c->lb, c->expected);
        return;
    }
    ASSERT_EQ(rc, -ENOMEM);
    ASSERT_UINT_EQ(c->lb, 12345);
}

static void test_out_of_memory(void)
{
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    o.alignment = 1;
    rng_state = 0xD15EA5Eull;
    trace dense = random_trace(300, 60, 5000, 1);
    trace sparse = random_trace(200, 100000, 5000, 1);
    int64_t *fixed = malloc(dense.n * 8);
    uint64_t *off = malloc(dense.n * 8);
    ASSERT(fixed && off);
    lshm_plan_result r;
    plan_trace(&dense, 1, 0, 0.0, off, &r);
    for (size_t i = 0; i < dense.n; i++)
        fixed[i] = rnd() % 5 == 0 ? (int64_t)off[i] : -1;
    int counts[6];
    ASSERT_EQ(setenv("LSHM_PLAN_ENGINE", "dense", 1), 0); /* (the segment-tree engine) */
    counts[0] = plan_failing_each_allocation(&dense, NULL, &o);
    counts[2] = plan_failing_each_allocation(&dense, fixed, &o);
    ASSERT_EQ(unsetenv("LSHM_PLAN_ENGINE"), 0);
    counts[1] = plan_failing_each_allocation(&sparse, NULL, &o);
    o.flags = LSHM_PLAN_INCLUSIVE, o.alignment = 64;
    counts[3] = plan_failing_each_allocation(&sparse, NULL, &o);
    /* the exact search (a time budget) and capacity mode on a packing only it finds */
    trace medium = trace_from(tflm_greedy_medium_data, COUNT(tflm_greedy_medium_data));
    o.flags = 0, o.alignment = 1, o.time_limit = 0.05;
    counts[4] = plan_failing_each_allocation(&medium, NULL, &o);
    trace packed = guillotine_trace(3, 24, 40, 4096);
    o.capacity = 4096;
    counts[5] = plan_failing_each_allocation(&packed, NULL, &o);
    for (int c = 0; c < 6; c++)
        ASSERT(counts[c] > 0); /* (each case did allocate: the points are reached) */
    printf("  allocations failed in turn: %d %d %d %d %d %d\n", counts[0], counts[1], counts[2],
           counts[3], counts[4], counts[5]);
    /* the lower bound alone */
    o.capacity = 0, o.time_limit = 0.0;
    bound_call bound = {&dense, &o, 0, r.lower_bound};
    ASSERT(failing_each_allocation(run_lower_bound, check_lower_bound, &bound) > 0);
    free(fixed), free(off);
    trace_free(&dense), trace_free(&sparse), trace_free(&medium), trace_free(&packed);
}

/* The two placement engines (sparse interval tree, dense segment tree of coalesced ranges)
 * must give the very same offsets: one is picked by density, so a plan must not depend on
 * which. Random traces, sparse and dense, unaligned sizes at alignments 1, 64 and 4096, with
 * and without pinned tensors, and nested lifetimes (every tensor alive at the midpoint, where
 * the dense engine coalesces ranges across alignment padding and skips covered sets). */
static void test_engines_place_alike(void)
{
    rng_state = 0xE9617Eull;
    for (int round = 0; round < 24; round++) {
        size_t n = 50 + rnd() % 400;
        trace t = random_trace(n, round % 2 ? 60 : 5000, round % 3 ? 5000 : 100000,
                               round % 4 == 0);
        if (round % 6 == 5) { /* nested */
            for (size_t i = 0; i < n; i++) {
                t.first[i] = (int64_t)i;
                t.last[i] = (int64_t)(2 * n - i);
            }
        }
        lshm_plan_options o;
        lshm_plan_options_init(&o);
        o.alignment = (uint64_t[]){1, 64, 4096}[round % 3];
        o.flags = round % 5 == 0 ? LSHM_PLAN_INCLUSIVE : 0;
        int64_t *fixed = malloc(n * 8);
        uint64_t *dense = malloc(n * 8), *sparse = malloc(n * 8);
        ASSERT(fixed && dense && sparse);
        for (size_t i = 0; i < n; i++)
            fixed[i] = round % 4 == 1 && rnd() % 9 == 0 ? (int64_t)(rnd() % 64) * 8192 : -1;
        lshm_plan_result rd, rs;
        ASSERT_EQ(setenv("LSHM_PLAN_ENGINE", "dense", 1), 0);
        int rc_dense = lshm_plan(n, t.size, t.first, t.last, fixed, &o, dense, &rd);
        ASSERT_EQ(setenv("LSHM_PLAN_ENGINE", "sparse", 1), 0);
        int rc_sparse = lshm_plan(n, t.size, t.first, t.last, fixed, &o, sparse, &rs);
        ASSERT_EQ(unsetenv("LSHM_PLAN_ENGINE"), 0);
        ASSERT_EQ(rc_dense, rc_sparse); /* (pinned tensors may collide: -EINVAL both) */
        if (rc_dense == 0) {
            ASSERT_UINT_EQ(rd.arena_size, rs.arena_size);
            ASSERT(strcmp(rd.strategy, rs.strategy) == 0);
            ASSERT(memcmp(dense, sparse, n * 8) == 0);
        }
        free(fixed), free(dense), free(sparse);
        trace_free(&t);
    }
}

/* A call of 40,000 tensors whose lifetimes overlap heavily (about half of them each: tens of
 * seconds) run on another thread. */
typedef struct {
    size_t n;
    uint64_t *size, *off;
    int64_t *first, *last;
    lshm_plan_options opts;
    lshm_plan_result r;
    int rc;
    double seconds;
    char error[256];
} slow_call;

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *run_slow_call(void *arg)
{
    slow_call *c = arg;
    double t0 = now_seconds();
    c->rc = lshm_plan(c->n, c->size, c->first, c->last, NULL, &c->opts, c->off, &c->r);
    c->seconds = now_seconds() - t0;
    snprintf(c->error, sizeof c->error, "%s", lshm_last_error());
    return NULL;
}

static void test_interrupt(void)
{
    slow_call c = {.n = 40000};
    c.size = malloc(c.n * 8), c.off = malloc(c.n * 8);
    c.first = malloc(c.n * 8), c.last = malloc(c.n * 8);
    ASSERT(c.size && c.off && c.first && c.last);
    rng_state = 0x1A7E5ull;
    for (size_t i = 0; i < c.n; i++) {
        c.first[i] = (int64_t)(rnd() % c.n);
        c.last[i] = c.first[i] + 1 + (int64_t)(rnd() % c.n);
        c.size[i] = 1 + rnd() % 100000;
    }
    lshm_plan_options_init(&c.opts);
    ASSERT_ERR(lshm_plan_interrupt(NULL), -EINVAL);
    ASSERT_EQ(lshm_plan_interrupt(&c.opts), 0); /* (none running) */
    /* interrupted at once, in its set-up, in its first strategy, later */
    const useconds_t delays[] = {0, 2000, 20000, 100000, 300000};
    for (size_t d = 0; d < sizeof delays / sizeof delays[0]; d++) {
        memset(c.off, 0xAB, c.n * 8);
        memset(&c.r, 0xCD, sizeof c.r);
        pthread_t thread;
        ASSERT_EQ(pthread_create(&thread, NULL, run_slow_call, &c), 0);
        /* until the call runs (it registers first thing), then interrupt it */
        double t0 = now_seconds();
        usleep(delays[d]);
        int found = 0;
        while (!(found = lshm_plan_interrupt(&c.opts)) && now_seconds() - t0 < 10)
            usleep(100);
        ASSERT_EQ(found, 1);
        if (d == 0) { /* a fork's child has no call running (its thread is not there) */
            pid_t pid = fork();
            ASSERT(pid >= 0);
            if (pid == 0)
                _exit(lshm_plan_interrupt(&c.opts) == 0 ? 0 : 3);
            int status;
            ASSERT_EQ(waitpid(pid, &status, 0), pid);
            ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        }
        ASSERT_EQ(pthread_join(thread, NULL), 0);
        ASSERT_EQ(c.rc, -ECANCELED);
        ASSERT(strstr(c.error, "interrupted") != NULL);
        ASSERT_LT(c.seconds, 5.0); /* (uninterrupted: tens of seconds) */
        for (size_t i = 0; i < c.n; i++) /* nothing written */
            ASSERT_UINT_EQ(c.off[i], 0xABABABABABABABABull);
        ASSERT_UINT_EQ(c.r.arena_size, 0xCDCDCDCDCDCDCDCDull);
    }
    ASSERT_EQ(lshm_plan_interrupt(&c.opts), 0); /* (ended) */
    /* the same options plan again, uninterrupted (a small input) */
    ASSERT_OK(lshm_plan(100, c.size, c.first, c.last, NULL, &c.opts, c.off, &c.r));
    free(c.size), free(c.off), free(c.first), free(c.last);
}

/* Sizes that sum past 2^64 but are never all live together: lshm_plan used to refuse them
 * with -EOVERFLOW (it bounded every placement by the sum). Only the peak must fit: such plans
 * are made (sum saturated, every end checked against the highest aligned offset), with either
 * engine and with a time budget, and a peak past 64 bits is still refused. */
static void test_sum_past_2_64(void)
{
    const uint64_t q = (uint64_t)1 << 62; /* a quarter of 2^64 */
    lshm_plan_options o;
    lshm_plan_options_init(&o);
    lshm_plan_result r;
    /* a chain: tensor i live on [i, i + 2), 5 x 2^62 in all, at most 2^63 live at once */
    uint64_t size[5] = {q, q, q, q, q}, off[5];
    int64_t first[5] = {0, 1, 2, 3, 4}, last[5] = {2, 3, 4, 5, 6};
    const char *engines[2] = {"sparse", "dense"};
    for (int budget = 0; budget < 2; budget++) {
        for (int e = 0; e < 2; e++) {
            ASSERT_EQ(setenv("LSHM_PLAN_ENGINE", engines[e], 1), 0);
            o.time_limit = budget ? 0.05 : 0.0;
            ASSERT_EQ(lshm_plan(5, size, first, last, NULL, &o, off, &r), 0);
            ASSERT_UINT_EQ(r.lower_bound, 2 * q);
            ASSERT_UINT_EQ(r.arena_size, 2 * q);
            ASSERT_EQ(lshm_plan_validate(5, size, first, last, off, &o, r.arena_size), 0);
        }
    }
    ASSERT_EQ(unsetenv("LSHM_PLAN_ENGINE"), 0);
    o.time_limit = 0.0;
    uint64_t lb = 0;
    ASSERT_EQ(lshm_plan_lower_bound(5, size, first, last, &o, &lb), 0);
    ASSERT_UINT_EQ(lb, 2 * q);
    /* three tensors of 2^63 one after the other, at alignment 1 and 64: all at offset 0 */
    uint64_t half[3] = {2 * q, 2 * q, 2 * q}, off3[3] = {7, 7, 7};
    int64_t f3[3] = {0, 1, 2}, l3[3] = {1, 2, 3};
    for (uint64_t alignment = 1; alignment <= 64; alignment *= 64) {
        o.alignment = alignment;
        ASSERT_EQ(lshm_plan(3, half, f3, l3, NULL, &o, off3, &r), 0);
        ASSERT_UINT_EQ(off3[0] | off3[1] | off3[2], 0);
        ASSERT_UINT_EQ(r.arena_size, 2 * q);
        ASSERT(r.optimal);
    }
    /* ... but two of them live together need 2^64 bytes: refused, nothing written */
    l3[0] = 2;
    memset(off3, 0x11, sizeof off3);
    ASSERT_EQ(lshm_plan(3, half, f3, l3, NULL, &o, off3, &r), -EOVERFLOW);
    ASSERT_UINT_EQ(off3[0], 0x1111111111111111ull);
    ASSERT(strstr(lshm_last_error(), "same time") != NULL);
    ASSERT_EQ(lshm_plan_lower_bound(3, half, f3, l3, &o, &lb), -EOVERFLOW);
    /* at alignment 1 an arena of 2^64 - 2 bytes is the largest (UINT64_MAX means "no plan") */
    o.alignment = 1;
    uint64_t tight[3] = {2 * q, 2 * q - 1, 2 * q};
    ASSERT_EQ(lshm_plan(3, tight, f3, l3, NULL, &o, off3, &r), -EOVERFLOW);
    ASSERT(strstr(lshm_last_error(), "same time") != NULL);
    tight[1]--;
    ASSERT_EQ(lshm_plan(3, tight, f3, l3, NULL, &o, off3, &r), 0);
    ASSERT_UINT_EQ(r.arena_size, UINT64_MAX - 1);
    ASSERT_EQ(lshm_plan_validate(3, tight, f3, l3, off3, &o, r.arena_size), 0);
    /* a planned arena over the chain (not allocated: it would not fit in memory) */
    lshm_arena *a = NULL;
    o.alignment = 64;
    ASSERT_EQ(lshm_arena_create(5, size, first, last, &o, 0, &a), 0);
    ASSERT_UINT_EQ(lshm_arena_size(a), 2 * q);
    lshm_arena_counters c;
    ASSERT_EQ(lshm_arena_stats(a, &c), 0);
    ASSERT_UINT_EQ(c.managed_bytes, UINT64_MAX); /* saturated */
    ASSERT_UINT_EQ(c.lower_bound, 2 * q);
    ASSERT_EQ(lshm_arena_destroy(a), 0);
}

int main(void)
{
    RUN_TEST(test_framework_facts);
    RUN_TEST(test_bad_input);
    RUN_TEST(test_edge_cases);
    RUN_TEST(test_random_validity);
    RUN_TEST(test_determinism);
    RUN_TEST(test_dense);
    RUN_TEST(test_time_budget);
    RUN_TEST(test_capacity);
    RUN_TEST(test_validate_large_plans);
    RUN_TEST(test_capacity_max);
    RUN_TEST(test_lower_bound_huge_alignment);
    RUN_TEST(test_extreme_lifetimes_exact);
    RUN_TEST(test_out_of_memory);
    RUN_TEST(test_engines_place_alike);
    RUN_TEST(test_interrupt);
    RUN_TEST(test_sum_past_2_64);
    return 0;
}
