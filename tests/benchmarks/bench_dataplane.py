#!/usr/bin/env python3
"""Benchmark: the data plane's cost and its continuity under churn — the gateway (pearlctl.router) and a real
vllm-router in front of fake, instant OpenAI workers. Not a test: it prints a table that docs/benchmarks.md
keeps ("Data plane").

Workers are small ASGI apps in their own processes (``--serve-fake PORT``): ``/v1/completions`` with
deterministic greedy "decoding" (the next token is a function of the whole sequence so far, so a
continuation from token ids must reproduce an uninterrupted run exactly), ``return_token_ids``, streaming,
``/abort_requests`` (in-flight requests end with ``finish_reason: "abort"`` and their partial output, as
vLLM's do), ``/health`` and ``/v1/models``.

1. **Latency.** Sequential requests, interleaved round by round: straight to a worker, through vllm-router
   alone, through gateway + router. Printed: p50/p99 per path and what router and gateway add.
2. **Churn.** Concurrent requests (half streamed) through the gateway while workers leave and join: every
   ``--churn-every-s`` one member is removed (every second removal also aborts what runs on it, as an
   agent's drain does), and comes back a moment later; one more worker joins mid-run. Printed: requests
   sent, completed, lost (a non-200 answer, a broken stream or token ids that differ from the expected
   run), and how many were continued.

    python tests/benchmarks/bench_dataplane.py [--requests 400] [--churn-s 20] [--workers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VOCAB = 256


def next_token(seq: list[int]) -> int:
    """The fake model: greedy, a function of the whole sequence (its last token and its length)."""
    return (seq[-1] * 31 + len(seq) * 7 + 3) % VOCAB if seq else 1


def expected_tokens(prompt_ids: list[int], n: int) -> list[int]:
    seq = list(prompt_ids)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt_ids) :]


def tokenize(prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return list(str(prompt).encode())


def detok(t: int) -> str:
    return chr(33 + t % 90)


# -- the fake worker ----------------------------------------------------------------------------------
def fake_worker_app(name: str, token_delay_s: float):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    inflight: set[asyncio.Event] = set()

    async def health(request: Request):
        return JSONResponse({})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def abort(request: Request):
        n = len(inflight)
        for ev in list(inflight):
            ev.set()
        return JSONResponse({"aborted": n})

    async def completions(request: Request):
        body = await request.json()
        prompt_ids = tokenize(body.get("prompt", ""))
        max_tokens = int(body.get("max_tokens") or 16)
        want_ids = bool(body.get("return_token_ids"))
        stream = bool(body.get("stream"))
        stop = asyncio.Event()
        inflight.add(stop)
        seq = list(prompt_ids)
        rid = f"cmpl-{name}-{random.getrandbits(32):x}"
        created = int(time.time())

        def choice(ids: list[int], finish, first: bool) -> dict:
            c = {"index": 0, "text": "".join(detok(t) for t in ids), "logprobs": None, "finish_reason": finish}
            if want_ids:
                c["token_ids"] = ids
                if first:
                    c["prompt_token_ids"] = prompt_ids
            return c

        async def generate():
            for _ in range(max_tokens):
                if stop.is_set():
                    return
                if token_delay_s:
                    await asyncio.sleep(token_delay_s)
                if stop.is_set():
                    return
                t = next_token(seq)
                seq.append(t)
                yield t

        if not stream:
            try:
                out = [t async for t in generate()]
            finally:
                inflight.discard(stop)
            finish = "abort" if len(out) < max_tokens else "length"
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            doc = {"id": rid, "object": "text_completion", "created": created, "model": "fake"}
            return JSONResponse({**doc, "choices": [choice(out, finish, True)], "usage": usage})

        async def events():
            n, first = 0, True
            try:
                async for t in generate():
                    n += 1
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": "fake"}
                    chunk["choices"] = [choice([t], None, first)]
                    first = False
                    yield f"data: {json.dumps(chunk)}\n\n"
                finish = "abort" if n < max_tokens else "length"
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": "fake"}
                chunk["choices"] = [choice([], finish, first)]
                yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                inflight.discard(stop)

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/abort_requests", abort, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


def serve_fake(port: int, token_delay_s: float) -> None:
    import uvicorn

    uvicorn.run(
        fake_worker_app(str(port), token_delay_s), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeWorker:
    def __init__(self, token_delay_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve-fake", str(self.port), "--token-delay-s", str(token_delay_s)],
            start_new_session=True,
        )

    def wait(self) -> None:
        import httpx

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"fake worker {self.url} did not start")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


# -- measurements -------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def latency(record, key: str, worker_url: str, n: int) -> dict[str, list[float]]:
    import httpx

    body = {"model": "fake", "prompt": "latency probe", "max_tokens": 8, "return_token_ids": True}
    paths = {
        "worker (direct)": (worker_url + "/v1/completions", {}),
        "vllm-router": (record.router_url + "/v1/completions", {"X-Session-ID": "lat"}),
        "gateway + vllm-router": (
            record.base_url + "/completions",
            {"Authorization": f"Bearer {key}", "X-Session-ID": "lat"},
        ),
    }
    out: dict[str, list[float]] = {p: [] for p in paths}
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(20):  # warm connections
            for url, headers in paths.values():
                (await http.post(url, json=body, headers=headers)).raise_for_status()
        for _ in range(n):
            for name, (url, headers) in paths.items():
                t0 = time.perf_counter()
                resp = await http.post(url, json=body, headers=headers)
                dt = time.perf_counter() - t0
                resp.raise_for_status()
                out[name].append(dt * 1000)
    return out


async def churn(record, key: str, workers: list[FakeWorker], spare: FakeWorker, args) -> dict:
    import httpx

    from pearlctl.router.membership import RouterMembership

    headers = {"Authorization": f"Bearer {key}"}
    stats = {"sent": 0, "completed": 0, "lost": 0, "continued": 0, "continuations": 0, "streamed": 0}
    errors: list[str] = []
    stop_at = time.monotonic() + args.churn_s
    members = RouterMembership(record.url, key)
    events: list[str] = []

    async def client(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(timeout=60) as http:
            while time.monotonic() < stop_at:
                prompt = f"episode {i} turn {stats['sent']}"
                n = rng.randint(16, args.max_tokens)
                stream = rng.random() < 0.5
                body = {"model": "fake", "prompt": prompt, "max_tokens": n, "return_token_ids": True, "stream": stream}
                want = expected_tokens(tokenize(prompt), n)
                h = {**headers, "X-Session-ID": f"s{i}"}
                stats["sent"] += 1
                try:
                    if stream:
                        stats["streamed"] += 1
                        got, pearl, done = [], {}, False
                        async with http.stream("POST", record.base_url + "/completions", json=body, headers=h) as r:
                            if r.status_code != 200:
                                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                            async for line in r.aiter_lines():
                                if not line.startswith("data:"):
                                    continue
                                data = line[5:].strip()
                                if data == "[DONE]":
                                    done = True
                                    break
                                obj = json.loads(data)
                                if "error" in obj:
                                    raise RuntimeError(f"error event: {obj['error']}")
                                for c in obj.get("choices", []):
                                    got.extend(c.get("token_ids") or [])
                                pearl = obj.get("pearl") or pearl
                        if not done:
                            raise RuntimeError("stream ended without [DONE]")
                    else:
                        r = await http.post(record.base_url + "/completions", json=body, headers=h)
                        if r.status_code != 200:
                            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                        doc = r.json()
                        got, pearl = doc["choices"][0]["token_ids"], doc.get("pearl") or {}
                    if got != want:
                        raise RuntimeError(f"token ids differ: {len(got)} got vs {len(want)} expected")
                    stats["completed"] += 1
                    if pearl.get("continued"):
                        stats["continued"] += 1
                        stats["continuations"] += pearl["continued"]
                except Exception as exc:  # a lost request: counted and shown, never raised
                    stats["lost"] += 1
                    errors.append(f"{type(exc).__name__}: {exc}")

    async def churner() -> None:
        rng = random.Random(7)
        k = 0
        joined = False
        await asyncio.sleep(args.churn_every_s)
        while time.monotonic() < stop_at - 2:
            w = rng.choice(workers)
            abort = k % 2 == 1
            await asyncio.to_thread(members.remove, w.url)
            if abort:
                async with httpx.AsyncClient(timeout=5) as http:
                    aborted = (await http.post(w.url + "/abort_requests")).json()["aborted"]
                events.append(f"leave+abort({aborted})")
            else:
                events.append("leave")
            await asyncio.sleep(0.5)
            await asyncio.to_thread(members.add, w.url, "1")
            events.append("join")
            if not joined and time.monotonic() > stop_at - args.churn_s / 2:
                await asyncio.to_thread(members.add, spare.url, "1")
                events.append("join(new)")
                joined = True
            k += 1
            await asyncio.sleep(args.churn_every_s)

    await asyncio.gather(churner(), *(client(i) for i in range(args.concurrency)))
    members.close()
    stats["events"] = events
    stats["errors"] = errors[:10]
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--token-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=400, help="latency: requests per path")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--churn-s", type=float, default=20.0)
    ap.add_argument("--churn-every-s", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--churn-token-delay-s", type=float, default=0.01, help="fake decode time per token in churn")
    args = ap.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, args.token_delay_s)
        return 0

    from pearlctl.router import service
    from pearlctl.router.membership import RouterMembership

    run_dir = Path(tempfile.mkdtemp(prefix="pearl-bench-dataplane-"))
    key = service.ensure_key(run_dir)
    fast = [FakeWorker(0.0) for _ in range(args.workers)]
    slow = [FakeWorker(args.churn_token_delay_s) for _ in range(args.workers + 1)]
    record = None
    try:
        for w in fast + slow:
            w.wait()
        record = service.start(run_dir, "127.0.0.1", 0, retry_for_s=30.0)
        print(f"gateway {record.url} (pid {record.pid}), vllm-router {record.router_url}", flush=True)
        with RouterMembership(record.url, key) as members:
            members.sync({w.url: "1" for w in fast})
        lat = asyncio.run(latency(record, key, fast[0].url, args.requests))
        with RouterMembership(record.url, key) as members:
            members.sync({w.url: "1" for w in slow[:-1]})
        t0 = time.monotonic()
        ch = asyncio.run(churn(record, key, slow[:-1], slow[-1], args))
        churn_s = time.monotonic() - t0
    finally:
        if record is not None:
            service.stop(record, run_dir=run_dir)
        for w in fast + slow:
            w.stop()
        shutil.rmtree(run_dir, ignore_errors=True)

    direct = lat["worker (direct)"]
    d50, d99 = pct(direct, 0.5), pct(direct, 0.99)
    print(f"\nLatency: {args.requests} sequential requests per path (8 tokens, instant workers), interleaved\n")
    print("| path | p50 | p99 | added p50 | added p99 | p50 / direct |")
    print("|---|---|---|---|---|---|")
    for name, values in lat.items():
        p50, p99 = pct(values, 0.5), pct(values, 0.99)
        added = "—" if values is direct else f"+{p50 - d50:.2f} ms"
        added99 = "—" if values is direct else f"+{p99 - d99:.2f} ms"
        print(f"| {name} | {p50:.2f} ms | {p99:.2f} ms | {added} | {added99} | {p50 / d50:.2f}× |")
    r50 = pct(lat["vllm-router"], 0.5)
    g50 = pct(lat["gateway + vllm-router"], 0.5)
    print(f"\ngateway alone (gateway+router − router), p50: +{g50 - r50:.2f} ms")
    print(
        f"\nChurn: {churn_s:.1f} s, {args.concurrency} concurrent clients, {args.workers} workers "
        f"({args.churn_token_delay_s * 1000:g} ms/token, 16–{args.max_tokens} tokens), half streamed\n"
    )
    print("| sent | completed | lost | continued (requests) | continuations | streamed | leaves / aborting leaves |")
    print("|---|---|---|---|---|---|---|")
    leaves = sum(1 for e in ch["events"] if e.startswith("leave"))
    aborting = sum(1 for e in ch["events"] if e.startswith("leave+abort"))
    print(
        f"| {ch['sent']} | {ch['completed']} | {ch['lost']} | {ch['continued']} | {ch['continuations']} | "
        f"{ch['streamed']} | {leaves} / {aborting} |"
    )
    print(f"\nmembership events: {' '.join(ch['events'])}")
    if ch["errors"]:
        print("lost requests (first 10):\n  " + "\n  ".join(ch["errors"]))
    print(
        json.dumps(
            {
                "latency_ms": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in lat.items()},
                "churn": {k: v for k, v in ch.items() if k != "errors"},
                "median_direct_ms": statistics.median(direct),
            }
        )
    )
    return 0 if ch["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
