"""pyshm.Arena: planned arenas (allocate/deallocate cycles, arrays, BufferError while arrays
live), shared arenas seen from another process, record-then-replay, stats, bad input."""

import gc
import itertools
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyshm
from pyshm.arena import ArenaStats

from conftest import after_c_calls, held_after_a_release, interrupted_at, memfd_held, open_fds

# A chain with a skip connection: tensor i lives on [firsts[i], lasts[i]).
SIZES = [4096, 10000, 3000, 10000, 64, 0]
FIRSTS = [0, 1, 2, 3, 4, 2]
LASTS = [2, 4, 4, 5, 6, 3]


def live_at(t):
    return [i for i in range(len(SIZES)) if FIRSTS[i] <= t < LASTS[i]]


@pytest.mark.parametrize("shared", [False, True])
def test_planned_arena_arrays_and_lifetime(shared, no_fd_leak):
    arena = pyshm.Arena(SIZES, FIRSTS, LASTS, shared=shared)
    plan = arena.plan
    assert isinstance(plan, pyshm.Plan)
    assert plan.arena_size == arena.size >= plan.lower_bound
    pyshm.planner.validate(SIZES, FIRSTS, LASTS, plan.offsets, plan.arena_size, alignment=64)
    assert len(arena) == len(SIZES)
    assert arena.fd is None and arena.data_ptr == 0  # no buffer before allocate
    arena.allocate()
    assert (arena.fd is not None) == shared
    base = arena.data_ptr
    arrays = [arena.array(i) for i in range(len(SIZES))]
    for i, a in enumerate(arrays):
        assert a.nbytes == SIZES[i] and a.dtype == np.uint8
        if SIZES[i]:
            assert a.ctypes.data == base + arena.offset(i)
            assert not a.any()  # a new buffer is zero
        assert pyshm.is_shared(a) == shared
    # Write each tensor when it starts; every live tensor keeps its own bytes.
    for t in range(6):
        for i in range(len(SIZES)):
            if FIRSTS[i] == t:
                arrays[i][:] = i + 1
        for i in live_at(t):
            assert (arrays[i] == i + 1).all()
    with pytest.raises(BufferError):
        arena.deallocate()
    with pytest.raises(BufferError):
        arena.close()
    view = arrays[1][::2]
    del arrays, a
    with pytest.raises(BufferError):  # a view keeps the storage referenced
        arena.deallocate()
    del view
    arena.deallocate()
    with pytest.raises(OSError):  # not allocated
        arena.array(0)
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(ValueError):
        arena.allocate()


def test_typed_arrays_and_bounds():
    with pyshm.Arena([800, 80], [0, 0], [1, 1]) as arena:
        arena.allocate()
        x = arena.array(0, (10, 10), np.float64)
        y = arena.array(1, None, np.int32)
        assert x.shape == (10, 10) and y.shape == (20,)
        x[:] = 1.5
        y[:] = 7
        assert x.sum() == 150 and y.sum() == 140
        with pytest.raises(ValueError):
            arena.array(0, (101,), np.float64)  # larger than the tensor
        with pytest.raises(ValueError):
            arena.array(2)  # no such tensor
        with pytest.raises(ValueError):
            arena.array(1, None, np.dtype("V3"))  # 80 bytes are not whole 3-byte items
        s = arena.storage(0)
        assert s.nbytes == 800 and s.data_ptr == x.ctypes.data
        s.close()
        del x, y
        arena.deallocate()


def test_allocate_deallocate_1000_cycles_fd_and_buffer_stable():
    for shared in (False, True):
        arena = pyshm.Arena(SIZES, FIRSTS, LASTS, shared=shared)
        arena.allocate()
        base = arena.data_ptr
        arena.deallocate()
        gc.collect()
        fds = open_fds()
        for cycle in range(1000):
            arena.allocate()
            assert arena.data_ptr == base  # the kept buffer
            a = arena.array(3, (2500,), np.float32)
            a[:] = cycle
            del a
            arena.deallocate()
        gc.collect()
        assert open_fds() == fds
        stats = arena.stats
        assert isinstance(stats, ArenaStats)
        assert stats.reuse_count == 1000 * len(SIZES)
        assert stats.iterations == 1001
        assert stats.storages == len(SIZES)
        assert stats.managed_bytes == sum(SIZES)
        assert stats.arena_bytes == arena.size
        assert stats.lower_bound <= stats.arena_bytes < stats.managed_bytes
        arena.trim()
        assert arena.data_ptr == 0
        arena.close()


