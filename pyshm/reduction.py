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
  (:func:`pyshm.share_memory_`, the way ``torch`` does it): same address, every existing view
  keeps aliasing it. This is never a silent copy. Memory that cannot be shared in place (an
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
Each process that sends starts (lazily) one daemon thread serving an abstract-namespace
``AF_UNIX`` ``SOCK_SEQPACKET`` socket with an unguessable name; only peers with the same uid
are served. The pickle carries that address. A receiver first looks the memfd's
``(st_dev, st_ino)`` up in its per-process weak cache of mappings; only on a miss does it
connect, get the fd with ``SCM_RIGHTS`` (``socket.recv_fds``, several fds per message), check
that the fd really is that memfd, map it whole **once** (``lshm_segment_attach``) and cache it.
Every array received from that memfd, however many times it is sent, is a view of that one
mapping (same address for the same bytes). Arrays a process sent are found again when they come
back (a ``Pool`` result returning its argument is the original memory at the original address),
and forked children inherit the parent's cache, so they need no fd at all.

One round trip per message, not per memfd: every token also names the sending thread (its
*stream*) and the token's place in that thread's sequence of exports. A message is pickled by
one thread in one go, so its memfds are consecutive in that sequence. On a miss, the receiver
asks for its memfd *and* for the memfds the same thread exported right after it (up to
``MAX_EXTRAS`` = 1,024 distinct ones within the next ``WINDOW_EVENTS`` exports, fewer when the
receiver is short of fds), all over one connection (250 fds per ``SCM_RIGHTS`` message). The
receiver checks each extra fd is the memfd named and keeps it, unmapped, for
``PREFETCH_SECONDS``; later tokens of the message (and of the next messages) find it there. So
a ``Pool.map`` chunk of 256 in-place-shared arrays costs one round trip instead of 256.
Extras are a guess, never a hand-over: the sender keeps serving every key to everyone (with
``Pool(2)`` a worker may be handed the memfds of the other worker's chunk), and an extra does
not release the sender's keep-alive hold; the receiver acknowledges the extras it really used
(with its next request, or from a small ``pyshm-janitor`` thread that also closes extras
unused after ``PREFETCH_SECONDS`` and exits when none are left).

Liveness: the sender holds memory it made for ``KEEPALIVE_SECONDS`` after pickling it (or until
the receiver fetched it) so an array can be dropped right after ``put``; memory it received
from elsewhere and sends on is not held (forward it only while you or its owner keep it); after that the memory must still be
alive in the sender (or already mapped by the receiver) when the receiver unpickles. As with
torch's ``file_descriptor`` strategy and the stdlib ``DupFd``, the sender must stay alive until
the receiver has unpickled a message carrying memory it has not seen yet.

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
  than ``max(64, RLIMIT_NOFILE // 2)`` of them; beyond that it closes the fd right after mapping
  (``lshm_segment_close_fd``) and such an array can no longer be sent on (pickling it raises).
  Extras handed out with a fetch (above) wait as fds, at most ``RLIMIT_NOFILE // 4`` of them.
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
import fcntl
import os
import pickle
import resource
import secrets
import selectors
import socket
import struct
import threading
import time
import weakref
from ctypes import byref, c_int, c_uint64, c_void_p
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import numpy as np

from . import _ffi
from ._ffi import lib
from .arrays import ArrayOwner, _owner_of, _wrap
from .storage import Storage, _share_in_place

__all__ = [
    "share_readonly",
    "register",
    "segment_count",
    "SLAB_SIZE",
    "SLAB_MAX",
    "KEEPALIVE_SECONDS",
]

SLAB_SIZE = _ffi.SLAB_BYTES  # libshm's slabs (lshm.h: LSHM_SLAB_BYTES)
SLAB_MAX = _ffi.SLAB_MAX_BYTES  # storages up to this size live in slabs
KEEPALIVE_SECONDS = 60.0
RECENT_SLABS = 8
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
_WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE
_MAX_FDS_PER_MESSAGE = 250  # SCM_MAX_FD is 253
_KEY = struct.Struct("=QQ")
# request header: explicit keys, acks, most extras wanted, stream, sequence number
_REQUEST = struct.Struct("=IIIIQ")
LOG_LENGTH = 8192  # export events remembered per stream (sending thread)
WINDOW_EVENTS = 4096  # events after the one asked for that a fetch may hand out too
MAX_EXTRAS = 1024  # distinct memfds handed out in one fetch beyond the one asked for
PREFETCH_SECONDS = 1.0  # an extra fd nobody used by then is closed
JANITOR_SECONDS = 0.2
_MAX_ACKS = 2048
_REPLY_TIMEOUT = 30.0
_REQUEST_SECONDS = 5.0  # a connection to the fd server must send its request by then


# --------------------------------------------------------------------------------------------
# Mappings: one per memfd per process, found by (st_dev, st_ino)
# --------------------------------------------------------------------------------------------


class _Mapping:
    """One reference to a mapped segment (a slab of ours, or a memfd received), cached weakly.

    Every array or storage built on it holds this object, so the cache entry lives exactly as
    long as something uses the mapping.
    """

    __slots__ = ("segment", "key", "size", "fd_kept", "_finalizer", "__weakref__")

    def __init__(self, segment: int, key: tuple, fd_kept: bool) -> None:
        self.segment = segment
        self.key = key
        self.size = lib.lshm_segment_size(segment)
        self.fd_kept = fd_kept
        self._finalizer = weakref.finalize(self, _drop_segment, segment, fd_kept)
        self._finalizer.atexit = False


class _State:
    """Per-process state, rebuilt in a forked child."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.mappings: "weakref.WeakValueDictionary[tuple, _Mapping]" = (
            weakref.WeakValueDictionary()
        )
        self.kept_fds = 0
        # exports: key -> [holder, pending pickles, deadline]; live: key -> a holder of that
        # memfd (weak; see shared_keys); ranges: (key, size, offset, nbytes) -> a weak
        # reference to the holder of that storage, so that memory coming back is the same
        # storage, even in a slab or an arena (plain weakrefs, dead ones dropped by _sweep: a
        # WeakValueDictionary costs a few us per export)
        self.exports: dict = {}
        self.live: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
        self.ranges: dict = {}
        # keys exported from more than one storage (slabs, arenas): _lookup_export looks in
        # ranges for another holder once live's is gone
        self.shared_keys: set = set()
        self.next_sweep = 0.0
        self.server: Optional[_Server] = None
        # the few most recently received slabs, held strongly so that arrays sent one message
        # at a time do not re-map their slab every time (bounded: RECENT_SLABS x SLAB_SIZE)
        self.recent: list = []
        # sender: per sending thread ("stream"), the keys it exported, in order
        self.local = threading.local()
        self.streams: dict = {}  # stream id -> _Log
        self.next_stream = 1
        # receiver: fds handed out with a fetch before any token asked for them:
        # key -> (fd, deadline, sender address); consumed ones are acknowledged to the sender
        self.prefetched: dict = {}
        self.acks: dict = {}  # sender address -> [key, ...]
        self.janitor: Optional[threading.Thread] = None
        self.fetches = 0  # fd-fetch round trips (connections to a sender) made so far


class _Log:
    """The keys one sending thread exported, in order (the last LOG_LENGTH of them)."""

    __slots__ = ("base", "keys", "thread")

    def __init__(self) -> None:
        self.base = 0  # sequence number of keys[0]
        self.keys: list = []
        self.thread = weakref.ref(threading.current_thread())

    def append(self, key: tuple) -> int:
        keys = self.keys
        if len(keys) >= LOG_LENGTH:
            drop = LOG_LENGTH // 2
            del keys[:drop]
            self.base += drop
        keys.append(key)
        return self.base + len(keys) - 1


_state = _State()


def fetch_count() -> int:
    """How many fd-fetch round trips this process made to senders (one per cache miss batch)."""
    return _state.fetches


def _drop_segment(segment: int, fd_kept: bool) -> None:
    if fd_kept:
        _state.kept_fds -= 1
    lib.lshm_segment_release(segment)


def _fd_budget() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft // 2)


def segment_count() -> int:
    """How many memfds this process maps as wholes: received ones (pyshm's cache of mappings)
    plus the memfds of libshm's slabs (one per slab that has shared storages)."""
    counters = _ffi.SlabCounters()
    lib.lshm_slab_stats(byref(counters))
    return len(_state.mappings) + int(counters.memfds)


def _new_view(mapping: _Mapping, offset: int, nbytes: int, readonly: bool) -> int:
    out = c_void_p()
    flags = _ffi.STORAGE_READONLY if readonly else 0
    lib.lshm_storage_create_view(mapping.segment, offset, nbytes, flags, byref(out))
    return out.value


# --------------------------------------------------------------------------------------------
# Sender: exports and the fd server
# --------------------------------------------------------------------------------------------


def _key_of(fd: int) -> tuple:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _handle_of(holder: Any) -> int:
    """The C storage of an export's holder (an ArrayOwner or a Storage, see _export)."""
    if isinstance(holder, ArrayOwner):
        return holder._handle
    return holder._as_parameter_


def _fd_of_holder(holder: Any) -> int:
    fd = c_int(-1)
    offset = c_uint64(0)
    lib.lshm_storage_fd(_handle_of(holder), byref(fd), byref(offset))
    return fd.value


def _sweep(now: float) -> None:
    """Drop the holds of exports whose keep-alive has passed, and the ranges of storages that
    are gone (lock held; at most once a second)."""
    if now < _state.next_sweep:
        return
    _state.next_sweep = now + 1.0
    dead = [key for key, entry in _state.exports.items() if entry[2] < now]
    for key in dead:
        del _state.exports[key]
    gone = [where for where, ref in _state.ranges.items() if ref() is None]
    for where in gone:
        del _state.ranges[where]


def _export(
    handle: int, holder: Any, hold: bool = True, mapping: Optional[_Mapping] = None
) -> tuple:
    """Make storage `handle` sendable; returns the token the receiver needs.

    With `hold`, `holder` is kept alive for KEEPALIVE_SECONDS (or until fetched) so the sender
    may drop the array right after pickling. Memory received from another process is not held
    (its owner holds it; holding it here would pin one fd per array for no one's benefit).
    `mapping`: the cached segment `handle` views (a slab, or memory received), whose key and
    size are known already.
    """
    flags = lib.lshm_storage_flags(handle)
    if not flags & _ffi.STORAGE_SHARED:
        # in place, same address, atomic on failure; memory that cannot be shared in place is
        # refused here, in the sender
        _share_in_place(handle, "pickling for another process", pickle.PicklingError)
    info = _ffi.ExportInfo()
    try:
        lib.lshm_storage_export(handle, byref(info))
    except _ffi.ShmError as exc:
        if exc.errno == errno.EBADF:
            raise pickle.PicklingError(
                "this pyshm array was received from another process and its fd was closed to "
                "stay under RLIMIT_NOFILE, so it cannot be sent on; raise 'ulimit -n' or send a "
                "copy (pyshm.copy(array, shared=True))"
            ) from exc
        raise
    readonly = bool(flags & _ffi.STORAGE_READONLY) or bool(info.readonly)
    if mapping is not None:
        key, size = mapping.key, mapping.size
    else:
        key, size = (info.dev, info.ino), info.file_size
    offset = info.offset
    nbytes = lib.lshm_storage_nbytes(handle)
    now = time.monotonic()
    with _state.lock:
        _sweep(now)
        entry = _state.exports.get(key)
        if not hold:
            pass
        elif entry is None:
            _state.exports[key] = [holder, 1, now + KEEPALIVE_SECONDS]
        else:
            entry[1] += 1
            entry[2] = now + KEEPALIVE_SECONDS
        live = _state.live.get(key)
        if live is None:
            _state.live[key] = holder
        elif live is not holder:
            # Several storages in one memfd (a slab's, an arena buffer's): `live` names one of
            # them, and the memfd stays reachable while any of them lives (_lookup_export).
            _state.shared_keys.add(key)
        _state.ranges[(key, size, offset, nbytes)] = weakref.ref(holder)
        server = _state.server
        if server is None:  # (a forked child starts without one: _after_fork_in_child)
            server = _state.server = _Server()
        stream = getattr(_state.local, "stream", 0)
        log = _state.streams.get(stream)
        if log is None:
            stream = _state.local.stream = _state.next_stream
            _state.next_stream += 1
            log = _state.streams[stream] = _Log()
            _forget_dead_streams()
        seq = log.append(key)
    return (key, server.address, size, offset, nbytes, readonly, (stream, seq))


def _forget_dead_streams() -> None:
    """Drop the logs of threads that have exited (lock held; called when a stream is added)."""
    if len(_state.streams) <= 16:
        return
    for stream, log in list(_state.streams.items()):
        thread = log.thread()
        if thread is None or not thread.is_alive():
            del _state.streams[stream]


def _lookup_export(key: tuple) -> Optional[Any]:
    with _state.lock:
        entry = _state.exports.get(key)
        if entry is not None:
            return entry[0]
        holder = _state.live.get(key)
        if holder is None and key in _state.shared_keys:
            # The holder `live` named is gone; another storage exported from the same memfd
            # may still be alive and holds the memfd just as well.
            holder = next((h for (k, _, _, _), ref in list(_state.ranges.items())
                           if k == key and (h := ref()) is not None), None)
            if holder is None:
                _state.shared_keys.discard(key)
            else:
                _state.live[key] = holder
        return holder


class _Server:
    """Hands out the fds of exported memfds, by key, to same-uid peers over SCM_RIGHTS."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.address = b"\0pyshm-%d-%s" % (self.pid, secrets.token_hex(16).encode())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.address)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(1.0)
        self.sock = sock
        self.thread = threading.Thread(target=self._run, name="pyshm-fd-server", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """Accept and serve connections until the socket is closed; survive everything else.

        Connections wait for their request in one selector, each for at most
        _REQUEST_SECONDS, so a peer that connects and sends nothing stalls nobody; a request
        that cannot be served (malformed, naming memory that is gone or closed) gets nothing
        and never ends this thread.
        """
        sock = self.sock
        uid = os.getuid()
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        waiting: dict = {}  # connection -> deadline for its request
        try:
            while True:
                now = time.monotonic()
                timeout = min([1.0] + [deadline - now for deadline in waiting.values()])
                try:
                    events = selector.select(max(0.0, timeout))
                except (OSError, ValueError):
                    return  # closed (after fork in the child, or at exit)
                for key, _ in events:
                    if key.fileobj is sock:
                        try:
                            conn, _ = sock.accept()
                        except (BlockingIOError, socket.timeout):
                            continue
                        except OSError:
                            return  # closed
                        if not self._welcome(conn, uid):
                            conn.close()
                            continue
                        selector.register(conn, selectors.EVENT_READ)
                        waiting[conn] = time.monotonic() + _REQUEST_SECONDS
                    else:
                        conn = key.fileobj
                        selector.unregister(conn)
                        del waiting[conn]
                        try:
                            self._serve(conn)
                        except Exception:  # noqa: BLE001 - the server must outlive any request
                            pass
                        finally:
                            conn.close()
                now = time.monotonic()
                for conn in [c for c, deadline in waiting.items() if deadline <= now]:
                    selector.unregister(conn)
                    del waiting[conn]
                    conn.close()  # sent nothing in time
                if not events:
                    with _state.lock:
                        _sweep(now)
        finally:
            for conn in waiting:
                conn.close()
            selector.close()

    @staticmethod
    def _welcome(conn: socket.socket, uid: int) -> bool:
        """A new connection from a peer of our uid, set up for its request; False to drop it."""
        try:
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            _pid, peer_uid, _gid = struct.unpack("3i", cred)
            # the request arrives whole (SEQPACKET); the replies are small: a peer that does
            # not read them makes sending time out instead of blocking the server
            conn.settimeout(_REQUEST_SECONDS)
        except OSError:
            return False
        return peer_uid == uid

    def _serve(self, conn: socket.socket) -> None:
        request = conn.recv(65536)
        if len(request) < _REQUEST.size:
            return
        count, nacks, max_extra, stream, seq = _REQUEST.unpack_from(request)
        if len(request) != _REQUEST.size + (count + nacks) * _KEY.size:
            return
        keys = [
            _KEY.unpack_from(request, _REQUEST.size + i * _KEY.size) for i in range(count + nacks)
        ]
        status = bytearray(count)
        fds = []
        extras = []
        holders = []  # keep every fd open until the kernel has taken its copy
        with _state.lock:
            for key in keys[count:]:
                _release_hold(key)  # the receiver used an fd it got as an extra
            for i, key in enumerate(keys[:count]):
                if _add_fd(key, fds, holders):
                    status[i] = 1
                    _release_hold(key)
            log = _state.streams.get(stream) if count else None
            if log is not None and max_extra:
                # The memfds this thread exported right after the one asked for: the rest of
                # the message being unpickled (and maybe the next ones). Extras do not release
                # the sender's hold: another receiver may be the one that needs them.
                seen = set(keys[:count])
                start = max(0, seq + 1 - log.base)
                for key in log.keys[start : start + WINDOW_EVENTS]:
                    if key in seen:
                        continue
                    seen.add(key)
                    if _add_fd(key, fds, holders):
                        extras.append(key)
                        if len(extras) >= min(max_extra, MAX_EXTRAS):
                            break
        reply = bytes(status) + b"".join(_KEY.pack(*key) for key in extras)
        socket.send_fds(conn, [reply], fds[:_MAX_FDS_PER_MESSAGE])
        for start in range(_MAX_FDS_PER_MESSAGE, len(fds), _MAX_FDS_PER_MESSAGE):
            socket.send_fds(conn, [b"+"], fds[start : start + _MAX_FDS_PER_MESSAGE])
        del holders


def _add_fd(key: tuple, fds: list, holders: list) -> bool:
    """Append the fd of export `key` (and what keeps it open) if it is still here (lock held)."""
    holder = _lookup_export(key)
    if holder is None:
        return False
    try:
        fds.append(_fd_of_holder(holder))
    except (OSError, ValueError):  # its fd was closed, or the Storage handle itself
        return False
    holders.append(holder)
    return True


def _release_hold(key: tuple) -> None:
    """One pickle of `key` was fetched: drop the keep-alive hold when none is left (lock held)."""
    entry = _state.exports.get(key)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _state.exports[key]


def _fetch_fds(
    address: bytes, keys: list, where: tuple = (0, 0), max_extra: int = 0, acks: list = ()
) -> tuple:
    """Ask the sender at `address` for the fds of `keys` (one round trip).

    Returns (a list of fd or None for `keys`, a list of (key, fd) extras: memfds the sender's
    thread `where[0]` exported after event `where[1]`, at most `max_extra`). `acks` are keys
    of extras this process used since its last request. The caller closes every fd.
    """
    if not isinstance(address, bytes) or not address.startswith(b"\0pyshm-"):
        raise pickle.UnpicklingError(f"bad pyshm sender address {address!r}")
    received: list = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(_REPLY_TIMEOUT)
        try:
            sock.connect(address)
        except OSError as exc:
            raise ConnectionError(
                f"pyshm: cannot reach the process that sent this array ({exc}); the sender must "
                "stay alive until the receiver has unpickled memory it has not seen before"
            ) from None
        if keys:
            _state.fetches += 1
        stream, seq = where
        header = _REQUEST.pack(len(keys), len(acks), max_extra, stream, seq)
        sock.sendall(header + b"".join(_KEY.pack(*key) for key in (*keys, *acks)))
        reply, fds, flags, _ = socket.recv_fds(
            sock, 65536, _MAX_FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC
        )
        received.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise OSError(
                errno.EMFILE,
                "pyshm: fds sent by another process were dropped (no fd left in this "
                "process: RLIMIT_NOFILE)",
            )
        status = reply[: len(keys)]
        tail = reply[len(keys) :]
        if len(status) != len(keys) or len(tail) % _KEY.size or len(tail) > max_extra * _KEY.size:
            raise pickle.UnpicklingError("pyshm: malformed reply from the sending process")
        extra_keys = [_KEY.unpack_from(tail, i) for i in range(0, len(tail), _KEY.size)]
        wanted = sum(1 for ok in status if ok) + len(extra_keys)
        while len(received) < wanted:
            _, more, flags, _ = socket.recv_fds(
                sock, 16, _MAX_FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC
            )
            received.extend(more)
            if not more or flags & socket.MSG_CTRUNC:
                raise OSError(errno.EMFILE, "pyshm: fds from the sending process were dropped")
        if len(received) != wanted:
            raise pickle.UnpicklingError("pyshm: malformed reply from the sending process")
        it = iter(received)
        asked = [next(it) if ok else None for ok in status]
        return asked, list(zip(extra_keys, it))
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    finally:
        sock.close()


# --------------------------------------------------------------------------------------------
# Receiver
# --------------------------------------------------------------------------------------------


def _check_token(token: Any) -> tuple:
    try:
        key, address, size, offset, nbytes, readonly, (stream, seq) = token
        key = (int(key[0]), int(key[1]))
        size, offset, nbytes = int(size), int(offset), int(nbytes)
        stream, seq = int(stream), int(seq)
    except (TypeError, ValueError):
        raise pickle.UnpicklingError(f"bad pyshm token {token!r}") from None
    if not (0 <= stream < 1 << 32 and 0 <= seq < 1 << 64):
        raise pickle.UnpicklingError(f"bad pyshm token {token!r}")
    where = (stream, seq)
    if min(size, offset, nbytes) < 0 or offset + nbytes > size:
        raise pickle.UnpicklingError(
            f"bad pyshm token: {nbytes} bytes at offset {offset} of a {size}-byte memfd"
        )
    return key, address, size, offset, nbytes, bool(readonly), where


def _attach(fd: int, key: tuple, readonly: bool, checked: bool = False) -> _Mapping:
    """Map a received memfd whole (validated by libshm) and cache it (lock held).

    `checked`: the fd is known to be the memfd `key` names (an extra checked on arrival)."""
    if not checked and _key_of(fd) != key:
        raise pickle.UnpicklingError("pyshm: the fd received is not the memfd that was named")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise _ffi.ShmValueError(errno.EINVAL, f"received fd is not a memfd: {exc}") from None
    if seals & _WRITE_SEALS:
        readonly = True
    out = c_void_p()
    lib.lshm_segment_attach(fd, _ffi.STORAGE_READONLY if readonly else 0, byref(out))
    keep = _state.kept_fds < _fd_budget()
    if keep:
        _state.kept_fds += 1
    else:
        lib.lshm_segment_close_fd(out.value)
    mapping = _Mapping(out.value, key, fd_kept=keep)
    _state.mappings[key] = mapping
    if mapping.size <= SLAB_SIZE:
        _state.recent.append(mapping)
        del _state.recent[:-RECENT_SLABS]
    return mapping


def _resolve(token: Any) -> tuple:
    """(mapping or None, storage handle with a reference the caller must release)."""
    key, address, size, offset, nbytes, readonly, where = _check_token(token)
    with _state.lock:
        ref = _state.ranges.get((key, size, offset, nbytes))
        holder = ref() if ref is not None else None
        if holder is not None:
            # memory that left from here coming back: the very same storage, same address
            return None, lib.lshm_storage_retain(_handle_of(holder))
        mapping = _state.mappings.get(key)
        if mapping is None:
            holder = _lookup_export(key)
            if holder is not None:
                # our own memory coming back: another storage of the same memfd (a tensor of a
                # shared arena) is a view of it at the same address
                handle = _handle_of(holder)
                own = _own_storage_for(handle, offset, nbytes, size, readonly)
                if own is not None:
                    return None, own
            handle = _own_slab_storage(key, size, offset, nbytes)
            if handle is not None:  # ours, sent back by a forked child that inherited it
                return None, handle
        if mapping is None:
            entry = _state.prefetched.pop(key, None)
            if entry is not None:  # handed to us with an earlier fetch
                fd, _, sender = entry
                try:
                    mapping = _attach(fd, key, readonly, checked=True)
                finally:
                    os.close(fd)
                _state.acks.setdefault(sender, []).append(key)
                _ensure_janitor()
            else:
                acks = _state.acks.pop(address, [])
                if len(acks) > _MAX_ACKS:
                    _state.acks[address] = acks[_MAX_ACKS:]
                    del acks[_MAX_ACKS:]
                room = min(MAX_EXTRAS, _fd_budget() // 2 - len(_state.prefetched))
    if mapping is None:
        # Never hold the lock while waiting for another process: two processes fetching
        # from each other would deadlock.
        (fd,), extras = _fetch_fds(address, [key], where, max(0, room), acks)
        try:
            with _state.lock:
                _keep_extras(extras, address)
                extras = []
                if fd is None:
                    raise ConnectionError(
                        "pyshm: the sending process no longer holds this memory (it was "
                        f"dropped there and its {KEEPALIVE_SECONDS:.0f} s keep-alive after "
                        "pickling passed before this receiver unpickled it)"
                    )
                mapping = _state.mappings.get(key)  # another thread may have won the race
                if mapping is None:
                    mapping = _attach(fd, key, readonly)
        finally:
            if fd is not None:
                os.close(fd)
            for _, extra in extras:
                os.close(extra)
    if mapping.size != size:
        raise pickle.UnpicklingError(
            f"pyshm: memfd is {mapping.size} bytes, the sender said {size}"
        )
    return mapping, _new_view(mapping, offset, nbytes, readonly)


def _own_storage_for(handle: int, offset: int, nbytes: int, size: int,
                     readonly: bool) -> Optional[int]:
    """A storage (a new reference) for [offset, offset + nbytes) of the memfd of `handle`, a
    storage this process exported, or None. Several storages may live in one memfd (a shared
    arena's tensors): the one exported first is the holder, so the range decides."""
    segment = lib.lshm_storage_segment(handle)
    if not segment:  # (a storage alone in its memfd, or in a slab: _state.ranges knows it)
        return None
    data = lib.lshm_storage_data(handle) or 0
    start = data - (lib.lshm_segment_data(segment) or 0)
    if start == offset and lib.lshm_storage_nbytes(handle) == nbytes:
        return lib.lshm_storage_retain(handle)  # the very same storage
    if lib.lshm_segment_size(segment) == size:
        return _new_view_of_segment(segment, offset, nbytes, readonly)  # same pages, same address
    return None


def _new_view_of_segment(segment: int, offset: int, nbytes: int, readonly: bool) -> int:
    out = c_void_p()
    flags = _ffi.STORAGE_READONLY if readonly else 0
    lib.lshm_storage_create_view(segment, offset, nbytes, flags, byref(out))
    return out.value


def _own_slab_storage(key: tuple, size: int, offset: int, nbytes: int) -> Optional[int]:
    """A live storage of this process in its slab memfd `key` at `offset` (a reference the
    caller releases), or None."""
    if size != SLAB_SIZE:
        return None
    out = c_void_p()
    try:
        lib.lshm_slab_find(key[0], key[1], offset, nbytes, byref(out))
    except _ffi.ShmError:
        return None
    return out.value


def _keep_extras(extras: list, address: bytes) -> None:
    """Keep the fds a fetch handed out beyond the one asked for, briefly (lock held)."""
    deadline = time.monotonic() + PREFETCH_SECONDS
    for key, fd in extras:
        try:
            valid = _key_of(fd) == key
        except OSError:
            valid = False
        if (
            not valid
            or key in _state.mappings
            or key in _state.prefetched
            or _lookup_export(key) is not None
        ):
            os.close(fd)  # a lie, or one we have already (or our own memory)
        else:
            _state.prefetched[key] = (fd, deadline, address)
    if _state.prefetched:
        _ensure_janitor()


def _ensure_janitor() -> None:
    """Start the thread that closes unused extras and acknowledges used ones (lock held)."""
    if _state.janitor is None:
        _state.janitor = threading.Thread(target=_janitor, name="pyshm-janitor", daemon=True)
        _state.janitor.start()


def _janitor() -> None:
    me = threading.current_thread()
    while True:
        time.sleep(JANITOR_SECONDS)
        stale = []
        with _state.lock:
            if _state.janitor is not me:
                return
            now = time.monotonic()
            for key, (fd, deadline, _) in list(_state.prefetched.items()):
                if deadline < now:
                    del _state.prefetched[key]
                    stale.append(fd)
            acks, _state.acks = _state.acks, {}
            done = not _state.prefetched
            if done:
                _state.janitor = None
        for fd in stale:
            os.close(fd)
        for address, keys in acks.items():
            for start in range(0, len(keys), _MAX_ACKS):
                try:
                    _fetch_fds(address, [], acks=keys[start : start + _MAX_ACKS])
                except (OSError, pickle.UnpicklingError):
                    break  # the sender is gone: nothing to release
        if done:
            return


def _rebuild_ndarray(token, shape, dtype, strides, start, writeable) -> np.ndarray:
    mapping, handle = _resolve(token)
    try:
        nbytes = lib.lshm_storage_nbytes(handle)
        flat = _wrap(handle, (nbytes,), np.dtype(np.uint8), 0, keep=mapping)
    finally:
        lib.lshm_storage_release(handle)
    try:
        array = np.ndarray(shape, dtype, buffer=flat, offset=start, strides=strides)
    except (TypeError, ValueError) as exc:
        raise pickle.UnpicklingError(f"pyshm: array does not fit its storage: {exc}") from None
    if not writeable and array.flags.writeable:
        array.flags.writeable = False
    return array


def _rebuild_storage(token) -> Storage:
    mapping, handle = _resolve(token)
    storage = Storage._from_handle(handle)
    storage._keep = mapping
    return storage


# --------------------------------------------------------------------------------------------
# Reducers
# --------------------------------------------------------------------------------------------


def _reduce_ndarray(array: np.ndarray):
    owner = _owner_of(array)
    if owner is None or array.size == 0:
        return array.__reduce_ex__(4)  # numpy's own by-value pickling
    handle = owner._handle
    mapping = owner._keep if isinstance(owner._keep, _Mapping) else None
    token = _export(handle, owner, hold=mapping is None, mapping=mapping)
    data = lib.lshm_storage_data(handle) or 0
    start = array.__array_interface__["data"][0] - data
    return _rebuild_ndarray, (
        token,
        array.shape,
        array.dtype,
        array.strides,
        start,
        bool(array.flags.writeable),
    )


def _reduce_storage(storage: Storage):
    handle = storage._as_parameter_
    if lib.lshm_storage_nbytes(handle) == 0:
        return reduce_storage_by_value(storage, 4)
    mapping = storage._keep
    if isinstance(mapping, _Mapping):
        return _rebuild_storage, (_export(handle, storage, hold=False, mapping=mapping),)
    holder = Storage._from_handle(lib.lshm_storage_retain(handle))
    return _rebuild_storage, (_export(handle, holder),)


def reduce_storage_by_value(storage: Storage, protocol: int):
    """Plain pickle of a Storage: its bytes (out of band with protocol 5), no fd."""
    data = storage.asarray()
    payload = pickle.PickleBuffer(data) if protocol >= 5 else data.tobytes()
    return _storage_from_bytes, (payload,)


def _storage_from_bytes(payload) -> Storage:
    view = memoryview(payload).cast("B")
    storage = Storage(view.nbytes)
    if view.nbytes:
        storage.asarray()[:] = np.frombuffer(view, np.uint8)
    return storage


def register() -> None:
    """Register the reducers with multiprocessing (done when pyshm is imported)."""
    ForkingPickler.register(np.ndarray, _reduce_ndarray)
    ForkingPickler.register(Storage, _reduce_storage)


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
    owner = _owner_of(array)
    if owner is None or owner._handle is None:
        raise TypeError(
            "share_readonly needs an array whose memory pyshm owns; use "
            "pyshm.share_readonly(pyshm.copy(array))"
        )
    handle = owner._handle
    # Every check before anything changes: no share, no fd lookup (which would export it).
    shared = bool(lib.lshm_storage_flags(handle) & _ffi.STORAGE_SHARED)
    segment = lib.lshm_storage_segment(handle) if shared else None
    if segment:
        # A view of a segment: alone in it only if it covers the whole of it.
        nbytes = lib.lshm_storage_nbytes(handle)
        size = lib.lshm_segment_size(segment)
        offset = (lib.lshm_storage_data(handle) or 0) - (lib.lshm_segment_data(segment) or 0)
        if offset != 0 or nbytes != size:
            raise ValueError(
                f"this array's {nbytes} bytes at offset {offset} share a {size}-byte memfd (a "
                "slab, or an arena's buffer) with other arrays; sealing it read-only would "
                "affect them too. Use pyshm.share_readonly(pyshm.copy(array)) to give it a "
                "memfd of its own"
            )
    try:
        # Unshared: in place into a memfd of its own (a small array too), never handed out.
        # Shared already in its slab's memfd: refused by libshm (EINVAL), nothing changed.
        _share_in_place(handle, "share_readonly", share=lib.lshm_storage_share_readonly)
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
# fork: the child gets fresh locks, no server and no holds (libshm's fork handlers make the
# child share its slab arrays into memfds of its own).
# --------------------------------------------------------------------------------------------


def _after_fork_in_child() -> None:
    old = _state
    if old.server is not None:
        try:
            old.server.sock.close()
        except OSError:
            pass
    old.server = None
    old.lock = threading.RLock()
    old.exports = {}
    old.live = weakref.WeakValueDictionary()
    old.ranges = {}
    old.shared_keys = set()
    old.recent = []
    old.local = threading.local()
    old.streams = {}
    old.next_stream = 1
    for fd, _, _ in old.prefetched.values():
        os.close(fd)
    old.prefetched = {}
    old.acks = {}
    old.janitor = None


os.register_at_fork(after_in_child=_after_fork_in_child)
