"""Cross-process benchmark: send N small arrays to a Pool worker and back.

    python tools/bench_processes.py [--count 5000] [--method fork] [--repeats 3] [--json]

Entry points for ``python -m pyshm bench``: :func:`add_arguments` (argparse options),
:func:`run` (returns result rows) and :func:`main` (prints the table).

Methods, each on a ``Pool(1)`` of the same start method, each array sent as a task argument
and returned as its result (the worker increments one element, so every array is really used
on both sides):

* ``pyshm slab``: arrays from ``pyshm.empty(..., shared=True)`` (4 KiB: packed in 4 MiB
  slabs, one fd per slab, fetched once per receiver);
* ``pyshm in place``: ``pyshm.empty`` arrays shared in place (one memfd each, one fd fetch
  per array);
* ``torch``: ``torch.multiprocessing`` with tensors after ``share_memory_()``
  (``file_descriptor`` strategy), when torch is installed;
* ``SharedMemory``: one ``multiprocessing.shared_memory.SharedMemory`` per array; its name,
  shape and dtype are sent and the worker attaches by name.

Two shapes of traffic: ``batched`` (``pool.map`` with chunks of 256 arrays per message: the
per-array throughput) and ``one by one`` (``pool.apply`` per array: the latency of one
round trip). The table shows microseconds per array, the logical GB/s (array bytes delivered
per second; nothing is copied) and each row's time as a ratio of torch's.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing import shared_memory

import numpy as np

import pyshm

ARRAY_BYTES = 4096
CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=5000, help="arrays per batched run")
    parser.add_argument("--single", type=int, default=300, help="arrays sent one by one")
    parser.add_argument("--method", default="fork", choices=["fork", "spawn", "forkserver"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="machine-readable result on stdout")


# ---- worker side ----------------------------------------------------------------------------


def touch_array(array):
    array[0] += 1
    return array


_attached: dict = {}


def touch_shared_memory(handle):
    name, shape, dtype = handle
    shm = _attached.get(name)
    if shm is None:  # attach once per segment, as a user would
        shm = _attached[name] = shared_memory.SharedMemory(name)
    array = np.ndarray(shape, dtype, buffer=shm.buf)
    array[0] += 1
    del array
    return handle


# ---- makers: each returns (items to send, check, cleanup) -----------------------------------


def make_pyshm_slab(count):
    arrays = [pyshm.empty(ARRAY_BYTES // 8, np.int64, shared=True) for _ in range(count)]
    return arrays, lambda: all(a[0] >= 1 for a in arrays), lambda: None


def make_pyshm_inplace(count):
    arrays = [pyshm.share_memory_(pyshm.empty(ARRAY_BYTES // 8, np.int64)) for _ in range(count)]
    return arrays, lambda: all(a[0] >= 1 for a in arrays), lambda: None


def make_torch(count):
    import torch

    tensors = [torch.zeros(ARRAY_BYTES // 8, dtype=torch.int64) for _ in range(count)]
    for t in tensors:
        t.share_memory_()
    return tensors, lambda: all(int(t[0]) >= 1 for t in tensors), lambda: None


def make_shared_memory(count):
    blocks = [shared_memory.SharedMemory(create=True, size=ARRAY_BYTES) for _ in range(count)]
    handles = [(b.name, (ARRAY_BYTES // 8,), "int64") for b in blocks]

    def check():
        return all(np.ndarray((ARRAY_BYTES // 8,), np.int64, buffer=b.buf)[0] >= 1 for b in blocks)

    def cleanup():
        for b in blocks:
            b.close()
            b.unlink()

    return handles, check, cleanup


def methods():
    rows = [
        ("pyshm slab", make_pyshm_slab, touch_array, mp),
        ("pyshm in place", make_pyshm_inplace, touch_array, mp),
    ]
    try:
        import torch.multiprocessing as tmp

        rows.append(("torch", make_torch, touch_array, tmp))
    except ImportError:
        pass
    rows.append(("SharedMemory", make_shared_memory, touch_shared_memory, mp))
    return rows


# ---- measuring -------------------------------------------------------------------------------


def run(count: int = 5000, single: int = 300, method: str = "fork", repeats: int = 3) -> list:
    """Time every method; a list of dicts (method, traffic, us_per_array, gb_per_s)."""
    results = []
    for name, make, work, module in methods():
        ctx = module.get_context(method)
        with ctx.Pool(1) as pool:
            pool.apply(int, (0,))  # worker started
            for traffic, n in (("batched", count), ("one by one", single)):
                times = []
                for _ in range(repeats):
                    items, check, cleanup = make(n)
                    start = time.perf_counter()
                    if traffic == "batched":
                        back = pool.map(work, items, chunksize=CHUNK)
                    else:
                        back = [pool.apply(work, (item,)) for item in items]
                    times.append(time.perf_counter() - start)
                    assert len(back) == n and check(), f"{name}: the worker's writes are missing"
                    del back, items
                    cleanup()
                    gc.collect()
                best = min(times)
                results.append(
                    {
                        "method": name,
                        "traffic": traffic,
                        "arrays": n,
                        "us_per_array": best / n * 1e6,
                        "median_us_per_array": statistics.median(times) / n * 1e6,
                        "gb_per_s": n * ARRAY_BYTES / best / 1e9,
                    }
                )
    return results


def table(results: list) -> str:
    torch = {r["traffic"]: r["us_per_array"] for r in results if r["method"] == "torch"}
    lines = [
        f"{'method':<16}{'traffic':<12}{'us/array (best)':>16}{'median':>9}{'GB/s':>8}"
        f"{'x torch':>9}",
    ]
    for r in results:
        ratio = r["us_per_array"] / torch[r["traffic"]] if r["traffic"] in torch else float("nan")
        lines.append(
            f"{r['method']:<16}{r['traffic']:<12}{r['us_per_array']:>16.1f}"
            f"{r['median_us_per_array']:>9.1f}{r['gb_per_s']:>8.3f}{ratio:>9.3f}"
        )
    lines.append("target: pyshm slab at most 0.1x torch per array (4 KiB arrays)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    results = run(args.count, args.single, args.method, args.repeats)
    text = table(results)
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(results))
    else:
        print(f"{ARRAY_BYTES}-byte arrays, Pool(1), start method {args.method}")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