def test_shared_arena_seen_from_another_process(tmp_path):
    arena = pyshm.Arena(SIZES, FIRSTS, LASTS, shared=True).allocate()
    x = arena.array(1, (2500,), np.float32)
    x[:] = np.arange(2500, dtype=np.float32)
    fd = arena.fd
    child = textwrap.dedent(
        f"""
        import numpy as np, pyshm
        s = pyshm.Storage.attach({fd}, {10000}, offset={arena.offset(1)})
        x = s.asarray((2500,), np.float32)
        assert (x == np.arange(2500, dtype=np.float32)).all(), x[:5]
        t = pyshm.Storage.attach({fd}, 64, offset={arena.offset(4)})
        t.asarray()[:] = 0x5A
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", child], pass_fds=[fd], cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert (arena.array(4) == 0x5A).all()  # the child's write, same memory
    del x
    gc.collect()
    arena.close()


def run_program(arena, sizes):
    """t0 = alloc; t1 = alloc; free t0; t2 = alloc; free t1; t3 = alloc; free t2; free t3."""
    t0 = arena.empty(sizes[0] // 8, np.float64)
    t1 = arena.empty(sizes[1] // 8, np.float64)
    t0[:] = 1
    t1[:] = 2
    arena.free(t0)
    t2 = arena.empty(sizes[2] // 8, np.float64)
    t2[:] = 3
    assert (t1 == 2).all()
    arena.free(t1)
    t3 = arena.empty(sizes[3] // 8, np.float64)
    t3[:] = 4
    assert (t2 == 3).all()
    arena.free(t2)
    assert (t3 == 4).all()
    arena.free(t3)
    arena.end_iteration()


@pytest.mark.parametrize("shared", [False, True])
def test_record_then_replay(shared, no_fd_leak):
    arena = pyshm.Arena.recording(shared=shared)
    assert arena.plan is None and arena.size == 0
    sizes = [8000, 16000, 24000, 4000]
    run_program(arena, sizes)  # recording: ordinary allocations
    stats = arena.stats
    assert (stats.fallback_count, stats.reuse_count, stats.iterations) == (4, 0, 1)
    plan = arena.plan
    assert plan is not None and len(plan.offsets) == 4
    assert plan.lower_bound >= 16000 + 24000 and plan.arena_size >= plan.lower_bound
    base = arena.data_ptr
    for _ in range(5):
        run_program(arena, sizes)  # replayed from the buffer
    assert arena.data_ptr == base
    stats = arena.stats
    assert (stats.fallback_count, stats.reuse_count, stats.replans) == (4, 20, 0)
    grown = [8000, 16000, 72000, 4000]
    run_program(arena, grown)  # request 2 does not fit: served ordinarily, then re-planned
    stats = arena.stats
    assert (stats.fallback_count, stats.replans, stats.iterations) == (5, 1, 7)
    assert arena.plan.lower_bound >= 16000 + 72000
    run_program(arena, grown)
    run_program(arena, sizes)  # sizes never shrink: still fits
    assert arena.stats.replans == 1 and arena.stats.fallback_count == 5
    gc.collect()
    arena.close()


def test_recording_free_rules():
    arena = pyshm.Arena.recording()
    a = arena.empty(100)
    with pytest.raises(ValueError):
        arena.free(np.zeros(3))  # not from this arena
    with pytest.raises(ValueError):
        arena.free(pyshm.empty(3))
    with pytest.raises(BufferError):
        arena.end_iteration()  # a is not freed
    arena.free(a)
    with pytest.raises(ValueError):
        arena.free(a)  # twice
    assert (a == 0).all()  # an ordinary storage: the array keeps its memory
    arena.end_iteration()
    b = arena.empty(100)  # now from the buffer
    handle = pyshm.storage_of(b)
    with pytest.raises(BufferError):
        arena.free(b)  # another Storage handle on a buffer slice
    handle.close()
    arena.free(b)
    arena.end_iteration()
    with pytest.raises(BufferError):
        arena.close()  # a and b are still alive
    del a, b
    gc.collect()
    arena.close()
    with pytest.raises(ValueError):
        arena.empty(3)


@pytest.mark.parametrize("shared", [False, True])
def test_recording_dropped_array_freed_at_end_iteration(shared, no_fd_leak):
    # An array dropped without free() used to make every later end_iteration raise
    # BufferError until close(): nothing could free it any more.
    arena = pyshm.Arena.recording(shared=shared)
    for iteration in range(4):
        kept = arena.empty(1000, np.uint8)
        dropped = arena.empty(2000, np.uint8)  # never freed: live until the iteration's end
        dropped[:] = 7
        kept[:] = 1
        other = arena.empty(3000, np.uint8)  # so it must not overlap `dropped`
        other[:] = 9
        assert (dropped == 7).all() and (kept == 1).all()
        arena.free(kept)
        arena.free(other)
        del dropped
        arena.end_iteration()
    stats = arena.stats
    # recorded once, then every iteration served from the one plan: no re-plan
    assert (stats.iterations, stats.fallback_count, stats.replans) == (4, 3, 0)
    assert stats.reuse_count == 9
    plan = arena.plan
    assert plan.arena_size >= 2000 + 3000
    live = arena.empty(10, np.uint8)  # alive and not freed: still refused, then recovers
    with pytest.raises(BufferError):
        arena.end_iteration()
    arena.free(live)
    arena.end_iteration()
    del kept, other, live
    gc.collect()
    arena.close()


@pytest.mark.parametrize("shared", [False, True])
def test_a_ctrl_c_right_after_an_allocation_leaves_the_arena_usable(monkeypatch, shared,
                                                                     no_fd_leak):
    # A signal during lshm_arena_alloc: its handler's KeyboardInterrupt comes when the C call
    # returns, before the arena recorded the storage it allocated; every later end_iteration
    # then refused (BufferError "1 storages of this iteration are not freed"), for good
    from pyshm import arena as arena_module

    arena = pyshm.Arena.recording(shared=shared)
    for iteration in range(3):
        a = arena.empty(1000, np.uint8)
        arena.free(a)
        arena.end_iteration()
    alloc = arena_module.lib.lshm_arena_alloc

    def alloc_then_signal(*args):
        alloc(*args)
        signal.raise_signal(signal.SIGUSR1)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        monkeypatch.setattr(arena_module.lib, "lshm_arena_alloc", alloc_then_signal)
        with pytest.raises(KeyboardInterrupt):
            arena.empty(1000, np.uint8)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        monkeypatch.undo()
    arena.end_iteration()  # the interrupted allocation is freed here
    for iteration in range(2):
        a = arena.empty(1000, np.uint8)
        a[:] = 5
        arena.free(a)
        del a
        arena.end_iteration()
    assert arena.stats.replans == 0  # served from the plan all along
    arena.close()


def test_wrong_kind_and_bad_input():
    with pytest.raises(ValueError):
        pyshm.Arena([1, 2], [0, 0], [1])  # mismatched lengths
    with pytest.raises(ValueError):
        pyshm.Arena([1], [3], [1])  # first > last
    with pytest.raises(ValueError):
        pyshm.Arena([1], [0], [1], alignment=48)
    with pytest.raises(ValueError):
        pyshm.Arena([-1], [0], [1])
    with pytest.raises(OverflowError):
        pyshm.Arena([1 << 64], [0], [1])
    with pytest.raises(ValueError):
        pyshm.Arena.recording(time_limit=-1)
    planned = pyshm.Arena([10], [0], [1])
    with pytest.raises(ValueError):
        planned.empty(3)  # a planned arena has no alloc
    recording = pyshm.Arena.recording()
    with pytest.raises(ValueError):
        recording.allocate()
    empty = pyshm.Arena([], [], [])
    empty.allocate()
    assert len(empty) == 0 and empty.size == 0
    for arena in (planned, recording, empty):
        arena.close()


def test_garbage_collection_frees_everything(no_fd_leak):
    arena = pyshm.Arena(SIZES, FIRSTS, LASTS, shared=True).allocate()
    x = arena.array(0)
    del arena  # the array keeps the arena alive
    x[:] = 1
    del x
    recording = pyshm.Arena.recording(shared=True)
    y = recording.empty(10)
    del recording, y
    gc.collect()



def test_storage_and_arrays_keep_the_arena_alive(no_fd_leak):
    import weakref

    arena = pyshm.Arena([4096], [0], [1])
    arena.allocate()
    a = arena.array(0)
    a[:] = 7
    storage = pyshm.storage_of(a)
    ref = weakref.ref(arena)
    del arena, a
    gc.collect()
    assert ref() is not None  # the Storage keeps the arena (and its buffer) alive
    b = storage.asarray()
    del storage
    gc.collect()
    assert ref() is not None and (b == 7).all()  # and so does an array made from it
    del b
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("shared", [False, True])
def test_a_storage_of_a_tensor_keeps_the_arena_and_frees_it_after(shared, no_fd_leak):
    # Arena.storage(i) held past the arena: the arena stays alive, and goes with the storage
    # (before: its destroy failed with EBUSY and the whole buffer, fd and mapping leaked)
    import weakref

    def memfd_mappings():
        with open("/proc/self/maps") as f:
            return sum("memfd:" in line for line in f)

    before = memfd_mappings()
    for _ in range(5):
        arena = pyshm.Arena([8 << 20], [0], [1], shared=shared).allocate()
        arena.array(0)[:] = 3
        storage = arena.storage(0)
        ref = weakref.ref(arena)
        del arena
        gc.collect()
        assert ref() is not None and (storage.asarray() == 3).all()
        del storage
        gc.collect()
        assert ref() is None
    assert memfd_mappings() <= before + 1  # (a slab of small arrays may come meanwhile)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("call", ["storage", "array", "array and storage"])
def test_a_ctrl_c_anywhere_in_storage_or_array_leaves_the_arena_closable(monkeypatch, call):
    # A KeyboardInterrupt at each point of Arena.storage(i) / Arena.array(i) where a signal
    # handler can raise one: right after lshm_storage_retain returned (or the buffer's
    # retain), before the Storage / _ArenaKeep recorded the reference, it was lost, and
    # deallocate() and close() refused with EBUSY for good ("still has 1 references")
    from pyshm import _ffi

    arena = pyshm.Arena([4096, 8192], [0, 0], [1, 1], shared=True).allocate()
    inode = os.fstat(arena.fd).st_ino
    wrappers = after_c_calls(monkeypatch, _ffi.lib, "lshm_storage_retain",
                             "lshm_arena_buffer_retain", "lshm_arena_storage")
    actions = {
        "storage": lambda: arena.storage(1),
        "array": lambda: arena.array(1, dtype=np.int32),
        "array and storage": lambda: (arena.array(0), arena.storage(0)),
    }
    point = 1
    while interrupted_at(point, actions[call], wrappers):
        arena.deallocate()  # nothing of the interrupted call holds a storage any more
        arena.allocate()
        point += 1
    assert point > 10  # (the points were there)
    monkeypatch.undo()
    arena.close()
    assert memfd_held(inode) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_anywhere_in_an_arenas_death_is_made_up_for_at_the_next_release():
    # A KeyboardInterrupt at each point of the death of a shared arena: at the entry of its
    # finalizer (_destroy, a Python function called by the release callback once that had
    # taken its record out) the arena was never destroyed, and its memfd's fd and mapping
    # stayed until the process exited. Now they go by the next release at the latest.
    point = 1
    while True:
        held = [pyshm.Arena([4096, 8192], [0, 0], [1, 1], shared=True).allocate()]
        inode = os.fstat(held[0].fd).st_ino
        assert memfd_held(inode)
        if not interrupted_at(point, held.clear):
            break
        assert held == []
        assert held_after_a_release(inode) == [], point
        point += 1
    assert point > 3
    assert memfd_held(inode) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("call", ["free", "close"])
def test_a_ctrl_c_anywhere_in_free_or_close_leaves_the_arena_whole(monkeypatch, call):
    # A KeyboardInterrupt at each point of free() / close() of a recording arena: right after
    # lshm_arena_free returned, the storage stayed in _live, and every later end_iteration()
    # and close() freed it again and refused for good (EINVAL, "freed already"); right after
    # lshm_arena_destroy returned, the arena looked open, and the next close() (or its
    # finalizer) destroyed it again (glibc: "double free detected", the process aborted).
    from pyshm import _ffi

    wrappers = after_c_calls(monkeypatch, _ffi.lib, "lshm_arena_free", "lshm_arena_destroy")
    for point in itertools.count(1):
        arena = pyshm.Arena.recording(shared=True)
        x = arena.empty(1000)
        arena.free(x)
        arena.end_iteration()  # (planned: the next ones are slices of its memfd)
        inode = os.fstat(arena.fd).st_ino
        x, y = arena.empty(1000), arena.empty(10)
        if call == "free":
            interrupted = interrupted_at(point, lambda: arena.free(x), wrappers)
            del x, y
            arena.end_iteration()  # (frees the dropped ones)
        else:
            del x, y
            interrupted = interrupted_at(point, arena.close, wrappers)
            assert arena.closed or memfd_held(inode), point  # (never destroyed while open)
        arena.close()
        assert held_after_a_release(inode) == [], point
        if not interrupted:
            break
    assert point > 10


def test_an_arena_subclass_with_its_own_eq_and_hash():
    # Each call entered its arena in a set (for a fork): an Arena subclass that defined
    # __eq__ (so __hash__ = None) raised TypeError ("unhashable") from every method, and one
    # with its own __hash__/__eq__ ran them in every call (and in the fork hook). The set
    # holds the arena's lock now, whose hash is C's.
    calls = []

    class ByValue(pyshm.Arena):
        def __eq__(self, other):
            calls.append("eq")
            return NotImplemented

    class Hashed(ByValue):
        def __hash__(self):
            calls.append("hash")
            return 1

    for cls in (ByValue, Hashed):
        arena = cls([64, 64], [0, 0], [1, 1]).allocate()
        x = arena.array(1)
        x[:] = 7
        assert len(arena) == 2 and arena.array(1).sum() == 7 * 64
        del x
        arena.close()
        recording = cls.recording()
        y = recording.empty(8, np.uint8)
        recording.free(y)
        recording.end_iteration()
        assert recording.stats.iterations == 1
    assert calls == []


def test_only_an_arena_in_a_call_is_in_the_fork_list():
    # Every fork took the lock of every arena alive (a closed one too, until collected): with
    # 10,000 arenas a fork took 20-30 ms, not 1-2. Now it waits for the arenas in a call only:
    # those in _IN_CALL, during the call (an exception's too), and never a closed one.
    from pyshm import arena as arena_module

    arena = pyshm.Arena([64], [0], [1]).allocate()
    seen = []

    class Index:
        def __init__(self, value):
            self.value = value

        def __index__(self):
            seen.append([lock.arena() for lock in arena_module._IN_CALL])
            return self.value

    assert arena.offset(Index(0)) == 0
    with pytest.raises(ValueError, match="tensor 5"):
        arena.offset(Index(5))
    assert seen == [[arena]] * 2 and not arena_module._IN_CALL
    arena.close()
    assert not arena_module._IN_CALL
    assert arena.closed and repr(arena) == "<pyshm.Arena closed>"
    arena.close()  # (idempotent)
    with pytest.raises(ValueError, match="closed"):
        arena.empty(3)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if arena.closed else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_plan_refuses_a_non_bool_inclusive():
    with pytest.raises(TypeError, match="inclusive"):
        pyshm.plan(sizes=[1], firsts=[0], lasts=[1], inclusive="no")
    assert pyshm.plan(sizes=[1], firsts=[0], lasts=[1], inclusive=1).inclusive is True


# ---- issue 9, point 2: a freed array never points at unmapped memory ------------------------

_FREED_ARRAY_SCRIPT = r"""
import gc, os, sys
import numpy as np
import pyshm

shared, mode = sys.argv[1] == "shared", sys.argv[2]

def mapped(address, n):
    # mappings of /proc/self/maps overlapping [address, address + n)
    count = 0
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        count += lo < address + n and hi > address
    return count

def memfd_maps(inode):
    return sum(1 for line in open("/proc/self/maps") if line.split()[4] == str(inode))

ar = pyshm.Arena.recording(shared=shared)
t = ar.empty(4096, np.uint8); ar.free(t); ar.end_iteration()
t = ar.empty(4096, np.uint8)
t[:] = 7
address = t.ctypes.data
assert address == ar.data_ptr  # on the buffer
inode = os.fstat(ar.fd).st_ino if shared else None
ar.free(t)
u = ar.empty(1 << 24, np.uint8); ar.free(u); ar.end_iteration()  # a re-plan
assert ar.data_ptr != address  # a new buffer
if mode == "trim":
    ar.trim()
    assert ar.data_ptr == 0
assert mapped(address, 4096) >= 1
assert int(t[0]) == 7 and int(t[-1]) == 7 and (t == 7).all()  # old bytes, still mapped
t[0] = 1  # and writable
view = t[10:]
del t, u
gc.collect()
assert int(view[-1]) == 7  # a view keeps the old buffer too
del view
gc.collect()
assert mapped(address, 4096) == 0, "the old buffer leaked"
if shared:
    assert memfd_maps(inode) == 0
print("ok")
"""


@pytest.mark.parametrize("shared", ["private", "shared"])
@pytest.mark.parametrize("mode", ["replan", "trim"])
def test_freed_recording_array_survives_replan_and_trim(shared, mode):
    # In a subprocess: on the old code this is a SIGSEGV, which must fail the test, not pytest.
    result = subprocess.run(
        [sys.executable, "-c", _FREED_ARRAY_SCRIPT, shared, mode],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip() == "ok"


def test_planned_arena_arrays_keep_their_buffer_reference():
    arena = pyshm.Arena([4096, 4096], [0, 1], [1, 2]).allocate()
    a = arena.array(0)
    b = arena.array(1)
    owner_a = pyshm._memory.owner_of(a)
    owner_b = pyshm._memory.owner_of(b)
    assert owner_a.keep is owner_b.keep  # one buffer reference for all arrays on it
    assert owner_a.keep.arena is arena and owner_a.keep.buffer is not None
    del a, b, owner_a, owner_b
    gc.collect()
    arena.deallocate()
    arena.close()


# ---- issue 9, point 3: arena arrays are shared in place or refused, never un-aliased --------


def add_one_and_return(array):  # a Pool worker (fork: no import needed)
    array += 1
    return array


def _assert_aliased(a, storage):
    # writes through either one are seen by the other
    a[:4] = [1, 2, 3, 4]
    assert bytes(storage.asarray()[:4]) == b"\x01\x02\x03\x04"
    storage.asarray()[:4] = 9
    assert (a[:4] == 9).all()


@pytest.mark.parametrize("recording", [False, True], ids=["planned", "recording"])
def test_private_arena_array_share_is_refused_and_changes_nothing(recording):
    from multiprocessing.reduction import ForkingPickler
    import pickle

    if recording:
        arena = pyshm.Arena.recording()
        t, u = arena.empty(4096, np.uint8), arena.empty(4096, np.uint8)
        arena.free(t)
        arena.free(u)
        arena.end_iteration()
        a, b = arena.empty(4096, np.uint8), arena.empty(4096, np.uint8)
        for x in (a, b):  # both on the buffer
            assert pyshm.storage_of(x).flags & pyshm._ffi.STORAGE_INPLACE
    else:
        arena = pyshm.Arena([4096, 4096], [0, 0], [1, 1]).allocate()
        a, b = arena.array(0), arena.array(1)
    storage = pyshm.storage_of(a)
    address = storage.data_ptr
    assert a.ctypes.data == address
    for attempt in (
        lambda: pyshm.share_memory_(a),
        lambda: pyshm.share_memory_(a[10:]),
        storage.share_memory_,
        lambda: pyshm.share_readonly(a),
    ):
        with pytest.raises(BufferError, match="shared=True") as info:
            attempt()
        assert "pyshm.copy(array, shared=True)" in str(info.value)
        assert not pyshm.is_shared(a) and not storage.is_shared
        assert storage.data_ptr == address == a.ctypes.data
        _assert_aliased(a, storage)
    # Pickling for another process refuses in the sender (not an UnpicklingError later).
    for obj in (b, a[::2], storage):
        with pytest.raises((pickle.PicklingError, BufferError), match="shared=True"):
            ForkingPickler.dumps(obj)
    assert not pyshm.is_shared(b) and not pyshm.is_shared(a)
    assert pyshm.storage_of(b).data_ptr == b.ctypes.data
    _assert_aliased(b, pyshm.storage_of(b))
    # The way out the message gives works.
    copy = pyshm.copy(a, shared=True)
    assert pyshm.is_shared(copy) and (copy == a).all()
    if recording:
        storage.close()
        arena.free(a)
        arena.free(b)
        arena.end_iteration()


def test_shared_arena_arrays_pickle_and_arrive_aliased():
    import multiprocessing as mp

    # tensors 0 and 1 have one size: each must come back as itself, not as the other
    arena = pyshm.Arena([4096, 4096, 64], [0, 0, 0], [1, 1, 1], shared=True).allocate()
    arrays = [arena.array(i) for i in range(3)]
    for i, a in enumerate(arrays):
        a[:] = i + 1
    with mp.get_context("fork").Pool(1) as pool:
        back = pool.map(add_one_and_return, [arrays[1], arrays[0][100:200], arrays[2]])
    assert (arrays[0][100:200] == 2).all() and (arrays[0][:100] == 1).all()
    assert (arrays[1] == 3).all() and (arrays[2] == 4).all()  # the worker's writes, same memory
    # what comes back is the arena's memory (the same pages, written both ways)
    for got, original in zip(back, [arrays[1], arrays[0][100:200], arrays[2]]):
        assert (got == original).all()
        got[:] = 42
        assert (original == 42).all()
    assert (arrays[0][:100] == 1).all() and (arrays[0][200:] == 1).all()
    del back, arrays, a
    gc.collect()


def test_arena_cannot_be_copied_or_pickled():
    # copy.copy(arena) made a second Arena on the same C arena: closing the copy destroyed it
    # under the original (use after free, then a second destroy at the original's close)
    import copy
    import pickle

    arena = pyshm.Arena([4096, 4096], [0, 1], [1, 2]).allocate()
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied"):
            attempt(arena)
    keep = arena.array(0)
    for attempt in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be copied"):
            attempt(keep.base.keep)  # an arena array's keep (_ArenaKeep)
    del keep
    arena.close()


INTERRUPTED_ARENA = textwrap.dedent(
    """
    import os, signal, sys, threading, time, numpy as np, pyshm
    rng = np.random.default_rng(5)
    n = 40_000  # (lifetimes that overlap about half the others: tens of seconds to plan)
    firsts = rng.integers(0, n, n)
    lasts = firsts + 1 + rng.integers(0, n, n)
    sizes = rng.integers(1, 100_000, n)
    if sys.argv[1] == "recording":
        arena = pyshm.Arena.recording()
        live = []
        for i in range(n):  # (each allocation, then every other time a random live one freed)
            live.append(arena.empty(int(sizes[i]), np.uint8))
            if i & 1:
                k = int(rng.integers(0, len(live)))
                arena.free(live[k])
                live[k] = live[-1]
                live.pop()
        for a in live:
            arena.free(a)
        del live
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    try:
        if sys.argv[1] == "recording":
            arena.end_iteration()
        else:
            pyshm.Arena(sizes, firsts, lasts)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic() - started,
              [t.name for t in threading.enumerate() if t.name == "pyshm-plan"])
    """
)


@pytest.mark.parametrize("how", ["planned", "recording"])
def test_ctrl_c_interrupts_an_arena_s_big_plan(how):
    # an arena planning tens of thousands of tensors (at creation, or at the end of a recording
    # arena's first iteration) ran in C on the calling thread, deaf to Ctrl-C until it returned
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_ARENA, how], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    word, seconds, threads = done.stdout.split(maxsplit=2)
    assert word == "interrupted"
    assert float(seconds) < 5.0
    assert threads.strip() == "[]"


THREADS_ON_ONE_ARENA = """
import threading, numpy as np, pyshm
errors = []
def work(a, rounds):
    try:
        for it in range(rounds):
            xs = [a.empty((64 + it % 5,), np.float64) for _ in range(8)]
            for x in xs:
                x[:] = 1
                a.free(x)
            a.stats, a.size, len(a), repr(a)
    except Exception as exc:
        errors.append(repr(exc))
