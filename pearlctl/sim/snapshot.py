"""What a policy sees of a simulation (``PolicyView``, one per ``pearlctl.sim.run.Sim``): the
``pearlctl.planner.model.Snapshot`` the daemon's ``Borrowing.snapshot`` would build from the simulated cluster.

What a policy sees is what a live daemon could know: the GPUs and their roles, counts and means of the work in
flight (turns left from the workload's history, not the drawn future), the trainer's phase and the ETA the
training loop itself reports (examples/grpo/train.py: a moving average of its measured waits; none before the
first), transition costs as the daemon's running estimates (``pearlctl.sim.moves.Moves.costs``), and the
scenario's profile with the predictor's running correction as its ``time_scale`` (``pearlctl.sim.correction``).
Under a model mismatch the policy keeps seeing the scenario's profile and distributions: the planner does not
know the truth, it only learns from what happens. The oracle (``pearlctl.sim.oracle``) alone reads the future.

Guarantees: the workload's history is a fixed sample of the scenario's distributions (the same for every
policy); a GPU's snapshot slot is kept while its fields are the same objects, which changes no value.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pearlctl.planner import plan
from pearlctl.planner.model import GpuSlot, Judging, Mode, Snapshot, Trainer, Work
from pearlctl.sim.gpus import judge_workers
from pearlctl.sim.trajectories import TOOL
from pearlctl.vocabulary import JUDGE_BUSY_REPORTS, PD_ROLES

if TYPE_CHECKING:
    from pearlctl.planner.profile import Profile, TransitionCosts
    from pearlctl.sim.availability import Trace
    from pearlctl.sim.engine import Engine
    from pearlctl.sim.gpus import SimGpu
    from pearlctl.sim.judging import Judges
    from pearlctl.sim.scenario import Scenario


class ViewedCorrection(Protocol):
    """What the view asks of the predictor's correction (``pearlctl.sim.correction.Correction``): whether the run
    keeps one, and the profile a policy plans with for some work on some GPUs."""

    on: bool

    def profile(self, work: Work, gpus) -> Profile: ...


class ViewedMoves(Protocol):
    """What the view asks of the moves (``pearlctl.sim.moves.Moves``): the transition costs a policy plans with,
    and when a plan last changed a GPU."""

    last_change_at: float | None

    def costs(self) -> TransitionCosts: ...


class ViewedRun(Protocol):
    """What ``PolicyView`` reads of its run (``pearlctl.sim.run.Sim``): the scenario and its profile, the GPUs, the
    engines' work in flight, the elastic trace, the trainer's phase, measured waits and latest batch, and the
    correction and the moves that a snapshot's profile and costs come from (read-only: the run's own parts, of
    which the view needs no more than ``ViewedCorrection`` and ``ViewedMoves`` say)."""

    scenario: Scenario
    profile: Profile
    gpus: list[SimGpu]
    engine: Engine
    trace: Trace
    training_until: float | None
    wait_ema: float | None
    waiting_since: float
    last_batch: Work
    judges: Judges | None

    @property
    def correction(self) -> ViewedCorrection: ...

    @property
    def moves(self) -> ViewedMoves: ...


class PolicyView:
    """``sim`` as its policy sees it."""

    def __init__(self, sim: ViewedRun):
        self.sim = sim
        wl = sim.scenario.workload
        # What history says about the workload (a live system learns it; the drawn future stays hidden).
        self.turns_mean, self.turns_p99 = wl.turns.summary()
        self.resp_mean, self.resp_p99 = wl.response_tokens.summary()
        self.tool_out_mean, _ = wl.tool_output_tokens.summary()
        self.lat_mean, self.lat_p99 = wl.tool_latency_s.summary()
        self._residual_turns = residual_table(wl.turns)
        self._slots: list[GpuSlot | None] = [None] * len(sim.gpus)  # each GPU's last snapshot slot (``_slot``)
        # the judge queue's last two reports (when, judged), and at how many reports in a row, the last one included,
        # every GPU judging had work (counted up to JUDGE_BUSY_REPORTS, as the daemon's ``judge_saturated``)
        self._reports: list[tuple[float, int]] = [(0.0, 0), (0.0, 0)]
        self._saturated = 0
        self._capacity = 0.0  # the most verdicts per second per GPU judging a busy report saw (Judging)

    def snapshot(self, t: float, *, corrected: bool = True) -> Snapshot:
        """What the daemon's ``Borrowing.snapshot`` would build from this state. ``corrected``: the profile's
        ``time_scale`` is the predictor's correction for the work's shape (when the run keeps one)."""
        sim = self.sim
        work = self.work()
        trainer = self.trainer(t)
        deadline = t + trainer.wait_left_s if trainer.phase == "waiting" else t
        gpus = tuple(self._slot(g, deadline) for g in sim.gpus if g.present)
        disagg = any(g.role in PD_ROLES for g in gpus)
        profile = sim.profile
        if corrected and sim.correction.on:  # predictions corrected by what the run's past batches took
            profile = sim.correction.profile(work, gpus)
        snapshot = Snapshot(
            now=t,
            gpus=gpus,
            work=work,
            trainer=trainer,
            profile=profile,
            costs=sim.moves.costs(),
            judge_costs=sim.moves.judge_costs() if sim.scenario.judge is not None else None,
            mode=Mode.DISAGGREGATED if disagg else Mode.COLOCATED,
            preempt_per_hour=sim.trace.preempt_per_hour,
            last_change_at=sim.moves.last_change_at,
            last_batch=sim.last_batch,
            judging=self.judging(t),
        )
        if trainer.wait_known:
            return snapshot
        # no wait measured yet: the horizon is the planner's prediction of the batch in flight, as the daemon's
        snapshot = plan.expect_wait(snapshot)
        deadline = t + snapshot.trainer.wait_left_s
        return replace(snapshot, gpus=tuple(replace(g, return_deadline=deadline) if g.borrowed else g for g in gpus))

    def _slot(self, g: SimGpu, deadline: float) -> GpuSlot:
        """``g`` as a snapshot shows it. A frozen ``GpuSlot`` costs a field-by-field ``__init__`` and a snapshot of a
        large cluster holds thousands, so the slot of a GPU not lent is kept while its fields are the same objects
        (a lent GPU's return deadline moves with time: its slot is made anew)."""
        kept = self._slots[g.id]
        if (
            kept is None
            or g.borrowed
            or kept.borrowed
            or kept.role is not g.role
            or kept.parked is not g.parked
            or kept.parked_judge is not g.parked_judge
            or kept.ends_at is not g.ends_at
        ):
            kept = GpuSlot(
                id=g.id,
                node=g.node,
                pool=g.pool,
                role=g.role,
                parked=g.parked,
                parked_judge=g.parked_judge,
                borrowed=g.borrowed,
                return_deadline=deadline if g.borrowed else None,
                ends_at=g.ends_at,
            )
            self._slots[g.id] = kept
        return kept

    def trainer(self, t: float) -> Trainer:
        """What the trainer hook would report: its phase and its ETA for the batch it waits on."""
        sim = self.sim
        step_s = sim.scenario.training.train_step_s
        if sim.training_until is not None:
            return Trainer(phase="training", wait_left_s=0.0, step_time_s=step_s)
        if sim.wait_ema is None:  # no wait measured yet: the trainer reports none (``plan.expect_wait``)
            return Trainer(phase="waiting", step_time_s=step_s, wait_known=False)
        return Trainer(phase="waiting", wait_left_s=self._expected_wait(t), step_time_s=step_s)

    def _expected_wait(self, t: float) -> float:
        """The trainer's ETA, as examples/grpo/train.py computes it — the simulated trainer's own numbers, never
        the policy's predictor: from the moment it starts waiting (the end of its step, so the weight sync and
        the next batch's launch are inside it), a moving average (0.7 old, 0.3 new) of the waits it measured,
        less the time waited so far, floored at 0 (the trainer hook's ``wait_until``). The same in an
        asynchronous loop, where a batch generated ahead makes the wait short or nothing. Before any wait was
        measured the trainer reports none, unless the scenario gives it a hint (``first_wait_s``, as
        ``PEARL_FIRST_WAIT_S``); ``trainer`` then leaves the wait to the planner's prediction."""
        sim = self.sim
        return max((sim.wait_ema or 0.0) - (t - sim.waiting_since), 0.0)

    def judging(self, t: float) -> Judging:
        """The judge queue as the rollout driver reports it, with the verdicts per second between its last two
        reports (one every ``control_interval_s``), whether every GPU judging had work at both and at the report
        before them (``busy``, ``JUDGE_BUSY_REPORTS``), and the most a busy rate showed per GPU judging, as the
        daemon keeps them beside the driver's report (pearlctl/daemon/trainer_side.py)."""
        judges = self.sim.judges
        if judges is None:
            return Judging()
        waiting, judging, done = judges.counts()
        reported = t - self._reports[-1][0] >= self.sim.scenario.control_interval_s - 1e-9
        serving = judge_workers(self.sim.gpus, 1, t) if reported else 0  # GPUs judging (as pivot counts judges)
        if reported:  # saturated: every GPU judging had work (verdicts waiting, or one in flight per GPU)
            saturated = serving > 0 and (waiting > 0 or judging >= serving)
            self._saturated = min(self._saturated + 1, JUDGE_BUSY_REPORTS) if saturated else 0
            self._reports = [self._reports[-1], (t, done)]
        (t0, d0), (t1, d1) = self._reports
        rate = (d1 - d0) / (t1 - t0) if t1 > t0 else 0.0
        busy = self._saturated >= JUDGE_BUSY_REPORTS
        if reported and busy and rate > 0:  # a judging GPU's capacity
            self._capacity = max(self._capacity, rate / serving)
        return Judging(waiting, judging, done, 0, rate, busy, self._capacity)

    def work(self) -> Work:
        """The work in flight as the rollout driver reports it: counts and means, the turns left from history."""
        e = self.sim.engine
        i = e.in_flight()
        if not i.size:
            return Work()
        done_turns = e.turn[i].astype(float)
        left = self._residual_turns[np.minimum(e.turn[i], len(self._residual_turns) - 1)]
        return Work(
            trajectories=int(i.size),
            tool_waiting=int((e.phase[i] == TOOL).sum()),
            turns_left=float(left.mean()),
            turns_left_max=float(max(self.turns_p99 - done_turns.min(), 1.0)),
            decode_tokens_per_turn=self.resp_mean,
            decode_tokens_per_turn_max=self.resp_p99,
            prefill_tokens_per_turn=self.tool_out_mean,
            context_tokens=float(e.ctx[i].mean()),
            tool_latency_s=self.lat_mean,
            tool_latency_max_s=self.lat_p99,
        )


def residual_table(turns) -> np.ndarray:
    """E[turns left | turns done = d] for d = 0 .. max, from the workload's turn distribution (history)."""
    x = np.maximum(1, np.rint(turns.sample(np.random.default_rng(7), 20000)))
    top = int(x.max())
    out = np.ones(top + 1)
    for d in range(top + 1):
        alive = x[x > d]
        out[d] = float((alive - d).mean()) if alive.size else 1.0
    return out
