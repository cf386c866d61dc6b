#!/usr/bin/env python3
"""The reference rollout driver: multi-turn agentic episodes with a calculator tool, through the run's
rollout workers (pearlctl.router.client), scored by a rule, written as GRPO batches for train.py.

An episode: the user asks "a + b ="; the policy answers (turn 1); the environment runs the calculator
tool — with a real latency (``--tool-latency-s``, exponential with that mean), during which the episode
does not decode — and returns the tool result; the policy answers again (turn 2). The reward is 1 if
the final answer contains the right sum, partial credit for matching digits (train.sum_reward).

Token-level, without drift: every turn is sent to vLLM as TOKEN IDS, never as re-rendered text. The first
prompt is the ChatML user message tokenized once; the second turn's prompt is exactly the first prompt's
ids + the ids vLLM sampled in turn 1 + the tokenized tool message (ChatML markup included; a ``<|im_end|>``
first when turn 1 did not end with it). So the sequence the trainer trains on is the sequence the workers
sampled, token for token, with the logprob vLLM returned for each sampled token (``logprobs: 0``). Only the
environment's text (the user message, the tool's answer) is ever tokenized, by the model's tokenizer:
``--tokenizer``, else ``$PEARL_MODEL``, else the model directory the workers serve (``root`` in the
gateway's ``/v1/models``, a path on the shared filesystem). A turn whose answer lacks token ids or
logprobs, or whose echoed prompt ids differ from those sent, fails the episode (and so the step).

Each step writes ``OUT/step-NNNNNN.jsonl`` (token_batch.py; docs/rollout-batches.md): one GRPO group per
line — the prompt and rewards, per episode its trajectory (prompt ids, completion ids, loss mask, sampled
logprobs, per turn its span and weight version, per part of a continued turn the version that sampled it),
and for people the episode's text and the worker and weight version of its last turn (``served_by``) —
by rename, and reports progress to the daemon (queued / generating / tool_wait / done, tokens). Run next
to train.py with ``--rollouts file:OUT``.

``--reward judge`` scores each trajectory with the run's judge (the ``reward`` pool's model, a generative reward
model: pearlctl.router.judge) as soon as its episode finishes, while the step's other episodes run: a verdict
probability P(yes) (``--judge-mode verdict``, the default) or a critique with a parsed score (``critique``). The
batch's rewards are the verdicts, and each group records which judge scored each trajectory (``judged_by``: model,
worker, weight version). Each trajectory is judged once; a verdict that cannot be had (an unparseable critique
after its retries, a judge that does not answer within ``--retry-for-s``) fails the step, never scores it zero.
The judge queue (waiting, judging, done, failed) goes to the daemon with the progress. The rule (``--reward
rule``) stays the default.

A failed turn never loses the step: the client retries it on other workers, with back-off, for up to
``--retry-for-s`` (and continues a turn a draining worker aborted). A step is written whole or not at
all: an episode that still cannot complete within that bound stops the driver with a ``rollout step
failed`` line and exit status 1, never a short batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from token_batch import Group, Judged, Part, Sampled, trajectory_from_turns, turn_version, write_batch  # noqa: E402
from train import sum_reward  # noqa: E402  (the same rule the synthetic source uses)

from pearlctl.router.client import JOIN_WAIT_S, Completion, RolloutClient, TurnFailed  # noqa: E402
from pearlctl.router.judge import JudgeClient, JudgeError, Mode, Verdict  # noqa: E402

USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # ChatML, as the workers' chat template
TOOL = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"  # after the assistant's <|im_end|>
END = "<|im_end|>"


class BadTurn(Exception):
    """A turn's answer cannot be trained on as it is (no token ids, no logprobs, a prompt that drifted)."""


class Encoder:
    """The model's tokenizer, for the environment's text only (never for what the policy sampled). One call at
    a time: a fast tokenizer shared by the episode threads can refuse concurrent calls ("Already borrowed")."""

    def __init__(self, tokenizer):
        self.tok, self.lock = tokenizer, threading.Lock()
        end = tokenizer.convert_tokens_to_ids(END) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        unknown = getattr(tokenizer, "unk_token_id", None)  # what a tokenizer without <|im_end|> maps it to
        self.end_id = end if isinstance(end, int) and end != unknown else tokenizer.eos_token_id

    def __call__(self, text: str) -> list[int]:
        with self.lock:
            return [int(t) for t in self.tok(text, add_special_tokens=False)["input_ids"]]


