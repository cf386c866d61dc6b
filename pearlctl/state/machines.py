"""The state machines of pearlctl's records, as data (pure: no SQLite, no I/O).

Each stateful table (runs, allocations, gpus, workers, transitions, steps) has a ``StrEnum`` of states
and an explicit table of allowed edges, ``{(old, new): "why this edge exists"}``. ``check_edge`` is the
one gate every state write passes (``Store.set_state`` calls it); an edge that is not in the table is
refused with ``IllegalTransition``.

Invariants (tests/unit/test_state_machines.py checks them):

- the first member of each state enum is the state a row is created in (``Machine.initial``);
- every state is reachable from it;
- no edge goes from a state to itself: a write that keeps the state is a field update
  (``Store.update_fields``), not a transition, so the journal never shows "RUNNING -> RUNNING".
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import NamedTuple

from pearlctl.state.errors import IllegalTransition, StateError
from pearlctl.vocabulary import PoolKind, Role, StepKind  # noqa: F401  (re-exported: state's words)


class RunState(StrEnum):
    CREATED = "CREATED"  # intent recorded, nothing submitted
    SUBMITTING = "SUBMITTING"  # sbatch calls in progress; some pools may have a job id
    ACTIVE = "ACTIVE"  # all pools submitted
    CANCELLING = "CANCELLING"  # scancel issued; waiting for every allocation to end
    CANCELLED = "CANCELLED"
    ENDED = "ENDED"  # every allocation ended by itself
    FAILED = "FAILED"  # submission failed; whatever was submitted got cancelled


class AllocationState(StrEnum):
    REQUESTED = "REQUESTED"  # row written before sbatch; no Slurm id yet
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PREEMPTING = "PREEMPTING"  # Slurm signalled preemption; grace time running
    ENDED = "ENDED"
    LOST = "LOST"  # vanished from Slurm without a final state we could read


class GpuState(StrEnum):
    UP = "UP"
    DRAINING = "DRAINING"  # leaving: its work is being moved off before it goes
    LOST = "LOST"  # its agent stopped reporting
    GONE = "GONE"  # not part of the allocation any more


class WorkerState(StrEnum):
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"  # out of the router, finishing in-flight requests
    SLEEPING = "SLEEPING"  # process alive, weights/KV offloaded (vLLM sleep mode, DeepSpeed offload)
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    LOST = "LOST"  # its agent stopped reporting; the process may well still run


class TransitionState(StrEnum):
    PLANNED = "PLANNED"
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"  # stopped with an effect it could neither finish, undo nor prove
    ROLLING_BACK = "ROLLING_BACK"
    ROLLED_BACK = "ROLLED_BACK"  # the GPUs are back in from_role


# transitions that still move GPUs (the executor advances them; a new plan waits for them)
OPEN_TRANSITION_STATES = frozenset({TransitionState.PLANNED, TransitionState.RUNNING, TransitionState.ROLLING_BACK})


class StepState(StrEnum):
    INTENT = "INTENT"  # durable before the effect; the effect is idempotent for the step's key
    DONE = "DONE"
    FAILED = "FAILED"
    HELD = "HELD"  # effect could not be proven after a crash: never blindly repeated


Edges = Mapping[tuple[StrEnum, StrEnum], str]

R = RunState
RUN_EDGES: Edges = {
    (R.CREATED, R.SUBMITTING): "the launcher starts calling sbatch for the pools",
    (R.CREATED, R.FAILED): "submission could not start (backend refused the spec); nothing was submitted",
    (R.CREATED, R.CANCELLING): "cancelled before any sbatch; cancel takes one path whatever it finds, and "
    "with nothing submitted it completes at once",
    (R.SUBMITTING, R.ACTIVE): "every pool got a Slurm job id",
    (R.SUBMITTING, R.FAILED): "an sbatch failed and the pools already submitted were scancelled",
    (R.SUBMITTING, R.CANCELLING): "cancelled while pools were being submitted",
    (R.ACTIVE, R.CANCELLING): "the user cancelled; scancel issued for every pool",
    (R.ACTIVE, R.ENDED): "every allocation ended by itself (job finished, time limit, node failure)",
    (R.CANCELLING, R.CANCELLED): "every allocation is confirmed ENDED after the scancel",
}

A = AllocationState
ALLOCATION_EDGES: Edges = {
    (A.REQUESTED, A.PENDING): "sbatch returned a job id; Slurm queued the task",
    (A.REQUESTED, A.RUNNING): "after a crash between sbatch and recording the id, the job was found by "
    "name already running",
    (A.REQUESTED, A.ENDED): "sbatch failed, or the run was cancelled before this task was submitted",
    (A.PENDING, A.RUNNING): "Slurm started the task",
    (A.PENDING, A.ENDED): "cancelled or failed while still queued",
    (A.PENDING, A.LOST): "the job vanished from squeue and sacct had no final state",
    (A.RUNNING, A.PREEMPTING): "Slurm signalled preemption; the grace time is running",
    (A.RUNNING, A.PENDING): "requeued (preempted or node failure) without a grace signal we saw",
    (A.RUNNING, A.ENDED): "the task finished, hit its time limit, failed or was cancelled",
    (A.RUNNING, A.LOST): "the job vanished from squeue and sacct had no final state",
    (A.PREEMPTING, A.PENDING): "requeued after the preemption grace time",
    (A.PREEMPTING, A.RUNNING): "requeued and started again between two polls",
    (A.PREEMPTING, A.ENDED): "preempted without requeue (or cancelled during the grace time)",
    (A.PREEMPTING, A.LOST): "the job vanished during the grace time without a final state",
    (A.LOST, A.PENDING): "truth learned later: Slurm lists the job again, queued",
    (A.LOST, A.RUNNING): "truth learned later: Slurm lists the job again, running (its agent reports)",
    (A.LOST, A.PREEMPTING): "truth learned later: the agent reports a preemption signal",
    (A.LOST, A.ENDED): "truth learned later: sacct shows a final state, or the loss is given up on",
}

G = GpuState
GPU_EDGES: Edges = {
    (G.UP, G.DRAINING): "the GPU is leaving (preemption, borrowed GPU returning, allocation ending)",
    (G.UP, G.LOST): "its agent stopped heartbeating",
    (G.UP, G.GONE): "the allocation ended, or the agent re-registered without this device index",
    (G.DRAINING, G.UP): "the reason to leave went away (drain aborted, transition rolled back)",
    (G.DRAINING, G.LOST): "its agent stopped heartbeating during the drain",
    (G.DRAINING, G.GONE): "drained; the allocation released it",
    (G.LOST, G.UP): "its agent came back and re-registered the device",
    (G.LOST, G.DRAINING): "its agent came back draining: a preemption notice reached it while it was out of reach",
    (G.LOST, G.GONE): "the allocation is confirmed ended",
    (G.GONE, G.UP): "the allocation was requeued and its agent registered this device index again "
    "(perhaps on another node)",
}

W = WorkerState
WORKER_EDGES: Edges = {
    (W.STARTING, W.READY): "the engine passed its health check",
    (W.STARTING, W.FAILED): "the engine exited or missed its start deadline",
    (W.STARTING, W.STOPPED): "the start was cancelled (plan rolled back) and the process stopped cleanly",
    (W.STARTING, W.LOST): "its agent stopped reporting during the start",
    (W.READY, W.DRAINING): "taken out of the router; in-flight requests finish before sleep or stop",
    (W.READY, W.SLEEPING): "a worker without router traffic (trainer ranks) offloads directly",
    (W.READY, W.STOPPED): "stopped without a drain: trainer ranks carry no router traffic, or the "
    "allocation ended under it",
    (W.READY, W.FAILED): "the engine crashed or failed its health check",
    (W.READY, W.LOST): "its agent stopped reporting",
    (W.DRAINING, W.READY): "the drain was aborted (transition rolled back); back in the router",
    (W.DRAINING, W.SLEEPING): "drained, then put to sleep (weights/KV offloaded, process kept)",
    (W.DRAINING, W.STOPPED): "drained, then retired",
    (W.DRAINING, W.FAILED): "the engine crashed during the drain",
    (W.DRAINING, W.LOST): "its agent stopped reporting during the drain",
    (W.SLEEPING, W.READY): "woken (weights reloaded) and verified healthy",
    (W.SLEEPING, W.STOPPED): "retired while asleep",
    (W.SLEEPING, W.FAILED): "the wake-up failed or the process died while asleep",
    (W.SLEEPING, W.LOST): "its agent stopped reporting while the worker slept",
    (W.LOST, W.STARTING): "its agent came back and the worker was still starting (a busy host delayed its reports)",
    (W.LOST, W.READY): "its agent came back and the worker was still serving (daemon restarts never kill workers)",
    (W.LOST, W.DRAINING): "its agent came back and the worker was still draining",
    (W.LOST, W.SLEEPING): "its agent came back and the worker was still asleep",
    (W.LOST, W.STOPPED): "truth learned later: the process is gone (allocation ended)",
    (W.LOST, W.FAILED): "truth learned later: the process died",
}

T = TransitionState
TRANSITION_EDGES: Edges = {
    (T.PLANNED, T.RUNNING): "the executor wrote its first step intent",
    (T.PLANNED, T.ROLLED_BACK): "dropped before any step ran (superseded or vetoed by the policy); nothing to undo",
    (T.RUNNING, T.DONE): "every step is DONE",
    (T.RUNNING, T.ROLLING_BACK): "a step FAILED (or a return deadline came first); compensating steps run",
    (T.RUNNING, T.FAILED): "a step is HELD (effect unprovable after a crash) or cannot be compensated",
    (T.ROLLING_BACK, T.ROLLED_BACK): "every compensating step is DONE; the GPUs are in from_role again",
    (T.ROLLING_BACK, T.FAILED): "a compensating step failed or is HELD",
    (T.FAILED, T.ROLLING_BACK): "what was held got resolved (a later probe or an operator); undo the partial change",
}

S = StepState
STEP_EDGES: Edges = {
    (S.INTENT, S.DONE): "the effect happened and was confirmed (or a probe after a crash proved it)",
    (S.INTENT, S.FAILED): "the effect reported an error, or a probe proved it cannot happen",
    (S.INTENT, S.HELD): "after a crash the probe could prove neither that the effect happened nor that it did not",
    (S.HELD, S.DONE): "a later probe or an operator confirmed the effect",
    (S.HELD, S.FAILED): "a later probe or an operator confirmed there was no effect, and it is given up",
    (S.HELD, S.INTENT): "a probe proved there was no effect (or an operator released the hold): redo it "
    "under the same idempotency key",
}

del R, A, G, W, T, S


class Machine(NamedTuple):
    """One table's state machine: its states and its edges (unpacks as ``states, edges``)."""

    states: type[StrEnum]
    edges: Edges

    @property
    def initial(self) -> StrEnum:
        """The state rows of this table are created in: by convention the enum's first member."""
        return next(iter(self.states))

    def next_states(self, old: str) -> tuple[StrEnum, ...]:
        """The states reachable from ``old`` in one edge, in enum order (empty: terminal)."""
        return tuple(new for new in self.states if (old, new) in self.edges)

    def terminal(self) -> frozenset[StrEnum]:
        """States without outgoing edges."""
        return frozenset(s for s in self.states if not self.next_states(s))


