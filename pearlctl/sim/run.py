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
flight (turns left from the workload's history, not the drawn future), the trainer's phase and the ETA the
training loop itself reports (examples/grpo/train.py: a moving average of its measured waits; none before the
first), transition costs as the daemon's running estimates (the median of the last 5 journaled steps of each
kind, else the profile's), and the scenario's profile with the predictor's running correction as its
``time_scale`` — kept as the daemon keeps it (``_check_prediction``, pearlctl.planner.correct). The oracle
(``pearlctl.sim.oracle``) alone reads the future.

Under a model mismatch (the scenario's ``[mismatch]``, pearlctl.sim.scenario.Mismatch) the engines run the
truth — decode, prefill and tool calls slower or faster than the profile and the workload say — and every move
takes its true cost (its profile cost times a factor drawn per move), while the policies keep seeing the
scenario's profile and distributions: the planner does not know the truth, it only learns from what happens.

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

Guarantees: deterministic for a scenario (its seed draws the work, the elastic trace and the mismatch); the
daemon's return guarantee holds — when the trainer needs its GPUs, lent ones are returned
(forced if the policy has not) and the wait they cause is counted as trainer delay; a GPU is never moved
while it is in transition; moves that do not match the simulated state are refused and counted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pearlctl.planner import correct, plan
from pearlctl.planner.choose import worker_groups
from pearlctl.planner.model import (
    SERVING,
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
from pearlctl.planner.predict import predict
from pearlctl.planner.profile import STEP_COSTS, WEIGHT_LOAD, TransitionCosts
from pearlctl.sim.availability import Trace, build_trace
from pearlctl.sim.engine import ABORT_S, W_DECODE, W_OFF, W_PREFILL, W_ROLLOUT, Engine
from pearlctl.sim.routing import DEFAULT_ROUTER
from pearlctl.sim.scenario import Scenario
from pearlctl.sim.trajectories import TOOL, Draws, draw, with_mismatch
from pearlctl.vocabulary import PoolKind
from pearlctl.vocabulary import StepKind as K

ENGINE_ROLE = {Role.ROLLOUT: W_ROLLOUT, Role.PREFILL: W_PREFILL, Role.DECODE: W_DECODE}
MAX_SIM_S = 7 * 24 * 3600.0  # a run that has not finished its steps by then is reported as unfinished
STALL_S = 3600.0  # simulated seconds without decode progress or a train step: the run is stuck
TIMELINE_EVERY_S = 10.0
COST_ESTIMATE_LAST = 5  # the daemon's running transition-cost estimates: the median of the last 5 steps of a kind

# GPU-second categories: the roles, with TRAIN split by whether the trainer is computing, and TRANSITION.
_R = Role
CATEGORIES = (_R.TRAIN, "TRAIN_IDLE", _R.ROLLOUT, _R.PREFILL, _R.DECODE, _R.REWARD, _R.IDLE, "TRANSITION")


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
class Schedule:
    """What a run did with its GPUs, as the oracle replays it (pearlctl.sim.oracle, ``ReplayController``): every
    change of a GPU's role (its target role from the moment its move began; None while the GPU is not granted),
    and when each of the trainer's steps began its epoch — ``epochs[e]``: the time it had trained ``e`` steps."""

    epochs: list[float] = field(default_factory=lambda: [0.0])
    changes: list[tuple[float, int, Role | None]] = field(default_factory=list)


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
    # the predictor's correction (pearlctl.planner.correct) as the run left it: batches checked, and the
    # overall measured/predicted ratio (None: the correction was off or learned nothing)
    predictor_checks: int = 0
    predictor_ratio: float | None = None
    schedule: Schedule | None = None  # the GPU roles over time (``record_schedule``), for the oracle's replay
    oracle_choice: str | None = None  # the oracle's winning candidate (pearlctl.sim.oracle)

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
        correction: bool = True,
        record_schedule: bool = False,
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
                pool, role, node = PoolKind.TRAINER, Role.TRAIN, f"t{i // c.gpus_per_node}"
            elif i < c.trainer_gpus + c.rollout_gpus:
                j = i - c.trainer_gpus
                pool, role, node = PoolKind.ROLLOUT, Role.ROLLOUT, f"r{j // c.gpus_per_node}"
            else:
                j = i - c.trainer_gpus - c.rollout_gpus
                pool, role, node = PoolKind.ELASTIC, Role.IDLE, f"e{j // c.gpus_per_node}"
            self.gpus.append(SimGpu(i, node, pool, role, present=pool != PoolKind.ELASTIC))
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
        self.step_times: list[float] = []  # when each train step ended
        self.training_until: float | None = None
        self.sync_until = 0.0
        self.blocked_since: float | None = None
        self.waiting_since = 0.0  # when the trainer last started waiting for a batch (the end of its step)
        self.due_since: float | None = None  # when the next batch became due (the driver's join wait runs from then)
        # its measured waits, averaged as examples/grpo/train.py does, from its first-wait hint (None: unknown)
        self.wait_ema: float | None = scenario.training.first_wait_s
        self.last_batch = Work()  # the latest batch's work as it began (Snapshot.last_batch)
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
        self._gpu_state_kept: tuple[bool, tuple[int, ...]] | None = None  # (``_gpu_state``)
        self._slots: list[GpuSlot | None] = [None] * total  # each GPU's last snapshot slot (``_slot``)
        self._presence: tuple[bool, ...] | None = None  # (``presence``)
        self._counts: dict[str, int] = {}
        self._killed: set[int] = set()  # workers preempted without a drain since the last role sync
        # a plan's switches not started yet, one group per live transition (node, pool, roles), and the GPUs
        # of the group now switching: the daemon runs a plan's switches one transition at a time
        self._switch_queue: list[list[Move]] = []
        self._switching: list[int] = []
        # the loop's clocks: the next periodic decision, the events last decided on, the next timeline sample
        self._next_control = 0.0
        self._seen: tuple | None = None
        self._next_sample = 0.0
        # Model mismatch: each move's true duration is its profile cost times a factor drawn per move; the steps'
        # true durations are journaled and the snapshot's costs are their running estimates, as the daemon's.
        self._move_rng = np.random.default_rng([scenario.seed, 0x7A11])
        self._journal: dict[str, list[float]] = {}
        self._costs: TransitionCosts | None = None  # (``costs``)
        self._scaled_profile = None  # (``_scaled``)
        # The predictor's running correction (pearlctl.planner.correct), kept and applied as the daemon does.
        self.correction = correction
        self.predictor: dict = {}
        self.checks: list[correct.Check] = []
        self._launches_seen = 0  # batches launched when the correction last looked
        # The roles over time, for the oracle's replay (``Schedule``): recorded at every refresh of the roles.
        self.schedule = Schedule() if record_schedule else None
        self._recorded: list[Role | None] = [None] * total
        # The loop's own clock and progress (``advance``).
        self.now = 0.0
        self._progress, self._progress_at = -1.0, 0.0
        self.stalled = False

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> RunResult:
        self.advance(math.inf)
        return self.result()

    @property
    def over(self) -> bool:
        """The run trained its steps, or gave up (stalled, or past ``MAX_SIM_S``)."""
        return self.trained >= self.steps or self.stalled or self.now >= MAX_SIM_S

    def advance(self, until: float) -> None:
        """Tick until simulated time ``until`` or the run is over (the oracle plays candidates leg by leg)."""
        dt = self.scenario.tick_s
        while not self.over and self.now < until - 1e-9:
            # A policy that leaves nothing serving would never finish: give up after an hour without progress.
            done = self.engine.stats["decode_tokens"] + self.trained
            if done != self._progress:
                self._progress, self._progress_at = done, self.now
            elif self.now - self._progress_at > STALL_S:
                self.stalled = True
                break
            self.tick(self.now, dt)
            self.now += dt

    def result(self) -> RunResult:
        finished = self.trained >= self.steps
        end = self._finished_at if finished else self.now
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
            predictor_checks=len(self.checks),
            predictor_ratio=(self.predictor.get("all") or {}).get("ratio"),
            schedule=None if self.schedule is None else replace(self.schedule, epochs=[0.0, *self.step_times]),
        )

    def tick(self, t: float, dt: float) -> None:
        """One step of simulated time from ``t``: the elastic trace, the trainer and the driver, the control
        (the policy or the oracle), the engines, the accounting."""
        self._availability(t)
        self._trainer(t)
        if self.correction and self.controller is None:
            self._check_prediction(t)
        if self.controller is not None:
            self.controller.control(self, t)
        elif self._switch_queue or self._switching:
            self._next_switch(t)  # the daemon plans nothing new while a plan's switches still run
        elif t >= self._next_control - 1e-9 or self._events() != self._seen:
            # every control interval, and as soon as the trainer or the elastic trace changes: the daemon
            # decides every tick (0.5 s), so it reacts to a trainer's report or a grant within one
            self._next_control, self._seen = t + self.scenario.control_interval_s, self._events()
            self._control(t)
        if self._dirty or t >= self._next_expiry:
            self._refresh(t)
        self.engine.step(t, dt)
        for k, n in self._counts.items():
            self.gpu_s[k] += n * dt
        if self.record_timeline and t >= self._next_sample:
            self.timeline.append((t, dict(self._counts)))
            self._next_sample = t + TIMELINE_EVERY_S

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
            self._presence = None
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
                    self._presence = None

    def presence(self) -> tuple[bool, ...]:
        """Which GPUs are present, GPU by GPU (the oracle's controllers key their decisions on it): made again
        only after the elastic trace changed one (``_availability``), the only place presence changes."""
        if self._presence is None:
            self._presence = tuple(g.present for g in self.gpus)
        return self._presence

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
            self.step_times.append(t)
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
        return [g for g in self.gpus if g.pool == PoolKind.TRAINER and (g.role != Role.TRAIN or g.busy_until > t)]

    def joining(self, t: float) -> int:
        """Workers on their way to serving rollouts: those whose GPUs are in a transition toward a serving role
        (a borrow, start, wake or switch not finished yet) — the ``joining`` of the daemon's ``GET /v1/workers``
        (pearlctl/daemon/agents.py, routable_workers)."""
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
        began = not self.engine.busy()  # the driver's first report with work after none (the daemon's batch_work)
        lo, hi = self._batch_range(self.launched)
        self.engine.launch(lo, hi, t)
        self.launched_at.append(t)
        self.launched += 1
        if began:
            self.last_batch = self.work_view()

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
        # the move's steps (journal kind, profile seconds); a stale wake also loads the newest weights
        wake = [(K.WAKE, c.wake_s)] + ([(WEIGHT_LOAD, self.scenario.training.weight_sync_s)] if stale else [])
        if kind == MoveKind.BORROW:
            # The trainer releases a GPU only while it waits for rollouts, never mid-step.
            if g.pool != PoolKind.TRAINER or self.training_until is not None or to not in SERVING:
                return self._refuse(move, "borrow of a non-trainer GPU, to a non-serving role, or mid-step")
            steps = [(K.OFFLOAD, c.offload_s)] + (wake if g.parked else [(K.START, c.start_s)])
            g.borrowed, g.parked = True, False
        elif kind == MoveKind.RETURN:
            if g.pool != PoolKind.TRAINER or to != Role.TRAIN:
                return self._refuse(move, "return of a non-trainer GPU or to a role other than TRAIN")
            # the rollout worker is parked asleep: the next borrow is a wake
            steps = [(K.SLEEP, c.sleep_s), (K.RELOAD, c.reload_s)]
            g.borrowed, g.parked = False, True
        elif kind in (MoveKind.START, MoveKind.WAKE):
            if g.pool == PoolKind.TRAINER or g.role != Role.IDLE or to not in SERVING:
                return self._refuse(move, "start/wake of a trainer GPU, a non-idle GPU, or to a non-serving role")
            steps = wake if g.parked else [(K.START, c.start_s)]  # a WAKE of a GPU with nothing parked: cold start
            g.parked = False
        elif kind == MoveKind.RETIRE:
            if g.role not in SERVING or to != Role.IDLE or g.pool == PoolKind.TRAINER:
                return self._refuse(move, "retire of a trainer GPU or of a GPU not serving")
            # Elastic GPUs may vanish: stop the worker; rollout GPUs park it for a quick wake.
            elastic = g.pool == PoolKind.ELASTIC
            steps, g.parked = ([(K.STOP, c.stop_s)], False) if elastic else ([(K.SLEEP, c.sleep_s)], True)
        elif kind == MoveKind.SWITCH:
            if g.role not in SERVING or to not in SERVING:
                return self._refuse(move, "switch between non-serving roles")
            steps = [("SWITCH", c.role_switch_s)]  # not a journaled step kind: planned at the profile's cost
        else:
            return self._refuse(move, "unknown move kind")
        cost = self._true_cost(steps)
        if g.role in SERVING:
            cost += ABORT_S  # a worker leaving its role first aborts what it runs (continued elsewhere)
        if to in SERVING:
            g.version = self.version  # a cold start loads the newest weights; a stale wake paid its sync above
        g.role = to
        g.busy_until = t + cost
        self.transitions += 1
        self._dirty = True
        return True

    def _true_cost(self, steps: list[tuple[str, float]]) -> float:
        """A move's true duration: its steps' profile costs times the mismatch's factor for this move (one
        draw per move, in move order: deterministic for a seed). Each step's true duration is journaled."""
        mm = self.scenario.mismatch.transitions
        f = 1.0 if mm.zero else float(mm.factors(self._move_rng, 1)[0])
        cost = 0.0
        for kind, seconds in steps:
            true_s = seconds * f
            self._journal.setdefault(kind, []).append(true_s)
            self._costs = None  # (``costs``: estimated again)
            cost += true_s
        return cost

    def costs(self) -> TransitionCosts:
        """The transition costs a policy plans with: the daemon's running estimates (``Borrowing.costs``: the
        median of the last 5 journaled steps of each kind, else the profile's). They change only when a step is
        journaled (``_true_cost``), so they are kept until then."""
        if self._costs is None:
            est = {
                field: statistics.median(self._journal[kind][-COST_ESTIMATE_LAST:])
                for kind, field in STEP_COSTS.items()
                if kind in self._journal
            }
            self._costs = replace(self.profile.costs, **est) if est else self.profile.costs
        return self._costs

    def _scaled(self, time_scale: float):
        """The profile with the predictor's correction ``time_scale``: the same object while the correction is
        the same number (a profile's ``replace`` checks every field again, at every decision)."""
        kept = self._scaled_profile
        same = kept is not None and kept.time_scale == time_scale
        if not same or math.copysign(1.0, kept.time_scale) != math.copysign(1.0, time_scale):  # (0.0 and -0.0)
            kept = self._scaled_profile = replace(self.profile, time_scale=time_scale)
        return kept

    def _refuse(self, move: Move, why: str) -> bool:
        key = f"{move.kind.value}: {why}"
        self.refusals[key] = self.refusals.get(key, 0) + 1
        return False

    # -- what the policy sees ----------------------------------------------------------------------------

    def snapshot(self, t: float, *, corrected: bool = True) -> Snapshot:
        """What the daemon's ``Borrowing.snapshot`` would build from this state. ``corrected``: the profile's
        ``time_scale`` is the predictor's correction for the work's shape (when the run keeps one)."""
        work = self.work_view()
        trainer = self._trainer_view(t)
        deadline = t + trainer.wait_left_s if trainer.phase == "waiting" else t
        gpus = tuple(self._slot(g, deadline) for g in self.gpus if g.present)
        disagg = any(g.role in (Role.PREFILL, Role.DECODE) for g in gpus)
        profile = self.profile
        if corrected and self.correction:  # predictions corrected by what the run's past batches took
            key = correct.shape(work, serving_workers(gpus, profile.gpus_per_worker))
            profile = self._scaled(correct.factor(self.predictor, key))
        snapshot = Snapshot(
            now=t,
            gpus=gpus,
            work=work,
            trainer=trainer,
            profile=profile,
            costs=self.costs(),
            mode=Mode.DISAGGREGATED if disagg else Mode.COLOCATED,
            preempt_per_hour=self.trace.preempt_per_hour,
            last_change_at=self.last_change_at,
            last_batch=self.last_batch,
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
            or kept.ends_at is not g.ends_at
        ):
            kept = GpuSlot(
                id=g.id,
                node=g.node,
                pool=g.pool,
                role=g.role,
                parked=g.parked,
                borrowed=g.borrowed,
                return_deadline=deadline if g.borrowed else None,
                ends_at=g.ends_at,
            )
            self._slots[g.id] = kept
        return kept

    def _trainer_view(self, t: float) -> Trainer:
        """What the trainer hook would report: its phase and its ETA for the batch it waits on."""
        step_s = self.scenario.training.train_step_s
        if self.training_until is not None:
            return Trainer(phase="training", wait_left_s=0.0, step_time_s=step_s)
        if self.wait_ema is None:  # no wait measured yet: the trainer reports none (``plan.expect_wait``)
            return Trainer(phase="waiting", step_time_s=step_s, wait_known=False)
        return Trainer(phase="waiting", wait_left_s=self._expected_wait(t), step_time_s=step_s)

    def _expected_wait(self, t: float) -> float:
        """The trainer's ETA, as examples/grpo/train.py computes it — the simulated trainer's own numbers, never
        the policy's predictor: from the moment it starts waiting (the end of its step, so the weight sync and
        the next batch's launch are inside it), a moving average (0.7 old, 0.3 new) of the waits it measured,
        less the time waited so far, floored at 0 (the trainer hook's ``wait_until``). The same in an
        asynchronous loop, where a batch generated ahead makes the wait short or nothing. Before any wait was
        measured the trainer reports none, unless the scenario gives it a hint (``first_wait_s``, as
        ``PEARL_FIRST_WAIT_S``); ``_trainer_view`` then leaves the wait to the planner's prediction."""
        return max((self.wait_ema or 0.0) - (t - self.waiting_since), 0.0)

    # -- the predictor's correction (pearlctl.planner.correct), as the daemon keeps it ---------------------------

    def _moving(self, t: float) -> bool:
        """A transition is open: a GPU in one, or a plan's switches still to run."""
        return bool(self._switch_queue) or self._gpu_state(t)[0]

    def _serving_ids(self, t: float) -> tuple[int, ...]:
        return self._gpu_state(t)[1]

    def _gpu_state(self, t: float) -> tuple[bool, tuple[int, ...]]:
        """(some present GPU is in transition, the ids of the serving GPUs that are not stopped) at ``t``. Both
        change only when a GPU's presence, role, ``busy_until`` or ``abort_at`` does (each sets ``_dirty``) or when
        time passes one of those instants (``_next_expiry``: the first after the last ``_refresh``), so the answer
        is kept from the first tick that asks until either happens (``_refresh`` drops it)."""
        kept = self._gpu_state_kept
        if kept is not None and not self._dirty and t < self._next_expiry:
            return kept
        busy, ids = False, []
        for g in self.gpus:  # (one pass: a large cluster has thousands)
            if g.present:
                if g.busy_until > t:
                    busy = True  # (in transition: stopped)
                elif g.role in SERVING and not self._stopped(g, t):
                    ids.append(g.id)
        serving = tuple(ids)
        if not self._dirty and t < self._next_expiry:
            self._gpu_state_kept = busy, serving
        return busy, serving

    def _check_prediction(self, t: float) -> None:
        """The daemon's ``Borrowing.check_prediction`` on the simulated rollout driver's progress: a watch starts
        while work is in flight and no transition is open — the completion predicted then for the serving GPUs
        (uncorrected), the time, the GPUs; a change of the serving GPUs drops it (a plan's effect is not
        prediction error) and the next stable moment starts another; the first moment without work ends the
        batch, and measured / predicted goes into the correction (``correct.learn``)."""
        watch = self.predictor.get("watch")
        if not self.engine.busy():  # the driver reports no work left
            if watch is not None:
                state, check = correct.finish(self.predictor, t)
                self.predictor = {**state, "watch": None}
                if check is not None:
                    self.checks.append(check)
            self.predictor = {**self.predictor, "batch_since": None}
            return
        # (trajectories join only at a launch: the work is looked at only after one)
        launched, self._launches_seen = self._launches_seen, self.launched
        if watch is not None and launched != self.launched and correct.grew(self.predictor, self.work_view()):
            # the next batch joined before this one ended (asynchronous): no watch spans both
            self.predictor = {**self.predictor, "watch": None, "batch_since": None}
            watch = None
        if self.predictor.get("batch_since") is None:  # the batch's first moment with work
            self.predictor = {**self.predictor, "batch_since": t}
        if self._moving(t):
            if watch is not None:
                self.predictor = {**self.predictor, "watch": None}
            return
        serving = self._serving_ids(t)
        if watch is not None and watch["gpus"] == serving:
            return
        snap = self.snapshot(t, corrected=False)
        work = snap.work
        prediction = predict(work, plan.current_deployment(snap), self.profile)  # uncorrected
        key = correct.shape(work, serving_workers(snap.gpus, self.gpw))
        self.predictor = {**self.predictor, "watch": correct.watch(prediction, key, t, serving, work.trajectories)}

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
        if self.schedule is not None:
            self._record(t)
        self._sync_roles(t)
        self._counts = self._census(t)
        self._next_expiry = min(
            (x for g in self.gpus for x in (g.busy_until, g.abort_at or 0.0) if x > t), default=math.inf
        )
        self._dirty = False
        self._gpu_state_kept = None

    def _record(self, t: float) -> None:
        """Append the GPUs whose role (or presence) changed since the last record to the schedule."""
        seen, changes = self._recorded, self.schedule.changes
        for g in self.gpus:
            role = g.role if g.present else None
            if role != seen[g.id]:
                seen[g.id] = role
                changes.append((t, g.id, role))

    def _sync_roles(self, t: float) -> None:
        gpus, gpw = self.gpus, self.gpw
        n = len(gpus) // gpw
        # A worker serves when all its GPUs are present, in its first GPU's serving role and not stopped: one pass
        # over the GPUs, one over the workers (a large cluster has thousands; a one-GPU worker is its GPU).
        up = [g.present and g.role in SERVING and not self._stopped(g, t) for g in gpus]
        notice = [g.abort_at is not None for g in gpus]  # a preemption notice: its worker drains
        roles, routable = [W_OFF] * n, [True] * n
        for k in range(n):
            lo, hi = k * gpw, (k + 1) * gpw
            r = gpus[lo].role
            if up[lo] and (gpw == 1 or (all(up[lo:hi]) and all(g.role == r for g in gpus[lo:hi]))):
                roles[k] = ENGINE_ROLE[r]
                routable[k] = not any(notice[lo:hi])
        killed = np.zeros(n, bool)
        killed[list(self._killed)] = True
        self._killed.clear()
        self.engine.set_roles(np.array(roles, np.int8), t, routable=np.array(routable, bool), killed=killed)

    @staticmethod
    def _stopped(g: SimGpu, t: float) -> bool:
        """In transition, or a worker drained and stopped before its GPU's preemption."""
        return g.busy_until > t or (g.abort_at is not None and t >= g.abort_at and g.role in SERVING)

    def _category(self, g: SimGpu, t: float) -> str:
        if self._stopped(g, t):
            return "TRANSITION"
        if g.role == Role.TRAIN:
            return Role.TRAIN.value if self.training_until is not None else "TRAIN_IDLE"
        return str(g.role)  # (its value: a StrEnum's str, without the enum's value property)

    def _census(self, t: float) -> dict[str, int]:
        counts = dict.fromkeys(CATEGORIES, 0)
        for g in self.gpus:
            if g.present:
                counts[self._category(g, t)] += 1
        return counts


def serving_workers(gpus, gpus_per_worker: int) -> int:
    """Serving workers among planner GPU slots (whole groups per node and pool, as ``choose`` counts them) — the
    daemon's count for the predictor's batch shape (pearlctl/daemon/borrowing.py, ``_serving_workers``)."""
    return sum(worker_groups([g for g in gpus if g.role in SERVING], gpus_per_worker).values())


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
    """The run's trajectories, and under a model mismatch their truth (drawn from a stream of its own, so the
    workload is the same with and without a mismatch)."""
    n = scenario.steps * scenario.workload.batch_size
    draws = draw(scenario.workload, n, np.random.default_rng([scenario.seed, 0x7A5C]))
    return with_mismatch(draws, scenario.mismatch, np.random.default_rng([scenario.seed, 0x3A7C]))


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
    correction: bool = True,
    record_schedule: bool = False,
) -> RunResult:
    """Simulate ``policy`` (a name ``pearlctl.policies.load_policy`` finds; the oracle is
    ``pearlctl.sim.compare.simulate``'s) on ``scenario``; ``router``: the engine's router model
    (``pearlctl.sim.engine.ROUTERS``); ``correction``: keep and apply the predictor's running correction, as the
    daemon does; ``record_schedule``: keep the run's roles over time (``RunResult.schedule``) for the oracle."""
    from pearlctl.policies import load_policy

    module = load_policy(policy)
    sim = Sim(
        scenario,
        policy,
        module.decide,
        draws=draws,
        trace=trace,
        record_timeline=record_timeline,
        router=router,
        correction=correction,
        record_schedule=record_schedule,
    )
    return sim.run()
