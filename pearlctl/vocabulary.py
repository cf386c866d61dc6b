"""pearlctl's words, defined once (pure: no I/O, no imports of the project).

Roles, pool kinds, move and step kinds and engines are used by the run spec, state, the planner, the daemon, the
agent and the simulator. Each is a ``StrEnum`` here and nowhere else, so a new role (a generative reward
model, say) is added in one place and every layer sees it. The values are the strings stored in state
and sent over the control API. So are the groups of roles and pools the code asks about (which generate
rollouts, which are served, which rest): no other module lists roles or pools by hand, and
tests/unit/test_vocabulary_literals.py fails if one does.
"""

from __future__ import annotations

from enum import StrEnum


class PoolKind(StrEnum):
    """What a pool is for; the values are the names used in run specs (``[pools.<kind>]``)."""

    TRAINER = "trainer"
    ROLLOUT = "rollout"
    ELASTIC = "elastic"  # preemptible / backfill capacity that comes and goes
    REWARD = "reward"  # generative reward model (GenRM) evaluation


class Role(StrEnum):
    """What a GPU does now."""

    TRAIN = "TRAIN"
    ROLLOUT = "ROLLOUT"  # colocated prefill + decode
    PREFILL = "PREFILL"
    DECODE = "DECODE"
    REWARD = "REWARD"
    IDLE = "IDLE"


class StepKind(StrEnum):
    """The idempotent units a transition is made of (what each does and how it is proven: the ``STEPS``
    table in pearlctl.daemon.effects)."""

    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    DRAIN = "DRAIN"
    SLEEP = "SLEEP"
    WAKE = "WAKE"
    START = "START"
    STOP = "STOP"
    REGISTER = "REGISTER"
    DEREGISTER = "DEREGISTER"
    VERIFY = "VERIFY"


class MoveKind(StrEnum):
    """What a transition does to its GPUs (a transition's ``kind``; a plan's moves): each is run by a plan of steps
    (pearlctl.daemon.transitions)."""

    BORROW = "borrow"  # trainer GPU -> rollout role (offload + start or wake)
    RETURN = "return"  # lent GPU -> TRAIN (drain + sleep or stop + reload)
    START = "start"  # idle rollout/elastic GPU -> rollout role (cold start)
    WAKE = "wake"  # idle GPU with a parked worker -> rollout role
    RETIRE = "retire"  # rollout role -> IDLE (drain + stop, or sleep when it may come back)
    SWITCH = "switch"  # one serving role -> another (ROLLOUT <-> PREFILL/DECODE, the policy <-> the judge)


class Engine(StrEnum):
    """The engine process a worker runs."""

    VLLM = "vllm"
    DEEPSPEED = "deepspeed"


# Pools in the order they are launched (the trainer first: rollout workers load its weights later).
POOL_KINDS: tuple[PoolKind, ...] = tuple(PoolKind)
# Pools whose GPUs generate rollouts.
GENERATION_POOLS: tuple[PoolKind, ...] = (PoolKind.ROLLOUT, PoolKind.ELASTIC)
# The fixed pools whose GPUs serve a model (the policy's, the judge's): what a fixed deployment of a run with a
# judge shares between the two (pearlctl.sim.baselines).
SERVING_POOLS: tuple[PoolKind, ...] = (PoolKind.ROLLOUT, PoolKind.REWARD)
# The role a pool's GPUs start in.
DEFAULT_ROLE: dict[PoolKind, Role] = {
    PoolKind.TRAINER: Role.TRAIN,
    PoolKind.ROLLOUT: Role.ROLLOUT,
    PoolKind.ELASTIC: Role.ROLLOUT,
    PoolKind.REWARD: Role.REWARD,
}
# Roles whose workers generate rollouts: colocated, or a disaggregated pair's halves (the roles the router routes
# to; REWARD is served too, but scores rollouts), in the order reports and commands list them.
GENERATION_ROLES: tuple[Role, ...] = (Role.ROLLOUT, Role.PREFILL, Role.DECODE)
# The halves of a disaggregated (prefill–decode) deployment.
PD_ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE)
# Roles of a GPU that serves nothing: its trainer's, or none. A vLLM worker may sleep parked on such a GPU.
RESTING_ROLES: tuple[Role, ...] = (Role.TRAIN, Role.IDLE)
# Roles served by a vLLM server, in the order commands list them: the policy's, then the judge's.
SERVED_ROLES: tuple[Role, ...] = (*GENERATION_ROLES, Role.REWARD)
SERVING_ROLES: frozenset[Role] = frozenset(SERVED_ROLES)
# Which engine serves which role (IDLE runs nothing).
ENGINE_FOR_ROLE: dict[Role, Engine] = {Role.TRAIN: Engine.DEEPSPEED, **{r: Engine.VLLM for r in SERVING_ROLES}}


