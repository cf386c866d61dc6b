"""A scenario at another size and another speed: the twin that a live run on paced engines can be held against.

``scaled(scenario, gpus=64, speedup=10)`` is the same scenario with every pool grown (or shrunk) to whole nodes
totalling ``gpus`` and the clock running ``speedup`` times faster:

- **Size.** Each pool's share of the cluster is kept, in whole nodes (largest remainder; a pool that had GPUs
  keeps at least one node). The work per GPU is kept too: prompts per step grow with the cluster, a train step
  takes ``batch / trainer GPUs`` as long as before, random grants arrive as often per elastic node, and explicit
  grant and preemption events are resized with the elastic pool (whole nodes).
- **Speed.** Every duration is divided by ``speedup`` and every rate multiplied by it: the profile's decode
  terms, prefill, request overheads and transition costs (``time_scaled_profile``); tool latencies; the train
  step and weight sync; the driver's join wait and the first-wait hint; availability times, lifetimes and the
  notice; the simulator's tick. Token counts, KV capacity and batch caps are untouched, so the engine's batches
  look exactly as before, only faster.
- **What the live control plane does not scale.** A live daemon decides at its own pace (``REDECIDE_S`` with
  unchanged inputs) and Slurm warns a preempted task its partition's grace time ahead, whatever the speedup:
  ``control_interval_s`` and ``notice_s``, when given, replace the scaled ones, so the simulation models the
  live run rather than a faster daemon than the one that runs.

Pure: a new frozen ``Scenario`` and ``Profile``; nothing is read or written. ``ScenarioError`` names what cannot
be scaled (too few GPUs for one node per pool, a speedup that is not positive).
"""

from __future__ import annotations

import math
from dataclasses import replace

from pearlctl.planner.profile import DecodeModel, Profile, TransitionCosts
from pearlctl.sim.scenario import Availability, AvailabilityEvent, Cluster, Distribution, Scenario, ScenarioError


def time_scaled_profile(profile: Profile, speedup: float) -> Profile:
    """``profile`` on a clock ``speedup`` times faster: seconds divided, rates multiplied, sizes kept."""
    k = _speedup(speedup)
    d = profile.decode
    decode = DecodeModel(
        weights_s=d.weights_s / k,
        seq_s=d.seq_s / k,
        kv_s_per_token=d.kv_s_per_token / k,
        experts_s=d.experts_s / k,
        moe_experts=d.moe_experts,
        moe_top_k=d.moe_top_k,
    )
    c = profile.costs
    costs = TransitionCosts(**{name: getattr(c, name) / k for name in c.__dataclass_fields__})
    name = profile.name if k == 1 else f"{profile.name}-x{k:g}"
    return replace(
        profile,
        name=name,
        decode=decode,
        prefill_tok_s=profile.prefill_tok_s * k,
        kv_transfer_gb_s=profile.kv_transfer_gb_s * k,
        request_overhead_s=profile.request_overhead_s / k,
        request_serial_s=profile.request_serial_s / k,
        costs=costs,
        sources={**profile.sources, "time_scale": f"every duration of {profile.name} divided by {k:g}"},
    )


def node_split(cluster: Cluster, gpus: int) -> Cluster:
    """The cluster's pools in whole nodes totalling ``gpus`` (a multiple of ``gpus_per_node``), each pool's share
    kept by largest remainder; a pool that had GPUs keeps at least one node."""
    per = cluster.gpus_per_node
    if gpus <= 0 or gpus % per:
        raise ScenarioError(f"gpus must be a positive multiple of gpus_per_node ({per}), not {gpus}")
    sizes = [cluster.trainer_gpus, cluster.rollout_gpus, cluster.elastic_gpus]
    nodes = gpus // per
    present = [i for i, s in enumerate(sizes) if s > 0]
    if nodes < len(present):
        raise ScenarioError(f"{gpus} GPUs are {nodes} node(s): too few for one node per pool ({len(present)} pools)")
    total = sum(sizes)
    share = [nodes * s / total for s in sizes]
    out = [max(1, math.floor(x)) if s > 0 else 0 for x, s in zip(share, sizes, strict=True)]
    while sum(out) > nodes:  # the one-node floors took too much: shrink the pool furthest above its share
        i = max((i for i in present if out[i] > 1), key=lambda i: out[i] - share[i])
        out[i] -= 1
    for i in sorted(present, key=lambda i: share[i] - out[i], reverse=True)[: nodes - sum(out)]:
        out[i] += 1
    return replace(cluster, trainer_gpus=out[0] * per, rollout_gpus=out[1] * per, elastic_gpus=out[2] * per)


