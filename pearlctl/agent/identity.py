"""Who am I: the node, GPUs and Slurm task an agent runs as, read from the environment (pure)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass


def _indices(value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    out = []
    for part in value.split(","):
        part = part.strip()
        if part.isdigit():
            out.append(int(part))
    return tuple(out)


@dataclass(frozen=True)
class Identity:
    run_id: str
    pool: str
    role: str
    job_id: str
    task_id: int
    node: str
    gpus: tuple[int, ...]
    restarts: int

    def as_dict(self) -> dict:
        return asdict(self)


def identity_from_env(env: Mapping[str, str] | None = None) -> Identity:
    """Slurm sets SLURMD_NODENAME (hostname is the same for every slurmd of a multi-slurmd host),
    SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES (no renumbering without cgroups), SLURM_RESTART_COUNT."""
    env = os.environ if env is None else env
    gpus = _indices(env.get("SLURM_JOB_GPUS")) or _indices(env.get("CUDA_VISIBLE_DEVICES"))
    return Identity(
        run_id=env.get("PEARL_RUN_ID", ""),
        pool=env.get("PEARL_POOL", ""),
        role=env.get("PEARL_ROLE", "IDLE"),
        job_id=env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID") or env.get("PEARL_LOCAL_JOB_ID", ""),
        task_id=int(env.get("SLURM_ARRAY_TASK_ID") or env.get("PEARL_LOCAL_TASK_ID") or 0),
        node=env.get("SLURMD_NODENAME") or socket.gethostname(),
        gpus=gpus,
        restarts=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
    )
