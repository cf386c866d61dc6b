"""The scenario file's format: its TOML tables as strict pydantic models, and every problem in words.

``read`` either returns a ``ScenarioFile`` (what the file says, keys not given as None where their default
depends on another table or on the profile) or every problem found, one line each: the key path
(``[workload] turns.p99``, ``[availability] lifetime_mixture[0] mean_s``) and what would be valid. Every table is
a ``Table``: strict types (no "8" for 8, no true for 1, no NaN or infinity), frozen, and one validator that
words its problems: unknown keys in one problem listing the allowed ones, a missing or mistyped key with what it
must be, a number out of range with its bound, then the table's own rules (``_problems``: between its keys, and
against the profile when it could be read) once its keys are valid. pearlctl/sim/scenario.py loads the profile,
applies the defaults and makes the ``Scenario`` the simulator consumes (docs/simulator.md has the format).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import UnionType
from typing import Annotated, Any, ClassVar, NoReturn, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from pearlctl.planner.profile import Profile

DISTRIBUTION_KINDS = ("const", "uniform", "lognormal")
DISTRIBUTION_PARAMETERS = {"const": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "p99")}
MISMATCH_KINDS = ("decode", "prefill", "tool_latency", "transitions")
MISMATCH_PRESET_NAMES = ("none", "measured")

Loc = tuple[str | int, ...]
Problems = Iterable[tuple[Loc, str]]
Count = Annotated[int, Field(ge=0)]
AtLeastOne = Annotated[int, Field(ge=1)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
_WHAT = {int: "an integer", float: "a number", str: "a string"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt")}


def _refuse(problems: Problems, value: Any) -> NoReturn:
    """Raise every problem as one validation error (pydantic prefixes each key path with where ``value`` is)."""
    errors = [
        InitErrorDetails(type=PydanticCustomError("scenario", text), loc=loc, input=value) for loc, text in problems
    ]
    raise ValidationError.from_exception_data("scenario", errors)


def _choice(values: Iterable[str], text: str) -> Any:
    """A string among ``values``; anything else is refused with ``text`` and what was given."""
    allowed = tuple(values)

    def check(value: Any) -> Any:
        if not isinstance(value, str) or value not in allowed:
            raise PydanticCustomError("scenario", f"{text} (got {value!r})")
        return value

    return Annotated[str, BeforeValidator(check)]


def _what(field: FieldInfo | None) -> str:
    """What a key must be, in words: its description, else said from its type (``X | None`` as X)."""
    if field is None:
        return "a table"
    if field.description:
        return field.description
    tp = field.annotation
    if get_origin(tp) in (Union, UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if isinstance(tp, type) and issubclass(tp, Table):
        return tp.shape
    return _WHAT.get(tp, "a table")


def _text(error: ErrorDetails, field: FieldInfo | None) -> str:
    """A pydantic error about ``field`` (the key the error is under) in the scenario's words."""
    kind, got = error["type"], error["input"]
    if kind == "scenario":  # said already, by a nested table or a choice
        return error["msg"]
    if kind == "missing":
        return f"required ({_what(field)})"
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"must be {op} {error['ctx'][key]:g} (got {got!r})"
    return f"must be {_what(field)} (got {got!r})"