for shared in (False, True):
    a = pyshm.Arena.recording(shared=shared)
    for iteration in range(3):
        threads = [threading.Thread(target=work, args=(a, 150)) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        a.end_iteration()
    a.close()
print(len(errors), errors[:3])
"""


def test_threads_calling_one_arena_at_once():
    # the C arena is not thread-safe, and each pyshm.Arena method calls it without the GIL:
    # threads sharing a recording arena corrupted its records (free of a live storage refused
    # as "not allocated in this iteration", outstanding storages nobody holds) or crashed the
    # interpreter (SIGILL/SIGSEGV). Each method now holds the arena's lock
    done = subprocess.run([sys.executable, "-c", THREADS_ON_ONE_ARENA], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0 []", done.stdout


@pytest.mark.parametrize("sizes", [[64, 64], [2048, 2048], [4096]])
def test_share_readonly_of_a_shared_arena_tensor_is_refused(sizes):
    # the first tensor of a small shared arena (its size rounded up to a page covers the whole
    # memfd) passed share_readonly's "alone in its memfd" check: the arena's whole memfd was
    # sealed F_SEAL_FUTURE_WRITE, for good, so the other tensors (and those of every later
    # allocate) could not be attached writable by another process any more
    import fcntl

    from pyshm import reduction

    n = len(sizes)
    arena = pyshm.Arena(sizes, [0] * n, [1] * n, shared=True).allocate()
    first = arena.array(0)
    with pytest.raises(ValueError, match="arena"):
        pyshm.share_readonly(first)
    assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) & reduction.F_SEAL_FUTURE_WRITE == 0
    attached = pyshm.Storage.attach(arena.fd, arena.size)
    assert not attached.readonly
    attached.close()
    del first
    arena.deallocate()
    arena.close()
    # a recording arena's tensor, alone in the buffer that serves the next iterations
    recording = pyshm.Arena.recording(shared=True)
    x = recording.empty((8,))
    recording.free(x)
    recording.end_iteration()
    x = recording.empty((8,))
    with pytest.raises(ValueError, match="arena"):
        pyshm.share_readonly(x)
    assert fcntl.fcntl(recording.fd, fcntl.F_GET_SEALS) & reduction.F_SEAL_FUTURE_WRITE == 0
    recording.free(x)
    del x
    recording.close()


INTERRUPTED_BUDGET = """
import os, signal, threading, time, numpy as np, pyshm
rng = np.random.default_rng(3)
n = 300  # (allocations and frees in a random order: a plan above the lower bound, which the
sizes = rng.integers(1, 50, n) * 1000 + rng.integers(0, 999, n)  # search spends its budget on)
events, live, k = [], [], 0
while k < n or live:
    if k < n and (not live or rng.random() < 0.55):
        events.append((True, k)); live.append(k); k += 1
    else:
        events.append((False, live.pop(int(rng.integers(0, len(live))))))
arena = pyshm.Arena.recording(time_limit=60)
arrays = {}
for alloc, i in events:
    if alloc:
        arrays[i] = arena.empty((int(sizes[i]),), np.uint8)
    else:
        arena.free(arrays.pop(i))
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
started = time.monotonic()
try:
    arena.end_iteration()
    print("planned", time.monotonic() - started)
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - started)
"""


def test_ctrl_c_interrupts_a_recording_arena_s_plan_with_a_budget():
    # pyshm.plan and pyshm.Arena wait apart (interruptibly) for a plan with a time_limit of
    # 0.5 s or more, but a recording arena's end_iteration did so only from 2,000 allocations:
    # Arena.recording(time_limit=60) planning 300 allocations was deaf to Ctrl-C for 60 s
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_BUDGET], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    word, seconds = done.stdout.split()
    assert word == "interrupted" and float(seconds) < 5.0, done.stdout


# (in a script, after `a = pyshm.Arena.recording(time_limit=...)`: an iteration of 400
# allocations whose plan stays above the lower bound, so that planning takes the time limit)
ITERATION_TO_PLAN = """
rng = np.random.default_rng(0)
live = []
for size in rng.integers(1, 100000, 400):
    live.append(a.empty(int(size), np.uint8))
    if len(live) > 7:
        a.free(live.pop(int(rng.integers(0, len(live)))))
