"""pyshm's entry in Dask's "dask.sizeof" entry-point group (pyproject.toml).

Dask loads every entry of that group at the import of ``dask.sizeof``, which ``import dask``
does. pyshm uses it to be imported in every process of distributed (client, scheduler,
nanny, worker) of an environment where it is installed, before the process makes or accepts
its first connection, with no preload to configure: a worker of such an environment installs
pyshm's hooks and says, in the handshake of each of its connections, that it loads pyshm
references (pyshm.engines._announce_references); a worker of an environment without pyshm
says nothing and is sent the bytes.

``distributed`` imports dask first, so in a process that imports ``distributed`` first the
entry runs while ``distributed`` is being imported, and pyshm is imported there. A process
that imports dask first (the ``dask worker`` command, ``from dask.distributed import ...``,
a spawned worker re-running such a script) gets a watch instead: pyshm is imported when
``distributed`` is. A process of dask without distributed (dask.array on its threads, say)
never imports pyshm for it: pyshm would cost it numpy and pyshm's own imports (about 60 ms
here) for nothing; beside distributed, which imports numpy itself, pyshm's import costs
about 15 ms.

This module is installed at the top level, beside the package and outside it, so that
loading the entry point runs no code of pyshm's: Dask lets an error in loading an entry point
through (``import dask`` would fail), but catches and logs an error in calling it. So a pyshm
that cannot be imported (its library missing, a wrong ``PYSHM_LIBRARY``) costs a logged error
("Failed to register sizeof entry point pyshm") or, after the watch, an ``ImportWarning``,
never Dask itself. It registers no sizeof.
"""

import sys
import threading


class _WatchDistributed:
    """A finder on ``sys.meta_path`` that finds nothing: asked for ``distributed`` the first
    time, it imports pyshm (whose own watch then installs the hook for distributed once that
    has run); the finders after it find ``distributed``. It stays on ``sys.meta_path``, inert
    after that: leaving the list while the import system walks it would skip the finder
    after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name != "distributed" or self.done:
            return None
        with self.lock:
            if self.done:
                return None
            self.done = True
        _import_pyshm()
        return None


def _import_pyshm() -> None:
    try:
        import pyshm  # noqa: F401
    except Exception as error:  # (distributed goes on without pyshm's hooks)
        import warnings

        warnings.warn(f"pyshm could not be imported for distributed: {error!r}",
                      ImportWarning, stacklevel=2)


def register(sizeof: object) -> None:
    """Import pyshm in a process of distributed, now or when it imports ``distributed``."""
    if "distributed" in sys.modules:
        import pyshm  # noqa: F401  (an error: Dask logs it)
    elif not any(type(finder).__name__ == "_WatchDistributed" for finder in sys.meta_path):
        sys.meta_path.insert(0, _WatchDistributed())