def listed_models(client: RolloutClient, wait_s: float, at_least: int = 1, poll_s: float = 1.0) -> list[dict]:
    """The models the run's gateway lists (vLLM's ``/v1/models`` entries: the policy's first, then the judge's),
    asked until it lists ``at_least`` or ``wait_s`` has passed (the run's gateway or workers may still be
    starting): the last list it gave ([] if none)."""
    deadline, entries = time.monotonic() + wait_s, []
    while True:
        try:
            url, key = client.endpoint()
            resp = httpx.get(url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=30.0)
            if resp.status_code == 200:
                entries = [e for e in resp.json()["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]
                if len(entries) >= at_least:
                    return entries
        except Exception:  # noqa: BLE001 — no gateway record yet, no answer, an answer of another shape: ask again
            pass
        if time.monotonic() >= deadline:
            return entries
        time.sleep(poll_s)


def model_root(client: RolloutClient, wait_s: float) -> str | None:
    """The model directory the policy's workers serve, as vLLM's ``/v1/models`` says (``root``); None if the
    gateway never says within ``wait_s``."""
    listed = listed_models(client, wait_s)
    root = listed[0].get("root") if listed else None
    return root if isinstance(root, str) and root else None


def judge_model(args, client: RolloutClient) -> str:
    """``--judge-model``, else ``$PEARL_JUDGE_MODEL``, else the one model the gateway lists besides the policy's
    (the first), waiting for the judge's workers to serve; exits 2 saying so when that is not one model."""
    named = args.judge_model or os.environ.get("PEARL_JUDGE_MODEL")
    if named:
        return named
    models = [e["id"] for e in listed_models(client, args.weights_timeout_s, at_least=2)]
    if len(models) == 2:
        return models[1]
    print(
        json.dumps(
            {
                "event": "no judge",
                "listed": models,
                "hint": "--reward judge needs the run's judge: a [pools.reward] pool serving its model; pass "
                "--judge-model NAME (or set PEARL_JUDGE_MODEL) when the gateway lists other than the policy's "
                "model and one judge",
            }
        ),
        flush=True,
    )
    raise SystemExit(2)


def load_tokenizer(args, client: RolloutClient) -> Encoder:
    """``--tokenizer``, else ``$PEARL_MODEL``, else the served model's directory; exits 2 naming the three when
    none is a tokenizer this machine can load."""
    from transformers import AutoTokenizer

    tried = []
    for where in (args.tokenizer, os.environ.get("PEARL_MODEL"), None):
        if where is None and tried:
            continue
        path = where if where is not None else model_root(client, args.weights_timeout_s)
        if path is None:
            continue
        tried.append(path)
        try:
            return Encoder(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError) as exc:
            print(json.dumps({"event": "tokenizer not loaded", "path": path, "error": str(exc)[:300]}), flush=True)
    print(
        json.dumps(
            {
                "event": "no tokenizer",
                "tried": tried,
                "hint": "pass --tokenizer MODEL_DIR (or set PEARL_MODEL): the driver tokenizes the environment's "
                "text (user and tool messages) and sends every turn as token ids",
            }
        ),
        flush=True,
    )
    raise SystemExit(2)


def sample(
    client: RolloutClient, session: str, prompt_ids: list[int], max_tokens: int, end_id: int | None = None
) -> tuple[Completion, Sampled]:
    """One turn sent as token ids, with the sampled tokens' logprobs (``logprobs: 0``: the sampled token's
    only), ending at ``end_id`` (the sampled end token is part of the turn's ids, as any sampled token);
    `BadTurn` if the answer lacks ids or logprobs, or the worker saw other prompt ids than those sent."""
    extra: dict = {"logprobs": 0}
    if end_id is not None:
        extra["stop_token_ids"] = [end_id]
    c = client.complete(session, prompt_ids, max_tokens=max_tokens, extra=extra)
    if c.prompt_token_ids is not None and list(c.prompt_token_ids) != prompt_ids:
        raise BadTurn(
            f"session {session}: the worker saw {len(c.prompt_token_ids)} prompt ids, not the {len(prompt_ids)} sent"
        )
    if len(c.token_ids) != c.tokens:
        raise BadTurn(f"session {session}: {c.tokens} token(s) generated but {len(c.token_ids)} token id(s) returned")
    if c.logprobs is None or len(c.logprobs) != len(c.token_ids) or any(v is None for v in c.logprobs):
        got = "none" if c.logprobs is None else f"{sum(v is not None for v in c.logprobs)} of {len(c.token_ids)}"
        raise BadTurn(f"session {session}: logprobs of the sampled tokens: {got}")
    parts = tuple(Part(tokens=int(p.get("tokens") or 0), weight_version=p.get("weight_version")) for p in c.parts)
    version = turn_version(parts, c.weight_version)
    if parts and sum(p.tokens for p in parts) != len(c.token_ids):
        parts = ()  # the gateway's part counts do not add up: keep the turn's version (None if mixed), not the parts
    turn = Sampled(
        list(c.token_ids), [float(v) for v in c.logprobs if v is not None], version, parts, c.finish_reason, c.worker
    )
    return c, turn


def episode(
    client: RolloutClient, encode: Encoder, session: str, a: int, b: int, args, rng: random.Random, remaining
) -> dict:
    prompt = f"{a} + {b} ="
    prompt_ids = encode(USER.format(prompt))
    first, turn1 = sample(client, session, prompt_ids, args.max_tokens, encode.end_id)
    remaining.turn(session, first.tokens)
    client.count("tool_wait")
    latency = args.tool_latency_s
    if args.tool_latency_dist == "exp" and latency > 0:
        latency = rng.expovariate(1.0 / latency)
    called = time.monotonic()
    time.sleep(latency)  # the tool call: this episode does not decode meanwhile
    client.count("tool_wait", -1)
    remaining.tool(session, time.monotonic() - called)
    result = f"calc({a},{b}) = {a + b}"
    ended = bool(turn1.ids) and turn1.ids[-1] == encode.end_id
    tool_ids = encode(("" if ended else END) + TOOL.format(result))
    second, turn2 = sample(client, session, prompt_ids + turn1.ids + tool_ids, args.max_tokens, encode.end_id)
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
        "trajectory": trajectory_from_turns(prompt_ids, [turn1, tool_ids, turn2]),
    }


TURNS = 2  # an episode: answer, tool call, answer


class Remaining:
    """The remaining work of the current step, as the planner's Work fields (pearlctl.planner.model.Work):
    turns left per unfinished episode, tokens per turn seen so far, the tool's latency law.

    The planner's trajectories all run at once, each a closed loop (a turn, a tool call, the next turn). The
    driver runs at most ``--concurrency`` episodes at once and queues the others, so it reports its work as
    that many loops (``slots``), each running its share of the unfinished episodes one after another: their
    turns in sequence, and their tool calls spread over the gaps between those turns (an episode's last turn
    calls no tool, and the next episode starts at once); a tool call in progress counts as one left, since its
    slot waits for it. Reported as if every episode ran at once, a batch of 16 episodes 4 at a time was
    predicted a quarter of its length. With no queue (``--concurrency`` at least the episodes left) the
    slots are the episodes themselves, reported as they are.

    It also times the step's tool calls (``tools``), summed per loop — a thread of the step's pool runs one loop:
    its episodes one after another — so that the daemon's predictor correction can take the luck of the slowest
    loop's draws out of the step's measured time (pearlctl.planner.correct)."""

    def __init__(self, args):
        self.args, self.lock = args, threading.Lock()
        self.turns_done: dict[str, int] = {}
        self.tools_done: dict[str, int] = {}
        self.tokens: list[int] = []
        self.prompt_chars: list[int] = []
        self.tool_s: dict[int, float] = {}  # the step's tool seconds per loop (the pool's thread that runs it)

    def start(self, sessions: list[str]) -> None:
        with self.lock:
            self.turns_done = dict.fromkeys(sessions, 0)
            self.tools_done = dict.fromkeys(sessions, 0)
            self.tool_s = {}

    def turn(self, session: str, tokens: int) -> None:
        with self.lock:
            self.turns_done[session] += 1
            self.tokens.append(tokens)

    def tool(self, session: str, seconds: float) -> None:
        """The session's tool call returned after ``seconds`` (called on the thread that runs the session)."""
        loop = threading.get_ident()
        with self.lock:
            self.tools_done[session] = self.tools_done.get(session, 0) + 1
            self.tool_s[loop] = self.tool_s.get(loop, 0.0) + seconds

    def tools(self) -> dict | None:
        """The step's tool calls so far, as the daemon takes them (pearlctl.api.bodies.ToolTimes): the largest
        sum of tool seconds over its loops; None before a call returned."""
        with self.lock:
            return {"slowest_s": max(self.tool_s.values())} if self.tool_s else None

    def finish(self, session: str) -> None:
        with self.lock:
            self.turns_done.pop(session, None)
            self.tools_done.pop(session, None)

    def work(self) -> dict:
        with self.lock:
            left = [TURNS - d for d in self.turns_done.values()]
            # the tool calls not returned yet: after every turn of an episode but its last, those in progress too
            calls = sum(TURNS - 1 - self.tools_done.get(s, 0) for s in self.turns_done)
            recent = self.tokens[-200:]
        mean_tokens = sum(recent) / len(recent) if recent else float(self.args.max_tokens)
        latency = self.args.tool_latency_s
        tail = latency * 4.6 if self.args.tool_latency_dist == "exp" else latency  # p99 of the law
        concurrency = getattr(self.args, "concurrency", None)
        turns = sum(left)
        if concurrency and len(left) > concurrency:  # episodes queue: ``concurrency`` loops
            slots = concurrency
            spread = calls / (turns - slots)  # over the gaps the planner counts: after each turn of a loop but its last
        else:
            slots, spread = len(left), 1.0
        return {
            "trajectories": slots,
            "turns_left": turns / slots if slots else 0.0,
            "turns_left_max": float(max(max(left, default=0), math.ceil(turns / slots) if slots else 0)),
            "decode_tokens_per_turn": mean_tokens,
            "decode_tokens_per_turn_max": float(self.args.max_tokens),
            "prefill_tokens_per_turn": 16.0,  # the question, then the tool's answer: a few words each
            "context_tokens": 16.0 + mean_tokens * (TURNS - (sum(left) / len(left) if left else 0)),
            "tool_latency_s": latency * spread,  # of one call; none follows the last answer (the predictor knows)
            "tool_latency_max_s": tail * spread,
        }


class StepFailed(Exception):
    """An episode of the step could not complete, or its verdict could not be had: the step is not written."""


class Judging:
    """The step's verdicts: each trajectory is sent to the judge as soon as its episode finishes (``pool``: the
    judge's threads, beside the episodes'), and judged once."""

    def __init__(self, judge: JudgeClient, pool: ThreadPoolExecutor):
        self.judge, self.pool = judge, pool
        self.lock = threading.Lock()
        self.pending: dict[str, Future] = {}

    def submit(self, session: str, task: str, answer: str) -> None:
        with self.lock:
            if session in self.pending:  # an episode's trajectory is judged once
                raise StepFailed(f"trajectory {session} was sent to the judge twice")
            self.judge.enqueue()
            self.pending[session] = self.pool.submit(self.judge.score, session, task, answer)

    def collect(self, step: int) -> dict[str, Verdict]:
        """Every verdict of the step (waiting for those in flight), and nothing left for the next step;
        `StepFailed` naming the trajectory whose verdict could not be had."""
        with self.lock:
            pending, self.pending = self.pending, {}
        verdicts = {}
        for session, future in pending.items():
            try:
                verdicts[session] = future.result()
            except (JudgeError, TurnFailed) as exc:
                raise StepFailed(f"step {step}: the verdict on {session} failed: {exc}") from exc
        return verdicts


def run_step(
    client: RolloutClient,
    encode: Encoder,
    step: int,
    args,
    pool: ThreadPoolExecutor,
    remaining: Remaining,
    judging: Judging | None = None,
) -> list[Group]:
    """Every episode of the step, grouped by prompt; `StepFailed` as soon as one episode fails (its turn
    exhausted the client's retry bound), with the episodes not started yet cancelled. ``judging``: each
    finished episode is scored by the judge at once, and its verdict is its reward."""
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
                    result = episode(client, encode, session, a, b, args, random.Random(seed), remaining)
                except (TurnFailed, BadTurn) as exc:
                    raise StepFailed(f"step {step}: episode {session} failed: {exc}") from exc
                remaining.finish(session)
                client.count("done")
                if judging is not None:
                    judging.submit(session, result["prompt"], result["completion"])
                return p, session, result

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
    verdicts = judging.collect(step) if judging is not None else {}
    groups: dict[int, list[dict]] = {}
    for f in futures:
        p, session, result = f.result()
        if judging is not None:
            result["reward"], result["judged"] = verdicts[session].score, verdicts.pop(session).record()
        groups.setdefault(p, []).append(result)
    if verdicts:  # a verdict on no trajectory of this step
        raise StepFailed(f"step {step}: verdicts on trajectories the step has not: {sorted(verdicts)}")
    if sorted(groups) != list(range(args.prompts)) or any(len(e) != args.group_size for e in groups.values()):
        raise StepFailed(f"step {step}: incomplete batch {[len(e) for _, e in sorted(groups.items())]}")
    return [
        Group(
            prompt=eps[0]["prompt"],
            rewards=tuple(float(e["reward"]) for e in eps),
            trajectories=tuple(e["trajectory"] for e in eps),
            completions=tuple(e["completion"] for e in eps),
            served_by=tuple({"worker": e["worker"], "weight_version": e["weight_version"]} for e in eps),
            judged_by=tuple(Judged(**e["judged"]) for e in eps) if judging is not None else None,
        )
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
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="the model's tokenizer directory, for the environment's text (default: $PEARL_MODEL, else the "
        "model directory the workers serve, from the gateway's /v1/models)",
    )
    ap.add_argument(
        "--reward",
        choices=("rule", "judge"),
        default="rule",
        help="rule: the sum rule (train.sum_reward); judge: the run's judge scores each trajectory as it finishes",
    )
    ap.add_argument("--judge-model", default=None, help="the judge's model name (default: the one the gateway lists)")
    ap.add_argument("--judge-mode", choices=[str(m) for m in Mode], default=str(Mode.VERDICT))
    ap.add_argument("--judge-concurrency", type=int, default=4, help="verdicts asked for at once")
    ap.add_argument(
        "--judge-attempts", type=int, default=3, help="critique: answers asked for before an unreadable score fails"
    )
    ap.add_argument("--judge-max-tokens", type=int, default=64, help="critique: the most tokens a critique may take")
    ap.add_argument(
        "--judge-constrained",
        action="store_true",
        help="critique: a structured-output regex that makes every critique end in a score line",
    )
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
    encode = load_tokenizer(args, client)
    judge = None
    if args.reward == "judge":
        judge = JudgeClient(
            client,
            judge_model(args, client),
            mode=Mode(args.judge_mode),
            max_tokens=args.judge_max_tokens,
            attempts=args.judge_attempts,
            constrained=args.judge_constrained,
            seed=args.seed,
        )

    def queue() -> dict | None:
        return judge.queue.counts() if judge is not None else None

    def progress():
        while not stop.wait(1.0):
            client.report_progress(work=remaining.work(), judge=queue(), tools=remaining.tools())

    threading.Thread(target=progress, daemon=True).start()
    with ThreadPoolExecutor(args.concurrency) as pool, ThreadPoolExecutor(args.judge_concurrency) as judge_pool:
        judging = Judging(judge, judge_pool) if judge is not None else None
        for step in range(args.first_step, args.first_step + args.steps):
            version = str(step - 1) if args.on_policy and step > 1 else None
            wait_for_workers(client, version, args.weights_timeout_s, args.join_wait_s)
            t0, started_at = time.monotonic(), time.time()
            try:
                groups = run_step(client, encode, step, args, pool, remaining, judging)
            except StepFailed as exc:
                print(json.dumps({"event": "rollout step failed", "step": step, "error": str(exc)}), flush=True)
                sys.stderr.flush()
                # nothing of this step was written; exit now rather than wait for the step's other
                # episodes, which may retry for up to --retry-for-s more (a pool's threads are joined at exit)
                os._exit(1)
            # the daemon hears that the step is rolled out and judged before the trainer can read it: lent GPUs
            # start back while the batch is written, not once the trainer already waits for them
            client.report_progress(step, work=remaining.work(), judge=queue(), tools=remaining.tools())
            write_batch(args.out, step, groups)
            rewards = [r for g in groups for r in g.rewards]
            versions = sorted({t.weight_version or "?" for g in groups for tr in g.trajectories for t in tr.turns})
            print(
                json.dumps(
                    {
                        "event": "rollout step",
                        "step": step,
                        "started_at": round(started_at, 3),  # the step's launch (wall clock, as state's times)
                        "seconds": round(time.monotonic() - t0, 3),
                        "reward_mean": round(sum(rewards) / len(rewards), 4),
                        "tokens": client.counts["tokens"],
                        "weight_versions": versions,
                        "reward": args.reward,
                        "judged": sum(len(g.judged_by or ()) for g in groups),
                        **(
                            {"judge_models": sorted({j.model for g in groups for j in g.judged_by or ()})}
                            if judge
                            else {}
                        ),
                    }
                ),
                flush=True,
            )
    stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
