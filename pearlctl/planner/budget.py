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

These are the rules for one GPU. Their aggregates over a snapshot — the trainer GPUs that may be lent now, the
GPUs each budget may serve — are computed once per snapshot by ``pearlctl.planner.view`` (``view.lendable``,
``view.servable``, ``view.may_serve``), the one place they are written.
"""

from __future__ import annotations

from pearlctl.planner.model import SERVING, GpuSlot, Role, Snapshot
from pearlctl.vocabulary import GENERATION_POOLS, PoolKind

# Slack on every deadline: one slow control-loop tick or one slow agent (the same as policy greedy's).
RETURN_SLACK_S = 2.0


def return_cost_s(snapshot: Snapshot) -> float:
    """Seconds a lent GPU's return takes: its engine parks asleep and the trainer reloads — the slower of the
    policy's engine and the judge's to park (a lent GPU may serve either; its deadline holds for both)."""
    sleep_s = max(snapshot.costs.sleep_s, snapshot.engine_costs(Role.REWARD).sleep_s)
    return sleep_s + snapshot.costs.reload_s


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


def may_start(snapshot: Snapshot, gpu: GpuSlot) -> bool:
    """An idle rollout/elastic GPU whose allocation lasts long enough for a worker to come up on it."""
    if gpu.role is not Role.IDLE or gpu.pool not in GENERATION_POOLS:
        return False
    if gpu.ends_at is None:
        return True
    return gpu.ends_at > snapshot.now + bring_up_s(snapshot, gpu) + RETURN_SLACK_S
