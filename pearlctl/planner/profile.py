"""Engine profiles: how fast one rollout worker prefills and decodes, how much KV cache it holds, and what
each role transition costs. Pure data with pure functions; files are TOML (``[profile]``,
``[profile.decode]``, ``[profile.costs]``, ``[sources]``) so shipped profiles cite where each number
comes from.

Decode model (one iteration of a continuous batch of ``B`` sequences whose mean context is ``L``)::

    itl(B, L) = weights_s + experts_s * distinct_experts(B) + seq_s * B + kv_s_per_token * B * L

- ``weights_s``: reading the dense weights once per iteration — the memory-bound floor at batch 1;
- ``experts_s``: reading one expert's weights (all layers); an MoE batch touches
  ``E * (1 - (1 - k/E) ** B)`` distinct experts (uniform routing), so MoE decode speed grows far less than
  linearly with batch — a dense model has ``moe_experts = 0``;
- ``seq_s``: per-sequence compute in an iteration;
- ``kv_s_per_token``: reading one token of KV cache (attention is memory-bound in decode).

Aggregate decode throughput is ``B / itl(B, L)``: sublinear in ``B`` and never above the compute line.
A single sequence cannot go faster than ``1 / itl(1, L)`` tokens/s — the straggler floor.
"""

from __future__ import annotations

import math
import statistics
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pearlctl.vocabulary import Role, StepKind


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class DecodeModel:
    weights_s: float
    seq_s: float
    kv_s_per_token: float
    experts_s: float = 0.0
    moe_experts: int = 0
    moe_top_k: int = 0

    def distinct_experts(self, batch: float) -> float:
        if not self.moe_experts:
            return 0.0
        e, k = self.moe_experts, self.moe_top_k
        return e * (1.0 - (1.0 - k / e) ** max(batch, 1.0))

    def itl(self, batch: float, context: float) -> float:
        """Seconds of one decode iteration for ``batch`` sequences of mean context ``context`` tokens."""
        b = max(batch, 1.0)
        return (
            self.weights_s
            + self.experts_s * self.distinct_experts(b)
            + self.seq_s * b
            + self.kv_s_per_token * b * max(context, 0.0)
        )

    def itl_terms(self, context: float) -> tuple[float, float, float, float]:
        """``itl``'s terms at one context, ``(fixed, per_seq, experts, keep)``: with ``b = max(batch, 1)``,
        ``itl = fixed + per_seq * b`` for a dense model and ``fixed + experts * (1 - keep**b) + per_seq * b`` for a
        MoE one (``moe_experts`` set). ``itl_at`` and the completion model's bisection compute from these."""
        fixed = self.weights_s
        per_seq = self.seq_s + self.kv_s_per_token * max(context, 0.0)
        if not self.moe_experts:
            return fixed, per_seq, 0.0, 1.0
        return fixed, per_seq, self.experts_s * self.moe_experts, 1.0 - self.moe_top_k / self.moe_experts

    def itl_at(self, context: float):
        """``itl(batch, context)`` as a function of the batch alone, with the context's terms folded in: the
        completion model calls it hundreds of times per prediction at one context."""
        fixed, per_seq, experts, keep = self.itl_terms(context)
        if not self.moe_experts:

            def dense(batch: float) -> float:
                return fixed + per_seq * (batch if batch > 1.0 else 1.0)

            return dense

        def moe(batch: float) -> float:
            b = batch if batch > 1.0 else 1.0
            return fixed + experts * (1.0 - keep**b) + per_seq * b

        return moe

    def tok_s(self, batch: float, context: float) -> float:
        """Aggregate decode tokens/s of one worker."""
        return max(batch, 1.0) / self.itl(batch, context)


@dataclass(frozen=True)
class TransitionCosts:
    """Seconds each step takes (running estimates replace these once the journal has measured ones)."""

    start_s: float = 60.0  # cold start of a vLLM worker: load weights, allocate KV, warm up
    wake_s: float = 3.0  # wake a worker parked asleep
    sleep_s: float = 3.0  # park a worker asleep (level 1: weights to host memory, KV freed)
    stop_s: float = 5.0  # drain and stop a worker
    offload_s: float = 2.0  # trainer releases its GPUs (DeepSpeed offload_states)
    reload_s: float = 2.0  # trainer takes them back (reload_states)
    weight_sync_s: float = 10.0  # new policy weights reach every rollout worker
    # a rollout worker changes role (ROLLOUT <-> PREFILL/DECODE): drain + restart KV config. A switch between the
    # policy and the judge is another model: it costs a stop and a start (pearlctl.planner.view, View.move)
    role_switch_s: float = 5.0

    def borrow_s(self, warm: bool) -> float:
        return self.offload_s + (self.wake_s if warm else self.start_s)

    def return_s(self, park: bool) -> float:
        return (self.sleep_s if park else self.stop_s) + self.reload_s


