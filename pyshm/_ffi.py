"""The one binding table of pyshm: loads liblshm and declares every C function once.

Where the library comes from, in order:

1. ``PYSHM_LIBRARY=/path/to/liblshm.so`` in the environment (another build, a debug copy);
2. the copy installed inside this package (found with :mod:`importlib.resources`, which also
   works for meson-python editable installs).

The library is loaded with :class:`ctypes.CDLL`, so every call that copies, maps or makes a
syscall releases the GIL for its whole duration: copies into shared memory issued from several
Python threads run in parallel. The few O(1) accessors in ``_GIL_HELD`` (a field read, an atomic
increment; no lock, no syscall, no callback) are called through a :class:`ctypes.PyDLL` handle on
the same library instead, which keeps the GIL: releasing and retaking it would cost more than
the call (0.55 us a call through CDLL against 0.37 through PyDLL, min times of
``tools/bench_binding.py gil``), and they run once per array pickled or received. Three more
there make a few system calls on one memfd that never block: the channel's, which would wait a
switch interval to take the GIL back whenever another thread runs Python. Functions that
return an ``int`` status get an ``errcheck`` that turns a negative errno into the matching
exception (see :func:`raise_for`), carrying the library's thread-local message, which is read in
the same thread right after the call.

Handles are typed: each opaque struct of lshm.h has its pointer type here (``StorageHandle``,
``SegmentHandle``, ``ArenaHandle``, ``ArenaBufferHandle``), every function is declared with the
ones it takes, and ctypes refuses any other kind, or a bare address, with
:class:`ctypes.ArgumentError` before the call. Two handles on one storage are two objects:
:func:`address` gives the identity.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import importlib.metadata
import importlib.resources
import os
import re
import struct
import threading
from ctypes import (
    POINTER,
    c_char,
    c_char_p,
    c_double,
    c_int,
    c_int64,
    c_size_t,
    c_uint,
    c_uint64,
    c_void_p,
)
from typing import Optional

__all__ = [
    "lib",
    "LIBRARY_PATH",
    "ShmError",
    "ShmMemoryError",
    "ShmValueError",
    "ShmBufferError",
    "ShmPermissionError",
    "raise_for",
    "PlanOptions",
    "PlanResult",
    "STORAGE_RESIZABLE",
    "STORAGE_SHARED",
    "STORAGE_READONLY",
    "STORAGE_INPLACE",
    "PLAN_INCLUSIVE",
]

LIBRARY_NAME = "liblshm.so"


def _header_version() -> tuple:
    """(major, minor) of the lshm.h this binding mirrors, as its LSHM_VERSION_* macros state
    them (the one place the version is written): the header installed in pyshm/include, or
    libshm/include in a source tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    for header in (os.path.join(here, "include", "lshm.h"),
                   os.path.join(here, os.pardir, "libshm", "include", "lshm.h")):
        try:
            with open(header) as file:
                text = file.read()
        except OSError:
            continue
        numbers = []
        for part in ("MAJOR", "MINOR"):
            found = re.search(rf"^#define LSHM_VERSION_{part} (\d+)$", text, re.MULTILINE)
            if found is None:
                raise ImportError(f"pyshm: {header} has no line '#define LSHM_VERSION_{part} "
                                  "<digits>'")
            numbers.append(int(found.group(1)))
        return tuple(numbers)
    raise ImportError(f"pyshm: no lshm.h in {here}/include (nor a source tree's libshm/include): "
                      "reinstall pyshm with 'python -m pip install .'")


# the ABI this binding mirrors (0.y minors may change it)
EXPECTED_VERSION_MAJOR, EXPECTED_VERSION_MINOR = _header_version()

STORAGE_RESIZABLE = 0x1
STORAGE_SHARED = 0x2
STORAGE_READONLY = 0x4
STORAGE_INPLACE = 0x8
PLAN_INCLUSIVE = 0x1


# --------------------------------------------------------------------------------------------
# Exceptions: every one is an OSError (errno, strerror) and also the Python category a user
# would catch for that kind of failure.
# --------------------------------------------------------------------------------------------


