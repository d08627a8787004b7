"""The GIL is released during sharing: threads make progress and share in parallel."""

import threading
import time
from multiprocessing.pool import ThreadPool

import numpy as np

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
