"""The methods ``python -m pyshm bench`` compares: each builds its sources the way its users
would, then shares item i on request (pyshm, torch, SharedMemory, and the ceilings)."""

from __future__ import annotations

import ctypes
import errno
import gc
from multiprocessing import shared_memory

import numpy as np

from .. import arrays, storage
from .libc import (
    HUGE,
    MADV_COLLAPSE,
    MADV_HUGEPAGE,
    MADV_POPULATE_WRITE,
    MAP_ANONYMOUS,
    MAP_FAILED,
    MAP_FIXED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    MAP_SHARED,
    MFD_CLOEXEC,
    PROT_NONE,
    PROT_READ,
    PROT_WRITE,
    Libc,
    oserror,
)
from .measure import fd_budget
from .workloads import Workload


class Method:
    key = ""
    label = ""
    skip = ()  # workload keys this method does not run

    def new_source(self, shape: tuple):
        """One source array: (the object to share, a writable numpy view to fill it through)."""
        array = np.empty(shape, np.uint8)
        return array, array

    def capacity(self, workload: Workload) -> int:
        """How many arrays of ``workload`` this method can hold at once (fd limits)."""
        return workload.count

    def prepare(self, workload: "Workload", count: int, pool) -> None:
        """Untimed, before the sources are built: give back the memfds libshm keeps for
        reuse, so that no method runs while pyshm holds memory it has released (fresh memory
        is what every method pays for, and held memory would slow the others down)."""
        storage.trim_pool()

    def start(self, sources: list) -> None:
        self.items = sources

    def share(self, index: int) -> None:
        raise NotImplementedError

    def result(self, index: int) -> np.ndarray:
        return self.items[index]

    def check_shared(self, index: int) -> None:
        pass

    def finish(self) -> None:
        self.items = None


class PyshmMethod(Method):
    key = "pyshm"
    label = "pyshm.share_memory_"

    def new_source(self, shape):
        array = arrays.empty(shape, np.uint8)
        return array, array

    def start(self, sources):
        self.items = sources
        self.addresses = [array.ctypes.data for array in sources]

    def share(self, index):
        arrays.share_memory_(self.items[index])

    def check_shared(self, index):
        array = self.items[index]
        if not arrays.is_shared(array):
            raise AssertionError(f"pyshm array {index} is not shared")
        if array.ctypes.data != self.addresses[index]:
            raise AssertionError(f"pyshm array {index} moved (in place sharing broke)")


class PyshmRecycledMethod(PyshmMethod):
    """pyshm when it shares the same sizes again: an untimed run of the same workload first
    leaves its released memfds in libshm's recycling pool, which the timed run refills."""

    key = "pyshm_recycled"
    label = "pyshm, recycled memfds"
    # libshm keeps no memfd of 1 MiB up to 64 MiB (a fresh chunked share is faster there), so
    # the seed arrays would run exactly as the plain pyshm row.
    skip = ("seed",)

    def prepare(self, workload, count, pool):
        storage.trim_pool()
        sources = []
        for index in range(count):
            array = arrays.empty(workload.shape, np.uint8)
            workload.fill(array, index)
            sources.append(array)
        if pool is None:
            for array in sources:
                arrays.share_memory_(array)
        else:
            pool.map(arrays.share_memory_, sources, chunksize=1)
        del sources, array
        gc.collect()


class TorchMethod(Method):
    key = "torch"
    label = "torch share_memory_"

    def __init__(self, torch) -> None:
        self.torch = torch

    def new_source(self, shape):
        tensor = self.torch.empty(shape, dtype=self.torch.uint8)
        return tensor, tensor.numpy()

    def capacity(self, workload):
        # file_descriptor strategy: every shared storage keeps one fd open.
        return min(workload.count, fd_budget())

    def share(self, index):
        self.items[index].share_memory_()

    def result(self, index):
        return self.items[index].numpy()

    def check_shared(self, index):
        if not self.items[index].is_shared():
            raise AssertionError(f"torch tensor {index} is not shared")


