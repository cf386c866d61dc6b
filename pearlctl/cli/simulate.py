"""`pearlctl simulate SCENARIO.toml`: run policies against the simulated cluster of a scenario file
(docs/simulator.md). The same policy modules the daemon loads (pearlctl.policies.load_policy) decide; the
simulator only plays the cluster, the engines and the RL loop. ``oracle`` is the simulator's upper bound.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import typer
from rich.table import Table

from pearlctl.cli.app import app
from pearlctl.cli.common import EXIT_SIMULATION, EXIT_USAGE, emit_json, err, exits, fail, out
from pearlctl.vocabulary import GENERATION_ROLES, Role


@app.command()
def simulate(
    scenario_paths: list[Path] = typer.Argument(
        ..., metavar="SCENARIO.toml", help="A scenario file (examples/scenarios/); with --sweep, one or more."
    ),
    policy: str = typer.Option(None, "--policy", help="The policy to simulate (a name, as for borrow, or oracle)."),
    compare_names: str = typer.Option(
        None, "--compare", help="Comma-separated policies to run side by side, e.g. static,elastic,pearl,oracle."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (policies, ratios)."),
    timeline: Path = typer.Option(None, "--timeline", help="Write a PNG of GPU roles over time to this path."),
    seed: int = typer.Option(None, "--seed", help="Override the scenario's seed (work draws and elastic trace)."),
    steps: int = typer.Option(None, "--steps", help="Override the number of RL steps to simulate."),
    sweep: bool = typer.Option(
        False, "--sweep", help="Run scenarios x seeds x policies as a job array and print one merged table."
    ),
    seeds: str = typer.Option(
        None, "--seeds", help="--sweep: comma-separated seeds (default: each scenario's seed and the next two)."
    ),
    executor: str = typer.Option(
        None, "--executor", help="--sweep: slurm, local or auto (default auto: slurm when a slurmctld answers)."
    ),
    partition: str = typer.Option(None, "--partition", help="--sweep on Slurm: the array's partition."),
    time_limit: str = typer.Option(None, "--time", help="--sweep on Slurm: each task's time limit (default 60 min)."),
    folder: Path = typer.Option(
        None, "--folder", help="--sweep: keep submitit's files here (default: a folder under the state dir, removed)."
    ),
    max_memory: float = typer.Option(
        None,
        "--max-memory",
        help="GiB each simulation process may use (default: half this machine's memory over the processes run at "
        "once); past it the command stops with one line (exit 10). 0 lifts the guard.",
    ),
) -> None:
    """Simulate RL steps of a scenario under one policy or several, and report throughput and costs."""
    with exits():
        if not sweep:
            sweep_only = {"--seeds": seeds, "--executor": executor, "--partition": partition, "--time": time_limit}
            sweep_only["--folder"] = folder
            given = [k for k, v in sweep_only.items() if v is not None]
            if given:
                raise fail(f"{', '.join(given)} only go with --sweep", EXIT_USAGE)
            if len(scenario_paths) != 1:
                raise fail(f"give one SCENARIO.toml (several only with --sweep), got {len(scenario_paths)}", EXIT_USAGE)
        if (policy is None) == (compare_names is None):
            raise fail("give exactly one of --policy NAME or --compare a,b,c", EXIT_USAGE)
        names = [policy] if policy else [n.strip() for n in compare_names.split(",") if n.strip()]
        if not names or len(set(names)) != len(names):
            raise fail(f"--compare needs distinct policy names, comma-separated (got {compare_names!r})", EXIT_USAGE)
        if steps is not None and steps < 1:
            raise fail(f"--steps must be >= 1 (got {steps})", EXIT_USAGE)
        if max_memory is not None and not (max_memory >= 0 and math.isfinite(max_memory)):
            raise fail(f"--max-memory must be a number of GiB >= 0 (0: no guard), got {max_memory}", EXIT_USAGE)
        if timeline is not None and timeline.suffix.lower() != ".png":
            raise fail(f"--timeline must name a .png file (got {timeline})", EXIT_USAGE)
        _load_policies(names)
        if sweep:
            _sweep(
                scenario_paths, names, steps, seed, seeds, executor, partition, time_limit, folder, timeline, json_out
            )
            return
        _simulate_one(
            scenario_paths[0],
            names,
            steps=steps,
            seed=seed,
            timeline=timeline,
            max_memory=max_memory,
            json_out=json_out,
        )


def _load_policies(names: list[str]) -> None:
    """Each name is a policy the daemon could load, or a baseline the simulator computes (``oracle``,
    ``colocated``, ``disaggregated``); an unknown one is a usage error naming the known ones."""
    from pearlctl.policies import PolicyError, load_policy
    from pearlctl.sim.compare import BASELINES

    for name in names:
        if name in BASELINES:
            continue
        try:
            load_policy(name)
        except PolicyError as exc:
            raise fail(f"{exc}, {', '.join(BASELINES)}", EXIT_USAGE) from None


def _simulate_one(
    path: Path,
    names: list[str],
    *,
    steps: int | None,
    seed: int | None,
    timeline: Path | None,
    max_memory: float | None,
    json_out: bool,
) -> None:
    """One scenario under each policy, in this process: the report as JSON or a table, the timeline drawn."""
    # the simulator (numpy) is imported by the command that runs it, not by every pearlctl command
    from pearlctl.sim import report
    from pearlctl.sim.compare import SimulationError, compare
    from pearlctl.sim.scenario import ScenarioError, load

    try:
        scenario = load(path).with_overrides(steps=steps, seed=seed)
    except ScenarioError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    try:
        results = compare(
            scenario, names, record_timeline=timeline is not None, max_memory=_memory_limit(max_memory, names)
        )
    except SimulationError as exc:
        raise fail(str(exc), EXIT_SIMULATION) from None
    doc = report.to_json(scenario, results)
    if timeline is not None:
        from pearlctl.sim.timeline import write_png

        doc["timeline"] = str(write_png(results, timeline, title=f"{scenario.name} ({scenario.steps} steps)"))
    if json_out:
        emit_json(doc)
        return
    _render(doc)


def _memory_limit(gib: float | None, names: list[str]) -> int | None:
    """Bytes each simulation process may use: ``--max-memory`` (0: no limit), by default half the machine's
    memory shared by the processes that run at once (one per policy, at most one per CPU)."""
    if gib is not None:
        return None if gib == 0 else int(gib * 2**30)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    at_once = max(1, min(len(names), os.cpu_count() or 1))
    return total // 2 // at_once


def _render(doc: dict) -> None:
    table = Table(title=f"{doc['scenario']}: {doc['steps']} {doc['training']} steps of {doc['batch_size']} samples")
    judged = any("judge" in p for p in doc["policies"].values())
    cols = ("policy", "samples/s", "steps/h", "transitions", "trainer delay s", "rollout GPU-h")
    for col in (*cols, *(("judge GPU-h",) if judged else ()), "idle GPU-h"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, p in doc["policies"].items():
        by = p["gpu_seconds_by_role"]
        serving = sum(by.get(r, 0.0) for r in GENERATION_ROLES) / 3600
        idle = (by.get(Role.IDLE, 0.0) + by.get("TRAIN_IDLE", 0.0)) / 3600
        label = name if p["finished"] else f"{name} (unfinished)"
        judging = (f"{by.get(Role.REWARD, 0.0) / 3600:.1f}",) if judged else ()
        table.add_row(
            label,
            f"{p['samples_per_s']:.3f}",
            f"{p['steps_per_hour']:.2f}",
            str(p["transitions"]),
            f"{p['trainer_delay_s']:.1f}",
            f"{serving:.1f}",
            *judging,
            f"{idle:.1f}",
        )
    out.print(table)
    if doc["ratios"]:
        out.print("  ".join(f"{k} {v:.2f}x" for k, v in doc["ratios"].items()), markup=False)
    if doc.get("timeline"):
        out.print(f"timeline: {doc['timeline']}", markup=False)


def _sweep(paths, names, steps, seed, seeds_text, executor, partition, time_limit, folder, timeline, json_out) -> None:
    """--sweep: checks every input before anything is submitted (exit 2), then runs the array (exit 3 when a
    task gives no result: its state and log are named, and submitit's folder is kept)."""
    from pearlctl.config import slurm_option_problems
    from pearlctl.ops.sweep import SweepError, run_sweep, tasks_of  # submitit is imported only for a sweep
    from pearlctl.sim.scenario import ScenarioError, load

    if timeline is not None:
        raise fail("--timeline draws one run: not with --sweep", EXIT_USAGE)
    if seed is not None:
        raise fail("--seed sets one seed: with --sweep use --seeds 1,2,3", EXIT_USAGE)
    seeds = None
    if seeds_text is not None:
        try:
            seeds = [int(x) for x in seeds_text.split(",") if x.strip()]
        except ValueError:
            seeds = []
        if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
            raise fail(f"--seeds must be distinct non-negative integers, comma-separated (got {seeds_text!r})", 2)
    if executor is not None and executor not in ("auto", "slurm", "local"):
        raise fail(f"--executor must be auto, slurm or local (got {executor!r})", EXIT_USAGE)
    bad = slurm_option_problems(partition=partition, time_limit=time_limit)
    if bad:
        raise fail("; ".join(str(p) for p in bad), EXIT_USAGE)
    scenarios = []
    for path in paths:
        try:
            scenarios.append(load(path).with_overrides(steps=steps))
        except ScenarioError as exc:
            raise fail(str(exc), EXIT_USAGE) from None
    try:
        tasks = tasks_of(scenarios, seeds, names)
        err.print(f"sweep: {len(tasks)} simulations ({len(scenarios)} scenarios x seeds x {len(names)} policies)")
        doc = run_sweep(
            tasks,
            executor=executor or "auto",
            folder=folder,
            partition=partition,
            time_limit=time_limit,
            progress=lambda line: err.print(line, markup=False),
        )
    except SweepError as exc:
        raise fail(str(exc), exc.exit_code) from None
    if json_out:
        emit_json(doc)
        return
    _render_sweep(doc)


def _cell(stats: dict, fmt: str) -> str:
    return f"{stats['mean']:{fmt}} ± {stats['sd']:{fmt}}" if stats["sd"] else f"{stats['mean']:{fmt}}"


def _render_sweep(doc: dict) -> None:
    info = doc["sweep"]
    where = f"job {info['job_id']}" if info["executor"] == "slurm" else "local processes"
    table = Table(title=f"sweep: {info['tasks']} simulations on {info['executor']} ({where}); mean ± sd over seeds")
    cols = ("scenario", "policy", "seeds", "samples/s", "steps/h", "transitions", "trainer delay s", "rollout GPU-h")
    for col in (*cols, "idle GPU-h"):
        table.add_column(col, justify="left" if col in ("scenario", "policy") else "right")
    for name, sc in doc["scenarios"].items():
        for p, row in sc["policies"].items():
            table.add_row(
                name,
                p if row["finished"] else f"{p} (unfinished)",
                str(row["n"]),
                _cell(row["samples_per_s"], ".3f"),
                _cell(row["steps_per_hour"], ".2f"),
                _cell(row["transitions"], ".1f"),
                _cell(row["trainer_delay_s"], ".1f"),
                _cell(row["rollout_gpu_h"], ".1f"),
                _cell(row["idle_gpu_h"], ".1f"),
            )
    out.print(table)
    for name, sc in doc["scenarios"].items():
        if sc["ratios"]:
            ratios = "  ".join(
                f"{k} {v['mean']:.2f}x" + (f" ± {v['sd']:.2f}" if v["sd"] else "") for k, v in sc["ratios"].items()
            )
            out.print(f"{name} (seeds {', '.join(map(str, sc['seeds']))}): {ratios}", markup=False)
    if info["folder"]:
        out.print(f"submitit files: {info['folder']}", markup=False)
