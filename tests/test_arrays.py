"""numpy arrays backed by pyshm storages: views keep aliasing across share_memory_."""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyshm


def test_empty_zeros_copy_basics():
    a = pyshm.empty((3, 4), np.int32)
    assert isinstance(a, np.ndarray)
    assert a.shape == (3, 4) and a.dtype == np.int32 and a.flags.c_contiguous
    assert a.flags.writeable
    assert (a == 0).all()
    z = pyshm.zeros(5)
    assert z.dtype == np.float64 and (z == 0).all()
    source = np.arange(12.0).reshape(3, 4)[:, ::2]  # non-contiguous source
    c = pyshm.copy(source)
    assert np.array_equal(c, source) and c.flags.c_contiguous
    assert pyshm.storage_of(c) is not None and not pyshm.is_shared(c)
    s = pyshm.copy(source, shared=True)
    assert pyshm.is_shared(s) and np.array_equal(s, source)


def test_base_keeps_storage_alive_after_handle_closed():
    a = pyshm.empty(1000, np.uint8)
    storage = pyshm.storage_of(a)
    storage.close()  # our handle only; the array holds its own reference
    a[:] = 9
    view = a[10:20]
    del a
    gc.collect()
    assert (view == 9).all()
    assert pyshm.storage_of(view).nbytes == 1000


def views_of(a):
    return {
        "slice": a[1:3],
        "step": a[::2],
        "transpose": a.T,
        "view_of_view": a[1:].T[::-1],
        "dtype_u8": a.view(np.uint8),
        "reshape": a.reshape(-1),
    }


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.complex128, np.uint16])
def test_views_before_share_see_writes_after_both_ways(dtype):
    a = pyshm.empty((4, 6), dtype)
    a[...] = np.arange(24).reshape(4, 6).astype(dtype)
    before = a.copy()
    views = views_of(a)
    address = a.ctypes.data
    storage = pyshm.storage_of(a)
    assert pyshm.share_memory_(a) is a
    assert a.ctypes.data == address == storage.data_ptr
    assert np.array_equal(a, before)
    for name, view in views.items():
        assert pyshm.is_shared(view), name
    # write through the array, read through each old view
    a[2, 3] = 99
    assert views["slice"][1, 3] == 99
    assert views["transpose"][3, 2] == 99
    assert views["reshape"][15] == 99
    # write through an old view, read through the array and the shared fd
    views["step"][0, 0] = 42
    assert a[0, 0] == 42
    raw = os.pread(storage.fd, a.nbytes, storage.fd_offset)
    assert np.frombuffer(raw, dtype).reshape(4, 6)[0, 0] == 42
    # and through a new attach of the fd
    attached = pyshm.Storage.attach(storage.fd, a.nbytes, offset=storage.fd_offset)
    attached = attached.asarray((4, 6), dtype)
    attached[3, 5] = 7
    assert a[3, 5] == 7 and views["view_of_view"][0, 2] == 7


def test_share_through_a_view_shares_the_whole_storage():
    a = pyshm.empty(10000, np.uint8)
    pyshm.share_memory_(a[5:7])
    assert pyshm.is_shared(a)


def test_an_array_made_through_the_buffer_protocol_is_the_same_memory():
    # np.frombuffer(memoryview(a)) aliases a's pages: pyshm sees it as a's memory (before:
    # is_shared said False, share_memory_ raised TypeError, and a fork's pickle sent a copy)
    from multiprocessing.reduction import ForkingPickler

    a = pyshm.zeros(1 << 16, np.uint8)
    view = np.frombuffer(memoryview(a)[16:], dtype=np.uint32)
    assert not pyshm.is_shared(view)
    pyshm.share_memory_(view)
    assert pyshm.is_shared(a) and pyshm.is_shared(view)
    assert pyshm.storage_of(view).data_ptr == pyshm.storage_of(a).data_ptr
    pid = os.fork()
    if pid == 0:  # (a forked child unpickles what a Pool worker would get)
        code = 1
        try:
            got = ForkingPickler.loads(ForkingPickler.dumps(view))
            got[0] = 0xABCDEF01
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert int(view[0]) == 0xABCDEF01 and bytes(a[16:20]) == (0xABCDEF01).to_bytes(4, "little")


