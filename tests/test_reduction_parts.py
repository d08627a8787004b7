"""Part of our own memory coming back: a worker sends back memory it found by address (a DLPack
view, a tensor over part of an array it received, a Storage of such a part), whose token names
bytes of a storage of ours that no storage here views exactly. Every rebuild path must find
that storage and give the very memory at its own address (np.shares_memory true): never a
second mapping of the same memfd (but for a Storage of part of a storage, which is mapped
again: a Storage is a whole storage's bytes), never a crash."""

from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import pickle
import sys
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import pyshm
from conftest import after_c_calls, held_after_a_release, interrupted_at, memfd_held

ROWS = 100


def memfd_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/memfd:" in line for line in maps)


MAKERS = {
    "slab": lambda: pyshm.zeros((ROWS, 3), np.float32, shared=True),
    "slab-second-slot": lambda: pyshm.zeros((ROWS, 3), np.float32, shared=True),
    "small-shared-in-place": lambda: pyshm.zeros((ROWS, 3), np.float32),
    "big-shared-in-place": lambda: pyshm.zeros((1 << 16, 3), np.float32),
}


def make(kind: str) -> tuple:
    """(array, what must stay alive with it) of that kind, filled with its row numbers and
    shared (its memfd mapped here)."""
    keep = []
    if kind == "slab-second-slot":
        keep.append(pyshm.zeros((ROWS, 3), np.float32, shared=True))
    if kind == "arena":
        arena = pyshm.Arena([ROWS * 12, ROWS * 12], [0, 0], [1, 1], shared=True).allocate()
        keep.append(arena)
        array = arena.array(1, (ROWS, 3), np.float32)
    else:
        array = MAKERS[kind]()
    array[:] = np.arange(array.shape[0], dtype=np.float32)[:, None]
    pyshm.ref(array)  # (shared in place now, if not yet)
    return array, keep


KINDS = [*MAKERS, "arena"]
# (rows lo:hi: [10, 20) starts at byte 120 of the array, not page aligned; [1, 2) at byte 12)
PARTS = [(10, 20), (1, 2)]


def part_by_dlpack(array, lo, hi):
    return np.from_dlpack(array[lo:hi])


def part_storage(array, lo, hi):
    """In a worker: a Storage of just the bytes of rows lo:hi of the memfd received."""
    whole = pyshm.storage_of(array)
    return pyshm.Storage.attach(whole.fd, (hi - lo) * 12, offset=whole.fd_offset + lo * 12)


def part_pickled(array, lo, hi):
    """In a worker: the pickle of a part, for the parent to unpickle when it likes."""
    return bytes(ForkingPickler.dumps(np.from_dlpack(array[lo:hi])))


@pytest.fixture(scope="module")
def pool():
    with mp.get_context("fork").Pool(1) as pool:
        yield pool


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lo,hi", PARTS)
@pytest.mark.parametrize("send", [part_by_dlpack, part_storage], ids=["array", "Storage"])
def test_a_part_coming_back_is_that_memory_at_its_own_address(pool, kind, lo, hi, send):
    array, keep = make(kind)
    before = memfd_mappings()
    # (unpickled on the Pool's result thread: an error comes as a stand-in, Undelivered)
    back = pool.apply(send, (array, lo, hi))
    if send is part_storage:
        assert not isinstance(back, pyshm.Undelivered), back.error
        assert back.nbytes == (hi - lo) * 12
        view = back.asarray((hi - lo, 3), np.float32)
        assert view[:, 0].tolist() == list(range(lo, hi))
        view[0, 1] = -1  # the same bytes: seen in the array
        assert array[lo, 1] == -1
        if kind == "arena":  # (a shared arena's buffer is a segment: a view of it, here)
            assert view.ctypes.data == array[lo:hi].ctypes.data
        # else (part of a slab's storage, or of one shared in place): a Storage is a whole
        # storage's bytes, so the memfd is mapped again, those bytes at another address
        del view, back
        gc.collect()
        return
    assert back.ctypes.data == array[lo:hi].ctypes.data
    assert np.shares_memory(back, array)
    assert back[:, 0].tolist() == list(range(lo, hi))
    del back
    assert memfd_mappings() <= before  # (no second mapping of our memfd)


