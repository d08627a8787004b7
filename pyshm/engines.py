"""pyshm memory through the engines people already use: torch, joblib, dask.distributed, Ray.

Importing pyshm imports none of them. Each hook is installed when its engine is present: at
pyshm's import for an engine imported before, and for one imported later right after its own
import (a finder on ``sys.meta_path`` watches for it and steps aside once every hook is in).
:func:`install` does the same on demand, for whatever is imported by then.

What each hook does, and the engine's extension point it uses:

* **torch** registers its reducers for tensors with multiprocessing's ``ForkingPickler``
  (``torch.multiprocessing.reductions``, at ``import torch``); they move every CPU tensor's
  storage into torch's own shared memory, copying it (so a tensor over pyshm memory and the
  numpy array under it part ways). The hook wraps that reducer: a tensor whose storage lies
  in pyshm memory (``torch.from_numpy(a)``, ``torch.from_dlpack(a)``, ``torch.frombuffer``)
  is sent as its dtype, size, strides and offset over a pyshm array of its storage's bytes,
  which travels by reference like any pyshm array; every other tensor goes to torch's reducer
  unchanged. So torch.multiprocessing ``Queue``, ``Pool``, ``DataLoader`` workers returning
  such tensors (fork and spawn) carry the same memory. A tensor over memory shared read-only
  goes by value (a copy of its bytes, not torch's reducer, which would move it away from its
  array): a tensor has no read-only flag. Torch's reducer for storages is wrapped the same
  way (_storage_reducer).
* **joblib** (loky and multiprocessing backends) pickles numpy arrays with its own reducers,
  which copy big ones into memmapped files of a temporary folder (read-only, or copy-on-write
  in the worker) and small ones by value, both ways. joblib has no registry for those, so the
  hook wraps its two array reducers (``ArrayMemmapForwardReducer.__call__`` and
  ``reduce_array_memmap_backward``): a pyshm array goes by reference, anything else as before.
  Its picklers do not use torch's ForkingPickler reducer: the reducers it makes for a pool or
  an executor (``get_memmapping_reducers``) get pyshm's for torch tensors too, in front of the
  user's own (_JoblibTensor).
* **dask.distributed** serializes numpy arrays with the serializer it registers for them in
  its ``dask_serialize`` registry (scatter, results, transfers between workers); the hook
  registers a wrapper there: shared pyshm memory sent straight to a process of this user on
  this machine that says it loads references goes as a pickled reference (under
  distributed's own "pickle" header, so any receiver rebuilds it), everything else (another
  machine, a scheduler, disk, a process without pyshm) by value as before. A process says
  so with a key that pyshm adds to the handshake of its every connection
  (``Comm.handshake_info``, whose dict a peer's serializers get as ``context["recipient"]``),
  and pyshm's entry in Dask's ``dask.sizeof`` entry points (pyshm/_pyshm_dask.py) imports
  pyshm early in every process of distributed of an environment that has it. distributed's
  serializers for torch tensors serialize their numpy view without that context: for a
  tensor over shared pyshm memory pyshm passes it on (_install_distributed_tensors).
  Task arguments (``submit(f, a)``, ``map``) are pickled into the task, which goes through
  the scheduler, where no reference is safe, so ``Client.submit`` and ``Client.map`` are
  wrapped to scatter each pyshm array, each tensor over pyshm memory and each ``pyshm.ref``
  among them (other arrays go dask's way, by value) straight to a worker here first (by
  reference, through the hook above) and pass its future instead (a ref where dask does
  not look, inside an object, goes through a pickled call with placeholders, see _Call). A
  reference's secrets travel out of band (see pyshm._channel._secret_out), in frames that
  distributed does not log when a receiver fails to load the pickle.
* **Ray** pickles objects (task arguments and results, actor calls, ``ray.put``) with its
  cloudpickle, where ``ray.util.register_serializer`` replaces the pickling of a type. The
  hook registers one for numpy arrays (and, once torch is imported, for tensors): pyshm
  memory goes as a reference *and* as Ray's own copy (Ray stores objects, reads them many
  times, later, anywhere in the cluster: only the reader knows whether the sender can still
  give the memory). A reader gets the sender's memory itself when it can (the sender runs and
  holds it, on this machine, in this network namespace), else Ray's copy; a worker keeps
  what it fetched for a moment, so that tasks in a row on one object fetch it once
  (_RayLinger). Everything else is
  pickled exactly as without pyshm (Ray's own way, or a serializer registered before).
"""

from __future__ import annotations

import copyreg
import errno
import importlib
import importlib.abc
import os
import pickle
import socket
import sys
import threading
import time
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import numpy as np

from . import _channel, _pyshm_dask, reduction
from .arrays import is_shared

__all__ = ["install", "installed"]

_installed: set = set()


def installed() -> frozenset:
    """The engines whose hooks are in ("torch", "joblib", "distributed", "ray")."""
    if "ray" in _installed:  # (a user may have deregistered it: ray.util.deregister_serializer)
        from ray.cloudpickle import CloudPickler

        if not getattr(CloudPickler.dispatch.get(np.ndarray), "_pyshm", False):
            _installed.discard("ray")
    return frozenset(_installed)


def install() -> frozenset:
    """Install the hook of every engine imported by now (idempotent); returns
    :func:`installed`. pyshm calls it at import and after each engine's own import. An engine
    whose internals are not what the hook expects gets no hook (and never an error)."""
    for name, module, hook in (("torch", "torch.multiprocessing.reductions", _install_torch),
                               ("joblib", "joblib._memmapping_reducer", _install_joblib),
                               ("distributed", "distributed.client", _install_distributed),
                               ("ray", "ray.util.serialization", _install_ray)):
        if name not in _installed and module in sys.modules:
            try:
                hook()
            except (AttributeError, KeyError, TypeError, ImportError):
                pass  # (another version of the engine: it keeps its own ways)
    for name, tensors in (("ray", _install_ray_tensors),
                          ("distributed", _install_distributed_tensors),
                          ("joblib", _update_joblib_reducers)):
        if name in _installed:
            try:
                tensors()
            except (AttributeError, KeyError, TypeError, ImportError):
                pass
    return installed()


# ---- torch ----------------------------------------------------------------------------------


def _tensor_bytes(tensor: Any):
    """The pyshm byte array under ``tensor``'s whole storage, or None (not pyshm memory, or
    not a plain CPU tensor)."""
    try:
        if tensor.device.type != "cpu" or tensor.layout is not _torch().strided or \
                tensor.is_quantized or tensor.is_nested:
            return None
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None  # (tensors without storage: meta, functional wrappers...)
    return _storage_bytes(storage)


