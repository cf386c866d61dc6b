"""The RL loop in simulated time, driving a policy exactly as the daemon does.

One ``Sim`` is one policy on one scenario. Each tick it applies the elastic trace (grants, notices,
preemptions), moves the trainer (synchronous: rollout batch → train step → weight sync; asynchronous: batches
generated up to ``staleness`` steps ahead of the trainer, engines pausing for each weight sync), advances the
engines (``pearlctl.sim.engine``) and, every ``control_interval_s`` and as soon as the trainer's phase, the
batches or the elastic trace change (a live daemon decides every tick, so it reacts to those within one),
builds a ``pearlctl.planner.model.Snapshot`` of the simulated cluster and calls the policy's ``decide`` — the
module ``pearlctl.policies.load_policy`` gives the daemon, never a copy. The plan's moves are applied at their
*true* cost from the profile (a move's own ``cost_s`` is the planner's estimate, not what the simulated GPU
pays).

What a policy sees is what a live daemon could know: the GPUs and their roles, counts and means of the work in
flight (turns left from the workload's history, not the drawn future), the trainer's phase and its expected
wait from past batches. The oracle (``pearlctl.sim.oracle``) alone reads the future.

Leaves are paid as the live system pays them (``pearlctl.sim.engine``: abort and continue). A move that takes a
worker out of serving (return, retire, switch) first aborts what it runs — ``ABORT_S`` more than the step's own
cost. A plan's switches run one group at a time, a group being the GPUs of one node and pool moving between
the same roles (one live transition), the other workers serving meanwhile; no new plan is made until they
all ran — as the daemon does (pearlctl/daemon/borrowing.py). A preemption notice makes the worker's agent
drain (pearlctl/agent/__main__.py): the router sends it nothing new, it decodes what it runs for the agent's
drain window (``drain_s``) and then aborts the rest, which is continued elsewhere; a preemption with less
notice than that window is a hard kill (the running turns are retried from their start). The oracle's GPUs
serve to the end and lose nothing.

The rollout driver launches a batch as examples/grpo/rollout.py does: when it is due (synchronous: after the
weight sync; asynchronous: within the staleness bound), but while workers are joining — GPUs in a transition
toward a serving role — it waits for them, at most the scenario's ``join_wait_s``, whatever the policy.

Guarantees: the daemon's return guarantee holds — when the trainer needs its GPUs, lent ones are returned
(forced if the policy has not) and the wait they cause is counted as trainer delay; a GPU is never moved
while it is in transition; moves that do not match the simulated state are refused and counted.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from pearlctl.planner.model import (
    SERVING,
    Deployment,
    GpuSlot,
    Mode,
    Move,
    MoveKind,
    Plan,
    Role,
    Snapshot,
    Trainer,
    Work,
)
from pearlctl.planner.predict import completion_s
from pearlctl.sim.availability import Trace, build_trace
from pearlctl.sim.engine import (
    ABORT_S,
    DEFAULT_ROUTER,
    TOOL,
    W_DECODE,
    W_OFF,
    W_PREFILL,
    W_ROLLOUT,
    Draws,
    Engine,
    draw,
)
from pearlctl.sim.scenario import Scenario

ENGINE_ROLE = {Role.ROLLOUT: W_ROLLOUT, Role.PREFILL: W_PREFILL, Role.DECODE: W_DECODE}
MAX_SIM_S = 7 * 24 * 3600.0  # a run that has not finished its steps by then is reported as unfinished
STALL_S = 3600.0  # simulated seconds without decode progress or a train step: the run is stuck
TIMELINE_EVERY_S = 10.0

# GPU-second categories: the roles, with TRAIN split by whether the trainer is computing, and TRANSITION.
CATEGORIES = ("TRAIN", "TRAIN_IDLE", "ROLLOUT", "PREFILL", "DECODE", "REWARD", "IDLE", "TRANSITION")


@dataclass
class SimGpu:
    id: int
    node: str
    pool: str
    role: Role
    present: bool = True  # elastic: granted and not yet preempted
    parked: bool = False
    borrowed: bool = False
    busy_until: float = 0.0  # in transition until then (does no work)
    ends_at: float | None = None
    version: int = 0  # policy weights it holds (a woken parked worker with old weights must sync)
    abort_at: float | None = None  # preemption notice: its worker drains until then, then aborts and stops


@dataclass
class RunResult:
    policy: str
    scenario: str
    finished: bool
    sim_time_s: float
    steps: int
    samples: int
    trainer_delay_s: float
    transitions: int
    forced_returns: int
    refusals: dict[str, int]
    plans: int
    preemptions: int
    gpu_seconds_by_role: dict[str, float]
    batch_rollout_s: list[float]
    engine: dict[str, float]
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.sim_time_s if self.sim_time_s > 0 else 0.0

    @property
    def steps_per_hour(self) -> float:
        return self.steps / (self.sim_time_s / 3600.0) if self.sim_time_s > 0 else 0.0


class Sim:
    """One policy on one scenario. ``controller`` is None for a policy (``decide``) or the oracle."""

    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        decide: Callable[[Snapshot], Plan | None] | None,
        *,
        draws: Draws | None = None,
        trace: Trace | None = None,
        free_migration: bool = False,
        record_timeline: bool = False,
        router: str = DEFAULT_ROUTER,
    ):
        self.scenario = scenario
        self.policy = policy
        self.decide = decide
        self.profile = scenario.profile
        c, wl = scenario.cluster, scenario.workload
        self.batch = wl.batch_size
        self.steps = scenario.steps
        self.draws = draws if draws is not None else make_draws(scenario)
        self.trace = trace if trace is not None else make_trace(scenario)
        self.gpw = self.profile.gpus_per_worker
        total = c.trainer_gpus + c.rollout_gpus + c.elastic_gpus
        self.engine = Engine(
            self.profile, self.draws, total // self.gpw, wl.max_context_tokens, free_migration, router=router
        )
        self.gpus: list[SimGpu] = []
        for i in range(total):
            if i < c.trainer_gpus:
                pool, role, node = "trainer", Role.TRAIN, f"t{i // c.gpus_per_node}"
            elif i < c.trainer_gpus + c.rollout_gpus:
                j = i - c.trainer_gpus
                pool, role, node = "rollout", Role.ROLLOUT, f"r{j // c.gpus_per_node}"
            else:
                j = i - c.trainer_gpus - c.rollout_gpus
                pool, role, node = "elastic", Role.IDLE, f"e{j // c.gpus_per_node}"
            self.gpus.append(SimGpu(i, node, pool, role, present=pool != "elastic"))
        self.controller = None  # the oracle sets itself here
        # What history says about the workload (a live system learns it; the drawn future stays hidden).
        self.turns_mean, self.turns_p99 = wl.turns.summary()
        self.resp_mean, self.resp_p99 = wl.response_tokens.summary()
        self.tool_out_mean, _ = wl.tool_output_tokens.summary()
        self.lat_mean, self.lat_p99 = wl.tool_latency_s.summary()
        self._residual_turns = _residual_table(wl.turns)
        # Trainer and batches.
        self.trained = 0
        self.launched = 0
        self.launched_at: list[float] = []
        self.completed_at: list[float] = []
        self.training_until: float | None = None
        self.sync_until = 0.0
        self.blocked_since: float | None = None
        self.waiting_since = 0.0  # when the trainer last started waiting for a batch (the end of its step)
        self.due_since: float | None = None  # when the next batch became due (the driver's join wait runs from then)
        self.wait_ema: float | None = None  # its measured waits, averaged as examples/grpo/train.py does
        self.version = 0
        # Lease events, in time order.
        self._grants = sorted(self.trace.leases, key=lambda x: x.start)
        self._notices = sorted((x for x in self.trace.leases if math.isfinite(x.end)), key=lambda x: x.notice_at)
        self._ends = sorted((x for x in self.trace.leases if math.isfinite(x.end)), key=lambda x: x.end)
        self._gi = self._ni = self._ei = 0
        # Accounting.
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.gpu_s = dict.fromkeys(CATEGORIES, 0.0)
        self.trainer_delay_s = 0.0
        self.transitions = 0
        self.forced_returns = 0
        self.refusals: dict[str, int] = {}  # refused moves by reason
        self.plans = 0
        self.preemptions = 0
        self.last_change_at: float | None = None
        self._finished_at: float | None = None
        # Roles and the GPU census change only on events; recomputed then (``_dirty``) or when a transition ends.
        self._dirty = True
        self._next_expiry = 0.0
        self._counts: dict[str, int] = {}
        self._killed: set[int] = set()  # workers preempted without a drain since the last role sync
        # a plan's switches not started yet, one group per live transition (node, pool, roles), and the GPUs
        # of the group now switching: the daemon runs a plan's switches one transition at a time
        self._switch_queue: list[list[Move]] = []
        self._switching: list[int] = []

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> RunResult:
        dt = self.scenario.tick_s
        every = self.scenario.control_interval_s
        next_control = 0.0
        next_sample = 0.0
        t = 0.0
        progress, progress_at = -1.0, 0.0
        seen = None
        while self.trained < self.steps and t < MAX_SIM_S:
            # A policy that leaves nothing serving would never finish: give up after an hour without progress.
            done = self.engine.stats["decode_tokens"] + self.trained
            if done != progress:
                progress, progress_at = done, t
            elif t - progress_at > STALL_S:
                break
            self._availability(t)
            self._trainer(t)
            if self.controller is not None:
                self.controller.control(self, t)
            elif self._switch_queue or self._switching:
                self._next_switch(t)  # the daemon plans nothing new while a plan's switches still run
            elif t >= next_control - 1e-9 or self._events() != seen:
                # every control interval, and as soon as the trainer or the elastic trace changes: the daemon
                # decides every tick (0.5 s), so it reacts to a trainer's report or a grant within one
                next_control, seen = t + every, self._events()
                self._control(t)
            if self._dirty or t >= self._next_expiry:
                self._refresh(t)
            self.engine.step(t, dt)
            for k, n in self._counts.items():
                self.gpu_s[k] += n * dt
            if self.record_timeline and t >= next_sample:
                self.timeline.append((t, dict(self._counts)))
                next_sample = t + TIMELINE_EVERY_S
            t += dt
        finished = self.trained >= self.steps
        end = self._finished_at if finished else t
        return RunResult(
            policy=self.policy,
            scenario=self.scenario.name,
            finished=finished,
            sim_time_s=end,
            steps=self.trained,
            samples=self.trained * self.batch,
            trainer_delay_s=self.trainer_delay_s,
            transitions=self.transitions,
            forced_returns=self.forced_returns,
            refusals=dict(self.refusals),
            plans=self.plans,
            preemptions=self.preemptions,
            gpu_seconds_by_role={k: round(v, 1) for k, v in self.gpu_s.items()},
            batch_rollout_s=[b - a for a, b in zip(self.launched_at, self.completed_at, strict=False)],
            engine={k: float(v) for k, v in self.engine.stats.items()},
            timeline=self.timeline,
        )

    # -- elastic capacity ----------------------------------------------------------------------------

    def _availability(self, t: float) -> None:
        while self._gi < len(self._grants) and self._grants[self._gi].start <= t:
            lease = self._grants[self._gi]
            self._gi += 1
            if lease.end <= t:
                continue
            for g in lease.gpus:
                gpu = self.gpus[g]
                gpu.present, gpu.role, gpu.parked, gpu.busy_until, gpu.ends_at = True, Role.IDLE, False, 0.0, None
                gpu.abort_at = None
            self._dirty = True
        while self._ni < len(self._notices) and self._notices[self._ni].notice_at <= t:
            lease = self._notices[self._ni]
            self._ni += 1
            # The agent drains its workers (the router sends them nothing new) and aborts what is left at the
            # end of its drain window; a notice shorter than that is no notice: a hard kill at the end.
            abort_at = lease.notice_at + drain_s(lease.end - lease.notice_at)
            for g in lease.gpus:
                if self.gpus[g].present:
                    self.gpus[g].ends_at = lease.end
                    if not self.engine.free_migration and abort_at < lease.end:
                        self.gpus[g].abort_at = abort_at
                        self._dirty = True
        while self._ei < len(self._ends) and self._ends[self._ei].end <= t:
            lease = self._ends[self._ei]
            self._ei += 1
            for g in lease.gpus:
                gpu = self.gpus[g]
                if gpu.present:
                    if gpu.abort_at is None:
                        self._killed.add(g // self.gpw)  # no drain came first: whatever it runs is lost
                    gpu.present, gpu.role, gpu.parked, gpu.busy_until, gpu.ends_at = False, Role.IDLE, False, 0.0, None
                    gpu.abort_at = None
                    self.preemptions += 1
                    self._dirty = True

    # -- the trainer ----------------------------------------------------------------------------------

    def _batch_range(self, j: int) -> tuple[int, int]:
        return j * self.batch, (j + 1) * self.batch

    def _trainer(self, t: float) -> None:
        tr = self.scenario.training
        # Batches finishing.
        while len(self.completed_at) < self.launched and self.engine.all_done(
            *self._batch_range(len(self.completed_at))
        ):
            lo, hi = self._batch_range(len(self.completed_at))
            self.completed_at.append(float(np.nanmax(self.engine.done_at[lo:hi])))
        # A train step finishing: new weights go to every serving worker (the engines pause meanwhile).
        if self.training_until is not None and t >= self.training_until - 1e-9:
            self.trained += 1
            self.training_until = None
            self.waiting_since = t
            self._dirty = True
            if self.trained >= self.steps:
                self._finished_at = t
                return
            self.version += 1
            self.sync_until = t + tr.weight_sync_s
            self.engine.pause_until = self.sync_until
            for g in self.gpus:
                if g.present and g.role in SERVING and not g.parked:
                    g.version = self.version
        # Launch batches: synchronous after the weight sync; asynchronous up to the staleness bound.
        # The driver's join wait (``_may_launch``) may hold a due batch back a little while workers join.
        if tr.mode == "sync":
            if self.launched == self.trained and self.training_until is None and t >= self.sync_until:
                if self._may_launch(t):
                    self._launch(t)
        else:
            while self.launched < self.steps and self.launched <= self.trained + tr.staleness and self._may_launch(t):
                self._launch(t)
        # Start the next train step once its batch is complete and every trainer GPU is back.
        if self.training_until is None and len(self.completed_at) > self.trained:
            for g in self._away(t):
                if g.role != Role.TRAIN and g.busy_until <= t:
                    self._force_return(g, t)  # the daemon's return guarantee (instant for the oracle)
            if self._away(t):
                if self.blocked_since is None:
                    self.blocked_since = t
            else:
                if self.blocked_since is not None:
                    self.trainer_delay_s += t - self.blocked_since
                    self.blocked_since = None
                # the wait the trainer measures: from its waiting point to its batch's arrival
                waited = max(self.completed_at[self.trained] - self.waiting_since, 0.0)
                self.wait_ema = waited if self.wait_ema is None else 0.7 * self.wait_ema + 0.3 * waited
                self.training_until = t + tr.train_step_s
                self._dirty = True

    def _events(self) -> tuple:
        """What a daemon reacts to at once: the trainer's phase and batches, grants, notices, preemptions."""
        return (self.trained, self.launched, self.training_until is None, self._gi, self._ni, self._ei)

    def _away(self, t: float) -> list[SimGpu]:
        return [g for g in self.gpus if g.pool == "trainer" and (g.role != Role.TRAIN or g.busy_until > t)]

    def joining(self, t: float) -> int:
        """Workers on their way to serving rollouts: those whose GPUs are in a transition toward a serving role
        (a borrow, start, wake or switch not finished yet) — the ``joining`` of the daemon's ``GET /v1/workers``
        (pearlctl/daemon/controller.py, routable_workers)."""
        return len({g.id // self.gpw for g in self.gpus if g.present and g.role in SERVING and g.busy_until > t})

    def _may_launch(self, t: float) -> bool:
        """The rollout driver's join wait, as examples/grpo/rollout.py runs it (pearlctl/router/client.py,
        RolloutClient.wait_for_joining): a batch due while workers are joining is launched once none is, or
        ``join_wait_s`` after it became due — whatever the policy; a worker that joins later takes sessions at
        their next turns only. The joined workers serve from the launch, so the batch's first turns spread over
        them too (the router's ring includes them when the batch's requests are sent)."""
        if self.due_since is None:
            self.due_since = t
        wait = self.scenario.training.join_wait_s
        if wait > 0 and t < self.due_since + wait - 1e-9 and self.joining(t):
            return False
        self.due_since = None
        return True

    def _launch(self, t: float) -> None:
        lo, hi = self._batch_range(self.launched)
        self.engine.launch(lo, hi, t)
        self.launched_at.append(t)
        self.launched += 1

    def trainer_needs_gpus(self, t: float) -> bool:
        """The trainer is computing, or its next batch is complete and it wants its GPUs now."""
        return self.training_until is not None or len(self.completed_at) > self.trained

    def _force_return(self, g: SimGpu, t: float) -> None:
        if self.controller is not None:  # the oracle's GPUs come back instantly
            g.role, g.borrowed, self._dirty = Role.TRAIN, False, True
            return
        self.forced_returns += 1
        self._apply(Move(g.id, MoveKind.RETURN, g.role, Role.TRAIN, 0.0), t)

    # -- policy ----------------------------------------------------------------------------------------

    def _control(self, t: float) -> None:
        plan = self.decide(self.snapshot(t))
        if plan is None or not plan.moves:
            return
        self.plans += 1
        applied = 0
        groups: dict[tuple, list[Move]] = {}
        for move in plan.moves:
            if move.kind is MoveKind.SWITCH and 0 <= move.gpu < len(self.gpus):
                g = self.gpus[move.gpu]
                groups.setdefault((g.node, g.pool, move.from_role, move.to_role), []).append(move)
            else:
                applied += self._apply(move, t)
        self._switch_queue = list(groups.values())
        applied += self._next_switch(t)
        if applied:
            self.last_change_at = t

    def _next_switch(self, t: float) -> int:
        """Start the plan's next group of switches once the group switching now has finished (as the
        daemon's transitions do: one switch at a time, the other workers serving meanwhile); a group none
        of whose moves still fit ends the plan's switches, as a failed switch drops the daemon's waiting
        ones. Returns the moves applied."""
        if any(self.gpus[i].busy_until > t for i in self._switching):
            return 0
        self._switching = []
        while self._switch_queue:
            group = self._switch_queue.pop(0)
            applied = [m.gpu for m in group if self._apply(m, t)]
            if applied:
                self._switching = applied
                return len(applied)
            self._switch_queue = []
        return 0

    def _apply(self, move: Move, t: float) -> bool:
        """Apply one move at its true cost; refuse (and count) one that does not fit the simulated state."""
        if not 0 <= move.gpu < len(self.gpus) or not self.gpus[move.gpu].present:
            return self._refuse(move, "no such GPU present")
        g = self.gpus[move.gpu]
        c = self.profile.costs
        if g.busy_until > t:
            return self._refuse(move, "GPU in transition")
        if g.role != move.from_role or move.to_role == move.from_role:
            return self._refuse(move, f"GPU is {g.role.value}, not {move.from_role.value}")
        kind, to = move.kind, move.to_role
        stale = g.version < self.version
        wake = c.wake_s + (self.scenario.training.weight_sync_s if stale else 0.0)
        if kind == MoveKind.BORROW:
            # The trainer releases a GPU only while it waits for rollouts, never mid-step.
            if g.pool != "trainer" or self.training_until is not None or to not in SERVING:
                return self._refuse(move, "borrow of a non-trainer GPU, to a non-serving role, or mid-step")
            cost = c.offload_s + (wake if g.parked else c.start_s)
            g.borrowed, g.parked = True, False
        elif kind == MoveKind.RETURN:
            if g.pool != "trainer" or to != Role.TRAIN:
                return self._refuse(move, "return of a non-trainer GPU or to a role other than TRAIN")
            cost = c.sleep_s + c.reload_s  # the rollout worker is parked asleep: the next borrow is a wake
            g.borrowed, g.parked = False, True
        elif kind in (MoveKind.START, MoveKind.WAKE):
            if g.pool == "trainer" or g.role != Role.IDLE or to not in SERVING:
                return self._refuse(move, "start/wake of a trainer GPU, a non-idle GPU, or to a non-serving role")
            cost = wake if g.parked else c.start_s  # a WAKE of a GPU with nothing parked is a cold start
            g.parked = False
        elif kind == MoveKind.RETIRE:
            if g.role not in SERVING or to != Role.IDLE or g.pool == "trainer":
                return self._refuse(move, "retire of a trainer GPU or of a GPU not serving")
            # Elastic GPUs may vanish: stop the worker; rollout GPUs park it for a quick wake.
            cost, g.parked = (c.stop_s, False) if g.pool == "elastic" else (c.sleep_s, True)
        elif kind == MoveKind.SWITCH:
            if g.role not in SERVING or to not in SERVING:
                return self._refuse(move, "switch between non-serving roles")
            cost = c.role_switch_s
        else:
            return self._refuse(move, "unknown move kind")
        if g.role in SERVING:
            cost += ABORT_S  # a worker leaving its role first aborts what it runs (continued elsewhere)
        if to in SERVING:
            g.version = self.version  # a cold start loads the newest weights; a stale wake paid its sync above
        g.role = to
        g.busy_until = t + cost
        self.transitions += 1
        self._dirty = True
        return True

    def _refuse(self, move: Move, why: str) -> bool:
        key = f"{move.kind.value}: {why}"
        self.refusals[key] = self.refusals.get(key, 0) + 1
        return False

    # -- what the policy sees ----------------------------------------------------------------------------

    def snapshot(self, t: float) -> Snapshot:
        work = self.work_view()
        trainer = self._trainer_view(t, work)
        deadline = t + trainer.wait_left_s if trainer.phase == "waiting" else t
        gpus = tuple(
            GpuSlot(
                id=g.id,
                node=g.node,
                pool=g.pool,
                role=g.role,
                parked=g.parked,
                borrowed=g.borrowed,
                return_deadline=deadline if g.borrowed else None,
                ends_at=g.ends_at,
            )
            for g in self.gpus
            if g.present
        )
        disagg = any(g.role in (Role.PREFILL, Role.DECODE) for g in gpus)
        return Snapshot(
            now=t,
            gpus=gpus,
            work=work,
            trainer=trainer,
            profile=self.profile,
            costs=self.profile.costs,
            mode=Mode.DISAGGREGATED if disagg else Mode.COLOCATED,
            preempt_per_hour=self.trace.preempt_per_hour,
            last_change_at=self.last_change_at,
        )

    def _trainer_view(self, t: float, work: Work) -> Trainer:
        """What the trainer hook would report: its phase and its ETA for the batch it waits on."""
        step_s = self.scenario.training.train_step_s
        if self.training_until is not None:
            return Trainer(phase="training", wait_left_s=0.0, step_time_s=step_s)
        return Trainer(phase="waiting", wait_left_s=self._expected_wait(t, work), step_time_s=step_s)

    def _expected_wait(self, t: float, work: Work) -> float:
        """The trainer's ETA, as a training loop could know it. Synchronous: what examples/grpo/train.py
        reports — from the moment it starts waiting (the end of its step, so the weight sync and the next
        batch's launch are inside it), a moving average of its past waits less the time waited so far.
        Asynchronous: from the interval between batch completions (batches overlap). Before any history, or
        when the batch is already later than history says, the planner's prediction for the deployment
        serving now (what a rollout driver with the profile would report)."""
        wait = 0.0
        if self.scenario.training.mode == "async":
            if self.trained >= self.launched:
                return 0.0
            done = self.completed_at
            if len(done) >= 2:
                wait = float(np.mean(np.diff(done))) - (t - done[-1])
        elif self.wait_ema is not None:
            wait = self.wait_ema - (t - self.waiting_since)
        if wait > 0 or work.empty:
            return max(wait, 0.0)
        predicted = completion_s(work, self._deployment(), self.profile)
        return predicted if math.isfinite(predicted) else 0.0

    def _deployment(self) -> Deployment:
        n = {r: sum(1 for g in self.gpus if g.present and g.role == r) // self.gpw for r in SERVING}
        if n[Role.PREFILL] or n[Role.DECODE]:
            return Deployment(Mode.DISAGGREGATED, decode=n[Role.DECODE] + n[Role.ROLLOUT], prefill=n[Role.PREFILL])
        return Deployment(Mode.COLOCATED, decode=n[Role.ROLLOUT])

    def work_view(self) -> Work:
        e = self.engine
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

    # -- engine roles and accounting -----------------------------------------------------------------------

    def _refresh(self, t: float) -> None:
        self._sync_roles(t)
        self._counts = self._census(t)
        self._next_expiry = min(
            (x for g in self.gpus for x in (g.busy_until, g.abort_at or 0.0) if x > t), default=math.inf
        )
        self._dirty = False

    def _sync_roles(self, t: float) -> None:
        n = len(self.gpus) // self.gpw
        roles = np.full(n, W_OFF, np.int8)
        routable = np.ones(n, bool)
        for k in range(n):
            group = self.gpus[k * self.gpw : (k + 1) * self.gpw]
            r = group[0].role
            if r in SERVING and all(g.present and g.role == r and not self._stopped(g, t) for g in group):
                roles[k] = ENGINE_ROLE[r]
                routable[k] = all(g.abort_at is None for g in group)  # a preemption notice: draining
        killed = np.zeros(n, bool)
        killed[list(self._killed)] = True
        self._killed.clear()
        self.engine.set_roles(roles, t, routable=routable, killed=killed)

    @staticmethod
    def _stopped(g: SimGpu, t: float) -> bool:
        """In transition, or a worker drained and stopped before its GPU's preemption."""
        return g.busy_until > t or (g.abort_at is not None and t >= g.abort_at and g.role in SERVING)

    def _category(self, g: SimGpu, t: float) -> str:
        if self._stopped(g, t):
            return "TRANSITION"
        if g.role == Role.TRAIN:
            return "TRAIN" if self.training_until is not None else "TRAIN_IDLE"
        return g.role.value

    def _census(self, t: float) -> dict[str, int]:
        counts = dict.fromkeys(CATEGORIES, 0)
        for g in self.gpus:
            if g.present:
                counts[self._category(g, t)] += 1
        return counts


def drain_s(notice_s: float) -> float:
    """How long a worker told of its preemption ``notice_s`` ahead drains before it aborts what is still in
    flight: the agent's drain timeout is the notice less 5 s (pearlctl/slurm/script.py, PEARL_DRAIN_TIMEOUT_S),
    of which it keeps min(5 s, 25 %) for the abort and the stop (pearlctl/agent/workers.py, VllmWorker.stop)."""
    timeout = max(1.0, notice_s - 5.0)
    return max(0.1, timeout - min(5.0, 0.25 * timeout))


def _residual_table(turns) -> np.ndarray:
    """E[turns left | turns done = d] for d = 0 .. max, from the workload's turn distribution (history)."""
    x = np.maximum(1, np.rint(turns.sample(np.random.default_rng(7), 20000)))
    top = int(x.max())
    out = np.ones(top + 1)
    for d in range(top + 1):
        alive = x[x > d]
        out[d] = float((alive - d).mean()) if alive.size else 1.0
    return out


def make_draws(scenario: Scenario) -> Draws:
    n = scenario.steps * scenario.workload.batch_size
    return draw(scenario.workload, n, np.random.default_rng([scenario.seed, 0x7A5C]))


def make_trace(scenario: Scenario) -> Trace:
    return build_trace(scenario, horizon_s=MAX_SIM_S, seed=scenario.seed)


def run_policy(
    scenario: Scenario,
    policy: str,
    *,
    record_timeline: bool = False,
    draws=None,
    trace=None,
    router: str = DEFAULT_ROUTER,
) -> RunResult:
    """Simulate ``policy`` (a name ``pearlctl.policies.load_policy`` finds, or ``oracle``) on ``scenario``;
    ``router``: the engine's router model (``pearlctl.sim.engine.ROUTERS``)."""
    if policy == "oracle":
        from pearlctl.sim.oracle import run_oracle

        return run_oracle(scenario, record_timeline=record_timeline, draws=draws, trace=trace, router=router)
    from pearlctl.policies import load_policy

    module = load_policy(policy)
    sim = Sim(scenario, policy, module.decide, draws=draws, trace=trace, record_timeline=record_timeline, router=router)
    return sim.run()


def compare(
    scenario: Scenario,
    policies: list[str],
    *,
    record_timeline: bool = False,
    workers: int | None = None,
    router: str = DEFAULT_ROUTER,
) -> dict[str, RunResult]:
    """Every policy on the same drawn work and the same elastic trace; runs are independent, so they go to
    ``workers`` processes (default: one per policy, at most one per CPU). Results keep the given order."""
    draws, trace = make_draws(scenario), make_trace(scenario)
    n = min(len(policies), workers if workers is not None else (os.cpu_count() or 1))
    kw = {"record_timeline": record_timeline, "draws": draws, "trace": trace, "router": router}
    if n <= 1:
        return {p: run_policy(scenario, p, **kw) for p in policies}
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {p: pool.submit(run_policy, scenario, p, **kw) for p in policies}
        return {p: f.result() for p, f in futures.items()}
