"""A program that uses pyshm exits with its own exit code and an empty stderr, whatever pyshm
objects are alive at its exit (in module globals, in cycles, in a daemon thread still
running, received from processes, some of them killed), and leaves no process behind."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest


def _run(path, script: str, *args: str, flags: tuple = ()) -> subprocess.CompletedProcess:
    """Run `script` as the file `path` (a file: spawn's children import its functions)."""
    path.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, *flags, str(path), *args], capture_output=True,
                          text=True, timeout=60, check=False)


def _left_running(pids: list, seconds: float = 5.0) -> list:
    """Those of `pids` still running (not exited, nor a zombie) after up to `seconds`."""
    end = time.monotonic() + seconds
    while True:
        running = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue  # gone
            if state not in ("Z", "X"):
                running.append(pid)
        if not running or time.monotonic() > end:
            return running
        time.sleep(0.02)


# Every kind of pyshm object: arrays, views, storages, arenas (a recording one mid-iteration),
# memory received (pickled for multiprocessing, unpickled here), refs and read-only memory.
_OBJECTS = """
import pickle, numpy as np, pyshm
from multiprocessing.reduction import ForkingPickler

def every_kind():
    k = [pyshm.empty(100, shared=True), pyshm.empty(5), pyshm.empty(10**6), pyshm.zeros(9)[1:]]
    a = pyshm.empty(1000); pyshm.share_memory_(a); k += [a, a[::2]]
    k += [pyshm.Storage(64), pyshm.Storage(10**5, shared=True), pyshm.Storage(10, resizable=True)]
    k += [pyshm.Storage(100).asarray(), pyshm.storage_of(pyshm.empty(64, shared=True))]
    private = pyshm.Arena([100, 200], [0, 1], [1, 2]).allocate()
    shared = pyshm.Arena([100, 200], [0, 1], [1, 2], shared=True).allocate()
    k += [private, private.array(0), shared, shared.array(1)]
    recording = pyshm.Arena.recording(shared=True)
    x = recording.empty(10); recording.free(x); del x; recording.end_iteration()
    plain = pyshm.Arena.recording()
    k += [recording, recording.empty(10), plain, plain.empty(30)]
    k += [pyshm.ref(pyshm.empty(300)), pyshm.share_readonly(pyshm.empty(5000))]
    k += [pickle.loads(pickle.dumps(pyshm.ref(pyshm.empty(20, shared=True))))]
    k += [ForkingPickler.loads(bytes(ForkingPickler.dumps(pyshm.empty(7000, shared=True))))]
    return k
"""


def test_objects_that_outlive_pyshms_modules_at_exit_print_nothing(tmp_path):
    # At exit CPython wipes the globals of modules still alive (sets them to None) and only
    # then frees what modules wiped after them hold. Here pyshm's modules outlive their
    # sys.modules entries, and numpy (imported before them: wiped after them) holds pyshm
    # objects: their weak reference callbacks (pyshm._memory.released, _lifetime_ended) ran
    # on wiped globals and printed "Exception ignored ... 'NoneType' object has no attribute
    # 'pop'" for every object
    done = _run(tmp_path / "wiped.py", _OBJECTS + """
import sys
sys.kept_modules = [m for name, m in sys.modules.items() if name.startswith("pyshm")]
np.kept = every_kind()
""", flags=("-X", "dev"))
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("flags", [(), ("-X", "dev"), ("-W", "error")], ids=str)
@pytest.mark.parametrize("end", ["return", "sys.exit"])
def test_a_program_exits_cleanly_whatever_pyshm_objects_are_alive(tmp_path, flags, end):
    # alive at exit: every kind of object in globals and in a cycle, and a daemon thread
    # still sharing, replanning and pickling
    done = _run(tmp_path / "alive.py", _OBJECTS + """
import sys, threading, time
kept = every_kind()
cycle = [every_kind()]; cycle.append(cycle); del cycle

def busy():
    arena = pyshm.Arena.recording(shared=True)
    while True:
        a = pyshm.empty(1 << 16); pyshm.share_memory_(a)
        xs = [arena.empty(100) for _ in range(3)]
        for x in xs:
            arena.free(x)
        del xs; arena.end_iteration()
        ForkingPickler.loads(bytes(ForkingPickler.dumps(pyshm.empty(5000, shared=True))))
        pyshm.Storage(100, resizable=True).resize_(200)

thread = threading.Thread(target=busy, daemon=True)
thread.start()
for _ in range(20):
    time.sleep(0.01) if thread.is_alive() else sys.exit("the busy thread died")
print("done", flush=True)
if sys.argv[1] == "sys.exit":
    sys.exit(0)
""", end, flags=flags)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "done\n")


