"""Builders for the worlds tests set up: a run in a Store with its pools and allocations, pool dicts, and the
planner's Profile and Snapshot.

Each builder takes the few values a test cares about as keywords and fills the rest with the defaults the tests
had repeated by hand, so a test states only what differs. They build nothing a test could not build with the
public Store and planner APIs; they only keep those set-ups in one place.
"""

from __future__ import annotations

from pathlib import Path

from pearlctl.planner.model import Snapshot, Trainer, Work
from pearlctl.planner.profile import DecodeModel, Profile


def pool(name: str, role: str, *, nodes: int = 1, gpus_per_node: int = 1, run_id: str = "r", **extra) -> dict:
    """A pool dict as ``store.runs.create`` takes it: kind = ``name``, no partition, job name ``pearl.<run>.<name>``."""
    return {"name": name, "kind": name, "role": role, "partition": None, "nodes": nodes,
            "gpus_per_node": gpus_per_node, "job_name": f"pearl.{run_id}.{name}", **extra}  # fmt: skip


def create_run(store, run_dir: Path, pools: list[dict], *, run_id: str = "r", spec: dict | None = None,
               spec_path: str | None = None, backend: str = "slurm", policy: str = "never") -> None:  # fmt: skip
    """Create run ``run_id`` (named as its id) in ``store`` with ``pools``; its allocations stay REQUESTED."""
    store.runs.create(run_id=run_id, name=run_id, spec=spec or {}, spec_path=spec_path, run_dir=str(run_dir),
                     backend=backend, policy=policy, pools=pools)  # fmt: skip


def submit(store, alloc_id: int, job_id: str) -> None:
    """Walk a REQUESTED allocation to PENDING as Slurm job ``job_id``."""
    store.set_state("allocations", alloc_id, expect="REQUESTED", to="PENDING", event="t", job_id=job_id)


def start(store, alloc_id: int, node: str) -> None:
    """Walk a PENDING allocation to RUNNING on ``node``."""
    store.set_state("allocations", alloc_id, expect="PENDING", to="RUNNING", event="t", node=node)


def run_all(store, run_id: str = "r") -> list:
    """Walk every allocation of ``run_id`` to RUNNING, the i-th as job ``10 + i`` on node ``n<i>``; returns them."""
    allocs = store.fleet.allocations(run_id)
    for i, a in enumerate(allocs):
        submit(store, a.id, str(10 + i))
        start(store, a.id, f"n{i}")
    return allocs


def profile(name: str = "test", **overrides) -> Profile:
    """A planner Profile with model "m" on hardware "h" and the given fields (``decode``, ``prefill_tok_s``,
    ``kv_capacity_tokens``, ``costs``, ...); ``decode`` may be a dict of DecodeModel fields."""
    decode = overrides.pop("decode", {})
    if isinstance(decode, dict):
        decode = DecodeModel(**decode)
    return Profile(name=name, model=overrides.pop("model", "m"), hardware=overrides.pop("hardware", "h"),
                   decode=decode, **overrides)  # fmt: skip


def snapshot(gpus, work: Work, profile: Profile, *, now: float, phase: str = "waiting", wait_left_s: float,
             **fields) -> Snapshot:  # fmt: skip
    """A planner Snapshot of ``gpus`` at ``now``, the trainer in ``phase`` with ``wait_left_s`` left, costs the
    profile's; ``fields`` sets the rest (``max_lend``, ``mode``, ...)."""
    return Snapshot(now=now, gpus=tuple(gpus), work=work, trainer=Trainer(phase=phase, wait_left_s=wait_left_s),
                    profile=profile, costs=profile.costs, **fields)  # fmt: skip