def _storage_bytes(storage: Any):
    """The pyshm byte array of a torch ``UntypedStorage``'s bytes, or None."""
    try:
        if storage.device.type != "cpu" or storage.resizable():
            return None  # torch's own memory (memory torch borrows, as from numpy, is not)
        return reduction.bytes_at(storage.data_ptr(), storage.nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _Reduced:
    """A reduction made already (the pyshm array of a tensor's bytes), pickled as it is."""

    __slots__ = ("value",)

    def __init__(self, value: tuple) -> None:
        self.value = value

    def __reduce__(self):
        return self.value


def _torch():
    return sys.modules["torch"]


_CONJ, _NEG = 1, 2  # a tensor's lazy conjugation and negation bits (views: no bytes changed)


def _rebuild_tensor(data, dtype: str, size: tuple, stride: tuple, offset: int,
                    requires_grad: bool, parameter: bool, bits: int = 0,
                    attributes: Optional[dict] = None):
    if not isinstance(data, np.ndarray):
        return data  # (an Undelivered stand-in: it raises on first use)
    if not data.flags.writeable:
        # (a tensor has no read-only flag: one over read-only memory would crash its writer.
        # Senders send such tensors by value (_tensor_by_value): a forged pickle)
        error = pickle.UnpicklingError(
            "pyshm: a tensor over memory this process may only read (a read-only secret)")
        stand_in = _channel.stand_in(error)
        if stand_in is None:
            raise error
        return stand_in
    torch = _torch() if "torch" in sys.modules else __import__("torch")
    with warnings.catch_warnings():
        # (the storage of a read-only array would warn; refused above)
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.from_numpy(data).untyped_storage()
    tensor = torch.empty((0,), dtype=getattr(torch, dtype)).set_(storage, offset, size, stride)
    if bits & _CONJ:
        tensor = torch._conj(tensor)
    if bits & _NEG:
        tensor = torch._neg_view(tensor)
    if parameter:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    elif requires_grad:
        tensor.requires_grad_(True)
    if attributes:
        tensor.__dict__.update(attributes)
    return tensor


def _sendable(data: np.ndarray) -> bool:
    """Whether pyshm memory goes by reference from this pickling: shared already, pickled on
    the caller's own thread (where it is shared in place), or shared now under the write fence
    on a thread of the engine's own; where it cannot be (no fence here) the engine goes its own
    way, as without pyshm (see pyshm.reduction)."""
    return (is_shared(data) or not reduction.pickled_off_the_callers_thread()
            or reduction.share_if_fenced(data))


def _tensor_reduction(tensor: Any, attributes: bool = False):
    """The reduction that sends ``tensor`` (a plain CPU tensor or Parameter over pyshm memory)
    by reference, or None: not pyshm memory, a non-leaf tensor that needs its graph, or
    memory not shared yet pickled on a thread of multiprocessing's own (a Queue's feeder)
    where it cannot be shared under the write fence (see pyshm.reduction). Memory shared
    read-only raises _ReadOnlyTensor, a ``PicklingError`` (a tensor has no read-only flag:
    torch's hook sends it by value, Ray its copy). The tensor's Python attributes go
    along only with `attributes` (Ray's pickling keeps them; torch's reducer drops them, and
    some cannot be pickled: process groups, modules that hold the tensor itself)."""
    torch = _torch()
    kind = type(tensor)
    parameter = kind is torch.nn.Parameter
    if kind is not torch.Tensor and not parameter:
        return None
    data = None if tensor.requires_grad and not tensor.is_leaf else _tensor_bytes(tensor)
    if data is None or not _sendable(data):
        return None
    reduced = reduction.reduce_ndarray(data)
    if reduced[1][1].readonly:  # (the ticket: what every receiver would get)
        raise _ReadOnlyTensor(
            "pyshm: this tensor's storage is read-only pyshm memory for its receivers "
            "(pyshm.share_readonly), and torch tensors have no read-only flag: a receiver's "
            "write would crash it")
    return _tensor_layout(tensor, _Reduced(reduced), parameter, attributes)


def _tensor_layout(tensor: Any, data: Any, parameter: bool, attributes: bool) -> tuple:
    """The reduction of ``tensor`` as a tensor over ``data`` (what pickles to its storage's
    bytes) with its layout: _rebuild_tensor's."""
    _torch().utils.hooks.warn_if_has_hooks(tensor)  # (as torch's reducer does)
    bits = (_CONJ if tensor.is_conj() else 0) | (_NEG if tensor.is_neg() else 0)
    return _rebuild_tensor, (data, str(tensor.dtype).split(".")[-1],
                             tuple(tensor.size()), tuple(tensor.stride()),
                             tensor.storage_offset(), bool(tensor.requires_grad), parameter,
                             bits, (dict(tensor.__dict__) or None) if attributes else None)


class _ReadOnlyTensor(pickle.PicklingError):
    """A tensor over pyshm memory its receivers may only read: it cannot go by reference."""


def _tensor_by_value(tensor: Any) -> tuple:
    """The reduction of a tensor over read-only pyshm memory (see _ReadOnlyTensor): a copy of
    its storage's bytes, pickled by value (numpy's), as Ray's copy of it goes. Not torch's
    reducer: that one would move the sender's tensor into new torch shared memory, away from
    the array it views. The receiver gets a writable copy of its own. Only the elements the
    tensor spans are copied (a row of a big storage sends the row)."""
    offset, item = tensor.storage_offset(), tensor.element_size()
    low = high = offset
    for count, stride in zip(tensor.size(), tensor.stride()):
        if count == 0:
            low = high = offset = 0  # (no element: nothing to copy)
            break
        if stride < 0:
            low += stride * (count - 1)
        else:
            high += stride * (count - 1)
    nbytes = (high + 1 - low) * item if tensor.numel() else 0
    copy = np.array(_tensor_bytes(tensor)[low * item:low * item + nbytes])  # (by value)
    rebuild, args = _tensor_layout(tensor, copy, type(tensor) is _torch().nn.Parameter, False)
    return rebuild, (*args[:4], offset - low, *args[5:])


def _tensor_reducer(original):
    def reduce_tensor(tensor):
        try:
            return _tensor_reduction(tensor) or original(tensor)
        except _ReadOnlyTensor:
            return _tensor_by_value(tensor)

    reduce_tensor._pyshm_wraps = original
    return reduce_tensor


def _rebuild_storage(data):
    """The ``UntypedStorage`` of a storage of pyshm memory sent (_storage_reducer)."""
    if not isinstance(data, np.ndarray):
        return data  # (an Undelivered stand-in)
    torch = _torch() if "torch" in sys.modules else __import__("torch")
    if not data.flags.writeable:  # (sent by value when read-only: a forged pickle)
        data = np.array(data)
    return torch.from_numpy(data).untyped_storage()


def _storage_reducer(original):
    """torch's reducer for ``UntypedStorage`` (typed storages reduce to theirs) moves the
    storage into torch's own shared memory, as its tensor reducer does: every tensor over a
    storage of pyshm memory would leave it. Such a storage goes as its pyshm bytes, by
    reference (read-only memory: a copy, as for tensors); any other goes to torch's."""

    def reduce_storage(storage):
        data = _storage_bytes(storage) if type(storage) is _torch().UntypedStorage else None
        if data is None or not _sendable(data):
            return original(storage)
        reduced = reduction.reduce_ndarray(data)
        if reduced[1][1].readonly:  # (the ticket: a storage has no read-only flag either)
            return _rebuild_storage, (np.array(data),)
        return _rebuild_storage, (_Reduced(reduced),)

    reduce_storage._pyshm_wraps = original
    return reduce_storage


def _install_torch() -> None:
    reductions = sys.modules["torch.multiprocessing.reductions"]
    for kind, reducer in list(ForkingPickler._extra_reducers.items()):
        if reducer is reductions.reduce_storage:
            ForkingPickler.register(kind, _storage_reducer(reducer))
    original = reductions.reduce_tensor
    wrapped = None
    # every type torch registered its tensor reducer for (torch.Tensor, Parameter, the legacy
    # tensor classes); a type already wrapped is left alone
    for kind, reducer in list(ForkingPickler._extra_reducers.items()):
        if reducer is original:
            wrapped = wrapped or _tensor_reducer(original)
            ForkingPickler.register(kind, wrapped)
    if wrapped is not None or any(getattr(r, "_pyshm_wraps", None) is original
                                  for r in ForkingPickler._extra_reducers.values()):
        _installed.add("torch")


# ---- joblib ---------------------------------------------------------------------------------


def _pyshm_array(a: Any) -> bool:
    """A pyshm array to send by reference (see _sendable; also one that reaches pyshm memory
    through another exporter: reduction.as_pyshm); others go joblib's way."""
    if type(a) is not np.ndarray or a.nbytes == 0:
        return False
    found = reduction.as_pyshm(a)
    return found is not None and _sendable(found)


def _install_joblib() -> None:
    module = sys.modules["joblib._memmapping_reducer"]
    forward = module.ArrayMemmapForwardReducer
    if getattr(forward.__call__, "_pyshm_wraps", None) is None:
        original_call = forward.__call__

        def __call__(self, a):
            if _pyshm_array(a):
                return reduction.reduce_ndarray(a)
            return original_call(self, a)

        __call__._pyshm_wraps = original_call
        forward.__call__ = __call__
    backward = module.reduce_array_memmap_backward
    if getattr(backward, "_pyshm_wraps", None) is None:
        module.reduce_array_memmap_backward = _JoblibBackward(backward)
        _repoint_pending.append(True)  # (see _update_joblib_reducers, which install() calls)
    _install_joblib_tensors(module)
    _installed.add("joblib")


class _JoblibBackward:
    """pyshm's wrapper of joblib's ``reduce_array_memmap_backward`` (``_pyshm_wraps``), the
    reducer of arrays in results: a pyshm array by reference, any other as joblib's. Pickled
    (a worker's result reducers go to it: loky's, a pool's of a spawn or forkserver context)
    as the wrapper of the process that loads it, by any pickler (loky's may be plain pickle:
    LOKY_PICKLER), where a function of its own would not pickle."""

    __slots__ = ("_pyshm_wraps",)
    _pyshm_joblib_backward = True  # (the mark by which a loky worker finds its result reducers)

    def __init__(self, original: Any) -> None:
        self._pyshm_wraps = original

    def __call__(self, a: Any) -> tuple:
        if _pyshm_array(a):
            return reduction.reduce_ndarray(a)
        return self._pyshm_wraps(a)

    def __reduce__(self):
        return _joblib_backward, ()


def _joblib_backward() -> Any:
    """This process's reducer of arrays in joblib's results (a pickled _JoblibBackward): pyshm's
    wrapper, or joblib's own where the hook cannot go in."""
    module = importlib.import_module("joblib._memmapping_reducer")
    install()
    return module.reduce_array_memmap_backward


class _JoblibTensor:
    """joblib's reducer for torch tensors (both ways) in a pool's or an executor's reducers:
    over pyshm memory by reference (read-only memory by value, see _tensor_by_value); any other
    tensor as joblib's pickler would send it without pyshm: by the reducer that was in those
    reducers for its type (``previous``: one of the user's, ``forward_reducers`` and
    ``backward_reducers``), else one registered for its type with ``copyreg`` or, for loky's
    pickler (``loky``), with loky's ``register``, else torch's own pickling (by value)."""

    __slots__ = ("previous", "loky")

    def __init__(self, previous: Any, loky: bool) -> None:
        self.previous, self.loky = previous, loky

    def __call__(self, tensor: Any) -> tuple:
        try:
            reduced = _tensor_reduction(tensor)
        except _ReadOnlyTensor:
            return _tensor_by_value(tensor)
        if reduced is not None:
            return reduced
        reducer = self.previous or _registered_reducer(type(tensor), self.loky)
        if reducer is not None:
            return reducer(tensor)
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    def __reduce__(self):
        return _JoblibTensor, (self.previous, self.loky)


def _registered_reducer(kind: type, loky: bool) -> Any:
    """The reducer registered for ``kind`` with copyreg or, for loky's pickler, in loky's
    registry (``loky.backend.reduction.register``, which that pickler puts above copyreg's),
    or None."""
    registry = getattr(sys.modules.get("joblib.externals.loky.backend.reduction"),
                       "_dispatch_table", None) if loky else None
    found = registry.get(kind) if isinstance(registry, dict) else None
    return found or copyreg.dispatch_table.get(kind)


def _install_joblib_tensors(module: Any) -> None:
    """joblib pickles a pool's or an executor's arguments and results with the reducers
    get_memmapping_reducers makes for it (a dispatch table: numpy's arrays only), and torch's
    tensor reducer is ForkingPickler's, which joblib's picklers do not use: so the reducers
    made get pyshm's for torch tensors too (those made before torch's import get it at that
    import: _update_joblib_reducers). joblib.pool and joblib.executor hold the function under
    their own names (imported from the module)."""
    original = module.get_memmapping_reducers
    wrapped = original
    if getattr(original, "_pyshm_wraps", None) is None:

        def get_memmapping_reducers(*args, **kwargs):
            forward, backward = original(*args, **kwargs)
            # (for loky's executor, or for a multiprocessing pool: whose pickler's registry)
            loky = sys._getframe(1).f_globals.get("__name__") == "joblib.executor"
            if _with_joblib_tensors(forward, loky) and _with_joblib_tensors(backward, loky):
                return forward, backward
            # (no torch yet: dicts it can find again once torch is imported)
            forward, backward = _Reducers(forward, loky), _Reducers(backward, loky)
            for reducers in (forward, backward):
                _reducers_without_tensors[id(reducers)] = reducers
            if _late_joblib_tensors_added:  # (torch came meanwhile, imported by another thread)
                for reducers in (forward, backward):
                    _with_joblib_tensors(reducers, loky)
            return forward, backward

        get_memmapping_reducers._pyshm_wraps = original
        get_memmapping_reducers.__doc__ = original.__doc__
        module.get_memmapping_reducers = wrapped = get_memmapping_reducers
    original = getattr(wrapped, "_pyshm_wraps", original)
    for name in ("joblib.executor", "joblib.pool"):
        user = sys.modules.get(name)
        if getattr(user, "get_memmapping_reducers", None) is original:
            user.get_memmapping_reducers = wrapped


class _Reducers(dict):
    """joblib's reducers for a pool or an executor made before torch's import, in a dict that a
    weak reference can name, with the pickler they are for (``loky``: see _JoblibTensor);
    pickled (a loky worker's result reducers go to it) as a plain dict."""

    __slots__ = ("__weakref__", "loky")

    def __init__(self, reducers: dict, loky: bool) -> None:
        super().__init__(reducers)
        self.loky = loky

    def __reduce__(self):
        return dict, (dict(self),)


# (the reducer dicts made before torch's import, while their pool or executor lives)
_reducers_without_tensors: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_late_joblib_tensors_added = False
_repoint_pending: list = []  # (the hook is in: a loky worker's result reducers to repoint)
_loky_results: list = []  # ([the result reducers of this loky worker], once looked for)


def _torch_ready() -> bool:
    """Whether torch is imported, as far as its tensor types (torch.nn.Parameter)."""
    torch = sys.modules.get("torch")
    return torch is not None and hasattr(torch, "nn")


def _with_joblib_tensors(reducers: dict, loky: bool) -> bool:
    """Add pyshm's reducer for torch tensors to a dict of joblib's reducers, for loky's pickler
    or not (in front of the one there: _JoblibTensor); False (nothing added) if torch is not
    imported."""
    if not _torch_ready():
        return False
    torch = _torch()
    for kind in (torch.Tensor, torch.nn.Parameter):
        previous = reducers.get(kind)
        if type(previous) is not _JoblibTensor:
            reducers[kind] = _JoblibTensor(previous, loky)
    return True


def _executor_reducers() -> list:
    """The reducer dicts of loky's reusable executor (joblib's loky backend: one per process,
    which every Parallel call reuses with the reducers it was made with), if there is one."""
    loky = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(loky, "_executor", None)
    queues = (getattr(executor, "_call_queue", None), getattr(executor, "_result_queue", None))
    return [q._reducers for q in queues if isinstance(getattr(q, "_reducers", None), dict)]


def _update_joblib_reducers() -> None:
    """After the joblib hook's install and after each later watched import (install()): the
    reducers joblib made before get what they lack. Once torch is imported, pyshm's tensor
    reducer: the reducers made before torch's import (a pool or an executor keeps them for its
    life) and those of loky's executor, made maybe before pyshm's import. In a loky worker, its
    result reducers (unpickled at its start): pyshm's array reducer in place of joblib's, and
    the tensor reducer. So tensors and arrays over pyshm memory go by reference through all of
    them."""
    global _late_joblib_tensors_added
    tensors = not _late_joblib_tensors_added and _torch_ready()
    if tensors:
        _late_joblib_tensors_added = True
        for reducers in list(_reducers_without_tensors.values()):
            _with_joblib_tensors(reducers, reducers.loky)
        for reducers in _executor_reducers():
            _with_joblib_tensors(reducers, True)
        _reducers_without_tensors.clear()
    repoint = bool(_repoint_pending)
    if not (tensors or repoint):
        return
    _repoint_pending.clear()
    module = sys.modules["joblib._memmapping_reducer"]
    wrapped = module.reduce_array_memmap_backward
    original = getattr(wrapped, "_pyshm_wraps", wrapped)
    for holder in _loky_result_reducers(original):
        for kind in (np.ndarray, np.memmap):
            if repoint and holder.get(kind) is original:
                holder[kind] = wrapped
        if tensors:
            _with_joblib_tensors(holder, True)


def _loky_result_reducers(original: Any) -> list:
    """In a loky worker: the dicts of reducers (its result queue's, unpickled at its start)
    whose reducer for numpy arrays is joblib's ``original`` or pyshm's wrapper of it; none
    elsewhere. Found among the referrers of np.ndarray, a walk over every object: once per
    worker, kept (a worker has one result queue, unpickled before its first task: before
    _CURRENT_DEPTH is set)."""
    if _loky_results:
        return _loky_results[0]
    loky = sys.modules.get("joblib.externals.loky.process_executor")
    if loky is None or not getattr(loky, "_CURRENT_DEPTH", 0) > 0:
        return []
    import gc

    _loky_results.append([
        holder for holder in gc.get_referrers(np.ndarray) if isinstance(holder, dict) and
        (holder.get(np.ndarray) is original or
         getattr(holder.get(np.ndarray), "_pyshm_joblib_backward", False))])
    return _loky_results[0]


# ---- dask.distributed -------------------------------------------------------------------------


def _local_host(host: str) -> bool:
    """Whether ``host`` (an address of a comm) is this machine in this network namespace."""
    import ipaddress

    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # (names are not resolved: they may name another machine)
    if address.is_loopback:
        return True
    return str(address) in _own_addresses()


# (time read, addresses): read again once older than _PEER_SECONDS, so that an interface that
# comes up later (a VPN, a container network, a DHCP lease) is this machine's too, and an
# address that left (maybe to another machine) is not
_OWN_ADDRESSES: list = []


def _own_addresses() -> set:
    """The IP addresses of this network namespace's interfaces (/proc/net), as read at most
    _PEER_SECONDS ago."""
    now = time.monotonic()
    known = _OWN_ADDRESSES[0] if _OWN_ADDRESSES else None
    if known is not None and now - known[0] < _PEER_SECONDS:
        return known[1]
    own = set()
    try:  # IPv4: the local routes' table lists every address of ours
        with open("/proc/net/fib_trie") as table:
            lines = table.read().splitlines()
        for at, line in enumerate(lines):
            if "/32 host LOCAL" in line and at > 0:
                own.add(lines[at - 1].split()[-1])
    except OSError:
        pass
    try:  # IPv6
        import ipaddress

        with open("/proc/net/if_inet6") as table:
            for line in table:
                raw = line.split()[0]
                own.add(str(ipaddress.ip_address(int(raw, 16))))
    except (OSError, ValueError):
        pass
    _OWN_ADDRESSES[:] = [(now, own)]
    return own


def _schedulers() -> set:
    """The addresses of the schedulers this process knows (its clients', its workers', its
    own): a scheduler passes data on to whoever asks, still serialized, so a reference sent to
    one could end on another machine."""
    import distributed

    found = set()
    for kind, attribute in ((distributed.Client, "scheduler"), (distributed.Worker, "scheduler"),
                            (distributed.Scheduler, None)):
        for instance in list(getattr(kind, "_instances", ())):
            try:
                address = (getattr(instance, attribute).address if attribute else
                           instance.address)
            except (AttributeError, ValueError, RuntimeError):
                continue
            if isinstance(address, str):
                found.add(address)
    return found


_TCP_STATES = ("01", "0A")  # ESTABLISHED, LISTEN (/proc/net/tcp's st column)
_TCP_LISTEN = "0A"


def _proc_net_address(host: str) -> tuple:
    """How /proc/net/tcp{,6} write ``host``'s address: each 32-bit word in hex, in this
    machine's byte order; with the wildcard that a listener bound to every address shows."""
    import ipaddress
    import struct

    address = ipaddress.ip_address(host.strip("[]"))
    packed = address.packed
    words = "".join(f"{w:08X}" for w in struct.unpack(f"={len(packed) // 4}I", packed))
    if address.version == 4:  # (also as an IPv4-mapped address of a dual-stack socket)
        mapped = ipaddress.IPv6Address(f"::ffff:{address}").packed
        return words, "00000000", "".join(
            f"{w:08X}" for w in struct.unpack("=4I", mapped)), "0" * 32
    return words, "0" * 32


# how long a peer's uids read from /proc/net/tcp{,6} are remembered (7 ms a read on a 2-CPU VM
# with almost no sockets open, as the kernel walks its whole hash tables; only where sock_diag
# finds no socket or is refused). A sock_diag answer (35 us, tools/bench_binding.py peers) is
# never remembered: the socket at an address may be another user's a moment later.
_PEER_SECONDS = 1.0
_peers: dict = {}  # (host, port, via) -> (monotonic time read, uids)


def _peer_uids(host: str, port: int, via: Optional[tuple] = None) -> set:
    """The uids owning the TCP sockets of this network namespace at (host, port): the
    process a message to that address reaches (empty if none is found). `via`: (host, port)
    of our end of the connection to it, if known: then the peer's socket of that very
    connection (an accepted connection, or a client's, which listens nowhere), else one
    listening there. Asked of the kernel each time (_diag_uids); read from the tables where
    it cannot say, and those remembered for _PEER_SECONDS."""
    uids = _diag_uids(host, port, via)
    if uids is not None:
        return uids
    now = time.monotonic()
    known = _peers.get((host, port, via))
    if known is not None and now - known[0] < _PEER_SECONDS:
        return known[1]
    if len(_peers) > 4096:
        _peers.clear()
    uids = _table_uids(host, port, via)
    _peers[host, port, via] = (now, uids)
    return uids


def _table_uids(host: str, port: int, via: Optional[tuple] = None) -> set:
    """_diag_uids from /proc/net/tcp{,6}: the uids of the sockets connected at (host, port) to
    `via` (any peer without it), else of those listening there."""
    try:
        wanted = _proc_net_address(host)
        peers = {f"{word}:{int(via[1]):04X}" for word in _proc_net_address(via[0])
                 if word.strip("0")} if via is not None else None
    except (ValueError, TypeError):
        return set()
    suffix = f":{port:04X}"
    connected, listening = set(), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    if len(fields) > 7 and fields[3] in _TCP_STATES and \
                            fields[1].endswith(suffix) and \
                            fields[1][:-len(suffix)] in wanted:
                        if fields[3] == _TCP_LISTEN:
                            listening.add(int(fields[7]))
                        elif peers is None or fields[2] in peers:
                            connected.add(int(fields[7]))
        except (OSError, ValueError):
            continue
    return connected | listening if via is None else connected or listening


_NETLINK_SOCK_DIAG = 4  # (linux/netlink.h)
_SOCK_DIAG_BY_FAMILY = 20  # (linux/sock_diag.h: a request, and each socket of the answer)
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF  # (INET_DIAG_NOCOOKIE: any socket at that address)
_TCP_ESTABLISHED = 1  # (an inet_diag_msg's state)


def _diag_queries(host: str, via: Optional[tuple]) -> list:
    """(family, the socket's address, its peer's) of each lookup _diag_uids makes: an IPv4
    address also as IPv4-mapped IPv6 (sockets of both stacks); the peer's address zero
    (a listener) without `via`."""
    import ipaddress

    address = ipaddress.ip_address(host.strip("[]"))
    peer = ipaddress.ip_address(via[0].strip("[]")) if via is not None else None
    if peer is not None and peer.version != address.version:
        raise ValueError("one connection, two IP versions")
    if address.version == 6:
        return [(socket.AF_INET6, address.packed, peer.packed if peer else bytes(16))]

    def mapped(ip):
        return ipaddress.IPv6Address(f"::ffff:{ip}").packed
    return [(socket.AF_INET, address.packed + bytes(12),
             peer.packed + bytes(12) if peer else bytes(16)),
            (socket.AF_INET6, mapped(address), mapped(peer) if peer else bytes(16))]


def _diag_uids(host: str, port: int, via: Optional[tuple] = None) -> Optional[set]:
    """_peer_uids through the kernel's own socket lookup (sock_diag, as ``ss`` asks it;
    no privilege needed): the uid of the socket at (host, port) whose peer is `via` (our
    end of a connection to it), or without `via` of the listener a new connection there
    reaches (bound to that address or to every address); with a `via` that names no
    connection there, the kernel answers with that listener too, as _table_uids does (the
    owner of what answers at that address); an empty set if the socket found is
    held by no process (a connection its peer closed: the kernel names no owner but root);
    None if netlink finds none or cannot say (refused here: the caller reads /proc/net/tcp
    instead, which a socket the lookup cannot find may be in, and remembers it)."""
    import struct

    try:
        queries = _diag_queries(host, via)
        peer_port = int(via[1]) if via is not None else 0
        ports = struct.pack("!HH", port, peer_port)
    except (ValueError, TypeError, struct.error):
        return set()
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                             _NETLINK_SOCK_DIAG)
    except (OSError, AttributeError):
        return None
    try:
        sock.settimeout(1.0)  # (the kernel answers at once; never wait on a broken one)
        for sequence, (family, source, peer) in enumerate(queries, 1):
            # inet_diag_req_v2: family, protocol, extensions, states (any), then the
            # socket's id: its port, its peer's, their addresses, any interface, no cookie
            request = (struct.pack("=BBxxI", family, socket.IPPROTO_TCP, 0xFFFFFFFF) + ports
                       + source + peer + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
            sock.send(struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, 1,
                                  sequence, 0) + request)
            reply = sock.recv(65536)
            if len(reply) < 20:
                return None
            kind, = struct.unpack_from("=H", reply, 4)
            if kind == _NLMSG_ERROR:
                error = -struct.unpack_from("=i", reply, 16)[0]
                if error == errno.ENOENT:
                    continue  # (no such socket: the next family, or none)
                return None
            # inet_diag_msg: 4 bytes, the socket's id (48), expires, queues, its uid, inode
            if kind != _SOCK_DIAG_BY_FAMILY or len(reply) < 16 + 72:
                return None
            uid, inode = struct.unpack_from("=II", reply, 16 + 64)
            # (no inode and not established: no process holds it, nor will: a time-wait or
            # orphaned socket, whose uid the kernel gives as 0; established: one not accepted
            # yet, the listener's)
            return {uid} if inode or reply[16 + 1] == _TCP_ESTABLISHED else set()
        # None found: the kernel's lookup misses what /proc/net/tcp lists as ours where a
        # socket is bound to an interface, which a distributed address does not name (a
        # link-local address's, SO_BINDTODEVICE, a VRF), and a kernel without tcp_diag (not
        # built, a module that cannot be loaded) says ENOENT to all
        return None
    except OSError:
        return None
    finally:
        sock.close()


