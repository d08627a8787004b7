"""The arena planner: place tensors with known lifetimes into one buffer (see lshm_plan)."""

from __future__ import annotations

import csv
import ctypes
import functools
from typing import Optional, Sequence

import numpy as np

from . import _checks, _ffi
from ._ffi import I64Pointer, U64Pointer, lib
from ._planning import (
    Plan,
    as_array,
    big_plan,
    inputs,
    interruptibly,
    lifetime_pointers,
    options,
    plan_from_result,
    pointer,
)

__all__ = ["Plan", "plan", "lower_bound", "validate", "read_trace", "write_trace"]



def plan(
    sizes: Sequence[int],
    firsts: Sequence[int],
    lasts: Sequence[int],
    *,
    alignment: int = 64,
    inclusive: bool = False,
    time_limit: float = 0.0,
    fixed_offsets: Optional[Sequence[int]] = None,
    capacity: int = 0,
) -> Plan:
    """Place ``n`` tensors in one arena so that tensors alive at once never overlap.

    Tensor ``i`` has ``sizes[i]`` bytes and is live on ``[firsts[i], lasts[i])`` (or
    ``[firsts[i], lasts[i]]`` with ``inclusive=True``). ``fixed_offsets[i] >= 0`` pins a tensor;
    ``-1`` lets the planner choose. The heuristic portfolio always runs; ``time_limit`` seconds
    more are spent on improvement and exact search when the plan is above the lower bound.
    ``capacity > 0`` makes the goal a plan that fits in ``capacity`` bytes: the exact search
    decides feasibility at that capacity within ``time_limit``; when no plan fits, the best plan
    found is returned with ``arena_size > capacity`` (not an error; check it).
    The call runs in C without the GIL; one of 2,000 tensors or more, or with a
    ``time_limit`` of 0.5 s or more, runs on a helper thread while the calling thread waits,
    so that Ctrl-C stops it (KeyboardInterrupt, within milliseconds); a fork meanwhile on
    that thread (from a signal handler) waits for the plan to finish. With
    ``time_limit=0`` it is deterministic; a time limit bounds its search by the clock, so a
    busier machine may return another (valid) plan. It takes about O(n log n) on lifetimes
    that overlap little, and up to O(n * k) where each tensor overlaps k others (nested
    lifetimes of 10,000 tensors, every one alive at the midpoint: about 1 s).
    The sizes may sum past 2**64 when they are never all live together: only the bytes live at
    one time must fit in 64 bits, else it raises ValueError (errno EOVERFLOW).
    """
    n, sizes_a, firsts_a, lasts_a = inputs(sizes, firsts, lasts)
    opts = options(alignment, inclusive, time_limit, capacity)
    fixed_a = None
    if fixed_offsets is not None:
        fixed_a = as_array(fixed_offsets, np.int64, "fixed_offsets")
        if len(fixed_a) != n:
            raise ValueError(f"fixed_offsets has {len(fixed_a)} entries for {n} tensors")
    offsets = np.zeros(n, dtype=np.uint64)
    result = _ffi.PlanResult()
    call = functools.partial(
        lib.lshm_plan,
        n,
        *lifetime_pointers(sizes_a, firsts_a, lasts_a),
        pointer(fixed_a, I64Pointer),
        ctypes.byref(opts),
        pointer(offsets, U64Pointer),
        ctypes.byref(result),
    )
    interruptibly(call, functools.partial(lib.lshm_plan_interrupt, ctypes.byref(opts)),
                  big_plan(n, time_limit))
    return plan_from_result(offsets, result, int(opts.alignment), bool(inclusive))


def lower_bound(
    sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int], *,
    alignment: int = 64, inclusive: bool = False,
) -> int:
    """The most bytes live at one time (sizes rounded up to ``alignment``)."""
    n, sizes_a, firsts_a, lasts_a = inputs(sizes, firsts, lasts)
    opts = options(alignment, inclusive, 0.0)
    out = ctypes.c_uint64()
    lib.lshm_plan_lower_bound(
        n, *lifetime_pointers(sizes_a, firsts_a, lasts_a),
        ctypes.byref(opts), ctypes.byref(out),
    )
    return int(out.value)


