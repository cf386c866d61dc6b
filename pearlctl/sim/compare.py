"""Policies simulated side by side, and any one by name, the oracle included: the entry points of the CLI
(``pearlctl simulate``), the sweep and the benchmarks. Above both ``run`` (a policy's run) and ``oracle``
(which replays the policies' runs), so neither imports the other back.

Each simulation runs in a process of its own under a memory limit (``simulate --max-memory``); one that runs
out of it, or whose process dies, ends in one ``SimulationError`` line naming the policy and the scenario.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from pearlctl.sim.baselines import colocated, disaggregated
from pearlctl.sim.engine import DEFAULT_ROUTER
from pearlctl.sim.gpus import Schedule
from pearlctl.sim.oracle import run_oracle
from pearlctl.sim.run import RunResult, SimulationError, make_draws, make_trace, run_policy
from pearlctl.sim.scenario import Scenario

# Baselines that are not policies the daemon runs: the simulator computes them (``simulate``).
BASELINES = ("oracle", "colocated", "disaggregated")


def simulate(scenario: Scenario, policy: str, *, schedules: dict[str, Schedule] | None = None, **kw) -> RunResult:
    """``policy`` on ``scenario``: ``run.run_policy``'s, or for ``oracle`` ``oracle.run_oracle`` (``schedules``:
    the compared policies' schedules it replays; pearl's is run when missing), or for ``colocated`` and
    ``disaggregated`` theirs (pearlctl.sim.baselines). ``kw``: ``run_policy``'s (the oracle takes
    record_timeline, draws, trace and router of them)."""
    if policy == "oracle":
        keep = ("record_timeline", "draws", "trace", "router")
        return run_oracle(scenario, schedules=schedules, **{k: v for k, v in kw.items() if k in keep})
    if policy == "colocated":
        return colocated(scenario, **kw)
    if policy == "disaggregated":
        return disaggregated(scenario, **kw)
    return run_policy(scenario, policy, **kw)


def _limit_memory(max_bytes: int | None) -> None:
    """Cap this process's address space at ``max_bytes`` (``simulate --max-memory``): an allocation past it
    raises MemoryError here rather than the machine running out of memory."""
    if max_bytes is None:
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _guarded(scenario: Scenario, policy: str, max_memory: int | None, kw: dict) -> RunResult:
    """``run_policy`` under the memory limit, its failure one ``SimulationError`` line."""
    _limit_memory(max_memory)
    try:
        return simulate(scenario, policy, **kw)
    except MemoryError:
        gib = (max_memory or 0) / 2**30
        raise SimulationError(
            f"simulating {policy} on {scenario.name} ran out of memory (limit {gib:.1f} GiB, --max-memory)"
        ) from None


def compare(
    scenario: Scenario,
    policies: list[str],
    *,
    record_timeline: bool = False,
    workers: int | None = None,
    router: str = DEFAULT_ROUTER,
    correction: bool = True,
    max_memory: int | None = None,
) -> dict[str, RunResult]:
    """Every policy on the same drawn work and the same elastic trace; runs are independent, so they go to
    ``workers`` processes (default: one per policy, at most one per CPU), each capped at ``max_memory`` bytes.
    The oracle runs last and replays every other policy's schedule (pearlctl.sim.oracle). Results keep the
    given order. A run that fails raises ``SimulationError`` (one line, naming the policy and the scenario)."""
    draws, trace = make_draws(scenario), make_trace(scenario)
    kw = {"record_timeline": record_timeline, "draws": draws, "trace": trace, "router": router}
    kw["correction"] = correction
    oracle = "oracle" in policies
    others = [p for p in policies if p != "oracle"]
    n = min(len(others), workers if workers is not None else (os.cpu_count() or 1))
    results: dict[str, RunResult] = {}
    if others:
        kw_others = {**kw, "record_schedule": oracle}
        if n <= 1:
            results = {p: _run_in_process(scenario, p, max_memory, kw_others) for p in others}
        else:
            with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = {p: pool.submit(_guarded, scenario, p, max_memory, kw_others) for p in others}
                results = {p: _result(f, p, scenario) for p, f in futures.items()}
    if oracle:
        schedules = {p: r.schedule for p, r in results.items() if r.schedule is not None}
        results["oracle"] = _run_in_process(scenario, "oracle", max_memory, {**kw, "schedules": schedules})
    for r in results.values():
        r.schedule = None  # replayed: not part of the result any more
    return {p: results[p] for p in policies}


def _run_in_process(scenario: Scenario, policy: str, max_memory: int | None, kw: dict) -> RunResult:
    """One run in a process of its own (so that its memory limit and its memory go with it)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return _result(pool.submit(_guarded, scenario, policy, max_memory, kw), policy, scenario)


def _result(future, policy: str, scenario: Scenario) -> RunResult:
    from concurrent.futures.process import BrokenProcessPool

    try:
        return future.result()
    except BrokenProcessPool:
        raise SimulationError(
            f"simulating {policy} on {scenario.name}: its process died (killed, most likely out of memory: "
            "lower --max-memory or the scenario's size)"
        ) from None
