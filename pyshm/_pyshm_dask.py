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
a spawned worker re-running such a script) gets a watch instead: pyshm is imported just
before ``distributed`` runs. A process of dask without distributed (dask.array on its threads, say)
never imports pyshm for it: pyshm would cost it numpy and pyshm's own imports (about 60 ms
here) for nothing; beside distributed, which imports numpy itself, pyshm's import costs
about 15 ms.

This module is installed at the top level, beside the package and outside it, so that
loading the entry point runs no code of pyshm's: Dask lets an error in loading an entry point
through (``import dask`` would fail), but catches and logs an error in calling it. So a pyshm
that cannot be imported (its library missing, a wrong ``PYSHM_LIBRARY``) costs a logged error
("Failed to register sizeof entry point pyshm") or, after the watch, a ``RuntimeWarning``,
never Dask itself. It registers no sizeof.
"""

import sys
import threading


class WrappedLoader:
    """A module's real loader, which also runs ``before`` and ``after`` (given the module)
    around the module's code; everything else (resource readers, is_package, get_code...) is
    the real loader's. (pyshm.engines wraps the engines' loaders with it too.)"""

    def __init__(self, loader, before=None, after=None) -> None:
        self.loader, self.before, self.after = loader, before, after

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def exec_module(self, module) -> None:
        if self.before is not None:
            self.before(module)
        self.loader.exec_module(module)
        if self.after is not None:
            self.after(module)


_asking = threading.local()  # (.askers: the finders asking the others now, on this thread)


def spec_from_the_others(asker, name, path, target, wrap):
    """The spec that the finders on ``sys.meta_path`` other than ``asker`` give for
    ``name``, its loader wrapped by ``wrap``; None if none finds it, or if ``asker`` is asking
    already on this thread (a finder after it, one like it, asked it back)."""
    askers = getattr(_asking, "askers", None)
    if askers is None:
        askers = _asking.askers = set()
    if id(asker) in askers:
        return None
    askers.add(id(asker))
    try:
        for finder in list(sys.meta_path):
            if finder is asker or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = wrap(spec.loader)
                return spec
        return None
    finally:
        askers.discard(id(asker))


class _WatchDistributed:
    """A finder on ``sys.meta_path`` that finds ``distributed``, until it has run, through the
    finders after it, with a loader that imports pyshm before it runs ``distributed`` (maybe
    waiting for another thread's import of pyshm to end) and asks pyshm for its hooks again
    after (a thread that imported pyshm meanwhile may have looked at distributed's modules
    half-run). A ``find_spec`` alone (``importlib.util.find_spec("distributed")``, a library
    asking whether distributed is there) does not end the watch. Nothing is imported in
    ``find_spec`` itself: the import system calls finders under its global lock, and an
    import there would wait, under that lock, on a module that another thread is importing
    (which waits for that lock). It stays on ``sys.meta_path``, inert after that: leaving the
    list while the import system walks it would skip the finder after it."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name != "distributed" or self.done:
            return None
        return spec_from_the_others(self, name, path, target, lambda loader: WrappedLoader(
            loader, before=self.before, after=_hooks_again))

    def before(self, module) -> None:
        self.done = True
        _import_pyshm()


def _hooks_again(module) -> None:
    engines = getattr(sys.modules.get("pyshm"), "engines", None)
    if engines is not None:
        engines.install()


def _import_pyshm() -> None:
    try:
        import pyshm  # noqa: F401
    except Exception as error:  # (distributed goes on without pyshm's hooks)
        import warnings

        warnings.warn(f"pyshm could not be imported for distributed, whose processes will "
                      f"send each other copies of pyshm arrays: {error!r}", RuntimeWarning,
                      stacklevel=2)


def register(sizeof: object) -> None:
    """Import pyshm in a process of distributed, now or when it imports ``distributed``."""
    if "distributed" in sys.modules:
        import pyshm  # noqa: F401  (an error: Dask logs it)
    # (by name: pyshm._pyshm_dask's class is another than this top-level copy's)
    elif not any(type(finder).__name__ == "_WatchDistributed" for finder in sys.meta_path):
        sys.meta_path.insert(0, _WatchDistributed())