def _recipient_here(context: Any) -> bool:
    """Whether a distributed message goes straight to a process of this user on this machine
    (not through a scheduler, see _schedulers): only then is a reference of any use (a
    process of another user would be refused the memory, and a worker that cannot unpickle a
    message stops). No recipient (spilling to disk, a cache) means no.

    Decided once per message: a comm makes a new context dict for each message it writes
    (Comm.write, distributed/comm/tcp.py and ws.py: its "sender" and "recipient" facts, the
    latter the comm's own dict, kept for the connection) and passes that one dict to the
    serializer of each object in it, so the answer is kept in that dict (_DECIDED), and the
    next message asks the kernel again (a port may be another user's a moment later)."""
    if isinstance(context, dict) and "sender" in context:
        decided = context.get(_DECIDED)
        if decided is None:
            decided = context[_DECIDED] = _decide_recipient_here(context)
        return decided
    return _decide_recipient_here(context)


def _decide_recipient_here(context: Any) -> bool:
    """_recipient_here, asked now."""
    recipient = context.get("recipient") if isinstance(context, dict) else None
    # (both ends of that connection as its socket names them, where our handshake noted them
    # (_socket_ends); else our end where distributed gives it: the comm's local address)
    sender = context.get("sender") if isinstance(context, dict) else None
    ends = _noted_ends(sender) if isinstance(recipient, dict) else None
    via = ends[0] if ends is not None else \
        _host_and_port(sender.get("address")) if isinstance(sender, dict) else None
    if isinstance(recipient, dict):  # (distributed gives the comm's peer info)
        # The peer's handshake names the pickle protocol it takes. A reference is a pickle of
        # protocol 5 (its secrets are out-of-band buffers), and a scheduler asks for 4 on
        # every comm it makes or accepts ("common denominator", Scheduler.__init__ and
        # Scheduler.start_unsafe): so this also tells the scheduler's own connection to a
        # worker, from an ephemeral port that _schedulers cannot know, over which it fetches
        # results for a client (Scheduler.gather) and relays them unopened, maybe to another
        # machine. Without the key (not a comm's handshake): no.
        protocol = recipient.get("pickle-protocol")
        if not isinstance(protocol, int) or protocol < 5:
            return False
        # And it says whether the peer loads references (_announce_references): a worker
        # from an environment without pyshm would fail to, and Dask would then wait forever
        # for the data (dask/distributed#7060).
        # And on which machine it runs: a TCP forwarder of this user (ssh -L, socat, kubectl
        # port-forward) makes a process elsewhere look like one of ours here.
        # The namespace to compare with is that of our fd server, where the peer will ask
        # for the memory: it stays where it started if this process moved since.
        if recipient.get(_ANNOUNCED) != _REFERENCE_FORMAT or \
                recipient.get(_MACHINE_KEY) != _machine(_channel.own_netns()):
            return False
        recipient = recipient.get("address")
    peer = ends[1] if ends is not None else _host_and_port(recipient)
    if peer is None or not _local_host(peer[0]) or recipient in _schedulers():
        return False  # (inproc: the same process, distributed passes objects as they are)
    # (the socket's owner: a worker of another user on this machine gets the bytes)
    return _peer_uids(*peer, via) == {os.geteuid()}