@pytest.mark.parametrize("dtype", ["S0", "U0", ">U0"])
def test_a_string_dtype_of_no_length_holds_one_character_as_in_numpy(dtype):
    # (before: numpy's "data is NULL but array contains data" ValueError)
    for array in (pyshm.zeros(3, dtype), pyshm.zeros(3, dtype, shared=True),
                  pyshm.Storage(64).asarray((3,), dtype)):
        assert array.dtype.itemsize == np.zeros(3, dtype).dtype.itemsize
        assert array.dtype.kind == np.dtype(dtype).kind and array.shape == (3,)
        array[1] = "x"
        assert array[1] == array.dtype.type("x")


def test_share_is_idempotent():
    a = pyshm.zeros(100)
    pyshm.share_memory_(a)
    fd = pyshm.storage_of(a).fd
    pyshm.share_memory_(a)
    pyshm.share_memory_(a[::3])
    assert pyshm.storage_of(a).fd == fd


def test_readonly_array_can_be_shared_and_stays_readonly():
    a = pyshm.empty(100, np.int16)
    a[:] = 5
    ro = a.view()
    ro.flags.writeable = False
    pyshm.share_memory_(ro)
    assert pyshm.is_shared(a) and not ro.flags.writeable
    with pytest.raises(ValueError):
        ro[0] = 1
    a[0] = 3
    assert ro[0] == 3


@pytest.mark.parametrize(
    "foreign",
    [np.zeros(10), np.arange(5)[::2], bytearray(b"abc"), memoryview(b"xyz"), [1, 2, 3]],
)
def test_foreign_memory_type_error_points_to_copy(foreign):
    with pytest.raises(TypeError, match=r"pyshm\.copy\(array, shared=True\)"):
        pyshm.share_memory_(foreign)
    assert not pyshm.is_shared(foreign)
    assert pyshm.storage_of(foreign) is None


def test_the_array_functions_given_a_storage_answer_for_it():
    # pyshm.share_memory_(storage) raised TypeError saying a pyshm.Storage was "not backed by
    # a pyshm storage", and pyshm.is_shared(storage) said False for a shared one
    storage = pyshm.Storage(100_000)
    address = storage.data_ptr
    assert pyshm.is_shared(storage) is False
    assert pyshm.share_memory_(storage) is storage
    assert storage.is_shared and storage.data_ptr == address
    assert pyshm.is_shared(storage) is True
    assert pyshm.is_shared(pyshm.Storage(10, shared=True)) is True
    storage.close()
    with pytest.raises(ValueError, match="closed"):
        pyshm.share_memory_(storage)


@pytest.mark.parametrize("size", [4096, 3 << 20])  # (a slab's range; memory of its own)
def test_the_array_functions_find_pyshm_memory_through_dlpack(size):
    # numpy.from_dlpack(a) of a pyshm array ends its base chain at a DLPack capsule: is_shared
    # said False, storage_of None, share_memory_ and share_readonly raised TypeError, while
    # pickling (and pyshm.ref) found the same memory by address
    a = pyshm.empty(size, np.uint8)
    a[:] = 7
    address = a.ctypes.data
    b = np.from_dlpack(a)
    assert b.ctypes.data == address and pyshm.is_shared(b) is False
    assert pyshm.storage_of(b) == pyshm.storage_of(a)
    assert pyshm.share_memory_(b) is b
    assert pyshm.is_shared(a) and pyshm.is_shared(b)
    assert a.ctypes.data == b.ctypes.data == address and int(b[-1]) == 7
    c = pyshm.empty(size, np.uint8)
    d = np.from_dlpack(c)
    if size < (1 << 20):  # (a slab's range: refused, nothing changed)
        pyshm.share_memory_(c)
        with pytest.raises(ValueError, match="other storages"):
            pyshm.share_readonly(d)
    else:
        assert pyshm.share_readonly(d) is d
        assert pyshm.is_shared(c)
    numpy_own = np.from_dlpack(np.zeros(size, np.uint8))  # (numpy's memory: still not ours)
    assert pyshm.storage_of(numpy_own) is None and not pyshm.is_shared(numpy_own)
    with pytest.raises(TypeError):
        pyshm.share_memory_(numpy_own)


