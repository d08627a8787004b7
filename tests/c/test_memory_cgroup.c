/*
 * test_memory_cgroup.c -- a memfd of more than the process's memory cgroup can hold is -ENOMEM
 * at once (its pages would end in the cgroup's OOM killer, not in an error), also where the
 * limit is set on a cgroup above the process's own, which has none: the library reads the
 * smallest limit on the way up. A child joins `outer/inner` (outer: 256 MiB, inner: no limit)
 * before its first library call (the library reads the cgroup once), then a share, a storage
 * created shared and a segment past the limit are refused, changing nothing, while one that fits
 * is made; and the memfd pool's default cap follows that limit. Needs a writable memory cgroup
 * (root): else skipped (exit 77, as meson counts it).
 */
#include "task.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>
#include <unistd.h>

#define SKIP 77
#define LIMIT ((uint64_t)256 << 20)

/* This process's memory cgroup directory (v1's memory controller, else v2's unified one) and
 * the name of its limit file; 0 when there is none. */
static int memory_cgroup_dir(char *dir, size_t len, const char **limit_file) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (f == NULL)
        return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 != NULL ? strchr(c1 + 1, ':') : NULL;
        if (c2 == NULL)
            continue;
        *c2 = '\0';
        char *controllers = c1 + 1, *path = c2 + 1, *item, *save = NULL;
        for (item = strtok_r(controllers, ",", &save); item != NULL;
             item = strtok_r(NULL, ",", &save))
            if (strcmp(item, "memory") == 0) {
                snprintf(dir, len, "/sys/fs/cgroup/memory%s", path);
                *limit_file = "memory.limit_in_bytes";
                found = 1;
            }
        if (!found && strcmp(line, "0") == 0 && *controllers == '\0' &&
            access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0) {
            snprintf(dir, len, "/sys/fs/cgroup%s", path);
            *limit_file = "memory.max";
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static int write_file(const char *dir, const char *name, const char *text) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* In the child, inside inner: past the outer limit (and the machine's swap) is refused. */
static void past_the_limit_above(void) {
    struct sysinfo si;
    ASSERT_OK(sysinfo(&si));
    size_t page = lshm_page_size();
    size_t big = (size_t)(LIMIT + (uint64_t)si.totalswap * si.mem_unit) + ((size_t)64 << 20);
    lshm_storage *s;
    ASSERT_ERR(lshm_storage_create_shared(big, 0, &s), -ENOMEM);
    ASSERT(strstr(lshm_last_error(), "memory cgroup") != NULL);
    lshm_segment *seg = NULL;
    ASSERT_ERR(lshm_segment_create(big, 0, &seg), -ENOMEM);
    ASSERT(seg == NULL);
    for (unsigned flags = 0; flags <= LSHM_STORAGE_RESIZABLE; flags += LSHM_STORAGE_RESIZABLE) {
        ASSERT_OK(lshm_storage_create(big, NULL, flags, &s)); /* (private: pages not touched) */
        unsigned char *data = lshm_storage_data(s);
        memset(data, 7, page);
        ASSERT_ERR(lshm_storage_share(s), -ENOMEM);
        ASSERT(strstr(lshm_last_error(), "memory cgroup") != NULL);
        ASSERT_PTR_EQ(lshm_storage_data(s), data);
        ASSERT_EQ(lshm_storage_flags(s), flags);
        ASSERT(data[0] == 7 && data[page - 1] == 7);
        lshm_storage_release(s);
    }
    ASSERT_OK(lshm_storage_create_shared((size_t)32 << 20, 0, &s)); /* what fits is made */
    lshm_storage_release(s);
}

/* The pool's default cap is an eighth of what the process may use: here outer's 256 MiB, so 32
 * MiB of 512 KiB memfds, 64 of them (an eighth of the machine's RAM would keep all 100). */
static void pool_capped_by_the_limit_above(void) {
    enum { COUNT = 100 };
    const size_t each = (size_t)512 << 10;
    lshm_storage *s[COUNT];
    for (int i = 0; i < COUNT; i++) {
        ASSERT_OK(lshm_storage_create(each, NULL, 0, &s[i]));
        ASSERT_OK(lshm_storage_share(s[i]));
    }
    for (int i = 0; i < COUNT; i++)
        lshm_storage_release(s[i]);
    ASSERT_EQ(lshm_pool_trim(), (int)((LIMIT / 8) / each));
}

int main(void) {
    char dir[4096], outer[4200], inner[4300], pid_text[32];
    const char *limit_file = NULL;
    if (!memory_cgroup_dir(dir, sizeof dir, &limit_file) || access(dir, W_OK) != 0) {
        fprintf(stderr, "skipped: no writable memory cgroup\n");
        return SKIP;
    }
    snprintf(outer, sizeof outer, "%s/lshm-test-%d", dir, (int)getpid());
    snprintf(inner, sizeof inner, "%s/inner", outer);
    char limit_text[32];
    snprintf(limit_text, sizeof limit_text, "%llu", (unsigned long long)LIMIT);
    if (mkdir(outer, 0755) != 0 || write_file(outer, limit_file, limit_text) != 0 ||
        mkdir(inner, 0755) != 0) {
        fprintf(stderr, "skipped: cannot make a memory cgroup under %s: %s\n", dir,
                strerror(errno));
        rmdir(inner), rmdir(outer);
        return SKIP;
    }
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        snprintf(pid_text, sizeof pid_text, "%d", (int)getpid());
        if (write_file(inner, "cgroup.procs", pid_text) != 0)
            _exit(SKIP);
        unsetenv("LSHM_POOL_BYTES"); /* (the default: read at the first share) */
        RUN_TEST(pool_capped_by_the_limit_above);
        RUN_TEST(past_the_limit_above);
        _exit(0);
    }
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    rmdir(inner), rmdir(outer);
    if (WIFSIGNALED(status))
        TEST_FAIL("the child was killed by signal %d", WTERMSIG(status));
    ASSERT(WIFEXITED(status));
    if (WEXITSTATUS(status) == SKIP)
        fprintf(stderr, "skipped: cannot join a memory cgroup\n");
    return WEXITSTATUS(status);
}
