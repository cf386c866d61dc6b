"""Benchmark: every shipped scenario under static, elastic, pearl and the oracle, side by side in one run.

Not a timed test: it prints a markdown table (samples/s per policy, ratios, pearl/oracle, transitions,
trainer delay) next to the published references, and with ``--write-docs`` writes it to
docs/simulator-results.md together with the command that made it.

    .venv/bin/python tests/benchmarks/bench_simulate.py [--write-docs] [--steps N] [--router R] [SCENARIO ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.sim import report  # noqa: E402
from pearlctl.sim import scenario as sc  # noqa: E402
from pearlctl.sim.engine import DEFAULT_ROUTER, ROUTERS  # noqa: E402
from pearlctl.sim.run import compare  # noqa: E402

POLICIES = ["static", "elastic", "pearl", "oracle"]
REFERENCES = (
    "Published references (design.md §1; the PEARL paper itself was not available, docs/sources.md §7): PEARL "
    "2.17–2.79× the throughput of fixed-resource ROLL (compare pearl/static) and +26.9% (Qwen3-8B) / +36.3% "
    "(Qwen3-30B-A3B) over the elastic RLBoost+ baseline (compare pearl/elastic: 1.27× / 1.36×)."
)


def run(paths: list[Path], steps: int | None, router: str = DEFAULT_ROUTER) -> tuple[list[dict], float]:
    docs = []
    t0 = time.monotonic()
    for path in paths:
        s = sc.load(path).with_overrides(steps=steps)
        t1 = time.monotonic()
        doc = report.to_json(s, compare(s, POLICIES, router=router))
        doc["wall_s"] = round(time.monotonic() - t1, 1)
        docs.append(doc)
        print(f"{s.name}: {doc['wall_s']} s", file=sys.stderr)
    return docs, time.monotonic() - t0


def table(docs: list[dict]) -> str:
    head = (
        "| scenario | static | elastic | pearl | oracle | pearl/static | pearl/elastic | pearl/oracle "
        "| transitions (pearl) | trainer delay s (pearl) |"
    )
    lines = [head, "|" + "---|" * 10]
    for d in docs:
        p, r = d["policies"], d["ratios"]
        lines.append(
            f"| {d['scenario']} ({d['steps']} {d['training']} steps) "
            + "".join(f"| {p[n]['samples_per_s']:.3f} " for n in POLICIES)
            + f"| {r['pearl/static']:.2f}× | {r['pearl/elastic']:.2f}× | {r['pearl/oracle']:.3f} "
            + f"| {p['pearl']['transitions']} | {p['pearl']['trainer_delay_s']:.0f} |"
        )
    lines.append("")
    lines.append("Samples per second (trajectories trained per simulated second); ratios are of samples/s.")
    lines.append("")
    lines.append(
        "| scenario | policy | steps/h | transitions | forced returns | trainer delay s | GPU-h serving "
        "| GPU-h idle (incl. trainer waiting) | GPU-h in transition | recompute Mtok |"
    )
    lines.append("|" + "---|" * 10)
    for d in docs:
        for name, p in d["policies"].items():
            by = p["gpu_seconds_by_role"]
            serving = sum(by[k] for k in ("ROLLOUT", "PREFILL", "DECODE")) / 3600
            idle = (by["IDLE"] + by["TRAIN_IDLE"]) / 3600
            lines.append(
                f"| {d['scenario']} | {name} | {p['steps_per_hour']:.2f} | {p['transitions']} | {p['forced_returns']} "
                f"| {p['trainer_delay_s']:.0f} | {serving:.1f} | {idle:.1f} | {by['TRANSITION'] / 3600:.2f} "
                f"| {p['engine']['recompute_tokens'] / 1e6:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="override every scenario's step count")
    ap.add_argument("--write-docs", action="store_true", help="write docs/simulator-results.md")
    ap.add_argument(
        "--router",
        choices=ROUTERS,
        default=DEFAULT_ROUTER,
        help="the engines' router model (docs/simulator.md); --write-docs writes only the default's table",
    )
    args = ap.parse_args()
    if args.write_docs and args.router != DEFAULT_ROUTER:
        ap.error("--write-docs documents the default router model: drop --router")
    paths = args.scenarios or sorted((REPO / "examples/scenarios").glob("*.toml"))
    docs, wall = run(paths, args.steps, args.router)
    body = table(docs)
    print(body)
    print()
    print(REFERENCES)
    if args.write_docs:
        cmd = "python tests/benchmarks/bench_simulate.py --write-docs" + (
            f" --steps {args.steps}" if args.steps else ""
        )
        text = (
            "# Simulator results\n\n"
            f"Made by `{cmd}` ({wall:.0f} s on this machine). Do not edit by hand: rerun the command.\n"
            "How to read it, and why the numbers differ from the published ones: docs/simulator.md.\n\n"
            f"{body}\n\n{REFERENCES}\n"
        )
        (REPO / "docs/simulator-results.md").write_text(text)
        print("wrote docs/simulator-results.md", file=sys.stderr)


if __name__ == "__main__":
    main()
