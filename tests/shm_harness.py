"""Helpers shared by the property tests and the stress test (not a test module).

* resource counts: fds (/proc/self/fd), mappings (/proc/self/maps lines, and memfd ones);
* `settle()`: drop what pyshm legitimately keeps for a while (the memfd recycling pool, the
  sender's keep-alive holds) so that counts can be compared with a baseline;
* `run_in_fork()`: run a risky sequence in a forked child so that a SIGSEGV/SIGBUS or a hang
  fails a test instead of killing (or blocking) pytest;
* byte patterns and the worker loop the processes run (module level: spawn and forkserver
  import it by name).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import traceback
import zlib

import numpy as np

import pyshm


# ---- resource counts ---------------------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # listdir's own fd


def leave_few_fds(free: int) -> int:
    """RLIMIT_NOFILE at the fds open now plus `free` (a program with all but a few fds in
    use: test scripts and Pool initializers). Returns the fds open now."""
    import resource

    open_now = fd_count()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + free, hard))
    return open_now


def maps_lines() -> list:
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


def memfd_maps() -> list:
    return [line for line in maps_lines() if "/memfd:" in line]


HEAP_MAX = 64 << 20  # glibc: a thread's malloc arena lives in a 64 MiB-aligned heap


def _anon(fields: list) -> bool:
    return len(fields) == 5  # no path: anonymous memory


def _span(fields: list) -> tuple:
    lo, hi = fields[0].split("-")
    return int(lo, 16), int(hi, 16)


def outside_malloc_heaps(lines: list) -> list:
    """The mappings that are neither a glibc per-thread malloc heap nor a thread's stack.

    Both come and go with threads, outside pyshm's control:
    * a heap is a 64 MiB-aligned anonymous reservation that glibc grows and shrinks with
      mprotect (so it shows as several lines, its unused tail PROT_NONE up to the next 64 MiB
      boundary) and never unmaps while the process lives; its first line may merge with an
      anonymous mapping just below it, so a heap is also recognised by that tail;
    * a thread stack is a PROT_NONE guard page with an anonymous read-write mapping of
      RLIMIT_STACK bytes right above it; glibc caches a few freed stacks and may make new ones.
    pyshm's own mappings are never inside a heap, and none is a guard page plus a stack.
    """
    import resource

    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack <= 0 or stack == resource.RLIM_INFINITY:
        stack = 8 << 20
    parsed = [(line, line.split()) for line in lines]
    heaps = set()
    for _, fields in parsed:
        if not _anon(fields):
            continue
        lo, hi = _span(fields)
        if lo % HEAP_MAX == 0:
            heaps.add(lo)
        if fields[1].startswith("---") and hi % HEAP_MAX == 0:
            heaps.add(hi - HEAP_MAX)
    skip = set()
    for i, (_, fields) in enumerate(parsed[:-1]):
        above = parsed[i + 1][1]
        if not (_anon(fields) and _anon(above) and fields[1].startswith("---")):
            continue
        lo, hi = _span(fields)
        alo, ahi = _span(above)
        if alo == hi and hi - lo <= 64 << 10 and ahi - alo == stack:
            skip.update((i, i + 1))
    out = []
    for i, (line, fields) in enumerate(parsed):
        if i in skip:
            continue
        if _anon(fields):
            lo, hi = _span(fields)
            if lo - lo % HEAP_MAX in heaps or (hi - 1) - (hi - 1) % HEAP_MAX in heaps:
                continue
        if line.endswith("[heap]"):  # the main arena (brk): split and merged by glibc alone
            continue
        out.append(line)
    return out


def describe_fds() -> list:
    out = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def drop_holds() -> None:
    """Drop the sender's keep-alive holds (as if KEEPALIVE_SECONDS had passed): see settle()."""
    from pyshm import reduction

    reduction._channel.drop_holds()
    gc.collect()


def settle() -> None:
    """Bring the process to a countable state: garbage collected, no kept memfds, no holds.

    The keep-alive holds are documented behaviour (pyshm.reduction: a sender holds memory it
    pickled for KEEPALIVE_SECONDS unless the receiver fetched it; a receiver that already has
    the memfd mapped, e.g. one of its RECENT_SLABS, never fetches): they are dropped here,
    like an expired keep-alive, so that a count taken now does not depend on a 60 s timer.
    """
    for _ in range(3):
        gc.collect()
    drop_holds()
    for _ in range(2):
        gc.collect()
    pyshm.trim_pool()


