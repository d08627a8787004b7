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
  ThreadPool that is one segment per thread at a time (the "ceiling" rows of the README tables).

Cases: (a) the seed workload (uint8 arrays of 128x480x640, 64 by default, fewer when a quarter
of the available memory does not hold them) from a ``ThreadPool`` of 1, 2 and 8 threads; (b)
one 1 GiB array; (c) 10,000 arrays of 4 KiB, one call at a time (time per share in us); (d)
``processes``: 4 KiB shared arrays sent to a ``Pool(1)`` worker and back, batched and one by
one (us per array, ratios to torch and SharedMemory; see :mod:`pyshm.bench.processes`); (e)
``receiver``: a spawned worker's first read of a big shared array
(:mod:`pyshm.bench.receiver`); (f) ``huge_off``: the seed workload and the receiver again with
``LSHM_HUGE=0``; (g) ``engines``: one 64 MiB array through torch, joblib, Dask and Ray
(:mod:`pyshm.bench.engines`).

Fairness: memory new to the process is slow on these VMs (the README's "ceiling" and "memcpy"
rows show it: a copy into fresh memfd pages runs at about a quarter of memcpy's speed into
populated memory), so each method builds its own inputs the same way right before its timed
run, frees or replaces its sources while it copies, and releases all of its results (and is
garbage-collected) before the next method builds anything: two full workloads are never alive
at once. Every result is checked (a few bytes per array, and that it really is shared) so that
no method is timed doing less work. Progress goes to stderr; ``--json`` puts a machine-readable
result on stdout (the tables then go to stderr).

Modules: :mod:`.runner` (the command line, the array cases, targets and report),
:mod:`.workloads` (how arrays are filled and checked), :mod:`.methods` (pyshm, torch,
SharedMemory and the ceilings), :mod:`.libc` (the ceilings' libc calls), :mod:`.measure`
(loads, timed runs, row statistics), and one module per other case. The runtime (``import
pyshm``) never imports this package.
"""

from __future__ import annotations

__all__ = ["add_arguments", "format_report", "main", "run"]


def __getattr__(name: str):
    # (lazily: a worker that imports one case module, e.g. the receiver's, loads nothing else)
    if name in __all__:
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
