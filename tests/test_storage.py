"""pyshm.Storage: lifecycle, accessors, sharing, errors, fds."""

import ctypes
import errno
import os
import re
import signal
import stat
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import pyshm
from pyshm import _ffi
from conftest import after_c_calls, interrupted_at, memfd_held

PAGE = os.sysconf("SC_PAGE_SIZE")


def read_bytes(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


def test_create_accessors_and_close(no_fd_leak):
    storage = pyshm.Storage(10000)
    assert storage.nbytes == 10000
    assert storage.data_ptr % PAGE == 0  # whole pages: shareable in place
    assert not storage.is_shared
    assert storage.fd is None
    assert read_bytes(storage.data_ptr, 10000) == bytes(10000)  # zero-filled
    assert "private" in repr(storage)
    storage.close()
    storage.close()  # idempotent
    assert storage.closed
    assert "closed" in repr(storage)


def test_use_after_close_raises_instead_of_crashing():
    storage = pyshm.Storage(4096)
    storage.close()
    for action in (
        lambda: storage.nbytes,
        lambda: storage.data_ptr,
        lambda: storage.is_shared,
        lambda: storage.fd,
        storage.share_memory_,
        lambda: storage.copy_(pyshm.Storage(4096)),
        lambda: pyshm.Storage(4096).copy_(storage),
        lambda: storage.asarray(),
    ):
        with pytest.raises(ValueError, match="closed"):
            action()
    with pytest.raises(ValueError):
        with storage:
            pass


def test_context_manager_closes():
    with pyshm.Storage(100) as storage:
        assert storage.nbytes == 100
    assert storage.closed


def test_share_in_place_keeps_address_and_bytes(no_fd_leak):
    with pyshm.Storage(3 * PAGE + 5) as storage:
        address = storage.data_ptr
        ctypes.memset(address, 0x5A, storage.nbytes)
        assert storage.share_memory_() is storage
        assert storage.data_ptr == address
        assert storage.is_shared
        assert read_bytes(address, storage.nbytes) == b"\x5a" * storage.nbytes
        fd = storage.fd
        assert fd is not None and fd >= 0
        assert os.get_inheritable(fd) is False  # O_CLOEXEC
        assert stat.S_ISREG(os.fstat(fd).st_mode)
        # The fd sees the bytes, and a write through memory shows in the fd.
        ctypes.memset(address, 0x11, 1)
        assert os.pread(fd, 2, storage.fd_offset) == b"\x11\x5a"
        # Idempotent: the same fd, the same address.
        storage.share_memory_()
        assert storage.fd == fd and storage.data_ptr == address


def test_share_is_not_resizable_and_resize_before():
    storage = pyshm.Storage(100, resizable=True)
    assert storage.resizable
    ctypes.memset(storage.data_ptr, 7, 100)
    storage.resize_(200)
    assert storage.nbytes == 200
    assert read_bytes(storage.data_ptr, 200) == b"\x07" * 100 + bytes(100)
    storage.share_memory_()
    assert not storage.resizable
    with pytest.raises(PermissionError):
        storage.resize_(300)
    assert storage.nbytes == 200
    with pytest.raises(PermissionError):
        pyshm.Storage(10).resize_(20)  # not resizable


def test_created_shared_and_copy(no_fd_leak):
    source = pyshm.Storage(5000)
    ctypes.memset(source.data_ptr, 0xAB, 5000)
    target = pyshm.Storage(5000, shared=True)
    assert target.is_shared and target.fd is not None
    assert target.copy_(source) is target
    assert read_bytes(target.data_ptr, 5000) == b"\xab" * 5000
    with pytest.raises(ValueError):
        target.copy_(pyshm.Storage(4999))
    with pytest.raises(TypeError):
        target.copy_(b"not a storage")
    source.close()
    target.close()


def test_zero_byte_storage_shares():
    with pyshm.Storage(0) as storage:
        assert storage.nbytes == 0
        assert storage.data_ptr == 0
        storage.share_memory_()
        assert storage.is_shared
        assert os.fstat(storage.fd).st_size == 0


@pytest.mark.parametrize(
    "nbytes, error",
    [(-1, ValueError), (1 << 64, OverflowError), (2**63, OverflowError), (1.5, TypeError),
     ("10", TypeError), (None, TypeError)],
)
def test_bad_sizes(nbytes, error):
    with pytest.raises(error):
        pyshm.Storage(nbytes)


def test_unsatisfiable_size_is_memory_error():
    with pytest.raises(MemoryError) as info:
        pyshm.Storage(1 << 62)
    assert isinstance(info.value, OSError) and info.value.errno in (errno.ENOMEM, errno.EOVERFLOW)


@pytest.mark.parametrize("nbytes", [1 << 45, 1 << 62])
def test_shared_memory_bigger_than_the_machine_is_a_memory_error_at_once(nbytes, no_fd_leak):
    # every page of shared memory is allocated when it is made (no SIGBUS later): beyond RAM
    # and swap that only ends in the OOM killer, which kills whatever it picks on the machine
    # (before: a 32 TiB shared storage was allocated byte by byte into it). Not run on the old
    # code for that reason.
    import time

    started = time.monotonic()
    for make in (lambda: pyshm.Storage(nbytes, shared=True),
                 lambda: pyshm.zeros(nbytes, np.uint8, shared=True)):
        with pytest.raises(MemoryError, match="more than this machine") as info:
            make()
        assert info.value.errno == errno.ENOMEM
    assert time.monotonic() - started < 5


def test_error_carries_errno_and_library_message():
    with pytest.raises(pyshm.ShmError) as info:
        pyshm.Storage.attach(987654, 16)
    assert info.value.errno == errno.EBADF
    assert "lshm_storage_attach" in str(info.value)
    assert ".c:" in str(info.value)  # file:line of the library's thread-local message


def test_attach_validates_foreign_fds(tmp_path, no_fd_leak):
    regular = tmp_path / "file"
    regular.write_bytes(b"x" * 4096)
    with open(regular, "rb+") as handle:
        with pytest.raises(ValueError):
            pyshm.Storage.attach(handle.fileno(), 16)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ValueError):
            pyshm.Storage.attach(read_end, 16)
    finally:
        os.close(read_end)
        os.close(write_end)
    with pyshm.Storage(4096, shared=True) as storage:
        size = os.fstat(storage.fd).st_size  # its slab's memfd (4 MiB), not 4096
        with pytest.raises(ValueError, match="smaller"):
            pyshm.Storage.attach(storage.fd, size - storage.fd_offset + 4096,
                                 offset=storage.fd_offset)
        with pytest.raises(ValueError):
            pyshm.Storage.attach(storage.fd, 16, offset=-1)


