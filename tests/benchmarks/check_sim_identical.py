"""Check that a change to the simulator leaves what it simulates unchanged: every shipped scenario at both
mismatches on its own seed, under static, elastic, pearl and the oracle (as tests/benchmarks/bench_simulate.py's
``_task`` runs them), with every simulation's raw numbers (each oracle candidate's too, unrounded).

    .venv/bin/python tests/benchmarks/check_sim_identical.py --save FILE [--steps N] [SCENARIO ...]     # baseline
    .venv/bin/python tests/benchmarks/check_sim_identical.py --compare FILE [--steps N] [SCENARIO ...]  # after

``--compare`` prints the largest relative difference of any number and every key where one differs (exit 1 when
any does), and the CPU seconds per scenario and policy against the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.sim import report  # noqa: E402
from pearlctl.sim import run as sim_run  # noqa: E402
from pearlctl.sim import scenario as sc  # noqa: E402
from pearlctl.sim.oracle import run_oracle  # noqa: E402

MISMATCHES = {"none": sc.NO_MISMATCH, "measured": sc.MEASURED}
_runs: list[dict] = []  # every simulation's raw result, in the order they ran


def _raw(r: sim_run.RunResult) -> dict:
    return {
        "sim_time_s": r.sim_time_s,
        "steps": r.steps,
        "trainer_delay_s": r.trainer_delay_s,
        "transitions": r.transitions,
        "batch_rollout_s": r.batch_rollout_s,
        "engine": r.engine,
        "gpu_seconds_by_role": r.gpu_seconds_by_role,
        "predictor_ratio": r.predictor_ratio,
    }


def _recording(run):
    def wrapped(self):
        r = run(self)
        _runs.append(_raw(r))
        return r

    return wrapped


sim_run.Sim.run = _recording(sim_run.Sim.run)


def task(path: Path, mismatch: str, steps: int | None) -> dict:
    s = sc.load(path).with_overrides(mismatch=MISMATCHES[mismatch], steps=steps)
    draws, trace = sim_run.make_draws(s), sim_run.make_trace(s)
    cpu, runs = {}, {}
    for p in ("static", "elastic", "pearl"):
        t0 = time.process_time()
        runs[p] = sim_run.run_policy(s, p, draws=draws, trace=trace, record_schedule=p == "pearl")
        cpu[p] = time.process_time() - t0
    t0 = time.process_time()
    runs["oracle"] = run_oracle(s, draws=draws, trace=trace, schedules={"pearl": runs["pearl"].schedule})
    cpu["oracle"] = time.process_time() - t0
    for r in runs.values():
        r.schedule = None
    raw = list(_runs)
    _runs.clear()
    return {"doc": report.to_json(s, runs), "raw": raw, "cpu": cpu}


def _numbers(x, key=""):
    """Every leaf of a JSON document, keyed by its path."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{key}/{k}")
    elif isinstance(x, list):
        for k, v in enumerate(x):
            yield from _numbers(v, f"{key}[{k}]")
    else:
        yield key, x


def compare(a: dict, b: dict) -> tuple[float, list[str]]:
    """The largest relative difference of any number, and the keys that differ (or exist in one only)."""
    la, lb = dict(_numbers(a)), dict(_numbers(b))
    diff = sorted(set(la) ^ set(lb))
    worst = 0.0
    for k in la.keys() & lb.keys():
        x, y = la[k], lb[k]
        if x == y:
            continue
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
            rel = abs(x - y) / max(abs(x), abs(y))
            worst = max(worst, rel)
            diff.append(f"{k}: {x!r} vs {y!r} (rel {rel:.2e})")
        else:
            diff.append(f"{k}: {x!r} vs {y!r}")
    return worst, diff


def main() -> int:
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--compare", type=Path)
    ap.add_argument("--steps", type=int, help="every scenario at this step count (a quicker, partial check)")
    ap.add_argument("scenarios", nargs="*")
    args = ap.parse_args()
    paths = sorted((REPO / "examples/scenarios").glob("*.toml"))
    if args.scenarios:
        paths = [p for p in paths if p.stem in args.scenarios]
    base = json.loads(args.compare.read_text()) if args.compare else None
    out, worst, bad = {}, 0.0, 0
    for p in paths:
        for m in MISMATCHES:
            key = f"{p.stem}/{m}"
            res = task(p, m, args.steps)
            out[key] = res
            cpu = " ".join(f"{k} {v:.2f}" for k, v in res["cpu"].items())
            if base is None:
                print(f"{key}: cpu {cpu}", flush=True)
                continue
            was = base[key]
            w, diff = compare({"doc": was["doc"], "raw": was["raw"]}, {"doc": res["doc"], "raw": res["raw"]})
            worst = max(worst, w)
            bad += bool(diff)
            ratio = " ".join(
                f"{k} {was['cpu'][k]:.2f}->{v:.2f} ({v / was['cpu'][k]:.2f})" for k, v in res["cpu"].items()
            )
            print(f"{key}: {'IDENTICAL' if not diff else f'DIFFERS (max rel {w:.2e})'}; cpu {ratio}", flush=True)
            for d in diff[:20]:
                print(f"    {d}")
    if args.save:
        args.save.write_text(json.dumps(out, indent=1))
        return 0
    total = {k: sum(r["cpu"][k] for r in out.values()) for k in ("static", "elastic", "pearl", "oracle")}
    was = {k: sum(base[key]["cpu"][k] for key in out) for k in total}
    print("total cpu " + " ".join(f"{k} {was[k]:.1f}->{v:.1f}" for k, v in total.items()))
    print(f"{len(out) - bad} of {len(out)} tasks identical; max relative difference {worst:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