@pytest.mark.parametrize("kind", ["slab", "big-shared-in-place", "arena"])
def test_a_part_coming_back_while_its_last_array_is_dropped(pool, kind):
    # one thread unpickles a part of an array while another drops that array (the last one of
    # its storage): the part is that memory (the same address, the same bytes) or a clear
    # error, never a crash or an array over memory unmapped meanwhile
    outcomes = set()
    for _ in range(30):
        array, keep = make(kind)
        address = array[10:20].ctypes.data
        data = pool.apply(part_pickled, (array, 10, 20))
        got = []
        start = threading.Barrier(2)

        def unpickle():
            start.wait()
            try:
                got.append(pickle.loads(data))
            except (pickle.UnpicklingError, pyshm.DeliveryError) as exc:
                got.append(exc)

        thread = threading.Thread(target=unpickle)
        thread.start()
        start.wait()
        del array, keep
        gc.collect()
        thread.join()
        back = got[0]
        if isinstance(back, Exception):
            outcomes.add(type(back).__name__)
            continue
        gc.collect()
        # (readable whatever happened: its memory is held by the array itself)
        assert back[:, 0].tolist() == list(range(10, 20))
        outcomes.add("same" if back.ctypes.data == address else "fetched")
        del back
    assert outcomes <= {"same", "fetched", "DeliveryError", "UnpicklingError"}


def inherited_pickled(lo, hi):
    """In a worker forked after INHERITED[0] was made: the pickle of rows lo:hi of that array
    of the parent's (which the worker did not receive: it sends it as memory of its own)."""
    return bytes(ForkingPickler.dumps(INHERITED[0][lo:hi]))


def part_storage_pickled(array, lo, hi):
    """In a worker: the pickle of a Storage of rows lo:hi of the memfd received."""
    return bytes(ForkingPickler.dumps(part_storage(array, lo, hi)))


def storage_pickled():
    """In a worker: the pickle of a shared Storage of its own, filled with 7s."""
    storage = pyshm.Storage(4096, shared=True)
    storage.asarray()[:] = 7
    return bytes(ForkingPickler.dumps(storage))


def big_array_pickled(twice=False):
    """In a worker: the pickle of a shared array of its own, too big for a slab (whose
    mappings a receiver keeps a while: _cache.recent), or `twice` of (it, a view of it).
    (A pickle, not the array: a Pool's result thread may still hold what it unpickled as
    apply() returns.)"""
    array = pyshm.zeros(1 << 20, np.uint8, shared=True)
    array[:] = 5
    return bytes(ForkingPickler.dumps((array, array[1:]) if twice else array))


INHERITED: list = []
HELD_VIEWS = 2  # (the references the test takes to every view made: see unpickling_cases)


def _refcount(handle) -> int:
    from pyshm import _ffi

    return _ffi.lib.lshm_storage_refcount(handle)


def _counting(handle):
    """The count of a storage of ours that unpickling must leave as it was: its references."""
    return lambda: _refcount(handle)


