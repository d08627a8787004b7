"""Arena: the storages of a planned set in one slab, backed by slices of one buffer."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import _thread
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import _checks, _ffi
from ._ffi import lib
from ._memory import (
    LIFETIMES,
    ArrayOwner,
    HandleLifetime,
    ShapeLike,
    array_dtype,
    array_from_storage,
    nbytes_of,
    normalize_shape,
    owner_of,
)
from ._planning import (
    CUT_OFF_AT_FORK,
    Plan,
    plans_in_c,
    big_plan,
    inputs,
    interruptibly,
    lifetime_pointers,
    options,
    plan_from_result,
)
from .storage import Storage

__all__ = ["Arena", "ArenaStats"]



@dataclass(frozen=True)
class ArenaStats:
    """Counters of an arena (see ``lshm_arena_stats`` in lshm.h for the exact definitions).

    ``reuse_count`` counts storages served from an arena buffer that already existed, i.e.
    with no new system allocation; ``fallback_count`` the allocations of a recording arena
    served by ordinary allocation (recording iteration, or a request that did not fit).
    """

    managed_bytes: int
    arena_bytes: int
    lower_bound: int
    storages: int
    reuse_count: int
    fallback_count: int
    iterations: int
    replans: int


def _index(i: Any) -> int:
    """A tensor index for C (a size_t): never wrapped; the library checks it against n."""
    return _checks.size_t(i, "tensor index")


def _unless_no_data(func, *args) -> bool:
    """Call ``func``; False when it reports ENODATA (nothing there yet), True on success."""
    try:
        func(*args)
    except _ffi.ShmError as exc:
        if exc.errno == errno.ENODATA:
            return False
        raise
    return True


def _locked(method):
    """``method`` under the arena's lock: the C arena is not thread-safe, and two threads in
    it at once (an alloc beside a free, a re-plan beside an offset read) corrupted its records
    or read freed memory. The outermost call of a thread enters the arena in _IN_CALL, which
    a fork waits for (see _lock_arenas_before_fork)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        if self._handle is None:
            # (closed: no C arena left to guard; every method then raises ValueError or returns)
            return method(self, *args, **kwargs)
        if self._generation != _GENERATION:
            _renew_lock(self)  # (the first call in a forked child)
        with self._lock:
            if self._lock in _IN_CALL:  # (a call of this thread's in the arena: it holds it)
                return method(self, *args, **kwargs)
            try:
                _IN_CALL.add(self._lock)
                if _FORKER is not None:
                    _wait_for_fork(self._lock)
                return method(self, *args, **kwargs)
            finally:
                _IN_CALL.discard(self._lock)

    return locked


# A fork waits until no other thread is inside an arena call, so that the child never gets a
# C arena as a call left it halfway (a re-plan started and not installed, a storage allocated
# and not yet in _live, so end_iteration refused in the child forever). It took every arena's
# lock, which made a fork with 10,000 arenas alive take 20-30 ms instead of 1-2; now it takes
# the locks of the arenas in a call only. _IN_CALL holds them (a set of _ArenaLock: their hash
# and == are C's, never an Arena subclass's __hash__/__eq__, which made every call raise
# TypeError, "unhashable", or run that subclass's code inside the fork hook): a thread's
# outermost call enters it under the arena's lock, then checks _FORKER, the thread forking
# now, if any; the fork sets _FORKER, then reads _IN_CALL. So a call begun before the fork
# is waited for; one begun after leaves _IN_CALL again and waits for the fork to end, and
# the fork does not wait for it (its arena is unchanged). The lock of an arena the fork did
# not take may be held in the child by a thread that is not there: each arena's lock belongs
# to a generation (_GENERATION, one per process), and the child's first call on it makes a
# new one (_renew_lock). The locks a fork took are the forking thread's own (_HELD_FOR_FORK),
# released by it in parent and child. Forks take turns (_FORK_TURN): two at once took locks
# in two orders and released each other's. (Reentrant: a fork from a signal handler that
# ran while its thread held it, in _wait_for_fork or, before, in Arena(), waited for itself.)
# The wait for each arena is bounded: a thread inside an arena call runs Python (an index's
# __index__, a finalizer the garbage collector runs there) that may wait for a lock the
# forking thread holds, and a fork that waited for the arena's lock for ever hung with it.
# It waits _FORK_WAIT_SECONDS, longer while the call plans in C (_planning, and a plan in C:
# that waits for nothing of ours, and a plan with a time_limit takes that long). An arena
# whose lock it did not get is unusable in the child (_BusyAtFork): its C arena may be
# halfway there.
_IN_CALL: set = set()


