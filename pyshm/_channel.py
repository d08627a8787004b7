"""The fd channel: how the memfds named in a pickle reach the process that holds the pickle.

A pyshm pickle carries no fd, only tokens. Each process that sends starts (lazily) one daemon
thread, the *server*, on an abstract ``AF_UNIX`` ``SOCK_SEQPACKET`` socket; a receiver that
does not have a memfd mapped yet connects and gets its fd over ``SCM_RIGHTS``.

Who gets an fd (README, "Who can reach shared memory")
------------------------------------------------------
Abstract socket names are visible in ``/proc/net/unix`` to every process of the network
namespace, including containers that cannot see our ``/proc/<pid>``. So the socket's name is
not a secret, and neither is a memfd's ``(st_dev, st_ino)`` (inode numbers are sequential).
What is secret:

* every exported memfd has two random 128-bit secrets, one that yields a writable fd and one
  that yields a read-only fd; a token carries one of them (the read-only one for read-only
  memory), and a request gets the fd of a memfd only with its secret. A read-only fd is handed
  out only if the memfd is sealed against writes (``F_SEAL_FUTURE_WRITE``), so no holder can
  map it writable. A request carries the secret bound to the address it is sent to (HMAC:
  for_server), so a stranger that binds the name of a sender that is gone learns nothing from
  the requests of receivers still holding its pickles that opens memory anywhere else;
* every pickled *message* has a batch secret (see below); it lets the holder of the message
  fetch, in the same round trip, the fds of the other memfds named in that message, and none
  other. Peers of another uid are refused (``SO_PEERCRED``) before they can say anything.

A pickle of protocol 5 carries the secrets as ``pickle.PickleBuffer`` objects: a pickler
with a ``buffer_callback`` (dask.distributed's, Ray's) hands them out of band, beside the
pickle, so a framework that logs a pickle it fails to load logs no secret.

Secrets are compared in constant time; a request that is malformed, names nothing, or proves
nothing gets an empty answer and the server goes on (a connection that sends nothing is
dropped after ``_REQUEST_SECONDS`` without stalling others).

Messages, holds and acknowledgements
------------------------------------
The reducers put two small objects in every token: the sending thread's *mark* and a
*ticket*. Pickle memoizes the mark, so its ``__reduce__`` runs once per message, before the
first ticket: that is where a new batch (message) begins. Each ticket's ``__reduce__``
enlists its memfd in the current batch, and the batch holds that memory (a strong reference
to its storage) until the receiver has it. A ticket pickled outside the batch's pickler call
(a pickler nested in another's ``__reduce__``, a pure-Python pickler) gets a batch of its own.

A batch is released when the receiver fetched all its memfds (one round trip: the fd asked
for plus the rest of the batch as *extras*; memfds handed over in an earlier round trip stay
held until then), when the receiver acknowledges it (it had every memfd mapped already:
acknowledged by the receiver's janitor thread right after the message is unpickled), or after
``KEEPALIVE_SECONDS``, whichever is first. A message whose unpickling failed for want of fds
in the receiver (``_WantHere``) is not acknowledged, and a fetch asks for no fd it has no room
for, so the same pickle loaded again with fds free gets its memory. So memory sent and dropped by
both sides is freed within about ``JANITOR_SECONDS`` of the receiver unpickling it, and
memory nobody fetches is freed after ``KEEPALIVE_SECONDS``. An acknowledgement whose request
failed in this process (no fd or memory left here) is sent again at the janitor's next
rounds, up to ``ACK_ATTEMPTS`` requests in all; one whose sender said no, is gone or does not
answer, or that failed that often, is not, and the message is acknowledged again if it is
unpickled again.

A sender may exit right after sending: a process started by :mod:`multiprocessing` that still
holds batches when it exits (a ``Pool`` worker with ``maxtasksperchild=1`` that returned an
array, a producer that puts and ends) waits, in ``multiprocessing``'s exit handlers, until its
batches are released or expired. If the memory cannot be delivered anyway (the sender was
SIGKILLed first), unpickling raises :class:`DeliveryError`, which is not an ``OSError``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hmac
import multiprocessing
import os
import pickle
import secrets
import select
import selectors
import socket
import struct
import sys
import threading
import time
import warnings
import weakref
from multiprocessing import util as _mp_util
from typing import Any, Callable, Optional

from ._memory import storage_fd

KEEPALIVE_SECONDS = 60.0  # an unfetched, unacknowledged batch holds its memory this long
GIVEN_UP_SECONDS = 1.0  # how long an exit waits for the readers of a queue given up (linger)
PREFETCH_SECONDS = 1.0  # an extra fd this process did not use by then is closed
JANITOR_SECONDS = 0.2  # how often the receiver's janitor acknowledges and closes extras
ACK_ATTEMPTS = 5  # requests the janitor makes, a period apart, to get one acknowledgement across
MAX_EXTRAS = 1024  # memfds handed out in one fetch beyond the ones asked for
SECRET_BYTES = 16
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE
_MAX_FDS_PER_MESSAGE = 250  # SCM_MAX_FD is 253
_REQUEST_SECONDS = 5.0  # a connection must send its request by then
_MAX_WAITING = 64  # connections the fd server keeps waiting for their request at once
_ACCEPTS_PER_WAKE = 16  # connections the fd server takes from its backlog at most per wake
_BACKOFF_SECONDS = 0.05  # the fd server's pause after an error of its own (no fd left)
_EVICT_SECONDS = 0.5  # a waiting connection dropped for a newer one has waited this long
_REPLY_TIMEOUT = 30.0  # a receiver looks this often whether a silent sender still lives
_HELD_WAIT_MS = 1  # a receiver waits this long for a reply with the GIL held (_Peer.recv_fds)
_PATIENCE_SECONDS = 600.0  # how long a receiver waits for a sender alive but silent
_ADDRESS_PREFIX = b"\0pyshm-"
_ADDRESS_MAX = 108  # (sun_path's size: no longer name can be bound)
_VOUCHED_FLOOR = 1024  # received memfds' secrets kept before a prune (vouch)

_reached: dict = {}  # fd server addresses this process reached (bounded: see reachable)


def _netns() -> int:
    """The inode of the calling thread's network namespace (a namespace is a thread's:
    unshare(CLONE_NEWNET) moves the caller only); 0 if /proc cannot tell."""
    for path in ("/proc/thread-self/ns/net", "/proc/self/ns/net"):
        try:
            return os.stat(path).st_ino
        except OSError:
            pass
    return 0


# The network namespace this process was in at import, and that of each fd server it started
# (its own, former ones and, once forked, its ancestors'): what a connect that failed is
# compared with (elsewhere), never looked at on the way of a send
_NETNS_AT_IMPORT = _netns()
_server_netns: dict = {}  # fd server address -> its network namespace (inode)
_SERVER_NETNS_MAX = 256


def elsewhere(address: bytes) -> str:
    """For a connection to the fd server at `address` that failed (refused, no such name):
    why, if this thread is in another network namespace than that server (its own, or its
    parent's when forked) or, for a server not known here, than this process was at import,
    else "". Abstract socket names are per network namespace: a sender that moved
    (unshare(CLONE_NEWNET), setns) after its server started, or a receiver that moved, finds
    no socket at that name, though the sender lives."""
    now = _netns()
    then = _server_netns.get(address, _NETNS_AT_IMPORT)
    if not now or not then or now == then:
        return ""
    return ("pyshm: the process that sent this memory cannot be reached: this process is in "
            "another network namespace than that sender's fd server (unshare(CLONE_NEWNET) "
            "or setns() since it started), and abstract sockets are not seen across network "
            "namespaces. Send it by value, or keep its senders and receivers in one network "
            "namespace")


def is_address(address: Any) -> bool:
    """Whether `address` has the form of an fd server's address."""
    return (type(address) is bytes and address.startswith(_ADDRESS_PREFIX)
            and len(address) <= _ADDRESS_MAX)


def note_reached(address: bytes) -> None:
    """`address` answered a connection: a server of this machine and network namespace."""
    if len(_reached) >= 4096:
        _reached.clear()
    _reached[address] = True


def reachable(address: Any) -> bool:
    """Whether `address` is an fd server this process can reach: its own, one it reached
    before, or one whose name is bound in this network namespace now (one non-blocking
    connect, closed at once: a full backlog, EAGAIN, says so too). Memfds are named by this
    kernel's numbers (device, inode), which a sender on another machine can share with
    memory here: only a token of a sender reachable from here may stand for memory this
    process has (pyshm.reduction). Never raises: no fd to make one, a sandbox refusing
    sockets, say unreachable."""
    if type(address) is bytes and address in _reached:  # (the usual case, first)
        return True
    if not is_address(address):
        return False
    try:
        sock = _held.socket()  # (non-blocking; the GIL held: see _HeldCalls)
    except OSError:
        return False
    try:
        _held.connect(sock, address)
    except BlockingIOError:
        pass  # (its backlog is full: it is there)
    except OSError:
        return False
    finally:
        _held.close(sock)
    note_reached(address)
    return True

# ---- wire format ---------------------------------------------------------------------------
# request: _HEAD, the batch proof (id 0: none), `fetches` x _ITEM, `acks` x _PROOF; an item's
# secret is the memfd's secret bound to the server's address (for_server)
# reply: one status byte per fetch (0 nothing, 1 fd), one flags byte (1: the batch is
# released), then one _EXTRA per extra fd; the fds ride on the first message, and on "+"
# messages after it, _MAX_FDS_PER_MESSAGE at a time, in order: asked ones, then extras.
MAGIC = b"pyS3"  # (pyS2: secrets not bound to the address)
_HEAD = struct.Struct("=4sIII")  # magic, fetches, acks, most extras wanted
_PROOF = struct.Struct("=Q16s")  # batch id, batch secret
_ITEM = struct.Struct("=QQ16s")  # memfd key (st_dev, st_ino), its secret
_EXTRA = struct.Struct("=QQB")  # memfd key, 1 if read-only
MAX_REQUEST = 65536
MAX_ITEMS = (MAX_REQUEST - _HEAD.size - _PROOF.size) // _ITEM.size
RELEASED = 1


class DeliveryError(pickle.UnpicklingError):
    """The memory a pickle names cannot be delivered: its sender exited or was killed before
    this process fetched it, dropped it after ``KEEPALIVE_SECONDS``, or does not know the
    token. Deliberately not an :class:`OSError` (multiprocessing takes an ``OSError`` from a
    result pipe for a closed pipe)."""


class Undelivered:
    """Stands in for an array or Storage that could not be unpickled (its memory could not be
    delivered, or could not be mapped here, or the pickle was bad), where raising would wedge
    the caller: in ``multiprocessing.Pool``'s result-handler thread, any exception while
    unpickling a result kills that thread, and every later ``.get()`` of the pool hangs. So a
    Pool result arrives, and the first use of this object (an attribute, ``numpy.asarray``,
    indexing, ``len``, ``bool``, comparison, hashing, iteration) raises a
    :class:`DeliveryError`; ``error`` holds it (its ``__cause__``: the original error, if it
    was another). Everywhere else unpickling raises directly.
    """

    __slots__ = ("error",)

    def __init__(self, error: DeliveryError) -> None:
        object.__setattr__(self, "error", error)

    def _raise(self, *args: Any, **kwargs: Any) -> Any:
        raise DeliveryError(str(self.error)) from self.error

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # (protocol probes: copy, pickle, numpy, repr)
        return self._raise()

    __array__ = __getitem__ = __setitem__ = __len__ = __iter__ = __bool__ = _raise
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = _raise
    __truediv__ = __rtruediv__ = __floordiv__ = __mod__ = __pow__ = __neg__ = _raise
    __lt__ = __le__ = __gt__ = __ge__ = __float__ = __int__ = __index__ = _raise
    __eq__ = __ne__ = __hash__ = _raise
    __array_interface__ = property(_raise)
    __reduce__ = __reduce_ex__ = _raise  # (never sent on as if it were memory)

    def __repr__(self) -> str:
        return f"<pyshm.Undelivered: {self.error}>"


# multiprocessing.Pool's result handler: an exception while it unpickles kills it (see above)
_RESULT_HANDLERS = ("Pool._handle_results",)


def on_thread_of(names: tuple) -> bool:
    """Whether this thread runs one of multiprocessing's own thread functions, named by
    qualified name (CPython-internal names: a test checks that they still exist)."""
    target = getattr(threading.current_thread(), "_target", None)
    return getattr(target, "__qualname__", "") in names


def _in_pool_worker_get() -> bool:
    """Whether this unpickling is a multiprocessing.Pool worker's own get() of its next task
    (an exception there kills the worker and the task is lost: its caller waits for ever), not
    an unpickle inside a task: the frame that called the queue's get is the worker loop."""
    pool = sys.modules.get("multiprocessing.pool")
    queues = sys.modules.get("multiprocessing.queues")
    worker = getattr(getattr(pool, "worker", None), "__code__", None)
    get = getattr(getattr(getattr(queues, "SimpleQueue", None), "get", None), "__code__", None)
    if worker is None or get is None:
        return False
    frame = sys._getframe(2)
    while frame is not None:
        back = frame.f_back
        if back is not None and back.f_code is worker:
            return frame.f_code is get  # (not a task's own unpickling: that raises)
        frame = back
    return False


def stand_in(error: Exception) -> Optional[Undelivered]:
    """For a rebuild that failed with `error`: an :class:`Undelivered` to return instead on a
    thread that an exception would kill for good, or in a Pool worker's get() of its task
    (the task then runs and its use of the argument raises, back to the caller), else None
    (raise `error`)."""
    if not on_thread_of(_RESULT_HANDLERS) and not _in_pool_worker_get():
        return None
    if not isinstance(error, DeliveryError):
        wrapped = DeliveryError(f"pyshm: this could not be unpickled here: {error}")
        wrapped.__cause__ = error
        error = wrapped
    return Undelivered(error)


def for_server(secret: bytes, address: bytes) -> bytes:
    """A memfd's `secret` as a request to the fd server at `address` carries it, bound to that
    address (HMAC): the server there compares it with its own secrets bound the same way.
    The name of a sender that is gone is free, and a stranger of this uid that binds it reads
    the requests of receivers still holding its pickles; a secret opens a memfd in more than
    one process (receivers export memory with the secrets it came with, forked children
    derive theirs from their parent's: vouch, forked_secret), so a request must open nothing
    at any other address. A batch's secret goes as it is: it opens nothing but that batch,
    in its own sender."""
    return hmac.new(secret, b"pyshm-request:" + address, "sha256").digest()[:SECRET_BYTES]


def parse_request(data: bytes) -> tuple:
    """(proof, fetches, acks, most extras) of a request; ValueError if malformed.

    proof: (batch id, secret) or None; fetches: [((dev, ino), secret)]; acks: [(id, secret)].
    """
    if len(data) < _HEAD.size + _PROOF.size:
        raise ValueError("short request")
    magic, nfetch, nack, max_extras = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("bad magic")
    if nfetch > MAX_ITEMS or nack > MAX_ITEMS:
        raise ValueError("too many items")
    if len(data) != _HEAD.size + _PROOF.size + nfetch * _ITEM.size + nack * _PROOF.size:
        raise ValueError("bad length")
    batch, secret = _PROOF.unpack_from(data, _HEAD.size)
    proof = (batch, secret) if batch else None
    at = _HEAD.size + _PROOF.size
    fetches = []
    for _ in range(nfetch):
        dev, ino, item_secret = _ITEM.unpack_from(data, at)
        fetches.append(((dev, ino), item_secret))
        at += _ITEM.size
    acks = [_PROOF.unpack_from(data, at + i * _PROOF.size) for i in range(nack)]
    return proof, fetches, [ack for ack in acks if ack[0]], min(max_extras, MAX_EXTRAS)


def build_request(proof: Optional[tuple], fetches: list, acks: list, max_extras: int,
                  address: bytes) -> bytes:
    """The request for the server at `address`; each fetch's secret goes as it opens memory
    there only (for_server)."""
    batch, secret = proof if proof else (0, bytes(SECRET_BYTES))
    parts = [_HEAD.pack(MAGIC, len(fetches), len(acks), max_extras), _PROOF.pack(batch, secret)]
    parts.extend(_ITEM.pack(key[0], key[1], for_server(item_secret, address))
                 for key, item_secret in fetches)
    parts.extend(_PROOF.pack(*ack) for ack in acks)
    return b"".join(parts)


# ---- state ---------------------------------------------------------------------------------


class _Batch:
    """One pickled message (or one lone ticket): the memory it holds until delivered."""

    __slots__ = ("id", "secret", "members", "handed", "deadline", "frame", "thread")

    def __init__(self, batch_id: int, frame: int) -> None:
        self.id = batch_id
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.members: dict = {}  # key -> [holder, readonly]: not handed over yet
        # the members handed over already, held while some are not: a receiver whose
        # unpickling then failed for want of fds (_WantHere) fetches them again when it loads
        # the message again (before: the sender had dropped them, DeliveryError)
        self.handed: dict = {}
        self.deadline = time.monotonic() + KEEPALIVE_SECONDS
        self.frame = frame  # id() of the frame that called the pickler (see Mark)
        # the pickling thread itself, not its ident, which a later thread may get again (see
        # _abandoned_threads)
        self.thread = threading.current_thread()


class _State:
    """Per-process channel state, rebuilt in a forked child. One lock guards it and the
    receiver's cache of mappings (pyshm.reduction), so no two locks are ever nested."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # sender
        self.secrets: dict = {}  # key -> (writable secret, read-only secret, the key itself)
        self.inherited: dict = {}  # key -> the parent's pair, in a forked child (secrets)
        self.live: dict = {}  # key -> weakref to the first live holder (dead ones: swept)
        self.ranges: dict = {}  # (key, size, offset, nbytes) -> weakref to its holder
        self.shared_keys: set = set()  # keys exported from several storages (slabs, arenas)
        self.batches: dict = {}  # id -> _Batch
        self.next_batch = 1
        self.local = threading.local()  # .mark, .batch
        self.server: Optional[_Server] = None
        # servers of the users this process ran as before (setuid: see _own_server)
        self.former: list = []
        self.next_sweep = 0.0
        # receiver
        self.prefetched: dict = {}  # key -> (fd, deadline, readonly, (address, proof)): extras
        #   not used yet, for the tokens of the message whose fetch brought them
        # key -> [(secret, readonly)]: secrets of tokens whose memfd their sender handed over
        # (vouch); such a token may stand for memory here without a fetch, and our own
        # tokens for that memory carry them (export)
        self.vouched: dict = {}
        self.vouch_limit = _VOUCHED_FLOOR  # (vouched is pruned when it reaches this size)
        self.acks: dict = {}  # sender address -> [(batch id, secret)] to acknowledge
        self.ack_failures: dict = {}  # (sender address, batch id) -> requests failed so far
        self.janitor: Optional[threading.Thread] = None
        self.fetches = 0  # fetch round trips made to senders
        self.round_trips = 0  # round trips made to senders (fetches and acknowledgements)


state = _State()
_monotonic = time.monotonic
_on_server_start: list = []


def fetch_count() -> int:
    """How many fd-fetch round trips this process made to senders."""
    return state.fetches


def round_trip_count() -> int:
    """How many round trips this process made to senders (fetches and acknowledgements)."""
    return state.round_trips


def own_address() -> Optional[bytes]:
    server = state.server
    return server.address if server is not None else None


def own_netns() -> int:
    """The inode of the network namespace this process's fd server is bound in (0: none
    started yet, or /proc cannot tell): where its receivers must be, wherever this process
    moved since (see elsewhere)."""
    server = state.server
    return _server_netns.get(server.address, 0) if server is not None else 0


# ---- sender: exports, batches, holds ---------------------------------------------------------


def export(key: tuple, holder: Any, size: int, offset: int, nbytes: int,
           readonly: bool) -> tuple:
    """Make memfd `key` fetchable while `holder` (which keeps it open) lives; returns
    (server address, the secret for a token: the read-only one if `readonly`, the weak
    reference registered for the range: while ``state.ranges`` still holds that very object,
    holder is registered as this range's and the secret is valid, so a caller may reuse the
    token; the key object to put in tokens: one per memfd, so that pickle writes it once per
    message)."""
    ref = weakref.ref(holder)
    with state.lock:
        now = _monotonic()
        if now >= state.next_sweep:
            _sweep(now)
        server = _own_server()
        pair = state.secrets.get(key)
        if pair is None:
            parent = state.inherited.get(key)
            if parent is not None:  # (memory the parent exported before our fork: see below)
                pair = (forked_secret(parent[0], server.address),
                        forked_secret(parent[1], server.address), key)
            else:
                # memory received: the secrets it came with (vouch), so that its sender,
                # and whoever else that secret came from, knows our tokens for it
                given = dict((ro, secret) for secret, ro in state.vouched.get(key, ()))
                pair = (given.get(False) or secrets.token_bytes(SECRET_BYTES),
                        given.get(True) or secrets.token_bytes(SECRET_BYTES), key)
            state.secrets[key] = pair
        live = state.live.get(key)
        first = live() if live is not None else None
        if first is None:
            state.live[key] = ref
        elif first is not holder:
            state.shared_keys.add(key)
        state.ranges[(key, size, offset, nbytes)] = ref
        return server.address, pair[1 if readonly else 0], ref, pair[2]


def _own_server() -> "_Server":
    """This process's fd server, started if it is not yet (lock held). A process that changed
    its user (setuid: a program dropping its privileges) gets a new one: receivers of its new
    user are told that the old one is another user's (its socket's credentials are those of
    its listen(2)), and it serves only peers of that user. The old one serves on for them
    (what was sent to them before), and tokens made for the old one are made anew (their
    address is not own_address(): see reduction.reduce_ndarray). One that comes back to a
    user it ran as before (seteuid back and forth) gets that user's server back: one server
    per user, not one per switch (and one more, rarely, started while another thread
    switched users: it serves the user its listen(2) ran as)."""
    server = state.server
    euid = os.geteuid()
    if server is not None and server.uid != euid:
        back = next((f for f in state.former if f.uid == euid), None)
        state.former = [f for f in state.former if f is not back] + [server]
        server = state.server = back
    if server is None:
        server = state.server = _Server()
        for hook in _on_server_start:
            hook()
    return server


def check_user() -> None:
    """A new fd server if this process changed its user since its own started (see
    _own_server): before a token made for the old one is reused (lock held or not)."""
    server = state.server
    if server is not None and server.uid != os.geteuid():
        with state.lock:
            _own_server()


def is_own_address(address: Any) -> bool:
    """Whether `address` is this process's fd server's, or a former one's (_own_server)."""
    server = state.server
    if server is not None and address == server.address:
        return True
    return any(address == former.address for former in state.former)


