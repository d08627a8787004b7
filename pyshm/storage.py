"""Storage: a Python handle on one libshm storage (a refcounted, never-moving byte buffer)."""

from __future__ import annotations

import ctypes
import errno
import os
import pickle
import threading
from typing import Any, Optional

import numpy as np

from . import _checks, _ffi
from ._ffi import lib
from ._memory import HandleLifetime, array_from_storage, check_nbytes, create, share_in_place

__all__ = ["Storage", "trim_pool"]


# Guards every Storage's count of calls in flight (_pins) against close() on another thread
# (held for a few bytecodes only, never across a C call).
_PIN_LOCK = threading.Lock()
# Which process the pins count calls of: a forked child counts none of its parent's (the
# threads that made them are not in the child), so a Storage pinned at the fork is released
# by its close() there, not only by garbage collection.
_PIN_EPOCH = 0


def _new_pin_lock_in_child() -> None:
    global _PIN_LOCK, _PIN_EPOCH
    _PIN_LOCK = threading.Lock()  # (a thread that held it at the fork is not in the child)
    _PIN_EPOCH += 1


os.register_at_fork(after_in_child=_new_pin_lock_in_child)


class Storage(HandleLifetime):
    """A refcounted byte buffer owned by libshm, usable from Python and numpy.

    Lifetime contract:

    * ``Storage(nbytes)`` allocates ``nbytes`` zero bytes in whole pages owned by the storage.
      The memory is released when the storage is closed *and* every numpy array made from it
      (see :func:`pyshm.empty`, :meth:`asarray`) is gone: each array holds its own reference to
      the C storage, so ``close()`` never invalidates a live array.
    * ``close()`` (or leaving a ``with`` block) drops this handle's reference; afterwards every
      method raises :class:`ValueError`. Closing twice is fine.
    * ``share_memory_()`` moves the bytes into an anonymous memfd *in place*: the data pointer,
      and therefore every existing array and raw pointer, keeps working and now sees shared
      memory, which other processes can map (``fd``). There is no name to unlink: the kernel
      frees the memory when the last mapping and fd are gone, even after a crash.
    * ``resize_()`` (resizable storages only) never frees memory under a live array: it raises
      :class:`BufferError` while any array, view, export or other handle holds the storage.
    * At interpreter exit nothing is freed explicitly; the operating system reclaims it.
    """

    # _keep: what the memory depends on (a mapping received from another process), or None
    # _pins: the pins of the calls in flight on _handle (a set, see _pin): close() leaves the
    # release to the last; _pin_epoch: the _PIN_EPOCH they were taken in; _resizing: the pin of
    # the last resize_ (one is in flight while it is in _pins), or None
    __slots__ = ("_handle", "_key", "_keep", "_pins", "_pin_epoch", "_resizing")

    def __init__(self, nbytes: int, *, shared: bool = False, resizable: bool = False) -> None:
        # The release is recorded first (of NULL until the storage is made: nothing), so that
        # a Ctrl-C right after the C call returns never loses the storage (see _memory.create)
        handle = _ffi.StorageHandle()
        self._adopt(handle)
        create(handle, nbytes, shared, resizable)
        self._key = _ffi.address(handle)

    def _adopt(self, handle: _ffi.StorageHandle, keep: Any = None, take: Any = None,
               hand: Optional[list] = None) -> None:
        self._handle = handle
        self._keep = keep
        self._pins = set()
        self._pin_epoch = _PIN_EPOCH
        self._resizing = None
        self._key = _ffi.address(handle)  # the identity, kept after close for a stable hash
        # (the C function itself: a Python function between the callback and it was one more
        # point where a Ctrl-C lost the release, see _memory.released)
        self._release_with(lib.lshm_storage_release, handle, take=take, hand=hand)

    @classmethod
    def from_handle(cls, handle: _ffi.StorageHandle, keep: Any = None) -> "Storage":
        """Wrap a C storage (an ``lshm_storage *`` as a :class:`pyshm._ffi.StorageHandle`)
        whose reference the caller hands over: the Storage releases it when it is closed or
        collected. ``keep``: an object the memory depends on (the mapping of memory received
        from another process), kept alive as long as the Storage; see :attr:`keep`. TypeError
        for anything but a StorageHandle, ValueError for NULL: then the caller keeps its
        reference."""
        if not isinstance(handle, _ffi.StorageHandle):
            raise TypeError(f"from_handle expects a StorageHandle, not {type(handle).__name__}")
        if not handle:
            raise ValueError("from_handle: a NULL storage handle")
        self = cls.__new__(cls)
        self._adopt(handle, keep)
        return self

    @classmethod
    def _retaining(cls, handle: _ffi.StorageHandle, keep: Any = None,
                   hand: Optional[list] = None) -> "Storage":
        """A Storage with a reference of its own to the C storage `handle` (which the caller
        keeps), taken in the same step that records it (see HandleLifetime._release_with);
        or, when `hand` holds `handle`, the caller's, taken over (see pyshm._memory.HANDS)."""
        self = cls.__new__(cls)
        self._adopt(handle, keep, take=lib.lshm_storage_retain, hand=hand)
        return self

    @property
    def keep(self) -> Any:
        """What this storage's memory depends on, kept alive with it (the mapping of memory
        received from another process), or None for memory of its own."""
        return self._keep

    @classmethod
    def attach(
        cls, fd: int, nbytes: int, *, offset: int = 0, readonly: bool = False
    ) -> "Storage":
        """Map ``nbytes`` at ``offset`` of a shared-memory fd received from another process.

        The fd is validated (a memfd, long enough, sealed against shrink and grow) and
        duplicated; the caller keeps ownership of ``fd``.
        """
        fd = _checks.fd(fd)
        nbytes = check_nbytes(nbytes)
        offset = _checks.uint64(offset, "offset")
        out = _ffi.StorageHandle()
        flags = _ffi.STORAGE_READONLY if readonly else 0
        self = cls.__new__(cls)
        self._adopt(out)  # (first: see __init__)
        lib.lshm_storage_attach(fd, offset, nbytes, flags, ctypes.byref(out))
        self._key = _ffi.address(out)
        return self

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def _as_parameter_(self) -> _ffi.StorageHandle:
        handle = self._handle
        if handle is None:
            raise ValueError("operation on a closed pyshm.Storage")
        return handle

    def _pin(self, pin: object, resizing: bool = False) -> _ffi.StorageHandle:
        """The handle, for a call of more than one step or without the GIL (ValueError once
        closed): until the pin is given back, a close() (say on another thread) only marks
        this Storage closed and the reference is given back by the last call out, so the
        storage never dies under a call in flight.

        `pin`: an ``object()`` the caller made before its ``try``, added to ``_pins`` under
        the lock; the caller gives it back with, first thing in its ``finally``::

            self._pins.discard(pin)  # (one C call: no signal handler runs before it)
            self._unpinned()

        A KeyboardInterrupt (a signal handler raises it at the interpreter's next check: after
        a C call returns, at the entry of a Python function) can come anywhere in the caller,
        a second one in its ``finally`` too: when giving the pin back took a Python call
        (its entry is such a check), that pin stayed taken, and the Storage refused every
        resize_ (or every call, after an interrupted resize_), and close() did not give its
        reference back, until it was collected. ``discard`` is a C method called directly: it
        cannot be interrupted, and does nothing for a pin never taken (refused, or an
        exception before it was taken). Only _unpinned's release can be lost that way, and
        that one is made when the Storage is collected.

        `resizing` (resize_): the storage's one C reference serves every thread that uses this
        object, so libshm's rule (resize only while the caller holds the one reference) cannot
        see a call of another thread in flight on it (copy_, asarray: they read its memory, a
        resize moves or unmaps it). A resize is pinned only while no other call is, and no
        other call while it runs: BufferError (EBUSY) for the one that comes second."""
        with _PIN_LOCK:  # (nothing allocated under it: no garbage collection, no finalizer)
            handle = self._handle
            busy = None
            if handle is not None:
                if self._pin_epoch != _PIN_EPOCH:  # (pins of the parent's calls: not ours)
                    self._pins.clear()  # (not a new set: nothing allocated under the lock)
                    self._pin_epoch, self._resizing = _PIN_EPOCH, None
                if self._resizing in self._pins:
                    busy = "being resized on another thread"
                elif resizing and self._pins:
                    busy = ("in use by a call on another thread (resizing would move or free "
                            "its memory under that call)")
                else:
                    self._pins.add(pin)
                    if resizing:
                        self._resizing = pin
        if handle is None:
            raise ValueError("operation on a closed pyshm.Storage")
        if busy is not None:
            raise _ffi.ShmBufferError(errno.EBUSY, f"pyshm: this Storage is {busy}")
        return handle

    def _unpinned(self) -> None:
        """After a caller gave its pin back (see _pin): the reference, if close() left its
        release to the last call in flight and none is left (twice is harmless: released
        once)."""
        with _PIN_LOCK:
            release = self._handle is None and not self._pins
        if release:
            self._release_now()

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Drop this handle's reference (idempotent). Live arrays keep the memory alive.

        A call running on another thread with this Storage (``share_memory_``, ``copy_``,
        ``resize_``, ...) keeps the reference until it returns."""
        with _PIN_LOCK:
            if self._handle is None:
                return
            self._handle = None
            if self._pins and self._pin_epoch == _PIN_EPOCH:
                return  # the last call in flight gives the reference back
        self._release_now()

    def __enter__(self) -> "Storage":
        self._as_parameter_  # raises when closed
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __eq__(self, other: object) -> bool:
        # A storage's identity is its address: two handles on one storage are equal.
        if not isinstance(other, Storage):
            return NotImplemented
        if self._handle is None or other._handle is None:
            return self is other
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        if self._handle is None:
            return "<pyshm.Storage closed>"
        state = "shared" if self.is_shared else "private"
        return f"<pyshm.Storage {self.nbytes} bytes {state} at 0x{self.data_ptr:x}>"

    def __reduce_ex__(self, protocol):
        # Plain pickle copies the bytes (out of band with protocol 5); multiprocessing sends
        # the memory itself (pyshm.reduction registers a ForkingPickler reducer).
        return reduce_storage_by_value(self, protocol)

    def __reduce__(self):
        return reduce_storage_by_value(self, 2)  # (not HandleLifetime's refusal)

    # ---- accessors --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return lib.lshm_storage_nbytes(self._as_parameter_)

    @property
    def data_ptr(self) -> int:
        """Address of the first byte (0 for an empty storage). Stable across share_memory_()."""
        return lib.lshm_storage_data(self._as_parameter_) or 0

    @property
    def flags(self) -> int:
        return lib.lshm_storage_flags(self._as_parameter_)

    @property
    def is_shared(self) -> bool:
        return bool(lib.lshm_storage_flags(self._as_parameter_) & _ffi.STORAGE_SHARED)

    @property
    def readonly(self) -> bool:
        return bool(lib.lshm_storage_flags(self._as_parameter_) & _ffi.STORAGE_READONLY)

    @property
    def resizable(self) -> bool:
        return bool(lib.lshm_storage_flags(self._as_parameter_) & _ffi.STORAGE_RESIZABLE)

    @property
    def fd(self) -> Optional[int]:
        """The memfd behind a shared storage (borrowed: dup it to keep it), else None (not
        shared). Raises :class:`pyshm.ShmError` (errno EBADF) where the storage has no fd open
        any more: memory received from another process and mapped, whose fd was closed."""
        fd, _ = self._fd_offset()
        return fd

    @property
    def fd_offset(self) -> int:
        """Byte offset of this storage's data in its fd (0 unless it views a segment)."""
        _, offset = self._fd_offset()
        return offset

    def _fd_offset(self) -> tuple[Optional[int], int]:
        pin = object()
        try:
            handle = self._pin(pin)
            if not lib.lshm_storage_flags(handle) & _ffi.STORAGE_SHARED:
                return None, 0
            fd = ctypes.c_int(-1)
            offset = ctypes.c_uint64(0)
            lib.lshm_storage_fd(handle, ctypes.byref(fd), ctypes.byref(offset))
            return fd.value, offset.value
        finally:
            self._pins.discard(pin)
            self._unpinned()

    @property
    def refcount(self) -> int:
        return lib.lshm_storage_refcount(self._as_parameter_)

    # ---- operations -------------------------------------------------------------------------

    def share_memory_(self) -> "Storage":
        """Move the bytes into shared memory in place (same address); idempotent; returns self.

        Runs in one C call without the GIL. Raises :class:`MemoryError` (an ``OSError`` too)
        when memory runs out, in which case the storage is exactly as before.
        :class:`BufferError` (changing nothing) for a tensor of a private
        :class:`pyshm.Arena`: its bytes are a slice of the arena's buffer, which cannot be
        shared in place (create the arena with ``shared=True``).
        """
        pin = object()
        try:
            share_in_place(self._pin(pin), "share_memory_")
        finally:
            self._pins.discard(pin)
            self._unpinned()
        return self

    def copy_(self, other: "Storage") -> "Storage":
        """Copy every byte of ``other`` (same nbytes) into this storage; returns self."""
        if not isinstance(other, Storage):
            raise TypeError(f"copy_ expects a pyshm.Storage, got {type(other).__name__}")
        pin = object()
        try:
            handle = self._pin(pin)
            source_pin = object()
            try:
                lib.lshm_storage_copy(handle, other._pin(source_pin))
            finally:
                other._pins.discard(source_pin)
                other._unpinned()
        finally:
            self._pins.discard(pin)
            self._unpinned()
        return self

    def resize_(self, nbytes: int) -> "Storage":
        """Resize a resizable, unshared storage (the data pointer may change); returns self.

        Like ``bytearray``, a storage cannot be resized while its memory is in use: while any
        array or view made from it (:meth:`asarray`, :func:`pyshm.storage_of`), any export of
        such an array (a ``memoryview``, a buffer held by another library) or another
        :class:`Storage` handle on it exists, this raises :class:`BufferError`
        (``pyshm.ShmBufferError``, errno ``EBUSY``) and changes nothing. In other words it
        works only while this handle holds the storage's one reference (``refcount == 1``),
        which is the same rule ``lshm_storage_resize`` applies in C. Delete the arrays first.
        The same BufferError while another thread's call on this Storage is in flight
        (``copy_``, ``asarray``, ``share_memory_``...), and such a call raises it while a
        resize runs: one handle serves every thread that uses it.
        :class:`PermissionError` when the storage is not resizable or is shared (checked
        first: that never changes, live arrays or not).
        """
        # libshm decides, in its order: not resizable / shared / foreign memory is EPERM (for
        # good, whatever holds the storage), then any other reference is EBUSY (growing may
        # move the pages and shrinking unmaps the tail: either would leave a live array on
        # freed memory).
        nbytes = check_nbytes(nbytes)
        pin = object()
        try:
            lib.lshm_storage_resize(self._pin(pin, resizing=True), nbytes)
        finally:
            self._pins.discard(pin)
            self._unpinned()
        return self

    def asarray(self, shape=None, dtype="uint8", offset: int = 0):
        """A numpy array over this storage's bytes (it keeps the memory alive)."""
        pin = object()
        try:
            return array_from_storage(self._pin(pin), shape, dtype, offset, self._keep)
        finally:
            self._pins.discard(pin)
            self._unpinned()


def reduce_storage_by_value(storage: Storage, protocol: int):
    """Plain pickle of a Storage: its bytes (out of band with protocol 5), no fd."""
    data = storage.asarray()
    payload = pickle.PickleBuffer(data) if protocol >= 5 else data.tobytes()
    return storage_from_bytes, (payload,)


def storage_from_bytes(payload) -> Storage:
    view = memoryview(payload).cast("B")
    storage = Storage(view.nbytes)
    if view.nbytes:
        storage.asarray()[:] = np.frombuffer(view, np.uint8)
    return storage


def trim_pool() -> int:
    """Give back the memory libshm keeps for reuse; returns how many memfds it closed.

    When a storage shared in place is released, libshm may keep its memfd (pages allocated,
    sealed) so that the next share of the same size refills it faster than fresh memory
    (arrays under 1 MiB, and from 64 MiB up; between them a fresh share is faster, so nothing is
    kept). Only memfds nobody else can reach are kept (never sent, no fork since), at most
    ``LSHM_POOL_BYTES`` bytes (environment, read at the first share; default 1/8 of physical
    memory, or of the memory cgroup's limit where that is less; ``0`` disables the pool) and 256
    entries. Call this to release them now.
    """
    return int(lib.lshm_pool_trim())
