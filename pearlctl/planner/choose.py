"""PD choice (docs/planner.md): for the GPUs that may serve, the deployment — colocated, or disaggregated with
a prefill:decode ratio from a coarse grid — with the least predicted completion time, and the ``Target``
that says it in GPU counts by pool.

Workers are tensor-parallel groups of ``profile.gpus_per_worker`` GPUs of one allocation on one node, so a
budget counts whole groups per (node, pool); GPUs left over on a node serve nothing. Colocated always uses
every worker (in the completion model more colocated workers are never slower); disaggregated splits the
same workers. The grid is coarse on purpose: the model is not accurate to finer ratios, and each point costs
a prediction. Ties go to the current mode, then to colocated (fewer moving parts).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pearlctl.planner import view
from pearlctl.planner.model import Deployment, GpuSlot, Mode, Snapshot, Target
from pearlctl.planner.predict import Prediction
from pearlctl.vocabulary import PoolKind

# Prefill workers' share of all workers in disaggregated mode.
PREFILL_SHARES = (1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3)


@dataclass(frozen=True)
class Choice:
    """The chosen deployment, its target, and its prediction — made only when read if there was a single
    candidate (a baseline's choice needs no price)."""

    deployment: Deployment
    target: Target
    predicted: Callable[[], Prediction] = field(repr=False, compare=False)

    @functools.cached_property
    def prediction(self) -> Prediction:
        return self.predicted()

    @property
    def seconds(self) -> float:
        return self.prediction.seconds


def worker_groups(gpus: Iterable[GpuSlot], gpus_per_worker: int) -> dict[str, int]:
    """Whole workers per pool: each (node, pool) holds ``count // gpus_per_worker`` of them."""
    per_node = Counter((g.node, g.pool) for g in gpus)
    out: Counter[str] = Counter()
    for (_, pool), count in per_node.items():
        out[pool] += count // gpus_per_worker
    return dict(out)


def disaggregated_splits(workers: int) -> list[tuple[int, int]]:
    """(prefill, decode) worker counts on the grid, each side at least one worker, no duplicates."""
    seen: dict[tuple[int, int], None] = {}
    for share in PREFILL_SHARES:
        p = min(max(round(workers * share), 1), workers - 1)
        if p >= 1:
            seen[(p, workers - p)] = None
    return list(seen)


def choose(
    snapshot: Snapshot, budget: Sequence[GpuSlot], *, modes: Sequence[Mode] = (Mode.COLOCATED, Mode.DISAGGREGATED)
) -> Choice | None:
    """The best deployment of ``budget`` (None: not one whole worker in it)."""
    return choose_workers(snapshot, worker_groups(budget, snapshot.profile.gpus_per_worker), modes=modes)


def choose_workers(
    snapshot: Snapshot, by_pool: dict[str, int], *, modes: Sequence[Mode] = (Mode.COLOCATED, Mode.DISAGGREGATED)
) -> Choice | None:
    """``choose`` for a budget already counted in whole workers per pool (``worker_groups``)."""
    gpw = snapshot.profile.gpus_per_worker
    workers = sum(by_pool.values())
    if workers <= 0:
        return None
    target_of = _targets(by_pool, gpw)

    candidates: list[Deployment] = []
    if Mode.COLOCATED in modes:
        candidates.append(Deployment(Mode.COLOCATED, decode=workers))
    if Mode.DISAGGREGATED in modes:
        candidates += [Deployment(Mode.DISAGGREGATED, decode=d, prefill=p) for p, d in disaggregated_splits(workers)]

    predict = view.of(snapshot).predict  # predict(snapshot.work, dep, snapshot.profile), once per deployment
    if len(candidates) == 1:
        (only,) = candidates
        return Choice(only, target_of(only), functools.partial(predict, only))
    best: Choice | None = None
    for dep in candidates:
        pred = predict(dep)
        if best is None or _better(pred.seconds, dep.mode, best, snapshot.mode):
            best = Choice(dep, target_of(dep), functools.partial(_given, pred))
    return best


def _given(prediction: Prediction) -> Prediction:
    return prediction


def _better(seconds: float, mode: Mode, best: Choice, current: Mode) -> bool:
    if seconds < best.seconds * (1 - 1e-9):
        return True
    if seconds > best.seconds * (1 + 1e-9):
        return False

    # a tie: stay in the current mode, else prefer colocated
    def rank(m: Mode) -> tuple[bool, bool]:
        return (m is not current, m is not Mode.COLOCATED)

    return rank(mode) < rank(best.deployment.mode)


def _targets(by_pool: dict[str, int], gpw: int):
    lend = by_pool.get(PoolKind.TRAINER, 0) * gpw
    elastic = by_pool.get(PoolKind.ELASTIC, 0) * gpw

    def target_of(dep: Deployment) -> Target:
        return Target(
            mode=dep.mode,
            rollout_gpus=dep.workers * gpw,
            prefill_gpus=dep.prefill * gpw if dep.mode is Mode.DISAGGREGATED else 0,
            lend=lend,
            elastic=elastic,
        )

    return target_of
