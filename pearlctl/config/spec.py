"""What a valid run spec is to the rest of pearlctl: ``RunSpec``, its ``PoolSpec``s and its ``RouterSpec``,
plain frozen values. pearlctl.config.load makes them from a validated document; the launcher records
``RunSpec.to_dict()`` with the run, and reads a pool back from that record (pearlctl.ops.launcher.pool_spec_of),
where a key a later pearlctl added takes its default here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearlctl import vocabulary


@dataclass(frozen=True)
class PoolSpec:
    """One pool: a Slurm array job, one array task per node."""

    name: str  # one of vocabulary.POOL_KINDS; a run has at most one pool of each kind
    nodes: int
    gpus_per_node: int
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None  # sbatch --constraint: the node features the pool's nodes must have
    exclude: str | None = None  # sbatch --exclude: nodes the pool must not run on
    max_nodes: int | None = None  # elastic pools may grow up to this
    # elastic pools: an added task still PENDING after this long is cancelled, and growth backs off
    pending_timeout_s: float | None = None
    requeue: bool = False
    preempt_signal: str = "USR2"
    preempt_notice_s: int = 60
    command: tuple[str, ...] | None = None
    train_command: tuple[str, ...] | None = None  # trainer pools: what the agent runs as the TRAIN worker
    engine_args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # vLLM pools: how a new weight version reaches workers on nodes without a trainer rank (WEIGHT_PATHS)
    weights: str = "disk"
    model: str | None = None  # a reward pool's judge model (None: the run's model)

    @property
    def role(self) -> str:
        return str(vocabulary.DEFAULT_ROLE[vocabulary.PoolKind(self.name)])

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["command"] = list(self.command) if self.command else None
        d["train_command"] = list(self.train_command) if self.train_command else None
        return d


@dataclass(frozen=True)
class RouterSpec:
    """``[router]``: the run's one OpenAI-compatible endpoint (pearlctl.router, started by the daemon)."""

    enabled: bool = True
    port: int = 0  # where the gateway listens on the daemon's host (0: any free port, named in status)
    policy: str = "consistent_hash"  # vllm-router's; consistent_hash keeps an episode (X-Session-ID) on one worker

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunSpec:
    name: str
    model: Path
    run_dir: Path
    policy: str
    backend: str
    poll_interval_s: float
    pools: dict[str, PoolSpec]
    source: Path
    router: RouterSpec = RouterSpec()
    # what the vLLM pools' workers run: "vllm", or "paced" with engine_profile (the profile TOML it keeps the
    # timing of): pearlctl/agent/engines/paced.py, for control-plane runs at scale without GPUs
    engine: str = "vllm"
    engine_profile: Path | None = None
    # what was let through with ``model_on_this_host=False`` and would refuse a real launch (printed by
    # `launch --dry-run`); never part of the stored spec
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": str(self.model),
            "run_dir": str(self.run_dir),
            "policy": self.policy,
            "backend": self.backend,
            "poll_interval_s": self.poll_interval_s,
            "source": str(self.source),
            "pools": {k: p.to_dict() for k, p in self.pools.items()},
            "router": self.router.to_dict(),
            "engine": self.engine,
            "engine_profile": str(self.engine_profile) if self.engine_profile else None,
        }


def judge_model(stored: dict[str, Any]) -> str | None:
    """The model a run's judge serves — its reward pool's, else the run's — from the run's stored spec
    (``RunSpec.to_dict``); None when the run has no reward pool."""
    judge = (stored.get("pools") or {}).get(vocabulary.PoolKind.REWARD)
    return None if judge is None else str(judge.get("model") or stored.get("model"))
