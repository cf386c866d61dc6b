"""Where allocations come from: a Slurm cluster, or local process groups when there is none.

- ``slurm``: the Slurm backend, a thin adapter from ``Backend`` to ``SlurmClient``;
- ``local``: allocations as process groups on this machine;
- ``base``: the ``Backend`` protocol and ``BackendError``.

Both backends take the same rendered sbatch script and answer with the same :class:`JobRecord`s, so
state, the watcher and the agents do not care which one runs. ``auto`` picks Slurm whenever a
slurmctld answers, and the local backend otherwise.

A request's ``first_task`` sets the first array task index (an elastic pool's added task is a one-task
array ``--array=K``), and ``cancel_tasks`` ends single tasks, so a pool can grow and shrink by one task
(pearlctl.daemon.elastic).
"""

from __future__ import annotations

from pearlctl.backends.base import Backend, BackendError

__all__ = ["Backend", "BackendError", "open_backend"]


def open_backend(name: str, *, state_dir: str) -> Backend:
    """``slurm``, ``local`` or ``auto`` (Slurm when a slurmctld answers, else local)."""
    from pearlctl.backends.local import LocalBackend
    from pearlctl.backends.slurm import SlurmBackend

    if name == "auto":
        name = "slurm" if SlurmBackend.reachable() else "local"
    if name == "slurm":
        return SlurmBackend()
    if name == "local":
        return LocalBackend(state_dir)
    raise BackendError(f"unknown backend {name!r}; valid: auto, slurm, local")