class _ArenaLock(_thread.RLock):
    """An arena's lock (a C RLock), with a weak reference to its arena (for a fork)."""

    __slots__ = ("arena",)


def _new_lock(arena: "Arena") -> _ArenaLock:
    lock = _ArenaLock()  # (no argument: some CPythons' RLock refuses them)
    lock.arena = weakref.ref(arena)
    return lock


_FORKER: Optional[int] = None
_GENERATION = 0
_RENEWING = threading.RLock()  # (a signal handler may call an arena inside _renew_lock)
_FORK_TURN = threading.RLock()  # (a signal handler may fork inside _wait_for_fork's)
_HELD_FOR_FORK = threading.local()
_FORK_WAIT_SECONDS = 0.25


class _BusyAtFork:
    """The lock of a forked child's arena whose lock the fork could not take: entering it (as
    every method does, see _locked) raises OSError(EBUSY)."""

    def __enter__(self) -> None:
        raise OSError(errno.EBUSY, "pyshm.Arena: this arena was busy in another thread when "
                      "the process forked (here it may be halfway through that call); make a "
                      "new one")

    def __exit__(self, *exc_info) -> None:
        pass


_BUSY_AT_FORK = _BusyAtFork()


def _wait_for_fork(lock: _ArenaLock) -> None:
    """A call entered in _IN_CALL while a thread forks: unless it is the forking thread, leave
    _IN_CALL and wait for the fork's end (the arena's lock held: the fork no longer waits for
    it), then enter again."""
    me = threading.get_ident()
    while _FORKER is not None and _FORKER != me:
        _IN_CALL.discard(lock)
        _WAITING_FOR_FORK.add(lock)
        try:
            with _FORK_TURN:  # (held by the fork until its end)
                pass
        finally:
            _WAITING_FOR_FORK.discard(lock)
        _IN_CALL.add(lock)


# The locks held by calls waiting in _wait_for_fork. A signal handler that forks there (once
# the other fork ended) leaves the child a call of its own thread's, about to go on under
# that lock: the child keeps it (a lock made anew let another thread of the child's into the
# arena beside that call).
_WAITING_FOR_FORK: set = set()


def _renew_lock(arena: "Arena") -> None:
    with _RENEWING:
        if arena._generation != _GENERATION:
            if arena._lock is not _BUSY_AT_FORK:  # (busy at an earlier fork: halfway for good)
                arena._lock = _new_lock(arena)
            arena._generation = _GENERATION


def _lock_arenas_before_fork() -> None:
    global _FORKER
    held: list = []
    busy: list = []
    # (a stack: a signal handler may fork while this thread's fork waits below; that fork's
    # hooks took the one list and flag of this one, which then released nothing: the arena
    # locks it took and _FORK_TURN stayed held, and every later fork waited for ever)
    forks = _HELD_FOR_FORK.__dict__.setdefault("forks", [])
    record = [held, busy, False]  # (+ whether it has _FORK_TURN)
    forks.append(record)
    try:
        _FORK_TURN.acquire()
        record[2] = True
        _FORKER = threading.get_ident()
        for lock in list(_IN_CALL):
            arena = lock.arena()
            if arena is None:
                continue
            give_up = time.monotonic() + _FORK_WAIT_SECONDS
            while not lock.acquire(timeout=0.005):
                if lock not in _IN_CALL:
                    break  # (its call ended, or waits for this fork: nothing halfway)
                if arena._planning and plans_in_c(arena._planning):
                    give_up = time.monotonic() + _FORK_WAIT_SECONDS
                elif time.monotonic() > give_up:
                    busy.append(arena)
                    break
            else:
                held.append((arena, lock))
    except BaseException:
        _interrupted_wait(held, busy)
        raise  # (os.fork() reports it as ignored, and goes ahead)