def test_attach_sees_same_bytes_both_ways(no_fd_leak):
    with pyshm.Storage(8192) as storage:
        storage.share_memory_()
        # (a small storage lies at fd_offset of its slab's memfd)
        with pyshm.Storage.attach(storage.fd, 4096, offset=storage.fd_offset + 4096) as view:
            assert view.data_ptr != storage.data_ptr
            ctypes.memset(view.data_ptr, 0x42, 4096)
            assert read_bytes(storage.data_ptr + 4096, 4096) == b"\x42" * 4096
            ctypes.memset(storage.data_ptr + 4096, 0x43, 1)
            assert read_bytes(view.data_ptr, 1) == b"\x43"
        with pyshm.Storage.attach(storage.fd, 8192, offset=storage.fd_offset,
                                  readonly=True) as readonly:
            assert readonly.readonly
            array = readonly.asarray()
            assert not array.flags.writeable
            with pytest.raises(ValueError):
                array[0] = 1


def test_handles_compare_by_address():
    array = pyshm.empty(10)
    first, second = pyshm.storage_of(array), pyshm.storage_of(array)
    assert first == second and hash(first) == hash(second)
    assert first != pyshm.storage_of(pyshm.empty(10))


def test_from_handle_adopts_one_reference_and_keeps_what_the_memory_depends_on():
    import gc
    import weakref

    class Mapping:  # stands for what the memory depends on (a received mapping)
        pass

    base = pyshm.Storage(4096)
    handle = base._as_parameter_
    refs = _ffi.lib.lshm_storage_refcount(handle)
    dependency = Mapping()
    gone = weakref.ref(dependency)
    adopted = pyshm.Storage.from_handle(_ffi.lib.lshm_storage_retain(handle), keep=dependency)
    del dependency
    gc.collect()
    assert adopted == base and adopted.keep is gone() is not None  # the same storage, kept
    assert _ffi.lib.lshm_storage_refcount(handle) == refs + 1  # the reference handed over
    adopted.close()
    assert _ffi.lib.lshm_storage_refcount(handle) == refs
    del adopted
    gc.collect()
    assert gone() is None  # kept as long as the Storage, no longer
    assert base.keep is None  # memory of its own
    with pytest.raises(TypeError, match="StorageHandle, not int"):  # a bare address
        pyshm.Storage.from_handle(_ffi.address(handle))
    with pytest.raises(TypeError, match="not LP_lshm_segment"):  # a handle of another kind
        pyshm.Storage.from_handle(_ffi.SegmentHandle())
    with pytest.raises(ValueError, match="NULL"):
        pyshm.Storage.from_handle(_ffi.StorageHandle())


def test_the_binding_refuses_a_handle_of_another_kind_or_a_bare_address():
    # Every opaque type of lshm.h has its handle type, and each function takes only its own.
    header = (Path(__file__).resolve().parent.parent / "libshm/include/lshm.h").read_text()
    opaque = set(re.findall(r"^typedef struct (\w+) \1;$", header, re.MULTILINE))
    assert opaque == {name for name, cls in vars(_ffi).items() if isinstance(cls, type)
                      and issubclass(cls, _ffi.Opaque) and cls is not _ffi.Opaque}
    storage = pyshm.Storage(4096, shared=True)
    segment = _ffi.SegmentHandle()
    _ffi.lib.lshm_segment_create(1 << 20, 0, ctypes.byref(segment))
    arena = pyshm.Arena([64], [0], [0])
    try:
        handle = storage._as_parameter_
        assert _ffi.lib.lshm_storage_flags(storage) & _ffi.STORAGE_SHARED  # (its own kind)
        for wrong in (segment, arena._as_parameter_, _ffi.address(handle)):
            for call in (lambda h: _ffi.lib.lshm_storage_flags(h),
                         lambda h: _ffi.lib.lshm_storage_release(h),
                         lambda h: _ffi.share_unchecked(h),
                         lambda h: _ffi.export(h)):
                with pytest.raises(ctypes.ArgumentError):
                    call(wrong)
        with pytest.raises(ctypes.ArgumentError):
            _ffi.lib.lshm_segment_size(handle)
        with pytest.raises(ctypes.ArgumentError):
            _ffi.create_view(handle, 0, 4096, 0)
        with pytest.raises(ctypes.ArgumentError):
            _ffi.lib.lshm_arena_count(segment)
        assert storage.refcount == 1 and storage.is_shared  # nothing was released
        view = _ffi.create_view(segment, 4096, 4096, 0)
        assert _ffi.address(view) and _ffi.lib.lshm_storage_nbytes(view) == 4096
        assert _ffi.address(_ffi.lib.lshm_storage_segment(view)) == _ffi.address(segment)
        _ffi.lib.lshm_storage_release(view)
        assert _ffi.address(_ffi.StorageHandle()) == 0
    finally:
        _ffi.lib.lshm_segment_release(segment)
        arena.close()
        storage.close()


