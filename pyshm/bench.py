"""``python -m pyshm bench``: pyshm against torch and SharedMemory, and the machine's ceiling.

Everything is measured side by side in one process, methods interleaved round by round:

* ``pyshm``: :func:`pyshm.share_memory_` on arrays made by :func:`pyshm.empty` (in place: the
  memfd is mapped over the array's own pages, so every source page is replaced as it goes);
* ``torch``: ``Tensor.share_memory_()`` on tensors made with ``torch.empty(..., dtype=uint8)``,
  ``file_descriptor`` sharing strategy (only when torch imports; it frees each old storage);
* ``SharedMemory``: ``multiprocessing.shared_memory.SharedMemory(create=True)`` plus
  ``numpy.copyto`` from an ``np.empty`` array, deleting each source right after its copy;
* ``ceiling``: what the machine can do at all, with ctypes calls straight into libc (they release
  the GIL): a fresh memfd per array (``memfd_create``, ``ftruncate``), the bytes written with
  ``pwrite``, then ``mmap``-ed and the fd closed; each source is freed as it goes. With a
  ThreadPool that is one segment per thread at a time (the "prototype" rows of DESIGN section 8).

Cases: (a) the seed workload (uint8 arrays of 128x480x640, 64 by default, fewer when a quarter
of the available memory does not hold them) from a ``ThreadPool`` of 1, 2 and 8 threads; (b)
one 1 GiB array; (c) 10,000 arrays of 4 KiB, one call at a time (time per share in us); (d)
``processes``: 4 KiB shared arrays sent to a ``Pool(1)`` worker and back, batched and one by one
(us per array, ratios to torch and SharedMemory; see :mod:`pyshm.bench_processes`).

Fairness (DESIGN section 8, "Benchmarking caveat"): memory new to the process is slow on these
VMs, so each method builds its own inputs the same way right before its timed run, frees or
replaces its sources while it copies, and releases all of its results (and is garbage-collected)
before the next method builds anything: two full workloads are never alive at once. Every
result is checked (a few bytes per array, and that it really is shared) so that no method is
timed doing less work. Progress goes to stderr; ``--json`` puts a machine-readable result on
stdout (the tables then go to stderr).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
from multiprocessing import shared_memory
from multiprocessing.pool import ThreadPool
from typing import Callable, Optional

import numpy as np

from . import arrays, demo, storage

__all__ = ["add_arguments", "main", "run"]

FRAME_SHAPE = demo.FRAME_SHAPE
FRAME_BYTES = demo.FRAME_BYTES
SMALL_BYTES = 4096
BIG_ROW = 1 << 16  # the big array is filled row by row with one 64 KiB pattern
BIG_MARK = 1 << 20  # and a counter byte every MiB

DEFAULTS = {"repeats": 5, "threads": (1, 2, 8), "big_mib": 1024, "receiver_mib": 1024,
            "small_count": 10_000}
QUICK = {"repeats": 3, "count": 4, "big_mib": 256, "receiver_mib": 256, "small_count": 2_000}

# Targets of the issue / DESIGN section 7.
TARGET_SEED_VS_TORCH = 0.35  # pyshm time / torch time, seed workload, ThreadPool(2)
TARGET_SEED_VS_CEILING = 1.10  # pyshm time / huge-page ceiling time, same case
TARGET_BIG_SPEEDUP = 2.5  # torch time / pyshm time, one 1 GiB array
TARGET_RECEIVER_VS_TORCH = 0.10  # a spawned worker's first read of 1 GiB, pyshm / torch
TARGET_HUGE_OFF_VS_TORCH = 0.65  # seed workload, ThreadPool(2), with LSHM_HUGE=0
TARGET_SMALL_US = 12.0  # pyshm us per 4 KiB share
TARGET_SMALL_VS_CEILING = 0.60  # pyshm time per 4 KiB in-place share / the ceiling's (slabs)

CASES = ("seed", "big", "small", "processes", "receiver", "huge_off", "engines")

# A timed run is "quiet" when other processes kept fewer CPUs than this busy meanwhile.
QUIET_LOAD = 0.25
LOAD_WINDOW = 0.5  # seconds: the shortest run whose load /proc/stat resolves well enough


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _int_list(text: str) -> tuple:
    try:
        values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers: {text}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1: {text}")
    return tuple(dict.fromkeys(values))


def _case_list(text: str) -> tuple:
    values = tuple(part for part in text.replace(" ", "").split(",") if part)
    unknown = [value for value in values if value not in CASES]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"cases are {', '.join(CASES)}; got {text}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser`` (the ``python -m pyshm bench`` subcommand)."""
    parser.add_argument("--quick", action="store_true",
                        help=f"a run of about a minute: {QUICK['count']} seed arrays, "
                             f"{QUICK['repeats']} rounds, a {QUICK['big_mib']} MiB big array, "
                             f"{QUICK['small_count']} small arrays, fewer arrays sent to "
                             f"processes, a {QUICK['receiver_mib']} MiB receiver case")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON on stdout (tables go to stderr)")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help=f"rounds per case (default {DEFAULTS['repeats']})")
    parser.add_argument("--count", type=_positive_int, default=None,
                        help="seed workload arrays (default: as many of 64 as fit in a quarter "
                             "of the available memory)")
    parser.add_argument("--threads", type=_int_list, default=None,
                        help="ThreadPool sizes for the seed workload (default 1,2,8)")
    parser.add_argument("--big-mib", type=_positive_int, default=None,
                        help=f"size of the big array in MiB (default {DEFAULTS['big_mib']})")
    parser.add_argument("--receiver-mib", type=_positive_int, default=None,
                        help="size of the array of the receiver case in MiB (default "
                             f"{DEFAULTS['receiver_mib']})")
    parser.add_argument("--small-count", type=_positive_int, default=None,
                        help=f"number of 4 KiB arrays (default {DEFAULTS['small_count']})")
    parser.add_argument("--cases", type=_case_list, default=CASES,
                        help="which cases to run, comma-separated (default "
                             f"{','.join(CASES)})")
    parser.add_argument("--no-torch", action="store_true", help="do not try to import torch")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``python -m pyshm bench``; returns the exit status."""
    config = _config(args)
    result = run(config, progress=None if args.quiet else _Progress())
    out = sys.stderr if args.json else sys.stdout
    print(format_report(result), file=out, flush=True)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=False))
    pyshm_failed = any(row["method"] == "pyshm" and row["error"]
                       for case in result["cases"] for row in case["rows"])
    return 1 if pyshm_failed else 0


def _config(args: argparse.Namespace) -> dict:
    quick = bool(args.quick)
    available = demo.available_memory()

    def pick(name):
        value = getattr(args, name, None)
        if value is not None:
            return value
        if quick and name in QUICK:
            return QUICK[name]
        return DEFAULTS.get(name)

    count = args.count or (min(QUICK["count"], demo.default_count()) if quick
                           else demo.default_count())
    big_bytes = pick("big_mib") << 20
    if args.big_mib is None:  # the default shrinks to a quarter of the available memory
        while big_bytes > BIG_MARK and big_bytes > available // 4:
            big_bytes //= 2
    receiver_bytes = pick("receiver_mib") << 20
    if args.receiver_mib is None:
        while receiver_bytes > BIG_MARK and receiver_bytes > available // 4:
            receiver_bytes //= 2
    return {
        "quick": quick,
        "repeats": pick("repeats"),
        "count": count,
        "threads": list(pick("threads")),
        "big_bytes": big_bytes,
        "receiver_bytes": receiver_bytes,
        "small_count": pick("small_count"),
        "cases": list(args.cases),
        "torch": not args.no_torch,
        "available_memory": available,
    }


class _Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Workloads: how the arrays are filled and checked (identical for every method)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _frame_pattern(index: int) -> np.ndarray:
    pattern = demo._pattern(index)
    pattern.flags.writeable = False
    return pattern


def _fill_frame(view: np.ndarray, index: int) -> None:
    """The bytes of ``demo.build`` (its pattern cached here, so no method pays for making it)."""
    demo.fill_frame(view, _frame_pattern(index), index)


def _check_frame(view: np.ndarray, index: int) -> None:
    pattern = _frame_pattern(index)
    ok = (np.array_equal(view[:, 0, 0], demo.frame_corner(index))
          and np.array_equal(view[0, -1], pattern[-1])
          and np.array_equal(view[FRAME_SHAPE[0] // 2, FRAME_SHAPE[1] // 2],
                             pattern[FRAME_SHAPE[1] // 2])
          and np.array_equal(view[-1, 1:, -1], pattern[1:, -1]))
    if not ok:
        raise AssertionError(f"frame {index}: wrong bytes after sharing")


@functools.lru_cache(maxsize=1)
def _big_row() -> np.ndarray:
    row = np.ascontiguousarray(_frame_pattern(0).reshape(-1)[:BIG_ROW])
    row.flags.writeable = False
    return row


def _big_marks(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes // BIG_MARK) % 251).astype(np.uint8)


def _fill_big(view: np.ndarray, index: int) -> None:
    view.reshape(-1, BIG_ROW)[:] = _big_row()
    view[::BIG_MARK] = _big_marks(view.nbytes)


def _check_big(view: np.ndarray, index: int) -> None:
    row = _big_row()
    rows = view.nbytes // BIG_ROW
    ok = np.array_equal(view[::BIG_MARK], _big_marks(view.nbytes))
    for k in (0, rows // 3, rows // 2, rows - 1):
        ok = ok and np.array_equal(view[k * BIG_ROW + 1:(k + 1) * BIG_ROW], row[1:])
    if not ok:
        raise AssertionError("big array: wrong bytes after sharing")


@functools.lru_cache(maxsize=1)
def _small_table() -> np.ndarray:
    table = (np.arange(SMALL_BYTES + 256) % 256).astype(np.uint8)
    table.flags.writeable = False
    return table


def _fill_small(view: np.ndarray, index: int) -> None:
    start = index % 251
    view[:] = _small_table()[start:start + SMALL_BYTES]


def _check_small(view: np.ndarray, index: int) -> None:
    start = index % 251
    table = _small_table()
    for k in (0, SMALL_BYTES // 2, SMALL_BYTES - 1):
        if view[k] != table[start + k]:
            raise AssertionError(f"4 KiB array {index}: wrong bytes after sharing")


class Workload:
    """``count`` arrays of ``shape`` (uint8), filled and checked the same way for every method."""

    def __init__(self, key: str, title: str, shape: tuple, count: int,
                 fill: Callable, check: Callable, per_share: bool = False) -> None:
        self.key = key
        self.title = title
        self.shape = shape
        self.count = count
        self.fill = fill
        self.check = check
        self.per_share = per_share  # report microseconds per share call
        self.item_bytes = int(np.prod(shape))

    @property
    def nbytes(self) -> int:
        return self.count * self.item_bytes


# ---------------------------------------------------------------------------------------------
# The ceiling: raw libc through ctypes
# ---------------------------------------------------------------------------------------------

MFD_CLOEXEC = 0x1
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_HUGEPAGE, MADV_POPULATE_WRITE, MADV_COLLAPSE = 14, 23, 25
HUGE = 2 << 20


class _Libc:
    """The libc calls of the ceiling, declared once (CDLL: each call releases the GIL)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        off_t = ctypes.c_int64
        self.memfd_create = self._declare(libc, "memfd_create", ctypes.c_int,
                                          [ctypes.c_char_p, ctypes.c_uint])
        self.ftruncate = self._declare(libc, "ftruncate", ctypes.c_int, [ctypes.c_int, off_t])
        self.pwrite = self._declare(libc, "pwrite", ctypes.c_ssize_t,
                                    [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, off_t])
        self.mmap = self._declare(libc, "mmap", ctypes.c_void_p,
                                  [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, off_t])
        self.munmap = self._declare(libc, "munmap", ctypes.c_int,
                                    [ctypes.c_void_p, ctypes.c_size_t])
        self.close = self._declare(libc, "close", ctypes.c_int, [ctypes.c_int])
        self.madvise = self._declare(libc, "madvise", ctypes.c_int,
                                     [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
        self.memcpy = self._declare(libc, "memcpy", ctypes.c_void_p,
                                    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t])

    @staticmethod
    def _declare(libc, name, restype, argtypes):
        func = getattr(libc, name)
        func.restype = restype
        func.argtypes = argtypes
        return func


def _oserror(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


# ---------------------------------------------------------------------------------------------
# Methods: each builds its sources the way its users would, then shares item i on request
# ---------------------------------------------------------------------------------------------


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
        return min(workload.count, _fd_budget())

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
        return min(workload.count, _fd_budget() // 2)

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
        self.libc = _Libc()

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
            raise _oserror("memfd_create")
        if self.libc.ftruncate(fd, nbytes) != 0:
            error = _oserror("ftruncate")
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
                    raise _oserror("pwrite")
                done += wrote
            mapped = libc.mmap(None, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
            if mapped is None or mapped == MAP_FAILED:
                raise _oserror("mmap")
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
                    raise _oserror("pwrite")
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
            raise _oserror("mmap")
        aligned = (reserved + HUGE - 1) // HUGE * HUGE
        mapped = libc.mmap(aligned, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0)
        if mapped is None or mapped == MAP_FAILED:
            error = _oserror("mmap")
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
            raise _oserror("mmap")
        return self._trim_to_aligned(reserved, span, nbytes)

    def share(self, index):
        address, nbytes = self.sources[index]
        self.libc.memcpy(self.maps[index], address, nbytes)
        self.items[index] = None


def _fd_budget() -> int:
    """File descriptors this process may still open, less a margin."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, soft - used - 256)


def _raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass


def _dev_shm_free() -> Optional[int]:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _cpu_snapshot() -> Optional[tuple]:
    """(wall s, busy CPU s of the whole machine, CPU s of this process), or None off Linux."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    ticks = [int(value) for value in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()


def _other_load(before: Optional[tuple], after: Optional[tuple]) -> Optional[float]:
    """CPUs kept busy on average by everything but this process between two snapshots.

    /proc/stat counts in 10 ms ticks per CPU, so windows shorter than LOAD_WINDOW give None.
    """
    if before is None or after is None or after[0] - before[0] < LOAD_WINDOW:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others / (after[0] - before[0]))


def _load_torch(wanted: bool):
    """(torch module or None, description)."""
    if not wanted:
        return None, "not run (--no-torch)"
    try:
        import torch
        import torch.multiprocessing

        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    except Exception as exc:  # ImportError, or a broken install
        return None, f"not installed ({type(exc).__name__}: {exc})"
    return torch, f"{torch.__version__} (file_descriptor strategy, " \
                  f"{torch.get_num_threads()} intra-op threads)"


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _run_once(method: Method, workload: Workload, count: int,
              pool: Optional[ThreadPool]) -> tuple:
    """Build ``count`` sources for ``method``, share them all (timed), check, and free.

    Returns (seconds, CPUs that other processes kept busy meanwhile, or None).
    """
    method.prepare(workload, count, pool)
    sources = []
    for index in range(count):
        item, view = method.new_source(workload.shape)
        workload.fill(view, index)
        sources.append(item)
        del item, view  # the list holds the only reference to each source
    method.start(sources)
    del sources
    gc.collect()
    try:
        share = method.share
        before = _cpu_snapshot()
        start = time.perf_counter()
        if pool is None:
            for index in range(count):
                share(index)
        else:
            pool.map(share, range(count), chunksize=1)
        seconds = time.perf_counter() - start
        others = _other_load(before, _cpu_snapshot())
        for index in range(count):
            method.check_shared(index)
            workload.check(method.result(index), index)
    finally:
        method.finish()
        gc.collect()
    return seconds, others


class _Row:
    def __init__(self, method: Method, threads: int, count: int, note: str = "") -> None:
        self.method = method
        self.threads = threads
        self.count = count
        self.seconds: list = []
        self.loads: list = []  # CPUs other processes kept busy during each timed run
        self.error = ""
        self.note = note


def _rotated(methods: list, shift: int) -> list:
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


def _run_case(workload: Workload, methods: list, threads: list, repeats: int,
              progress) -> list:
    """Interleave every method round by round; one row per (method, threads)."""
    dev_shm = _dev_shm_free()
    rows = {}
    for method in methods:
        count = method.capacity(workload)
        note = ""
        if count < workload.count:
            note = f"{count:,} arrays (fd limit)"
        if (method.key in ("torch", "shm") and dev_shm is not None
                and dev_shm < count * workload.item_bytes * 1.05):
            note = f"skipped: /dev/shm has {dev_shm / 1e9:.2f} GB free"
            count = 0
        for pool_size in threads:
            row = _Row(method, pool_size, count, note)
            if count == 0:
                row.error = note
            rows[method.key, pool_size] = row
    pools = {size: ThreadPool(size) for size in threads if size} if workload.key == "seed" else {}
    try:
        for round_index in range(repeats):
            for pool_size in threads:
                done = []
                for method in _rotated(methods, round_index):
                    row = rows[method.key, pool_size]
                    if row.error:
                        continue
                    try:
                        seconds, others = _run_once(method, workload, row.count,
                                                    pools.get(pool_size))
                    except Exception as exc:  # report, keep the other methods going
                        row.error = f"{type(exc).__name__}: {exc}"
                        done.append(f"{method.key} FAILED")
                        continue
                    row.seconds.append(seconds)
                    row.loads.append(others)
                    if workload.per_share:
                        done.append(f"{method.key} {seconds / row.count * 1e6:.1f} us")
                    else:
                        done.append(f"{method.key} {seconds:.3f} s")
                if progress:
                    where = (f", {pool_size} thread{'s' if pool_size > 1 else ''}"
                             if workload.key == "seed" else "")
                    progress(f"{workload.key} round {round_index + 1}/{repeats}{where}: "
                             + ", ".join(done))
    finally:
        for pool in pools.values():
            pool.close()
            pool.join()
    return [rows[method.key, size] for size in threads for method in methods]


def _warm_up(methods: list) -> None:
    """One small untimed run per method: lazy imports, resource tracker, first calls."""
    tiny = Workload("warm-up", "", (SMALL_BYTES,), 8, _fill_small, _check_small)
    for method in methods:
        try:
            _run_once(method, tiny, tiny.count, None)
        except Exception:
            pass  # the timed runs report it


def run(config: dict, progress=None) -> dict:
    """Run the benchmark described by ``config`` (see :func:`_config`); returns the result."""
    from . import __version__

    _raise_fd_limit()
    torch, torch_text = _load_torch(config["torch"])
    methods = [PyshmMethod(), PyshmRecycledMethod()]
    if torch is not None:
        methods.append(TorchMethod(torch))
    methods += [SharedMemoryMethod(), CeilingMethod(), HugeCeilingMethod(), MemcpyMethod()]
    repeats = config["repeats"]
    count = config["count"]
    workloads = {
        "seed": (Workload("seed", f"Seed workload: {count} uint8 arrays of "
                          f"{'x'.join(map(str, FRAME_SHAPE))} ({count * FRAME_BYTES / 1e9:.2f} GB),"
                          " shared from a ThreadPool", FRAME_SHAPE, count,
                          _fill_frame, _check_frame), config["threads"]),
        "big": (Workload("big", f"One {_size_text(config['big_bytes'])} array, one call",
                         (config["big_bytes"],), 1, _fill_big, _check_big), [1]),
        "small": (Workload("small", f"{config['small_count']:,} arrays of 4 KiB, one call at a "
                           "time (us per share)", (SMALL_BYTES,), config["small_count"],
                           _fill_small, _check_small, per_share=True), [1]),
    }
    if progress:
        progress(f"pyshm {__version__}; torch {torch_text}; "
                 f"{repeats} rounds of {', '.join(config['cases'])}")
    _warm_up(methods)
    # Move everything alive now (torch alone is ~10^5 objects) out of the collector's sight:
    # the gc.collect() between runs then takes microseconds instead of ~40 ms.
    gc.collect()
    gc.freeze()
    before = _cpu_snapshot()
    try:
        result = _run_cases(config, methods, workloads, torch, torch_text, progress)
    finally:
        gc.unfreeze()
    result["other_cpu_load"] = _other_load(before, _cpu_snapshot())
    return result


def _run_cases(config: dict, methods: list, workloads: dict, torch, torch_text: str,
               progress=None) -> dict:
    from . import __version__

    result = {
        "pyshm": __version__,
        "numpy": np.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_note": torch_text,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "available_memory": config["available_memory"],
        "config": {key: value for key, value in config.items() if key != "available_memory"},
        "cases": [],
    }
    more_targets = []
    for key in config["cases"]:
        if key == "receiver":
            from . import bench_receiver

            case = bench_receiver.run_case(config["receiver_bytes"], config["repeats"],
                                           torch is not None, progress)
            result["cases"].append(case)
            continue
        if key == "engines":
            from . import bench_engines

            case = bench_engines.run_case(bench_engines.NBYTES, config["repeats"],
                                          torch is not None, progress)
            result["cases"].append(case)
            more_targets += bench_engines.targets(case)
            continue
        if key == "huge_off":
            result["cases"] += _huge_off_cases(config, torch is not None, progress)
            continue
        if key == "processes":
            from . import bench_processes

            sizes = bench_processes.QUICK if config["quick"] else bench_processes.DEFAULTS
            case = bench_processes.run_case(sizes["count"], sizes["single"], "fork",
                                            config["repeats"], torch is not None, progress)
            result["cases"].append(case)
            more_targets += bench_processes.targets(case, config["quick"])
            continue
        workload, threads = workloads[key]
        runs = [method for method in methods if key not in method.skip]
        rows = _run_case(workload, runs, threads, config["repeats"], progress)
        result["cases"].append(_case_result(workload, rows))
    result["targets"] = _targets(result) + more_targets
    return result


def _huge_off_cases(config: dict, use_torch: bool, progress=None) -> list:
    """The seed workload at ThreadPool(2), and the receiver case when this run has it, again
    in a child process with ``LSHM_HUGE=0`` (libshm reads it once per process): their cases,
    keys suffixed ``_huge_off``. A child that fails gives a case whose one row says why."""
    cases = ["seed"] + (["receiver"] if "receiver" in config["cases"] else [])
    command = [sys.executable, "-m", "pyshm", "bench", "--json", "--quiet",
               "--cases", ",".join(cases), "--threads", "2",
               "--repeats", str(config["repeats"]), "--count", str(config["count"]),
               "--receiver-mib", str(config["receiver_bytes"] >> 20)]
    if config["quick"]:
        command.append("--quick")
    if not use_torch:
        command.append("--no-torch")
    if progress:
        progress(f"huge_off: {', '.join(cases)} again in a child process with LSHM_HUGE=0")
    env = dict(os.environ, LSHM_HUGE="0")
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, env=env)
    try:
        if done.returncode != 0:
            raise ValueError(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                             else f"exit status {done.returncode}")
        child = json.loads(done.stdout)
    except ValueError as exc:
        return [{"case": "seed_huge_off", "title": "Huge pages off (LSHM_HUGE=0)",
                 "shape": [], "count": 0, "bytes": 0, "per_share": False,
                 "rows": [{"method": "pyshm", "label": "pyshm.share_memory_", "threads": 2,
                           "seconds": [], "error": f"child process failed: {exc}",
                           "note": None, "ratios": {}}]}]
    out = []
    for case in child["cases"]:
        case["case"] += "_huge_off"
        case["title"] = "Huge pages off (LSHM_HUGE=0): " + case["title"]
        out.append(case)
    return out


def _size_text(nbytes: int) -> str:
    if nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30} GiB"
    return f"{nbytes >> 20} MiB"


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------

BASELINES = ("torch", "shm", "ceiling", "ceiling_huge", "memcpy", "own")


def row_stats(seconds: list, loads: list, count: int, nbytes: int, per_share: bool) -> dict:
    """The measured fields of a result row (also used by :mod:`pyshm.bench_processes`): the
    runs' seconds and other-CPU loads, how many were quiet, min and median, GB/s and whether
    the best run was quiet, and microseconds per item when ``per_share``."""
    stats = {
        "seconds": seconds,
        "other_cpu_load": loads,
        "quiet_runs": sum(1 for load in loads if load is not None and load < QUIET_LOAD),
        "min_s": min(seconds) if seconds else None,
        "median_s": statistics.median(seconds) if seconds else None,
    }
    if seconds:
        stats["gbps"] = nbytes / stats["min_s"] / 1e9
        best_load = loads[seconds.index(stats["min_s"])]
        stats["best_run_quiet"] = None if best_load is None else best_load < QUIET_LOAD
        if per_share:
            stats["min_us_per_share"] = stats["min_s"] / count * 1e6
            stats["median_us_per_share"] = stats["median_s"] / count * 1e6
    return stats


def measure_into(runs: dict, errors: dict, done: list, key, label: str, run: Callable,
                 text: Callable) -> None:
    """One timed run of a method (also for :mod:`pyshm.bench_processes` and the receiver and
    engine cases): ``run()`` gives (seconds, other CPUs' load or None), kept in ``runs[key]``;
    a failure is kept in ``errors[key]`` and the others go on. ``done`` gets the progress
    text (``text(seconds)``, or FAILED)."""
    try:
        seconds, others = run()
    except Exception as exc:  # report, keep the other methods going
        errors[key] = f"{type(exc).__name__}: {exc}"
        done.append(f"{label} FAILED")
        return
    runs[key].append((seconds, others))
    done.append(f"{label} {text(seconds)}")


def target_notes(median_text: str, met: bool, met_on_median: bool, rows: tuple,
                 extra: list) -> str:
    """A target's note: its median (and whether that disagrees with the verdict), the rows
    whose best run other processes disturbed, then ``extra``."""
    notes = [f"median {median_text}"
             + ("" if met_on_median == met else
                ", met on the median only" if met_on_median else ", not met on the median")]
    disturbed = [r["label"] for r in rows if r is not None and r.get("best_run_quiet") is False]
    if disturbed:
        notes.append(f"best run of {' and '.join(disturbed)} disturbed by other processes")
    return "; ".join(notes + extra)


def _case_result(workload: Workload, rows: list) -> dict:
    out_rows = []
    for row in rows:
        nbytes = row.count * workload.item_bytes
        out_rows.append({
            "method": row.method.key,
            "label": row.method.label,
            "threads": row.threads,
            "count": row.count,
            "bytes": nbytes,
            **row_stats(row.seconds, row.loads, row.count, nbytes, workload.per_share),
            "error": row.error or None,
            "note": row.note or None,
        })
    # Ratios: this row's time over the baseline's time at the same thread count (per share
    # for the small case, where counts may differ), from the min and from the median times.
    for entry in out_rows:
        entry["ratios"] = {}
        for base in BASELINES:
            other = next((o for o in out_rows if o["method"] == base
                          and o["threads"] == entry["threads"]), None)
            if other is None or not other["seconds"] or not entry["seconds"]:
                continue
            entry["ratios"][base] = {
                stat: (entry[f"{stat}_s"] / entry["count"]) / (other[f"{stat}_s"] / other["count"])
                for stat in ("min", "median")
            }
    return {
        "case": workload.key,
        "title": workload.title,
        "shape": list(workload.shape),
        "count": workload.count,
        "bytes": workload.nbytes,
        "per_share": workload.per_share,
        "rows": out_rows,
    }


def _find(result: dict, case: str, method: str, threads: int) -> Optional[dict]:
    for entry in result["cases"]:
        if entry["case"] == case:
            for row in entry["rows"]:
                if row["method"] == method and row["threads"] == threads and row["seconds"]:
                    return row
    return None


def _targets(result: dict) -> list:
    """Each target of the issue: the measured value, met or not, and what may weaken it."""
    ran = {entry["case"] for entry in result["cases"]}
    off_threads = result["config"]["threads"] if 2 in result["config"]["threads"] else [2]
    big_text = _size_text(result["config"]["big_bytes"])
    specs = [
        # name, bar, case, threads, baseline, value from (pyshm row, baseline row), met?, format
        ("seed workload, ThreadPool(2), pyshm time / torch time",
         f"<= {TARGET_SEED_VS_TORCH:.2f}", "seed", 2, "torch",
         lambda row, base, stat: row["ratios"]["torch"][stat],
         lambda value: value <= TARGET_SEED_VS_TORCH, "{:.2f}"),
        ("seed workload, ThreadPool(2), pyshm time / huge-page ceiling time",
         f"<= {TARGET_SEED_VS_CEILING:.2f}", "seed", 2, "ceiling_huge",
         lambda row, base, stat: row["ratios"]["ceiling_huge"][stat],
         lambda value: value <= TARGET_SEED_VS_CEILING, "{:.2f}"),
        (f"one {big_text} array, torch time / pyshm time",
         f">= {TARGET_BIG_SPEEDUP:.2f}", "big", 1, "torch",
         lambda row, base, stat: 1 / row["ratios"]["torch"][stat],
         lambda value: value >= TARGET_BIG_SPEEDUP, "{:.2f}x"),
        ("4 KiB arrays, pyshm us per share",
         f"<= {TARGET_SMALL_US:.0f} us", "small", 1, None,
         lambda row, base, stat: row[f"{stat}_us_per_share"],
         lambda value: value <= TARGET_SMALL_US, "{:.1f} us"),
        ("4 KiB arrays, pyshm time per in-place share / ceiling time",
         f"<= {TARGET_SMALL_VS_CEILING:.2f}", "small", 1, "ceiling",
         lambda row, base, stat: row["ratios"]["ceiling"][stat],
         lambda value: value <= TARGET_SMALL_VS_CEILING, "{:.2f}"),
        ("a spawned worker's first read, pyshm time / torch time",
         f"<= {TARGET_RECEIVER_VS_TORCH:.2f}", "receiver", 1, "torch",
         lambda row, base, stat: row["ratios"]["torch"][stat],
         lambda value: value <= TARGET_RECEIVER_VS_TORCH, "{:.3f}"),
        ("huge pages off (LSHM_HUGE=0): seed workload, ThreadPool(2), pyshm time / torch time",
         f"<= {TARGET_HUGE_OFF_VS_TORCH:.2f}", "seed_huge_off", 2, "torch",
         lambda row, base, stat: row["ratios"]["torch"][stat],
         lambda value: value <= TARGET_HUGE_OFF_VS_TORCH, "{:.2f}"),
    ]
    targets = []
    for name, bar, case, threads, base_key, value_of, passes, form in specs:
        target = {"name": name, "bar": bar, "value": None, "median_value": None, "met": None,
                  "text": "", "note": ""}
        targets.append(target)
        row = _find(result, case, "pyshm", threads)
        base = _find(result, case, base_key, threads) if base_key else None
        if case not in ran or (case == "seed" and threads not in result["config"]["threads"]) \
                or (case == "seed_huge_off" and threads not in off_threads):
            target["text"] = "not measured (case not run)"
            continue
        if row is None:
            target["text"] = "not measured (pyshm failed)"
            continue
        if base_key and base is None:
            why = result["torch_note"] if base_key == "torch" else f"{base_key} failed"
            target["text"] = f"not measured: {why}"
            continue
        value, median = value_of(row, base, "min"), value_of(row, base, "median")
        target.update(value=value, median_value=median, met=passes(value),
                      text=form.format(value))
        extra = []
        if case == "big" and result["config"]["big_bytes"] != 1 << 30:
            extra.append("measured on a smaller array")
        if case == "receiver" and result["config"]["receiver_bytes"] != 1 << 30:
            extra.append("measured on a smaller array")
        if result["config"]["quick"]:
            extra.append("quick run")
        target["note"] = target_notes(form.format(median), passes(value), passes(median),
                                      (row, base), extra)
    return targets


def quiet_text(row: dict) -> str:
    """"quiet runs/runs", or "-" when no run was long enough to measure other processes."""
    known = sum(1 for load in row["other_cpu_load"] if load is not None)
    return f"{row['quiet_runs']}/{len(row['seconds'])}" if known else "-"


def target_text(target: dict) -> str:
    """One target as a line: name, bar, measured value, met or not, note."""
    state = {True: "met", False: "NOT MET", None: "-"}[target["met"]]
    text = f"{target['name']} {target['bar']}: {target['text']}  {state}"
    return text + (f"  ({target['note']})" if target["note"] else "")


def _ratio_text(row: dict, base: str) -> str:
    ratio = row["ratios"].get(base)
    if ratio is None:
        return "-"
    return f"{ratio['min']:.2f} ({ratio['median']:.2f})"


def format_report(result: dict) -> str:
    """The tables and the targets block, as printed."""
    lines = []
    mem = result["available_memory"] / 2**30
    lines.append(f"pyshm {result['pyshm']} bench: Python {result['python']}, numpy "
                 f"{result['numpy']}, {result['cpus']} CPUs, {mem:.1f} GiB available")
    lines.append(f"torch: {result['torch_note']}")
    load = result.get("other_cpu_load")
    if load is not None:
        text = f"other processes kept {load:.2f} of {result['cpus']} CPUs busy during the run"
        if load > 0.2:
            text += ": the machine was not quiet, absolute times and ratios are less reliable"
        lines.append(text)
    lines.append(f"{result['config']['repeats']} rounds per case, methods interleaved; "
                 "ratio = this row's time / the baseline's time at the same thread count, "
                 "from min times (median times in brackets); < 1 means this row is faster; "
                 f"quiet = runs during which other processes kept < {QUIET_LOAD} CPU busy "
                 f"(- for runs under {LOAD_WINDOW} s, too short to tell)")
    present = {row["method"] for case in result["cases"] for row in case["rows"]
               if row["seconds"]}
    bases = [base for base in BASELINES if base in present]
    base_titles = {"torch": "vs torch", "shm": "vs SharedMem", "ceiling": "vs ceiling",
                   "ceiling_huge": "vs huge ceil", "memcpy": "vs memcpy",
                   "own": "vs own way"}
    for case in result["cases"]:
        unit = ("us" if case["per_share"] else
                "ms" if case["case"].startswith(("receiver", "engines")) else "s")
        head = (f"{'method':<22}{'threads':>8}{'min ' + unit:>10}{'median ' + unit:>11}"
                f"{'GB/s':>8}{'quiet':>7}"
                + "".join(f"{base_titles[base]:>15}" for base in bases))
        lines += ["", case["title"], head, "-" * len(head)]
        for row in case["rows"]:
            text = f"{row['label']:<22}{row['threads']:>8}"
            if not row["seconds"]:
                lines.append(f"{text}  {row['error'] or 'no result'}")
                continue
            if case["per_share"]:
                low, mid = row["min_us_per_share"], row["median_us_per_share"]
                text += f"{low:>10.1f}{mid:>11.1f}"
            elif unit == "ms":
                text += f"{row['min_s'] * 1e3:>10.2f}{row['median_s'] * 1e3:>11.2f}"
            else:
                text += f"{row['min_s']:>10.3f}{row['median_s']:>11.3f}"
            text += f"{row['gbps']:>8.2f}{quiet_text(row):>7}"
            text += "".join(f"{_ratio_text(row, base):>15}" for base in bases)
            notes = [note for note in (row["note"], row["error"] and f"then failed: "
                                       f"{row['error']}") if note]
            if notes:
                text += "  " + "; ".join(notes)
            lines.append(text)
    lines += ["", "targets (judged on min times)"]
    lines += ["  " + target_text(target) for target in result["targets"]]
    return "\n".join(lines)
