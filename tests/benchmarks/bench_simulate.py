"""Benchmark and gate: every shipped scenario under static, elastic, pearl and the oracle, at its own step count,
with the planner's model exact (no mismatch) and with the measured mismatch (docs/simulator.md, "Model
mismatch"), and pearl twice more: without the predictor's correction, and with its trainer's first expected
wait unknown (the scenario's first_wait_s unset).

    .venv/bin/python tests/benchmarks/bench_simulate.py [--check] [--write-docs] [--steps N] [--router R]
                                                        [--first-wait-s S|none] [--jobs N] [SCENARIO ...]

It prints the tables. ``--write-docs`` writes them to docs/simulator-results.md with the command, the commit
they were measured at and the numbers in a machine-readable block. ``--check`` is the gate; it exits 1 when,
on any scenario at either mismatch, a policy beats the oracle or pearl is below static or elastic — or, when it
ran every shipped scenario at its own step count with the default router, when docs/simulator-results.md no
longer holds these numbers (a ratio off by more than ``DOCS_TOLERANCE``: rerun with ``--write-docs``).
Runs are independent and go to ``--jobs`` processes (default: one per CPU), the slowest first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.sim import report  # noqa: E402
from pearlctl.sim import scenario as sc  # noqa: E402
from pearlctl.sim.engine import DEFAULT_ROUTER, ROUTERS  # noqa: E402
from pearlctl.sim.run import RunResult, run_policy  # noqa: E402

POLICIES = ["static", "elastic", "pearl", "oracle"]
UNCORRECTED = "pearl-uncorrected"  # pearl without the predictor's running correction
NO_FIRST_WAIT = "pearl-no-first-wait"  # pearl with the trainer's first expected wait unknown (no --first-wait-s)
VARIANTS = [UNCORRECTED, NO_FIRST_WAIT]
MISMATCHES = {"none": sc.NO_MISMATCH, "measured": sc.MEASURED}
DOCS = REPO / "docs/simulator-results.md"
DOCS_TOLERANCE = 0.005  # relative: a documented ratio further than this from a fresh run is stale
_BLOCK = re.compile(r"<!-- results\n(.*?)\n-->", re.S)
REFERENCES = (
    "Published references (docs/sources.md §7; the PEARL paper itself was not available): PEARL "
    "2.17–2.79× the throughput of fixed-resource ROLL (compare pearl/static) and +26.9% (Qwen3-8B) / +36.3% "
    "(Qwen3-30B-A3B) over the elastic RLBoost+ baseline (compare pearl/elastic: 1.27× / 1.36×)."
)
# the slowest runs first, so that the last one to finish is a short one
_COST = {"oracle": 0, "static": 1, "elastic": 2, "pearl": 3, UNCORRECTED: 4, NO_FIRST_WAIT: 5}


def _job(path: Path, steps: int | None, mismatch: str, policy: str, router: str, first_wait) -> RunResult:
    s = sc.load(path).with_overrides(steps=steps, mismatch=MISMATCHES[mismatch], first_wait_s=first_wait)
    name = "pearl" if policy in VARIANTS else policy
    if policy == NO_FIRST_WAIT:
        s = s.with_overrides(first_wait_s=None)
    r = run_policy(s, name, router=router, correction=policy != UNCORRECTED)
    r.policy = policy
    return r


def run(
    paths: list[Path],
    steps: int | None,
    router: str = DEFAULT_ROUTER,
    jobs: int | None = None,
    first_wait: float | None | sc.Keep = sc.KEEP,
) -> tuple[list[dict], float]:
    """Every scenario at every mismatch under every policy: one document per scenario (``{"scenario", "steps",
    "training", "batch_size", MISMATCH: report.to_json(...)}``), and the wall time it took."""
    scenarios = {p: sc.load(p).with_overrides(steps=steps, first_wait_s=first_wait) for p in paths}
    work = [(p, m, pol) for p in paths for m in MISMATCHES for pol in [*POLICIES, *VARIANTS]]
    work.sort(key=lambda w: (_COST[w[2]], -scenarios[w[0]].steps * scenarios[w[0]].workload.batch_size))
    n = max(1, min(len(work), jobs or os.cpu_count() or 1))
    t0 = time.monotonic()
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {w: pool.submit(_job, w[0], steps, w[1], w[2], router, first_wait) for w in work}
        results = {w: f.result() for w, f in futures.items()}
    wall = time.monotonic() - t0
    docs = []
    for p, s in scenarios.items():
        doc = {"scenario": s.name, "steps": s.steps, "training": s.training.mode, "batch_size": s.workload.batch_size}
        for m in MISMATCHES:
            by = {pol: results[(p, m, pol)] for pol in [*POLICIES, *VARIANTS]}
            doc[m] = report.to_json(s.with_overrides(mismatch=MISMATCHES[m]), by)
        docs.append(doc)
    print(f"{len(work)} runs on {n} processes: {wall:.0f} s", file=sys.stderr)
    return docs, wall


# -- the gate -----------------------------------------------------------------------------------------------


def violations(docs: list[dict]) -> list[str]:
    """What the gate refuses: a policy faster than the oracle; pearl slower than static or elastic."""
    out = []
    for d in docs:
        for m in MISMATCHES:
            sps = {k: v["samples_per_s"] for k, v in d[m]["policies"].items()}
            where = f"{d['scenario']} ({d['steps']} steps, mismatch {m})"
            for name, x in sps.items():
                if name != "oracle" and x > sps["oracle"] * (1 + 1e-9):
                    out.append(f"{where}: {name} {x:.4f} samples/s beats the oracle's {sps['oracle']:.4f}")
            for base in ("static", "elastic"):
                if sps["pearl"] < sps[base] * (1 - 1e-9):
                    out.append(f"{where}: pearl {sps['pearl']:.4f} samples/s is below {base}'s {sps[base]:.4f}")
    return out


def documented() -> dict | None:
    """The numbers docs/simulator-results.md holds (its machine-readable block), or None."""
    if not DOCS.is_file():
        return None
    m = _BLOCK.search(DOCS.read_text())
    return json.loads(m.group(1)) if m else None


def stale(docs: list[dict]) -> list[str]:
    """Where docs/simulator-results.md no longer holds what this run measured."""
    held = documented()
    if held is None:
        return [f"{DOCS.relative_to(REPO)} has no results block: rerun with --write-docs"]
    out = []
    fresh = _numbers(docs)["scenarios"]
    for name, f in fresh.items():
        h = held.get("scenarios", {}).get(name)
        if h is None or h.get("steps") != f["steps"]:
            out.append(f"{name}: not documented at {f['steps']} steps")
            continue
        for m in MISMATCHES:
            for key, x in f[m]["ratios"].items():
                y = h.get(m, {}).get("ratios", {}).get(key)
                if y is None or abs(x - y) > DOCS_TOLERANCE * max(abs(y), 1e-9):
                    out.append(f"{name}, mismatch {m}: {key} is {x:.4f}, documented {y}")
    if out:
        out.append(f"{DOCS.relative_to(REPO)} is stale: rerun tests/benchmarks/bench_simulate.py --write-docs")
    return out


# -- tables ---------------------------------------------------------------------------------------------------


def _numbers(docs: list[dict]) -> dict:
    return {
        "scenarios": {
            d["scenario"]: {
                "steps": d["steps"],
                **{
                    m: {
                        "samples_per_s": {k: v["samples_per_s"] for k, v in d[m]["policies"].items()},
                        "ratios": d[m]["ratios"],
                        "predictor_ratio": d[m]["policies"]["pearl"]["predictor"]["ratio"],
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


def _x(r: float) -> str:
    return f"{r:.2f}×"


def table(docs: list[dict]) -> str:
    lines = [
        "| scenario | pearl/static | pearl/elastic | pearl/oracle | static/oracle | elastic/oracle "
        "| pearl with/without correction | pearl with/without a first wait |",
        "|" + "---|" * 8,
    ]
    for d in docs:

        def pair(key: str, fmt, d=d) -> str:
            return " · ".join(fmt(d[m]["ratios"][key]) for m in MISMATCHES)

        lines.append(
            f"| {d['scenario']} ({d['steps']} {d['training']} steps) "
            f"| {pair('pearl/static', _x)} | {pair('pearl/elastic', _x)} | {pair('pearl/oracle', '{:.3f}'.format)} "
            f"| {pair('static/oracle', '{:.3f}'.format)} | {pair('elastic/oracle', '{:.3f}'.format)} "
            f"| {pair(f'pearl/{UNCORRECTED}', '{:.3f}'.format)} | {pair(f'pearl/{NO_FIRST_WAIT}', '{:.3f}'.format)} |"
        )
    lines += [
        "",
        "Each cell: no mismatch · the measured mismatch. Ratios are of samples per second (trajectories trained per "
        "simulated second); the last two columns are pearl against pearl without the predictor's correction, and "
        "against pearl whose trainer reports no expected wait before its first measured one (no --first-wait-s: "
        "the scenario's [training] first_wait_s unset).",
        "",
        "| scenario | mismatch | static | elastic | pearl | pearl, no correction | pearl, no first wait | oracle "
        "| pearl's learned correction (batches) |",
        "|" + "---|" * 9,
    ]
    for d in docs:
        for m in MISMATCHES:
            p = d[m]["policies"]
            learned = _learned(p["pearl"]["predictor"])
            lines.append(
                f"| {d['scenario']} | {m} "
                + "".join(f"| {p[k]['samples_per_s']:.3f} " for k in ("static", "elastic", "pearl", *VARIANTS))
                + f"| {p['oracle']['samples_per_s']:.3f} | {learned} |"
            )
    lines += [
        "",
        "Samples per second. The learned correction is measured / predicted over the batches the predictor "
        "checked (pearlctl.planner.correct: the overall ratio at the end of the run, and how many batches); "
        "batch rollout s: each batch from its launch to its last trajectory.",
        "",
        "| scenario | mismatch | policy | steps/h | transitions | forced returns | trainer delay s | GPU-h serving "
        "| GPU-h idle (incl. trainer waiting) | GPU-h in transition | recompute Mtok | learned correction (batches) "
        "| batch rollout s |",
        "|" + "---|" * 13,
    ]
    for d in docs:
        for m in MISMATCHES:
            for name, p in d[m]["policies"].items():
                by = p["gpu_seconds_by_role"]
                serving = sum(by[k] for k in ("ROLLOUT", "PREFILL", "DECODE")) / 3600
                idle = (by["IDLE"] + by["TRAIN_IDLE"]) / 3600
                lines.append(
                    f"| {d['scenario']} | {m} | {name} | {p['steps_per_hour']:.2f} | {p['transitions']} "
                    f"| {p['forced_returns']} | {p['trainer_delay_s']:.0f} | {serving:.1f} | {idle:.1f} "
                    f"| {by['TRANSITION'] / 3600:.2f} | {p['engine']['recompute_tokens'] / 1e6:.0f} "
                    f"| {_learned(p['predictor'])} | {' '.join(f'{x:.0f}' for x in p['batch_rollout_s'])} |"
                )
    return "\n".join(lines)


def commit() -> str:
    """The commit the numbers were measured at, and whether tracked files differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            # the results file itself (rewritten by every --write-docs) does not make the tree dirty
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{DOCS.relative_to(REPO)}"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def write_docs(docs: list[dict], cmd: str, wall: float, verdict: list[str]) -> None:
    numbers = {"commit": commit(), "command": cmd, **_numbers(docs)}
    m = sc.MEASURED_BIAS, sc.MEASURED_SPREAD
    if verdict:
        gate = "FAILED:\n\n" + "\n".join(f"- {v}" for v in verdict)
    else:
        gate = "passed: no policy beats the oracle, and pearl is never below static or elastic, on any scenario at "
        gate += "either mismatch."
    text = (
        "# Simulator results\n\n"
        f"Made by `{cmd}` at commit {numbers['commit']} ({wall:.0f} s on this machine). Do not edit by hand: rerun "
        "the command; `--check` (the gate) fails when these numbers no longer hold.\n"
        "How to read it, the model mismatch and why the numbers differ from the published ones: docs/simulator.md.\n\n"
        f"Mismatch: `none` — the engines run the planner's own profile; `measured` — decode, prefill, tool calls "
        f"and transitions each take {m[0]}× what the profile and workload say, with a per-request spread "
        f"(log-sd {m[1]}), from the predictor's error against real runs (docs/planner.md).\n\n"
        f"{table(docs)}\n\nGate (`--check`): {gate}\n\n{REFERENCES}\n\n"
        f"<!-- results\n{json.dumps(numbers, indent=1, sort_keys=True)}\n-->\n"
    )
    DOCS.write_text(text)
    print(f"wrote {DOCS.relative_to(REPO)}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's step count")
    ap.add_argument("--check", action="store_true", help="the gate: exit 1 on a violation or stale docs")
    ap.add_argument("--write-docs", action="store_true", help="write docs/simulator-results.md")
    ap.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    ap.add_argument(
        "--router",
        choices=ROUTERS,
        default=DEFAULT_ROUTER,
        help="the engines' router model (docs/simulator.md); --write-docs writes only the default's table",
    )
    ap.add_argument(
        "--first-wait-s",
        default=None,
        metavar="S|none",
        help="override every scenario's [training] first_wait_s (the trainer's --first-wait-s); none: unknown",
    )
    args = ap.parse_args()
    first_wait = sc.KEEP
    if args.first_wait_s is not None:
        first_wait = None if args.first_wait_s == "none" else float(args.first_wait_s)
    full = not args.scenarios and args.steps is None and args.router == DEFAULT_ROUTER and first_wait is sc.KEEP
    if args.write_docs and not full:
        ap.error("--write-docs documents every shipped scenario as it is (steps, first wait) with the default router")
    paths = args.scenarios or sorted((REPO / "examples/scenarios").glob("*.toml"))
    docs, wall = run(paths, args.steps, args.router, args.jobs, first_wait)
    print(table(docs))
    print()
    print(REFERENCES)
    verdict = violations(docs)
    if args.write_docs:
        cmd = "python tests/benchmarks/bench_simulate.py --write-docs"
        write_docs(docs, cmd, wall, verdict)
    if not args.check:
        return 0
    if full:
        verdict += stale(docs)
    print()
    for v in verdict:
        print(f"GATE: {v}")
    print(f"GATE: {'FAILED' if verdict else 'passed'} ({wall:.0f} s)")
    return 1 if verdict else 0


if __name__ == "__main__":
    sys.exit(main())