class ShmError(OSError):
    """A libshm call failed; ``errno`` is the error code, ``strerror`` the library's message."""


class ShmMemoryError(ShmError, MemoryError):
    """Out of memory or space (ENOMEM, ENOSPC): nothing was changed."""


class ShmValueError(ShmError, ValueError):
    """Invalid argument (EINVAL, EOVERFLOW, ERANGE): nothing was changed."""


class ShmBufferError(ShmError, BufferError):
    """The storage is in use in a way that forbids the operation (EBUSY)."""


class ShmPermissionError(ShmError, PermissionError):
    """Refused by seals or access mode (EPERM, EACCES)."""


_ERRNO_CLASSES = {
    _errno.ENOMEM: ShmMemoryError,
    _errno.ENOSPC: ShmMemoryError,
    _errno.EINVAL: ShmValueError,
    _errno.EOVERFLOW: ShmValueError,
    _errno.ERANGE: ShmValueError,
    _errno.EBUSY: ShmBufferError,
    _errno.EPERM: ShmPermissionError,
    _errno.EACCES: ShmPermissionError,
}


def raise_for(rc: int, what: str = "") -> None:
    """Raise the exception for a negative status ``rc`` (no-op for rc >= 0)."""
    if rc >= 0:
        return
    code = -rc
    detail = lib.lshm_last_error().decode("utf-8", "replace")
    message = lib.lshm_strerror(rc).decode("utf-8", "replace")
    text = f"{what}: {message}" if what else message
    if detail:
        text = f"{text} ({detail})"
    raise _ERRNO_CLASSES.get(code, ShmError)(code, text)


def _check_status(result: int, func, args):
    if result < 0:
        raise_for(result, func.__name__)
    return result


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _load() -> tuple[ctypes.CDLL, str]:
    override = os.environ.get("PYSHM_LIBRARY")
    if override:
        candidates = [override]
    else:
        resource = importlib.resources.files(__package__ or "pyshm") / LIBRARY_NAME
        candidates = [str(resource)] if resource.is_file() else []
    if not candidates:
        # Imported from a source checkout (e.g. `python -m pyshm` in the repository root puts
        # the source folder first on sys.path): use the library of the installed distribution,
        # whose version is checked below like any other.
        try:
            installed = importlib.metadata.distribution("pyshm").locate_file(
                f"pyshm/{LIBRARY_NAME}"
            )
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is not None and os.path.isfile(str(installed)):
            candidates = [str(installed)]
    if not candidates:
        raise ImportError(
            f"pyshm: {LIBRARY_NAME} is not inside the installed package. Install pyshm with "
            "'python -m pip install .' (it builds the library), or point PYSHM_LIBRARY at a "
            "built liblshm.so."
        )
    path = candidates[0]
    try:
        library = ctypes.CDLL(path, use_errno=True)
    except OSError as exc:
        raise ImportError(f"pyshm: could not load {path}: {exc}") from exc
    try:
        version = library.lshm_version
    except AttributeError:
        raise ImportError(f"pyshm: {path} is not liblshm (no lshm_version symbol)") from None
    version.restype = c_int
    version.argtypes = []
    found = version()
    if found // 10000 != EXPECTED_VERSION_MAJOR or found // 100 % 100 != EXPECTED_VERSION_MINOR:
        # (before 1.0 each minor version may change the ABI: only its own patch releases fit)
        raise ImportError(
            f"pyshm: {path} is libshm {found // 10000}.{found // 100 % 100}.{found % 100}; "
            f"this pyshm needs {EXPECTED_VERSION_MAJOR}.{EXPECTED_VERSION_MINOR}.x"
        )
    return library, path


lib, LIBRARY_PATH = _load()


class PlanOptions(ctypes.Structure):
    _fields_ = [
        ("alignment", c_uint64), ("flags", c_uint), ("time_limit", c_double),
        ("capacity", c_uint64),
    ]


class PlanResult(ctypes.Structure):
    _fields_ = [
        ("arena_size", c_uint64),
        ("lower_bound", c_uint64),
        ("optimal", c_int),
        ("strategy", c_char * 48),
        ("seconds", c_double),
    ]


