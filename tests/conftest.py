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
