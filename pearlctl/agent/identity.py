"""Who am I: the node, GPUs and Slurm task an agent runs as, read from the environment (pure)."""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from pearlctl.vocabulary import Role

# torchrun's rendezvous port for a multi-node trainer: 29500 .. 29500 + 2000, by job id (a port the same on
# every node without anyone publishing it; two trainers on one node 0 collide with probability 1/2000, and
# PEARL_RDZV_PORT in the pool's env then fixes it)
RDZV_PORT_BASE, RDZV_PORT_SPAN = 29500, 2000


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
    nnodes: int = 1  # nodes of the job this task is one node of (a multi-node trainer); task_id is its rank
    rdzv_host: str = "127.0.0.1"  # where the job's node 0 is reached: its distributed rendezvous
    rdzv_port: int | None = None  # its port; None: derived from the job id

    def as_dict(self) -> dict:
        return asdict(self)

    def rendezvous_env(self) -> dict[str, str]:
        """torchrun's settings (its ``PET_*`` variables) for one trainer of ``nnodes`` nodes: a c10d rendezvous
        at node 0, on a port derived from the job id (the same on every node, and after a requeue), keyed by
        the job and its restart count. Empty for a one-node job. A value given on torchrun's command line
        wins over these; ``--standalone`` would make every node a trainer of its own (pearlctl.config refuses
        it for a trainer of several nodes)."""
        if self.nnodes <= 1:
            return {}
        port = self.rdzv_port or RDZV_PORT_BASE + zlib.crc32(self.job_id.encode()) % RDZV_PORT_SPAN
        return {
            "PET_NNODES": str(self.nnodes),
            "PET_NODE_RANK": str(self.task_id),
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": f"{self.rdzv_host}:{port}",
            "PET_RDZV_ID": f"pearl-{self.job_id}-{self.restarts}",
        }


def identity_from_env(env: Mapping[str, str] | None = None) -> Identity:
    """Slurm sets SLURMD_NODENAME (hostname is the same for every slurmd of a multi-slurmd host),
    SLURM_JOB_GPUS / CUDA_VISIBLE_DEVICES (no renumbering without cgroups), SLURM_RESTART_COUNT. A task of a
    multi-node job (one srun task per node) is the node ``SLURM_NODEID`` of ``SLURM_JOB_NUM_NODES``, and its
    node 0 is where srun was started (``SLURM_LAUNCH_NODE_IPADDR``: the batch host, the job's first node);
    the local backend says ``PEARL_LOCAL_TASK_ID`` of ``PEARL_LOCAL_NNODES``, all on this machine.
    ``PEARL_RDZV_HOST`` and ``PEARL_RDZV_PORT`` (a pool's ``env``) override the rendezvous address: for a
    site whose batch host is not node 0's address the ranks can reach, or two trainers sharing a node 0."""
    env = os.environ if env is None else env
    gpus = _indices(env.get("SLURM_JOB_GPUS")) or _indices(env.get("CUDA_VISIBLE_DEVICES"))
    array = env.get("SLURM_ARRAY_JOB_ID") is not None
    return Identity(
        run_id=env.get("PEARL_RUN_ID", ""),
        pool=env.get("PEARL_POOL", ""),
        role=env.get("PEARL_ROLE", Role.IDLE),
        job_id=env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID") or env.get("PEARL_LOCAL_JOB_ID", ""),
        task_id=_int(env.get("SLURM_ARRAY_TASK_ID") or env.get("SLURM_NODEID") or env.get("PEARL_LOCAL_TASK_ID")),
        node=env.get("SLURMD_NODENAME") or socket.gethostname(),
        gpus=gpus,
        restarts=_int(env.get("SLURM_RESTART_COUNT")),
        nnodes=1 if array else max(1, _int(env.get("SLURM_JOB_NUM_NODES") or env.get("PEARL_LOCAL_NNODES"), 1)),
        rdzv_host=env.get("PEARL_RDZV_HOST") or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1",
        rdzv_port=_int(env.get("PEARL_RDZV_PORT")) or None,
    )


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default
