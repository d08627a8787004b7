"""numpy arrays backed by libshm storages, and sharing them in place.

Every array made here is an ordinary :class:`numpy.ndarray` built with ``numpy.asarray(owner)``
where ``owner`` is an :class:`ArrayOwner`: it publishes the storage's pointer through
``__array_interface__`` and holds its own reference to the C storage, so the array's ``.base``
chain keeps the memory alive for as long as any view of it exists, whatever happens to the
:class:`~pyshm.Storage` handle the user holds.
"""

from __future__ import annotations

import ctypes
import math
import operator
import sys
import weakref
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _checks, _ffi
from ._ffi import lib
from .storage import Storage, _create, _share_in_place

__all__ = [
    "ArrayOwner",
    "empty",
    "zeros",
    "copy",
    "share_memory_",
    "is_shared",
    "storage_of",
]

ShapeLike = Union[int, Sequence[int]]


# typestr of the plain dtypes seen (no fields, no subarray: typestr says all of them), as
# dtype.str builds a new string every time
_TYPESTRS: dict = {}


# ArrayOwner weak reference -> the C reference it holds. The reference is given back by the
# weak reference's callback, as weakref.finalize would (0.2 us instead of 3): CPython clears
# every weak reference to a dying owner before it runs callbacks, so the channel's weak
# references (pyshm._channel) never see an owner whose storage is being released, and in a
# garbage cycle the release runs in the same phase as the other finalizers (an Arena's among
# them), before any __del__. The dict keeps the weak references reachable, which is what
# makes CPython call them for cyclic garbage too.
_REFERENCES: dict = {}


# Owners made since pyshm.reduction's index of memory by address last looked (only once it
# has been used: a torch tensor was sent), so that it adds them instead of rebuilding; past
# _NEW_OWNERS_MAX it stops collecting and rebuilds at its next use.
_NEW_OWNERS: list = []
_NEW_OWNERS_MAX = 1 << 16
_tracking = False


def _note_new_owner(ref: "weakref.ref") -> None:
    global _tracking
    if len(_NEW_OWNERS) < _NEW_OWNERS_MAX:
        _NEW_OWNERS.append(ref)
    else:
        _tracking = False
        _NEW_OWNERS.clear()


def _released(ref: "weakref.ref") -> None:
    handle = _REFERENCES.pop(ref, None)
    if handle:
        _c_release(handle)


_c_release = lib.lshm_storage_release  # (bound here: still callable while shutting down)


def array_interface(shape: tuple, dtype: np.dtype, address: int, readonly: bool,
                    strides: Optional[tuple]) -> dict:
    """The ``__array_interface__`` of an array of that layout at `address`."""
    typestr = _TYPESTRS.get(dtype)
    interface = {
        "version": 3,
        "shape": shape,
        "typestr": typestr or dtype.str,
        "data": (address, readonly),
        "strides": strides,
    }
    if typestr is None:
        if dtype.fields is not None or dtype.subdtype is not None:
            interface["descr"] = dtype.descr  # (typestr alone says only "void" for these)
        elif len(_TYPESTRS) < 256:
            _TYPESTRS[dtype] = interface["typestr"]
    return interface


class ArrayOwner:
    """The ``base`` of every pyshm array: one reference to a C storage, plus the array layout.

    It exists so that numpy builds arrays from an owner, never from a bare address, and so that
    the memory outlives every view. ``_keep`` is what that memory itself depends on, kept alive
    as long as the array (a mapping received from another process, an arena), or None. Not meant
    to be created by users.
    """

    __slots__ = ("_handle", "_ref", "_keep", "__array_interface__", "_token", "_facts",
                 "_sent", "__weakref__")
    # _ref: the weak reference whose callback gives the C reference back (see _REFERENCES)

    def __init__(self, handle: int, shape: tuple, dtype: np.dtype, offset: int, readonly: bool,
                 keep: Any = None, strides: Optional[tuple] = None, adopt: bool = False,
                 data: Optional[int] = None):
        # The owner takes its own reference (adopt: the caller hands over one of its own
        # instead), last: if anything here raises, the caller still has its reference and
        # nothing is released twice. data: the storage's data pointer, when the caller knows it.
        self._handle = self._ref = None
        self._keep = keep
        self._token = None  # the last token it was sent with (pyshm.reduction)
        self._facts = None  # (flags, data, nbytes) of memory received (pyshm.reduction)
        self._sent = None  # (weak reference to the array last sent, its start: pyshm.reduction)
        if data is None:
            data = lib.lshm_storage_data(handle) or 0
        self.__array_interface__ = array_interface(shape, dtype, data + offset, readonly,
                                                   strides)
        ref = weakref.ref(self, _released)
        _REFERENCES[ref] = handle if adopt else lib.lshm_storage_retain(handle)
        if _tracking:
            _note_new_owner(ref)
        self._ref = ref
        self._handle = handle

    def _release(self) -> None:
        """Give up the owner's reference now (once; the arrays over it must not be used)."""
        self._handle = None
        if self._ref is not None:
            _released(self._ref)

    def storage(self) -> Storage:
        """A new :class:`Storage` handle (its own reference) on the same C storage."""
        storage = Storage._from_handle(lib.lshm_storage_retain(self._handle))
        storage._keep = self._keep
        return storage


