"""The command line of ``python -m pyshm bench`` and its array cases (seed, big, small): the
runs, interleaved round by round, the rows and ratios, the targets and the report; the other
cases are modules of their own (processes, receiver, engines), run from here."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from multiprocessing.pool import ThreadPool
from typing import Optional

import numpy as np

from .. import demo
from .measure import (
    LOAD_WINDOW,
    QUIET_LOAD,
    cpu_snapshot,
    dev_shm_free,
    load_torch,
    other_load,
    quiet_text,
    raise_fd_limit,
    row_stats,
    size_text,
    target_notes,
    target_text,
)
from .methods import (
    CeilingMethod,
    HugeCeilingMethod,
    MemcpyMethod,
    Method,
    PyshmMethod,
    PyshmRecycledMethod,
    SharedMemoryMethod,
    TorchMethod,
)
from .workloads import (
    BIG_MARK,
    FRAME_BYTES,
    FRAME_SHAPE,
    SMALL_BYTES,
    Workload,
    check_big,
    check_frame,
    check_small,
    fill_big,
    fill_frame,
    fill_small,
)

__all__ = ["add_arguments", "main", "run"]

DEFAULTS = {"repeats": 5, "threads": (1, 2, 8), "big_mib": 1024, "receiver_mib": 1024,
            "small_count": 10_000}
QUICK = {"repeats": 3, "count": 4, "big_mib": 256, "receiver_mib": 256, "small_count": 2_000}

# The speed targets (README, Benchmark, "Targets"; the bars of the project's design brief):
# each report ends with whether this run met them.
TARGET_SEED_VS_TORCH = 0.35  # pyshm time / torch time, seed workload, ThreadPool(2)
TARGET_SEED_VS_CEILING = 1.10  # pyshm time / huge-page ceiling time, same case
TARGET_BIG_SPEEDUP = 2.5  # torch time / pyshm time, one 1 GiB array
TARGET_RECEIVER_VS_TORCH = 0.10  # a spawned worker's first read of 1 GiB, pyshm / torch
TARGET_HUGE_OFF_VS_TORCH = 0.65  # seed workload, ThreadPool(2), with LSHM_HUGE=0
TARGET_SMALL_US = 12.0  # pyshm us per 4 KiB share
TARGET_SMALL_VS_CEILING = 0.60  # pyshm time per 4 KiB in-place share / the ceiling's (slabs)

CASES = ("seed", "big", "small", "processes", "receiver", "huge_off", "engines")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _int_list(text: str) -> tuple:
    try:
        values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers: {text}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1: {text}")
    return tuple(dict.fromkeys(values))


def _case_list(text: str) -> tuple:
    values = tuple(part for part in text.replace(" ", "").split(",") if part)
    unknown = [value for value in values if value not in CASES]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"cases are {', '.join(CASES)}; got {text}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser`` (the ``python -m pyshm bench`` subcommand)."""
    parser.add_argument("--quick", action="store_true",
                        help=f"a run of about a minute: {QUICK['count']} seed arrays, "
                             f"{QUICK['repeats']} rounds, a {QUICK['big_mib']} MiB big array, "
                             f"{QUICK['small_count']} small arrays, fewer arrays sent to "
                             f"processes, a {QUICK['receiver_mib']} MiB receiver case")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON on stdout (tables go to stderr)")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help=f"rounds per case (default {DEFAULTS['repeats']})")
    parser.add_argument("--count", type=_positive_int, default=None,
                        help="seed workload arrays (default: as many of 64 as fit in a quarter "
                             "of the available memory)")
    parser.add_argument("--threads", type=_int_list, default=None,
                        help="ThreadPool sizes for the seed workload (default 1,2,8)")
    parser.add_argument("--big-mib", type=_positive_int, default=None,
                        help=f"size of the big array in MiB (default {DEFAULTS['big_mib']})")
    parser.add_argument("--receiver-mib", type=_positive_int, default=None,
                        help="size of the array of the receiver case in MiB (default "
                             f"{DEFAULTS['receiver_mib']})")
    parser.add_argument("--small-count", type=_positive_int, default=None,
                        help=f"number of 4 KiB arrays (default {DEFAULTS['small_count']})")
    parser.add_argument("--cases", type=_case_list, default=CASES,
                        help="which cases to run, comma-separated (default "
                             f"{','.join(CASES)})")
    parser.add_argument("--no-torch", action="store_true", help="do not try to import torch")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m pyshm bench``; returns the exit status."""
    config = _config(args)
    result = run(config, progress=None if args.quiet else _Progress())
    out = sys.stderr if args.json else sys.stdout
    print(format_report(result), file=out, flush=True)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=False))
    pyshm_failed = any(row["method"] == "pyshm" and row["error"]
                       for case in result["cases"] for row in case["rows"])
    return 1 if pyshm_failed else 0


def _config(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    available = demo.available_memory()

    def pick(name):
        value = getattr(args, name, None)
        if value is not None:
            return value
        if quick and name in QUICK:
            return QUICK[name]
        return DEFAULTS.get(name)

    count = args.count or (min(QUICK["count"], demo.default_count()) if quick
                           else demo.default_count())
    big_bytes = pick("big_mib") << 20
    if args.big_mib is None:  # the default shrinks to a quarter of the available memory
        while big_bytes > BIG_MARK and big_bytes > available // 4:
            big_bytes //= 2
    receiver_bytes = pick("receiver_mib") << 20
    if args.receiver_mib is None:
        while receiver_bytes > BIG_MARK and receiver_bytes > available // 4:
            receiver_bytes //= 2
    return {
        "quick": quick,
        "repeats": pick("repeats"),
        "count": count,
        "threads": list(pick("threads")),
        "big_bytes": big_bytes,
        "receiver_bytes": receiver_bytes,
        "small_count": pick("small_count"),
        "cases": list(args.cases),
        "torch": not args.no_torch,
        "available_memory": available,
    }


class _Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _run_once(method: Method, workload: Workload, count: int,
              pool: Optional[ThreadPool]) -> tuple:
    """Build ``count`` sources for ``method``, share them all (timed), check, and free.

    Returns (seconds, CPUs that other processes kept busy meanwhile, or None).
    """
    method.prepare(workload, count, pool)
    sources = []
    for index in range(count):
        item, view = method.new_source(workload.shape)
        workload.fill(view, index)
        sources.append(item)
        del item, view  # the list holds the only reference to each source
    method.start(sources)
    del sources
    gc.collect()
    try:
        share = method.share
        before = cpu_snapshot()
        start = time.perf_counter()
        if pool is None:
            for index in range(count):
                share(index)
        else:
            pool.map(share, range(count), chunksize=1)
        seconds = time.perf_counter() - start
        others = other_load(before, cpu_snapshot())
        for index in range(count):
            method.check_shared(index)
            workload.check(method.result(index), index)
    finally:
        method.finish()
        gc.collect()
    return seconds, others


class _Row:
    def __init__(self, method: Method, threads: int, count: int, note: str = "") -> None:
        self.method = method
        self.threads = threads
        self.count = count
        self.seconds: list = []
        self.loads: list = []  # CPUs other processes kept busy during each timed run
        self.error = ""
        self.note = note


def _rotated(methods: list, shift: int) -> list:
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


def _run_case(workload: Workload, methods: list, threads: list, repeats: int,
              progress) -> list:
    """Interleave every method round by round; one row per (method, threads)."""
    dev_shm = dev_shm_free()
    rows = {}
    for method in methods:
        count = method.capacity(workload)
        note = ""
        if count < workload.count:
            note = f"{count:,} arrays (fd limit)"
        if (method.key in ("torch", "shm") and dev_shm is not None
                and dev_shm < count * workload.item_bytes * 1.05):
            note = f"skipped: /dev/shm has {dev_shm / 1e9:.2f} GB free"
            count = 0
        for pool_size in threads:
            row = _Row(method, pool_size, count, note)
            if count == 0:
                row.error = note
            rows[method.key, pool_size] = row
    pools = {size: ThreadPool(size) for size in threads if size} if workload.key == "seed" else {}
    try:
        for round_index in range(repeats):
            for pool_size in threads:
                done = []
                for method in _rotated(methods, round_index):
                    row = rows[method.key, pool_size]
                    if row.error:
                        continue
                    try:
                        seconds, others = _run_once(method, workload, row.count,
                                                    pools.get(pool_size))
                    except Exception as exc:  # report, keep the other methods going
                        row.error = f"{type(exc).__name__}: {exc}"
                        done.append(f"{method.key} FAILED")
                        continue
                    row.seconds.append(seconds)
                    row.loads.append(others)
                    if workload.per_share:
                        done.append(f"{method.key} {seconds / row.count * 1e6:.1f} us")
                    else:
                        done.append(f"{method.key} {seconds:.3f} s")
                if progress:
                    where = (f", {pool_size} thread{'s' if pool_size > 1 else ''}"
                             if workload.key == "seed" else "")
                    progress(f"{workload.key} round {round_index + 1}/{repeats}{where}: "
                             + ", ".join(done))
    finally:
        for pool in pools.values():
            pool.close()
            pool.join()
    return [rows[method.key, size] for size in threads for method in methods]


def _warm_up(methods: list) -> None:
    """One small untimed run per method: lazy imports, resource tracker, first calls."""
    tiny = Workload("warm-up", "", (SMALL_BYTES,), 8, fill_small, check_small)
    for method in methods:
        try:
            _run_once(method, tiny, tiny.count, None)
        except Exception:
            pass  # the timed runs report it


def run(config: dict, progress=None) -> dict:
    """Run the benchmark described by ``config`` (see :func:`_config`); returns the result."""
    from .. import __version__

    raise_fd_limit()
    torch, torch_text = load_torch(config["torch"])
    methods = [PyshmMethod(), PyshmRecycledMethod()]
    if torch is not None:
        methods.append(TorchMethod(torch))
    methods += [SharedMemoryMethod(), CeilingMethod(), HugeCeilingMethod(), MemcpyMethod()]
    repeats = config["repeats"]
    count = config["count"]
    workloads = {
        "seed": (Workload("seed", f"Seed workload: {count} uint8 arrays of "
                          f"{'x'.join(map(str, FRAME_SHAPE))} ({count * FRAME_BYTES / 1e9:.2f} GB),"
                          " shared from a ThreadPool", FRAME_SHAPE, count,
                          fill_frame, check_frame), config["threads"]),
        "big": (Workload("big", f"One {size_text(config['big_bytes'])} array, one call",
                         (config["big_bytes"],), 1, fill_big, check_big), [1]),
        "small": (Workload("small", f"{config['small_count']:,} arrays of 4 KiB, one call at a "
                           "time (us per share)", (SMALL_BYTES,), config["small_count"],
                           fill_small, check_small, per_share=True), [1]),
    }
    if progress:
        progress(f"pyshm {__version__}; torch {torch_text}; "
                 f"{repeats} rounds of {', '.join(config['cases'])}")
    _warm_up(methods)
    # Move everything alive now (torch alone is ~10^5 objects) out of the collector's sight:
    # the gc.collect() between runs then takes microseconds instead of ~40 ms.
    gc.collect()
    gc.freeze()
    before = cpu_snapshot()
    try:
        result = _run_cases(config, methods, workloads, torch, torch_text, progress)
    finally:
        gc.unfreeze()
    result["other_cpu_load"] = other_load(before, cpu_snapshot())
    return result


def _run_cases(config: dict, methods: list, workloads: dict, torch, torch_text: str,
               progress=None) -> dict:
    from .. import __version__

    result = {
        "pyshm": __version__,
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_note": torch_text,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "available_memory": config["available_memory"],
        "config": {key: value for key, value in config.items() if key != "available_memory"},
        "cases": [],
    }
    more_targets = []
    for key in config["cases"]:
        if key == "receiver":
            from . import receiver

            case = receiver.run_case(config["receiver_bytes"], config["repeats"],
                                           torch is not None, progress)
            result["cases"].append(case)
            continue
        if key == "engines":
            from . import engines

            case = engines.run_case(engines.NBYTES, config["repeats"],
                                          torch is not None, progress)
            result["cases"].append(case)
            more_targets += engines.targets(case)
            continue
        if key == "huge_off":
            result["cases"] += _huge_off_cases(config, torch is not None, progress)
            continue
        if key == "processes":
            from . import processes

            sizes = processes.QUICK if config["quick"] else processes.DEFAULTS
            case = processes.run_case(sizes["count"], sizes["single"], "fork",
                                            config["repeats"], torch is not None, progress)
            result["cases"].append(case)
            more_targets += processes.targets(case, config["quick"])
            continue
        workload, threads = workloads[key]
        runs = [method for method in methods if key not in method.skip]
        rows = _run_case(workload, runs, threads, config["repeats"], progress)
        result["cases"].append(_case_result(workload, rows))
    result["targets"] = _targets(result) + more_targets
    return result


def _huge_off_cases(config: dict, use_torch: bool, progress=None) -> list:
    """The seed workload at ThreadPool(2), and the receiver case when this run has it, again
    in a child process with ``LSHM_HUGE=0`` (libshm reads it once per process): their cases,
    keys suffixed ``_huge_off``. A child that fails gives a case whose one row says why."""
    cases = ["seed"] + (["receiver"] if "receiver" in config["cases"] else [])
    command = [sys.executable, "-m", "pyshm", "bench", "--json", "--quiet",
               "--cases", ",".join(cases), "--threads", "2",
               "--repeats", str(config["repeats"]), "--count", str(config["count"]),
               "--receiver-mib", str(config["receiver_bytes"] >> 20)]
    if config["quick"]:
        command.append("--quick")
    if not use_torch:
        command.append("--no-torch")
    if progress:
        progress(f"huge_off: {', '.join(cases)} again in a child process with LSHM_HUGE=0")
    env = dict(os.environ, LSHM_HUGE="0")
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, env=env)
    try:
        if done.returncode != 0:
            raise ValueError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                             else f"exit status {done.returncode}")
        child = json.loads(done.stdout)
    except ValueError as exc:
        return [{"case": "seed_huge_off", "title": "Huge pages off (LSHM_HUGE=0)",
                 "shape": [], "count": 0, "bytes": 0, "per_share": False,
                 "rows": [{"method": "pyshm", "label": "pyshm.share_memory_", "threads": 2,
                           "seconds": [], "error": f"child process failed: {exc}",
                           "note": None, "ratios": {}}]}]
    out = []
    for case in child["cases"]:
        case["case"] += "_huge_off"
        case["title"] = "Huge pages off (LSHM_HUGE=0): " + case["title"]
        out.append(case)
    return out


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

BASELINES = ("torch", "shm", "ceiling", "ceiling_huge", "memcpy", "own", "once")


def _case_result(workload: Workload, rows: list) -> dict:
    out_rows = []
    for row in rows:
        nbytes = row.count * workload.item_bytes
        out_rows.append({
            "method": row.method.key,
            "label": row.method.label,
            "threads": row.threads,
            "count": row.count,
            "bytes": nbytes,
            **row_stats(row.seconds, row.loads, row.count, nbytes, workload.per_share),
            "error": row.error or None,
            "note": row.note or None,
        })
    # Ratios: this row's time over the baseline's time at the same thread count (per share
    # for the small case, where counts may differ), from the min and from the median times.
    for entry in out_rows:
        entry["ratios"] = {}
        for base in BASELINES:
            other = next((o for o in out_rows if o["method"] == base
                          and o["threads"] == entry["threads"]), None)
            if other is None or not other["seconds"] or not entry["seconds"]:
                continue
            entry["ratios"][base] = {
                stat: (entry[f"{stat}_s"] / entry["count"]) / (other[f"{stat}_s"] / other["count"])
                for stat in ("min", "median")
            }
    return {
        "case": workload.key,
        "title": workload.title,
        "shape": list(workload.shape),
        "count": workload.count,
        "bytes": workload.nbytes,
        "per_share": workload.per_share,
        "rows": out_rows,
    }


def _find(result: dict, case: str, method: str, threads: int) -> Optional[dict]:
    for entry in result["cases"]:
        if entry["case"] == case:
            for row in entry["rows"]:
                if row["method"] == method and row["threads"] == threads and row["seconds"]:
                    return row
    return None


def _targets(result: dict) -> list:
    """Each speed target (the TARGET_* constants): the measured value, met or not, and what may
    weaken it."""
    ran = {entry["case"] for entry in result["cases"]}
    off_threads = result["config"]["threads"] if 2 in result["config"]["threads"] else [2]
    big_text = size_text(result["config"]["big_bytes"])
    specs = [
        # name, bar, case, threads, baseline, value from (pyshm row, baseline row), met?, format
        ("seed workload, ThreadPool(2), pyshm time / torch time",
         f"<= {TARGET_SEED_VS_TORCH:.2f}", "seed", 2, "torch",
         lambda row, base, stat: row["ratios"]["torch"][stat],
         lambda value: value <= TARGET_SEED_VS_TORCH, "{:.2f}"),
        ("seed workload, ThreadPool(2), pyshm time / huge-page ceiling time",
         f"<= {TARGET_SEED_VS_CEILING:.2f}", "seed", 2, "ceiling_huge",
         lambda row, base, stat: row["ratios"]["ceiling_huge"][stat],
         lambda value: value <= TARGET_SEED_VS_CEILING, "{:.2f}"),
        (f"one {big_text} array, torch time / pyshm time",
         f">= {TARGET_BIG_SPEEDUP:.2f}", "big", 1, "torch",
         lambda row, base, stat: 1 / row["ratios"]["torch"][stat],
         lambda value: value >= TARGET_BIG_SPEEDUP, "{:.2f}x"),
        ("4 KiB arrays, pyshm us per share",
         f"<= {TARGET_SMALL_US:.0f} us", "small", 1, None,
         lambda row, base, stat: row[f"{stat}_us_per_share"],
         lambda value: value <= TARGET_SMALL_US, "{:.1f} us"),
        ("4 KiB arrays, pyshm time per in-place share / ceiling time",
         f"<= {TARGET_SMALL_VS_CEILING:.2f}", "small", 1, "ceiling",
         lambda row, base, stat: row["ratios"]["ceiling"][stat],
         lambda value: value <= TARGET_SMALL_VS_CEILING, "{:.2f}"),
        ("a spawned worker's first read, pyshm time / torch time",
         f"<= {TARGET_RECEIVER_VS_TORCH:.2f}", "receiver", 1, "torch",
         lambda row, base, stat: row["ratios"]["torch"][stat],
         lambda value: value <= TARGET_RECEIVER_VS_TORCH, "{:.3f}"),
        ("huge pages off (LSHM_HUGE=0): seed workload, ThreadPool(2), pyshm time / torch time",
         f"<= {TARGET_HUGE_OFF_VS_TORCH:.2f}", "seed_huge_off", 2, "torch",
         lambda row, base, stat: row["ratios"]["torch"][stat],
         lambda value: value <= TARGET_HUGE_OFF_VS_TORCH, "{:.2f}"),
    ]
    targets = []
    for name, bar, case, threads, base_key, value_of, passes, form in specs:
        target = {"name": name, "bar": bar, "value": None, "median_value": None, "met": None,
                  "text": "", "note": ""}
        targets.append(target)
        row = _find(result, case, "pyshm", threads)
        base = _find(result, case, base_key, threads) if base_key else None
        if case not in ran or (case == "seed" and threads not in result["config"]["threads"]) \
                or (case == "seed_huge_off" and threads not in off_threads):
            target["text"] = "not measured (case not run)"
            continue
        if row is None:
            target["text"] = "not measured (pyshm failed)"
            continue
        if base_key and base is None:
            why = result["torch_note"] if base_key == "torch" else f"{base_key} failed"
            target["text"] = f"not measured: {why}"
            continue
        value, median = value_of(row, base, "min"), value_of(row, base, "median")
        target.update(value=value, median_value=median, met=passes(value),
                      text=form.format(value))
        extra = []
        if case == "big" and result["config"]["big_bytes"] != 1 << 30:
            extra.append("measured on a smaller array")
        if case == "receiver" and result["config"]["receiver_bytes"] != 1 << 30:
            extra.append("measured on a smaller array")
        if result["config"]["quick"]:
            extra.append("quick run")
        target["note"] = target_notes(form.format(median), passes(value), passes(median),
                                      (row, base), extra)
    return targets


def _ratio_text(row: dict, base: str) -> str:
    ratio = row["ratios"].get(base)
    if ratio is None:
        return "-"
    return f"{ratio['min']:.2f} ({ratio['median']:.2f})"


def format_report(result: dict) -> str:
    """The tables and the targets block, as printed."""
    lines = []
    mem = result["available_memory"] / 2**30
    lines.append(f"pyshm {result['pyshm']} bench: Python {result['python']}, numpy "
                 f"{result['numpy']}, {result['cpus']} CPUs, {mem:.1f} GiB available")
    lines.append(f"torch: {result['torch_note']}")
    load = result.get("other_cpu_load")
    if load is not None:
        text = f"other processes kept {load:.2f} of {result['cpus']} CPUs busy during the run"
        if load > 0.2:
            text += ": the machine was not quiet, absolute times and ratios are less reliable"
        lines.append(text)
    lines.append(f"{result['config']['repeats']} rounds per case, methods interleaved; "
                 "ratio = this row's time / the baseline's time at the same thread count, "
                 "from min times (median times in brackets); < 1 means this row is faster; "
                 f"quiet = runs during which other processes kept < {QUIET_LOAD} CPU busy "
                 f"(- for runs under {LOAD_WINDOW} s, too short to tell)")
    base_titles = {"torch": "vs torch", "shm": "vs SharedMem", "ceiling": "vs ceiling",
                   "ceiling_huge": "vs huge ceil", "memcpy": "vs memcpy",
                   "own": "vs own way", "once": "vs sent once"}
    for case in result["cases"]:
        # (the columns of the baselines this case measured)
        present = {row["method"] for row in case["rows"] if row["seconds"]}
        bases = [base for base in BASELINES if base in present]
        unit = ("us" if case["per_share"] else
                "ms" if case["case"].startswith(("receiver", "engines")) else "s")
        width = max([22] + [len(row["label"]) + 1 for row in case["rows"]])
        head = (f"{'method':<{width}}{'threads':>8}{'min ' + unit:>10}{'median ' + unit:>11}"
                f"{'GB/s':>8}{'quiet':>7}"
                + "".join(f"{base_titles[base]:>15}" for base in bases))
        lines += ["", case["title"], head, "-" * len(head)]
        for row in case["rows"]:
            text = f"{row['label']:<{width}}{row['threads']:>8}"
            if not row["seconds"]:
                lines.append(f"{text}  {row['error'] or 'no result'}")
                continue
            if case["per_share"]:
                low, mid = row["min_us_per_share"], row["median_us_per_share"]
                text += f"{low:>10.1f}{mid:>11.1f}"
            elif unit == "ms":
                text += f"{row['min_s'] * 1e3:>10.2f}{row['median_s'] * 1e3:>11.2f}"
            else:
                text += f"{row['min_s']:>10.3f}{row['median_s']:>11.3f}"
            text += f"{row['gbps']:>8.2f}{quiet_text(row):>7}"
            text += "".join(f"{_ratio_text(row, base):>15}" for base in bases)
            notes = [note for note in (row["note"], row["error"] and f"then failed: "
                                       f"{row['error']}") if note]
            if notes:
                text += "  " + "; ".join(notes)
            lines.append(text)
    lines += ["", "targets (judged on min times)"]
    lines += ["  " + target_text(target) for target in result["targets"]]
    return "\n".join(lines)
