"""The planner's binding, shared by pyshm.planner and pyshm.arena: the :class:`Plan` result,
the checked inputs and options of ``lshm_plan``-style calls, and the Plan built from the C
library's result. Imports only the binding (``_ffi``)."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import _checks, _ffi
from ._ffi import lib


@dataclass(frozen=True)
class Plan:
    """The result of :func:`plan`.

    ``offsets[i]`` is where tensor ``i`` starts; ``arena_size`` the bytes the arena needs;
    ``lower_bound`` the most bytes live at one time, which no plan can beat; ``strategy`` the
    name of the placement that won; ``optimal`` whether ``arena_size`` is proven minimal.
    """

    offsets: np.ndarray
    arena_size: int
    lower_bound: int
    strategy: str
    optimal: bool
    seconds: float
    alignment: int
    inclusive: bool

    @property
    def ratio(self) -> float:
        """arena_size / lower_bound (1.0 is perfect)."""
        return self.arena_size / self.lower_bound if self.lower_bound else 1.0


Plan.__module__ = "pyshm.planner"  # (its public home: repr, docs, pickles name it there)


def options(
    alignment: int, inclusive: bool, time_limit: float, capacity: int = 0
) -> _ffi.PlanOptions:
    inclusive = _checks.flag(inclusive, "inclusive")  # (a string such as "no" reads as true)
    alignment = _checks.uint64(alignment, "alignment")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 1, got {alignment}")
    time_limit = _checks.seconds(time_limit, "time_limit")
    capacity = _checks.uint64(capacity, "capacity")
    opts = _ffi.PlanOptions()
    lib.lshm_plan_options_init(ctypes.byref(opts))
    opts.alignment = alignment
    opts.flags = _ffi.PLAN_INCLUSIVE if inclusive else 0
    opts.time_limit = time_limit
    opts.capacity = capacity
    return opts


def as_array(values: Any, dtype, name: str) -> np.ndarray:
    return _checks.int_array(values, dtype, name)


def inputs(sizes, firsts, lasts):
    sizes_a = as_array(sizes, np.uint64, "sizes")
    firsts_a = as_array(firsts, np.int64, "firsts")
    lasts_a = as_array(lasts, np.int64, "lasts")
    n = len(sizes_a)
    if len(firsts_a) != n or len(lasts_a) != n:
        raise ValueError(
            "sizes, firsts and lasts must have one length, "
            f"got {n}, {len(firsts_a)}, {len(lasts_a)}"
        )
    return n, sizes_a, firsts_a, lasts_a


def pointer(array: Optional[np.ndarray], ptype):
    return None if array is None else array.ctypes.data_as(ptype)


def lifetime_pointers(sizes: np.ndarray, firsts: np.ndarray, lasts: np.ndarray) -> tuple:
    """The sizes, firsts and lasts arguments of the planner's C functions, in their order."""
    return (pointer(sizes, _ffi.U64Pointer), pointer(firsts, _ffi.I64Pointer),
            pointer(lasts, _ffi.I64Pointer))


def plan_from_result(
    offsets: np.ndarray, result: _ffi.PlanResult, alignment: int, inclusive: bool
) -> Plan:
    """A :class:`Plan` from the C library's lshm_plan_result."""
    return Plan(
        offsets=offsets,
        arena_size=int(result.arena_size),
        lower_bound=int(result.lower_bound),
        strategy=result.strategy.decode("utf-8", "replace"),
        optimal=bool(result.optimal),
        seconds=float(result.seconds),
        alignment=alignment,
        inclusive=inclusive,
    )


WAIT_APART_FROM = 2000  # tensors: a plan this big (or with this budget) is waited for apart,
WAIT_APART_SECONDS = 0.5  # so that Ctrl-C interrupts it (a smaller one takes a few ms)


def big_plan(n: int, time_limit: float) -> bool:
    """Whether a plan of `n` tensors with `time_limit` is waited for apart (interruptibly)."""
    return n >= WAIT_APART_FROM or time_limit >= WAIT_APART_SECONDS


# The calls running on a helper thread (at most one: only the main thread hands its call to
# one): their `finished` event -> their outcome list. A fork on the main thread, which waits
# for that call (the fork then comes from a signal handler, as a server's that forks a worker
# at SIGCHLD), waits for it to finish: it went ahead mid-call, and the child, which has no
# helper thread, waited for it forever. (A fork on another thread leaves no waiting thread in
# the child; it waits for an arena's call at the arena's lock, see pyshm.arena.) It waits as
# long as the helper is in its C call, then _FORK_WAIT_SECONDS at most: the helper runs
# Python after it (ctypes' error check, a finalizer the garbage collector runs there) that
# may wait for a lock the forking thread holds, and a fork that waited for ever hung with it.
# In the child, such a call (in CUT_OFF_AT_FORK: pyshm.arena makes its arena unusable there)
# raises OSError(EBUSY).
_HELPERS_RUNNING: dict = {}
_FORK_WAIT_SECONDS = 0.25
CUT_OFF_AT_FORK: list = []  # (the last fork's: (finished, outcome) of the calls it cut off)
# The plans under way: a key -> (the thread that makes the C call, the code of the Python
# function that makes it, the thread the plan is for: the caller of interruptibly). The
# thread is in C while that function's frame is its top one.
_PLANNING: dict = {}