def _interrupted_wait(held: list, busy: list) -> None:
    """A signal handler's exception (KeyboardInterrupt at Ctrl-C) while a fork waited for its
    turn or an arena call: os.fork() ignores it and goes ahead, and the child used the arenas
    it had not waited for as whole (perhaps halfway). Those still in a call are unusable in
    the child (busy) now."""
    taken = [lock for _, lock in held]
    for lock in list(_IN_CALL):
        arena = lock.arena()
        if arena is None or any(lock is other for other in taken):
            continue
        if lock.acquire(blocking=False):  # (free, or this thread's own call's)
            held.append((arena, lock))
        else:
            busy.append(arena)


def _release_for_fork() -> tuple:
    """Release what the innermost _lock_arenas_before_fork of this thread took: ((arena, lock)
    of each lock it took, the arenas it found busy)."""
    global _FORKER
    forks = _HELD_FOR_FORK.__dict__.get("forks")
    if not forks:
        return [], []
    held, busy, turn = forks.pop()
    if turn and not forks:  # (else a fork of this thread's is still under way: a signal
        _FORKER = None      # handler's ran; or, without the turn, _FORKER is another's)
    for _, lock in reversed(held):
        lock.release()
    if turn:
        _FORK_TURN.release()
    return held, busy


def _unlock_arenas_in_parent() -> None:
    _release_for_fork()


def _new_locks_in_child() -> None:
    global _RENEWING, _GENERATION
    _RENEWING = threading.RLock()  # (perhaps held by a thread that is not here)
    _GENERATION += 1  # (every other arena's lock is made anew at its first call)
    taken, busy = _release_for_fork()
    for arena, _ in taken:
        arena._generation = _GENERATION
        if arena._planning and CUT_OFF_AT_FORK:  # (its plan, on a helper thread: cut off)
            busy.append(arena)
    for arena in busy:
        # (its C arena may be halfway: never called again here, not even by its finalizer;
        # what it holds is the child's copy, gone with the process)
        arena._lock, arena._generation = _BUSY_AT_FORK, _GENERATION
        arena._release_never()
    waiting = list(_WAITING_FOR_FORK)
    _WAITING_FOR_FORK.clear()
    for lock in waiting:  # (this thread's call, if its lock is this thread's: it goes on here)
        arena = lock.arena()
        if arena is not None and arena._lock is lock and lock.acquire(blocking=False):
            lock.release()
            arena._generation = _GENERATION
            _WAITING_FOR_FORK.add(lock)
    # (the calls in flight here are this thread's: the fork took their locks; the others
    # were another thread's, gone; a cut-off plan's arena has no lock left to be in a call)
    _IN_CALL.intersection_update([lock for arena, lock in taken if arena._lock is lock])


os.register_at_fork(before=_lock_arenas_before_fork, after_in_parent=_unlock_arenas_in_parent,
                    after_in_child=_new_locks_in_child)


class _ArenaKeep(HandleLifetime):
    """What an arena array's owner keeps alive (its ``keep``): the arena, and one C reference
    to the buffer the array's bytes lie in (``buffer``, an lshm_arena_buffer handle, or None
    for ordinary memory), released when the last array over that buffer is gone. So a re-plan
    or :meth:`Arena.trim` never unmaps bytes a live array points at, even after ``free()``.
    One object per buffer is shared by all the arena's arrays on it."""

    __slots__ = ("arena", "buffer")

    def __init__(self, arena: "Arena", buffer: Optional[_ffi.ArenaBufferHandle]) -> None:
        self.arena = arena
        self.buffer = buffer
        if buffer is not None:
            self._release_with(lib.lshm_arena_buffer_release, buffer,
                               take=lib.lshm_arena_buffer_retain)
        else:
            self._lifetime = None


