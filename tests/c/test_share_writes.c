/*
 * test_share_writes.c -- no write by another thread is lost to a share (DESIGN section 5:
 * "no write by any thread is ever undone by a share").
 *
 * A writer thread adds 1 to one word per cache line of a storage, pass after pass, while the
 * main thread shares the storage in place; when both are done every word it wrote must equal
 * the number of passes it made. Every in-place path: a slab page, one memfd (below the chunk
 * threshold), a pooled memfd refilled, chunks of small pages, chunks of huge pages, pages never
 * touched before; in a forked child; as an unprivileged user (userfaultfd in user-mode-only
 * mode); with the kernel writing for the thread (pread into the storage); through failed
 * shares (a fault mid-way, a fence that cannot be set up). A process that never had a second
 * thread sets up no fence; a protection that fails lets its writers go; a child forked without
 * the atfork handlers leaves its parent's memory alone; a program that closes the library's
 * userfaultfd keeps its own fd of that number, and the library opens another; memory the
 * program's own userfaultfd watches is shared unfenced and keeps that registration; a slab
 * stays registered ahead of its shares (also through a fence that fails), and a fork's child
 * registers its copy itself. And the control: with the fence off the same writer does lose
 * writes, so the test can fail.
 */
#ifndef LSHM_TESTING
#define LSHM_TESTING
#endif
#include "internal.h"
#include "task.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define STRIDE 8 /* words: one per 64-byte line */

/* The writer races with the share on purpose: what orders its writes against the share's copy
 * and remap is the share's write fence (a userfaultfd: the writes wait in their page faults),
 * which ThreadSanitizer cannot see. So under it the writer's accesses are not tracked (the
 * runtime's dynamic annotations; its pread's writes included); lost_words checks them after
 * the join. */
#ifdef LSHM__TSAN
void AnnotateIgnoreReadsBegin(const char *file, int line);
void AnnotateIgnoreReadsEnd(const char *file, int line);
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
#define UNTRACKED_BEGIN()                                                                     \
    (AnnotateIgnoreReadsBegin(__FILE__, __LINE__), AnnotateIgnoreWritesBegin(__FILE__, __LINE__))
#define UNTRACKED_END()                                                                       \
    (AnnotateIgnoreWritesEnd(__FILE__, __LINE__), AnnotateIgnoreReadsEnd(__FILE__, __LINE__))
#else
#define UNTRACKED_BEGIN() ((void)0)
#define UNTRACKED_END() ((void)0)
#endif

typedef struct writer {
    volatile uint64_t *words;
    size_t nwords;
    int kernel;     /* write through pread(2) from `src` (the kernel writes), one word per page */
    int src;
    _Atomic int started, stop;
    uint64_t passes;
    int error;      /* errno of a failed pread */
} writer;

static void write_passes_untracked(writer *w) {
    size_t step = w->kernel ? lshm__os_page_size() / sizeof(uint64_t) : STRIDE;
    atomic_store(&w->started, 1);
    do {
        for (size_t i = 0; i < w->nwords; i += step) {
            if (!w->kernel) {
                w->words[i] += 1;
                continue;
            }
            uint64_t v = w->words[i] + 1;
            if (pwrite(w->src, &v, sizeof v, 0) != (ssize_t)sizeof v ||
                pread(w->src, (void *)&w->words[i], sizeof v, 0) != (ssize_t)sizeof v) {
                w->error = errno;
                return;
            }
        }
        w->passes++;
    } while (!atomic_load(&w->stop) || w->passes < 3);
}

static void *write_passes(void *arg) {
    UNTRACKED_BEGIN();
    write_passes_untracked(arg);
    UNTRACKED_END();
    return NULL;
}

/* How many of the written words do not equal the number of passes. */
static size_t lost_words(const writer *w) {
    size_t step = w->kernel ? lshm__os_page_size() / sizeof(uint64_t) : STRIDE, lost = 0;
    for (size_t i = 0; i < w->nwords; i += step)
        if (w->words[i] != w->passes)
            lost++;
    return lost;
}

typedef struct share_run {
    int rc;
    size_t lost;
    uint64_t passes;
    int error;
} share_run;

/* How the tests share: lshm_storage_share, or lshm_storage_share_fenced (which must behave the
 * same wherever the fence can be set up). */
static int (*share_call)(lshm_storage *) = lshm_storage_share;

/* Share s while a writer runs over its first n bytes (zero before); the writer stops once the
 * share returned and it made 3 passes. */
static share_run share_while_writing(lshm_storage *s, size_t n, int kernel) {
    writer w = {.words = lshm_storage_data(s), .nwords = n / sizeof(uint64_t), .kernel = kernel};
    if (kernel) {
        w.src = memfd_create("src", MFD_CLOEXEC);
        ASSERT_GE(w.src, 0);
    }
    pthread_t t;
    ASSERT_OK(pthread_create(&t, NULL, write_passes, &w));
    while (!atomic_load(&w.started))
        ;
    usleep(1000); /* the writer is inside its passes */
    share_run r = {share_call(s), 0, 0, 0};
    atomic_store(&w.stop, 1);
    ASSERT_OK(pthread_join(t, NULL));
    if (kernel)
        close(w.src);
    r.lost = lost_words(&w);
    r.passes = w.passes;
    r.error = w.error;
    return r;
}