MACHINES: Mapping[str, Machine] = {
    "runs": Machine(RunState, RUN_EDGES),
    "allocations": Machine(AllocationState, ALLOCATION_EDGES),
    "gpus": Machine(GpuState, GPU_EDGES),
    "workers": Machine(WorkerState, WORKER_EDGES),
    "transitions": Machine(TransitionState, TRANSITION_EDGES),
    "steps": Machine(StepState, STEP_EDGES),
}


def machine(table: str) -> Machine:
    """The state machine of ``table``; ``StateError`` if the table has none."""
    try:
        return MACHINES[table]
    except KeyError:
        stateful = ", ".join(MACHINES)
        raise StateError(f"table {table!r} has no state machine; stateful tables: {stateful}") from None


def check_edge(table: str, old: str, new: str) -> None:
    """Refuse (``IllegalTransition``) unless ``old -> new`` is an edge of ``table``'s machine.

    Values that are not states of the table are refused the same way, so a typo cannot slip through.
    A same-state write is not an edge and is refused too.
    """
    m = machine(table)
    if (old, new) in m.edges:
        return
    known = [s.value for s in m.states]
    unknown = [v for v in (old, new) if v not in known]
    note = f"{unknown[0]!r} is not a state of {table} (states: {', '.join(known)})" if unknown else ""
    raise IllegalTransition(table, old, new, m.next_states(old), note=note)
