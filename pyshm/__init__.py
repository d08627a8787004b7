"""pyshm: numpy arrays in never-moving storages, shared in place through anonymous memfds.

Quick tour::

    import numpy as np, pyshm
    a = pyshm.empty((1024, 1024), np.float32)   # an ordinary ndarray owned by a pyshm storage
    v = a[::2]                                   # any view
    pyshm.share_memory_(a)                       # now in shared memory, same address:
    assert pyshm.is_shared(v)                    # every view sees the shared bytes
    b = pyshm.copy(np.arange(10), shared=True)   # bring foreign memory in

Heavy calls run in C without the GIL, so a ``ThreadPool`` shares many arrays in parallel.
See :class:`pyshm.Storage` for the lifetime contract and ``python -m pyshm --help`` for the
demo, the benchmark and the planner command line.
"""

from ._ffi import (
    LIBRARY_PATH,
    ShmBufferError,
    ShmError,
    ShmMemoryError,
    ShmPermissionError,
    ShmValueError,
    lib as _lib,
)
from .arena import Arena
from .arrays import copy, empty, is_shared, share_memory_, storage_of, zeros
from .planner import Plan, lower_bound, plan
from .storage import Storage, trim_pool
from ._channel import DeliveryError, Undelivered
from .reduction import Ref, ref, register as _register_reducers, share_readonly
from . import engines as _engines

_register_reducers()
_engines._watch()

__version__ = _lib.lshm_version_string().decode()

__all__ = [
    "Storage",
    "empty",
    "zeros",
    "copy",
    "share_memory_",
    "is_shared",
    "storage_of",
    "trim_pool",
    "share_readonly",
    "ref",
    "Ref",
    "plan",
    "lower_bound",
    "Plan",
    "Arena",
    "ShmError",
    "ShmMemoryError",
    "ShmValueError",
    "ShmBufferError",
    "ShmPermissionError",
    "DeliveryError",
    "Undelivered",
    "LIBRARY_PATH",
    "__version__",
]
