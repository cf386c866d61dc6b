"""The run spec's TOML tables as pydantic models: for every key, what it takes (type, bounds, form, choices),
its default, and what it says when it is wrong; then the rules between keys. pearlctl.config.load validates
a decoded document as ``Document`` and words each error with pearlctl.config.errors.

Every value ends up in a shell script (a pool's sbatch script), so the tables are strict: unknown keys are
refused by name, nothing is coerced (``"3"`` is no integer, ``1`` no boolean, ``3.0`` no node count), numbers
are finite and bounded (pearlctl.config.values), and no string, resolved path, argv element, ``engine_args``
key or value, or ``env`` name or value holds a control character.

Every problem is reported, not just the first: pydantic checks every key; a rule between keys runs where the
keys it reads are valid (a field validator reading ``info.data``); the one rule on which tables are there (a
generating pool) is checked before their contents. Two rules read a whole table and run once it is otherwise
valid: the weight broadcast's (a pool's) and the paced engine's (the document's). Validation takes a
``SpecContext``: the spec's directory, the policies known here.
"""

import math
import os
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pearlctl import vocabulary
from pearlctl.config import values as v
from pearlctl.config.errors import invalid, problem, problems
from pearlctl.config.problems import SpecProblem
from pearlctl.vocabulary import PoolKind, ServingEngine


@dataclass
class SpecContext:
    """What validating a spec needs beyond the document, and what it finds besides problems of keys."""

    base: Path  # the spec file's directory: relative paths resolve against it, as compose files do
    policies: tuple[str, ...]  # the borrowing policies known here (pearlctl.policies.known_policies)
    model_on_this_host: bool = True  # False (`launch --dry-run`): a missing model path is a warning
    problems: list[SpecProblem] = field(default_factory=list)  # the rule on which tables are there
    warnings: list[str] = field(default_factory=list)


# --- the values keys take --------------------------------------------------------------------------------------


def _no_control(value: Any) -> Any:
    """(before a string's other checks) A control character is reported as such, not as a wrong form."""
    if isinstance(value, str) and v.has_control(value):
        raise problem(f"{v.CONTROL_WHAT}, got {value!r}")
    return value


def _form(test: Callable[[str], object]) -> AfterValidator:
    def check(value: str) -> str:
        if not test(value):
            raise invalid()
        return value

    return AfterValidator(check)


def _text(what: str, test: Callable[[str], object] | None = None) -> Any:
    """A non-empty string without control characters, of ``test``'s form; ``what`` says what it is."""
    checks = (_form(test),) if test is not None else ()
    return Annotated[(str, Field(min_length=1, description=what), *checks, BeforeValidator(_no_control))]


def _int(low: int, high: int) -> Any:
    return Annotated[int, Field(ge=low, le=high, description=f"an integer >= {low} and <= {high}")]


def _number(low: float, high: float) -> Any:
    """A finite number (an integer is taken as a float)."""
    return Annotated[
        float, Field(ge=low, le=high, allow_inf_nan=False, description=f"a number >= {low:g} and <= {high:g}")
    ]


def _choice(options: tuple[str, ...]) -> Any:
    return Annotated[Literal[options], Field(description=f"one of {', '.join(options)}")]


