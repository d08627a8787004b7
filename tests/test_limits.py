"""Running into vm.max_map_count, or into a memory cgroup's limit, while sharing: a clean
MemoryError, the array unchanged.

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


# The same limit reached from inside the process, for any user (the sysctl untouched): the
# child maps a run of pages and cuts it into one mapping per page until it has exactly the
# number of mappings asked for, then frees or shares arrays there.
FILL = r"""
import ctypes, gc, os, threading, numpy as np, pyshm

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PAGE = os.sysconf('SC_PAGE_SIZE')
LIMIT = int(open('/proc/sys/vm/max_map_count').read())

def maps():
    # (line by line: at the limit, a big buffer's own mmap would fail)
    with open('/proc/self/maps') as f:
        yield from f

def count():  # (as the kernel counts: [vsyscall] is no mapping of this process)
    return sum(1 for line in maps() if not line.rstrip().endswith('[vsyscall]'))

class Filler:
    # a PROT_READ run whose every other page turns PROT_NONE: two more mappings a page
    def __init__(self):
        self.pages = 2 * LIMIT + 8
        self.base = libc.mmap(None, self.pages * PAGE, 1, 0x22 | 0x4000, -1, 0)  # NORESERVE
        assert self.base not in (None, ctypes.c_void_p(-1).value)
        self.next, self.last_used = 1, False

    def up_to(self, target):
        while True:
            missing = target - count()
            if missing <= 0:
                return missing == 0
            if missing == 1:  # (one more: the run's last page alone, once)
                if self.last_used or \
                        libc.mprotect(self.base + (self.pages - 1) * PAGE, PAGE, 0) != 0:
                    return False
                self.last_used = True
                continue
            for _ in range(max(1, (missing - 2) // 2)):
                if self.next >= self.pages - 3 or \
                        libc.mprotect(self.base + self.next * PAGE, PAGE, 0) != 0:
                    return False
                self.next += 2

    def free(self):
        assert libc.munmap(self.base, self.pages * PAGE) == 0

def shared_over(a):
    lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes
    out = []
    for line in maps():
        start, end = (int(x, 16) for x in line.split()[0].split('-'))
        if start < hi and end > lo and line.split()[1][3] == 's':
            out.append(line)
    return out

def mapped(address):
    return any(int(l.split('-')[0], 16) <= address < int(l.split()[0].split('-')[1], 16)
               for l in maps())

# 1. three arrays side by side (merged into one mapping): the middle one freed at the limit
arrays = [pyshm.empty(4 << 20, np.uint8) for _ in range(3)]
for a in arrays:
    a[:] = 1
middle = arrays[1].ctypes.data
filler = Filler()
assert filler.up_to(LIMIT), 'could not reach the limit'
del arrays[1], a
gc.collect()                       # (before: abort() in lshm__os_unmap)
filler.free()
pyshm.empty(4 << 20, np.uint8)     # a later unmap (its own) unmaps the middle range too
gc.collect()
assert not mapped(middle), 'the middle array was never unmapped'
del arrays

# 1b. more such ranges at once than a fixed list held (64 before): every one unmapped later
arrays = [pyshm.empty(2 << 20, np.uint8) for _ in range(201)]
middles = [a.ctypes.data for a in arrays[1::2]]
filler = Filler()
assert filler.up_to(LIMIT), 'could not reach the limit'
del arrays[1::2]
gc.collect()
assert all(mapped(m) for m in middles), 'the test needs ranges that cannot be unmapped'
filler.free()
pyshm.empty(4 << 20, np.uint8)
gc.collect()
assert not [m for m in middles if mapped(m)], 'ranges never unmapped'
del arrays

# 2. a share at the limit, and 1 to 6 mappings below it: shared, or a MemoryError with the
# array as it was (same address, bytes, private: a forked child's writes are its own)
threading.Thread(target=lambda: None).start()   # (the write fence on)
outcomes = []
for headroom in range(7):
    a = pyshm.empty(16 << 20, np.uint8)
    a[:] = 5
    address = a.ctypes.data
    filler = Filler()
    assert filler.up_to(LIMIT - headroom)
    try:
        pyshm.share_memory_(a)
        outcomes.append('shared')
    except MemoryError as exc:
        outcomes.append('refused')
        assert 'vm.max_map_count' in str(exc), exc
        assert a.ctypes.data == address and not pyshm.is_shared(a)
        assert not shared_over(a), shared_over(a)
        pid = os.fork()
        if pid == 0:
            a[:] = 9
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    assert a.ctypes.data == address and (a == 5).all()
    filler.free()
    if outcomes[-1] == 'refused':  # with room again it works
        pyshm.share_memory_(a)
        assert pyshm.is_shared(a) and (a == 5).all()
    del a
    gc.collect()
print(' '.join(outcomes))
"""


@pytest.mark.parametrize("huge", ["1", "0"])
def test_mappings_at_the_limit_from_inside_the_process(huge):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), LSHM_HUGE=huge)
    done = subprocess.run([sys.executable, "-c", FILL], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = done.stdout.split()
    assert len(outcomes) == 7 and outcomes[0] == "refused", done.stdout


# A memory cgroup (a container's memory limit) smaller than the shared memory asked for: every
# page of a memfd is allocated when it is made, and a memory cgroup that cannot hold them does
# not fail the allocation but runs its OOM killer (before: SIGKILL for the process, or for
# whichever process of the cgroup it picked). Each way in is refused at once, changing nothing.
CGROUP_CHILD = r"""
import errno, os, numpy as np, pyshm

N = 512 << 20  # beyond the cgroup's 256 MiB

def fds():
    return sorted(os.listdir('/proc/self/fd'))

def refused(make):
    try:
        make()
    except MemoryError as exc:
        assert exc.errno == errno.ENOMEM and 'memory cgroup' in str(exc), exc
        return
    raise AssertionError('not refused')

fds_before = fds()
for resizable in (False, True):  # chunked in place; one memfd filled with pwrite
    s = pyshm.Storage(N, resizable=resizable)
    a = s.asarray()
    a[:1 << 20] = 7  # (a few pages touched: the memfd needs all of them)
    address = s.data_ptr
    refused(s.share_memory_)
    assert not s.is_shared and s.data_ptr == address and (a[:1 << 20] == 7).all()
    assert s.resizable == resizable
    del a
    s.close()
refused(lambda: pyshm.empty(N, np.uint8, shared=True))
refused(lambda: pyshm.Storage(N, shared=True))
refused(lambda: pyshm.copy(np.zeros(N, np.uint8), shared=True))  # (calloc: not touched)
assert fds() == fds_before, (fds_before, fds())
small = pyshm.empty(32 << 20, np.uint8)  # what fits is shared as before
small[:] = 3
pyshm.share_memory_(small)
assert pyshm.is_shared(small) and (small == 3).all()
print('ok')
"""


def _memory_cgroup_dir():
    """This process's memory cgroup directory and its limit file's name (v1 or v2), or None."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "/sys/fs/cgroup/memory" + path.rstrip("/"), "memory.limit_in_bytes"
    for line in lines:
        if line.startswith("0::") and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            return "/sys/fs/cgroup" + line[3:].rstrip("/"), "memory.max"
    return None


def _run_in_memory_cgroup(code: str, limit: int) -> subprocess.CompletedProcess:
    """Run `code` in a new Python process inside a new memory cgroup of `limit` bytes, made
    under this process's (skips the test where it cannot be made: not root, no cgroup)."""
    found = _memory_cgroup_dir()
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("needs a writable memory cgroup (root)")
    parent, limit_file = found
    cgroup = os.path.join(parent, f"pyshm-test-{os.getpid()}")
    try:
        os.mkdir(cgroup)
        with open(os.path.join(cgroup, limit_file), "w") as f:
            f.write(str(limit))
    except OSError as exc:
        if os.path.isdir(cgroup):
            os.rmdir(cgroup)
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    procs = os.path.join(cgroup, "cgroup.procs")

    def enter():  # (in the child, before it runs Python)
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("LSHM_POOL_BYTES", None)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=120, preexec_fn=enter)
    finally:
        os.rmdir(cgroup)


def test_shared_memory_beyond_the_memory_cgroups_limit_is_a_memory_error_at_once():
    done = _run_in_memory_cgroup(CGROUP_CHILD, 256 << 20)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout == "ok\n"


# The memfds libshm keeps for reuse (its pool) count against a memory cgroup too: by default
# at most an eighth of the memory the process may use, its cgroup's limit where that is less
# than the machine's RAM (before: an eighth of the machine's RAM, 3 GiB here, so a program
# that shares and drops one array of 64 to 76 MiB at a time in a 512 MiB cgroup was SIGKILLed
# by the cgroup's OOM killer at its sixth, for the memfds kept).
POOL_CHILD = r"""
import numpy as np, pyshm

for k in range(12):
    a = pyshm.empty((64 + k) << 20, np.uint8)
    a[:] = k
    pyshm.share_memory_(a)
    assert (a[::4096] == k).all()
    del a
assert pyshm.trim_pool() <= 1  # (64 MiB: one of them at most)
print('ok')
"""


def test_the_memfds_kept_for_reuse_fit_the_memory_cgroup():
    done = _run_in_memory_cgroup(POOL_CHILD, 512 << 20)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout == "ok\n"
