"""The ``engines`` case of ``python -m pyshm bench``: one 64 MiB array to a worker and back
through each engine installed, pyshm memory against the engine's own way.

Each round, for each engine and method, the parent makes the data the way that method's users
have it (untimed), then times one round trip: the worker writes one byte of what it got and
returns it, and the parent checks the result (and, for pyshm, that the worker's write is in
the parent's own memory: the engine's own ways copy, so there the write stays in the copy).
Workers are started once per engine, before the rounds.

* torch.multiprocessing ``Pool(1)`` (fork), ``apply``: a ``torch.zeros`` tensor (torch moves
  it into its own shared memory when it is sent, copying it) against a tensor over a pyshm
  array made with ``shared=True`` (``torch.from_numpy``);
* joblib ``Parallel(n_jobs=2)`` on the loky backend, one task: a ``numpy.zeros`` array
  (joblib dumps it into a memmapped file of its temporary folder, and the worker's result
  comes back by value)
  against a pyshm array made with ``shared=True``;
* dask.distributed ``LocalCluster`` (one process worker), a client with direct transfers:
  ``scatter`` then ``submit`` and ``result`` ("dask"), and ``submit(f, array)`` with the
  array as the task's argument ("dask submit": pickled into the task, through the scheduler;
  a pyshm array there pyshm scatters to the worker first), a ``numpy.zeros`` array (by value
  both ways) against a pyshm array made with ``shared=True``;
* Ray, a local cluster of 2 CPUs: ``ray.put`` then a task on the object and ``ray.get``, a
  ``numpy.zeros`` array (Ray's object store: read in place, read-only, so the worker writes a
  copy that comes back by value) against a pyshm array made with ``shared=True`` (which Ray
  still copies into its store both ways, beside the reference: see pyshm.engines).

For dask ("dask") and Ray, a third row ("once") is each engine's fastest way as #13 measured
it: the array scattered (or ``ray.put``) before the timing, and the timed task reads one byte
of it and returns that byte; nothing comes back and a write would stay in the worker's copy
(dask) or raise (Ray's read-only store), so it is no round trip of the array, but the bar the
issue sets. A fourth ("pyshm once") does the same with a pyshm array made with
``shared=True``, but its task writes the byte, and the parent checks that the write is in its
own memory: the array sent once, its changes back with no transfer.
"""

from __future__ import annotations

import gc
import time
import warnings

import numpy as np

import pyshm
from pyshm.bench.measure import measure_rounds, row_stats

__all__ = ["run_case", "NBYTES"]

NBYTES = 64 << 20
MARK = 9
ONCE = ("once", "pyshm once")  # the rows of an array sent before the timing
ONCE_RUNS = 4  # runs of those per round: each costs a few ms, and they differ by less


def touch_tensor(tensor):
    tensor[-1] = MARK
    return tensor


def touch_array(array):
    array = np.asarray(array)
    if array.flags.writeable:
        array[-1] = MARK
        return array
    out = np.array(array)  # (joblib's memmaps are read-only: the worker writes a copy)
    out[-1] = MARK
    return out


def peek(array):
    return int(np.asarray(array)[-1])


def poke(array):
    """Writes the last byte of ``array`` in place, returns what it was."""
    array = np.asarray(array)
    before = int(array[-1])
    array[-1] = MARK
    return before


def _array_methods(nbytes, run, own_label, send_once=None, once_label="") -> list:
    """An engine's methods for numpy arrays, given run(state, array) -> the timed call: a
    ``numpy.zeros`` array, and a pyshm array made with ``shared=True`` whose write by the
    worker must be in the parent's own memory; and, given send_once(state, array, write) ->
    the timed call, the engine's fastest own way, with the array sent before the timing
    (untimed) and the worker reading one byte of it (no write: it would stay in the worker's
    copy), as #13 measured it ("scatter once", "ray.put once"), and the same way with a pyshm
    array whose worker writes that byte (write=True), which must be in the parent's memory."""
    def own(state):
        array = np.zeros(nbytes, np.uint8)
        return run(state, array), lambda back: int(back[-1]) == MARK

    def ours(state):
        array = pyshm.zeros(nbytes, np.uint8, shared=True)

        def check(back):
            return int(back[-1]) == MARK and int(array[-1]) == MARK
        return run(state, array), check

    def once(state):
        return send_once(state, np.zeros(nbytes, np.uint8), False), lambda back: back == 0

    def ours_once(state):
        array = pyshm.zeros(nbytes, np.uint8, shared=True)

        def check(back):
            return back == 0 and int(array[-1]) == MARK
        return send_once(state, array, True), check

    methods = [("own", own_label, own), ("pyshm", "pyshm", ours)]
    if send_once is not None:
        methods[1:1] = [("once", once_label, once)]
        methods.append(("pyshm once", "pyshm (sent before, written)", ours_once))
    return methods


