"""Running into vm.max_map_count while sharing: a clean MemoryError, the array unchanged.

Small arrays shared one every other page split their slab into one mapping per page, the
worst case the README states. The sysctl is lowered for a moment (root only; it is global, so
the window is kept short and the old value is always put back by this process, not by the
child that runs into it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SYSCTL = "/proc/sys/vm/max_map_count"

CHILD = r"""
import os, sys, numpy as np, pyshm

def maps():
    return sum(1 for _ in open('/proc/self/maps'))

page = os.sysconf('SC_PAGE_SIZE')
arrays = [pyshm.empty(page, np.uint8) for _ in range(4096)]   # 4 slabs of pages
for i, a in enumerate(arrays):
    a[:] = i % 251
print(maps(), flush=True)              # the parent now lowers the limit
assert sys.stdin.readline() == 'go\n'
failed = None
for i in range(0, len(arrays), 2):     # every other page: one more mapping each
    a = arrays[i]
    address = a.ctypes.data
    try:
        pyshm.share_memory_(a)
    except MemoryError as exc:
        failed = (i, exc)
        break
print('done', flush=True)              # the parent restores the limit
assert sys.stdin.readline() == 'restored\n'
assert failed is not None, 'never ran into vm.max_map_count'
i, exc = failed
a = arrays[i]
assert 'vm.max_map_count' in str(exc), exc   # (mmap's, or the write fence's, split)
assert a.ctypes.data == address and not pyshm.is_shared(a)
assert (a == i % 251).all() and all((b == j % 251).all() for j, b in enumerate(arrays))
pyshm.share_memory_(a)                 # with room again it works
assert pyshm.is_shared(a) and (a == i % 251).all()
print('ok', i)
"""


@pytest.mark.skipif(not os.access(SYSCTL, os.W_OK), reason="needs root to lower vm.max_map_count")
def test_share_at_max_map_count_is_a_clean_error():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with open(SYSCTL) as f:
        old = f.read().strip()
    try:
        child_maps = int(child.stdout.readline())
        ours = sum(1 for _ in open("/proc/self/maps"))
        # Room for the child to split about 300 pages, and for us to have what we have.
        limit = max(child_maps, ours) + 600
        with open(SYSCTL, "w") as f:
            f.write(str(limit))
        try:
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline()
        finally:
            with open(SYSCTL, "w") as f:
                f.write(old)
        assert line == "done\n", child.stderr.read()[-3000:]
        child.stdin.write("restored\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err[-3000:]
    assert out.startswith("ok"), out
