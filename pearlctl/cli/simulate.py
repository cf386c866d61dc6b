"""`pearlctl simulate SCENARIO.toml`: run policies against the simulated cluster of a scenario file
(docs/simulator.md). The same policy modules the daemon loads (pearlctl.policies.load_policy) decide; the
simulator only plays the cluster, the engines and the RL loop. ``oracle`` is the simulator's upper bound.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from pearlctl.cli import app
from pearlctl.cli.common import EXIT_USAGE, emit_json, exits, fail, out
from pearlctl.policies import PolicyError, load_policy
from pearlctl.sim import report
from pearlctl.sim.run import compare
from pearlctl.sim.scenario import ScenarioError, load


@app.command()
def simulate(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO.toml", help="A scenario file (examples/scenarios/)."),
    policy: str = typer.Option(None, "--policy", help="The policy to simulate (a name in policies/, or oracle)."),
    compare_names: str = typer.Option(
        None, "--compare", help="Comma-separated policies to run side by side, e.g. static,elastic,pearl,oracle."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (policies, ratios)."),
    timeline: Path = typer.Option(None, "--timeline", help="Write a PNG of GPU roles over time to this path."),
    seed: int = typer.Option(None, "--seed", help="Override the scenario's seed (work draws and elastic trace)."),
    steps: int = typer.Option(None, "--steps", help="Override the number of RL steps to simulate."),
) -> None:
    """Simulate RL steps of a scenario under one policy or several, and report throughput and costs."""
    with exits():
        if (policy is None) == (compare_names is None):
            raise fail("give exactly one of --policy NAME or --compare a,b,c", EXIT_USAGE)
        names = [policy] if policy else [n.strip() for n in compare_names.split(",") if n.strip()]
        if not names or len(set(names)) != len(names):
            raise fail(f"--compare needs distinct policy names, comma-separated (got {compare_names!r})", EXIT_USAGE)
        if steps is not None and steps < 1:
            raise fail(f"--steps must be >= 1 (got {steps})", EXIT_USAGE)
        if timeline is not None and timeline.suffix.lower() != ".png":
            raise fail(f"--timeline must name a .png file (got {timeline})", EXIT_USAGE)
        for name in names:
            if name == "oracle":
                continue
            try:
                load_policy(name)
            except PolicyError as exc:
                raise fail(f"{exc}, oracle", EXIT_USAGE) from None
        try:
            scenario = load(scenario_path).with_overrides(steps=steps, seed=seed)
        except ScenarioError as exc:
            raise fail(str(exc), EXIT_USAGE) from None
        results = compare(scenario, names, record_timeline=timeline is not None)
        doc = report.to_json(scenario, results)
        if timeline is not None:
            from pearlctl.sim.timeline import write_png

            doc["timeline"] = str(write_png(results, timeline, title=f"{scenario.name} ({scenario.steps} steps)"))
        if json_out:
            emit_json(doc)
            return
        _render(doc)


def _render(doc: dict) -> None:
    table = Table(title=f"{doc['scenario']}: {doc['steps']} {doc['training']} steps of {doc['batch_size']} samples")
    for col in ("policy", "samples/s", "steps/h", "transitions", "trainer delay s", "rollout GPU-h", "idle GPU-h"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, p in doc["policies"].items():
        by = p["gpu_seconds_by_role"]
        serving = sum(by.get(r, 0.0) for r in ("ROLLOUT", "PREFILL", "DECODE")) / 3600
        idle = (by.get("IDLE", 0.0) + by.get("TRAIN_IDLE", 0.0)) / 3600
        label = name if p["finished"] else f"{name} (unfinished)"
        table.add_row(
            label,
            f"{p['samples_per_s']:.3f}",
            f"{p['steps_per_hour']:.2f}",
            str(p["transitions"]),
            f"{p['trainer_delay_s']:.1f}",
            f"{serving:.1f}",
            f"{idle:.1f}",
        )
    out.print(table)
    if doc["ratios"]:
        out.print("  ".join(f"{k} {v:.2f}x" for k, v in doc["ratios"].items()), markup=False)
    if doc.get("timeline"):
        out.print(f"timeline: {doc['timeline']}", markup=False)