def validate(
    sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int], offsets: Sequence[int],
    arena_size: int, *, alignment: int = 1, inclusive: bool = False,
) -> None:
    """Raise :class:`ValueError` naming the first overlapping or misaligned tensor, if any."""
    n, sizes_a, firsts_a, lasts_a = inputs(sizes, firsts, lasts)
    offsets_a = as_array(offsets, np.uint64, "offsets")
    if len(offsets_a) != n:
        raise ValueError(f"offsets has {len(offsets_a)} entries for {n} tensors")
    opts = options(alignment, inclusive, 0.0)
    lib.lshm_plan_validate(
        n, *lifetime_pointers(sizes_a, firsts_a, lasts_a),
        pointer(offsets_a, U64Pointer), ctypes.byref(opts),
        _checks.uint64(arena_size, "arena_size"),
    )


def read_trace(path: str):
    """Read a trace CSV ``id,lower,upper,size[,...]`` into (ids, sizes, firsts, lasts).

    Every value is checked as it is read (``size`` in [0, 2**64), ``lower`` and ``upper`` in
    int64, ``lower <= upper``): a bad one is a :class:`ValueError` naming the file and line,
    as is a line the csv module refuses. A byte order mark and blanks around the column
    names are ignored.
    """
    ids, sizes, firsts, lasts, _ = read_trace_lines(path)
    return ids, sizes, firsts, lasts


def read_trace_lines(path: str):
    """read_trace, plus the file's line number of each tensor (for error messages: the
    command line's plan)."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        try:
            return _read_rows(path, reader)
        except csv.Error as exc:  # (e.g. a field over csv.field_size_limit())
            raise ValueError(f"{path}:{reader.reader.line_num}: {exc}") from None


def _read_rows(path: str, reader: csv.DictReader):
    ids, sizes, firsts, lasts, lines = [], [], [], [], []
    names = reader.fieldnames
    if names:
        # without a byte order mark (spreadsheets write one) or blanks around the names
        # ("id, lower, upper, size" by hand); int() takes the numbers' blanks already
        reader.fieldnames = [name.strip(" \t\ufeff") for name in names]
    missing = {"id", "lower", "upper", "size"} - set(reader.fieldnames or ())
    if missing:
        raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
    for row in reader:
        line = reader.line_num  # the file's line (blank lines and quoted newlines count)
        where = f"{path}:{line}"
        if row.get("id") is None:  # DictReader fills missing cells with None
            raise ValueError(f"{where}: fewer cells than columns in row {_row_text(row)}")
        try:
            lower = _checks.int64(_cell_int(row, "lower"), "lower")
            upper = _checks.int64(_cell_int(row, "upper"), "upper")
            size = _checks.uint64(_cell_int(row, "size"), "size")
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{where}: {exc} in row {_row_text(row)}") from None
        if lower > upper:
            raise ValueError(f"{where}: lower {lower} > upper {upper} in row {_row_text(row)}")
        ids.append(row["id"])
        firsts.append(lower)
        lasts.append(upper)
        sizes.append(size)
        lines.append(line)
    return ids, sizes, firsts, lasts, lines


def _cell_int(row: dict, column: str) -> int:
    text = row.get(column)
    if text is None:
        raise ValueError(f"no {column} value")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{column} {text!r} is not an integer") from None


def _row_text(row: dict) -> str:
    return ",".join("" if v is None else str(v) for k, v in row.items() if k is not None)


def write_trace(path: str, ids, sizes, firsts, lasts, offsets) -> None:
    """Write the trace rows with an added ``offset`` column (MiniMalloc's output format)."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "lower", "upper", "size", "offset"])
        for row in zip(ids, firsts, lasts, sizes, offsets):
            writer.writerow([row[0], row[1], row[2], row[3], int(row[4])])
