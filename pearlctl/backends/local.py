"""The local backend: allocations as process groups on this machine, for running pearlctl with no
Slurm at all (a laptop, a CI box, a newcomer's first run).

It runs the same rendered sbatch script (the ``#SBATCH`` lines are comments to bash), one process
group per array task (per node of a multi-node job, ``PEARL_LOCAL_NNODES`` its size), in its own session
so the whole worker tree can be signalled at once.
Bookkeeping lives in files under ``<state_dir>/local-jobs/<job_id>/`` so any later pearlctl process
can poll or cancel what an earlier one started:

- ``task-<i>.pid``: "<pid> <start-ticks>" — start ticks guard against PID reuse;
- ``task-<i>.rc``: the exit status, written when the task ends by itself;
- ``cancelled``: written before the groups are signalled; ``task-<i>.cancelled`` for one task cancelled
  alone (``cancel_tasks``: an elastic pool shrinking);
- ``meta.json``: the job's name, its task count and its first task index (an elastic pool's added task
  is a one-task job whose only task is numbered like Slurm's ``--array=K``).

No ``SLURM_*`` variable is set: torchrun and DeepSpeed change behaviour when they see one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from pearlctl.backends.base import BackendError
from pearlctl.host.processes import proc_start_ticks, signal_group
from pearlctl.slurm.parse import PartitionInfo
from pearlctl.slurm.records import JobRecord
from pearlctl.slurm.script import SubmitRequest

LOCAL_PARTITION = "local"
NODE = socket.gethostname()


def _visible_gpus() -> list[str]:
    return [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]


class LocalBackend:
    name = "local"

    def __init__(self, state_dir: str | os.PathLike, *, kill_wait_s: float = 5.0):
        self.root = Path(state_dir) / "local-jobs"
        self.kill_wait_s = kill_wait_s

    def partitions(self) -> dict[str, PartitionInfo]:
        # One node; GPUs are whatever CUDA_VISIBLE_DEVICES lists here (none on a CPU box, which
        # pools with gpus_per_node = 0 or the CPU engines accept).
        gpus = len(_visible_gpus())
        return {LOCAL_PARTITION: PartitionInfo(LOCAL_PARTITION, True, 1, gpus, default=True)}

    def _job_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def submit(self, req: SubmitRequest, script: str) -> str:
        job_id = f"local-{uuid.uuid4().hex[:8]}"
        jdir = self._job_dir(job_id)
        jdir.mkdir(parents=True)
        script_path = jdir / "job.sh"
        script_path.write_text(script)
        (jdir / "meta.json").write_text(
            json.dumps(
                {
                    "name": req.job_name,
                    "array_size": req.array_size,
                    "first_task": req.first_task,
                    "submitted_at": time.time(),
                }
            )
        )
        Path(req.run_dir, "logs").mkdir(parents=True, exist_ok=True)
        for task in range(req.first_task, req.first_task + req.array_size):
            log_path = req.log_pattern.replace("%A", job_id).replace("%j", job_id)
            log_path = log_path.replace("%a", str(task)).replace("%t", str(task))
            env = dict(os.environ, PEARL_LOCAL_JOB_ID=job_id, PEARL_LOCAL_TASK_ID=str(task))
            if req.gang:  # a multi-node job: every task is one node of it, the task index its rank
                env["PEARL_LOCAL_NNODES"] = str(req.array_size)
            # As Slurm's --gres would, a task sees only its pool's share of this machine's GPUs (the first
            # gpus_per_node of them: there is no ledger sharing GPUs out among local jobs).
            env["CUDA_VISIBLE_DEVICES"] = ",".join(_visible_gpus()[: req.gpus_per_node])
            rc_file = jdir / f"task-{task}.rc"
            # The outer bash records the exit status atomically (tmp + rename) once the script ends.
            wrapper = 'bash "$0"; rc=$?; echo $rc > "$1.tmp" && mv "$1.tmp" "$1"; exit $rc'
            with open(log_path, "ab") as log:
                try:
                    proc = subprocess.Popen(
                        ["/bin/bash", "-c", wrapper, str(script_path), str(rc_file)],
                        cwd=req.run_dir,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise BackendError(f"could not start local task {task} of {req.job_name}: {exc}") from exc
            ticks = proc_start_ticks(proc.pid) or 0
            (jdir / f"task-{task}.pid").write_text(f"{proc.pid} {ticks}\n")
        return job_id

    def _task_record(self, job_id: str, name: str, task: int) -> JobRecord:
        jdir = self._job_dir(job_id)
        rc_file = jdir / f"task-{task}.rc"
        pid, ticks = (jdir / f"task-{task}.pid").read_text().split()
        alive = proc_start_ticks(int(pid)) == int(ticks)
        if alive:
            state = "RUNNING"
        elif (jdir / "cancelled").exists() or (jdir / f"task-{task}.cancelled").exists():
            state = "CANCELLED"
        elif rc_file.exists():
            state = "COMPLETED" if rc_file.read_text().strip() == "0" else "FAILED"
        else:
            state = "FAILED"  # vanished without an exit status: killed from outside
        exit_code = rc_file.read_text().strip() if rc_file.exists() else ""
        return JobRecord(
            job_id=job_id,
            array_task_id=task,
            state=state,
            name=name,
            partition=LOCAL_PARTITION,
            nodes=(NODE,) if alive else (),
            gpus={},
            exit_code=exit_code,
            source="local",
        )

    def _records(self, job_id: str) -> list[JobRecord]:
        meta_file = self._job_dir(job_id) / "meta.json"
        if not meta_file.exists():
            return []
        meta = json.loads(meta_file.read_text())
        first = int(meta.get("first_task", 0))  # absent in jobs submitted before elastic growth
        return [self._task_record(job_id, meta["name"], t) for t in range(first, first + meta["array_size"])]

    def find_by_name(self, job_name: str) -> list[JobRecord]:
        if not self.root.exists():
            return []
        out: list[JobRecord] = []
        for jdir in self.root.iterdir():
            out.extend(r for r in self._records(jdir.name) if r.name == job_name and r.phase != "ENDED")
        return out

    def poll(self, job_ids: list[str]) -> list[JobRecord]:
        return [r for j in job_ids for r in self._records(j)]

    def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            jdir = self._job_dir(job_id)
            if not jdir.exists():
                continue
            (jdir / "cancelled").touch()
            self._terminate(list(jdir.glob("task-*.pid")))

    def cancel_tasks(self, tasks: list[tuple[str, int]]) -> None:
        """End single tasks, as ``scancel JOB_TASK`` would: the job's other tasks keep running. An unknown
        job or task, or one that already ended, is not an error (as with scancel)."""
        pid_files = []
        for job_id, task in tasks:
            jdir = self._job_dir(job_id)
            pid_file = jdir / f"task-{int(task)}.pid"
            if not pid_file.exists():
                continue
            (jdir / f"task-{int(task)}.cancelled").touch()
            pid_files.append(pid_file)
        self._terminate(pid_files)

    def _terminate(self, pid_files: list[Path]) -> None:
        """SIGTERM each live task's process group, SIGKILL what is left after ``kill_wait_s``."""
        pids = []
        for pid_file in pid_files:
            pid, ticks = pid_file.read_text().split()
            if proc_start_ticks(int(pid)) == int(ticks):
                pids.append(int(pid))
                signal_group(int(pid), signal.SIGTERM)
        if pids:
            deadline = time.monotonic() + self.kill_wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if proc_start_ticks(p) is not None]
                time.sleep(0.05)
            for pid in pids:  # KillWait passed, as Slurm would: SIGKILL the group
                signal_group(pid, signal.SIGKILL)
