"""What every backend is: the ``Backend`` protocol and the error it raises (imported by the backends and, through
the package, by everybody else)."""

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