class _Engine:
    def __init__(self, key, label, start, stop, methods) -> None:
        self.key, self.label, self.start, self.stop, self.methods = key, label, start, stop, methods
        self.state = None


def _torch_engine(nbytes):
    import torch
    import torch.multiprocessing as tmp

    def start():
        tmp.set_sharing_strategy("file_descriptor")
        pool = tmp.get_context("fork").Pool(1)
        pool.apply(int, (0,))
        return pool

    def own(pool):
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        return lambda: pool.apply(touch_tensor, (tensor,)), lambda back: int(back[-1]) == MARK

    def ours(pool):
        array = pyshm.zeros(nbytes, np.uint8, shared=True)
        tensor = torch.from_numpy(array)

        def check(back):
            return int(back[-1]) == MARK and int(array[-1]) == MARK
        return lambda: pool.apply(touch_tensor, (tensor,)), check

    return _Engine("torch", f"torch.multiprocessing Pool {torch.__version__}", start,
                   lambda pool: (pool.terminate(), pool.join()),
                   [("own", "own way", own), ("pyshm", "pyshm", ours)])


def _joblib_engine(nbytes):
    import joblib

    def start():
        joblib.Parallel(n_jobs=2, backend="loky")(joblib.delayed(int)(0) for _ in range(2))
        return None

    def run(_, array):
        # (n_jobs=2: with one job joblib runs the task in this process)
        return lambda: joblib.Parallel(n_jobs=2, backend="loky")(
            joblib.delayed(touch_array)(array) for _ in range(1))[0]

    return _Engine("joblib", f"joblib {joblib.__version__} loky", start, lambda _: None,
                   _array_methods(nbytes, run, "own (memmap)"))


def _dask_engines(nbytes):
    """Two engines over one cluster: data scattered then named in a task ("dask"), and the
    array as the task's argument ("dask submit": pickled into the task, through the
    scheduler; pyshm scatters a shared array to a worker first)."""
    import distributed

    cluster: list = []

    def start():
        if not cluster:
            made = distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                            dashboard_address=None)
            cluster.extend([made, distributed.Client(made, direct_to_workers=True)])
            cluster[1].submit(int, 0).result()
        return cluster[1]

    def stop(_):
        if cluster:
            cluster[1].close()
            cluster[0].close()
            cluster.clear()

    def scatter(client, array):
        return lambda: client.submit(touch_array, client.scatter(array, hash=False),
                                     pure=False).result()

    def scatter_once(client, array, write):
        future = client.scatter(array, hash=False)
        return lambda: client.submit(poke if write else peek, future, pure=False).result()

    def argument(client, array):
        def call():
            with warnings.catch_warnings():  # (by value, dask warns of "a large graph")
                warnings.filterwarnings("ignore", "Sending large graph")
                return client.submit(touch_array, array, pure=False).result()
        return call

    label = f"distributed {distributed.__version__}"
    return [_Engine("dask", label, start, stop,
                    _array_methods(nbytes, scatter, "own (by value)", scatter_once,
                                   "own (scattered before, read)")),
            _Engine("dask submit", label, start, stop,
                    _array_methods(nbytes, argument, "own (by value)"))]


def _ray_engine(nbytes):
    import ray

    def start():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        tasks = ray.remote(touch_array), ray.remote(peek), ray.remote(poke)
        for task in tasks:
            ray.get(task.remote(pyshm.zeros(1, np.uint8, shared=True)))
        return tasks

    def run(tasks, array):
        # (ray.put, then a task on it: Ray's zero-copy way, the object store read in place)
        return lambda: ray.get(tasks[0].remote(ray.put(array)))

    def put_once(tasks, array, write):
        # put, and read by a task, before the timing (as every task but the first on an
        # object put once has it: a pyshm array's memory already fetched by the worker)
        put = ray.put(array)
        ray.get(tasks[1].remote(put))
        return lambda: ray.get(tasks[2 if write else 1].remote(put))

    return _Engine("ray", f"ray {ray.__version__}", start, lambda _: ray.shutdown(),
                   _array_methods(nbytes, run, "own (object store)", put_once,
                                  "own (put before, read)"))


def _engines(nbytes, use_torch):
    engines, notes = [], {}
    makers = [("torch", _torch_engine)] if use_torch else []
    makers += [("joblib", _joblib_engine), ("dask", _dask_engines), ("ray", _ray_engine)]
    for name, make in makers:
        try:
            made = make(nbytes)
            engines.extend(made if isinstance(made, list) else [made])
        except ImportError as exc:
            notes[name] = f"not installed ({exc})"
    if not use_torch:
        notes["torch"] = "not run (--no-torch)"
    return engines, notes


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _round_trip(make, state) -> tuple:
    """(seconds of one round trip, None): the data made untimed, the result checked."""
    call, check = make(state)
    gc.collect()
    start = time.perf_counter()
    back = call()
    seconds = time.perf_counter() - start
    if not check(back):
        raise AssertionError("the worker's write did not come back")
    del back, call, check
    gc.collect()
    return seconds, None


