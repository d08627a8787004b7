"""pyshm's entry in Dask's "dask.sizeof" entry-point group (pyproject.toml).

Dask loads every entry of that group at the import of ``dask.sizeof``, which ``import dask``
does. A Dask worker, nanny or scheduler imports ``distributed`` first, and ``distributed``
imports dask: so in such a process this entry runs while ``distributed`` is being imported,
before the process makes or accepts its first connection, and it imports pyshm there, with no
preload to configure. A worker of an environment with pyshm then installs pyshm's hooks and
says, in the handshake of each of its connections, that it loads pyshm references
(pyshm.engines._announce_references); a worker of an environment without pyshm says nothing
and is sent the bytes. A process that imports dask without distributed (dask.array on its
threads, say) does not import pyshm for it: pyshm would cost it numpy and pyshm's own imports
(about 60 ms here) for nothing; against distributed, which imports numpy itself, pyshm's
import costs about 15 ms. (A client that imported dask before distributed announces once it
imports pyshm itself, as any client sending pyshm arrays has; until then it is sent copies.)

This module is installed at the top level, beside the package and outside it, so that
loading the entry point runs no code of pyshm's: Dask lets an error in loading an entry point
through (``import dask`` would fail), but catches and logs an error in calling it. So a pyshm
that cannot be imported (its library missing, a wrong ``PYSHM_LIBRARY``) costs a logged error
("Failed to register sizeof entry point pyshm"), never Dask itself. It registers no sizeof.
"""


def register(sizeof: object) -> None:
    """Import pyshm in a process of distributed (its import installs the hooks of the engines
    imported by then, and watches for the rest)."""
    import sys

    if "distributed" in sys.modules:
        import pyshm  # noqa: F401
