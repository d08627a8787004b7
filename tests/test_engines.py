"""pyshm memory through engines: torch.multiprocessing, joblib, dask.distributed, Ray, and
``pyshm.ref`` through any pickler. Each engine's tests are skipped when it is not installed;
.ci/run installs every one, and with CI=true their absence fails these tests.

What is checked is the memory: a worker's write is read by the parent, what comes back is at
the parent's address, no warning is raised, and tensors and arrays that are not pyshm memory
go the engine's own way unchanged.
"""

from __future__ import annotations

import collections
import importlib.util
import multiprocessing as mp
import os
import gc
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

import numpy as np
import pytest

import pyshm
from pyshm import _channel, engines, reduction
from shm_harness import describe_fds, needs_fence, run_without_the_fence

HERE = os.path.dirname(os.path.abspath(__file__))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def engine_or_skip(name: str):
    try:
        return __import__(name)
    except ImportError:
        if IN_CI:
            pytest.fail(f"{name} is missing but CI=true: .ci/run must install it")
        pytest.skip(f"{name} is not installed")


def run_python(code: str, stdin: bytes = b"", timeout: float = 120) -> bytes:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=stdin,
                          capture_output=True, timeout=timeout, cwd=HERE)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


# ---- pyshm.ref ------------------------------------------------------------------------------

READ_AND_WRITE = """
    import pickle, sys
    import numpy as np
    import pyshm
    array = pickle.loads(sys.stdin.buffer.read())
    assert type(array) is np.ndarray and pyshm.is_shared(array)
    print(int(array.sum()), array.dtype, array.shape)
    array[:] += 1
"""


@pytest.mark.parametrize("nbytes", [4096, 3 << 20])
def test_a_ref_pickled_with_plain_pickle_is_the_same_memory_in_another_process(nbytes):
    array = pyshm.zeros(nbytes // 4, np.int32, shared=True)
    array[:] = 2
    data = pickle.dumps(pyshm.ref(array))
    assert len(data) < 600  # a reference, not the bytes
    out = run_python(READ_AND_WRITE, data).decode().split()
    assert out == [str(2 * (nbytes // 4)), "int32", f"({nbytes // 4},)"]
    assert (array == 3).all()  # the other process wrote our memory


def test_a_ref_shares_an_unshared_array_in_place_and_refuses_other_memory():
    array = pyshm.empty(100_000, np.uint8)
    address = array.ctypes.data
    handle = pyshm.ref(array)
    assert pyshm.is_shared(array) and array.ctypes.data == address
    assert pyshm.ref(handle) is handle
    with pytest.raises(TypeError, match="pyshm.copy"):
        pyshm.ref(np.zeros(10))
    with pytest.raises(TypeError, match="numpy array"):
        pyshm.ref(b"bytes")


def test_a_ref_unpickled_here_is_a_view_of_the_array():
    array = pyshm.zeros((64, 64), np.float32, shared=True)
    back = pickle.loads(pickle.dumps(pyshm.ref(array[3:9, ::2])))
    assert back.ctypes.data == array[3:9, ::2].ctypes.data and back.strides == (256, 8)
    back[0, 0] = 5
    assert array[3, 0] == 5


@pytest.mark.parametrize("nbytes", [100_000, 3 << 20])
def test_a_ref_unpickled_here_again_while_an_array_of_it_lives_is_that_memory(nbytes):
    # A ref can be unpickled while this process has the memory. Once the array was dropped,
    # the first unpickling here gave an array over it, but the next one (Ray's ray.get of an
    # object the driver put unpickles every time) raised DeliveryError while that array still
    # held the memory, and so did another process given the pickle.
    array = pyshm.zeros(nbytes, np.uint8)
    array[:] = 7
    address = array.ctypes.data
    data = pickle.dumps(pyshm.ref(array))
    del array
    gc.collect()
    first = pickle.loads(data)
    assert first.ctypes.data == address
    gc.collect()
    second = pickle.loads(data)
    assert second.ctypes.data == address and (second == 7).all()
    second[0] = 1
    assert first[0] == 1
    del second
    gc.collect()
    out = run_python(READ_AND_WRITE, data).decode().split()
    assert out == [str(7 * nbytes - 6), "uint8", f"({nbytes},)"]
    assert first[0] == 2 and (first[1:] == 8).all()  # the other process wrote our memory
    # a Storage sent by reference the same way, unpickled here by two handles (equal: one
    # storage), the first of them dropped
    storage = pyshm.Storage(nbytes)
    data = bytes(ForkingPickler.dumps(storage))
    del storage
    gc.collect()
    one, two = ForkingPickler.loads(data), ForkingPickler.loads(data)
    assert one == two
    del one
    gc.collect()
    three = ForkingPickler.loads(data)
    assert three == two and three.data_ptr == two.data_ptr


def test_a_ref_travels_through_cloudpickle():
    cloudpickle = engine_or_skip("cloudpickle")  # (installed with distributed and joblib)
    array = pyshm.zeros(10_000, np.int64, shared=True)
    data = cloudpickle.dumps({"payload": pyshm.ref(array), "f": lambda x: x + 1})
    out = run_python("""
        import pickle, sys
        message = pickle.loads(sys.stdin.buffer.read())
        message["payload"][:] = message["f"](41)
    """, data)
    assert out == b"" and (array == 42).all()


def test_a_ref_after_its_memory_is_gone_raises_delivery_error():
    array = pyshm.zeros(1 << 20, np.uint8, shared=True)
    data = pickle.dumps(pyshm.ref(array))
    del array
    _channel.drop_holds()  # as if KEEPALIVE_SECONDS had passed
    out = run_python("""
        import pickle, sys
        import pyshm
        try:
            pickle.loads(sys.stdin.buffer.read())
        except pyshm.DeliveryError as exc:
            print("DeliveryError", exc)
    """, data)
    assert out.startswith(b"DeliveryError")


def test_a_ref_from_a_process_that_exited_raises_delivery_error():
    data = run_python("""
        import pickle, sys
        import numpy as np
        import pyshm
        sys.stdout.buffer.write(pickle.dumps(pyshm.ref(pyshm.zeros(5000, np.uint8, shared=True))))
    """)
    with pytest.raises(pyshm.DeliveryError):
        pickle.loads(data)


def test_a_ref_with_a_forged_secret_gets_nothing():
    array = pyshm.zeros(1 << 20, np.uint8, shared=True)
    data = pickle.dumps(pyshm.ref(array))
    # the secrets are the only 16-byte strings of the pickle (SHORT_BINBYTES, length 16)
    marker = b"C\x10"
    forged = bytearray(data)
    at = forged.find(marker)
    while at >= 0:
        forged[at + 2:at + 18] = bytes(16)
        at = forged.find(marker, at + 18)
    assert forged != bytearray(data)
    out = run_python("""
        import pickle, sys
        import pyshm
        try:
            pickle.loads(sys.stdin.buffer.read())
        except pyshm.DeliveryError:
            print("refused")
    """, bytes(forged))
    assert out.strip() == b"refused"
    assert (array == 0).all()


# ---- torch ----------------------------------------------------------------------------------


def torch_or_skip():
    torch = engine_or_skip("torch")
    assert "torch" in engines.installed()
    return torch


def add_one_tensor(tensor):
    tensor += 1
    return tensor


def tensor_facts(tensor):
    return (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype),
            type(tensor).__name__, tensor.requires_grad)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_pool_gets_the_same_memory_and_gives_it_back(method):
    torch = torch_or_skip()
    import torch.multiprocessing as tmp

    shared = pyshm.zeros((256, 1024), np.float32, shared=True)  # 1 MiB
    small = pyshm.zeros(100, np.int16, shared=True)  # in a slab
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tmp.get_context(method).Pool(1) as pool:
            for array, tensor in ((shared, torch.from_numpy(shared)),
                                  (shared, torch.from_numpy(shared)[10:20, ::4]),
                                  (small, torch.from_dlpack(small))):
                back = pool.apply(add_one_tensor, (tensor,))
                assert back.data_ptr() == tensor.data_ptr()  # our own memory, come back
                assert back.stride() == tensor.stride() and back.shape == tensor.shape
                assert not tensor.is_shared()  # torch did not copy it into its own memory
            assert int(shared.sum()) == 256 * 1024 + 10 * 256 and (small == 1).all()
            # tensors that are not pyshm memory still go torch's way
            plain = torch.zeros(1000)
            assert float(pool.apply(add_one_tensor, (plain,)).sum()) == 1000
            assert plain.is_shared() and float(plain.sum()) == 1000


def send_back_facts(queue_in, queue_out):
    tensor = queue_in.get()
    tensor.detach()[0] = 7  # (a Parameter: no autograd for this write)
    queue_out.put(tensor_facts(tensor))
    queue_out.put(tensor)
    queue_in.get()  # (wait until the parent has it)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_queue_carries_parameters_and_views(method):
    torch = torch_or_skip()
    import torch.multiprocessing as tmp

    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    ctx = tmp.get_context(method)
    for tensor in (torch.nn.Parameter(torch.from_numpy(array)),
                   torch.from_numpy(array)[8::2]):
        to_child, to_parent = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=send_back_facts, args=(to_child, to_parent))
        child.start()
        to_child.put(tensor)
        _, shape, stride, dtype, kind, grad = to_parent.get(timeout=60)
        back = to_parent.get(timeout=60)
        to_child.put(None)
        child.join(60)
        assert child.exitcode == 0
        assert (shape, stride, dtype) == (tuple(tensor.shape), tuple(tensor.stride()),
                                          str(tensor.dtype))
        assert (kind, grad) == (type(tensor).__name__, tensor.requires_grad)
        assert back.data_ptr() == tensor.data_ptr() and type(back) is type(tensor)
        assert float(tensor.detach()[0]) == 7  # the child's write, in our memory
        array[:] = 0


def lazy_tensors(torch, array):
    """Tensors over `array` (complex64 [1+2j, 3+4j, ...]) with their lazy bits and an
    attribute: what each must read as, and the tensors."""
    tensor = torch.from_numpy(array)
    tagged = tensor[1:]
    tagged.tag = "kept"
    return [(tensor.conj(), {"conj": True}), (torch._neg_view(tensor), {"neg": True}),
            (tensor.conj().imag, {"neg": True}), (tagged, {"tag": "kept"})]


def read_lazy(tensor):
    """What a receiver sees of one of lazy_tensors (values, bits, attribute), and the tensor
    itself to send back."""
    return (tensor.resolve_conj().resolve_neg().tolist(), tensor.is_conj(), tensor.is_neg(),
            getattr(tensor, "tag", None)), tensor


def check_lazy(sent, got, attributes=True):
    facts, back = got
    expected = (sent.resolve_conj().resolve_neg().tolist(), sent.is_conj(), sent.is_neg(),
                getattr(sent, "tag", None) if attributes else None)
    assert facts == expected  # (as the receiver saw it)
    assert read_lazy(back)[0] == expected  # (as it came back)
    assert back.data_ptr() == sent.data_ptr()  # (the same memory, both ways)


def test_torch_lazy_conjugate_and_negative_views_arrive():
    # (torch's own reducer drops these bits; over pyshm memory they come; attributes are
    # dropped, as torch's reducer drops them: some cannot be pickled)
    torch = torch_or_skip()
    import torch.multiprocessing as tmp

    array = pyshm.zeros(4, np.complex64, shared=True)
    array[:] = [1 + 2j, 3 + 4j, 5 + 6j, 7 + 8j]
    awkward = torch.from_numpy(array)[2:]
    awkward.lock, awkward.me = threading.Lock(), awkward  # (neither pickles)
    with tmp.get_context("fork").Pool(1) as pool:
        for sent, _ in lazy_tensors(torch, array) + [(awkward, {})]:
            check_lazy(sent, pool.apply(read_lazy, (sent,)), attributes=False)


def test_torch_tensor_over_unshared_pyshm_memory_is_shared_in_place_on_send():
    torch = torch_or_skip()
    import torch.multiprocessing as tmp

    array = pyshm.zeros(1 << 20, np.uint8)
    address = array.ctypes.data
    tensor = torch.from_numpy(array)
    ctx = tmp.get_context("spawn")
    child = ctx.Process(target=add_one_tensor, args=(tensor,))  # (pickled on this thread)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert pyshm.is_shared(array) and array.ctypes.data == address
    assert (array == 1).all() and tensor.data_ptr() == address


def send_a_tensor_of(array):
    """In a worker: a tensor over the (read-only) array received, pickled to send it on."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns of non-writable numpy arrays)
        tensor = torch.from_numpy(array)
    payload = bytes(ForkingPickler.dumps(tensor))
    return array.flags.writeable, payload, tensor.data_ptr() == array.ctypes.data


def test_torch_tensor_over_read_only_pyshm_memory_goes_by_value():
    # a tensor has no read-only flag: over memory its receivers may only read it goes as a copy
    # of its bytes (as through Ray), which the receiver may write (the memory itself would
    # crash it); the sender's tensor stays over its array (torch's own reducer would move it)
    torch_or_skip()
    array = pyshm.share_readonly(pyshm.copy(np.arange(1 << 14, dtype=np.uint8)))
    with mp.get_context("fork").Pool(1) as pool:
        writeable, payload, aliases = pool.apply(send_a_tensor_of, (array,))
    assert not writeable and aliases
    back = pickle.loads(payload)
    assert np.array_equal(back.numpy(), array) and back.data_ptr() != array.ctypes.data
    back[0] = 7  # (a copy of its own, writable)
    assert array[0] == 0


class ReadOnlyFrames:
    """Items: arrays shared read-only, returned as they are (the DataLoader makes tensors)."""

    def __init__(self):
        self.frames = [pyshm.share_readonly(pyshm.copy(np.full((64, 64), i, np.float32)))
                       for i in range(4)]

    def __len__(self):
        return len(self.frames)

    def __getitem__(self, i):
        return self.frames[i]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_dataloader_over_read_only_pyshm_memory_delivers_copies(method):
    # (before: pyshm refused those tensors on the result queue's feeder thread, which dropped
    # them, and the loop waited forever; here DataLoader's timeout says so)
    torch = torch_or_skip()
    data = ReadOnlyFrames()
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=1,
                                         multiprocessing_context=method, timeout=60)
    got = [float(frame[0, 0]) for frame in loader]
    assert got == [0.0, 1.0, 2.0, 3.0]


class PyshmDataset:
    """Items are tensors over pyshm arrays the parent made; a worker writes each one."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays)

    def __getitem__(self, index):
        import torch

        array = self.arrays[index]
        array[0] = 100 + index
        return torch.from_numpy(array)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_dataloader_workers_return_the_parents_memory(method):
    torch = torch_or_skip()
    # in slabs and with memfds of their own
    arrays = [pyshm.zeros(size + index, np.float64, shared=True)
              for index, size in enumerate([4096] * 3 + [40_000] * 3)]
    loader = torch.utils.data.DataLoader(PyshmDataset(arrays), batch_size=None, num_workers=2,
                                         multiprocessing_context=method)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        items = list(loader)
    assert [a[0] for a in arrays] == [100 + index for index in range(6)]
    for item, array in zip(items, arrays):
        item[1] = 5  # the item is that memory
        assert array[1] == 5 and not item.is_shared()  # (not torch's own shared memory)
    addresses = [item.data_ptr() for item in items]
    if method == "spawn":  # (this process sent the dataset: its own memory comes back)
        assert addresses == [a.ctypes.data for a in arrays]
    else:  # forked workers never got it from this pyshm: slabs are known by their memfd
        assert addresses[:3] == [a.ctypes.data for a in arrays[:3]]


class NewArrays:
    """A dataset whose workers make new pyshm memory for every item (they are its senders)."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        import torch

        array = pyshm.zeros(1 << 20, np.uint8)
        array[0] = index
        return torch.from_numpy(array)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_dataloader_left_early_does_not_wait_for_its_workers(method):
    # a loop left with break: the workers' prefetched items are never read; their data
    # queues are given up (cancel_join_thread), so they wait for a reader GIVEN_UP_SECONDS
    # only, not KEEPALIVE_SECONDS, which made the DataLoader wait 5 s for each worker, then
    # terminate it
    torch = torch_or_skip()
    loader = torch.utils.data.DataLoader(NewArrays(), batch_size=None, num_workers=2,
                                         multiprocessing_context=method)
    iterator = iter(loader)
    assert int(next(iterator)[0]) == 0
    started = time.monotonic()
    del iterator
    assert time.monotonic() - started < 4


def write_storage(storage):
    storage[1] = 5
    return storage


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_storages_over_pyshm_memory_are_the_same_memory(method):
    # torch's reducer for storages moves a storage into torch's own shared memory, as its
    # tensor reducer does: the parent's tensor (and every tensor over that storage) would
    # leave the array, and the worker's write would land elsewhere
    torch = torch_or_skip()
    import torch.multiprocessing as tmp

    array = pyshm.zeros(1 << 12, np.float32, shared=True)
    tensor = torch.from_numpy(array)
    typed = torch.TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=torch.float32,
                               _internal=True)
    # (a tensor subclass, which its forked worker knows too)
    globals()["TensorSubclass"] = type("TensorSubclass", (torch.Tensor,), {"__module__": __name__})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "TypedStorage is deprecated")  # (torch's own)
        with tmp.get_context(method).Pool(1) as pool:
            back = pool.apply(write_storage, (tensor.untyped_storage(),))
            assert tensor.untyped_storage().data_ptr() == array.ctypes.data  # not moved
            assert back.data_ptr() == array.ctypes.data and back.nbytes() == array.nbytes
            assert array.view(np.uint8)[1] == 5  # the worker's write, in our memory
            back = pool.apply(write_storage, (typed,))
            assert type(back) is torch.TypedStorage and back.dtype == torch.float32
            assert back.data_ptr() == array.ctypes.data and array[1] == 5
            # read-only memory goes as a copy of its bytes (a storage has no read-only flag)
            frozen = pyshm.share_readonly(pyshm.copy(np.arange(8, dtype=np.uint8)))
            back = pool.apply(write_storage, (torch.from_numpy(frozen).untyped_storage(),))
            assert back.tolist() == [0, 5, 2, 3, 4, 5, 6, 7] and frozen[1] == 1
            if method == "fork":  # (a tensor subclass pickles its storage on its own)
                sub = torch.from_numpy(array).as_subclass(TensorSubclass)  # noqa: F821
                back = pool.apply(add_one_tensor, (sub,))
                assert type(back) is TensorSubclass and back.data_ptr() == array.ctypes.data
                assert sub.data_ptr() == array.ctypes.data and array[0] == 1
            # storages of torch's own memory still go torch's way
            plain = torch.zeros(4)
            assert pool.apply(write_storage, (plain.untyped_storage(),)).nbytes() == 16
            assert plain.is_shared()


def part_as_tensor(array):
    """In a worker: rows 10 to 19 of the array received, as a tensor of their own storage."""
    import torch

    return torch.from_numpy(array[10:20])


def part_through_dlpack(array):
    return np.from_dlpack(array[10:20])


def memfd_mappings():
    with open("/proc/self/maps") as maps:
        return sum("/memfd:" in line for line in maps)


@pytest.mark.parametrize("make", [lambda: pyshm.zeros((100, 3), np.float32, shared=True),
                                  lambda: pyshm.zeros((100, 3), np.float32),
                                  lambda: pyshm.zeros((1 << 16, 3), np.float32)],
                         ids=["slab", "small-shared-in-place", "big-shared-in-place"])
def test_a_part_of_our_memory_sent_back_from_its_own_storage_is_at_its_own_address(make):
    # a worker's tensor (or DLPack view) over part of an array it received has a storage of
    # that part only, found by address: its token names a range of our memory that we never
    # registered. It must still come back as our memory at its own address, not as a second
    # mapping of it fetched from the worker (there numpy cannot see the overlap: a[10:20] =
    # back[::-1] would read rows it has overwritten)
    torch_or_skip()
    with mp.get_context("spawn").Pool(1) as pool:
        for part in (part_as_tensor, part_through_dlpack):
            array = make()
            array[:] = np.arange(array.shape[0], dtype=np.float32)[:, None]
            pyshm.ref(array)  # (shared in place now, if not yet: its memfd is mapped)
            maps_before = memfd_mappings()
            for _ in range(3):
                back = pool.apply(part, (array,))
                back = back.numpy() if not isinstance(back, np.ndarray) else back
                assert back.ctypes.data == array[10:20].ctypes.data, part.__name__
                assert np.shares_memory(back, array)
            array[10:20] = back[::-1]
            assert array[10:20, 0].tolist() == list(range(19, 9, -1))
            del back
            assert memfd_mappings() <= maps_before  # (none of our memory mapped once more)


def test_torch_registered_when_imported_after_pyshm():
    engine_or_skip("torch")  # (its child imports torch)
    out = run_python("""
        import sys
        import pyshm
        assert "torch" not in sys.modules and not pyshm.engines.installed()
        import torch
        import numpy as np
        from multiprocessing.reduction import ForkingPickler
        print(sorted(pyshm.engines.installed()))
        array = pyshm.zeros(1 << 20, np.uint8, shared=True)
        data = ForkingPickler.dumps(torch.from_numpy(array))
        print(len(data) < 1000, torch.from_numpy(array).is_shared())
    """)
    engine_or_skip("torch")
    assert out.decode().split() == ["['torch']", "True", "False"]


# ---- joblib ---------------------------------------------------------------------------------


def add_one_array(array):
    array += 1
    return array


@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_joblib_workers_write_the_parents_arrays(backend):
    joblib = engine_or_skip("joblib")
    assert "joblib" in engines.installed()
    big = pyshm.zeros(1 << 20, np.float32, shared=True)  # 4 MiB: joblib would memmap it
    small = pyshm.zeros(100, np.int64, shared=True)  # joblib would pickle it by value
    plain = np.zeros(1 << 20, np.float32)  # not pyshm memory: joblib's own way
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with joblib.parallel_config(backend=backend, n_jobs=2):
            results = joblib.Parallel()(joblib.delayed(add_one_array)(a)
                                        for a in (big, small, big, small))
            copies = joblib.Parallel()(joblib.delayed(np.add)(plain, 1) for _ in range(2))
    assert (big == 2).all() and (small == 2).all()
    assert [r.ctypes.data for r in results] == [a.ctypes.data for a in (big, small, big, small)]
    assert (plain == 0).all() and all((c == 1).all() for c in copies)


def fill_tensor(tensor):
    # (through numpy: torch's own fill may run OpenMP, which hangs in a child forked after its
    # parent ran it, as the multiprocessing backend forks: a torch matter, pyshm or not)
    tensor.numpy()[...] = 7
    return tensor


@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_joblib_workers_write_the_parents_tensors_and_dlpack_views(backend):
    # (before: joblib's picklers knew numpy's arrays only, so a tensor over pyshm memory went
    # by torch's own pickling, and an array reaching pyshm memory through DLPack by joblib's
    # memmap: copies, the worker's write lost)
    joblib = engine_or_skip("joblib")
    torch = torch_or_skip()
    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    tensor = torch.from_numpy(array)[100:].view(-1, 4).t()  # (offset, non-contiguous)
    readonly = pyshm.share_readonly(pyshm.zeros(64, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with joblib.parallel_config(backend=backend, n_jobs=2):
            back, = joblib.Parallel()(joblib.delayed(fill_tensor)(t) for t in [tensor])
            assert (array[100:] == 7).all() and (array[:100] == 0).all()
            assert back.data_ptr() == tensor.data_ptr() and back.stride() == tensor.stride()
            dlpack = np.from_dlpack(array)
            back, = joblib.Parallel()(joblib.delayed(add_one_array)(a) for a in [dlpack])
            assert (array[100:] == 8).all() and back.ctypes.data == array.ctypes.data
            # a tensor over memory shared read-only: a copy (no read-only flag), as torch's
            frozen = torch.from_numpy(readonly)
            copy, = joblib.Parallel()(joblib.delayed(fill_tensor)(t) for t in [frozen])
            assert (copy == 7).all() and (readonly == 0).all()
            plain = torch.zeros(1000)  # torch's own memory: joblib's way, by value
            copy, = joblib.Parallel()(joblib.delayed(fill_tensor)(t) for t in [plain])
            assert (copy == 7).all() and (plain == 0).all()


def test_joblib_registered_when_imported_after_pyshm():
    engine_or_skip("joblib")
    out = run_python("""
        import sys
        import pyshm
        assert "joblib" not in sys.modules
        import joblib
        import numpy as np
        print(sorted(pyshm.engines.installed()))
        a = pyshm.zeros(1 << 20, np.float32, shared=True)
        a[:] = 1
        joblib.Parallel(n_jobs=2)(joblib.delayed(np.multiply)(a, 2, out=a) for _ in range(1))
        print(int(a.sum()))
    """)
    assert out.decode().split() == ["['joblib']", str(2 << 20)]


def test_joblib_executor_started_before_pyshm_returns_the_parents_arrays():
    # loky's workers keep the reducers of their results from their start: an executor made
    # before pyshm's import still sends pyshm arrays back as the parent's memory (before: as
    # copies, for the executor's whole life)
    engine_or_skip("joblib")
    out = run_python("""
        import numpy as np
        from joblib import Parallel, delayed
        Parallel(n_jobs=2)(delayed(abs)(i) for i in range(2))  # (the executor, started)
        import pyshm
        a = pyshm.zeros((4, 1 << 18), np.float32, shared=True)
        backs = Parallel(n_jobs=2)(delayed(np.add)(a[i], 1, out=a[i]) for i in range(4))
        print([b.ctypes.data == a[i].ctypes.data for i, b in enumerate(backs)], int(a.sum()))
    """)
    assert out.decode().split() == ["[True,", "True,", "True,", "True]", str(1 << 20)]


@pytest.mark.parametrize("before, after", [("import pyshm", "import torch"),
                                           ("", "import torch, pyshm"),
                                           ("import torch", "import pyshm")])
def test_joblib_executor_made_before_torchs_or_pyshms_import_sends_tensors_by_reference(
        before, after):
    # an executor keeps the reducers it was made with (loky's workers: those of their results,
    # from their start), and joblib reuses it: one made before torch's or pyshm's import now
    # sends tensors over pyshm memory as that memory both ways once both are imported (before:
    # by value for the executor's whole life, the workers' writes lost without a word; made
    # before pyshm's import: [False]*4 and 0 until this fix)
    engine_or_skip("joblib")
    torch_or_skip()
    out = run_python(f"""
        import numpy as np
        from joblib import Parallel, delayed
        {before}
        Parallel(n_jobs=2)(delayed(abs)(i) for i in range(2))  # (the executor, started)
        {after}
        import pyshm, torch
        a = pyshm.zeros((4, 1 << 16), np.float32, shared=True)
        t = torch.from_numpy(a)
        def fill(x):
            x.numpy()[...] = 3
            return x
        backs = Parallel(n_jobs=2)(delayed(fill)(t[i]) for i in range(4))
        print([b.data_ptr() == t[i].data_ptr() for i, b in enumerate(backs)], int(a.sum()))
    """)
    assert out.decode().split() == ["[True,", "True,", "True,", "True]", str(3 << 18)]


def test_joblib_tensor_made_in_a_worker_that_alone_imports_torch_is_the_parents_memory():
    # torch imported in a loky worker only (a task's import), after the executor's start: the
    # worker's result reducers get the tensor reducer then, so a tensor it makes over a pyshm
    # array it received comes back over the parent's memory (the parent imports torch then)
    engine_or_skip("joblib")
    torch_or_skip()
    out = run_python("""
        import sys
        import numpy as np
        import pyshm
        from joblib import Parallel, delayed
        def as_tensor(x):
            import torch
            t = torch.from_numpy(x)[2:].view(-1, 2)
            t.numpy()[...] = 7
            return t
        a = pyshm.zeros((2, 64), np.float32, shared=True)
        Parallel(n_jobs=2)(delayed(abs)(i) for i in range(2))  # (the executor, started)
        assert "torch" not in sys.modules
        backs = Parallel(n_jobs=2)(delayed(as_tensor)(a[i]) for i in range(2))
        print([b.data_ptr() == a[i, 2:].ctypes.data for i, b in enumerate(backs)], int(a.sum()))
    """)
    assert out.decode().split() == ["[True,", "True]", str(2 * 62 * 7)]


@pytest.mark.parametrize("setting, backend", [("LOKY_PICKLER=pickle", "loky"),
                                              ("JOBLIB_START_METHOD=spawn", "multiprocessing"),
                                              ("JOBLIB_START_METHOD=forkserver",
                                               "multiprocessing")])
def test_joblib_workers_that_get_their_reducers_by_plain_pickle_start(setting, backend):
    # loky with plain pickle for its pickler, and a pool of a spawn or forkserver context
    # (Python 3.14's default on Linux), pickle the reducers of results for each worker with
    # plain pickle: pyshm's, a function of its own, could not be, so every Parallel call
    # raised (before: AttributeError "Can't pickle local object ...reduce_array_memmap_
    # backward"); now they start, and pyshm arrays go by reference both ways
    engine_or_skip("joblib")
    name, _, value = setting.partition("=")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import numpy as np
        import pyshm
        from joblib import Parallel, delayed
        a = pyshm.zeros((2, 1 << 18), np.float32, shared=True)
        backs = Parallel(n_jobs=2, backend="{backend}")(
            delayed(np.add)(a[i], 3, out=a[i]) for i in range(2))
        print([b.ctypes.data == a[i].ctypes.data for i, b in enumerate(backs)], int(a.sum()))
    """)], capture_output=True, timeout=120, cwd=HERE, env={**os.environ, name: value})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["[True,", "True]", str(3 << 19)]


