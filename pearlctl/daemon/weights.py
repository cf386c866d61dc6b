"""Which vLLM workers the trainer broadcasts a new weight version to (``GET /v1/weights/targets``).

Opt-in per pool (``[pools.rollout] weights = "broadcast"``, docs/run-spec.md): the launcher starts that pool's
workers with the ``pearl_gloo`` receiver, and trainer rank 0 asks this route, through its ``DaemonChannel``, for
the workers to send each version to before the version is published (pearlctl.trainer.broadcast,
``WeightBroadcaster``; docs/weights.md, "Across nodes").

A worker is a target when, and only when:

- it is READY and routable, with a URL, and its engine is vLLM;
- its allocation belongs to a pool whose spec says ``weights = "broadcast"`` (so it was started with the
  receiver; a pool launched before the key existed is ``disk``);
- none of its allocation's nodes (the allocation's node and its GPUs' nodes: Slurm node names, what the node-local
  store is keyed by, pearlctl.host.weight_store ``NodeStore.for_node``) runs a trainer rank (a RUNNING or
  PREEMPTING trainer allocation's nodes): workers there read the trainer's copy in the node-local store instead.
  Nodes that share one host (several slurmd on one machine) are told apart, as their stores are; the agent's host
  counts only where no node name is known.

``select_targets`` is pure (rows in, targets out); ``broadcast_targets`` reads the rows from state. The daemon
only answers: it neither sends nor records a broadcast, and a worker left out reads the disk as by default.
"""

from __future__ import annotations

from collections.abc import Iterable

from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store
from pearlctl.vocabulary import Engine, PoolKind

BROADCAST = "broadcast"
_TRAINER_LIVE = (A.RUNNING, A.PREEMPTING)


def select_targets(
    *,
    spec: dict,
    pools: Iterable[dict],
    allocations: Iterable[dict],
    gpus: Iterable[dict],
    nodes: Iterable[dict],
    workers: Iterable[dict],
) -> dict:
    """``{"workers": [{"id", "url", "allocation_id", "role", "weight_version"}], "trainer_nodes": [...]}``
    from the run's spec (``runs.spec``) and rows (module docstring)."""
    spec_pools = spec.get("pools") or {}
    pool_name = {p["id"]: p["name"] for p in pools}
    broadcast_pools = {
        pid for pid, name in pool_name.items() if (spec_pools.get(name) or {}).get("weights", "disk") == BROADCAST
    }
    allocations = list(allocations)
    node_name = {n["id"]: n["name"] for n in nodes}
    hosts: dict[int, set[str]] = {}
    for a in allocations:
        hosts[a.id] = {a.node.lower()} if a.node else set()
    for g in gpus:
        name = node_name.get(g.node_id)
        if name:
            hosts.setdefault(g.allocation_id, set()).add(name.lower())
    for a in allocations:
        if not hosts[a.id] and a.agent_host:
            hosts[a.id] = {a.agent_host.lower()}
    trainer_nodes: set[str] = set()
    for a in allocations:
        if pool_name.get(a.pool_id) == PoolKind.TRAINER and a.state in _TRAINER_LIVE:
            trainer_nodes |= hosts.get(a.id, set())
    pool_of = {a.id: a.pool_id for a in allocations}
    targets = []
    for w in workers:
        alloc = w.allocation_id
        if not (w.state == W.READY and w.routable and w.url and w.engine == Engine.VLLM):
            continue
        if pool_of.get(alloc) not in broadcast_pools:
            continue
        where = hosts.get(alloc, set())
        if not where or where & trainer_nodes:  # unknown node, or a trainer's: the store or the disk
            continue
        targets.append(
            {
                "id": w.id,
                "url": w.url,
                "allocation_id": alloc,
                "role": w.role,
                "weight_version": w.weight_version,
            }
        )
    return {"workers": targets, "trainer_nodes": sorted(trainer_nodes)}


def broadcast_targets(store: Store, run_id: str) -> dict:
    """``select_targets`` over the run's current state."""
    run = store.runs.get(run_id)
    return select_targets(
        spec=run.get("spec") or {},
        pools=store.runs.pools(run_id),
        allocations=store.fleet.allocations(run_id),
        gpus=store.fleet.gpus(run_id),
        nodes=store.runs.nodes(run_id),
        workers=store.fleet.workers(run_id),
    )