class ArenaCounters(ctypes.Structure):
    """lshm_arena_counters: see lshm_arena_stats in lshm.h."""

    _fields_ = [
        ("managed_bytes", c_uint64),
        ("arena_bytes", c_uint64),
        ("lower_bound", c_uint64),
        ("storages", c_uint64),
        ("reuse_count", c_uint64),
        ("fallback_count", c_uint64),
        ("iterations", c_uint64),
        ("replans", c_uint64),
    ]


ARENA_SHARED = 0x1

# lshm.h: LSHM_SLAB_MAX_BYTES, LSHM_SLAB_BYTES
SLAB_MAX_BYTES = 64 << 10
SLAB_BYTES = 4 << 20


class ExportInfo(ctypes.Structure):
    """lshm_export_info (lshm.h)."""

    _fields_ = [
        ("fd", c_int),
        ("offset", c_uint64),
        ("dev", c_uint64),
        ("ino", c_uint64),
        ("file_size", c_uint64),
        ("readonly", c_int),
        ("flags", c_uint),
        ("data", c_void_p),
        ("nbytes", c_size_t),
    ]


class SlabCounters(ctypes.Structure):
    """lshm_slab_counters (lshm.h)."""

    _fields_ = [
        ("slabs", c_uint64),
        ("memfds", c_uint64),
        ("storages", c_uint64),
    ]

# The library's four opaque types. A handle is a ctypes pointer to one of them, so a handle of
# one kind passed where another is expected (or a bare int) is refused by ctypes itself with
# ctypes.ArgumentError. ctypes checks the type in C: 0.49 us a call against 0.26 for a c_void_p
# int, and 0.88 for a Python from_param check (lshm_storage_flags through PyDLL, min times of
# tools/bench_binding.py typed). Handles compare by object, not by address: use address().
class Opaque(ctypes.Structure):
    """The base of the library's opaque structs: no fields, no size, never made by value."""


class lshm_storage(Opaque):
    """Opaque (lshm.h): only ever behind a StorageHandle."""


class lshm_segment(Opaque):
    """Opaque (lshm.h): only ever behind a SegmentHandle."""


class lshm_arena(Opaque):
    """Opaque (lshm.h): only ever behind an ArenaHandle."""


class lshm_arena_buffer(Opaque):
    """Opaque (lshm.h): only ever behind an ArenaBufferHandle."""


StorageHandle = POINTER(lshm_storage)
SegmentHandle = POINTER(lshm_segment)
ArenaHandle = POINTER(lshm_arena)
ArenaBufferHandle = POINTER(lshm_arena_buffer)
_addressof = ctypes.addressof


def address(handle) -> int:
    """The address a handle points to (0 for NULL or None): what identifies a storage, a
    segment, an arena or a buffer."""
    return _addressof(handle.contents) if handle else 0


U64Pointer = POINTER(c_uint64)
I64Pointer = POINTER(c_int64)


def _declare(name: str, restype, argtypes, status: bool = False) -> None:
    func = getattr(lib, name)
    func.restype = restype
    func.argtypes = argtypes
    if status:
        func.errcheck = _check_status


