#!/usr/bin/env python3
"""What the per-call figures in pyshm's comments were measured with: the binding's costs.

Each case times the alternatives a comment weighs, interleaved in one process, and prints the
min and median microseconds per call over `--repeat` rounds of `--number` calls:

  gil       an O(1) accessor (lshm_storage_flags) through ctypes.PyDLL (GIL kept) and through
            ctypes.CDLL (GIL released and retaken): pyshm/_ffi.py, _GIL_HELD
  typed     the same call given a typed handle, a bare int through c_void_p, and a c_void_p
            subclass whose from_param checks the type in Python: _ffi.py, Opaque
  errcheck  a call (lshm_abi_value) with and without the errcheck that turns -errno into an
            exception: _ffi.py, share_unchecked
  convert   lshm_storage_create_view refused at once (NULL segment), its two 64-bit
            arguments declared c_void_p and c_uint64: _ffi.py, _create_view
  release   an object released by a bare weak-reference callback (an ArrayOwner's), through
            HandleLifetime._release_with, and by weakref.finalize: pyshm/_memory.py
  address   an array's data pointer read at its offset and through __array_interface__:
            _memory.py, data_address
  peers     a peer's uids: one sock_diag lookup, one read of /proc/net/tcp and tcp6:
            pyshm/engines.py, _peer_uids (_diag_uids, _table_uids)

    PYTHONPATH=. python3 tools/bench_binding.py                 # every case
    PYTHONPATH=. python3 tools/bench_binding.py gil typed --repeat 9

Library: $PYSHM_LIBRARY, else the one pyshm finds. Run it alone: the machine's noise is
larger than some of these differences.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys
import timeit
import weakref

import numpy as np

from pyshm import _ffi, _memory, engines


def storage() -> _ffi.StorageHandle:
    handle = _ffi.StorageHandle()
    _memory.create(handle, 4096, False)
    return handle


def case_gil():
    handle = storage()
    cdll = ctypes.CDLL(_ffi.LIBRARY_PATH)
    released = cdll.lshm_storage_flags
    released.restype, released.argtypes = ctypes.c_uint, [_ffi.StorageHandle]
    kept = _ffi.lib.lshm_storage_flags
    return {"PyDLL (GIL kept)": lambda: kept(handle),
            "CDLL (GIL released)": lambda: released(handle)}


def case_typed():
    handle = storage()
    flags = _ffi.lib.lshm_storage_flags
    untyped = ctypes.PyDLL(_ffi.LIBRARY_PATH).lshm_storage_flags
    untyped.restype, untyped.argtypes = ctypes.c_uint, [ctypes.c_void_p]

    class Checked(ctypes.c_void_p):
        @classmethod
        def from_param(cls, value):
            if not isinstance(value, _ffi.StorageHandle):
                raise TypeError("a storage handle")
            return ctypes.c_void_p(_ffi.address(value))

    checked = ctypes.PyDLL(_ffi.LIBRARY_PATH).lshm_storage_flags
    checked.restype, checked.argtypes = ctypes.c_uint, [Checked]
    address = _ffi.address(handle)
    return {"typed handle": lambda: flags(handle), "c_void_p int": lambda: untyped(address),
            "Python from_param": lambda: checked(handle)}


def case_errcheck():
    value = ctypes.c_uint64()
    calls = {}
    for label, errcheck in (("no errcheck", None), ("errcheck", _ffi._check_status)):
        func = ctypes.PyDLL(_ffi.LIBRARY_PATH).lshm_abi_value  # (0 from a table lookup)
        func.restype, func.argtypes = ctypes.c_int, [ctypes.c_char_p, _ffi.U64Pointer]
        if errcheck is not None:
            func.errcheck = errcheck
        calls[label] = functools.partial(func, b"LSHM_STORAGE_SHARED", ctypes.byref(value))
    return calls


def case_convert():
    out = _ffi.StorageHandle()
    calls = {}
    for name, kind in (("c_void_p", ctypes.c_void_p), ("c_uint64", ctypes.c_uint64)):
        func = ctypes.PyDLL(_ffi.LIBRARY_PATH).lshm_storage_create_view
        func.restype = ctypes.c_int
        func.argtypes = [_ffi.SegmentHandle, kind, kind, ctypes.c_uint,
                         ctypes.POINTER(_ffi.StorageHandle)]
        calls[name] = functools.partial(func, None, 4096, 8192, 0, ctypes.byref(out))
    return calls


def case_release():
    class Owner:
        __slots__ = ("__weakref__",)

    keep = {}

    def callback(ref):
        keep.pop(ref, None)

    def bare():
        owner = Owner()
        keep[weakref.ref(owner, callback)] = None
        del owner

    def finalized():
        owner = Owner()
        weakref.finalize(owner, keep.get, None)
        del owner

    class Lifetime(_memory.HandleLifetime):
        __slots__ = ()

    def lifetime():
        owner = Lifetime()
        owner._release_with(keep.get, None)
        del owner

    return {"weak-reference callback": bare, "HandleLifetime": lifetime,
            "weakref.finalize": finalized}


def case_address():
    array = np.zeros(16, np.uint8)
    return {"data_address": lambda: _memory.data_address(array),
            "__array_interface__": lambda: array.__array_interface__["data"][0]}


def case_peers():
    def lookup():
        engines._diag_uids("127.0.0.1", 1)

    def read():
        engines._table_uids("127.0.0.1", 1)

    return {"sock_diag lookup": lookup, "/proc/net/tcp{,6} read": read}


CASES = {name[5:]: func for name, func in globals().items() if name.startswith("case_")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", choices=[*CASES, []], help="default: every case")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--number", type=int, default=0, help="calls per round (0: auto)")
    args = parser.parse_args(argv)
    for name in args.cases or CASES:
        methods = CASES[name]()
        number = args.number or (20 if name == "peers" else 20000)
        times: dict = {label: [] for label in methods}
        for _ in range(args.repeat):  # interleaved: each round runs every method once
            for label, call in methods.items():
                times[label].append(timeit.timeit(call, number=number) / number * 1e6)
        for label, rounds in times.items():
            print(f"{name:9} {label:26} min {min(rounds):9.3f} us  "
                  f"median {statistics.median(rounds):9.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
