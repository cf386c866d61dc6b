"""Scoring finished trajectories with the run's judge: a generative reward model (the ``reward`` pool's model)
called through the run's one endpoint by its model's name (the gateway sends those requests to the judge's
workers only: pearlctl.router.routing).

Two scoring modes (`Mode`):

- **verdict**: P(yes) for a rubric question, from the judge's logprobs. One request scores both candidate
  replies as prompts (``"… Reply: yes"`` and ``"… Reply: no"``) with ``prompt_logprobs``, ``max_tokens`` 1; the
  score is ``P(yes) / (P(yes) + P(no))``, each the probability of that candidate's tokens after the prompt both
  share (their common token prefix, so that a tokenizer merging a candidate with the text before it is still
  compared on equal terms). Deterministic (no sampling), and it works with any model, random-weight test
  models included: it never depends on "yes" being among the judge's likeliest next tokens.
- **critique**: the judge writes a critique ending in ``Score: N`` (0 ≤ N ≤ ``scale``); the score is N / scale.
  An answer without a parseable score is retried with another seed, up to ``attempts`` times, and then is an
  error (`VerdictUnparsed`) naming the trajectory: never silently a zero. ``constrained`` adds a structured-
  output regex (vLLM's ``structured_outputs``) that makes every answer end in a score.

Guarantees:

- **One verdict per call**, whatever happened on the way: the gateway re-sends a request it cannot continue
  (two prompts, or a structured output) whole until one answer reaches this client, and this client retries
  only what the gateway could not answer (pearlctl.router.client: bounded by ``retry_for_s``). So a judge
  worker that leaves mid-verdict costs a re-sent request, never a lost or a second verdict. Re-sending is
  correct here: a verdict has no side effect, and a critique's seed makes the re-sent request the same one.
- **What scored it.** A `Verdict` names the judge's model, the worker that answered and the weights it served
  (as the gateway tagged them), and how many requests it took.
- **Bad answers are errors, not scores**: an answer of the wrong shape (no ``prompt_logprobs``: a server
  without them) is `JudgeError` at once; an unparseable critique is `VerdictUnparsed` after its retries.
"""

from __future__ import annotations

import math
import re
import threading
import zlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pearlctl.router.client import RolloutClient, pearl_record

VERDICT_PROMPT = "Task: {task}\nAnswer: {answer}\nQuestion: {rubric} Reply yes or no.\nReply:"
CANDIDATES = (" yes", " no")  # appended to the verdict prompt: P(yes) against P(no)
CRITIQUE_PROMPT = (
    "Task: {task}\nAnswer: {answer}\n{rubric}\nWrite a short critique, then a last line 'Score: N' with N a whole "
    "number from 0 to {scale}.\nCritique:"
)
RUBRIC = "Is the answer correct?"
SCORE = re.compile(r"score\s*[:=]\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


class Mode(StrEnum):
    VERDICT = "verdict"
    CRITIQUE = "critique"


class JudgeError(Exception):
    """The judge answered something that is not a verdict (a server without ``prompt_logprobs``…)."""


class VerdictUnparsed(JudgeError):
    """No critique of this trajectory had a score that could be read, after every attempt."""

    def __init__(self, trajectory: str, attempts: int, last_text: str):
        self.trajectory, self.attempts, self.last_text = trajectory, attempts, last_text
        super().__init__(
            f"trajectory {trajectory}: no score could be read in {attempts} critique(s) of the judge "
            f"(expected a last line 'Score: N'); the last ended {last_text[-120:]!r}"
        )


@dataclass(frozen=True)
class Verdict:
    trajectory: str
    score: float  # in [0, 1]
    mode: Mode
    model: str  # the judge's model, as requests name it
    worker: str | None  # the judge worker that answered, when the gateway could tell
    weight_version: str | None  # the weights it served, as the gateway tagged them (None: the model as loaded)
    requests: int  # judge requests this verdict took (critiques retried for a parseable score included)
    text: str | None = None  # critique: the judge's answer that was scored

    def record(self) -> dict[str, Any]:
        """What a rollout batch keeps of it (docs/rollout-batches.md, ``judged_by``)."""
        return {
            "mode": str(self.mode),
            "model": self.model,
            "worker": self.worker,
            "weight_version": self.weight_version,
            "score": self.score,
            "requests": self.requests,
        }


@dataclass
class Queue:
    """The judge queue as the driver reports it (``POST /v1/rollout/progress``, ``judge``): trajectories waiting
    for a verdict, being judged, judged; ``failed``: judge answers that gave no verdict (each retried, or its
    trajectory's step failed). Thread-safe."""

    waiting: int = 0
    judging: int = 0
    done: int = 0
    failed: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"waiting": self.waiting, "judging": self.judging, "done": self.done, "failed": self.failed}


