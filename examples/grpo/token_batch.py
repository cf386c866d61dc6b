"""Token-level rollout batches: the one format in which a rollout driver hands GRPO groups to the trainer.

A batch is a JSON-lines file, one `Group` per line: a prompt, its rewards, and one `Trajectory` per sampled
episode — the token ids the policy saw and sampled (the whole multi-turn episode as one sequence), a loss
mask (1 on tokens the policy sampled, 0 on prompt and tool-output tokens), the logprob the sampler returned
for every sampled token, and per turn where its tokens are and which weight version sampled them.
docs/rollout-batches.md is the schema, for anyone writing their own driver.

Guarantees:

- **Parsed at the edge.** `parse_batch` / `read_batch` turn a batch file into typed `Group` values or raise
  `BatchError` naming the file, the line and the field (``line 3: trajectories.1.mask: ...``): a malformed
  line is never a ``KeyError`` or a crash deep in the loss.
- **Invariants checked**, not assumed: ``len(mask) == len(completion_ids)``; ``len(logprobs)`` equals the
  number of mask-1 tokens; a group scored by a judge has one verdict (``judged_by``) per trajectory, and each
  reward is its verdict's score; the turns' spans (``start``, ``tokens``) are in order, do not overlap, lie inside
  ``completion_ids`` and cover exactly the mask-1 positions; a turn's ``parts`` (when given) add up to its
  tokens; logprobs are finite and at most 0; token ids are non-negative integers; one reward per trajectory.
- **Built the same way by every source.** `trajectory_from_turns` assembles a trajectory from the segments of
  an episode (environment tokens, sampled tokens with their logprobs) so a driver cannot get the offsets wrong.

Pure: no I/O beyond `read_batch`/`write_batch`, no torch, no tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

TokenId = Annotated[int, Field(ge=0)]
LogProb = Annotated[float, Field(le=0.0, allow_inf_nan=False)]
MaskBit = Annotated[int, Field(ge=0, le=1)]
Count = Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


class Part(_Model):
    """A stretch of a turn sampled by one worker: a turn continued after an interruption has several."""

    tokens: Count
    weight_version: str | None = None


class Turn(_Model):
    """One sampled turn: ``completion_ids[start : start + tokens]``, all mask 1."""

    start: Count
    tokens: Count
    weight_version: str | None  # the version that sampled every token of the turn; None: unknown or mixed
    parts: tuple[Part, ...] = ()
    finish_reason: str | None = None
    worker: str | None = None

    @model_validator(mode="after")
    def _parts_add_up(self) -> Turn:
        if self.parts and sum(p.tokens for p in self.parts) != self.tokens:
            raise ValueError(
                f"parts add up to {sum(p.tokens for p in self.parts)} token(s), the turn has {self.tokens}"
            )
        return self


class Trajectory(_Model):
    """One episode as one token sequence: ``prompt_ids + completion_ids``."""

    prompt_ids: Annotated[tuple[TokenId, ...], Field(min_length=1)]
    completion_ids: tuple[TokenId, ...]
    mask: tuple[MaskBit, ...]
    logprobs: tuple[LogProb, ...]
    turns: Annotated[tuple[Turn, ...], Field(min_length=1)]

    @model_validator(mode="after")
    def _consistent(self) -> Trajectory:
        n = len(self.completion_ids)
        if len(self.mask) != n:
            raise ValueError(f"mask has {len(self.mask)} entries, completion_ids {n}: they must be equal")
        sampled = sum(self.mask)
        if len(self.logprobs) != sampled:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries, mask has {sampled} sampled token(s)")
        at = 0
        spans = [0] * n
        for i, turn in enumerate(self.turns):
            if turn.start < at:
                raise ValueError(f"turns.{i} starts at {turn.start}, before the previous turn ends ({at})")
            end = turn.start + turn.tokens
            if end > n:
                raise ValueError(f"turns.{i} ends at {end}, past completion_ids ({n} tokens)")
            for k in range(turn.start, end):
                spans[k] = 1
            at = end
        if tuple(spans) != self.mask:
            first = next(k for k in range(n) if spans[k] != self.mask[k])
            raise ValueError(
                f"mask is {self.mask[first]} at completion position {first}, where the turns say "
                f"{'a sampled token' if spans[first] else 'no sampled token'}: mask must be 1 exactly on the turns"
            )
        return self


class Judged(_Model):
    """Which judge scored a trajectory (a generative reward model: pearlctl.router.judge), and its score."""

    mode: Literal["verdict", "critique"]
    model: str  # the judge's model, as requests name it
    worker: str | None = None  # the judge worker that answered
    weight_version: str | None = None  # the judge's weights as the gateway tagged them (None: as loaded)
    score: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    requests: Annotated[int, Field(ge=1)]  # judge requests it took (critiques retried for a readable score)


class Group(_Model):
    """A GRPO group: one prompt, one trajectory and one reward per sampled episode; with a judge, per trajectory
    the verdict that is its reward."""

    prompt: str  # for people and the reward rule; the loss uses ``prompt_ids``
    rewards: Annotated[tuple[Annotated[float, Field(allow_inf_nan=False)], ...], Field(min_length=1)]
    trajectories: Annotated[tuple[Trajectory, ...], Field(min_length=1)]
    completions: tuple[str, ...] | None = None  # the episodes as text, for people and logs
    served_by: tuple[dict, ...] | None = None  # per trajectory: worker and weight version of its last turn
    judged_by: tuple[Judged, ...] | None = None  # per trajectory, when a judge scored them: its verdict

    @model_validator(mode="after")
    def _one_reward_each(self) -> Group:
        if len(self.rewards) != len(self.trajectories):
            raise ValueError(f"{len(self.rewards)} reward(s) for {len(self.trajectories)} trajectories")
        if self.completions is not None and len(self.completions) != len(self.trajectories):
            raise ValueError(f"{len(self.completions)} completion text(s) for {len(self.trajectories)} trajectories")
        if self.judged_by is not None:
            if len(self.judged_by) != len(self.trajectories):
                raise ValueError(f"{len(self.judged_by)} verdict(s) for {len(self.trajectories)} trajectories")
            for i, (reward, judged) in enumerate(zip(self.rewards, self.judged_by, strict=True)):
                if reward != judged.score:
                    raise ValueError(f"rewards.{i} is {reward}, but the judge scored that trajectory {judged.score}")
        return self


class BatchError(ValueError):
    """A batch that is not token-level GRPO groups; the message names the line and the field."""


def _describe(err: ValidationError) -> str:
    errors = err.errors(include_url=False)
    locs = [tuple(e["loc"]) for e in errors]
    # pydantic also reports a tuple as too short once an item of it failed: the item is the news
    errors = [
        e
        for e in errors
        if not (
            e["type"] == "too_short"
            and any(o[: len(e["loc"])] == tuple(e["loc"]) and o != tuple(e["loc"]) for o in locs)
        )
    ]
    out = []
    for e in errors[:3]:
        where = ".".join(str(x) for x in e["loc"]) or "(the line)"
        out.append(f"{where}: {e['msg']}")
    more = len(errors) - len(out)
    return "; ".join(out) + (f" (and {more} more)" if more > 0 else "")


def parse_group(line: str) -> Group:
    """One batch line as a `Group`; `BatchError` naming the field otherwise."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise BatchError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BatchError(f"a group is a JSON object, not {type(doc).__name__}")
    if "trajectories" not in doc and "completions" in doc:
        raise BatchError(
            "trajectories: missing — a text-only batch (prompt, completions): the trainer trains on token ids "
            "and needs token-level trajectories (docs/rollout-batches.md)"
        )
    try:
        return Group.model_validate_json(line, strict=True)
    except ValidationError as err:
        raise BatchError(_describe(err)) from None


