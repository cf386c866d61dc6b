"""The typed Slurm client: the only code in pearlctl that runs sbatch, squeue, scontrol, scancel,
sacct or sinfo.

Guarantees:
- every command is a list argv with a timeout, through the injected :class:`CommandRunner`;
- :meth:`SlurmClient.poll` costs one ``squeue --json`` per call, whatever the number of jobs, plus at
  most one ``sacct`` (accounting on) or one ``scontrol show job`` (accounting off) for jobs that have
  left the queue — admins ban tools that call slurmctld once per job;
- 22.05's ``squeue --json`` ignores filters, so filtering happens here, in Python;
- errors name the command and what Slurm said.
"""

from __future__ import annotations

import logging
import shutil

from pearlctl.slurm.parse import (
    SACCT_FIELDS,
    SINFO_FORMAT,
    PartitionConfig,
    PartitionInfo,
    parse_sacct,
    parse_sbatch_parsable,
    parse_scontrol_config,
    parse_scontrol_jobs,
    parse_scontrol_partitions,
    parse_sinfo,
    parse_squeue_json,
)
from pearlctl.slurm.records import JobRecord
from pearlctl.slurm.runner import (
    CommandNotFound,
    CommandResult,
    CommandRunner,
    CommandTimeout,
    SubprocessRunner,
)

log = logging.getLogger(__name__)

ACCOUNTING_DISABLED = "accounting storage is disabled"


class SlurmError(Exception):
    """A Slurm command failed or could not be run. ``str()`` says which and what Slurm printed."""


class SlurmNotConfigured(SlurmError):
    """A Slurm command found no configuration: no SLURM_CONF, no slurm.conf where Slurm looks for one, no DNS
    SRV record of a configless slurmctld. ``said`` is what the command printed."""

    def __init__(self, message: str, said: str):
        super().__init__(message)
        self.said = said


# What Slurm clients print when they find no configuration at all (22.05: DNS SRV lookup, then fatal).
NO_CONFIG_MARKERS = ("Could not establish a configuration source", "DNS SRV lookup failed", "resolve_ctls_from_dns_srv")


# How long one Slurm command may take by default (the daemon's lease outlives it: pearlctl.daemon.main).
DEFAULT_TIMEOUT_S = 30.0


