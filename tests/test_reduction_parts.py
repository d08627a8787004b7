"""Part of our own memory coming back: a worker sends back memory it found by address (a DLPack
view, a tensor over part of an array it received, a Storage of such a part), whose token names
bytes of a storage of ours that no storage here views exactly. Every rebuild path must find
that storage and give the very memory at its own address (np.shares_memory true): never a
second mapping of the same memfd (but for a Storage of part of a storage, which is mapped
again: a Storage is a whole storage's bytes), never a crash."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import pyshm

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


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_anywhere_in_unpickling_our_own_memory_releases_it_once(monkeypatch):
    # A read-only view of ours unpickled here is made over a retained reference to our
    # storage, which the new array's owner adopts (_build_ndarray). A KeyboardInterrupt right
    # after the owner had recorded it, before the caller knew (as the constructor returned),
    # made the caller release it too: one reference too few, so the storage could be
    # destroyed under live arrays. (One too many, a leak, is still possible: an interrupt as
    # the retained reference goes up from _own_storage to _build_ndarray, six points.)
    from conftest import after_c_calls, interrupted_at

    from pyshm import _ffi, _memory

    array = pyshm.zeros(1 << 20, np.uint8, shared=True)
    array[10:20] = 7
    view = array[10:20]
    view.flags.writeable = False
    data = bytes(ForkingPickler.dumps(view))
    handle = _memory.handle_of(_memory.owner_of(array))
    gc.collect()
    refs, leaked = _ffi.lib.lshm_storage_refcount(handle), 0
    wrappers = after_c_calls(monkeypatch, _ffi.lib, "lshm_storage_retain",
                             "lshm_storage_release", "lshm_storage_flags",
                             "lshm_storage_data", "lshm_storage_nbytes")
    point = 1
    while interrupted_at(point, lambda: ForkingPickler.loads(data), wrappers):
        gc.collect()
        pyshm.Storage(4096).close()  # (a release: one cut off in a callback is made there)
        now = _ffi.lib.lshm_storage_refcount(handle)
        assert now >= refs, point  # (never released twice)
        leaked, refs = leaked + now - refs, now
        point += 1
    assert point > 50 and leaked <= 6
    back = ForkingPickler.loads(data)
    assert int(back[0]) == 7 and not back.flags.writeable
    del back
    gc.collect()
    assert _ffi.lib.lshm_storage_refcount(handle) == refs
