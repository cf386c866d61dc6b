#!/usr/bin/env python3
"""Benchmark: the `pivot` policy's decision against pearl's on bench_planner's 4,096-GPU snapshots, with 27 rollout
GPUs judging and 20,000 trajectories waiting for a verdict (a judge's queue at scale), and the process's peak memory.
Not a test: it prints medians (7 repetitions) side by side.

    python tests/benchmarks/bench_pivot.py
"""

from __future__ import annotations

import resource
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from bench_planner import big_snapshot, timings  # noqa: E402

from pearlctl.planner.model import Judging, Role  # noqa: E402
from pearlctl.policies import load_policy  # noqa: E402


def main() -> int:
    pearl, pivot = load_policy("pearl"), load_policy("pivot")
    for tail in (True, False):
        s = big_snapshot(long_tail=tail)
        s = replace(s, profile=replace(s.profile, gpus_per_worker=1))  # pivot moves single-GPU workers only
        gpus = tuple(
            replace(g, role=Role.REWARD) if g.pool == "rollout" and g.role == Role.ROLLOUT and g.id % 64 == 0 else g
            for g in s.gpus
        )
        s = replace(s, gpus=gpus, judging=Judging(waiting=20_000, judging=512, done=50_000, verdicts_per_s=300.0))
        judges = sum(g.role == Role.REWARD for g in s.gpus)
        for name, policy in (("pearl", pearl), ("pivot", pivot)):
            med, p90, cpu = timings(lambda policy=policy, s=s: policy.decide(s), 7)
            print(f"long tail {tail}, {judges} judges: {name} median {med:.1f} ms, p90 {p90:.1f} ms, CPU {cpu:.1f} ms")
        planned = pivot.decide(s)
        print(f"  pivot's plan: {planned.why if planned else None} ({len(planned.moves) if planned else 0} moves)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
