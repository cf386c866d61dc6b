"""The planner's vocabulary (docs/planner.md) as frozen data: what the planner and the policies see
(``Snapshot``), what they decide (``Target``), and how the current assignment gets there (``Plan`` of
``Move``\\ s). The daemon builds snapshots from state, the simulator from its simulated cluster.

GPU roles: a trainer-pool GPU is TRAIN, or lent (``borrowed``) to a rollout role; rollout and elastic GPUs
serve ROLLOUT (prefill and decode colocated) or PREFILL / DECODE (disaggregated); IDLE GPUs hold nothing
running (a vLLM worker may be parked asleep on them: ``parked``). REWARD is reserved for a generative
reward model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pearlctl.planner.profile import Profile, TransitionCosts
from pearlctl.vocabulary import GENERATION_ROLES, MoveKind, Role

SERVING = GENERATION_ROLES  # the roles the planner serves rollouts with


class Mode(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class GpuSlot:
    id: int
    node: str
    pool: str  # trainer | rollout | elastic | reward
    role: Role
    parked: bool = False  # a vLLM worker of the policy sleeps here: a wake, not a cold start, brings it back
    parked_judge: bool = False  # the judge's vLLM worker sleeps here: a loan to the judge wakes it (policy pivot)
    borrowed: bool = False  # a trainer GPU lent to a rollout role
    return_deadline: float | None = None  # borrowed: when the trainer needs it back (absolute seconds)
    ends_at: float | None = None  # the allocation's known end (elastic: preemption notice), absolute seconds


@dataclass(frozen=True)
class Work:
    """The remaining work of the current rollout batch (means over unfinished trajectories; ``*_max``:
    the straggler's). Live, the rollout driver's progress reports fill it; the simulator knows it exactly."""

    trajectories: int = 0  # unfinished
    tool_waiting: int = 0  # of which waiting on a tool (or the environment) right now
    turns_left: float = 0.0
    turns_left_max: float = 0.0
    decode_tokens_per_turn: float = 0.0  # response tokens per turn
    decode_tokens_per_turn_max: float = 0.0
    prefill_tokens_per_turn: float = 0.0  # new tokens per turn: the prompt, then tool output
    context_tokens: float = 0.0  # current context of a trajectory
    tool_latency_s: float = 0.0  # mean latency of one tool call (a trajectory calls one after every turn but its last)
    tool_latency_max_s: float = 0.0  # the p99 latency of one tool call

    @property
    def empty(self) -> bool:
        return self.trajectories <= 0


@dataclass(frozen=True)
class Trainer:
    phase: str | None = None  # "training" | "waiting" | None (no report)
    wait_left_s: float = 0.0  # how long the trainer still expects to wait for rollouts
    step_time_s: float = 0.0  # its measured training step time
    # False: the trainer reported no expected wait (none measured yet); ``plan.expect_wait`` then puts the
    # planner's own prediction of the batch in flight in ``wait_left_s`` and sets ``wait_predicted``
    wait_known: bool = True
    wait_predicted: bool = False
    # True: the batch the trainer waits for is complete — the rollout driver reported no work left after the
    # trainer began this wait — so it trains next: nothing is lent, and lent GPUs go back now (``budget``)
    batch_ready: bool = False


@dataclass(frozen=True)
class Deployment:
    """How rollout GPUs are organised: ``workers`` colocated, or ``prefill`` + ``decode`` workers."""

    mode: Mode
    decode: int  # colocated: every rollout worker; disaggregated: the decode workers
    prefill: int = 0

    @property
    def workers(self) -> int:
        return self.decode + self.prefill


@dataclass(frozen=True)
class Judging:
    """The judge queue (a generative reward model's, pearlctl.router.judge), as the rollout driver reports it:
    finished trajectories waiting for a verdict, being judged, judged, and judge answers that gave no verdict
    (each retried). Empty for a run without a judge."""

    waiting: int = 0
    judging: int = 0
    done: int = 0
    failed: int = 0
    verdicts_per_s: float = 0.0  # between the driver's last two reports
    # every GPU judging had work at both of those reports and at the one before (verdicts waiting, or one in flight
    # per GPU; pearlctl.vocabulary.JUDGE_BUSY_REPORTS): the rate is the judges' capacity (a rate over a window in
    # which they ran dry says only what was asked of them, and one in which they filled up counts few verdicts)
    busy: bool = False
    # the most verdicts per second per GPU judging that a ``busy`` report saw (0: never measured): what the judges
    # can do, kept for the moments nothing waits (between batches) and early in a batch
    capacity_per_judge_s: float = 0.0

    @property
    def backlog(self) -> int:
        """Trajectories without their verdict yet: the judge's demand."""
        return self.waiting + self.judging


@dataclass(frozen=True)
class Snapshot:
    now: float
    gpus: tuple[GpuSlot, ...]
    work: Work
    trainer: Trainer
    profile: Profile
    costs: TransitionCosts  # running estimates (journal), else the profile's
    mode: Mode = Mode.COLOCATED  # the current PD mode
    max_lend: int | None = None  # cap on lent trainer GPUs (`pearlctl borrow --gpus`)
    preempt_per_hour: float = 0.0  # expected preemptions of one elastic GPU per hour
    last_change_at: float | None = None  # when the last plan was applied (hysteresis)
    horizon_s: float | None = None  # how far ahead gains count (default: the batch's predicted time)
    # the latest batch's work as it began (its first report with work after none): what the next batch is
    # expected to hold, for a decision made between batches, when ``work`` is empty; empty before any batch
    last_batch: Work = Work()
    judging: Judging = Judging()  # the judge's demand (its queue); empty without a judge
    # the judge's engine (another model than the policy's): running estimates of its starts, wakes, sleeps and
    # stops, as ``costs`` are the policy's (``engine_costs``); None: the same as ``costs``
    judge_costs: TransitionCosts | None = None
    extra: dict = field(default_factory=dict)  # what a simulator's oracle may know (never set live)

    def engine_costs(self, role: Role) -> TransitionCosts:
        """The transition costs of the engine that serves ``role``: the judge's for REWARD, else the policy's
        (the trainer's offload and reload are the same in both)."""
        return self.judge_costs if role == Role.REWARD and self.judge_costs is not None else self.costs

    def by_pool(self, pool: str) -> list[GpuSlot]:
        return [g for g in self.gpus if g.pool == pool]

    def serving(self) -> list[GpuSlot]:
        return [g for g in self.gpus if g.role in SERVING]

    def lent(self) -> list[GpuSlot]:
        return [g for g in self.gpus if g.borrowed]


@dataclass(frozen=True)
class Target:
    """What the rollout side should look like: the PD layout, how many trainer GPUs it borrows and how many
    elastic GPUs it uses. Counts are GPUs; the planner turns them into workers of the profile's size."""

    mode: Mode
    rollout_gpus: int  # GPUs serving (ROLLOUT, or PREFILL + DECODE)
    prefill_gpus: int = 0  # disaggregated: of rollout_gpus, those in PREFILL
    lend: int = 0  # trainer GPUs among rollout_gpus
    elastic: int = 0  # elastic GPUs among rollout_gpus


@dataclass(frozen=True)
class Move:
    gpu: int
    kind: MoveKind
    from_role: Role
    to_role: Role
    cost_s: float  # seconds the GPU does no rollout work while it moves


@dataclass(frozen=True)
class Plan:
    target: Target
    moves: tuple[Move, ...]
    predicted_now_s: float  # the batch's predicted completion time without the plan
    predicted_s: float  # with it (transition time included)
    cost_s: float  # GPU-seconds of rollout work lost to the moves
    why: str = ""

    @property
    def gain_s(self) -> float:
        return self.predicted_now_s - self.predicted_s

    @property
    def empty(self) -> bool:
        return not self.moves
