#!/usr/bin/env python3
"""The reference rollout driver: multi-turn agentic episodes with a calculator tool, through the run's
rollout workers (pearlctl.router.client), scored by a rule, written as GRPO batches for train.py.

An episode: the user asks "a + b ="; the policy answers (turn 1); the environment runs the calculator
tool — with a real latency (``--tool-latency-s``, exponential with that mean), during which the episode
does not decode — and returns the tool result; the policy answers again (turn 2). The reward is 1 if
the final answer contains the right sum, partial credit for matching digits (train.sum_reward).

Each step writes ``OUT/step-NNNNNN.jsonl`` (groups: prompt, completions, rewards, and per completion
the worker and weight version that produced it) by rename, and reports progress to the daemon
(queued / generating / tool_wait / done, tokens). Run next to train.py with ``--rollouts file:OUT``.

A failed turn never loses the step: the client retries it on other workers, with back-off, for up to
``--retry-for-s`` (and continues a turn a draining worker aborted). A step is written whole or not at
all: an episode that still cannot complete within that bound stops the driver with a ``rollout step
failed`` line and exit status 1, never a short batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import sum_reward  # noqa: E402  (the same rule the synthetic source uses)

from pearlctl.router.client import JOIN_WAIT_S, RolloutClient, TurnFailed  # noqa: E402


def chat(turns: list[tuple[str, str]]) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n"


def episode(client: RolloutClient, session: str, a: int, b: int, args, rng: random.Random, remaining) -> dict:
    prompt = f"{a} + {b} ="
    turns = [("user", prompt)]
    first = client.complete(session, chat(turns), max_tokens=args.max_tokens, stop=["<|im_end|>"])
    remaining.turn(session, first.tokens)
    turns.append(("assistant", first.text))
    client.count("tool_wait")
    latency = args.tool_latency_s
    if args.tool_latency_dist == "exp" and latency > 0:
        latency = rng.expovariate(1.0 / latency)
    time.sleep(latency)  # the tool call: this episode does not decode meanwhile
    client.count("tool_wait", -1)
    turns.append(("tool", f"calc({a},{b}) = {a + b}"))
    second = client.complete(session, chat(turns), max_tokens=args.max_tokens, stop=["<|im_end|>"])
    remaining.turn(session, second.tokens)
    completion = first.text + "\n" + second.text
    return {
        "prompt": prompt,
        "completion": completion,
        "reward": sum_reward(prompt, completion),
        "worker": second.worker,
        "weight_version": second.weight_version,
        "retries": first.retries + second.retries,
        "tokens": first.tokens + second.tokens,
    }


TURNS = 2  # an episode: answer, tool call, answer


class Remaining:
    """The remaining work of the current step, as the planner's Work fields (pearlctl.planner.model.Work):
    turns left per unfinished episode, tokens per turn seen so far, the tool's latency law."""

    def __init__(self, args):
        self.args, self.lock = args, threading.Lock()
        self.turns_done: dict[str, int] = {}
        self.tokens: list[int] = []
        self.prompt_chars: list[int] = []

    def start(self, sessions: list[str]) -> None:
        with self.lock:
            self.turns_done = dict.fromkeys(sessions, 0)

    def turn(self, session: str, tokens: int) -> None:
        with self.lock:
            self.turns_done[session] += 1
            self.tokens.append(tokens)

    def finish(self, session: str) -> None:
        with self.lock:
            self.turns_done.pop(session, None)

    def work(self) -> dict:
        with self.lock:
            left = [TURNS - d for d in self.turns_done.values()]
            recent = self.tokens[-200:]
        mean_tokens = sum(recent) / len(recent) if recent else float(self.args.max_tokens)
        latency = self.args.tool_latency_s
        tail = latency * 4.6 if self.args.tool_latency_dist == "exp" else latency  # p99 of the law
        return {
            "trajectories": len(left),
            "turns_left": sum(left) / len(left) if left else 0.0,
            "turns_left_max": float(max(left, default=0)),
            "decode_tokens_per_turn": mean_tokens,
            "decode_tokens_per_turn_max": float(self.args.max_tokens),
            "prefill_tokens_per_turn": 16.0,  # the question, then the tool's answer: a few words each
            "context_tokens": 16.0 + mean_tokens * (TURNS - (sum(left) / len(left) if left else 0)),
            "tool_latency_s": latency * (TURNS - 1) / TURNS,  # no tool call after the last answer
            "tool_latency_max_s": tail,
        }


class StepFailed(Exception):
    """An episode of the step could not complete: the step is not written."""