def test_joblib_reducers_made_while_another_thread_imports_torch_get_the_tensor_reducer(
        monkeypatch):
    # a pool or an executor made on one thread while torch's import completes on another: its
    # reducers, made when torch was not there yet, are registered after the import's update
    # took the reducers to update (forced here: torch is said absent to the maker only).
    # Before, they kept no tensor reducer for their life (tensors by value, writes lost)
    engine_or_skip("joblib")
    torch = torch_or_skip()
    from joblib import _memmapping_reducer

    assert engines._late_joblib_tensors_added  # (torch's import has updated the reducers)
    monkeypatch.setattr(engines, "_torch_ready", iter([False] + [True] * 9).__next__)
    forward, backward = _memmapping_reducer.get_memmapping_reducers()
    for reducers in (forward, backward):
        assert isinstance(reducers[torch.Tensor], engines._JoblibTensor)
        assert isinstance(reducers[torch.nn.Parameter], engines._JoblibTensor)


class Point:
    def __init__(self, x):
        self.x = x


def rebuild_point(x):
    point = Point(x)
    point.via = "the user's reducer"
    return point


def reduce_point(point):
    return rebuild_point, (point.x,)


def rebuild_marked_tensor(values, mark):
    import torch

    tensor = torch.from_numpy(values)
    tensor.via = mark
    return tensor


def reduce_marked_tensor(tensor, mark="the user's reducer"):
    return rebuild_marked_tensor, (tensor.detach().numpy().copy(), mark)


def reduce_tensor_for_copyreg(tensor):
    return reduce_marked_tensor(tensor, "copyreg")


def reduce_tensor_for_loky(tensor):
    return reduce_marked_tensor(tensor, "loky's registry")


def users_reducers_seen(point, shared, plain, parameter, array):
    import torch

    shared.numpy()[...] += 1
    array += 1
    return ([getattr(x, "via", None) for x in (point, plain, parameter)], shared, array,
            torch.zeros(2))


@pytest.mark.parametrize("backend", ["loky", "multiprocessing"])
def test_joblib_uses_the_users_own_reducers_beside_pyshms(backend):
    # reducers of the user's own, for this Parallel (forward_reducers, backward_reducers: in
    # Parallel's arguments or parallel_config's) or registered for every pickling (copyreg,
    # and loky's register for loky's pickler, above copyreg there), still pickle what is not
    # pyshm memory, and pyshm memory still goes by reference (before: a user's tensor reducer
    # for this Parallel sent pyshm tensors by value, the worker's write lost; one registered
    # with loky or copyreg was never called)
    joblib = engine_or_skip("joblib")
    torch = torch_or_skip()
    import copyreg

    from joblib.externals.loky.backend import reduction as loky_reduction

    array = pyshm.zeros(1 << 10, np.float32, shared=True)
    shared = torch.from_numpy(pyshm.zeros(1 << 10, np.float32, shared=True))[8:]
    plain, parameter = torch.zeros(3), torch.nn.Parameter(torch.zeros(3))
    call = [joblib.delayed(users_reducers_seen)(Point(1), shared, plain, parameter, array)]
    own = {"forward_reducers": {Point: reduce_point, torch.Tensor: reduce_marked_tensor},
           "backward_reducers": {torch.Tensor: reduce_marked_tensor}}
    copyreg.pickle(torch.nn.Parameter, reduce_tensor_for_copyreg)
    loky_reduction.register(torch.nn.Parameter, reduce_tensor_for_loky)
    try:
        if backend == "loky":
            results = joblib.Parallel(n_jobs=2, backend=backend, **own)(call)
        else:
            with joblib.parallel_config(backend=backend, n_jobs=2, **own):
                results = joblib.Parallel()(call)
    finally:
        loky_reduction._dispatch_table.pop(torch.nn.Parameter, None)
        copyreg.dispatch_table.pop(torch.nn.Parameter, None)
    (seen, back, back_array, result), = results
    assert seen == ["the user's reducer", "the user's reducer",
                    "loky's registry" if backend == "loky" else "copyreg"]
    assert getattr(result, "via", None) == "the user's reducer"  # (backward_reducers)
    assert back.data_ptr() == shared.data_ptr() and (shared == 1).all()
    assert back_array.ctypes.data == array.ctypes.data and (array == 1).all()


# ---- attacks on the hooks (a review's findings) ----------------------------------------------