def test_fd_count_stable_over_10000_cycles():
    import gc

    # Small shared arrays come from a pooled slab: create one first so the pool's open slab is
    # part of the baseline, then the count must not move.
    warm = pyshm.empty(512, np.uint8, shared=True)
    del warm
    # Earlier tests' sends hold their memory for a while (reduction.KEEPALIVE_SECONDS); drop
    # those holds now, so their fds do not close in the middle of the count.
    pyshm.reduction._channel.drop_holds()
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(10000):
        with pyshm.Storage(4096) as storage:
            storage.share_memory_()
    for _ in range(1000):
        array = pyshm.empty(512, np.uint8, shared=True)
        del array
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


def test_flags_constants_match_library():
    storage = pyshm.Storage(1)
    assert storage.flags & _ffi.STORAGE_INPLACE == 0  # heap storage
    storage.share_memory_()
    assert storage.flags & _ffi.STORAGE_SHARED


def test_trim_pool_gives_back_recycled_memfds():
    import gc

    pyshm.trim_pool()
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    arrays = [pyshm.empty(1 << 19, np.uint8) for _ in range(4)]
    for a in arrays:
        a[:] = 1
        pyshm.share_memory_(a)
    del a, arrays
    gc.collect()
    kept = len(os.listdir("/proc/self/fd")) - before  # memfds kept for reuse
    assert kept == (0 if os.environ.get("LSHM_POOL_BYTES") == "0" else 4)
    # A recycled memfd carries the new bytes only (and leaves the pool).
    b = pyshm.empty(1 << 19, np.uint8)
    b[:] = 2
    pyshm.share_memory_(b)
    assert (b == 2).all()
    assert len(os.listdir("/proc/self/fd")) - before == max(kept, 1)
    assert pyshm.trim_pool() == max(kept - 1, 0)
    del b
    gc.collect()
    pyshm.trim_pool()
    assert len(os.listdir("/proc/self/fd")) == before
    # Arrays of 1 MiB up to 64 MiB are never kept: a fresh share is faster for them.
    c = pyshm.empty(4 << 20, np.uint8)
    pyshm.share_memory_(c)
    del c
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


# ---- issue 9, point 7: every number that crosses into C is checked -------------------------


def _arena():
    return pyshm.Arena([4096, 4096], [0, 0], [1, 1]).allocate()


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: pyshm.Storage(3.0), TypeError),
        (lambda: pyshm.Storage(np.float64(3)), TypeError),
        (lambda: pyshm.Storage(True), TypeError),
        (lambda: pyshm.Storage(-1), ValueError),
        (lambda: pyshm.Storage(2**64 + 10), OverflowError),
        (lambda: pyshm.Storage(10, resizable=True).resize_(2**64 + 10), OverflowError),
        (lambda: pyshm.Storage(10, resizable=True).resize_(20.0), TypeError),
        # ctypes used to truncate: 2**32 + 3 attached fd 3
        (lambda: pyshm.Storage.attach(2**32 + 3, 16), OverflowError),
        (lambda: pyshm.Storage.attach(-1, 16), ValueError),
        (lambda: pyshm.Storage.attach(3.0, 16), TypeError),
        (lambda: pyshm.Storage.attach(0, 16.0), TypeError),
        (lambda: pyshm.Storage.attach(0, 16, offset=2**64), OverflowError),
        (lambda: pyshm.Storage.attach(0, 16, offset=-1), ValueError),
        (lambda: pyshm.Storage(4096).asarray(offset=1.0), TypeError),
        (lambda: pyshm.Storage(4096).asarray(offset=-1), ValueError),
        (lambda: pyshm.Storage(4096).asarray(offset=2**64), OverflowError),
        (lambda: pyshm.empty((2.0,)), TypeError),
        (lambda: pyshm.empty((-1,)), ValueError),
        (lambda: pyshm.empty((2**64,)), OverflowError),
        # arena tensor indices: never wrapped to another tensor
        (lambda: _arena().array(-1), ValueError),
        (lambda: _arena().array(2**64), OverflowError),
        (lambda: _arena().array(2**64 + 1), OverflowError),
        (lambda: _arena().array(1.0), TypeError),
        (lambda: _arena().array(2), ValueError),
        (lambda: _arena().storage(2**64), OverflowError),
        (lambda: _arena().offset(-1), ValueError),
        (lambda: _arena().offset(2**64), OverflowError),
    ],
)
def test_numbers_into_c_are_checked(call, error):
    with pytest.raises(error):
        call()


