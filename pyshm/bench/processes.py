"""Cross-process benchmark: send 4 KiB arrays to a Pool worker and back.

    python -m pyshm.bench.processes [--count 2000] [--single 200] [--method fork]
                                    [--repeats 5] [--quick] [--no-torch] [--json]

``python -m pyshm bench`` runs it as its ``processes`` case (through :func:`run_case`).

Methods, each on a ``Pool(1)`` of the same start method, each array sent as a task argument
and returned as its result (the worker increments one element, so every array is really used
on both sides; the sender checks every write came back):

* ``pyshm slab``: arrays from ``pyshm.empty(..., shared=True)`` (4 KiB: in libshm's 4 MiB
  slabs, one memfd per slab);
* ``pyshm in place``: ``pyshm.empty`` arrays shared in place with ``pyshm.share_memory_``
  (the same slabs: each share goes into its slab's memfd; a receiver fetches the fds of a
  whole message in one round trip);
* ``torch``: ``torch.multiprocessing`` with tensors after ``share_memory_()``
  (``file_descriptor`` strategy: one fd per tensor through the resource sharer), when torch is
  installed;
* ``SharedMemory``: one ``multiprocessing.shared_memory.SharedMemory`` per array; its name,
  shape and dtype are sent and the worker attaches by name (once per block).

Three shapes of traffic: ``batched`` (``pool.map`` with chunks of 256 arrays per message: the
per-array throughput), ``one by one`` (``pool.apply`` per array: the latency of one round
trip) and ``busy`` (one by one, a fifth as many, while another thread of the parent runs
Python all along, as a program that goes on working while its pool does: every thread that
lets the GIL go for a call, the parent's fd servers among them, then waits a switch interval
to take it back). Methods are interleaved round by round (order rotated each round); every
method builds its arrays untimed right before its run. Reported: microseconds per array (min
and median over rounds), the logical GB/s (array bytes delivered per second; nothing is
copied), each row's time as a ratio of torch's and of SharedMemory's for the same traffic,
and the bar: sending shared 4 KiB arrays, batched, costs at most 0.05x torch's time per
array, slab and in place alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import numpy as np

import pyshm
from pyshm.bench.measure import (
    cpu_snapshot,
    measure_rounds,
    other_load,
    quiet_text,
    row_stats,
    stop_pools,
    target_notes,
    target_text,
    torch_multiprocessing,
)

__all__ = ["add_arguments", "run_case", "targets", "format_case", "main"]

ARRAY_BYTES = 4096
CHUNK = 256
TRAFFIC = ("batched", "one by one", "busy")
_SHORT = {"batched": "batch", "one by one": "1 by 1", "busy": "busy"}  # (fit the tables)
BUSY_SHARE = 5  # the busy traffic sends a fifth as many arrays as one by one
DEFAULTS = {"count": 2000, "single": 200, "repeats": 5}
QUICK = {"count": 768, "single": 60, "repeats": 3}
TARGET_VS_TORCH = 0.05  # pyshm time per array / torch's, batched (slab and in place alike)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=None,
                        help=f"arrays per batched run (default {DEFAULTS['count']})")
    parser.add_argument("--single", type=int, default=None,
                        help=f"arrays sent one by one (default {DEFAULTS['single']})")
    parser.add_argument("--method", default="fork", choices=["fork", "spawn", "forkserver"],
                        help="start method of the worker pools")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"rounds (default {DEFAULTS['repeats']})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['count']} batched, {QUICK['single']} one by one, "
                             f"{QUICK['repeats']} rounds")
    parser.add_argument("--no-torch", action="store_true", help="do not try to import torch")
    parser.add_argument("--json", action="store_true", help="machine-readable result on stdout")


# ---- worker side ----------------------------------------------------------------------------


def touch_array(array):
    array[0] += 1
    return array


_attached: dict = {}


def touch_shared_memory(handle):
    name, shape, dtype = handle
    shm = _attached.get(name)
    if shm is None:  # attach once per block, as a user would
        shm = _attached[name] = shared_memory.SharedMemory(name)
    array = np.ndarray(shape, dtype, buffer=shm.buf)
    array[0] += 1
    del array
    return handle


def forget_shared_memory():
    for shm in _attached.values():
        shm.close()
    _attached.clear()


# ---- makers: each returns (items to send, check, cleanup) -----------------------------------


def make_pyshm_slab(count):
    arrays = [pyshm.empty(ARRAY_BYTES // 8, np.int64, shared=True) for _ in range(count)]
    return arrays, lambda: all(a[0] == 1 for a in arrays), lambda: None


def make_pyshm_inplace(count):
    arrays = [pyshm.share_memory_(pyshm.empty(ARRAY_BYTES // 8, np.int64)) for _ in range(count)]
    for a in arrays:
        a[0] = 0
    return arrays, lambda: all(a[0] == 1 for a in arrays), lambda: None


def make_torch(count):
    import torch

    tensors = [torch.zeros(ARRAY_BYTES // 8, dtype=torch.int64) for _ in range(count)]
    for t in tensors:
        t.share_memory_()
    return tensors, lambda: all(int(t[0]) == 1 for t in tensors), lambda: None


def make_shared_memory(count):
    blocks = [shared_memory.SharedMemory(create=True, size=ARRAY_BYTES) for _ in range(count)]
    handles = [(b.name, (ARRAY_BYTES // 8,), "int64") for b in blocks]

    def check():
        return all(np.ndarray((ARRAY_BYTES // 8,), np.int64, buffer=b.buf)[0] == 1 for b in blocks)

    def cleanup():
        for b in blocks:
            b.close()
            b.unlink()

    return handles, check, cleanup


class _Method:
    def __init__(self, key, label, make, work, module, after=None) -> None:
        self.key, self.label, self.make, self.work, self.module = key, label, make, work, module
        self.after = after  # run in the worker after each run (untimed)
        self.pool = None


def _methods(use_torch: bool) -> tuple:
    """(methods, torch description)."""
    methods = [
        _Method("pyshm", "pyshm slab", make_pyshm_slab, touch_array, mp),
        _Method("pyshm", "pyshm in place", make_pyshm_inplace, touch_array, mp),
    ]
    tmp, note = torch_multiprocessing(use_torch)
    if tmp is not None:
        methods.append(_Method("torch", "torch", make_torch, touch_array, tmp))
    methods.append(_Method("shm", "SharedMemory", make_shared_memory, touch_shared_memory, mp,
                           after=forget_shared_memory))
    return methods, note


# ---- measuring -------------------------------------------------------------------------------


def _busy(stop: threading.Event) -> None:
    """Python without pause until `stop` (a thread of the parent, for the busy traffic)."""
    while not stop.is_set():
        sum(range(1000))


def _run_once(method: _Method, traffic: str, n: int) -> tuple:
    """(seconds, CPUs other processes kept busy meanwhile or None); checks every write."""
    pool = method.pool
    items, check, cleanup = method.make(n)
    gc.collect()
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    try:
        if traffic == "busy":
            busy.start()
        before = cpu_snapshot()
        start = time.perf_counter()
        if traffic == "batched":
            back = pool.map(method.work, items, chunksize=CHUNK)
        else:
            back = [pool.apply(method.work, (item,)) for item in items]
        seconds = time.perf_counter() - start
        stop.set()
        others = other_load(before, cpu_snapshot())
        if len(back) != n or not check():
            raise AssertionError(f"{method.label}: the worker's writes are missing")
        del back
    finally:
        stop.set()
        if busy.is_alive():
            busy.join()
        del items
        cleanup()
        if method.after is not None:
            pool.apply(method.after)
        gc.collect()
    return seconds, others


def run_case(count: int, single: int, start_method: str = "fork", repeats: int = 3,
             use_torch: bool = True, progress=None) -> dict:
    """Time every method, interleaved; the ``processes`` case of ``python -m pyshm bench``.

    Rows use the keys of :mod:`pyshm.bench` results (method, label, threads, count, seconds,
    min_s, median_s, gbps, min_us_per_share, ratios to torch and shm...) plus ``traffic``.
    """
    methods, torch_note = _methods(use_torch)
    resource_tracker.ensure_running()  # one tracker, shared by the workers (no stray warnings)
    counts = {"batched": count, "one by one": single, "busy": max(1, single // BUSY_SHARE)}
    runs = {(m.label, t): [] for m in methods for t in TRAFFIC}
    errors: dict = {}
    try:
        for method in methods:
            method.pool = method.module.get_context(start_method).Pool(1)
            method.pool.apply(int, (0,))  # worker started
            _run_once(method, "batched", 8)  # warm: imports, first fetches, trackers
        def plan(round_index):
            shift = round_index % len(methods)  # (which method goes first rotates)
            for traffic in TRAFFIC:
                for method in methods[shift:] + methods[:shift]:
                    yield ((method.label, traffic), f"{method.label}, {_SHORT[traffic]}",
                           lambda method=method, traffic=traffic: _run_once(
                               method, traffic, counts[traffic]),
                           lambda seconds, traffic=traffic:
                               f"{seconds / counts[traffic] * 1e6:.0f} us")

        measure_rounds(runs, errors, repeats, plan, progress, "processes")
    finally:
        stop_pools(methods)
    rows = []
    for traffic in TRAFFIC:
        for method in methods:
            measured = runs[method.label, traffic]
            n = counts[traffic]
            seconds = [s for s, _ in measured]
            loads = [load for _, load in measured]
            rows.append({
                "method": method.key,
                "label": f"{method.label}, {_SHORT[traffic]}",
                "traffic": traffic,
                "threads": 1,
                "count": n,
                "bytes": n * ARRAY_BYTES,
                **row_stats(seconds, loads, n, n * ARRAY_BYTES, per_share=True),
                "error": errors.get((method.label, traffic)),
                "note": None,
                "ratios": {},
            })
    for row in rows:
        for base in ("torch", "shm"):
            other = next((o for o in rows if o["method"] == base
                          and o["traffic"] == row["traffic"] and o["seconds"]), None)
            if other is not None and row["seconds"]:
                row["ratios"][base] = {stat: row[f"{stat}_s"] / other[f"{stat}_s"]
                                       for stat in ("min", "median")}
    return {
        "case": "processes",
        "title": f"{count:,} arrays of 4 KiB to a Pool(1) worker ({start_method}) and back in "
                 f"chunks of {CHUNK} (batched), {single:,} one by one with pool.apply, "
                 f"{counts['busy']:,} one by one beside a thread of the parent running Python "
                 "(busy; us per array)",
        "shape": [ARRAY_BYTES],
        "count": count,
        "bytes": count * ARRAY_BYTES,
        "per_share": True,
        "start_method": start_method,
        "torch_note": torch_note,
        "rows": rows,
    }


def targets(case: dict, quick: bool = False) -> list:
    """The 0.1x-torch bar for both kinds of pyshm arrays, in :mod:`pyshm.bench`'s format."""
    out = []
    for label in ("pyshm slab", "pyshm in place"):
        target = {"name": f"sending shared 4 KiB arrays to a worker, batched, {label} time / "
                          "torch time", "bar": f"<= {TARGET_VS_TORCH:.2f}", "value": None,
                  "median_value": None, "met": None, "text": "", "note": ""}
        out.append(target)
        row = next((r for r in case["rows"]
                    if r["label"] == f"{label}, {_SHORT['batched']}"), None)
        if row is None or not row["seconds"]:
            target["text"] = "not measured (pyshm failed)"
            continue
        ratio = row["ratios"].get("torch")
        if ratio is None:
            target["text"] = f"not measured: torch {case['torch_note']}"
            continue
        value, median = ratio["min"], ratio["median"]
        target.update(value=value, median_value=median, met=value <= TARGET_VS_TORCH,
                      text=f"{value:.3f}")
        torch_row = next(r for r in case["rows"]
                         if r["method"] == "torch" and r["traffic"] == "batched")
        target["note"] = target_notes(f"{median:.3f}", target["met"],
                                      median <= TARGET_VS_TORCH, (row, torch_row),
                                      ["quick run"] if quick else [])
    return out