def scaled(
    scenario: Scenario,
    *,
    gpus: int | None = None,
    speedup: float = 1.0,
    control_interval_s: float | None = None,
    notice_s: float | None = None,
) -> Scenario:
    """The scenario resized to ``gpus`` (None: as it is) and ``speedup`` times faster (module doc)."""
    k = _speedup(speedup)
    old = scenario.cluster
    cluster = node_split(old, gpus) if gpus is not None else old
    f = (cluster.trainer_gpus + cluster.rollout_gpus + cluster.elastic_gpus) / (
        old.trainer_gpus + old.rollout_gpus + old.elastic_gpus
    )
    w = scenario.workload
    prompts = max(1, round(w.prompts_per_step * f))
    workload = replace(w, prompts_per_step=prompts, tool_latency_s=_faster(w.tool_latency_s, k))
    tr = scenario.training
    per_gpu = (prompts / w.prompts_per_step) * (old.trainer_gpus / cluster.trainer_gpus)
    training = replace(
        tr,
        train_step_s=tr.train_step_s * per_gpu / k,
        weight_sync_s=tr.weight_sync_s / k,
        join_wait_s=tr.join_wait_s / k,
        first_wait_s=None if tr.first_wait_s is None else tr.first_wait_s / k,
    )
    availability = _availability(scenario.availability, old, cluster, k)
    if notice_s is not None:
        availability = replace(
            availability, notice_s=notice_s, events=tuple(replace(e, notice_s=None) for e in availability.events)
        )
    return replace(
        scenario,
        name=scenario.name if (gpus is None and k == 1) else f"{scenario.name}@{_total(cluster)}gpu-x{k:g}",
        profile=time_scaled_profile(scenario.profile, k),
        cluster=cluster,
        availability=availability,
        workload=workload,
        training=training,
        tick_s=scenario.tick_s / k,
        control_interval_s=scenario.control_interval_s / k if control_interval_s is None else control_interval_s,
    )


def _availability(a: Availability, old: Cluster, new: Cluster, k: float) -> Availability:
    per = new.gpus_per_node
    f = new.elastic_gpus / old.elastic_gpus if old.elastic_gpus else 1.0

    def nodes(n: int) -> int:  # a grant or preemption of n GPUs on the resized elastic pool, in whole nodes
        return 0 if n <= 0 else max(per, round(n * f / per) * per)

    events = tuple(
        AvailabilityEvent(
            at_s=e.at_s / k,
            grant=nodes(e.grant),
            preempt=nodes(e.preempt),
            notice_s=None if e.notice_s is None else e.notice_s / k,
        )
        for e in a.events
    )
    return replace(
        a,
        events=events,
        initial_gpus=nodes(a.initial_gpus),
        # node-sized random grants arrive f times as often on f times the elastic nodes
        grant_interval_s=a.grant_interval_s / k / f,
        lifetime_s=a.lifetime_s / k,
        lifetime_mixture=tuple((p, mean / k) for p, mean in a.lifetime_mixture),
        reclaim_interval_s=a.reclaim_interval_s / k,  # cluster-wide: as often whatever the size
        notice_s=a.notice_s / k,
    )


def _faster(d: Distribution, k: float) -> Distribution:
    return replace(
        d, value=d.value / k, low=d.low / k, high=d.high / k, median=d.median / k, p99=d.p99 / k, min=d.min / k,
        max=d.max / k,
    )  # fmt: skip


def _total(c: Cluster) -> int:
    return c.trainer_gpus + c.rollout_gpus + c.elastic_gpus


def _speedup(speedup: float) -> float:
    if not (isinstance(speedup, (int, float)) and math.isfinite(speedup) and speedup > 0):
        raise ScenarioError(f"speedup must be a positive number, not {speedup!r}")
    return float(speedup)
