"""The Slurm backend: a thin adapter from the Backend protocol to :class:`SlurmClient`."""

from __future__ import annotations

from pearlctl.backends.base import BackendError
from pearlctl.slurm.client import SlurmClient, SlurmError
from pearlctl.slurm.parse import ParseError, PartitionInfo
from pearlctl.slurm.records import JobRecord
from pearlctl.slurm.script import SubmitRequest


class SlurmBackend:
    name = "slurm"

    def __init__(self, client: SlurmClient | None = None):
        self.client = client or SlurmClient()

    @staticmethod
    def reachable() -> bool:
        return SlurmClient.answers()

    def _call(self, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except (SlurmError, ParseError) as exc:
            raise BackendError(str(exc)) from exc

    def partitions(self) -> dict[str, PartitionInfo]:
        return self._call(self.client.partitions)

    def submit(self, req: SubmitRequest, script: str) -> str:
        return self._call(self.client.submit, script, workdir=req.run_dir)

    def find_by_name(self, job_name: str) -> list[JobRecord]:
        return self._call(self.client.find_by_name, job_name)

    def poll(self, job_ids: list[str]) -> list[JobRecord]:
        return self._call(self.client.poll, job_ids)

    def cancel(self, job_ids: list[str]) -> None:
        self._call(self.client.cancel, job_ids)

    def cancel_tasks(self, tasks: list[tuple[str, int]]) -> None:
        self._call(self.client.cancel_tasks, tasks)