def _case(kind, pool, views):
    """(pickle, count(), what must stay alive) of unpickling memory of `kind` (see
    test_a_ctrl_c_anywhere_in_unpickling_our_own_memory_releases_it_exactly_once). `views`: the
    storage views unpickling makes (libshm storages of their own), which the test holds."""
    from pyshm import _memory

    if kind == "read-only view":  # (the range's own storage, borrowed: _own_storage)
        array = pyshm.zeros(1 << 20, np.uint8, shared=True)
        array[10:20] = 7
        view = array[10:20]
        view.flags.writeable = False
        return ForkingPickler.dumps(view), _counting(_memory.owner_of(array).handle), [array]
    if kind == "Storage":
        storage = pyshm.Storage(1 << 16, shared=True)
        storage.asarray()[:] = 7
        data = ForkingPickler.dumps(storage)
        # (the first unpickled keeps the range's holder alive: later ones find it, borrowed)
        return data, _counting(storage._as_parameter_), [storage, ForkingPickler.loads(data)]
    if kind == "part of a range":  # (_own_part_back)
        array, keep = make("slab")
        data = pool.apply(part_pickled, (array, 10, 20))
        return data, _counting(_memory.owner_of(array).handle), [array, keep]
    if kind == "slab array sent back by a forked child":  # (lshm_slab_find)
        array = pyshm.zeros((ROWS, 3), np.float32, shared=True)
        array[:] = np.arange(ROWS, dtype=np.float32)[:, None]
        INHERITED[:] = [array]
        with mp.get_context("fork").Pool(1) as child:
            data = child.apply(inherited_pickled, (10, 20))
            ForkingPickler.loads(data)  # (fetched from the child once: then its secret is ours)
        INHERITED.clear()
        return data, _counting(_memory.owner_of(array).handle), [array]
    # views (libshm storages of their own) of a memfd mapped here: each one's references
    array, keep = make("arena")
    if kind == "view of another storage of ours":  # (a shared arena's: _channel.lookup)
        data = pool.apply(part_storage_pickled, (array, 10, 20))
    else:  # "Storage received": a view of the mapping (_resolve, last)
        data = pool.apply(storage_pickled)
        keep.append(ForkingPickler.loads(data))  # (which keeps the mapping)
    return data, lambda: [_refcount(v) for v in views if _refcount(v) != HELD_VIEWS], [array,
                                                                                     keep]


