"""pyshm arrays and storages across processes: zero-copy pickling under fork, spawn, forkserver.

Every case checks real memory: a write on one side is read on the other, data pointers and
/proc/self/maps show one mapping per memfd, fds are counted. Pools are reused per start method
and arrays are small, to keep the suite fast.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import pyshm
from pyshm import _channel, _ffi, reduction
from pyshm._memory import owner_of as _owner_of

from shm_harness import needs_fence, start_with_pipe

METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture(scope="module", params=METHODS)
def pool(request):
    ctx = mp.get_context(request.param)
    with ctx.Pool(1) as p:
        p.ctx = ctx
        yield p


# ---- worker functions (module level: spawn and forkserver import them) ----------------------


def add_one(array):
    array += 1
    return array


def describe(arrays):
    """Addresses of what arrived, writeable flags, and how many mappings each memfd has."""
    out = []
    for a in arrays:
        st = pyshm.storage_of(a)
        key = os.fstat(st.fd).st_ino
        maps = [line for line in open("/proc/self/maps") if line.split()[4] == str(key)]
        out.append((a.ctypes.data, bool(a.flags.writeable), len(maps), int(a.sum())))
    return out


def write_storage(storage):
    storage.asarray()[:] = 42
    return storage.nbytes


def process_child(array, queue, conn):
    array[:] = 5
    queue.put(array[2:])
    conn.send(array)
    conn.close()


# What a receiver of a read-only array (first byte 11) finds when it tries to write it.
READONLY_SEEN = {
    "writeable": False,
    "value": 11,
    "mmap": errno.EPERM,
    "write": errno.EPERM,
    "store": "refused",
}


def readonly_probe(array):
    st = pyshm.storage_of(array)
    fd, size = st.fd, os.fstat(st.fd).st_size
    result = {"writeable": bool(array.flags.writeable), "value": int(array[0])}
    try:
        mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        result["mmap"] = "ok"
    except OSError as exc:
        result["mmap"] = exc.errno
    try:
        os.pwrite(fd, b"x", 0)
        result["write"] = "ok"
    except OSError as exc:
        result["write"] = exc.errno
    try:
        array[0] = 1
        result["store"] = "ok"
    except ValueError:
        result["store"] = "refused"
    return result


def truncate_probe(array):
    fd = pyshm.storage_of(array).fd
    codes = []
    for size in (0, os.fstat(fd).st_size * 2):
        try:
            os.ftruncate(fd, size)
            codes.append("ok")
        except OSError as exc:
            codes.append(exc.errno)
    return codes


def write_and_sleep(array):
    array[:] = 3
    time.sleep(60)


def write_then_die(array):
    array[:] = 9
    os.kill(os.getpid(), signal.SIGKILL)


def allocate_in_child(conn):
    a = pyshm.empty(16, np.uint8, shared=True)
    a[:] = 0xAA
    conn.send(a.ctypes.data)


def open_fd_count():
    return len(os.listdir("/proc/self/fd"))


def fetches_and_touch(arrays):
    for a in arrays:
        a[1] = 7
    return reduction.fetch_count(), [int(a[0]) for a in arrays]


def first_element(array):
    return int(array[0]), os.getpid()


def receive_and_watch_extras(conn):
    baseline = open_fd_count()
    array = conn.recv()
    held = len(reduction._state.prefetched)
    fds = open_fd_count()
    time.sleep(_channel.PREFETCH_SECONDS + 3 * _channel.JANITOR_SECONDS)
    conn.send((int(array[0]), held, fds - baseline, len(reduction._state.prefetched)))
    del array
    import gc

    gc.collect()
    conn.send(open_fd_count() - baseline)


# ---- zero-copy sending ------------------------------------------------------------------------


def test_pool_args_and_results_alias(pool):
    small = pyshm.empty(64, np.int64, shared=True)  # packed in a slab
    small[:] = np.arange(64)
    big = pyshm.copy(np.full(1 << 16, 7, np.int32), shared=True)  # its own memfd
    results = pool.map(add_one, [small, big, small])
    assert (small == np.arange(64) + 2).all()  # both writes in the worker landed here
    assert (big == 8).all()
    # the results are our own memory, at the original addresses
    assert [r.ctypes.data for r in results] == [small.ctypes.data, big.ctypes.data] + [
        small.ctypes.data
    ]
    results[1][0] = -1
    assert big[0] == -1


def add_one_and_reply(conn):
    view = conn.recv()
    view += 1
    conn.send(view)
    conn.close()


def test_unshared_array_is_shared_in_place_on_send(pool):
    # Pickled on the caller's own thread (Pipe, Process arguments, SimpleQueue): shared in place.
    a = pyshm.empty((256, 16), np.float32)  # private memory
    a[:] = 1.5
    view = a[10:20]
    address = a.ctypes.data
    assert not pyshm.is_shared(a)
    parent_end, child = start_with_pipe(pool.ctx, add_one_and_reply)
    parent_end.send(view)
    assert pyshm.is_shared(a) and a.ctypes.data == address  # shared in place, no copy
    result = parent_end.recv()
    child.join(30)
    assert (view == 2.5).all() and (a[:10] == 1.5).all()  # the worker wrote our pages
    assert result.ctypes.data == view.ctypes.data


def test_unshared_array_on_a_pool_is_shared_in_place_under_the_fence(pool):
    # A Pool pickles tasks on its task-handler thread while the caller goes on: the array is
    # shared in place there under libshm's write fence (without one it is refused:
    # test_channel's test_without_the_fence_...), and the worker writes our pages.
    needs_fence()
    a = pyshm.empty(1000, np.float32)
    a[:] = 1.5
    address = a.ctypes.data
    assert pool.apply(add_one, (a,)).ctypes.data == address
    assert pyshm.is_shared(a) and a.ctypes.data == address and (a == 2.5).all()


def test_same_memfd_is_mapped_once_in_the_receiver(pool):
    a = pyshm.empty(100, np.uint8, shared=True)
    b = pyshm.empty(100, np.uint8, shared=True)  # same slab as a
    assert pyshm.storage_of(a).fd == pyshm.storage_of(b).fd
    big = pyshm.copy(np.ones(5000, np.uint8), shared=True)
    (info,) = pool.map(describe, [[a, a, b, big, big[1:]]])
    (a1, _, maps_a, _), (a2, _, _, _), (b1, _, maps_b, _), (g1, _, maps_g, s), (g2, *_) = info
    assert a1 == a2  # the same array sent twice: one view
    assert b1 - a1 == b.ctypes.data - a.ctypes.data  # same slab: same mapping, same layout
    assert maps_a == maps_b == 1 and maps_g == 1
    assert g2 == g1 + 1 and s == 5000
    # a second message reuses the receiver's cached mapping
    (again,) = pool.map(describe, [[b]])
    assert again[0][0] == b1


def test_storage_travels_by_reference(pool):
    storage = pyshm.Storage(10_000)
    storage.share_memory_()  # (a Pool pickles on a thread of its own: share first)
    assert pool.apply(write_storage, (storage,)) == 10_000
    assert storage.is_shared and (storage.asarray() == 42).all()


def test_process_queue_and_pipe(pool):
    ctx = pool.ctx
    array = pyshm.empty(1000, np.int16, shared=True)
    queue = ctx.Queue()
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=process_child, args=(array, queue, child_end))
    child.start()
    child_end.close()
    from_pipe = parent_end.recv()
    from_queue = queue.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    assert (array == 5).all()
    assert from_pipe.ctypes.data == array.ctypes.data
    assert from_queue.ctypes.data == array.ctypes.data + 4
    from_queue[0] = 77
    assert array[2] == 77


def write_seven(array):
    array[...] = 7
    return array


def test_pyshm_memory_through_another_exporter_goes_by_reference(pool):
    # arrays whose base chain ends at another exporter (a DLPack capsule, a ctypes object)
    # over pyshm memory are found by address: the same memory, not a copy (before: by value,
    # the worker's write lost)
    import ctypes

    a = pyshm.zeros(1 << 16, np.float32, shared=True)
    pointer = ctypes.cast(a.ctypes.data + 400, ctypes.POINTER(ctypes.c_float))
    views = [np.from_dlpack(a), np.from_dlpack(a[::-3]), np.ctypeslib.as_array(pointer, (100,)),
             np.from_dlpack(a[10:20])]
    for view in views:
        assert _owner_of(view) is None  # (its chain does not lead to pyshm)
        a[:] = 0
        back = pool.apply(write_seven, (view,))
        assert (view == 7).all() and back.ctypes.data == view.ctypes.data
        assert back.strides == view.strides and back.shape == view.shape
        assert int((a == 7).sum()) == view.size  # (that view's elements, no others)
    # pyshm.ref of such a view (before: a ValueError, "truth value of an array")
    ref = pyshm.ref(np.from_dlpack(a[5:9]))
    assert _owner_of(ref.array) is not None and ref.array.ctypes.data == a[5:].ctypes.data
    assert pool.apply(write_seven, (ref,)).ctypes.data == a[5:].ctypes.data and a[8] == 7
    # read-only stays read-only; memory pyshm does not hold goes by value
    frozen = np.ctypeslib.as_array(pointer, (100,))
    frozen.flags.writeable = False
    assert not pool.apply(readonly_flag, (frozen,))
    plain = np.frombuffer(bytearray(64), np.uint8)
    assert len(ForkingPickler.dumps(plain)) > 64
    back = pool.apply(write_seven, (plain,))
    assert (back == 7).all() and (plain == 0).all()


def readonly_flag(array):
    return array.flags.writeable


def test_foreign_arrays_and_plain_pickle_go_by_value():
    plain = np.arange(1000, dtype=np.float64)
    payload = ForkingPickler.dumps(plain)
    assert len(payload) > plain.nbytes  # numpy's own pickling: the bytes themselves
    shared = pyshm.copy(plain, shared=True)
    assert len(ForkingPickler.dumps(shared)) < 1000  # a reference, not 8000 bytes
    # plain pickle never uses fds: by value
    copy = pickle.loads(pickle.dumps(shared))
    assert (copy == plain).all() and copy.ctypes.data != shared.ctypes.data
    copy[0] = -1
    assert shared[0] == 0
    # protocol 5: the buffer goes out of band, without a copy
    buffers = []
    data = pickle.dumps(shared, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and len(data) < 1000
    raw = buffers[0].raw()
    assert np.frombuffer(raw, np.float64).ctypes.data == shared.ctypes.data
    again = pickle.loads(data, buffers=buffers)
    assert (again == plain).all()
    # a Storage pickles by value too, to a private storage
    storage = pyshm.storage_of(shared)
    for protocol in (2, 4, 5):
        clone = pickle.loads(pickle.dumps(storage, protocol=protocol))
        assert isinstance(clone, pyshm.Storage) and not clone.is_shared
        assert clone.asarray().tobytes() == storage.asarray().tobytes()
    # a pickle of a Storage made by pyshm 0.1 or 0.2, which named pyshm.reduction's function
    old = b"\x80\x03cpyshm.reduction\n_storage_from_bytes\nC\x03abc\x85R."
    clone = pickle.loads(old)
    assert isinstance(clone, pyshm.Storage) and clone.asarray().tobytes() == b"abc"


def test_forked_child_never_allocates_from_the_parents_slab():
    pyshm.empty(8, np.uint8, shared=True)  # a current slab exists
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=allocate_in_child, args=(child_end,))
    child.start()
    child_address = parent_end.recv()
    child.join(30)
    mine = pyshm.empty(16, np.uint8, shared=True)
    assert (mine == 0).all()  # the child's 0xAA went to a slab of its own
    assert mine.ctypes.data != child_address or (mine == 0).all()


# ---- one fd fetch per message, not per array ----------------------------------------------------


def test_a_message_of_in_place_arrays_needs_few_fetches(pool):
    n = 600
    # above the slab threshold (64 KiB): 1 memfd each
    arrays = [pyshm.share_memory_(pyshm.empty(17 << 10, np.int32)) for _ in range(n)]
    for i, a in enumerate(arrays):
        a[0] = i
    before, _ = pool.apply(fetches_and_touch, ([],))
    after, firsts = pool.apply(fetches_and_touch, (arrays,))  # one message, 600 memfds
    assert firsts == list(range(n))
    assert all(a[1] == 7 for a in arrays)  # the worker wrote our memory
    assert 1 <= after - before <= -(-n // 250)
    # a second message of the same arrays: none of them is mapped in the worker any more
    # (they were dropped there), each fetch still returns many
    again, _ = pool.apply(fetches_and_touch, (arrays[::-1],))
    assert 1 <= again - after <= -(-n // 250)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_extras_one_worker_got_stay_fetchable_by_another(method):
    # Arrays made on the fly and dropped by the sender right after pickling, spread over two
    # workers: a worker's fetch also hands it the other worker's memfds, which must not
    # release the sender's hold on them.
    def arrays():
        for i in range(400):
            a = pyshm.share_memory_(pyshm.empty(256, np.int64))
            a[0] = i
            yield a

    with mp.get_context(method).Pool(2) as p:
        results = list(p.imap(first_element, arrays(), chunksize=40))
    assert [value for value, _ in results] == list(range(400))


def test_extras_come_only_from_the_same_message():
    # The fetch for one message hands out the fds of that message's other memfds, and never
    # those of another message the same thread pickled right after it (maybe for another
    # receiver): only the holder of a pickle gets the memory it names.
    ctx = mp.get_context("fork")
    parent_end, child = start_with_pipe(ctx, receive_and_watch_extras)
    # above the slab threshold (64 KiB), so each has a memfd of its own
    first = pyshm.share_memory_(pyshm.empty(8193, np.int64))
    first[0] = 5
    others = [pyshm.share_memory_(pyshm.empty(8193, np.int64)) for _ in range(100)]
    payload = ForkingPickler.dumps(first)
    ForkingPickler.dumps(others)  # pickled after `first` by this thread, never sent
    parent_end.send_bytes(payload)
    value, held, extra_fds, held_later = parent_end.recv()
    assert value == 5
    assert held == 0 and extra_fds <= 1  # the one fd the child keeps for `first`
    assert held_later == 0
    assert parent_end.recv() <= 1
    child.join(30)
    assert child.exitcode == 0


def unpickle_and_report(conn):
    payload = conn.recv_bytes()
    arrays = pickle.loads(payload)
    conn.send((reduction.fetch_count(), [int(a[0]) for a in arrays]))


def test_a_message_of_300_memfds_costs_one_fetch():
    ctx = mp.get_context("spawn")
    parent_end, child = start_with_pipe(ctx, unpickle_and_report)
    arrays = [pyshm.share_memory_(pyshm.empty(8193, np.int64)) for _ in range(300)]
    for i, a in enumerate(arrays):
        a[0] = i
    parent_end.send_bytes(ForkingPickler.dumps(arrays))
    fetches, firsts = parent_end.recv()
    child.join(30)
    assert firsts == list(range(300)) and fetches == 1


# ---- read-only sharing and seals --------------------------------------------------------------


def test_readonly_sharing(pool):
    array = pyshm.copy(np.full(4096, 3, np.uint8))
    assert pyshm.share_readonly(array) is array
    assert array.flags.writeable
    array[0] = 11  # the owner keeps writing
    probe = pool.apply(readonly_probe, (array,))
    assert probe == READONLY_SEEN
    # a slab array cannot be sealed alone
    small = pyshm.empty(10, np.uint8, shared=True)
    with pytest.raises(ValueError, match="slab"):
        pyshm.share_readonly(small)
    with pytest.raises(TypeError):
        pyshm.share_readonly(np.zeros(3))


def test_receiver_cannot_resize(pool):
    array = pyshm.copy(np.arange(2048, dtype=np.int32), shared=True)
    assert pool.apply(truncate_probe, (array,)) == [errno.EPERM, errno.EPERM]
    assert (array == np.arange(2048)).all()  # owner unaffected (no SIGBUS either)


# ---- faults -----------------------------------------------------------------------------------


def test_sigkilled_worker_leaves_data_and_no_fds(pool):
    ctx = pool.ctx
    array = pyshm.empty(5000, np.int32, shared=True)
    array[:] = 1
    big = pyshm.copy(np.full(50_000, 2, np.int16), shared=True)
    ForkingPickler.dumps(array)  # the fd server runs before the baseline is taken
    import gc

    gc.collect()
    baseline = open_fd_count()
    child = ctx.Process(target=write_then_die, args=(array,))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert (array == 9).all()  # what it wrote before dying is there, nothing else changed
    with ctx.Pool(1) as p:
        p.apply_async(write_and_sleep, (big,))
        deadline = time.monotonic() + 30
        while big[-1] != 3 and time.monotonic() < deadline:  # the worker is using it now
            time.sleep(0.01)
        worker = p._pool[0]
        os.kill(worker.pid, signal.SIGKILL)  # mid-use (an idle worker would hold the
        worker.join(30)  # queue's lock and hang Pool.terminate: a CPython limitation)
        p.terminate()
    del p, worker, child
    gc.collect()
    assert (big == 3).all() and (array == 9).all()
    assert open_fd_count() <= baseline  # (fewer: a hold released by a late acknowledgement)


def test_out_of_fds_while_sharing_raises_and_changes_nothing(tmp_path):
    script = textwrap.dedent(
        """
        import os, resource, numpy as np, pyshm
        from multiprocessing.reduction import ForkingPickler
        a = pyshm.copy(np.arange(100000, dtype=np.int64))
        address = a.ctypes.data
        used = len(os.listdir('/proc/self/fd')) - 1  # minus listdir's own fd
        resource.setrlimit(resource.RLIMIT_NOFILE, (used, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        for what in ('send', 'empty', 'slab'):
            try:
                if what == 'send':
                    ForkingPickler.dumps(a)
                elif what == 'empty':
                    pyshm.empty(1 << 20, shared=True)
                else:
                    pyshm.empty(16, shared=True)
            except OSError as exc:
                assert exc.errno in (24, 23), exc
                assert str(exc), exc
                print(what, 'EMFILE', flush=True)
            else:
                raise SystemExit(what + ' did not fail')
        assert not pyshm.is_shared(a) and a.ctypes.data == address
        assert (a == np.arange(100000)).all()
        try:
            pyshm.empty(1 << 47, np.uint8, shared=True)
        except (MemoryError, OSError) as exc:
            print('huge', type(exc).__name__, flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["send EMFILE", "empty EMFILE", "slab EMFILE"]
    assert done.stdout.split("\n")[3].startswith("huge ")


def _token(array):
    """The rebuild function and its arguments for `array`, with its token made (no batch: the
    token carries a batch of its own) as the receiver gets it."""
    func, args = reduction.reduce_ndarray(array)
    _, (token,) = args[1].__reduce__()
    return func, [None, token, *args[2:]]


def test_a_dtype_the_array_interface_cannot_describe_comes_back_whole():
    # overlapping fields: dtype.descr refuses them, so the receiver takes the flat path; the
    # storage keeps exactly its references
    overlapping = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<i4"],
                            "offsets": [0, 0], "itemsize": 4})
    base = pyshm.zeros(16, np.uint8, shared=True)
    view = base.view(overlapping)
    handle = _owner_of(base).handle
    refs = _ffi.lib.lshm_storage_refcount(handle)
    back = pickle.loads(ForkingPickler.dumps(view))
    assert back.dtype == overlapping and back.ctypes.data == view.ctypes.data
    base[:4] = 7
    assert back["a"][0] == back["b"][0] == int.from_bytes(bytes([7] * 4), "little")
    del back
    gc.collect()
    assert _ffi.lib.lshm_storage_refcount(handle) == refs


def test_views_are_sent_at_their_own_offset():
    # the sender reads a view's data pointer inside numpy's object (a probed offset): every
    # view must come back at its own address, with its own strides
    base = pyshm.zeros(4096, np.uint8, shared=True)
    base[:] = np.arange(4096) % 251
    two_d = base.reshape(64, 64)
    for view in (base[100:], base[::-1], base[7::3], base[4095:], two_d[3:, ::-2], two_d.T):
        back = pickle.loads(ForkingPickler.dumps(view))
        assert back.ctypes.data == view.ctypes.data
        assert np.array_equal(back, view) and back.strides == view.strides


def storages_made_on_demand(arrays):
    """In the receiver, for arrays of a memfd mapped here already (the second one): their C
    storages are made when first asked for, once even when two threads ask at once, and
    given back when the array goes; the array is sent back after a write."""
    from pyshm import _memory as pyshm_memory

    _, b = arrays
    before = len(pyshm_memory.REFERENCES)
    assert pyshm.is_shared(b) and len(pyshm_memory.REFERENCES) == before  # (no view made)
    storages: list = []

    def ask():
        for _ in range(200):
            storages.append(pyshm.storage_of(b))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = len(pyshm_memory.REFERENCES) - before
    same = all(st == storages[0] for st in storages)
    refs = _ffi.lib.lshm_storage_refcount(_owner_of(b).handle)
    for st in storages:
        st.close()
    refs_after = _ffi.lib.lshm_storage_refcount(_owner_of(b).handle)
    b[0] = 99
    probe = b[1:]  # a view, sent and dropped: its owner's reference goes with it
    del probe
    gc.collect()
    return made, same, refs - refs_after, pyshm.is_shared(b), b


def test_arrays_of_a_memfd_mapped_already_make_their_storage_on_demand(pool):
    a = pyshm.zeros(64, np.int64, shared=True)
    b = pyshm.zeros(64, np.int64, shared=True)  # the same slab: mapped when `a` arrives
    pool.apply(first_element, (a,))
    made, same, released, shared, back = pool.apply(storages_made_on_demand, ([a, b],))
    assert (made, same, released, shared) == (1, True, 400, True)
    assert b[0] == 99 and back.ctypes.data == b.ctypes.data


def make_readonly_and_reshape(array):
    array.flags.writeable = False
    return array, array.reshape(8, 8)


def test_own_arrays_come_back_as_themselves(pool):
    a = pyshm.zeros(64, np.int64, shared=True)
    back = pool.apply(add_one, (a,))
    # the layout it left with: a new view of the very array
    assert back is not a and back.base is a and (a == 1).all()
    back[1] = 5
    assert a[1] == 5
    # not writeable, or another layout, over the same storage: new arrays at the same address
    readonly, square = pool.apply(make_readonly_and_reshape, (a,))
    assert not readonly.flags.writeable and a.flags.writeable
    with pytest.raises(ValueError):  # as the receiver made it: for good
        readonly.flags.writeable = True
    assert readonly.ctypes.data == square.ctypes.data == a.ctypes.data
    assert square.shape == (8, 8) and square[0, 1] == 5
    assert pyshm.storage_of(square) == pyshm.storage_of(a)
    # the array that was sent is gone (its storage is not): the same bytes come back
    view = a[2:]
    payload = ForkingPickler.dumps(view)
    del view
    gc.collect()
    again = pickle.loads(payload)
    assert again.ctypes.data == a.ctypes.data + 16 and again.shape == (62,)
    assert pyshm.storage_of(again) == pyshm.storage_of(a)


def ident(x):
    return x


def metadata_of(array):
    return dict(array.dtype.metadata or {}), int(array[1])


def test_a_dtype_with_metadata_comes_back_whole(pool):
    # (dtype equality ignores metadata: h5py's enum dtypes carry theirs there)
    tagged = np.dtype(np.int32, metadata={"enum": {"red": 0, "blue": 1}})
    a = pyshm.zeros(64, tagged, shared=True)
    assert a.dtype.metadata == {"enum": {"red": 0, "blue": 1}}  # made with it
    a[1] = 1
    view = a[1:]
    assert pickle.loads(ForkingPickler.dumps(view)).dtype.metadata == tagged.metadata  # ours
    assert pool.apply(metadata_of, (a,)) == (tagged.metadata, 1)  # a receiver's
    back = pool.apply(ident, (view,))  # and back, as itself
    assert back.dtype.metadata == tagged.metadata and back.ctypes.data == view.ctypes.data


def test_an_array_of_ours_comes_back_only_as_its_token_says():
    a = pyshm.zeros(512, np.int64, shared=True)
    func, args = _token(a)
    token = tuple(args[1][:-1]) + (None,)
    shape, dtype, strides, start, writeable = args[2:]
    for bad_start in (0.0, 1e-9):  # a start that is no index: refused, as by the general path
        with pytest.raises(pickle.UnpicklingError):
            func(None, token, shape, dtype, strides, bad_start, writeable)
    # the array changed its layout meanwhile (another thread): the token's layout comes back
    payload = ForkingPickler.dumps(a)
    a.shape = (8, 64)
    back = pickle.loads(payload)
    assert back.shape == (512,) and back.ctypes.data == a.ctypes.data
    # a key no memfd can have
    huge_key = ((2 ** 70, 1),) + token[1:]
    with pytest.raises(pickle.UnpicklingError):
        func(None, huge_key, shape, dtype, strides, start, writeable)
    # fields a plain pickle can hold that no int or bool can come from: refused as bad tokens
    key, address, size, offset, nbytes, readonly, secret, _ = token
    inf = float("inf")
    for bad in [((inf, 1), address, size, offset, nbytes, readonly, secret, None),
                (key, address, inf, offset, nbytes, readonly, secret, None),
                (key, address, size, -inf, nbytes, readonly, secret, None),
                (key, address, size, offset, float("nan"), readonly, secret, None),
                (key, address, size, offset, nbytes, readonly, secret, (inf, secret)),
                (key, address, size, offset, nbytes, np.array([True, False]), secret, None)]:
        with pytest.raises(pickle.UnpicklingError, match="bad pyshm token"):
            func(None, bad, shape, dtype, strides, start, writeable)


HOSTILE_LAYOUTS = [((1000,), "u1", (1,), 0), ((2,), "u1", (-1,), 0), ((2,), "u1", (10 ** 9,), 0),
                   ((2, 3), "u1", (1,), 0), ((1,), "u1", (1,), -1), ((1,), "u1", (1,), 100),
                   ((2,), "i8", (8,), 90), ((1,), "u1", (1,), 2 ** 70), ((1,), "u1", (1.0,), 0),
                   ((1,), "O", (8,), 0)]


def rebuild_hostile(args):
    """In a receiver that has the memfd mapped already: each hostile token or layout raises
    UnpicklingError (never a crash or an array); a good one still works."""
    array, token = args
    out = []
    key, address, size, offset, nbytes, readonly, secret, _ = token
    tokens = [(key, address, size + 4096, offset, nbytes, readonly, secret, None),
              (key, address, size, size - 10, 100, readonly, secret, None),
              (key, address, size, offset, -1, readonly, secret, None),
              (key, address, size, offset, nbytes, readonly, b"short", None),
              ([1, 2], address, size, offset, nbytes, readonly, secret, None)]
    for bad in tokens:
        try:
            reduction.rebuild_ndarray(None, bad, (100,), np.dtype(np.uint8), (1,), 0, True)
            out.append("made")
        except pickle.UnpicklingError:
            out.append("refused")
    for shape, dt, st, at in HOSTILE_LAYOUTS:
        try:
            reduction.rebuild_ndarray(None, token, shape, np.dtype(dt), st, at, True)
            out.append("made")
        except pickle.UnpicklingError:
            out.append("refused")
    good = reduction.rebuild_ndarray(None, token, (50,), np.dtype(np.uint8), (2,), 0, True)
    return out, int(good[1]), good.ctypes.data == array.ctypes.data, type(good.base).__name__


def test_hostile_layouts_in_a_receiver_that_has_the_memfd_mapped(pool):
    a = pyshm.empty(100, np.uint8, shared=True)
    a[:] = np.arange(100)
    _, args = _token(a)
    token = tuple(args[1][:-1]) + (None,)  # the message's batch, not one of its own
    out, second, same, owner = pool.apply(rebuild_hostile, ((a, token),))
    assert out == ["refused"] * len(out) and len(out) == 5 + len(HOSTILE_LAYOUTS)
    assert second == 2 and same and owner == "_ReceivedOwner"  # (the receiver's quick path)


def elsewhere(address):
    """`address` as a sender's elsewhere would be (another machine, or a VM restored from
    the same snapshot): the same form, nobody here listening."""
    return address[:-8] + (b"00000000" if address[-8:] != b"00000000" else b"11111111")


def rebuild_from_elsewhere(args):
    """In a receiver that has the memfd mapped: the token as a sender elsewhere would make
    it, then as it came."""
    array, token = args
    key, address, size, offset, nbytes, readonly, _, solo = token
    try:
        reduction.rebuild_ndarray(None, (key, elsewhere(address), size, offset, nbytes,
                                         readonly, os.urandom(16), solo), (100,),
                                  np.dtype(np.uint8), (1,), 0, True)
        out = "made"
    except pyshm.DeliveryError as exc:
        out = str(exc)
    good = reduction.rebuild_ndarray(None, token, (100,), np.dtype(np.uint8), (1,), 0, True)
    return out, good.ctypes.data == array.ctypes.data


def test_a_token_of_a_sender_elsewhere_never_names_memory_here(pool):
    # memfds are named by this kernel's numbers (device, inode), which a sender on another
    # machine (or a VM restored from the same snapshot) can share with memory here, with the
    # same sizes (the same program on every node): a token whose sender cannot be reached
    # from here is refused before any lookup, so it never becomes memory of ours, nor memory
    # mapped here, whatever its numbers
    a = pyshm.empty(100, np.uint8, shared=True)
    a[:] = 5
    func, args = _token(a)
    key, address, size, offset, nbytes, readonly, secret, solo = args[1]
    assert func(None, args[1], *args[2:]).ctypes.data == a.ctypes.data  # (as it came: ours)
    # (a sender elsewhere has secrets of its own; one with ours is ours, wherever it is)
    foreign = (key, elsewhere(address), size, offset, nbytes, readonly, os.urandom(16), solo)
    with pytest.raises(pyshm.DeliveryError, match="cannot be reached"):
        func(None, foreign, *args[2:])
    with pytest.raises(pyshm.DeliveryError, match="cannot be reached"):
        reduction._rebuild_storage(None, foreign)
    rest = [size, offset, nbytes, readonly, secret, solo]
    for bad in (address.decode("latin-1"), address + b"-" * 200, b"\0other" + address[7:]):
        with pytest.raises(pickle.UnpicklingError, match="no sender's address"):
            func(None, (key, bad, *rest), *args[2:])
    token = tuple(args[1][:-1]) + (None,)
    out, same = pool.apply(rebuild_from_elsewhere, ((a, token),))
    assert "cannot be reached" in out and same


@pytest.fixture
def exported():
    """A shared array and its token (made before no_fd_leak looks: the first export starts
    this process's fd server, whose socket and selector stay open for good)."""
    a = pyshm.empty(100, np.uint8, shared=True)
    func, args = _token(a)
    for fd in _channel.fetch(args[1][1], [])[0]:  # (a round trip: the server is serving)
        os.close(fd)
    return a, func, args


def test_hostile_payloads_raise(exported, no_fd_leak, tmp_path):
    a, func, args = exported
    key, address, size, offset, nbytes, readonly, secret, solo = args[1]
    unknown = (key[0], key[1] + 12345)
    guess = bytes(16)
    bad_tokens = [
        (key, address, size, offset, size + 1, readonly, secret, solo),  # larger than the memfd
        (key, address, size, size - 10, 100, readonly, secret, solo),  # past the end
        (key, address, size + 4096, offset, nbytes, readonly, secret, solo),  # lies about size
        (unknown, address, size, offset, nbytes, readonly, secret, solo),  # a memfd nobody sent
        (unknown, b"\0pyshm-nobody", size, offset, nbytes, readonly, secret, solo),  # no server
        (unknown, "not bytes", size, offset, nbytes, readonly, secret, solo),
        (unknown, b"/etc/passwd", size, offset, nbytes, readonly, secret, solo),
        (unknown, address, size, offset, nbytes, readonly, guess, None),  # a guessed secret
        (unknown, address, size, offset, nbytes, readonly, b"short", None),
        (unknown, address, size, offset, nbytes, readonly, secret, (-1, guess)),  # bad batch
        (key, address, size, offset, nbytes, readonly, secret),  # no batch field
        "garbage",
    ]
    for token in bad_tokens:
        with pytest.raises((pickle.UnpicklingError, OSError, ValueError)):
            func(None, token, *args[2:])
    # layouts that do not fit the storage (100 bytes): too long, before its start, past its
    # end, lengths that disagree, object dtype
    token, _, dtype, strides, start, writeable = args[1:]
    for shape, dt, st, at in [((1000,), dtype, strides, start), ((2,), dtype, (-1,), 0),
                              ((2,), dtype, (10 ** 9,), 0), ((2, 3), dtype, (1,), 0),
                              ((1,), dtype, (1,), -1), ((1,), dtype, (1,), 100),
                              ((2,), np.dtype(np.int64), (8,), 90),
                              ((np.int64(200),), dtype, (1,), 0), ((1,), np.dtype(object), (8,), 0)]:
        with pytest.raises(pickle.UnpicklingError):
            func(None, token, shape, dt, st, at, writeable)
    # a layout that fits but numpy cannot make (too many items): refused, not a ValueError
    with pytest.raises(pickle.UnpicklingError):
        func(None, token, (2 ** 40, 2 ** 40), dtype, (0, 0), 0, writeable)
    # and those that do, read back exactly: reversed, strided, the last byte
    a[:] = np.arange(100, dtype=np.uint8)
    for shape, st, at, want in [((100,), (-1,), 99, a[::-1]), ((10,), (10,), 5, a[5::10]),
                                ((1,), (1,), 99, a[99:]), ((5, 2), (20, 3), 1, None)]:
        got = func(None, token, shape, dtype, st, at, writeable)
        if want is None:
            want = np.lib.stride_tricks.as_strided(a[1:], shape, st)
        assert np.array_equal(got, want) and pyshm.storage_of(got) == pyshm.storage_of(a)
    # truncated pickle
    payload = ForkingPickler.dumps(a)
    for cut in (1, len(payload) // 2, len(payload) - 1):
        with pytest.raises((pickle.UnpicklingError, EOFError, ValueError)):
            pickle.loads(payload[:cut])

    # a hostile sender that hands out foreign fds for the key it named
    pipe_r, pipe_w = os.pipe()
    regular = open(tmp_path / "f", "wb+")
    regular.truncate(1 << 16)
    hostile = [pipe_r, regular.fileno()]
    try:  # (a hugetlbfs memfd: it answers F_GET_SEALS, but maps only in whole huge pages)
        hostile.append(os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
                                       | os.MFD_HUGETLB))
        os.ftruncate(hostile[-1], 2 << 20)
    except OSError:
        pass
    try:
        for fd in hostile:
            st = os.fstat(fd)
            fake = _FakeSender(fd)
            token = ((st.st_dev, st.st_ino), fake.address, 4096, 0, 100, False, guess, None)
            # (an UnpicklingError, no OSError: multiprocessing reads an OSError from a result
            # pipe as "the pipe is closed"; before, F_GET_SEALS's EINVAL came through)
            with pytest.raises(pickle.UnpicklingError, match="not a memfd"):
                func(None, token, *args[2:])
            fake.close()
            assert fake.served  # (the refusal is of the fd it handed out)
    finally:
        os.close(pipe_r)
        os.close(pipe_w)
        regular.close()
        for fd in hostile[2:]:
            os.close(fd)


class _FakeSender:
    def __init__(self, fd):
        self.address = b"\0pyshm-fake-" + os.urandom(8).hex().encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(self.address)
        self.sock.listen(1)
        self.thread = threading.Thread(target=self._serve, args=(fd,), daemon=True)
        self.thread.start()

    served = False

    def _serve(self, fd):
        while True:
            conn, _ = self.sock.accept()
            with conn:
                if conn.recv(1024):  # (nothing: a receiver making sure a sender is there)
                    socket.send_fds(conn, [b"\x01\x00"], [fd])  # "here is your fd"
                    self.served = True
                    return

    def close(self):
        self.thread.join(10)
        self.sock.close()


# ---- 100,000 arrays under ulimit -n 1024 -------------------------------------------------------

MANY_SCRIPT = """
import os, resource, sys, multiprocessing as mp, numpy as np, pyshm
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

def check(arrays):
    ok = all(int(a[0]) == i for i, a in enumerate(arrays))
    for a in arrays:
        a[1] = 7
    return ok, len(os.listdir('/proc/self/fd')), pyshm.reduction.segment_count()

if __name__ == '__main__':
    n = 100_000
    arrays = [pyshm.empty(512, np.int64, shared=True) for _ in range(n)]   # 4 KiB each
    for i, a in enumerate(arrays):
        a[0] = i
    ctx = mp.get_context(sys.argv[1])
    with ctx.Pool(1) as pool:
        ok, child_fds, child_segments = pool.apply(check, (arrays,))
    assert ok
    assert all(a[1] == 7 for a in arrays)
    fds = len(os.listdir('/proc/self/fd'))
    print(child_fds, child_segments, fds, pyshm.reduction.segment_count())
"""


@pytest.mark.parametrize("method", ["spawn"])
def test_100k_small_arrays_under_ulimit_1024(tmp_path, method):
    script = tmp_path / "many.py"
    script.write_text(MANY_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, str(script), method], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    child_fds, child_segments, fds, segments = map(int, done.stdout.split())
    assert 98 <= child_segments <= 110 and 98 <= segments <= 110
    assert child_fds < 300 and fds < 300


# ---- issue 9, point 6: share_readonly for arrays of any size; refusals change nothing --------


@pytest.mark.parametrize("nbytes", [1000, 100_000])
def test_readonly_sharing_any_size(pool, nbytes):
    array = pyshm.empty(nbytes, np.uint8)  # private: shared in place with a memfd of its own
    array[:] = 3
    assert pyshm.share_readonly(array) is array
    assert pyshm.is_shared(array) and array.flags.writeable
    array[0] = 11
    probe = pool.apply(readonly_probe, (array,))
    assert probe == READONLY_SEEN
    # the copy the refusals suggest works for a small array too
    small = pyshm.empty(10, np.uint8, shared=True)  # in a slab
    copy = pyshm.share_readonly(pyshm.copy(small))
    assert pool.apply(readonly_probe, (copy,))["writeable"] is False


def share_readonly_here(array):
    try:
        return pyshm.share_readonly(array) is array, bool(array.flags.writeable)
    except Exception as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("nbytes", [100_000, 102_400])
def test_share_readonly_of_memory_received_says_what_it_is_whatever_its_size(pool, nbytes):
    # A receiver maps the whole memfd, whole pages: an array of it that is not (100,000 bytes)
    # was refused with a ValueError saying its memfd held other arrays too (a slab, an
    # arena's buffer), where the same array in whole pages (102,400 bytes) got what it is:
    # read-only memory is read-only already, writable memory was handed out writable.
    readonly = pyshm.share_readonly(pyshm.copy(np.zeros(nbytes, np.uint8)))
    assert pool.apply(share_readonly_here, (readonly,)) == (True, False)
    writable = pyshm.share_memory_(pyshm.copy(np.zeros(nbytes, np.uint8)))
    name, message = pool.apply(share_readonly_here, (writable,))
    assert name == "ShmPermissionError" and "handed out writable" in message, message


def test_readonly_refusals_change_nothing():
    small = pyshm.empty(100, np.uint8, shared=True)  # a slab view
    storage = pyshm.storage_of(small)
    flags, address = storage.flags, storage.data_ptr
    seals = fcntl.fcntl(storage.fd, fcntl.F_GET_SEALS)
    with pytest.raises(ValueError, match="slab") as info:
        pyshm.share_readonly(small)
    assert "pyshm.share_readonly(pyshm.copy(array))" in str(info.value)
    assert storage.flags == flags and storage.data_ptr == address and pyshm.is_shared(small)
    assert fcntl.fcntl(storage.fd, fcntl.F_GET_SEALS) == seals
    # a shared arena's tensor views part of the arena's memfd: refused the same way
    arena = pyshm.Arena([4096, 4096], [0, 0], [1, 1], shared=True).allocate()
    tensor = arena.array(1)
    with pytest.raises(ValueError, match="slab"):
        pyshm.share_readonly(tensor)
    assert fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS) & reduction.F_SEAL_FUTURE_WRITE == 0
    # a private arena's tensor cannot be shared in place: refused, and still private
    private = pyshm.Arena([4096], [0], [1]).allocate()
    p = private.array(0)
    with pytest.raises(BufferError):
        pyshm.share_readonly(p)
    assert not pyshm.is_shared(p)
    # a whole memfd of its own (shared=True above 64 KiB) is sealed fine
    big = pyshm.empty(100_000, np.uint8, shared=True)
    pyshm.share_readonly(big)
    assert fcntl.fcntl(pyshm.storage_of(big).fd, fcntl.F_GET_SEALS) & reduction.F_SEAL_FUTURE_WRITE