def test_attach_with_a_wrapping_fd_does_not_attach_the_small_fd(no_fd_leak):
    with pyshm.Storage(4096, shared=True) as storage:
        fd = storage.fd
        with pytest.raises(OverflowError):
            pyshm.Storage.attach(fd + 2**32, 16)
        with pyshm.Storage.attach(fd, 16) as same:  # the fd itself still works
            assert same.nbytes == 16


# ---- issue 9, point 1: resize never frees memory under a live array --------------------------

_RESIZE_SCRIPT = r"""
import gc, sys
import numpy as np
import pyshm

case, target = sys.argv[1], int(sys.argv[2])
st = pyshm.Storage(1 << 20, resizable=True)
a = st.asarray()
a[-1] = 0x5A
a[0] = 0x11
address = st.data_ptr
if case == "array":
    holder = None
elif case == "view":
    holder = a[10:]
elif case == "memoryview":
    holder = memoryview(a)
elif case == "handle":
    holder = pyshm.storage_of(a)
if holder is not None:
    del a
    gc.collect()
try:
    st.resize_(target)
except BufferError as exc:
    assert isinstance(exc, OSError) and exc.errno == 16, exc  # EBUSY
    assert "in use" in str(exc)
else:
    raise SystemExit("resize_ was not refused")
assert st.nbytes == 1 << 20 and st.data_ptr == address  # nothing changed
if holder is None:
    assert a[-1] == 0x5A and a[0] == 0x11  # the old bytes, still mapped
    del a
elif case == "view":
    assert holder[-1] == 0x5A
elif case == "memoryview":
    assert holder[-1] == 0x5A and holder[0] == 0x11
    holder.release()
del holder
gc.collect()
st.resize_(target)  # nothing else holds it now
assert st.nbytes == target
b = st.asarray()
assert b[0] == 0x11
if target > 1 << 20:
    assert b[(1 << 20) - 1] == 0x5A and b[-1] == 0
print("ok")
"""


@pytest.mark.parametrize("target", [64 << 20, 4096], ids=["grow", "shrink"])
@pytest.mark.parametrize("case", ["array", "view", "memoryview", "handle"])
def test_resize_refused_while_arrays_views_or_exports_exist(case, target):
    # In a subprocess: on the old code the access after the resize is a SIGSEGV.
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _RESIZE_SCRIPT, case, str(target)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip() == "ok"


def test_resize_error_class():
    storage = pyshm.Storage(100, resizable=True)
    array = storage.asarray()
    with pytest.raises(pyshm.ShmBufferError) as info:
        storage.resize_(200)
    assert info.value.errno == errno.EBUSY
    assert isinstance(info.value, BufferError) and isinstance(info.value, OSError)
    del array
    storage.resize_(200)
    assert storage.nbytes == 200


@pytest.mark.parametrize("holder", ["array", "memoryview", "export"])
def test_resize_of_a_shared_storage_is_permission_error_even_while_held(holder):
    # A shared (or never resizable) storage can never be resized: PermissionError (EPERM), as
    # libshm says, not the BufferError (EBUSY) of a storage that deleting the arrays would
    # free. The old code looked at the refcount first, so any array, export or multiprocessing
    # keep-alive hold (pyshm.reduction) on a shared storage turned EPERM into EBUSY.
    from multiprocessing.reduction import ForkingPickler

    from pyshm import reduction

    storage = pyshm.Storage(5000, resizable=True)
    array = storage.asarray()
    array[:] = 7
    if holder == "export":  # sent to another process: shared in place, held for a while
        ForkingPickler.dumps(array)
        del array
        keep = None
    else:
        storage.share_memory_()
        keep = memoryview(array) if holder == "memoryview" else array
        del array
    assert storage.is_shared and not storage.resizable and storage.refcount > 1
    address = storage.data_ptr
    with pytest.raises(pyshm.ShmPermissionError) as info:
        storage.resize_(8192)
    assert info.value.errno == errno.EPERM
    assert not isinstance(info.value, BufferError)
    assert storage.nbytes == 5000 and storage.data_ptr == address
    assert read_bytes(address, 5000) == b"\x07" * 5000
    del keep
    reduction._channel.drop_holds()
    storage.close()


def test_resize_of_a_non_resizable_storage_with_an_array_is_permission_error():
    storage = pyshm.Storage(10)
    array = storage.asarray()
    with pytest.raises(pyshm.ShmPermissionError):
        storage.resize_(20)
    assert storage.nbytes == 10
    del array
    with pytest.raises(PermissionError):
        storage.resize_(20)


