#!/usr/bin/env python3
"""Benchmark the libshm arena planner (lshm_plan) on tensor-lifetime traces.

For every trace CSV (`id,lower,upper,size`, half-open [lower, upper)) under a folder it prints
n, the lower bound (LB), our arena and ratio to LB, the same for three anchor planners
re-implemented here in numpy (so they run on the same input):

  tflite   size desc + best fit (TFLite arena_planner, XNNPACK, nativert, XLA spatial)
  online   execution order + best fit (ONNX Runtime mem_pattern_planner, ggml, IREE-like)
  lifo     PyTorch static runtime: LIFO reuse of storage groups, size-blind; arena = sum of groups

and our planning time (min over repeats). It says so when our arena is worse than an anchor.

    python3 tools/bench_planner.py                      # ../shared/traces, heuristics only
    python3 tools/bench_planner.py --time-limit 10      # with local search + exact tail
    python3 tools/bench_planner.py ../shared/traces/minimalloc --time-limit 10 --capacity 1048576
    python3 tools/bench_planner.py --scaling            # 1k / 10k / 100k random tensors, nested
    python3 tools/bench_planner.py --json out.json

Library: $PYSHM_LIBRARY, else pyshm._ffi.lib if importable, else ./build*/liblshm.so.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PlanOptions(ctypes.Structure):
    _fields_ = [("alignment", ctypes.c_uint64), ("flags", ctypes.c_uint),
                ("time_limit", ctypes.c_double), ("capacity", ctypes.c_uint64)]


class PlanResult(ctypes.Structure):
    _fields_ = [("arena_size", ctypes.c_uint64), ("lower_bound", ctypes.c_uint64),
                ("optimal", ctypes.c_int), ("strategy", ctypes.c_char * 48),
                ("seconds", ctypes.c_double)]


def load_library():
    path = os.environ.get("PYSHM_LIBRARY")
    if path:
        lib = ctypes.CDLL(path)
    else:
        lib = None
        try:
            import pyshm._ffi as ffi  # type: ignore
            lib = getattr(ffi, "lib", None)
            lib = getattr(lib, "_lib", lib) if not hasattr(lib, "lshm_plan") else lib
        except Exception:
            lib = None
        if lib is None or not hasattr(lib, "lshm_plan"):
            cands = sorted(glob.glob(os.path.join(REPO, "build*", "liblshm.so")))
            cands = [os.path.join(REPO, "build", "liblshm.so")] + cands
            cands = [c for c in cands if os.path.exists(c)]
            if not cands:
                sys.exit("liblshm.so not found: build it (meson setup build && ninja -C build) "
                         "or set PYSHM_LIBRARY")
            lib = ctypes.CDLL(cands[0])
    u64p = ctypes.POINTER(ctypes.c_uint64)
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.lshm_plan.argtypes = [ctypes.c_size_t, u64p, i64p, i64p, i64p,
                              ctypes.POINTER(PlanOptions), u64p, ctypes.POINTER(PlanResult)]
    lib.lshm_plan.restype = ctypes.c_int
    lib.lshm_plan_validate.argtypes = [ctypes.c_size_t, u64p, i64p, i64p, u64p,
                                       ctypes.POINTER(PlanOptions), ctypes.c_uint64]
    lib.lshm_plan_validate.restype = ctypes.c_int
    return lib


def ptr(a, t):
    return a.ctypes.data_as(ctypes.POINTER(t))


def run_ours(lib, size, lo, up, time_limit, repeats, capacity=0):
    n = len(size)
    off = np.zeros(n, dtype=np.uint64)
    opts = PlanOptions(1, 0, time_limit, capacity)
    res = PlanResult()
    best_t = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        rc = lib.lshm_plan(n, ptr(size, ctypes.c_uint64), ptr(lo, ctypes.c_int64),
                           ptr(up, ctypes.c_int64), None, ctypes.byref(opts),
                           ptr(off, ctypes.c_uint64), ctypes.byref(res))
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"lshm_plan failed: {rc}")
        best_t = min(best_t, dt)
        if time_limit > 0 or dt > 0.5:
            break
    ok = lib.lshm_plan_validate(n, ptr(size, ctypes.c_uint64), ptr(lo, ctypes.c_int64),
                                ptr(up, ctypes.c_int64), ptr(off, ctypes.c_uint64),
                                ctypes.byref(opts), res.arena_size) == 0
    return res, best_t, ok


# ---- anchors (independent numpy re-implementations) ------------------------------------------

def lower_bound(size, lo, up):
    t = np.concatenate([lo, up])
    d = np.concatenate([size.astype(np.int64), -size.astype(np.int64)])
    o = np.lexsort((d, t))  # at equal time, frees (negative) first: half-open
    return int(np.cumsum(d[o]).max()) if len(t) else 0


def best_fit_in_order(order, size, lo, up):
    """Place tensors in `order`, each at the smallest gap (incl. offset 0) among the placed
    tensors overlapping in time, else on top. O(n^2) vectorised."""
    n = len(order)
    ps = np.empty(n, np.int64); pe = np.empty(n, np.int64)
    po = np.empty(n, np.int64); ph = np.empty(n, np.int64)
    arena = 0
    for k, i in enumerate(order):
        a, b, s = lo[i], up[i], int(size[i])
        m = (ps[:k] < b) & (pe[:k] > a)
        offs, his = po[:k][m], ph[:k][m]
        best = None
        if len(offs):
            srt = np.argsort(offs, kind="stable")
            offs, his = offs[srt], his[srt]
            tops = np.maximum.accumulate(his)
            prev = np.concatenate([[0], tops[:-1]])
            gaps = offs - prev
            fit = np.nonzero(gaps >= s)[0]
            if len(fit):
                j = fit[np.argmin(gaps[fit])]
                best = int(prev[j])
            else:
                best = int(tops[-1])
        else:
            best = 0
        ps[k], pe[k], po[k], ph[k] = a, b, best, best + s
        arena = max(arena, best + s)
    return arena


def anchor_tflite(size, lo, up):
    order = np.lexsort((np.arange(len(size)), lo, -size.astype(np.int64)))
    return best_fit_in_order(order, size, lo, up)


def anchor_online(size, lo, up):
    order = np.lexsort((np.arange(len(size)), lo))
    return best_fit_in_order(order, size, lo, up)


def anchor_lifo(size, lo, up):
    """PyTorch static runtime DisjointStorageGroups: in execution order, reuse the most
    recently freed group (LIFO), whatever its size; a group is as large as its largest tensor."""
    order = np.lexsort((np.arange(len(size)), lo))
    groups = []
    free = []
    releases = []  # heap of (end, group)
    import heapq
    for i in order:
        while releases and releases[0][0] <= lo[i]:
            _, g = heapq.heappop(releases)
            free.append(g)
        if free:
            g = free.pop()
            groups[g] = max(groups[g], int(size[i]))
        else:
            g = len(groups)
            groups.append(int(size[i]))
        heapq.heappush(releases, (int(up[i]), g))
    return sum(groups)


ANCHORS = [("tflite", anchor_tflite), ("online", anchor_online), ("lifo", anchor_lifo)]


def read_trace(path):
    d = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2, usecols=(0, 1, 2, 3),
                   converters={0: lambda s: 0})  # ids may be names ("b1")
    if d.size == 0:
        return None
    lo = np.ascontiguousarray(d[:, 1]); up = np.ascontiguousarray(d[:, 2])
    size = np.ascontiguousarray(d[:, 3]).astype(np.uint64)
    return size, lo, up


def bench_traces(lib, folder, time_limit, max_anchor_n, as_json, capacity=0):
    files = sorted(glob.glob(os.path.join(folder, "**", "*.csv"), recursive=True))
    rows = []
    hdr = (f"{'trace':28} {'n':>6} {'LB':>14} {'ours':>8} {'ms':>9}  "
           + " ".join(f"{a:>8}" for a, _ in ANCHORS) + "  strategy")
    print(hdr)
    worse = []
    for f in files:
        tr = read_trace(f)
        name = os.path.relpath(f, folder)
        if tr is None:
            print(f"{name:28} {'empty':>6}")
            continue
        size, lo, up = tr
        n = len(size)
        res, dt, ok = run_ours(lib, size, lo, up, time_limit, 5, capacity)
        lb = res.lower_bound
        assert lb == lower_bound(size, lo, up), (name, lb, lower_bound(size, lo, up))
        row = {"trace": name, "n": n, "lb": lb, "ours": res.arena_size,
               "ratio": res.arena_size / lb, "seconds": dt, "valid": ok,
               "optimal": bool(res.optimal), "strategy": res.strategy.decode()}
        cells = []
        for an, fn in ANCHORS:
            if n > max_anchor_n and an != "lifo":
                row[an] = None
                cells.append(f"{'-':>8}")
                continue
            v = fn(size, lo, up)
            row[an] = v
            cells.append(f"{v / lb:8.4f}")
            if res.arena_size > v:
                worse.append((name, an, res.arena_size, v))
        rows.append(row)
        print(f"{name:28} {n:6d} {lb:14d} {row['ratio']:8.4f} {dt * 1e3:9.2f}  "
              + " ".join(cells) + f"  {row['strategy']}{'' if ok else '  INVALID'}"
              + ("  (opt)" if row["optimal"] else ""), flush=True)
    print()
    real = [r for r in rows if not r["trace"].startswith(("minimalloc", "small"))]
    if rows:
        print(f"summary: {len(rows)} traces, all valid: {all(r['valid'] for r in rows)}, "
              f"max ratio {max(r['ratio'] for r in rows):.4f}, "
              f"real-network max ratio {max((r['ratio'] for r in real), default=0):.4f}, "
              f"at LB: {sum(r['ours'] == r['lb'] for r in rows)}")
    for an, _ in ANCHORS:
        vals = [r for r in rows if r.get(an)]
        better = sum(r["ours"] < r[an] for r in vals)
        same = sum(r["ours"] == r[an] for r in vals)
        print(f"  vs {an:7}: better on {better}, equal on {same}, worse on "
              f"{len(vals) - better - same} of {len(vals)}")
    for name, an, ours, v in worse:
        print(f"  WORSE: {name}: ours {ours} > {an} {v}")
    if as_json:
        with open(as_json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


def random_trace(n, rng):
    """DNN-like: tensors produced at step t, short lifetimes (a few consumers), a few long ones."""
    lo = np.sort(rng.integers(0, n, n)).astype(np.int64)
    life = rng.geometric(0.15, n).astype(np.int64)
    longl = rng.random(n) < 0.02
    life[longl] = rng.integers(1, 256, int(longl.sum()))  # bounded: live set independent of n
    up = lo + life
    size = (rng.integers(1, 1 << 12, n) * 64).astype(np.uint64)
    return size, lo, up


def scaling(lib):
    rng = np.random.default_rng(1)
    print(f"{'n':>7} {'ms (min of runs)':>17} {'arena/LB':>9}  strategy    bar")
    bars = {1000: 2, 10000: 30, 100000: 500}
    for n in (1000, 10000, 100000):
        size, lo, up = random_trace(n, rng)
        res, dt, ok = run_ours(lib, size, lo, up, 0.0, 5 if n < 100000 else 3)
        print(f"{n:7d} {dt * 1e3:17.2f} {res.arena_size / res.lower_bound:9.4f}  "
              f"{res.strategy.decode():10}  <= {bars[n]} ms {'ok' if dt * 1e3 <= bars[n] else 'MISSED'}"
              f"{'' if ok else ' INVALID'}")
    # nested lifetimes (freed in the reverse order of their making: every tensor alive at the
    # midpoint, each overlapping all others) with sizes that are no multiple of the alignment:
    # the worst case of the placement engine, where each query meets every placed tensor
    print(f"{'nested':>7} {'ms (one run)':>17} {'arena/LB':>9}  strategy")
    for n in (5000, 10000, 20000):
        size = rng.integers(1, 100_000, n).astype(np.uint64)
        lo = np.arange(n, dtype=np.int64)
        up = 2 * n - lo
        res, dt, ok = run_ours(lib, size, lo, up, 0.0, 1)
        print(f"{n:7d} {dt * 1e3:17.2f} {res.arena_size / res.lower_bound:9.4f}  "
              f"{res.strategy.decode():10}{'' if ok else ' INVALID'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(os.path.dirname(REPO), "shared", "traces")
    ap.add_argument("folder", nargs="?", default=default)
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds for local search + exact tail per trace (0: heuristics only)")
    ap.add_argument("--capacity", type=int, default=0,
                    help="target arena bytes (0: minimise); exact search decides feasibility")
    ap.add_argument("--max-anchor-n", type=int, default=20000,
                    help="skip the O(n^2) numpy best-fit anchors above this n")
    ap.add_argument("--scaling", action="store_true",
                    help="time 1k/10k/100k random tensors and 5k-20k nested lifetimes")
    ap.add_argument("--json", help="write per-trace rows to this file")
    args = ap.parse_args()
    lib = load_library()
    if args.scaling:
        scaling(lib)
        return
    if not os.path.isdir(args.folder):
        sys.exit(f"no trace folder {args.folder}")
    bench_traces(lib, args.folder, args.time_limit, args.max_anchor_n, args.json, args.capacity)


if __name__ == "__main__":
    main()