# (name, restype, argtypes, returns a status to check)
_TABLE = [
    # version and errors
    ("lshm_version", c_int, [], False),
    ("lshm_version_string", c_char_p, [], False),
    ("lshm_abi_value", c_int, [c_char_p, U64Pointer], True),
    ("lshm_strerror", c_char_p, [c_int], False),
    ("lshm_err_name", c_char_p, [c_int], False),
    ("lshm_last_error", c_char_p, [], False),
    ("lshm_page_size", c_size_t, [], False),
    # storages
    ("lshm_storage_sizeof", c_size_t, [], False),
    ("lshm_storage_alignof", c_size_t, [], False),
    ("lshm_storage_create", c_int, [c_size_t, c_void_p, c_uint, POINTER(StorageHandle)], True),
    (
        "lshm_storage_create_foreign",
        c_int,
        [c_void_p, c_size_t, c_void_p, c_void_p, c_uint, POINTER(StorageHandle)],
        True,
    ),
    ("lshm_storage_retain", StorageHandle, [StorageHandle], False),
    ("lshm_storage_release", None, [StorageHandle], False),
    ("lshm_storage_refcount", c_size_t, [StorageHandle], False),
    ("lshm_storage_data", c_void_p, [StorageHandle], False),
    ("lshm_storage_nbytes", c_size_t, [StorageHandle], False),
    ("lshm_storage_flags", c_uint, [StorageHandle], False),
    ("lshm_storage_fd", c_int, [StorageHandle, POINTER(c_int), U64Pointer], True),
    ("lshm_storage_export", c_int, [StorageHandle, POINTER(ExportInfo)], True),
    ("lshm_storage_resize", c_int, [StorageHandle, c_size_t], True),
    ("lshm_storage_copy", c_int, [StorageHandle, StorageHandle], True),
    # sharing
    ("lshm_storage_create_shared", c_int, [c_size_t, c_uint, POINTER(StorageHandle)], True),
    ("lshm_storage_share", c_int, [StorageHandle], True),
    # (no errcheck: its -EOPNOTSUPP is an answer, see reduction._share_for_sending)
    ("lshm_storage_share_fenced", c_int, [StorageHandle], False),
    (
        "lshm_storage_attach",
        c_int,
        [c_int, c_uint64, c_size_t, c_uint, POINTER(StorageHandle)],
        True,
    ),
    # segments
    ("lshm_segment_create", c_int, [c_size_t, c_uint, POINTER(SegmentHandle)], True),
    ("lshm_segment_attach", c_int, [c_int, c_uint, POINTER(SegmentHandle)], True),
    ("lshm_segment_retain", SegmentHandle, [SegmentHandle], False),
    ("lshm_segment_release", None, [SegmentHandle], False),
    ("lshm_segment_data", c_void_p, [SegmentHandle], False),
    ("lshm_segment_size", c_size_t, [SegmentHandle], False),
    ("lshm_segment_fd", c_int, [SegmentHandle, POINTER(c_int)], True),
    ("lshm_segment_flags", c_uint, [SegmentHandle], False),
    ("lshm_segment_close_fd", c_int, [SegmentHandle], True),
    ("lshm_segment_seal_readonly", c_int, [SegmentHandle], True),
    (
        "lshm_storage_create_view",
        c_int,
        [SegmentHandle, c_uint64, c_size_t, c_uint, POINTER(StorageHandle)],
        True,
    ),
    ("lshm_storage_segment", SegmentHandle, [StorageHandle], False),
    # planner
    ("lshm_plan_options_init", None, [POINTER(PlanOptions)], False),
    (
        "lshm_plan",
        c_int,
        [
            c_size_t,
            U64Pointer,
            I64Pointer,
            I64Pointer,
            I64Pointer,
            POINTER(PlanOptions),
            U64Pointer,
            POINTER(PlanResult),
        ],
        True,
    ),
    ("lshm_plan_interrupt", c_int, [POINTER(PlanOptions)], True),
    (
        "lshm_plan_validate",
        c_int,
        [c_size_t, U64Pointer, I64Pointer, I64Pointer, U64Pointer, POINTER(PlanOptions), c_uint64],
        True,
    ),
    (
        "lshm_plan_lower_bound",
        c_int,
        [c_size_t, U64Pointer, I64Pointer, I64Pointer, POINTER(PlanOptions), U64Pointer],
        True,
    ),
    # arena
    (
        "lshm_arena_create",
        c_int,
        [c_size_t, U64Pointer, I64Pointer, I64Pointer, POINTER(PlanOptions), c_uint,
         POINTER(ArenaHandle)],
        True,
    ),
    (
        "lshm_arena_create_recording",
        c_int,
        [POINTER(PlanOptions), c_uint, POINTER(ArenaHandle)],
        True,
    ),
    ("lshm_arena_destroy", c_int, [ArenaHandle], True),
    ("lshm_arena_allocate", c_int, [ArenaHandle], True),
    ("lshm_arena_deallocate", c_int, [ArenaHandle], True),
    ("lshm_arena_trim", c_int, [ArenaHandle], True),
    ("lshm_arena_count", c_size_t, [ArenaHandle], False),
    ("lshm_arena_storage", c_int, [ArenaHandle, c_size_t, POINTER(StorageHandle)], True),
    ("lshm_arena_offset", c_int, [ArenaHandle, c_size_t, U64Pointer], True),
    ("lshm_arena_data", c_void_p, [ArenaHandle], False),
    ("lshm_arena_size", c_uint64, [ArenaHandle], False),
    ("lshm_arena_fd", c_int, [ArenaHandle, POINTER(c_int)], True),
    ("lshm_arena_current_buffer", c_int, [ArenaHandle, POINTER(ArenaBufferHandle)], True),
    ("lshm_arena_buffer_retain", ArenaBufferHandle, [ArenaBufferHandle], False),
    ("lshm_arena_buffer_release", None, [ArenaBufferHandle], False),
    ("lshm_arena_buffer_data", c_void_p, [ArenaBufferHandle], False),
    ("lshm_arena_buffer_size", c_size_t, [ArenaBufferHandle], False),
    ("lshm_arena_stats", c_int, [ArenaHandle, POINTER(ArenaCounters)], True),
    ("lshm_arena_interrupt", c_int, [ArenaHandle], True),
    ("lshm_arena_plan_result", c_int, [ArenaHandle, POINTER(PlanResult)], True),
    ("lshm_arena_alloc", c_int, [ArenaHandle, c_size_t, POINTER(StorageHandle)], True),
    ("lshm_arena_free", c_int, [ArenaHandle, StorageHandle], True),
    ("lshm_arena_end_iteration", c_int, [ArenaHandle], True),
    ("lshm_storage_seal_readonly", c_int, [StorageHandle], True),
    ("lshm_storage_share_readonly", c_int, [StorageHandle], True),
    ("lshm_slab_stats", c_int, [POINTER(SlabCounters)], True),
    (
        "lshm_slab_find",
        c_int,
        [c_uint64, c_uint64, c_uint64, c_size_t, POINTER(StorageHandle)],
        True,
    ),
    ("lshm_slab_knows", c_int, [c_uint64, c_uint64], False),
    ("lshm_pool_trim", c_int, [], False),
]

