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
