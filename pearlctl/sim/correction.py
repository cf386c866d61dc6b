"""The predictor's running correction (pearlctl.planner.correct) in a simulation, kept and applied as the daemon
keeps it (``Correction``, one per ``pearlctl.sim.run.Sim``): batches' measured completion against the
planner's uncorrected prediction, learned per shape of work, and the profile a policy plans with scaled by it
(``time_scale``).

Guarantees: the same rules as the daemon's ``Borrowing.check_prediction`` — a watch starts only while work is in
flight and no transition is open, a change of the serving GPUs drops it (a plan's effect is not prediction
error), a batch that another joins before it ends is not measured, a batch's end comes with its slowest tool
sum as a driver timing its tool calls reports it (``correct.Tools``: its luck is taken out as the daemon takes
it out); the oracle's runs keep no correction.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from pearlctl.planner import correct, plan
from pearlctl.planner.choose import worker_groups
from pearlctl.planner.model import SERVING, Work
from pearlctl.planner.predict import predict
from pearlctl.planner.profile import Profile

if TYPE_CHECKING:
    from pearlctl.sim.engine import Engine
    from pearlctl.sim.gpus import GpuRoles
    from pearlctl.sim.moves import Moves
    from pearlctl.sim.snapshot import PolicyView


class CorrectionRun(Protocol):
    """What the ``Correction`` reads of its run (``pearlctl.sim.run.Sim``): the profile and how many GPUs make a
    worker, whether the engines have work in flight (and a batch's slowest tools), batch ``j``'s trajectories
    (``batch_range``) and the batches launched, what the policy sees (``view``: the work, the uncorrected
    snapshot), whether a plan's switches wait (``moves``), and which GPUs are in transition or serve
    (``roles``)."""

    profile: Profile
    gpw: int
    engine: Engine
    launched: int
    view: PolicyView
    moves: Moves
    roles: GpuRoles

    def batch_range(self, j: int) -> tuple[int, int]: ...


class Correction:
    """``sim``'s predictor correction; ``on`` false: kept off (nothing learned, nothing applied)."""

    def __init__(self, sim: CorrectionRun, on: bool):
        self.sim = sim
        self.on = on
        self.predictor: dict = {}  # pearlctl.planner.correct's state
        self.checks: list[correct.Check] = []
        self._launches_seen = 0  # batches launched when the correction last looked
        self._scaled_profile = None  # (``_scaled``)

    def check(self, t: float) -> None:
        """The daemon's ``Borrowing.check_prediction`` on the simulated rollout driver's progress: a watch starts
        while work is in flight and no transition is open — the completion predicted then for the serving GPUs
        (uncorrected), the time, the GPUs; a change of the serving GPUs drops it (a plan's effect is not
        prediction error) and the next stable moment starts another; the first moment without work ends the
        batch, and measured / predicted goes into the correction (``correct.learn``)."""
        sim = self.sim
        watch = self.predictor.get("watch")
        if not sim.engine.busy():  # the driver reports no work left, and its last batch's slowest tool sum
            if watch is not None:
                slowest = sim.engine.slowest_tools(*sim.batch_range(sim.launched - 1))
                tools = None if slowest is None else correct.Tools(slowest)
                state, check = correct.finish(self.predictor, t, tools)
                self.predictor = {**state, "watch": None}
                if check is not None:
                    self.checks.append(check)
            self.predictor = {**self.predictor, "batch_since": None}
            return
        # (trajectories join only at a launch: the work is looked at only after one)
        launched, self._launches_seen = self._launches_seen, sim.launched
        if watch is not None and launched != sim.launched and correct.grew(self.predictor, sim.view.work()):
            # the next batch joined before this one ended (asynchronous): no watch spans both
            self.predictor = {**self.predictor, "watch": None, "batch_since": None}
            watch = None
        if self.predictor.get("batch_since") is None:  # the batch's first moment with work
            self.predictor = {**self.predictor, "batch_since": t}
        if sim.moves.queued or sim.roles.in_transition(t):  # a transition is open
            if watch is not None:
                self.predictor = {**self.predictor, "watch": None}
            return
        serving = sim.roles.serving_ids(t)
        if watch is not None and watch["gpus"] == serving:
            return
        snap = sim.view.snapshot(t, corrected=False)
        work = snap.work
        prediction = predict(work, plan.current_deployment(snap), sim.profile)  # uncorrected
        key = correct.shape(work, serving_workers(snap.gpus, sim.gpw))
        self.predictor = {**self.predictor, "watch": correct.watch(prediction, key, t, serving, work.trajectories)}

    def profile(self, work: Work, gpus) -> Profile:
        """The profile a policy plans with for ``work`` on the snapshot's ``gpus``: the scenario's, its
        ``time_scale`` the correction learned for the work's shape."""
        profile = self.sim.profile
        key = correct.shape(work, serving_workers(gpus, profile.gpus_per_worker))
        return self._scaled(correct.factor(self.predictor, key))

    def _scaled(self, time_scale: float) -> Profile:
        """The profile with the predictor's correction ``time_scale``: the same object while the correction is
        the same number (a profile's ``replace`` checks every field again, at every decision)."""
        kept = self._scaled_profile
        same = kept is not None and kept.time_scale == time_scale
        if not same or math.copysign(1.0, kept.time_scale) != math.copysign(1.0, time_scale):  # (0.0 and -0.0)
            kept = self._scaled_profile = replace(self.sim.profile, time_scale=time_scale)
        return kept


def serving_workers(gpus, gpus_per_worker: int) -> int:
    """Serving workers among planner GPU slots (whole groups per node and pool, as ``choose`` counts them) — the
    daemon's count for the predictor's batch shape (pearlctl/daemon/borrowing.py, ``_serving_workers``)."""
    return sum(worker_groups([g for g in gpus if g.role in SERVING], gpus_per_worker).values())
