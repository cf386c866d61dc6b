"""What pearlctl knows about one Slurm job (or array task), whichever command it came from.

Slurm job states are mapped through one table (:data:`STATE_TABLE`) onto a small set of phases the
watcher acts on. A state this table does not know becomes ``UNKNOWN`` and is logged, never a crash:
sites run patched Slurms and new releases add states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class JobPhase(StrEnum):
    PENDING = "PENDING"  # waiting for resources, or requeued and waiting again
    RUNNING = "RUNNING"  # holds its nodes (includes COMPLETING, SUSPENDED)
    ENDED = "ENDED"  # final: it will not run again by itself
    UNKNOWN = "UNKNOWN"  # a state we do not know; keep the last thing we believed


# Slurm state (base name, without flags such as "+" or reasons) -> phase, with why.
STATE_TABLE: dict[str, tuple[JobPhase, str]] = {
    "PENDING": (JobPhase.PENDING, "queued, waiting for resources or priority"),
    "REQUEUED": (JobPhase.PENDING, "being put back in the queue (after preemption or node failure)"),
    "REQUEUE_FED": (JobPhase.PENDING, "requeued by a federation sibling"),
    "REQUEUE_HOLD": (JobPhase.PENDING, "requeued and held: it will run once released"),
    "RESV_DEL_HOLD": (JobPhase.PENDING, "held because its reservation was deleted"),
    "CONFIGURING": (JobPhase.RUNNING, "nodes allocated, booting or being set up"),
    "RUNNING": (JobPhase.RUNNING, "running"),
    "COMPLETING": (JobPhase.RUNNING, "processes ending; nodes not yet released"),
    "SUSPENDED": (JobPhase.RUNNING, "suspended (gang scheduling or preempt=suspend); still holds nodes"),
    "STOPPED": (JobPhase.RUNNING, "SIGSTOPped; still holds nodes"),
    "SIGNALING": (JobPhase.RUNNING, "being signalled"),
    "STAGE_OUT": (JobPhase.RUNNING, "burst-buffer stage-out"),
    "RESIZING": (JobPhase.RUNNING, "changing size"),
    "COMPLETED": (JobPhase.ENDED, "exited 0"),
    "CANCELLED": (JobPhase.ENDED, "scancel, or preempted without requeue"),
    "FAILED": (JobPhase.ENDED, "non-zero exit"),
    "TIMEOUT": (JobPhase.ENDED, "hit its time limit"),
    "PREEMPTED": (JobPhase.ENDED, "preempted and not requeued (sacct also shows this for a requeued run)"),
    "NODE_FAIL": (JobPhase.ENDED, "a node failed"),
    "BOOT_FAIL": (JobPhase.ENDED, "a node failed to boot"),
    "DEADLINE": (JobPhase.ENDED, "missed its deadline"),
    "OUT_OF_MEMORY": (JobPhase.ENDED, "killed by the OOM handler"),
    "REVOKED": (JobPhase.ENDED, "revoked in a federation"),
    "SPECIAL_EXIT": (JobPhase.PENDING, "requeued in a held special state"),
}


def phase_of(slurm_state: str) -> JobPhase:
    """Map a Slurm state string ('RUNNING', 'CANCELLED by 0', 'COMPLETING+') to a phase."""
    base = slurm_state.strip().split()[0].rstrip("+").upper() if slurm_state.strip() else ""
    entry = STATE_TABLE.get(base)
    return entry[0] if entry else JobPhase.UNKNOWN


@dataclass(frozen=True)
class JobRecord:
    """One job or array task, as seen by squeue, scontrol, sacct or the local backend."""

    job_id: str  # the array's id for array tasks ("123"), else the job's id
    array_task_id: int | None  # None for a plain job or an unexpanded pending range
    state: str  # raw Slurm state, e.g. "RUNNING"
    name: str = ""
    partition: str = ""
    reason: str = ""
    nodes: tuple[str, ...] = ()
    gpus: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node -> device indices
    restarts: int = 0
    preempt_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    exit_code: str = ""
    pending_tasks: tuple[int, ...] = ()  # for a pending array record covering several tasks
    source: str = ""  # which command produced this record

    @property
    def phase(self) -> JobPhase:
        return phase_of(self.state)

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.job_id, self.array_task_id)
