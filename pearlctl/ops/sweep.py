"""``pearlctl simulate --sweep``: every scenario × seed × policy as one simulator run, run as a submitit job
array (pearlctl.slurm.functions: one ``sbatch --array`` on Slurm, processes here without Slurm), merged into
one table: per scenario and policy the mean and spread across seeds, and the ratios between policies (as
``simulate --compare`` computes them, per seed, then averaged).

Each task is a pure function call: :func:`simulate_one` simulates one policy on one scenario at one seed on
the work drawn from that seed (``make_draws``/``make_trace``), which is exactly what ``compare`` gives that
policy for that seed; so a sweep's per-seed documents equal ``simulate SCENARIO --seed S --compare ...
--json`` (deterministic).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pearlctl.host import home
from pearlctl.sim import report
from pearlctl.sim.compare import simulate
from pearlctl.sim.run import RunResult, make_draws, make_trace
from pearlctl.sim.scenario import Scenario
from pearlctl.slurm import functions
from pearlctl.vocabulary import GENERATION_ROLES, Role

DEFAULT_SEEDS = 3  # without --seeds: the scenario's own seed and the next two
DEFAULT_TIME = "60"  # minutes, each task's Slurm time limit
# the numbers a sweep aggregates per scenario × policy: key in the row -> from a policy's report document
METRICS: dict[str, Callable[[dict], float]] = {
    "samples_per_s": lambda p: p["samples_per_s"],
    "steps_per_hour": lambda p: p["steps_per_hour"],
    "transitions": lambda p: p["transitions"],
    "trainer_delay_s": lambda p: p["trainer_delay_s"],
    "rollout_gpu_h": lambda p: sum(p["gpu_seconds_by_role"].get(r, 0.0) for r in GENERATION_ROLES) / 3600,
    "idle_gpu_h": lambda p: (
        (p["gpu_seconds_by_role"].get(Role.IDLE, 0.0) + p["gpu_seconds_by_role"].get("TRAIN_IDLE", 0.0)) / 3600
    ),
}


class SweepError(Exception):
    """The sweep could not run or a task gave no result; ``exit_code`` as the CLI documents it."""

    def __init__(self, message: str, exit_code: int, folder: Path | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.folder = folder


@dataclass(frozen=True)
class Task:
    scenario: Scenario  # with its seed (and steps) set
    policy: str


def simulate_one(task: Task) -> RunResult:
    """One simulator run; what a task of the array runs on its node."""
    s = task.scenario
    return simulate(s, task.policy, draws=make_draws(s), trace=make_trace(s))


def tasks_of(scenarios: list[Scenario], seeds: list[int] | None, policies: list[str]) -> list[Task]:
    """Scenarios × seeds × policies, in that order (``seeds`` None: each scenario's seed and the next two)."""
    names = [s.name for s in scenarios]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SweepError(f"two scenarios are named {', '.join(twice)}: a sweep needs distinct names", 2)
    out = []
    for s in scenarios:
        for seed in seeds if seeds is not None else [s.seed + i for i in range(DEFAULT_SEEDS)]:
            for p in policies:
                out.append(Task(s.with_overrides(seed=seed), p))
    return out


def default_folder() -> Path:
    return home.state_dir() / "submitit" / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def run_sweep(
    tasks: list[Task],
    *,
    executor: str = "auto",
    folder: Path | None = None,
    partition: str | None = None,
    time_limit: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run every task as one job array and merge the results (:func:`merge`). The folder is removed after
    the results are read unless it was given; on a failure it is kept and named."""
    keep = folder is not None
    where = Path(folder) if folder is not None else default_folder()
    res = functions.Resources(job_name="pearl.sweep", time_limit=time_limit or DEFAULT_TIME, partition=partition)
    try:
        results, ran = functions.map_array(
            simulate_one, tasks, executor=executor, folder=where, resources=res, progress=progress
        )
    except functions.FunctionError as exc:
        raise SweepError(f"{exc}\n(the job files are kept in {where})", 3, where) from None
    except ValueError as exc:  # an unknown executor name
        raise SweepError(str(exc), 2) from None
    doc = merge(tasks, results)
    doc["sweep"] = {
        "executor": ran.executor,
        "job_id": ran.job_id,
        "tasks": len(tasks),
        "folder": str(where) if keep else None,
    }
    if not keep:
        functions.remove(where)
    return doc


def _stats(values: list[float]) -> dict:
    return {
        "mean": round(statistics.fmean(values), 4),
        "sd": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def merge(tasks: list[Task], results: list[RunResult]) -> dict:
    """One document: per scenario its seeds, per policy ``n`` and the stats (mean, sd, min, max across
    seeds) of each metric, the ratios' stats, and under ``runs`` each seed's ``simulate --compare --json``
    document (``pearlctl.sim.report.to_json``)."""
    by: dict[str, dict[int, dict[str, RunResult]]] = {}
    scenario_at: dict[tuple[str, int], Scenario] = {}
    policies: list[str] = []
    for task, result in zip(tasks, results, strict=True):
        s = task.scenario
        by.setdefault(s.name, {}).setdefault(s.seed, {})[task.policy] = result
        scenario_at[(s.name, s.seed)] = s
        if task.policy not in policies:
            policies.append(task.policy)
    scenarios: dict[str, dict] = {}
    for name, seeds in by.items():
        runs = {str(seed): report.to_json(scenario_at[(name, seed)], rs) for seed, rs in seeds.items()}
        first = scenario_at[(name, next(iter(seeds)))]
        rows = {}
        for p in policies:
            docs = [r["policies"][p] for r in runs.values()]
            rows[p] = {"n": len(docs), "finished": all(d["finished"] for d in docs)}
            rows[p].update({k: _stats([f(d) for d in docs]) for k, f in METRICS.items()})
        ratio_keys = list(next(iter(runs.values()))["ratios"])
        ratios = {k: _stats([r["ratios"][k] for r in runs.values()]) for k in ratio_keys}
        scenarios[name] = {
            "path": str(first.path) if first.path else None,
            "steps": first.steps,
            "seeds": list(seeds),
            "policies": rows,
            "ratios": ratios,
            "runs": runs,
        }
    return {"policies": policies, "scenarios": scenarios}