def _socket_ends(comm: Any) -> Optional[list]:
    """[[host, port] of our end, [host, port] of the peer's] of the TCP connection under a
    distributed comm, as its socket names them (tcp and tls: the comm's stream; ws and wss:
    the websocket's, client or server side); None for another comm (inproc, ucx) or a socket
    that cannot say. distributed's own addresses do not tell a websocket's ends: the server
    side's are the Host header the client sent and the client's IP with port 0, without a
    scheme (so results and transfers between workers over ws:// went by value), and the
    client side's own address is the server's."""
    for path in (("stream",), ("sock", "protocol", "stream"),
                 ("handler", "ws_connection", "stream")):
        found = comm
        for name in path:
            found = getattr(found, name, None)
        sock = getattr(found, "socket", None)
        if isinstance(sock, socket.socket):
            break
    else:
        return None
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return [[_plain_host(end[0]), end[1]] for end in (sock.getsockname(),
                                                            sock.getpeername())]
    except (OSError, ValueError):
        return None


def _plain_host(host: str) -> str:
    """An IP address as the kernel's socket lookup and _local_host take it: without an IPv6
    scope, an IPv4-mapped IPv6 address as IPv4 (an IPv4 peer of a dual-stack socket)."""
    import ipaddress

    address = ipaddress.ip_address(host.partition("%")[0])
    return str(getattr(address, "ipv4_mapped", None) or address)


