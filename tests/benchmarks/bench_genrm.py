"""Benchmark: the shipped GenRM scenarios (examples/scenarios/genrm/: a judge beside the policy) under the fixed
split (``static``: the scenario's own pools), the best fixed split (``disaggregated``, pearlctl/sim/compare.py),
``pearl`` (moves no GPU to the judge) and ``pivot`` (pearlctl/policies/shipped/pivot.py), at no mismatch and at the
measured one, on ``--seeds`` seeds (the scenario's own and the next ones). Prints one table of samples per second
(mean over the seeds) with pivot's ratios, and with ``--write-docs`` writes it to docs/simulator-genrm.md.

Not a gate yet: the oracle and the ``colocated`` baseline of a run with a judge are not built (docs/simulator.md,
"The judge"). ``--check`` exits 1 when a run did not train all its steps or judged a trajectory other than once.

    python tests/benchmarks/bench_genrm.py [--seeds 3] [--write-docs] [--check]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.sim import scenario as sc  # noqa: E402
from pearlctl.sim.compare import compare  # noqa: E402

POLICIES = ["disaggregated", "static", "pearl", "pivot"]
MISMATCHES = {"none": sc.NO_MISMATCH, "measured": sc.MEASURED}
DOCS = REPO / "docs/simulator-genrm.md"


def run(path: Path, seeds: int) -> list[dict]:
    base = sc.load(path)
    out = []
    for label, mismatch in MISMATCHES.items():
        per_seed = []
        for k in range(seeds):
            s = base.with_overrides(mismatch=mismatch, seed=base.seed + k)
            per_seed.append(compare(s, POLICIES, workers=2))
        out.append({"scenario": base.name, "mismatch": label, "steps": base.steps, "runs": per_seed})
    return out


def problems(rows: list[dict]) -> list[str]:
    """Runs that did not train all their steps, or whose verdicts are not one per trajectory trained."""
    out = []
    for row in rows:
        for runs in row["runs"]:
            for name, r in runs.items():
                verdicts = r.judge.get("verdicts", 0)
                if not r.finished or verdicts != r.samples:
                    out.append(f"{row['scenario']} ({row['mismatch']}) {name}: finished {r.finished}, "
                               f"{r.samples} trained, {verdicts:.0f} judged")  # fmt: skip
    return out


def table(rows: list[dict]) -> str:
    head = "| scenario | mismatch | " + " | ".join(POLICIES) + " | pivot/disaggregated | pivot/static | pivot/pearl |"
    head += " best split (first seed) | pivot's moves (first seed) |"
    lines = [head, "|" + "---|" * (len(POLICIES) + 7)]
    for row in rows:
        mean = {p: statistics.fmean(runs[p].samples_per_s for runs in row["runs"]) for p in POLICIES}
        first = row["runs"][0]
        cells = [f"{mean[p]:.3f}" for p in POLICIES]
        ratios = [f"{mean['pivot'] / mean[p]:.2f}" for p in ("disaggregated", "static", "pearl")]
        what = [first["disaggregated"].chosen or "", str(first["pivot"].transitions)]
        lines.append(f"| {row['scenario']} | {row['mismatch']} | " + " | ".join(cells + ratios + what) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    t0 = time.monotonic()
    rows = [row for path in sorted((REPO / "examples/scenarios/genrm").glob("*.toml")) for row in run(path, args.seeds)]
    text = table(rows)
    print(text)
    bad = problems(rows)
    for line in bad:
        print(f"CHECK: {line}")
    took = time.monotonic() - t0
    print(f"{len(rows)} scenario-mismatch rows, {args.seeds} seed(s) each, in {took:.0f} s")
    if args.write_docs:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
        command = "python tests/benchmarks/bench_genrm.py --write-docs" + (
            f" --seeds {args.seeds}" if args.seeds != 3 else ""
        )
        DOCS.write_text(
            "# Simulator results with a judge (GenRM)\n\n"
            f"Made by `{command}` at commit {commit.stdout.strip() or 'unknown'} ({took:.0f} s on this machine). Do "
            'not edit by hand: rerun the command. How to read it: docs/simulator.md, "The judge".\n\n'
            f"Samples per second (trajectories trained per simulated second), the mean over {args.seeds} seed(s) "
            "(the scenario's own and the next ones); ratios of those means.\n\n" + text + "\n"
        )
        print(f"wrote {DOCS.relative_to(REPO)}")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
