/*
 * fork.c -- fork() and the library: a fork waits for the shares and resizes in flight, and
 * parent and child each put their process-wide state right (the pool of memfds, the slabs, the
 * share's write fence) from pthread_atfork handlers registered once, at load time. Interface:
 * internal.h (lshm__fork_guard_enter/leave around a share, lshm__forked_child,
 * lshm__fork_handlers_ok).
 */
#include "internal.h"

#include <assert.h>
#include <pthread.h>

#ifdef LSHM__TSAN
#include <sanitizer/tsan_interface.h>
#endif

/* Set in the child of a fork(): no helper threads there (the work they would share is done on
 * the calling thread). A thread started in a child forked from a process with other threads
 * may need a lock one of those threads held at the fork (AddressSanitizer's allocator is one:
 * a helper hung in its first calloc). */
static _Atomic int forked_child;

/* A fork() while another thread is inside a share (or resize) would give the child that
 * storage's mutex held by a thread it does not have (its own share would block forever) and,
 * for a chunked share, the chunks swapped so far mapped shared with the parent while the
 * storage says it is private. So shares and resizes hold fork_lock for reading around their
 * locked section, and an atfork prepare handler takes it for writing: fork() waits until none
 * is in flight, and none starts until the fork is done. The child therefore finds every
 * storage either shared completely (mapped shared, as before) or not at all.
 * Writer-preferring, so a fork is not starved by a thread pool that shares continuously; that
 * is also why a thread never takes the read lock twice (fork_depth counts its nesting, e.g. an
 * allocator callback that shares another storage): a second read lock behind a waiting writer
 * would deadlock.
 * Handlers, in one registration so their order is fixed: prepare takes fork_lock, then the slab
 * lock, then pool_lock (the order of a share, which takes those inside its read section), then
 * the lock of os_linux.c's deferred unmaps (taken inside any of those), then the write fence's
 * and the planner's (each held alone); parent and child release those two and the deferred
 * unmaps' first, empty the pool and release pool_lock, release the slab lock (the
 * child also stops sharing into its parent's slab memfds), then fork_lock. glibc's rwlock
 * tells a write unlock from a read unlock by the writer's thread id, which the child's only
 * thread no longer has, so the child re-initialises fork_lock instead (nothing else runs there
 * to hold it). */
#ifdef PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP
#define FORK_LOCK_INITIALIZER PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP
#else
#define FORK_LOCK_INITIALIZER PTHREAD_RWLOCK_INITIALIZER
#endif
static pthread_rwlock_t fork_lock = FORK_LOCK_INITIALIZER;
static const pthread_rwlock_t fork_lock_fresh = FORK_LOCK_INITIALIZER;
static _Thread_local int fork_depth; /* this thread's nesting of fork_guard_enter */
static _Thread_local int fork_writer; /* this thread's prepare handler holds fork_lock */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static int atfork_ok; /* the handlers are registered (written once, under atfork_once) */

static void prepare_fork(void) {
    /* A fork from inside a share or resize of this very thread (an allocator callback) cannot
     * wait for itself: it goes ahead, and the child carries on with this thread's call. */
    if (fork_depth == 0) {
        pthread_rwlock_wrlock(&fork_lock);
        fork_writer = 1;
    }
    lshm__slab_prepare_fork(); /* a share takes the slab lock inside its read section too */
    lshm__pool_prepare_fork();
    lshm__os_prepare_fork(); /* (after those: unmaps take it inside any of them) */
    lshm__os_fence_prepare_fork(); /* (held alone, never inside another) */
    lshm__plan_prepare_fork(); /* (held alone, never inside another) */
}

static void parent_after_fork(void) {
    lshm__plan_after_fork(0);
    lshm__os_fence_after_fork();
    lshm__os_after_fork();
    lshm__pool_after_fork();
    lshm__slab_after_fork_parent();
    if (fork_writer) {
        fork_writer = 0;
        pthread_rwlock_unlock(&fork_lock);
    }
}

static void child_after_fork(void) {
    atomic_store_explicit(&forked_child, 1, memory_order_relaxed);
    lshm__plan_after_fork(1);
    lshm__os_fence_after_fork();
    lshm__os_after_fork();
    lshm__pool_after_fork();
    lshm__slab_after_fork_child();
    lshm__os_fence_after_fork_child(); /* the inherited userfaultfd is the parent's */
#ifdef LSHM__TSAN
    /* The store below drops this thread's write lock behind the back of ThreadSanitizer,
     * which watches the rwlock calls only: say so, or it takes the lock for still held and
     * reports the child's next read lock ("read lock of a write locked mutex"). A read lock
     * of a share in flight (fork_depth > 0) is left as it sees it: held, as it is again once
     * the rdlock below has run (saying it was dropped would show that rdlock under the
     * storage's lock, the reverse of the usual order, as a lock-order inversion). */
    if (fork_writer) {
        __tsan_mutex_pre_unlock(&fork_lock, 0);
        __tsan_mutex_post_unlock(&fork_lock, 0);
    }
#endif
    fork_writer = 0;
    fork_lock = fork_lock_fresh;
    if (fork_depth > 0) /* this thread is inside a share: it will unlock when it leaves */
        pthread_rwlock_rdlock(&fork_lock);
}

static void register_atfork(void) {
    /* Fails only with ENOMEM: then fork() does not wait, nothing is pooled (lshm__pool_epoch)
     * and nothing goes in slabs (a child would share into its parent's slab memfds). */
    atfork_ok = pthread_atfork(prepare_fork, parent_after_fork, child_after_fork) == 0;
    if (!atfork_ok)
        atomic_store_explicit(&lshm__slab_max_bytes, 0, memory_order_relaxed);
}

/* At load time, so that no fork can start its handler list before they are in it while the
 * first share of the process runs; the once in fork_guard_enter covers a build without it. */
__attribute__((constructor)) static void register_atfork_at_load(void) {
    pthread_once(&atfork_once, register_atfork);
    (void)lshm__os_fence_open(); /* (the write fence of shares: os_linux.c) */
}

void lshm__fork_guard_enter(void) {
    pthread_once(&atfork_once, register_atfork);
    if (fork_depth++ == 0)
        pthread_rwlock_rdlock(&fork_lock);
}

void lshm__fork_guard_leave(void) {
    assert(fork_depth > 0);
    if (--fork_depth == 0)
        pthread_rwlock_unlock(&fork_lock);
}

int lshm__fork_handlers_ok(void) {
    pthread_once(&atfork_once, register_atfork);
    return atfork_ok;
}

int lshm__forked_child(void) {
    return atomic_load_explicit(&forked_child, memory_order_relaxed);
}
