"""Huge pages: from 2 MiB on, a private storage of libshm's default allocator starts at a
2 MiB boundary and asks for transparent huge pages (MADV_HUGEPAGE), and a storage created
shared has every whole 2 MiB of its memfd in a huge page (MADV_COLLAPSE); smaller ones,
``LSHM_HUGE=0`` and ``prctl(PR_SET_THP_DISABLE)`` give small pages, never an error.

What is checked is what the kernel says about the mapping (/proc/self/smaps: its range, the
``hg`` VmFlag that MADV_HUGEPAGE sets, ``AnonHugePages``), the bytes, and the mappings left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyshm

HUGE = 2 << 20
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    try:
        text = open(THP).read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def huge_switched_off() -> bool:
    """Whether this process runs with huge pages off (LSHM_HUGE=0, or THP disabled for it by
    prctl, inherited from whoever started it): the tests of huge pages themselves then skip,
    the rest of the suite runs the small-page way, and the off-switch test says what off
    gives."""
    import ctypes

    PR_GET_THP_DISABLE = 42
    disabled = ctypes.CDLL(None, use_errno=True).prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0)
    return os.environ.get("LSHM_HUGE") == "0" or disabled == 1


needs_huge = pytest.mark.skipif(huge_switched_off(), reason="huge pages switched off here")


def mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding `address`: its range and fields."""
    found: dict = {}
    current = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            low, high = (int(x, 16) for x in head[0].split("-"))
            current = low <= address < high
            if current:
                found["range"] = (low, high)
        elif current:
            found[head[0].rstrip(":")] = head[1:]
    return found


def huge_kib(entry: dict) -> int:
    return int(entry.get("AnonHugePages", ["0"])[0])


@needs_huge
def test_storages_from_2_mib_on_are_aligned_and_ask_for_huge_pages():
    small = pyshm.empty(HUGE - 4096, np.uint8)
    entry = mapping_of(small.ctypes.data)
    assert "hg" not in entry["VmFlags"]
    for nbytes in (HUGE, 8 << 20, 39_000_000):
        array = pyshm.empty(nbytes, np.uint8)
        assert array.ctypes.data % HUGE == 0
        array[:] = 7
        entry = mapping_of(array.ctypes.data)
        assert "hg" in entry["VmFlags"]
        # the mapping is the storage's pages and nothing more: no head or tail left over
        low, high = entry["range"]
        assert low <= array.ctypes.data and array.ctypes.data + nbytes <= high
        if thp_mode() in ("always", "madvise"):
            # every whole 2 MiB of it may be a huge page, never more than its size
            assert 0 < huge_kib(entry) * 1024 <= nbytes
        assert (array == 7).all()


def test_aligned_storages_leave_no_mappings_behind():
    before = len(open("/proc/self/maps").readlines())
    for _ in range(200):
        array = pyshm.empty(3 << 20, np.uint8)
        array[::4096] = 1
        del array
    assert len(open("/proc/self/maps").readlines()) <= before + 2


@needs_huge
def test_resizing_past_2_mib_keeps_the_bytes_and_aligns():
    # (a resize needs no array over the storage: each array is dropped before it)
    want = np.arange(100_000) % 251
    storage = pyshm.Storage(100_000, resizable=True)
    storage.asarray()[:] = want
    storage.resize_(9 << 20)
    assert storage.data_ptr % HUGE == 0
    data = storage.asarray()
    assert (data[:100_000] == want).all() and not data[100_000:].any()
    del data
    assert "hg" in mapping_of(storage.data_ptr)["VmFlags"]
    start = storage.data_ptr
    storage.resize_(5 << 20)  # shrinking stays where it is
    assert storage.data_ptr == start and (storage.asarray()[:100_000] == want).all()
    storage.close()


def test_shared_in_place_after_an_aligned_start_keeps_its_address():
    array = pyshm.empty(6 << 20, np.uint8)
    array[:] = 3
    address = array.ctypes.data
    pyshm.share_memory_(array)
    assert array.ctypes.data == address and (array == 3).all()


def shmem_huge_kib(entry: dict) -> int:
    return int(entry.get("ShmemPmdMapped", ["0"])[0])


