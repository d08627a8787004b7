"""Passing pyshm arrays and storages to other processes: zero-copy pickling, slabs, read-only.

How an array travels
--------------------
Importing :mod:`pyshm` registers reducers with :class:`multiprocessing.reduction.ForkingPickler`
for :class:`numpy.ndarray` and :class:`pyshm.Storage`. Everything multiprocessing pickles
(``Process`` arguments, ``Pool`` tasks and results, ``Queue``, ``Pipe``, under fork, spawn and
forkserver) then sends a pyshm array *by reference*: a few dozen bytes naming the memfd that
holds it (its ``(st_dev, st_ino)``), the byte range, dtype, shape and strides. The receiver maps
the memfd and builds an array over the same pages: writes on either side are seen by the other.

* An array pyshm owns but has not shared yet is **shared in place on send**
  (:func:`pyshm.share_memory_`, the way ``torch`` does it) when it is pickled on the caller's
  thread (see "Implicit shares" below): same address, every existing view keeps aliasing it.
  This is never a silent copy. Memory that cannot be shared in place (an
  array of a private :class:`pyshm.Arena`) is refused when it is pickled, in the sender, with
  :class:`pickle.PicklingError` saying what to do (``shared=True``, or send ``pyshm.copy``).
* Arrays whose memory pyshm does not own (any other ndarray) are pickled by numpy as usual,
  i.e. by value.
* Plain :func:`pickle.dumps` (no fd channel, e.g. to another host) is untouched: numpy pickles
  the array by value, with protocol-5 out-of-band buffers when asked
  (``pickle.dumps(a, protocol=5, buffer_callback=...)``); a :class:`pyshm.Storage` pickles the
  same way and unpickles as a new private storage with equal bytes.

fds travel out of band and only on a cache miss
-----------------------------------------------
The pickle carries tokens, never fds: the memfd's ``(st_dev, st_ino)``, the byte range, and a
secret that lets its holder fetch the fd from the sender's fd server (:mod:`pyshm._channel`:
the wire protocol, who gets which fd, holds, acknowledgements, exit). A receiver first looks
the memfd up in its per-process weak cache of mappings; only on a miss does it fetch the fd,
check that it is that memfd, map it whole **once** (``lshm_segment_attach``) and cache it.
Every array received from that memfd, however many times it is sent, is a view of that one
mapping (same address for the same bytes); its own libshm storage (a view of the mapping) is
made only if something asks for it (``storage_of``, a Storage of it). Memory that comes back
to the process it left is found by its byte range and is the very same storage (a ``Pool``
result returning its argument unchanged is a new view of the original array, at the original
address; an arena's tensor is that tensor), and forked children inherit the parent's cache,
so they need no fd at all. One round trip per message: the
first fetch of a message also brings the fds of its other memfds.

Implicit shares: an unshared array is shared in place when it is pickled on the caller's own
thread. On multiprocessing's own pickling threads (a ``Queue``'s feeder, a ``Pool``'s task
handler, and so ``ProcessPoolExecutor``) the caller may still be writing to it, and an in-place
share copies the bytes before it maps them back: there it is shared only under libshm's write
fence (``lshm_storage_share_fenced``: a concurrent write waits and lands in the shared pages),
and where this process has no fence (``LSHM_FENCE=0``, no userfaultfd write protection) it is
refused with :class:`pickle.PicklingError`, changing nothing.

Liveness: each message holds the memory it names until its receiver has it (fetched, or
acknowledged), for at most ``KEEPALIVE_SECONDS``; a multiprocessing child waits at exit for
its receivers. Memory that cannot be delivered raises :class:`DeliveryError`.

fd and mapping policy (why 100,000 small arrays work under ``ulimit -n 1024``)
-----------------------------------------------------------------------------
* Arrays of at most ``SLAB_MAX`` bytes (64 KiB) live in libshm's **slabs**, whether they
  are created with ``shared=True`` or shared in place later (:func:`pyshm.share_memory_`, or
  on send): 4 MiB of pages with one memfd (sealed against shrink and grow) per slab once one
  of its arrays is shared. 100,000 arrays of 4 KiB shared one by one use 98 fds in the sender
  and about as many in every receiver. Larger arrays get a memfd of their own: one fd and one
  mapping each. What a receiver of one slab array can read is said in the README ("What a
  receiver of a slab array can read").
* A receiver keeps each received memfd's fd (so it can send the array on) while it holds fewer
  than ``RLIMIT_NOFILE // 2`` of them and more than ``FD_RESERVE`` (8) fds stay free; beyond
  that it closes the fd right after mapping (``lshm_segment_close_fd``). Such an array is sent
  on as a token of the process it came from, which the next receiver then asks for it: it
  arrives while that process still holds the memory (its own memory comes back to it with no
  fetch), and raises ``DeliveryError`` once it does not. Extras handed out with a fetch (above)
  wait as fds, at most ``RLIMIT_NOFILE // 4`` of them, and a fetch asks for no more than the fds
  free less ``FD_RESERVE``. Under a limit of 4096 the fds free are counted (``/proc/self/fd``),
  so a receiver that starts with few fds left gets its arrays one fetch at a time, not an error.
* Mappings: one per memfd, and ``vm.max_map_count`` (65,530 by default) bounds them, so a
  receiver can hold at most ~65,000 distinct memfds at once (about 256 GiB of slabs, or 65,000
  in-place-shared arrays). Slabs are what make 100,000+ small arrays possible.
* A receiver of a slab array maps the slab's whole memfd: every array of the slab that was
  shared is visible to it; arrays never shared are not in the memfd.

Read-only sharing
-----------------
:func:`share_readonly` seals an array's memfd with ``F_SEAL_FUTURE_WRITE``
(``lshm_storage_seal_readonly``): this process keeps
writing through its existing mapping, every receiver gets a read-only array, and no receiver can
make a writable mapping of the fd or ``write`` to it (the kernel refuses, whatever the receiver
does). It needs the array to be alone in its memfd (not in a slab: sealing would make the slab's
other arrays read-only too), and its fd not to have been handed out writable yet (libshm then
forbids further seals); ``share_readonly(pyshm.copy(a))`` gives it a memfd of its own, of any
size (a private copy is shared in place). Receivers that
mapped it writable before the seal keep their mappings. Every memfd is also sealed against
shrink and grow, so no receiver can truncate it under the others (that would be SIGBUS).
"""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import resource
import weakref
from ctypes import byref
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar, Optional

import numpy as np

from . import _channel, _ffi, _memory
from ._channel import KEEPALIVE_SECONDS, DeliveryError, fetch_count  # noqa: F401 - public
from ._ffi import lib
from ._memory import (
    REFERENCES,
    ArrayOwner,
    HandleLifetime,
    array_interface,
    data_address,
    handle_of,
    owner_of,
    released,
    share_in_place,
    wrap,
)
from .arrays import copy as pyshm_copy
from .storage import Storage, reduce_storage_by_value
from .storage import storage_from_bytes as _storage_from_bytes  # noqa: F401 - old pickles' name

__all__ = [
    "share_readonly",
    "ref",
    "Ref",
    "bytes_at",
    "register",
    "segment_count",
    "DeliveryError",
    "SLAB_SIZE",
    "SLAB_MAX",
    "KEEPALIVE_SECONDS",
]

SLAB_SIZE = _ffi.SLAB_BYTES  # libshm's slabs (lshm.h: LSHM_SLAB_BYTES)
SLAB_MAX = _ffi.SLAB_MAX_BYTES  # storages up to this size live in slabs
RECENT_SLABS = 8
F_SEAL_FUTURE_WRITE = _channel.F_SEAL_FUTURE_WRITE
_WRITE_SEALS = _channel.WRITE_SEALS
_state = _channel.state


# --------------------------------------------------------------------------------------------
# Mappings: one per memfd per process, found by (st_dev, st_ino)
# --------------------------------------------------------------------------------------------


