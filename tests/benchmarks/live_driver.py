#!/usr/bin/env python3
"""The live benchmark's rollout driver: a scenario's own trajectories, sent through a run's gateway.

bench_live.py starts it next to a run on paced engines (docs/paced.md). It replays exactly the trajectories the
simulator draws for the same scaled scenario and seed (``pearlctl.sim.run.make_draws`` of
``pearlctl.sim.scale.scaled``): trajectory ``i`` of the run has the simulator's prompt length, turns, response
and tool-output lengths and tool latencies, and ends where the simulator's ends (its turns, or a full
context). It launches batches by the simulator's rule (``Sim._trainer``): synchronous — batch ``j`` once the
trainer has exported step ``j`` and every routable worker serves it, then the join wait; asynchronous — while
at most ``staleness`` batches are ahead of the trainer. Every trajectory of a batch starts at its launch, as
in the simulation.

Token ids, not text: a trajectory's prompt is ``P`` ids of its own (no two share a prefix, as no two share one
in the simulation), a turn asks for exactly its response length (``ignore_eos``), and the next turn's prompt is
the previous prompt, the ids the worker returned, and the tool's output ids.

Many trajectories at once: the episodes run on threads in ``--procs`` child processes, each with its own
``RolloutClient`` (pearlctl.router.client: the gateway continues and retries turns; the client retries what the
gateway could not). This process keeps every trajectory's state from their events, reports progress to the
daemon as examples/grpo/rollout.py does — the counts, and the remaining batch's ``Work`` computed as the
simulator computes it (``PolicyView.work``: the same distribution summaries and residual-turn table) — and
writes ``OUT/step-NNNNNN.jsonl`` (one line per group, its rewards) when a batch is whole, which is what the
paced trainer (pearlctl.trainer.paced) waits for.

Prints one JSON line at the end: trajectories expected and done, turns, tokens decoded, tokens recomputed
after continuations (the context re-prefilled on another worker), continued and retried turns, and per batch
its launch and end (unix seconds). A trajectory that fails (its turn exhausted the client's bound) fails the
driver: exit status 1 and a ``rollout failed`` line, never a short batch. With ``--trace FILE`` it also writes one
JSON line per trajectory: its start and end (unix seconds) and per turn when it was sent (seconds after the
start), its round trip, its tokens, the worker that finished it, and the tool latency asked for and slept.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pearlctl.sim import run as simrun  # noqa: E402
from pearlctl.sim import scale  # noqa: E402
from pearlctl.sim import scenario as sc  # noqa: E402
from pearlctl.sim.snapshot import residual_table  # noqa: E402

VOCAB_LO, VOCAB_HI = 100, 2000  # ids inside the tiny model's vocabulary (2,048), clear of its special tokens
PROGRESS_S = 0.2  # how often the daemon hears of progress (examples/grpo/rollout.py: 1 s on a run 1x fast)


def build_scenario(args: argparse.Namespace) -> sc.Scenario:
    """The scaled scenario bench_live.py simulates: the same arguments give the same trajectories."""
    base = sc.load(args.scenario)
    s = scale.scaled(
        base, gpus=args.gpus, speedup=args.speedup, control_interval_s=args.control_interval_s, notice_s=args.notice_s
    )
    return s.with_overrides(steps=args.steps, seed=args.seed, mismatch=sc.NO_MISMATCH)


def ids(seed: int, n: int) -> list[int]:
    """``n`` token ids of their own for ``seed`` (a trajectory's prompt, or one tool output)."""
    rng = np.random.default_rng([seed, n])
    return rng.integers(VOCAB_LO, VOCAB_HI, size=int(n)).tolist()


# -- the episodes, in a child process ------------------------------------------------------------------------
def child(run_dir: str, inbox: mp.Queue, outbox: mp.Queue, threads: int, traced: bool) -> None:
    from pearlctl.router.client import RolloutClient, TurnFailed

    client = RolloutClient(run_dir, retry_for_s=600.0)

    def episode(spec: dict) -> None:
        ep, cap = spec["ep"], spec["cap"]
        prompt = ids(spec["seed"], spec["prompt"])
        ctx = len(prompt)
        decoded = recomputed = continued = retried = turns = 0
        t0 = time.time()
        # per turn: sent (s after t0), its round trip (s), tokens, worker, tool asked, slept, and the gateway's span
        # (received and answered, s after the send) when it said
        trace: list[list] = []
        try:
            for k in range(spec["turns"]):
                if k > 0:
                    out = int(min(spec["tool_output"][k - 1], max(cap - ctx, 0)))
                    prompt = prompt + ids(spec["seed"] * 1_000 + k, out) if out else prompt
                    ctx = len(prompt)
                left = int(min(spec["response"][k], cap - ctx))
                if left < 1:
                    break
                outbox.put(("turn", ep, ctx))
                sent = time.time()
                c = client.complete(f"t{ep}", prompt, max_tokens=left, temperature=1.0, extra={"ignore_eos": True})
                took = time.time() - sent
                span = [round(t - sent, 4) for t in c.gateway_span] if c.gateway_span else None
                trace.append([round(sent - t0, 4), round(took, 4), c.tokens, c.worker, 0.0, 0.0, span])
                turns += 1
                decoded += c.tokens
                continued += 1 if c.continued else 0
                retried += c.retries
                before = 0
                for part in c.parts[:-1]:  # each continuation re-prefills the context as it was then
                    before += int(part.get("tokens") or 0)
                    recomputed += ctx + before
                prompt = (c.prompt_token_ids or prompt) + c.token_ids
                ctx = len(prompt)
                if k + 1 >= spec["turns"] or ctx >= cap - 1:
                    break
                outbox.put(("tool", ep, k + 1, ctx, c.tokens))
                slept = time.time()
                time.sleep(float(spec["tool_latency"][k]))
                trace[-1][4:6] = [round(float(spec["tool_latency"][k]), 4), round(time.time() - slept, 4)]
            if traced:
                outbox.put(
                    ("trace", ep, {"ep": ep, "start": round(t0, 4), "end": round(time.time(), 4), "turns": trace})
                )
            outbox.put(("done", ep, turns, decoded, recomputed, continued, retried))
        except TurnFailed as exc:
            outbox.put(("failed", ep, str(exc)))
        except Exception as exc:  # a bug here must fail the driver, not hang it
            outbox.put(("failed", ep, f"{type(exc).__name__}: {exc}"))

    with ThreadPoolExecutor(threads) as pool:
        # every thread made before the first batch (the pool makes one per task it cannot hand to an idle one: a
        # batch's episodes would otherwise wait for hundreds of thread starts) ...
        for _ in range(threads):
            pool.submit(time.sleep, 0.2)
        # ... and a batch's episodes come as one message: one read of the queue instead of one per episode, each
        # of which waits for the interpreter lock behind the episodes already started
        while (specs := inbox.get()) is not None:
            for spec in specs:
                pool.submit(episode, spec)


# -- the coordinator -------------------------------------------------------------------------------------------
class Trajectories:
    """Every trajectory in flight as its events tell it (turns done, phase, context), the counts the daemon is
    told, and the remaining batch as the simulator sees it (``PolicyView.work``)."""

    def __init__(self, s: sc.Scenario):
        wl = s.workload
        self.turns_p99 = wl.turns.summary()[1]
        self.resp_mean, self.resp_p99 = wl.response_tokens.summary()
        self.tool_out_mean, _ = wl.tool_output_tokens.summary()
        self.lat_mean, self.lat_p99 = wl.tool_latency_s.summary()
        self.residual = residual_table(wl.turns)
        self.state: dict[int, list] = {}  # ep -> [turns done, phase ("queued" | "generating" | "tool_wait"), context]
        self.tokens: dict[int, int] = {}  # ep -> tokens counted so far
        self.done = 0
        self.decoded = 0
        self.lock = threading.Lock()

    def launch(self, eps: range, prompts: np.ndarray) -> None:
        with self.lock:
            for i in eps:
                self.state[i] = [0, "queued", float(prompts[i])]
                self.tokens[i] = 0

    def event(self, event: tuple) -> tuple | None:
        """Fold one child's event in; returns a finished trajectory's totals (``done``), else None."""
        kind, ep = event[0], event[1]
        with self.lock:
            row = self.state.get(ep)
            if row is None:
                return None
            if kind == "turn":
                row[1], row[2] = "generating", float(event[2])
            elif kind == "tool":
                row[0], row[1], row[2] = event[2], "tool_wait", float(event[3])
                self.tokens[ep] += event[4]
                self.decoded += event[4]
            elif kind == "done":
                del self.state[ep]
                self.decoded += event[3] - self.tokens.pop(ep)
                self.done += 1
                return event[2:]
        return None

    def counts(self) -> dict[str, int]:
        with self.lock:
            out = {"queued": 0, "generating": 0, "tool_wait": 0}
            for row in self.state.values():
                out[row[1]] += 1
            return {**out, "done": self.done, "tokens": self.decoded}

    def work(self) -> dict | None:
        with self.lock:
            rows = [list(r) for r in self.state.values()]
        if not rows:
            return None
        done = np.array([r[0] for r in rows])
        left = self.residual[np.minimum(done, len(self.residual) - 1)]
        return {
            "trajectories": float(len(rows)),
            "tool_waiting": float(sum(1 for r in rows if r[1] == "tool_wait")),
            "turns_left": float(left.mean()),
            "turns_left_max": float(max(self.turns_p99 - done.min(), 1.0)),
            "decode_tokens_per_turn": self.resp_mean,
            "decode_tokens_per_turn_max": self.resp_p99,
            "prefill_tokens_per_turn": self.tool_out_mean,
            "context_tokens": float(np.mean([r[2] for r in rows])),
            "tool_latency_s": self.lat_mean,
            "tool_latency_max_s": self.lat_p99,
        }


def trained(weights: Path) -> int:
    """The trainer's last exported step (its weights' LATEST), 0 before the first."""
    try:
        return int((weights / "LATEST").read_text().strip())
    except (OSError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True, type=Path)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--speedup", type=float, required=True)
    ap.add_argument("--control-interval-s", type=float, default=None)
    ap.add_argument("--notice-s", type=float, default=None)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True, type=Path, help="where step-NNNNNN.jsonl batches go")
    ap.add_argument("--weights", required=True, type=Path, help="the trainer's weights directory (its LATEST)")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--trace", type=Path, default=None, help="a JSON line per trajectory: its turns' timing")
    args = ap.parse_args(argv)

    from pearlctl.router.client import RolloutClient

    s = build_scenario(args)
    draws = simrun.make_draws(s)
    batch, cap = s.workload.batch_size, s.workload.max_context_tokens
    group = s.workload.group_size
    args.out.mkdir(parents=True, exist_ok=True)
    client = RolloutClient(args.run_dir, args.run_id)
    traj = Trajectories(s)

    ctx = mp.get_context("spawn")
    outbox: mp.Queue = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(args.procs)]
    per_proc = -(-batch * (1 + (s.training.staleness if s.training.mode == "async" else 0)) // args.procs)
    procs = [
        ctx.Process(target=child, args=(args.run_dir, q, outbox, per_proc + 8, args.trace is not None), daemon=True)
        for q in inboxes
    ]
    for p in procs:
        p.start()

    totals = {"turns": 0, "decoded": 0, "recomputed": 0, "continued": 0, "retried": 0}
    left_in_batch: dict[int, int] = {}
    batches: list[dict] = []
    failed: list[str] = []
    stop = threading.Event()

    def progress() -> None:
        told = dict.fromkeys(("queued", "generating", "tool_wait", "done", "tokens"), 0)
        while not stop.wait(PROGRESS_S):
            now = traj.counts()
            for key, value in now.items():
                client.count(key, value - told[key])
            told = now
            client.report_progress(sum(1 for b in batches if "ended_at" in b) or None, work=traj.work())

    def launch(j: int) -> None:
        eps = range(j * batch, (j + 1) * batch)
        traj.launch(eps, draws.prompt)
        left_in_batch[j] = batch
        batches.append({"step": j + 1, "launched_at": time.time()})
        specs: list[list[dict]] = [[] for _ in inboxes]
        for i in eps:
            t = int(draws.turns[i])
            specs[i % args.procs].append({
                "ep": i, "seed": s.seed * 10_000_019 + i, "cap": cap, "prompt": int(draws.prompt[i]), "turns": t,
                "response": draws.response[i, :t].tolist(), "tool_output": draws.tool_output[i, :t].tolist(),
                "tool_latency": draws.tool_latency[i, :t].tolist(),
            })  # fmt: skip
        for inbox, mine in zip(inboxes, specs, strict=True):
            inbox.put(mine)

    def finished(ep: int, result: tuple) -> None:
        for key, value in zip(totals, result, strict=True):
            totals[key] += value
        j = ep // batch
        left_in_batch[j] -= 1
        if left_in_batch[j]:
            return
        batches[j]["ended_at"] = time.time()
        lines = [json.dumps({"group": g, "rewards": [0.0] * group}) for g in range(s.workload.prompts_per_step)]
        tmp = args.out / f".step-{j + 1:06d}.jsonl.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, args.out / f"step-{j + 1:06d}.jsonl")

    threading.Thread(target=progress, daemon=True).start()
    traces = args.trace.open("w") if args.trace else None
    launched = 0
    steps = s.steps
    try:
        while sum(1 for b in batches if "ended_at" in b) < steps and not failed:
            if launched < steps and due(s, launched, trained(args.weights), client):
                client.wait_for_joining(s.training.join_wait_s)
                launch(launched)
                launched += 1
                continue
            try:
                event = outbox.get(timeout=0.05)
            except queue.Empty:
                continue
            while event is not None:
                if event[0] == "failed":
                    failed.append(f"trajectory {event[1]}: {event[2]}")
                elif event[0] == "trace":
                    traces.write(json.dumps(event[2]) + "\n")
                elif (result := traj.event(event)) is not None:
                    finished(event[1], result)
                try:
                    event = outbox.get_nowait()
                except queue.Empty:
                    event = None
    finally:
        stop.set()
        if traces:
            traces.close()
        for q in inboxes:
            q.put(None)
    client.report_progress(steps, work=None)
    out = {
        "expected": steps * batch,
        "completed": sum(batch - left for left in left_in_batch.values()),
        **totals,
        "batches": [{k: round(v, 3) if isinstance(v, float) else v for k, v in b.items()} for b in batches],
    }
    if failed:
        print(json.dumps({"event": "rollout failed", "error": failed[0], **out}), flush=True)
        for p in procs:  # episodes still running: the children go with the driver, not after it
            p.kill()
        os._exit(1)
    print(json.dumps({"event": "rollout done", **out}), flush=True)
    return 0


def due(s: sc.Scenario, launched: int, done_steps: int, client) -> bool:
    """Whether batch ``launched`` (0-based) may start, by the simulator's rule (``Sim._trainer``)."""
    if s.training.mode == "sync":
        return launched == done_steps and (launched == 0 or all_serve(client, str(launched)))
    return launched <= done_steps + s.training.staleness


_ASKED: list[float] = [0.0]


def all_serve(client, version: str) -> bool:
    """Every routable worker serves ``version`` (the daemon is asked at most every 0.2 s, as rollout.py does)."""
    if time.monotonic() - _ASKED[0] < 0.2:
        return False
    _ASKED[0] = time.monotonic()
    workers = client.workers(force=True)
    return bool(workers) and all(w.weight_version == version for w in workers)


if __name__ == "__main__":
    sys.exit(main())
