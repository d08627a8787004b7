"""Small arrays in libshm's slabs: created unshared, shared in place one by one, sent to workers.

What a user relies on: sharing 100,000 small arrays with share_memory_ costs one fd per 4 MiB
slab (not one per array) and few mappings, on both sides; writes are seen both ways; a
receiver of one array cannot read arrays of the slab that were not shared, nor a later
array placed where a shared one was; a fork after a slab is partly shared keeps the unshared
arrays private.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
from multiprocessing.reduction import ForkingPickler
import pytest

import pyshm
from pyshm import _ffi, reduction

PAGE = os.sysconf("SC_PAGE_SIZE")


def slab_counters():
    counters = _ffi.SlabCounters()
    _ffi.lib.lshm_slab_stats(counters)
    return counters


def memfd_key(array):
    storage = pyshm.storage_of(array)
    st = os.fstat(storage.fd)
    return st.st_dev, st.st_ino, storage.fd_offset


def mappings_of(inode: int) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.split()[4:5] == [str(inode)])


# ---- worker functions (module level: spawn imports them) ---------------------------------------


def read_neighbour(array, offset: int, nbytes: int):
    """In the worker: the bytes at `offset` of the memfd `array` came in (what it could read)."""
    storage = pyshm.storage_of(array)
    return os.pread(storage.fd, nbytes, offset), bytes(array[:4])


def keep_and_report(array, conn):
    """Keep a received array, report its first bytes whenever asked, until told to stop."""
    conn.send("ready")
    while conn.recv() == "again":
        conn.send(bytes(array[:8]))


# ---- one process --------------------------------------------------------------------------------


ONE_BY_ONE = """
import gc, os, numpy as np, pyshm
from pyshm import reduction

def maps_of(inode):
    return sum(1 for line in open('/proc/self/maps') if line.split()[4:5] == [str(inode)])

page = os.sysconf('SC_PAGE_SIZE')
before_fds = len(os.listdir('/proc/self/fd'))
arrays = [pyshm.zeros(512, np.int64) for _ in range(3000)]  # 4 KiB each, unshared
assert len(os.listdir('/proc/self/fd')) == before_fds  # no fd before a share
addresses = [a.ctypes.data for a in arrays]
for i, a in enumerate(arrays):
    a[0] = i
    pyshm.share_memory_(a)
