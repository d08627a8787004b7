"""Zero-copy hand-off of pyshm arrays through DLPack and the buffer protocol (numpy, torch).

torch is optional: its cases skip when it is not installed.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

import pyshm


def test_numpy_dlpack_and_buffer_protocol_alias():
    a = pyshm.empty((64, 32), np.float32, shared=False)
    a[:] = 1
    pyshm.share_memory_(a)
    via_dlpack = np.from_dlpack(a)
    via_buffer = np.frombuffer(memoryview(a), np.float32)
    assert via_dlpack.ctypes.data == via_buffer.ctypes.data == a.ctypes.data
    via_dlpack[3, 4] = 7
    via_buffer[0] = 5
    assert a[3, 4] == 7 and a[0, 0] == 5
    small = pyshm.empty(100, np.int64, shared=True)  # a slab array
    assert np.from_dlpack(small).ctypes.data == small.ctypes.data


def test_torch_sees_the_same_memory():
    torch = pytest.importorskip("torch")
    a = pyshm.copy(np.arange(1000, dtype=np.float32), shared=True)
    t = torch.from_dlpack(a)
    b = torch.frombuffer(a, dtype=torch.float32)
    n = torch.from_numpy(a)
    assert t.data_ptr() == b.data_ptr() == n.data_ptr() == a.ctypes.data
    t[1] = -1
    b[2] = -2
    assert a[1] == -1 and a[2] == -2
    a[3] = 99
    assert float(t[3]) == float(b[3]) == 99


def torch_child(array, conn):
    import torch

    tensor = torch.from_numpy(array)  # zero-copy over the received mapping
    conn.send((float(tensor.sum()), tensor.data_ptr() == array.ctypes.data))
    tensor.mul_(2)
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_reads_a_shared_array_as_a_torch_tensor(method):
    pytest.importorskip("torch")
    ctx = mp.get_context(method)
    array = pyshm.copy(np.arange(4096, dtype=np.float32), shared=True)
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=torch_child, args=(array, child_end))
    child.start()
    child_end.close()
    total, aliased = parent_end.recv()
    child.join(60)
    assert child.exitcode == 0
    assert total == float(np.arange(4096, dtype=np.float32).sum()) and aliased
    assert (array == 2 * np.arange(4096, dtype=np.float32)).all()  # the tensor's write is ours


@pytest.mark.parametrize("torch_first", [True, False])
def test_torch_in_the_same_process_does_not_clash(torch_first):
    """torch ships its own libshm.so; ours is liblshm and exports only lshm_ symbols, so both
    load side by side in either import order and both share memory correctly."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    import textwrap

    imports = "import torch, pyshm" if torch_first else "import pyshm, torch"
    code = textwrap.dedent(
        f"""
        {imports}
        import numpy as np
        maps = open("/proc/self/maps").read()
        assert "liblshm.so" in maps, "pyshm's library is not loaded"
        assert pyshm.LIBRARY_PATH.endswith("liblshm.so")
        t = torch.ones(1 << 16)
        t.share_memory_()                      # torch's own sharing still works
        assert t.is_shared() and float(t.sum()) == 1 << 16
        a = pyshm.empty(1 << 16, np.float32)
        a[:] = 2
        pyshm.share_memory_(a)
        view = torch.from_numpy(a)             # zero-copy both ways
        view[0] = 5
        assert a[0] == 5 and pyshm.is_shared(a)
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