class SharedMemoryMethod(Method):
    key = "shm"
    label = "SharedMemory+copyto"

    def capacity(self, workload):
        # A SharedMemory keeps its fd plus the one mmap.mmap duplicates.
        return min(workload.count, fd_budget() // 2)

    def start(self, sources):
        self.items = sources
        self.segments = [None] * len(sources)
        self.views = [None] * len(sources)

    def share(self, index):
        source = self.items[index]
        segment = shared_memory.SharedMemory(create=True, size=source.nbytes)
        view = np.ndarray(source.shape, source.dtype, buffer=segment.buf)
        np.copyto(view, source)
        self.items[index] = None  # the source is freed right after its copy
        del source
        self.segments[index] = segment
        self.views[index] = view

    def result(self, index):
        return self.views[index]

    def finish(self):
        self.items = None
        self.views = None  # drop the exported buffers before closing
        for segment in self.segments:
            if segment is not None:
                segment.close()
                segment.unlink()
        self.segments = None


class CeilingMethod(Method):
    key = "ceiling"
    label = "ceiling memfd+pwrite"

    def __init__(self) -> None:
        self.libc = Libc()

    def start(self, sources):
        self.items = sources
        # The source addresses are a property of the sources: read them before the clock runs.
        self.sources = [(array.ctypes.data, array.nbytes) for array in sources]
        self.shape = sources[0].shape if sources else ()
        self.maps = [0] * len(sources)

    def _sized_memfd(self, nbytes: int) -> int:
        """A new memfd of nbytes (closed again if sizing it fails)."""
        fd = self.libc.memfd_create(b"pyshm-bench", MFD_CLOEXEC)
        if fd < 0:
            raise oserror("memfd_create")
        if self.libc.ftruncate(fd, nbytes) != 0:
            error = oserror("ftruncate")
            self.libc.close(fd)
            raise error
        return fd

    def _trim_to_aligned(self, reserved: int, span: int, nbytes: int) -> int:
        """Of a fresh mapping [reserved, reserved + span), span = nbytes + 2 MiB: unmap what
        lies before its first 2 MiB boundary and after nbytes (in pages) from there."""
        aligned = (reserved + HUGE - 1) // HUGE * HUGE
        if aligned > reserved:
            self.libc.munmap(reserved, aligned - reserved)
        end = (aligned + nbytes + 4095) // 4096 * 4096
        if reserved + span > end:
            self.libc.munmap(end, reserved + span - end)
        return aligned

    def share(self, index):
        libc = self.libc
        address, nbytes = self.sources[index]
        fd = self._sized_memfd(nbytes)
        try:
            done = 0
            while done < nbytes:
                wrote = libc.pwrite(fd, address + done, nbytes - done, done)
                if wrote < 0:
                    if ctypes.get_errno() == errno.EINTR:
                        continue
                    raise oserror("pwrite")
                done += wrote
            mapped = libc.mmap(None, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if mapped is None or mapped == MAP_FAILED:
                raise oserror("mmap")
        finally:
            libc.close(fd)
        self.maps[index] = mapped
        self.items[index] = None  # the source is freed as it goes

    def result(self, index):
        nbytes = self.sources[index][1]
        buffer = (ctypes.c_ubyte * nbytes).from_address(self.maps[index])
        return np.ctypeslib.as_array(buffer).reshape(self.shape)

    def finish(self):
        self.items = None
        for address, (_, nbytes) in zip(self.maps or (), self.sources or ()):
            if address:
                self.libc.munmap(address, nbytes)
        self.maps = self.sources = None


class HugeCeilingMethod(CeilingMethod):
    """The huge-page ceiling: a fresh memfd per array mapped at a 2 MiB boundary, one byte
    written per 2 MiB, the whole 2 MiB ranges collapsed into huge pages (MADV_COLLAPSE), then
    one memcpy of the array into the mapping (the tail short of 2 MiB in small pages). Where
    the kernel refuses the collapse it measures small pages filled by memcpy."""

    key = "ceiling_huge"
    label = "ceiling huge pages"
    skip = ("small",)

    def share(self, index):
        libc = self.libc
        address, nbytes = self.sources[index]
        fd = self._sized_memfd(nbytes)
        try:
            mapped = self._map_aligned(fd, nbytes)
            whole = nbytes // HUGE * HUGE
            zero = ctypes.c_char(0)
            for offset in range(0, whole, HUGE):
                if libc.pwrite(fd, ctypes.byref(zero), 1, offset) != 1:
                    raise oserror("pwrite")
            if whole:
                libc.madvise(mapped, whole, MADV_COLLAPSE)  # (refused: small pages)
            libc.memcpy(mapped, address, nbytes)
        finally:
            libc.close(fd)
        self.maps[index] = mapped
        self.items[index] = None

    def _map_aligned(self, fd, nbytes):
        libc = self.libc
        span = nbytes + HUGE
        reserved = libc.mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                             -1, 0)
        if reserved is None or reserved == MAP_FAILED:
            raise oserror("mmap")
        aligned = (reserved + HUGE - 1) // HUGE * HUGE
        mapped = libc.mmap(aligned, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0)
        if mapped is None or mapped == MAP_FAILED:
            error = oserror("mmap")
            libc.munmap(reserved, span)
            raise error
        return self._trim_to_aligned(reserved, span, nbytes)


class MemcpyMethod(CeilingMethod):
    """The physical limit: memcpy of each array into private memory populated beforehand
    (untimed: huge pages where THP gives them, every page present), so only the copy is
    timed. Nothing is shared; no method that creates memory can be faster."""

    key = "memcpy"
    label = "memcpy, populated"
    skip = ("small",)

    def start(self, sources):
        super().start(sources)
        libc = self.libc
        for index, (_, nbytes) in enumerate(self.sources):
            mapped = self._map_anon(nbytes)
            self.maps[index] = mapped
            libc.madvise(mapped, nbytes, MADV_HUGEPAGE)
            if libc.madvise(mapped, nbytes, MADV_POPULATE_WRITE) != 0:
                ctypes.memset(mapped, 0, nbytes)  # (kernels before 5.14)

    def _map_anon(self, nbytes):
        libc = self.libc
        span = nbytes + HUGE
        reserved = libc.mmap(None, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                             -1, 0)
        if reserved is None or reserved == MAP_FAILED:
            raise oserror("mmap")
        return self._trim_to_aligned(reserved, span, nbytes)

    def share(self, index):
        address, nbytes = self.sources[index]
        self.libc.memcpy(self.maps[index], address, nbytes)
        self.items[index] = None