for x in live:
    a.free(x)
del live, x
"""

FORK_WHILE_LOCKED = """
import ctypes, os, threading, time, numpy as np, pyshm
from pyshm._ffi import ArenaCounters, lib
a = pyshm.Arena.recording(time_limit=0.3)  # (a plan above the lower bound: it takes 0.3 s)
""" + ITERATION_TO_PLAN + """
t = threading.Thread(target=a.end_iteration); t.start()
counters = ArenaCounters()  # (read without the lock: the C call counts the iteration first)
while lib.lshm_arena_stats(a._handle, ctypes.byref(counters)) == 0 and not counters.iterations:
    time.sleep(0.001)
pid = os.fork()  # while the other thread is inside end_iteration, planning
if pid == 0:
    print(a.stats.iterations, a.plan is not None, flush=True)
    y = a.empty((4,)); a.free(y); a.end_iteration(); os._exit(7)
t.join()
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(os.waitstatus_to_exitcode(status)); break
    time.sleep(0.02)
else:
    os.kill(pid, 9); os.waitpid(pid, 0); print("hung")
"""


def test_fork_while_another_thread_is_in_the_arena():
    # A fork while another thread was inside an arena call gave the child the arena as that
    # call had left it halfway (here: the iteration counted, its plan not installed), under a
    # fresh lock. Now the fork waits for the call: the child sees it done, and its own
    # iteration works (a lock held by a thread that does not exist there is made anew).
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_LOCKED], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "True", "7"], done.stdout


def assert_prints(script: str, lines: list, timeout: float) -> None:
    """Run `script` in a new interpreter: exit code 0 and exactly `lines` printed."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n") == [*lines, ""], done.stdout + done.stderr[-2000:]