/* A fresh storage of n bytes (zeros; `touch`: its pages written first, else never touched),
 * shared while written: nothing lost, shared in place. */
static void check_no_loss(size_t n, int touch, int kernel, int origin) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
    if (origin >= 0)
        ASSERT_EQ(s->origin, origin);
    void *data = lshm_storage_data(s);
    if (touch)
        memset(data, 0, n);
    unsigned long fences = lshm__fences_set;
    share_run r = share_while_writing(s, n, kernel);
    ASSERT_OK(r.rc);
    ASSERT_EQ(r.error, 0);
    ASSERT_PTR_EQ(lshm_storage_data(s), data);
    ASSERT(lshm_storage_flags(s) & LSHM_STORAGE_SHARED);
    ASSERT_UINT_EQ(lshm__fences_set, fences + 1);
    ASSERT_UINT_EQ(r.lost, 0);
    ASSERT_GE(r.passes, 3);
    lshm_storage_release(s);
}

static size_t page;

static void test_every_path_loses_nothing(void) {
    int fds = fd_count();
    for (int round = 0; round < 3; round++) {
        check_no_loss(page, 1, 0, LSHM__ORIGIN_SLAB);         /* a slab page */
        check_no_loss(16 * page, 1, 0, LSHM__ORIGIN_SLAB);    /* several */
        check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES);   /* one memfd */
        check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES);   /* the last one's, pooled */
        check_no_loss(3 << 19, 1, 0, LSHM__ORIGIN_PAGES);     /* chunks of small pages */
        check_no_loss(3 << 19, 0, 0, LSHM__ORIGIN_PAGES);     /* ... never touched before */
        check_no_loss(64 << 20, 1, 0, LSHM__ORIGIN_PAGES);    /* chunks of huge pages */
        check_no_loss(64 << 20, 0, 0, LSHM__ORIGIN_PAGES);    /* ... never touched before */
    }
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds);
}

/* The pooled path really was taken by the second 512 KiB share above: a pooled memfd exists
 * after the first release and is gone (taken) after the second share. */
static void test_pooled_refill_loses_nothing(void) {
    lshm_pool_trim();
    int fds = fd_count();
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(512 << 10, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    lshm_storage_release(s);
    ASSERT_EQ(fd_count(), fds + 1); /* pooled */
    ASSERT_OK(lshm_storage_create(512 << 10, NULL, 0, &s));
    memset(lshm_storage_data(s), 0, 512 << 10);
    share_run r = share_while_writing(s, 512 << 10, 0);
    ASSERT_OK(r.rc);
    ASSERT_EQ(fd_count(), fds + 1); /* the pooled one, now the storage's */
    ASSERT_UINT_EQ(r.lost, 0);
    lshm_storage_release(s);
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds);
}

/* The kernel writing for the thread (pread into the storage) waits as a plain write does. */
static void test_kernel_writes_are_not_lost(void) {
    if (geteuid() != 0) { /* (user-mode-only userfaultfd: such writes fail with EFAULT) */
        printf("  skipped: not root\n");
        return;
    }
    for (int round = 0; round < 3; round++) {
        check_no_loss(512 << 10, 1, 1, LSHM__ORIGIN_PAGES);
        check_no_loss(64 << 20, 1, 1, LSHM__ORIGIN_PAGES);
    }
}

/* The control: without the fence the same writer loses writes (so the checks above can fail). */
static void test_unfenced_share_loses_writes(void) {
    atomic_store(&lshm__fence_off, 1);
    size_t lost = 0;
    for (int trial = 0; trial < 10 && lost == 0; trial++) {
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(64 << 20, NULL, 0, &s));
        memset(lshm_storage_data(s), 0, 64 << 20);
        unsigned long fences = lshm__fences_set;
        share_run r = share_while_writing(s, 64 << 20, 0);
        ASSERT_OK(r.rc);
        ASSERT_UINT_EQ(lshm__fences_set, fences);
        lost += r.lost;
        lshm_storage_release(s);
    }
    atomic_store(&lshm__fence_off, 0);
    ASSERT_GT(lost, 0);
}

/* A share that fails (each fault point of a chunked share in turn, while written): the writer
 * never hangs, nothing it wrote is lost, the storage is private and writable as before. */
static void test_failed_shares_lose_nothing(void) {
    int fds = fd_count();
    size_t saved = lshm__share_chunk_bytes;
    lshm__share_chunk_bytes = 64 << 10; /* 24 chunks of 1.5 MiB */
    const size_t sizes[] = {3 << 19, 64 << 20, 512 << 10, 16 * page};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t n = sizes[k];
        for (int nth = 1;; nth++) {
            lshm_pool_trim();
            lshm_storage *s;
            ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
            void *data = lshm_storage_data(s);
            memset(data, 0, n);
            lshm__fault_arm(nth, -ENOSPC);
            share_run r = share_while_writing(s, n, 0);
            int hit = lshm__fault_points_hit();
            lshm__fault_arm(0, 0);
            ASSERT_UINT_EQ(r.lost, 0);
            ASSERT_PTR_EQ(lshm_storage_data(s), data);
            if (hit < nth) { /* past every point: it succeeded */
                ASSERT_OK(r.rc);
                lshm_storage_release(s);
                break;
            }
            ASSERT_ERR(r.rc, -ENOSPC);
            ASSERT_EQ(lshm_storage_flags(s), 0);
            /* private and writable (a fence left behind would block this write for ever) */
            ((volatile uint64_t *)data)[n / sizeof(uint64_t) - 1] = 5;
            /* a retry while written loses nothing either */
            uint64_t *words = data;
            memset(data, 0, n);
            r = share_while_writing(s, n, 0);
            ASSERT_OK(r.rc);
            ASSERT_UINT_EQ(r.lost, 0);
            ASSERT_UINT_EQ(words[0], r.passes);
            lshm_storage_release(s);
            if (nth > 40)
                break; /* (the 64 MiB share's later points are the same steps again) */
        }
    }
    lshm__share_chunk_bytes = saved;
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds);
}

