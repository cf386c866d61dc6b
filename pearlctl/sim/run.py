"""The RL loop in simulated time, driving a policy exactly as the daemon does.

One ``Sim`` is one policy on one scenario. Each tick it applies the elastic trace (grants, notices,
preemptions), moves the trainer (synchronous: rollout batch → train step → weight sync; asynchronous: batches
generated up to ``staleness`` steps ahead of the trainer, engines pausing for each weight sync), advances the
engines (``pearlctl.sim.engine``) and, every ``control_interval_s`` and as soon as the trainer's phase, the
batches or the elastic trace change (a live daemon decides every tick, so it reacts to those within one),
builds a ``pearlctl.planner.model.Snapshot`` of the simulated cluster and calls the policy's ``decide`` — the
module ``pearlctl.policies.load_policy`` gives the daemon, never a copy.

The ``Sim`` keeps the clock, the trainer, the rollout driver and the elastic trace; its parts, one object each
working on it, do the rest:

- ``view`` (``pearlctl.sim.snapshot``): what the policy sees — what a live daemon could know, never the drawn
  future; the oracle (``pearlctl.sim.oracle``) alone reads the future;
- ``correction`` (``pearlctl.sim.correction``): the predictor's running correction, kept as the daemon keeps it;
- ``moves`` (``pearlctl.sim.moves``): the plans carried out, each move at its true cost, a plan's switches one
  transition at a time, the trainer's GPUs returned when it needs them;
- ``roles`` (``pearlctl.sim.gpus``): the GPUs' roles passed on to the engines, the GPU-second census, the
  timeline and the schedule the oracle replays.

Each part states what it reads and writes of the ``Sim`` as a protocol of its own module (``ViewedRun``,
``CorrectionRun``, ``MovesRun``, ``RolesRun``), so none imports this module and each can be read and tested with
no more than its protocol lists. The parts use one another in one direction — ``roles`` below ``view``, below
``moves``, below ``correction`` — and the view asks the correction and the moves above it only what
``ViewedCorrection`` and ``ViewedMoves`` say.

Under a model mismatch (the scenario's ``[mismatch]``, pearlctl.sim.scenario.Mismatch) the engines run the
truth — decode, prefill and tool calls slower or faster than the profile and the workload say — and every move
takes its true cost (its profile cost times a factor drawn per move), while the policies keep seeing the
scenario's profile and distributions: the planner does not know the truth, it only learns from what happens.

Leaves are paid as the live system pays them (``pearlctl.sim.engine``: abort and continue; a move's leave:
``pearlctl.sim.moves``). A preemption notice makes the worker's agent drain (pearlctl/agent/__main__.py): the
router sends it nothing new, it decodes what it runs for the agent's drain window (``drain_s``) and then aborts
the rest, which is continued elsewhere; a preemption with less notice than that window is a hard kill (the
running turns are retried from their start). The oracle's GPUs serve to the end and lose nothing.

A scenario with a ``[judge]`` runs a generative reward model beside the policy (``pearlctl.sim.judging``): each
trajectory's verdict is asked when it finishes, on the judge workers (GPUs in role REWARD), and a batch is complete
only once every verdict is in.

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
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pearlctl.planner.model import SERVING, Plan, Role, Snapshot, Work
from pearlctl.sim.availability import Trace, build_trace
from pearlctl.sim.correction import Correction
from pearlctl.sim.engine import Engine
from pearlctl.sim.gpus import GpuRoles, Schedule, SimGpu, judge_workers, make_gpus
from pearlctl.sim.judging import Judges
from pearlctl.sim.moves import Moves
from pearlctl.sim.routing import DEFAULT_ROUTER
from pearlctl.sim.scenario import Scenario
from pearlctl.sim.snapshot import PolicyView
from pearlctl.sim.trajectories import DONE, Draws, draw, with_mismatch
from pearlctl.vocabulary import PoolKind

MAX_SIM_S = 7 * 24 * 3600.0  # a run that has not finished its steps by then is reported as unfinished
STALL_S = 3600.0  # simulated seconds without decode progress or a train step: the run is stuck


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
    judge: dict[str, float] = field(default_factory=dict)  # the judge's counts (pearlctl.sim.judging); {}: none
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    # the predictor's correction (pearlctl.planner.correct) as the run left it: batches checked, and the
    # overall measured/predicted ratio (None: the correction was off or learned nothing)
    predictor_checks: int = 0
    predictor_ratio: float | None = None
    schedule: Schedule | None = None  # the GPU roles over time (``record_schedule``), for the oracle's replay
    oracle_choice: str | None = None  # the oracle's winning candidate (pearlctl.sim.oracle)
    chosen: str | None = None  # what a baseline chose among its runs (pearlctl.sim.compare: disaggregated's split)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.sim_time_s if self.sim_time_s > 0 else 0.0

    @property
    def steps_per_hour(self) -> float:
        return self.steps / (self.sim_time_s / 3600.0) if self.sim_time_s > 0 else 0.0


class SimulationError(Exception):
    """A simulation that could not finish: out of its memory limit, or its process died, or a baseline asked of a
    scenario it does not fit. One line, naming the policy and the scenario (the CLI prints it as it is)."""


class Sim:
    """One policy on one scenario, or a run a ``controller`` drives (the oracle's candidates, with
    ``free_migration``: the oracle's world; the colocated baseline)."""

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
        self.batch = scenario.workload.batch_size
        self.steps = scenario.steps
        self.draws = draws if draws is not None else make_draws(scenario)
        self.trace = trace if trace is not None else make_trace(scenario)
        self.gpw = self.profile.gpus_per_worker
        self.gpus: list[SimGpu] = make_gpus(scenario.cluster)
        self.free_migration = free_migration
        self.engine = Engine(
            self.profile,
            self.draws,
            len(self.gpus) // self.gpw,
            scenario.workload.max_context_tokens,
            free_migration,
            router=router,
        )
        # The judge (a scenario's [judge]): each finished trajectory is asked for its verdict; a batch is complete
        # once every verdict is in. ``_asked``: trajectories whose verdict was asked; ``_ask_lo``: all before it were.
        n = len(self.draws.turns)
        self.judges = None
        if scenario.judge is not None:
            self.judges = Judges(scenario.judge, n, scenario.mismatch, scenario.seed, free_migration)
        self._asked = np.zeros(n if self.judges is not None else 0, bool)
        self._ask_lo = 0
        self._judge_workers = 0
        self.controller = None  # a run no policy drives: the oracle's candidates, the colocated baseline
        self._trainer_at_start(scenario.training.first_wait_s)
        # Lease events, in time order.
        self._grants = sorted(self.trace.leases, key=lambda x: x.start)
        self._notices = sorted((x for x in self.trace.leases if math.isfinite(x.end)), key=lambda x: x.notice_at)
        self._ends = sorted((x for x in self.trace.leases if math.isfinite(x.end)), key=lambda x: x.end)
        self._gi = self._ni = self._ei = 0
        self.preemptions = 0
        self._presence: tuple[bool, ...] | None = None  # (``presence``)
        # Moves started (by the policy's plans or the oracle's controllers). A GPU's presence, role, busy_until
        # or abort_at changed since the roles were last refreshed: ``gpus_changed`` (whoever changes one sets it).
        self.transitions = 0
        self.gpus_changed = True
        # The parts (the module doc), and the schedule ``roles`` records for the oracle's replay.
        self.schedule = Schedule() if record_schedule else None
        self.view = PolicyView(self)
        self.correction = Correction(self, correction)
        self.moves = Moves(self)
        self.roles = GpuRoles(self, self.schedule, record_timeline)
        # The loop's clocks (``advance``, ``tick``): now, the next periodic decision, the events last decided on.
        self.now = 0.0
        self._next_control = 0.0
        self._seen: tuple | None = None
        self._progress, self._progress_at = -1.0, 0.0
        self.stalled = False

    def _trainer_at_start(self, first_wait_s: float | None) -> None:
        """The trainer and its batches as a run begins: no step trained, no batch launched, weights version 0."""
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
        self.wait_ema: float | None = first_wait_s
        self.last_batch = Work()  # the latest batch's work as it began (Snapshot.last_batch)
        self.version = 0
        self.trainer_delay_s = 0.0
        self._finished_at: float | None = None

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
            if self.judges is not None:
                done += self.judges.stats["verdicts"] + self.judges.stats["prefill_tokens"]
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
            forced_returns=self.moves.forced_returns,
            refusals=dict(self.moves.refusals),
            plans=self.moves.plans,
            preemptions=self.preemptions,
            gpu_seconds_by_role={k: round(v, 1) for k, v in self.roles.gpu_s.items()},
            batch_rollout_s=[b - a for a, b in zip(self.launched_at, self.completed_at, strict=False)],
            engine={k: float(v) for k, v in self.engine.stats.items()},
            judge={} if self.judges is None else {k: float(v) for k, v in self.judges.stats.items()},
            timeline=self.roles.timeline,
            predictor_checks=len(self.correction.checks),
            predictor_ratio=(self.correction.predictor.get("all") or {}).get("ratio"),
            schedule=None if self.schedule is None else replace(self.schedule, epochs=[0.0, *self.step_times]),
        )

    def tick(self, t: float, dt: float) -> None:
        """One step of simulated time from ``t``: the elastic trace, the trainer and the driver, the control
        (the policy or the oracle), the engines, the accounting."""
        self._availability(t)
        self._trainer(t)
        if self.correction.on and self.controller is None:
            self.correction.check(t)
        if self.controller is not None:
            self.controller.control(self, t)
        elif self.moves.switching:
            self.moves.next_switch(t)  # the daemon plans nothing new while a plan's switches still run
        elif t >= self._next_control - 1e-9 or self._events() != self._seen:
            # every control interval, and as soon as the trainer or the elastic trace changes: the daemon
            # decides every tick (0.5 s), so it reacts to a trainer's report or a grant within one
            self._next_control, self._seen = t + self.scenario.control_interval_s, self._events()
            self.moves.control(t)
        if self.gpus_changed or t >= self.roles.next_expiry:
            self.roles.refresh(t)
            if self.judges is not None:
                self._judge_workers = judge_workers(self.gpus, self.judges.gpus_per_worker, t)
        self.engine.step(t, dt)
        if self.judges is not None:
            self._judge(t, dt)
        self.roles.account(t, dt)

    def _judge(self, t: float, dt: float) -> None:
        """Ask the verdicts of the trajectories that finished, and advance the judge."""
        e, lo, hi = self.engine, self._ask_lo, self.engine.hi
        if hi > lo:
            new = np.flatnonzero((e.phase[lo:hi] == DONE) & ~self._asked[lo:hi]) + lo
            if new.size:
                self._asked[new] = True
                self.judges.submit(new, e.done_at[new], e.ctx[new])
                waiting = np.flatnonzero(~self._asked[lo:hi])
                self._ask_lo = lo + (int(waiting[0]) if waiting.size else hi - lo)
        self.judges.step(t, dt, self._judge_workers)

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
            self.gpus_changed = True
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
                    if not self.free_migration and abort_at < lease.end:
                        self.gpus[g].abort_at = abort_at
                        self.gpus_changed = True
        while self._ei < len(self._ends) and self._ends[self._ei].end <= t:
            lease = self._ends[self._ei]
            self._ei += 1
            for g in lease.gpus:
                gpu = self.gpus[g]
                if gpu.present:
                    if gpu.abort_at is None:
                        self.roles.killed.add(g // self.gpw)  # no drain came first: whatever it runs is lost
                    gpu.present, gpu.role, gpu.parked, gpu.busy_until, gpu.ends_at = False, Role.IDLE, False, 0.0, None
                    gpu.abort_at = None
                    self.preemptions += 1
                    self.gpus_changed = True
                    self._presence = None

    def presence(self) -> tuple[bool, ...]:
        """Which GPUs are present, GPU by GPU (the oracle's controllers key their decisions on it): made again
        only after the elastic trace changed one (``_availability``), the only place presence changes."""
        if self._presence is None:
            self._presence = tuple(g.present for g in self.gpus)
        return self._presence

    # -- the trainer ----------------------------------------------------------------------------------

    def batch_range(self, j: int) -> tuple[int, int]:
        """The trajectories of batch ``j`` (from 0), as indices [lo, hi) into the draws."""
        return j * self.batch, (j + 1) * self.batch

    def _trainer(self, t: float) -> None:
        tr = self.scenario.training
        # Batches finishing.
        while len(self.completed_at) < self.launched and self._complete(*self.batch_range(len(self.completed_at))):
            lo, hi = self.batch_range(len(self.completed_at))
            end = float(np.nanmax(self.engine.done_at[lo:hi]))
            if self.judges is not None:
                end = max(end, float(np.nanmax(self.judges.judged_at[lo:hi])))
            self.completed_at.append(end)
        # A train step finishing: new weights go to every serving worker (the engines pause meanwhile).
        if self.training_until is not None and t >= self.training_until - 1e-9:
            self.trained += 1
            self.training_until = None
            self.waiting_since = t
            self.gpus_changed = True
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
                    self.moves.force_return(g, t)  # the daemon's return guarantee (instant for the oracle)
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
                self.gpus_changed = True

    def _complete(self, lo: int, hi: int) -> bool:
        """Batch [lo, hi) is rolled out, and judged when the run has a judge."""
        return self.engine.all_done(lo, hi) and (self.judges is None or self.judges.all_judged(lo, hi))

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
        lo, hi = self.batch_range(self.launched)
        self.engine.launch(lo, hi, t)
        self.launched_at.append(t)
        self.launched += 1
        if began:
            self.last_batch = self.view.work()

    def trainer_needs_gpus(self, t: float) -> bool:
        """The trainer is computing, or its next batch is complete and it wants its GPUs now."""
        return self.training_until is not None or len(self.completed_at) > self.trained


def drain_s(notice_s: float) -> float:
    """How long a worker told of its preemption ``notice_s`` ahead drains before it aborts what is still in
    flight: the agent's drain timeout is the notice less 5 s (pearlctl/slurm/script.py, PEARL_DRAIN_TIMEOUT_S),
    of which it keeps min(5 s, 25 %) for the abort and the stop (pearlctl/agent/workers.py, VllmWorker.stop)."""
    timeout = max(1.0, notice_s - 5.0)
    return max(0.1, timeout - min(5.0, 0.25 * timeout))


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