def _noted_ends(sender: Any) -> Optional[tuple]:
    """((host, port) of our end, (host, port) of the peer's) that our handshake noted
    (_socket_ends) in a comm's own facts (a message's "sender"), else None."""
    ends = sender.get(_ENDS_KEY) if isinstance(sender, dict) else None
    if not isinstance(ends, (list, tuple)) or len(ends) != 2 or not all(
            isinstance(end, (list, tuple)) and len(end) == 2 and isinstance(end[0], str)
            and type(end[1]) is int for end in ends):
        return None
    return tuple(map(tuple, ends))


def _host_and_port(address: Any) -> Optional[tuple]:
    """(host, port) of a distributed address over TCP ("tcp://127.0.0.1:8786"; tls, ws and
    wss too), else None."""
    if not isinstance(address, str) or "://" not in address:
        return None
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    # (isdigit alone takes "²", which int() refuses)
    if scheme not in ("tcp", "tls", "ws", "wss") or not port.isascii() or \
            not port.isdigit() or not host:
        return None
    return host, int(port)


# The handshake key by which a process of distributed says it loads pyshm references, and the
# format of those it loads (the "pyshm" key of a reference's header too)
_ANNOUNCED = "pyshm"
_REFERENCE_FORMAT = 1
# ... and the key of a message's context (never sent) under which _recipient_here keeps its
# answer for that message
_DECIDED = "pyshm-recipient-here"
# ... and the key of a message's context (never sent) under which a tensor's numpy view goes by
# reference only over memory its receivers may write (_install_distributed_tensors)
_WRITABLE_ONLY = "pyshm-writable-only"
# ... and the key by which it says where it runs: this boot of this machine, this network
# namespace (whose abstract sockets the channel uses)
_MACHINE_KEY = "pyshm-machine"
# ... and the key by which it notes the two ends of the connection, as its socket names them
# (_socket_ends: read back only from our own facts, a message's "sender", never the peer's)
_ENDS_KEY = "pyshm-ends"
_BOOT: list = []


def _machine(netns: int = 0) -> Optional[str]:
    """This boot of this machine and this process's network namespace (read each time: a
    process may move to another, unshare(CLONE_NEWNET)), or the namespace whose inode is
    `netns` if not 0, as a string; None if /proc cannot tell (then no peer is taken for this
    machine's)."""
    try:
        if not _BOOT:
            with open("/proc/sys/kernel/random/boot_id") as boot:
                _BOOT.append(boot.read().strip())
        return f"{_BOOT[0]}/{netns or os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def _announce_references() -> None:
    """Add to the handshake that every comm of this process sends its peer (the information a
    peer's serializers get as ``context["recipient"]``) that this process loads references,
    and on which machine it runs (_machine); and the connection's two ends, which this
    process's serializers read back from its own facts (_socket_ends). pyshm is imported in
    every Dask process of an environment that has it (its "dask.sizeof" entry point,
    pyshm/_pyshm_dask.py), so a process without it says nothing and gets the bytes. The
    saying is the handshake's, once per connection: a connection made before this (pyshm
    imported late, where the entry point is not installed) carries none, and Dask keeps
    connections, so its peer gets copies over it."""
    from distributed.comm.core import Comm

    info = Comm.handshake_info
    if getattr(info, "_pyshm_wraps", None) is not None:
        return

    def handshake_info(self):
        facts = info(self)
        machine = _machine()
        if machine is not None:
            facts.update({_ANNOUNCED: _REFERENCE_FORMAT, _MACHINE_KEY: machine})
        ends = _socket_ends(self)
        if ends is not None:
            facts[_ENDS_KEY] = ends
        return facts

    handshake_info._pyshm_wraps = info
    Comm.handshake_info = handshake_info


def _install_distributed() -> None:
    from distributed.protocol import numpy as dask_numpy  # (registers its own first)
    from distributed.protocol.serialize import dask_serialize

    original = dask_numpy.serialize_numpy_ndarray
    if getattr(dask_serialize.dispatch(np.ndarray), "_pyshm_wraps", None) is not None:
        _announce_references()
        _install_distributed_arguments()
        _installed.add("distributed")
        return

    def serialize_ndarray(x, context=None):
        # by reference: shared pyshm memory (no implicit share on distributed's threads), to
        # a process on this machine; else (another machine, disk, no recipient) by value.
        # The reference is a pickle, under distributed's own "pickle" header, so that any
        # receiver (pyshm imported there or not) rebuilds it with its stock deserializer.
        # Its secrets go in frames of their own: a receiver that fails to load the pickle
        # (pyshm not importable there) logs the pickle's first frame, and only that.
        found = reduction.as_pyshm(x) if type(x) is np.ndarray and x.nbytes > 0 else None
        if found is not None and is_shared(found) and _recipient_here(context):
            reduced = reduction.reduce_ndarray(found)  # (what pickling a ref of it makes)
            if reduced[1][1].readonly and context.get(_WRITABLE_ONLY):
                return original(x, context=context)  # (a tensor's view: see below)
            frames: list = [None]
            frames[0] = pickle.dumps(_Reduced(reduced), protocol=5,
                                     buffer_callback=lambda b: frames.append(b.raw()))
            return {"pickle": True, _ANNOUNCED: _REFERENCE_FORMAT}, frames
        return original(x, context=context)

    serialize_ndarray._pyshm_wraps = original
    _announce_references()
    dask_serialize.register(np.ndarray)(serialize_ndarray)
    _install_distributed_arguments()
    _installed.add("distributed")
    _install_distributed_tensors()


def _install_distributed_tensors() -> None:
    """Tensors over pyshm memory through dask (once both are imported). distributed's own
    serializers for them (distributed.protocol.torch, registered lazily) serialize the tensor's
    numpy view, or a Parameter's tensor, without the message's context, so that the array
    serializer above would send it by value: for a tensor over pyshm memory shared, and a
    recipient where a reference goes, pyshm makes the same message with the context passed
    on (the numpy view: found by address, see reduction.as_pyshm), which the array serializer
    sends by value if the memory is read-only for receivers (_WRITABLE_ONLY: a tensor has no
    read-only flag), telling so from the one reduction it makes for the message;
    distributed's deserializer then makes the tensor over the same memory. Other tensors go
    distributed's way."""
    if "distributed" not in _installed or not _torch_ready():
        return
    from distributed.protocol.serialize import dask_serialize, serialize

    torch = _torch()
    for kind in (torch.Tensor, torch.nn.Parameter):
        original = dask_serialize.dispatch(kind)  # (registers distributed's, if lazy still)
        if getattr(original, "_pyshm_wraps", None) is not None:
            continue

        def serialize_tensor(t, context=None, original=original, kind=kind):
            if type(t) is kind and _dask_tensor(t) and _recipient_here(context):
                data = _tensor_bytes(t)
                if data is not None and is_shared(data):
                    # (by reference only if writable for receivers, which the numpy view's
                    # serializer tells from the one reduction it makes: else by value, the
                    # message distributed's serializer makes)
                    writable = {**context, _WRITABLE_ONLY: True}
                    if kind is torch.Tensor:
                        sub_header, frames = serialize(t.detach().numpy(), context=writable)
                        header = {"sub-header": sub_header, "device": "cpu"}
                    else:
                        sub_header, frames = serialize(t.detach(), context=writable)
                        header = {"sub-header": sub_header}
                    header["requires_grad"] = bool(t.requires_grad)
                    return header, frames
            return original(t)

        serialize_tensor._pyshm_wraps = original
        dask_serialize.register(kind)(serialize_tensor)


