"""Bounded stress tests: threads sharing, verifying, sending and releasing arrays while worker
processes are SIGKILLed at random; os.fork while threads are inside big chunked shares.

Nothing may crash, every surviving array keeps its bytes, the only exceptions are the ones a
killed worker causes on its own channel (EOF / broken pipe / connection reset), and at the end
fds and memfd mappings are back at the baseline. PYSHM_STRESS_SECONDS (default 20) sets the
length of the first test; the iteration counts are printed (pytest -s to see them).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import select
import signal
import threading
import time

import numpy as np

import pyshm

import shm_harness as H
from shm_harness import digest, pattern

SECONDS = float(os.environ.get("PYSHM_STRESS_SECONDS", "20"))
N_THREADS = 4
N_WORKERS = 3
SIZES = [4096, 40_000, 200_000, 1 << 20, (3 << 20) + 123]  # slabs, own memfds, chunked shares
# fds and memfd mappings must not grow. Other mappings are counted outside glibc's
# per-thread malloc heaps and thread stacks (a thread may create either at any time, see
# shm_harness.outside_malloc_heaps); the rest may move by a few lines: pymalloc arenas, numpy's
# cache. The warm-up runs the same threads once.
MAPS_TOLERANCE = 4
CHANNEL_ERRORS = (EOFError, BrokenPipeError, ConnectionResetError)


class Slot:
    """One worker process and its duplex pipe; `lock` serialises requests on it."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.lock = threading.Lock()
        self.proc = None
        self.conn = None
        self.generation = 0
        self.start()

    def start(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=H.worker_loop, args=(child,), daemon=True)
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        self.generation += 1

    def replace(self):
        """The worker died (lock held): reap it, close its channel, start a new one."""
        self.proc.kill()
        self.proc.join(30)
        self.proc.close()
        self.conn.close()
        self.start()

    def stop(self):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(10)
        self.proc.close()
        self.conn.close()


def make_array(rng, n, seed):
    """A fresh array of n bytes filled with pattern(seed), shared one of three ways."""
    how = rng.choice(["in place", "in place", "created shared", "copy"])
    data = pattern(seed, n)
    if how == "in place":
        a = pyshm.empty(n, np.uint8)
        a[:] = data
        ptr = a.ctypes.data
        pyshm.share_memory_(a)
        assert a.ctypes.data == ptr and pyshm.storage_of(a).data_ptr == ptr
    elif how == "created shared":
        a = pyshm.empty(n, np.uint8, shared=True)
        a[:] = data
    else:
        a = pyshm.copy(data, shared=True)
    assert pyshm.is_shared(a)
    return a, data.copy()