def test_a_tensor_over_memory_shared_read_only_goes_by_value_from_its_owner():
    torch = torch_or_skip()
    from multiprocessing.reduction import ForkingPickler

    array = pyshm.share_readonly(pyshm.zeros(100_000, np.float32))
    assert array.flags.writeable  # (the owner keeps writing; receivers would get read-only)
    tensor = torch.from_numpy(array)
    back = pickle.loads(ForkingPickler.dumps(tensor))
    assert back.data_ptr() != array.ctypes.data and back.shape == tensor.shape
    tensor[1] = 5  # the owner's tensor still over its array (not moved into torch's memory)
    assert array[1] == 5 and tensor.data_ptr() == array.ctypes.data and back[1] == 0
    # only the elements a view spans go (a row of a big storage: the row), layout kept
    square = tensor[:99_856].view(316, 316)
    # (numpy's fill: a torch op this big runs OpenMP, after which a torch op in a child that
    # this process forks can hang, as a later test forks: a torch matter, pyshm or not)
    square.numpy()[...] = np.arange(99_856, dtype=np.float32).reshape(316, 316)
    for view in (square[7], square[3:9:2, 1::3], square.t()[2:5], square[5, 5], square[4:4],
                 square.expand(2, 316, 316)[:, 9]):
        payload = ForkingPickler.dumps(view)
        back = pickle.loads(payload)
        assert torch.equal(back, view) and back.stride() == view.stride()
        span = 1 + sum(st * (n - 1) for n, st in zip(view.shape, view.stride())) \
            if view.numel() else 0
        assert len(payload) < span * 4 + 2000  # (not the storage: 400 KB)


def test_the_memory_index_survives_a_collection_while_it_is_rebuilt():
    torch = torch_or_skip()
    from multiprocessing.reduction import ForkingPickler

    keep = [pyshm.zeros(64, np.float32, shared=True) for _ in range(5000)]
    target = pyshm.zeros(1 << 16, np.uint8, shared=True)

    class Cycle:
        pass

    for _ in range(20):  # pyshm arrays in garbage cycles: the collector drops their owners
        cycle = Cycle()
        cycle.self, cycle.array = cycle, pyshm.zeros(16, np.uint8)
        del cycle
        assert len(ForkingPickler.dumps(torch.from_numpy(target))) < 1000
    del keep


def test_a_tensor_inside_a_big_arena_tensor_with_many_smaller_ones_is_found():
    torch = torch_or_skip()
    from multiprocessing.reduction import ForkingPickler

    n = 100  # small tensors at offsets that overlap the big one's (disjoint lifetimes)
    arena = pyshm.Arena([1 << 16] + [64] * n, [0] + [2] * n, [1] + [3] * n,
                        shared=True).allocate()
    big = arena.array(0, dtype=np.uint8)
    smalls = [arena.array(i) for i in range(1, n + 1)]
    for start in (0, 8192, (1 << 16) - 64):
        tensor = torch.from_numpy(big[start:])
        back = pickle.loads(ForkingPickler.dumps(tensor))
        assert tensor.data_ptr() == big[start:].ctypes.data  # torch did not move it away
        assert back.data_ptr() == tensor.data_ptr()
    del smalls


def add_one_back(queue_in, queue_out):
    tensor = queue_in.get()
    view = tensor.numpy()  # (numpy's ops: torch's may hang in a forked child, see fill_tensor)
    view += 1
    queue_out.put(float(view.sum()))


def test_unshared_pyshm_memory_on_a_queue_feeder_thread_is_shared_under_the_fence():
    # torch's Queue pickles on its feeder thread: the tensor's pyshm memory is shared in place
    # there under libshm's write fence, and the child writes our pages
    torch = torch_or_skip()
    needs_fence()
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("fork")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=add_one_back, args=(to_child, to_parent))
    child.start()
    array = pyshm.zeros(1 << 16, np.float32)  # not shared yet
    array[:] = 2
    address = array.ctypes.data
    to_child.put(torch.from_numpy(array))
    assert to_parent.get(timeout=60) == 3 * (1 << 16)
    child.join(60)
    assert child.exitcode == 0
    assert pyshm.is_shared(array) and array.ctypes.data == address and (array == 3).all()


def test_unshared_pyshm_arrays_through_joblib_are_shared_under_the_fence():
    # joblib pickles on threads of its pools (loky's queue feeder, multiprocessing's task
    # handler): shared in place there under the fence, the workers write our pages
    joblib = engine_or_skip("joblib")
    needs_fence()
    for backend in ("loky", "multiprocessing"):
        arrays = [pyshm.zeros(10), pyshm.zeros(1 << 18)]  # joblib: by value; memmapped
        addresses = [a.ctypes.data for a in arrays]
        with joblib.parallel_config(backend=backend, n_jobs=2):
            back = joblib.Parallel()(joblib.delayed(add_one_array)(a) for a in arrays)
        assert all(pyshm.is_shared(a) and (a == 1).all() for a in arrays), backend
        assert [a.ctypes.data for a in arrays] == addresses
        assert [b.ctypes.data for b in back] == addresses


UNFENCED_ENGINES = """
    import json, multiprocessing as mp
    import numpy as np, pyshm

    def add_one_back(queue_in, queue_out):
        tensor = queue_in.get()
        tensor += 1
        queue_out.put(float(tensor.sum()))

    def first_plus_one(a):
        return float(a[0]) + 1

    out = {}
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        torch = None
    if torch is not None:
        ctx = tmp.get_context("fork")
        to_child, to_parent = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=add_one_back, args=(to_child, to_parent))
        child.start()
        a = pyshm.zeros(1 << 16, np.float32)
        a[:] = 2
        to_child.put(torch.from_numpy(a))
        out["torch"] = [to_parent.get(timeout=60), pyshm.is_shared(a), float(a.max())]
        child.join(60)
    try:
        import joblib
    except ImportError:
        joblib = None
    if joblib is not None:
        for backend in ("loky", "multiprocessing"):
            arrays = [pyshm.zeros(10), pyshm.zeros(1 << 18)]
            with joblib.parallel_config(backend=backend, n_jobs=2):
                sums = joblib.Parallel()(joblib.delayed(first_plus_one)(a) for a in arrays)
            out[backend] = [sums, [pyshm.is_shared(a) for a in arrays]]
    print(json.dumps(out))
"""


def test_without_the_fence_unshared_pyshm_memory_goes_the_engines_way():
    # LSHM_FENCE=0: no fence, so no share on an engine's own thread; torch and joblib copy it
    # their way, as without pyshm (no error, no hang)
    if importlib.util.find_spec("torch") is None and importlib.util.find_spec("joblib") is None:
        pytest.skip("neither torch nor joblib is installed")
    out, _ = run_without_the_fence(UNFENCED_ENGINES, timeout=300)
    if "torch" in out:
        assert out["torch"] == [3.0 * (1 << 16), False, 2.0]  # the child added 1 to a copy
    for backend in ("loky", "multiprocessing"):
        if backend in out:
            assert out[backend] == [[1.0, 1.0], [False, False]]


def test_plain_torch_tensors_never_look_for_pyshm_memory():
    torch = torch_or_skip()
    from multiprocessing.reduction import ForkingPickler

    from pyshm import _memory

    ForkingPickler.dumps(torch.from_numpy(pyshm.zeros(10, shared=True)))  # (the index is used)
    fresh = pyshm.zeros(10, shared=True)  # (the index would add it at its next use)
    assert _memory.tracking and _memory.NEW_OWNERS
    ForkingPickler.dumps(torch.zeros(1000))
    assert _memory.NEW_OWNERS  # not looked at
    del fresh


def test_copies_of_a_ref_and_refs_of_other_memory():
    import copy

    array = pyshm.zeros(100, shared=True)
    handle = pyshm.ref(array)
    assert copy.copy(handle).array is array
    deep = copy.deepcopy(handle)
    assert deep.array.ctypes.data != array.ctypes.data and pyshm.is_shared(deep.array)
    with pytest.raises(TypeError):
        pyshm.Ref(np.zeros(3))  # the constructor checks as pyshm.ref does


def test_the_import_hook_keeps_the_loaders_and_survives_a_reload():
    engine_or_skip("torch")
    out = run_python("""
        import importlib, importlib.resources, pkgutil, sys
        import pyshm
        importlib.reload(pyshm.engines)
        importlib.reload(pyshm)
        import torch.multiprocessing
        print(sorted(pyshm.engines.installed()))
        names = [p.name for p in importlib.resources.files(torch.multiprocessing).iterdir()]
        print("__init__.py" in names, pkgutil.get_data("torch.multiprocessing",
                                                        "__init__.py") is not None)
        print(sum(type(f).__name__ == "_Finder" for f in sys.meta_path))
    """)
    assert out.decode().split() == ["['torch']", "True", "True", "1"]


def test_tensors_over_memory_made_between_sends_and_past_the_new_owners_bound():
    torch = torch_or_skip()
    from multiprocessing.reduction import ForkingPickler

    from pyshm import _memory

    def by_reference(array):
        back = pickle.loads(ForkingPickler.dumps(torch.from_numpy(array)))
        return back.data_ptr() == array.ctypes.data

    assert by_reference(pyshm.zeros(100, shared=True))
    for _ in range(50):  # each new, and older ones dying in between
        assert by_reference(pyshm.zeros(100, shared=True))
    many = [pyshm.zeros(8, np.uint8, shared=True) for _ in range(_memory.NEW_OWNERS_MAX + 10)]
    assert not _memory.tracking  # (too many to collect: the index rebuilds at its next use)
    assert by_reference(many[-1]) and by_reference(many[len(many) // 2])
    assert _memory.tracking


# ---- dask.distributed -----------------------------------------------------------------------


def fill_array(array, value):
    array[:] = value
    return array


def test_dask_scatter_submit_and_results_are_the_same_memory():
    distributed = engine_or_skip("distributed")
    assert "distributed" in engines.installed()
    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    plain = np.zeros(1 << 18, np.float32)
    # (direct transfers, both ways: what passes through the scheduler goes by value, as the
    # scheduler may pass it on anywhere; see the network-namespace test below)
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster, direct_to_workers=True) as client:
        # (hash=False: dask names scattered data by a hash of its bytes by default, and two
        # arrays of equal bytes would be one)
        future, plain_future = client.scatter([array, plain], hash=False)
        back = client.submit(fill_array, future, 2.0).result()
        assert (array == 2).all()  # the worker's write, in our memory
        assert back.ctypes.data == array.ctypes.data  # the result is our own array
        copied = client.submit(fill_array, plain_future, 3.0).result()
        assert (plain == 0).all() and (copied == 3).all()  # other arrays: dask's own way


def fill_and_keep(array, value):
    array[:] = value
    return array


def test_dask_results_and_transfers_between_workers_over_websockets_are_the_same_memory():
    # Over ws://, the accepting side of a connection (a worker answering a client's request
    # for a result, or another worker's for its data) knew its peer only as "<ip>:0" (no
    # scheme; the client's IP, port 0) and sent the bytes; the connecting side's own address
    # was the server's. Both ends are now read from the connection's socket at its handshake
    distributed = engine_or_skip("distributed")
    from distributed.comm import registry

    try:
        registry.get_backend("ws")
    except ValueError:
        pytest.skip("distributed has no websocket comm here")
    array = pyshm.zeros(1 << 12, np.float64, shared=True)
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  protocol="ws://", dashboard_address=None) as cluster, \
            distributed.Client(cluster, direct_to_workers=True) as client:
        first, second = sorted(client.scheduler_info()["workers"])
        assert first.startswith("ws://")
        future = client.scatter(array, workers=[first], direct=True, hash=False)
        # (the second worker fetches it from the first, writes it, and returns it)
        back = client.submit(fill_and_keep, future, 2.0, workers=[second],
                             allow_other_workers=False, pure=False).result()
        assert (array == 2).all()  # (before: each hop a copy; our array stayed 0)
        assert back.ctypes.data == array.ctypes.data


def fill_tensor_with(tensor, value):
    tensor.detach().numpy()[...] = value  # (numpy's write: see fill_tensor)
    return tensor


def tensor_total(tensor):
    return float(tensor.abs().sum()) if tensor.is_complex() else float(tensor.float().sum())


def fill_tensors(tensors, value):
    return [fill_tensor_with(t, value) for t in tensors]


def test_dask_tensors_over_pyshm_memory_are_the_same_memory(caplog):
    # (before: distributed's tensor serializer sent the tensor's numpy view without the
    # message's context, by value; submit's arguments looked for numpy arrays only)
    distributed = engine_or_skip("distributed")
    torch = torch_or_skip()
    array = pyshm.zeros(1 << 16, np.float32, shared=True)
    unshared = pyshm.zeros(1 << 12, np.float32)
    readonly = pyshm.share_readonly(pyshm.zeros(64, np.float32))
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster, direct_to_workers=True) as client, \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = torch.from_numpy(array)[8:].view(-1, 8).t()  # (offset, non-contiguous)
        back = client.submit(fill_tensor_with, tensor, 1.0, pure=False).result()
        assert (array[8:] == 1).all() and (array[:8] == 0).all()
        assert back.data_ptr() == tensor.data_ptr() and back.stride() == tensor.stride()
        future = client.scatter(tensor, direct=True, hash=False)
        back = client.submit(fill_tensor_with, future, 2.0, pure=False).result()
        assert (array[8:] == 2).all() and back.data_ptr() == tensor.data_ptr()
        # map, lists, a leaf that requires grad, a Parameter, memory not shared yet
        halves = [torch.from_numpy(array[:100]), torch.from_numpy(array[100:200])]
        assert client.map(fill_tensor_with, halves, [3.0, 4.0], pure=False)[1].result() \
            .data_ptr() == halves[1].data_ptr()
        leaf = torch.from_numpy(array[200:300]).requires_grad_(True)
        parameter = torch.nn.Parameter(torch.from_numpy(unshared))
        backs = client.submit(fill_tensors, [leaf, parameter], 5.0, pure=False).result()
        assert (array[200:300] == 5).all() and (unshared == 5).all() and pyshm.is_shared(unshared)
        assert backs[0].requires_grad and type(backs[1]) is torch.nn.Parameter
        assert backs[1].data_ptr() == parameter.data_ptr()
        assert client.gather(client.map(fill_tensor_with, halves, [6.0, 6.0], pure=False)) \
            and (array[:100] == 6).all() and (array[100:200] == 6).all()
        # a view of slab memory: it goes as its numpy view and comes back as a storage of that
        # part (before: fetched from the worker, a second mapping at another address)
        small = pyshm.zeros(64, np.float32, shared=True)
        part = torch.from_numpy(small)[8:16]
        back = client.submit(fill_tensor_with, part, 7.0, pure=False).result()
        assert back.data_ptr() == part.data_ptr() and (small[8:16] == 7).all()
        # read-only memory (no read-only flag) and torch's own memory: by value, as before
        for copied in (torch.from_numpy(readonly), torch.zeros(64)):
            back = client.submit(fill_tensor_with, copied, 9.0, pure=False).result()
            assert (back == 9).all() and (copied == 0).all()
        # tensors distributed cannot send as their numpy view (lazy conjugation, a dtype numpy
        # lacks): dask's way, by value, with nothing logged (before: two "Failed to Serialize"
        # errors each, from pyshm's serializer)
        import logging

        complex_array = pyshm.zeros(16, np.complex64, shared=True)
        caplog.set_level(logging.ERROR)
        for odd in (torch.from_numpy(complex_array).conj(),
                    torch.from_numpy(array[:64]).view(torch.bfloat16)):
            assert client.submit(tensor_total, odd, pure=False).result() == tensor_total(odd)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_dask_a_scattered_tensor_is_reduced_once(monkeypatch):
    # a tensor over pyshm memory scattered (or a task's result) is reduced once, for its
    # message; before, once more to tell whether its memory is read-only for receivers, and a
    # Parameter twice more (its tensor went through the same check): 2 and 3 reductions
    distributed = engine_or_skip("distributed")
    torch = torch_or_skip()
    array = pyshm.zeros(1 << 12, np.float32, shared=True)
    tensor = torch.from_numpy(array)[8:].view(-1, 8)[:, 2:5]
    parameter = torch.nn.Parameter(torch.from_numpy(array)[:64], requires_grad=False)
    frozen = torch.from_numpy(pyshm.share_readonly(pyshm.zeros(64, np.float32)))
    reduced = []
    reduce_ndarray = reduction.reduce_ndarray
    monkeypatch.setattr(reduction, "reduce_ndarray",
                        lambda a: reduced.append(a) or reduce_ndarray(a))
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster, direct_to_workers=True) as client:
        counts = []
        for sent in (tensor, parameter, frozen):
            reduced.clear()
            future = client.scatter(sent, direct=True, hash=False)
            counts.append(len(reduced))
            back = client.submit(fill_tensor_with, future, 5.0, pure=False).result()
            assert (back.data_ptr() == sent.data_ptr()) is (sent is not frozen)
    assert counts == [1, 1, 1]
    assert (array[:64] == 5).all() and (frozen == 0).all()  # (read-only: a copy was written)