def counts() -> dict:
    settle()
    lines = maps_lines()
    outside = outside_malloc_heaps(lines)
    return {"fds": fd_count(), "maps": len(lines), "lines": lines, "outside_lines": outside,
            "maps_outside_heaps": len(outside),
            "memfd_maps": sum(1 for line in lines if "/memfd:" in line)}


def diff_counts(before: dict, after: dict, maps_tolerance: int, heaps: bool = False) -> list:
    """Human-readable problems, [] when `after` is back at `before`.

    fds and memfd mappings must not be more than before (fewer is fine: something counted in
    `before` was still on its way out, e.g. memory the fd server was handing out, or a hold a
    receiver's acknowledgement released since). Other mappings may be up to `maps_tolerance`
    more (allocator arenas of Python, numpy and glibc come and go on their own) and any number
    fewer. `heaps`: count only the mappings outside glibc's malloc heaps and thread stacks
    (runs with threads, which may create both)."""
    problems = []
    if after["fds"] > before["fds"]:
        problems.append(f"fd count {before['fds']} -> {after['fds']}: {describe_fds()}")
    if after["memfd_maps"] > before["memfd_maps"]:
        problems.append(
            f"memfd mappings {before['memfd_maps']} -> {after['memfd_maps']}: {memfd_maps()}"
        )
    key = "maps_outside_heaps" if heaps else "maps"
    if after[key] - before[key] > maps_tolerance:
        which = "outside_lines" if heaps else "lines"
        old = set(before.get(which, ()))
        new = [line for line in after.get(which, ()) if line not in old]
        problems.append(f"{key} {before[key]} -> {after[key]} (tolerance "
                        f"{maps_tolerance}); new or changed: {new[:30]}")
    return problems


def forked_sender(send) -> tuple:
    """Fork a child that writes the bytes ``send()`` returns to a pipe, then stays (its fd
    server serving) until released; returns (those bytes, release), release() letting it exit
    and returning its wait status."""
    r, w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.close(done_w)
            os.write(w, send())
            os.close(w)
            os.read(done_r, 1)
        finally:
            os._exit(0)
    os.close(w)
    os.close(done_r)
    with os.fdopen(r, "rb") as f:
        payload = f.read()

    def release() -> int:
        os.write(done_w, b"x")
        os.close(done_w)
        return os.waitpid(pid, 0)[1]

    return payload, release


def start_with_pipe(ctx, target, *args):
    """Start `target(child_end, *args)` in a process of context `ctx`; returns (parent_end,
    process), the child's end already closed here."""
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=target, args=(child_end, *args))
    child.start()
    child_end.close()
    return parent_end, child


@contextlib.contextmanager
def exits_ok(process, seconds: float = 30):
    """Around the use of a started multiprocessing child: it must then exit 0 within
    `seconds`; on any failure (an assertion, a hang) it is killed and joined, so that no
    child is left behind."""
    try:
        yield process
        process.join(seconds)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join()


