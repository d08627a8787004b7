"""The workloads of ``python -m pyshm bench``: how each method's arrays are filled and checked
(identical for every method, so that none is timed doing less work)."""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from .. import demo

FRAME_SHAPE = demo.FRAME_SHAPE
FRAME_BYTES = demo.FRAME_BYTES
SMALL_BYTES = 4096
BIG_ROW = 1 << 16  # the big array is filled row by row with one 64 KiB pattern
BIG_MARK = 1 << 20  # and a counter byte every MiB


@functools.lru_cache(maxsize=None)
def _frame_pattern(index: int) -> np.ndarray:
    pattern = demo._pattern(index)
    pattern.flags.writeable = False
    return pattern


def fill_frame(view: np.ndarray, index: int) -> None:
    """The bytes of ``demo.build`` (its pattern cached here, so no method pays for making it)."""
    demo.fill_frame(view, _frame_pattern(index), index)


def check_frame(view: np.ndarray, index: int) -> None:
    pattern = _frame_pattern(index)
    ok = (np.array_equal(view[:, 0, 0], demo.frame_corner(index))
          and np.array_equal(view[0, -1], pattern[-1])
          and np.array_equal(view[FRAME_SHAPE[0] // 2, FRAME_SHAPE[1] // 2],
                             pattern[FRAME_SHAPE[1] // 2])
          and np.array_equal(view[-1, 1:, -1], pattern[1:, -1]))
    if not ok:
        raise AssertionError(f"frame {index}: wrong bytes after sharing")


@functools.lru_cache(maxsize=1)
def _big_row() -> np.ndarray:
    row = np.ascontiguousarray(_frame_pattern(0).reshape(-1)[:BIG_ROW])
    row.flags.writeable = False
    return row


def _big_marks(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes // BIG_MARK) % 251).astype(np.uint8)


def fill_big(view: np.ndarray, index: int) -> None:
    view.reshape(-1, BIG_ROW)[:] = _big_row()
    view[::BIG_MARK] = _big_marks(view.nbytes)


def check_big(view: np.ndarray, index: int) -> None:
    row = _big_row()
    rows = view.nbytes // BIG_ROW
    ok = np.array_equal(view[::BIG_MARK], _big_marks(view.nbytes))
    for k in (0, rows // 3, rows // 2, rows - 1):
        ok = ok and np.array_equal(view[k * BIG_ROW + 1:(k + 1) * BIG_ROW], row[1:])
    if not ok:
        raise AssertionError("big array: wrong bytes after sharing")


@functools.lru_cache(maxsize=1)
def _small_table() -> np.ndarray:
    table = (np.arange(SMALL_BYTES + 256) % 256).astype(np.uint8)
    table.flags.writeable = False
    return table


def fill_small(view: np.ndarray, index: int) -> None:
    start = index % 251
    view[:] = _small_table()[start:start + SMALL_BYTES]


def check_small(view: np.ndarray, index: int) -> None:
    start = index % 251
    table = _small_table()
    for k in (0, SMALL_BYTES // 2, SMALL_BYTES - 1):
        if view[k] != table[start + k]:
            raise AssertionError(f"4 KiB array {index}: wrong bytes after sharing")


class Workload:
    """``count`` arrays of ``shape`` (uint8), filled and checked the same way for every method."""

    def __init__(self, key: str, title: str, shape: tuple, count: int,
                 fill: Callable, check: Callable, per_share: bool = False) -> None:
        self.key = key
        self.title = title
        self.shape = shape
        self.count = count
        self.fill = fill
        self.check = check
        self.per_share = per_share  # report microseconds per share call
        self.item_bytes = int(np.prod(shape))

    @property
    def nbytes(self) -> int:
        return self.count * self.item_bytes