def _destroy(key: int, handle: _ffi.ArenaHandle, live: dict,
             _lifetimes: dict = LIFETIMES, _free: Any = _ffi.gil_held("lshm_arena_free"),
             _destroy_arena: Any = _ffi.gil_held("lshm_arena_destroy")) -> None:
    # Finalizer: no arrays are alive (each one keeps the Arena object alive), so only the
    # references the Arena itself holds remain; give them back, then the arena. A keyed
    # release (see pyshm._memory KEYED): cut off by a Ctrl-C anywhere, it goes on from there at
    # the next settle; each step takes its record out and makes its C call with no point
    # between where a signal handler runs. Two settles at once (two threads releasing, or a
    # garbage collection here) both run it: a slot is read with no call (next(iter()) was
    # two: another thread could run between them and after) and taken only if still there,
    # and the C calls keep the GIL (no other thread's _destroy may destroy the arena while a
    # free of its runs, nor a fork see one halfway). A refusal (a status < 0) is ignored:
    # something still holds a storage, and leaking beats freeing memory in use.
    while live:
        slot = None
        for slot in live:  # (the first one: no call, so no point where another thread runs;
            break  # a garbage collection as the iterator is made may empty it, though)
        storage = live[slot] if slot in live else None
        if storage is not None:
            del live[slot]
            _free(handle, storage)
    if key in _lifetimes:
        del _lifetimes[key]
        _destroy_arena(handle)


def _free_live(handle: _ffi.ArenaHandle, live: dict, key: Any) -> None:
    """lshm_arena_free of the storage that ``live`` (an arena's _live) holds at `key`: taken
    out of `live` first, with no point between where a signal handler runs, and put back if
    libshm refuses. Freed first, a KeyboardInterrupt as the C call returned left it in
    `live`, and every later end_iteration() and close() freed it again, refused (EINVAL:
    "freed already"), for good."""
    storage = live[key]
    del live[key]
    try:
        lib.lshm_arena_free(handle, storage)
    except OSError:
        live[key] = storage
        raise


