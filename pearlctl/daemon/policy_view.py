"""What the run's policy sees: the planner's ``Snapshot`` of the run, built from state, with the inputs it was
built from (pearlctl.daemon.borrowing decides on it, off the lock, and carries a decision out only if those inputs
still hold), and the running estimates of transition costs the deadline rules use.

``PolicyInputs`` reads state only. The GPU rows, the planner's GPU slots and what is derived from them are kept
for one state generation: a tick asks for them several times, and at 4,096 GPUs each read or rebuild costs
milliseconds (read-only: never modified).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pearlctl.planner import correct, plan
from pearlctl.planner import profile as profiles
from pearlctl.planner.choose import worker_groups
from pearlctl.planner.model import GpuSlot, Judging, Mode, MoveKind, Role, Snapshot, Trainer, Work
from pearlctl.planner.profile import (
    COST_ESTIMATE_LAST,
    DecodeModel,
    Profile,
    TransitionCosts,
    judge_engine_costs,
    measured_costs,
)
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.schema import ROLLOUT_PROGRESS, TRAINER_REPORT
from pearlctl.state.store import Store
from pearlctl.vocabulary import GENERATION_ROLES, PD_ROLES, SERVING_ROLES, PoolKind

# Before any transition was measured (a CPU vLLM cold start takes ~20 s, a return a few seconds).
DEFAULT_COSTS = TransitionCosts(start_s=25.0, wake_s=3.0, sleep_s=3.0, stop_s=5.0, offload_s=2.0, reload_s=2.0)

# What a run without a measured profile plans with: it carries the transition costs; its speeds are
# placeholders, so policies that predict (NEEDS_PROFILE) are refused for such a run.
UNMEASURED = Profile(
    name="unmeasured",
    model="",
    hardware="",
    decode=DecodeModel(weights_s=0.01, seq_s=0.0, kv_s_per_token=0.0),
    prefill_tok_s=1e4,
    kv_capacity_tokens=10**6,
    costs=DEFAULT_COSTS,
)


_PD = PD_ROLES


class PolicyInputs:
    """The run's state as the policy sees it (read-only)."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id
        self._derived: dict[str, tuple[tuple[int, int], Any]] = {}  # ``_per_generation``

    def gpu_rows(self) -> list[dict]:
        """The run's GPU rows as of now (shared, read-only)."""
        return self._per_generation("rows", lambda: self.store.fleet.gpus(self.run_id))

    def _per_generation(self, what: str, make: Callable[[], Any]) -> Any:
        """``make()``, kept for one state generation under the name ``what`` (the GPU rows, or something
        derived from state, which changes only with the generation)."""
        generation = self.store.generation()
        hit = self._derived.get(what)
        if hit is None or hit[0] != generation:
            hit = self._derived[what] = (generation, make())
        return hit[1]

    def serving_gpu_ids(self) -> list[int]:
        """The ids of the GPUs that serve rollouts now, sorted (shared, read-only)."""
        return self._per_generation(
            "serving", lambda: sorted(g.id for g in self.gpu_rows() if g.state == G.UP and _serves(g))
        )

    def serving_workers(self, gpus_per_worker: int) -> int:
        """Serving workers among the planner's GPU slots now (``_serving_workers``)."""
        return self._per_generation(
            f"workers/{gpus_per_worker}", lambda: _serving_workers(self.slots(), gpus_per_worker)
        )

    def settings(self) -> dict:
        run = self.store.runs.get(self.run_id)
        return run.get("borrow") or {"policy": run.get("policy") or "never", "max_gpus": None}

    def profile(self) -> Profile | None:
        doc = self.store.runs.get(self.run_id).get("profile")
        return profiles.from_dict(doc) if doc else None

    def judge_profile(self) -> Profile | None:
        """The judge's engine profile (``pearlctl profile --judge``), if one was stored."""
        doc = self.store.runs.get(self.run_id).get("judge_profile")
        return profiles.from_dict(doc) if doc else None

    def costs(self, base: TransitionCosts) -> TransitionCosts:
        """Running estimates of the policy's engine and the trainer's steps: the median of the last 5 DONE steps of
        each kind, else ``base``'s; a start never journaled as a step is the median of the last 5 cold starts the
        policy's workers made (their agents measure them: the workers a launch starts are no transition)."""
        return self._measured(base)[0]

    def judge_costs(self, base: TransitionCosts) -> TransitionCosts:
        """``costs`` with the judge's engine's own starts, wakes, sleeps and stops (``Snapshot.judge_costs``:
        another model than the policy's): its steps' running estimates, else its workers' measured cold starts,
        else the judge's profile's (``judge_profile``), else ``base``'s."""
        return self._measured(base)[1]

    def has_judge(self) -> bool:
        return has_judge(self.store.runs.get(self.run_id))

    def _measured(self, base: TransitionCosts) -> tuple[TransitionCosts, TransitionCosts]:
        recent = self.store.transitions.recent_steps(self.run_id, state="DONE", per_kind=COST_ESTIMATE_LAST)
        steps = [s.to_dict() for s in recent]
        workers = self.store.fleet.workers(self.run_id)

        def measured(judge: bool) -> dict[str, float]:
            roles = (Role.REWARD,) if judge else GENERATION_ROLES
            starts = [w.ready_s for w in workers if w.role in roles and w.ready_s is not None]
            return measured_costs(steps, starts, judge=judge, last=COST_ESTIMATE_LAST)

        policy = TransitionCosts(**{**vars(base), **measured(False)})
        judge, judge_profile = measured(True), self.judge_profile()
        judge_base = judge_profile.costs if judge_profile is not None else base
        return policy, judge_engine_costs(policy, judge, judge_base)

    def cost(self, kind: MoveKind) -> float:
        """Running estimate of a whole transition's duration: the median of the last 5 that completed, else
        the sum of its steps' estimates. The deadline rules use it."""
        latest = self.store.transitions.all(self.run_id, states=(T.DONE,), kind=kind, last=COST_ESTIMATE_LAST)
        done = [t.updated_at - t.created_at for t in latest]
        if done:
            return statistics.median(done)
        costs = self.costs((self.profile() or UNMEASURED).costs)
        return costs.borrow_s(warm=False) if kind == MoveKind.BORROW else costs.return_s(park=True)

    def trainer_gpus(self) -> list[dict]:
        return [g for g in self.gpu_rows() if g.state == G.UP and g.pool == PoolKind.TRAINER]

    def snapshot(self, now: float, settings: dict | None = None) -> Snapshot:
        """The planner's view of the run now (pure data). ``settings``: borrowing settings to assume."""
        return self._snapshot(now, settings)[0]

    def _snapshot(self, now: float, settings: dict | None = None) -> tuple[Snapshot, tuple]:
        """``snapshot`` and its inputs: everything it is built from but the clock (see the module doc; equal
        inputs and the same ``now`` build equal snapshots)."""
        run = self.store.runs.get(self.run_id)
        settings = settings or self.settings()
        trainer = run.get(TRAINER_REPORT) or {}
        wait = trainer.get("expected_wait_s")
        # each report's expected wait is what is left at that report (the hook's wait_until counts it down)
        since = trainer.get("reported_at") or trainer.get("phase_since")
        left = (since + wait - now) if wait is not None and since else 0.0
        gpus = self.slots()
        profile = self.profile() or UNMEASURED
        work = work_from_progress(run.get(ROLLOUT_PROGRESS) or {})
        ready = batch_ready(trainer, run.get(ROLLOUT_PROGRESS) or {})
        if profile is not UNMEASURED:  # predictions corrected by what the run's past batches took
            key = correct.shape(work, self.serving_workers(profile.gpus_per_worker))
            profile = replace(profile, time_scale=correct.factor(run.get("predictor"), key))
        transitions = self.store.transitions.all(self.run_id, last=1)
        costs, judge_costs = self._measured(profile.costs)
        snapshot = Snapshot(
            now=now,
            gpus=gpus,
            work=work,
            trainer=Trainer(
                phase=trainer.get("phase"),
                wait_left_s=left,
                step_time_s=trainer.get("step_s") or 0.0,
                wait_known=wait is not None,
                batch_ready=ready,
            ),
            profile=profile,
            costs=costs,
            judge_costs=judge_costs if self.has_judge() else None,
            mode=Mode.DISAGGREGATED if any(g.role in _PD for g in gpus) else Mode.COLOCATED,
            max_lend=settings.get("max_gpus"),
            last_change_at=transitions[-1].created_at if transitions else None,
            last_batch=Work(**(run.get(ROLLOUT_PROGRESS) or {}).get("batch_work") or {}),
            judging=judging_from_progress(run.get(ROLLOUT_PROGRESS) or {}),
        )
        # a trainer that reported no expected wait (none measured yet): the planner's prediction of the batch,
        # from a measured profile only (the placeholder's speeds predict nothing: nothing is lent then)
        if profile is not UNMEASURED:
            snapshot = plan.expect_wait(snapshot)
        # the clock only in ``now`` and the trainer's wait left: the inputs hold the time it waits until instead
        # (the GPUs: one tuple per state generation, and equal tuples compare element by element)
        timeless = replace(snapshot, now=0.0, trainer=replace(snapshot.trainer, wait_left_s=0.0))
        waits_until = (since, wait) if wait is not None and since else None
        inputs = (timeless, waits_until, sorted(settings.items(), key=lambda kv: kv[0]))
        return snapshot, inputs

    def slots(self) -> tuple[GpuSlot, ...]:
        """The planner's view of the run's live GPUs (kept for one state generation)."""
        return self._per_generation("slots", self._make_slots)

    def _make_slots(self) -> tuple[GpuSlot, ...]:
        asleep = {w.id: w.role for w in self.store.fleet.workers(self.run_id) if w.state == "SLEEPING"}
        gpus = []
        for g in self.gpu_rows():
            if g.state != G.UP:
                continue
            if g.pool == PoolKind.TRAINER:  # lent: the role it serves (the policy's or the judge's); else TRAIN
                role = (Role(g.role) if g.role in SERVING_ROLES else Role.ROLLOUT) if g.borrowed else Role.TRAIN
            else:
                role = Role(g.role) if g.role in SERVING_ROLES else Role.IDLE
            gpus.append(
                GpuSlot(
                    id=g.id,
                    node=g.node,
                    pool=g.pool,
                    role=role,
                    # a parked worker wakes for its own model only: the policy's, or the judge's (a GPU serving
                    # one may hold the other's asleep, from a shift)
                    parked=asleep.get(g.worker_id) in GENERATION_ROLES,
                    parked_judge=asleep.get(g.parked_judge_id) == Role.REWARD,
                    borrowed=bool(g.borrowed),
                    return_deadline=g.return_deadline,
                )
            )
        return tuple(gpus)

    def view(self, now: float, settings: dict | None = None) -> dict:
        """A summary of the snapshot for people (``borrow --dry-run``)."""
        return summary(self.snapshot(now, settings))


