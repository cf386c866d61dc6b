"""Short Python functions run on a compute node for a value, through submitit: ``pearlctl profile --slurm``
(profile an engine on a GPU node) and ``pearlctl simulate --sweep`` (a job array of simulator runs).

This module is the only one that imports submitit (ruff's banned-API rule). It is generic: it runs a
callable that pickles (a function of an importable module, with picklable arguments) and returns its value;
it knows nothing of profiles or scenarios. Long-lived pools and the daemon's job stay plain sbatch scripts
(docs/architecture.md, "Pools are sbatch scripts; functions go through submitit").

Executors: ``slurm`` (submitit's SlurmExecutor: one ``sbatch`` per function, one ``sbatch --array`` for a
map), ``local`` (submitit's LocalExecutor: a process per function on this machine, at most one per CPU at a
time), ``auto`` (slurm when a slurmctld answers, else local — as a run spec's ``backend = "auto"``).

Waiting: submitit's own watcher (``SlurmJob.watcher``) calls ``sacct`` 2, 4, 8, ... s after each submission
and then every min(600 s, half the time since the last submission). It is not used here: the wait loop
looks for each task's result file once a second (the shared filesystem, no Slurm call) and asks Slurm once
per ``poll_interval_s`` (default 5 s) with pearlctl's one batched poll (``SlurmClient.poll``: one
``squeue --json``, plus one ``sacct`` for tasks that left the queue) for the whole array, to notice a task
that ended without a result (failed, cancelled, timed out, node failure). A task that ended without a
result file after ``RESULT_GRACE_S`` is a failure naming its state and log.

The folder holds the pickled function and arguments, the results and the logs; on Slurm it must be on a
filesystem the compute nodes see. Callers remove it after reading the results (``remove``) or keep it.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from pearlctl.config import time_limit_seconds
from pearlctl.slurm.client import SlurmClient, SlurmError
from pearlctl.slurm.records import JobPhase, phase_of
from pearlctl.vocabulary import POLL_INTERVAL_S

EXECUTORS = ("auto", "slurm", "local")
RESULT_GRACE_S = 15.0  # a task Slurm reports ended may still be writing its result on a slow filesystem
LOG_TAIL_LINES = 30


class FunctionError(Exception):
    """A function could not be submitted, or its job ended without a value. ``scheduler``: Slurm refused or
    lost it (submission, TIMEOUT, NODE_FAIL, ...), rather than the function raising on the node."""

    def __init__(self, message: str, *, folder: Path | None = None, scheduler: bool = True):
        super().__init__(message)
        self.folder = folder
        self.scheduler = scheduler


@dataclass(frozen=True)
class Resources:
    """What each function's job asks for. ``time_limit`` is a Slurm ``--time`` value (minutes, M:S, H:M:S,
    D-H...), checked by the caller (pearlctl.config.slurm_option_problems)."""

    job_name: str
    time_limit: str = "60"
    partition: str | None = None
    nodelist: str | None = None
    gpus: int = 0
    cpus: int = 1


@dataclass
class Ran:
    """Where and how the functions ran: the executor, the Slurm job id (an array's id) or local pids, the
    folder, and each task's final state as last seen."""

    executor: str
    job_id: str
    folder: Path
    tasks: list[str] = field(default_factory=list)


def slurm_answers() -> bool:
    """Whether a slurmctld answers here, as ``backend = "auto"`` decides (``SlurmClient.answers``)."""
    return SlurmClient.answers()


def resolve_executor(name: str) -> str:
    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; valid: {', '.join(EXECUTORS)}")
    if name == "auto":
        return "slurm" if slurm_answers() else "local"
    return name


def _minutes(time_limit: str) -> int | None:
    seconds = time_limit_seconds(time_limit)
    return None if seconds is None else max(1, math.ceil(seconds / 60))


def _executor(kind: str, folder: Path, res: Resources):
    minutes = _minutes(res.time_limit)
    if kind == "slurm":
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
        params: dict[str, Any] = {"job_name": res.job_name, "cpus_per_task": res.cpus, "stderr_to_stdout": True}
        # submitit tells a timeout from a preemption by this value (a preempted task is requeued, a timed-out
        # one ends); UNLIMITED goes to sbatch as such, with a value submitit can compare against
        params["time"] = minutes if minutes is not None else 10**6
        if minutes is None:
            params["additional_parameters"] = {"time": "UNLIMITED"}
        if res.partition:
            params["partition"] = res.partition
        if res.nodelist:
            params["nodelist"] = res.nodelist
        if res.gpus:
            params["gres"] = f"gpu:{res.gpus}"
        ex.update_parameters(**params)
        return ex
    ex = submitit.LocalExecutor(folder=folder, max_num_timeout=0)
    ex.update_parameters(timeout_min=minutes or 7 * 24 * 60, gpus_per_node=res.gpus, cpus_per_task=res.cpus)
    return ex


def run(
    fn: Callable[..., Any],
    *args: Any,
    executor: str,
    folder: Path,
    resources: Resources,
    poll_interval_s: float = POLL_INTERVAL_S,
    progress: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> tuple[Any, Ran]:
    """``fn(*args, **kwargs)`` in one job; returns its value and where it ran."""
    values, ran = _run_all(fn, [(args, kwargs)], executor, folder, resources, poll_interval_s, progress)
    return values[0], ran


def map_array(
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    *,
    executor: str,
    folder: Path,
    resources: Resources,
    poll_interval_s: float = POLL_INTERVAL_S,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Any], Ran]:
    """``[fn(item) for item in items]``, one task each: on Slurm one job array (``executor.map_array``),
    locally at most one process per CPU at a time. Values keep the order of ``items``."""
    calls = [((item,), {}) for item in items]
    return _run_all(fn, calls, executor, folder, resources, poll_interval_s, progress)


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _run_all(fn, calls, executor, folder, res, poll_interval_s, progress) -> tuple[list[Any], Ran]:
    kind = resolve_executor(executor)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        ex = _executor(kind, folder, res)
    except RuntimeError as exc:  # SlurmExecutor without srun
        raise FunctionError(f"cannot use the slurm executor: {exc}", folder=folder) from None
    if kind == "slurm":
        return _run_slurm(ex, fn, calls, folder, poll_interval_s, progress)
    return _run_local(ex, fn, calls, folder, progress)


def _submit_slurm(ex, fn, calls, folder: Path) -> list:
    try:
        if len(calls) == 1:
            args, kwargs = calls[0]
            return [ex.submit(fn, *args, **kwargs)]
        return ex.map_array(fn, [args[0] for args, _ in calls])
    except Exception as exc:  # submitit raises its own FailedJobError / CalledProcessError for sbatch
        raise FunctionError(f"sbatch refused the function job: {exc}", folder=folder) from None


def _run_slurm(ex, fn, calls, folder: Path, poll_interval_s: float, progress) -> tuple[list[Any], Ran]:
    jobs = _submit_slurm(ex, fn, calls, folder)
    job_id = jobs[0].job_id.split("_")[0]
    ran = Ran("slurm", job_id, folder, [j.job_id for j in jobs])
    client = SlurmClient()
    values: dict[int, Any] = {}
    ended: dict[int, tuple[float, str]] = {}  # task -> (first seen ended, state)
    states: dict[int, str] = {}
    last_poll = float("-inf")
    said = ""
    try:
        while len(values) < len(jobs):
            for i, job in enumerate(jobs):
                if i not in values and job.paths.result_pickle.exists():
                    values[i] = _value(job, folder)
            if len(values) == len(jobs):
                break
            now = time.monotonic()
            if now - last_poll >= poll_interval_s:
                last_poll = now
                try:
                    states.update(_task_states(client.poll([job_id]), len(jobs)))
                except SlurmError as exc:  # one failed poll is not the job's failure: try at the next interval
                    states = {i: f"UNKNOWN ({exc})" for i in range(len(jobs)) if i not in values}
                for i, state in states.items():
                    if i not in values and _ended(state):
                        ended.setdefault(i, (now, state))
                if progress is not None:
                    line = _summary(job_id, len(jobs), values, states)
                    if line != said:
                        progress(line)
                        said = line
            for i, (since, state) in ended.items():
                if i not in values and now - since > RESULT_GRACE_S and not jobs[i].paths.result_pickle.exists():
                    raise FunctionError(_no_result(jobs[i], state), folder=folder)
            time.sleep(min(1.0, poll_interval_s))
    except BaseException:
        if len(values) < len(jobs):
            try:
                client.cancel([job_id])
            except SlurmError:
                pass
        raise
    return [values[i] for i in range(len(jobs))], ran


def _task_states(records, n: int) -> dict[int, str]:
    states: dict[int, str] = {}
    for r in records:
        if r.pending_tasks:
            for t in r.pending_tasks:
                states[t] = r.state
        elif r.array_task_id is not None:
            states[r.array_task_id] = r.state
        elif n == 1:
            states[0] = r.state
    return states


def _ended(state: str) -> bool:
    return phase_of(state) is JobPhase.ENDED


def _summary(job_id: str, n: int, values: dict, states: dict[int, str]) -> str:
    counts: dict[str, int] = {}
    for i in range(n):
        if i not in values:
            s = (states.get(i) or "SUBMITTED").split()[0]
            counts[s] = counts.get(s, 0) + 1
    rest = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"job {job_id}: {len(values)}/{n} done" + (f" ({rest})" if rest else "")


def _value(job, folder: Path) -> Any:
    try:
        return job.result()
    except Exception as exc:  # submitit.core.utils.FailedJobError: the function raised on the node
        raise FunctionError(
            f"job {job.job_id} raised on {_node(job)}:\n{_tail(str(exc))}\n(log: {job.paths.stdout})",
            folder=folder,
            scheduler=False,
        ) from None


def _node(job) -> str:
    return "the compute node" if isinstance(job, submitit.SlurmJob) else "this machine"


def _no_result(job, state: str) -> str:
    log = job.paths.stdout
    try:
        text = _tail(log.read_text(errors="replace"))
    except OSError:
        text = f"(no log at {log}: is the folder on a filesystem the compute nodes see?)"
    return f"job {job.job_id} ended {state} without a result; its log {log} ends:\n{text}"


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-LOG_TAIL_LINES:])


def _run_local(ex, fn, calls, folder: Path, progress) -> tuple[list[Any], Ran]:
    """At most one process per CPU at a time: LocalExecutor would start every task at once."""
    width = max(1, min(len(calls), os.cpu_count() or 1))
    jobs: list = []
    values: dict[int, Any] = {}
    running: dict[int, Any] = {}
    said = ""
    try:
        while len(values) < len(calls):
            while len(running) < width and len(jobs) < len(calls):
                args, kwargs = calls[len(jobs)]
                job = ex.submit(fn, *args, **kwargs)
                running[len(jobs)] = job
                jobs.append(job)
            for i, job in list(running.items()):
                if job.done():
                    del running[i]
                    values[i] = _value(job, folder)
            if progress is not None:
                line = f"local: {len(values)}/{len(calls)} done ({len(running)} running)"
                if line != said:
                    progress(line)
                    said = line
            if len(values) < len(calls):
                time.sleep(0.2)
    except BaseException:
        for job in running.values():
            try:
                job.cancel(check=False)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        raise
    return [values[i] for i in range(len(calls))], Ran("local", ",".join(j.job_id for j in jobs), folder)