def _in_c(key: Any, caller: Optional[int] = None) -> bool:
    entry = _PLANNING.get(key)
    if entry is None or (caller is not None and entry[2] != caller):
        return False
    # (CPython's, 3.9 on; a Python without it: "not in C", so a fork waits 0.25 s at most, as
    # for Python, rather than raise in the fork hook, which then took no lock)
    current_frames = getattr(sys, "_current_frames", None)
    frame = None if current_frames is None else current_frames().get(entry[0])
    return frame is not None and frame.f_code is entry[1]


def plans_in_c(caller: int) -> bool:
    """Whether a plan for thread `caller` (made there or on its helper thread) runs in C now:
    it waits for nothing of Python's. (Any thread's plan waited for: a fork waited as long as
    another thread planned, one plan after another, for an arena stuck in Python.)"""
    return any(_in_c(key, caller) for key in list(_PLANNING))


def _wait_for_helpers_before_fork() -> None:
    CUT_OFF_AT_FORK.clear()
    if threading.current_thread() is not threading.main_thread():
        return
    helpers = list(_HELPERS_RUNNING.items())
    try:
        for finished, outcome in helpers:
            give_up = time.monotonic() + _FORK_WAIT_SECONDS
            while not finished.wait(0.005):
                if _in_c(finished):
                    give_up = time.monotonic() + _FORK_WAIT_SECONDS
                elif time.monotonic() > give_up:
                    CUT_OFF_AT_FORK.append((finished, outcome))
                    break
    except BaseException:
        # (a signal handler's exception, KeyboardInterrupt at Ctrl-C: os.fork() ignores it and
        # goes ahead; a helper not waited for is cut off, or the child waited for it for ever)
        for finished, outcome in helpers:
            if not finished.is_set() and all(finished is not f for f, _ in CUT_OFF_AT_FORK):
                CUT_OFF_AT_FORK.append((finished, outcome))
        raise


def _cut_off_in_child() -> None:
    for finished, outcome in CUT_OFF_AT_FORK:
        outcome.insert(0, OSError(
            errno.EBUSY, "pyshm: the plan was on a helper thread when the process forked "
            "(here it may be halfway)"))
        reinit = getattr(finished, "_at_fork_reinit", None)  # (CPython's, 3.9 on)
        if reinit is not None:
            reinit()  # (its lock may be held by the helper, not here)
        finished.set()
    _HELPERS_RUNNING.clear()
    me = threading.get_ident()
    for key, (thread, _, _) in list(_PLANNING.items()):
        if thread != me:  # (a thread that is not here)
            del _PLANNING[key]


os.register_at_fork(before=_wait_for_helpers_before_fork, after_in_child=_cut_off_in_child)


def interruptibly(call: Callable[[], Any], interrupt: Callable[[], Any], apart: bool) -> None:
    """call() (a C call that plans) and, if `apart`, on a helper thread while this one waits,
    so that a signal's exception (KeyboardInterrupt at Ctrl-C) interrupts it: interrupt()
    (lshm_plan_interrupt) stops the call, which gives nothing back, and the exception goes
    on. Off the main thread, which gets no signals, the call runs right here."""
    if not apart or threading.current_thread() is not threading.main_thread():
        key = object()
        me = threading.get_ident()
        _PLANNING[key] = (me, interruptibly.__code__, me)
        try:
            call()
        finally:
            _PLANNING.pop(key, None)
        return
    outcome: list = []
    caller = threading.get_ident()
    finished = threading.Event()  # (waited for, not the thread: an interrupted join in
    # CPython 3.11 can mark a running thread stopped, bpo-45274's fix)

    def run() -> None:
        _PLANNING[finished] = (threading.get_ident(), run.__code__, caller)
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - raised again by the waiting thread
            outcome.append(exc)
        finally:
            _PLANNING.pop(finished, None)
            finished.set()

    worker = threading.Thread(target=run, name="pyshm-plan", daemon=True)
    _HELPERS_RUNNING[finished] = outcome
    try:
        worker.start()
    except BaseException:
        _HELPERS_RUNNING.pop(finished, None)
        raise
    try:
        while not finished.wait(0.1):
            pass
    except BaseException:
        while not finished.is_set():  # (again until it took: the call may not have begun)
            interrupt()
            finished.wait(0.01)
        worker.join()
        raise
    finally:
        _HELPERS_RUNNING.pop(finished, None)
    worker.join()
    if outcome:
        raise outcome[0]