# Task arguments: Client.submit and Client.map pickle their arguments into the task, which
# goes through the scheduler, where no reference is safe (it keeps task messages, and it would
# have to fetch on its event loop). So a pyshm array or a pyshm.ref among the arguments (an
# array as a ref of it: _arrays_as_refs; other arrays keep dask's own way) is scattered first,
# straight to a worker of this user on this machine (where the data hook above sends it by
# reference), and the task gets its future, as submit(f, client.scatter(a, direct=True,
# hash=False)) would by hand. The scheduler then holds a key, never the memory. With no such
# worker, an asynchronous client, or a scatter that fails, the ref's array goes into the task
# by value, as any array would. A scattered argument, unlike one inside the task, does not
# survive the loss of the worker that holds it (dask cancels the task). Refs are looked for
# where dask looks for futures (dask._task_spec.parse_input): in lists, tuples, sets and
# dicts, at any depth.


def _may_hold(items: Any, kind: Any) -> bool:
    """Whether ``items`` has a ``kind`` or a container among them (by their types, in one
    pass of C: a list of a million numbers costs 20 ms, not the 135 of a Python loop)."""
    wanted = (kind, dict, list, tuple, set)
    return any(issubclass(type_, wanted) for type_ in set(map(type, items)))


def _swap_refs(value: Any, swap: Any, kind: Any = None, memo: Optional[dict] = None) -> Any:
    """``value`` with each pyshm.ref (or instance of ``kind``) in it replaced by
    ``swap(ref)``: the value itself, or inside the lists, tuples, sets and dicts dask looks
    into for futures, at any depth; each container with a ref in it is rebuilt as dask would
    hand it to the task (a plain list, set, dict or tuple; a namedtuple of its own type).
    ``value`` itself if it holds no ref. Each container is walked once (``memo``: id ->
    what it became; a container met again inside itself stays as it is)."""
    kind = kind or reduction.Ref
    if isinstance(value, kind):
        return swap(value)
    if not isinstance(value, (dict, list, tuple, set)):
        return value
    if not _may_hold(value.values() if isinstance(value, dict) else value, kind):
        return value
    memo = {} if memo is None else memo
    done = memo.get(id(value))
    if done is not None:
        return done[0]
    memo[id(value)] = (value,)  # (until it is rebuilt: a cycle leads back to itself)
    memo[id(value)] = new = (_rebuilt(value, swap, kind, memo),)
    return new[0]


