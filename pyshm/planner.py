"""The arena planner: place tensors with known lifetimes into one buffer (see lshm_plan)."""

from __future__ import annotations

import csv
import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import _checks, _ffi
from ._ffi import _i64_p, _u64_p, lib

__all__ = ["Plan", "plan", "lower_bound", "validate", "read_trace", "write_trace"]



@dataclass(frozen=True)
class Plan:
    """The result of :func:`plan`.

    ``offsets[i]`` is where tensor ``i`` starts; ``arena_size`` the bytes the arena needs;
    ``lower_bound`` the most bytes live at one time, which no plan can beat; ``strategy`` the
    name of the placement that won; ``optimal`` whether ``arena_size`` is proven minimal.
    """

    offsets: np.ndarray
    arena_size: int
    lower_bound: int
    strategy: str
    optimal: bool
    seconds: float
    alignment: int
    inclusive: bool

    @property
    def ratio(self) -> float:
        """arena_size / lower_bound (1.0 is perfect)."""
        return self.arena_size / self.lower_bound if self.lower_bound else 1.0


def _options(
    alignment: int, inclusive: bool, time_limit: float, capacity: int = 0
) -> _ffi.PlanOptions:
    alignment = _checks.uint64(alignment, "alignment")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 1, got {alignment}")
    time_limit = _checks.seconds(time_limit, "time_limit")
    capacity = _checks.uint64(capacity, "capacity")
    opts = _ffi.PlanOptions()
    lib.lshm_plan_options_init(ctypes.byref(opts))
    opts.alignment = alignment
    opts.flags = _ffi.PLAN_INCLUSIVE if inclusive else 0
    opts.time_limit = time_limit
    opts.capacity = capacity
    return opts


def _as_array(values: Any, dtype, name: str) -> np.ndarray:
    return _checks.int_array(values, dtype, name)


def _inputs(sizes, firsts, lasts):
    sizes_a = _as_array(sizes, np.uint64, "sizes")
    firsts_a = _as_array(firsts, np.int64, "firsts")
    lasts_a = _as_array(lasts, np.int64, "lasts")
    n = len(sizes_a)
    if len(firsts_a) != n or len(lasts_a) != n:
        raise ValueError(
            f"sizes, firsts and lasts must have one length, got {n}, {len(firsts_a)}, {len(lasts_a)}"
        )
    return n, sizes_a, firsts_a, lasts_a


def _p(array: Optional[np.ndarray], ptype):
    return None if array is None else array.ctypes.data_as(ptype)


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
    The call runs in C without the GIL and is deterministic.
    """
    n, sizes_a, firsts_a, lasts_a = _inputs(sizes, firsts, lasts)
    opts = _options(alignment, inclusive, time_limit, capacity)
    fixed_a = None
    if fixed_offsets is not None:
        fixed_a = _as_array(fixed_offsets, np.int64, "fixed_offsets")
        if len(fixed_a) != n:
            raise ValueError(f"fixed_offsets has {len(fixed_a)} entries for {n} tensors")
    offsets = np.zeros(n, dtype=np.uint64)
    result = _ffi.PlanResult()
    lib.lshm_plan(
        n,
        _p(sizes_a, _u64_p),
        _p(firsts_a, _i64_p),
        _p(lasts_a, _i64_p),
        _p(fixed_a, _i64_p),
        ctypes.byref(opts),
        _p(offsets, _u64_p),
        ctypes.byref(result),
    )
    return _plan_from_result(offsets, result, int(opts.alignment), inclusive)


def _plan_from_result(
    offsets: np.ndarray, result: _ffi.PlanResult, alignment: int, inclusive: bool
) -> Plan:
    """A :class:`Plan` from the C library's lshm_plan_result (shared with pyshm.arena)."""
    return Plan(
        offsets=offsets,
        arena_size=int(result.arena_size),
        lower_bound=int(result.lower_bound),
        strategy=result.strategy.decode("utf-8", "replace"),
        optimal=bool(result.optimal),
        seconds=float(result.seconds),
        alignment=alignment,
        inclusive=inclusive,
    )


def lower_bound(
    sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int], *,
    alignment: int = 64, inclusive: bool = False,
) -> int:
    """The most bytes live at one time (sizes rounded up to ``alignment``)."""
    n, sizes_a, firsts_a, lasts_a = _inputs(sizes, firsts, lasts)
    opts = _options(alignment, inclusive, 0.0)
    out = ctypes.c_uint64()
    lib.lshm_plan_lower_bound(
        n, _p(sizes_a, _u64_p), _p(firsts_a, _i64_p), _p(lasts_a, _i64_p),
        ctypes.byref(opts), ctypes.byref(out),
    )
    return int(out.value)


def validate(
    sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int], offsets: Sequence[int],
    arena_size: int, *, alignment: int = 1, inclusive: bool = False,
) -> None:
    """Raise :class:`ValueError` naming the first overlapping or misaligned tensor, if any."""
    n, sizes_a, firsts_a, lasts_a = _inputs(sizes, firsts, lasts)
    offsets_a = _as_array(offsets, np.uint64, "offsets")
    if len(offsets_a) != n:
        raise ValueError(f"offsets has {len(offsets_a)} entries for {n} tensors")
    opts = _options(alignment, inclusive, 0.0)
    lib.lshm_plan_validate(
        n, _p(sizes_a, _u64_p), _p(firsts_a, _i64_p), _p(lasts_a, _i64_p),
        _p(offsets_a, _u64_p), ctypes.byref(opts), _checks.uint64(arena_size, "arena_size"),
    )


def read_trace(path: str):
    """Read a trace CSV ``id,lower,upper,size[,...]`` into (ids, sizes, firsts, lasts).

    Every value is checked as it is read (``size`` in [0, 2**64), ``lower`` and ``upper`` in
    int64, ``lower <= upper``): a bad one is a :class:`ValueError` naming the file and line.
    """
    ids, sizes, firsts, lasts, _ = _read_trace(path)
    return ids, sizes, firsts, lasts


def _read_trace(path: str):
    """read_trace, plus the file's line number of each tensor (for error messages)."""
    ids, sizes, firsts, lasts, lines = [], [], [], [], []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
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