/* The fence cannot be set up (UFFDIO_REGISTER's ENOMEM: vm.max_map_count): the share fails
 * with that error and changes nothing; the next one works. */
static void test_fence_that_cannot_be_set_up(void) {
    int fds = fd_count();
    const size_t sizes[] = {page, 512 << 10, 64 << 20};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        lshm_pool_trim(); /* (the last round's memfd) */
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(sizes[k], NULL, 0, &s));
        unsigned char *data = lshm_storage_data(s);
        memset(data, 9, sizes[k]);
        atomic_store(&lshm__fence_fails, -ENOMEM);
        int rc = lshm_storage_share(s);
        atomic_store(&lshm__fence_fails, 0);
        ASSERT_ERR(rc, -ENOMEM);
        ASSERT(strstr(lshm_last_error(), "userfaultfd") != NULL);
        ASSERT(strstr(lshm_last_error(), "vm.max_map_count") != NULL);
        ASSERT_PTR_EQ(lshm_storage_data(s), data);
        ASSERT_EQ(lshm_storage_flags(s), 0);
        ASSERT_EQ(fd_count(), fds);
        data[0] = 1; /* writable */
        ASSERT_OK(lshm_storage_share(s));
        ASSERT_EQ(data[0], 1);
        ASSERT_EQ(data[sizes[k] - 1], 9);
        lshm_storage_release(s);
    }
    /* memory the fence cannot protect (another error): shared unfenced, as before */
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    unsigned long fences = lshm__fences_set;
    atomic_store(&lshm__fence_fails, -EINVAL);
    int rc = lshm_storage_share(s);
    atomic_store(&lshm__fence_fails, 0);
    ASSERT_OK(rc);
    ASSERT_UINT_EQ(lshm__fences_set, fences);
    lshm_storage_release(s);
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds);
}

static void *nothing(void *arg) {
    return arg;
}

/* The number of lines of /proc/self/maps. */
static int map_count(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    ASSERT(f != NULL);
    int lines = 0;
    for (int c; (c = fgetc(f)) != EOF;)
        lines += c == '\n';
    fclose(f);
    return lines;
}

/* lshm_storage_share_fenced never shares unfenced: wherever the fence cannot be set up (the
 * fence off, memory it cannot protect, memory another userfaultfd watches) it fails with
 * -EOPNOTSUPP and changes nothing (same pages, bytes, flags, fds, mappings); -ENOMEM stays
 * -ENOMEM; with the fence it shares on every path and loses no concurrent write; a storage
 * shared already is 0 without a fence. */
static void test_fenced_share_never_goes_unfenced(void) {
    pthread_t t; /* (a second thread: a process without one needs no fence, see below) */
    ASSERT_OK(pthread_create(&t, NULL, nothing, NULL));
    ASSERT_OK(pthread_join(t, NULL));
    int fds = fd_count();
    const size_t sizes[] = {page, 512 << 10, 3 << 19, 64 << 20}; /* slab, pages, chunks, huge */
    /* 0: the fence off; 1: WRITEPROTECT fails (-EINVAL) after REGISTER worked */
    const int refusals[] = {0, -EINVAL, -EBUSY, -ENOMEM, 1};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        for (size_t j = 0; j < sizeof refusals / sizeof refusals[0]; j++) {
            lshm_pool_trim();
            lshm_storage *s;
            ASSERT_OK(lshm_storage_create(sizes[k], NULL, 0, &s));
            unsigned char *data = lshm_storage_data(s);
            memset(data, 7, sizes[k]);
            int maps = map_count();
            unsigned long fences = lshm__fences_set;
            if (refusals[j] == 0)
                atomic_store(&lshm__fence_off, 1);
            else if (refusals[j] == 1)
                atomic_store(&lshm__fence_wp_fails, -EINVAL);
            else
                atomic_store(&lshm__fence_fails, refusals[j]);
            int rc = lshm_storage_share_fenced(s);
            atomic_store(&lshm__fence_fails, 0);
            atomic_store(&lshm__fence_wp_fails, 0);
            atomic_store(&lshm__fence_off, 0);
            if (refusals[j] == -ENOMEM) {
                ASSERT_ERR(rc, -ENOMEM);
            } else {
                ASSERT_ERR(rc, -EOPNOTSUPP);
                ASSERT(strstr(lshm_last_error(), "no write fence") != NULL);
            }
            ASSERT_UINT_EQ(lshm__fences_set, fences);
            ASSERT_PTR_EQ(lshm_storage_data(s), data);
            ASSERT_EQ(lshm_storage_flags(s), 0);
            ASSERT_EQ(fd_count(), fds);
            ASSERT_EQ(map_count(), maps);
            ASSERT_EQ(data[0], 7);
            ASSERT_EQ(data[sizes[k] - 1], 7);
            data[0] = 1; /* private and writable */
            lshm_storage_release(s);
        }
        /* where the fence can be set up: as lshm_storage_share, nothing lost */
        share_call = lshm_storage_share_fenced;
        check_no_loss(sizes[k], 1, 0, -1);
        share_call = lshm_storage_share;
    }
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    atomic_store(&lshm__fence_off, 1);
    ASSERT_OK(lshm_storage_share_fenced(s)); /* shared already: nothing to copy */
    atomic_store(&lshm__fence_off, 0);
    lshm_storage_release(s);
    ASSERT_ERR(lshm_storage_share_fenced(NULL), -EINVAL);
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds);
}