def _resolved(value: Any, info: ValidationInfo) -> Any:
    """(before) A path string resolved against the spec's directory (and ``~``): the resolved path must be free
    of control characters too (the spec's directory, the home directory) and at most MAX_PATH_CHARS long."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise invalid()
    _no_control(value)
    try:
        path = (info.context.base / os.path.expanduser(value)).resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        raise problem(f"cannot resolve path {value!r}: {exc}") from exc
    _no_control(str(path))
    if len(str(path)) > v.MAX_PATH_CHARS:
        raise problem(f"must be a path of at most {v.MAX_PATH_CHARS} characters, got {len(str(path))}")
    return path


def _argv_shape(value: Any) -> Any:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise problem(f"must be a non-empty list of strings (an argv), got {value!r}")
    return value


def _placeholders_ok(arg: str) -> bool:
    """Whether the launcher can expand ``arg``'s ``{name}`` placeholders (pearlctl.ops.launcher.expand_command):
    only plain names, no attributes, indexes, conversions or format specs; braces balanced."""
    try:
        fields = list(string.Formatter().parse(arg))
    except ValueError:
        return False
    return all(
        name is None or (name.isidentifier() and not spec and conversion is None)
        for _, name, spec, conversion in fields
    )


def _placeholders(arg: str) -> str:
    if not _placeholders_ok(arg):
        raise problem(
            f"braces must be placeholders like {{python}}, {{repo}}, {{model}} or {{run_dir}} "
            f"(write a literal brace as {{{{ or }}}}), got {arg!r}"
        )
    return arg


def _engine_value_problem(value: Any) -> str | None:
    """What is wrong with an engine_args value (they travel as JSON), or None."""
    if isinstance(value, bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "must be a finite number (not nan or inf)"
    if isinstance(value, str):
        return "must not contain control characters (newline, tab, ...)" if v.has_control(value) else None
    if isinstance(value, list):
        for item in value:
            if isinstance(item, list | dict) or _engine_value_problem(item) is not None:
                return "a list must hold strings (without control characters), finite numbers or booleans"
        return None
    return "must be a string, number, boolean or list"


def _engine_value(value: Any) -> Any:
    what = _engine_value_problem(value)
    if what is not None:
        raise problem(f"{what}, got {value!r}")
    return value


def _env_name(name: str) -> str:
    if not v.ENV_KEY_RE.fullmatch(name):
        raise problem("must be a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    return name


def _env_value(value: Any) -> Any:
    if not isinstance(value, str):
        raise problem(f'must be a string, got {value!r} (quote numbers: "1")')
    return _no_control(value)


NodeCount = _int(1, v.MAX_NODES)
GpuCount = _int(0, v.MAX_GPUS_PER_NODE)
TrainerGpuCount = _int(1, v.MAX_GPUS_PER_NODE)  # a trainer trains on GPUs
CpuCount = _int(1, v.MAX_CPUS_PER_TASK)
NoticeSeconds = _int(1, v.MAX_PREEMPT_NOTICE_S)
Port = _int(0, 65535)
PollInterval = _number(1.0, v.MAX_POLL_INTERVAL_S)
PendingTimeout = _number(v.MIN_PENDING_TIMEOUT_S, v.MAX_PENDING_TIMEOUT_S)
Backend = _choice(v.BACKENDS)
Engine = _choice(v.ENGINES)
RouterPolicy = _choice(v.ROUTER_POLICIES)
PreemptSignal = _choice(v.PREEMPT_SIGNALS)
WeightPath = _choice(v.WEIGHT_PATHS)
Partition = _text("a Slurm partition name", v.SLURM_WORD_RE.fullmatch)
Account = _text("a Slurm account name", v.SLURM_WORD_RE.fullmatch)
Qos = _text("a Slurm QOS name", v.SLURM_WORD_RE.fullmatch)
TimeLimit = _text(v.TIME_WHAT, v.time_limit_ok)
Memory = _text(v.MEM_WHAT, v.mem_ok)
Constraint = _text(v.CONSTRAINT_WHAT, v.CONSTRAINT_RE.fullmatch)
NodeList = _text(v.HOSTLIST_WHAT, v.HOSTLIST_RE.fullmatch)
Name = _text("a name of letters, digits, '-' or '_' (max 40), starting with a letter", v.NAME_RE.fullmatch)
SpecPath = Annotated[Path, BeforeValidator(_resolved)]
Flag = Annotated[bool, Field(description="true or false")]
Argv = Annotated[list[Annotated[str, BeforeValidator(_no_control)]], BeforeValidator(_argv_shape)]
# train_command: {python}, {repo}, {model} and {run_dir} are filled in by the launcher
TrainArgv = Annotated[
    list[Annotated[str, AfterValidator(_placeholders), BeforeValidator(_no_control)]], BeforeValidator(_argv_shape)
]
EngineArgs = dict[Annotated[str, BeforeValidator(_no_control)], Annotated[Any, AfterValidator(_engine_value)]]
Env = dict[Annotated[str, AfterValidator(_env_name)], Annotated[str, BeforeValidator(_env_value)]]
PROFILE_WHAT = "a path to a profile TOML (examples/profiles)"

# keys that only some kinds of pool take -> (those kinds, what any other pool's table says when it has the key)
ONLY_IN: dict[str, tuple[tuple[str, ...], str]] = {
    "max_nodes": ((PoolKind.ELASTIC,), "only an elastic pool can grow; remove it or move it to [pools.elastic]"),
    "pending_timeout_s": (
        (PoolKind.ELASTIC,),
        "only an elastic pool adds tasks that may wait in the queue; remove it or move it to [pools.elastic]",
    ),
    "train_command": ((PoolKind.TRAINER,), "only the trainer pool runs a training command; move it to [pools.trainer]"),
    "model": (
        (PoolKind.REWARD,),
        "only a reward pool serves a model of its own (its judge); the other pools serve [run] model: remove it",
    ),
    "weights": (
        v.WEIGHTS_POOLS,
        f"only the pools whose vLLM workers serve the trainer's weights ({', '.join(v.WEIGHTS_POOLS)}) take it; "
        "remove it",
    ),
}


def _model_here(model: Path, info: ValidationInfo, where: str) -> Path:
    """A model directory (``where`` names its key): one missing on this host is a warning only with
    ``model_on_this_host=False`` (it may exist only on the compute nodes); a real launch refuses it."""
    try:
        if not model.exists() and not info.context.model_on_this_host:
            info.context.warnings.append(
                f"{where}: path {model} does not exist on this host (it may exist only on the compute nodes); "
                "a real launch refuses it"
            )
        elif not model.exists():
            raise problem(f"path {model} does not exist; give the model directory (HF format)")
        elif not os.access(model, os.R_OK):
            raise problem(f"path {model} is not readable")
    except OSError as exc:
        raise problem(f"cannot use path {model}: {exc.strerror or exc}") from exc
    return model


# --- the tables --------------------------------------------------------------------------------------------------


class _Table(BaseModel):
    """A TOML table: strict, unknown keys refused, frozen once valid. A key that may be left out defaults to
    None while its type has none: it is never given as null (TOML has no null)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RunTable(_Table):
    """``[run]`` (docs/run-spec.md)."""

    name: Name
    model: SpecPath = Field(description="a path to the model directory")
    run_dir: SpecPath = Field(description="a directory for logs and checkpoints")
    policy: str = "never"
    backend: Backend = "auto"
    poll_interval_s: PollInterval = vocabulary.POLL_INTERVAL_S
    engine: Engine = str(ServingEngine.VLLM)
    engine_profile: SpecPath | None = Field(None, description=PROFILE_WHAT, validate_default=True)

    @field_validator("model")
    @classmethod
    def _model_is_here(cls, model: Path, info: ValidationInfo) -> Path:
        return _model_here(model, info, "run.model")

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_usable(cls, run_dir: Path) -> Path:
        if any(ch.isspace() for ch in str(run_dir)):
            raise problem(
                f"{str(run_dir)!r} contains whitespace: Slurm's #SBATCH --output line would be split there; use a "
                "directory path without spaces"
            )
        try:
            if run_dir.exists() and not run_dir.is_dir():
                raise problem(f"{run_dir} exists and is not a directory")
        except OSError as exc:
            raise problem(f"cannot use path {run_dir}: {exc.strerror or exc}") from exc
        return run_dir

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_is_known(cls, policy: Any, info: ValidationInfo) -> Any:
        if policy not in info.context.policies:
            raise problem(f"must be one of {', '.join(info.context.policies)}; got {policy!r}")
        return policy

    @field_validator("engine_profile")
    @classmethod
    def _profile_with_paced(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        """Required with ``engine = "paced"`` (a profile TOML that loads), refused without."""
        paced = info.data.get("engine") == ServingEngine.PACED
        if path is None and paced:
            raise problem(f"is required: {PROFILE_WHAT}")
        if path is not None and not paced:
            raise problem('is read only with engine = "paced"; remove it, or set engine = "paced"')
        if path is not None:
            from pearlctl.planner.profile import ProfileError, load

            try:
                load(path)
            except ProfileError as exc:
                raise problem(str(exc)) from exc
        return path


class RouterTable(_Table):
    """``[router]``: the run's one OpenAI-compatible endpoint."""

    enabled: Flag = True
    port: Port = 0
    policy: RouterPolicy = "consistent_hash"


class Pool(_Table):
    """``[pools.<kind>]``: one pool, a Slurm array job of one task per node. A subclass per kind (``kind``)."""

    kind: ClassVar[PoolKind]

    nodes: NodeCount
    gpus_per_node: GpuCount
    partition: Partition = None
    time_limit: TimeLimit = None
    account: Account = None
    qos: Qos = None
    cpus_per_task: CpuCount = None
    mem: Memory = None
    constraint: Constraint = None
    exclude: NodeList = None
    max_nodes: NodeCount = None  # elastic pools may grow up to this
    pending_timeout_s: PendingTimeout = None
    requeue: Flag = False
    preempt_signal: PreemptSignal = "USR2"
    preempt_notice_s: NoticeSeconds = 60
    command: Argv = None
    train_command: TrainArgv = None
    engine_args: EngineArgs = {}
    env: Env = {}
    weights: WeightPath = "disk"
    model: SpecPath | None = None  # a reward pool's judge (default: [run] model)

    @field_validator(*ONLY_IN, mode="before")
    @classmethod
    def _taken_by_this_kind(cls, value: Any, info: ValidationInfo) -> Any:
        kinds, refusal = ONLY_IN[info.field_name]
        if cls.kind not in kinds:
            raise problem(refusal)
        return value

    @field_validator("model")
    @classmethod
    def _model_is_here(cls, model: Path | None, info: ValidationInfo) -> Path | None:
        return None if model is None else _model_here(model, info, f"pools.{cls.kind}.model")

    @field_validator("max_nodes")
    @classmethod
    def _at_least_nodes(cls, max_nodes: int | None, info: ValidationInfo) -> int | None:
        nodes = info.data.get("nodes")
        if max_nodes is not None and nodes is not None and max_nodes < nodes:
            raise problem(f"must be >= nodes ({nodes}), got {max_nodes}")
        return max_nodes

    @field_validator("train_command")
    @classmethod
    def _not_standalone(cls, argv: list[str] | None, info: ValidationInfo) -> list[str] | None:
        nodes = info.data.get("nodes")
        if argv is not None and nodes is not None and nodes > 1 and "--standalone" in argv:
            raise problem(
                f"--standalone makes each of the {nodes} nodes a trainer of its own; drop it: pearlctl gives torchrun "
                "the multi-node rendezvous (PET_NNODES, PET_NODE_RANK, PET_RDZV_*; docs/run-spec.md)"
            )
        return argv

    @field_validator("env")
    @classmethod
    def _rendezvous_port(cls, env: dict[str, str]) -> dict[str, str]:
        port = env.get("PEARL_RDZV_PORT")
        if port is not None and not (port.isascii() and port.isdigit() and 1024 <= int(port) <= 65535):
            raise problem(f"must be a TCP port from 1024 to 65535, got {port!r}", at="PEARL_RDZV_PORT")
        return env

    @model_validator(mode="after")
    def _broadcast_sets_its_own(self) -> Self:
        if self.weights == "broadcast":
            said = 'weights = "broadcast" sets it (the pearl_gloo receiver); remove it, or use weights = "disk"'
            clash = {f"engine_args.{key}": said for key in v.BROADCAST_ENGINE_KEYS if key in self.engine_args}
            if clash:
                raise problems(clash)
        return self


class TrainerPool(Pool):
    kind = PoolKind.TRAINER
    gpus_per_node: TrainerGpuCount


class RolloutPool(Pool):
    kind = PoolKind.ROLLOUT


class ElasticPool(Pool):
    """Requeued after a preemption; an added task still PENDING after ``pending_timeout_s`` is cancelled."""

    kind = PoolKind.ELASTIC
    requeue: Flag = True
    pending_timeout_s: PendingTimeout = v.DEFAULT_PENDING_TIMEOUT_S


class RewardPool(Pool):
    kind = PoolKind.REWARD


class Pools(_Table):
    """``[pools]``: at most one pool of each kind (vocabulary.POOL_KINDS, in that order)."""

    key_noun: ClassVar[str] = "pool"

    trainer: TrainerPool = Field(description="an RL run needs a trainer pool")
    rollout: RolloutPool = None
    elastic: ElasticPool = None
    reward: RewardPool = None

    @model_validator(mode="before")
    @classmethod
    def _one_generates(cls, data: Any, info: ValidationInfo) -> Any:
        """Reported with the pools' own problems, not after them: checked on the keys, before the tables."""
        if isinstance(data, dict) and not any(kind in data for kind in vocabulary.GENERATION_POOLS):
            info.context.problems.append(SpecProblem("pools", "needs a rollout or an elastic pool to generate with"))
        return data

    def present(self) -> dict[str, Pool]:
        """The pools the spec has, by kind."""
        return {kind: pool for kind in type(self).model_fields if (pool := getattr(self, kind)) is not None}


class Document(_Table):
    """A whole run spec."""

    run: RunTable = Field(description="a table")
    pools: Pools = Field(description="a table")
    router: RouterTable = Field(default_factory=RouterTable)

    @model_validator(mode="after")
    def _paced_engine_does_it(self) -> Self:
        """A paced run's pools use only what the paced engine does: its engine_args (the trainer's too: they start
        the workers on its lent GPUs), weights from disk."""
        if self.run.engine != ServingEngine.PACED:
            return self
        found = {}
        for kind, pool in self.pools.present().items():
            unknown = sorted(set(pool.engine_args) - set(vocabulary.PACED_ENGINE_ARGS))
            if unknown:
                found[f"pools.{kind}.engine_args"] = (
                    f'{", ".join(unknown)} mean nothing to the paced engine (run.engine = "paced"); it reads '
                    f"{', '.join(vocabulary.PACED_ENGINE_ARGS)}"
                )
            if pool.weights != "disk":
                found[f"pools.{kind}.weights"] = 'the paced engine reloads weights from disk only: use weights = "disk"'
        if found:
            raise problems(found)
        return self


RUN_KEYS = tuple(RunTable.model_fields)
POOL_KEYS = tuple(Pool.model_fields)
