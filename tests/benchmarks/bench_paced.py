#!/usr/bin/env python3
"""Benchmark: how many paced engines (pearlctl/agent/engines/paced.py) this machine holds, and whether they keep
their profile's time when many run at once.

For each count K (``--servers``) it starts K paced engines as the agent does (`PacedServer`, one process each) on
a profile (``--profile``, the start cost set to 1 s), sends each of them one wave of B concurrent requests of T
tokens (``--batch``, ``--tokens``; prompts of P tokens, ``--prompt``) from one asyncio client, and prints, side by
side per K:

- the model time of one request: prefill of the wave's B prompts plus T iterations of ``itl(B, context)``, what one
  worker of that profile takes (and the least an answer can take: a busy machine delays, never speeds);
- the engines' own mean latency (arrival to last token, their ``vllm:e2e_request_latency_seconds``) over the model
  time: how far the paced engines fall behind their profile at that count;
- the latency the client measured (median and max), and its ratio to the model time: the engines' and the
  client's own cost together (one asyncio httpx client sends every request);
- the servers' CPU (user + system seconds of their processes, from /proc, over the wave) per wall second, the
  start-up's CPU seconds, and their resident memory.

    python tests/benchmarks/bench_paced.py [--servers 8,32,64] [--batch 16] [--tokens 256] [--prompt 512]
        [--profile examples/profiles/qwen3-8b-h100.toml]

The machine is shared and noisy: read the ratios. Nothing here is a target yet; docs/paced.md quotes a run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.agent.engines.vllm import PacedServer  # noqa: E402
from pearlctl.agent.workers import free_port  # noqa: E402
from pearlctl.planner import profile as profiles  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except OSError:
            continue
    return total * PAGE / 2**20


async def wave(urls: list[str], batch: int, tokens: int, prompt: int) -> list[float]:
    limits = httpx.Limits(max_connections=len(urls) * batch + 8, max_keepalive_connections=len(urls) * batch + 8)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        # the bodies are made before the wave, so the client's CPU goes to sending them
        bodies = [
            json.dumps(
                {"model": "m", "prompt": [(i * 7919 + k) % 50000 + 1 for k in range(prompt)], "max_tokens": tokens}
            )
            for i in range(batch)
        ]
        headers = {"content-type": "application/json"}

        async def one(url: str, i: int) -> float:
            t0 = time.monotonic()
            r = await client.post(url + "/v1/completions", content=bodies[i], headers=headers)
            r.raise_for_status()
            assert r.json()["usage"]["completion_tokens"] == tokens
            return time.monotonic() - t0

        return await asyncio.gather(*(one(u, i) for u in urls for i in range(batch)))


def run(count: int, prof: profiles.Profile, path: Path, args: argparse.Namespace, logs: Path) -> dict:
    servers = [
        PacedServer(
            "m",
            profile=path,
            port=free_port(),
            role="ROLLOUT",
            gpus=[],
            engine_args={"max_model_len": args.prompt + args.tokens + 8},
            log_path=logs / f"paced-{count}-{i}.log",
        )
        for i in range(count)
    ]
    t0 = time.monotonic()
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout=300)
        start_s = time.monotonic() - t0
        pids = [s.pid for s in servers]
        start_cpu = cpu_s(pids)
        cpu0, w0, c0 = cpu_s(pids), time.monotonic(), time.process_time()
        lat = asyncio.run(wave([s.url for s in servers], args.batch, args.tokens, args.prompt))
        wall = time.monotonic() - w0
        cpu = (cpu_s(pids) - cpu0) / wall
        client = (time.process_time() - c0) / wall
        served = [s.metrics() for s in servers]
        engine = sum(m["e2e_request_latency_seconds_sum"] for m in served) / sum(
            m["e2e_request_latency_seconds_count"] for m in served
        )
        rss = rss_mib(pids)
    finally:
        for s in servers:
            s.stop(timeout=10)
    context = args.prompt + args.tokens / 2
    model = args.batch * args.prompt / prof.prefill_tok_s + args.tokens * prof.decode.itl(args.batch, context)
    model += prof.request_overhead_s
    med, worst = statistics.median(lat), max(lat)
    return {"servers": count, "start_s": start_s, "start_cpu_s": start_cpu, "model_s": model, "median_s": med,
            "max_s": worst, "ratio_med": med / model, "ratio_max": worst / model, "engine_s": engine, "cpu_per_s": cpu,
            "client_per_s": client, "rss_mib": rss}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default="8,32,64")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--profile", type=Path, default=REPO / "examples/profiles/qwen3-8b-h100.toml")
    args = ap.parse_args(argv)
    prof = profiles.load(args.profile)
    prof = dataclasses.replace(prof, costs=dataclasses.replace(prof.costs, start_s=1.0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-paced-") as tmp:
        path = Path(tmp) / "profile.toml"
        path.write_text(profiles.dumps(prof))
        for count in (int(c) for c in args.servers.split(",")):
            rows.append(run(count, prof, path, args, Path(tmp)))
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"`python tests/benchmarks/bench_paced.py --servers {args.servers} --batch {args.batch} --tokens "
          f"{args.tokens} --prompt {args.prompt}`, profile {prof.name}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} at the end:\n")  # fmt: skip
    print("| servers | ready in | start CPU | model time | engines' mean latency / model "
          "| client's latency median, max | client's latency / model (median, max) "
          "| servers' CPU per second | client's CPU per second | servers' RSS |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['servers']} | {r['start_s']:.1f} s | {r['start_cpu_s']:.1f} s | {r['model_s']:.2f} s | "
              f"{r['engine_s'] / r['model_s']:.2f}x | "
              f"{r['median_s']:.2f}, {r['max_s']:.2f} s | {r['ratio_med']:.2f}x, {r['ratio_max']:.2f}x | "
              f"{r['cpu_per_s']:.2f} | {r['client_per_s']:.2f} | {r['rss_mib']:.0f} MiB |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