def fill_and_say(array, value):
    array[:] = value
    return float(array.sum()), pyshm.is_shared(array)


def fill_at(i, array):
    array[i] = i + 1
    return pyshm.is_shared(array)


Pair = collections.namedtuple("Pair", "array value")


def fill_nested(arrays, pair):
    first, second = arrays[0], arrays[1]["b"][0]
    assert isinstance(pair, Pair)
    for i, array in enumerate((first, second, pair.array)):
        array[:] = pair.value + i
    return [pyshm.is_shared(a) for a in (first, second, pair.array)]


def test_dask_task_arguments_that_are_pyshm_arrays_or_refs_are_the_same_memory():
    """A pyshm array or a pyshm.ref of one among submit's or map's arguments (where dask
    looks: positional, keyword, map's lists, nested lists/tuples/dicts) is scattered straight
    to a worker here first (by reference), and the task gets its future: the worker writes
    our memory. One not shared yet is shared in place by submit. Other arrays, and pyshm
    arrays hidden in a closure, go dask's own way (by value)."""
    distributed = engine_or_skip("distributed")
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client, warnings.catch_warnings():
        for given in (pyshm.ref, lambda a: a):
            warnings.simplefilter("error")  # (by value, dask warns of "a large graph" here)
            big = pyshm.zeros(16 << 20, np.float32, shared=True)  # 64 MiB
            address = big.ctypes.data
            assert client.submit(fill_and_say, given(big), 2.0).result() == (2.0 * big.size,
                                                                              True)
            assert (big == 2).all() and big.ctypes.data == address  # the worker's write, here
            assert client.submit(fill_and_say, array=given(big[::2]), value=3.0).result()[1]
            assert big[0] == 3 and big[1] == 2  # (keyword arguments, views)
            # twice with the default pure=True: each submit a task of its own (the arrays'
            # bytes are not hashed: the memory may change between the two)
            assert client.submit(fill_at, 0, given(big)).result() and big[0] == 1
            big[0] = 5
            assert client.submit(fill_at, 0, given(big)).result() and big[0] == 1
            fresh = pyshm.zeros(1 << 20, np.float32)  # (not shared yet: shared in place)
            fresh_address = fresh.ctypes.data
            assert client.submit(fill_and_say, given(fresh), 4.0).result() == (
                4.0 * fresh.size, True)
            assert pyshm.is_shared(fresh) and fresh.ctypes.data == fresh_address
            assert (fresh == 4).all()
            small = [pyshm.zeros(1000, np.float32, shared=True) for _ in range(3)]  # (a slab)
            args = [given(a) for a in small]
            # (pure=False: equal bytes would otherwise make the three one task)
            results = client.gather(client.map(fill_and_say, args + [args[0]],
                                               [1.0, 2.0, 3.0, 1.0], pure=False))
            assert results == [(1000.0, True), (2000.0, True), (3000.0, True), (1000.0, True)]
            assert [float(a[0]) for a in small] == [1.0, 2.0, 3.0]
            trio = [pyshm.zeros(1000, np.float32, shared=True) for _ in range(3)]
            nested = client.submit(fill_nested, [given(trio[0]), {"b": (given(trio[1]),)}],
                                   Pair(given(trio[2]), 4.0), pure=False).result()
            assert nested == [True, True, True]
            assert [float(a[0]) for a in trio] == [4.0, 5.0, 6.0]
            # an argument passed to every task of a map (a keyword argument)
            results = client.gather(client.map(fill_at, [0, 1, 2], array=given(big),
                                               pure=False))
            assert results == [True] * 3 and list(big[:3]) == [1.0, 2.0, 3.0]
        # map over an array: its rows are map's elements, as without pyshm (by value)
        rows = pyshm.zeros((2, 4), np.float32, shared=True)
        assert client.gather(client.map(fill_at, [0, 1], rows, pure=False)) == [False, False]
        assert (rows == 0).all()
        # everything else: dask's own way (a copy, written there)
        warnings.simplefilter("ignore")
        plain = np.zeros(1000, np.float32)
        assert client.submit(fill_and_say, plain, 6.0, pure=False).result() == (6000.0, False)
        assert (plain == 0).all()
        captured = small[1]
        assert client.submit(lambda: fill_and_say(captured, 7.0)).result() == (7000.0, False)
        assert captured[0] == 2


class StandInClient:
    """What pyshm asks of a dask client (engines._scatter_arguments), without a cluster:
    ``workers`` its workers' addresses, ``fail`` whether a scatter raises."""

    asynchronous = False

    def __init__(self, workers, fail=False):
        self.workers, self.fail = workers, fail

    def sync(self, func, *args, **kwargs):
        return func(*args, **kwargs)

    @property
    def scheduler(self):
        return self

    def identity(self, n_workers=0):
        return {"workers": {w: {} for w in self.workers}}

    def scatter(self, values, **options):
        if self.fail:
            raise OSError("the worker is gone")
        return [f"future of {id(v)}" for v in values]


def test_dask_ref_arguments_that_cannot_be_scattered_go_as_their_arrays():
    """No worker of ours here, an asynchronous client or a failed scatter: the ref's array
    goes into the task (by value), never the ref (the scheduler would map and keep it)."""
    engine_or_skip("distributed")
    array = pyshm.zeros(1000, np.float32, shared=True)

    Client = StandInClient
    asynchronous = Client([])
    asynchronous.asynchronous = True
    for client in (Client([]), Client(["tcp://203.0.113.7:1"]), asynchronous):
        out = engines._scatter_arguments(client, [1, pyshm.ref(array), array])
        assert out[0] == 1 and out[1] is array and out[2] is array
    import socket

    ours = socket.socket()  # (a worker of ours, here)
    ours.bind(("127.0.0.1", 0))
    ours.listen()
    try:
        here = [f"tcp://127.0.0.1:{ours.getsockname()[1]}"]
        out = engines._scatter_arguments(Client(here), [pyshm.ref(array), pyshm.ref(array)])
        assert out == [f"future of {id(array)}"] * 2  # (scattered once)
        out = engines._scatter_arguments(Client(here, fail=True), [pyshm.ref(array)])
        assert out[0] is array
        # inside containers, at any depth, rebuilt as dask hands them to a task
        other = pyshm.zeros(10, np.float32, shared=True)
        given = [[1, pyshm.ref(array)], {"k": (pyshm.ref(other), [[pyshm.ref(array)]])},
                 Pair(pyshm.ref(array), 2), collections.OrderedDict(x=[pyshm.ref(other)])]
        for client, of in ((Client(here), lambda a: f"future of {id(a)}"),
                           (Client([]), lambda a: a)):
            out = engines._scatter_arguments(client, given)
            got = [out[0][1], out[1]["k"][0], out[1]["k"][1][0][0], out[2].array, out[3]["x"][0]]
            for value, source in zip(got, (array, other, array, array, other)):
                assert value is source if client.workers == [] else value == of(source)
            assert type(out[0]) is list and out[0][0] == 1 and type(out[1]["k"]) is tuple
            assert type(out[2]) is Pair and out[2].value == 2 and type(out[3]) is dict
            assert isinstance(given[0][1], pyshm.reduction.Ref)  # (the caller's, unchanged)
        out = engines._scatter_arguments(Client(here), [{1, pyshm.ref(array)}])
        assert out == [{1, f"future of {id(array)}"}]
        with pytest.raises(TypeError, match="inside a set"):  # (an array is not hashable)
            engines._scatter_arguments(Client([]), [{1, pyshm.ref(array)}])
        untouched = [[1, [2, {"a": (3,)}]], {4}, Pair(array, 5)]
        out = engines._scatter_arguments(Client(here), untouched)
        assert all(o is u for o, u in zip(out, untouched))  # (no ref: the very same objects)
        # one list in 2**60 places and a list inside itself: each walked once, in no time
        deep, cyclic = [0], [1]
        for _ in range(60):
            deep = [deep, deep]
        cyclic.append(cyclic)
        out = engines._scatter_arguments(Client(here), [deep, cyclic])
        assert out[0] is deep and out[1] is cyclic
        assert engines._hidden_call((len, (deep, cyclic), {}), [deep, cyclic]) is None
        shared = [pyshm.ref(array)]
        for _ in range(60):
            shared = [shared, shared]
        (out,) = engines._scatter_arguments(Client(here), [shared])
        for _ in range(60):
            assert type(out) is list and out[0] is out[1]  # (rebuilt once, shared as given)
            out = out[0]
        assert out == [f"future of {id(array)}"]
    finally:
        ours.close()


def test_dask_pyshm_array_arguments_go_as_refs_or_by_value():
    """submit and map hand each pyshm array where dask looks to the scatter refs get: its
    future with a worker here, the array itself (by value) with none; arrays that are not
    pyshm memory, or cannot be shared in place, are passed on as they are."""
    engine_or_skip("distributed")
    import socket

    given = []

    def submit(self, func, *args, key=None, pure=True, **kwargs):
        given.append((args, kwargs))

    def map(self, func, *iterables, key=None, pure=True, **kwargs):
        given.append((iterables, kwargs))

    submit_, map_ = engines._wrap_task_maker(submit), engines._wrap_task_maker(map)
    array = pyshm.zeros(1000, np.float32, shared=True)
    fresh, plain = pyshm.zeros(1000, np.float32), np.zeros(1000, np.float32)
    ours = socket.socket()  # (a worker of ours, here)
    ours.bind(("127.0.0.1", 0))
    ours.listen()
    try:
        here = StandInClient([f"tcp://127.0.0.1:{ours.getsockname()[1]}"])
        submit_(here, len, array, [fresh, {"k": plain}], value=array, pure=False)
        (args, kwargs), = given
        assert args[0] == f"future of {id(array)}" and kwargs["value"] == args[0]
        assert args[1][0] == f"future of {id(fresh)}" and pyshm.is_shared(fresh)
        assert args[1][1]["k"] is plain and set(kwargs) == {"value"}
        given.clear()
        rows = pyshm.zeros((2, 3), np.float32, shared=True)
        map_(here, len, [array, plain], rows, (fresh,), range(2), array=array)
        (iterables, kwargs), = given
        assert iterables[0] == [f"future of {id(array)}", plain] and iterables[1] is rows
        assert iterables[2] == [f"future of {id(fresh)}"] and kwargs["array"] == iterables[0][0]
        assert isinstance(iterables[3], range)
        given.clear()
        # an empty pyshm array and an ndarray subclass over pyshm memory: as they are
        empty, sub = pyshm.zeros(0, np.float32, shared=True), array.view(np.recarray)
        submit_(here, len, array, empty, [sub])
        (args, _), = given
        assert args[0] == f"future of {id(array)}" and args[1] is empty and args[2][0] is sub
        given.clear()
        with pyshm.Arena([800, 80], [0, 0], [1, 1]) as arena:  # (private: no in-place share)
            arena.allocate()
            slot = arena.array(0, (200,), np.float32)
            submit_(here, len, slot)
            assert given[0][0][0] is slot and not pyshm.is_shared(slot)
            given.clear()
            del slot
        # no pyshm array: the scheduler is not asked for its workers (a round trip per submit)
        asked = []
        counting = StandInClient(here.workers)
        counting.identity = lambda n_workers=0: asked.append(1) or {"workers": {}}
        submit_(counting, len, [1, [2.0, {"k": plain}]], plain, value=(plain,))
        map_(counting, len, [plain, 3], value=[plain])
        assert asked == [] and len(given) == 2
        given.clear()
        # a pyshm array and a ref hidden in an object: the scheduler asked once for both
        counting.identity = lambda n_workers=0: asked.append(1) or {
            "workers": {w: {} for w in here.workers}}
        submit_(counting, fill_holder, array, Holder(pyshm.ref(array), 1.0))
        (args, _), = given  # (the pickled call, its buffers, then its holes' values)
        assert asked == [1] and list(args[2:]) == [f"future of {id(array)}"] * 2
        given.clear()
        # no worker here (none, or in this very process): by value, nothing shared in place,
        # every container as it was given
        for workers in ([], ["inproc://10.0.0.1/1/2"]):
            unshared = pyshm.zeros(1000, np.float32)
            counts = collections.defaultdict(int, a=unshared)
            submit_(StandInClient(workers), len, array, [array], unshared, counts=counts)
            (args, kwargs), = given
            assert args[0] is array and args[1][0] is array and args[2] is unshared
            assert kwargs["counts"] is counts and not pyshm.is_shared(unshared)
            given.clear()
    finally:
        ours.close()


def test_dask_a_tensor_argument_is_reduced_once_before_its_scatter(monkeypatch):
    # submit looks at each tensor among its arguments once (_pyshm_value: by reference or
    # not, which reduces its bytes), wherever it is among them; before, twice for each place
    # (once to decide to ask the scheduler for its workers, once to make its ref): here 4
    # times, about 20 us each on a 2-CPU VM
    engine_or_skip("distributed")
    torch = torch_or_skip()
    import socket

    given, looked = [], []

    def submit(self, func, *args, key=None, pure=True, **kwargs):
        given.append(args)

    reduce_tensor = engines._tensor_reduction
    monkeypatch.setattr(engines, "_tensor_reduction",
                        lambda t, *more: looked.append(t) or reduce_tensor(t, *more))
    tensor = torch.from_numpy(pyshm.zeros(1000, np.float32, shared=True))[8:].view(-1, 8)
    ours = socket.socket()  # (a worker of ours, here)
    ours.bind(("127.0.0.1", 0))
    ours.listen()
    try:
        here = StandInClient([f"tcp://127.0.0.1:{ours.getsockname()[1]}"])
        engines._wrap_task_maker(submit)(here, len, tensor, [tensor], pure=False)
    finally:
        ours.close()
    assert given == [(f"future of {id(tensor)}", [f"future of {id(tensor)}"])]
    assert len(looked) == 1 and looked[0] is tensor


class Holder:
    """A user's own object: dask does not look into it for futures."""

    def __init__(self, array, value) -> None:
        self.array, self.value = array, value


def fill_holder(holder):
    holder.array[:] = holder.value
    return pyshm.is_shared(holder.array)


def fill_with(value, array):
    array[:] = value
    return pyshm.is_shared(array)


async def fill_holder_later(holder):
    return fill_holder(holder)


def test_dask_refs_hidden_in_objects_are_the_same_memory_in_submit():
    """A ref inside a user's object, a functools.partial or a closure, where dask does not
    look: submit scatters it all the same and the worker puts the array in its place (the
    task, through the scheduler, carries no reference); map sends such a ref's array by
    value (a copy)."""
    distributed = engine_or_skip("distributed")
    import functools

    array = pyshm.zeros(1 << 16, np.float32, shared=True)
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client, warnings.catch_warnings():
        warnings.simplefilter("error")
        future = client.submit(fill_holder, Holder(pyshm.ref(array), 2.0))
        assert future.result() is True and (array == 2).all()
        assert future.key.startswith("fill_holder-")  # (the user's function names the task)
        assert client.submit(functools.partial(fill_with, 3.0, pyshm.ref(array))).result()
        assert (array == 3).all()
        captured = pyshm.ref(array[::2])
        assert client.submit(lambda: fill_with(4.0, captured)).result()
        assert array[0] == 4 and array[1] == 3
        # a hidden ref beside a visible one, a plain array and keyword arguments
        plain = np.zeros(8, np.float32)
        other = pyshm.zeros(8, np.float32, shared=True)
        both = client.submit(lambda h, p, a=None: [fill_holder(h), fill_with(6.0, p),
                                                   fill_with(7.0, a)],
                             Holder(pyshm.ref(other), 5.0), plain, a=pyshm.ref(array),
                             pure=False).result()
        assert both == [True, False, True]
        assert (other == 5).all() and (plain == 0).all() and (array == 7).all()
        # the scheduler holds the call with placeholders, never a reference
        import cloudpickle

        task = cluster.scheduler.tasks[future.key].run_spec
        assert b"rebuild_ndarray" not in cloudpickle.dumps(task)
        # futures where dask looks still give their values; async functions are awaited
        given = client.submit(lambda: 41, pure=False)
        assert client.submit(lambda x, h: (x, fill_holder(h)), given,
                             Holder(pyshm.ref(array), 7.5), pure=False).result() == (41, True)
        assert (array == 7.5).all()
        # (and where dask does not look, a future stays a future, as without pyshm)
        assert client.submit(lambda x, h, inside=Holder(given, 0): (
            x, type(inside.array).__name__, fill_holder(h)), given,
            Holder(pyshm.ref(array), 7.25), pure=False).result() == (41, "Future", True)
        # many threads at once: each finds the worker (the client's refreshes race them)
        from concurrent.futures import ThreadPoolExecutor

        arrays = [pyshm.zeros(16, np.float32, shared=True) for _ in range(32)]

        def one(i):
            return client.submit(fill_holder, Holder(pyshm.ref(arrays[i]), i + 1.0),
                                 pure=False).result()

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(32))) == [True] * 32
        assert [float(a[0]) for a in arrays] == [i + 1.0 for i in range(32)]
        assert client.submit(fill_holder_later, Holder(pyshm.ref(array), 7.0),
                             pure=False).result() is True
        assert (array == 7).all()
        # map: by value
        assert client.gather(client.map(fill_holder, [Holder(pyshm.ref(array), 8.0)])) == [
            False]
        assert (array == 7).all()
        assert client.gather(client.map(functools.partial(fill_with, array=pyshm.ref(array)),
                                        [9.0], pure=False)) == [False]
        assert (array == 7).all()