class ServingEngine(StrEnum):
    """What a run's `Engine.VLLM` workers run (``[run] engine``): real vLLM, or the paced engine standing in for it
    (pearlctl/agent/engines/paced.py: vLLM's HTTP API, a profile's timing, no model) for control-plane runs at
    scale without GPUs. Either way the worker speaks vLLM's API, so state and the daemon call it `Engine.VLLM`."""

    VLLM = "vllm"
    PACED = "paced"


# Timing defaults every layer shares (the daemon, its agents, the CLI, the run spec), each set here alone.
HEARTBEAT_S = 2.0  # agents' heartbeat interval (`pearlctl daemon --heartbeat-s`); the daemon tells its agents
POLL_INTERVAL_S = 5.0  # the Slurm poll interval: a run's (`[run] poll_interval_s`), a function's (slurm.functions)

# A join rebalances a worker's requests (pearlctl/router/admin.py live, pearlctl/sim/migration.py simulated) when it
# holds a queue, or when it is imbalanced against the idlest routable worker by the test vllm-router's own
# `cache_aware` policy uses, with its defaults (`vllm-router --help`, 0.1.17: balance when max_load - min_load >
# --balance-abs-threshold 64 and max_load > min_load * --balance-rel-threshold 1.5). A load is a worker's requests
# running and waiting (vLLM's `vllm:num_requests_running` + `vllm:num_requests_waiting`).
JOIN_BALANCE_ABS = 64
JOIN_BALANCE_REL = 1.5

# The judges' verdicts per second between two of the rollout driver's reports are their capacity ("busy",
# planner.model.Judging) only when every GPU judging had work at this many reports in a row, the window's two ends
# and the report before it (pearlctl/daemon/trainer_side.py live, pearlctl/sim/snapshot.py simulated). A window
# whose start is the judges' first full moment counts few verdicts: those begun in it are still being judged at its
# end (each takes its prefill and decode). In the simulator the first such window of genrm-same-size-8b, at the
# measured mismatch, showed half the capacity later windows did, and shifted four GPUs to the judge that never paid.
JUDGE_BUSY_REPORTS = 3


def imbalanced(load, least):
    """Whether ``load`` (a worker's requests, or an array of them) is imbalanced against ``least``, the idlest
    routable worker's: vllm-router's test (``JOIN_BALANCE_ABS``, ``JOIN_BALANCE_REL``). Elementwise on arrays."""
    return (load - least > JOIN_BALANCE_ABS) & (load > least * JOIN_BALANCE_REL)


# engine_args the paced engine reads (as its flags); any other is refused, so a vLLM flag is never silently lost
PACED_ENGINE_ARGS: tuple[str, ...] = ("max_num_seqs", "max_model_len")


def one_job_of_nodes(pool: str, nodes: int) -> bool:
    """Whether a pool is launched as one multi-node job, its tasks the job's nodes (``sbatch --nodes``), rather
    than as an array of one-node tasks: a trainer of several nodes, which trains as one distributed job and is
    started and requeued whole. Its Slurm id is the job's (``5``), not an array task's (``5_1``)."""
    return pool == PoolKind.TRAINER and nodes > 1