def test_the_version_is_written_once_and_the_binding_takes_only_its_own_minor(tmp_path):
    import re
    import shutil
    import subprocess
    import sys

    header = os.path.join(os.path.dirname(__file__), "..", "libshm", "include", "lshm.h")
    with open(header) as text:
        macros = dict(re.findall(r"^#define LSHM_VERSION_(MAJOR|MINOR|PATCH) (\d+)$",
                                 text.read(), re.MULTILINE))
    major, minor, patch = (int(macros[name]) for name in ("MAJOR", "MINOR", "PATCH"))
    assert pyshm.__version__ == f"{major}.{minor}.{patch}"  # the library built from it
    assert (_ffi.EXPECTED_VERSION_MAJOR, _ffi.EXPECTED_VERSION_MINOR) == (major, minor)
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler to build a library of another version")
    for other in ((major, minor - 1, 9), (major, minor + 1, 0), (major + 1, minor, patch)):
        source = tmp_path / "fake.c"
        number = other[0] * 10000 + other[1] * 100 + other[2]
        source.write_text(f"int lshm_version(void) {{ return {number}; }}\n")
        fake = tmp_path / f"liblshm_{'_'.join(map(str, other))}.so"
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(fake), str(source)], check=True)
        done = subprocess.run([sys.executable, "-c", "import pyshm"], capture_output=True,
                              text=True, env=dict(os.environ, PYSHM_LIBRARY=str(fake)))
        assert done.returncode != 0
        assert (f"is libshm {other[0]}.{other[1]}.{other[2]}; this pyshm needs "
                f"{major}.{minor}.x") in done.stderr
    # the binding's expectation is read from the header beside it, nowhere else: a package
    # whose header states another minor refuses this library, one without a header says so
    package = tmp_path / "site" / "pyshm"
    shutil.copytree(os.path.dirname(pyshm.__file__), package,
                    ignore=shutil.ignore_patterns("include", "*.so", "__pycache__"))
    env = dict(os.environ, PYSHM_LIBRARY=_ffi.LIBRARY_PATH, PYTHONPATH=str(package.parent))
    done = subprocess.run([sys.executable, "-c", "import pyshm"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, check=False)
    assert done.returncode != 0 and "no lshm.h in" in done.stderr, done.stderr
    (package / "include").mkdir()
    with open(header) as text:
        (package / "include" / "lshm.h").write_text(text.read().replace(
            f"#define LSHM_VERSION_MINOR {minor}\n", f"#define LSHM_VERSION_MINOR {minor + 1}\n"))
    done = subprocess.run([sys.executable, "-c", "import pyshm"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, check=False)
    assert done.returncode != 0 and f"this pyshm needs {major}.{minor + 1}.x" in done.stderr
    with open(header) as text:
        (package / "include" / "lshm.h").write_text(text.read())
    done = subprocess.run([sys.executable, "-c", "import pyshm"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr


# every struct and constant pyshm._ffi mirrors, by its name in lshm.h
MIRRORED_STRUCTS = {"PlanOptions": "lshm_plan_options", "PlanResult": "lshm_plan_result",
                    "ArenaCounters": "lshm_arena_counters", "ExportInfo": "lshm_export_info",
                    "SlabCounters": "lshm_slab_counters"}
MIRRORED_CONSTANTS = {"STORAGE_RESIZABLE": "LSHM_STORAGE_RESIZABLE",
                      "STORAGE_SHARED": "LSHM_STORAGE_SHARED",
                      "STORAGE_READONLY": "LSHM_STORAGE_READONLY",
                      "STORAGE_INPLACE": "LSHM_STORAGE_INPLACE",
                      "PLAN_INCLUSIVE": "LSHM_PLAN_INCLUSIVE", "ARENA_SHARED": "LSHM_ARENA_SHARED",
                      "SLAB_MAX_BYTES": "LSHM_SLAB_MAX_BYTES", "SLAB_BYTES": "LSHM_SLAB_BYTES",
                      "EXPECTED_VERSION_MAJOR": "LSHM_VERSION_MAJOR",
                      "EXPECTED_VERSION_MINOR": "LSHM_VERSION_MINOR"}
# the macros and enum members of lshm.h that pyshm._ffi deliberately does not mirror, and why
UNMIRRORED_CONSTANTS = {
    "LSHM_H": "the include guard",
    "LSHM_API": "the export attribute of the declarations",
    "LSHM_VERSION_PATCH": "the binding takes any patch of its minor",
    "LSHM_VERSION_NUMBER": "the binding asks lshm_version() (compared with it below)",
    "LSHM_ALLOCATOR_WHOLE_PAGES": "pyshm passes no allocator (lshm_storage_create gets NULL)",
}
HEADER = Path(__file__).resolve().parent.parent / "libshm/include/lshm.h"


def header_constants(header: str) -> set:
    """Every object-like LSHM_ macro and every enum member that the text of lshm.h defines."""
    code = re.sub(r"//[^\n]*", " ", re.sub(r"/\*.*?\*/", " ", header, flags=re.DOTALL))
    names = set(re.findall(r"^[ \t]*#[ \t]*define[ \t]+(LSHM_\w+)(?![\w(])", code, re.MULTILINE))
    for body in re.findall(r"\benum\b[^{;]*\{([^}]*)\}", code):
        names.update(re.findall(r"(?:^|,)\s*([A-Za-z_]\w*)", body))
    return names


def abi_value(name: str) -> int:
    value = ctypes.c_uint64()
    _ffi.lib.lshm_abi_value(name.encode(), ctypes.byref(value))
    return value.value


def test_the_bindings_structs_and_flags_are_the_librarys():
    structs = {name: cls for name, cls in vars(_ffi).items()
               if isinstance(cls, type) and issubclass(cls, ctypes.Structure)
               and not issubclass(cls, _ffi.Opaque)}
    assert set(structs) == set(MIRRORED_STRUCTS)  # (a new mirror gets its line above)
    for name, c_name in MIRRORED_STRUCTS.items():
        cls = structs[name]
        assert ctypes.sizeof(cls) == abi_value(c_name), name
        assert len(cls._fields_) == abi_value(f"{c_name}#fields"), name  # none left out
        for field, _ in cls._fields_:
            assert getattr(cls, field).offset == abi_value(f"{c_name}.{field}"), (name, field)
            assert getattr(cls, field).size == abi_value(f"{c_name}.{field}#size"), (name, field)
    for name, c_name in MIRRORED_CONSTANTS.items():
        assert getattr(_ffi, name) == abi_value(c_name), name
    assert abi_value("LSHM_VERSION_NUMBER") == _ffi.lib.lshm_version()
    with pytest.raises(pyshm.ShmError) as caught:
        abi_value("lshm_plan_options.no_such_field")
    assert caught.value.errno == errno.ENOENT and "no_such_field" in str(caught.value)


def test_every_constant_of_the_header_is_mirrored_or_listed_as_not():
    # A constant added to lshm.h gets a mirror in _ffi and a line in MIRRORED_CONSTANTS (which
    # the test above checks against the library), or a line with its reason in
    # UNMIRRORED_CONSTANTS; either way it is not missed.
    constants = header_constants(HEADER.read_text())
    mirrored = set(MIRRORED_CONSTANTS.values())
    assert not mirrored & set(UNMIRRORED_CONSTANTS)
    assert constants - mirrored - set(UNMIRRORED_CONSTANTS) == set()  # neither: list it above
    assert mirrored | set(UNMIRRORED_CONSTANTS) <= constants  # (no stale line)
    # the parser sees a new macro and new enum members, and skips function-like macros
    added = ("#define LSHM_NEW_FLAG 0x10u /* a comment */\n#define LSHM_NEW_CALL(x) (x)\n"
             "typedef enum lshm_kind {\n    LSHM_KIND_A = 1, /* one */\n    LSHM_KIND_B,\n"
             "} lshm_kind;\n")
    found = header_constants(HEADER.read_text() + added) - constants
    assert found == {"LSHM_NEW_FLAG", "LSHM_KIND_A", "LSHM_KIND_B"}


def test_the_export_layout_is_the_librarys_lshm_export_info():
    # EXPORT_LAYOUT unpacks lshm_export_info in one call, into the tuple of ExportInfo's fields
    # in their order: its size, and each field's offset and size, are the library's.
    layout = _ffi.EXPORT_LAYOUT
    assert re.fullmatch(r"@[a-zA-Z?]+", layout.format), layout.format  # one letter per field
    codes = layout.format[1:]
    names = [name for name, _ in _ffi.ExportInfo._fields_]
    assert layout.size == abi_value("lshm_export_info")
    assert len(codes) == len(names) == abi_value("lshm_export_info#fields")
    for i, (name, code) in enumerate(zip(names, codes)):
        size = struct.calcsize("@" + code)
        offset = struct.calcsize("@" + codes[: i + 1]) - size  # (native alignment, as in C)
        assert offset == abi_value(f"lshm_export_info.{name}"), (name, code)
        assert size == abi_value(f"lshm_export_info.{name}#size"), (name, code)


def test_storages_give_their_reference_back_once_when_collected_and_never_at_exit():
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, sys, types, pyshm
        from pyshm import storage
        real = storage.lib.lshm_storage_release
        def noisy(handle):
            print("released", flush=True)
            real(handle)
        storage.lib.lshm_storage_release = noisy  # (what a Storage made from now on calls)
        a, b = pyshm.Storage(64), None
        b = pyshm.Storage.from_handle(pyshm._ffi.lib.lshm_storage_retain(a._as_parameter_))
        assert a == b  # (equal storages: each still has a lifetime of its own)
        b.close(); b.close()
        print("closed", flush=True)
        del b; gc.collect()
        cycle = [pyshm.Storage(64)]; cycle.append(cycle); del cycle; gc.collect()
        print("collected", flush=True)
        # alive at exit, held by a module that outlives pyshm's at shutdown: not released then
        holder = sys.modules["holder"] = types.ModuleType("holder")
        holder.kept = pyshm.Storage(64)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.split("\n") == ["released", "closed", "released", "collected", ""]


def test_threads_closing_one_storage_at_once_give_its_reference_back_once():
    import threading

    base = pyshm.Storage(4096)
    handle = base._as_parameter_
    refs = _ffi.lib.lshm_storage_refcount(handle)
    for _ in range(50):
        adopted = pyshm.Storage.from_handle(_ffi.lib.lshm_storage_retain(handle))
        start = threading.Barrier(8)

        def close(storage=adopted, start=start):
            start.wait()
            storage.close()

        threads = [threading.Thread(target=close) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        del adopted
        assert _ffi.lib.lshm_storage_refcount(handle) == refs  # once, never twice
    assert base.nbytes == 4096


_CLOSE_DURING_CALL = r"""
import sys, threading, time
import pyshm

what = sys.argv[1]
N = 32 << 20
for i in range(24):
    s = pyshm.Storage(N, resizable=(what == "resize"))
    other = pyshm.Storage(N)
    call = {"share": s.share_memory_, "copy": lambda: s.copy_(other),
            "resize": lambda: s.resize_(2 * N)}[what]
    def run():
        try:
            call()
        except ValueError:
            pass  # closed before the call began: the clean outcome
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.0005 * (i % 8))
    s.close()
    t.join()
"""


@pytest.mark.parametrize("what", ["share", "copy", "resize"])
def test_close_on_another_thread_during_a_call_frees_nothing_under_it(what):
    # close() while another thread is inside a C call on the same Storage (the GIL is
    # released there): the storage must outlive the call (before: abort in storage.c's
    # destroy, or a segfault, as the only reference was dropped under the running call)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CLOSE_DURING_CALL, what], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_close_while_pinned_defers_the_release():
    storage = pyshm.Storage(100)
    array = storage.asarray()
    handle = pyshm.storage_of(array)
    assert handle.refcount == 3  # storage, the array's owner, handle
    pin = object()
    storage._pin(pin)  # what a call in flight on another thread holds
    storage.close()
    assert storage.closed
    with pytest.raises(ValueError):
        storage.nbytes
    assert handle.refcount == 3  # not released while the call runs
    storage._pins.discard(pin)
    storage._unpinned()
    assert handle.refcount == 2  # the last call out gives the reference back
    storage.close()
    assert handle.refcount == 2


def test_a_storage_pinned_at_fork_is_released_by_close_in_the_child():
    # a call in flight on another thread at fork() (its pin) is not in the child: a close()
    # there used to wait for that call's unpin, which never comes (only garbage collection
    # gave the reference back); now it gives it back at once
    storage = pyshm.Storage(100)
    array = storage.asarray()
    handle = pyshm.storage_of(array)
    pin = object()
    storage._pin(pin)  # (a call in flight on another thread)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                storage.close()
                code = 0 if handle.refcount == 2 else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        storage.close()
        assert handle.refcount == 3  # (here the call is still in flight)
    finally:
        storage._pins.discard(pin)
        storage._unpinned()
    assert handle.refcount == 2


class _InterruptAfterRelease:
    """Stands in for pyshm.storage._PIN_LOCK: once armed, the release is followed by a
    KeyboardInterrupt, which is where a signal handler raises one (its first check after the
    release, still inside _pin)."""

    def __init__(self, lock):
        self.lock = lock
        self.armed = False

    def __enter__(self):
        return self.lock.__enter__()

    def __exit__(self, *exc_info):
        self.lock.__exit__(*exc_info)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


_PINNING_CALLS = {
    "resize_": lambda s, other: s.resize_(2 * PAGE),
    "copy_": lambda s, other: s.copy_(other),
    "copy_ from": lambda s, other: other.copy_(s),
    "asarray": lambda s, other: s.asarray(),
    "share_memory_": lambda s, other: s.share_memory_(),
    "fd": lambda s, other: s.fd,
    "reduce": lambda s, other: pyshm.reduction._reduce_storage(s),
}


@pytest.mark.parametrize("where", ["in _pin", "after _pin"])
@pytest.mark.parametrize("call", sorted(_PINNING_CALLS))
def test_an_interrupt_at_the_pin_leaves_the_storage_usable(monkeypatch, call, where):
    # A KeyboardInterrupt (Ctrl-C: a signal handler raises it at the interpreter's next check)
    # after _pin counted a call and before the caller's try: that pin was never given back, so
    # resize_ refused for ever ("in use by a call on another thread"), and after an
    # interrupted resize_ every call did ("being resized on another thread"); close() left the
    # release to that pin. (A real SIGALRM every 0.3 ms in a loop of resize_ did it within
    # the first few interrupts.)
    from pyshm import storage as storage_module

    s = pyshm.Storage(PAGE, resizable=True)
    other = pyshm.Storage(PAGE)
    if where == "in _pin":
        lock = _InterruptAfterRelease(storage_module._PIN_LOCK)
        monkeypatch.setattr(storage_module, "_PIN_LOCK", lock)
        lock.armed = True
    else:
        pin = pyshm.Storage._pin

        def pin_then_interrupt(self, *args, **kwargs):
            pin(self, *args, **kwargs)
            monkeypatch.undo()  # (once)
            raise KeyboardInterrupt

        monkeypatch.setattr(pyshm.Storage, "_pin", pin_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _PINNING_CALLS[call](s, other)
    monkeypatch.undo()
    assert (s._pins, other._pins) == (set(), set())
    if not s.is_shared:
        s.resize_(3 * PAGE)  # nothing in flight
    s.asarray()
    s.close()
    other.close()


class _TwoInterrupts:
    """Ctrl-C twice: a SIGUSR1 handler raises KeyboardInterrupt, and the second signal comes
    while the first one unwinds. CPython runs a handler at its next check for signals, such
    as the entry of a Python function: a profile function raises the second signal at the
    first Python call after the first handler ran, so its handler runs there."""

    def __init__(self) -> None:
        self.handled = 0

    def __enter__(self) -> "_TwoInterrupts":
        self.profile = sys.getprofile()
        self.previous = signal.signal(signal.SIGUSR1, self._handler)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.setprofile(self.profile)
        signal.signal(signal.SIGUSR1, self.previous)

    def first(self) -> None:
        signal.raise_signal(signal.SIGUSR1)

    def _handler(self, signum, frame):
        self.handled += 1
        if self.handled == 1:
            sys.setprofile(self._second)
        raise KeyboardInterrupt

    def _second(self, frame, event, arg):
        if event == "call":
            sys.setprofile(self.profile)
            signal.raise_signal(signal.SIGUSR1)


@pytest.mark.parametrize("call", sorted(_PINNING_CALLS))
def test_a_second_interrupt_in_the_callers_finally_gives_the_pin_back(monkeypatch, call):
    # The first KeyboardInterrupt right after the pin, the second at the first Python call
    # of the caller's finally: that call was _unpin, so the pin stayed taken (resize_ said
    # "in use by a call on another thread" for ever, close() left the storage's reference to
    # garbage collection); now the pin goes back in one C call before any Python call
    s = pyshm.Storage(PAGE, resizable=True)
    other = pyshm.Storage(PAGE)
    pin = pyshm.Storage._pin

    def pin_then_interrupt(self, *args, **kwargs):
        handle = pin(self, *args, **kwargs)
        monkeypatch.undo()  # (once)
        interrupts.first()
        return handle

    monkeypatch.setattr(pyshm.Storage, "_pin", pin_then_interrupt)
    with _TwoInterrupts() as interrupts, pytest.raises(KeyboardInterrupt):
        _PINNING_CALLS[call](s, other)
    monkeypatch.undo()
    assert interrupts.handled == 2
    if not s.is_shared:
        s.resize_(3 * PAGE)  # nothing in flight
    for storage in (s, other):
        keeper = pyshm.Storage.from_handle(_ffi.lib.lshm_storage_retain(storage._as_parameter_))
        storage.close()
        assert keeper.refcount == 1  # close() gave its reference back at once
        keeper.close()


def test_two_interrupts_during_a_share_leave_it_whole_and_leak_nothing(monkeypatch):
    # The first signal comes during the share's C call (its handler runs when it returns),
    # the second while the first KeyboardInterrupt unwinds: the share is done in full (same
    # address, same bytes, shared), and close() gives the memfd and its mapping back at once
    # (before: the pin stayed taken, and both stayed until the Storage was collected)
    s = pyshm.Storage(1 << 20)
    array = s.asarray()
    array[:] = np.arange(array.size, dtype=np.uint8)
    address = s.data_ptr
    share = _ffi.share_unchecked

    def share_then_interrupt(handle):
        rc = share(handle)
        interrupts.first()
        return rc

    monkeypatch.setattr(_ffi, "share_unchecked", share_then_interrupt)
    with _TwoInterrupts() as interrupts, pytest.raises(KeyboardInterrupt):
        s.share_memory_()
    monkeypatch.undo()
    assert interrupts.handled == 2
    assert s.is_shared and s.data_ptr == address and array.ctypes.data == address
    assert np.array_equal(array, np.arange(array.size, dtype=np.uint8))
    inode = os.fstat(s.fd).st_ino
    assert memfd_held(inode)
    del array
    s.close()
    assert memfd_held(inode) == []


_DYING = {
    "array": lambda: pyshm.empty(2 << 20, np.uint8, shared=True),
    "Storage": lambda: pyshm.Storage(2 << 20, shared=True),
    "array of a Storage": lambda: pyshm.Storage(2 << 20, shared=True).asarray(),
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", sorted(_DYING))
def test_a_ctrl_c_in_a_release_callback_is_made_up_for_at_the_next_release(kind):
    # A KeyboardInterrupt at each point of the death of an array / Storage (2 MiB: libshm
    # keeps no memfd of that size for reuse): in its weak reference callback (at its entry,
    # right after the dict pop) CPython printed "Exception ignored" and the release was lost:
    # the memfd's fd and mapping stayed until the process exited. Now they go by the next
    # release at the latest.
    point = 1
    while True:
        held = [_DYING[kind]()]
        holder = held[0] if isinstance(held[0], pyshm.Storage) else held[0].base
        inode = os.fstat(pyshm._memory.storage_fd(holder)).st_ino
        del holder
        assert memfd_held(inode)
        if not interrupted_at(point, held.clear):
            break
        assert held == []
        other = pyshm.Storage(PAGE)
        other.close()  # (a release)
        assert memfd_held(inode) == [], (kind, point)
        point += 1
    assert point > 1


def _memfds_held() -> int:
    """How many memfd fds and mappings this process has."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass  # (listdir's own fd, closed since)
    with open("/proc/self/maps") as maps:
        return fds + sum("/memfd:" in line for line in maps)


_MAKING = {
    "pyshm.empty": lambda fd: pyshm.empty(2 << 20, np.uint8, shared=True),
    "Storage": lambda fd: pyshm.Storage(2 << 20, shared=True),
    "Storage.attach": lambda fd: pyshm.Storage.attach(fd, 2 << 20),
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("kind", sorted(_MAKING))
def test_a_ctrl_c_anywhere_in_making_a_storage_leaks_nothing(monkeypatch, kind):
    # A KeyboardInterrupt at each point of pyshm.empty / Storage() / Storage.attach: right
    # after lshm_storage_create_shared (or _attach) returned, the new storage's handle was
    # lost, with its memfd fd and mapping, until the process exited
    source = pyshm.Storage(2 << 20, shared=True)
    fd = source.fd
    wrappers = after_c_calls(monkeypatch, _ffi.lib, "lshm_storage_create_shared",
                             "lshm_storage_attach")
    held = _memfds_held()
    point = 1
    while interrupted_at(point, lambda: _MAKING[kind](fd), wrappers):
        pyshm.Storage(PAGE).close()  # (a release: one cut off in a callback is made there)
        assert _memfds_held() == held, (kind, point)
        point += 1
    assert point > 3
    assert _memfds_held() == held
    source.close()