class Table(BaseModel):
    """A table of the scenario file (the module's docstring says what it refuses and how)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    shape: ClassVar[str] = "a table"  # what a value in this table's place must be

    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """The table a value that is not one stands for (a number for a distribution or a bias): a dict to
        validate, or a table taken as it is."""
        return value

    @classmethod
    def _allowed(cls, value: dict) -> set[str]:
        return set(cls.model_fields)

    def _problems(self, profile: Profile | None) -> Problems:
        """The rules between this table's keys (and the profile's numbers, when it could be read)."""
        return ()

    @model_validator(mode="wrap")
    @classmethod
    def _validate(cls, value: Any, handler: ModelWrapValidatorHandler, info: ValidationInfo) -> Any:
        value = cls._shorthand(value)
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _refuse([((), f"must be {cls.shape}")], value)
        allowed = cls._allowed(value)
        unknown = sorted(str(k) for k in value if k not in allowed)
        problems: list[tuple[Loc, str]] = []
        if unknown:
            problems.append(((), f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"))
        try:
            table = handler({k: v for k, v in value.items() if k in allowed})
        except ValidationError as exc:
            problems += [
                (e["loc"], _text(e, cls.model_fields.get(str(e["loc"][0])) if e["loc"] else None)) for e in exc.errors()
            ]
        else:
            problems += table._problems((info.context or {}).get("profile"))
        if problems:
            _refuse(problems, value)
        return table


DistributionKind = _choice(DISTRIBUTION_KINDS, f"must be one of {', '.join(DISTRIBUTION_KINDS)}")
Mode = _choice(("sync", "async"), 'must be "sync" or "async"')
Preset = _choice(MISMATCH_PRESET_NAMES, f"must be one of {', '.join(MISMATCH_PRESET_NAMES)}")


class DistributionTable(Table):
    """A workload distribution: a number (a constant) or ``{kind = ..., <its parameters>, min, max}``."""

    shape = (
        f"a number or an inline table with kind = {'|'.join(DISTRIBUTION_KINDS)}, "
        'e.g. {kind = "lognormal", median = 500, p99 = 4000}'
    )
    kind: DistributionKind = Field(description=f"one of {', '.join(DISTRIBUTION_KINDS)}")
    value: NonNegative | None = None
    low: NonNegative | None = None
    high: NonNegative | None = None
    median: NonNegative | None = None
    p99: NonNegative | None = None
    min: NonNegative = 0.0
    max: NonNegative | None = None  # None: no upper clip

    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # a bare number is a constant taken as it is, unchecked (as the hand-written parser before this took it)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls.model_construct(kind="const", value=float(value))
        return value

    @classmethod
    def _allowed(cls, value: dict) -> set[str]:
        kind = value.get("kind")
        if not isinstance(kind, str) or kind not in DISTRIBUTION_PARAMETERS:
            return set(cls.model_fields)
        return {"kind", "min", "max", *DISTRIBUTION_PARAMETERS[kind]}

    def _problems(self, profile: Profile | None) -> Problems:
        missing = [k for k in DISTRIBUTION_PARAMETERS[self.kind] if getattr(self, k) is None]
        for k in missing:
            yield (k,), "required (a number)"
        if missing:
            return
        if self.kind == "uniform" and self.high < self.low:
            yield (), "high must be >= low"
        if self.kind == "lognormal":
            if self.median <= 0:
                yield ("median",), "must be > 0"
            if self.p99 < self.median:
                yield ("p99",), f"must be >= median ({self.median})"
        if self.max is not None and self.max < self.min:
            yield (), "max must be >= min"


class PerturbationTable(Table):
    """One part of a ``[mismatch]``: a number (the bias) or ``{bias, spread}``; a key not given is the preset's."""

    shape = "a number (the bias) or an inline table {bias = 1.3, spread = 0.1}"
    bias: Positive | None = None
    spread: NonNegative | None = None

    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"bias": value}
        return value


class _Head(Table):
    """``[scenario]``."""

    name: str = Field(min_length=1, description="a non-empty string")
    description: Any = ""  # anything, as text
    profile: str = Field(description="a profile TOML path relative to the scenario file")
    steps: AtLeastOne = 8
    seed: Count = 0
    tick_s: Positive = 0.5
    control_interval_s: Positive = 5.0


class _Cluster(Table):
    trainer_gpus: AtLeastOne
    rollout_gpus: Count
    elastic_gpus: Count = 0
    reward_gpus: Count = 0  # the reward pool: judges from the start ([judge])
    gpus_per_node: AtLeastOne = 8

    def _problems(self, profile: Profile | None) -> Problems:
        if profile is not None:
            g = profile.gpus_per_worker
            for key in ("trainer_gpus", "rollout_gpus", "elastic_gpus", "gpus_per_node"):
                if getattr(self, key) % g:
                    yield (key,), f"must be a multiple of the profile's gpus_per_worker ({g})"
        if self.rollout_gpus == 0 and self.elastic_gpus == 0:
            yield (), "rollout_gpus and elastic_gpus are both 0: nothing could ever generate rollouts"


class _Event(Table):
    shape = "an inline table {at_s = ..., grant = N} or {at_s, preempt = N}"
    at_s: NonNegative
    grant: Count = 0
    preempt: Count = 0
    notice_s: NonNegative | None = None

    def _problems(self, profile: Profile | None) -> Problems:
        if (self.grant > 0) == (self.preempt > 0):
            yield (), "give exactly one of grant = N or preempt = N (N > 0)"


class _Lifetime(Table):
    """One component of ``lifetime_mixture``: an exponential lifetime of mean ``mean_s``, drawn by ``weight``."""

    shape = "an inline table {weight = 0.6, mean_s = 1500.0}"
    weight: Positive
    mean_s: Positive