def test_readonly_after_a_writable_fd_says_to_copy():
    # (above the slab threshold: a memfd of its own; slab arrays are refused for another reason)
    array = pyshm.share_memory_(pyshm.empty(70_000, np.uint8))
    array[:] = 7
    fd = pyshm.storage_of(array).fd  # handed out writable
    # libshm seals an fd it hands out writable with F_SEAL_SEAL: nobody can add seals now.
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError, match=r"pyshm\.share_readonly\(pyshm\.copy\(array\)\)"):
        pyshm.share_readonly(array)
    assert pyshm.is_shared(array) and array.flags.writeable
    copy = pyshm.share_readonly(pyshm.copy(array))
    assert (copy == 7).all()
    assert fcntl.fcntl(pyshm.storage_of(copy).fd, fcntl.F_GET_SEALS) & reduction.F_SEAL_FUTURE_WRITE


# ---- the fd server outlives idle clients and requests it cannot serve -------------------------


def _fetch_own(array):
    """Ask this process's own fd server for the memfd of `array` (what a receiver does)."""
    _, args = _token(array)
    key, address, secret = args[1][0], args[1][1], args[1][6]
    (fd,), extras, _ = _channel.fetch(address, [(key, secret)])
    for _, _, extra in extras:
        os.close(extra)
    return fd