/* Run fn in a forked child (after `unprivileged`: as nobody, without CAP_SYS_PTRACE) and
 * expect it to exit 0; the child starts with `extra` more fds than the parent. */
static void in_child(void (*fn)(void), int unprivileged, int extra) {
    int fds = fd_count();
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        if (fd_count() != fds + extra) /* its own userfaultfd took the inherited one's place */
            _exit(3);
        if (unprivileged) {
            if (setgroups(0, NULL) != 0 || setresgid(65534, 65534, 65534) != 0 ||
                setresuid(65534, 65534, 65534) != 0)
                _exit(4);
            lshm__os_fence_after_fork_child(); /* as an ordinary user opens it */
            if (fd_count() != fds)
                _exit(5);
        }
        fn();
        _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status));
    ASSERT_EQ(WEXITSTATUS(status), 0);
}

static void child_shares(void) {
    check_no_loss(page, 1, 0, LSHM__ORIGIN_SLAB);
    check_no_loss(3 << 19, 1, 0, LSHM__ORIGIN_PAGES);
    check_no_loss(64 << 20, 0, 0, LSHM__ORIGIN_PAGES);
}

static void test_forked_child_loses_nothing(void) {
    in_child(child_shares, 0, 0);
}

static void test_ordinary_user_loses_nothing(void) {
    if (geteuid() != 0) {
        child_shares(); /* this is an ordinary user */
        return;
    }
    in_child(child_shares, 1, 0);
}

/* UFFDIO_WRITEPROTECT fails after it protected (part of) the range, with a writer waiting
 * there: the share fails, changing nothing, and the writer goes on (unregistering alone would
 * leave it asleep for ever). */
static void test_protection_that_fails_lets_its_writers_go(void) {
    const size_t sizes[] = {page, 512 << 10, 64 << 20};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(sizes[k], NULL, 0, &s));
        memset(lshm_storage_data(s), 0, sizes[k]);
        atomic_store(&lshm__fence_wp_fails, -ENOMEM);
        alarm(60); /* (a writer left asleep: the test dies instead of hanging) */
        share_run r = share_while_writing(s, sizes[k], 0);
        alarm(0);
        atomic_store(&lshm__fence_wp_fails, 0);
        ASSERT_ERR(r.rc, -ENOMEM);
        ASSERT_EQ(lshm_storage_flags(s), 0);
        ASSERT_UINT_EQ(r.lost, 0);
        ASSERT_OK(lshm_storage_share(s));
        lshm_storage_release(s);
    }
}

/* A child forked without the atfork handlers (_Fork) holds its parent's userfaultfd, whose
 * ioctls act on the parent's address space: it shares unfenced, and the parent's memory stays
 * writable. */
static void test_child_without_fork_handlers_leaves_the_parent_alone(void) {
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(512 << 10, NULL, 0, &s));
    volatile unsigned char *data = lshm_storage_data(s);
    memset((void *)data, 3, 512 << 10);
    pid_t pid = _Fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        unsigned long fences = lshm__fences_set;
        if (lshm_storage_share_fenced(s) != -EOPNOTSUPP) /* (it may not use the parent's) */
            _exit(4);
        int rc = lshm_storage_share(s);
        _exit(rc != 0 ? 1 : lshm__fences_set != fences ? 2 : 0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status));
    ASSERT_EQ(WEXITSTATUS(status), 0);
    alarm(10); /* (write-protected from the child: this write would never return) */
    data[0] = 4;
    data[(512 << 10) - 1] = 4;
    alarm(0);
    ASSERT_EQ(lshm_storage_flags(s), 0);
    check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES); /* and the parent's fence works */
    lshm_storage_release(s);
}

static int is_pipe(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode);
}

static int reused_number; /* (for the child below) */

static void child_keeps_the_programs_fd(void) {
    if (!is_pipe(reused_number))
        _exit(7); /* the fork handler closed an fd of the program's */
    check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES);
}

/* The program closes the library's userfaultfd (a close-all) and the number is reused: a
 * fork's child does not close the program's fd in its place, and the next share opens a new
 * userfaultfd and is fenced. */