# The simulator's name for the weight load of a woken worker whose weights are a train step old: a timed part
# of its move, journaled like a step. Live it is no step of its own (the agent reloads the weights before VERIFY
# passes), so the daemon's estimate of weight_sync_s stays the profile's.
WEIGHT_LOAD = "SYNC_WEIGHTS"
# journaled step kind -> the TransitionCosts field its measured durations estimate: the one table behind the
# daemon's running estimates (``step_costs``) and the simulator's (pearlctl.sim.moves.Moves.costs)
STEP_COSTS: dict[str, str] = {
    StepKind.START: "start_s",
    StepKind.WAKE: "wake_s",
    StepKind.SLEEP: "sleep_s",
    StepKind.STOP: "stop_s",
    StepKind.OFFLOAD: "offload_s",
    StepKind.RELOAD: "reload_s",
    WEIGHT_LOAD: "weight_sync_s",
}
# The window of the running cost estimates, the daemon's and the simulator's alike: a cost measured is the median
# of the last this many durations measured — of a step kind (``step_costs``' ``last``; pearlctl.sim.moves), of an
# engine's cold starts (``measured_costs``), of a whole transition of a kind (pearlctl.daemon.policy_view)
COST_ESTIMATE_LAST = 5


# The steps that act on a serving engine, and which end of their move names it: a start or a wake brings up the
# engine of the role the GPU goes to, a stop or a sleep ends the one of the role it leaves (the policy's model or
# the judge's, REWARD). The trainer's offload and reload, and a weight load, are the policy side's.
ENGINE_END: dict[str, str] = {
    StepKind.START: "to_role",
    StepKind.WAKE: "to_role",
    StepKind.STOP: "from_role",
    StepKind.SLEEP: "from_role",
}


# the TransitionCosts fields of those steps: the costs that are each engine's own
ENGINE_COSTS: tuple[str, ...] = tuple(STEP_COSTS[k] for k in ENGINE_END)


def judge_engine_costs(
    policy: TransitionCosts, measured: Mapping[str, float], base: TransitionCosts
) -> TransitionCosts:
    """The judge's engine's costs: ``policy``'s (the trainer's offload and reload are the same for both) with the
    judge's own start, wake, sleep and stop — ``measured`` (its journaled steps), else ``base``'s (its profile)."""
    return TransitionCosts(**{**vars(policy), **{f: measured.get(f, getattr(base, f)) for f in ENGINE_COSTS}})


def judges_step(step: Mapping[str, Any]) -> bool:
    """Whether a journaled step (with its transition's ``from_role`` and ``to_role``) acted on the judge's engine."""
    end = ENGINE_END.get(step.get("kind") or "")
    return end is not None and step.get(end) == Role.REWARD


def step_costs(steps: Iterable[dict], *, last: int | None = None, judge: bool | None = None) -> dict[str, float]:
    """Median seconds of each journaled step kind — of its ``last`` DONE steps, or all — keyed by the
    TransitionCosts field it estimates (only steps with start and finish times count). ``judge``: only the
    steps on the judge's engine (True) or only the others (False, ``judges_step``); None: all."""
    seen: dict[str, list[float]] = {}
    for s in steps:
        d = s.get("detail") or {}
        if s.get("state") == "DONE" and s.get("kind") in STEP_COSTS and "started_at" in d and "finished_at" in d:
            if judge is None or judges_step(s) == judge:
                seen.setdefault(STEP_COSTS[s["kind"]], []).append(d["finished_at"] - d["started_at"])
    return {k: statistics.median(v[-last:] if last else v) for k, v in seen.items()}