def format_case(case: dict, case_targets: list) -> str:
    def ratio(row, base):
        r = row["ratios"].get(base)
        return "-" if r is None else f"{r['min']:.3f} ({r['median']:.3f})"

    head = (f"{'method':<26}{'min us':>9}{'median us':>11}{'GB/s':>8}{'quiet':>7}"
            f"{'vs torch':>16}{'vs SharedMem':>16}")
    lines = [case["title"], f"torch: {case['torch_note']}", head, "-" * len(head)]
    for row in case["rows"]:
        text = f"{row['label']:<26}"
        if not row["seconds"]:
            lines.append(f"{text}  {row['error'] or 'no result'}")
            continue
        text += (f"{row['min_us_per_share']:>9.1f}{row['median_us_per_share']:>11.1f}"
                 f"{row['gbps']:>8.3f}{quiet_text(row):>7}{ratio(row, 'torch'):>16}"
                 f"{ratio(row, 'shm'):>16}")
        if row["error"]:
            text += f"  then failed: {row['error']}"
        lines.append(text)
    lines.append("ratio = this row's time / the baseline's for the same traffic, min (median)")
    lines += ["target: " + target_text(target) for target in case_targets]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyshm.bench.processes",
                                     description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else DEFAULTS
    case = run_case(args.count or sizes["count"], args.single or sizes["single"], args.method,
                    args.repeats or sizes["repeats"], use_torch=not args.no_torch,
                    progress=lambda message: print(message, file=sys.stderr, flush=True))
    case_targets = targets(case, args.quick)
    print(format_case(case, case_targets), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"case": case, "targets": case_targets}, indent=2))
    failed = any(row["method"] == "pyshm" and row["error"] for row in case["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