class _Mapping(HandleLifetime):
    """One reference to a mapped segment (a memfd received), cached weakly.

    Every array or storage built on it holds this object, so the cache entry lives exactly as
    long as something uses the mapping.
    """

    __slots__ = ("segment", "key", "size", "fd_kept", "sealed", "data", "flags", "ours",
                 "origin")

    def __init__(self, segment: _ffi.SegmentHandle, key: tuple, fd_kept: bool,
                 sealed: bool, origin: Optional[tuple] = None) -> None:
        self.segment = segment
        self.key = key
        # (address, secret) of the token whose sender handed this memfd over: what its
        # arrays are sent on as once its fd is closed (_forwarded)
        self.origin = origin
        self.size = lib.lshm_segment_size(segment)
        self.fd_kept = fd_kept
        # sealed against writes when it came; for good: a writable fd is handed out with
        # F_SEAL_SEAL, so nobody can add that seal later
        self.sealed = sealed
        self.data = lib.lshm_segment_data(segment) or 0
        self.flags = lib.lshm_segment_flags(segment)  # (what its views' flags start from)
        # one of our own slab memfds, come back without its storage being found: only then can
        # a later token naming it be a storage of ours (lshm_slab_knows says why that holds)
        self.ours = self.size == SLAB_SIZE and bool(lib.lshm_slab_knows(key[0], key[1]))
        self._release_with(_drop_segment, segment, fd_kept, keyed=True)

    def view_facts(self, offset: int, nbytes: int, readonly: bool) -> tuple:
        """(flags, data, nbytes) of a view of [offset, offset + nbytes) of this mapping, as
        lshm_storage_init_view sets them: what its array need not ask libshm for."""
        flags = _ffi.STORAGE_SHARED | self.flags | (_ffi.STORAGE_READONLY if readonly else 0)
        return flags, self.data + offset, nbytes


class _Cache:
    """The receiver's mappings (guarded by the channel's lock), rebuilt in a forked child."""

    def __init__(self) -> None:
        self.mappings: "weakref.WeakValueDictionary[tuple, _Mapping]" = (
            weakref.WeakValueDictionary()
        )
        self.kept_fds = 0
        # the few most recently received slabs, held strongly so that arrays sent one message
        # at a time do not re-map their slab every time (bounded: RECENT_SLABS x SLAB_SIZE)
        self.recent: list = []


_cache = _Cache()


def _mapped_here(key: tuple) -> bool:
    return key in _cache.mappings


_channel.mapped_here = _mapped_here  # (what the vouched secrets are pruned by)


def _drop_segment(key: int, segment: _ffi.SegmentHandle, fd_kept: bool,
                  _lifetimes: dict = _memory.LIFETIMES) -> None:
    # (a keyed release: its entry out, the count and the release with no point between where
    # a signal handler runs; a Ctrl-C at its entry leaves it to the next settle, see KEYED)
    if key in _lifetimes:
        del _lifetimes[key]
        if fd_kept:
            _cache.kept_fds -= 1
        lib.lshm_segment_release(segment)


