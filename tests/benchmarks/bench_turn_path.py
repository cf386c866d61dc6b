#!/usr/bin/env python3
"""Benchmark: where a turn's time goes on its way from a rollout's threads to a paced engine and back.

One paced engine (pearlctl/agent/engines/paced.py, ``--profile``) and the run's gateway in front of it
(``python -m pearlctl.router``, which runs vllm-router as its child), all on loopback. A wave of ``--turns``
concurrent turns (prompts of ``--prompt`` token ids, ``--tokens`` generated, each on a thread of its own and
a session of its own, as a rollout's episodes are) is sent three ways, one after the other. For each way it
prints side by side the mean seconds of a turn as the sender measured it, as the gateway measured it
(``/pearl/stats``: arrival to answer) and as the engine measured it (``vllm:e2e_request_latency_seconds``:
arrival to last token):

- ``direct``: httpx straight to the engine, one client shared by every thread;
- ``gateway``: `RolloutClient` (pearlctl.router.client) through the gateway and vllm-router, as a rollout sends;
- ``gateway, one pool``: the same with one httpx client of httpx's default limits passed in (``http=``), as
  `RolloutClient` was before it kept several pools.

A path that adds nothing reads the same three means; the difference between the sender's and the gateway's is
the sender's own queueing, between the gateway's and the engine's vllm-router's and the loopback's.

    python tests/benchmarks/bench_turn_path.py [--turns 584] [--tokens 300] [--prompt 6000]
        [--profile PROFILE]

The default profile is bursty-elastic-8b's sped up 5 times (bench_live.py's until it ran at 4x). The machine is
shared and noisy: read the differences within a row.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.planner import profile as profiles  # noqa: E402
from pearlctl.router.client import RolloutClient  # noqa: E402
from pearlctl.sim import scale  # noqa: E402
from pearlctl.sim import scenario as sc  # noqa: E402

PY = sys.executable
KEY = "k" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, headers: dict | None = None, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


def engine_seconds(engine: str) -> tuple[float, float]:
    text = httpx.get(engine + "/metrics", timeout=30).text
    total = float(re.search(r"^vllm:e2e_request_latency_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^vllm:e2e_request_latency_seconds_count (\S+)", text, re.M).group(1))
    return total, count


def gateway_seconds(gateway: str) -> float:
    stats = httpx.get(gateway + "/pearl/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    return float(stats["seconds"]["turns"])


def wave(n: int, send: Callable[[int], None]) -> list[float]:
    took = [0.0] * n

    def one(i: int) -> None:
        t = time.monotonic()
        send(i)
        took[i] = time.monotonic() - t

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=584, help="turns in flight at once (one thread each)")
    ap.add_argument("--tokens", type=int, default=300, help="tokens each turn generates")
    ap.add_argument("--prompt", type=int, default=6000, help="token ids in each prompt")
    ap.add_argument("--profile", type=Path, default=None, help="default: bench_live.py's (bursty-elastic-8b, 5x)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pearl-turn-path-"))
    profile_file = args.profile
    if profile_file is None:
        base = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml")
        profile_file = work / "profile.toml"
        profile_file.write_text(profiles.dumps(scale.scaled(base, gpus=64, speedup=5.0).profile))
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], log: str, env: dict | None = None) -> None:
        out = (work / log).open("w")
        procs.append(subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env))

    ep, gp = free_port(), free_port()
    engine, gateway = f"http://127.0.0.1:{ep}", f"http://127.0.0.1:{gp}"
    try:
        start([PY, "-m", "pearlctl.agent.engines.paced", "--model", "m", "--profile", str(profile_file),
               "--port", str(ep), "--max-model-len", "65536"], "engine.log")  # fmt: skip
        wait_for(engine + "/health")
        (work / "run" / ".pearl").mkdir(parents=True)
        (work / "key").write_text(KEY)
        start([PY, "-m", "pearlctl.router", "--run-dir", str(work / "run"), "--host", "127.0.0.1",
               "--port", str(gp), "--key-file", str(work / "key"), "--worker", engine, "--log-level", "warning"],
              "gateway.log")  # fmt: skip
        wait_for(gateway + "/v1/models", {"Authorization": f"Bearer {KEY}"})
        end = time.monotonic() + 60
        while httpx.get(gateway + "/pearl/stats", headers={"Authorization": f"Bearer {KEY}"}).json()["members"] < 1:
            if time.monotonic() > end:
                raise SystemExit("the gateway did not take the engine as a member within 60 s")
            time.sleep(0.2)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(100, 2000, args.prompt).tolist() for _ in range(args.turns)]
        body = {"model": "m", "max_tokens": args.tokens, "ignore_eos": True, "return_token_ids": True}
        direct = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=None))
        pooled = RolloutClient(base_url=gateway + "/v1", api_key=KEY, model="m")
        single = RolloutClient(base_url=gateway + "/v1", api_key=KEY, model="m", http=httpx.Client(timeout=600))
        ways: dict[str, Callable[[int], None]] = {
            "direct": lambda i: direct.post(engine + "/v1/completions", json={**body, "prompt": prompts[i]}),
            "gateway": lambda i: pooled.complete(f"s{i}", prompts[i], max_tokens=args.tokens,
                                                 extra={"ignore_eos": True}),
            "gateway, one pool": lambda i: single.complete(f"s{i}", prompts[i], max_tokens=args.tokens,
                                                           extra={"ignore_eos": True}),
        }  # fmt: skip
        print(f"{args.turns} turns at once, {args.prompt}-token prompts, {args.tokens} tokens each; mean seconds")
        print("| path | sender | gateway | engine | sender − engine |")
        print("|---|---:|---:|---:|---:|")
        for name, send in ways.items():
            (e0, n0), g0 = engine_seconds(engine), gateway_seconds(gateway)
            took = wave(args.turns, send)
            (e1, n1), g1 = engine_seconds(engine), gateway_seconds(gateway)
            sender, eng = float(np.mean(took)), (e1 - e0) / max(n1 - n0, 1)
            gw = (g1 - g0) / args.turns if name != "direct" else float("nan")
            print(f"| {name} | {sender:.2f} | {gw:.2f} | {eng:.2f} | {sender - eng:.2f} |", flush=True)
        for c in (direct, pooled, single):
            c.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RUST_LOG", "warn")
    sys.exit(main())