class SlurmClient:
    def __init__(self, runner: CommandRunner | None = None, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.runner = runner or SubprocessRunner()
        self.timeout = timeout
        self._accounting: bool | None = None

    # -- plumbing --
    def _run(self, argv: list[str], *, input: str | None = None, ok_codes=(0,)) -> CommandResult:
        try:
            result = self.runner.run(argv, timeout=self.timeout, input=input)
        except (CommandNotFound, CommandTimeout) as exc:
            raise SlurmError(str(exc)) from exc
        if result.returncode not in ok_codes:
            said = (result.stderr or result.stdout).strip()
            message = f"{' '.join(argv)} exited {result.returncode}: {said}"
            if any(marker in said for marker in NO_CONFIG_MARKERS):
                raise SlurmNotConfigured(message, said)
            raise SlurmError(message)
        return result

    @staticmethod
    def installed() -> bool:
        return shutil.which("sbatch") is not None and shutil.which("squeue") is not None

    @classmethod
    def answers(cls) -> bool:
        """Whether Slurm is installed and a slurmctld answers here (``scontrol ping``): how ``auto`` picks Slurm."""
        if not cls.installed():
            return False
        try:
            cls(timeout=10).ping()
            return True
        except SlurmError:
            return False

    # -- cluster facts --
    def version(self) -> str:
        return self._run(["scontrol", "--version"]).stdout.strip()

    def ping(self) -> str:
        """`scontrol ping`: raises SlurmError unless a slurmctld answers."""
        out = self._run(["scontrol", "ping"]).stdout.strip()
        if "UP" not in out:
            raise SlurmError(f"slurmctld is not up: {out}")
        return out

    def partitions(self) -> dict[str, PartitionInfo]:
        return parse_sinfo(self._run(["sinfo", "-h", "-o", SINFO_FORMAT]).stdout)

    def config(self) -> dict[str, str]:
        """`scontrol show config`: the running slurmctld's settings (PreemptType, PreemptMode, ...)."""
        return parse_scontrol_config(self._run(["scontrol", "show", "config"]).stdout)

    def partition_configs(self) -> list[PartitionConfig]:
        """`scontrol show partition -o`: each partition's PreemptMode, GraceTime and PriorityTier."""
        return parse_scontrol_partitions(self._run(["scontrol", "show", "partition", "-o"]).stdout)

    def accounting_enabled(self) -> bool:
        """Whether sacct works here (slurmdbd configured). Asked once per client."""
        if self._accounting is None:
            try:
                result = self.runner.run(["sacct", "-n", "-X", "-j", "1"], timeout=self.timeout)
                said = (result.stderr + result.stdout).lower()
                self._accounting = result.returncode == 0 and ACCOUNTING_DISABLED not in said
            except (CommandNotFound, CommandTimeout):
                self._accounting = False
        return self._accounting

    # -- jobs --
    def submit(self, script: str, *, workdir: str) -> str:
        """Submit a batch script given as text (sbatch reads it from stdin); returns the job id."""
        result = self._run(["sbatch", "--parsable", f"--chdir={workdir}"], input=script)
        return parse_sbatch_parsable(result.stdout)

    def queue(self) -> list[JobRecord]:
        """Every job slurmctld still holds, from one `squeue --json`."""
        return parse_squeue_json(self._run(["squeue", "--json"]).stdout)

    def find_by_name(self, name: str) -> list[JobRecord]:
        """Jobs whose name is exactly ``name`` (used to adopt the jobs of a launch that crashed)."""
        return [r for r in self.queue() if r.name == name]

    def poll(self, job_ids: list[str]) -> list[JobRecord]:
        """Records for every task of the given (array) job ids: one batched query, plus one for the gone.

        A pending array appears in squeue as one record with a range of task ids; it is returned as is
        (``pending_tasks``) and the caller spreads it over its tasks.
        """
        wanted = {str(j) for j in job_ids}
        if not wanted:
            return []
        records = [r for r in self.queue() if r.job_id in wanted]
        seen = {r.job_id for r in records}
        gone = sorted(wanted - seen)
        if gone:
            records.extend(self._finished(gone))
        return records

    def _finished(self, job_ids: list[str]) -> list[JobRecord]:
        """Final records of jobs no longer in squeue: sacct if accounting is on, else scontrol.

        scontrol keeps finished jobs for MinJobAge (300 s by default); after that, without
        accounting, a job that left the queue is simply unknown and the watcher marks it LOST.
        """
        if self.accounting_enabled():
            argv = ["sacct", "-X", "-n", "-P", f"--format={','.join(SACCT_FIELDS)}", "-j", ",".join(job_ids)]
            return parse_sacct(self._run(argv).stdout)
        result = self._run(["scontrol", "show", "job", "-d", "-o"], ok_codes=(0, 1))
        wanted = set(job_ids)
        return [r for r in parse_scontrol_jobs(result.stdout) if r.job_id in wanted]

    def cancel(self, job_ids: list[str], *, signal: str | None = None) -> None:
        """One scancel for all ids. Cancelling a job that already ended is not an error."""
        if not job_ids:
            return
        argv = ["scancel"] + ([f"--signal={signal}"] if signal else []) + [str(j) for j in job_ids]
        result = self._run(argv, ok_codes=(0, 1))
        if result.returncode == 1 and "Invalid job id" not in result.stderr:
            raise SlurmError(f"{' '.join(argv)} exited 1: {result.stderr.strip()}")

    def cancel_tasks(self, tasks: list[tuple[str, int]]) -> None:
        """One scancel for single array tasks (``scancel 123_4 125_7``): the rest of each array keeps
        running. Cancelling a task that already ended is not an error."""
        if not tasks:
            return
        argv = ["scancel"] + [f"{job_id}_{task}" for job_id, task in tasks]
        result = self._run(argv, ok_codes=(0, 1))
        if result.returncode == 1 and "Invalid job id" not in result.stderr:
            raise SlurmError(f"{' '.join(argv)} exited 1: {result.stderr.strip()}")