# O(1), lock-free and syscall-free in libshm (see the module docstring): called with the GIL held
_GIL_HELD = frozenset({
    "lshm_storage_retain",
    "lshm_storage_refcount",
    "lshm_storage_data",
    "lshm_storage_nbytes",
    "lshm_storage_flags",
    "lshm_storage_segment",
    "lshm_segment_retain",
    "lshm_segment_data",
    "lshm_segment_size",
    "lshm_segment_flags",
    # Not syscall-free, but a few system calls on one memfd that never block (fstat, fcntl,
    # dup, mmap without populating, close) and no lock: the channel's calls for each memfd it
    # hands out or receives. A thread that releases the GIL waits a switch interval (5 ms) to
    # take it back whenever another thread runs Python, so these keep it (see
    # _channel._HeldCalls).
    "lshm_storage_fd",
    "lshm_segment_attach",
    "lshm_segment_close_fd",
})

for _name, _restype, _argtypes, _status in _TABLE:
    _declare(_name, _restype, _argtypes, _status)

_pylib = ctypes.PyDLL(LIBRARY_PATH)  # the same loaded library: dlopen returns its handle
for _name, _restype, _argtypes, _status in _TABLE:
    if _name in _GIL_HELD:
        _func = _pylib[_name]
        _func.restype, _func.argtypes = _restype, _argtypes
        if _status:
            _func.errcheck = _check_status
        setattr(lib, _name, _func)


