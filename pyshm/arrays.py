"""numpy arrays backed by libshm storages, and sharing them in place.

Every array made here is an ordinary :class:`numpy.ndarray` built with ``numpy.asarray(owner)``
where ``owner`` is an :class:`ArrayOwner`: it publishes the storage's pointer through
``__array_interface__`` and holds its own reference to the C storage, so the array's ``.base``
chain keeps the memory alive for as long as any view of it exists, whatever happens to the
:class:`~pyshm.Storage` handle the user holds.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import numpy as np

from . import _checks, _ffi
from ._ffi import lib
from ._memory import (  # noqa: F401 - ArrayOwner: public here, as before
    ArrayOwner,
    ShapeLike,
    array_dtype,
    create,
    data_address,
    nbytes_of,
    normalize_shape,
    owner_of,
    share_in_place,
    wrap,
)
from .storage import Storage

ArrayOwner.__module__ = __name__  # (its public home, as before: repr and docs name it here)

__all__ = [
    "ArrayOwner",
    "empty",
    "zeros",
    "copy",
    "share_memory_",
    "is_shared",
    "storage_of",
]

def empty(shape: ShapeLike, dtype: Any = np.float64, *, shared: bool = False) -> np.ndarray:
    """A new C-contiguous array backed by its own storage (whole pages, zero-filled).

    With ``shared=True`` the bytes live in an anonymous memfd from the start. Arrays of at most
    64 KiB live in libshm's slabs either way (4 MiB of pages; shared ones in the slab's one
    memfd, see "File descriptors" in the README). The array's ``.base`` keeps the storage
    alive; :func:`storage_of` returns it.
    """
    dtype = array_dtype(dtype)
    shape = normalize_shape(shape)
    nbytes = nbytes_of(shape, dtype)
    handle = _ffi.StorageHandle()  # no Storage object: the array's owner holds it
    try:
        create(handle, nbytes, shared)
        return wrap(handle, shape, dtype)
    finally:
        lib.lshm_storage_release(handle)  # (NULL, if none was made: nothing)


def zeros(shape: ShapeLike, dtype: Any = np.float64, *, shared: bool = False) -> np.ndarray:
    """Like :func:`empty`; storages always start zero-filled, so this costs nothing more."""
    return empty(shape, dtype, shared=shared)


def copy(array: Any, *, shared: bool = False) -> np.ndarray:
    """A pyshm-owned copy of ``array`` (C order), optionally in shared memory from the start.

    This is the way to bring memory pyshm does not own (any numpy array, anything with the
    buffer protocol) into a storage that can then be shared in place.
    """
    shared = _checks.flag(shared, "shared")
    source = np.asarray(array)
    if not shared or nbytes_of(source.shape, source.dtype) <= _ffi.SLAB_MAX_BYTES:
        result = empty(source.shape, source.dtype, shared=shared)
        np.copyto(result, source, casting="no")
        return result
    contiguous = np.ascontiguousarray(source)
    # Borrow the source bytes as a foreign storage and share it: one pwrite straight from the
    # source into a fresh memfd (no page faults, no zero-fill), mapped at a new address. The
    # borrowed source is never written or released by the library.
    out = _ffi.StorageHandle()
    lib.lshm_storage_create_foreign(
        contiguous.ctypes.data, contiguous.nbytes, None, None, 0, ctypes.byref(out)
    )
    try:
        lib.lshm_storage_share(out)
        return wrap(out, source.shape, source.dtype)
    finally:
        lib.lshm_storage_release(out)


def storage_of(array: Any) -> Optional[Storage]:
    """The :class:`Storage` behind a pyshm array or any view of one, else ``None``.

    The result is a new handle with its own reference: closing it never affects the array.
    Two handles on the same storage compare equal.
    """
    owner = _pyshm_owner(array)
    return None if owner is None else _owner_storage(owner)


def _pyshm_owner(array: Any) -> Optional[ArrayOwner]:
    """The owner of the pyshm memory under ``array``, also where its base chain ends at
    another exporter (``numpy.from_dlpack(a)``, ``torch.from_numpy(a).numpy()``): found by
    address, as pickling finds it (reduction.pyshm_owner), else None."""
    owner = owner_of(array)
    if owner is not None or type(array) is not np.ndarray:
        return owner
    from .reduction import pyshm_owner  # (reduction imports this module)

    return pyshm_owner(array)


def _owner_storage(owner: ArrayOwner) -> Storage:
    """A new :class:`Storage` handle (its own reference) on the owner's C storage."""
    return Storage._retaining(owner.handle, keep=owner.keep)


ArrayOwner.storage = _owner_storage  # (kept: the method it always had)


def is_shared(array: Any) -> bool:
    """True when ``array`` is a view of a pyshm storage that lives in shared memory (or is
    such a :class:`Storage`)."""
    if isinstance(array, Storage):
        return array.is_shared
    owner = _pyshm_owner(array)
    if owner is None:
        return False
    if owner.facts is not None:  # memory received: what its flags are (no C view made for it)
        return bool(owner.facts[0] & _ffi.STORAGE_SHARED)
    return bool(lib.lshm_storage_flags(owner.handle) & _ffi.STORAGE_SHARED)


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

    A :class:`Storage` is shared as by its own ``share_memory_()``.
    """
    if isinstance(array, Storage):
        return array.share_memory_()
    base = getattr(array, "base", None)
    owner = base if type(base) is ArrayOwner else _pyshm_owner(array)
    if owner is None:
        raise TypeError(
            f"share_memory_ needs an array whose memory pyshm owns (got {type(array).__name__} "
            "not backed by a pyshm storage); use pyshm.copy(array, shared=True) to get a "
            "shared copy"
        )
    share_in_place(owner.handle, "share_memory_")
    return array
