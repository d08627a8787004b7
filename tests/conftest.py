"""Test set-up: always test the *installed* pyshm, never the source folder.

`python -m pytest` puts the current directory on sys.path, where the source `pyshm/` has no
compiled library; drop the repository root so `import pyshm` finds the installed package
(a regular or editable install). With PYSHM_LIBRARY pointing at a built liblshm.so, the source
folder works as it is and is left on the path.
"""

import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYSHM_LIBRARY"):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
    # The same for the Python subprocesses tests start (`python -c ...` in the repository
    # root would otherwise import the source folder): Python 3.11+ then leaves cwd off sys.path.
    os.environ["PYTHONSAFEPATH"] = "1"

# A run started where SIGINT is ignored (a background job of a non-interactive shell, nohup,
# some CI runners) passes that to every process it starts, and Python then raises no
# KeyboardInterrupt: the tests of Ctrl-C (a SIGINT the test sends) would see nothing. Python's
# own handler here makes the processes the tests start get the default again at their exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def open_fds() -> set:
    """The fds open in this process right now (entries of /proc/self/fd)."""
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_fd_leak():
    """Fail the test when it leaves more fds open than it found."""
    before = open_fds()
    yield
    import gc

    gc.collect()
    leaked = open_fds() - before
    # listdir's own fd may show in either set; anything else is a leak
    leaked = {fd for fd in leaked if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked, f"leaked fds: {sorted(leaked)}: " + ", ".join(
        os.readlink(f"/proc/self/fd/{fd}") for fd in sorted(leaked)
    )


def memfd_held(inode: int) -> list:
    """This process's fds and mappings of the memfd of that inode."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino == inode:
                held.append(f"fd {fd}")
        except OSError:
            pass  # (listdir's own fd, closed since)
    with open("/proc/self/maps") as maps:
        held += [line for line in maps if len(line.split()) > 5 and line.split()[4] == str(inode)]
    return held


def held_after_a_release(inode: int) -> list:
    """memfd_held(inode) after one release (a Storage closed): a release cut off by an
    interrupt in a weak reference callback is made up for at the next one (pyshm._memory
    DIED, KEYED)."""
    import pyshm

    pyshm.Storage(4096).close()
    return memfd_held(inode)


def interrupted_at(point: int, action, wrappers=()) -> bool:
    """Run ``action()`` with a KeyboardInterrupt at its `point`-th interrupt point (1, 2...):
    True if it had that many (the interrupt came; the action may have swallowed it, as a
    weak reference callback does), False if it ended first (no interrupt).

    A signal handler that raises (Ctrl-C) runs where CPython checks for signals: at the entry
    of a Python function and right after a call returns. A profile function stands for it
    there: it raises at a "call" event (the function fails before its first line), at a
    "return" or "c_return" event (the caller gets the exception instead of the result).
    ``wrappers``: Python functions standing for C functions (ctypes calls, which have no
    events of their own): only their return is an interrupt point, not their entry."""
    codes = {wrapper.__code__ for wrapper in wrappers}
    seen = 0

    def profile(frame, event, arg):
        nonlocal seen
        if event == "c_call" or event == "c_exception" or (
                event == "call" and frame.f_code in codes):
            return
        seen += 1
        if seen == point:
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        action()
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    return seen >= point


def after_c_calls(monkeypatch, lib, *names) -> list:
    """Wrap `lib`'s ctypes functions `names` in Python functions (see interrupted_at), so
    that an interrupt can come right after each returns; returns the wrappers."""
    wrappers = []
    for name in names:
        def wrapper(*args, _c_function=getattr(lib, name)):
            return _c_function(*args)

        monkeypatch.setattr(lib, name, wrapper)
        wrappers.append(wrapper)
    return wrappers