def test_dask_hidden_refs_that_cannot_be_scattered_go_as_their_arrays():
    engine_or_skip("distributed")
    array = pyshm.zeros(1000, np.float32, shared=True)
    calls = []

    def submit(client, func, *args, **kwargs):
        calls.append((func, args, kwargs))

    holder, listed = Holder(pyshm.ref(array), 1.0), [pyshm.ref(array)]
    call = (fill_holder, (holder, listed), {"v": pyshm.ref(array)})
    pickled = engines._hidden_call(call, [holder, listed, call[2]["v"]])
    assert pickled is not None and len(pickled.refs) == 3
    assert b"pyshm.reduction" not in pickled.data  # (placeholders, never a reference)
    elsewhere = StandInClient(["tcp://203.0.113.7:1"])  # (no worker of ours here)
    engines._submit_hidden(elsewhere, submit, pickled, fill_holder, {"pure": False})
    (func, args, kwargs), = calls
    assert func is fill_holder and kwargs["pure"] is False and kwargs["v"] is array
    assert args[0] is not holder and args[0].array is array and args[1][0] is array
    assert isinstance(holder.array, pyshm.reduction.Ref)  # (the caller's object, unchanged)
    # what a worker runs needs no pyshm there (pickled by value)
    import cloudpickle

    plain = engines._Call((divmod, (7, pyshm.ref(array)), {}))  # (the ref: a hole)
    assert len(plain.holes) == 1 and b"rebuild_ndarray" not in plain.data
    out = run_python("""
        import sys
        sys.modules["pyshm"] = None  # (pyshm not importable here)
        import cloudpickle
        loader, data, buffers, value = cloudpickle.loads(sys.stdin.buffer.read())
        print(loader(data, buffers, value))
    """, cloudpickle.dumps((engines._LOADERS[0], plain.data, plain.buffers, 2)))
    assert out.strip() == b"(3, 1)"
    # nothing hidden: dask's own way (containers are looked into already)
    visible = [1.0, [pyshm.ref(array)], {"k": pyshm.ref(array)}]
    assert engines._hidden_call((fill_with, tuple(visible), {}), visible) is None
    assert engines._hidden_call((fill_with, (lambda: None,), {}), []) is None


def sum_and_say_if_shared(array):
    return float(array.sum()), pyshm.is_shared(array)


SCATTER_AND_EXIT = """
    import os, sys
    import numpy as np
    import distributed, pyshm
    client = distributed.Client(sys.argv[1], direct_to_workers=True)
    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    array[:] = 5
    client.publish_dataset(left=client.scatter(array, hash=False))
    os._exit(0)  # at once: no goodbye to the scheduler, the channel's server gone with us
"""


def checksum_to(array, path):
    time.sleep(0.5)  # (the client is gone by now)
    with open(path + ".part", "w") as out:
        out.write(f"{float(array.sum())} {pyshm.is_shared(array)}")
    os.rename(path + ".part", path)


SUBMIT_AND_EXIT = """
    import sys
    import numpy as np
    import distributed, pyshm
    from test_engines import Holder, checksum_of_holder_to, checksum_to
    client = distributed.Client(sys.argv[1])
    array = pyshm.zeros(1 << 20, np.float32, shared=True)
    array[:] = 5
    distributed.fire_and_forget(client.submit(checksum_to, pyshm.ref(array), sys.argv[2],
                                              pure=False))
    # a ref hidden in an object: the task's call, pickled with a hole, goes through a loader
    distributed.fire_and_forget(client.submit(checksum_of_holder_to, Holder(
        pyshm.ref(array), 0.0), sys.argv[3], pure=False))
    # the array itself as the argument
    distributed.fire_and_forget(client.submit(checksum_to, array, sys.argv[4], pure=False))
    # and the script ends at once: the worker mapped the memory when it was scattered to it
"""


def checksum_of_holder_to(holder, path):
    checksum_to(holder.array, path)


def test_dask_data_scattered_by_a_client_that_exits_at_once_stays_readable(tmp_path):
    distributed = engine_or_skip("distributed")
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(SCATTER_AND_EXIT),
                               cluster.scheduler_address], capture_output=True, timeout=120,
                              cwd=HERE)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        # a task argument of a client that ends right after fire_and_forget(submit(...))
        path, hidden = str(tmp_path / "checksum"), str(tmp_path / "checksum-hidden")
        itself = str(tmp_path / "checksum-array")
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SUBMIT_AND_EXIT), cluster.scheduler_address,
             path, hidden, itself], capture_output=True, timeout=120, cwd=HERE,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                HERE, os.environ.get("PYTHONPATH", "")]))))
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        deadline = time.monotonic() + 60
        for written in (path, hidden, itself):
            while not os.path.exists(written) and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(written) as result:
                assert result.read() == f"{5.0 * (1 << 20)} True"
        left = client.get_dataset("left")
        # the worker mapped the memory when the data arrived (by reference: pyshm memory),
        # so it outlives its sender
        total, shared = client.submit(sum_and_say_if_shared, left, pure=False).result()
        assert shared and total == 5.0 * (1 << 18)


def socket_as(uid: int, connect_to: int = 0, bind_to: int = 0):
    """(port, child pid) of a TCP socket on 127.0.0.1 in a forked child that became `uid`: a
    process of another user on this machine (the child waits to be killed). A listener (on
    port `bind_to` if given); or, given `connect_to`, the local port of its connection to
    127.0.0.1:`connect_to`."""
    import socket

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if connect_to:
                sock = socket.create_connection(("127.0.0.1", connect_to))
            else:
                sock = socket.socket()
                sock.bind(("127.0.0.1", bind_to))
                sock.listen()
            os.write(write_end, str(sock.getsockname()[1]).encode())
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(write_end)
    port = int(os.read(read_end, 16) or b"0")
    os.close(read_end)
    return port, pid


def test_dask_sends_by_value_where_the_recipient_is_not_on_this_machine():
    engine_or_skip("distributed")
    import socket

    array = pyshm.zeros(1 << 18, np.uint8, shared=True)
    array[::7] = 5
    ours = socket.socket()  # (a process of ours listens there: ourselves)
    ours.bind(("127.0.0.1", 0))
    ours.listen()
    # (the peer info a comm gives: its handshake, with the protocol it asked for and whether
    # it loads references, and its address)
    peer = f"tcp://127.0.0.1:{ours.getsockname()[1]}"
    from pyshm import engines

    facts = {"pickle-protocol": 5, "pyshm": 1, "pyshm-machine": engines._machine()}

    def to(address: str, **handshake) -> dict:
        return {"recipient": {"address": address, **handshake}}

    # (a connection to it: our end the accepted one, the peer's the client's, which listens
    # nowhere)
    client = socket.create_connection(ours.getsockname())
    accepted = ours.accept()[0]
    ends = [list(accepted.getsockname()), list(client.getsockname())]

    here = to(peer, **facts)
    cases = [(here, True),
             (to("tcp://127.0.0.1:1", **facts), False),  # (nobody there)
             (to("tcp://203.0.113.7:8786", **facts), False),
             (to("tcp://node7.example:8786", **facts), False),
             # a scheduler's own comm (it asks for protocol 4 and relays what it fetches)
             (to(peer, **{**facts, "pickle-protocol": 4}), False),
             (to(peer), False),  # (no handshake: not a comm's)
             # a process that does not say it loads references (no pyshm there)
             (to(peer, **{"pickle-protocol": 5}), False),
             (to(peer, **{**facts, "pyshm": 2}), False),
             # another machine's process behind a TCP forwarder of ours (ssh -L, socat)
             (to(peer, **{**facts, "pyshm-machine": "0f1e2d3c/4026531840"}), False),
             (to(peer, **{k: v for k, v in facts.items() if k != "pyshm-machine"}), False),
             # an address no port of which int() reads: no error out of the serializer
             (to("tcp://127.0.0.1:\u00b2", **facts), False),
             ({**here, "sender": {"address": "tcp://127.0.0.1:\u00b2"}}, True),
             # a websocket's accepting side: distributed names its peer "<ip>:0"; the ends
             # its socket named at the handshake are read from our own facts, never the peer's
             ({**to("127.0.0.1:0", **facts), "sender": {"pyshm-ends": ends}}, True),
             (to("127.0.0.1:0", **facts, **{"pyshm-ends": ends}), False),
             (None, False)]  # (spilling to disk: no recipient)
    other = None
    if os.geteuid() == 0:  # a worker of another user here: it would be refused the memory
        other = socket_as(65534)
        cases.append((to(f"tcp://127.0.0.1:{other[0]}", **facts), False))
    try:
        check_dask_serialize(array, here, cases)
    finally:
        for sock in (ours, client, accepted):
            sock.close()
        if other is not None:
            os.kill(other[1], 9)
            os.waitpid(other[1], 0)


def test_dask_the_owner_of_a_peers_socket_is_asked_of_the_kernel_not_read_from_proc(
        monkeypatch, no_fd_leak):
    # Whether a Dask peer is a process of this user (a reference is of no use to another
    # user's) was a read of /proc/net/tcp and tcp6: 7 ms here, once a second per peer on each
    # side, as the kernel walks its whole socket tables. It is now one sock_diag lookup of
    # the peer's socket of that very connection (distributed gives both ends), about 40 us,
    # with the answers those tables gave, which stay for where netlink is refused
    import socket

    monkeypatch.setattr(engines, "_peers", {})  # (no answer of the tables remembered before)
    sockets = []

    def listener(family, host, v6only=False):
        sock = socket.socket(family)
        sockets.append(sock)
        if v6only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, 0))
        sock.listen()
        return sock.getsockname()[1]

    def connection(port):
        """(our client's (host, port), the accepted end's (host, port))"""
        client = socket.create_connection(("127.0.0.1", port))
        accepted = sockets[0].accept()[0]
        sockets.extend([client, accepted])
        return client.getsockname()[:2], accepted.getsockname()[:2]

    children = []
    try:
        ours = listener(socket.AF_INET, "127.0.0.1")
        everywhere = listener(socket.AF_INET, "0.0.0.0")
        both = listener(socket.AF_INET6, "::")
        v6 = listener(socket.AF_INET6, "::1", v6only=True)
        client_end, accepted_end = connection(ours)
        me, nobody = {os.geteuid()}, set()
        cases = [("127.0.0.1", ours, None, me), ("127.0.0.2", ours, None, nobody),
                 ("::1", ours, None, nobody), ("127.0.0.1", everywhere, None, me),
                 ("127.0.0.1", both, None, me), ("::1", both, None, me),
                 ("[::1]", v6, None, me), ("127.0.0.1", v6, None, nobody),
                 ("127.0.0.1", 1, None, nobody), ("node7.example", ours, None, nobody),
                 # a connection's peer: a listener's accepted end, a client (no listener)
                 ("127.0.0.1", ours, client_end, me), (*client_end, accepted_end, me),
                 (*client_end, ("127.0.0.1", 1), nobody)]  # (no such connection)
        if os.geteuid() == 0:  # a process of another user: listening, and connected to us
            other_port, pid = socket_as(65534)
            children.append(pid)
            towards_other = socket.create_connection(("127.0.0.1", other_port))
            sockets.append(towards_other)
            other_client, pid = socket_as(65534, connect_to=ours)
            children.append(pid)
            cases += [("127.0.0.1", other_port, None, {65534}),
                      ("127.0.0.1", other_port, towards_other.getsockname()[:2], {65534}),
                      ("127.0.0.1", other_client, ("127.0.0.1", ours), {65534})]
        for host, port, via, uids in cases:
            assert engines._peer_uids(host, port, via) == uids, (host, port, via)
            if host[0].isdigit() or host[0] in ":[":
                # (None: none found; then the tables are read, see below)
                assert engines._diag_uids(host, port, via) == (uids or None), (host, port, via)
            assert engines._table_uids(host, port, via) == uids, (host, port, via)
        # where netlink is refused (a seccomp filter, an old sandbox): the tables, as before
        real_socket = socket.socket

        def no_netlink(family=-1, *args, **kwargs):
            if family == socket.AF_NETLINK:
                raise PermissionError(1, "Operation not permitted")
            return real_socket(family, *args, **kwargs)

        monkeypatch.setattr(socket, "socket", no_netlink)
        monkeypatch.setattr(engines, "_peers", {})  # (nor any of the lookups above)
        assert engines._diag_uids("127.0.0.1", ours) is None
        assert engines._peer_uids("127.0.0.1", ours, client_end) == me
        monkeypatch.undo()  # (and no_fd_leak: no netlink socket left open)
    finally:
        for sock in sockets:
            sock.close()
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


class NetlinkAnsweringNoSuchSocket:
    """A NETLINK_SOCK_DIAG socket of a kernel without its TCP lookup (inet_diag or tcp_diag
    not built, or a module that cannot be loaded): every request is answered ENOENT, as if
    there were no such socket."""

    def __init__(self, *args):
        self.replies = []

    def settimeout(self, seconds):
        pass

    def send(self, request):
        import errno
        import struct

        sequence = struct.unpack_from("=I", request, 8)[0]
        self.replies.append(struct.pack("=IHHIIi", 36, 2, 0, sequence, 0, -errno.ENOENT)
                            + request[:16])

    def recv(self, size):
        return self.replies.pop(0)

    def close(self):
        pass


def test_dask_a_peers_owner_is_not_remembered_nor_taken_from_a_kernel_that_cannot_tell(
        monkeypatch, no_fd_leak):
    # The sock_diag lookup of a peer's owner (35 us) was remembered for a second, as the 7 ms
    # /proc read was: a socket closed and another user's at that address in that second got
    # a reference still. A connection its peer closed (time-wait, orphaned) was said to be
    # root's (the kernel names no owner there). And a kernel without the TCP lookup answers
    # "no such socket" to all: every peer of ours got bytes, where the tables said ours
    import socket

    me = {os.geteuid()}
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child, sockets = None, [server]
    try:
        assert engines._peer_uids("127.0.0.1", port) == me
        client = socket.create_connection(("127.0.0.1", port))
        accepted = server.accept()[0]
        sockets += [client, accepted]
        client_end, accepted_end = client.getsockname(), accepted.getsockname()
        assert engines._peer_uids(*accepted_end, client_end) == me
        accepted.close()  # (the peer goes; its end stays, in FIN-WAIT-2, owned by no one)
        assert engines._diag_uids(*accepted_end, client_end) == set()
        assert engines._peer_uids(*accepted_end, client_end) == set()
        # (a listener that had no connection: its port is free at once once it is closed)
        fresh = socket.create_server(("127.0.0.1", 0))
        sockets.append(fresh)
        port = fresh.getsockname()[1]
        assert engines._peer_uids("127.0.0.1", port) == me
        fresh.close()
        assert engines._peer_uids("127.0.0.1", port) == set()  # (at once: nobody there)
        if os.geteuid() == 0:  # another user's listener at that address, at once
            bound, child = socket_as(65534, bind_to=port)
            assert bound == port
            assert engines._peer_uids("127.0.0.1", port) == {65534}
            context = {"recipient": {"address": f"tcp://127.0.0.1:{port}",
                                     "pickle-protocol": 5, engines._ANNOUNCED:
                                     engines._REFERENCE_FORMAT, engines._MACHINE_KEY:
                                     engines._machine(_channel.own_netns())}}
            if importlib.util.find_spec("distributed") is not None:  # (it asks distributed
                assert not engines._recipient_here(context)  # which are its schedulers)
        # a kernel that answers ENOENT to every lookup: not "nobody"; the tables (7 ms,
        # remembered) answer
        with socket.create_server(("127.0.0.1", 0)) as ours:
            real_socket = socket.socket

            def kernel_without_tcp_lookup(family=-1, *args, **kwargs):
                if family == socket.AF_NETLINK:
                    return NetlinkAnsweringNoSuchSocket()
                return real_socket(family, *args, **kwargs)

            with monkeypatch.context() as patched:
                patched.setattr(socket, "socket", kernel_without_tcp_lookup)
                assert engines._diag_uids("127.0.0.1", ours.getsockname()[1]) is None
                assert engines._peer_uids("127.0.0.1", ours.getsockname()[1]) == me
    finally:
        for sock in sockets:
            sock.close()
        if child is not None:
            os.kill(child, 9)
            os.waitpid(child, 0)