assert [a.ctypes.data for a in arrays] == addresses  # in place
assert all(int(a[0]) == i for i, a in enumerate(arrays))
slabs = -(-3000 * page // reduction.SLAB_SIZE)
assert len(os.listdir('/proc/self/fd')) - before_fds == slabs, os.listdir('/proc/self/fd')
inodes = {os.fstat(pyshm.storage_of(a).fd).st_ino for a in arrays}
assert len(inodes) == slabs
# consecutive shares merged: one mapping per slab memfd
assert sum(maps_of(inode) for inode in inodes) == len(inodes)
del arrays, a
gc.collect()
assert len(os.listdir('/proc/self/fd')) == before_fds  # every slab gave its memfd back
assert sum(maps_of(inode) for inode in inodes) == 0
print("ok")
"""


def test_small_shares_use_one_memfd_per_slab():
    # A fresh process: slabs other tests keep alive would hold their memfds here.
    done = subprocess.run([sys.executable, "-c", ONE_BY_ONE], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in sys.path if p)))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_thresholds():
    small = pyshm.empty(reduction.SLAB_MAX, np.uint8)
    big = pyshm.empty(reduction.SLAB_MAX + 1, np.uint8)
    pyshm.share_memory_(small)
    pyshm.share_memory_(big)
    assert os.fstat(pyshm.storage_of(small).fd).st_size == reduction.SLAB_SIZE
    assert os.fstat(pyshm.storage_of(big).fd).st_size == reduction.SLAB_MAX + PAGE
    resizable = pyshm.Storage(100, resizable=True)
    resizable.share_memory_()
    assert os.fstat(resizable.fd).st_size == PAGE  # resizable storages own their pages


def test_shared_true_uses_the_same_slabs():
    a = pyshm.empty(100, np.uint8, shared=True)
    b = pyshm.zeros(100, np.uint8)
    pyshm.share_memory_(b)
    assert memfd_key(a)[:2] == memfd_key(b)[:2]  # one slab, one memfd
    assert pyshm.is_shared(a) and (a == 0).all()


def test_unshared_neighbours_are_not_in_the_memfd():
    a = pyshm.empty(PAGE, np.uint8)
    b = pyshm.empty(PAGE, np.uint8)  # the next page of the same slab
    a[:] = 1
    b[:] = 2
    pyshm.share_memory_(a)
    _, _, offset_a = memfd_key(a)
    offset_b = offset_a + (b.ctypes.data - a.ctypes.data)
    fd = pyshm.storage_of(a).fd
    assert os.pread(fd, PAGE, offset_b) == bytes(PAGE)  # b's bytes are not there
    assert os.pread(fd, PAGE, offset_a) == b"\x01" * PAGE


WALK = """
import os, numpy as np, pyshm
PAGE = os.sysconf('SC_PAGE_SIZE')
arrays = [pyshm.empty(PAGE, np.uint8) for _ in range(40)]  # a fresh process: a fresh slab
for i, a in enumerate(arrays):
    a[:] = i + 1
base = arrays[0].ctypes.data
assert [a.ctypes.data - base for a in arrays] == [i * PAGE for i in range(40)]
for a in arrays[:5]:
    pyshm.share_memory_(a)
storage = pyshm.storage_of(arrays[0])
fd, offset0 = storage.fd, storage.fd_offset
for i, a in enumerate(arrays):
    got = os.pread(fd, PAGE, offset0 + i * PAGE)
    assert got == (bytes([i + 1]) * PAGE if i < 5 else bytes(PAGE)), i
    assert a[0] == i + 1 and a[-1] == i + 1
print(os.fstat(fd).st_blocks * 512)
"""


def test_a_walk_of_shares_allocates_ahead_only_zeros():
    # shares one after the other up a slab allocate the memfd's pages a window ahead: those
    # pages hold zeros, never the bytes of the private storages there, and no more than the
    # documented 64 KiB beyond what was shared is allocated
    done = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              p for p in sys.path if p)))
    assert done.returncode == 0, done.stderr
    allocated = int(done.stdout)
    assert 5 * PAGE <= allocated <= 5 * PAGE + (64 << 10)


def test_readonly_gets_a_memfd_of_its_own():
    neighbour = pyshm.empty(1000, np.uint8)
    pyshm.share_memory_(neighbour)
    a = pyshm.copy(np.full(1000, 9, np.uint8))
    pyshm.share_readonly(a)
    assert os.fstat(pyshm.storage_of(a).fd).st_size == PAGE
    assert pyshm.storage_of(a).fd_offset == 0
    # sealing a slab memfd would make the neighbours read-only: refused, nothing changed
    flags = pyshm.storage_of(neighbour).flags
    with pytest.raises(ValueError, match="slab"):
        pyshm.share_readonly(neighbour)
    assert pyshm.storage_of(neighbour).flags == flags


# ---- across processes --------------------------------------------------------------------------


def test_receiver_cannot_read_an_unshared_neighbour():
    a = pyshm.empty(PAGE, np.uint8)
    secret = pyshm.empty(PAGE, np.uint8)
    a[:] = 7
    secret[:] = 0x5E
    with mp.get_context("spawn").Pool(1) as pool:
        pyshm.share_memory_(a)
        offset_secret = memfd_key(a)[2] + (secret.ctypes.data - a.ctypes.data)
        seen, head = pool.apply(read_neighbour, (a, offset_secret, PAGE))
    assert head == b"\x07" * 4
    assert seen == bytes(PAGE)


def test_slot_reuse_never_aliases_a_receivers_old_array():
    ctx = mp.get_context("fork")
    keep = pyshm.empty(PAGE, np.uint8)  # keeps the slab (and its memfd) alive
    pyshm.share_memory_(keep)
    a = pyshm.empty(PAGE, np.uint8)
    a[:] = 0xA1
    pyshm.share_memory_(a)
    parent_end, child_end = ctx.Pipe()
    # the worker must receive `a` by pickling, not by fork inheritance: send it after start
    child = ctx.Process(target=_receive_then_report, args=(child_end,))
    child.start()
    parent_end.send(a)
    assert parent_end.recv() == "ready"
    address = a.ctypes.data
    del a
    gc.collect()
    reduction._channel.drop_holds()  # the sender's keep-alive hold: not what this test is about
    gc.collect()
    later = []
    for i in range(200):  # new arrays, some shared, none on a's page while the memfd lives
        b = pyshm.empty(PAGE, np.uint8)
        b[:] = 0xB2
        if i % 2:
            pyshm.share_memory_(b)
        later.append(b)
        assert b.ctypes.data != address
    parent_end.send("again")
    assert parent_end.recv() == b"\xa1" * 8  # the receiver still reads a's bytes
    parent_end.send("stop")
    child.join(30)
    assert child.exitcode == 0


def _receive_then_report(conn):
    array = conn.recv()
    keep_and_report(array, conn)


def test_fork_after_a_slab_is_partly_shared():
    shared = pyshm.empty(PAGE, np.uint8)
    private = pyshm.empty(PAGE, np.uint8)
    pyshm.share_memory_(shared)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            shared[:] = 1  # reaches the parent
            private[:] = 2  # does not
            pyshm.share_memory_(private)  # into a memfd of the child's own
            mine = memfd_key(private)[1] != memfd_key(shared)[1]
            os.write(write_end, b"y" if mine else b"n")
        finally:
            os._exit(0)
    os.close(write_end)
    answer = os.read(read_end, 1)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert answer == b"y"
    assert (shared == 1).all()
    assert (private == 0).all()
    assert not pyshm.is_shared(private)


MANY_IN_PLACE = """
import os, resource, sys, multiprocessing as mp, numpy as np, pyshm

def maps():
    return sum(1 for _ in open('/proc/self/maps'))

def check(arrays):
    ok = all(int(a[0]) == i for i, a in enumerate(arrays))
    for a in arrays:
        a[1] = 7
    return ok, len(os.listdir('/proc/self/fd')), maps()

if __name__ == '__main__':
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    base_fds, base_maps = len(os.listdir('/proc/self/fd')), maps()
    n = 100_000
    arrays = [pyshm.zeros((512,), np.int64) for _ in range(n)]   # created unshared, 4 KiB
    for i, a in enumerate(arrays):
        a[0] = i
        pyshm.share_memory_(a)                                   # one by one, in place
    shared_fds, shared_maps = len(os.listdir('/proc/self/fd')), maps()
    with mp.get_context('spawn').Pool(1) as pool:
        ok, child_fds, child_maps = pool.apply(check, (arrays,))
    assert ok
    assert all(int(a[1]) == 7 for a in arrays)
    print(base_fds, shared_fds, child_fds, base_maps, shared_maps, child_maps)
"""


def test_100k_in_place_shares_to_a_spawn_worker_under_ulimit_1024(tmp_path):
    script = tmp_path / "many_in_place.py"
    script.write_text(MANY_IN_PLACE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    base_fds, shared_fds, child_fds, base_maps, shared_maps, child_maps = map(
        int, done.stdout.split()
    )
    assert shared_fds - base_fds <= 110  # one per 4 MiB slab: 98
    assert child_fds < 200
    assert shared_maps - base_maps < 1000
    assert child_maps < 1000


def test_a_slab_memfd_stays_fetchable_while_any_of_its_exported_arrays_lives():
    # Two arrays of one slab share its memfd, i.e. one export key. The first one exported
    # used to be the only holder the fd server could find for that key: once it was gone (and
    # the keep-alive holds were fetched or expired) a receiver of the second one, still alive
    # here, got "the sending process no longer holds this memory".
    first = pyshm.empty(PAGE, np.uint8)
    second = pyshm.empty(PAGE, np.uint8)
    second[:] = 0x5C
    pyshm.share_memory_(first)
    pyshm.share_memory_(second)
    ForkingPickler.dumps(first)  # exported, in this order: `first` is the key's first holder
    ForkingPickler.dumps(second)
    key_and_offset = memfd_key(second)
    key = key_and_offset[:2]
    assert memfd_key(first)[:2] == key
    reduction._channel.drop_holds()  # both holds fetched (or their keep-alive passed)
    del first
    gc.collect()
    holder = reduction._channel.lookup(key)
    assert holder is not None
    fds, holders = [], []
    assert reduction._channel._fd_for(key, False, fds, holders)
    assert os.fstat(fds[0]).st_ino == key[1]
    offset = key_and_offset[2]
    assert os.pread(fds[0], 4, offset) == b"\x5c" * 4  # the receiver would read `second`


def test_export_info_matches_the_fd():
    """lshm_storage_export says in one call what fstat and F_GET_SEALS would."""
    import fcntl

    small = pyshm.empty(1000, np.uint8)
    big = pyshm.empty(reduction.SLAB_MAX + 1, np.uint8)
    ro = pyshm.share_readonly(pyshm.copy(np.zeros(10, np.uint8)))
    pyshm.share_memory_(small)
    pyshm.share_memory_(big)
    for array, readonly in ((small, 0), (big, 0), (ro, 1)):
        storage = pyshm.storage_of(array)
        info = _ffi.ExportInfo()
        _ffi.lib.lshm_storage_export(storage._as_parameter_, info)
        st = os.fstat(info.fd)
        assert (info.dev, info.ino, info.file_size) == (st.st_dev, st.st_ino, st.st_size)
        assert info.offset == storage.fd_offset
        assert info.readonly == readonly
        handle = storage._as_parameter_
        assert (info.flags, info.data, info.nbytes) == (
            _ffi.lib.lshm_storage_flags(handle), array.ctypes.data, array.nbytes)
        assert bool(fcntl.fcntl(info.fd, fcntl.F_GET_SEALS) & reduction.F_SEAL_FUTURE_WRITE) \
            == bool(readonly)
    unshared = pyshm.storage_of(pyshm.empty(10, np.uint8))
    with pytest.raises(OSError):
        _ffi.lib.lshm_storage_export(unshared._as_parameter_, _ffi.ExportInfo())


def test_export_records_of_dead_arrays_are_dropped():
    from multiprocessing.reduction import ForkingPickler
    import time

    arrays = [pyshm.empty(64, np.uint8, shared=True) for _ in range(200)]
    ForkingPickler.dumps(arrays)
    reduction._channel.drop_holds()  # the keep-alive holds: not what this test is about
    before = len(reduction._state.ranges)
    del arrays
    gc.collect()
    deadline = time.monotonic() + 10
    while len(reduction._state.ranges) > before - 200 and time.monotonic() < deadline:
        time.sleep(0.2)  # the server's sweep runs about once a second
    assert len(reduction._state.ranges) <= before - 200
