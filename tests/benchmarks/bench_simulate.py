"""Benchmark and gate: every shipped scenario under static, elastic, pearl and the oracle, at its own step count,
with the planner's model exact (no mismatch) and with the measured mismatch (docs/simulator.md, "Model
mismatch"), on several seeds (the scenario's own and the next ones: other draws of the work and of the elastic
trace). No run is given a hint: no shipped scenario sets ``[training] first_wait_s``, and the gate refuses one
that does.

    .venv/bin/python tests/benchmarks/bench_simulate.py [--check] [--write-docs] [--seeds N] [--steps N]
                                                        [--router R] [--jobs N] [SCENARIO ...]

It prints the tables. ``--write-docs`` writes them to docs/simulator-results.md with the command, the commit
they were measured at and the numbers in a machine-readable block. ``--check`` is the gate: it exits 1 when,
on any scenario at either mismatch (``violations``),

- pearl is below ``PEARL_OVER_ORACLE`` of the oracle in the mean over seeds, or below ``PEARL_OVER_ORACLE_WORST``
  on its worst seed;
- pearl is below static or elastic (on any seed);
- any policy is above the oracle (on any seed);
- any run did not train all its steps;

unless the miss is one of ``OPEN`` (the targets the policies miss today, each with its reason; a miss of the
last three rules never is, and an open entry whose target holds again fails the gate: the list only shrinks);
or, when it ran every shipped scenario at its own step count, the default seeds and router, when
docs/simulator-results.md no longer holds these numbers (a ratio off by more than ``DOCS_TOLERANCE``: rerun with
``--write-docs``). It prints the CPU time it took: the gate's budget is ``CPU_BUDGET_S`` of one core.
One task is one scenario at one mismatch and seed (static, elastic, pearl, then the oracle replaying pearl);
tasks go to ``--jobs`` processes (default: one per CPU), the slowest first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.sim import report  # noqa: E402
from pearlctl.sim import scenario as sc  # noqa: E402
from pearlctl.sim.oracle import run_oracle  # noqa: E402
from pearlctl.sim.routing import DEFAULT_ROUTER, ROUTERS  # noqa: E402
from pearlctl.sim.run import make_draws, make_trace, run_policy  # noqa: E402
from tests.benchmarks import _targets  # noqa: E402

POLICIES = ["static", "elastic", "pearl", "oracle"]
MISMATCHES = {"none": sc.NO_MISMATCH, "measured": sc.MEASURED}
SEEDS = 3  # the scenario's own seed and the next ones
# The targets (the speedups-without-a-hint issue): pearl within 10% of the oracle on average over the seeds and
# 15% on its worst seed, never below the fixed or the elastic allocation, nothing above the oracle.
PEARL_OVER_ORACLE = 0.90
PEARL_OVER_ORACLE_WORST = 0.85
CPU_BUDGET_S = 360.0  # the gate's CI run, in CPU seconds of one core
# Targets the policies miss today, each with why (measured at the commit docs/simulator-results.md names; its
# "Open" list repeats them). The gate fails on any other miss, and on any of these that holds again, so the list
# only shrinks; a run that beats the oracle, does not finish or uses a hint can never be open.
OPEN = {
    ("preemption-storm-8b", "measured", "pearl/oracle"): (
        "at the measured mismatch every part of the work is slower than pearl's model and the spot workers' cold "
        "start longer: pearl's first three batches wait for the 32 spot workers to come up and join (about 135 s "
        "each against the oracle's 83, whose spot workers serve from t = 0 and whose transitions are free); with no "
        "mismatch pearl holds 0.91"
    ),
    **{
        ("single-turn-math-8b", m, "pearl/oracle"): (
            "a batch (about 24 s) is shorter than any borrow (a cold start, or a wake and a weight sync), so no "
            "paid move pays; the oracle's free trainer GPUs halve it"
        )
        for m in MISMATCHES
    },
}
DOCS = REPO / "docs/simulator-results.md"
DOCS_TOLERANCE = 0.005  # relative: a documented ratio further than this from a fresh run is stale
_BLOCK = re.compile(r"<!-- results\n(.*?)\n-->", re.S)
RATIOS = ("pearl/oracle", "pearl/static", "pearl/elastic", "static/oracle", "elastic/oracle")
REFERENCES = (
    "Published references (docs/sources.md §7; the PEARL paper itself was not available): PEARL "
    "2.17–2.79× the throughput of fixed-resource ROLL (compare pearl/static) and +26.9% (Qwen3-8B) / +36.3% "
    "(Qwen3-30B-A3B) over the elastic RLBoost+ baseline (compare pearl/elastic: 1.27× / 1.36×)."
)


def _task(path: Path, steps: int | None, mismatch: str, seed: int, router: str) -> dict:
    """One scenario at one mismatch and seed: the policies on the same draws and trace, then the oracle replaying
    pearl's schedule; the ``report.to_json`` document, with the task's CPU seconds."""
    t0 = time.process_time()
    s = sc.load(path).with_overrides(steps=steps, seed=seed, mismatch=MISMATCHES[mismatch])
    draws, trace = make_draws(s), make_trace(s)
    runs = {
        p: run_policy(s, p, draws=draws, trace=trace, router=router, record_schedule=p == "pearl")
        for p in POLICIES
        if p != "oracle"
    }
    runs["oracle"] = run_oracle(s, draws=draws, trace=trace, router=router, schedules={"pearl": runs["pearl"].schedule})
    for r in runs.values():
        r.schedule = None
    return {**report.to_json(s, runs), "cpu_s": time.process_time() - t0}


def run(
    paths: list[Path], steps: int | None, seeds: int, router: str = DEFAULT_ROUTER, jobs: int | None = None
) -> tuple[list[dict], float, float]:
    """Every scenario at every mismatch and seed: one document per scenario (``{"scenario", "steps", "training",
    "batch_size", "seeds", "hint", MISMATCH: {"runs": [a document per seed], "mean": {...}, "worst": {...}}}``),
    the wall time and the CPU time it took."""
    scenarios = {p: sc.load(p).with_overrides(steps=steps) for p in paths}
    work = [
        (p, m, scenarios[p].seed + k) for p in paths for m in MISMATCHES for k in range(seeds)
    ]  # the biggest first, so that the last one to finish is a short one
    work.sort(key=lambda w: -scenarios[w[0]].steps * scenarios[w[0]].workload.batch_size)
    n = max(1, min(len(work), jobs or os.cpu_count() or 1))
    t0 = time.monotonic()
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {w: pool.submit(_task, w[0], steps, w[1], w[2], router) for w in work}
        results = {w: f.result() for w, f in futures.items()}
    wall = time.monotonic() - t0
    cpu = sum(r.pop("cpu_s") for r in results.values())
    docs = []
    for p, s in scenarios.items():
        doc = {
            "scenario": s.name,
            "steps": s.steps,
            "training": s.training.mode,
            "batch_size": s.workload.batch_size,
            "seeds": [s.seed + k for k in range(seeds)],
            "hint": s.training.first_wait_s,
        }
        for m in MISMATCHES:
            per_seed = [results[(p, m, s.seed + k)] for k in range(seeds)]
            doc[m] = {"runs": per_seed, **_summary(per_seed)}
        docs.append(doc)
    print(f"{len(work)} tasks on {n} processes: {wall:.0f} s, {cpu:.0f} CPU-s", file=sys.stderr)
    return docs, wall, cpu


def _summary(per_seed: list[dict]) -> dict:
    """The mean over seeds of each ratio and of each policy's samples/s, and each ratio's worst seed."""
    keys = [k for k in RATIOS if all(k in r["ratios"] for r in per_seed)]
    return {
        "ratios": {k: round(statistics.fmean(r["ratios"][k] for r in per_seed), 4) for k in keys},
        "worst": {k: min(r["ratios"][k] for r in per_seed) for k in keys},
        "samples_per_s": {
            name: round(statistics.fmean(r["policies"][name]["samples_per_s"] for r in per_seed), 4)
            for name in per_seed[0]["policies"]
        },
    }


# -- the gate -----------------------------------------------------------------------------------------------


def violations(docs: list[dict]) -> list[tuple[tuple | None, str]]:
    """Every target the runs miss (the module doc): (its key for ``OPEN`` — (scenario, mismatch, ratio) — or None
    for a rule no miss of which may be open, the message)."""
    out: list[tuple[tuple | None, str]] = []
    for d in docs:
        name = d["scenario"]
        if d["hint"] is not None:
            out.append((None, f"{name}: sets [training] first_wait_s = {d['hint']} (no gated number may use a hint)"))
        for m in MISMATCHES:
            where = f"{name} ({d['steps']} steps, mismatch {m})"
            mean, worst = d[m]["ratios"]["pearl/oracle"], d[m]["worst"]["pearl/oracle"]
            if mean < PEARL_OVER_ORACLE:
                msg = f"{where}: pearl/oracle {mean:.3f} (mean over seeds) is below {PEARL_OVER_ORACLE}"
                out.append(((name, m, "pearl/oracle"), msg))
            if worst < PEARL_OVER_ORACLE_WORST:
                msg = f"{where}: pearl/oracle {worst:.3f} (worst seed) is below {PEARL_OVER_ORACLE_WORST}"
                out.append(((name, m, "pearl/oracle"), msg))
            for r in d[m]["runs"]:
                at = f"{where}, seed {r['seed']}"
                sps = {k: v["samples_per_s"] for k, v in r["policies"].items()}
                for policy, p in r["policies"].items():
                    if not p["finished"]:
                        out.append((None, f"{at}: {policy} trained {p['steps']} of {d['steps']} steps"))
                    if policy != "oracle" and sps[policy] > sps["oracle"] * (1 + 1e-9):
                        msg = f"{at}: {policy} {sps[policy]:.4f} samples/s beats the oracle's {sps['oracle']:.4f}"
                        out.append((None, msg))
                for base in ("static", "elastic"):
                    if sps["pearl"] < sps[base] * (1 - 1e-9):
                        msg = f"{at}: pearl {sps['pearl']:.4f} samples/s is below {base}'s {sps[base]:.4f}"
                        out.append(((name, m, f"pearl/{base}"), msg))
    return out


def verdict(docs: list[dict]) -> tuple[list[str], list[str]]:
    """(what fails the gate, the open misses it still reports): ``split_open`` of ``violations``."""
    return split_open(violations(docs), OPEN, {d["scenario"] for d in docs}, "bench_simulate.py")


def split_open(
    missed: list[tuple[tuple | None, str]], open_misses: dict, ran: set[str], script: str
) -> tuple[list[str], list[str]]:
    """A gate's verdict on its ``missed`` targets (key, message): (what fails it, the open misses it still reports).
    Every miss not in ``open_misses``, and every open entry of a scenario that ran whose target now holds (the list
    only shrinks: ``script`` is where to remove it)."""
    keys = {k for k, _ in missed if k is not None}
    failing = [msg for k, msg in missed if k is None or k not in open_misses]
    failing += [
        f"{name}, mismatch {m}: {ratio} now holds its target: remove it from OPEN in {script}"
        for (name, m, ratio) in open_misses
        if name in ran and (name, m, ratio) not in keys
    ]
    still = [f"{msg} (open: {open_misses[k]})" for k, msg in missed if k is not None and k in open_misses]
    return failing, still


def documented(path: Path = DOCS) -> dict | None:
    """The numbers a results doc holds (its machine-readable block; docs/simulator-results.md by default), or
    None."""
    if not path.is_file():
        return None
    m = _BLOCK.search(path.read_text())
    return json.loads(m.group(1)) if m else None


def results_block(numbers: dict) -> str:
    """The machine-readable block ``documented`` reads."""
    return f"<!-- results\n{json.dumps(numbers, indent=1, sort_keys=True)}\n-->"


def stale(docs: list[dict]) -> list[str]:
    """Where docs/simulator-results.md no longer holds what this run measured."""
    held = documented()
    if held is None:
        return [f"{DOCS.relative_to(REPO)} has no results block: rerun with --write-docs"]
    out = []
    for name, f in _numbers(docs)["scenarios"].items():
        h = held.get("scenarios", {}).get(name)
        if h is None or h.get("steps") != f["steps"] or h.get("seeds") != f["seeds"]:
            out.append(f"{name}: not documented at {f['steps']} steps, seeds {f['seeds']}")
            continue
        for m in MISMATCHES:
            for part in ("ratios", "worst"):
                for key, x in f[m][part].items():
                    y = h.get(m, {}).get(part, {}).get(key)
                    if y is None or abs(x - y) > DOCS_TOLERANCE * max(abs(y), 1e-9):
                        out.append(f"{name}, mismatch {m}: {key} ({part}) is {x:.4f}, documented {y}")
    if out:
        out.append(f"{DOCS.relative_to(REPO)} is stale: rerun tests/benchmarks/bench_simulate.py --write-docs")
    return out


# -- tables ---------------------------------------------------------------------------------------------------


def _numbers(docs: list[dict]) -> dict:
    return {
        "scenarios": {
            d["scenario"]: {
                "steps": d["steps"],
                "seeds": d["seeds"],
                **{
                    m: {
                        "samples_per_s": d[m]["samples_per_s"],
                        "ratios": d[m]["ratios"],
                        "worst": d[m]["worst"],
                        "oracle_choice": [r["policies"]["oracle"].get("oracle_choice") for r in d[m]["runs"]],
                    }
                    for m in MISMATCHES
                },
            }
            for d in docs
        }
    }


def _learned(predictor: dict) -> str:
    r = predictor["ratio"]
    return "—" if r is None else f"{r:.2f} ({predictor['checks']})"


def table(docs: list[dict]) -> str:
    def cell(d: dict, m: str, key: str) -> str:
        return f"{d[m]['ratios'][key]:.3f} ({d[m]['worst'][key]:.3f})"

    lines = [
        "| scenario | mismatch | pearl/oracle | pearl/static | pearl/elastic | static/oracle | elastic/oracle |",
        "|" + "---|" * 7,
    ]
    for d in docs:
        for m in MISMATCHES:
            lines.append(
                f"| {d['scenario']} ({d['steps']} {d['training']} steps) | {m} | "
                + " | ".join(cell(d, m, k) for k in RATIOS)
                + " |"
            )
    seeds = ", ".join(str(x) for x in docs[0]["seeds"]) if docs else ""
    lines += [
        "",
        f"Each cell: the mean over seeds, and in brackets the worst seed (seeds: the scenario's own and the next "
        f"ones; the first scenario's: {seeds}). Ratios are of samples per second (trajectories trained per "
        "simulated second). No run has a hint: the trainer reports no expected wait before it measured one, and "
        "the first batch's lending horizon is the planner's own prediction.",
        "",
        "| scenario | mismatch | seed | static | elastic | pearl | oracle | oracle's candidate "
        "| pearl's learned correction (batches) |",
        "|" + "---|" * 9,
    ]
    for d in docs:
        for m in MISMATCHES:
            for r in d[m]["runs"]:
                p = r["policies"]
                lines.append(
                    f"| {d['scenario']} | {m} | {r['seed']} "
                    + "".join(f"| {p[k]['samples_per_s']:.3f} " for k in POLICIES)
                    + f"| {p['oracle'].get('oracle_choice', '')} | {_learned(p['pearl']['predictor'])} |"
                )
    lines += [
        "",
        "Samples per second per seed; the oracle's candidate is the schedule that won (pearlctl/sim/oracle.py). "
        "The learned correction is measured / predicted over the batches the predictor checked "
        "(pearlctl.planner.correct: the overall ratio at the end of the run, and how many batches).",
        "",
        "| scenario | mismatch | policy | steps/h | transitions | forced returns | trainer delay s | GPU-h serving "
        "| GPU-h idle (incl. trainer waiting) | GPU-h in transition | recompute Mtok | batch rollout s |",
        "|" + "---|" * 12,
    ]
    for d in docs:
        for m in MISMATCHES:
            r = d[m]["runs"][0]  # the scenario's own seed
            for name, p in r["policies"].items():
                by = p["gpu_seconds_by_role"]
                serving = sum(by[k] for k in ("ROLLOUT", "PREFILL", "DECODE")) / 3600
                idle = (by["IDLE"] + by["TRAIN_IDLE"]) / 3600
                lines.append(
                    f"| {d['scenario']} | {m} | {name} | {p['steps_per_hour']:.2f} | {p['transitions']} "
                    f"| {p['forced_returns']} | {p['trainer_delay_s']:.0f} | {serving:.1f} | {idle:.1f} "
                    f"| {by['TRANSITION'] / 3600:.2f} | {p['engine']['recompute_tokens'] / 1e6:.0f} "
                    f"| {' '.join(f'{x:.0f}' for x in p['batch_rollout_s'])} |"
                )
    lines += ["", "Per policy at each scenario's own seed."]
    return "\n".join(lines)


def commit() -> str:
    """The commit the numbers were measured at, and whether tracked files differed from it (the results file
    itself, rewritten by every --write-docs, does not count)."""
    return _targets.commit(exclude=DOCS)


def write_docs(docs: list[dict], cmd: str, wall: float, cpu: float, failing: list[str], still: list[str]) -> None:
    numbers = {"commit": commit(), "command": cmd, **_numbers(docs)}
    m = sc.MEASURED_BIAS, sc.MEASURED_SPREAD
    targets = (
        f"on every scenario at either mismatch pearl at least {PEARL_OVER_ORACLE} of the oracle over the seeds and "
        f"{PEARL_OVER_ORACLE_WORST} on its worst seed, never below static or elastic; no policy beats the oracle; "
        "every run trains all its steps; no hint"
    )
    if failing:
        gate = "FAILED:\n\n" + "\n".join(f"- {v}" for v in failing)
    else:
        gate = f"passed. Its targets: {targets}. No miss but the open ones below."
    gate += (
        f"\n\nOpen — targets missed today, each with why (`OPEN` in the benchmark; the gate fails when one of them "
        f"holds again, so the list only shrinks): {len(still)} misses.\n\n" + "\n".join(f"- {v}" for v in still)
        if still
        else "\n\nNo target is open."
    )
    text = (
        "# Simulator results\n\n"
        f"Made by `{cmd}` at commit {numbers['commit']} ({wall:.0f} s on this machine, {cpu:.0f} CPU-s). Do not "
        "edit by hand: rerun the command; `--check` (the gate) fails when these numbers no longer hold.\n"
        "How to read it, the model mismatch and why the numbers differ from the published ones: docs/simulator.md.\n\n"
        f"Mismatch: `none` — the engines run the planner's own profile; `measured` — decode, prefill, tool calls "
        f"and transitions each take {m[0]}× what the profile and workload say, with a per-request spread "
        f"(log-sd {m[1]}), from the predictor's error against real runs (docs/planner.md).\n\n"
        f"{table(docs)}\n\nGate (`--check`): {gate}\n\n{REFERENCES}\n\n"
        f"{results_block(numbers)}\n"
    )
    DOCS.write_text(text)
    print(f"wrote {DOCS.relative_to(REPO)}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's step count")
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds per scenario (default {SEEDS})")
    ap.add_argument("--check", action="store_true", help="the gate: exit 1 on a missed target or stale docs")
    ap.add_argument("--write-docs", action="store_true", help="write docs/simulator-results.md")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    ap.add_argument(
        "--router",
        choices=ROUTERS,
        default=DEFAULT_ROUTER,
        help="the engines' router model (docs/simulator.md); --write-docs writes only the default's table",
    )
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    full = not args.scenarios and args.steps is None and args.router == DEFAULT_ROUTER and args.seeds == SEEDS
    if args.write_docs and not full:
        ap.error("--write-docs documents every shipped scenario as it is, on the default seeds and router")
    paths = args.scenarios or sorted((REPO / "examples/scenarios").glob("*.toml"))
    docs, wall, cpu = run(paths, args.steps, args.seeds, args.router, args.jobs)
    print(table(docs))
    print()
    print(REFERENCES)
    failing, still = verdict(docs)
    if args.write_docs:
        write_docs(docs, "python tests/benchmarks/bench_simulate.py --write-docs", wall, cpu, failing, still)
    if not args.check:
        return 0
    if full:
        failing += stale(docs)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print()
    for v in still:
        print(f"GATE: open: {v}")
    for v in failing:
        print(f"GATE: {v}")
    print(
        f"GATE: {'FAILED' if failing else 'passed'} ({len(still)} open misses; {wall:.0f} s, {cpu:.0f} CPU-s in the "
        f"simulations, {children.ru_utime + children.ru_stime:.0f} CPU-s in all; budget {CPU_BUDGET_S:.0f})"
    )
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