static void test_userfaultfd_closed_by_the_program(void) {
    int ufd = userfaultfd_number();
    ASSERT_GE(ufd, 0);
    int p[2];
    ASSERT_OK(pipe2(p, O_CLOEXEC));
    ASSERT_EQ(dup3(p[0], ufd, O_CLOEXEC), ufd); /* (closes the userfaultfd) */
    reused_number = ufd;
    in_child(child_keeps_the_programs_fd, 0, 1); /* (the pipe end and its new userfaultfd) */
    unsigned long fences = lshm__fences_set;
    check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES); /* fenced (it asserts the count too) */
    ASSERT_UINT_EQ(lshm__fences_set, fences + 1);
    ASSERT(is_pipe(ufd));
    int fresh = userfaultfd_number();
    ASSERT_GE(fresh, 0);
    ASSERT_NE(fresh, ufd);
    close(ufd);
    close(p[0]);
    close(p[1]);
    /* closed, not reused: the new one takes the same number (the lowest free); the next
     * share is fenced, lshm_storage_share_fenced too (not refused) */
    ufd = userfaultfd_number();
    ASSERT_GE(ufd, 0);
    close(ufd);
    fences = lshm__fences_set;
    share_call = lshm_storage_share_fenced;
    check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES);
    ASSERT_GE(userfaultfd_number(), 0);
    close(userfaultfd_number());
    check_no_loss(3 << 19, 1, 0, LSHM__ORIGIN_PAGES);
    share_call = lshm_storage_share;
    ASSERT_UINT_EQ(lshm__fences_set, fences + 2);
    ASSERT_GE(userfaultfd_number(), 0);
}

/* The program closes the library's userfaultfd while several threads share: each share is
 * still fenced (a share beside the reopen used to find no userfaultfd and go unfenced: the
 * fenced share refused), the library opens one new userfaultfd for all of them and no fd is
 * left over. (Under ThreadSanitizer: the reopen rewrote the userfaultfd's pid and identity
 * while other threads' shares read them.) */
enum { CLOSED_UFFD_THREADS = 3 };
static pthread_barrier_t closed_uffd_barrier;

static void *share_after_close(void *arg) {
    int *rc = arg;
    lshm_storage *s;
    ASSERT_OK(lshm_storage_create(512 << 10, NULL, 0, &s));
    pthread_barrier_wait(&closed_uffd_barrier);
    *rc = lshm_storage_share_fenced(s);
    lshm_storage_release(s);
    return NULL;
}

static void test_userfaultfd_closed_while_threads_share(void) {
    int fds = fd_count();
    ASSERT_OK(pthread_barrier_init(&closed_uffd_barrier, NULL, CLOSED_UFFD_THREADS + 1));
    for (int round = 0; round < 20; round++) {
        int ufd = userfaultfd_number();
        ASSERT_GE(ufd, 0);
        pthread_t t[CLOSED_UFFD_THREADS];
        int rc[CLOSED_UFFD_THREADS];
        for (int i = 0; i < CLOSED_UFFD_THREADS; i++)
            ASSERT_OK(pthread_create(&t[i], NULL, share_after_close, &rc[i]));
        close(ufd);
        pthread_barrier_wait(&closed_uffd_barrier);
        for (int i = 0; i < CLOSED_UFFD_THREADS; i++) {
            ASSERT_OK(pthread_join(t[i], NULL));
            ASSERT_OK(rc[i]); /* fenced: by the userfaultfd opened again */
        }
        ASSERT_GE(userfaultfd_number(), 0); /* opened again */
    }
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds); /* one userfaultfd, as before */
    ASSERT_OK(pthread_barrier_destroy(&closed_uffd_barrier));
}

/* The program takes the library's userfaultfd from under it again and again while threads
 * share (`replace`: dup2 of /dev/null onto its number, else close), each time as soon as a new
 * one appears: sometimes before the library has even set it up (UFFDIO_API). The library never
 * closes an fd of the program's (it closed the /dev/null it found at the number of the
 * userfaultfd it had just opened), and it never gives the fence up for good: once the program
 * stops, a fenced share works (a userfaultfd taken before its setup counted as "none can be
 * opened": every later fenced share was refused). Shares may be refused meanwhile. */
static _Atomic int taken_uffd_stop;

static void *share_until_stopped(void *arg) {
    (void)arg;
    while (!atomic_load(&taken_uffd_stop)) {
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(512 << 10, NULL, 0, &s));
        int rc = lshm_storage_share_fenced(s);
        ASSERT(rc == 0 || rc == -EOPNOTSUPP);
        lshm_storage_release(s);
    }
    return NULL;
}