def run_workload(seconds, ctx, stats, errors, kill=True):
    slots = [Slot(ctx) for _ in range(N_WORKERS)]
    deadline = time.monotonic() + seconds
    stats_lock = threading.Lock()

    def bump(key, k=1):
        with stats_lock:
            stats[key] = stats.get(key, 0) + k

    def sharer(index):
        rng = random.Random(1000 + index)
        live = []
        tag = 0
        try:
            while time.monotonic() < deadline:
                n = rng.choice(SIZES)
                live.append(make_array(rng, n, rng.randrange(256)))
                bump("shares")
                for _ in range(2):
                    a, model = rng.choice(live)
                    slot = rng.choice(slots)
                    value = rng.randrange(256)
                    tag += 1
                    with slot.lock:
                        generation = slot.generation
                        try:
                            slot.conn.send((tag, a, digest(model), value, False))
                            if not slot.conn.poll(60):
                                raise AssertionError("a live worker did not answer in 60 s")
                            reply = slot.conn.recv()
                        except CHANNEL_ERRORS:
                            # killed under us: what it wrote before dying may or may not be
                            # there, nothing else may have changed
                            assert a[0] in (model[0], value), "a killed worker's array changed"
                            model[0] = a[0]
                            bump("lost_requests")
                            if slot.generation == generation:
                                slot.replace()
                                bump("replaced")
                            continue
                    assert reply[0] == tag, reply
                    _, ok, writeable, _, wrote = reply
                    assert ok and writeable and wrote, reply
                    model[0] = value
                    bump("sends")
                for b, m in live:
                    assert np.array_equal(b, m), "a surviving array lost its bytes"
                bump("verified", len(live))
                while len(live) > 5 or (live and rng.random() < 0.3):
                    live.pop(rng.randrange(len(live)))
                    bump("released")
        except BaseException as exc:  # reported by the test, never lost in a thread
            errors.append(f"sharer {index}: {exc!r}")

    def killer():
        rng = random.Random(7)
        try:
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(0.05, 0.4))
                slot = rng.choice(slots)
                proc = slot.proc
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    bump("kills")
                except (ProcessLookupError, ValueError, AttributeError):
                    pass  # already dead or being replaced
        except BaseException as exc:
            errors.append(f"killer: {exc!r}")

    threads = [threading.Thread(target=sharer, args=(i,)) for i in range(N_THREADS)]
    if kill:
        threads.append(threading.Thread(target=killer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
        if t.is_alive():
            errors.append(f"{t.name} still running long after the deadline")
    for slot in slots:
        with slot.lock:
            slot.stop()


def test_threads_share_send_and_release_while_workers_are_sigkilled():
    ctx = mp.get_context("forkserver")
    warm, errors = {}, []
    # Warm-up: the forkserver, the fd server, a slab, the threads' stacks and malloc arenas
    # exist from now on: they are part of the baseline.
    run_workload(1.0, ctx, warm, errors, kill=False)
    assert not errors, errors
    before = H.counts()
    stats: dict = {}
    start = time.monotonic()
    run_workload(SECONDS, ctx, stats, errors)
    elapsed = time.monotonic() - start
    print(f"\nstress ({elapsed:.1f} s, {N_THREADS} threads, {N_WORKERS} workers): "
          + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))
    assert not errors, errors
    assert stats.get("shares", 0) > 0 and stats.get("sends", 0) > 0
    assert stats.get("kills", 0) > 0
    after = H.counts()
    print(f"mappings outside heaps and stacks: {before['maps_outside_heaps']} -> "
          f"{after['maps_outside_heaps']}")
    problems = H.diff_counts(before, after, MAPS_TOLERANCE, heaps=True)
    assert not problems, "after the stress run: " + "; ".join(problems)


# ---- fork while threads are inside big chunked shares (issue 9 point 4) -----------------------

BIG = [64 << 20, 128 << 20, 256 << 20]
N_FORKS = 8
CHILD_TIMEOUT = 10.0
MARK = 0xEE


def _read_line(fd, timeout):
    data = b""
    end = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 256)
        if not chunk:
            return None
        data += chunk
    return data.decode()


def test_fork_while_threads_share_big_arrays():
    """The child of a fork taken while another thread is inside a 64-256 MiB chunked share
    can share that very storage itself within a timeout (point 4a), and while it believes
    the storage private it never sees the parent's writes made after the fork (point 4b)."""
    before = H.counts()
    stop = threading.Event()
    inflight: dict = {}  # thread index -> (id, array, seed) while inside share_memory_
    lock = threading.Lock()
    errors: list = []
    stats = {"big_shares": 0}

    def sharer(index):
        rng = random.Random(index)
        serial = 0
        try:
            while not stop.is_set():
                n = rng.choice(BIG)
                seed = rng.randrange(1, 200)
                a = pyshm.empty(n, np.uint8)
                a[::4096] = seed  # every page touched: the share copies all of them
                a[1::4096] = seed
                serial += 1
                with lock:
                    inflight[index] = (index * 1_000_000 + serial, a, seed)
                pyshm.share_memory_(a)
                with lock:
                    del inflight[index]
                assert pyshm.is_shared(a)
                assert (a[1::4096] == seed).all(), "bytes lost by a big share"
                stats["big_shares"] += 1
                del a
        except BaseException as exc:
            errors.append(f"sharer {index}: {exc!r}")
            with lock:
                inflight.pop(index, None)

    threads = [threading.Thread(target=sharer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    outcomes = []
    rng = random.Random(42)
    try:
        for f in range(N_FORKS):
            if sum(1 for o in outcomes if not o.startswith("ok")) >= 2:
                break  # enough evidence; each hang costs CHILD_TIMEOUT
            end = time.monotonic() + 30
            while not inflight and time.monotonic() < end:
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.06))  # somewhere inside the share (or just after)
            with lock:
                snapshot = dict(inflight)
            outcomes.append(_fork_once(snapshot, inflight, f))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print(f"\nfork stress: forks={len(outcomes)}, big shares={stats['big_shares']}, "
          f"outcomes={outcomes}")
    assert not errors, errors
    assert all(o.startswith("ok") for o in outcomes), (
        f"issue 9 point 4 (fork during a share): {outcomes}"
    )
    del snapshot
    problems = H.diff_counts(before, H.counts(), MAPS_TOLERANCE, heaps=True)
    assert not problems, "after the fork stress: " + "; ".join(problems)


