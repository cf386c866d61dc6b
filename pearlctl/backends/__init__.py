"""Where allocations come from: a Slurm cluster, or local process groups when there is none.

- ``slurm``: the Slurm backend, a thin adapter from ``Backend`` to ``SlurmClient``;
- ``local``: allocations as process groups on this machine.

Both backends take the same rendered sbatch script and answer with the same :class:`JobRecord`s, so
state, the watcher and the agents do not care which one runs. ``auto`` picks Slurm whenever a
slurmctld answers, and the local backend otherwise.

A request's ``first_task`` sets the first array task index (an elastic pool's added task is a one-task
array ``--array=K``), and ``cancel_tasks`` ends single tasks, so a pool can grow and shrink by one task
(pearlctl.daemon.elastic).
"""

from __future__ import annotations

from typing import Protocol

from pearlctl.slurm.parse import PartitionInfo
from pearlctl.slurm.records import JobRecord
from pearlctl.slurm.script import SubmitRequest


class BackendError(Exception):
    """The scheduler could not do what was asked; the message says what it answered."""


class Backend(Protocol):
    name: str

    def partitions(self) -> dict[str, PartitionInfo]: ...

    def submit(self, req: SubmitRequest, script: str) -> str: ...

    def find_by_name(self, job_name: str) -> list[JobRecord]: ...

    def poll(self, job_ids: list[str]) -> list[JobRecord]: ...

    def cancel(self, job_ids: list[str]) -> None: ...

    def cancel_tasks(self, tasks: list[tuple[str, int]]) -> None:
        """Cancel single array tasks, each ``(job_id, task index)``; the rest of each array keeps running."""
        ...


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
