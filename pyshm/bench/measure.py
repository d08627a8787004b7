"""Measuring on a noisy 2-core machine, for every case of ``python -m pyshm bench``: the load
other processes put on the CPUs during a run (from /proc/stat), one timed run kept with its
load, the statistics of a result row, and the texts of the report; plus the process set-up
the cases share (fd limit, torch).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional

# A timed run is "quiet" when other processes kept fewer CPUs than this busy meanwhile.
QUIET_LOAD = 0.25
LOAD_WINDOW = 0.5  # seconds: the shortest run whose load /proc/stat resolves well enough


def fd_budget() -> int:
    """File descriptors this process may still open, less a margin."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, soft - used - 256)


def raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass


def dev_shm_free() -> Optional[int]:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def cpu_snapshot() -> Optional[tuple]:
    """(wall s, busy CPU s of the whole machine, CPU s of this process), or None off Linux."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    ticks = [int(value) for value in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()


def other_load(before: Optional[tuple], after: Optional[tuple]) -> Optional[float]:
    """CPUs kept busy on average by everything but this process between two snapshots.

    /proc/stat counts in 10 ms ticks per CPU, so windows shorter than LOAD_WINDOW give None.
    """
    if before is None or after is None or after[0] - before[0] < LOAD_WINDOW:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others / (after[0] - before[0]))


def load_torch(wanted: bool):
    """(torch module or None, description)."""
    if not wanted:
        return None, "not run (--no-torch)"
    try:
        import torch
        import torch.multiprocessing

        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    except Exception as exc:  # ImportError, or a broken install
        return None, f"not installed ({type(exc).__name__}: {exc})"
    return torch, f"{torch.__version__} (file_descriptor strategy, " \
                  f"{torch.get_num_threads()} intra-op threads)"


def torch_multiprocessing(use_torch: bool) -> tuple:
    """(torch.multiprocessing with the file_descriptor strategy, or None; what to say of
    torch): the torch rows of this case and of the receiver case."""
    if not use_torch:
        return None, "not run (--no-torch)"
    try:
        import torch
        import torch.multiprocessing as tmp

        tmp.set_sharing_strategy("file_descriptor")
        return tmp, f"{torch.__version__} (file_descriptor strategy)"
    except Exception as exc:  # ImportError, or a broken install
        return None, f"not installed ({type(exc).__name__}: {exc})"


def stop_pools(methods: list) -> None:
    """Terminate the worker pool of each method that has one (``method.pool``), at a case's end."""
    for method in methods:
        if method.pool is not None:
            method.pool.terminate()
            method.pool.join()
            method.pool = None


def size_text(nbytes: int) -> str:
    if nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30} GiB"
    return f"{nbytes >> 20} MiB"


def row_stats(seconds: list, loads: list, count: int, nbytes: int, per_share: bool) -> dict:
    """The measured fields of a result row (also used by :mod:`pyshm.bench_processes`): the
    runs' seconds and other-CPU loads, how many were quiet, min and median, GB/s and whether
    the best run was quiet, and microseconds per item when ``per_share``."""
    stats = {
        "seconds": seconds,
        "other_cpu_load": loads,
        "quiet_runs": sum(1 for load in loads if load is not None and load < QUIET_LOAD),
        "min_s": min(seconds) if seconds else None,
        "median_s": statistics.median(seconds) if seconds else None,
    }
    if seconds:
        stats["gbps"] = nbytes / stats["min_s"] / 1e9
        best_load = loads[seconds.index(stats["min_s"])]
        stats["best_run_quiet"] = None if best_load is None else best_load < QUIET_LOAD
        if per_share:
            stats["min_us_per_share"] = stats["min_s"] / count * 1e6
            stats["median_us_per_share"] = stats["median_s"] / count * 1e6
    return stats


def measure_into(runs: dict, errors: dict, done: list, key, label: str, run: Callable,
                 text: Callable) -> None:
    """One timed run of a method (every case's): ``run()`` gives (seconds, other CPUs' load or
    None), kept in ``runs[key]``; a failure is kept in ``errors[key]`` and the others go on.
    ``done`` gets the progress text (``text(seconds)``, or FAILED)."""
    try:
        seconds, others = run()
    except Exception as exc:  # report, keep the other methods going
        errors[key] = f"{type(exc).__name__}: {exc}"
        done.append(f"{label} FAILED")
        return
    runs[key].append((seconds, others))
    done.append(f"{label} {text(seconds)}")


def measure_rounds(runs: dict, errors: dict, repeats: int, plan: Callable, progress,
                   case: str) -> None:
    """``repeats`` rounds of measure_into: round i times every (key, label, run, text) that
    ``plan(i)`` gives (in that order: it interleaves the methods) whose key has not failed,
    then reports the round through ``progress``."""
    for round_index in range(repeats):
        done: list = []
        for key, label, run, text in plan(round_index):
            if key not in errors:
                measure_into(runs, errors, done, key, label, run, text)
        if progress:
            progress(f"{case} round {round_index + 1}/{repeats}: " + ", ".join(done))


def target_notes(median_text: str, met: bool, met_on_median: bool, rows: tuple,
                 extra: list) -> str:
    """A target's note: its median (and whether that disagrees with the verdict), the rows
    whose best run other processes disturbed, then ``extra``."""
    notes = [f"median {median_text}"
             + ("" if met_on_median == met else
                ", met on the median only" if met_on_median else ", not met on the median")]
    disturbed = [r["label"] for r in rows if r is not None and r.get("best_run_quiet") is False]
    if disturbed:
        notes.append(f"best run of {' and '.join(disturbed)} disturbed by other processes")
    return "; ".join(notes + extra)


def quiet_text(row: dict) -> str:
    """"quiet runs/runs", or "-" when no run was long enough to measure other processes."""
    known = sum(1 for load in row["other_cpu_load"] if load is not None)
    return f"{row['quiet_runs']}/{len(row['seconds'])}" if known else "-"


def target_text(target: dict) -> str:
    """One target as a line: name, bar, measured value, met or not, note."""
    state = {True: "met", False: "NOT MET", None: "-"}[target["met"]]
    text = f"{target['name']} {target['bar']}: {target['text']}  {state}"
    return text + (f"  ({target['note']})" if target["note"] else "")