def userfaultfds() -> dict:
    """This process's userfaultfds: {fd: close-on-exec}."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[userfaultfd]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
        except (OSError, IndexError):
            continue  # (the listing's own fd)
        found[int(name)] = bool(flags & os.O_CLOEXEC)
    return found


def run_without_the_fence(code: str, timeout: float = 180) -> tuple:
    """Run `code` (Python source, dedented; its last line of output one JSON value) in a fresh
    interpreter with LSHM_FENCE=0, where libshm opens no userfaultfd and so sets up no write
    fence; returns (that value, the child's stderr). Fails if the child fails; on a timeout
    its whole process group (its pools' workers too) is killed."""
    env = dict(os.environ, LSHM_FENCE="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:  # (the group is gone already)
            pass
        child.communicate()
        raise
    assert child.returncode == 0, err
    return json.loads(out.splitlines()[-1]), err


def needs_fence() -> None:
    """Skip the calling test where this process has no write fence (no userfaultfd: a kernel
    before 6.4, a seccomp sandbox, LSHM_FENCE=0 in the environment), where pyshm refuses
    (or leaves to the engine) what the test expects it to share."""
    import pytest

    if not userfaultfds():
        pytest.skip("no write fence in this process (no userfaultfd write protection)")


# ---- byte patterns -----------------------------------------------------------------------------


def pattern(seed: int, n: int) -> np.ndarray:
    """n deterministic bytes for `seed` (never all zero for n > 1)."""
    i = np.arange(n, dtype=np.uint32)
    return ((i * 131 + seed * 7 + (i >> 8) * 17 + 1) % 251).astype(np.uint8)


def digest(buf) -> int:
    """crc32 of the bytes of an array (any layout) or bytes-like."""
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1) if buf.size else b""
    return zlib.crc32(memoryview(buf).cast("B") if not isinstance(buf, bytes) else buf)


# ---- running risky code in a child ------------------------------------------------------------


class ChildResult:
    def __init__(self, status: str, code, output: str) -> None:
        self.status = status  # "exit", "signal", "timeout"
        self.code = code  # exit code, signal number or None
        self.output = output

    @property
    def ok(self) -> bool:
        return self.status == "exit" and self.code == 0

    def __repr__(self) -> str:
        what = {
            "exit": f"exit code {self.code}",
            "signal": f"killed by signal {self.code} ({_signame(self.code)})",
            "timeout": "timed out (killed)",
        }[self.status]
        return f"<child {what}: {self.output.strip()[-2000:]!r}>"


def _signame(sig) -> str:
    try:
        return signal.Signals(sig).name
    except (ValueError, TypeError):
        return "?"


def run_in_fork(fn, timeout: float = 20.0) -> ChildResult:
    """Run ``fn()`` in a forked child; its return value (an int, default 0) is the exit code.

    An exception in the child is exit code 99 with the traceback in ``output``; a signal
    (SIGSEGV, SIGBUS, ...) or a hang past ``timeout`` is reported, never propagated.
    ``fn`` may write a message with ``note(text)``.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 98
        try:
            os.close(read_end)
            global _note_fd
            _note_fd = write_end
            result = fn()
            code = 0 if result is None else int(result)
        except BaseException:
            try:
                os.write(write_end, traceback.format_exc().encode()[-4000:])
            except OSError:
                pass
            code = 99
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    deadline = time.monotonic() + timeout
    status = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = ChildResult("timeout", None, b"".join(chunks).decode(errors="replace"))
                break
            ready, _, _ = select.select([read_end], [], [], min(left, 0.05))
            if ready:
                data = os.read(read_end, 65536)
                if data:
                    chunks.append(data)
                    continue
            done, wstatus = os.waitpid(pid, os.WNOHANG)
            if done:
                while True:  # whatever is left in the pipe
                    ready, _, _ = select.select([read_end], [], [], 0)
                    if not ready:
                        break
                    data = os.read(read_end, 65536)
                    if not data:
                        break
                    chunks.append(data)
                out = b"".join(chunks).decode(errors="replace")
                if os.WIFSIGNALED(wstatus):
                    status = ChildResult("signal", os.WTERMSIG(wstatus), out)
                else:
                    status = ChildResult("exit", os.WEXITSTATUS(wstatus), out)
                break
    finally:
        os.close(read_end)
    return status


_note_fd = None


def note(text: str) -> None:
    """From inside a run_in_fork child: send a line of text to the parent's report."""
    if _note_fd is not None:
        os.write(_note_fd, (text + "\n").encode())


def wait_or_kill(pid: int, seconds: float):
    """The wait status of child ``pid`` once it exits, or None if it has not within
    ``seconds`` (it is then SIGKILLed and reaped: a hung child is never left behind)."""
    end = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.01)


# ---- the worker processes ---------------------------------------------------------------------


def seal_attempt(fd) -> str:
    """Try to add F_SEAL_FUTURE_WRITE to a received memfd; 'refused:<errno>' or 'added'."""
    import fcntl

    future_write = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, future_write)
    except OSError as exc:
        return f"refused:{exc.errno}"
    return "added"


def worker_loop(conn) -> None:
    """Serve (tag, obj, crc, write, try_seal) requests on `conn` until None or EOF.

    obj is an ndarray or a pyshm.Storage received through multiprocessing's pickler (so by
    reference). Reply: (tag, crc matches, writeable, seal attempt, wrote). With `write` a byte
    value and a writeable uint8 array, writes it at the array's first element. With `try_seal`,
    first tries to add a write seal to the memfd (an attack: it must be refused).
    """
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # unpickling failed: say so (the parent's test fails)
            try:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            except OSError:
                return
            continue
        if msg is None:
            return
        tag, obj, crc, write, try_seal = msg
        if isinstance(obj, pyshm.Storage):
            array = obj.asarray()
        else:
            array = obj
        ok = digest(array) == crc
        writeable = bool(array.flags.writeable)
        seal = "n/a"
        st = pyshm.storage_of(array)
        if try_seal and st is not None and st.is_shared and writeable:
            seal = seal_attempt(st.fd)
        wrote = False
        if write is not None and writeable and array.dtype == np.uint8 and array.size:
            array[(0,) * array.ndim] = write  # the first element (the sender knows its address)
            wrote = True
        del array, obj, st
        conn.send((tag, ok, writeable, seal, wrote))