def run_step(client: RolloutClient, step: int, args, pool: ThreadPoolExecutor, remaining: Remaining) -> list[dict]:
    """Every episode of the step, grouped by prompt; `StepFailed` as soon as one episode fails (its turn
    exhausted the client's retry bound), with the episodes not started yet cancelled."""
    rng = random.Random(args.seed * 100_003 + step)
    problems = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(args.prompts)]
    client.count("queued", args.prompts * args.group_size)
    remaining.start([f"s{step}-p{p}-g{g}" for p in range(args.prompts) for g in range(args.group_size)])
    futures = []
    for p, (a, b) in enumerate(problems):
        for g in range(args.group_size):
            seed = rng.random()  # drawn here, in order: the step's tool latencies do not depend on threads

            def job(a=a, b=b, p=p, g=g, seed=seed):
                client.count("queued", -1)
                session = f"s{step}-p{p}-g{g}"
                try:
                    result = episode(client, session, a, b, args, random.Random(seed), remaining)
                except TurnFailed as exc:
                    raise StepFailed(f"step {step}: episode {session} failed: {exc}") from exc
                remaining.finish(session)
                client.count("done")
                return p, result

            futures.append(pool.submit(job))
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
    if failed is not None:
        for f in pending:
            f.cancel()  # episodes not started yet; those running end within the client's retry bound
        exc = failed.exception()
        if isinstance(exc, StepFailed):
            raise exc
        raise StepFailed(f"step {step}: an episode failed: {exc!r}") from exc
    groups: dict[int, list[dict]] = {}
    for f in futures:
        p, result = f.result()
        groups.setdefault(p, []).append(result)
    if sorted(groups) != list(range(args.prompts)) or any(len(e) != args.group_size for e in groups.values()):
        raise StepFailed(f"step {step}: incomplete batch {[len(e) for _, e in sorted(groups.items())]}")
    return [
        {
            "prompt": eps[0]["prompt"],
            "completions": [e["completion"] for e in eps],
            "rewards": [e["reward"] for e in eps],
            "served_by": [{"worker": e["worker"], "weight_version": e["weight_version"]} for e in eps],
        }
        for _, eps in sorted(groups.items())
    ]


def wait_for_weights(client: RolloutClient, version: str, timeout_s: float) -> None:
    """Synchronous (on-policy) RL: step N's rollouts use the weights of step N-1 on every worker."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = client.workers(force=True)
        if workers and all(w.get("weight_version") == version for w in workers):
            return
        time.sleep(0.2)
    print(json.dumps({"event": "weights not synced in time", "version": version}), flush=True)


def wait_for_workers(client: RolloutClient, version: str | None, timeout_s: float, join_wait_s: float) -> None:
    """Before a step's launch: the workers hold the previous step's weights (``version``; None: off-policy,
    no wait), then — while workers are joining (lent trainer GPUs, a started or woken worker: the daemon's
    ``joining``) — wait for them, at most ``join_wait_s``: a worker that joins after the launch gets sessions
    only at their next turns, so the step's first turns would all queue at the workers serving now. Workers
    that joined meanwhile are waited on for the weights too."""
    if version is not None:
        wait_for_weights(client, version, timeout_s)
    if client.wait_for_joining(join_wait_s) > 0 and version is not None:
        wait_for_weights(client, version, timeout_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default=os.environ.get("PEARL_RUN_DIR"), help="the run directory (.pearl/)")
    ap.add_argument("--run-id", default=os.environ.get("PEARL_RUN_ID"))
    ap.add_argument("--out", required=True, type=Path, help="where step-NNNNNN.jsonl batches go")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--first-step", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tool-latency-s", type=float, default=0.3, help="mean latency of one tool call")
    ap.add_argument("--tool-latency-dist", choices=("exp", "fixed"), default="exp")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--off-policy",
        dest="on_policy",
        action="store_false",
        help="do not wait for the workers to serve the previous step's weights",
    )
    ap.add_argument("--weights-timeout-s", type=float, default=180.0)
    ap.add_argument(
        "--join-wait-s",
        type=float,
        default=JOIN_WAIT_S,
        help="how long a step's launch waits at most for workers that are joining (lent, started, woken) "
        f"to serve, so that its first turns go to them too; 0: launch at once (default {JOIN_WAIT_S:g})",
    )
    ap.add_argument(
        "--retry-for-s",
        type=float,
        default=600.0,
        help="how long one turn is retried on other workers (with back-off) before the driver fails",
    )
    args = ap.parse_args(argv)
    if not args.run_dir or not args.run_id:
        ap.error("--run-dir and --run-id (or PEARL_RUN_DIR / PEARL_RUN_ID) are required")
    args.out.mkdir(parents=True, exist_ok=True)
    client = RolloutClient(args.run_dir, args.run_id, retry_for_s=args.retry_for_s)
    stop = threading.Event()

    remaining = Remaining(args)

    def progress():
        while not stop.wait(1.0):
            client.report_progress(work=remaining.work())

    threading.Thread(target=progress, daemon=True).start()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for step in range(args.first_step, args.first_step + args.steps):
            version = str(step - 1) if args.on_policy and step > 1 else None
            wait_for_workers(client, version, args.weights_timeout_s, args.join_wait_s)
            t0 = time.monotonic()
            try:
                groups = run_step(client, step, args, pool, remaining)
            except StepFailed as exc:
                print(json.dumps({"event": "rollout step failed", "step": step, "error": str(exc)}), flush=True)
                sys.stderr.flush()
                # nothing of this step was written; exit now rather than wait for the step's other
                # episodes, which may retry for up to --retry-for-s more (a pool's threads are joined at exit)
                os._exit(1)
            tmp = args.out / f".step-{step:06d}.jsonl.tmp"
            tmp.write_text("".join(json.dumps(g) + "\n" for g in groups))
            tmp.rename(args.out / f"step-{step:06d}.jsonl")
            client.report_progress(step, work=remaining.work())
            rewards = [r for g in groups for r in g["rewards"]]
            versions = sorted({s["weight_version"] or "?" for g in groups for s in g["served_by"]})
            print(
                json.dumps(
                    {
                        "event": "rollout step",
                        "step": step,
                        "seconds": round(time.monotonic() - t0, 3),
                        "reward_mean": round(sum(rewards) / len(rewards), 4),
                        "tokens": client.counts["tokens"],
                        "weight_versions": versions,
                    }
                ),
                flush=True,
            )
    stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