def test_an_idle_client_stalls_nobody():
    a = pyshm.empty(100, np.uint8, shared=True)
    address = _token(a)[1][1][1]
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.connect(address)  # and never sends anything
    try:
        start = time.monotonic()
        fd = _fetch_own(a)
        took = time.monotonic() - start
        assert fd is not None
        os.close(fd)
        assert took < 1.0, f"a fetch waited {took:.1f} s behind an idle connection"
    finally:
        idle.close()


def test_the_server_survives_a_closed_storage_it_was_serving():
    storage = pyshm.Storage(100_000)
    storage.share_memory_()
    ticket = reduction._export(storage)
    _, (token,) = ticket.__reduce__()
    key, address, secret = token[0], token[1], token[6]
    storage.close()  # the holder the server knows is closed now
    (fd,), _, _ = _channel.fetch(address, [(key, secret)])
    assert fd is None  # nothing to hand out, and no exception in the server
    thread = _channel.state.server.thread
    a = pyshm.empty(100, np.uint8, shared=True)
    fd = _fetch_own(a)
    assert fd is not None and thread.is_alive()
    os.close(fd)


def test_zero_itemsize_array_goes_by_value(pool):
    # an array of a zero-size dtype has items but no bytes: it went by reference and the
    # receiver could not rebuild it (the worker died unpickling the task: apply hung)
    for a in (pyshm.empty(3, "V0"), pyshm.empty(4, np.dtype([])), pyshm.empty((2, 5), "V0")[:, ::2]):
        assert a.size and a.nbytes == 0
        assert pool.apply_async(np.shape, (a,)).get(timeout=60) == a.shape
