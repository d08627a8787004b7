/*
 * example_share.c -- libshm from a C user's point of view: make a storage, fill it, share it
 * in place, and see that the same pointer now reads the shared bytes; then attach the fd
 * again, as another process would, and compare.
 *
 *   cc tools/example_share.c $(pkg-config --cflags --libs lshm) && ./a.out
 */
#include <lshm.h>

#include <stdio.h>
#include <string.h>

#define CHECK(call)                                                                           \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_ != 0) {                                                                       \
            fprintf(stderr, "%s: %s (%s)\n", #call, lshm_strerror(rc_), lshm_last_error());   \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

int main(void) {
    if (lshm_version() != LSHM_VERSION_NUMBER) {
        fprintf(stderr, "header %d but library %s\n", LSHM_VERSION_NUMBER, lshm_version_string());
        return 1;
    }
    const size_t n = 1 << 20;
    lshm_storage *s;
    CHECK(lshm_storage_create(n, NULL, 0, &s));
    unsigned char *p = lshm_storage_data(s);
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 7);

    CHECK(lshm_storage_share(s));
    if (lshm_storage_data(s) != p || !(lshm_storage_flags(s) & LSHM_STORAGE_SHARED)) {
        fprintf(stderr, "share moved the data or did not mark it shared\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(i * 7)) {
            fprintf(stderr, "byte %zu changed by the share\n", i);
            return 1;
        }

    int fd;
    uint64_t offset;
    CHECK(lshm_storage_fd(s, &fd, &offset));
    lshm_storage *other;
    CHECK(lshm_storage_attach(fd, offset, n, 0, &other));
    p[12345] = 42; /* a write through the old pointer shows in the other mapping */
    if (memcmp(lshm_storage_data(other), p, n) != 0) {
        fprintf(stderr, "attached copy differs\n");
        return 1;
    }
    lshm_storage_release(other);
    lshm_storage_release(s);
    printf("OK\n");
    return 0;
}