# (in a script: helpers of the tests that fork while a thread is inside an arena call)
FORK_HELPERS = """
import errno, os, sys, threading, time, numpy as np, pyshm
from pyshm import _planning, arena as arena_module
def taken(arena):  # (its lock held by another thread)
    if arena._lock.acquire(blocking=False):
        arena._lock.release(); return False
    return True
def in_function(thread, name):  # (the Python function the thread is in now)
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_name == name
def hold(arena):  # a thread inside one of the arena's methods, until release()
    held, planned = threading.Event(), threading.Lock()
    planned.acquire()
    def inside(arena):  # (as a plan in C: a fork waits for it however long it takes)
        me = threading.get_ident()
        _planning._PLANNING[held] = (me, inside.__code__, me)
        arena._planning = me; held.set()
        planned.acquire()  # (in C: this frame stays the thread's top one)
        arena._planning = False; del _planning._PLANNING[held]
    threading.Thread(target=arena_module._locked(inside), args=(arena,)).start(); held.wait()
    return planned.release
def fork_in_a_thread(pids):  # a thread that forks (a child that exits), now in the fork hook
    def fork():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
    thread = threading.Thread(target=fork); thread.start()
    while not in_function(thread, "_lock_arenas_before_fork"):
        time.sleep(0.001)
    return thread
def exit_by_use(arena):  # (a child: exits 1 if the arena works, 2 at EBUSY, 3 else)
    try:
        arena.stats
    except OSError as exc:
        os._exit(2 if exc.errno == errno.EBUSY else 3)
    os._exit(1)
"""

TWO_FORKS_AT_ONCE = FORK_HELPERS + """
free, busy = pyshm.Arena.recording(), pyshm.Arena.recording()
release = hold(busy)
children = []
def use(arena):  # a call begun while the forks wait: it waits for them
    y = arena.empty(4); arena.free(y)
one = fork_in_a_thread(children)  # (waits for `busy`)
two = fork_in_a_thread(children)  # (waits for its turn)
user = threading.Thread(target=use, args=(free,)); user.start()
while not in_function(user, "_wait_for_fork"):
    time.sleep(0.001)
release(); one.join(); two.join(10); user.join(10)
print("forked", len(children), "held", sum(map(taken, [free, busy])), "in calls",
      len(arena_module._IN_CALL), arena_module._FORKER, flush=True)
for pid in children:
    os.waitpid(pid, 0)
os._exit(0)
"""


def test_two_threads_forking_at_once_with_an_arena_busy():
    # Two forks at once, while a third thread was inside an arena call, took the arena locks
    # in two orders (an arena made in between changed the order) into one shared list: the
    # first fork's parent handler released the second's lock (RuntimeError), left one of its
    # own held for good, and the second fork waited for it forever.
    done = subprocess.run([sys.executable, "-c", TWO_FORKS_AT_ONCE], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["forked", "2", "held", "0", "in", "calls", "0", "None"], (
        done.stdout + done.stderr)
    assert "Exception" not in done.stderr, done.stderr


ARENA_MADE_WHILE_A_FORK_WAITS = FORK_HELPERS + """
import ctypes
from pyshm._ffi import ArenaCounters, lib
busy = pyshm.Arena.recording()
release = hold(busy)
pids = []
def fork():
    pid = os.fork()
    if pid == 0:
        print([(x.stats.iterations, x.plan is not None) for x in made], flush=True)
        for x in made:  # (its lock was held by the maker, not here: made anew)
            y = x.empty(4); x.free(y); x.end_iteration()
        os._exit(0)
    pids.append(pid)
forker = threading.Thread(target=fork); forker.start()
while not in_function(forker, "_lock_arenas_before_fork"):
    time.sleep(0.001)
made = []
def make_and_plan():  # an arena made, and used, after the fork took its list of arenas
    a = pyshm.Arena.recording(time_limit=0.3); made.append(a)
""" + textwrap.indent(ITERATION_TO_PLAN, "    ") + """
    a.end_iteration()
maker = threading.Thread(target=make_and_plan); maker.start()
counters = ArenaCounters()
deadline = time.monotonic() + 2  # (until it plans, or its first call waits for the fork)
while time.monotonic() < deadline and not in_function(maker, "_wait_for_fork"):
    if made and lib.lshm_arena_stats(made[0]._handle, ctypes.byref(counters)) == 0 and \\
            counters.iterations:
        break
    time.sleep(0.001)
release(); forker.join(); maker.join()
print(os.waitstatus_to_exitcode(os.waitpid(pids[0], 0)[1]))
"""


def test_arena_made_while_a_fork_waits_for_the_arena_locks():
    # An arena made while a fork waited for another arena's call was not in the fork's list
    # of arenas: a call on it ran on while the fork went ahead, and the child saw it halfway
    # (here: the iteration counted, its plan not installed). Now a call that begins during
    # a fork (the fork takes only the arenas in a call) waits for its end, the arena's lock
    # held: the child sees the arena untouched, and can use it (its lock is made anew there).
    done = subprocess.run([sys.executable, "-c", ARENA_MADE_WHILE_A_FORK_WAITS],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] in ("[]", "[(0, False)]"), done.stdout
    assert done.stdout.split()[-1] == "0", done.stdout + done.stderr[-2000:]


# (in a script: a recording arena `a` whose plan runs on a helper thread, and a fork from a
# signal handler, under the program's `user_lock`, while this thread waits for that plan)
FORK_AT_A_SIGNAL = """
import os, signal, threading, time, numpy as np, pyshm
a = pyshm.Arena.recording(time_limit=0.5)  # (its plan runs on a helper thread: 0.5 s)
""" + ITERATION_TO_PLAN + """
user_lock = threading.Lock()  # (a lock of the program's, taken by its signal handler)
child = []
def on_alarm(signum, frame):  # (as a server that forks a worker at a signal)
    with user_lock:
        pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(10)  # (it hung: killed by SIGALRM)
    else:
        child.append(pid)
signal.signal(signal.SIGALRM, on_alarm)
"""
CHILD_STATUS = """
_, status = os.waitpid(child[0], 0)
print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

FORK_FROM_A_SIGNAL_HANDLER = FORK_AT_A_SIGNAL + """
signal.setitimer(signal.ITIMER_REAL, 0.1)  # while this thread waits for the plan
a.end_iteration()
who = "child" if not child else "parent"  # (one write each: the two share the pipe)
os.write(1, f"{who} {a.stats.iterations} {a.plan is not None}\\n".encode())
if not child:
    y = a.empty(4, np.uint8); a.free(y); a.end_iteration(); os._exit(7)
""" + CHILD_STATUS


def test_fork_from_a_signal_handler_during_a_plan_on_a_helper_thread():
    # A fork on the thread that waits for its plan's helper thread (from a signal handler)
    # did not wait for the plan, and the child, where that helper does not exist, waited
    # for it forever. Now the fork waits for it: both see the plan done and go on.
    done = subprocess.run([sys.executable, "-c", FORK_FROM_A_SIGNAL_HANDLER],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split("\n")[:2]) == ["child 1 True", "parent 1 True"], done.stdout
    assert done.stdout.split()[-1] == "7", done.stdout + done.stderr[-2000:]


FORK_WHILE_A_FINALIZER_WAITS = """
import errno, gc, os, threading, numpy as np, pyshm
a = pyshm.Arena([64, 64], [0, 0], [1, 1], shared=True).allocate()
x = a.array(0); x[:] = 5
user_lock = threading.Lock()  # (a lock of the program's: a pool's, a logger's, a cache's)
finalizing = threading.Event()
class Garbage:  # collected inside the arena call below; its finalizer takes user_lock
    def __del__(self):
        finalizing.set()
        with user_lock:
            pass
class Index:  # a tensor index whose __index__ lets the garbage collector run there
    def __index__(self):
        g = Garbage(); g.cycle = g; del g
        gc.collect()
        return 1
user_lock.acquire()
inside = threading.Thread(target=lambda: a.array(Index())); inside.start()
finalizing.wait()  # that thread holds the arena's lock and waits for user_lock
pid = os.fork()  # with user_lock held (it waited for the arena's lock for ever: both hung)
if pid == 0:
    calls = [lambda: a.array(0), lambda: a.size, lambda: len(a), lambda: a.stats,
             lambda: a.fd, a.allocate, a.deallocate, a.trim, lambda: a.storage(0)]
    for call in calls:
        try:
            call()
            print("worked")
        except OSError as exc:
            print(errno.errorcode[exc.errno], "busy in another thread" in str(exc))
    print(repr(a))
    fds = sorted(os.listdir("/proc/self/fd"))
    a.close()  # (frees nothing: the C arena may be halfway)
    print(a.closed, fds == sorted(os.listdir("/proc/self/fd")), int(x.sum()), flush=True)
    del x; gc.collect()
    os._exit(0)
user_lock.release(); inside.join()
_, status = os.waitpid(pid, 0)
print("parent", int(x.sum()), a.array(1).size, os.waitstatus_to_exitcode(status), flush=True)
"""


def test_fork_while_an_arena_call_runs_a_finalizer_that_waits_for_the_forking_thread():
    # A thread inside an arena call ran a finalizer (the garbage collector runs them wherever
    # it collects) that waited for a lock the forking thread held, and the fork waited for the
    # arena's lock for ever: both hung. Now the fork waits 0.25 s; the child's copy of that
    # arena (halfway, perhaps) refuses every call with EBUSY and its close() frees nothing,
    # and the parent goes on untouched.
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_A_FINALIZER_WAITS],
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:9] == ["EBUSY True"] * 9, done.stdout
    assert lines[9:] == ["<pyshm.Arena unusable: busy in another thread at the fork>",
                         "True True 320", "parent 320 64 0"], done.stdout


# (in a script, after `user_lock = threading.Lock()`: the arena's end_iteration, whose C call
# runs Python once the plan is made, in its thread, that waits for user_lock, as a finalizer
# the garbage collector runs there; outcome(call): "done" or the errno's name)
LATE_END_ITERATION = """
import ctypes, errno
from pyshm import _ffi, arena as arena_module
real = _ffi.lib.lshm_arena_end_iteration
late = ctypes.CDLL(_ffi.LIBRARY_PATH, use_errno=True).lshm_arena_end_iteration
late.argtypes, late.restype = real.argtypes, real.restype
def check(result, func, args):  # (ctypes runs it in the planning thread, after the plan)
    with user_lock:
        pass
    return real.errcheck(result, func, args) if real.errcheck else result
late.errcheck = check
class Lib:  # the library, with that end_iteration
    lshm_arena_end_iteration = late
    def __getattr__(self, name):
        return getattr(_ffi.lib, name)
arena_module.lib = Lib()
def outcome(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]
"""

FORK_WHILE_THE_PLAN_HELPER_RUNS_A_FINALIZER = FORK_AT_A_SIGNAL + LATE_END_ITERATION + """
signal.setitimer(signal.ITIMER_REAL, 0.1)  # (the fork waited for the helper for ever)
result = outcome(a.end_iteration)
after = outcome(lambda: a.stats)
who = "child" if not child else "parent"
os.write(1, f"{who} {result} {after} {a.stats.iterations if child else ''}\\n".encode())
if not child:
    a.close(); os._exit(7)
""" + CHILD_STATUS


def test_fork_from_a_signal_handler_while_the_plan_helper_runs_a_finalizer():
    # A fork from a signal handler on the thread waiting for its plan's helper thread waited
    # for the helper for ever; the helper, its plan done, ran Python (ctypes' error check, a
    # finalizer the garbage collector runs there) that waited for a lock the handler held:
    # both hung. Now the fork waits while the helper is in C, then 0.25 s at most: the child
    # gets EBUSY from end_iteration and the arena is unusable there; the parent's plan is done.
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_THE_PLAN_HELPER_RUNS_A_FINALIZER],
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split("\n")
    assert sorted(line.strip() for line in lines[:2]) == ["child EBUSY EBUSY",
                                                          "parent done done 1"], done.stdout
    assert lines[2] == "7", done.stdout + done.stderr[-2000:]



FORK_WHILE_A_PLAN_ENDS_IN_A_FINALIZER_SETUP = """
import os, threading, time, numpy as np, pyshm
from pyshm._ffi import ArenaCounters, lib
a = pyshm.Arena.recording(time_limit=0.3)  # (a plan above the lower bound: it takes 0.3 s)
""" + ITERATION_TO_PLAN + """
user_lock = threading.Lock()
""" + LATE_END_ITERATION
# (then: `a` planning in another thread, stuck after its plan; a fork meanwhile, `took` long)
FORK_AS_A_PLAN_ENDS_IN_A_FINALIZER = """
ended = []
planner = threading.Thread(target=lambda: ended.append(outcome(a.end_iteration)))
counters = ArenaCounters()
with user_lock:
    planner.start()
    while lib.lshm_arena_stats(a._handle, ctypes.byref(counters)) == 0 and \\
            not counters.iterations:  # (read without the lock: counted first, then planned)
        time.sleep(0.001)
    began = time.monotonic()
    pid = os.fork()  # (it waited for the arena for ever: the plan's thread waits for us)
    if pid == 0:
        os.write(1, f"child {outcome(lambda: a.stats)}\\n".encode())  # (one write)
        os._exit(0)
    took = time.monotonic() - began
planner.join()
_, status = os.waitpid(pid, 0)
"""

FORK_WHILE_A_PLAN_ENDS_IN_A_FINALIZER = (
    FORK_WHILE_A_PLAN_ENDS_IN_A_FINALIZER_SETUP + FORK_AS_A_PLAN_ENDS_IN_A_FINALIZER + """
print("parent", ended, a.stats.iterations, a.plan is not None,
      os.waitstatus_to_exitcode(status))
""")


def test_fork_while_a_plan_in_another_thread_ends_in_a_finalizer_that_waits():
    # A fork waited for an arena's call as long as the call planned (a plan with a time_limit
    # takes that long), and then for the rest of it: Python (ctypes' error check, a finalizer
    # the garbage collector runs there) that here waits for a lock the forking thread holds.
    # Both hung. Now the fork waits while the plan is in C, then 0.25 s: the child gets that
    # arena unusable (EBUSY), the parent's plan is done.
    assert_prints(FORK_WHILE_A_PLAN_ENDS_IN_A_FINALIZER, [
        "child EBUSY", "parent ['done'] 1 True 0"], timeout=20)



FORK_WHILE_HOLDING_THE_FORK_TURN = """
import os, pyshm
from pyshm import arena as arena_module
a = pyshm.Arena.recording()
with arena_module._FORK_TURN:  # (as a signal handler that runs there: see _wait_for_fork)
    pid = os.fork()
    if pid == 0:
        y = a.empty(4); a.free(y); a.end_iteration(); os._exit(5)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), a.empty(2).size)
