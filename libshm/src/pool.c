/*
 * pool.c -- the pool of recycled memfds.
 *
 * A storage shared in place that is released gives its memfd here instead of closing it: the
 * memfd is already sized, sealed and has every page allocated, so the next share of the same
 * capacity only writes into it (8.3 GB/s instead of 2.5 into fresh pages for one 256 MiB
 * array on a 2-CPU VM: the "recycled memfds" and "ceiling memfd+pwrite" rows of
 * `python -m pyshm bench --cases big --big-mib 256`). Safe only while nobody else can reach the
 * memfd: never exported (fd handed out or sealed read-only) and no fork since the share began
 * (a child inherits the fd and the mapping): a fork empties the pool in parent and child, and
 * bumps the epoch that a share records (lshm__pool_epoch), so a storage shared before a fork
 * never gives its memfd back. At most LSHM_POOL_BYTES bytes (read at the first use; default an
 * eighth of the memory the process may use: physical memory, or its memory cgroup's limit if
 * less; 0 disables it) and 256 entries. Interface: internal.h.
 */
#include "internal.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

enum { POOL_MAX_ENTRIES = 256 };
typedef struct pool_entry {
    size_t capacity;
    int fd;
} pool_entry;

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pool_entry pool[POOL_MAX_ENTRIES];
static _Atomic int pool_count; /* changed under pool_lock; read without it to skip an empty pool */
static size_t pool_bytes;
size_t lshm__pool_limit; /* bytes; 0 disables the pool (tests may change it) */
static _Atomic unsigned long fork_epoch = 1;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

void lshm__pool_prepare_fork(void) {
    pthread_mutex_lock(&pool_lock);
}

/* After a fork, in both processes: the pooled memfds are reachable from the other process
 * too, so none may be reused; forget them all. pool_lock is held (lshm__pool_prepare_fork). */
void lshm__pool_after_fork(void) {
    atomic_fetch_add_explicit(&fork_epoch, 1, memory_order_relaxed);
    for (int i = 0; i < pool_count; i++)
        lshm__os_close(pool[i].fd);
    pool_count = 0;
    pool_bytes = 0;
    pthread_mutex_unlock(&pool_lock);
}

/* Worth keeping when released? Refilling a pooled memfd beats a fresh share only below the
 * chunk threshold and for big shares a process makes alone (see pool_pays in share.c); on
 * release nobody knows who shares next, so by size alone. */
static int worth_keeping(size_t capacity) {
    return capacity < atomic_load_explicit(&lshm__share_chunk_threshold, memory_order_relaxed) ||
           capacity >= atomic_load_explicit(&lshm__share_split_threshold, memory_order_relaxed);
}

static void pool_init(void) {
    /* (the memory this process may use: its memory cgroup's limit where that is less than the
     * machine's, since kept memfds count against it too, and the cgroup's OOM killer kills) */
    uint64_t limit = lshm__os_memory_bytes() / 8;
    const char *env = getenv("LSHM_POOL_BYTES");
    if (env != NULL && *env != '\0') {
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(env, &end, 10);
        if (errno == 0 && end != env && *end == '\0')
            limit = v;
    }
    lshm__pool_limit = limit > SIZE_MAX ? SIZE_MAX : (size_t)limit;
    /* Without the fork handlers a child would reuse pooled memfds: pool nothing. */
    if (!lshm__fork_handlers_ok())
        lshm__pool_limit = 0;
}

unsigned long lshm__pool_epoch(void) {
    pthread_once(&pool_once, pool_init);
    return atomic_load_explicit(&fork_epoch, memory_order_relaxed);
}

int lshm__pool_take(size_t capacity) {
    if (atomic_load_explicit(&pool_count, memory_order_relaxed) == 0)
        return -1; /* the common case, without the lock */
    int fd = -1;
    pthread_mutex_lock(&pool_lock);
    for (int i = pool_count - 1; i >= 0; i--) {
        if (pool[i].capacity == capacity) {
            fd = pool[i].fd;
            pool_bytes -= capacity;
            pool[i] = pool[--pool_count];
            break;
        }
    }
    pthread_mutex_unlock(&pool_lock);
    return fd;
}

void lshm__pool_put(lshm_storage *s) {
    assert(s->origin == LSHM__ORIGIN_PAGES);
    /* A storage never shared by lshm_storage_share has fork_epoch 0, never the current one. */
    if (s->capacity == 0 || !worth_keeping(s->capacity) ||
        atomic_load_explicit(&s->exported, memory_order_relaxed) ||
        s->fork_epoch != lshm__pool_epoch())
        return;
    int taken = 0;
    pthread_mutex_lock(&pool_lock);
    /* Check the epoch again under the lock: a fork empties the pool while holding it. */
    if (s->fork_epoch == atomic_load_explicit(&fork_epoch, memory_order_relaxed) &&
        s->capacity <= lshm__pool_limit && pool_bytes <= lshm__pool_limit - s->capacity &&
        pool_count < POOL_MAX_ENTRIES) {
        pool[pool_count++] = (pool_entry){s->capacity, s->fd};
        pool_bytes += s->capacity;
        taken = 1;
    }
    pthread_mutex_unlock(&pool_lock);
    if (taken)
        s->fd = -1;
}

int lshm_pool_trim(void) {
    pool_entry taken[POOL_MAX_ENTRIES];
    pthread_mutex_lock(&pool_lock);
    int n = pool_count;
    memcpy(taken, pool, (size_t)n * sizeof *pool);
    pool_count = 0;
    pool_bytes = 0;
    pthread_mutex_unlock(&pool_lock);
    for (int i = 0; i < n; i++)
        lshm__os_close(taken[i].fd);
    return n;
}