_COUNT_FDS_BELOW = 4096  # under this RLIMIT_NOFILE, the fds open are counted (_free_fds)
FD_RESERVE = 8  # fds left free for the program by the fds pyshm keeps and asks for


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def _fd_budget() -> int:
    """How many fds of received memfds pyshm may keep open at most (half the limit)."""
    return max(1, _fd_limit() // 2)  # (a floor above the limit would ask for fds not there)


def _free_fds() -> Optional[int]:
    """How many more fds this process can open now, or None for "plenty" (a limit of
    _COUNT_FDS_BELOW or more: counting costs about 0.4 us per fd open, so it is done only
    where the limit is small enough for pyshm's fds to matter; or no /proc)."""
    limit = _fd_limit()
    if limit >= _COUNT_FDS_BELOW:
        return None
    try:
        open_now = _channel._held.open_fds()  # (os.listdir with the GIL held)
    except OSError as exc:
        return 0 if exc.errno in (errno.EMFILE, errno.ENFILE) else None
    return max(0, limit - open_now)


def _may_keep_fd(free: Optional[int]) -> bool:
    """Whether a received memfd's fd may stay open (without it, the memfd's arrays are sent
    on as tokens of their sender: _forwarded), leaving FD_RESERVE free for the program; `free`
    as _free_fds says (the fd in question open already)."""
    return _cache.kept_fds < _fd_budget() and (free is None or free > FD_RESERVE)


def _extras_room(free: Optional[int]) -> int:
    """How many extra fds a fetch may ask for beyond the one it needs: at most half the
    budget less those waiting already, and no more than `free` (_free_fds, now) less the
    fetch's socket and the fd it asks for and FD_RESERVE (the kernel drops fds that do not
    fit)."""
    room = min(_channel.MAX_EXTRAS, _fd_budget() // 2 - len(_state.prefetched))
    if free is not None:
        room = min(room, free - 2 - FD_RESERVE)
    return max(0, room)


def segment_count() -> int:
    """How many memfds this process maps as wholes: received ones (pyshm's cache of mappings)
    plus the memfds of libshm's slabs (one per slab that has shared storages)."""
    counters = _ffi.SlabCounters()
    lib.lshm_slab_stats(byref(counters))
    return len(_cache.mappings) + int(counters.memfds)


def _new_view(segment: _ffi.SegmentHandle, offset: int, nbytes: int,
              readonly: bool, out: Optional[_ffi.StorageHandle] = None) -> _ffi.StorageHandle:
    # (offset and nbytes come from a checked token: ints in [0, 2**63); out: see create_view)
    return _ffi.create_view(segment, offset, nbytes, _ffi.STORAGE_READONLY if readonly else 0,
                            out)


# --------------------------------------------------------------------------------------------
# Sender: making a storage sendable
# --------------------------------------------------------------------------------------------


def _memfd_facts(fd: int) -> Optional[tuple]:
    """(key, seals) of the memfd `fd`: its (st_dev, st_ino) as os.fstat gives them and its
    F_GET_SEALS, both read with the GIL held; None if `fd` is no memfd. F_GET_SEALS comes
    first: it refuses any other fd without asking its filesystem, where fstat could block (an
    fd of a hung mount, from a hostile sender) with the GIL held."""
    try:
        seals = _channel._held.seals(fd)
        return _channel._held.key(fd), seals
    except OSError:
        return None


def _received_seals(fd: int, key: tuple) -> int:
    """The seals of `fd`, handed over by a sender for the memfd `key` names; UnpicklingError
    unless it is that memfd."""
    facts = _memfd_facts(fd)
    if facts is None:
        raise pickle.UnpicklingError("pyshm: the fd received is not a memfd")
    if facts[0] != key:
        raise pickle.UnpicklingError("pyshm: the fd received is not the memfd that was named")
    return facts[1]


# multiprocessing pickles these on a thread of its own, while the caller goes on: an implicit
# share there could undo the caller's writes made after put()/apply_async() returned
_ASYNC_PICKLERS = ("Queue._feed", "Pool._handle_tasks")


def _export(holder: Any, mapping: Optional[_Mapping] = None) -> "_channel.Ticket":
    """Make the storage of `holder` (an ArrayOwner or a Storage) sendable; returns the ticket
    that becomes its token.

    `holder` keeps the storage (and so its memfd) alive; the message's batch holds it until
    the receiver has it (pyshm._channel). `mapping`: the cached segment the storage views
    (memory received), whose key and size are known already.
    """
    if mapping is not None and mapping.fd_kept:
        # memory received, sent on: all its export info is known already
        # (lshm_storage_export would make three syscalls to find it again); a view of the
        # whole-memfd mapping, whose flags, data and size its array may know (rebuild_ndarray)
        flags, data, nbytes = _facts_of(holder)
        if mapping.sealed or not flags & _ffi.STORAGE_READONLY:
            return _ticket(holder, flags, data, nbytes, mapping.key, mapping.size,
                           data - mapping.data, mapping.sealed)
    if (mapping is not None and not mapping.fd_kept and mapping.origin is not None
            and isinstance(holder, ArrayOwner)):
        # (an array's only: the holder a Storage's send registers in its sender is gone once
        # the Storage is fetched, so a token naming that sender would find nothing there)
        return _forwarded(holder, mapping)
    handle = handle_of(holder)
    rc, info = _ffi.export(handle)
    if rc == -errno.ENODATA:
        _share_for_sending(handle)
        rc, info = _ffi.export(handle)  # (shared by us or, meanwhile, by another thread)
    if rc == -errno.EBADF:
        raise pickle.PicklingError(
            "this pyshm array was received from another process and its fd was closed to "
            "stay under RLIMIT_NOFILE, so it cannot be sent on; raise 'ulimit -n' or send a "
            "copy (pyshm.copy(array, shared=True))"
        )
    if rc < 0:
        _ffi.raise_for(rc, "lshm_storage_export")
    _, offset, dev, ino, file_size, sealed, flags, data, nbytes = info
    readonly = bool(flags & _ffi.STORAGE_READONLY)
    if readonly and not sealed:
        raise _unsealed_readonly()
    readonly = readonly or bool(sealed)
    if mapping is not None:
        key, size = mapping.key, mapping.size
    else:
        key, size = (dev, ino), file_size
    return _ticket(holder, flags, data or 0, nbytes, key, size, offset, readonly)


def _handle_facts(handle: _ffi.StorageHandle) -> tuple:
    """(flags, data, nbytes) of a storage, from libshm."""
    return (lib.lshm_storage_flags(handle), lib.lshm_storage_data(handle) or 0,
            lib.lshm_storage_nbytes(handle))


def _facts_of(holder: Any) -> tuple:
    """(flags, data, nbytes) of the storage of `holder`, a view of a received memfd: what its
    array knows already (rebuild_ndarray), else libshm's."""
    facts = getattr(holder, "facts", None)
    return facts if facts is not None else _handle_facts(handle_of(holder))


def _unsealed_readonly() -> pickle.PicklingError:
    return pickle.PicklingError(
        "pyshm: this memory is read-only here but its memfd is not sealed against writes, so "
        "a receiver of it could write to it; send a sealed copy instead: "
        "pyshm.share_readonly(pyshm.copy(array))")


_NOT_REGISTERED = object()  # (a forwarded token's range is not the channel's: see _forwarded)


def _forwarded(holder: Any, mapping: _Mapping) -> "_channel.Ticket":
    """The ticket of memory received whose fd this process closed (_may_keep_fd), sent on:
    a token of the process it came from (mapping.origin: its address, and the secret its
    token carried), which the next receiver asks for that memfd, as if it had been sent
    that process's pickle itself. That sender hands it over while it holds the memory, and
    its own memory comes back to it with no fetch; this process cannot hand it over, as it
    has no fd for it, so no batch of its holds it (nor waits at exit for its receivers)."""
    flags, data, nbytes = _facts_of(holder)
    if flags & _ffi.STORAGE_READONLY and not mapping.sealed:  # (its secret opens it writable)
        raise _unsealed_readonly()
    readonly = mapping.sealed or bool(flags & _ffi.STORAGE_READONLY)
    address, secret = mapping.origin
    key, size, offset = mapping.key, mapping.size, data - mapping.data
    fields = (key, address, size, offset, nbytes, readonly, secret, None)
    # (an ArrayOwner, see _export: a new ticket each send, as reduce_ndarray finds the range
    # not registered)
    holder.token = (flags, (key, size, offset, nbytes), _NOT_REGISTERED, data, key, readonly,
                    fields)
    return _channel.Ticket(key, None, readonly, fields)


def _share_for_sending(handle: _ffi.StorageHandle) -> None:
    """Share an unshared storage in place because it is being pickled (implicit share)."""
    if lib.lshm_storage_flags(handle) & _ffi.STORAGE_SHARED:
        return  # another thread did it meanwhile
    # in place, same address, atomic on failure (idempotent: a concurrent share copies once);
    # memory that cannot be shared in place is refused here, in the sender; on a thread of
    # multiprocessing's own only under the write fence
    fenced = _share_fenced_or_refuse if _channel.on_thread_of(_ASYNC_PICKLERS) else None
    share_in_place(handle, "pickling for another process", pickle.PicklingError, fenced)


def _share_fenced_or_refuse(handle: _ffi.StorageHandle) -> None:
    """lshm_storage_share_fenced: multiprocessing (or an engine) pickles on a thread of its
    own while the caller's code goes on, maybe writing to the array; where no fence can keep
    those writes, PicklingError (nothing changed)."""
    rc = lib.lshm_storage_share_fenced(handle)
    if rc == -errno.EOPNOTSUPP:
        why = lib.lshm_last_error().decode("utf-8", "replace")
        raise pickle.PicklingError(
            "pyshm: this array is not shared yet, and multiprocessing is pickling it on a "
            "thread of its own (a Queue's feeder, a Pool's task handler) while your code "
            "may still be writing to it; this process cannot write-protect it during a share "
            f"(libshm: {why}), so sharing it in place now could undo those writes. Share it "
            "before sending it: pyshm.share_memory_(array), or create it with shared=True")
    _ffi.raise_for(rc, "lshm_storage_share_fenced")


def share_if_fenced(a: Any) -> bool:
    """For an engine pickling pyshm memory not shared yet on a thread of its own (torch's and
    joblib's reducers): True once `a`'s storage is shared in place under libshm's write fence
    (no write of the other threads lost), whatever thread this is; False where it cannot be
    (no fence in this process, memory that cannot be shared in place, a failed share: nothing
    changed), and the engine then goes its own way, as without pyshm. Memory received is
    shared already (True)."""
    owner = owner_of(a)
    if owner is None or owner.facts is not None:
        return owner is not None
    try:
        share_in_place(owner.handle, "pickling for another process", pickle.PicklingError,
                       _share_fenced_or_refuse)
    except (pickle.PicklingError, OSError, MemoryError):
        return False
    return True


def _ticket(holder: Any, flags: int, data: int, nbytes: int, key: tuple,
            size: int, offset: int, readonly: bool) -> "_channel.Ticket":
    address, secret, ref, key = _channel.export(key, holder, size, offset, nbytes, readonly)
    ticket = _channel.Ticket(key, holder, readonly,
                             (key, address, size, offset, nbytes, readonly, secret, None))
    if isinstance(holder, ArrayOwner):
        # every later send of the same owner reuses the token while nothing it depends on
        # changed (see reduce_ndarray)
        holder.token = (flags, (key, size, offset, nbytes), ref, data, key, readonly,
                         ticket.fields)
    return ticket


# --------------------------------------------------------------------------------------------
# Receiver
# --------------------------------------------------------------------------------------------


def _check_token(token: Any) -> tuple:
    """The fields of a token from a pickle, checked (UnpicklingError if malformed): (key,
    address, size, offset, nbytes, readonly, secret, solo), key a pair of ints in [0, 2**64),
    the range inside the memfd, readonly a bool. A token as pyshm senders make it (ints
    already) is checked without converting anything."""
    try:
        key, address, size, offset, nbytes, readonly, secret, solo = token
        secret = _channel.secret_bytes(secret)  # (in band or out of band)
        if not (type(key) is tuple and len(key) == 2 and type(key[0]) is int
                and type(key[1]) is int and type(size) is int and type(offset) is int
                and type(nbytes) is int):
            key = (int(key[0]), int(key[1]))
            size, offset, nbytes = int(size), int(offset), int(nbytes)
        if solo is not None:
            solo = (int(solo[0]), _channel.secret_bytes(solo[1]))
        readonly = readonly if type(readonly) is bool else bool(readonly)
    except (TypeError, ValueError, IndexError, OverflowError) as error:  # (inf: Overflow)
        # (neither the token nor the error's message, which may quote a field: a framework
        # logging this message would show its secrets)
        raise pickle.UnpicklingError("bad pyshm token: not the 8 fields pyshm makes "
                                     f"({type(error).__name__})") from None
    if secret is None or (solo is not None and not (solo[1] is not None
                                                    and 0 < solo[0] < 1 << 64)):
        raise pickle.UnpicklingError("bad pyshm token: malformed secret")
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise pickle.UnpicklingError(
            f"bad pyshm token: {nbytes} bytes at offset {offset} of a {size}-byte memfd"
        )
    if not (0 <= key[0] < 1 << 64 and 0 <= key[1] < 1 << 64):
        raise pickle.UnpicklingError(f"bad pyshm token: no memfd is {key!r}")
    return key, address, size, offset, nbytes, readonly, secret, solo


_UNCOUNTED = object()  # (_attach: the fds free not known, to be counted)


def _is_slab(size: int, nbytes: int) -> bool:
    """Whether a memfd of `size` bytes, received for a storage of `nbytes`, is a slab: the
    one kind _cache.recent keeps mapped (any other memfd is unmapped once nothing uses it).
    Every memfd is named alike, so a slab is told by its size and its storages' (at most
    SLAB_MAX each)."""
    return size == SLAB_SIZE and nbytes <= SLAB_MAX


def _attach(fd: int, key: tuple, seals: int, readonly: bool, origin: tuple, nbytes: int,
            free: Any = _UNCOUNTED) -> _Mapping:
    """Map a received memfd whole (validated by libshm) and cache it (lock held).

    `fd` is the memfd `key` names, with `seals` (_received_seals). `origin`: (sender
    address, secret) of the token it was handed over for, `nbytes` the size of its range
    (_is_slab). `free`: the fds free as _free_fds would say, when the caller knows (the
    count before its fetch, less what the fetch brought)."""
    sealed = bool(seals & _WRITE_SEALS)
    readonly = readonly or sealed
    out = _ffi.SegmentHandle()
    try:
        lib.lshm_segment_attach(fd, _ffi.STORAGE_READONLY if readonly else 0, byref(out))
    except _ffi.ShmValueError as exc:  # (a memfd libshm does not map: hugetlbfs)
        raise pickle.UnpicklingError(f"pyshm: the fd received is not a memfd pyshm maps "
                                     f"({exc.strerror})") from None
    keep = _may_keep_fd(_free_fds() if free is _UNCOUNTED else free)
    if keep:
        _cache.kept_fds += 1
    else:
        lib.lshm_segment_close_fd(out)
    mapping = _Mapping(out, key, fd_kept=keep, sealed=sealed, origin=origin)
    _cache.mappings[key] = mapping
    if _memory.tracking:
        _memory.note_new_owner(weakref.ref(mapping))
    if _is_slab(mapping.size, nbytes):
        _cache.recent.append(mapping)
        del _cache.recent[:-RECENT_SLABS]
    return mapping


def _own_storage(key: tuple, size: int, offset: int, nbytes: int, readonly: bool,
                 mapping: Optional[_Mapping], hand: list) -> tuple:
    """_own_memory's find: the storage itself, a view of the memfd (read-only if `readonly`)
    or a slab's storage, with a new reference in `hand` (see _resolve)."""
    # (ranges and the channel's holders only know memfds exported from here, which all have
    # secrets: a memfd received from elsewhere skips both)
    exported = key in _state.secrets
    ref = _state.ranges.get((key, size, offset, nbytes)) if exported else None
    holder = ref() if ref is not None else None
    handle = handle_of(holder) if holder is not None else None
    if handle:
        # the very same storage, retained right after it is in the hand (no point between
        # where a signal handler runs: see _resolve)
        hand[0] = handle
        lib.lshm_storage_retain(handle)
        token = getattr(holder, "token", None)
        if token is not None:
            # its flags, data and size, as its last export read them (none of them changes
            # once it is exported: lshm_storage_seal_readonly then refuses)
            flags, where, _, data, *_ = token
            return handle, (flags, data, where[3])
        return handle, None
    holder = _channel.lookup(key) if exported else None
    if holder is not None:
        # another storage of the same memfd (a tensor of a shared arena, a Storage.attach
        # view): a view of the same pages at the same address
        segment = lib.lshm_storage_segment(handle_of(holder))
        if segment and lib.lshm_segment_size(segment) == size:
            out = hand[0] = _ffi.StorageHandle()  # (see _resolve)
            return _new_view(segment, offset, nbytes, readonly, out), None
    if size == SLAB_SIZE and (mapping is None or mapping.ours):
        # ours, sent back by a forked child that inherited it
        out = hand[0] = _ffi.StorageHandle()  # (see _resolve)
        if _ffi.slab_find_unchecked(key[0], key[1], offset, nbytes, byref(out)) != 0:
            return None, None  # not one of our slabs' (or no live storage there)
        return out, None
    return None, None


def _own_memory(key: tuple, size: int, offset: int, nbytes: int, readonly: bool,
                mapping: Optional[_Mapping], hand: list) -> tuple:
    """(a storage of this process for that byte range of memfd `key` (its new reference in
    `hand`, the caller's: see _resolve) or None, its (flags, data, nbytes) if known): memory
    that left from here coming back (lock held). `mapping`: the cached mapping of `key`, if
    any. With `readonly`
    the facts say read-only whatever the storage is (a read-only secret opens no more here
    than in another process; memory of ours with a read-only secret is sealed, so sending
    such an array on gives read-only tokens too)."""
    handle, facts = _own_storage(key, size, offset, nbytes, readonly, mapping, hand)
    if handle is not None and readonly:
        flags, *rest = facts if facts is not None else _handle_facts(handle)
        facts = (flags | _ffi.STORAGE_READONLY, *rest)
    return handle, facts


def _resolve(batch: Optional[_channel.ReceivedBatch], fields: tuple,
             hand: list) -> tuple:
    """(mapping or None, a storage handle, its (flags, data, nbytes) or None) for the checked
    fields of a token (_check_token). The handle is in `hand`, the caller's ``[None]``, with
    a new reference, the caller's.

    The reference is in the hand from the step that takes it on: a storage of ours is put in
    the hand right before it is retained, and a NULL handle right before libshm writes a new
    one into it in place (a view, a slab's storage found), with no point between where a
    signal handler runs. The caller's owner or Storage takes it over from the hand in the
    step that records it, and the caller's ``finally`` releases whatever the hand still holds
    (see pyshm._memory.HANDS): a Ctrl-C (KeyboardInterrupt) anywhere neither leaks nor
    releases twice. A reference retained here and handed up as a result leaked at about six
    points on its way, and one adopted by the owner could not tell the caller, as the
    constructor returned, that it had taken it.

    A token stands for memory this process has (its own, or a memfd mapped here) without a
    fetch only if its secret says it may (_channel.vouched); any other token must have its
    memfd handed over by its sender (fetched, or as an extra of its own message's fetch),
    which proves the sender had it, before it stands for anything here."""
    key, address, size, offset, nbytes, readonly, secret, solo = fields
    # (a message's batch proof goes only to the process that sent the message: a token of
    # another process in it, sent on (_forwarded), is fetched without it, as that process
    # could fetch the message's other memfds with it)
    proof = solo if solo is not None else (
        batch.proof if batch is not None and batch.address == address else None)
    message = (address, proof)  # (what extras are handed out for: see _keep_extras)
    fd = None
    with _state.lock:
        mapping = _cache.mappings.get(key)
        trusted = _channel.vouched(key, address, secret)
        if trusted == _channel.READ_ONLY:
            readonly = True  # (whatever the token says: its secret opens no more)
        if trusted:
            handle, facts = _own_memory(key, size, offset, nbytes, readonly, mapping, hand)
            if handle is not None:
                if solo is not None:
                    _channel.queue_ack(address, solo)
                return None, handle, facts
        if mapping is None or not trusted:
            entry = _state.prefetched.get(key)
            if entry is not None and proof is not None and entry[3] == message and (
                    entry[0] is not None or mapping is not None):
                # handed to us with an earlier fetch of this very message: its sender had it
                del _state.prefetched[key]
                fd, _, extra_readonly, _ = entry
                try:
                    # (an extra's fd was checked to be its memfd on arrival: _keep_extras)
                    seals = None if fd is None else _channel._held.seals(fd)
                    readonly = readonly or extra_readonly or (
                        mapping.sealed if seals is None else bool(seals & _WRITE_SEALS))
                    _channel.vouch(key, secret, readonly)
                    trusted = True
                    handle, facts = _own_memory(key, size, offset, nbytes, readonly, mapping,
                                                hand)
                    if handle is not None:
                        return None, handle, facts
                    if mapping is None:
                        mapping = _attach(fd, key, seals, readonly, (address, secret), nbytes)
                finally:
                    if fd is not None:
                        os.close(fd)
                fd = None
            else:
                acks = _channel.take_acks(address)
                free = _free_fds()
                room = 0 if solo is not None else _extras_room(free)
        if trusted and mapping is not None and solo is not None:
            _channel.queue_ack(address, solo)
    if mapping is None or not trusted:
        # Never hold the lock while waiting for another process: two processes fetching
        # from each other would deadlock.
        (fd,), extras, released = _channel.fetch(address, [(key, secret)], proof, room, acks)
        if free is not None:  # (the fd asked for and the extras are open now: counted as such)
            free -= 1 + len(extras)
        try:
            with _state.lock:
                _keep_extras(extras, message)
                extras = []
                if released and proof is not None:  # (no acknowledgement needed)
                    _channel.settle(address, proof[0])
                if fd is None:
                    raise DeliveryError(
                        "pyshm: the sending process did not hand over this memory: it does not "
                        "hold it any more (it dropped it, and nobody fetched it within the "
                        f"{KEEPALIVE_SECONDS:.0f} s keep-alive after it was pickled), or this "
                        "pickle's secret or memfd key is not one it made (a damaged or forged "
                        "pickle)"
                    )
                seals = _received_seals(fd, key)
                readonly = readonly or bool(seals & _WRITE_SEALS)  # (what the secret opened:
                # see vouched)
                _channel.vouch(key, secret, readonly)
                mapping = _cache.mappings.get(key)  # another thread may have won the race
                handle, facts = _own_memory(key, size, offset, nbytes, readonly, mapping, hand)
                if handle is not None:
                    return None, handle, facts
                if mapping is None:
                    mapping = _attach(fd, key, seals, readonly, (address, secret), nbytes,
                                      free)
        finally:
            if fd is not None:
                os.close(fd)
            for _, _, extra in extras:
                os.close(extra)
    if mapping.size != size:
        raise pickle.UnpicklingError(
            f"pyshm: memfd is {mapping.size} bytes, the sender said {size}"
        )
    out = hand[0] = _ffi.StorageHandle()
    return (mapping, _new_view(mapping.segment, offset, nbytes, readonly, out),
            mapping.view_facts(offset, nbytes, readonly))


def _keep_extras(extras: list, message: tuple) -> None:
    """Keep the fds a fetch for `message` ((sender address, batch proof)) handed out beyond
    the one asked for, briefly, for that message's own tokens (lock held): a token of another
    message naming the same memfd proves nothing by it. One mapped here already is closed at
    once, but noted: the message's token for it is then vouched for (_resolve). Takes each
    out of `extras` as it goes: on an error, what is left there is the caller's to close."""
    deadline = _channel.time.monotonic() + _channel.PREFETCH_SECONDS
    while extras:
        key, readonly, fd = extras.pop()
        facts = _memfd_facts(fd)
        valid = facts is not None and facts[0] == key
        if not valid or key in _state.prefetched:
            os.close(fd)  # a lie, or one we have already
        elif key in _cache.mappings:
            os.close(fd)
            _state.prefetched[key] = (None, deadline, readonly, message)
        else:
            _state.prefetched[key] = (fd, deadline, readonly, message)
    if _state.prefetched:
        _channel.ensure_janitor()


def _fits(nbytes: int, shape: Any, dtype: Any, strides: Any, start: Any) -> bool:
    """Whether an array of that layout lies inside a storage of `nbytes` bytes (what
    np.ndarray(buffer=...) checks), for a layout that came in a pickle."""
    if (type(shape) is not tuple or type(strides) is not tuple or len(shape) != len(strides)
            or type(start) is not int):
        return False
    if len(shape) == 1:  # (the usual case, without the loop)
        dim, stride = shape[0], strides[0]
        if type(dim) is not int or type(stride) is not int or dim <= 0:
            return False
        span = (dim - 1) * stride
        return (start + span if stride < 0 else start) >= 0 and (
            (start if stride < 0 else start + span) + dtype.itemsize <= nbytes)
    low = high = start
    for dim, stride in zip(shape, strides):
        if type(dim) is not int or type(stride) is not int or dim <= 0:
            return False  # (an empty array is never sent by reference)
        if stride < 0:
            low += (dim - 1) * stride
        else:
            high += (dim - 1) * stride
    return low >= 0 and high + dtype.itemsize <= nbytes


_HANDLE = ArrayOwner.__dict__["handle"]  # the slots a _ReceivedOwner fills itself
_LIFETIME = HandleLifetime.__dict__["_lifetime"]


class _ReceivedOwner(ArrayOwner):
    """The owner of an array received from a memfd mapped here (_rebuild_quickly).

    The mapping it keeps holds the memory; its C storage (a view of the mapping, one libshm
    call and a lock) is made the first time something asks for ``handle`` (a Storage of it,
    a fresh export that needs libshm): an array that is only read, written and sent on never
    needs one.
    """

    __slots__ = ("_view",)

    def __init__(self, mapping: _Mapping, offset: int, nbytes: int, readonly: bool,
                 shape: tuple, dtype: np.dtype, strides: tuple, start: int) -> None:
        _HANDLE.__set__(self, None)
        _LIFETIME.__set__(self, None)
        self.keep = mapping
        self.token = self.sent = None
        self._view = (offset, nbytes, readonly)
        flags, data, _ = self.facts = mapping.view_facts(offset, nbytes, readonly)
        self.__array_interface__ = array_interface(
            shape, dtype, data + start, bool(flags & _ffi.STORAGE_READONLY), strides)

    @property
    def handle(self) -> Optional[_ffi.StorageHandle]:
        handle = _HANDLE.__get__(self)
        if handle is None and self._view is not None:
            with _state.lock:  # (two threads asking at once make one view)
                handle = _HANDLE.__get__(self)
                if handle is None and self._view is not None:
                    offset, nbytes, readonly = self._view
                    # The view is recorded NULL, then made in place: a Ctrl-C as libshm
                    # returned lost a view made first (and the mapping with it, until the
                    # process exited). A call cut off after the record left it: the same one
                    # (another weak reference to this owner equals it, so a second record
                    # replaced the first, a view made already with it).
                    ref = _LIFETIME.__get__(self)
                    if ref is None:
                        ref = weakref.ref(self, released)
                        _memory.MARKS[weakref.ref(self, _memory._died)] = ref  # (see DIED)
                        REFERENCES[ref] = _ffi.StorageHandle()
                        _LIFETIME.__set__(self, ref)
                    handle = REFERENCES[ref]
                    if not handle:
                        _new_view(self.keep.segment, offset, nbytes, readonly, handle)
                        if _memory.tracking:
                            _memory.note_new_owner(ref)
                    _HANDLE.__set__(self, handle)
        return handle

    @handle.setter
    def handle(self, value: Optional[_ffi.StorageHandle]) -> None:
        # (ArrayOwner._release_now: None, for good)
        self._view = None
        _HANDLE.__set__(self, value)


def _own_array_back(token: Any, shape, dtype, strides, start, writeable
                    ) -> Optional[np.ndarray]:
    """An array of ours that comes back in the layout it left with (writeable): a new view of
    that very array; else None. Before any token check: a range registered here is one of
    our own exports' (the same ints), so the token names valid memory whatever else it says,
    and nothing else of it is used."""
    try:
        key, address, size, offset, nbytes, _, secret, solo = token
        if solo is not None or not writeable or type(start) is not int or (
                key not in _state.secrets):
            return None
        # ours if the range is still registered to an owner, and quickly when that owner last
        # sent this very layout
        ref = _state.ranges.get((key, size, offset, nbytes))
    except (TypeError, ValueError):  # (not a token: the general path says why)
        return None
    # (and only for a token whose secret says so: its numbers anyone can write)
    if ref is None or _channel.vouched(key, address, secret) != _channel.WRITABLE:
        return None
    holder = ref()
    sent = getattr(holder, "sent", None)
    array = sent[0]() if sent is not None else None
    # (writeable only: a view of a writeable array could be made writeable again, where the
    # general path's read-only array cannot)
    if (array is None or sent[1] != start or array.shape != shape or array.strides != strides
            or array.dtype is not dtype and array.dtype != dtype
            or not array.flags.writeable):
        return None
    return _exact_dtype(array.view(), dtype)


def _own_part_back(fields: tuple, shape, dtype, strides, start, writeable
                   ) -> Optional[np.ndarray]:
    """For a checked token's fields (_check_token) naming part of a range we exported but not
    that range itself: an array over the storage of ours that holds it, at its own address;
    else None (the general path decides). A receiver makes such tokens for memory it found by
    address (bytes_at: a tensor over part of an array it received, a DLPack view), whose
    storage is that part alone. Without this, memory of a slab (or shared in place) that no
    storage of ours views exactly would be fetched back from the receiver and mapped a second
    time: the same bytes at another address, whose overlap with our arrays numpy cannot see.
    Only for a token whose secret is ours for that memfd (vouched), as _own_array_back."""
    key, address, size, offset, nbytes, readonly, secret, solo = fields
    if solo is not None or key not in _state.secrets or (
            _state.ranges.get((key, size, offset, nbytes)) is not None):
        return None  # (not ours, or a range of ours: the general path finds its storage)
    if not _fits(nbytes, shape, dtype, strides, start):
        return None
    hand = [None]  # (see _resolve)
    try:
        with _state.lock:
            level = _channel.vouched(key, address, secret)
            if not level:
                return None
            for (k, s, o, n), ref in list(_state.ranges.items()):
                holder = ref() if k == key and s == size and o <= offset and (
                    offset + nbytes <= o + n) else None
                try:
                    found = handle_of(holder) if holder is not None else None
                except ValueError:  # (a closed Storage)
                    found = None
                if found:
                    hand[0] = found  # (then retained: no point between, see _resolve)
                    lib.lshm_storage_retain(found)
                    delta = offset - o
                    break
            else:
                return None
        handle = hand[0]
        flags, data = lib.lshm_storage_flags(handle), lib.lshm_storage_data(handle) or 0
        readonly = (readonly or level == _channel.READ_ONLY
                    or bool(flags & _ffi.STORAGE_READONLY))
        try:
            owner = ArrayOwner(handle, shape, dtype, delta + start, readonly, strides=strides,
                               data=data, hand=hand)
        except (TypeError, ValueError):  # (a dtype the interface cannot describe: the
            return None  # general path makes it through a flat view)
    finally:
        if hand[0]:  # (then a C call: nothing between where a signal handler runs)
            lib.lshm_storage_release(hand[0])
    try:
        array = _exact_dtype(np.asarray(owner), dtype)
    except (TypeError, ValueError, OverflowError):
        return None  # (the general path says why)
    if array is not None and not writeable and array.flags.writeable:
        array.flags.writeable = False
    return array


def _mapped_array(fields: tuple, shape, dtype, strides, start, writeable
                  ) -> Optional[np.ndarray]:
    """For a checked token's fields (_check_token): an array of a memfd received and mapped
    here already (not ours, not a range of ours), made without libshm (_ReceivedOwner); else
    None (the general path decides)."""
    key, address, size, offset, nbytes, readonly, secret, solo = fields
    if solo is not None:
        return None
    ref = _cache.mappings.data.get(key)  # (WeakValueDictionary.get, without its frame)
    mapping = ref() if ref is not None else None
    if mapping is not None:
        level = _channel.vouched(key, address, secret)
        if not level or (level == _channel.READ_ONLY and not readonly):
            return None  # (a secret we cannot check, or read-only: the general path decides)
    # (a range of ours that is not registered is memory received, sent on and come back: its
    # other holders here are views of this mapping, as _own_memory would make; mapping.ours
    # says a slab of ours came back, which only lshm_slab_find can find)
    if (mapping is None or mapping.ours or size != mapping.size
            or (key in _state.secrets and _state.ranges.get((key, size, offset, nbytes)))
            or not _fits(nbytes, shape, dtype, strides, start)):
        return None
    try:
        array = np.asarray(_ReceivedOwner(mapping, offset, nbytes, readonly, shape, dtype,
                                          strides, start))
    except (TypeError, ValueError, OverflowError):
        return None  # (the general path says why)
    array = _exact_dtype(array, dtype)
    if array is not None and not writeable and array.flags.writeable:
        array.flags.writeable = False
    return array


def _exact_dtype(array: np.ndarray, dtype: np.dtype) -> Optional[np.ndarray]:
    """`array` with exactly `dtype` (its metadata too, which dtype equality ignores), or None
    if the array interface gave another dtype."""
    if array.dtype is dtype:
        return array
    if array.dtype != dtype:
        return None
    return array.view(dtype) if dtype.metadata is not None else array


# The holder a range of our memory is registered to (the array it was sent as, or the message
# that carries it until it is delivered), for each array or Storage of ours made from a token
# of that range: while one lives, its memory stays fetchable with the token's secret, and a
# token of it is found here (_own_storage), as pyshm.ref promises: the holder alone went with
# the message, and a pickle unpickled again here (Ray does it at every ray.get in the
# driver), or in another process, then got DeliveryError while an array of it lived.
# Each such owner or Storage keeps it in an entry of its own in pyshm._memory.LIFETIMES
# (keep_alive_with: a keyed release lets it go, whatever Ctrl-C comes as the owner dies).


def _keep_range_holder(made: Any, fields: tuple) -> None:
    """Let `made` (a new owner or Storage of our own memory, from a token's checked `fields`)
    keep the holder that range is registered to alive."""
    key, _, size, offset, nbytes = fields[:5]
    ref = _state.ranges.get((key, size, offset, nbytes))
    holder = ref() if ref is not None else None
    if holder is not None and holder is not made:
        _memory.keep_alive_with(made, holder)


def rebuild_ndarray(batch, token, shape, dtype, strides, start, writeable) -> np.ndarray:
    """The array a pickled pyshm array names (the memory may be ours, mapped here already, or
    fetched from its sender); on a thread an exception would wedge, an Undelivered instead of
    any error (_channel.stand_in)."""
    try:
        return _build_ndarray(batch, token, shape, dtype, strides, start, writeable)
    except Exception as exc:
        stand_in = _rebuild_failed(batch, exc)
        if stand_in is None:
            raise
        return stand_in


def _rebuild_failed(batch: Any, error: Exception) -> Optional[_channel.Undelivered]:
    """For a rebuild that failed with `error`: what it returns instead (_channel.stand_in),
    or None (it raises `error`). A message whose unpickling raises for want of fds here is
    not acknowledged (ReceivedBatch.kept_for_retry): loaded again with fds free, it gets its
    memory."""
    stand_in = _channel.stand_in(error)
    if stand_in is None and isinstance(error, _channel._WantHere) and isinstance(
            batch, _channel.ReceivedBatch):
        batch.kept_for_retry()
    return stand_in


def _check_reachable(token: Any) -> None:
    """DeliveryError for a token whose sender this process cannot reach (another machine, a
    VM restored from the same snapshot, another network namespace, or a sender gone): its
    memfd's numbers may equal those of memory here, ours or received, which must not stand
    in for it (_channel.reachable); it cannot be fetched either. But for memory of ours that
    the token proves it names (one of our secrets for it, or one a child forked from us made
    of one: a child that sent it back and exited at once)."""
    if type(token) is not tuple or len(token) != 8:
        return  # (not a token: _check_token says why)
    address = token[1]
    if _channel.reachable(address):  # (a sender reached before: a dict lookup)
        return
    if not _channel.is_address(address):
        raise pickle.UnpicklingError("bad pyshm token: no sender's address")
    if not _channel.own_token(token[0], address, token[6]):
        _channel.want_no_socket()  # (reachable() says no when it has no fd to ask with)
        raise DeliveryError(_channel.elsewhere(address) or (
            "pyshm: the process that sent this memory cannot be reached from here: it runs "
            "on another machine (or in another network namespace), or it has exited or was "
            "killed"))


def _build_ndarray(batch, token, shape, dtype, strides, start, writeable) -> np.ndarray:
    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        # (pointers read from shared memory would crash the receiver)
        raise pickle.UnpicklingError(f"pyshm: no array of dtype {dtype!r} in shared memory")
    _check_reachable(token)
    array = _own_array_back(token, shape, dtype, strides, start, writeable)
    if array is not None:
        return array
    fields = _check_token(token)
    array = _mapped_array(fields, shape, dtype, strides, start, writeable)
    if array is None:
        array = _own_part_back(fields, shape, dtype, strides, start, writeable)
    if array is not None:
        return array
    hand = [None]  # (see _resolve)
    try:
        mapping, handle, facts = _resolve(batch, fields, hand)
        if facts is None:
            facts = _handle_facts(handle)
        flags, data, nbytes = facts
        if not _fits(nbytes, shape, dtype, strides, start):
            # (never numpy's check instead: np.ndarray(buffer=, strides=) takes any layout
            # over an empty buffer, and huge negative strides wrap around in it)
            raise pickle.UnpicklingError(
                f"pyshm: an array of shape {shape!r} and strides {strides!r} at byte "
                f"{start!r} does not fit its {nbytes} bytes of shared memory")
        readonly = bool(flags & _ffi.STORAGE_READONLY)
        # the array itself over the storage, in one step
        try:
            owner = ArrayOwner(handle, shape, dtype, start, readonly, keep=mapping,
                               strides=strides, data=data, hand=hand)
        except (TypeError, ValueError):
            owner = None  # a dtype the interface cannot describe (dtype.descr refuses it)
        if owner is not None:
            if mapping is not None:
                owner.facts = facts  # (for sending it on: see _export)
            else:
                _keep_range_holder(owner, fields)
            try:
                array = np.asarray(owner)
            except (TypeError, ValueError, OverflowError) as exc:
                raise pickle.UnpicklingError(f"pyshm: bad array layout: {exc}") from None
            exact = _exact_dtype(array, dtype)
            if exact is not None:
                if not writeable and exact.flags.writeable:
                    exact.flags.writeable = False
                return exact
        # a dtype the interface could not say (exactly): through a flat view
        flat = wrap(handle, (nbytes,), np.dtype(np.uint8), 0, keep=mapping, readonly=readonly)
        if mapping is None:
            _keep_range_holder(flat.base, fields)  # (the owner the array is made over)
    finally:
        if hand[0]:  # (then a C call: nothing between where a signal handler runs)
            lib.lshm_storage_release(hand[0])
    try:
        array = np.ndarray(shape, dtype, buffer=flat, offset=start, strides=strides)
    except (TypeError, ValueError, OverflowError) as exc:
        raise pickle.UnpicklingError(f"pyshm: array does not fit its storage: {exc}") from None
    if not writeable and array.flags.writeable:
        array.flags.writeable = False
    return array


def _rebuild_storage(batch, token) -> Storage:
    hand = [None]  # (see _resolve)
    try:
        _check_reachable(token)
        fields = _check_token(token)
        mapping, handle, facts = _resolve(batch, fields, hand)
        if facts is not None and facts[0] & _ffi.STORAGE_READONLY and not (
                lib.lshm_storage_flags(handle) & _ffi.STORAGE_READONLY):
            # (memory of ours, writable here, named read-only: a Storage of it would be
            # writable, which the pickle's read-only secret does not open)
            raise pickle.UnpicklingError(
                "pyshm: this pickle names memory of this process read-only, which is writable "
                "here: it cannot be a Storage (that would be writable); unpickle an array of "
                "it instead, which is read-only")
        storage = Storage._retaining(handle, keep=mapping, hand=hand)
    except Exception as exc:
        stand_in = _rebuild_failed(batch, exc)
        if stand_in is None:
            raise
        return stand_in
    finally:
        if hand[0]:  # (then a C call: nothing between where a signal handler runs)
            lib.lshm_storage_release(hand[0])
    if mapping is None:
        _keep_range_holder(storage, fields)
    return storage


# --------------------------------------------------------------------------------------------
# Reducers
# --------------------------------------------------------------------------------------------


def reduce_ndarray(array: np.ndarray):
    owner = owner_of(array)
    if owner is None and array.base is not None and type(array) is np.ndarray:
        found = _found_by_address(array)  # (pyshm memory through another exporter: DLPack)
        if found is not None:
            array, owner = found, owner_of(found)
    if owner is None or array.nbytes == 0:
        # numpy's own by-value pickling (also for items of a zero-size dtype, which have no
        # bytes to send by reference)
        return array.__reduce_ex__(4)
    _channel.check_user()  # (a process that changed its user: a token made before is not)
    token = owner.token
    # The token made at this owner's last send still holds while the storage's flags are the
    # same (a defence: once shared they do not change; a view of memory received has no C
    # storage to ask, maybe), the channel still has the range registered to this owner (not
    # after a fork, nor once another holder took the range), and it names this process's
    # server (not a former user's: check_user): then the secret is the same too. Its layout:
    # (flags, (key, size, offset, nbytes), the weak reference registered for that range, data
    # pointer, key, readonly, the token's fields).
    if (token is not None and (owner.facts is not None
                               or token[0] == lib.lshm_storage_flags(owner.handle))
            and _state.ranges.get(token[1]) is token[2]
            and token[6][1] == _channel.own_address()):
        _, _, _, data, key, readonly, fields = token
        ticket = _channel.Ticket(key, owner, readonly, fields)
    else:
        mapping = owner.keep if isinstance(owner.keep, _Mapping) else None
        ticket = _export(owner, mapping)
        data = owner.token[3]  # (set by _ticket)
    start = data_address(array) - data
    if type(array) is np.ndarray:
        owner.sent = (weakref.ref(array), start)  # (so that it can come back as itself)
    return rebuild_ndarray, (
        _channel.mark(),
        ticket,
        array.shape,
        array.dtype,
        array.strides,
        start,
        bool(array.flags.writeable),
    )


def _reduce_storage(storage: Storage):
    pin = object()
    try:
        handle = storage._pin(pin)  # (a close() on another thread waits for the retain below)
        if lib.lshm_storage_nbytes(handle) == 0:
            return reduce_storage_by_value(storage, 4)
        mapping = storage.keep if isinstance(storage.keep, _Mapping) else None
        holder = Storage._retaining(handle, keep=storage.keep)
    finally:
        storage._pins.discard(pin)  # (see Storage._pin)
        storage._unpinned()
    return _rebuild_storage, (_channel.mark(), _export(holder, mapping))


def register() -> None:
    """Register the reducers with multiprocessing (done when pyshm is imported)."""
    ForkingPickler.register(np.ndarray, reduce_ndarray)
    ForkingPickler.register(Storage, _reduce_storage)
    # (the objects in every token: called directly, not through object.__reduce_ex__)
    ForkingPickler.register(_channel.Ticket, _channel.Ticket.__reduce__)
    ForkingPickler.register(_channel.Mark, _channel.Mark.__reduce__)


# --------------------------------------------------------------------------------------------
# Memory found by address (for objects that keep no Python path to their array: torch tensors)
# --------------------------------------------------------------------------------------------


class _Span:
    """The owner-side base of a byte array over part of an owner's memory: ``base`` leads
    :func:`pyshm._memory.owner_of` to the owner, which holds the memory."""

    __slots__ = ("__array_interface__", "base")

    def __init__(self, address: int, nbytes: int, readonly: bool, owner: Any) -> None:
        self.__array_interface__ = array_interface((nbytes,), np.dtype(np.uint8), address,
                                                   readonly, None)
        self.base = owner


class _MemoryIndex:
    """The pyshm memory of this process by address: the live owners of storages made here
    (``REFERENCES``) and the memfds received (the cache of mappings), as ranges sorted by
    start. Built in full at its first use and when too much in it died; in between, the owners
    and mappings made meanwhile (pyshm._memory.NEW_OWNERS) are added one by one. Ranges may
    overlap (an arena's tensors do): a range is looked for among those that start at most the
    longest range's length before it. A range is read from libshm once per owner (a storage's
    memory never moves while an owner holds it)."""

    def __init__(self) -> None:
        self.starts: list = []
        self.entries: list = []  # (start, end, weak reference to an owner or a _Mapping)
        self.longest = 0
        self.dead = 0  # entries found dead since the last full build
        self.built = False

    @staticmethod
    def _range(ref: "weakref.ref",
               handle: Optional[_ffi.StorageHandle]) -> Optional[tuple]:
        found = ref()  # (held while libshm is asked: the storage stays alive)
        if found is None:
            return None
        if isinstance(found, _Mapping):
            return found.data, found.data + found.size, ref
        handle = handle or REFERENCES.get(ref)
        if not handle:
            return None
        data = lib.lshm_storage_data(handle) or 0
        return data, data + lib.lshm_storage_nbytes(handle), ref

    def _build(self) -> None:
        _memory.tracking = True
        _memory.NEW_OWNERS.clear()
        references = REFERENCES.copy()  # (one C call: a collection meanwhile cannot upset it)
        mappings = list(_cache.mappings.data.copy().values())
        entries = [entry for entry in (self._range(ref, handle)
                                       for ref, handle in references.items()) if entry]
        entries += [entry for entry in (self._range(ref, None) for ref in mappings) if entry]
        entries.sort(key=lambda entry: entry[0])
        self.entries, self.starts = entries, [entry[0] for entry in entries]
        self.longest = max((end - start for start, end, _ in entries), default=0)
        self.dead, self.built = 0, True

    def _add_new(self) -> None:
        import bisect

        new = _memory.NEW_OWNERS[:]
        del _memory.NEW_OWNERS[:len(new)]
        for ref in new:
            entry = self._range(ref, None)
            if entry is not None:
                at = bisect.bisect_right(self.starts, entry[0])
                self.starts.insert(at, entry[0])
                self.entries.insert(at, entry)
                self.longest = max(self.longest, entry[1] - entry[0])

    def find(self, address: int, nbytes: int) -> Any:
        """An owner (ArrayOwner) or a _Mapping holding [address, address + nbytes), or None
        (channel lock held)."""
        import bisect

        if (not self.built or not _memory.tracking or self.dead > 1024 + len(self.entries) // 2
                or len(self.entries) > 1024 + 2 * (len(REFERENCES) + len(_cache.mappings))):
            self._build()  # (first use, too many new ones, too much dead)
        elif _memory.NEW_OWNERS:
            self._add_new()
        end = address + nbytes
        at = bisect.bisect_right(self.starts, address) - 1
        while at >= 0 and self.starts[at] >= end - self.longest:
            start, stop, ref = self.entries[at]
            if start <= address and end <= stop:
                found = ref()
                if found is not None and (isinstance(found, _Mapping) or found.handle):
                    return found
                self.dead += 1
            at -= 1
        return None


_by_address = _MemoryIndex()


def bytes_at(address: int, nbytes: int) -> Optional[np.ndarray]:
    """A uint8 array over [address, address + nbytes) when pyshm memory of this process holds
    that whole range (a storage made here, or a memfd received), whose base chain leads to the
    memory's owner, so that it pickles by reference like any pyshm array; else None."""
    if nbytes <= 0 or address <= 0:
        return None
    with _state.lock:
        found = _by_address.find(address, nbytes)
        if isinstance(found, _Mapping):
            return np.asarray(_ReceivedOwner(found, address - found.data, nbytes, found.sealed,
                                             (nbytes,), np.dtype(np.uint8), None, 0))
    if found is None:
        return None
    readonly = bool(lib.lshm_storage_flags(found.handle) & _ffi.STORAGE_READONLY)
    return np.asarray(_Span(address, nbytes, readonly, found))


def as_pyshm(array: np.ndarray) -> Optional[np.ndarray]:
    """``array`` if pyshm memory owns it (:func:`pyshm._memory.owner_of`), else an array of
    the same memory, layout and write flag whose base chain leads to pyshm's owner when
    ``array`` lies in pyshm memory of this process but its own chain ends at another exporter
    (``numpy.from_dlpack(a)``, ``torch.from_numpy(a).numpy()``: a DLPack capsule, a tensor),
    else None. Numpy's own memory (a chain that ends at an array with no base) is never
    looked up."""
    if owner_of(array) is not None:
        return array
    return _found_by_address(array)


def pyshm_owner(array: Any) -> Optional[ArrayOwner]:
    """:func:`pyshm._memory.owner_of`, or for a numpy array whose base chain ends at another
    exporter over pyshm memory of this process (see as_pyshm), that memory's owner: what
    pickling finds, is_shared, storage_of, share_memory_ and share_readonly find too."""
    owner = owner_of(array)
    if owner is None and type(array) is np.ndarray:
        found = _found_by_address(array)
        owner = None if found is None else owner_of(found)
    return owner


try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds  # (numpy 2)
except ImportError:  # (numpy 1)
    _byte_bounds = np.byte_bounds


# what an array's memory can come from that is never pyshm's (no lookup for those)
_NEVER_PYSHM = (bytes, bytearray, mmap.mmap, np.ndarray)


def _found_by_address(array: np.ndarray) -> Optional[np.ndarray]:
    """as_pyshm for an array whose base chain does not lead to pyshm's owner."""
    end, seen = array, 0
    while seen < 64:
        below = end.obj if isinstance(end, memoryview) else getattr(end, "base", None)
        if below is None:
            break
        end, seen = below, seen + 1
    if end is array or isinstance(end, _NEVER_PYSHM) or array.nbytes == 0:
        return None  # (memory numpy allocated itself, Python's bytes, a file's mapping)
    low, high = _byte_bounds(array)  # (numpy's: the first and one past the last byte)
    span = bytes_at(low, high - low)
    if span is None:
        return None
    view = np.ndarray(array.shape, array.dtype, span, data_address(array) - low,
                      array.strides)
    if not array.flags.writeable:
        view.flags.writeable = False
    return view


def pickled_off_the_callers_thread() -> bool:
    """Whether this pickling runs on one of multiprocessing's own threads (a Queue's feeder,
    a Pool's task handler: also loky's and joblib's), where an implicit share is made only
    under the write fence (:func:`share_if_fenced`)."""
    return _channel.on_thread_of(_ASYNC_PICKLERS)


# --------------------------------------------------------------------------------------------
# pyshm.ref: by reference through any pickler
# --------------------------------------------------------------------------------------------


class Ref:
    """A pyshm array that pickles by reference through any pickler; see :func:`ref` (which
    makes one; the constructor checks the same)."""

    __slots__ = ("__weakref__", "array")
    # (every Ref alive: engines looks for them then)
    live: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(self, array: Any) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"pyshm.ref takes a numpy array of pyshm memory, not "
                            f"{type(array).__name__}")
        if owner_of(array) is None and type(array) is np.ndarray:
            found = _found_by_address(array)  # (through DLPack, a tensor: see as_pyshm)
            array = array if found is None else found
        owner = owner_of(array)
        if owner is None or (owner.facts is None and not owner.handle):
            raise TypeError("pyshm.ref needs an array of pyshm memory: this one is not; bring "
                            "it in with pyshm.copy(array, shared=True)")
        if owner.facts is None:
            handle = owner.handle
            if not lib.lshm_storage_flags(handle) & _ffi.STORAGE_SHARED:
                share_in_place(handle, "pyshm.ref", TypeError)
        self.array = array
        Ref.live.add(self)

    def __reduce__(self):
        return reduce_ndarray(self.array)

    def __copy__(self) -> "Ref":
        return Ref(self.array)  # (the same memory)

    def __deepcopy__(self, memo: dict) -> "Ref":
        return Ref(pyshm_copy(self.array, shared=True))  # (new memory, like any deep copy)

    def __repr__(self) -> str:
        return f"pyshm.ref(<{self.array.dtype} array of shape {self.array.shape}>)"


def ref(array: Any) -> Ref:
    """A handle on ``array`` that any pickler (``pickle``, cloudpickle, a framework's own)
    pickles by reference: unpickled in another process of the same user on this machine (and
    network namespace), it is a numpy array over the very same memory; unpickled here, a view
    of ``array`` itself.

    ``array`` must be pyshm memory (:func:`pyshm.empty`, ``shared=True``, an array received);
    an array not shared yet is shared in place now, on this thread. Anything else raises
    :class:`TypeError` (bring it in with ``pyshm.copy(a, shared=True)``).

    Lifetime: the pickle names the memory and carries a secret that lets its holder, and only
    its holder, fetch the memfd from this process (README, "Who can reach shared memory"). It
    can be unpickled while this process runs and still has the memory (the array or any view
    of it, or this handle; for an array of a slab, 64 KiB or less, any shared array of that
    slab, whose memfd it fetches), and, even after both were dropped, within
    ``KEEPALIVE_SECONDS`` of pickling if it was not unpickled by then. Otherwise, from another
    machine or network namespace, or after this process exited, unpickling raises
    :class:`DeliveryError`. A process that has the memory mapped already fetches nothing
    from this one if it can tell that the pickle's secret opens that memory (its own, or one
    a sender handed the memfd over for), else it fetches the memfd once more; and it must
    have reached this process once (or reach it now): a token from a sender it cannot reach
    never stands for memory it has (README). ``copy.copy`` of the handle names the same
    memory, ``copy.deepcopy`` a shared copy of it.
    """
    return array if isinstance(array, Ref) else Ref(array)


# --------------------------------------------------------------------------------------------
# Read-only sharing
# --------------------------------------------------------------------------------------------


def share_readonly(array: Any) -> Any:
    """Share ``array`` so that every process it is sent to gets read-only memory; returns it.

    The array is shared in place first if needed (same address, a memfd of its own, whatever
    its size: a small array gets one instead of its slab's). Its memfd is then sealed with
    ``F_SEAL_FUTURE_WRITE``: this process keeps writing through its existing mapping (and its
    arrays stay writeable), while receivers get
    arrays that are not writeable and cannot map the fd writable or ``write`` to it.
    Irreversible for that memory. Processes that mapped it writable before the seal keep their
    mappings.

    Refusals change nothing (the array is not shared as a side effect, its fd is not handed
    out), and each says to use ``share_readonly(pyshm.copy(array))``, which gives the bytes a
    memfd of their own:

    * :class:`ValueError` when the array's bytes are a slice of a memfd other arrays use too
      (a slab from ``pyshm.empty(..., shared=True)`` of a small size, a shared arena's buffer):
      sealing would make them read-only too;
    * :class:`BufferError` for an array of a private :class:`pyshm.Arena` (cannot be shared
      in place);
    * :class:`PermissionError` when the memfd's fd was handed out writable already (sent to
      another process, or read through ``Storage.fd``): libshm seals such fds against further
      seals, so that no holder can add seals behind the owner's back.

    :class:`TypeError` for memory pyshm does not own.
    """
    owner = pyshm_owner(array)
    if owner is None or owner.handle is None:
        raise TypeError(
            "share_readonly needs an array whose memory pyshm owns; use "
            "pyshm.share_readonly(pyshm.copy(array))"
        )
    handle = owner.handle
    # Every check before anything changes: no share, no fd lookup (which would export it).
    shared = bool(lib.lshm_storage_flags(handle) & _ffi.STORAGE_SHARED)
    segment = lib.lshm_storage_segment(handle) if shared else None
    if segment:
        # A view of a segment: alone in it only if it covers the whole of it, but for the end
        # of its last page (a receiver maps a whole memfd, whose size is whole pages when its
        # sender shared an array in place). Never a shared arena's tensor (a slot, made in
        # place): the arena's buffer holds the other tensors, in that last page too, and serves
        # every later allocation.
        nbytes = lib.lshm_storage_nbytes(handle)
        size = lib.lshm_segment_size(segment)
        offset = (lib.lshm_storage_data(handle) or 0) - (lib.lshm_segment_data(segment) or 0)
        in_arena = bool(lib.lshm_storage_flags(handle) & _ffi.STORAGE_INPLACE)
        if in_arena or offset != 0 or not (
                nbytes <= size <= -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE):
            raise ValueError(
                f"this array's {nbytes} bytes at offset {offset} share a {size}-byte memfd (a "
                "slab, or an arena's buffer) with other arrays; sealing it read-only would "
                "affect them too. Use pyshm.share_readonly(pyshm.copy(array)) to give it a "
                "memfd of its own"
            )
    try:
        # Unshared: in place into a memfd of its own (a small array too), never handed out.
        # Shared already in its slab's memfd: refused by libshm (EINVAL), nothing changed.
        share_in_place(handle, "share_readonly", share=lib.lshm_storage_share_readonly)
    except _ffi.ShmValueError as exc:
        raise _ffi.ShmValueError(
            exc.errno,
            f"share_readonly: {exc.strerror}. Use pyshm.share_readonly(pyshm.copy(array)) to "
            "seal a copy in a memfd of its own",
        ) from None
    except _ffi.ShmPermissionError as exc:
        raise _ffi.ShmPermissionError(
            exc.errno,
            "share_readonly: this memory cannot be sealed read-only any more: its fd was "
            "handed out writable before (sent to another process, or read through "
            "Storage.fd), and libshm then forbids further seals so that no holder can add "
            "them. Share a copy instead: pyshm.share_readonly(pyshm.copy(array)) "
            f"({exc.strerror})",
        ) from None
    return array


# --------------------------------------------------------------------------------------------
# fork: the child starts with no mappings of its own besides what it inherited (libshm's fork
# handlers make the child share its slab arrays into memfds of its own); the channel resets
# itself (pyshm._channel).
# --------------------------------------------------------------------------------------------


def _after_fork_in_child() -> None:
    _cache.recent = []


os.register_at_fork(after_in_child=_after_fork_in_child)