"""


def test_fork_from_a_signal_handler_while_its_thread_holds_the_fork_turn():
    # A thread holds _FORK_TURN for a moment after another thread's fork (a call that began
    # during it waits for its end there; Arena() and close() took it too). A signal handler
    # that forked in that moment waited for the lock its own thread held: for ever. It is
    # reentrant now: the fork goes ahead, and parent and child use the arena.
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_HOLDING_THE_FORK_TURN],
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["5", "2"], done.stdout


FORK_FROM_A_SIGNAL_HANDLER_WHILE_A_FORK_WAITS = FORK_HELPERS + """
import signal
free, busy = pyshm.Arena.recording(), pyshm.Arena.recording()
release = hold(busy)
threading.Timer(0.4, release).start()  # (the holder's call ends: both forks go ahead)
handler_child = []
def on_alarm(signum, frame):  # a fork from a signal handler while this thread's fork waits
    pid = os.fork()
    handler_child.append(pid)
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.1)
pid = os.fork()  # (waits for `busy`: the alarm comes meanwhile)
if pid == 0 or handler_child == [0]:  # (a child: its own arenas work)
    for x in (free, busy):
        y = x.empty(4); x.free(y); x.end_iteration()
    if pid:
        os.waitpid(pid, 0)
    os._exit(0)
def use():
    y = busy.empty(4); busy.free(y)
def fork():
    p = os.fork()
    if p == 0:
        os._exit(0)
    os.waitpid(p, 0)