def parse_batch(text: str, source: str = "batch") -> list[Group]:
    """Every non-blank line of a batch as a `Group`; `BatchError` ("SOURCE line N: FIELD: why") on the first
    bad one, or when there is no group at all."""
    groups = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            groups.append(parse_group(line))
        except BatchError as exc:
            raise BatchError(f"{source} line {n}: {exc}") from None
    if not groups:
        raise BatchError(f"{source}: no group in the batch")
    return groups


def read_batch(path: Path) -> list[Group]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchError(f"{path}: cannot be read: {exc}") from None
    return parse_batch(text, str(path))


def dump_group(group: Group) -> str:
    return group.model_dump_json()


def write_batch(root: Path, step: int, groups: list[Group]) -> Path:
    """``root/step-NNNNNN.jsonl``, written under a temporary name and renamed: the trainer sees it whole."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step-{step:06d}.jsonl.tmp"
    tmp.write_text("".join(dump_group(g) + "\n" for g in groups))
    final = root / f"step-{step:06d}.jsonl"
    os.replace(tmp, final)
    return final


# -- building a trajectory -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampled:
    """A turn the policy sampled: its token ids, their logprobs, and who sampled them."""

    ids: list[int]
    logprobs: list[float]
    weight_version: str | None
    parts: tuple[Part, ...] = ()
    finish_reason: str | None = None
    worker: str | None = None


def trajectory_from_turns(prompt_ids: list[int], segments: list[list[int] | Sampled]) -> Trajectory:
    """The trajectory of an episode: the first prompt's ids, then its segments in order — a list of ids is
    environment text (a tool's answer and the chat markup around it: mask 0), a `Sampled` is a turn (mask 1).
    Raises `BatchError` when the result breaks an invariant (e.g. a turn whose logprobs do not match its ids)."""
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    turns: list[dict] = []
    for seg in segments:
        if isinstance(seg, Sampled):
            if len(seg.logprobs) != len(seg.ids):
                raise BatchError(f"a turn has {len(seg.ids)} token id(s) but {len(seg.logprobs)} logprob(s)")
            turns.append(
                {
                    "start": len(completion),
                    "tokens": len(seg.ids),
                    "weight_version": seg.weight_version,
                    "parts": seg.parts,
                    "finish_reason": seg.finish_reason,
                    "worker": seg.worker,
                }
            )
            completion += seg.ids
            mask += [1] * len(seg.ids)
            logprobs += seg.logprobs
        else:
            completion += seg
            mask += [0] * len(seg)
    try:
        return Trajectory(
            prompt_ids=tuple(prompt_ids),
            completion_ids=tuple(completion),
            mask=tuple(mask),
            logprobs=tuple(logprobs),
            turns=tuple(Turn(**t) for t in turns),
        )
    except ValidationError as err:
        raise BatchError(_describe(err)) from None


def turn_version(parts: list[Part] | tuple[Part, ...], fallback: str | None) -> str | None:
    """A turn's one weight version: the parts' when they all name the same one; None when they differ or one is
    unknown; ``fallback`` when there are no parts."""
    if not parts:
        return fallback
    versions = {p.weight_version for p in parts}
    return versions.pop() if len(versions) == 1 else None
