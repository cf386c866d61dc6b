"""Which GPUs may serve rollout now: the pool limits and return deadlines that ``choose``, ``diff`` and the
policies share, so a target the chooser builds is one the diff can reach.

Guarantees (what ``diff`` enforces and the property tests check):

- a trainer GPU is lent only while the trainer reports phase "waiting", never beyond ``max_lend`` lent GPUs
  in all, and never when its return would be late: ``now + borrow cost + return cost + RETURN_SLACK_S`` must
  not pass the deadline ``now + trainer.wait_left_s``;
- a lent GPU must go back (``must_return``) once its deadline is within its return cost plus the slack, or
  as soon as the trainer reports phase "training" (it is already waiting for its GPUs) or its batch is
  complete (``Trainer.batch_ready``: the rollout driver reported no work left after the trainer began waiting,
  so it trains next, whatever deadline its wait — reported or predicted — gave); nothing is lent then;
- an idle GPU whose allocation ends (``ends_at``: an elastic GPU's preemption notice) before a worker could
  be up on it is not used.

Return costs assume the worker parks asleep (``TransitionCosts.return_s(park=True)``), as the executor does
for a GPU that may be lent again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearlctl.planner.model import SERVING, GpuSlot, Role, Snapshot
from pearlctl.vocabulary import GENERATION_POOLS, PoolKind

# Slack on every deadline: one slow control-loop tick or one slow agent (the same as policy greedy's).
RETURN_SLACK_S = 2.0


def return_cost_s(snapshot: Snapshot) -> float:
    return snapshot.costs.return_s(park=True)


def bring_up_s(snapshot: Snapshot, gpu: GpuSlot) -> float:
    """Seconds until a worker serves on ``gpu`` (not serving now)."""
    costs = snapshot.costs
    if gpu.pool == PoolKind.TRAINER:
        return costs.borrow_s(warm=gpu.parked)
    return costs.wake_s if gpu.parked else costs.start_s


def trainer_deadline(snapshot: Snapshot) -> float:
    """When the trainer needs its GPUs back, from its own report."""
    return snapshot.now + max(snapshot.trainer.wait_left_s, 0.0)


def deadline(snapshot: Snapshot, gpu: GpuSlot) -> float:
    """A lent GPU's return deadline (the trainer's report when the slot carries none)."""
    return gpu.return_deadline if gpu.return_deadline is not None else trainer_deadline(snapshot)


def must_return(snapshot: Snapshot, gpu: GpuSlot) -> bool:
    """A lent GPU that has to start its return now to be back in time."""
    if not gpu.borrowed:
        return False
    if snapshot.trainer.phase == "training" or snapshot.trainer.batch_ready:
        return True
    return deadline(snapshot, gpu) - snapshot.now <= return_cost_s(snapshot) + RETURN_SLACK_S


def is_lent(gpu: GpuSlot) -> bool:
    return gpu.pool == PoolKind.TRAINER and gpu.borrowed and gpu.role in SERVING


def lendable(snapshot: Snapshot) -> list[GpuSlot]:
    """Trainer GPUs that may be lent now (not yet lent), best first (parked: a warm borrow), capped so that
    kept lent GPUs plus these never exceed ``max_lend``."""
    if snapshot.trainer.phase != "waiting" or snapshot.trainer.batch_ready:
        return []
    limit = trainer_deadline(snapshot) - RETURN_SLACK_S - return_cost_s(snapshot)
    out = [
        g
        for g in snapshot.gpus
        if g.pool == PoolKind.TRAINER
        and g.role is Role.TRAIN
        and not g.borrowed
        and snapshot.now + bring_up_s(snapshot, g) <= limit
    ]
    out.sort(key=lambda g: (not g.parked, g.node, g.id))
    if snapshot.max_lend is not None:
        kept = sum(1 for g in snapshot.gpus if is_lent(g) and not must_return(snapshot, g))
        out = out[: max(0, snapshot.max_lend - kept)]
    return out


def may_start(snapshot: Snapshot, gpu: GpuSlot) -> bool:
    """An idle rollout/elastic GPU whose allocation lasts long enough for a worker to come up on it."""
    if gpu.role is not Role.IDLE or gpu.pool not in GENERATION_POOLS:
        return False
    if gpu.ends_at is None:
        return True
    return gpu.ends_at > snapshot.now + bring_up_s(snapshot, gpu) + RETURN_SLACK_S


@dataclass(frozen=True)
class Servable:
    """The GPUs that may serve, by where they come from (one pass over the snapshot; budgets are unions)."""

    rollout: tuple[GpuSlot, ...]  # rollout pool: serving, or idle and startable
    elastic: tuple[GpuSlot, ...]  # elastic pool: serving, or idle and startable
    lent: tuple[GpuSlot, ...]  # lent trainer GPUs that need not return yet (within max_lend)
    lendable: tuple[GpuSlot, ...]  # trainer GPUs that may be lent now, parked first

    def budget(self, *, elastic: bool, borrow: bool, warm_borrow_only: bool = False) -> list[GpuSlot]:
        out = list(self.rollout)
        if elastic:
            out += self.elastic
        if borrow:
            out += self.lent
            out += [g for g in self.lendable if g.parked] if warm_borrow_only else self.lendable
        return out


def servable(snapshot: Snapshot) -> Servable:
    rollout: list[GpuSlot] = []
    elastic: list[GpuSlot] = []
    lent: list[GpuSlot] = []
    for g in snapshot.gpus:
        if g.pool in GENERATION_POOLS:
            if g.role in SERVING or may_start(snapshot, g):
                (rollout if g.pool == PoolKind.ROLLOUT else elastic).append(g)
        elif is_lent(g) and not must_return(snapshot, g):
            lent.append(g)
    if snapshot.max_lend is not None:
        lent = lent[: snapshot.max_lend]
    return Servable(tuple(rollout), tuple(elastic), tuple(lent), tuple(lendable(snapshot)))


def may_serve(snapshot: Snapshot, *, elastic: bool, borrow: bool, warm_borrow_only: bool = False) -> list[GpuSlot]:
    """The GPUs a deployment may use: the rollout pool's serving or startable GPUs; with ``elastic`` the
    elastic pool's; with ``borrow`` the lent trainer GPUs that need not return yet and the lendable ones
    (``warm_borrow_only``: only those with a parked worker, whose borrow is a wake)."""
    from pearlctl.planner import view  # (view builds on this module: ``servable`` once per snapshot)

    return view.of(snapshot).servable.budget(elastic=elastic, borrow=borrow, warm_borrow_only=warm_borrow_only)