results = []
for target in (use, fork):  # (each hung: the lock and the fork turn were held for good)
    t = threading.Thread(target=target, daemon=True); t.start(); t.join(3)
    results.append("hung" if t.is_alive() else "ok")
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in (pid, handler_child[0])]
print(*results, *codes, arena_module._FORKER, len(arena_module._IN_CALL), flush=True)
os._exit(0)
"""


def test_fork_from_a_signal_handler_while_its_threads_fork_waits():
    # A fork from a signal handler that ran while its thread's own fork waited for an arena
    # call took that fork's list of locks and its flag: the outer fork then released nothing,
    # _FORK_TURN stayed held, and every later fork on another thread hung. Each fork of a
    # thread has its own record now (a stack): all four processes end, and the parent's
    # threads call the arena and fork again.
    done = subprocess.run([sys.executable, "-c", FORK_FROM_A_SIGNAL_HANDLER_WHILE_A_FORK_WAITS],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "ok", "0", "0", "None", "0"], (
        done.stdout + done.stderr[-2000:])



SIGNAL_WHILE_A_CHILD_RENEWS_A_LOCK = """
import os, signal, pyshm
from pyshm import arena as arena_module
a, b = pyshm.Arena.recording(), pyshm.Arena.recording()
pid = os.fork()
if pid == 0:  # (a child: each arena's lock is made anew at its first call)
    signal.alarm(5)  # (it hung: killed by SIGALRM)
    forked = []
    def on_usr1(signum, frame):  # a signal handler that forks and uses an arena
        forked.append(os.fork())
        y = b.empty(4); b.free(y); b.end_iteration()
        if forked[-1] == 0:
            os._exit(3)
    signal.signal(signal.SIGUSR1, on_usr1)
    real = arena_module._new_lock
    def new_lock(arena):  # (the signal comes while this thread renews a's lock)
        arena_module._new_lock = real
        os.kill(os.getpid(), signal.SIGUSR1)
        return real(arena)
    arena_module._new_lock = new_lock
    y = a.empty(4); a.free(y); a.end_iteration()
    code = os.waitstatus_to_exitcode(os.waitpid(forked[0], 0)[1])
    os._exit(10 + code if b.stats.iterations == 1 == a.stats.iterations else 1)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_signal_handler_that_forks_and_uses_an_arena_while_a_child_renews_a_lock():
    # In a forked child, each arena's first call makes its lock anew under _RENEWING, a plain
    # Lock: a signal handler that ran there and called another arena (after forking, here)
    # waited for the lock its own thread held, for ever (the child was killed by its alarm).
    # It is reentrant now: child and grandchild use both arenas.
    done = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_A_CHILD_RENEWS_A_LOCK],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["13"], done.stdout + done.stderr[-2000:]



FORK_WHILE_ANOTHER_THREAD_PLANS_ON = FORK_WHILE_A_PLAN_ENDS_IN_A_FINALIZER_SETUP + """
rng = np.random.default_rng(0)
sizes, firsts, lasts, live, t = [], [], [], [], 0
for size in rng.integers(1, 100000, 400):  # (as ITERATION_TO_PLAN: a plan of 0.2 s)
    sizes.append(int(size)); firsts.append(t); lasts.append(0); live.append(len(sizes) - 1)
    t += 1
    if len(live) > 7:
        lasts[live.pop(int(rng.integers(0, len(live))))] = t; t += 1
for i in live:
    lasts[i] = t; t += 1
stop = threading.Event()
def planner_loop():  # another thread's plans, one after another, with nothing to do with `a`
    while not stop.is_set():
        pyshm.plan(sizes, firsts, lasts, time_limit=0.2)
other = threading.Thread(target=planner_loop); other.start()
time.sleep(0.05)  # (its first plan under way)
timer = threading.Timer(8, stop.set)  # (the fork waited for the other plans till then)
timer.start()
""" + FORK_AS_A_PLAN_ENDS_IN_A_FINALIZER + """
stop.set(); timer.cancel(); other.join()
print("parent", ended, took < 3, os.waitstatus_to_exitcode(status))
"""


def test_fork_waits_for_an_arena_stuck_in_python_while_another_thread_plans_on():
    # A fork waited longer for an arena in end_iteration while any thread's plan was in C: with
    # another thread planning one plan after another (nothing to do with that arena), and the
    # arena's call stuck in Python after its plan (a finalizer waiting for the forking thread),
    # the fork waited as long as the other thread planned (8 s here). Now it waits longer only
    # for a plan made for the thread in that arena's call: 0.25 s, and the child gets EBUSY.
    assert_prints(FORK_WHILE_ANOTHER_THREAD_PLANS_ON, [
        "child EBUSY", "parent ['done'] True 0"], timeout=60)



FORK_WITHOUT_CURRENT_FRAMES = FORK_HELPERS + """
busy = pyshm.Arena.recording()
release = hold(busy)  # (its call "plans in C": a fork waits for it while it can tell)
del sys._current_frames  # (a Python without it: the fork cannot tell, and waits 0.25 s)
pid = os.fork()
if pid == 0:
    exit_by_use(busy)  # (used as whole before: perhaps halfway)
release()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), busy.stats.iterations, flush=True)
"""


def test_fork_on_a_python_without_current_frames_still_keeps_a_busy_arena_out():
    # A fork tells a plan in C by sys._current_frames() (CPython's): without it, the fork hook
    # raised AttributeError while it waited for a busy arena ("Exception ignored"), went ahead
    # and the child used that arena (perhaps halfway) as if whole. Now the fork waits 0.25 s,
    # as for a call in Python, and the arena raises EBUSY in the child.
    done = subprocess.run([sys.executable, "-c", FORK_WITHOUT_CURRENT_FRAMES],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "0"], done.stdout + done.stderr[-2000:]
    assert "Exception" not in done.stderr, done.stderr



BUSY_ARENA_IN_A_GRANDCHILD = """
import errno, os, threading, pyshm
a = pyshm.Arena([64, 64], [0, 0], [1, 1]).allocate()
go, inside = threading.Event(), threading.Event()
class Index:  # (a thread inside a's call, in Python, past the fork's 0.25 s)
    def __index__(self):
        inside.set(); go.wait(); return 0
t = threading.Thread(target=lambda: a.array(Index())); t.start(); inside.wait()
def outcome(call):
    try:
        call(); return "worked"
    except OSError as exc:
        return errno.errorcode[exc.errno]
pid = os.fork()
if pid == 0:
    seen = [outcome(lambda: a.stats)]
    grandchild = os.fork()
    if grandchild == 0:  # (the arena is the same halfway copy here: unusable too)
        os.write(1, f"grandchild {outcome(lambda: a.stats)} {outcome(lambda: len(a))} "
                    f"{repr(a)[:22]}\\n".encode())
        os._exit(0)
    os.waitpid(grandchild, 0)
    os.write(1, f"child {seen[0]}\\n".encode())
    os._exit(0)
go.set(); t.join(); os.waitpid(pid, 0)
print("parent", outcome(lambda: a.stats))
"""


def test_an_arena_busy_at_a_fork_stays_unusable_in_a_grandchild():
    # A child's arena that was busy in another thread at the fork (its C arena perhaps
    # halfway) raised EBUSY in the child, but the child's own fork made its lock anew in the
    # grandchild, which then used that halfway arena as if whole. It stays unusable there.
    assert_prints(BUSY_ARENA_IN_A_GRANDCHILD, [
        "grandchild EBUSY EBUSY <pyshm.Arena unusable:", "child EBUSY", "parent worked"],
        timeout=30)



CTRL_C_WHILE_A_FORK_WAITS_FOR_AN_ARENA = FORK_HELPERS + """
import signal
busy = pyshm.Arena.recording()
release = hold(busy)  # (a plan in C: the fork waits for it)
def on_alarm(signum, frame):  # (as Ctrl-C while the fork waits)
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.1)
interrupted = False
try:
    pid = os.fork()
except KeyboardInterrupt:
    interrupted = True  # (no child: the fork did not happen)
    pid = None
if pid == 0:
    exit_by_use(busy)  # (used as whole before: perhaps halfway)
try:
    for _ in range(100):  # (the interrupt, if it comes after the fork)
        time.sleep(0.01)
except KeyboardInterrupt:
    interrupted = True
release()
code = None if pid is None else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(code, interrupted, busy.stats.iterations, arena_module._FORKER, len(arena_module._IN_CALL),
      flush=True)
"""


def test_ctrl_c_while_a_fork_waits_for_an_arena_keeps_that_arena_out_of_the_child():
    # A KeyboardInterrupt (a signal handler's exception) while the fork waited for another
    # thread's arena call ended the before-fork hook; os.fork() ignores that and went ahead,
    # and the child used that arena, perhaps halfway, as whole. It is unusable there now
    # (EBUSY), and the parent's fork state is clean (CPython drops the exception itself).
    done = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_A_FORK_WAITS_FOR_AN_ARENA],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "False", "0", "None", "0"], (
        done.stdout + done.stderr[-2000:])


CTRL_C_WHILE_A_FORK_WAITS_FOR_A_PLAN_HELPER = """
import os, signal, threading, time, numpy as np, pyshm
a = pyshm.Arena.recording(time_limit=0.5)  # (its plan runs on a helper thread: 0.5 s)
""" + ITERATION_TO_PLAN + """
child = []
def on_alarm(signum, frame):  # a fork at a signal while this thread waits for the plan
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    pid = os.fork()  # (SIGUSR1 comes while the fork waits for the plan's helper)
    if pid == 0:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(5)  # (it hung: killed by SIGALRM)
    else:
        child.append(pid)
def on_usr1(signum, frame):  # (as Ctrl-C)
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, on_alarm)
signal.signal(signal.SIGUSR1, on_usr1)
signal.setitimer(signal.ITIMER_REAL, 0.1)
try:
    a.end_iteration()
    result = "done"
except OSError as exc:
    result = f"errno {exc.errno}"
except KeyboardInterrupt:
    result = "interrupted"
if not child:
    os.write(1, f"child {result}\\n".encode()); os._exit(0)
_, status = os.waitpid(child[0], 0)
print("parent", result, os.waitstatus_to_exitcode(status), flush=True)
"""


