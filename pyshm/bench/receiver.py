"""The ``receiver`` case of ``python -m pyshm bench``: a spawned worker's first read of a big
shared array.

For each method the parent makes one array of ``nbytes`` (1 GiB by default), fills it, shares
it and sends it to a ``Pool(1)`` worker started with ``spawn`` (started once per method,
before the rounds); the worker times reading one byte per 4 KiB page of it, the first touch
of every page in that process, then writes one byte that the parent checks (so it is really
the same memory) and drops the array. Only that read is timed: unpickling and attaching are
not. Methods, interleaved round by round:

* ``pyshm``: ``pyshm.empty`` + ``pyshm.share_memory_`` (in place; huge pages unless
  ``LSHM_HUGE=0``), sent as a task argument;
* ``torch``: ``torch.empty`` + ``share_memory_()`` through ``torch.multiprocessing``
  (``file_descriptor`` strategy), when torch imports;
* ``SharedMemory``: ``SharedMemory(create=True)``, its name sent; the worker attaches by name.

What the kernel does on such a first read: with small pages one fault per 16 pages
(fault-around) and one page-table entry per page; with huge pages one fault and one entry per
2 MiB.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

import pyshm
from pyshm.bench.measure import (
    cpu_snapshot,
    measure_rounds,
    other_load,
    row_stats,
    stop_pools,
    torch_multiprocessing,
)

__all__ = ["DEFAULT_BYTES", "QUICK_BYTES", "run_case"]

DEFAULT_BYTES = 1 << 30
QUICK_BYTES = 256 << 20
PAGE = 4096
MARK = 77  # the worker writes it at the last byte; the parent checks it came through


def _first_read(array) -> tuple:
    """In the worker: (seconds to read one byte per page, how many pages had a 1)."""
    flat = array.reshape(-1)
    start = time.perf_counter()
    ones = int(np.count_nonzero(flat[::PAGE]))
    seconds = time.perf_counter() - start
    flat[-1] = MARK
    return seconds, ones


def read_array(array) -> tuple:
    return _first_read(array)


def read_tensor(tensor) -> tuple:
    return _first_read(tensor.numpy())


def read_shared_memory(handle) -> tuple:
    name, nbytes = handle
    segment = shared_memory.SharedMemory(name)  # (as the processes case: one tracker for all)
    try:
        view = np.ndarray((nbytes,), np.uint8, buffer=segment.buf)
        result = _first_read(view)
        del view
    finally:
        segment.close()
    return result


def _ones(view) -> None:
    view[::PAGE] = 1  # the first byte of each page; the rest stays as it was filled


def make_pyshm(nbytes):
    array = pyshm.empty(nbytes, np.uint8)
    array[:] = 0
    _ones(array)
    pyshm.share_memory_(array)
    return array, lambda: int(array[-1]) == MARK, lambda: None


def make_torch(nbytes):
    import torch

    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    _ones(tensor.numpy())
    tensor.share_memory_()
    return tensor, lambda: int(tensor[-1]) == MARK, lambda: None


def make_shared_memory(nbytes):
    segment = shared_memory.SharedMemory(create=True, size=nbytes)
    view = np.ndarray((nbytes,), np.uint8, buffer=segment.buf)
    view[:] = 0
    _ones(view)
    del view

    def check():
        return int(segment.buf[nbytes - 1]) == MARK

    def cleanup():
        segment.close()
        segment.unlink()

    return (segment.name, nbytes), check, cleanup


class _Method:
    def __init__(self, key, label, make, read, module) -> None:
        self.key, self.label, self.make, self.read, self.module = key, label, make, read, module
        self.pool = None


def _methods(use_torch: bool) -> tuple:
    methods = [_Method("pyshm", "pyshm", make_pyshm, read_array, mp)]
    tmp, note = torch_multiprocessing(use_torch)
    if tmp is not None:
        methods.append(_Method("torch", "torch", make_torch, read_tensor, tmp))
    methods.append(_Method("shm", "SharedMemory", make_shared_memory, read_shared_memory, mp))
    return methods, note


def _run_once(method: _Method, nbytes: int) -> tuple:
    """(seconds of the worker's read, None: the parent's CPU view says nothing of it)."""
    item, check, cleanup = method.make(nbytes)
    gc.collect()
    try:
        before = cpu_snapshot()
        seconds, ones = method.pool.apply(method.read, (item,))
        others = other_load(before, cpu_snapshot())
        if ones != nbytes // PAGE or not check():
            raise AssertionError(f"{method.label}: the worker did not read or write the "
                                 "parent's memory")
    finally:
        del item
        cleanup()
        gc.collect()
    return seconds, others


def run_case(nbytes: int, repeats: int, use_torch: bool = True, progress=None) -> dict:
    """Time every method's first read in a spawned worker, interleaved; rows as in
    :mod:`pyshm.bench` (seconds are the worker's read; ratios to torch and SharedMemory)."""
    methods, torch_note = _methods(use_torch)
    resource_tracker.ensure_running()
    runs = {method.key: [] for method in methods}
    errors: dict = {}
    try:
        for method in methods:
            method.pool = method.module.get_context("spawn").Pool(1)
            method.pool.apply(int, (0,))  # worker started, imports done
            try:
                _run_once(method, 4 << 20)  # warm: the receiving side's first calls
            except Exception as exc:
                errors[method.key] = f"{type(exc).__name__}: {exc}"
        def plan(round_index):
            shift = round_index % len(methods)
            for method in methods[shift:] + methods[:shift]:
                yield (method.key, method.label, lambda: _run_once(method, nbytes),
                       lambda seconds: f"{seconds * 1e3:.1f} ms")

        measure_rounds(runs, errors, repeats, plan, progress, "receiver")
    finally:
        stop_pools(methods)
    rows = []
    for method in methods:
        seconds = [s for s, _ in runs[method.key]]
        loads = [load for _, load in runs[method.key]]
        rows.append({
            "method": method.key,
            "label": f"{method.label} reads",
            "threads": 1,
            "count": 1,
            "bytes": nbytes,
            **row_stats(seconds, loads, 1, nbytes, per_share=False),
            "error": errors.get(method.key),
            "note": None,
            "ratios": {},
        })
    for row in rows:
        for base in ("torch", "shm"):
            other = next((o for o in rows if o["method"] == base and o["seconds"]), None)
            if other is not None and row["seconds"]:
                row["ratios"][base] = {stat: row[f"{stat}_s"] / other[f"{stat}_s"]
                                       for stat in ("min", "median")}
    size = f"{nbytes >> 30} GiB" if nbytes % (1 << 30) == 0 else f"{nbytes >> 20} MiB"
    return {
        "case": "receiver",
        "title": f"A spawned worker's first read of one byte per page of a {size} shared "
                 "array (seconds of that read)",
        "shape": [nbytes],
        "count": 1,
        "bytes": nbytes,
        "per_share": False,
        "torch_note": torch_note,
        "rows": rows,
    }