class JudgeClient:
    """Scores (task, answer) pairs with ``model`` through the run's gateway (``client``: its endpoint, key and
    retries). ``mode``: `Mode`; ``rubric``: the question the judge answers; ``verdict_prompt`` /
    ``critique_prompt``: templates with ``{task}``, ``{answer}``, ``{rubric}`` (and ``{scale}``);
    ``candidates``: the verdict's yes and no replies; critique: ``max_tokens``, ``temperature``, ``scale``,
    ``attempts`` (answers asked for before `VerdictUnparsed`), ``constrained`` (a regex that forces the score
    line). ``queue``: counted here (a trajectory is ``waiting`` from `enqueue` until its `score` begins)."""

    def __init__(
        self,
        client: RolloutClient,
        model: str,
        *,
        mode: Mode = Mode.VERDICT,
        rubric: str = RUBRIC,
        verdict_prompt: str = VERDICT_PROMPT,
        critique_prompt: str = CRITIQUE_PROMPT,
        candidates: tuple[str, str] = CANDIDATES,
        max_tokens: int = 64,
        temperature: float = 1.0,
        scale: int = 10,
        attempts: int = 3,
        constrained: bool = False,
        seed: int = 0,
        queue: Queue | None = None,
    ):
        if attempts < 1 or scale < 1 or max_tokens < 1:
            raise ValueError(
                f"attempts, scale and max_tokens must be at least 1 (got {attempts}, {scale}, {max_tokens})"
            )
        if candidates[0] == candidates[1]:
            raise ValueError(f"the verdict's candidates must differ (got {candidates[0]!r} twice)")
        self.client, self.model, self.mode = client, model, Mode(mode)
        self.rubric, self.verdict_prompt, self.critique_prompt = rubric, verdict_prompt, critique_prompt
        self.candidates = candidates
        self.max_tokens, self.temperature, self.scale = max_tokens, temperature, scale
        self.attempts, self.constrained, self.seed = attempts, constrained, seed
        self.queue = queue if queue is not None else Queue()

    def enqueue(self) -> None:
        """A finished trajectory is waiting for its verdict."""
        self.queue.add(waiting=1)

    def score(self, trajectory: str, task: str, answer: str) -> Verdict:
        """The verdict on one trajectory (its id names it in errors and is the judge's session: a critique
        retried goes to the same worker when it can). Counts a waiting trajectory as judged, then done."""
        self.queue.add(waiting=-1, judging=1)
        try:
            if self.mode == Mode.VERDICT:
                verdict = self._verdict(trajectory, task, answer)
            else:
                verdict = self._critique(trajectory, task, answer)
        except BaseException:
            self.queue.add(judging=-1)
            raise
        self.queue.add(judging=-1, done=1)
        return verdict

    # -- verdict probability ------------------------------------------------------------------------------
    def _verdict(self, trajectory: str, task: str, answer: str) -> Verdict:
        prompt = self.verdict_prompt.format(task=task, answer=answer, rubric=self.rubric)
        body = {
            "model": self.model,
            "prompt": [prompt + c for c in self.candidates],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        doc = self.client.request(f"judge-{trajectory}", body)
        try:
            yes, no = candidate_logprobs(doc["choices"])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            self.queue.add(failed=1)
            raise JudgeError(
                f"trajectory {trajectory}: the judge's answer has no usable prompt logprobs: {exc}"
            ) from exc
        return Verdict(trajectory, p_first(yes, no), Mode.VERDICT, self.model, *_served_by(doc), requests=1)

    # -- critique with a parsed score -----------------------------------------------------------------------
    def _critique(self, trajectory: str, task: str, answer: str) -> Verdict:
        prompt = self.critique_prompt.format(task=task, answer=answer, rubric=self.rubric, scale=self.scale)
        text = ""
        for attempt in range(1, self.attempts + 1):
            body: dict[str, Any] = {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                # the same request when the gateway re-sends it; another one for another attempt
                "seed": (zlib.crc32(trajectory.encode()) + self.seed * 1_000_003 + attempt) % 2**31,
            }
            if self.constrained:
                body["structured_outputs"] = {"regex": score_regex(self.scale, self.max_tokens)}
            doc = self.client.request(f"judge-{trajectory}", body)
            try:
                text = str(doc["choices"][0]["text"])
            except (KeyError, IndexError, TypeError) as exc:
                self.queue.add(failed=1)
                raise JudgeError(f"trajectory {trajectory}: the judge's answer has no text: {exc}") from exc
            value = parse_score(text, self.scale)
            if value is not None:
                worker, version = _served_by(doc)
                return Verdict(
                    trajectory, value / self.scale, Mode.CRITIQUE, self.model, worker, version, attempt, text
                )
            self.queue.add(failed=1)
        raise VerdictUnparsed(trajectory, self.attempts, text)


def candidate_logprobs(choices: list[dict]) -> tuple[float, float]:
    """log P(each candidate | the prompt both share), from the two choices' ``prompt_token_ids`` and
    ``prompt_logprobs`` (vLLM's: per position a map of token id to its logprob; None first): the sum over the
    positions after the two prompts' common token prefix. `ValueError` when that cannot be read."""
    if len(choices) != 2:
        raise ValueError(f"{len(choices)} choice(s), not the 2 asked for")
    ids = [list(c["prompt_token_ids"]) for c in sorted(choices, key=lambda c: c["index"])]
    lps = [c["prompt_logprobs"] for c in sorted(choices, key=lambda c: c["index"])]
    common = 0
    while common < min(len(ids[0]), len(ids[1])) and ids[0][common] == ids[1][common]:
        common += 1
    if common == 0 or common in (len(ids[0]), len(ids[1])):
        raise ValueError("the candidates share no prompt, or one is the start of the other")
    out = []
    for tokens, positions in zip(ids, lps, strict=True):
        if len(positions) != len(tokens):
            raise ValueError(f"{len(positions)} prompt logprobs for {len(tokens)} prompt tokens")
        total = 0.0
        for at in range(common, len(tokens)):
            entry = positions[at][str(tokens[at])] if str(tokens[at]) in positions[at] else positions[at][tokens[at]]
            value = float(entry["logprob"] if isinstance(entry, dict) else entry)
            if not math.isfinite(value) and value != -math.inf:
                raise ValueError(f"logprob {value} at prompt position {at}")
            total += value
        out.append(total)
    return out[0], out[1]


def p_first(a: float, b: float) -> float:
    """exp(a) / (exp(a) + exp(b)), computed without overflow; 0.5 when both are impossible."""
    if a == -math.inf and b == -math.inf:
        return 0.5
    return 1.0 / (1.0 + math.exp(b - a)) if b - a < 700 else 0.0


def parse_score(text: str, scale: int) -> float | None:
    """The last ``Score: N`` in a critique, when 0 ≤ N ≤ ``scale``; else None."""
    found = SCORE.findall(text)
    if not found:
        return None
    value = float(found[-1])
    return value if 0.0 <= value <= scale else None


def score_regex(scale: int, max_tokens: int) -> str:
    """A critique of at most a few words per token of ``max_tokens`` that ends in a score line, for vLLM's
    structured outputs."""
    scores = "|".join(str(n) for n in range(scale, -1, -1))
    return rf"[A-Za-z ,.]{{0,{max(0, 2 * max_tokens - 16)}}}\nScore: ({scores})"


def _served_by(doc: dict) -> tuple[str | None, str | None]:
    """(worker, weight version) of the part that answered, as the gateway's ``pearl`` record tags it."""
    _, parts = pearl_record(doc)
    last = parts[-1] if parts else {}
    worker, version = last.get("worker"), last.get("weight_version")
    return (worker if isinstance(worker, str) else None, version if isinstance(version, str) else None)
