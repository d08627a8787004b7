"""Checked conversions of Python values into the C types libshm takes.

ctypes converts a Python int to ``size_t``, ``uint64_t``, ``int64_t`` or ``int`` by truncation
(``2**32 + 3`` passed as an ``int`` fd is fd 3, ``-1`` as a ``uint64_t`` is ``2**64 - 1``) and
numpy converts ``1e30`` to ``uint64`` as 0 with only a RuntimeWarning. Every number a pyshm
wrapper hands to C goes through one of these functions first, so that such values are a clear
error before the call, never a wrap-around:

* not an integer where one is needed (a float, even ``3.0``, a string, a bool): TypeError;
* below the type's range: ValueError for unsigned types ("must be >= 0"), OverflowError for
  signed ones; above it: OverflowError;
* arrays (the planner's inputs): ValueError for non-integral, NaN, infinite or negative values
  (unsigned), OverflowError for values out of range, TypeError for non-numeric dtypes.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import operator
from typing import Any

import numpy as np

__all__ = [
    "integer",
    "size_t",
    "uint64",
    "int64",
    "c_int",
    "fd",
    "seconds",
    "int_array",
    "SIZE_MAX",
    "UINT64_MAX",
    "INT64_MIN",
    "INT64_MAX",
]

SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
UINT64_MAX = (1 << 64) - 1
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
INT_MIN = -(1 << (8 * ctypes.sizeof(ctypes.c_int) - 1))
INT_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)) - 1


def integer(value: Any, name: str, lo: int, hi: int, ctype: str = "") -> int:
    """``value`` as a Python int in ``[lo, hi]``, else TypeError/ValueError/OverflowError."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    where = f" (a C {ctype})" if ctype else ""
    if result < lo:
        if lo == 0:
            raise ValueError(f"{name} must be >= 0, got {result}")
        raise OverflowError(f"{name} {result} is below {lo}, the smallest value{where} allowed")
    if result > hi:
        raise OverflowError(f"{name} {result} is above {hi}, the largest value{where} allowed")
    return result


def size_t(value: Any, name: str) -> int:
    return integer(value, name, 0, SIZE_MAX, "size_t")


def uint64(value: Any, name: str) -> int:
    return integer(value, name, 0, UINT64_MAX, "uint64_t")


def int64(value: Any, name: str) -> int:
    return integer(value, name, INT64_MIN, INT64_MAX, "int64_t")


def c_int(value: Any, name: str) -> int:
    return integer(value, name, INT_MIN, INT_MAX, "int")


def fd(value: Any, name: str = "fd") -> int:
    """A file descriptor: an int in [0, INT_MAX]."""
    return integer(value, name, 0, INT_MAX, "int")


def flag(value: Any, name: str) -> bool:
    """True or False (numpy's bools and the ints 0 and 1 too): a string such as "no", which
    reads as true, is a TypeError."""
    if not isinstance(value, (bool, np.bool_, numbers.Integral)) or value not in (True, False):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def seconds(value: Any, name: str) -> float:
    """A finite real number >= 0, as a float (a C double)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    result = float(value)
    if not math.isfinite(result) or result < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {result}")
    return result


def _element(value: Any, name: str, lo: int, hi: int, ctype: str) -> int:
    """One element of an object array: an integer, or a float holding an integer."""
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{name} must be an integer, got {value}")
        value = int(value)
    return integer(value, name, lo, hi, ctype)


_RANGES = {
    np.dtype(np.uint64): (0, UINT64_MAX),
    np.dtype(np.int64): (INT64_MIN, INT64_MAX),
}


def int_array(values: Any, dtype: Any, name: str) -> np.ndarray:
    """A one-dimensional, C-contiguous array of ``dtype`` (uint64 or int64) holding exactly
    the integers in ``values``, checked element by element before any conversion."""
    dtype = np.dtype(dtype)
    lo, hi = _RANGES[dtype]
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=dtype)
    kind = array.dtype.kind
    if kind == "f" and not isinstance(values, np.ndarray):
        # a list mixing ints and floats, or ints beyond int64 and uint64 at once, became
        # float64 and lost digits: check the original elements instead
        kind, array = "O", np.array(values, dtype=object)
    if kind in "iu":
        # exact comparisons: numpy compares mixed signed/unsigned integers by value
        low, high = array.min(), array.max()
        if int(low) < lo:
            if lo == 0:
                raise ValueError(f"{name} must be >= 0, got {int(low)}")
            raise OverflowError(f"{name}: {int(low)} is below {lo}")
        if int(high) > hi:
            raise OverflowError(f"{name}: {int(high)} is above {hi}, the largest {dtype} value")
        return np.ascontiguousarray(array, dtype=dtype)
    if kind == "f":
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{name} must hold integers, got {array[~np.isfinite(array)][0]}")
        if not np.all(np.equal(np.mod(array, 1), 0)):
            raise ValueError(f"{name} must hold integers")
        if lo == 0 and np.any(array < 0):
            raise ValueError(f"{name} must be >= 0")
        # float(hi + 1) is a power of two, exact in binary floating point
        if np.any(array < float(lo)) or np.any(array >= float(hi + 1)):
            raise OverflowError(f"{name}: a value does not fit in {dtype}")
        return np.ascontiguousarray(array, dtype=dtype)
    if kind == "O":
        checked = [_element(v, f"{name}[{i}]", lo, hi, str(dtype)) for i, v in enumerate(array)]
        return np.array(checked, dtype=dtype)
    raise TypeError(f"{name} must hold integers, got an array of {array.dtype}")