def _rebuilt(value: Any, swap: Any, kind: Any, memo: dict) -> Any:
    """The container ``value`` with its refs swapped (see _swap_refs)."""
    if isinstance(value, dict):
        items = {key: _swap_refs(item, swap, kind, memo) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        return items
    old = list(value)
    items = [_swap_refs(item, swap, kind, memo) for item in old]
    if all(new is item for new, item in zip(items, old)):
        return value
    if isinstance(value, list):
        return items
    if isinstance(value, set):
        try:
            return set(items)
        except TypeError:  # (by value: arrays cannot be in a set)
            raise TypeError("a pyshm.ref inside a set reaches a dask task only as the "
                            "future of its scatter to a worker of this user on this "
                            "machine, and there is none: pass it outside the set") from None
    if hasattr(type(value), "_fields"):  # (a namedtuple: dask keeps its type)
        return type(value)(*items)
    return tuple(items)


def _workers_of(client: Any) -> list:
    """The addresses of ``client``'s workers, asked of the scheduler now (not
    Client.scheduler_info(), whose answer the client's periodic refresh, on another thread,
    can replace meanwhile with one that lists no worker)."""
    return list(client.sync(client.scheduler.identity, n_workers=-1).get("workers", {}))


def _refs_in(values: list, kind: Any = None, wanted: Any = None) -> dict:
    """The pyshm.refs (or the instances of ``kind`` for which ``wanted`` is true) where dask
    looks (see _swap_refs) in ``values``, by their ids; each container walked once (a cycle,
    or one list in many places, costs no more), and each instance asked once."""
    refs: dict = {}
    seen: set = set()

    def note(ref: Any) -> Any:
        if id(ref) not in seen:
            seen.add(id(ref))
            if wanted is None or wanted(ref):
                refs[id(ref)] = ref
        return ref

    _swap_refs(list(values), note, kind)
    return refs


def _workers_here(client: Any) -> list:
    """The addresses of ``client``'s workers that a reference can go to (see
    _recipient_here): none for an asynchronous client (its scatter cannot be waited for
    here) or when the scheduler cannot be asked."""
    if getattr(client, "asynchronous", False):
        return []
    try:
        return [address for address in _workers_of(client)
                if _recipient_here({"recipient": address})]
    except Exception:  # (a closed client, a scheduler gone: dask's own way)
        return []


def _scatter_arguments(client: Any, values: list, workers: Optional[list] = None) -> list:
    """``values`` with each pyshm.ref in them (see _swap_refs) replaced by the future of its
    array scattered to a worker here (``workers``: _workers_here, asked now if None), or,
    where that cannot be (no such worker, an asynchronous client, a failed scatter), by its
    array itself, which then goes into the task by value (a ref there would make the
    scheduler map the memory and keep it; see above). ``values`` itself if they hold no
    ref."""
    refs = _refs_in(values)
    if not refs:
        return values
    arrays = {key: ref.array for key, ref in refs.items()}
    replacement = arrays  # (by value, unless the scatter below works)
    workers = _workers_here(client) if workers is None else workers
    if workers:
        try:
            unique = {id(array): array for array in arrays.values()}
            futures = dict(zip(unique, client.scatter(list(unique.values()), workers=workers,
                                                      direct=True, hash=False)))
            replacement = {key: futures[id(array)] for key, array in arrays.items()}
        except Exception:  # (a worker gone meanwhile, a closed client: dask's own way)
            replacement = arrays
    return [_swap_refs(value, lambda ref: replacement[id(ref)]) for value in values]


# Refs hidden where dask does not look (a user's object, a functools.partial, a closure, the
# function itself) would reach the scheduler inside the task. They are found by pickling the
# call once more, as distributed will (cloudpickle; contiguous arrays out of band, not
# copied), with a placeholder (a hole) for each ref and for each future where dask looks.
# submit then runs that pickled call through a loader (_LOADERS: pickled by value, so a
# worker needs no pyshm to run it), the refs' arrays scattered as above and passed, with
# those futures, as the loader's arguments: dask resolves them and the loader puts them in
# the holes. Where nothing can be scattered, and for map, the call goes with each ref's
# array in its place, by value. Only while a ref is alive that is not where dask looks (a
# hidden ref is alive); a ref pickled inside a pickle of its own is not found.


class _Visible:
    """A future where dask looks, while the call is pickled: a hole (its other places in the
    call, inside objects, stay futures, as dask leaves them)."""

    __slots__ = ("future",)

    def __init__(self, future: Any) -> None:
        self.future = future


def _hole(at: int) -> Any:
    """What a pickled call names for its holes; the loaders resolve it themselves (see
    _make_loaders), so this never runs."""
    raise pickle.UnpicklingError("pyshm: a call with holes, loaded without its loader")


class _Call:
    """A call (function, arguments, keyword arguments; or any tuple of values) pickled with
    holes for its refs and for the futures dask would look at (see above); ``data`` None if
    it cannot be pickled. ``holes``: the refs and futures, in hole order."""

    __slots__ = ("buffers", "data", "holes")

    def __init__(self, call: tuple) -> None:
        import io

        from distributed import Future

        marked = _swap_refs(call, _Visible, Future)  # (futures where dask looks: holes)
        self.data = None
        for out_of_band in (True, False):
            self.holes, buffers, out = [], [], io.BytesIO()
            try:
                _call_pickler()(out, self.holes, buffers if out_of_band else None).dump(marked)
                # (the buffers travel as uint8 arrays: dask keeps their write flag, which it
                # drops from other buffers in a task)
                self.buffers = [np.frombuffer(b.raw(), np.uint8) for b in buffers]
            except BufferError:
                continue  # (a buffer that is not contiguous: in band, then)
            except Exception:  # (dask will say what cannot be pickled)
                return
            self.data = out.getvalue()
            return

    @property
    def refs(self) -> list:
        return [hole for hole in self.holes if isinstance(hole, reduction.Ref)]

    def by_value(self) -> Any:
        """What was pickled, again, each ref's array in its place (futures as they were)."""
        values = [hole.array if isinstance(hole, reduction.Ref) else hole
                  for hole in self.holes]
        return _LOADERS[0](self.data, self.buffers, *values, call=False)


_PICKLER: list = []


def _call_pickler():
    """cloudpickle's Pickler (distributed's own) that makes holes of refs and _Visible
    futures (reducer_override: never called for ints, floats, strings, lists, dicts...)."""
    if not _PICKLER:
        import cloudpickle

        class Pickler(cloudpickle.Pickler):
            def __init__(self, out, holes: list, buffers: Any) -> None:
                super().__init__(out, protocol=5, buffer_callback=None if buffers is None
                                 else buffers.append)
                self.holes, self.seen = holes, {}

            def reducer_override(self, obj):
                if type(obj) is _Visible:
                    self.holes.append(obj.future)
                    return _hole, (len(self.holes) - 1,)
                if isinstance(obj, reduction.Ref):
                    at = self.seen.get(id(obj))
                    if at is None:
                        at = self.seen[id(obj)] = len(self.holes)
                        self.holes.append(obj)
                    return _hole, (at,)
                return super().reducer_override(obj)

        _PICKLER.append(Pickler)
    return _PICKLER[0]


def _make_loaders() -> tuple:
    """The functions a worker runs for a call with holes (see above): made here, so that
    cloudpickle pickles them by value (they need nothing but the standard library)."""

    def call_with_refs(data, buffers, *values, call=True):
        import io
        import pickle

        def hole(at):
            if type(at) is not int or not 0 <= at < len(values):
                raise pickle.UnpicklingError(f"pyshm: no value {at!r} came with this call")
            return values[at]

        class Loader(pickle.Unpickler):
            def find_class(self, module, name):
                if module == "pyshm.engines" and name == "_hole":
                    return hole  # (not pyshm's: see engines._hole)
                return super().find_class(module, name)

        loaded = Loader(io.BytesIO(data), buffers=buffers).load()
        if not call:
            return loaded  # (on the client: the call, by value)
        func, args, kwargs = loaded
        return func(*args, **kwargs)

    async def call_with_refs_async(data, buffers, *values):
        return await call_with_refs(data, buffers, *values)

    return call_with_refs, call_with_refs_async


_LOADERS = _make_loaders()


def _hidden_call(call: tuple, visible: list) -> Any:
    """The pickled ``call`` (a _Call) if it holds a ref that is not among ``visible`` (where
    dask would find it), else None."""
    seen = _refs_in(visible)
    try:
        alive = list(reduction.Ref.live)
    except RuntimeError:  # (a ref died meanwhile, on another thread)
        alive = [None]
    if all(id(ref) in seen for ref in alive):
        return None  # (every ref alive is where dask looks: none can be hidden)
    pickled = _Call(call)
    if pickled.data is None or all(id(ref) in seen for ref in pickled.refs):
        return None
    return pickled


def _submit_hidden(client: Any, original, pickled: _Call, func: Any, options: dict,
                   workers: Optional[list] = None):
    """submit of a call with hidden refs (see above): through a loader, the refs' arrays
    scattered to a worker here, or, if none can be, the call rebuilt with the arrays
    themselves (by value). ``workers``: as for _scatter_arguments."""
    import inspect

    refs = pickled.refs
    scattered = _scatter_arguments(client, refs, workers)
    if any(future is ref.array for future, ref in zip(scattered, refs)):  # (not scattered)
        func, args, kwargs = pickled.by_value()
        return original(client, func, *args, **kwargs, **options)
    of = {id(ref): future for ref, future in zip(refs, scattered)}
    values = [of.get(id(hole), hole) for hole in pickled.holes]
    if options.get("key") is None:
        import uuid

        from dask.utils import funcname

        options["key"] = f"{funcname(func)}-{uuid.uuid4().hex}"
    loader = _LOADERS[1] if inspect.iscoroutinefunction(func) else _LOADERS[0]
    return original(client, loader, pickled.data, pickled.buffers, *values, **options)


def _by_value_if_hidden(value: Any) -> Any:
    """``value``, or a copy of it with each ref's array in its place if it holds a ref where
    dask does not look (for map: see above)."""
    pickled = _hidden_call((value,), [value])
    return value if pickled is None else pickled.by_value()[0]


class _TensorRef(reduction.Ref):
    """A tensor over pyshm memory among a task's arguments, to scatter as a ref's array is
    (see _arrays_as_refs): its future, or the tensor itself, replaces it before dask pickles
    the task. Pickled anywhere else, it is the tensor, by value."""

    __slots__ = ()

    def __init__(self, tensor: Any) -> None:  # (not Ref's: a tensor, checked by the caller)
        self.array = tensor
        reduction.Ref.live.add(self)

    def __reduce__(self):
        return self.array.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


def _dask_tensor(t: Any) -> bool:
    """Whether distributed's serializers could send tensor ``t`` as its numpy view (see
    _install_distributed_tensors): a leaf with no .grad to carry, no lazy conjugation or
    negation, of a dtype numpy has (not bfloat16, float8...). Other tensors go dask's way."""
    if not t.is_leaf or t.grad is not None or t.is_conj() or t.is_neg():
        return False
    try:
        t.detach().numpy()
    except (RuntimeError, TypeError):
        return False
    return True


def _pyshm_tensor(t: Any) -> bool:
    """A tensor to scatter (and so send by reference): a plain CPU tensor or Parameter over
    pyshm memory that can go by reference (shared, or shared in place now, on the caller's
    thread; not read-only for receivers) and as its numpy view (_dask_tensor)."""
    torch = sys.modules.get("torch")
    if torch is None or type(t) not in (torch.Tensor, getattr(torch.nn, "Parameter", None)) \
            or not _dask_tensor(t):
        return False
    try:
        return _tensor_reduction(t) is not None
    except _ReadOnlyTensor:
        return False


def _pyshm_value(a: Any) -> bool:
    return _pyshm_tensor(a) if type(a) is not np.ndarray else _pyshm_array(a)


def _scattered_kinds() -> tuple:
    """The types of the values _arrays_as_refs looks for: numpy's arrays, and torch's tensors
    once torch is imported."""
    torch = sys.modules.get("torch")
    return (np.ndarray, torch.Tensor) if torch is not None and hasattr(torch, "Tensor") \
        else (np.ndarray,)


def _array_as_ref(a: Any, sendable: bool) -> Any:
    """A ref of ``a`` if it is a pyshm array or tensor to pass by reference (``sendable``:
    _pyshm_value's answer, asked once: shared, or shared in place now, on the caller's
    thread), else ``a`` (dask's own way: by value). An array that cannot be shared in place (a
    slice of a private arena, no memory or fds left for its memfd) goes by value too, as it
    would without pyshm."""
    if not sendable:
        return a
    if type(a) is not np.ndarray:
        return _TensorRef(a)
    try:
        return reduction.Ref(reduction.as_pyshm(a))
    except (TypeError, OSError, MemoryError):
        return a


def _arrays_as_refs(client: Any, args: tuple, kwargs: dict, names: list,
                    each: bool) -> tuple:
    """(``args``, ``kwargs``, the workers here) with each pyshm array where dask looks (see
    _swap_refs) as a ref of it (_array_as_ref), so that it goes as a ref does: submit's
    positional arguments, map's list and tuple iterables element by element (an array given
    to map as an iterable stays one: map iterates it), and the keyword arguments ``names``.
    Only if ``client`` has a worker here (_workers_here, asked once, and only when a pyshm
    array is among them: None if not asked): else nothing would be scattered, so nothing is
    shared in place and every container stays as it is."""
    at = [i for i, a in enumerate(args) if not each or isinstance(a, (list, tuple))]
    looked = [args[i] for i in at] + [kwargs[name] for name in names]
    kinds = _scattered_kinds()
    sendable = _refs_in(looked, kinds, _pyshm_value)
    if not sendable:
        return args, kwargs, None  # (no pyshm array: no question to the scheduler)
    workers = _workers_here(client)
    if not workers:
        return args, kwargs, workers
    swapped = _swap_refs(looked, lambda a: _array_as_ref(a, id(a) in sendable), kinds)
    args = list(args)
    for i, value in zip(at, swapped):
        args[i] = value
    kwargs.update(zip(names, swapped[len(at):]))
    return tuple(args), kwargs, workers


def _wrap_task_maker(original):
    """Client.submit or Client.map, scattering the refs among its arguments first: submit's
    positional arguments, map's list and tuple iterables (element by element), and either's
    keyword arguments that are not its own options (map passes those to every task). A pyshm
    array there goes as a ref of it when the client has a worker here (one not shared yet is
    shared in place then: _arrays_as_refs)."""
    import inspect

    options = {p.name for p in inspect.signature(original).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY}
    each = original.__name__ == "map"

    def make(self, func, *args, **kwargs):
        if kwargs.get("actor") or kwargs.get("actors"):
            return original(self, func, *args, **kwargs)
        names = [name for name in kwargs if name not in options]
        args, kwargs, workers = _arrays_as_refs(self, args, kwargs, names, each)
        if not reduction.Ref.live:
            # (no ref is alive in this process: nothing to look for)
            return original(self, func, *args, **kwargs)
        if not each:
            user = {name: kwargs[name] for name in names}
            pickled = _hidden_call((func, args, user), [*args, *user.values()])
            if pickled is not None:
                own = {name: v for name, v in kwargs.items() if name not in user}
                return _submit_hidden(self, original, pickled, func, own, workers)
        # each argument as the run of values it stands for: map's lists element by element,
        # anything else (an iterator map must not consume too) as one value
        runs = [list(a) if each and isinstance(a, (list, tuple)) else [a] for a in args]
        flat = [value for run in runs for value in run]
        given = flat + [kwargs[name] for name in names]
        before = given
        if each and _hidden_call((func, given), given) is not None:
            # (map: a ref where dask does not look goes by value)
            func = _by_value_if_hidden(func)
            given = [_by_value_if_hidden(value) for value in given]
            if all(new is old for new, old in zip(given, before)):
                given = before
        values = _scatter_arguments(self, given, workers)
        if values is not before:
            rebuilt, at = [], 0
            for a, run in zip(args, runs):
                part = values[at:at + len(run)]
                rebuilt.append(part if each and isinstance(a, (list, tuple)) else part[0])
                at += len(run)
            args = tuple(rebuilt)
            kwargs.update(zip(names, values[at:]))
        return original(self, func, *args, **kwargs)

    make._pyshm_wraps = original
    make.__name__, make.__doc__ = original.__name__, original.__doc__
    return make


def _install_distributed_arguments() -> None:
    from distributed.client import Client

    for name in ("submit", "map"):
        current = getattr(Client, name)
        if getattr(current, "_pyshm_wraps", None) is None:
            setattr(Client, name, _wrap_task_maker(current))


# ---- ray ------------------------------------------------------------------------------------


class _ByValue:
    """An object pickled the way its pickler would pickle it without pyshm (numpy's or torch's
    own reduction, for that pickler's protocol: out of band with protocol 5)."""

    __slots__ = ("value", "previous")

    def __init__(self, value: Any, previous: Any = None) -> None:
        self.value, self.previous = value, previous

    def __reduce_ex__(self, protocol: int):
        if self.previous is not None:  # (a serializer registered before pyshm's: it decides)
            return self.previous(self.value)
        return self.value.__reduce_ex__(protocol)


_NOT_DELIVERED = (pickle.UnpicklingError, OSError, MemoryError)  # (DeliveryError among them)
# what pyshm's pickling of memory it cannot send by reference raises (a private arena's slice,
# memory that cannot be shared now: no fd, no memory left): Ray's copy goes alone then
_NOT_BY_REFERENCE = (pickle.PicklingError, BufferError, OSError, MemoryError)


# Ray deserializes an object again for every task that names it (and every ray.get), and a
# task's arguments die with the task: each of those would fetch the memory from its sender
# again (a round trip to its fd server, about 0.5 ms, taken on the sender's GIL). So a
# process keeps each array it rebuilt through Ray over memory received from another process
# (a mapping of a memfd not its own) for _RAY_LINGER_SECONDS after its latest rebuild of that
# memory (the _RAY_LINGER_MAX latest): a rebuild meanwhile maps nothing and fetches nothing
# (reduction._mapped_array). Memory both sides dropped is then freed that much later.
_RAY_LINGER_SECONDS = 0.5
_RAY_LINGER_MAX = 32


def _received_mapping(array: np.ndarray) -> Any:
    """The mapping of memory received from another process that `array` lies in, or None."""
    keep = getattr(reduction.owner_of(array), "keep", None)
    return keep if isinstance(keep, reduction._Mapping) and not keep.ours else None


class _RayLinger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrays: dict = {}  # (memfd key, size) -> (array, deadline), oldest first
        self.thread: Optional[threading.Thread] = None

    def keep(self, array: np.ndarray) -> None:
        """After a rebuild of `array` through Ray (never raises: a failure keeps nothing)."""
        mapping = _received_mapping(array)
        if mapping is None:
            return
        key = (mapping.key, mapping.size)
        dropped = []
        with self.lock:
            dropped.append(self.arrays.pop(key, None))
            self.arrays[key] = (array, time.monotonic() + _RAY_LINGER_SECONDS)
            while len(self.arrays) > _RAY_LINGER_MAX:
                dropped.append(self.arrays.pop(next(iter(self.arrays))))
            if self.thread is None:
                thread = threading.Thread(target=self._expire, name="pyshm-ray-linger",
                                          daemon=True)
                self.thread = thread
                try:
                    thread.start()
                except RuntimeError:  # (no thread now: keep nothing, try again next time)
                    self.thread = None
                    dropped.extend(self.arrays.values())
                    self.arrays.clear()
        del dropped  # (outside the lock: a last reference unmaps)

    def _expire(self) -> None:
        me = threading.current_thread()
        while True:
            with self.lock:
                if self.thread is not me:
                    return
                now = time.monotonic()
                expired = [key for key, (_, deadline) in self.arrays.items() if deadline <= now]
                dropped = [self.arrays.pop(key) for key in expired]
                if not self.arrays:
                    self.thread = None
                    return
                wait = min(deadline for _, deadline in self.arrays.values()) - now
            del dropped  # (outside the lock: a last reference unmaps)
            time.sleep(max(wait, 0.01))

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        self.arrays = {}
        self.thread = None


_ray_linger = _RayLinger()
os.register_at_fork(after_in_child=_ray_linger.after_fork_in_child)


def _ray_rebuild(reference: tuple) -> Any:
    array = reduction.rebuild_ndarray(*reference)
    if isinstance(array, np.ndarray):
        _ray_linger.keep(array)
    return array


def _ray_array_back(reference: tuple, copy: Any) -> Any:
    """A pyshm array sent through Ray: the sender's memory itself while the sender can still
    give it (it runs, holds the memory, and this process can reach it: this machine, this
    network namespace) or this process has it still (_RayLinger), else the copy Ray carried
    beside it (read-only from Ray's object store, as Ray gives any array)."""
    try:
        return _ray_rebuild(reference)
    except _NOT_DELIVERED:
        return copy


def _ray_tensor_back(reference: tuple, layout: tuple, copy: Any) -> Any:
    """The same for a tensor over pyshm memory: over the sender's memory, else Ray's copy."""
    try:
        data = _ray_rebuild(reference)
    except _NOT_DELIVERED:
        return copy
    return _rebuild_tensor(data, *layout)


def _ray_array(previous):
    def serialize(a: np.ndarray) -> tuple:
        # (a 1-tuple for operator.itemgetter(0), the deserializer)
        copy = _ByValue(a, previous)
        if not _pyshm_array(a):
            return (copy,)
        try:
            rebuild, reference = reduction.reduce_ndarray(a)
        except _NOT_BY_REFERENCE:
            return (copy,)
        if rebuild is not reduction.rebuild_ndarray:
            return (copy,)  # (what pyshm pickles by value itself: empty arrays)
        return (_Reduced((_ray_array_back, (reference, copy))),)

    serialize._pyshm = True
    return serialize


def _ray_tensor(previous):
    def serialize(tensor) -> tuple:
        copy = _ByValue(tensor, previous)
        try:
            reduced = _tensor_reduction(tensor, attributes=True)
        except _NOT_BY_REFERENCE:
            # (memory shared read-only: a tensor has no read-only flag; a private arena's
            # slice; no fd or memory left to share it: Ray's copy alone, as without pyshm)
            return (copy,)
        if reduced is None:
            return (copy,)
        (rebuild, reference), layout = reduced[1][0].value, reduced[1][1:]
        if rebuild is not reduction.rebuild_ndarray:
            return (copy,)
        return (_Reduced((_ray_tensor_back, (reference, layout, copy))),)

    serialize._pyshm = True
    return serialize


def _ray_register(kind: type, make) -> None:
    """Register pyshm's serializer for `kind` with Ray, over whatever is there (Ray's own
    reducer, a user's serializer: kept for what pyshm sends by value)."""
    import operator

    from ray.cloudpickle import CloudPickler
    from ray.util import register_serializer

    current = CloudPickler.dispatch.get(kind)
    if getattr(current, "_pyshm", False):
        return
    register_serializer(kind, serializer=make(current), deserializer=operator.itemgetter(0))
    CloudPickler.dispatch[kind]._pyshm = True


def _install_ray() -> None:
    from ray._private.serialization import SerializationContext

    _ray_register(np.ndarray, _ray_array)
    init = SerializationContext.__init__
    if getattr(init, "_pyshm_wraps", None) is None:
        # Ray's context for a new job registers Ray's own reducers again (its zero-copy tensor
        # reducer among them, RAY_ENABLE_ZERO_COPY_TORCH_TENSORS): pyshm's go back on top
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            _ray_register(np.ndarray, _ray_array)
            _install_ray_tensors()

        __init__._pyshm_wraps = init
        SerializationContext.__init__ = __init__
    _installed.add("ray")
    _install_ray_tensors()


def _install_ray_tensors() -> None:
    """Tensors over pyshm memory through Ray (once both are imported)."""
    if "ray" not in _installed or not _torch_ready():
        return
    torch = _torch()
    for kind in (torch.Tensor, torch.nn.Parameter):
        _ray_register(kind, _ray_tensor)


# ---- installing after an engine's own import --------------------------------------------------

# the module whose import completes each engine's reducers
# (torch.multiprocessing's own import registers torch's reducers, at its end); for
# distributed, distributed.client too: pyshm's entry point (pyshm/_pyshm_dask.py) imports
# pyshm from within distributed's own import (distributed -> dask -> dask.sizeof), when
# "distributed" is under way already
_WATCHED = {"torch.multiprocessing": "torch", "joblib._memmapping_reducer": "joblib",
            "distributed": "distributed", "distributed.client": "distributed", "ray": "ray"}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it returns the spec the other finders give,
    with a loader that installs the hook once the module has run."""

    def find_spec(self, name, path, target=None):
        if name not in _WATCHED or _WATCHED[name] in _installed:
            return None
        return _pyshm_dask.spec_from_the_others(
            self, name, path, target,
            lambda loader: _pyshm_dask.WrappedLoader(loader, after=_after_import))


_finder = _Finder()


def _after_import(module: Any) -> None:
    install()
    if all(engine in _installed for engine in _WATCHED.values()) and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def _watch() -> None:
    """At pyshm's import: hooks for the engines imported already, a watch for the rest."""
    install()
    # (a finder of an earlier copy of this module, after importlib.reload, goes first)
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__qualname__ != "_Finder" or
                        getattr(type(f), "__module__", None) != __name__ or f is _finder]
    if not all(engine in _installed for engine in _WATCHED.values()) and \
            _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