def forked_secret(parent_secret: bytes, address: bytes) -> bytes:
    """The secret a forked child gives memory its parent had exported before the fork (the
    parent's secret for it, through HMAC with the child's server address): the parent can
    tell such a token of its own memory from a child even once the child is gone
    (own_token), and nobody learns the parent's secret from it."""
    return hmac.new(parent_secret, b"pyshm-fork:" + address, "sha256").digest()[:SECRET_BYTES]


WRITABLE, READ_ONLY = 1, 2  # what a secret opens (own_token, vouched; 0: nothing)


def own_token(key: tuple, address: bytes, secret: Any) -> int:
    """What a token (memfd `key`, sender `address`, `secret`) opens of memory this process
    exported: WRITABLE or READ_ONLY for one of its secrets for it (or a secret a child forked
    from it made of one: forked_secret), else 0."""
    try:
        pairs = [pair for pair in (state.secrets.get(key), state.inherited.get(key)) if pair]
    except TypeError:  # (a malformed key: _check_token says so)
        return 0
    if not pairs:
        return 0
    secret = secret_bytes(secret)
    if secret is None:
        return 0
    # (our own secrets first: no HMAC to compute for the usual token)
    for level, at in ((WRITABLE, 0), (READ_ONLY, 1)):
        if any(hmac.compare_digest(pair[at], secret) for pair in pairs):
            return level
    if type(address) is not bytes:
        return 0
    for level, at in ((WRITABLE, 0), (READ_ONLY, 1)):
        if any(hmac.compare_digest(forked_secret(pair[at], address), secret)
               for pair in pairs):
            return level
    return 0