def test_dask_a_peers_owner_is_asked_once_per_message_and_again_for_the_next(monkeypatch):
    # Whether a message's recipient is a process of ours was asked of the kernel for each
    # shared array in it: a scatter of 50 arrays made 50 sock_diag lookups (35-60 us each).
    # Now once per message (the context dict distributed makes for each message it writes),
    # each way, and the next message asks again (never remembered across messages)
    distributed = engine_or_skip("distributed")
    arrays = [pyshm.zeros(8, np.float64, shared=True) for _ in range(50)]
    asked = []
    diag_uids = engines._diag_uids
    monkeypatch.setattr(engines, "_diag_uids", lambda *args: asked.append(args[:2]) or
                        diag_uids(*args))
    # (one process, over TCP: both directions' lookups are made here)
    with distributed.LocalCluster(n_workers=1, processes=False, protocol="tcp://",
                                  threads_per_worker=1, dashboard_address=None) as cluster, \
            distributed.Client(cluster, direct_to_workers=True) as client:
        worker = engines._host_and_port(next(iter(cluster.workers.values())).address)

        def lookups():
            to_worker = sum(peer == worker for peer in asked)
            counts, asked[:] = (to_worker, len(asked) - to_worker), []
            return counts

        asked.clear()
        futures = client.scatter(arrays, direct=True, hash=False)
        assert lookups() == (1, 0)  # (before: 50)
        back = client.gather(futures, direct=True)
        assert lookups() == (0, 1)  # (the worker's, toward us)
        assert [a.ctypes.data for a in back] == [a.ctypes.data for a in arrays]  # (by ref)
        named = client.scatter(dict(zip(map(str, range(50)), arrays)), direct=True)
        assert lookups() == (1, 0)  # (asked again: a new message)
        back = client.gather(named, direct=True)
        assert lookups() == (0, 1)
        assert [back[str(i)].ctypes.data for i in range(50)] == [a.ctypes.data for a in arrays]


def test_dask_a_peer_whose_socket_is_bound_to_an_interface_is_ours(no_fd_leak):
    # The kernel's lookup (sock_diag) finds a socket bound to an interface only given that
    # interface, which a distributed address does not name: a connection to a link-local
    # IPv6 address of ours ("[fe80::1]:port", no scope: the client's end is bound to the
    # scope's interface), a listener bound with SO_BINDTODEVICE (or in a VRF). It said
    # "nobody" and the peer got bytes where the /proc tables said ours; they answer now
    import ipaddress
    import socket

    me = {os.geteuid()}
    with socket.create_server(("127.0.0.1", 0)) as plain:  # (one the lookup finds)
        assert engines._diag_uids("127.0.0.1", plain.getsockname()[1]) == me
    with open("/proc/net/if_inet6") as table:
        scoped = [(str(ipaddress.ip_address(int(words[0], 16))), int(words[1], 16))
                  for words in map(str.split, table) if words[0].startswith("fe80")]
    tried = 0
    if scoped:
        address, interface = scoped[0]
        with socket.create_server(("::", 0), family=socket.AF_INET6) as server, \
                socket.socket(socket.AF_INET6) as client:
            client.connect((address, server.getsockname()[1], 0, interface))
            with server.accept()[0] as accepted:
                client_end, accepted_end = client.getsockname()[:2], accepted.getsockname()[:2]
                assert client_end[0] == address and engines._local_host(address)
                assert engines._peer_uids(*accepted_end, client_end) == me  # (to the server)
                assert engines._peer_uids(*client_end, accepted_end) == me  # (to the client)
        tried += 1
    with socket.socket() as server:
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        except PermissionError:  # (CAP_NET_RAW needed)
            pass
        else:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            assert engines._peer_uids("127.0.0.1", port) == me
            with socket.create_connection(("127.0.0.1", port)) as client, \
                    server.accept()[0]:  # (an accepted end is bound to that interface too)
                assert engines._peer_uids("127.0.0.1", port, client.getsockname()) == me
            tried += 1
    if not tried:
        pytest.skip("no link-local IPv6 address here, and SO_BINDTODEVICE not permitted")


LOAD_WITHOUT_PYSHM = """
    import logging, pickle, sys
    sys.modules["pyshm"] = None  # (pyshm not importable in this worker)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
    from distributed.protocol import deserialize
    header, frames = pickle.loads(sys.stdin.buffer.read())
    try:
        deserialize(header, frames)
    except ImportError as error:
        print("not loaded:", error)
"""


def test_dask_reference_that_a_worker_cannot_load_leaves_no_secret_in_its_log():
    # distributed logs (at INFO) the first 10,000 bytes of a pickle it fails to load, e.g. in
    # a worker where pyshm does not import: whoever reads that log must not be able to fetch
    # the memory, so the secrets travel in frames of their own
    engine_or_skip("distributed")
    import socket

    from distributed.protocol import serialize

    array = pyshm.zeros(1 << 18, np.uint8, shared=True)
    ours = socket.socket()
    ours.bind(("127.0.0.1", 0))
    ours.listen()
    try:
        header, frames = serialize(array, serializers=("dask",), context={
            "recipient": {"address": f"tcp://127.0.0.1:{ours.getsockname()[1]}",
                          "pickle-protocol": 5, "pyshm": 1,
                          "pyshm-machine": pyshm.engines._machine()}})
    finally:
        ours.close()
    frames = [bytes(frame) for frame in frames]
    # and what distributed pickles whole: a ref scattered by hand, inside an object
    others = [[bytes(f) for f in serialize(value, serializers=("pickle",))[1]]
              for value in (pyshm.ref(array), Holder(pyshm.ref(array), 1))]
    with _channel.state.lock:
        secrets = {secret for pair in _channel.state.secrets.values() for secret in pair[:2]}
        secrets |= {batch.secret for batch in _channel.state.batches.values()}
    # out of band: the batch's secret and the memfd's, nothing else
    assert len(frames) == 3 and all(frame in secrets for frame in frames[1:]), frames[1:]
    for pickled in [frames, *others]:
        assert not any(secret in pickled[0] for secret in secrets)
        assert len([frame for frame in pickled if frame in secrets]) == 2
    log = run_python(LOAD_WITHOUT_PYSHM, pickle.dumps((header, frames)))
    assert b"not loaded:" in log and b"Failed to deserialize" in log, log
    assert b"pyshm.reduction" in log, log  # (the pickle itself is in the log...)
    for secret in secrets:  # (...but not one secret)
        assert repr(secret)[2:-1].encode() not in log and secret.hex().encode() not in log
    # and the frames as they are load where pyshm does
    back = pickle.loads(frames[0], buffers=frames[1:])
    assert back.ctypes.data == array.ctypes.data


def check_dask_serialize(array, here, cases):
    from distributed.protocol import deserialize, serialize

    for context, by_reference in cases:
        header, frames = serialize(array, serializers=("dask",), context=context)
        frames = [bytes(frame) for frame in frames]  # (as they would arrive)
        size = sum(len(frame) for frame in frames)
        assert (size < 1000) == by_reference, context
        back = deserialize(header, frames)
        assert (back == array).all()
        assert (back.ctypes.data == array.ctypes.data) == by_reference
    unshared = pyshm.zeros(1 << 18, np.uint8)  # not shared: no implicit share on dask's threads
    header, frames = serialize(unshared, serializers=("dask",), context=here)
    assert sum(memoryview(frame).nbytes for frame in frames) >= unshared.nbytes
    assert not pyshm.is_shared(unshared)


class OtherNamespace(NamedTuple):
    name: str  # for ip netns exec
    here: str  # this namespace's end of the veth pair
    there: str  # the other namespace's end


# /24s for the veth pair; the first that no interface or route here uses is taken (a machine
# whose own network lies in 10.231.0.0/24 would route the replies away from the pair)
PAIR_SUBNETS = ("10.231.0.0/24", "172.30.231.0/24", "192.168.231.0/24", "198.18.231.0/24")


def free_pair_subnet() -> str:
    import ipaddress

    def run(*command: str) -> str:
        return subprocess.run(["ip", "-4", *command], capture_output=True, text=True,
                              check=False).stdout

    words = run("-o", "addr", "show").split()
    taken = [word for before, word in zip(words, words[1:]) if before == "inet"]
    for route in run("route", "show", "table", "all").splitlines():
        taken.extend(route.split()[:2])  # (a destination first, after its type if it has one)
    networks = []
    for word in taken:
        try:
            networks.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            pass  # ("default", a route type)
    taken = networks
    for subnet in PAIR_SUBNETS:
        if not any(ipaddress.ip_network(subnet).overlaps(other) for other in taken):
            return subnet
    pytest.fail(f"every subnet of {PAIR_SUBNETS} is in use here: {taken}")


def test_dask_an_address_that_comes_up_later_is_this_machine():
    # pyshm remembers this machine's addresses for a second; one that comes up later (a VPN,
    # a container network, a DHCP lease) must count as ours too, or workers listening there
    # get copies, and one that leaves must not (another machine may take it; a worker of ours
    # listening on 0.0.0.0 at the same port would pass the check of the socket's owner)
    import shutil

    from pyshm import engines

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to add an address")
    address = free_pair_subnet().rsplit(".", 1)[0] + ".1"
    assert not engines._local_host(address)  # (and the addresses are remembered now)
    name = f"pyshmd{os.getpid()}"
    done = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"no veth pair here: {done.stderr}")
    try:
        for command in (["ip", "addr", "add", f"{address}/24", "dev", name],
                        ["ip", "link", "set", name, "up"]):
            subprocess.run(command, capture_output=True, text=True, check=True)
        deadline = time.monotonic() + 5 * engines._PEER_SECONDS
        while not engines._local_host(address):
            assert time.monotonic() < deadline, f"{address} never counted as this machine's"
            time.sleep(0.05)
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
    # and once it left (it may be another machine's now): not ours, within a second
    deadline = time.monotonic() + 5 * engines._PEER_SECONDS
    while engines._local_host(address):
        assert time.monotonic() < deadline, f"{address} still counted as this machine's"
        time.sleep(0.05)


def test_dask_a_process_that_moved_to_another_network_namespace_says_so():
    # _machine names the network namespace as it is now, not as it was when first asked: a
    # forked child that moves to one of its own (unshare) cannot reach our abstract sockets,
    # so its handshake must not pass for ours
    import ctypes

    from pyshm import engines

    if os.geteuid() != 0:
        pytest.skip("needs root to unshare a network namespace")
    here = engines._machine()
    assert here is not None and engines._machine() == here
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            said = engines._machine() if libc.unshare(0x40000000) == 0 else \
                f"unshare failed: errno {ctypes.get_errno()}"  # (CLONE_NEWNET)
        except BaseException as error:
            said = repr(error)
        finally:
            os.write(write_end, str(said).encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        there = pipe.read().decode()
    assert os.waitpid(pid, 0)[1] == 0
    if there.startswith("unshare failed"):
        pytest.skip(there)
    # the same boot, another namespace
    assert there.split("/")[0] == here.split("/")[0] and there != here, (here, there)


SENDER_MOVES = """
    import ctypes, shutil, socket, subprocess, sys, numpy as np, pyshm
    from distributed.protocol import serialize
    from pyshm import engines

    def by_reference(array):
        with socket.socket() as ours:  # (a worker of ours, here: its handshake, as it says it)
            ours.bind(("127.0.0.1", 0))
            ours.listen()
            context = {"recipient": {"address": f"tcp://127.0.0.1:{ours.getsockname()[1]}",
                                     "pickle-protocol": 5, "pyshm": 1,
                                     "pyshm-machine": engines._machine()}}
            _, frames = serialize(array, serializers=("dask",), context=context)
        return sum(memoryview(frame).nbytes for frame in frames) < 1000

    array = pyshm.zeros(1 << 18, np.uint8, shared=True)
    print(by_reference(array))  # (the fd server starts here)
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # (CLONE_NEWNET)
        sys.exit(f"unshare failed: errno {ctypes.get_errno()}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    print(by_reference(array))
"""


def test_dask_a_sender_that_moved_to_another_network_namespace_sends_the_bytes():
    # a process whose fd server started before it moved (unshare(CLONE_NEWNET)) says it runs
    # in its new namespace, as its workers there do: they cannot reach its server, which stays
    # in the old one, so a reference to them would never load (distributed then waits for
    # ever); it goes by value
    import shutil

    engine_or_skip("distributed")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to unshare a network namespace")
    said = run_python(SENDER_MOVES).decode().split()
    assert said == ["True", "False"], said


REACH_FROM_THERE = """
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
        break
    except OSError as error:
        if time.monotonic() > deadline:
            sys.exit(f"cannot reach {sys.argv[1]}:{sys.argv[2]} from the namespace: {error}")
        time.sleep(0.1)
"""


@pytest.fixture
def other_network_namespace():
    """A network namespace of its own, reached over a veth pair (on a free /24: ``here`` is this
    namespace's end, ``there`` the other's): a process in it is on this machine but cannot
    reach our abstract sockets. The fixture checks that a TCP connection from there reaches a
    listener here before it hands the namespace over."""
    import shutil
    import socket

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    name = f"pyshm{os.getpid()}"
    prefix = free_pair_subnet().rsplit(".", 1)[0]
    pair = OtherNamespace(name, f"{prefix}.1", f"{prefix}.2")
    commands = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n"],
        ["ip", "link", "set", f"{name}n", "netns", name],
        ["ip", "addr", "add", f"{pair.here}/24", "dev", f"{name}h"],
        ["ip", "link", "set", f"{name}h", "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{pair.there}/24", "dev", f"{name}n"],
        ["ip", "netns", "exec", name, "ip", "link", "set", f"{name}n", "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"no network namespace here: {' '.join(command)}: {done.stderr}")
        with socket.create_server((pair.here, 0)) as listener:
            done = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c",
                                   REACH_FROM_THERE, pair.here, str(listener.getsockname()[1])],
                                  capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            network = subprocess.run("ip -4 addr; ip -4 route", shell=True, capture_output=True,
                                     text=True, check=False).stdout
            pytest.fail(f"the veth pair carries no TCP: {done.stderr}\n{network}")
        yield pair
    finally:
        subprocess.run(["ip", "link", "del", f"{name}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def stop(worker: subprocess.Popen) -> None:
    """End a worker started by a test (a worker closing gracefully may wait on its scheduler:
    it is never left running)."""
    worker.terminate()
    try:
        worker.wait(10)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(30)


def tail_of(path: str, size: int = 4000) -> str:
    """The last ``size`` characters of a log file (a worker's stderr), for a failure message."""
    try:
        with open(path, errors="replace") as log:
            return log.read()[-size:]
    except OSError as error:
        return f"(no log: {error})"


def test_dask_worker_that_cannot_reach_this_process_gets_the_bytes(other_network_namespace,
                                                                   tmp_path):
    distributed = engine_or_skip("distributed")
    pair, said = other_network_namespace, str(tmp_path / "worker.log")
    with distributed.LocalCluster(n_workers=0, host=pair.here, processes=True,
                                  dashboard_address=None) as cluster, open(said, "wb") as log:
        worker = subprocess.Popen(
            ["ip", "netns", "exec", pair.name, sys.executable, "-m",
             "distributed.cli.dask_worker", cluster.scheduler_address, "--host", pair.there,
             "--nthreads", "1", "--no-dashboard", "--no-nanny"],
            stdout=log, stderr=subprocess.STDOUT, cwd=HERE,
            # (the worker imports this module for fill_array: PYTHONSAFEPATH keeps cwd off)
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
        try:
            for direct in (False, True):  # through the scheduler, and straight to the worker
                with distributed.Client(cluster.scheduler_address,
                                        direct_to_workers=direct) as client:
                    try:
                        client.wait_for_workers(1, timeout=60)
                    except TimeoutError as error:
                        pytest.fail(f"{error!r}; the worker (exit code {worker.poll()}) wrote:\n"
                                    f"{tail_of(said)}")
                    array = pyshm.zeros(1 << 18, np.float32, shared=True)
                    array[:] = 1
                    future = client.scatter(array, hash=False)
                    back = client.submit(fill_array, future, 2.0, pure=False).result()
                    # by value both ways: the worker's copy was written, ours not
                    assert float(back.sum()) == 2 * (1 << 18) and (array == 1).all()
                    # a task argument (a ref): no worker here to scatter it to, so by value
                    back = client.submit(fill_array, pyshm.ref(array), 3.0,
                                         pure=False).result()
                    assert float(back.sum()) == 3 * (1 << 18) and (array == 1).all()
                    # the array itself as an argument: the same (by value)
                    back = client.submit(fill_array, array, 4.0, pure=False).result()
                    assert float(back.sum()) == 4 * (1 << 18) and (array == 1).all()
        finally:
            stop(worker)


DASK_PROCESS = """
    import sys, types
    {first}
    from distributed.comm.core import Comm
    pyshm = sys.modules.get("pyshm")
    said = Comm.handshake_info(types.SimpleNamespace(same_host=True))
    print(pyshm is not None and "distributed" in pyshm.engines.installed(), said.get("pyshm"),
          pyshm is not None and said.get("pyshm-machine") == pyshm.engines._machine())
"""


def test_dask_processes_import_pyshm_through_its_entry_point():
    # pyshm's "dask.sizeof" entry point: a process of distributed imports pyshm before its
    # first connection (so its handshake says it loads references); a process of dask alone
    # does not; a pyshm that cannot be imported costs distributed a logged error, not its import
    engine_or_skip("distributed")
    for first in ("import distributed",  # (dask's entry points run inside this import)
                  "import dask; import distributed",  # (... before it: a watch, then)
                  "from dask.distributed import Client",  # (so does the dask worker command)
                  # (a library asking whether distributed is there, as xarray does)
                  "import dask, importlib.util; importlib.util.find_spec('distributed'); "
                  "import distributed",
                  "import dask.__main__; import distributed.cli.dask_worker"):
        assert run_python(DASK_PROCESS.format(first=first)).split() == \
            [b"True", b"1", b"True"], first
    assert run_python("""
        import sys
        import dask.array
        print("pyshm" in sys.modules)
    """).split() == [b"False"]
    for first, says in (("import distributed", "Failed to register sizeof entry point pyshm"),
                        ("import dask; import distributed",
                         "pyshm could not be imported for distributed")):
        broken = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(DASK_PROCESS.format(first=first))],
            capture_output=True, text=True, timeout=120, cwd=HERE,
            env=dict(os.environ, PYSHM_LIBRARY="/nonexistent/liblshm.so"))
        assert broken.returncode == 0, broken.stderr
        assert broken.stdout.split() == ["False", "None", "False"], broken.stdout
        assert says in broken.stderr, broken.stderr
        assert "could not load /nonexistent/liblshm.so" in broken.stderr, broken.stderr


DASK_THEN_THREADS = """
    import sys, threading, time
    import dask
    # one thread imports numpy (or pyshm), another distributed, the first already under way
    first = threading.Thread(target=__import__, args=(sys.argv[2],))
    second = threading.Thread(target=__import__, args=("distributed",))
    first.start()
    time.sleep(float(sys.argv[1]))
    second.start()
    first.join()
    second.join()
    print("pyshm" in sys.modules and "distributed" in sys.modules["pyshm"].engines.installed())
"""


def test_dask_entry_point_imports_nothing_under_the_import_lock():
    # the watch of pyshm's entry point (dask imported before distributed) must not import
    # pyshm from a finder, under the import system's global lock: a thread importing numpy
    # meanwhile would wait for that lock, and the import of pyshm for numpy, forever
    engine_or_skip("distributed")
    for module in ("numpy", "pyshm"):
        for delay in ("0.002", "0.005", "0.01", "0.02"):
            done = subprocess.run([sys.executable, "-c", textwrap.dedent(DASK_THEN_THREADS),
                                   delay, module], capture_output=True, timeout=30, cwd=HERE)
            assert done.returncode == 0, done.stderr.decode()
            assert done.stdout.split() == [b"True"], (module, delay)


BARE_WORKER = """
    import importlib.metadata as metadata, sys
    # an environment without pyshm: neither the package nor its entry point
    sys.modules["pyshm"] = None
    every = metadata.entry_points
    metadata.entry_points = lambda **select: metadata.EntryPoints(
        point for point in every(**select) if not point.value.startswith("pyshm"))
    from distributed.cli.dask_worker import main
    sys.argv[1:] = [sys.argv[1], "--nthreads", "1", "--no-dashboard", "--no-nanny",
                    "--name", "bare"]
    main()
"""


def test_dask_worker_without_pyshm_gets_the_bytes(tmp_path):
    # A worker of this user on this machine, from an environment without pyshm, cannot load a
    # reference: it must get the bytes, whether a client scatters to it or another worker
    # holds the memory a task there needs (before, that transfer failed to load and Dask
    # waited forever: dask/distributed#7060). A worker of the `dask worker` command (which
    # imports dask before distributed; a nanny spawns it) gets our memory.
    distributed = engine_or_skip("distributed")
    said = str(tmp_path / "worker.log")
    # (the command's script itself, as users run it: the worker its nanny spawns runs the
    # script again, so it too imports dask before distributed; `python -m dask` would not)
    command = os.path.join(os.path.dirname(sys.executable), "dask")
    if not os.path.exists(command):
        (pytest.fail if IN_CI else pytest.skip)(f"no dask command beside {sys.executable}")
    # (the workers import this module for fill_and_say: PYTHONSAFEPATH keeps cwd off)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with distributed.LocalCluster(n_workers=0, processes=True,
                                  dashboard_address=None) as cluster, open(said, "wb") as log:
        workers = [subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(BARE_WORKER), cluster.scheduler_address],
            stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=env), subprocess.Popen(
            [command, "worker", cluster.scheduler_address, "--nthreads", "1",
             "--no-dashboard", "--name", "ours"],
            stdout=log, stderr=subprocess.STDOUT, cwd=HERE, env=env)]
        try:
            with distributed.Client(cluster, direct_to_workers=True) as client:
                try:
                    client.wait_for_workers(2, timeout=60)
                except TimeoutError as error:
                    pytest.fail(f"{error!r}; the workers wrote:\n{tail_of(said)}")
                names = {facts["name"]: at for at, facts in
                         client.scheduler_info(n_workers=-1)["workers"].items()}
                bare, ours = names["bare"], names["ours"]
                array = pyshm.zeros(1 << 18, np.float32, shared=True)
                array[:] = 1
                # (np.sum: what runs there cannot come from this module, which imports pyshm)
                there = client.scatter(array, hash=False, direct=True, workers=[bare])
                assert client.submit(np.sum, there, workers=[bare]).result(timeout=60) == \
                    1 << 18
                held = client.scatter(array, hash=False, direct=True, workers=[ours])
                assert client.submit(fill_and_say, held, 2.0, workers=[ours],
                                     pure=False).result(timeout=60) == (2.0 * (1 << 18), True)
                assert (array == 2).all()  # (the worker of the command wrote our memory)
                needed = client.submit(np.sum, held, workers=[bare], allow_other_workers=False,
                                       pure=False)
                assert needed.result(timeout=60) == 2 * (1 << 18), tail_of(said)
        finally:
            for worker in workers:
                stop(worker)