def _stop(engines: list) -> None:
    for engine in engines:
        if engine.state is not None:
            engine.stop(engine.state)
            engine.state = None


def run_case(nbytes: int, repeats: int, use_torch: bool = True, progress=None) -> dict:
    """Rows in :mod:`pyshm.bench`'s format (``method`` is "pyshm" or "own", ``engine`` says
    which); each pyshm row's ratio is to its engine's own way."""
    engines, notes = _engines(nbytes, use_torch)
    runs = {(engine.key, key): [] for engine in engines for key, _, _ in engine.methods}
    errors: dict = {}
    for engine in engines:
        try:
            engine.state = engine.start()
        except Exception as exc:  # report, go on with the others
            for key, _, _ in engine.methods:
                errors[engine.key, key] = f"{type(exc).__name__}: {exc}"
    try:
        def plan(round_index):
            for engine in engines:  # (each engine's methods alternate which goes first)
                methods = engine.methods[round_index % 2:] + engine.methods[:round_index % 2]
                # (the sent-once rows, a few ms against each other, ONCE_RUNS times a round)
                methods += [m for m in methods if m[0] in ONCE] * (ONCE_RUNS - 1)
                for key, _, make in methods:
                    yield ((engine.key, key), f"{engine.key} {key}",
                           lambda: _round_trip(make, engine.state), _milliseconds)

        measure_rounds(runs, errors, repeats, plan, progress, "engines")
    finally:
        _stop(engines)
    rows = []
    for engine in engines:
        for key, label, _ in engine.methods:
            measured = runs[engine.key, key]
            rows.append({
                "method": key,
                "engine": engine.key,
                "label": f"{engine.key}: {label}",
                "threads": 1,
                "count": 1,
                "bytes": nbytes,
                **row_stats([s for s, _ in measured], [load for _, load in measured], 1,
                            nbytes, per_share=False),
                "error": errors.get((engine.key, key)),
                "note": None,
                "ratios": {},
            })
    for row in rows:  # (pyshm against the engine's own way; pyshm once against its once)
        for base in ("own", "once"):
            if base == "own" and row["method"] == "pyshm once":
                continue
            other = next((o for o in rows if o["engine"] == row["engine"]
                          and o["method"] == base and o["seconds"]), None)
            if other is not None and row["seconds"]:
                row["ratios"][base] = {stat: row[f"{stat}_s"] / other[f"{stat}_s"]
                                       for stat in ("min", "median")}
    return {
        "case": "engines",
        "title": f"One {nbytes >> 20} MiB array to a worker and back through each engine "
                 "(ms per round trip; own = the engine's own way; once = its fastest: the "
                 "array sent before the timing, one byte read, nothing back; pyshm once: "
                 "the same, the byte written and seen by the parent; the sent-once rows "
                 f"{ONCE_RUNS} runs a round)",
        "shape": [nbytes],
        "count": 1,
        "bytes": nbytes,
        "per_share": False,
        "notes": notes,
        "rows": rows,
    }


def targets(case: dict) -> list:
    """Per engine: pyshm's round trip at most the engine's own way's, with writes visible;
    and, where measured, the array sent once with pyshm (the worker writes a byte, seen by
    the parent) at most the engine's fastest way (#13: "dask scatter-once about 10 ms, ray.put
    once about 2.5 ms"), which sends the array the same way before its timing and whose
    worker only reads a byte."""
    out = []
    for row in case["rows"]:
        if row["method"] == "pyshm":
            base, title = "own", "the engine's own"
        elif row["method"] == "pyshm once":
            base, title = "once", "the engine's own, both sent once"
        else:
            continue
        target = {"name": f"{row['engine']}: 64 MiB round trip, pyshm time / {title}",
                  "bar": "<= 1.00", "value": None, "median_value": None, "met": None,
                  "text": "", "note": ""}
        out.append(target)
        ratio = row["ratios"].get(base)
        if ratio is None:
            target["text"] = "not measured" + (f": {row['error']}" if row["error"] else "")
            continue
        target.update(value=ratio["min"], median_value=ratio["median"],
                      met=ratio["min"] <= 1.0, text=f"{ratio['min']:.3f}",
                      note=f"median {ratio['median']:.3f}; pyshm's write seen by the parent")
    for engine, note in case.get("notes", {}).items():
        out.append({"name": f"{engine}: 64 MiB round trip", "bar": "<= 1.00", "value": None,
                    "median_value": None, "met": None, "text": note, "note": ""})
    return out