def measured_costs(
    steps: Iterable[dict], starts: Iterable[float], *, judge: bool, last: int | None = None
) -> dict[str, float]:
    """One engine's measured costs: ``step_costs`` of its steps (``judge``: the judge's engine, else the policy's),
    and a start never journaled as a step priced at the median of the last 5 cold starts its workers made
    (``starts``, oldest first, as their agents measured them: the workers a launch starts are no transition)."""
    est = step_costs(steps, last=last, judge=judge)
    seen = list(starts)
    if "start_s" not in est and seen:
        est["start_s"] = statistics.median(seen[-COST_ESTIMATE_LAST:])
    return est


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    hardware: str
    decode: DecodeModel
    prefill_tok_s: float  # one worker, compute-bound prefill throughput
    kv_capacity_tokens: int  # one worker's KV cache, in tokens
    max_num_seqs: int = 256  # vLLM's cap on a worker's running batch
    gpus_per_worker: int = 1  # tensor parallel size
    kv_bytes_per_token: int = 0
    kv_transfer_gb_s: float = 10.0  # prefill -> decode KV transfer bandwidth (disaggregated mode)
    request_overhead_s: float = 0.0  # per request, outside prefill and decode: HTTP, tokenizing, scheduling
    # the part of request_overhead_s a worker's API server does one request at a time: B requests arriving
    # together wait up to (B - 1) times this, and a worker serves at most 1 / this requests a second
    request_serial_s: float = 0.0
    costs: TransitionCosts = field(default_factory=TransitionCosts)
    sources: dict[str, str] = field(default_factory=dict)  # field -> citation
    # the predictor's learned correction (pearlctl.planner.correct): every predicted time is multiplied by it.
    # Set by the daemon from the run's checked batches, never read from or written to a profile file.
    time_scale: float = 1.0

    def __post_init__(self):
        problems = []
        for name in ("prefill_tok_s", "kv_capacity_tokens", "max_num_seqs", "gpus_per_worker", "kv_transfer_gb_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0 (got {getattr(self, name)!r})")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            problems.append(f"time_scale must be a finite number > 0 (got {self.time_scale!r})")
        for name in ("request_overhead_s", "request_serial_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                problems.append(f"{name} must be a finite number >= 0 (got {value!r})")
        d = self.decode
        if not d.weights_s > 0 or d.seq_s < 0 or d.kv_s_per_token < 0 or d.experts_s < 0:
            problems.append("decode: weights_s must be > 0; seq_s, kv_s_per_token, experts_s >= 0")
        if d.moe_experts and not 0 < d.moe_top_k <= d.moe_experts:
            problems.append("decode: moe_top_k must be in 1..moe_experts")
        for name, value in asdict(self.costs).items():
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                problems.append(f"costs.{name} must be a finite number >= 0 (got {value!r})")
        if problems:
            raise ProfileError(f"profile {self.name!r}: " + "; ".join(problems))

    def kv_transfer_s(self, tokens: float) -> float:
        """Seconds to move the KV cache of ``tokens`` tokens from a prefill to a decode worker."""
        if not self.kv_bytes_per_token:
            return 0.0
        return tokens * self.kv_bytes_per_token / (self.kv_transfer_gb_s * 1e9)

    def with_costs(self, **changes: float) -> Profile:
        from dataclasses import replace

        return replace(self, costs=replace(self.costs, **changes))


# -- files -----------------------------------------------------------------------------------------

_TOP = {f.name for f in fields(Profile)} - {"decode", "costs", "sources", "time_scale"}
_DECODE = {f.name for f in fields(DecodeModel)}
_COSTS = {f.name for f in fields(TransitionCosts)}


def _known(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")


def from_dict(doc: dict, *, where: str = "profile") -> Profile:
    """A profile from its TOML document (``[profile]`` with ``decode`` and ``costs`` tables; ``[sources]``)."""
    body = dict(doc.get("profile") or {})
    if not body:
        raise ProfileError(f"{where}: no [profile] table")
    decode = body.pop("decode", None)
    costs = body.pop("costs", {})
    if decode is None:
        raise ProfileError(f"{where}: no [profile.decode] table (weights_s, seq_s, kv_s_per_token)")
    _known(body, _TOP, f"{where} [profile]")
    _known(decode, _DECODE, f"{where} [profile.decode]")
    _known(costs, _COSTS, f"{where} [profile.costs]")
    missing = [k for k in ("name", "model", "hardware", "prefill_tok_s", "kv_capacity_tokens") if k not in body]
    if missing:
        raise ProfileError(f"{where} [profile]: missing {', '.join(missing)}")
    try:
        return Profile(
            decode=DecodeModel(**decode),
            costs=TransitionCosts(**costs),
            sources={str(k): str(v) for k, v in (doc.get("sources") or {}).items()},
            **body,
        )
    except TypeError as exc:
        raise ProfileError(f"{where}: {exc}") from None


def load(path: str | Path) -> Profile:
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:  # (ValueError: TOMLDecodeError, or a path no file can have, e.g. a NUL)
        raise ProfileError(f"cannot read profile {path!s}: {exc}") from None
    return from_dict(doc, where=str(path))


def to_dict(profile: Profile) -> dict:
    body = {k: v for k, v in asdict(profile).items() if k not in ("decode", "costs", "sources", "time_scale")}
    body["decode"] = asdict(profile.decode)
    body["costs"] = asdict(profile.costs)
    return {"profile": body, "sources": dict(profile.sources)}


def dumps(profile: Profile) -> str:
    """The profile as TOML (what ``pearlctl profile --export`` writes and ``load`` reads back)."""
    doc = to_dict(profile)
    lines = ["[profile]"]
    lines += [f"{k} = {_toml(v)}" for k, v in doc["profile"].items() if not isinstance(v, dict)]
    for table in ("decode", "costs"):
        lines += ["", f"[profile.{table}]"] + [f"{k} = {_toml(v)}" for k, v in doc["profile"][table].items()]
    if doc["sources"]:
        lines += ["", "[sources]"] + [f"{k} = {_toml(v)}" for k, v in doc["sources"].items()]
    return "\n".join(lines) + "\n"


def _toml(v) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))