def _fork_once(snapshot, inflight, f):
    """Fork now; returns 'ok' or what went wrong in the child."""
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: one thread, a copy of `inflight` as it was at the fork
        code = 98
        try:
            os.close(to_parent_r)
            os.close(to_child_w)
            if not inflight:
                os.write(to_parent_w, b"none\n")
                code = 0
            else:
                ident, a, seed = next(iter(inflight.values()))
                private = not pyshm.is_shared(a)
                os.write(to_parent_w, b"%d %d\n" % (ident, private))
                select.select([to_child_r], [], [], 30)
                os.read(to_child_r, 16)  # the parent has written MARK by now (or gave up)
                saw = private and bool((a[::4096] == MARK).any())
                if saw:  # point 4b: a "private" storage sees the parent's writes
                    os.write(to_parent_w, b"4b\n")
                pyshm.share_memory_(a)  # point 4a: hangs on a mutex held by a dead thread
                if not (pyshm.is_shared(a) and (a[1::4096] == seed).all()):
                    os._exit(11)
                if saw:
                    os._exit(10)
                code = 0
        except BaseException:
            code = 99
        finally:
            os._exit(code)
    os.close(to_parent_w)
    os.close(to_child_r)
    try:
        line = _read_line(to_parent_r, CHILD_TIMEOUT)
        if line is not None and line != "none\n":
            ident, private = map(int, line.split())
            entry = next((e for e in snapshot.values() if e[0] == ident), None)
            if entry is not None:
                a = entry[1]
                end = time.monotonic() + 30  # the parent's share of it completes
                while not pyshm.is_shared(a) and time.monotonic() < end:
                    time.sleep(0.002)
                time.sleep(0.001)
                a[::4096] = MARK  # after the fork: a private copy must not see this
                del a, entry
        try:
            os.write(to_child_w, b"go")
        except BrokenPipeError:
            pass
        status = H.wait_or_kill(pid, CHILD_TIMEOUT)
        hung = status is None
        tail = _read_line(to_parent_r, 0.1) or ""
    finally:
        os.close(to_parent_r)
        os.close(to_child_w)
    saw = "4b" in tail
    problems = []
    if saw:
        problems.append("a storage private in the child saw the parent's later writes (4b)")
    if hung:
        problems.append(f"the child hung {CHILD_TIMEOUT:.0f} s "
                        + ("in share_memory_ of the storage in flight (4a)" if line
                           else "before reporting"))
    elif os.WIFSIGNALED(status):
        problems.append(f"child killed by signal {os.WTERMSIG(status)}")
    elif os.WEXITSTATUS(status) not in (0, 10):
        problems.append(f"child exit code {os.WEXITSTATUS(status)}")
    if problems:
        return f"fork {f}: " + "; ".join(problems)
    return "ok" if line and line != "none\n" else "ok (no share in flight)"