def _normalize_shape(shape: ShapeLike) -> tuple:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in dims:
        if d < 0:
            raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def _nbytes_of(shape: tuple, dtype: np.dtype) -> int:
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects and cannot live in shared memory")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= 1 << 63:
        raise OverflowError(f"array of shape {shape} and dtype {dtype} is too large ({nbytes} bytes)")
    return nbytes


def _wrap(handle: int, shape: tuple, dtype: np.dtype, offset: int = 0,
          keep: Any = None) -> np.ndarray:
    """An array over C storage `handle` at byte `offset` (its owner takes its own reference)."""
    readonly = bool(lib.lshm_storage_flags(handle) & _ffi.STORAGE_READONLY)
    owner = ArrayOwner(handle, shape, dtype, offset, readonly, keep)
    array = np.asarray(owner)
    if array.dtype != dtype or dtype.metadata is not None:
        array = array.view(dtype)  # (structured dtypes, metadata: make the view exact)
    return array


def _array_from_storage(
    handle: int, shape: Optional[ShapeLike], dtype: Any, offset: int, keep: Any = None
) -> np.ndarray:
    """An array over C storage `handle`, checked to fit; shape None: as many items as fit."""
    dtype = np.dtype(dtype)
    nbytes = lib.lshm_storage_nbytes(handle)
    offset = _checks.integer(offset, "offset", 0, _checks.SIZE_MAX, "size_t")
    if offset > nbytes:
        raise ValueError(f"offset {offset} outside a storage of {nbytes} bytes")
    if shape is None:
        if dtype.itemsize == 0 or (nbytes - offset) % dtype.itemsize:
            raise ValueError(
                f"{nbytes - offset} bytes are not a whole number of {dtype} items"
            )
        shape = ((nbytes - offset) // dtype.itemsize,)
    shape = _normalize_shape(shape)
    need = _nbytes_of(shape, dtype)
    if offset + need > nbytes:
        raise ValueError(
            f"array of {need} bytes at offset {offset} does not fit a storage of {nbytes} bytes"
        )
    return _wrap(handle, shape, dtype, offset, keep)


def empty(shape: ShapeLike, dtype: Any = np.float64, *, shared: bool = False) -> np.ndarray:
    """A new C-contiguous array backed by its own storage (whole pages, zero-filled).

    With ``shared=True`` the bytes live in an anonymous memfd from the start. Arrays of at most
    64 KiB live in libshm's slabs either way (4 MiB of pages; shared ones in the slab's one
    memfd, see "File descriptors" in the README). The array's ``.base`` keeps the storage
    alive; :func:`storage_of` returns it.
    """
    dtype = np.dtype(dtype)
    shape = _normalize_shape(shape)
    nbytes = _nbytes_of(shape, dtype)
    handle = _create(nbytes, shared)  # no Storage object: the array's owner holds it
    try:
        return _wrap(handle, shape, dtype)
    finally:
        lib.lshm_storage_release(handle)


def zeros(shape: ShapeLike, dtype: Any = np.float64, *, shared: bool = False) -> np.ndarray:
    """Like :func:`empty`; storages always start zero-filled, so this costs nothing more."""
    return empty(shape, dtype, shared=shared)


def copy(array: Any, *, shared: bool = False) -> np.ndarray:
    """A pyshm-owned copy of ``array`` (C order), optionally in shared memory from the start.

    This is the way to bring memory pyshm does not own (any numpy array, anything with the
    buffer protocol) into a storage that can then be shared in place.
    """
    source = np.asarray(array)
    if not shared or _nbytes_of(source.shape, source.dtype) <= _ffi.SLAB_MAX_BYTES:
        result = empty(source.shape, source.dtype, shared=shared)
        np.copyto(result, source, casting="no")
        return result
    contiguous = np.ascontiguousarray(source)
    # Borrow the source bytes as a foreign storage and share it: one pwrite straight from the
    # source into a fresh memfd (no page faults, no zero-fill), mapped at a new address. The
    # borrowed source is never written or released by the library.
    out = ctypes.c_void_p()
    lib.lshm_storage_create_foreign(
        contiguous.ctypes.data, contiguous.nbytes, None, None, 0, ctypes.byref(out)
    )
    try:
        lib.lshm_storage_share(out.value)
        return _wrap(out.value, source.shape, source.dtype)
    finally:
        lib.lshm_storage_release(out.value)


def _probe_data_offset() -> Optional[int]:
    """Where numpy keeps an array's data pointer in its object (``PyArrayObject_fields.data``,
    right after the object header in numpy's C ABI), if reading it there gives what
    ``__array_interface__`` says for a few probe arrays; None (use the slow way) otherwise."""
    if sys.implementation.name != "cpython":
        return None  # (id() is an address only there)
    offset = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # PyObject_HEAD
    probes = [np.empty(7, np.int64), np.empty((3, 5), np.uint8)[1:, ::2], np.arange(9.0)[::-1]]
    for probe in probes:
        if ctypes.c_void_p.from_address(id(probe) + offset).value != (
            probe.__array_interface__["data"][0]
        ):
            return None
    return offset


_DATA_OFFSET = _probe_data_offset()
_from_address = ctypes.c_void_p.from_address


def data_address(array: np.ndarray) -> int:
    """The address of ``array``'s first element (``__array_interface__['data'][0]``, without
    building that dict: 0.4 us instead of 3.6, once per array pickled)."""
    if _DATA_OFFSET is not None and type(array) is np.ndarray:
        return _from_address(id(array) + _DATA_OFFSET).value or 0
    return array.__array_interface__["data"][0]


def _owner_of(array: Any) -> Optional[ArrayOwner]:
    base = getattr(array, "base", None)
    if isinstance(base, ArrayOwner):
        return base  # (the usual case: an array made over its owner)
    obj = array
    seen = 0
    while obj is not None and seen < 64:
        if isinstance(obj, ArrayOwner):
            return obj
        obj = getattr(obj, "base", None)
        seen += 1
    return None


def storage_of(array: Any) -> Optional[Storage]:
    """The :class:`Storage` behind a pyshm array or any view of one, else ``None``.

    The result is a new handle with its own reference: closing it never affects the array.
    Two handles on the same storage compare equal.
    """
    owner = _owner_of(array)
    return None if owner is None else owner.storage()


def is_shared(array: Any) -> bool:
    """True when ``array`` is a view of a pyshm storage that lives in shared memory."""
    owner = _owner_of(array)
    if owner is None:
        return False
    if owner._facts is not None:  # memory received: what its flags are (no C view made for it)
        return bool(owner._facts[0] & _ffi.STORAGE_SHARED)
    return bool(lib.lshm_storage_flags(owner._handle) & _ffi.STORAGE_SHARED)


def share_memory_(array: Any) -> Any:
    """Move the storage behind ``array`` into shared memory in place and return ``array``.

    The address does not change: ``array``, every other view of the same storage and the
    storage's data pointer all see the same shared bytes afterwards, in both directions.
    Idempotent and thread-safe (concurrent calls copy once); the copy runs in C without the
    GIL. On failure (``MemoryError``/``OSError``) the array is untouched.

    Raises :class:`TypeError` for memory pyshm does not own: use
    ``pyshm.copy(array, shared=True)`` for those. Raises :class:`BufferError` (errno EBUSY),
    changing nothing, for an array of a private :class:`pyshm.Arena`: its bytes are a slice of
    the arena's buffer, which cannot be shared in place without the array losing its storage;
    create the arena with ``shared=True`` or share ``pyshm.copy(array, shared=True)``.
    """
    base = getattr(array, "base", None)
    owner = base if type(base) is ArrayOwner else _owner_of(array)
    if owner is None:
        raise TypeError(
            f"share_memory_ needs an array whose memory pyshm owns (got {type(array).__name__} "
            "not backed by a pyshm storage); use pyshm.copy(array, shared=True) to get a "
            "shared copy"
        )
    _share_in_place(owner._handle, "share_memory_")
    return array