def gil_held(name: str):
    """libshm's function `name` as a ctypes function that keeps the GIL through the call (no
    other thread runs Python meanwhile, nor forks) and returns its status unchecked."""
    for table_name, restype, argtypes, _ in _TABLE:
        if table_name == name:
            func = _pylib[name]  # (a new function object: the one in lib is untouched)
            func.restype, func.argtypes = restype, argtypes
            return func
    raise KeyError(name)


# lshm_storage_share without the errcheck, for callers that check the status themselves (the
# in-place share of a 4 KiB array takes 8.8 us, the "4 KiB" case of python -m pyshm bench
# --cases small, and the errcheck's Python frame adds 0.13 us: tools/bench_binding.py errcheck)
share_unchecked = lib["lshm_storage_share"]
share_unchecked.restype, share_unchecked.argtypes = c_int, [StorageHandle]
# The two calls of the channel's hot paths (once per array received, once per array sent),
# with the GIL held (a malloc; at most an fstat and two fcntl calls on a memfd, which never
# block) and no errcheck. lshm_storage_export fills one module-level out-struct: _OUT_LOCK is
# held from the call until its result is read (another thread may run in between); the view
# made by lshm_storage_create_view goes into a handle of its own.
_OUT_LOCK = threading.Lock()


def _new_out_lock_in_child() -> None:
    global _OUT_LOCK
    _OUT_LOCK = threading.Lock()  # (a thread that held it at the fork is not in the child)


os.register_at_fork(after_in_child=_new_out_lock_in_child)

# lshm_storage_create_view: its uint64_t/size_t arguments as c_void_p (on LP64 Linux both are
# one 64-bit register, and the call takes 1.26 us with c_void_p arguments, 1.58 with c_uint64:
# tools/bench_binding.py convert)
_create_view = _pylib["lshm_storage_create_view"]
_create_view.restype = c_int
_create_view.argtypes = [SegmentHandle, c_void_p, c_void_p, c_uint, POINTER(StorageHandle)]
_byref = ctypes.byref
assert ctypes.sizeof(c_void_p) == ctypes.sizeof(c_uint64) == ctypes.sizeof(c_size_t)


def create_view(segment: SegmentHandle, offset: int, nbytes: int, flags: int,
                out: Optional[StorageHandle] = None) -> StorageHandle:
    """lshm_storage_create_view for ints in [0, 2**63) (checked by the caller): the new view;
    raises as the errcheck would. `out`: the (NULL) handle the view goes into, in place, so
    that a caller that holds it before the call loses no view to a KeyboardInterrupt as the
    call returns; a new one if None."""
    view = StorageHandle() if out is None else out
    rc = _create_view(segment, offset, nbytes, flags, _byref(view))
    if rc < 0:
        raise_for(rc, "lshm_storage_create_view")
    return view


# lshm_storage_export, read in one unpack instead of nine field reads
_export = _pylib["lshm_storage_export"]
_export.restype = c_int
_export.argtypes = [StorageHandle, POINTER(ExportInfo)]
_export_info = ExportInfo()
_export_info_ref = ctypes.byref(_export_info)
EXPORT_LAYOUT = struct.Struct("@iQQQQiIPN")
assert EXPORT_LAYOUT.size == ctypes.sizeof(ExportInfo) and [
    getattr(ExportInfo, name).offset for name, _ in ExportInfo._fields_
] == [0, 8, 16, 24, 32, 40, 44, 48, 56]


def export(handle: StorageHandle) -> tuple:
    """(status of lshm_storage_export(handle), its lshm_export_info as a tuple: fd, offset, dev,
    ino, file_size, readonly, flags, data, nbytes); -ENODATA ("not shared yet") is an answer
    there, not an error, so nothing raises."""
    with _OUT_LOCK:
        rc = _export(handle, _export_info_ref)
        return rc, EXPORT_LAYOUT.unpack_from(_export_info)

# lshm_slab_find without the errcheck: "not one of ours" (-ENOENT) is an answer for a receiver,
# not an error worth an exception
slab_find_unchecked = lib["lshm_slab_find"]
slab_find_unchecked.restype = c_int
slab_find_unchecked.argtypes = [c_uint64, c_uint64, c_uint64, c_size_t, POINTER(StorageHandle)]