class _Availability(Table):
    events: list[_Event] = Field(
        [], description="a list of inline tables {at_s = ..., grant = N} or {at_s, preempt = N}"
    )
    initial_gpus: Count = 0
    grant_interval_s: NonNegative = 0.0
    grant_gpus: AtLeastOne | None = None  # None: [cluster] gpus_per_node
    lifetime_s: NonNegative | None = None
    # each grant's lifetime is exponential with the mean of a component drawn by weight (weights summing to 1);
    # not together with lifetime_s, which is then the mixture's mean
    lifetime_mixture: Annotated[list[_Lifetime], Field(min_length=1)] | None = Field(
        None, description="a non-empty list of {weight = 0.6, mean_s = 1500.0}"
    )
    reclaim_interval_s: NonNegative = 0.0
    notice_s: NonNegative = 30.0

    def _problems(self, profile: Profile | None) -> Problems:
        if self.lifetime_mixture is not None:
            if self.lifetime_s is not None:
                yield ("lifetime_mixture",), "give lifetime_s (one exponential mean) or lifetime_mixture, not both"
            total = sum(c.weight for c in self.lifetime_mixture)
            if abs(total - 1.0) > 1e-6:
                yield ("lifetime_mixture",), f"the weights must sum to 1 (got {total:g})"
        if profile is not None and self.grant_gpus is not None and self.grant_gpus % profile.gpus_per_worker:
            yield ("grant_gpus",), f"must be a multiple of the profile's gpus_per_worker ({profile.gpus_per_worker})"


class _Workload(Table):
    prompts_per_step: AtLeastOne
    group_size: AtLeastOne
    max_context_tokens: AtLeastOne = 32768
    turns: DistributionTable
    prompt_tokens: DistributionTable
    response_tokens: DistributionTable
    tool_output_tokens: DistributionTable
    tool_latency_s: DistributionTable

    def _problems(self, profile: Profile | None) -> Problems:
        capacity = None if profile is None else profile.kv_capacity_tokens
        if capacity is not None and self.max_context_tokens > capacity:
            why = "a longer trajectory could never fit one worker"
            yield ("max_context_tokens",), f"must be <= the profile's kv_capacity_tokens ({capacity}): {why}"


class _Training(Table):
    mode: Mode = "sync"
    train_step_s: Positive
    weight_sync_s: NonNegative | None = None  # None: the profile's
    staleness: Count | None = None  # None: 1 for async, 0 for sync
    join_wait_s: NonNegative | None = None  # None: the rollout driver's (pearlctl/sim/scenario.py JOIN_WAIT_S)
    first_wait_s: NonNegative | None = None

    def _problems(self, profile: Profile | None) -> Problems:
        if self.mode == "async" and self.staleness is not None and self.staleness < 1:
            yield ("staleness",), 'async needs staleness >= 1 (0 is synchronous RL: mode = "sync")'
        if self.mode == "sync" and self.staleness:
            yield ("staleness",), 'only for mode = "async"'


class _Judge(Table):
    """``[judge]``: a generative reward model that reads each finished trajectory and gives a verdict."""

    profile: str = Field(description="the judge's profile TOML path relative to the scenario file")
    rubric_tokens: Count = 0  # the rubric and instructions around a trajectory in the judge's prompt
    verdict_tokens: AtLeastOne = 1  # what the judge generates per verdict (1: a verdict probability)


class MismatchTable(Table):
    preset: Preset = "none"
    decode: PerturbationTable | None = None
    prefill: PerturbationTable | None = None
    tool_latency: PerturbationTable | None = None
    transitions: PerturbationTable | None = None


class ScenarioFile(Table):
    """The whole scenario file; its rules are those between tables."""

    scenario: _Head
    cluster: _Cluster
    availability: _Availability = _Availability()
    workload: _Workload
    training: _Training
    mismatch: MismatchTable = MismatchTable()
    judge: _Judge | None = None
    sources: dict[str, Any] = {}  # free-form citations, as text

    def _problems(self, profile: Profile | None) -> Problems:
        if self.judge is not None and not self.cluster.reward_gpus:
            yield ("cluster", "reward_gpus"), "must be > 0 with a [judge]: the reward pool serves it from the start"
        if self.judge is None and self.cluster.reward_gpus:
            yield ("cluster", "reward_gpus"), "needs a [judge] table: the model the reward pool serves"
        a, elastic = self.availability, self.cluster.elastic_gpus
        if (a.initial_gpus or a.grant_interval_s or a.events) and not elastic:
            yield ("availability",), "grants need [cluster] elastic_gpus > 0"
        if a.initial_gpus > elastic:
            yield ("availability", "initial_gpus"), f"must be <= [cluster] elastic_gpus ({elastic})"


def key_path(loc: Loc) -> str:
    """`` [workload] turns.p99``, `` [availability] lifetime_mixture[0] mean_s``: a table, then its keys."""
    if not loc:
        return ""
    out, sep = f" [{loc[0]}]", " "
    for part in loc[1:]:
        if isinstance(part, int):
            out, sep = f"{out}[{part}]", " "
        else:
            out, sep = f"{out}{sep}{part}", "."
    return out


def read(doc: Any, profile: Profile | None, where: str) -> tuple[ScenarioFile | None, list[str]]:
    """The file ``doc`` (parsed TOML) describes, or every problem found as ``<where> [table] key: ...`` lines;
    ``profile`` (None: it could not be read) is what the tables' rules check against."""
    try:
        return ScenarioFile.model_validate(doc, context={"profile": profile}), []
    except ValidationError as exc:
        return None, [f"{where}{key_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