CLIENT_ELSEWHERE = """
    import sys
    import numpy as np
    import distributed

    def made_shared(value):  # (on the worker: shared pyshm memory of the worker's own)
        import pyshm
        array = pyshm.zeros(1 << 18, np.float32, shared=True)
        array[:] = value
        return array

    def worker_read(array):
        return float(array.sum())

    # through the scheduler, as a client does by default: the scheduler fetches each result
    # from the worker and relays it
    with distributed.Client(sys.argv[1], direct_to_workers=False, timeout=60) as client:
        for value in (5.0, 6.0):
            back = client.submit(made_shared, value, pure=False).result(timeout=60)
            assert type(back) is np.ndarray and float(back.sum()) == value * (1 << 18), back
        # data a client here scattered to the worker by reference, then published
        scattered = client.get_dataset("shared")
        assert float(scattered.result(timeout=60).sum()) == 7.0 * (1 << 18)
        assert client.submit(worker_read, scattered).result(timeout=60) == 7.0 * (1 << 18)
    print("every result arrived")
"""


def test_dask_results_relayed_by_the_scheduler_arrive_by_value(other_network_namespace):
    # A scheduler here, its worker here, a client on another machine (a network namespace of
    # its own, which cannot reach our abstract sockets): the scheduler fetches results from
    # the worker over a connection of its own and relays them unopened. Before the worker
    # told that connection apart, shared pyshm memory went over it by reference, which the
    # client elsewhere could not load (DeliveryError).
    distributed = engine_or_skip("distributed")
    pair = other_network_namespace
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1,
                                  host=pair.here, dashboard_address=None) as cluster, \
            distributed.Client(cluster, direct_to_workers=True) as client:
        array = pyshm.zeros(1 << 18, np.float32, shared=True)
        array[:] = 7
        future = client.scatter(array, hash=False, direct=True)
        assert client.submit(fill_and_say, future, 7.0, pure=False).result() == \
            (7.0 * (1 << 18), True)  # (the worker has our memory by reference)
        client.publish_dataset(shared=future)
        done = subprocess.run(
            ["ip", "netns", "exec", pair.name, sys.executable, "-c",
             textwrap.dedent(CLIENT_ELSEWHERE), cluster.scheduler_address],
            capture_output=True, text=True, timeout=240, cwd=HERE, check=False)
        assert done.returncode == 0 and "every result arrived" in done.stdout, \
            done.stdout[-3000:] + done.stderr[-5000:]
        # and a client here, through the scheduler: by value too (the scheduler relays to
        # whoever asks); straight from the worker: our own memory
        with distributed.Client(cluster, direct_to_workers=False) as through:
            relayed = through.get_dataset("shared").result()
            assert (relayed == 7).all() and relayed.ctypes.data != array.ctypes.data
        assert future.result().ctypes.data == array.ctypes.data


# ---- Ray ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster (this machine only) for the Ray tests of this module."""
    ray = engine_or_skip("ray")
    assert "ray" in engines.installed()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                           if p])}})
    try:
        yield ray
    finally:
        ray.shutdown()


def fill_and_describe(array, value):
    writeable = bool(array.flags.writeable)
    if writeable:
        array[:] = value
    return array, writeable, pyshm.is_shared(array)


class ArrayHolder:
    def __init__(self, array):
        self.array = array

    def fill(self, value):
        self.array[:] = value
        return self.array


def test_ray_tasks_actors_and_put_carry_the_same_memory(ray_session):
    ray = ray_session
    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    task = ray.remote(fill_and_describe)
    back, writeable, shared = ray.get(task.remote(array, 2.0))
    assert writeable and shared and (array == 2).all()  # the worker's write, in our memory
    assert back.ctypes.data == array.ctypes.data  # the result is our own array
    view = array[1000:5000:2]  # a view goes as a view of the same memory
    back, _, _ = ray.get(task.remote(view, 3.0))
    assert (array[1000:5000:2] == 3).all() and (array[1001:5000:2] == 2).all()
    assert back.ctypes.data == view.ctypes.data
    holder = ray.remote(ArrayHolder).remote(array)  # an actor keeps it and writes later
    assert ray.get(holder.fill.remote(4.0)).ctypes.data == array.ctypes.data
    assert (array == 4).all()
    assert ray.get(holder.fill.remote(5.0)).ctypes.data == array.ctypes.data
    assert (array == 5).all()
    put = ray.get(ray.put(array))  # ray.put and get: the array itself, writable
    assert put.ctypes.data == array.ctypes.data and put.flags.writeable
    # other arrays go Ray's own way: a read-only copy from its object store
    plain = np.zeros(1 << 18, np.float32)
    back, writeable, shared = ray.get(task.remote(plain, 6.0))
    assert not writeable and not shared and (plain == 0).all()


LINGER_BYTES = reduction.SLAB_SIZE + 3 * 4096  # (no other test's size; above what
# reduction._cache.recent keeps)


def write_and_count(array, index):
    array[index] = index + 1
    return os.getpid(), _channel.fetch_count()


def still_mapped(_):
    time.sleep(0.2)  # (so that the tasks of one batch spread over the workers)
    gc.collect()
    return os.getpid(), any(mapping.size == LINGER_BYTES
                            for mapping in list(reduction._cache.mappings.values()))


def test_ray_tasks_on_one_object_fetch_its_memory_once(ray_session):
    # Ray rebuilds an object for every task that names it, and a task's arguments die with
    # it: a worker keeps what it fetched for a moment (engines._RayLinger), so tasks in a
    # row fetch the memory once per worker (not one round trip to this process each), all
    # write it, and each worker unmaps it soon after its last task
    ray = ray_session
    array = pyshm.zeros(LINGER_BYTES, np.uint8, shared=True)
    put = ray.put(array)
    task = ray.remote(write_and_count)
    counts = collections.defaultdict(list)
    for i in range(8):
        pid, count = ray.get(task.remote(put, i))
        counts[pid].append(count)
    assert array[:9].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert max(len(seen) for seen in counts.values()) >= 2, counts  # (else nothing to save)
    assert all(len(set(seen)) == 1 for seen in counts.values()), counts  # one fetch each
    deadline = time.monotonic() + 20
    mapped = {pid: True for pid in counts}
    while any(mapped.values()) and time.monotonic() < deadline:
        for pid, still in ray.get([ray.remote(still_mapped).remote(None) for _ in range(4)]):
            mapped[pid] = still
    assert not any(mapped.values()), mapped
    del put, array


def new_shared(nbytes):
    array = pyshm.zeros(nbytes, np.uint8, shared=True)
    array[:] = 4
    return array


def test_the_ray_linger_keeps_received_memory_only_and_never_raises(monkeypatch):
    # (without Ray: what engines._ray_rebuild hands it) memory received from another process
    # is kept, our own is not; a thread that cannot start keeps nothing and raises nothing;
    # a forked child starts with nothing kept
    linger = engines._RayLinger()
    with mp.get_context("fork").Pool(1) as pool:
        received = pool.apply(new_shared, (LINGER_BYTES,))
    linger.keep(pyshm.zeros(LINGER_BYTES, np.uint8, shared=True))  # ours
    assert not linger.arrays
    linger.keep(received)
    ((kept, _),) = linger.arrays.values()
    assert kept is received and linger.thread is not None
    deadline = time.monotonic() + 10
    while linger.arrays and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not linger.arrays and linger.thread is None  # (expired)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    linger.keep(received)
    assert not linger.arrays and linger.thread is None
    monkeypatch.undo()
    engines._ray_linger.keep(received)  # (the process's own, which fork empties)
    assert engines._ray_linger.arrays
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not engines._ray_linger.arrays and os.write(w, b"x") else 1)
    os.close(w)
    assert os.read(r, 1) == b"x" and os.waitpid(pid, 0)[1] == 0
    os.close(r)


def test_ray_pickles_of_a_sender_elsewhere_load_as_rays_copy():
    # a Ray pickle of pyshm memory from a sender this process cannot reach (another node)
    # loads as the copy beside it, even where a memfd of the same numbers is mapped (here:
    # the very one), and nothing is fetched
    array = pyshm.zeros(1 << 16, np.uint8, shared=True)
    array[::7] = 3
    (reduced,) = engines._ray_array(None)(array)
    back, _ = reduced.__reduce__()  # (what Ray's pickle calls, with the array's reference)
    assert back is engines._ray_array_back
    copy = array.copy()  # (Ray's, as it arrives)
    _, args = reduction.reduce_ndarray(array)
    _, (token,) = args[1].__reduce__()
    key, address, size, offset, nbytes, readonly, _, solo = token
    unreachable = address[:-8] + (b"0" * 8 if address[-8:] != b"0" * 8 else b"1" * 8)
    assert back((None, token, *args[2:]), copy).ctypes.data == array.ctypes.data
    fetches = _channel.fetch_count()
    foreign = (key, unreachable, size, offset, nbytes, readonly, os.urandom(16), solo)
    got = back((None, foreign, *args[2:]), copy)
    assert got is copy
    assert _channel.fetch_count() == fetches


def make_shared(value, pid_file):
    with open(pid_file, "w") as out:
        out.write(str(os.getpid()))
    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    array[:] = value
    return array


def test_ray_results_from_a_worker_that_exits_at_once_arrive(ray_session, tmp_path):
    ray = ray_session
    # max_calls=1: Ray ends the worker as soon as it has returned, before the result is read;
    # the reference cannot be used then, and the copy beside it is read instead
    once = ray.remote(max_calls=1)(make_shared)
    result = once.remote(7.0, str(tmp_path / "pid"))
    ray.wait([result], timeout=60)
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the worker did not exit"
    for _ in range(2):  # (read twice, and by a task: a Ray object is read many times)
        assert float(ray.get(result).sum()) == 7.0 * (1 << 18)
    assert ray.get(ray.remote(total_once_ready).remote(result, None)) == 7.0 * (1 << 18)


def add_one_tensor_and_say_where(tensor):
    tensor += 1
    return tensor, tensor.data_ptr()