_POOL = """
import json, multiprocessing as mp, os, signal, sys
import numpy as np, pyshm

def make(n):
    a = pyshm.zeros(n, np.uint8, shared=True)
    a[:] = 5
    return [a, pyshm.empty(n), pyshm.Storage(64, shared=True)]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    with ctx.Pool(2) as pool:
        kept = pool.map(make, [10, 1 << 20])  # alive at exit, in globals
        echo = pool.map(np.asarray, [pyshm.empty(100, shared=True), pyshm.empty(1 << 17)])
        # a worker killed right after it sent its result: it comes as the array, or as a
        # pyshm.Undelivered when the worker was gone before this process fetched its memfd
        first = pool.apply_async(make, (1 << 20,))
        killed = pool.apply_async(die)
        late = first.get(timeout=30)
        again = pool.apply(make, (100,))  # the pool goes on
        assert (kept[1][0] == 5).all() and (again[0] == 5).all()
        pids = [p.pid for p in mp.active_children()]
    if sys.argv[1] == "forkserver":
        from multiprocessing import forkserver
        pids.append(forkserver._forkserver._forkserver_pid)  # (it goes with this process)
    print(json.dumps(pids), flush=True)
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_arrays_from_pool_workers_alive_at_exit(tmp_path, method):
    done = _run(tmp_path / "pool.py", _POOL, method, flags=("-X", "dev"))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    assert _left_running(json.loads(done.stdout)) == []


_FORK = """
import os, sys, threading, numpy as np, pyshm
from multiprocessing.reduction import ForkingPickler

private = pyshm.empty(1 << 20, np.uint8); private[:] = 1
shared = pyshm.empty(1 << 20, np.uint8, shared=True); shared[:] = 2
small = pyshm.empty(100, np.uint8, shared=True); small[:] = 3
unshared = pyshm.empty(1 << 16, np.uint8); unshared[:] = 4
storage = pyshm.Storage(1 << 16, resizable=True)
arena = pyshm.Arena.recording(); tensor = arena.empty(1000, np.uint8); tensor[:] = 5
received = ForkingPickler.loads(bytes(ForkingPickler.dumps(pyshm.empty(5000, shared=True))))
ref = pyshm.ref(pyshm.empty(7000, np.uint8))
threading.Thread(target=lambda: None).start()  # (a second thread was: the write fence is on)
pid = os.fork()
if pid == 0:
    private[:] = 9; unshared[:] = 9; tensor[:] = 9; shared[0] = 8
    pyshm.share_memory_(unshared); pyshm.share_memory_(private)
    mine = [pyshm.empty(1 << 20, shared=True), pyshm.Storage(100), arena.empty(10)]
    storage.resize_(1 << 17)
    if sys.argv[1] == "os._exit":
        os._exit(0)
    if sys.argv[1] == "sys.exit":
        sys.exit(0)
else:  # (the child returning ends here too: a normal exit)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (private == 1).all() and (unshared == 4).all() and (tensor == 5).all()
    assert shared[0] == 8 and (shared[1:] == 2).all() and (small == 3).all()
    assert not pyshm.is_shared(private) and not pyshm.is_shared(unshared)
    pyshm.share_memory_(unshared); storage.resize_(1 << 18)
    arena.free(tensor); del tensor; arena.end_iteration()
    print("intact", flush=True)
"""


@pytest.mark.parametrize("end", ["os._exit", "sys.exit", "return"])
def test_a_forked_child_that_exits_leaves_its_parents_memory_intact(tmp_path, end):
    done = _run(tmp_path / "fork.py", _FORK, end, flags=("-X", "dev"))
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "intact\n")
