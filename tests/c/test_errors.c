/*
 * test_errors.c -- error codes, names, the thread-local last-error message, version, and the
 * fault-injection machinery the other tests rely on.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING /* the fault-injection hooks of internal.h */
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <pthread.h>

static void test_version(void) {
    ASSERT_EQ(lshm_version(), LSHM_VERSION_NUMBER);
    char expected[32];
    snprintf(expected, sizeof expected, "%d.%d.%d", LSHM_VERSION_MAJOR, LSHM_VERSION_MINOR,
             LSHM_VERSION_PATCH);
    ASSERT(strcmp(lshm_version_string(), expected) == 0);
}

static void test_abi_values(void) {
    uint64_t v = 7;
    ASSERT_OK(lshm_abi_value("lshm_export_info", &v));
    ASSERT_UINT_EQ(v, sizeof(lshm_export_info));
    ASSERT_OK(lshm_abi_value("lshm_export_info.nbytes", &v));
    ASSERT_UINT_EQ(v, offsetof(lshm_export_info, nbytes));
    ASSERT_OK(lshm_abi_value("lshm_plan_result.strategy#size", &v));
    ASSERT_UINT_EQ(v, 48);
    ASSERT_OK(lshm_abi_value("LSHM_SLAB_BYTES", &v));
    ASSERT_UINT_EQ(v, LSHM_SLAB_BYTES);
    v = 7;
    ASSERT_ERR(lshm_abi_value("lshm_export_info.no_such_field", &v), -ENOENT);
    ASSERT_ERR(lshm_abi_value(NULL, &v), -EINVAL);
    ASSERT_ERR(lshm_abi_value("LSHM_SLAB_BYTES", NULL), -EINVAL);
    ASSERT_UINT_EQ(v, 7); /* untouched on failure */
}

static void test_names(void) {
    ASSERT(strcmp(lshm_err_name(-EINVAL), "EINVAL") == 0);
    ASSERT(strcmp(lshm_err_name(EINVAL), "EINVAL") == 0); /* positive means its negation */
    ASSERT(strcmp(lshm_err_name(-EMFILE), "EMFILE") == 0);
    ASSERT(strcmp(lshm_err_name(-ENODATA), "ENODATA") == 0);
    ASSERT(strcmp(lshm_err_name(-EOVERFLOW), "EOVERFLOW") == 0);
    ASSERT(strcmp(lshm_err_name(-9999), "UNKNOWN") == 0);
    ASSERT(strcmp(lshm_err_name(INT_MIN), "UNKNOWN") == 0);
    ASSERT(strcmp(lshm_err_name(0), "OK") == 0);
    ASSERT(strcmp(lshm_strerror(-EINVAL), "invalid argument") == 0);
    ASSERT(strcmp(lshm_strerror(ENOMEM), "out of memory") == 0);
    ASSERT(strcmp(lshm_strerror(-9999), "unknown error") == 0);
    ASSERT(strcmp(lshm_strerror(INT_MIN), "unknown error") == 0);
    ASSERT(strcmp(lshm_strerror(0), "success") == 0);
    /* Every code the API documents has a name and a description. */
    static const int documented[] = {EINVAL, ENOMEM, EOVERFLOW, EBUSY, EPERM, ENODATA, EBADF,
                                     ENOSPC, EMFILE, ENFILE, EACCES, EFBIG};
    for (size_t i = 0; i < sizeof documented / sizeof documented[0]; i++) {
        ASSERT(strcmp(lshm_err_name(-documented[i]), "UNKNOWN") != 0);
        ASSERT(strcmp(lshm_strerror(-documented[i]), "unknown error") != 0);
    }
}

static void *other_thread_error(void *arg) {
    (void)arg;
    /* A fresh thread has no message, whatever the main thread did. */
    ASSERT(strcmp(lshm_last_error(), "") == 0);
    ASSERT_ERR(lshm_storage_share(NULL), -EINVAL);
    ASSERT(strstr(lshm_last_error(), "share.c:") != NULL);
    return NULL;
}

static void test_last_error(void) {
    ASSERT(strcmp(lshm_last_error(), "") == 0);
    lshm_storage *s = NULL;
    ASSERT_ERR(lshm_storage_create(SIZE_MAX, NULL, 0, &s), -EOVERFLOW);
    ASSERT(s == NULL);
    const char *msg = lshm_last_error();
    ASSERT(strncmp(msg, "os_linux.c:", 11) == 0); /* "file:line: message" (page arithmetic) */
    ASSERT(strstr(msg, "whole pages") != NULL);
    char saved[512];
    snprintf(saved, sizeof saved, "%s", msg);
    pthread_t t;
    ASSERT_OK(pthread_create(&t, NULL, other_thread_error, NULL));
    ASSERT_OK(pthread_join(t, NULL));
    ASSERT(strcmp(lshm_last_error(), saved) == 0); /* the other thread's failure is its own */
    /* Long messages are truncated, never overflowed. */
    char big[2000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    ASSERT_EQ(LSHM_FAIL(-EIO, "%s", big), -EIO);
    ASSERT_LT(strlen(lshm_last_error()), 512);
    /* A failure helper handed a non-negative code still reports a failure. */
    ASSERT_LT(LSHM_FAIL(0, "bug"), 0);
}

static void test_fault_injection(void) {
    int before = fd_count();
    lshm_storage *s = NULL;
    lshm__fault_arm(1, -ENOMEM);
    ASSERT_ERR(lshm_storage_create_shared(4096, 0, &s), -ENOMEM);
    ASSERT(s == NULL);
    ASSERT_EQ(lshm__fault_points_hit(), 1);
    ASSERT(strstr(lshm_last_error(), "injected") != NULL);
    /* Positive codes are armed as their negation. */
    lshm__fault_arm(2, ENOSPC);
    ASSERT_ERR(lshm_storage_create_shared(4096, 0, &s), -ENOSPC);
    /* Disarmed: the points are counted but nothing fails. */
    lshm__fault_arm(0, -ENOMEM);
    ASSERT_OK(lshm_storage_create_shared(4096, 0, &s));
    ASSERT_GE(lshm__fault_points_hit(), 4); /* memfd, ftruncate, seal, fallocate, mmap */
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), before);
}

int main(void) {
    RUN_TEST(test_version);
    RUN_TEST(test_names);
    RUN_TEST(test_last_error);
    RUN_TEST(test_fault_injection);
    RUN_TEST(test_abi_values); /* (last: it leaves a last-error message behind) */
    return 0;
}