static void userfaultfd_taken_while_threads_share(int replace) {
    int fds = fd_count();
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    ASSERT_GE(devnull, 0);
    struct stat null_st, st;
    ASSERT_OK(fstat(devnull, &null_st));
    int held = -1; /* the program's /dev/null at the number of a userfaultfd it took */
    atomic_store(&taken_uffd_stop, 0);
    pthread_t t[CLOSED_UFFD_THREADS];
    for (int i = 0; i < CLOSED_UFFD_THREADS; i++)
        ASSERT_OK(pthread_create(&t[i], NULL, share_until_stopped, NULL));
    struct timespec now, end;
    ASSERT_OK(clock_gettime(CLOCK_MONOTONIC, &end));
    end.tv_sec += 3;
    for (int taken = 0; taken < 5000;) {
        ASSERT_OK(clock_gettime(CLOCK_MONOTONIC, &now));
        if (now.tv_sec > end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec > end.tv_nsec))
            break;
        int ufd = 0;
        while (ufd < 64 && !is_userfaultfd(ufd)) /* (it takes the lowest free number) */
            ufd++;
        if (ufd == 64)
            continue; /* (not opened again yet) */
        /* (racing the library's use of these numbers on purpose, which ThreadSanitizer
         * reports as a race on the fd: not tracked) */
        UNTRACKED_BEGIN();
        int replaced = replace ? dup3(devnull, ufd, O_CLOEXEC) : close(ufd);
        /* the last /dev/null is still the program's: nobody else may have closed it */
        int kept = held < 0 || (fstat(held, &st) == 0 && st.st_ino == null_st.st_ino);
        if (replace && held >= 0)
            close(held);
        UNTRACKED_END();
        ASSERT_EQ(replaced, replace ? ufd : 0);
        ASSERT(kept);
        held = replace ? ufd : -1;
        taken++;
    }
    atomic_store(&taken_uffd_stop, 1);
    for (int i = 0; i < CLOSED_UFFD_THREADS; i++)
        ASSERT_OK(pthread_join(t[i], NULL));
    if (held >= 0) {
        ASSERT(fstat(held, &st) == 0 && st.st_ino == null_st.st_ino);
        close(held);
    }
    close(devnull);
    unsigned long fences = lshm__fences_set;
    share_call = lshm_storage_share_fenced;
    check_no_loss(512 << 10, 1, 0, LSHM__ORIGIN_PAGES); /* fenced again */
    share_call = lshm_storage_share;
    ASSERT_UINT_EQ(lshm__fences_set, fences + 1);
    lshm_pool_trim();
    ASSERT_EQ(fd_count(), fds);
}

static void test_userfaultfd_taken_while_threads_share(void) {
    userfaultfd_taken_while_threads_share(1);
    userfaultfd_taken_while_threads_share(0);
}

/* VmFlags of the mapping that holds p contain "uw" (registered for write-protect)? */
static int registered_wp_at(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    ASSERT(f != NULL);
    char line[512];
    int here = 0, found = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long start, end;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &start, &end, perms) == 3)
            here = start <= (unsigned long)(uintptr_t)p && (unsigned long)(uintptr_t)p < end;
        else if (here && strncmp(line, "VmFlags:", 8) == 0)
            found = strstr(line, " uw") != NULL;
    }
    fclose(f);
    return found;
}

/* Memory the program's own userfaultfd watches: the share goes unfenced (the fenced share
 * refuses it), and a share that fails leaves the program's registration in place (UNREGISTER
 * would remove anybody's). */
static void test_memory_another_userfaultfd_watches(void) {
    int mine = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    ASSERT_GE(mine, 0);
    struct uffdio_api api = {.api = UFFD_API};
    ASSERT_OK(ioctl(mine, UFFDIO_API, &api));
    const size_t n = 512 << 10;
    lshm_pool_trim();
    for (int nth = 1;; nth++) {
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
        void *data = lshm_storage_data(s);
        memset(data, 1, n);
        struct uffdio_register reg = {{(uintptr_t)data, n}, UFFDIO_REGISTER_MODE_WP, 0};
        ASSERT_OK(ioctl(mine, UFFDIO_REGISTER, &reg));
        ASSERT(registered_wp_at(data));
        unsigned long fences = lshm__fences_set;
        if (nth == 1) { /* the fenced share refuses it, and leaves the registration alone */
            ASSERT_ERR(lshm_storage_share_fenced(s), -EOPNOTSUPP);
            ASSERT(strstr(lshm_last_error(), "another userfaultfd") != NULL);
            ASSERT_EQ(lshm_storage_flags(s), 0);
            ASSERT(registered_wp_at(data));
        }
        lshm__fault_arm(nth, -ENOSPC);
        int rc = lshm_storage_share(s);
        int hit = lshm__fault_points_hit();
        lshm__fault_arm(0, 0);
        ASSERT_UINT_EQ(lshm__fences_set, fences); /* (EBUSY: unfenced) */
        if (hit < nth) {
            ASSERT_OK(rc);
            lshm_storage_release(s);
            break;
        }
        ASSERT_ERR(rc, -ENOSPC);
        ASSERT(registered_wp_at(data)); /* still the program's */
        lshm_storage_release(s);
    }
    close(mine);
}

static lshm_storage *inherited_slab_storage[2];

/* In a fork's child: the slab storages made before the fork sit in memory the child's
 * userfaultfd never registered (the parent's registration is not inherited). A share there
 * takes the full way, registering, and loses nothing. One the program's own userfaultfd
 * watches (it can: nothing of ours is registered there) is shared unfenced: never protected
 * through ours, where its writer would wait on a userfaultfd nobody wakes (alarm: a hang
 * kills the child). */
