"""``python -m pyshm demo``: the seed workload, shared in place from a ThreadPool.

It builds uint8 arrays of 128x480x640 (39 MB each; as many as fit in about a quarter of the
memory available, 64 at most by default), shares them in place with one thread and then with a
ThreadPool, checks every byte after each round, and prints time, GB/s and the speed-up.
"""

from __future__ import annotations

import gc
import os
import time
from multiprocessing.pool import ThreadPool

import numpy as np

from . import arrays
from .storage import trim_pool

FRAME_SHAPE = (128, 480, 640)
FRAME_BYTES = int(np.prod(FRAME_SHAPE))


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (falls back to total physical memory)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_count(limit: int = 64) -> int:
    return max(1, min(limit, available_memory() // 4 // FRAME_BYTES))


def _pattern(index: int) -> np.ndarray:
    rng = np.random.default_rng(index)
    return rng.integers(0, 256, size=FRAME_SHAPE[1:], dtype=np.uint8)


def frame_corner(index: int) -> np.ndarray:
    """The counter written down one corner of frame ``index`` (one byte per plane)."""
    return ((np.arange(FRAME_SHAPE[0]) + index) % 256).astype(np.uint8)


def fill_frame(view: np.ndarray, pattern: np.ndarray, index: int) -> None:
    """Frame ``index``'s bytes: ``pattern`` (``_pattern(index)``) on every plane, a counter in
    one corner (the benchmark fills its frames the same way)."""
    view[:] = pattern
    view[:, 0, 0] = frame_corner(index)


def build(count: int) -> list:
    """The seed workload: ``count`` pyshm arrays, each with its own recognisable bytes."""
    frames = []
    for index in range(count):
        frame = arrays.empty(FRAME_SHAPE, np.uint8)
        fill_frame(frame, _pattern(index), index)
        frames.append(frame)
    return frames


def verify(frames: list) -> None:
    for index, frame in enumerate(frames):
        if not arrays.is_shared(frame):
            raise AssertionError(f"array {index} is not shared")
        expected = _pattern(index)
        if not np.array_equal(frame[:, 0, 0], frame_corner(index)):
            raise AssertionError(f"array {index}: wrong bytes after sharing")
        frame[:, 0, 0] = expected[0, 0]
        if not (frame == expected).all():
            raise AssertionError(f"array {index}: wrong bytes after sharing")


def share_all(frames: list, threads: int) -> float:
    start = time.perf_counter()
    with ThreadPool(threads) as pool:
        pool.map(arrays.share_memory_, frames, chunksize=1)
    return time.perf_counter() - start


def run(count: int | None = None, threads: int | None = None) -> int:
    count = count or default_count()
    threads = threads or os.cpu_count() or 1
    gbytes = count * FRAME_BYTES / 1e9
    print(f"pyshm demo: {count} uint8 arrays of {'x'.join(map(str, FRAME_SHAPE))} "
          f"({gbytes:.2f} GB), shared in place")
    results = {}
    for pool_size in dict.fromkeys([1, threads]):
        frames = build(count)
        pointers = [frame.ctypes.data for frame in frames]
        seconds = share_all(frames, pool_size)
        if [frame.ctypes.data for frame in frames] != pointers:
            raise AssertionError("a data pointer moved during sharing")
        verify(frames)
        results[pool_size] = seconds
        print(f"  ThreadPool({pool_size}): {seconds:.3f} s, {gbytes / seconds:.2f} GB/s, "
              f"every byte checked, addresses unchanged")
        del frames
        gc.collect()
        # Start every round from fresh memory: without this, the next round would refill the
        # memfds this round released (libshm's recycling) and the comparison would flatter it.
        trim_pool()
    if threads != 1:
        print(f"  speed-up of {threads} threads over 1: {results[1] / results[threads]:.2f}x")
    return 0
