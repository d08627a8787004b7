"""The libc calls of the ceilings, through ctypes (each call releases the GIL): the bench's
only binding of libc; the library itself goes through liblshm."""

from __future__ import annotations

import ctypes
import os

MFD_CLOEXEC = 0x1
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_HUGEPAGE, MADV_POPULATE_WRITE, MADV_COLLAPSE = 14, 23, 25
HUGE = 2 << 20


class Libc:
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


def oserror(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")