@pytest.mark.parametrize("bad", ["no", "", None, 2, 1.0, np.array([True, False])])
def test_shared_and_resizable_must_be_bools(bad):
    # shared="no" made shared memory (the string is true) where the caller meant private
    for make in (lambda: pyshm.empty(8, shared=bad), lambda: pyshm.zeros(8, shared=bad),
                 lambda: pyshm.copy(np.ones(8), shared=bad),
                 lambda: pyshm.Storage(8, shared=bad), lambda: pyshm.Storage(8, resizable=bad)):
        with pytest.raises(TypeError, match="must be a bool"):
            make()
    for good in (True, False, 1, 0, np.True_, np.False_):
        assert pyshm.is_shared(pyshm.empty(8, shared=good)) == bool(good)
        assert pyshm.Storage(8, resizable=good).resizable == bool(good)


def test_zero_size_and_scalar_shapes():
    empty = pyshm.empty((0, 5), np.float32)
    assert empty.shape == (0, 5)
    pyshm.share_memory_(empty)
    assert pyshm.is_shared(empty)
    scalar = pyshm.empty((), np.int64)
    scalar[()] = 5
    pyshm.share_memory_(scalar)
    assert scalar == 5


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError):
        pyshm.empty((-1, 2))
    with pytest.raises(TypeError):
        pyshm.empty("abc")
    with pytest.raises(OverflowError):
        pyshm.empty((1 << 40, 1 << 40), np.uint8)
    with pytest.raises(MemoryError):
        pyshm.empty(1 << 61, np.uint8)
    with pytest.raises(TypeError):
        pyshm.empty(3, object)


def test_structured_dtype_roundtrip():
    dtype = np.dtype([("x", np.int32), ("y", np.float64)])
    a = pyshm.empty(4, dtype)
    a["x"] = [1, 2, 3, 4]
    pyshm.share_memory_(a)
    assert a.dtype == dtype and list(a["x"]) == [1, 2, 3, 4]


def test_storage_asarray_bounds():
    storage = pyshm.Storage(100)
    assert storage.asarray().shape == (100,)
    assert storage.asarray((10,), np.int32, offset=40).shape == (10,)
    with pytest.raises(ValueError):
        storage.asarray((10,), np.int64, offset=40)
    with pytest.raises(ValueError):
        storage.asarray(dtype=np.int64, offset=-1)
    with pytest.raises(ValueError):
        storage.asarray(dtype=np.int64)  # 100 bytes are not whole int64 items