def has_judge(run: dict) -> bool:
    """Whether the run serves a judge: its stored spec has ``[pools.reward]`` (the judge's model and engine)."""
    return PoolKind.REWARD in ((run.get("spec") or {}).get("pools") or {})


def summary(s: Snapshot) -> dict:
    """What a policy sees, in a few numbers for people (``borrow --dry-run``)."""
    return {
        "phase": s.trainer.phase,
        "wait_left_s": s.trainer.wait_left_s,
        "wait_from": "prediction" if s.trainer.wait_predicted else "trainer report",
        "idle_gpus": sum(1 for g in s.gpus if g.pool == PoolKind.TRAINER and not g.borrowed),
        "max_gpus": s.max_lend,
        "borrow_cost_s": s.costs.borrow_s(warm=False),
        "warm_borrow_cost_s": s.costs.borrow_s(warm=True),
        "return_cost_s": s.costs.return_s(park=True),
        "trajectories_left": s.work.trajectories,
        "profile": s.profile.name,
    }


def _serves(g: dict) -> bool:
    """A GPU row that serves rollouts now: a lent trainer GPU, or a rollout/elastic GPU in a role that serves the
    policy (a judge's does not)."""
    return bool(g.borrowed) if g.pool == PoolKind.TRAINER else g.role in GENERATION_ROLES


