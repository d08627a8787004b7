"""The GIL is released during sharing: threads make progress and share in parallel."""

import json
import os
import subprocess
import sys
import threading
import time
from multiprocessing.pool import ThreadPool

import numpy as np
import pytest
from shm_harness import userfaultfds

import pyshm


def test_other_thread_progresses_during_a_large_share():
    big = pyshm.empty(1 << 30, np.uint8)  # 1 GiB: the share copies for a good fraction of a second
    big[:: 4096] = 1  # touch every page so the copy has real work to do
    ticks = []
    started = threading.Event()
    done = threading.Event()

    def share():
        started.set()
        start = time.perf_counter()
        pyshm.share_memory_(big)
        ticks.append(("share", time.perf_counter() - start))
        done.set()

    def count():
        # Pure-Python work: only possible while the sharer does not hold the GIL.
        started.wait()
        n = 0
        while not done.is_set():
            n += 1
        ticks.append(("count", n))

    workers = [threading.Thread(target=share), threading.Thread(target=count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results = dict(ticks)
    assert pyshm.is_shared(big) and big[4096] == 1
    # The share took real time and the counter ran meanwhile (with the GIL held it would not
    # have run at all until the share returned).
    assert results["share"] > 0.02
    assert results["count"] > 10000, results


def test_eight_threads_sharing_one_array_copy_once():
    for _ in range(5):
        a = pyshm.empty(8 << 20, np.uint8)
        a[::1000] = 3
        address = a.ctypes.data
        barrier = threading.Barrier(8)

        def share(_):
            barrier.wait()
            pyshm.share_memory_(a)
            return pyshm.storage_of(a).fd

        with ThreadPool(8) as pool:
            fds = pool.map(share, range(8))
        assert len(set(fds)) == 1 and fds[0] is not None
        assert a.ctypes.data == address
        assert (a[::1000] == 3).all() and a[1] == 0


def test_seed_scenario_threadpool_many_arrays():
    frames = [pyshm.empty((16, 480, 640), np.uint8) for _ in range(16)]
    for i, frame in enumerate(frames):
        frame[:] = i
    with ThreadPool(4) as pool:
        result = pool.map(pyshm.share_memory_, frames)
    assert all(r is f for r, f in zip(result, frames))
    for i, frame in enumerate(frames):
        assert pyshm.is_shared(frame) and frame[7, 100, 100] == i and frame.min() == i


# ---- no write of another thread is lost to a share (DESIGN section 5) ------------------------


def _share_while(a, write):
    """Share a while `write(passes)` runs on another thread; returns the passes it made."""
    started, stop, passes = threading.Event(), threading.Event(), [0]

    def writer():
        started.set()
        while not stop.is_set() or passes[0] < 3:
            write()
            passes[0] += 1

    t = threading.Thread(target=writer)
    t.start()
    started.wait()
    time.sleep(0.001)  # the writer is inside its passes
    address = a.ctypes.data
    pyshm.share_memory_(a)
    stop.set()
    t.join(timeout=60)
    assert not t.is_alive()
    assert pyshm.is_shared(a) and a.ctypes.data == address
    return passes[0]


@pytest.mark.parametrize("nbytes", [4096, 512 << 10, 3 << 19, 64 << 20],
                         ids=["slab", "one-memfd", "chunks", "huge-chunks"])
def test_a_thread_writing_while_the_array_is_shared_loses_nothing(nbytes):
    for _ in range(3):
        a = pyshm.zeros(nbytes // 8, np.int64)
        passes = _share_while(a, lambda a=a: np.add(a, 1, out=a))  # (numpy drops the GIL)
        assert (a == passes).all()  # every pass's write to every element is there


def test_a_writer_holding_the_gil_while_it_waits_for_the_share_loses_nothing():
    a = pyshm.zeros((64 << 20) // 8, np.int64)
    picks = np.arange(0, a.size, 4096 // 8)  # one element per page, written from Python

    def write():
        for i in picks.tolist():
            a[i] += 1

    passes = _share_while(a, write)
    assert (a[picks] == passes).all()
    assert not a[1:4096 // 8].any()


_FENCE_CHILD = """
import json, os, subprocess, sys, threading
import numpy as np
import pyshm
sys.path.insert(0, {tests!r})
from shm_harness import userfaultfds
a = pyshm.zeros(1 << 20, np.int64)
t = threading.Thread(target=lambda: np.add(a, 1, out=a))
t.start()
pyshm.share_memory_(a)
t.join()
exec_child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.listdir('/proc/self/fd')))"],
                            close_fds=False, capture_output=True, text=True).stdout
print(json.dumps([userfaultfds(), pyshm.is_shared(a), int(a.min()), exec_child.count(",") + 1]))
"""


@pytest.mark.parametrize("fence", [None, "0"])
def test_one_close_on_exec_userfaultfd_per_process_none_with_LSHM_FENCE_0(fence):
    env = dict(os.environ)
    env.pop("LSHM_FENCE", None)
    if fence is not None:
        env["LSHM_FENCE"] = fence
    code = _FENCE_CHILD.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    fds, shared, low, exec_fds = json.loads(out.splitlines()[-1])
    assert shared
    if fence is None:
        assert list(fds.values()) == [True]  # one, close-on-exec
        assert low == 1  # the other thread's pass is all there
    else:
        assert fds == {}  # LSHM_FENCE=0: none opened (and that pass may have lost writes)
    assert exec_fds <= 4  # a program it runs inherits none (stdin/out/err and its listing)


def test_this_process_has_exactly_one_userfaultfd():
    assert list(userfaultfds().values()) == [True]


# One Storage used from two threads: calls in flight on one thread (copy_ and asarray read the
# storage's memory without the GIL) while the other resizes it. Run in a child: before the fix,
# a resize moved or unmapped the pages under the copy (a crash) or under the new array.
_RESIZE_CHILD = r"""
import sys, threading, time
import numpy as np
import pyshm

small, big = 4 << 20, 8 << 20
dst = pyshm.Storage(big, resizable=True)
src = pyshm.Storage(big)
src.asarray()[:] = 7
stop = threading.Event()
counts = {"copied": 0, "arrays": 0, "resized": 0, "busy": 0}

def copier():
    while not stop.is_set():
        try:
            dst.copy_(src)
            counts["copied"] += 1
        except BufferError:  # (being resized: the copy did not begin)
            continue
        except ValueError:  # (sizes differ: dst was resized to the other size)
            pass
        try:
            a = dst.asarray()
        except BufferError:
            continue
        # every page of the array must be mapped, and hold what was copied or zeros
        ok = int(a[::4096].max()) in (0, 7)
        del a
        counts["arrays"] += ok

def resizer():
    deadline = time.monotonic() + 60
    i = 0
    while (counts["resized"] < 50 or counts["copied"] < 50) and time.monotonic() < deadline:
        try:
            dst.resize_(small if i % 2 == 0 else big)
            counts["resized"] += 1
            i += 1
        except BufferError as exc:
            assert "resiz" in str(exc) or "in use" in str(exc), exc
            counts["busy"] += 1
        time.sleep(0.0002)
    stop.set()

errors = []

def run(step):
    try:
        step()
    except BaseException as exc:
        errors.append(repr(exc))
        stop.set()

threads = [threading.Thread(target=run, args=(step,)) for step in (copier, resizer)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
print(counts)
sys.stdout.flush()
"""


def test_resize_beside_calls_in_flight_on_another_thread_never_pulls_memory_from_under_them():
    # A Storage's one C reference serves every thread that uses the object, so libshm's rule
    # (resize only while the caller holds the storage's one reference) cannot see another
    # thread's copy_ or asarray of that same handle: pyshm itself makes resize_ wait for none
    # and refuse (BufferError) while such a call runs, and such calls refuse while it resizes.
    done = subprocess.run([sys.executable, "-c", _RESIZE_CHILD], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    counts = eval(done.stdout.strip().splitlines()[-1])
    assert counts["resized"] >= 50 and counts["copied"] >= 50 and counts["arrays"] > 0, counts