static void child_shares_inherited_slab_storage(void) {
    lshm_storage *s = inherited_slab_storage[0], *watched = inherited_slab_storage[1];
    if (registered_wp_at(lshm_storage_data(s)) || registered_wp_at(lshm_storage_data(watched)))
        _exit(10);
    unsigned long fences = lshm__fences_set;
    share_run r = share_while_writing(s, page, 0);
    if (r.rc != 0 || r.lost != 0 || r.passes < 3 || lshm__fences_set != fences + 1 ||
        (lshm_storage_flags(s) & LSHM_STORAGE_SHARED) == 0)
        _exit(11);
    int mine = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = {.api = UFFD_API};
    if (mine < 0 || ioctl(mine, UFFDIO_API, &api) != 0)
        _exit(12);
    struct uffdio_register reg = {
        {(uintptr_t)lshm_storage_data(watched), page}, UFFDIO_REGISTER_MODE_WP, 0};
    if (ioctl(mine, UFFDIO_REGISTER, &reg) != 0)
        _exit(13);
    fences = lshm__fences_set;
    alarm(30);
    r = share_while_writing(watched, page, 0);
    alarm(0);
    if (r.rc != 0 || r.passes < 3 || lshm__fences_set != fences) /* (unfenced: EBUSY) */
        _exit(14);
    close(mine);
}

/* A slab is registered with the process's userfaultfd when it is made, so each fence on it
 * only write-protects: its private pages stay registered across shares and across a fence
 * that fails (no mapping split, none added); the shared pages are the memfd's, unregistered;
 * writers lose nothing; a forked child, whose copy of the slab is not registered, registers
 * at its share and loses nothing either. */
static void test_slab_registered_ahead(void) {
    pthread_t t; /* (a second thread: a process without one needs no fence) */
    ASSERT_OK(pthread_create(&t, NULL, nothing, NULL));
    ASSERT_OK(pthread_join(t, NULL));
    if (userfaultfd_number() < 0) {
        fprintf(stderr, "   (no userfaultfd in this process: nothing to register)\n");
        return;
    }
    /* a slab made from here on (earlier tests closed the userfaultfd the older ones were
     * registered with, which unregisters them): storages until one starts a new slab */
    lshm_storage *filler[200];
    int fillers = 0;
    lshm_slab_counters before, now;
    ASSERT_OK(lshm_slab_stats(&before));
    do {
        ASSERT_LT(fillers, 200);
        ASSERT_OK(lshm_storage_create(LSHM_SLAB_MAX_BYTES, NULL, 0, &filler[fillers]));
        ASSERT_EQ(filler[fillers++]->origin, LSHM__ORIGIN_SLAB);
        ASSERT_OK(lshm_slab_stats(&now));
    } while (now.slabs == before.slabs);
    lshm_storage *s[4];
    for (int i = 0; i < 4; i++) {
        ASSERT_OK(lshm_storage_create(page, NULL, 0, &s[i]));
        ASSERT_EQ(s[i]->origin, LSHM__ORIGIN_SLAB);
        memset(lshm_storage_data(s[i]), 0, page);
        ASSERT(registered_wp_at(lshm_storage_data(s[i])));
    }
    unsigned long fences = lshm__fences_set;
    share_run r = share_while_writing(s[0], page, 0);
    ASSERT_OK(r.rc);
    ASSERT_UINT_EQ(r.lost, 0);
    ASSERT_UINT_EQ(lshm__fences_set, fences + 1);
    ASSERT(!registered_wp_at(lshm_storage_data(s[0]))); /* the memfd's page */
    ASSERT(registered_wp_at(lshm_storage_data(s[1])));  /* the slab's, still */
    /* a fence that fails after protecting: lifted, the slab still registered, no mapping
     * added, its writer let go */
    int maps = map_count();
    atomic_store(&lshm__fence_wp_fails, -ENOMEM);
    alarm(60); /* (a writer left asleep: the test dies instead of hanging) */
    r = share_while_writing(s[1], page, 0);
    alarm(0);
    atomic_store(&lshm__fence_wp_fails, 0);
    ASSERT_ERR(r.rc, -ENOMEM);
    ASSERT_UINT_EQ(r.lost, 0);
    ASSERT_EQ(lshm_storage_flags(s[1]), 0);
    ASSERT_EQ(map_count(), maps);
    ASSERT(registered_wp_at(lshm_storage_data(s[1])));
    memset(lshm_storage_data(s[1]), 0, page); /* (the writer counts from zero) */
    r = share_while_writing(s[1], page, 0);
    ASSERT_OK(r.rc);
    ASSERT_UINT_EQ(r.lost, 0);
    inherited_slab_storage[0] = s[2];
    inherited_slab_storage[1] = s[3];
    in_child(child_shares_inherited_slab_storage, 0, 0);
    ASSERT(registered_wp_at(lshm_storage_data(s[2]))); /* the parent's, untouched */
    ASSERT_EQ(lshm_storage_flags(s[2]), 0);
    /* a storage shared read-only has a memfd of its own; freed, its pages are private again
     * and registered again (merged back: no mapping left over), and no other userfaultfd
     * can watch them */
    maps = map_count();
    void *data = lshm_storage_data(s[3]);
    ASSERT_OK(lshm_storage_share_readonly(s[3]));
    ASSERT(!registered_wp_at(data));
    lshm_storage_release(s[3]);
    ASSERT_EQ(map_count(), maps);
    ASSERT(registered_wp_at(data));
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s[3]));
    ASSERT_PTR_EQ(lshm_storage_data(s[3]), data); /* (the pages freed first come first) */
    int mine = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    ASSERT_GE(mine, 0);
    struct uffdio_api api = {.api = UFFD_API};
    ASSERT_OK(ioctl(mine, UFFDIO_API, &api));
    struct uffdio_register reg = {{(uintptr_t)data, page}, UFFDIO_REGISTER_MODE_WP, 0};
    ASSERT_NE(ioctl(mine, UFFDIO_REGISTER, &reg), 0);
    ASSERT_EQ(errno, EBUSY);
    close(mine);
    memset(data, 0, page);
    r = share_while_writing(s[3], page, 0);
    ASSERT_OK(r.rc);
    ASSERT_UINT_EQ(r.lost, 0);
    for (int i = 0; i < 4; i++)
        lshm_storage_release(s[i]);
    while (fillers > 0)
        lshm_storage_release(filler[--fillers]);
}

