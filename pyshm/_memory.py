"""libshm storages as numpy memory: the owner object every pyshm array is built on, and the
helpers over C storage handles that the wrapper modules share (storage, arrays, arena,
reduction). It imports only the binding (``_ffi``), so dependencies run one way: the wrappers
-> this module -> ``_ffi`` -> liblshm.

Every array pyshm makes is an ordinary :class:`numpy.ndarray` built with
``numpy.asarray(owner)`` where ``owner`` is an :class:`ArrayOwner`: it publishes the storage's
pointer through ``__array_interface__`` and holds its own reference to the C storage, so the
array's ``.base`` chain keeps the memory alive for as long as any view of it exists.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import math
import operator
import sys
import weakref
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _checks, _ffi
from ._ffi import lib


def create(out: _ffi.StorageHandle, nbytes: int, shared: bool, resizable: bool = False) -> None:
    """A new C storage of ``nbytes`` into handle `out` (NULL), whose reference the caller owns.

    `out`, not a result: the caller has it, and gives the reference back, before the call
    returns. A Ctrl-C (KeyboardInterrupt) right after the C call returned lost a returned
    handle, and the storage (a memfd, for a shared one) with it."""
    nbytes = check_nbytes(nbytes)
    shared = _checks.flag(shared, "shared")
    resizable = _checks.flag(resizable, "resizable")
    if shared:
        if resizable:
            raise ValueError("a shared storage cannot be resizable")
        lib.lshm_storage_create_shared(nbytes, 0, ctypes.byref(out))
    else:
        flags = _ffi.STORAGE_RESIZABLE if resizable else 0
        lib.lshm_storage_create(nbytes, None, flags, ctypes.byref(out))


def share_in_place(handle: _ffi.StorageHandle, what: str, error: Optional[type] = None,
                    share: Any = None) -> None:
    """lshm_storage_share (or `share`, e.g. lshm_storage_share_readonly) of `handle`, with
    libshm's EBUSY refusal explained in pyshm's terms.

    A storage that owns whole pages is shared in place at the same address. One that does not
    (in pyshm: a slot of a private arena, whose bytes are a slice of the arena's buffer) would
    move to a new mapping while the arrays over it stay on the old bytes, so libshm refuses it
    with EBUSY, changing nothing, while anything besides the arena holds it. `error`: the
    exception class to raise instead of ShmBufferError (EBUSY).
    """
    try:
        if share is None:
            rc = _ffi.share_unchecked(handle)
            if rc >= 0:
                return
            _ffi.raise_for(rc, "lshm_storage_share")
        else:
            share(handle)
    except _ffi.ShmBufferError as exc:
        message = (
            f"{what}: this memory is a slice of a private pyshm.Arena's buffer, which cannot be "
            "shared in place (arrays over it would stop aliasing it); create the arena with "
            "shared=True, or share a copy: pyshm.copy(array, shared=True) "
            f"({exc.strerror})"
        )
        if error is None:
            raise _ffi.ShmBufferError(errno.EBUSY, message) from None
        raise error(message) from None


def check_nbytes(nbytes) -> int:
    """A byte count for C: an int (not a float, even 3.0) in [0, 2**63)."""
    return _checks.integer(nbytes, "nbytes", 0, _checks.INT64_MAX, "size_t below 2**63")


class HandleLifetime:
    """The lifetime of every pyshm object that holds a C reference (ArrayOwner, Storage, Arena,
    an arena's buffer keep, a received mapping): a weak reference to the object whose callback
    gives the reference back once, when the object is collected or closed: what
    weakref.finalize does, at 0.51 us an object (0.27 for an ArrayOwner, one for every array)
    instead of 1.00 (min times of ``tools/bench_binding.py release``, measured before the
    marks). The weak reference is kept in LIFETIMES, with what to release; an ArrayOwner's in
    REFERENCES, with its bare storage handle (the index of memory by address in
    pyshm.reduction reads them there). A second weak reference, the object's mark, records
    its death in C (see DIED), so that a Ctrl-C at the callback's entry loses no release: it
    costs about 0.5 us more per object (CPU time of a create/drop loop: an ArrayOwner 1.89 ->
    2.36 us, Storage.from_handle + close 2.32 -> 2.89 us). A release that is a Python
    function is registered keyed (see KEYED), so that one at its own entry loses none either.
    Releases registered with _release_with never run once the interpreter has begun to exit
    (the process's memory goes with the process); an ArrayOwner's storage reference can."""

    __slots__ = ("_lifetime", "__weakref__")

    def _release_with(self, release: Any, *args: Any, take: Any = None,
                      hand: Optional[list] = None, keyed: bool = False) -> None:
        """Run ``release(*args)`` once, when this object is collected or _release_now().

        `take`: a C function (``lib.lshm_storage_retain``) that takes the reference, called
        as ``take(args[0])`` right after the release is recorded. Nothing between the record
        and that call is a point where a signal handler runs (CPython runs them at a
        function's entry and after a call returns): a KeyboardInterrupt comes before both or
        after both. Retaining first and recording in a second call lost the reference when
        one came between (an arena tensor's storage then made deallocate refuse for good).
        `hand`: a hand (see HANDS) holding args[0], whose reference is taken over instead.
        `keyed`: `release` is a Python function, called as ``release(key, *args)`` (see
        KEYED)."""
        ref = weakref.ref(self, _lifetime_ended)
        mark = weakref.ref(self, _lifetime_died)  # (see DIED)
        LIFETIME_MARKS[id(mark)] = (mark, ref)  # (by id: hashing it would hash a Storage)
        LIFETIMES[id(ref)] = (ref, release, args, keyed)  # (by id: a Storage compares by
        # its address)
        self._lifetime = ref
        if hand is not None and hand[0] is args[0]:
            hand[0] = None  # (taken over: see HANDS)
        elif take is not None:
            take(args[0])

    def _release_now(self) -> None:
        """Give the reference back now (once: nothing happens when this object dies)."""
        _lifetime_ended(self._lifetime)

    def _release_never(self) -> None:
        """Forget the release: the caller has given the reference back itself."""
        LIFETIMES.pop(id(self._lifetime), None)

    def __reduce_ex__(self, protocol):
        # copy.copy, copy.deepcopy and pickle would copy the C handle without a reference of
        # its own (and the weak reference that gives it back): a second object on the same
        # storage or arena whose close, or the original's death, frees the memory under the
        # other. Refused (Storage overrides this: it pickles and copies by value).
        raise TypeError(f"pyshm: {type(self).__name__} holds a C reference and cannot be copied "
                        "or pickled")

    __reduce__ = __reduce_ex__


ShapeLike = Union[int, Sequence[int]]


# typestr of the plain dtypes seen (no fields, no subarray: typestr says all of them), as
# dtype.str builds a new string every time
_TYPESTRS: dict = {}


# ArrayOwner weak reference -> the C storage reference it holds; id of any other
# HandleLifetime's weak reference -> (that weak reference, release, args). The reference is
# given back by the weak reference's callback, as weakref.finalize would: CPython clears every
# weak reference to a dying object before it runs callbacks, so the channel's weak references
# (pyshm._channel) never see an owner whose storage is being released, and in a garbage cycle
# the release runs in the same phase as the other finalizers, before any __del__. The dicts
# keep the weak references reachable, which is what makes CPython call them for cyclic
# garbage too.
REFERENCES: dict = {}
LIFETIMES: dict = {}
# A Ctrl-C (a signal handler raises KeyboardInterrupt where CPython checks for signals: a
# function's entry, right after a call returns) at the entry of one of those callbacks is
# printed ("Exception ignored") and dropped, with the release: the memfd and its mapping
# stayed until the process exited. So each object also has a second weak reference, its mark:
# a key of MARKS (-> the callback's weak reference) whose callback is DIED.append, a C method,
# which no signal handler interrupts. Every death is recorded in DIED that way, and every
# release callback then settles DIED (_settle): a release whose callback was cut off is made
# there, at the next release. (The same for LIFETIMES, whose weak references are never hashed:
# LIFETIME_MARKS, id of the mark -> (mark, weak reference), and LIFETIMES_DIED.) The marks are
# made after the callbacks' weak references, and CPython calls the newest first: a death is
# recorded before its release callback runs, which then settles it at once.
# KEYED. A release that is a Python function (an arena's _destroy, a received mapping's
# _drop_segment) had a point of its own, its entry, where a Ctrl-C dropped it after its
# LIFETIMES entry was taken out: the arena or the mapping (and its fd) stayed until exit. Such
# a release is registered keyed: it is called as ``release(key, *args)`` with its entry (and
# its death's mark) still recorded, and takes the entry out itself (``if key in LIFETIMES:
# del LIFETIMES[key]``) right before its C call, with no point between; cut off at its
# entry, it is made again at the next settle, which takes the mark out only once the entry
# is gone.
MARKS: dict = {}
LIFETIME_MARKS: dict = {}
DIED: list = []
LIFETIMES_DIED: list = []
_died = DIED.append
_lifetime_died = LIFETIMES_DIED.append
_exiting = False  # (set at interpreter exit: _release_with's releases no longer run)


def _at_exit() -> None:
    global _exiting
    _exiting = True


atexit.register(_at_exit)


# Owners made since pyshm.reduction's index of memory by address last looked (only once it
# has been used: a torch tensor was sent), so that it adds them instead of rebuilding; past
# NEW_OWNERS_MAX it stops collecting and rebuilds at its next use.
NEW_OWNERS: list = []
NEW_OWNERS_MAX = 1 << 16
tracking = False


def note_new_owner(ref: "weakref.ref") -> None:
    global tracking
    if len(NEW_OWNERS) < NEW_OWNERS_MAX:
        NEW_OWNERS.append(ref)
    else:
        tracking = False
        NEW_OWNERS.clear()


# The two weak reference callbacks below may run while the interpreter exits, after CPython
# has wiped this module's globals (set them all to None: it does so to modules still alive
# then, before it frees what other modules hold). What they need is bound as default
# arguments, as the stdlib's WeakValueDictionary does, so they never raise then.


# A signal handler (Ctrl-C) runs where CPython checks for signals: at a function's entry and
# right after a call returns. Its KeyboardInterrupt in a weak reference callback is printed
# ("Exception ignored") and dropped, and so was the release when it came right after the
# entry was taken out of the dict with pop() (a call): the memfd and mapping stayed until the
# process exited. The entry is read and deleted with subscripts instead (no call), and the
# release is the next call, a C function: the interrupt comes before anything is taken, or
# after the release. (At the entry itself the dict keeps the entry: see HandleLifetime.)


def _settle(_died: list = DIED, _marks: dict = MARKS, _lifetimes_died: list = LIFETIMES_DIED,
            _lifetime_marks: dict = LIFETIME_MARKS, _references: dict = REFERENCES,
            _lifetimes: dict = LIFETIMES, _release: Any = lib.lshm_storage_release) -> None:
    """Make the releases of the deaths in DIED and LIFETIMES_DIED whose callback did not (cut
    off at its entry). Each step takes a record and its entry, and deletes both, with no call
    between (no point where a signal handler runs); the release is the next call."""
    while _died:
        mark = _died[-1]
        ref = _marks[mark] if mark in _marks else None
        handle = _references[ref] if ref in _references else None
        if ref is not None:
            del _marks[mark]
        if handle is not None:
            del _references[ref]
        del _died[-1]
        if handle:
            _release(handle)
    while _lifetimes_died:
        # (two calls, id, before anything is taken; _lifetime_marks keeps the mark and the
        # reference alive while the mark is in LIFETIMES_DIED: their ids are their own)
        mark = _lifetimes_died[-1]
        mark_key = id(mark)
        ref = _lifetime_marks[mark_key][1] if mark_key in _lifetime_marks else None
        key = id(ref)
        if not _lifetimes_died or _lifetimes_died[-1] is not mark:
            continue  # (another thread settled it meanwhile: a thread may switch at a call)
        entry = _lifetimes[key] if key in _lifetimes else None
        if entry is not None and entry[3] and _exiting is False:
            entry[1](key, *entry[2])  # (takes its entry out: see KEYED)
            # (dropped here, not by the next step's read: what the entry held may die with
            # it, and its death may settle too, within that step: keep_alive_with)
            entry = None
            continue  # (then the mark, once this is seen again with no entry)
        if ref is not None:
            del _lifetime_marks[mark_key]
        if entry is not None:
            del _lifetimes[key]
        del _lifetimes_died[-1]
        if entry is not None and _exiting is False:
            entry[1](*entry[2])
        entry = None  # (as above)


def released(ref: "weakref.ref", _references: dict = REFERENCES,
             _release: Any = lib.lshm_storage_release, _died: list = DIED,
             _lifetimes_died: list = LIFETIMES_DIED, _settle: Any = _settle) -> None:
    if ref in _references:
        handle = _references[ref]
        del _references[ref]
        if handle:
            _release(handle)
    if _died or _lifetimes_died:
        _settle()


def _lifetime_ended(ref: Optional[weakref.ref], _lifetimes: dict = LIFETIMES,
                    _died: list = DIED, _lifetimes_died: list = LIFETIMES_DIED,
                    _settle: Any = _settle) -> None:
    key = id(ref)
    entry = _lifetimes[key] if key in _lifetimes else None
    if entry is not None and entry[3] and _exiting is False:
        entry[1](key, *entry[2])  # (takes its entry out: see KEYED)
    elif entry is not None:
        del _lifetimes[key]
        if _exiting is False:  # (None too once the module is being wiped)
            entry[1](*entry[2])
    if _died or _lifetimes_died:
        _settle()


def keep_alive_with(obj: Any, kept: Any) -> None:
    """Keep `kept` alive for as long as `obj` (any object with weak references) lives.

    The reference to `kept` is in a LIFETIMES entry of `obj`'s, let go by a keyed release
    (see KEYED): a Ctrl-C (KeyboardInterrupt) at any point of `obj`'s death lets `kept` go
    by the next release at the latest. A weak reference callback of its own that took it out
    of a dict kept it until the process exited when one came at that callback's entry."""
    ref = weakref.ref(obj, _lifetime_ended)
    mark = weakref.ref(obj, _lifetime_died)  # (see DIED)
    LIFETIME_MARKS[id(mark)] = (mark, ref)
    LIFETIMES[id(ref)] = (ref, _let_go, (kept,), True)


def _let_go(key: int, kept: Any, _lifetimes: dict = LIFETIMES) -> None:
    # (keep_alive_with's keyed release: taking its entry out lets `kept` go; the caller's
    # frame holds it until it returns)
    if key in _lifetimes:
        del _lifetimes[key]


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


class ArrayOwner(HandleLifetime):
    """The ``base`` of every pyshm array: one reference to a C storage, plus the array layout.

    It exists so that numpy builds arrays from an owner, never from a bare address, and so that
    the memory outlives every view. ``keep`` is what that memory itself depends on, kept alive
    as long as the array (a mapping received from another process, an arena), or None. Not meant
    to be created by users.
    """

    __slots__ = ("handle", "keep", "__array_interface__", "token", "facts", "sent")
    # _lifetime (HandleLifetime's): the weak reference whose callback gives the C reference
    # back, registered in REFERENCES with the bare handle (not through _release_with)

    def __init__(self, handle: _ffi.StorageHandle, shape: tuple, dtype: np.dtype, offset: int,
                 readonly: bool, keep: Any = None, strides: Optional[tuple] = None,
                 data: Optional[int] = None, hand: Optional[list] = None):
        # The owner takes its own reference, last, in the step that records it (or takes the
        # caller's over, when `hand` holds `handle`: see HANDS): if anything here raises,
        # nothing was taken. data: the storage's data pointer, when the caller knows it.
        self.handle = self._lifetime = None
        self.keep = keep
        self.token = None  # the last token it was sent with (pyshm.reduction)
        self.facts = None  # (flags, data, nbytes) of memory received (pyshm.reduction)
        self.sent = None  # (weak reference to the array last sent, its start: pyshm.reduction)
        if data is None:
            data = lib.lshm_storage_data(handle) or 0
        self.__array_interface__ = array_interface(shape, dtype, data + offset, readonly,
                                                   strides)
        ref = weakref.ref(self, released)
        MARKS[weakref.ref(self, _died)] = ref  # (see DIED)
        REFERENCES[ref] = handle
        # right after the record, with no point between where a signal handler runs (see
        # HandleLifetime._release_with): retained first, a KeyboardInterrupt when the call
        # returned lost the reference
        if hand is not None and hand[0] is handle:
            hand[0] = None  # (taken over: see HANDS)
        else:
            lib.lshm_storage_retain(handle)
        if tracking:
            note_new_owner(ref)
        self._lifetime = ref
        self.handle = handle

    def _release_now(self) -> None:
        """Give up the owner's reference now (once; the arrays over it must not be used)."""
        self.handle = None
        if self._lifetime is not None:
            released(self._lifetime)

    def _release_never(self) -> None:
        REFERENCES.pop(self._lifetime, None)

    def _take_back(self, handle: _ffi.StorageHandle) -> None:
        """Hold `handle` again after _release_now gave it up (pyshm.Arena.free, refused by
        libshm): recorded, then retained in the next step (no point between, as in
        __init__)."""
        REFERENCES[self._lifetime] = handle
        lib.lshm_storage_retain(handle)
        self.handle = handle

    def _release_with(self, release: Any, *args: Any) -> None:
        raise TypeError("an ArrayOwner gives back its storage reference only")


# HANDS. A reference of a caller's that a new ArrayOwner (or Storage) adopts is handed over
# in a hand, a one-item list (``ArrayOwner(hand[0], ..., hand=hand)``): the owner records it
# and empties the hand with no point between where a signal handler runs, so whether it was
# taken is in the hand whatever KeyboardInterrupt came, even as the constructor returned (the
# caller then does not know the owner, and releasing the bare handle it passed released it
# twice). The caller's ``finally`` gives back what is still in the hand, inline (a Python
# function's entry would be one more point)::
#
#     if hand[0]:  # (then a C call: nothing between where a signal handler runs)
#         lib.lshm_storage_release(hand[0])
#
# The hand is filled so too: a NULL handle put in it, then libshm writes the new reference
# into it in place (``lshm_slab_find(..., byref(hand[0]))``), or a storage put in it right
# before it is retained, so that no reference is ever only in a local of a function an
# interrupt leaves (pyshm.reduction: unpickling our own memory).


def handle_of(holder: Any) -> Optional[_ffi.StorageHandle]:
    """The C storage of a holder of memory: an ArrayOwner's (None once given back) or a
    Storage's (ValueError once closed)."""
    if isinstance(holder, ArrayOwner):
        return holder.handle
    return holder._as_parameter_


def storage_fd(holder: Any) -> int:
    """The memfd behind a holder's C storage (see handle_of); the storage keeps it (not a new
    fd). OSError if it has none, ValueError if the Storage is closed or the owner has given
    its storage back."""
    handle = handle_of(holder)
    if handle is None:
        raise ValueError("pyshm: this array owner has given its storage back")
    fd = ctypes.c_int(-1)
    offset = ctypes.c_uint64(0)
    lib.lshm_storage_fd(handle, ctypes.byref(fd), ctypes.byref(offset))
    return fd.value


def normalize_shape(shape: ShapeLike) -> tuple:
    if isinstance(shape, (int, np.integer, bool, np.bool_)):
        shape = (shape,)
    try:
        dims = tuple(_dim(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in dims:
        if d < 0:
            raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def _dim(d: Any) -> int:
    if isinstance(d, (bool, np.bool_)):  # (an int to operator.index; numpy refuses it too)
        raise TypeError("a bool is not a dimension")
    return operator.index(d)


def array_dtype(dtype: Any) -> np.dtype:
    """``np.dtype(dtype)`` as an array of it gets it: a string of no length ('S0', 'U0')
    holds one character, as numpy's own arrays make it."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 0 and dtype.kind in "SU":
        dtype = np.dtype(dtype.str[:-1] + "1")
    return dtype


def nbytes_of(shape: tuple, dtype: np.dtype) -> int:
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects and cannot live in shared memory")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= 1 << 63:
        raise OverflowError(
            f"array of shape {shape} and dtype {dtype} is too large ({nbytes} bytes)")
    return nbytes


def wrap(handle: _ffi.StorageHandle, shape: tuple, dtype: np.dtype, offset: int = 0,
          keep: Any = None, readonly: bool = False) -> np.ndarray:
    """An array over C storage `handle` at byte `offset` (its owner takes its own reference);
    read-only if the storage is, or if `readonly`."""
    readonly = readonly or bool(lib.lshm_storage_flags(handle) & _ffi.STORAGE_READONLY)
    owner = ArrayOwner(handle, shape, dtype, offset, readonly, keep)
    array = np.asarray(owner)
    if array.dtype != dtype or dtype.metadata is not None:
        array = array.view(dtype)  # (structured dtypes, metadata: make the view exact)
    return array


def array_from_storage(
    handle: _ffi.StorageHandle, shape: Optional[ShapeLike], dtype: Any, offset: int,
    keep: Any = None
) -> np.ndarray:
    """An array over C storage `handle`, checked to fit; shape None: as many items as fit."""
    dtype = array_dtype(dtype)
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
    shape = normalize_shape(shape)
    need = nbytes_of(shape, dtype)
    if offset + need > nbytes:
        raise ValueError(
            f"array of {need} bytes at offset {offset} does not fit a storage of {nbytes} bytes"
        )
    return wrap(handle, shape, dtype, offset, keep)


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
    building that dict: 0.21 us instead of 1.04, min times of ``tools/bench_binding.py
    address``; once per array pickled)."""
    if _DATA_OFFSET is not None and type(array) is np.ndarray:
        return _from_address(id(array) + _DATA_OFFSET).value or 0
    return array.__array_interface__["data"][0]


def owner_of(array: Any) -> Optional[ArrayOwner]:
    base = getattr(array, "base", None)
    if isinstance(base, ArrayOwner):
        return base  # (the usual case: an array made over its owner)
    obj = array
    seen = 0
    while obj is not None and seen < 64:
        if isinstance(obj, ArrayOwner):
            return obj
        # (an array made through the buffer protocol, np.frombuffer(memoryview(a)): its base
        # is the memoryview, whose memory is its exporter's)
        obj = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
        seen += 1
    return None
