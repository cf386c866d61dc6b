"""Typed rows: what the Store's readers return for the tables the daemon decides with — transitions, steps, GPUs,
workers and allocations.

Each row is a frozen dataclass with one field per column (documented here, once), states and roles as their enums
(``pearlctl.state.machines``; a ``StrEnum`` still equals its stored string), JSON columns decoded, and the names a
reader joins in (a GPU's ``node`` and ``pool``, an allocation's ``pool``). Rows are values: they are never changed
in place (``dataclasses.replace`` makes a changed copy; only the Store writes state), so a reader may keep or share
one, and the Store's cache hands out the same objects without copying them. ``to_dict()`` is the row as the status
document and ``--json`` print it: the column names, plain values.

Tables read rarely and by few (runs, pools, nodes, the journal, leases) are plain dicts (``Store.get``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self

from pearlctl.state.machines import AllocationState, GpuState, StepState, TransitionState, WorkerState
from pearlctl.vocabulary import MoveKind, Role, StepKind


class TypedRow:
    """What every typed row shares: built from a reader's row, and back to a plain dict."""

    __slots__ = ()
    TABLE: ClassVar[str]
    _FIELDS: ClassVar[tuple[str, ...]]
    # columns converted on the way in (an enum of the column's values, or a sequence made a tuple)
    _CONVERT: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        """The row of a reader (``sqlite3.Row`` as a dict, JSON columns already decoded); columns this type does
        not name (a reader's window column, say) are left out."""
        convert = cls._CONVERT
        values = {}
        for name in cls._FIELDS:
            value = row.get(name)
            if value is not None and name in convert:
                value = convert[name](value)
            values[name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._FIELDS}


def _tuple(value: Any) -> tuple:
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition(TypedRow):
    """A role transition (pearlctl.daemon.transitions): GPUs moved from one role to another by a sequence of steps."""

    TABLE: ClassVar[str] = "transitions"
    id: int
    run_id: str
    kind: MoveKind
    from_role: Role
    to_role: Role
    gpu_ids: tuple[int, ...]  # the GPUs it moves (gpus.id)
    state: TransitionState
    version: int  # bumped by every write (compare-and-set)
    detail: Mapping[str, Any] | None  # what it carries besides the above (pearlctl.daemon.transitions)
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Step(TypedRow):
    """One idempotent step of a transition, journaled INTENT → effect → DONE/FAILED."""

    TABLE: ClassVar[str] = "steps"
    id: int
    transition_id: int
    seq: int  # its place in the transition's plan (a rollback's steps from 100)
    kind: StepKind
    idempotency_key: str  # ``<transition>:<seq>:<kind>``: an effect is applied once per key
    state: StepState
    version: int
    detail: Mapping[str, Any] | None  # why it failed or was held, what it observed
    updated_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveStep(Step):
    """A step with its transition's roles (``store.transitions.recent_steps``): whose engine it started or stopped."""

    from_role: Role
    to_role: Role


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu(TypedRow):
    """A GPU of an allocation: (allocation, device index), on the node the allocation runs on now."""

    TABLE: ClassVar[str] = "gpus"
    id: int
    run_id: str
    allocation_id: int
    node_id: int
    idx: int  # the device index on its node
    role: Role
    state: GpuState
    version: int
    borrowed: int  # 1 while a trainer GPU is lent to rollout
    return_deadline: float | None  # a lent GPU: when the trainer needs it back
    worker_id: int | None  # the policy's worker parked asleep on it (``parked_for``)
    updated_at: float
    node: str  # its node's name (joined)
    pool: str  # its pool's name (joined)
    parked_judge_id: int | None = None  # the judge's worker parked asleep on it

    def parked_for(self, role: str) -> int | None:
        """The worker parked asleep here that would serve ``role``: the judge's for REWARD, else the policy's."""
        return self.parked_judge_id if role == Role.REWARD else self.worker_id

    @property
    def parked(self) -> tuple[int, ...]:
        """Every worker parked here (at most one per model)."""
        return tuple(w for w in (self.worker_id, self.parked_judge_id) if w is not None)


def parked_column(role: str) -> str:
    """The ``gpus`` column that parks a worker of ``role``: one per model (``Gpu.parked_for``)."""
    return "parked_judge_id" if role == Role.REWARD else "worker_id"


@dataclass(frozen=True, slots=True, kw_only=True)
class Worker(TypedRow):
    """An engine process an agent runs (a vLLM server, a DeepSpeed rank group), as the agent last reported it."""

    TABLE: ClassVar[str] = "workers"
    id: int
    run_id: str
    allocation_id: int
    role: Role
    engine: str  # a pearlctl.vocabulary.Engine value
    state: WorkerState
    version: int
    url: str | None  # where it serves (vLLM's OpenAI-compatible API)
    pid: int | None
    weight_version: str | None  # the policy weights it has loaded
    updated_at: float
    worker_key: str | None  # its agent's name for it (unique in its allocation)
    gpu_idx: tuple[int, ...] | None  # the device indices it runs on
    routable: int  # 1 once REGISTER put it in the router
    ready_s: float | None  # its cold start, as its agent measured it: process start to its first healthy answer


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation(TypedRow):
    """One Slurm array task of a pool (or the local backend's process group standing in for one)."""

    TABLE: ClassVar[str] = "allocations"
    id: int
    run_id: str
    pool_id: int
    array_index: int
    job_id: str | None  # Slurm's id of the task (``5_1``), once submitted
    state: AllocationState
    version: int
    slurm_state: str | None  # what squeue/sacct said last
    reason: str | None
    node: str | None
    restarts: int
    preempted_at: float | None
    started_at: float | None
    ended_at: float | None
    updated_at: float
    agent_pid: int | None
    agent_seen_at: float | None  # its agent's last heartbeat as stored (the daemon keeps newer ones in memory)
    agent_host: str | None
    drain_requested_at: float | None  # elastic shrink: when it was asked to drain before its scancel
    pool: str  # its pool's name (joined)


for _cls, _convert in (
    (Transition, {"kind": MoveKind, "from_role": Role, "to_role": Role, "gpu_ids": _tuple, "state": TransitionState}),
    (Step, {"kind": StepKind, "state": StepState}),
    (MoveStep, {"kind": StepKind, "state": StepState, "from_role": Role, "to_role": Role}),
    (Gpu, {"role": Role, "state": GpuState}),
    (Worker, {"role": Role, "state": WorkerState, "gpu_idx": _tuple}),
    (Allocation, {"state": AllocationState}),
):
    _cls._CONVERT = _convert
    _cls._FIELDS = tuple(f.name for f in fields(_cls))

ROW_TYPES: Mapping[str, type[TypedRow]] = {cls.TABLE: cls for cls in (Transition, Step, Gpu, Worker, Allocation)}