def _serving_workers(gpus, gpus_per_worker: int) -> int:
    """Serving workers among planner GPU slots (whole groups per node and pool, as ``choose`` counts them)."""
    serving = [g for g in gpus if g.role in GENERATION_ROLES]
    return sum(worker_groups(serving, gpus_per_worker).values())


def batch_ready(trainer: dict, rollout: dict) -> bool:
    """Whether the batch the trainer waits for is complete (``Trainer.batch_ready``): it reports phase
    "waiting", and the rollout driver's work in flight emptied (``emptied_at``, kept by the controller's
    ``rollout_progress``) since that wait began. In a synchronous loop that is the batch's end: the trainer
    takes the batch and trains next. A wait that began after the work emptied is for a batch not launched
    yet (the trainer reports its next wait at the end of its step): that one may still be lent into. With a judge,
    the batch is complete once its last trajectory is judged too: nothing waits for a verdict or is being judged."""
    emptied, since = rollout.get("emptied_at"), trainer.get("phase_since")
    judged = judging_from_progress(rollout).backlog == 0
    began = emptied is not None and since is not None and emptied >= since
    return trainer.get("phase") == "waiting" and began and judged


def judging_from_progress(report: dict) -> Judging:
    """The planner's Judging (the judge's queue) from the rollout driver's last report; empty without a judge."""
    judge = report.get("judge") or {}
    rate = report.get("verdicts_per_s") if judge else None  # kept beside the driver's report (trainer_side)
    fields = {k: judge[k] for k in ("waiting", "judging", "done", "failed") if k in judge}
    if rate is not None:
        fields.update(verdicts_per_s=rate, busy=bool(report.get("judge_busy")))
    if judge and report.get("judge_capacity_per_judge_s"):
        fields["capacity_per_judge_s"] = report["judge_capacity_per_judge_s"]
    return Judging(**fields)


def work_from_progress(report: dict) -> Work:
    """The planner's Work from the rollout driver's last progress report: its counts, plus the ``work``
    details it may send (turns left, tokens per turn, tool latency); empty without a report."""
    unfinished = sum(int(report.get(k) or 0) for k in ("queued", "generating", "tool_wait"))
    details = dict(report.get("work") or {})
    details.setdefault("trajectories", unfinished)
    details.setdefault("tool_waiting", int(report.get("tool_wait") or 0))
    return Work(**details)