typedef struct forker {
    volatile unsigned char *data;
    size_t n;
    _Atomic int stop;
    int forks, bad;
} forker;

/* fork() over and over; each child writes the storage's first and last byte (a protection
 * inherited from the parent would make that wait for ever: alarm) and exits. */
static void *fork_repeatedly(void *arg) {
    forker *k = arg;
    while (!atomic_load(&k->stop)) {
        pid_t pid = fork();
        if (pid == 0) {
            alarm(10);
            k->data[0] += 1;
            k->data[k->n - 1] += 1;
            _exit(0);
        }
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
            WEXITSTATUS(status) != 0)
            k->bad++;
        k->forks++;
    }
    return NULL;
}

/* fork() from a third thread while one thread shares and another writes: fork waits for the
 * share, the writer loses nothing, every child runs and can write its copy. */
static void test_fork_while_a_fenced_share_is_written(void) {
    for (int round = 0; round < 5; round++) {
        const size_t n = 64 << 20;
        lshm_storage *s;
        ASSERT_OK(lshm_storage_create(n, NULL, 0, &s));
        memset(lshm_storage_data(s), 0, n);
        forker k = {.data = (unsigned char *)lshm_storage_data(s) + 8, .n = n - 16};
        pthread_t t;
        ASSERT_OK(pthread_create(&t, NULL, fork_repeatedly, &k));
        share_run r = share_while_writing(s, n, 0); /* (the writer skips bytes 8..n-9's ends) */
        atomic_store(&k.stop, 1);
        ASSERT_OK(pthread_join(t, NULL));
        ASSERT_OK(r.rc);
        ASSERT_UINT_EQ(r.lost, 0);
        ASSERT_GT(k.forks, 0);
        ASSERT_EQ(k.bad, 0);
        lshm_storage_release(s);
    }
}

/* A process that never started a second thread (this program run again as `single`) has
 * nobody to fence against: no fence until it starts one. */
static void child_single_then_threaded(void) {
    lshm_storage *s;
    unsigned long fences = lshm__fences_set;
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    lshm_storage_release(s);
    ASSERT_UINT_EQ(lshm__fences_set, fences);
    atomic_store(&lshm__fence_off, 1); /* no fence possible, and none needed: not refused */
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share_fenced(s));
    lshm_storage_release(s);
    pthread_t t;
    ASSERT_OK(pthread_create(&t, NULL, nothing, NULL));
    ASSERT_OK(pthread_join(t, NULL));
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    ASSERT_ERR(lshm_storage_share_fenced(s), -EOPNOTSUPP); /* a second thread: refused now */
    lshm_storage_release(s);
    atomic_store(&lshm__fence_off, 0);
    ASSERT_OK(lshm_storage_create(page, NULL, 0, &s));
    ASSERT_OK(lshm_storage_share(s));
    lshm_storage_release(s);
    ASSERT_UINT_EQ(lshm__fences_set, fences + 1);
}

static void test_single_threaded_process_needs_no_fence(void) {
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        execl("/proc/self/exe", "test_share_writes", "single", (char *)NULL);
        _exit(6);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT(WIFEXITED(status));
    ASSERT_EQ(WEXITSTATUS(status), 0);
}

int main(int argc, char **argv) {
    page = lshm__os_page_size();
    if (argc > 1 && strcmp(argv[1], "single") == 0) {
        child_single_then_threaded();
        return 0;
    }
    RUN_TEST(test_every_path_loses_nothing);
    RUN_TEST(test_pooled_refill_loses_nothing);
    RUN_TEST(test_kernel_writes_are_not_lost);
    RUN_TEST(test_unfenced_share_loses_writes);
    RUN_TEST(test_failed_shares_lose_nothing);
    RUN_TEST(test_fence_that_cannot_be_set_up);
    RUN_TEST(test_fenced_share_never_goes_unfenced);
    RUN_TEST(test_protection_that_fails_lets_its_writers_go);
    RUN_TEST(test_child_without_fork_handlers_leaves_the_parent_alone);
    RUN_TEST(test_userfaultfd_closed_by_the_program);
    RUN_TEST(test_userfaultfd_closed_while_threads_share);
    RUN_TEST(test_userfaultfd_taken_while_threads_share);
    RUN_TEST(test_memory_another_userfaultfd_watches);
    RUN_TEST(test_slab_registered_ahead);
    RUN_TEST(test_forked_child_loses_nothing);
    RUN_TEST(test_fork_while_a_fenced_share_is_written);
    RUN_TEST(test_ordinary_user_loses_nothing);
    RUN_TEST(test_single_threaded_process_needs_no_fence);
    return 0;
}