_MAX_VOUCHED = 4  # secrets remembered per memfd (vouch)
_MAX_VOUCHED_KEYS = 1 << 16  # memfds remembered (a process maps at most ~65,000: README)


def _never_mapped(key: tuple) -> bool:
    return False


# whether memfd `key` is mapped here still: pyshm.reduction's cache of mappings says
mapped_here: Callable[[tuple], bool] = _never_mapped


def _make_room_to_vouch() -> None:
    """Forget the secrets of memfds no longer mapped here nor exported from here
    (state.vouched reached state.vouch_limit, lock held): a token of one needs a fetch
    anyway, its memory being gone. Only if that frees less than a sixteenth of a full table,
    the oldest of those still mapped go too (a later token of one is fetched again). The
    next pass comes once the table doubled (from _VOUCHED_FLOOR up to full): a receiver of
    ever new memfds keeps about as many secrets as it maps, not 65,536 of them (about 30 MB),
    and each pass costs no more than the vouches that filled the table since the last."""
    vouched = state.vouched
    exported = state.secrets
    for key in [key for key in vouched if not mapped_here(key) and key not in exported]:
        del vouched[key]
    target = _MAX_VOUCHED_KEYS - max(1, _MAX_VOUCHED_KEYS // 16)
    while len(vouched) > target:
        del vouched[next(iter(vouched))]
    state.vouch_limit = min(_MAX_VOUCHED_KEYS, max(_VOUCHED_FLOOR, 2 * len(vouched)))


def vouch(key: tuple, secret: bytes, readonly: bool) -> None:
    """Remember that `secret` opens memfd `key`: its sender handed over that memfd for a token
    carrying it (the fd was checked to be that memfd). Lock held."""
    known = state.vouched.get(key)
    if known is None:
        if len(state.vouched) >= min(state.vouch_limit, _MAX_VOUCHED_KEYS):
            _make_room_to_vouch()
        known = state.vouched[key] = []
    elif any(hmac.compare_digest(s, secret) for s, _ in known):
        return
    known.append((secret, bool(readonly)))
    del known[:-_MAX_VOUCHED]


def vouched(key: tuple, address: Any, secret: Any) -> int:
    """What a token naming memfd `key` with `secret` (and sender `address`) may stand for of
    memory this process has, without a fetch: WRITABLE or READ_ONLY if `secret` is one of
    ours for it (own_token) or one a sender handed that memfd over for (vouch, read-only if
    it was handed over read-only or sealed), else 0. A token proves nothing else: its key,
    range, address and read-only flag are numbers anyone of this user can write, naming
    memory they were never sent. Lock held or not."""
    known = state.vouched.get(key) if type(key) is tuple else None
    if known:
        raw = secret_bytes(secret)
        if raw is not None:
            for known_secret, readonly in list(known):
                if hmac.compare_digest(known_secret, raw):
                    return READ_ONLY if readonly else WRITABLE
    return own_token(key, address, secret)


def _secret_out(secret: bytes, out_of_band: bool) -> Any:
    """`secret` as a token carries it. For a pickle of protocol 5 (out_of_band), a
    ``pickle.PickleBuffer``: a pickler with a ``buffer_callback`` hands it out of band, so the
    pickle itself names memory but cannot fetch it (for a framework that logs a pickle it
    fails to load but not its buffers: dask.distributed logs its first 10,000 bytes); one
    without a callback writes its bytes in band, as older protocols get them. Receivers take
    both (secret_bytes)."""
    return pickle.PickleBuffer(secret) if out_of_band else secret


def secret_bytes(value: Any) -> Optional[bytes]:
    """A secret from a pickle as bytes: in band (bytes) or out of band (a buffer of
    SECRET_BYTES bytes, see _secret_out); None if it is neither."""
    if type(value) is bytes:
        return value if len(value) == SECRET_BYTES else None
    try:  # (any buffer: the receiver's framework decides what out-of-band buffers are)
        with memoryview(value) as view:
            return view.tobytes() if view.nbytes == SECRET_BYTES else None
    except (TypeError, ValueError):
        return None  # (not a buffer, or a released one)


class _Reduced:
    """The base of Mark and Ticket: both pickle forms lead to ``_reduce(frame, out_of_band)``,
    frame the id of the pickler's caller, out_of_band for protocol 5 (see _secret_out)."""

    __slots__ = ()

    # (both forms: a pickler's dispatch table calls __reduce__, others __reduce_ex__ with
    # their protocol; either way sys._getframe(1) is the caller of the pickler)
    def __reduce__(self):
        return self._reduce(id(sys._getframe(1)), False)

    def __reduce_ex__(self, protocol: int):
        return self._reduce(id(sys._getframe(1)), protocol >= 5)

    def _reduce(self, frame: int, out_of_band: bool):
        raise NotImplementedError


class Mark(_Reduced):
    """The sending thread's marker in every token; pickle memoizes it per message, so its
    reduction runs once per message and begins that message's batch."""

    __slots__ = ()

    def _reduce(self, frame: int, out_of_band: bool):
        # (frame: the caller of this message's pickler)
        with state.lock:
            batch = _new_batch(frame)
            state.local.batch = batch
            # (started here if no export did yet: the message's first token may be one sent
            # on (reduction._forwarded), and this process's own tokens after it must find
            # their batch under its address, or they are fetched without the message's
            # proof and stay held until KEEPALIVE_SECONDS, never acknowledged)
            address = _own_server().address
        return _received_batch, (address, batch.id, _secret_out(batch.secret, out_of_band))


class Ticket(_Reduced):
    """One memfd named in a token; its reduction enlists the memory in the current batch and
    becomes the token the receiver resolves. `fields`: the token (key, address, size, offset,
    nbytes, readonly, secret, solo), solo None (no batch of its own; see _reduce). `holder`
    None: a token of another process sent on as it is (no batch holds anything for it)."""

    __slots__ = ("key", "holder", "readonly", "fields")

    def __init__(self, key: tuple, holder: Any, readonly: bool, fields: tuple) -> None:
        self.key, self.holder, self.readonly, self.fields = key, holder, readonly, fields

    def _enlist(self, frame: int) -> Optional[tuple]:
        """Put the memory in the current message's batch; returns the proof of a batch of its
        own (solo) when this is no message's pickling (see Mark), else None."""
        batch = getattr(state.local, "batch", None)
        solo = None
        # (no lock on this path: only this thread adds to its current batch, and nobody can
        # ask for the batch before its message, still being pickled here, is sent)
        if batch is None or batch.frame != frame or state.batches.get(batch.id) is not batch:
            with state.lock:
                batch = _new_batch(0)  # not this message's pickler call: a batch of its own
            solo = (batch.id, batch.secret)
        member = batch.members.get(self.key)
        if member is None:
            batch.members[self.key] = [self.holder, self.readonly]
        elif not self.readonly:
            member[1] = False
        return solo

    def _reduce(self, frame: int, out_of_band: bool):
        solo = None
        if self.holder is not None:  # (None: a token of another process, sent on
            # (reduction._forwarded): its memory is that process's to hand over, not ours)
            solo = self._enlist(frame)
        if solo is None and not out_of_band:
            return tuple, (self.fields,)
        *head, secret, _ = self.fields  # (the token's last two fields: its secret, solo)
        if out_of_band:  # (see _secret_out)
            secret = _secret_out(secret, True)
            solo = None if solo is None else (solo[0], _secret_out(solo[1], True))
        return tuple, ((*head, secret, solo),)


def mark() -> Mark:
    """This thread's mark (see Mark)."""
    local = state.local
    m = getattr(local, "mark", None)
    if m is None:
        m = local.mark = Mark()
    return m


def _new_batch(frame: int) -> _Batch:
    """A new batch, registered (lock held)."""
    batch = _Batch(state.next_batch, frame)
    state.next_batch += 1
    state.batches[batch.id] = batch
    return batch


def _sweep(now: float) -> None:
    """Drop expired batches, the ranges of storages that are gone, and the secrets of memfds
    nobody holds any more (lock held; at most once a second)."""
    if now < state.next_sweep:
        return
    state.next_sweep = now + 1.0
    # (batches are made in order of their deadlines, under the lock: the expired ones come
    # first, and a sender with many messages unread pays for those that expire, not for all)
    expired = []
    for batch_id, batch in state.batches.items():
        if batch.deadline >= now:
            break
        expired.append(batch_id)
    for batch_id in expired:
        _drop(batch_id)
    for where in [w for w, ref in state.ranges.items() if ref() is None]:
        del state.ranges[where]
    for key in [k for k, ref in state.live.items() if ref() is None]:
        del state.live[key]
    alive = {where[0] for where in state.ranges}
    unheld = [k for k in state.secrets if k not in alive and k not in state.live]
    if unheld:  # (the batches' members only then: many messages held, few memfds gone)
        # (list(): one C call; a pickling thread adds to its batch's members without the lock)
        held = {key for b in state.batches.values() for key in [*b.members, *b.handed]}
        for key in unheld:
            if key not in held:
                del state.secrets[key]
                state.shared_keys.discard(key)  # (lookup asks only for keys with secrets)


def _drop(batch_id: int) -> None:
    """Forget a batch and let go of what it holds (lock held); the thread that pickled it may
    still name it as its current batch."""
    batch = state.batches.pop(batch_id, None)
    if batch is not None:
        batch.members.clear()
        batch.handed.clear()


def release_batch(batch_id: int, secret: bytes) -> bool:
    """Drop batch `batch_id` if `secret` is its secret (lock held or not)."""
    with state.lock:
        batch = state.batches.get(batch_id)
        if batch is None or not hmac.compare_digest(batch.secret, secret):
            return False
        _drop(batch_id)
        return True


def drop_holds() -> None:
    """Release every batch now, as if KEEPALIVE_SECONDS had passed (tests, settle)."""
    with state.lock:
        for batch_id in list(state.batches):
            _drop(batch_id)


def held_batches(abandoned: bool = True) -> int:
    """How many batches still hold memory for a receiver (not delivered, not expired); with
    `abandoned` false, not counting those pickled by the feeder of a Queue whose owner gave
    its data up (``cancel_join_thread``: see _abandoned_threads)."""
    with state.lock:
        now = time.monotonic()
        skip = () if abandoned else _abandoned_threads()
        return sum(1 for b in state.batches.values()
                   if b.members and b.deadline > now
                   and not any(b.thread is thread for thread in skip))


# Queues whose cancel_join_thread() was called in this process: their owner is "prepared to
# lose data" (the stdlib's words) and exits without flushing them, so linger() waits for the
# messages their feeder pickled GIVEN_UP_SECONDS only (the stdlib would still deliver what
# reached the pipe: a reader within that second gets it, a later one a DeliveryError).
# torch's DataLoader workers do that when their iterator is shut down with items prefetched
# and never read (a loop left with break): each worker would otherwise wait
# KEEPALIVE_SECONDS at exit, and the DataLoader waits 5 s for each worker before it
# terminates it. The batches name their pickling thread itself: a later thread may get a
# dead feeder's ident.
_cancelled_queues: "weakref.WeakSet" = weakref.WeakSet()


def _abandoned_threads() -> list:
    """The feeder threads of the queues given up (lock held or not)."""
    threads = []
    for queue in list(_cancelled_queues):
        thread = getattr(queue, "_thread", None)
        if thread is not None:
            threads.append(thread)
    return threads


def _hook_cancel_join_thread() -> None:
    """Note every Queue.cancel_join_thread() (multiprocessing's, and so torch's)."""
    from multiprocessing import queues

    original = queues.Queue.cancel_join_thread
    if getattr(original, "_pyshm", False):
        return

    def cancel_join_thread(self):
        try:
            _cancelled_queues.add(self)
        except TypeError:  # (a subclass without weak references: waited for, as before)
            pass
        return original(self)

    cancel_join_thread._pyshm = True
    cancel_join_thread.__doc__ = original.__doc__
    queues.Queue.cancel_join_thread = cancel_join_thread


def lookup(key: tuple) -> Optional[Any]:
    """A live holder of exported memfd `key`, or None (lock held or not)."""
    with state.lock:
        if key not in state.secrets:
            return None  # never exported from here
        live = state.live.get(key)
        holder = live() if live is not None else None
        if holder is None:
            for batch in state.batches.values():
                member = batch.members.get(key) or batch.handed.get(key)
                if member is not None:
                    # (the holder next asked for: a fetch of a message of many ranges of one
                    # slab looks for each; without this it walked the batches for each again)
                    state.live[key] = weakref.ref(member[0])
                    return member[0]
        if holder is None and key in state.shared_keys:
            holder = next((h for (k, _, _, _), ref in list(state.ranges.items())
                           if k == key and (h := ref()) is not None), None)
            if holder is None:
                state.shared_keys.discard(key)
            else:
                state.live[key] = weakref.ref(holder)
        return holder


def _access(key: tuple, secret: bytes, address: bytes) -> int:
    """0: `secret` (as a request to `address` carries it: for_server) proves nothing about
    `key`; 1: writable; 2: read-only (lock held)."""
    pair = state.secrets.get(key)
    if pair is None:
        return 0
    bound = _bound.get(key)
    if bound is None or bound[0] is not pair or bound[1] != address:
        # (computed once per memfd and server: a request of 2,000 items naming our memfds
        # costs no 4,000 HMACs with the lock held)
        if len(_bound) > 2 * len(state.secrets) + 1024:
            _bound.clear()
        bound = _bound[key] = (pair, address, for_server(pair[0], address),
                               for_server(pair[1], address))
    if hmac.compare_digest(bound[2], secret):
        return 1
    if hmac.compare_digest(bound[3], secret):
        return 2
    return 0


# memfd key -> (its secrets, server address, both bound to it: for_server), for _access; an
# entry holds only while state.secrets has that very pair
_bound: dict = {}


def _fd_for(key: tuple, readonly: bool, fds: list, holders: list) -> bool:
    """Append the fd of `key` if it is still here and, for read-only access, sealed against
    writes (lock held)."""
    holder = lookup(key)
    if holder is None:
        return False
    try:
        fd = storage_fd(holder)
        if readonly and not _held.seals(fd) & WRITE_SEALS:
            return False
    except (OSError, ValueError):  # its fd was closed, or the Storage handle itself
        return False
    fds.append(fd)
    holders.append(holder)
    return True


def serve(request: bytes, address: Optional[bytes] = None) -> tuple:
    """The reply (bytes, fds, what keeps the fds open) to one request to the server at
    `address` (ours, if None); ValueError if malformed. The one place that decides who gets
    which fd."""
    proof, fetches, acks, max_extras = parse_request(request)
    if address is None:
        address = own_address()
    status = bytearray(len(fetches))
    fds: list = []
    holders: list = []
    extras: list = []
    flags = 0
    with state.lock:
        for batch_id, secret in acks:
            release_batch(batch_id, secret)
        batch = None
        if proof is not None:
            found = state.batches.get(proof[0])
            if found is not None and hmac.compare_digest(found.secret, proof[1]):
                batch = found
        for i, (key, secret) in enumerate(fetches):
            access = _access(key, secret, address) if address is not None else 0
            if access and _fd_for(key, access == 2, fds, holders):
                status[i] = 1
                if batch is not None and key in batch.members:
                    batch.handed[key] = batch.members.pop(key)
        if batch is not None and any(status):
            for key, (_, readonly) in list(batch.members.items()):
                if len(extras) >= max_extras:
                    break
                if _fd_for(key, readonly, fds, holders):
                    extras.append(_EXTRA.pack(key[0], key[1], int(readonly)))
                    batch.handed[key] = batch.members[key]
                del batch.members[key]
        if batch is not None and not batch.members:
            _drop(batch.id)
            flags |= RELEASED
    return bytes(status) + bytes([flags]) + b"".join(extras), fds, holders


class _HeldCalls:
    """The fd server's system calls, made with the GIL held (libc through ctypes.PyDLL).

    The fd server is a Python thread. A call that releases the GIL (every call of the
    socket, fcntl and os modules does, and each libshm call through ctypes.CDLL) must take it
    back after, and while another thread of the process runs Python (a Pool worker on its
    next task, a DataLoader worker making the next batch) that waits for the thread holding
    it to drop it: a switch interval, 5 ms. An answer made of a dozen such calls took a
    receiver 16 ms (median, 1 MiB arrays) where an idle sender answers in 0.4 ms. These calls
    never block (the connections are non-blocking, the request is usually there when the
    connection is accepted), so the server makes them all with the GIL held and takes it
    back once per wake of its poll(2). Only a request that comes late, or a reply the
    receiver does not read, waits with the GIL released."""

    def __init__(self) -> None:
        libc = ctypes.PyDLL(None, use_errno=True)
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t

        def call(name: str, restype: Any, *argtypes: Any) -> Any:
            function = libc[name]
            function.restype, function.argtypes = restype, list(argtypes)
            return function

        self._socket = call("socket", c_int, c_int, c_int, c_int)
        self._connect = call("connect", c_int, c_int, c_void_p, ctypes.c_uint32)
        self._accept4 = call("accept4", c_int, c_int, c_void_p, c_void_p, c_int)
        self._recvmsg = call("recvmsg", ctypes.c_ssize_t, c_int, c_void_p, c_int)
        self._recv = call("recv", ctypes.c_ssize_t, c_int, c_void_p, c_size_t, c_int)
        self._sendmsg = call("sendmsg", ctypes.c_ssize_t, c_int, c_void_p, c_int)
        self._getsockopt = call("getsockopt", c_int, c_int, c_int, c_int, c_void_p,
                                ctypes.POINTER(ctypes.c_uint32))
        self._fcntl = call("fcntl", c_int, c_int, c_int, c_int)
        self._close = call("close", c_int, c_int)
        self._poll = call("poll", c_int, c_void_p, ctypes.c_ulong, c_int)
        self._opendir = call("opendir", c_void_p, ctypes.c_char_p)
        self._readdir = call("readdir", c_void_p, c_void_p)
        self._closedir = call("closedir", c_int, c_void_p)
        self._fstat = None  # (then os.fstat, letting the GIL go)
        if os.uname().machine in ("x86_64", "aarch64") and ctypes.sizeof(c_void_p) == 8:
            try:  # (glibc 2.33 on; struct stat begins with st_dev and st_ino, 64 bits each)
                self._fstat = call("fstat", c_int, c_int, c_void_p)
            except AttributeError:
                pass
        self._buffers = threading.local()

    @staticmethod
    def _error() -> OSError:
        code = ctypes.get_errno()
        return OSError(code, os.strerror(code))  # (BlockingIOError for EAGAIN)

    def _again(self, function: Any, *args: Any) -> Optional[int]:
        """function(*args), made again on EINTR: its result, None if it would block
        (EAGAIN), OSError for any other failure."""
        while True:
            got = function(*args)
            if got >= 0:
                return got
            code = ctypes.get_errno()
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                return None
            if code != errno.EINTR:
                raise self._error()

    def accept(self, listening: int) -> int:
        """A new connection (non-blocking, close-on-exec); OSError as socket.accept."""
        fd = self._again(self._accept4, listening, None, None,
                         socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        if fd is None:
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return fd

    def socket(self) -> int:
        """A new socket for a connection to an fd server (non-blocking, close-on-exec);
        OSError (EMFILE: no fd left)."""
        fd = self._socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK |
                          socket.SOCK_CLOEXEC, 0)
        if fd < 0:
            raise self._error()
        return fd

    def connect(self, conn: int, address: bytes) -> None:
        """connect(2) to a server's address; BlockingIOError while its backlog is full."""
        name = struct.pack("=H", socket.AF_UNIX) + address
        if self._again(self._connect, conn, name, len(name)) is None:
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    def peer_cred(self, conn: int) -> Optional[tuple]:
        """(pid, uid) of the peer of `conn` (SO_PEERCRED), None if it cannot be read."""
        cred = (ctypes.c_int * 3)()
        size = ctypes.c_uint32(ctypes.sizeof(cred))
        if self._getsockopt(conn, socket.SOL_SOCKET, socket.SO_PEERCRED, cred,
                            ctypes.byref(size)) != 0 or size.value != ctypes.sizeof(cred):
            return None
        return cred[0], cred[1]

    def peer_uid(self, conn: int) -> Optional[int]:
        cred = self.peer_cred(conn)
        return None if cred is None else cred[1]

    def recv_fds(self, conn: int, size: int, most: int) -> Optional[tuple]:
        """As socket.recv_fds(conn, size, most, MSG_CMSG_CLOEXEC): (data, fds, flags, None),
        or None if no message came yet; OSError else. An end of the connection is said only
        when a second look finds no message either: a non-blocking recvmsg of a SEQPACKET
        socket looks at its queue, then at whether the peer is gone, so a reply sent and the
        connection closed between the two reads as the end (the kernel's __unix_dgram_recvmsg)."""
        received = self._recv_fds(conn, size, most)
        if received is not None and not received[0] and not received[1]:
            again = self._recv_fds(conn, size, most)
            if again is not None:
                received = again
        return received

    def _recv_fds(self, conn: int, size: int, most: int) -> Optional[tuple]:
        buffer = self._buffer(size)
        control = ctypes.create_string_buffer(socket.CMSG_SPACE(most * 4))
        iov = _Iovec(ctypes.cast(buffer, ctypes.c_void_p), size)
        message = _Msghdr(None, 0, ctypes.pointer(iov), 1,
                          ctypes.cast(control, ctypes.c_void_p), len(control), 0)
        got = self._again(self._recvmsg, conn, ctypes.byref(message),
                          socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
        if got is None:
            return None
        fds: list = []
        raw, at, end = control.raw, 0, min(message.controllen, len(control))
        while at + _CMSG_HEAD.size <= end:
            length, level, kind = _CMSG_HEAD.unpack_from(raw, at)
            if length < _CMSG_HEAD.size or at + length > end:
                break
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                count = (length - _CMSG_HEAD.size) // 4
                fds.extend(struct.unpack_from(f"{count}i", raw, at + _CMSG_HEAD.size))
            at += socket.CMSG_SPACE(length - _CMSG_HEAD.size)
        return ctypes.string_at(buffer, got), fds, message.flags, None

    def ready(self, conn: int, events: int, milliseconds: int) -> bool:
        """Whether `conn` is ready for `events` (or hung up) within `milliseconds`, waited
        for with the GIL held (a short wait only: every thread of the process waits too)."""
        return bool(self._again(self._poll, ctypes.byref(_Pollfd(conn, events, 0)), 1,
                                milliseconds))

    @staticmethod
    def wait(conn: int, events: int, seconds: float) -> bool:
        """Whether `conn` became ready for `events` (or hung up) within `seconds` (the one
        wait of a request: the GIL released)."""
        poller = select.poll()
        poller.register(conn, events)
        return bool(poller.poll(max(seconds, 0.0) * 1000))

    def _buffer(self, size: int) -> Any:
        buffer = getattr(self._buffers, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = self._buffers.buffer = ctypes.create_string_buffer(size)
        return buffer

    def recv(self, conn: int, size: int) -> Optional[bytes]:
        """The next message of `conn` (b"": closed), None if none came yet; OSError else."""
        buffer = self._buffer(size)
        got = self._again(self._recv, conn, buffer, size, socket.MSG_DONTWAIT)
        return None if got is None else ctypes.string_at(buffer, got)

    def send_reply(self, conn: int, reply: bytes, fds: list) -> None:
        """The reply and its fds, _MAX_FDS_PER_MESSAGE a message (then "+" messages); waits
        (GIL released) up to _REQUEST_SECONDS for a receiver that does not read them."""
        step = _MAX_FDS_PER_MESSAGE
        for start in range(0, max(len(fds), 1), step):
            self.send(conn, reply if start == 0 else b"+", fds[start : start + step],
                      _REQUEST_SECONDS)

    def send(self, conn: int, data: bytes, fds: list, seconds: float) -> None:
        """One message; waits (GIL released) up to `seconds` while it would block, then
        socket.timeout."""
        deadline = None
        while not self._send(conn, data, fds):
            if deadline is None:
                deadline = time.monotonic() + seconds
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            self.wait(conn, select.POLLOUT, left)

    def _send(self, conn: int, data: bytes, fds: list) -> bool:
        """One message with `fds` (SCM_RIGHTS); False if it would block, OSError else."""
        body = ctypes.create_string_buffer(data, len(data))
        iov = _Iovec(ctypes.cast(body, ctypes.c_void_p), len(data))
        control = _control_message(fds)
        room = ctypes.create_string_buffer(control, len(control)) if fds else None
        message = _Msghdr(None, 0, ctypes.pointer(iov), 1,
                          ctypes.cast(room, ctypes.c_void_p) if fds else None, len(control), 0)
        return self._again(self._sendmsg, conn, ctypes.byref(message),
                           socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) is not None

    def seals(self, fd: int) -> int:
        """fcntl(fd, F_GET_SEALS); OSError if it fails."""
        got = self._fcntl(fd, fcntl.F_GET_SEALS, 0)
        if got < 0:
            raise self._error()
        return got

    def key(self, fd: int) -> tuple:
        """(st_dev, st_ino) of `fd`, as os.fstat gives them; OSError if it fails."""
        if self._fstat is None:
            st = os.fstat(fd)
            return st.st_dev, st.st_ino
        stat = (ctypes.c_uint64 * 32)()  # (struct stat is 144 bytes on x86-64, 128 on arm64)
        if self._fstat(fd, stat) != 0:
            raise self._error()
        return stat[0], stat[1]

    def open_fds(self) -> int:
        """How many fds this process has open (the entries of /proc/self/fd); OSError if
        they cannot be listed."""
        listing = self._opendir(b"/proc/self/fd")
        if not listing:
            raise self._error()
        try:
            entries = 0
            while self._readdir(listing):
                entries += 1
        finally:
            self._closedir(listing)
        return entries - 3  # (".", ".." and the listing's own fd)

    def close(self, fd: int) -> None:
        self._close(fd)  # (never retried: the fd is gone whatever close says)


class _Pollfd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32),
                ("iov", ctypes.POINTER(_Iovec)), ("iovlen", ctypes.c_size_t),
                ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


_CMSG_HEAD = struct.Struct("@Nii")  # struct cmsghdr: cmsg_len, cmsg_level, cmsg_type


def _control_message(fds: list) -> bytes:
    """The SCM_RIGHTS control message carrying `fds` (b"" for none)."""
    if not fds:
        return b""
    data = struct.pack(f"{len(fds)}i", *fds)
    head = _CMSG_HEAD.pack(socket.CMSG_LEN(len(data)), socket.SOL_SOCKET, socket.SCM_RIGHTS)
    return (head + data).ljust(socket.CMSG_SPACE(len(data)), b"\0")


_held = _HeldCalls()


class _Server:
    """Accepts connections and answers requests with serve(), in one daemon thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.address = b"%s%d-%s" % (_ADDRESS_PREFIX, self.pid, secrets.token_hex(16).encode())
        if len(_server_netns) >= _SERVER_NETNS_MAX:
            del _server_netns[next(iter(_server_netns))]
        _server_netns[self.address] = _netns()  # (where its name is bound: see elsewhere)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.address)
            sock.listen(4096)  # (capped by net.core.somaxconn)
            # (the user its socket says it is: the one listen(2) ran as, whatever another
            # thread's seteuid did meanwhile; SO_PEERCRED of a listening socket)
            self.uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET,
                                                           socket.SO_PEERCRED, 12))[1]
        except BaseException:
            sock.close()
            raise
        sock.settimeout(1.0)
        self.sock = sock
        note_reached(self.address)
        self.answering = False  # between reading a request and sending its last fd (linger)
        # the connections accepted and not closed yet (waiting, or being answered): a forked
        # child closes its copies of them (_after_fork_in_child), which would keep them open
        # (a receiver whose connection we closed unanswered would wait for the child's end,
        # then get "connection reset"). Changed only under conns_lock, which a fork holds
        # (_before_fork): no connection is between its accept4 and this set when we fork (a
        # fork that could not take it has the child look for them: _close_accepted).
        self.conns: set = set()
        self.conns_lock = threading.Lock()
        self.failed = False  # (the server's own work failed: said once, see _say_failed)
        # one fd kept in reserve for a connection when this process has no fd left (its own
        # memfds up to RLIMIT_NOFILE, a share refused for that): closed to accept it, taken
        # back once a connection is closed (see _accept)
        self.reserve = _reserve_fd()
        self.thread = threading.Thread(target=self._run, name="pyshm-fd-server", daemon=True)
        try:
            self.thread.start()
        except BaseException:  # (no thread left: RLIMIT_NPROC, a cgroup's pids.max, memory)
            # (the next pickle tries again: none of this may stay behind from each try)
            sock.close()
            if self.reserve is not None:
                os.close(self.reserve)
            _server_netns.pop(self.address, None)
            _reached.pop(self.address, None)
            raise
        _register_linger()  # (again: a fork may have cleared it; linger() twice is harmless)

    def _say_failed(self, what: str, error: Exception) -> None:
        """One RuntimeWarning for the first failure of the server's own work (a bug, or a
        lasting want of fds), none after; never raises (a filter may make the warning an
        error: the server serves on)."""
        if self.failed:
            return
        self.failed = True
        try:
            warnings.warn(f"pyshm: the fd server's {what} failed ({error!r}); it goes on "
                          "serving (please report this)", RuntimeWarning, stacklevel=1)
        except Exception:  # noqa: BLE001
            pass

    def _run(self) -> None:
        """Serve until the socket is closed; survive everything else: an error of the server
        itself (no fd left for its selector, a bug: _serve) is said once and waited out."""
        while self.sock.fileno() >= 0:
            try:
                self._serve()
            except Exception as error:  # noqa: BLE001 - try again in a moment
                self._say_failed("loop", error)
                time.sleep(_BACKOFF_SECONDS)

    def _serve(self) -> None:
        """Connections wait for their request in one selector, each for at most
        _REQUEST_SECONDS, at most _MAX_WAITING of them: a peer that holds connections open
        without asking costs this process that many fds. Requests that came in are answered
        before anything new is accepted; with _MAX_WAITING waiting, a new connection drops
        the oldest if it waited _EVICT_SECONDS already (no request takes that long to come),
        and else waits in the kernel's backlog (the socket unwatched meanwhile)."""
        sock = self.sock
        uid = self.uid
        waiting: dict = {}  # connection -> when it was accepted, oldest first
        # (poll(2): registering a connection is no system call, see _held)
        selector = selectors.PollSelector()
        watched = False  # (the listening socket in the selector)
        try:
            while True:
                if self.reserve is None:
                    self.reserve = _reserve_fd()
                now = time.monotonic()
                oldest = next(iter(waiting.values()), now)
                room = len(waiting) < _MAX_WAITING or now - oldest >= _EVICT_SECONDS
                if room != watched:
                    if room:
                        selector.register(sock, selectors.EVENT_READ)
                    else:
                        selector.unregister(sock)
                    watched = room
                timeout = min(1.0, oldest + _REQUEST_SECONDS - now,
                              1.0 if room else oldest + _EVICT_SECONDS - now)
                try:
                    events = selector.select(max(0.0, timeout))
                except (OSError, ValueError):
                    if sock.fileno() < 0:
                        return  # closed (after fork in the child, or at exit)
                    raise
                for key, _ in events:  # (requests first: an accept may drop a connection)
                    conn = key.fileobj
                    if conn is sock or conn not in waiting:
                        continue
                    _forget(selector, waiting, conn)
                    self._answer(conn, waited=True)
                if any(key.fileobj is sock for key, _ in events):
                    # (those in the backlog too, a few: each wake costs a switch interval
                    # while another thread runs Python)
                    for _ in range(_ACCEPTS_PER_WAKE):
                        if not self._accept(selector, waiting, uid):
                            break
                now = time.monotonic()
                for conn in [c for c, t in waiting.items() if t + _REQUEST_SECONDS <= now]:
                    self._drop(selector, waiting, conn)  # (sent nothing in time, or late)
                if now >= state.next_sweep:
                    try:
                        with state.lock:
                            _sweep(now)
                    except Exception as error:  # noqa: BLE001 - the server lives on
                        self._say_failed("sweep", error)
        finally:
            for conn in waiting:
                self._close(conn)
            selector.close()

    def _drop_oldest(self, selector: Any, waiting: dict) -> bool:
        """Drop the oldest waiting connection if it waited _EVICT_SECONDS already."""
        if not waiting:
            return False
        conn, accepted = next(iter(waiting.items()))
        if time.monotonic() - accepted < _EVICT_SECONDS:
            return False
        self._drop(selector, waiting, conn)
        return True

    def _drop(self, selector: Any, waiting: dict, conn: int) -> None:
        """Stop waiting for the request of `conn`: answer it if it came since the last poll
        (this thread was held up: a thread holding the GIL in C, the channel's lock, a stopped
        process), else close it. Closed with a request unread in it, its receiver would get
        ECONNRESET for a request that had come in time."""
        _forget(selector, waiting, conn)
        if not self._answer(conn, waited=False):
            self._close(conn)

    def _accept(self, selector: Any, waiting: dict, uid: int) -> bool:
        """Take one connection and answer its request if it came already (the usual case:
        a receiver sends it right after connecting), else put the connection into `waiting`
        (dropping the oldest if there is no room and it waited long enough). No fd left for
        it (EMFILE: connections held open, or the program's own fds): the oldest goes if it
        waited long enough, and the next try comes after a moment. True if it took one and
        there is room for more."""
        listening = self.sock.fileno()
        try:
            conn = self._take(listening)
        except BlockingIOError:
            return False
        except OSError as exc:
            if self.sock.fileno() < 0 or exc.errno in (errno.EBADF, errno.EINVAL):
                raise
            if exc.errno == errno.EMFILE and self.reserve is not None:
                reserve, self.reserve = self.reserve, None  # (taken back at the loop's next
                os.close(reserve)  # turn, if it can be)
                try:
                    conn = self._take(listening)
                except OSError:
                    return False
            else:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and \
                        not self._drop_oldest(selector, waiting):
                    time.sleep(_BACKOFF_SECONDS)
                return False  # (else a connection that went away meanwhile: ECONNABORTED)
        if _held.peer_uid(conn) != uid:
            self._close(conn)  # (another user's: dropped unanswered)
            return True
        if self._answer(conn, waited=False):
            return True  # (answered, and closed)
        if len(waiting) >= _MAX_WAITING and not self._drop_oldest(selector, waiting):
            self._close(conn)  # (not watched then: only a race with the clock gets here)
            return False
        try:
            selector.register(conn, selectors.EVENT_READ)
        except BaseException:
            self._close(conn)
            raise
        waiting[conn] = time.monotonic()
        return len(waiting) < _MAX_WAITING

    def _answer(self, conn: int, waited: bool) -> bool:
        """Answer the request waiting on connection `conn` and close it; False (and nothing
        done) if none came yet and `waited` is false (just accepted)."""
        try:
            request = _held.recv(conn, MAX_REQUEST + 1)
        except OSError:
            request = b""
        if request is None and not waited:
            return False
        try:
            if request:  # (else closed without a request, or a poll woken for nothing)
                self.answering = True  # before serve() releases anything: see linger()
                reply, fds, holders = serve(request, self.address)
                _held.send_reply(conn, reply, fds)
                del holders  # every fd stays open until the kernel has taken its copy
        except Exception:  # noqa: BLE001 - the server outlives any request (ValueError:
            pass  # malformed, answered with nothing)
        finally:
            self.answering = False
            self._close(conn)
        return True

    def _take(self, listening: int) -> int:
        """A new connection (as _held.accept), noted in self.conns."""
        with self.conns_lock:
            conn = _held.accept(listening)
            self.conns.add(conn)
        return conn

    def _close(self, conn: int) -> None:
        with self.conns_lock:
            self.conns.discard(conn)
            _held.close(conn)


def _reserve_fd() -> Optional[int]:
    """An fd held only to be given up when the fd server needs one (None: none left now)."""
    try:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _forget(selector: Any, waiting: dict, conn: int) -> None:
    selector.unregister(conn)
    del waiting[conn]


def linger() -> None:
    """At the exit of a multiprocessing child (or a Ray worker, see pyshm.engines): wait until
    the batches this process holds are released (delivered, acknowledged) or expired, and the
    server has sent its last reply, so that its receivers can still fetch."""
    given_up_until = time.monotonic() + GIVEN_UP_SECONDS
    while True:
        server = state.server
        if server is None or server.pid != os.getpid():
            return
        if not held_batches(abandoned=time.monotonic() < given_up_until) and \
                not server.answering:
            return
        time.sleep(0.005)


def _register_linger(_state=None) -> None:
    """In a multiprocessing child, run linger() among multiprocessing's exit handlers, after
    the queues' feeder threads are joined (their exitpriority is -5). Registered when this
    module is imported in a child, and by multiprocessing's bootstrap of a forked child (which
    clears the exit handlers it inherited)."""
    # (a spawn or forkserver child imports this while unpickling its Process object, before
    # its bootstrap sets parent_process(); it is "inheriting" then, and keeps its handlers)
    child = getattr(multiprocessing.current_process(), "_inheriting", False)
    if child or multiprocessing.parent_process() is not None:
        _mp_util.Finalize(None, linger, exitpriority=-100)


# ---- receiver: fetching, extras, acknowledgements --------------------------------------------


class ReceivedBatch:
    """A message's batch as its receiver sees it: the proof for fetches, acknowledged (unless
    a fetch released it) once the message is unpickled and this object is gone, but not if
    its unpickling failed for want of fds here (kept_for_retry)."""

    __slots__ = ("address", "id", "secret", "done", "__weakref__")

    def __init__(self, address: bytes, batch_id: int, secret: bytes) -> None:
        self.address, self.id, self.secret = address, batch_id, secret
        self.done: Optional[weakref.finalize] = None  # (its acknowledgement)

    def kept_for_retry(self) -> None:
        """Its unpickling failed for want of this process's own fds (_WantHere): not
        acknowledged, so its sender keeps what it did not hand over yet (up to
        KEEPALIVE_SECONDS after it was pickled) for the same pickle loaded again. Before, the
        acknowledgement let the sender drop it, and a retry with fds free got
        DeliveryError."""
        if self.done is not None:
            self.done.detach()

    @property
    def proof(self) -> tuple:
        return (self.id, self.secret)


def _received_batch(address, batch_id, secret) -> ReceivedBatch:
    secret = secret_bytes(secret)
    if not (isinstance(address, bytes) and isinstance(batch_id, int) and secret is not None):
        raise pickle.UnpicklingError("bad pyshm batch in the pickle")
    batch = ReceivedBatch(address, batch_id, secret)
    if address:  # (b"": a sender with no fd server, whose tokens all name other processes)
        # (its message unpickled: acknowledged unless released already, see settle)
        done = batch.done = weakref.finalize(batch, queue_ack, address, (batch_id, secret))
        done.atexit = False  # (at exit there is nobody left to acknowledge to)
    return batch


# (address, batch id) of the latest messages this process knows released (by a fetch) or
# acknowledged, oldest first: such a message is not acknowledged (again) when its unpickling
# ends, nor when it is unpickled again and again (Ray deserializes an object for every task
# that names it: each would be a round trip of the janitor to its sender).
_settled: dict = {}
_MAX_SETTLED = 4096


def settle(address: bytes, batch_id: int) -> bool:
    """Note that the message (address, batch_id) is released or acknowledged; False if it was
    noted already."""
    key = (address, batch_id)
    with state.lock:
        if key in _settled:
            return False
        _settled[key] = None
        if len(_settled) > _MAX_SETTLED:
            del _settled[next(iter(_settled))]
        return True


def _unsettle(address: bytes, proofs: list) -> None:
    """Acknowledgements that did not reach `address`: a later unpickling of their messages
    acknowledges them again."""
    with state.lock:
        for batch_id, _ in proofs:
            _settled.pop((address, batch_id), None)


def _ack_failed(address: bytes, proofs: list, again: bool) -> None:
    """Acknowledgements that did not reach `address` (or are not known to have): queued for
    the janitor's next round if `again` (the request failed quickly) and fewer than
    ACK_ATTEMPTS requests failed for each; the others unsettled."""
    with state.lock:
        retry, given_up = [], []
        for proof in proofs:
            key = (address, proof[0])
            failures = state.ack_failures.get(key, 0) + 1
            if again and failures < ACK_ATTEMPTS:
                state.ack_failures[key] = failures
                retry.append(proof)
            else:
                state.ack_failures.pop(key, None)
                given_up.append(proof)
        _unsettle(address, given_up)
        if retry:
            state.acks.setdefault(address, []).extend(retry)
            ensure_janitor()


def _ack_delivered(address: bytes, proofs: list) -> None:
    """Acknowledgements the sender read: their failures are forgotten."""
    with state.lock:
        for batch_id, _ in proofs:
            state.ack_failures.pop((address, batch_id), None)


def queue_ack(address: bytes, proof: tuple) -> None:
    """Acknowledge `proof` to `address` soon, from the janitor (ours: at once), unless this
    process acknowledged it, or saw it released, before."""
    with state.lock:
        if not settle(address, proof[0]):
            return
        if is_own_address(address):
            release_batch(*proof)
            return
        state.acks.setdefault(address, []).append(proof)
        ensure_janitor()


def take_acks(address: bytes) -> list:
    """Acknowledgements due to `address`, to piggyback on a request there (lock held)."""
    acks = state.acks.pop(address, [])
    if len(acks) > MAX_ITEMS:
        state.acks[address] = acks[MAX_ITEMS:]
        del acks[MAX_ITEMS:]
    return acks


class _Forked(Exception):
    """This process is a child forked in the middle of a fetch (a signal handler that forks
    runs inside it): the connection, and the reply on its way, are its parent's."""


def fetch(address: bytes, fetches: list, proof: Optional[tuple] = None, max_extras: int = 0,
          acks: list = (), own_acks: bool = True) -> tuple:
    """One round trip to the sender at `address`.

    Returns (fd or None for each of `fetches`, [(key, readonly, fd)] extras, released flag).
    The caller closes every fd. DeliveryError when the sender cannot be reached. `acks` that
    the sender did not read go back to the janitor (_ack_failed), unless `own_acks` is false
    (the caller sees to them). A child forked in the middle of a fetch leaves that connection
    and its reply to its parent (before: the one that read first got the reply, the other
    "closed the connection without an answer") and asks again on a connection of its own.
    """
    while True:
        try:
            return _fetch_once(address, fetches, proof, max_extras, acks, own_acks)
        except _Forked:
            continue


def _fetch_once(address: bytes, fetches: list, proof: Optional[tuple], max_extras: int,
                acks: list, own_acks: bool) -> tuple:
    started = _monotonic()
    me = os.getpid()  # (see _Forked)
    if not is_address(address):
        raise pickle.UnpicklingError(f"bad pyshm sender address {address!r}")
    received: list = []
    answered = False  # (the sender replied: it has read the acknowledgements)
    sock = peer = None
    try:
        try:
            sock = _client_socket()
        except OSError as exc:
            raise _WantHere(f"pyshm: no socket left in this process to reach the process that "
                            f"sent this memory ({exc.strerror or exc})") from None
        _want_room(sock, len(fetches))  # (before the sender even sees a connection)
        try:
            _connect(sock, address)
        except OSError as exc:
            moved = elsewhere(address)
            if moved:
                raise DeliveryError(moved) from None
            raise DeliveryError(
                f"pyshm: the process that sent this memory has exited or was killed before this "
                f"process fetched it ({exc.strerror}); a sender that exits normally waits for its "
                "receivers, one that is killed cannot"
            ) from None
        pid = _check_peer_user(sock)
        # (an acknowledgement alone is not worth waiting for: the janitor sends them all)
        peer = _Peer(pid if fetches else 0, address, me)
        peer.check_forked()  # (a request of ours on our parent's connection: never)
        note_reached(address)
        state.round_trips += 1
        if fetches:
            state.fetches += 1
        _held.send(sock, build_request(proof, fetches, list(acks), max_extras, address), [],
                   _REPLY_TIMEOUT)
        reply, fds, flags, _ = peer.recv_fds(sock, 65536)
        received.extend(fds)  # (closed on every error below: an empty reply with fds too)
        if not reply:
            raise DeliveryError("pyshm: the sending process closed the connection without an "
                                "answer (it is overloaded, or stopping)")
        answered = True
        if acks and state.ack_failures:  # (none failed before: nothing to forget, no lock)
            _ack_delivered(address, acks)
        truncated = bool(flags & socket.MSG_CTRUNC)  # (no fd left here: the kernel dropped some)
        n = len(fetches)
        tail = reply[n + 1 :]
        if len(reply) < n + 1 or len(tail) % _EXTRA.size or len(tail) > max_extras * _EXTRA.size:
            raise DeliveryError("pyshm: malformed reply from the sending process")
        status, released = reply[:n], bool(reply[n] & RELEASED)
        extra_info = [_EXTRA.unpack_from(tail, i) for i in range(0, len(tail), _EXTRA.size)]
        needed = sum(1 for ok in status if ok)  # (the fds asked for come first, then extras)
        wanted = needed + len(extra_info)
        while len(received) < wanted and not truncated:
            _, more, flags, _ = peer.recv_fds(sock, 16)
            received.extend(more)
            truncated = bool(flags & socket.MSG_CTRUNC)
            if not more and not truncated:
                raise DeliveryError("pyshm: fds from the sending process were dropped (the "
                                    "sender went away)")
        if len(received) > wanted or (len(received) < wanted and not truncated):
            raise DeliveryError("pyshm: malformed reply from the sending process")
        if len(received) < needed:
            raise _WantHere(f"pyshm: fds sent by another process were dropped: no fd left in "
                            f"this process (RLIMIT_NOFILE, {errno.errorcode[errno.EMFILE]})")
        # the fds asked for all came; extras the kernel dropped are only missed: their tokens
        # fetch them again
        it = iter(received)
        asked = [next(it) if ok else None for ok in status]
        extras = [((dev, ino), bool(ro), fd) for (dev, ino, ro), fd in zip(extra_info, it)]
        return asked, extras, released
    except OSError as exc:  # reset, timed out: the sender went away or is stuck
        for fd in received:
            os.close(fd)
        raise DeliveryError(f"pyshm: the process that sent this memory stopped answering "
                            f"({exc.strerror or exc})") from None
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    finally:
        if sock is not None:
            _held.close(sock)
        if peer is not None:
            peer.close()
        if acks and not answered and own_acks and os.getpid() == me:
            _ack_failed(address, acks, _worth_again(started, sys.exc_info()[1]))


class _WantHere(DeliveryError):
    """A DeliveryError for a want of this process's own (no fd left): worth trying again. Raised
    before the sender hands anything over (_want_room), and its message is not acknowledged
    (ReceivedBatch.kept_for_retry): the same pickle loaded again gets its memory."""


def want_no_socket() -> None:
    """_WantHere if this process cannot make a socket now (no fd left): reachable() then said
    "unreachable" for a sender it could not ask, which is no sign that the sender is gone."""
    try:
        _held.close(_client_socket())
    except OSError as exc:
        raise _WantHere(f"pyshm: no socket left in this process to reach the process that "
                        f"sent this memory ({exc.strerror or exc})") from None


def _want_room(sock: int, fds: int) -> None:
    """_WantHere unless this process can open `fds` more fds now, besides the fetch's socket
    `sock`: a sender takes what it hands over out of its message's batch, so fds the kernel
    drops here for want of room (MSG_CTRUNC) are lost to a retry of that message. Each is
    tried (an fd duplicated, then closed) before the request is sent."""
    probes: list = []
    try:
        for _ in range(fds):
            probes.append(fcntl.fcntl(sock, fcntl.F_DUPFD_CLOEXEC, 0))
    except OSError as exc:
        raise _WantHere(f"pyshm: no fd left in this process for the memory another process "
                        f"sent ({exc.strerror or exc}); nothing was asked of it") from None
    finally:
        for fd in probes:
            os.close(fd)


def _client_socket() -> int:
    """A new connection's socket, non-blocking (no fd left: OSError, EMFILE). A fetch makes
    its calls with the GIL held but for its wait for the reply (see _HeldCalls)."""
    return _held.socket()


def _worth_again(started: float, error: Optional[BaseException]) -> bool:
    """Whether a request that failed with `error` is worth making again: it failed here (no fd
    or memory left in this process), quickly. Not when the sender said no or is gone
    (DeliveryError: another user, another network namespace, exited), nor when it did not
    answer (a request to it blocks the janitor up to _REPLY_TIMEOUT)."""
    return (error is not None
            and (not isinstance(error, DeliveryError) or isinstance(error, _WantHere))
            and _monotonic() - started < 5 * JANITOR_SECONDS)


def _check_peer_user(sock: int) -> int:
    """DeliveryError, said as it is, when the sender runs as another user: its server hands
    nothing to a peer of another uid (it drops the connection unanswered). Returns the
    sender's pid (0: not known, e.g. in another pid namespace)."""
    cred = _held.peer_cred(sock)
    if cred is None:
        return 0  # (the request itself then says what went wrong)
    pid, peer_uid = cred
    if peer_uid != os.geteuid():
        raise DeliveryError(
            f"pyshm: this memory was sent by a process of another user (uid {peer_uid}; this "
            f"process runs as uid {os.geteuid()}): a sender hands its memory only to processes "
            "of its own user. Send it by value (numpy's pickling), or run both as one user")
    return pid


# sender address -> (when fetches found it silent first, last) while its silence goes on
# (_Peer): the patience is the sender's, not each fetch's (a Pool's result handler goes on to
# the next token of a silent sender after a stand-in, and would wait _PATIENCE_SECONDS for
# each, 50 minutes for a result of 5 arrays)
_silent: dict = {}
_silent_lock = threading.Lock()


def _running(pid: int) -> bool:
    """Whether process `pid` runs (exited but not waited for, a zombie, does not), read
    without an fd of it: kill(pid, 0) and its /proc entry's state."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # (another user's: it exists)
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            run_state = stat.read().rpartition(b")")[2].split()[:1]
    except OSError:  # (no /proc: as kill said)
        return True
    return run_state not in ([b"Z"], [b"X"])


class _Peer:
    """The sender a fetch waits for: its answers are awaited while it lives, up to
    _PATIENCE_SECONDS of silence (the sender's, over all fetches from it: _silent). Its fd
    server is a Python thread, which a thread holding the GIL in C (or a SIGSTOP, a
    debugger) keeps silent however long that lasts: a receiver that gave up
    after _REPLY_TIMEOUT lost memory a live sender would have handed over. One that exited
    closed the connection (an error at once), unless a child of its holds its socket: then
    it is found dead at the next look. pid 0: not waited for (not known, or not worth it)."""

    __slots__ = ("pid", "pidfd", "address", "owner")

    def __init__(self, pid: int, address: bytes, owner: int = 0) -> None:
        self.pid = pid
        self.address = address
        self.pidfd: Optional[int] = None  # (opened at the first silence: no fd otherwise)
        self.owner = owner or os.getpid()  # (the process whose connection this is)

    def check_forked(self) -> None:
        """_Forked in a child forked since the connection was made (see fetch). Looked at
        right before each read: a signal handler that forks runs while we wait for the reply
        (a fork between this look and the read, a few bytecodes, is not caught)."""
        if os.getpid() != self.owner:
            raise _Forked()

    def alive(self) -> bool:
        if self.pid <= 0:
            return False
        if self.pidfd is None:
            try:
                self.pidfd = os.pidfd_open(self.pid)  # (close-on-exec)
            except ProcessLookupError:
                return False
            except (OSError, AttributeError):  # (no fd left, an old kernel: its /proc entry)
                return _running(self.pid)
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return not poller.poll(0)  # (readable once it exited, a zombie too)

    def recv_fds(self, sock: int, size: int) -> tuple:
        """socket.recv_fds of the next answer, waiting while the sender lives: first up to
        _HELD_WAIT_MS with the GIL held (an idle sender answers in about 0.3 ms; a thread
        that lets the GIL go waits a switch interval, 5 ms, to take it back while another
        thread runs Python), then with it released."""
        held = _HELD_WAIT_MS
        while True:
            self.check_forked()
            received = _held.recv_fds(sock, size, _MAX_FDS_PER_MESSAGE)
            if received is not None:
                with _silent_lock:
                    _silent.pop(self.address, None)  # (it answers)
                return received
            if held:
                ready, held = _held.ready(sock, select.POLLIN, held), 0
                if ready:
                    continue
            if _held.wait(sock, select.POLLIN, _REPLY_TIMEOUT):
                continue
            if self.pid <= 0:
                raise socket.timeout("timed out")  # (not waited for)
            now = _monotonic()
            with _silent_lock:
                since, last = _silent.get(self.address, (now, now))
                if now - last > 2 * _REPLY_TIMEOUT:  # (not known silent all along)
                    since = now
                if len(_silent) >= 4096:
                    _silent.clear()  # (bounded, as _reached)
                _silent[self.address] = (since, now)
            # (silent since the request at least: a _REPLY_TIMEOUT before the first look)
            if now - since + _REPLY_TIMEOUT >= _PATIENCE_SECONDS or not self.alive():
                raise socket.timeout("timed out")

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _connect(sock: int, address: bytes) -> None:
    """connect(), waiting while the server's backlog is full (EAGAIN: many receivers at
    once), up to _REPLY_TIMEOUT. Connected meanwhile (EISCONN, to `address`: a child forked
    while we waited, by a signal handler, connected it, and leaves it to us: see _Forked)."""
    deadline = time.monotonic() + _REPLY_TIMEOUT
    delay = 0.001
    while True:
        try:
            _held.connect(sock, address)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        except OSError as exc:
            if exc.errno != errno.EISCONN:
                raise
            return


def ensure_janitor() -> None:
    """Start the thread that closes unused extras and sends acknowledgements (lock held)."""
    if state.janitor is None:
        state.janitor = threading.Thread(target=_janitor, name="pyshm-janitor", daemon=True)
        state.janitor.start()


def _janitor() -> None:
    me = threading.current_thread()
    while True:
        time.sleep(JANITOR_SECONDS)
        stale = []
        with state.lock:
            if state.janitor is not me:
                return
            now = time.monotonic()
            for key, (fd, deadline, _, _) in list(state.prefetched.items()):
                if deadline < now:
                    del state.prefetched[key]
                    if fd is not None:  # (None: mapped here already, see _keep_extras)
                        stale.append(fd)
            acks, state.acks = state.acks, {}
            done = not state.prefetched
            if done:
                state.janitor = None
        for fd in stale:
            os.close(fd)
        for address, proofs in acks.items():
            for start in range(0, len(proofs), MAX_ITEMS):
                started = _monotonic()
                try:
                    fetch(address, [], acks=proofs[start : start + MAX_ITEMS], own_acks=False)
                except Exception as error:  # noqa: BLE001 (never the janitor's end)
                    # (not sent, or not known to be: sent again at the next rounds if the
                    # request failed here, quickly, else when their messages are unpickled
                    # again)
                    _ack_failed(address, proofs[start:], _worth_again(started, error))
                    break
        if done:
            return


# thread -> the servers whose conns_lock its fork under way holds (_before_fork); per thread:
# two threads may fork at once, one holding a lock the other did not wait for
_fork_held: dict = {}
_FORK_WAIT_SECONDS = 0.25  # how long a fork waits for a server's conns_lock (_before_fork)


def _before_fork() -> None:
    """Hold the conns_lock of every server of this process across a fork, so that the child
    finds each server's connections all in its conns set (_after_fork_in_child). Waited for
    _FORK_WAIT_SECONDS at most: the server thread runs Python while it holds one (a finalizer
    the garbage collector runs there may wait for a lock the forking thread holds, or fork
    itself), and a fork that waited for ever would hang both. A child forked without a
    server's lock finds that server's connections by their name instead (_close_accepted)."""
    servers = [] if state.server is None else [state.server, *state.former]
    _fork_held[threading.get_ident()] = [
        server for server in servers if server.conns_lock.acquire(timeout=_FORK_WAIT_SECONDS)]


def _after_fork_in_parent() -> None:
    for server in _fork_held.pop(threading.get_ident(), ()):
        server.conns_lock.release()


def _close_accepted(addresses: set) -> None:
    """Close every socket of this process whose name is one of `addresses` (a forked child,
    for the servers it inherited: a connection a server accepted bears its listening socket's
    name; a receiver's connection has none)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue  # (gone, or the listing's own fd)
        try:
            bound = sock.getsockname()
        except OSError:
            bound = None
        if bound in addresses:
            sock.close()
        else:
            sock.detach()


def _after_fork_in_child() -> None:
    global _silent_lock
    _silent_lock = threading.Lock()  # (perhaps held by a thread the fork left behind)
    # (the servers whose conns set the fork found complete; they stay the parent's: their
    # locks are never taken here)
    held = _fork_held.pop(threading.get_ident(), [])
    _fork_held.clear()
    old = state
    if old.server is not None:
        note_reached(old.server.address)  # (the parent's server: on this kernel)
        unheld = set()
        # (and those of the users it ran as before: see _own_server)
        for server in (old.server, *old.former):
            try:
                server.sock.close()
            except OSError:
                pass
            reserve, server.reserve = server.reserve, None
            if reserve is not None:
                os.close(reserve)
            # the parent's connections, waiting or being answered: ours would keep them open
            # after the parent closed them
            if any(server is h for h in held):
                for conn in server.conns:
                    try:
                        os.close(conn)
                    except OSError:
                        pass
            else:
                unheld.add(server.address)  # (its conns set may lack one, or name a closed fd)
            server.conns = set()
        if unheld:
            _close_accepted(unheld)
    old.former = []
    old.server = None
    old.lock = threading.RLock()
    # (the secrets of the parent (and its ancestors first) for memory exported before the
    # fork: ours for it derive from them (forked_secret), so that they can tell our tokens
    # of it from a stranger's)
    old.inherited = {**old.secrets, **old.inherited}
    old.secrets = {}
    old.live = {}
    old.ranges = {}
    old.shared_keys = set()
    old.batches = {}
    old.local = threading.local()
    for fd, *_ in old.prefetched.values():
        if fd is not None:
            os.close(fd)
    old.prefetched = {}
    old.acks = {}
    old.ack_failures = {}
    old.janitor = None
    _settled.clear()
    _cancelled_queues.clear()  # (an inherited Queue starts afresh in the child: Queue._reset)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                     after_in_child=_after_fork_in_child)
_register_linger()
_mp_util.register_after_fork(state, _register_linger)
_hook_cancel_join_thread()