UNPICKLED = ["read-only view", "Storage", "part of a range",
             "slab array sent back by a forked child", "view of another storage of ours",
             "Storage received"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", UNPICKLED)
def test_a_ctrl_c_anywhere_in_unpickling_our_own_memory_releases_it_exactly_once(
        monkeypatch, pool, kind):
    # Memory of ours unpickled here is made over our own storage. That storage went up from
    # where it was found (_own_storage) to the new array's owner as a retained reference,
    # which the owner adopted: a KeyboardInterrupt on the way (about six points) leaked it, so
    # the storage never died; one right as the owner's constructor returned made the caller
    # release it too, one reference too few (the storage freed under live arrays). Now every
    # point of the unpickling leaves the count exactly as it was: each storage (or each view
    # made of a memfd mapped here) has as many references after it as before.
    from pyshm import _ffi

    views = []
    create_view = _ffi._create_view
    retain = _ffi.lib.lshm_storage_retain

    def holding_views(segment, offset, nbytes, flags, out, _c_function=create_view):
        # (no call but C functions', which are no interrupt points: as if it were one)
        nonlocal views
        rc = _c_function(segment, offset, nbytes, flags, out)
        if rc == 0:
            views += [out._obj]
            retain(out._obj)  # (HELD_VIEWS: never freed here, so a release too many is seen)
            retain(out._obj)
        return rc

    monkeypatch.setattr(_ffi, "_create_view", holding_views)
    data, count, keep = _case(kind, pool, views)
    data = bytes(data)
    gc.collect()
    before = count()
    wrappers = [holding_views, *after_c_calls(
        monkeypatch, _ffi.lib, "lshm_storage_retain", "lshm_storage_release",
        "lshm_storage_flags", "lshm_storage_data", "lshm_storage_nbytes",
        "lshm_storage_segment", "lshm_segment_size"),
        *after_c_calls(monkeypatch, _ffi, "slab_find_unchecked")]
    # (what exists now is frozen out of the collections below: with torch, Dask and Ray
    # imported by earlier tests, each full collection took ~0.15 s, 150 s for the six cases)
    gc.freeze()
    try:
        point = 1
        while interrupted_at(point, lambda: ForkingPickler.loads(data), wrappers):
            gc.collect()
            pyshm.Storage(4096).close()  # (a release: one cut off in a callback is made there)
            assert count() == before, point  # (nothing leaked, nothing released twice)
            point += 1
        assert point > 20
        back = ForkingPickler.loads(data)  # whole
        if isinstance(back, pyshm.Storage):
            assert int(back.asarray()[0]) == 7 or kind.startswith("view")
        else:
            assert back.reshape(-1)[0] in (7, 10)
        del back
        gc.collect()
        assert count() == before
    finally:
        gc.unfreeze()
        for view in views:
            for _ in range(HELD_VIEWS):
                _ffi.lib.lshm_storage_release(view)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_anywhere_in_a_received_mappings_death_is_made_up_for_at_the_next_release(
        pool):
    # A KeyboardInterrupt at each point of the death of the last array of a memfd received:
    # at the entry of its finalizer (_drop_segment, a Python function called by the release
    # callback once that had taken its record out) the mapping and the fd kept stayed until
    # the process exited, and the count of fds kept stayed one too high. Now they go by the
    # next release at the latest.
    from pyshm import reduction

    kept = reduction._cache.kept_fds
    point = 1
    while True:
        held = [ForkingPickler.loads(pool.apply(big_array_pickled))]
        assert int(held[0][-1]) == 5
        inode = held[0].base.keep.key[1]
        assert memfd_held(inode) and reduction._cache.kept_fds == kept + 1
        if not interrupted_at(point, held.clear):
            break
        assert held == []
        assert held_after_a_release(inode) == [] and reduction._cache.kept_fds == kept, point
        point += 1
    assert point > 3
    assert memfd_held(inode) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_anywhere_in_making_a_received_arrays_storage_leaks_no_view(monkeypatch, pool):
    # An array of a memfd received has no C storage until something asks its owner for one
    # (_ReceivedOwner.handle: pyshm.storage_of, a send on that needs libshm). A
    # KeyboardInterrupt as libshm returned the new view, before the owner recorded it, leaked
    # the view, and with it the mapping and the fd, until the process exited.
    from pyshm import _ffi

    wrappers = after_c_calls(monkeypatch, _ffi, "_create_view")
    for point in itertools.count(1):
        # (the second array is made over the mapping the first made: a _ReceivedOwner's)
        held = list(ForkingPickler.loads(pool.apply(big_array_pickled, (True,))))
        inode = held[1].base.keep.key[1]
        interrupted = interrupted_at(point, lambda: held[1].base.handle, wrappers)
        assert int(held[1][-1]) == 5 and pyshm.storage_of(held[1]).nbytes == 1 << 20
        held.clear()
        assert held_after_a_release(inode) == [], point
        if not interrupted:
            break
    assert point > 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", ["Storage", "array"])
def test_a_ctrl_c_anywhere_in_the_death_of_our_memory_unpickled_lets_its_range_holder_go(
        monkeypatch, kind):
    # What is unpickled of our own memory keeps the holder its range is registered to (the
    # Storage the pickle made, an array's owner) alive. A weak reference callback of its own
    # let the holder go: a KeyboardInterrupt at its entry kept the holder, and the storage's
    # reference it holds, until the process exited. Now the holder goes by the next release.
    # The holder's death, in the settle that lets it go, settles too: the settle it came in
    # then found its step done under it (KeyError out of a release callback, or out of the
    # Storage.close() that settled). (Python's own hook prints what a callback raised and lets
    # it go; pytest's keeps its traceback, and the frames' locals with it, up to the end of
    # the test: this one keeps its type only.)
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: raised.append(
        unraisable.exc_type))
    storage = pyshm.Storage(1 << 16, shared=True)
    handle = storage._as_parameter_
    point = 1
    while True:
        sent = storage
        if kind == "array":  # (read-only: a writeable one comes back as a view of itself)
            sent = storage.asarray()[8:]
            sent.flags.writeable = False
        held = [ForkingPickler.loads(ForkingPickler.dumps(sent))]
        sent = None
        gc.collect()
        assert _refcount(handle) == 3  # (ours, the holder's, the unpickled one's)
        if not interrupted_at(point, held.clear):
            break
        assert held == []
        pyshm.Storage(4096).close()  # (a release: one cut off is made up for there)
        assert _refcount(handle) == 1, point
        assert set(raised) <= {KeyboardInterrupt}, point
        point += 1
    assert point > 3
    assert _refcount(handle) == 1