def shmem_collapse_allowed() -> bool:
    """MADV_COLLAPSE of shmem: Linux 6.1 or later, THP present, shmem_enabled not "deny"."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
    except OSError:
        return False
    release = tuple(int(x) for x in os.uname().release.split(".")[:2])
    return "[deny]" not in mode and "[force]" not in mode and release >= (6, 1)


def add_seven(array):
    array += 7
    return int(array[-1])


@needs_huge
def test_shared_arrays_from_2_mib_on_are_in_huge_pages():
    for nbytes in (HUGE, 8 << 20, 39_000_000):
        array = pyshm.empty(nbytes, np.uint8, shared=True)
        assert array.ctypes.data % HUGE == 0
        entry = mapping_of(array.ctypes.data)
        if shmem_collapse_allowed():
            # every whole 2 MiB of the memfd is one huge page, mapped as one
            assert shmem_huge_kib(entry) * 1024 == nbytes // HUGE * HUGE
        # memory: the memfd's pages and no more (a tail short of 2 MiB is in small pages)
        blocks = os.fstat(pyshm.storage_of(array).fd).st_blocks * 512
        assert nbytes <= blocks <= 1.06 * nbytes
        assert not array.any()
        array[:] = 3
        assert (array == 3).all()


@needs_huge
def test_arrays_shared_in_place_from_2_mib_on_are_in_huge_pages():
    nbytes = 39_321_600  # 128 x 480 x 640: 18 whole huge pages and a 1.5 MiB tail
    array = pyshm.empty(nbytes, np.uint8)
    array[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # (a byte pattern)
    view = array[1000:]
    address = array.ctypes.data
    pyshm.share_memory_(array)
    assert array.ctypes.data == address and view.ctypes.data == address + 1000
    assert int(array[nbytes - 1]) == (nbytes - 1) % 256 and int(view[0]) == 1000 % 256
    assert int(array.sum()) == int(np.arange(nbytes, dtype=np.uint64).astype(np.uint8).sum())
    view[0] = 200
    assert array[1000] == 200
    if shmem_collapse_allowed():
        assert shmem_huge_kib(mapping_of(address)) * 1024 == nbytes // HUGE * HUGE
    blocks = os.fstat(pyshm.storage_of(array).fd).st_blocks * 512
    assert nbytes <= blocks <= 1.06 * nbytes


@needs_huge
def test_copies_of_foreign_memory_made_shared_are_in_huge_pages():
    source = np.arange((8 << 20) + 5000, dtype=np.uint8)  # memory pyshm does not own
    array = pyshm.copy(source, shared=True)
    assert array.ctypes.data % HUGE == 0 and (array == source).all()
    entry = mapping_of(array.ctypes.data)
    if shmem_collapse_allowed():
        assert shmem_huge_kib(entry) == 8 << 10  # (the tail short of 2 MiB: small pages)


def read_every_page(array):
    """In a receiver: the array's alignment, the sum of a byte per page (the first reads), how
    much of its mapping is PMD-mapped after them."""
    total = int(array[::4096].sum())
    return array.ctypes.data % HUGE, total, shmem_huge_kib(mapping_of(array.ctypes.data))


@needs_huge
def test_a_receiver_maps_huge_pages_whole():
    import multiprocessing as mp

    array = pyshm.share_memory_(pyshm.empty(16 << 20, np.uint8))
    array[:] = 1
    with mp.get_context("spawn").Pool(1) as pool:
        misalign, total, pmd_kib = pool.apply(read_every_page, (array,))
    assert misalign == 0 and total == (16 << 20) // 4096
    if shmem_collapse_allowed():
        assert pmd_kib == 16 << 10


def test_a_huge_page_array_reaches_a_worker_and_back():
    import multiprocessing as mp

    created = pyshm.zeros(6 << 20, np.uint8, shared=True)
    in_place = pyshm.share_memory_(pyshm.zeros((6 << 20) + 12345, np.uint8))
    with mp.get_context("fork").Pool(1) as pool:
        for array in (created, in_place):
            assert pool.apply(add_seven, (array,)) == 7
            assert (array == 7).all()


CHILD = textwrap.dedent(
    """
    import ctypes, sys
    import numpy as np
    if sys.argv[1] == "prctl":
        PR_SET_THP_DISABLE = 41
        assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0
    import pyshm
    sys.path.insert(0, sys.argv[2])
    from test_huge import huge_kib, mapping_of, shmem_huge_kib
    array = pyshm.empty(8 << 20, np.uint8)
    array[:] = 5
    entry = mapping_of(array.ctypes.data)
    storage = pyshm.Storage(4096, resizable=True)
    storage.resize_(4 << 20)
    pyshm.share_memory_(array)
    shared = pyshm.zeros(8 << 20, np.uint8, shared=True)
    shared[:] = 1
    kib = huge_kib(entry) + shmem_huge_kib(mapping_of(shared.ctypes.data))
    right = int(array.sum()) == 5 * (8 << 20) and int(shared.sum()) == 8 << 20
    print(kib, "hg" in entry["VmFlags"], right)
    """
)


@pytest.mark.parametrize("how", ["LSHM_HUGE=0", "prctl"])
def test_huge_pages_off_gives_small_pages_and_no_error(how):
    env = dict(os.environ)
    if how == "LSHM_HUGE=0":
        env["LSHM_HUGE"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "env" if how != "prctl" else "prctl",
         os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    kib, advised, right = done.stdout.split()
    assert kib == "0" and right == "True"
    if how == "LSHM_HUGE=0":
        assert advised == "False"  # not even asked (under PR_SET_THP_DISABLE the kernel says no)



@pytest.mark.skipif(os.environ.get("PYSHM_HUGE_OFF_RUN") == "1", reason="(the nested run)")
@pytest.mark.parametrize("how", ["LSHM_HUGE=0", "prctl"])
def test_the_storage_and_array_tests_pass_with_huge_pages_off(how):
    """The suite's storage, array and huge-page tests again in a child with huge pages off.
    (The whole suite was run that way with each switch on 2026-12-01, 10 min each, more than
    CI's budget allows: only the huge-page tests themselves failed, in Python and C, and those
    now skip or adapt.)"""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYSHM_HUGE_OFF_RUN="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               os.path.join(tests, "test_storage.py"), os.path.join(tests, "test_arrays.py"),
               os.path.join(tests, "test_huge.py")]
    if how == "LSHM_HUGE=0":
        env["LSHM_HUGE"] = "0"
    else:  # (inherited across exec, like a container runtime's setting)
        command = [sys.executable, "-c",
                   "import ctypes, os, sys\n"
                   "assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0\n"
                   "os.execv(sys.executable, sys.argv[1:])", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(tests))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" in done.stdout  # (the huge ones skip)