def test_interpreter_exit_with_live_storages_is_clean():
    code = textwrap.dedent(
        """
        import numpy as np, pyshm
        keep = [pyshm.empty(1 << 20, np.uint8) for _ in range(5)]
        for a in keep[:3]:
            pyshm.share_memory_(a)
        s = pyshm.Storage(4096, shared=True)
        view = keep[0][::2]
        import atexit
        atexit.register(lambda: print("atexit sees", int(view[0] + keep[1][5])))
        print("done")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout and "atexit sees 0" in result.stdout
    assert result.stderr == ""


def test_python_m_pyshm_works_from_the_repository_root(tmp_path):
    """README's first command runs `python -m pyshm ...` in the clone, where the source folder
    shadows the installed package: it must still find the installed library."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trace = tmp_path / "t.csv"
    trace.write_text("id,lower,upper,size\n0,0,2,100\n1,1,3,50\n2,2,4,80\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    result = subprocess.run([sys.executable, "-m", "pyshm", "plan", str(trace), "--alignment", "1"],
                            capture_output=True, text=True, timeout=60, cwd=root, env=env)
    assert result.returncode == 0, result.stderr
    assert "arena size   150" in result.stdout


COPY_WITH_A_HOLE = """
    import ctypes, difflib, errno, os, sys
    import numpy as np
    import pyshm
    import shm_harness as H
    nbytes, hole = int(sys.argv[1]), int(sys.argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    base = libc.mmap(None, nbytes, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    ctypes.memset(base, 7, nbytes)

    class Foreign:  # an array over memory pyshm does not own
        __array_interface__ = {"data": (base, False), "shape": (nbytes,), "typestr": "|u1",
                               "version": 3}

    source = np.asarray(Foreign())
    assert pyshm.copy(source, shared=True)[nbytes - 1] == 7  # (whole: copied)
    assert libc.munmap(ctypes.c_void_p(base + hole), 16384) == 0  # now a hole in it
    fds = maps = None
    for attempt in range(3):
        try:
            pyshm.copy(source, shared=True)
            print("copied")
        except pyshm.ShmError as exc:
            assert exc.errno == errno.EFAULT, exc
            # What a failed copy could leave: an fd, a memfd mapping, or an anonymous
            # reservation as big as the copy (64 MiB). Left out: glibc's malloc heaps and thread
            # stacks (the helper thread's, H.outside_malloc_heaps) and Python's own 1 MiB arenas
            # for the lists made here (anonymous growth below 8 MiB).
            # The source's own 64 MiB are not counted: mapped at a 64 MiB boundary it looks
            # like a malloc heap (left out), until an anonymous mapping just below merges with
            # its first line (then counted: 68 MB "more" in a newcomer run)
            lines = H.outside_malloc_heaps(H.maps_lines())
            anon = sum(hi - lo - max(0, min(hi, base + nbytes) - max(lo, base))
                       for lo, hi in (map(lambda x: int(x, 16), f[0].split("-"))
                                      for f in map(str.split, lines) if len(f) == 5))
            now = H.describe_fds(), [line for line in lines if "/memfd:" in line], anon
            if fds is not None:
                assert now[0] == fds, f"left fds behind: {fds} -> {now[0]}"
                assert now[1] == maps[1] and now[2] - maps[2] < 8 << 20, (
                    f"left mappings behind ({now[2] - maps[2]} anonymous bytes more):\\n"
                    + "\\n".join(difflib.unified_diff(maps[0], lines, lineterm="")))
            fds, maps = now[0], (lines, now[1], now[2])
            print("EFAULT")
"""


@pytest.mark.parametrize("huge", ["1", "0"])
@pytest.mark.parametrize("where", [1 / 16, 3 / 4])  # (a split copy: pwrite's half, memcpy's)
def test_a_shared_copy_of_foreign_memory_with_a_hole_is_an_error_not_a_crash(huge, where):
    nbytes = 64 << 20
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COPY_WITH_A_HOLE), str(nbytes),
         str(int(nbytes * where) // 4096 * 4096)],
        capture_output=True, text=True, timeout=120, env=dict(
            os.environ, LSHM_HUGE=huge, PYTHONPATH=os.pathsep.join(filter(None, [
                os.path.dirname(os.path.abspath(__file__)),  # (shm_harness)
                os.environ.get("PYTHONPATH", "")]))))
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.split() == ["EFAULT"] * 3


def test_array_owner_cannot_be_copied_or_pickled():
    # copy.copy(a.base) made a second owner of the storage handle with no reference of its
    # own: arrays over the copy read freed pages once the original was gone (SIGSEGV)
    import copy
    import pickle

    a = pyshm.empty(1 << 20, np.uint8)
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied"):
            attempt(a.base)
    assert pyshm.storage_of(a).refcount == 2  # the owner and this handle, nothing more


def test_a_bool_is_not_a_dimension():
    # numpy refuses np.empty(True) and np.empty((2, False)); pyshm made shape (1,) and (2, 0)
    for shape in (True, np.True_, (2, False), [np.False_]):
        with pytest.raises(TypeError, match="shape must be"):
            pyshm.empty(shape)
    with pytest.raises(TypeError, match="shape must be"):
        pyshm.Storage(8).asarray((True,))