class Arena(HandleLifetime):
    """Tensors with planned offsets in one buffer, as numpy arrays.

    Two ways to make one:

    * ``Arena(sizes, firsts, lasts)`` plans ``n`` tensors (see :func:`pyshm.plan`; ``.plan``
      holds the result). :meth:`allocate` backs each tensor with its slice of one buffer,
      :meth:`array` views tensor ``i`` as a numpy array, :meth:`deallocate` detaches them.
    * ``Arena.recording()`` learns the plan: iteration 1 serves :meth:`empty` with ordinary
      memory while recording (alloc, free) events, :meth:`end_iteration` plans them, and
      later iterations are served from the arena's buffer (re-planning when a request grows).

    With ``shared=True`` the buffer is one anonymous memfd: ``.fd`` can be sent to another
    process, which maps it (``pyshm.Storage.attach(fd, nbytes, offset=arena.offset(i))``), and
    its arrays pickle for multiprocessing as views of it. A private arena's arrays cannot be
    shared in place (their bytes are a slice of the arena's buffer): ``share_memory_``,
    ``share_readonly`` and pickling them for another process raise :class:`BufferError` /
    :class:`pickle.PicklingError` and change nothing; use ``shared=True`` or
    ``pyshm.copy(array, shared=True)``.

    Lifetime contract:

    * The arena owns the buffer and the storage structs. :meth:`close` (or leaving a ``with``
      block) frees them; it raises :class:`BufferError` and changes nothing while any array
      made by the arena is alive. Without close, the memory goes when the arena object and
      every array made from it are gone.
    * Every array holds a reference to its storage, to the arena and to the arena's buffer its
      bytes lie in (``lshm_arena_current_buffer``), so the bytes it sees stay mapped as long as
      it lives, even when the arena replaces the buffer (a re-plan) or frees it (:meth:`trim`):
      the old buffer is unmapped once the last array over it is gone. :meth:`deallocate`
      raises :class:`BufferError` (changing nothing) while an array from :meth:`array` is
      alive: delete the arrays first.
    * The buffer is kept between :meth:`allocate` calls (no new mmap); :meth:`trim` frees it.
      Bytes are zero in a new buffer and left as they were in a reused one.
    * Recording arenas: :meth:`free` says a tensor is dead, and its slice may be handed to the
      next :meth:`empty` of the iteration. Using a freed array afterwards is a logic error like
      a use-after-free in C, except that it never touches unmapped memory (it may see another
      tensor's bytes, or the bytes of a buffer the arena no longer uses). :meth:`free` raises
      :class:`BufferError` while another :class:`~pyshm.Storage` handle on a buffer slice
      exists. An array dropped without :meth:`free` is freed by the next
      :meth:`end_iteration` (its tensor is live until then).
    * Threads may call an arena's methods at once: each takes the arena's lock, so they run
      one at a time. ``os.fork()`` waits for the arena calls in flight in other threads (a
      plan with a ``time_limit`` may take that long), and for the forking thread's own plan
      on a helper thread (a fork from a signal handler), so the child never sees one halfway;
      a call begun meanwhile waits for the fork to end. A call that keeps the arena 0.25 s
      outside a plan (it runs Python that may wait for the forking thread: a finalizer the
      garbage collector runs there), or a helper thread that runs Python 0.25 s after its
      plan, is not waited for further: in the child (and its own children), that arena's
      methods raise :class:`OSError` (``EBUSY``) and :meth:`close` frees nothing; the parent
      is untouched.
      A recording arena's iteration is still one sequence of events: allocs of threads
      interleaving differently each iteration fall back and re-plan more. Its arrays are
      ordinary arrays and may be used from any thread.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        firsts: Sequence[int],
        lasts: Sequence[int],
        *,
        alignment: int = 64,
        inclusive: bool = False,
        shared: bool = False,
        time_limit: float = 0.0,
    ) -> None:
        shared = _checks.flag(shared, "shared")  # (a string such as "no" reads as true)
        n, sizes_a, firsts_a, lasts_a = inputs(sizes, firsts, lasts)
        opts = options(alignment, inclusive, time_limit)
        out = _ffi.ArenaHandle()
        interruptibly(  # (Ctrl-C stops a big plan: see pyshm.planner.plan)
            functools.partial(
                lib.lshm_arena_create, n, *lifetime_pointers(sizes_a, firsts_a, lasts_a),
                ctypes.byref(opts), _ffi.ARENA_SHARED if shared else 0, ctypes.byref(out)),
            functools.partial(lib.lshm_plan_interrupt, ctypes.byref(opts)),
            big_plan(n, time_limit))
        self._setup(out, recording=False, shared=shared, alignment=int(opts.alignment),
                    inclusive=inclusive)

    @classmethod
    def recording(
        cls, *, shared: bool = False, alignment: int = 64, time_limit: float = 0.0
    ) -> "Arena":
        """A record-then-replay arena: use :meth:`empty`, :meth:`free`, :meth:`end_iteration`."""
        shared = _checks.flag(shared, "shared")  # (a string such as "no" reads as true)
        opts = options(alignment, False, time_limit)
        out = _ffi.ArenaHandle()
        lib.lshm_arena_create_recording(
            ctypes.byref(opts), _ffi.ARENA_SHARED if shared else 0, ctypes.byref(out)
        )
        self = cls.__new__(cls)
        self._setup(out, recording=True, shared=shared, alignment=int(opts.alignment),
                    inclusive=False)
        self._time_limit = float(opts.time_limit)
        return self

    def _setup(self, handle: _ffi.ArenaHandle, *, recording: bool, shared: bool, alignment: int,
               inclusive: bool) -> None:
        self._lock = _new_lock(self)  # (held by every method: see _locked)
        self._generation = _GENERATION  # (of its lock: a forked child makes a new one)
        self._handle = handle
        self._recording = recording
        self._shared = shared
        self._alignment = alignment
        self._inclusive = inclusive
        # Recording arenas: the address of each storage handed out and not freed yet -> the
        # handle of the reference we hold.
        self._live: dict = {}
        # allocations of this iteration: end_iteration waits apart for a big one's plan
        self._allocs = 0
        self._time_limit = 0.0  # (a recording arena's: its plans may take that long)
        # (in a C plan, under the lock: the planning thread's ident, 0 if none; a fork waits
        # longer for it)
        self._planning = 0
        # the owners of the arrays handed out (each keeps the arena alive: its keep)
        self._owners: "weakref.WeakSet[ArrayOwner]" = weakref.WeakSet()
        # buffer address (None: ordinary memory) -> the _ArenaKeep its arrays share
        self._keeps: "weakref.WeakValueDictionary[Optional[int], _ArenaKeep]" = (
            weakref.WeakValueDictionary()
        )
        self._release_with(_destroy, handle, self._live, keyed=True)

    # ---- lifetime -------------------------------------------------------------------------

    @property
    def _as_parameter_(self) -> _ffi.ArenaHandle:
        if self._handle is None:
            raise ValueError("operation on a closed pyshm.Arena")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    def close(self) -> None:
        """Free the storages, the slab and the buffer (idempotent).

        Raises :class:`BufferError`, changing nothing, while arrays made by the arena live.
        In a forked child, an arena that was busy in another thread at the fork (unusable
        there) is closed without freeing anything: its arrays keep working.
        """
        if self._lock is _BUSY_AT_FORK:
            self._handle = None  # (its C arena may be halfway: see _new_locks_in_child)
        else:
            self._close()

    @_locked
    def _close(self) -> None:
        if self._handle is None:
            return
        # (the owners alive, not len(): a Ctrl-C in the WeakSet's callback left a dead one
        # counted there, and close() refused for good)
        alive = len(list(self._owners))
        if alive:
            raise _ffi.ShmBufferError(
                errno.EBUSY, f"pyshm.Arena.close: {alive} array(s) made by the arena are alive"
            )
        handle = self._handle
        while self._live:
            _free_live(handle, self._live, next(iter(self._live)))
        # The finalizer's record, the handle and the arena go in one step (no point between
        # where a signal handler runs; all three back if libshm refuses): destroyed first, a
        # KeyboardInterrupt as the C call returned left the arena open and recorded, and the
        # next close() or the finalizer destroyed it again (glibc: double free, an abort).
        key = id(self._lifetime)
        entry = LIFETIMES[key] if key in LIFETIMES else None
        if entry is not None:
            del LIFETIMES[key]
        self._handle = None
        try:
            lib.lshm_arena_destroy(handle)
        except OSError:
            self._handle = handle
            if entry is not None:
                LIFETIMES[key] = entry
            raise

    def __enter__(self) -> "Arena":
        self._as_parameter_
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @_locked
    def __len__(self) -> int:
        return lib.lshm_arena_count(self._as_parameter_)

    def __repr__(self) -> str:
        if self._lock is _BUSY_AT_FORK and self._handle is not None:
            return "<pyshm.Arena unusable: busy in another thread at the fork>"
        return self._repr()

    @_locked
    def _repr(self) -> str:
        if self._handle is None:
            return "<pyshm.Arena closed>"
        kind = "recording" if self._recording else "planned"
        where = "shared" if self._shared else "private"
        return f"<pyshm.Arena {kind} {where} {len(self)} tensors, {self.size} bytes>"

    # ---- planned arenas -------------------------------------------------------------------

    @_locked
    def allocate(self) -> "Arena":
        """Back every planned tensor with its slice of the buffer (kept between calls)."""
        lib.lshm_arena_allocate(self._as_parameter_)
        return self

    @_locked
    def deallocate(self) -> None:
        """Detach every storage; :class:`BufferError` while arrays from :meth:`array` live."""
        lib.lshm_arena_deallocate(self._as_parameter_)

    @_locked
    def trim(self) -> None:
        """Free the kept buffer (the next :meth:`allocate` maps a new one)."""
        lib.lshm_arena_trim(self._as_parameter_)

    @_locked
    def array(self, i: int, shape: Optional[ShapeLike] = None, dtype: Any = np.uint8) -> np.ndarray:
        """A numpy array over planned tensor ``i`` (the arena must be allocated).

        ``shape=None`` views all its bytes as a 1-D array of ``dtype``. The array keeps the
        storage and the arena alive, and makes :meth:`deallocate` refuse until it is gone.
        """
        out = _ffi.StorageHandle()
        lib.lshm_arena_storage(self._as_parameter_, _index(i), ctypes.byref(out))
        return self._wrap(out, shape, dtype)

    @_locked
    def storage(self, i: int) -> Storage:
        """A :class:`Storage` handle (its own reference) on planned tensor ``i``; it keeps the
        arena alive, as its arrays do."""
        out = _ffi.StorageHandle()
        lib.lshm_arena_storage(self._as_parameter_, _index(i), ctypes.byref(out))
        return Storage._retaining(out, keep=self._keep_for(out))

    # ---- recording arenas -----------------------------------------------------------------

    @_locked
    def empty(self, shape: ShapeLike, dtype: Any = np.float64) -> np.ndarray:
        """Recording arenas: one allocation, served from the plan when it fits."""
        dtype = array_dtype(dtype)
        dims = normalize_shape(shape)
        out = _ffi.StorageHandle()
        try:
            lib.lshm_arena_alloc(self._as_parameter_, nbytes_of(dims, dtype), ctypes.byref(out))
        finally:
            # In _live whatever comes after the C call, a KeyboardInterrupt too (a signal
            # handler raises it when that call returns): a storage the arena allocated and
            # _live lost made every later end_iteration refuse (EBUSY, "not freed"). Dropped
            # before it is wrapped, it is freed by the next end_iteration (_free_dropped).
            if out:
                self._live[ctypes.addressof(out.contents)] = out
        self._allocs += 1
        return self._wrap(out, dims, dtype)

    @_locked
    def free(self, array: Any) -> None:
        """Recording arenas: tensor ``array`` (from :meth:`empty`) is dead from now on."""
        owner = owner_of(array)
        handle = getattr(owner, "handle", None)
        keep = getattr(owner, "keep", None)
        key = _ffi.address(handle)  # (0, never a live storage's, for no handle)
        if owner is None or getattr(keep, "arena", None) is not self or key not in self._live:
            raise ValueError("free expects a live array made by this arena's empty()")
        in_slot = bool(lib.lshm_storage_flags(handle) & _ffi.STORAGE_INPLACE)
        if in_slot:
            # Our reference and the owner's: anything more is a Storage handle elsewhere.
            refs = lib.lshm_storage_refcount(handle)
            if refs != 2:
                raise _ffi.ShmBufferError(
                    errno.EBUSY, f"pyshm.Arena.free: {refs - 2} other reference(s) to the storage"
                )
            # The slice goes to later allocs: the owner gives up its reference (the bytes stay
            # mapped: the owner keeps a reference to the buffer) and forgets the storage.
            owner._release_now()
        try:
            _free_live(self._as_parameter_, self._live, key)
        except _ffi.ShmBufferError:
            # (EBUSY: a reference taken since the check, by another thread unpickling this
            # very tensor, which holds the channel's lock and not this one: the owner takes
            # its reference back, and the refusal changes nothing)
            if in_slot:
                owner._take_back(handle)
            raise

    @_locked
    def end_iteration(self) -> None:
        """Recording arenas: end the iteration (plans after the first, or after a misfit). A
        plan of 2,000 allocations or more, or with a ``time_limit`` of 0.5 s or more, is made
        on a helper thread while this one waits, so that Ctrl-C stops it (see
        :func:`pyshm.planner.plan`; the next iteration plans again).

        An array from :meth:`empty` that was dropped without :meth:`free` (collected: no
        array over it and no :class:`~pyshm.Storage` handle on it left) is freed here, first,
        in the order of the allocations: it counts as live until the end of the iteration.
        One still alive and not freed makes it raise :class:`BufferError`, the iteration
        going on (the dropped ones are freed all the same): free or drop it and call again."""
        handle = self._as_parameter_
        self._free_dropped(handle)
        # (apart whether it plans or not: a helper thread costs about 0.1 ms, an iteration of
        # that many allocations, or a plan that may take that budget, far more)
        apart, self._allocs = big_plan(self._allocs, self._time_limit), 0
        self._planning = threading.get_ident()  # (whose plan a fork waits for)
        try:
            interruptibly(functools.partial(lib.lshm_arena_end_iteration, handle),
                          functools.partial(lib.lshm_arena_interrupt, handle), apart)
        finally:
            self._planning = 0

    def _free_dropped(self, handle: _ffi.ArenaHandle) -> None:
        """Free the storages of this iteration whose arrays are all gone: only the reference
        in ``_live`` is left (an array's owner or a Storage handle holds one more)."""
        for key, storage in list(self._live.items()):
            if lib.lshm_storage_refcount(storage) == 1:
                _free_live(handle, self._live, key)

    # ---- information ----------------------------------------------------------------------

    @property
    @_locked
    def size(self) -> int:
        """Bytes of the current plan's buffer (0 before a recording arena's first plan). A
        tensor that is never live (first == last, half-open) still gets a slice of its size,
        so it can be larger than the plan's ``arena_size``."""
        return int(lib.lshm_arena_size(self._as_parameter_))

    @_locked
    def offset(self, i: int) -> int:
        """Offset of tensor ``i`` in the buffer (and in ``.fd``)."""
        value = ctypes.c_uint64()
        lib.lshm_arena_offset(self._as_parameter_, _index(i), ctypes.byref(value))
        return int(value.value)

    @property
    @_locked
    def plan(self) -> Optional[Plan]:
        """The current plan (None for a recording arena before its first plan)."""
        result = _ffi.PlanResult()
        if not _unless_no_data(lib.lshm_arena_plan_result, self._as_parameter_,
                               ctypes.byref(result)):
            return None
        offsets = np.array([self.offset(i) for i in range(len(self))], dtype=np.uint64)
        return plan_from_result(offsets, result, self._alignment, self._inclusive)

    @property
    @_locked
    def stats(self) -> ArenaStats:
        counters = _ffi.ArenaCounters()
        lib.lshm_arena_stats(self._as_parameter_, ctypes.byref(counters))
        return ArenaStats(**{name: int(getattr(counters, name)) for name, _ in counters._fields_})

    @property
    def shared(self) -> bool:
        return self._shared

    @property
    @_locked
    def fd(self) -> Optional[int]:
        """The memfd of a shared arena's buffer (borrowed: dup it to keep it), else None."""
        if not self._shared:
            return None
        fd = ctypes.c_int(-1)
        if not _unless_no_data(lib.lshm_arena_fd, self._as_parameter_, ctypes.byref(fd)):
            return None
        return fd.value

    @property
    @_locked
    def data_ptr(self) -> int:
        """Address of the buffer's first byte (0 when there is none)."""
        return lib.lshm_arena_data(self._as_parameter_) or 0

    # ---- helpers --------------------------------------------------------------------------

    def _keep_for(self, handle: _ffi.StorageHandle) -> _ArenaKeep:
        """The _ArenaKeep for an array over storage `handle` (made by this arena)."""
        buffer = key = None
        if lib.lshm_storage_flags(handle) & _ffi.STORAGE_INPLACE:
            # a slot: its bytes lie in the current buffer
            buffer = _ffi.ArenaBufferHandle()
            lib.lshm_arena_current_buffer(self._as_parameter_, ctypes.byref(buffer))
            key = _ffi.address(buffer)
        keep = self._keeps.get(key)
        if keep is None:
            keep = self._keeps[key] = _ArenaKeep(self, buffer)
        return keep

    def _wrap(self, handle: _ffi.StorageHandle, shape: Optional[ShapeLike],
              dtype: Any) -> np.ndarray:
        array = array_from_storage(handle, shape, dtype, 0, keep=self._keep_for(handle))
        self._owners.add(owner_of(array))
        return array