def test_ray_carries_tensors_over_pyshm_memory(ray_session):
    torch = torch_or_skip()
    ray = ray_session
    assert "ray" in engines.installed() and "torch" in engines.installed()
    array = pyshm.zeros((64, 1024), np.float32, shared=True)
    tensor = torch.from_numpy(array)[8:40]
    back, _ = ray.get(ray.remote(add_one_tensor_and_say_where).remote(tensor))
    assert (array[8:40] == 1).all() and (array[:8] == 0).all()
    assert back.data_ptr() == tensor.data_ptr() and back.shape == tensor.shape
    plain = torch.zeros(1024)  # torch's own tensors: by value, as before
    back, _ = ray.get(ray.remote(add_one_tensor_and_say_where).remote(plain))
    assert float(plain.sum()) == 0 and float(back.sum()) == 1024
    frozen = pyshm.share_readonly(pyshm.zeros(1024, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns of non-writable numpy arrays)
        readonly = torch.from_numpy(frozen)
    # memory shared read-only: a tensor has no read-only flag, so it goes as Ray's copy, which
    # the worker may write (the memory itself would crash it)
    back, _ = ray.get(ray.remote(add_one_tensor_and_say_where).remote(readonly))
    assert float(back.sum()) == 1024 and float(frozen.sum()) == 0


def same_tensor(tensor):
    return tensor


def test_ray_carries_strided_and_expanded_views_of_pyshm_memory(ray_session):
    # a view with an offset and strides over part of a pyshm array, and one with a zero stride
    # (expand): the same memory both ways, as for the other engines
    torch = torch_or_skip()
    ray = ray_session
    array = pyshm.zeros((64, 48), np.float32, shared=True)
    strided = torch.from_numpy(array)[8:16, 1::3].t()
    back, _ = ray.get(ray.remote(add_one_tensor_and_say_where).remote(strided))
    assert back.data_ptr() == strided.data_ptr() and back.stride() == strided.stride()
    assert (array[8:16, 1::3] == 1).all() and array.sum() == 8 * 16
    expanded = torch.from_numpy(array)[20, :8].expand(4, 8)
    back = ray.get(ray.remote(same_tensor).remote(expanded))
    assert back.data_ptr() == expanded.data_ptr() and back.stride() == (0, 1)
    assert back.shape == (4, 8) and (back == 0).all()


def total(value):
    return float(np.asarray(value).sum())


def test_ray_sends_what_pyshm_cannot_send_by_reference_as_rays_copy(ray_session):
    # a slice of a private arena (no memfd to send) goes as Ray's copy, as it would without
    # pyshm, and so does a tensor over it (before: PicklingError at submission)
    ray = ray_session
    arena = pyshm.Arena([1 << 16], [0], [1])
    arena.allocate()
    private = arena.array(0, (8192,), np.float64)
    private[:] = 1
    assert ray.get(ray.remote(total).remote(private)) == 8192.0
    assert total(ray.get(ray.put(private))) == 8192.0
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        torch = torch_or_skip()
        assert ray.get(ray.remote(total).remote(torch.from_numpy(private))) == 8192.0
    del private


def test_ray_does_not_hide_a_fault_of_pyshm_behind_its_copy(ray_session, monkeypatch):
    # only what pyshm says it cannot send by reference goes as Ray's copy alone: any other
    # error in its pickling (a bug: TypeError, say) reaches the caller, who would otherwise
    # get copies with no word of why (before: TypeError was read as "cannot send")
    ray = ray_session
    array = pyshm.zeros(1024, np.float64, shared=True)

    def broken(_):
        raise TypeError("a fault of pyshm's own")

    monkeypatch.setattr(pyshm.reduction, "reduce_ndarray", broken)
    with pytest.raises(Exception):  # (Ray's own words: it inspects the object first)
        ray.put(array)
    monkeypatch.undo()
    assert total(ray.get(ray.put(array))) == 0.0


def test_ray_lazy_conjugate_and_negative_views_and_attributes_arrive(ray_session):
    # (Ray's own pickling keeps them for tensors of torch's memory: so must pyshm's)
    torch = torch_or_skip()
    ray = ray_session
    array = pyshm.zeros(4, np.complex64, shared=True)
    array[:] = [1 + 2j, 3 + 4j, 5 + 6j, 7 + 8j]
    for sent, _ in lazy_tensors(torch, array):
        check_lazy(sent, ray.get(ray.remote(read_lazy).remote(sent)))
        check_lazy(sent, (read_lazy(sent)[0], ray.get(ray.put(sent))))


def test_ray_registered_when_imported_after_pyshm():
    engine_or_skip("ray")
    out = run_python("""
        import numpy as np
        import pyshm
        from pyshm import engines
        assert "ray" not in engines.installed()
        import ray
        from ray.cloudpickle import CloudPickler
        print(sorted(engines.installed()), CloudPickler.dispatch[np.ndarray]._pyshm)
        # the reference and Ray's copy beside it: here, the reference is the array itself
        array = pyshm.zeros(1 << 16, np.uint8, shared=True)
        stream = ray.cloudpickle.dumps(array)
        back = ray.cloudpickle.loads(stream)
        print(len(stream) > array.nbytes, back.ctypes.data == array.ctypes.data)
    """)
    lines = out.decode().splitlines()
    assert "'ray'" in lines[0] and lines[0].endswith("True")
    assert lines[1] == "True True"


RAY_WITH_A_NODE_ELSEWHERE = """
    import os, subprocess, sys, time
    import numpy as np
    import pyshm, ray
    from pyshm import engines
    namespace, head, far, said = sys.argv[1:]
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             _node_ip_address=head)
    node = subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-m", "ray.scripts.scripts",
         "start", "--address", ray.get_runtime_context().gcs_address,
         "--node-ip-address", far, "--num-cpus", "1", "--resources", '{"far": 1}',
         "--block", "--disable-usage-stats"],
        stdout=open(said, "wb"), stderr=subprocess.STDOUT)
    try:
        def fill(array, value):
            array = array if array.flags.writeable else np.array(array)
            array[:] = value
            return array

        array = pyshm.zeros(1 << 18, np.float32, shared=True)
        here = ray.remote(fill)
        back = ray.get(here.remote(array, 2.0))
        assert (array == 2).all() and back.ctypes.data == array.ctypes.data  # by reference
        deadline = time.monotonic() + 90
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert node.poll() is None and time.monotonic() < deadline, "no second node"
            time.sleep(0.2)
        far = ray.remote(resources={"far": 1})(fill)
        back = ray.get(far.remote(array, 3.0))  # a node that cannot reach us: the bytes
        assert float(back.sum()) == 3 * array.size and (array == 2).all()
        back = ray.get(here.remote(array, 4.0))  # this machine: the memory, as before
        assert back.ctypes.data == array.ctypes.data and (array == 4).all()
        print("ok")
    finally:
        node.terminate()
        node.wait(60)
        ray.shutdown()
"""


def test_ray_node_that_cannot_reach_this_process_gets_the_bytes(other_network_namespace,
                                                                tmp_path):
    engine_or_skip("ray")
    pair, said = other_network_namespace, str(tmp_path / "node.log")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(RAY_WITH_A_NODE_ELSEWHERE),
                           pair.name, pair.here, pair.there, said],
                          capture_output=True, timeout=240, cwd=HERE)
    left = subprocess.run(["ip", "netns", "pids", pair.name],
                          capture_output=True, text=True).stdout.split()
    for pid in left:  # (a node that outlived its test: never left running)
        subprocess.run(["kill", "-9", pid], capture_output=True)
    try:  # (Ray leaves the address of that cluster for the next ray.init() to join)
        with open("/tmp/ray/ray_current_cluster") as current:
            if current.read().startswith(pair.here + ":"):
                os.unlink("/tmp/ray/ray_current_cluster")
    except OSError:
        pass
    assert done.returncode == 0, (done.stderr.decode()[-4000:]
                                  + "\nthe node in the other namespace wrote:\n" + tail_of(said))
    assert done.stdout.split() == [b"ok"]
    assert not left, "the Ray node in the other namespace outlived its process"


RAY_CLIENT = """
    import os, sys
    import numpy as np
    import pyshm, ray

    def fill(array, value):
        writeable = array.flags.writeable
        if writeable:
            array[:] = value
        return writeable, pyshm.is_shared(array)

    host, port, where = sys.argv[1:]
    for attempt in range(3):  # (Ray's client server fails to start now and then, at once)
        try:
            ray.init(f"ray://{host}:{port}", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError):
            if attempt == 2:
                raise
            ray.shutdown()
    try:
        assert "ray" in pyshm.engines.installed()
        task = ray.remote(fill)
        array = pyshm.zeros(1 << 18, np.float32, shared=True)
        array[:] = 1
        if where == "here":  # the same memory
            assert ray.get(task.remote(array, 2.0)) == (True, True) and (array == 2).all()
            assert ray.get(ray.put(array)).ctypes.data == array.ctypes.data
        else:  # a cluster that cannot reach us: Ray's copy, read-only, as without pyshm
            assert ray.get(task.remote(array, 2.0)) == (False, False) and (array == 1).all()
            back = ray.get(ray.put(array))
            assert back.ctypes.data != array.ctypes.data and (back == 1).all()
        plain = np.zeros(1 << 18, np.float32)  # (Ray's own way: a read-only copy)
        assert ray.get(task.remote(plain, 3.0)) == (False, False) and (plain == 0).all()
        print("ok")
    finally:
        ray.shutdown()
"""


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ray_client(host: str, where: str, inside: tuple = ()) -> None:
    """RAY_CLIENT against a Ray head started (by ``inside`` + ray start) on ``host``."""
    import shutil
    import tempfile

    place = tempfile.mkdtemp(prefix="/tmp/rc")  # (short: Ray's socket paths live under it)
    ports = [free_port() for _ in range(2)]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with open(os.path.join(place, "head.log"), "wb") as log:
        head = subprocess.Popen(
            [*inside, sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             "--port", str(ports[0]), "--ray-client-server-port", str(ports[1]),
             "--node-ip-address", host, "--num-cpus", "1", "--include-dashboard=false",
             "--disable-usage-stats", "--temp-dir", place],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(RAY_CLIENT), host,
                               str(ports[1]), where],
                              capture_output=True, timeout=180, cwd=HERE, env=env, check=False)
        assert done.returncode == 0, (done.stderr.decode()[-4000:] + "\nthe head wrote:\n"
                                      + tail_of(os.path.join(place, "head.log")))
        assert done.stdout.split() == [b"ok"]
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for pid in os.listdir("/proc"):  # (every process of that cluster: never left running)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    if place.encode() in cmdline.read():
                        os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
        shutil.rmtree(place, ignore_errors=True)
        try:  # (Ray leaves the address of that cluster for the next ray.init() to join)
            with open("/tmp/ray/ray_current_cluster") as current:
                if current.read().startswith(host + ":"):
                    os.unlink("/tmp/ray/ray_current_cluster")
        except OSError:
            pass


def test_ray_client_mode_on_this_machine_carries_the_same_memory():
    # a driver connected through Ray Client (ray://, which needs ray[client]): its arguments
    # go through the client server to the cluster; on this machine, the same memory
    engine_or_skip("ray")
    engine_or_skip("grpc")
    run_ray_client("127.0.0.1", "here")


def test_ray_client_of_a_cluster_that_cannot_reach_this_process_gets_the_bytes(
        other_network_namespace):
    # the same driver against a cluster in a network namespace of its own (as on another
    # machine): Ray's copy, read-only, no error
    engine_or_skip("ray")
    engine_or_skip("grpc")
    pair = other_network_namespace
    run_ray_client(pair.there, "elsewhere", ("ip", "netns", "exec", pair.name))
    left = subprocess.run(["ip", "netns", "pids", pair.name],
                          capture_output=True, text=True, check=False).stdout.split()
    assert not left, "the Ray head in the other namespace outlived its test"


def sleep_and_say(seconds):
    time.sleep(seconds)
    return seconds


def total_once_ready(array, _ready):
    return float(array.sum())


def test_ray_objects_outlive_the_senders_hold(ray_session, monkeypatch):
    # a ray.put object of memory the driver dropped, read twice and by a task, and task
    # arguments read past the keep-alive: Ray's copy, carried beside the reference
    ray = ray_session
    monkeypatch.setattr(_channel, "KEEPALIVE_SECONDS", 0.5)
    array = pyshm.zeros(1 << 18, np.float32, shared=True)
    array[:] = 1
    put = ray.put(array)
    del array
    gc.collect()
    for _ in range(2):
        assert float(ray.get(put).sum()) == 1 << 18
    assert ray.get(ray.remote(total_once_ready).remote(put, None)) == 1 << 18
    ready = ray.remote(sleep_and_say).remote(1.5)  # (the tasks below start after it)
    later = [ray.remote(total_once_ready).remote(
        pyshm.copy(np.full(1000, i, np.int64), shared=True), ready) for i in range(3)]
    assert ray.get(later) == [0, 1000, 2000]


CLOUDPICKLE_AFTER_EXIT = """
    import sys
    import numpy as np
    import pyshm, ray
    array = pyshm.zeros(1 << 16, np.uint8, shared=True)
    array[::3] = 7
    for protocol in (2, 3, 4, 5):  # (any protocol: what numpy itself does for it)
        ray.cloudpickle.loads(ray.cloudpickle.dumps(array, protocol=protocol))
    sys.stdout.buffer.write(ray.cloudpickle.dumps({"weights": array}))
"""


def test_ray_cloudpickle_of_pyshm_memory_loads_after_its_sender_exited():
    ray = engine_or_skip("ray")
    saved = run_python(CLOUDPICKLE_AFTER_EXIT)  # (a file written with ray.cloudpickle)
    weights = ray.cloudpickle.loads(saved)["weights"]
    expected = np.zeros(1 << 16, np.uint8)
    expected[::3] = 7
    assert (weights == expected).all()


def _load_ray_pickle_as_another_user(payload: bytes, write_end: int) -> None:
    """In a forked child that became another user (as a Ray worker of a cluster another user
    started on this machine would be): load Ray's pickle, report what came, write to it."""
    import json

    import ray

    outcome, before, after = None, [], []
    try:
        os.setgid(65534)
        os.setuid(65534)
        before = describe_fds()
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded = ray.cloudpickle.loads(payload)
        seconds = time.monotonic() - start
        # (through numpy: torch's own operations can hang in a forked child, on the OpenMP
        # threads of its parent)
        array, tensor = loaded["array"], loaded["tensor"].numpy()
        outcome = [float(array.sum()), float(tensor.sum()), pyshm.is_shared(array), seconds]
        array[:] = 9  # (a copy of its own: the sender must not see this)
        tensor[:] = 9
        del loaded, array, tensor
        gc.collect()
        after = describe_fds()
    except BaseException as exc:  # (reported to the test, which fails with it)
        outcome = repr(exc)
    finally:
        os.write(write_end, json.dumps([outcome, before, after]).encode())
        os._exit(0)


def test_ray_worker_of_another_user_gets_rays_copy():
    # A Ray worker of a cluster another user runs on this machine reads the object: the
    # sender's channel refuses it the memory (another uid), and it gets Ray's copy, at once,
    # with no error, no warning and no fd left open; its writes stay its own.
    ray = engine_or_skip("ray")
    torch = engine_or_skip("torch")
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    import json

    from pyshm import engines

    assert "ray" in engines.install()
    array = pyshm.zeros(1 << 16, np.float32, shared=True)
    array[:] = 2
    tensor = torch.from_numpy(pyshm.zeros(1 << 16, np.float32, shared=True))
    tensor.fill_(3)
    payload = ray.cloudpickle.dumps({"array": array, "tensor": tensor})
    same_user = ray.cloudpickle.loads(payload)  # (this user: the memory itself)
    assert same_user["array"].ctypes.data == array.ctypes.data
    assert same_user["tensor"].data_ptr() == tensor.data_ptr()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _load_ray_pickle_as_another_user(payload, write_end)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome, before, after = json.loads(pipe.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert isinstance(outcome, list), outcome
    total, tensor_total, shared, seconds = outcome
    assert total == 2 * (1 << 16) and tensor_total == 3 * (1 << 16) and not shared
    assert seconds < 5, seconds  # (refused at once, not after a timeout)
    # no fd of the refused fetch left (a socket to the sender, a memfd); one run of the whole
    # file once saw another new fd in the child, whose kind went unrecorded: another engine's
    # (Ray's or torch's) after fork, not a socket or memfd of pyshm's, is reported, not failed
    new = sorted(set(after) - set(before))  # ("fd->what it is", the listing's own left out)
    assert not [fd for fd in new if "socket:" in fd or "memfd:" in fd], new
    if new:
        warnings.warn(f"new fds in the child, not pyshm's: {new}")
    assert (array == 2).all() and bool((tensor == 3).all())  # (its writes went to its copy)


USERS_OWN_SERIALIZER = """
    import numpy as np
    import ray
    calls = []

    def mine(a):
        calls.append(1)
        return a.tolist()

    ray.util.register_serializer(np.ndarray, serializer=mine, deserializer=np.array)
    import pyshm  # (after the user's serializer: it stays in charge of other arrays)
    from pyshm import engines
    plain = np.arange(5)
    assert (ray.cloudpickle.loads(ray.cloudpickle.dumps(plain)) == plain).all() and calls
    shared = pyshm.copy(np.arange(5), shared=True)
    back = ray.cloudpickle.loads(ray.cloudpickle.dumps(shared))
    assert back.ctypes.data == shared.ctypes.data  # pyshm memory: by reference
    ray.util.deregister_serializer(np.ndarray)
    assert "ray" not in engines.installed()
    assert "ray" in engines.install()  # (back on demand)
    print("ok")
"""


def test_ray_keeps_a_serializer_registered_before_pyshm():
    engine_or_skip("ray")
    assert run_python(USERS_OWN_SERIALIZER).split() == [b"ok"]


def test_a_forked_child_of_a_ray_driver_pickles_pyshm_memory_at_once(ray_session):
    ray = ray_session
    array = pyshm.zeros(1 << 16, np.uint8, shared=True)
    ray.get(ray.put(array))
    pid = os.fork()
    if pid == 0:  # (a forked child: nothing on the pickling path may call the cluster)
        try:
            ray.cloudpickle.dumps(array)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung pickling pyshm memory for Ray")
    assert os.waitstatus_to_exitcode(status) == 0