def test_ctrl_c_while_a_fork_waits_for_the_plan_helper_does_not_hang_the_child():
    # A fork from a signal handler waits for its thread's plan on a helper thread; a
    # KeyboardInterrupt in that wait ended the hook without cutting the helper off, and the
    # child (no helper there) waited for it for ever. Now the child's end_iteration raises
    # EBUSY and the parent's plan is done.
    assert_prints(CTRL_C_WHILE_A_FORK_WAITS_FOR_A_PLAN_HELPER, [
        "child errno 16", "parent done 0"], timeout=30)



CTRL_C_WHILE_A_FORK_WAITS_FOR_ITS_TURN = FORK_HELPERS + """
import signal
busy = pyshm.Arena.recording()
release = hold(busy)  # (a plan in C: a fork waits for it)
other = []
one = fork_in_a_thread(other)  # (waits for `busy`)
def on_alarm(signum, frame):  # (as Ctrl-C while this thread's fork waits for its turn)
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.1)
pid = os.fork()
if pid == 0:
    exit_by_use(busy)  # (used as whole before: perhaps halfway)
release(); one.join()
def again():
    p = os.fork()
    if p == 0:
        os._exit(0)
    os.waitpid(p, 0)
t = threading.Thread(target=again, daemon=True); t.start(); t.join(5)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in [pid] + other]
print(codes, t.is_alive(), arena_module._FORKER, len(arena_module._IN_CALL), flush=True)
"""


def test_ctrl_c_while_a_fork_waits_for_its_turn():
    # The same (06b59dd) while the fork waited for another thread's fork to end: before, the
    # child used the busy arena as whole, and the after-fork hook reset the other fork's
    # _FORKER. Now the child gets EBUSY, the other fork ends as usual, a third one works.
    done = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_A_FORK_WAITS_FOR_ITS_TURN],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[2,", "0]", "False", "None", "0"], (
        done.stdout + done.stderr[-2000:])



FORK_FROM_A_SIGNAL_HANDLER_WHILE_A_CALL_WAITS_FOR_A_FORK = FORK_HELPERS + """
import signal
free, busy = pyshm.Arena.recording(), pyshm.Arena.recording()
release = hold(busy)
pids = []
one = fork_in_a_thread(pids)  # (waits for `busy`)
entered = []
def on_alarm(signum, frame):  # runs in _wait_for_fork: this thread holds free's lock there
    threading.Timer(0.1, release).start()  # (then `one`'s fork ends, and this one goes on)
    pid = os.fork()
    if pid == 0:  # another thread of the child's tries free while this call is under way
        other = threading.Thread(target=lambda: entered.append(len(free)), daemon=True)
        other.start(); other.join(0.3)
        os.write(1, f"child {entered}\\n".encode())
    else:
        pids.append(pid)
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, 0.1)
y = free.empty(4)  # (a call begun during `one`'s fork: waits for its end)
free.free(y); del y
if 0 not in pids and len(pids) < 2:
    os._exit(0)  # (the child)
one.join()
print("parent", [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids], flush=True)
"""


def test_fork_from_a_signal_handler_while_its_call_waits_for_another_fork():
    # A call begun during another thread's fork waits for its end in _wait_for_fork, holding
    # its arena's lock, out of _IN_CALL. A signal handler that forked there gave the child that
    # arena with a lock to make anew: another thread of the child's went into the arena while
    # the call of the forking thread was under way (it returned len() at once). The child keeps
    # that call's lock now: the other thread waits for the call.
    assert_prints(FORK_FROM_A_SIGNAL_HANDLER_WHILE_A_CALL_WAITS_FOR_A_FORK, [
        "child []", "parent [0, 0]"], timeout=30)


@pytest.mark.parametrize("make", [
    lambda shared: pyshm.Arena([64], [0], [1], shared=shared),
    lambda shared: pyshm.Arena.recording(shared=shared),
])
def test_arena_refuses_a_non_bool_shared(make):
    # shared="no" made a shared arena (a memfd) whose .shared said "no"
    with pytest.raises(TypeError, match="shared must be a bool"):
        make("no")
    assert make(False).shared is False and make(True).shared is True
    # numpy's bools and 0/1 pass the check: .shared says a bool for them too
    assert make(np.True_).shared is True and make(0).shared is False


def _destroy_cut_off() -> int:
    """A shared recording arena with two storages dropped but not freed (in its _live), whose
    death was cut off at its finalizer's entry (_destroy: left to the next settle); the inode
    of its memfd, still held."""
    arena = pyshm.Arena.recording(shared=True)
    arena.free(arena.empty(1000))
    arena.end_iteration()  # (planned: the next ones are slices of its memfd)
    inode = os.fstat(arena.fd).st_ino
    arena.empty(1000), arena.empty(10)
    held = [arena]
    del arena
    assert interrupted_at(2, held.clear)  # (1: the release callback's entry, 2: _destroy's)
    assert held == [] and memfd_held(inode)
    return inode


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("where", ["at each point of _destroy", "in lshm_arena_free"])
def test_an_arenas_death_made_up_for_by_two_settles_at_once_is_made_once(monkeypatch, where):
    # A recording arena whose finalizer (_destroy) was cut off by a Ctrl-C at its entry is
    # destroyed at the next settle. Two settles at once (two threads releasing; or a garbage
    # collection in the one) both ran it: the second one, running where the first had read
    # a slot of _live (after next(iter(live)) returned), freed that slot, and the first then
    # raised KeyError (out of the Storage.close() that settled; between iter() and next():
    # RuntimeError); running while the first was in lshm_arena_free (which let go of the
    # GIL), it destroyed the arena under that call (here: libshm refused, "storages not
    # freed yet", and the arena leaked). Now each slot is freed and the arena destroyed once,
    # by whichever settle comes to it, and the memfd is gone.
    from pyshm import _ffi

    for point in itertools.count(1):
        inode = _destroy_cut_off()
        seen, other = 0, []

        def other_thread_settles():
            other.append(1)
            pyshm.Storage(4096).close()  # (its release settles too)

        if where == "at each point of _destroy":
            def profile(frame, event, arg):
                # (where another thread may run: the function's entry, after a call returns)
                nonlocal seen
                if frame.f_code.co_name == "_destroy" and event in ("call", "c_return"):
                    seen += 1
                    if seen == point:
                        other_thread_settles()

            sys.setprofile(profile)
            try:
                pyshm.Storage(4096).close()
            finally:
                sys.setprofile(None)
        else:
            def free(*args, _c_function=_ffi.lib.lshm_arena_free):
                if not other:
                    other_thread_settles()
                return _c_function(*args)

            monkeypatch.setattr(_ffi.lib, "lshm_arena_free", free)
            pyshm.Storage(4096).close()
        assert memfd_held(inode) == [], point
        if not other:
            break
    assert point > 1 or where != "at each point of _destroy"


def test_a_free_refused_because_another_thread_unpickled_the_tensor_changes_nothing():
    # free() checks the storage's references (the arena's and the owner's: no other), then
    # the owner gives its reference up, then libshm frees the slot. Another thread unpickling
    # this very tensor (a pickle of it, here) can take a reference between the check and the
    # owner's release (it holds the channel's lock, not the arena's): libshm then refused
    # (BufferError, EBUSY), but the owner had given its reference up. The array could never
    # be freed again (ValueError, "free expects a live array") and its owner held no storage.
    # Now the owner takes its reference back: the refusal changes nothing.
    from multiprocessing.reduction import ForkingPickler

    arena = pyshm.Arena.recording(shared=True)
    arena.free(arena.empty(1000))
    arena.end_iteration()  # (planned: the next ones are slices of its memfd)
    x = arena.empty(1000, np.uint8)
    x[:] = 9
    view = x[1:]
    view.flags.writeable = False  # (a writeable one would come back as a view of x itself)
    data = ForkingPickler.dumps(view)
    del view
    handle = x.base.handle
    other = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_release_now" and not other:
            other.append(ForkingPickler.loads(data))  # (another thread, at this point)

    sys.setprofile(profile)
    try:
        with pytest.raises(BufferError):
            arena.free(x)
    finally:
        sys.setprofile(None)
    assert int(other[0][0]) == 9
    assert x.base.handle is handle
    other.clear()
    gc.collect()
    arena.free(x)  # (as if the refused one had never been)
    x[:] = 1  # (still mapped: a freed array's bytes are)
    del x
    arena.end_iteration()
    arena.close()
