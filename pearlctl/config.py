"""The run spec: a TOML file that describes one RL run, and its validation.

A spec is validated completely before anything is submitted or written to state: every problem is
collected (not just the first) and reported with its key path (``pools.rollout.gpus_per_node``) and
what would be valid. Checks that need the cluster (does ``sinfo`` know the partition, do its nodes have
that many GPUs) are made by the launcher against the parsed spec; everything here is pure.

Relative paths in a spec (``model``, ``run_dir``) are resolved against the directory of the spec file,
the way compose files do, so a spec means the same thing from whatever directory it is launched.
"""

from __future__ import annotations

import math
import os
import re
import string
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pearlctl import vocabulary

POOL_KINDS = tuple(str(k) for k in vocabulary.POOL_KINDS)
GENERATION_POOLS = tuple(str(k) for k in vocabulary.GENERATION_POOLS)
BACKENDS = ("auto", "slurm", "local")

# Every pattern is matched against the whole string (``fullmatch``): ``re.match`` with ``^...$`` lets a
# final newline through (``$`` matches before it), and one newline in a rendered ``#SBATCH`` line ends
# the directives and starts a shell command.
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,39}")
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; "UNLIMITED" / "INFINITE" too.
_TIME_RE = re.compile(r"(\d{1,6}-\d{1,6}(:\d{1,6}){0,2}|\d{1,6}(:\d{1,6}){0,2}|UNLIMITED|INFINITE)")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SLURM_WORD_RE = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
# A Slurm hostlist: names, ranges and lists, e.g. ``gpu[1-3,7],head``.
_HOSTLIST_RE = re.compile(r"[A-Za-z0-9_.,\[\]-]{1,1024}")
# a Slurm feature expression (sbatch --constraint): features joined by & | , with [ ] ( ) grouping and *N counts
_CONSTRAINT_RE = re.compile(r"[A-Za-z0-9_.+&|,*\[\]()-]{1,1024}")
CONSTRAINT_WHAT = "a Slurm feature expression like a100|h100 or [rack1|rack2]&nvlink"
_MEM_RE = re.compile(r"(\d{1,12})([KMGT]?)")
# Control characters (C0 and DEL) are refused in every string of a spec: each ends up in a shell script.
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# Upper bounds: a spec can ask for a lot, but not for what no cluster has (or what Slurm cannot express).
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
MAX_CPUS_PER_TASK = 4096
MAX_PREEMPT_NOTICE_S = 65535  # Slurm's limit for T in --signal=B:SIG@T
MAX_POLL_INTERVAL_S = 3600.0
MAX_TIME_LIMIT_S = 365 * 86400  # a finite --time of at most a year (UNLIMITED is still allowed)
MAX_MEM_MB = 64 * 1024 * 1024  # 64T
MAX_PATH_CHARS = 4096
# An elastic pool's added task still PENDING after this long is cancelled (pearlctl.daemon.elastic).
DEFAULT_PENDING_TIMEOUT_S = 300.0
MIN_PENDING_TIMEOUT_S = 10.0  # Slurm's own scheduling cycle and a requeue's BeginTime wait take seconds
MAX_PENDING_TIMEOUT_S = 86400.0
TIME_WHAT = "a Slurm time (MM, HH:MM:SS, D-HH:MM:SS or UNLIMITED) of at most 365 days"
HOSTLIST_WHAT = "a Slurm node list like gpu[1-3],head (letters, digits, '.', '_', '-', ',', '[', ']')"


def has_control(value: str) -> bool:
    """Whether ``value`` holds a control character (\\x00-\\x1f or \\x7f): never allowed in a spec."""
    return _CONTROL_RE.search(value) is not None


def _printable_key(key: str) -> str:
    """A key path as it can be printed on one line: control characters escaped (``\\n``)."""
    return _CONTROL_RE.sub(lambda m: repr(m.group())[1:-1], key)


def time_limit_seconds(value: str) -> int | None:
    """Seconds of a Slurm ``--time`` value (None for UNLIMITED/INFINITE). Assumes ``_TIME_RE`` matched."""
    if value in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = value.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m, sec = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + sec
    if len(parts) == 1:  # M
        return parts[0] * 60
    if len(parts) == 2:  # M:S
        return parts[0] * 60 + parts[1]
    h, m, sec = parts
    return h * 3600 + m * 60 + sec


def time_limit_ok(value: str) -> bool:
    if not _TIME_RE.fullmatch(value):
        return False
    seconds = time_limit_seconds(value)
    return seconds is None or seconds <= MAX_TIME_LIMIT_S


def _mem_ok(value: str) -> bool:
    m = _MEM_RE.fullmatch(value)
    if m is None:
        return False
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return int(m.group(1)) * scale <= MAX_MEM_MB


def slurm_option_problems(
    *, partition: str | None = None, nodelist: str | None = None, time_limit: str | None = None
) -> list[SpecProblem]:
    """Problems with sbatch options given on the command line (``pearlctl daemon --slurm``), checked the
    way a spec's are; each problem is keyed by its option (``--partition``)."""
    problems = []
    if partition is not None and not _SLURM_WORD_RE.fullmatch(partition):
        problems.append(SpecProblem("--partition", f"must be a Slurm partition name, got {partition!r}"))
    if nodelist is not None and not _HOSTLIST_RE.fullmatch(nodelist):
        problems.append(SpecProblem("--nodelist", f"must be {HOSTLIST_WHAT}, got {nodelist!r}"))
    if time_limit is not None and not time_limit_ok(time_limit):
        problems.append(SpecProblem("--time", f"must be {TIME_WHAT}, got {time_limit!r}"))
    return problems


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec: where, and what would be right."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class SpecError(Exception):
    """A spec that cannot be used; carries every problem found."""

    def __init__(self, source: str, problems: list[SpecProblem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid run spec {source}:\n{lines}")


@dataclass(frozen=True)
class PoolSpec:
    """One pool: a Slurm array job, one array task per node."""

    name: str  # one of POOL_KINDS; a run has at most one pool of each kind
    nodes: int
    gpus_per_node: int
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None  # sbatch --constraint: the node features the pool's nodes must have
    exclude: str | None = None  # sbatch --exclude: nodes the pool must not run on
    max_nodes: int | None = None  # elastic pools may grow up to this
    # elastic pools: an added task still PENDING after this long is cancelled, and growth backs off
    pending_timeout_s: float | None = None
    requeue: bool = False
    preempt_signal: str = "USR2"
    preempt_notice_s: int = 60
    command: tuple[str, ...] | None = None
    train_command: tuple[str, ...] | None = None  # trainer pools: what the agent runs as the TRAIN worker
    engine_args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # vLLM pools: how a new weight version reaches workers on nodes without a trainer rank (WEIGHT_PATHS)
    weights: str = "disk"

    @property
    def role(self) -> str:
        return str(vocabulary.DEFAULT_ROLE[vocabulary.PoolKind(self.name)])

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["command"] = list(self.command) if self.command else None
        d["train_command"] = list(self.train_command) if self.train_command else None
        return d


ROUTER_POLICIES = ("consistent_hash", "sticky_least_loaded", "round_robin", "power_of_two", "random", "cache_aware")


@dataclass(frozen=True)
class RouterSpec:
    """``[router]``: the run's one OpenAI-compatible endpoint (pearlctl.router, started by the daemon)."""

    enabled: bool = True
    port: int = 0  # where the gateway listens on the daemon's host (0: any free port, named in status)
    policy: str = "consistent_hash"  # vllm-router's; consistent_hash keeps an episode (X-Session-ID) on one worker

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunSpec:
    name: str
    model: Path
    run_dir: Path
    policy: str
    backend: str
    poll_interval_s: float
    pools: dict[str, PoolSpec]
    source: Path
    router: RouterSpec = RouterSpec()
    # what the vLLM pools' workers run: "vllm", or "paced" with engine_profile (the profile TOML it keeps the
    # timing of): pearlctl/agent/engines/paced.py, for control-plane runs at scale without GPUs
    engine: str = "vllm"
    engine_profile: Path | None = None
    # what was let through with ``model_on_this_host=False`` and would refuse a real launch (printed by
    # `launch --dry-run`); never part of the stored spec
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": str(self.model),
            "run_dir": str(self.run_dir),
            "policy": self.policy,
            "backend": self.backend,
            "poll_interval_s": self.poll_interval_s,
            "source": str(self.source),
            "pools": {k: p.to_dict() for k, p in self.pools.items()},
            "router": self.router.to_dict(),
            "engine": self.engine,
            "engine_profile": str(self.engine_profile) if self.engine_profile else None,
        }


# --- field checkers: each returns the value or records a problem and returns None -------------------

_MISSING = object()


class _Checker:
    def __init__(self) -> None:
        self.problems: list[SpecProblem] = []

    def fail(self, key: str, message: str) -> None:
        self.problems.append(SpecProblem(_printable_key(key), message))

    def unknown_keys(self, table: dict[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
        for key in table:
            if key not in allowed:
                close = _closest(key, allowed)
                hint = f" (did you mean {close!r}?)" if close else ""
                self.fail(f"{prefix}{key}", f"unknown key{hint}; valid keys: {', '.join(allowed)}")

    def no_control(self, key: str, value: str) -> bool:
        """Record a problem (and return False) when ``value`` holds a control character."""
        if has_control(value):
            self.fail(key, f"must not contain control characters (newline, tab, \\x00-\\x1f, \\x7f), got {value!r}")
            return False
        return True

    def string(self, table, key, prefix, *, required=False, pattern=None, what="a string", default=None, check=None):
        value = table.get(key, _MISSING)
        if value is _MISSING:
            if required:
                self.fail(prefix + key, f"is required: {what}")
            return default
        if not isinstance(value, str) or not value:
            self.fail(prefix + key, f"must be {what}, got {value!r}")
            return default
        if not self.no_control(prefix + key, value):
            return default
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(prefix + key, f"must be {what}, got {value!r}")
            return default
        if check is not None and not check(value):
            self.fail(prefix + key, f"must be {what}, got {value!r}")
            return default
        return value

    def integer(self, table, key, prefix, *, minimum, maximum, required=False, default=None):
        value = table.get(key, _MISSING)
        what = f"an integer >= {minimum} and <= {maximum}"
        if value is _MISSING:
            if required:
                self.fail(prefix + key, f"is required: {what}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            self.fail(prefix + key, f"must be {what}, got {value!r}")
            return default
        return value

    def number(self, table, key, prefix, *, minimum, maximum, default):
        value = table.get(key, _MISSING)
        if value is _MISSING:
            return default
        what = f"a number >= {minimum:g} and <= {maximum:g}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(prefix + key, f"must be {what}, got {value!r}")
            return default
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(prefix + key, f"must be a finite number (not nan or inf): {what}, got {value!r}")
            return default
        if not minimum <= value <= maximum:
            self.fail(prefix + key, f"must be {what}, got {value!r}")
            return default
        return float(value)

    def boolean(self, table, key, prefix, *, default):
        value = table.get(key, _MISSING)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            self.fail(prefix + key, f"must be true or false, got {value!r}")
            return default
        return value

    def choice(self, table, key, prefix, choices, *, default):
        value = table.get(key, _MISSING)
        if value is _MISSING:
            return default
        if value not in choices:
            self.fail(prefix + key, f"must be one of {', '.join(choices)}; got {value!r}")
            return default
        return value

    def table(self, parent, key, prefix, *, required=False):
        value = parent.get(key, _MISSING)
        if value is _MISSING:
            if required:
                self.fail(prefix + key, "is required: a table")
            return None
        if not isinstance(value, dict):
            self.fail(prefix + key, f"must be a table, got {type(value).__name__}")
            return None
        return value


def _closest(word: str, options: tuple[str, ...]) -> str | None:
    import difflib

    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return match[0] if match else None


_RUN_KEYS = ("name", "model", "run_dir", "policy", "backend", "poll_interval_s", "engine", "engine_profile")
ENGINES = tuple(vocabulary.ServingEngine)
_POOL_KEYS = (
    "nodes",
    "gpus_per_node",
    "partition",
    "time_limit",
    "account",
    "qos",
    "cpus_per_task",
    "mem",
    "constraint",
    "exclude",
    "max_nodes",
    "pending_timeout_s",
    "requeue",
    "preempt_signal",
    "preempt_notice_s",
    "command",
    "train_command",
    "engine_args",
    "env",
    "weights",
)
# [pools.<vllm pool>] weights: "disk" (every worker reloads each version from the node-local store or the shared
# disk: the default) or "broadcast" (its workers get the pearl_gloo receiver, and trainer rank 0 sends each
# version to those on nodes without a trainer rank before it is published; docs/weights.md)
WEIGHT_PATHS = ("disk", "broadcast")
WEIGHTS_POOLS = GENERATION_POOLS  # the pools whose vLLM workers serve the trainer's weights
# engine_args keys the broadcast sets itself (pearlctl.trainer.broadcast.server_engine_args)
BROADCAST_ENGINE_KEYS = ("weight_transfer_config", "worker_extension_cls")
# USR1 is left alone on purpose: NCCL may use it (submitit notes the same).
PREEMPT_SIGNALS = ("USR2", "TERM", "INT", "HUP", "URG")


def _argv(c: _Checker, raw: dict[str, Any], key: str, prefix: str, *, placeholders: bool = False) -> list[str] | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value)):
        c.fail(prefix + key, f"must be a non-empty list of strings (an argv), got {value!r}")
        return None
    if value is None:
        return None
    ok = True
    for i, arg in enumerate(value):
        if not c.no_control(f"{prefix}{key}[{i}]", arg):
            ok = False
        elif placeholders and not _placeholders_ok(arg):
            c.fail(
                f"{prefix}{key}[{i}]",
                f"braces must be placeholders like {{python}}, {{repo}}, {{model}} or {{run_dir}} "
                f"(write a literal brace as {{{{ or }}}}), got {arg!r}",
            )
            ok = False
    return value if ok else None


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


def _engine_value_problem(value: Any) -> str | None:
    """What is wrong with an engine_args value (they travel as JSON), or None."""
    if isinstance(value, bool | int):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "must be a finite number (not nan or inf)"
    if isinstance(value, str):
        return "must not contain control characters (newline, tab, ...)" if has_control(value) else None
    if isinstance(value, list):
        for item in value:
            if isinstance(item, list | dict) or _engine_value_problem(item) is not None:
                return "a list must hold strings (without control characters), finite numbers or booleans"
        return None
    return "must be a string, number, boolean or list"


def _check_pool(c: _Checker, name: str, raw: dict[str, Any]) -> PoolSpec | None:
    p = f"pools.{name}."
    c.unknown_keys(raw, _POOL_KEYS, p)
    before = len(c.problems)
    nodes = c.integer(raw, "nodes", p, minimum=1, maximum=MAX_NODES, required=True)
    min_gpus = 1 if name == vocabulary.PoolKind.TRAINER else 0
    gpus = c.integer(raw, "gpus_per_node", p, minimum=min_gpus, maximum=MAX_GPUS_PER_NODE, required=True)
    partition = c.string(raw, "partition", p, pattern=_SLURM_WORD_RE, what="a Slurm partition name")
    time_limit = c.string(raw, "time_limit", p, check=time_limit_ok, what=TIME_WHAT)
    account = c.string(raw, "account", p, pattern=_SLURM_WORD_RE, what="a Slurm account name")
    qos = c.string(raw, "qos", p, pattern=_SLURM_WORD_RE, what="a Slurm QOS name")
    cpus = c.integer(raw, "cpus_per_task", p, minimum=1, maximum=MAX_CPUS_PER_TASK)
    mem = c.string(raw, "mem", p, check=_mem_ok, what="a Slurm memory size like 16G, at most 64T")
    constraint = c.string(raw, "constraint", p, pattern=_CONSTRAINT_RE, what=CONSTRAINT_WHAT)
    exclude = c.string(raw, "exclude", p, pattern=_HOSTLIST_RE, what=HOSTLIST_WHAT)
    max_nodes = c.integer(raw, "max_nodes", p, minimum=1, maximum=MAX_NODES)
    if max_nodes is not None and name != vocabulary.PoolKind.ELASTIC:
        c.fail(p + "max_nodes", "only an elastic pool can grow; remove it or move it to [pools.elastic]")
    if max_nodes is not None and nodes is not None and max_nodes < nodes:
        c.fail(p + "max_nodes", f"must be >= nodes ({nodes}), got {max_nodes}")
    pending_timeout = c.number(
        raw,
        "pending_timeout_s",
        p,
        minimum=MIN_PENDING_TIMEOUT_S,
        maximum=MAX_PENDING_TIMEOUT_S,
        default=DEFAULT_PENDING_TIMEOUT_S if name == vocabulary.PoolKind.ELASTIC else None,
    )
    if "pending_timeout_s" in raw and name != vocabulary.PoolKind.ELASTIC:
        c.fail(
            p + "pending_timeout_s",
            "only an elastic pool adds tasks that may wait in the queue; remove it or move it to [pools.elastic]",
        )
    requeue = c.boolean(raw, "requeue", p, default=(name == vocabulary.PoolKind.ELASTIC))
    signal = c.choice(raw, "preempt_signal", p, PREEMPT_SIGNALS, default="USR2")
    notice = c.integer(raw, "preempt_notice_s", p, minimum=1, maximum=MAX_PREEMPT_NOTICE_S, default=60)
    command = _argv(c, raw, "command", p)
    train_command = _argv(c, raw, "train_command", p, placeholders=True)
    if train_command is not None and name != vocabulary.PoolKind.TRAINER:
        c.fail(p + "train_command", "only the trainer pool runs a training command; move it to [pools.trainer]")
    if train_command is not None and nodes is not None and nodes > 1 and "--standalone" in train_command:
        c.fail(
            p + "train_command",
            f"--standalone makes each of the {nodes} nodes a trainer of its own; drop it: pearlctl gives torchrun "
            "the multi-node rendezvous (PET_NNODES, PET_NODE_RANK, PET_RDZV_*; docs/run-spec.md)",
        )
    engine_args = c.table(raw, "engine_args", p) or {}
    for k, v in engine_args.items():
        if not c.no_control(f"{p}engine_args.{k}", k):
            continue
        problem = _engine_value_problem(v)
        if problem is not None:
            c.fail(f"{p}engine_args.{k}", f"{problem}, got {v!r}")
    env = c.table(raw, "env", p) or {}
    for k, v in env.items():
        if not _ENV_KEY_RE.fullmatch(k):
            c.fail(f"{p}env.{k}", "must be a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if not isinstance(v, str):
            c.fail(f"{p}env.{k}", f'must be a string, got {v!r} (quote numbers: "1")')
        else:
            c.no_control(f"{p}env.{k}", v)
    weights = c.choice(raw, "weights", p, WEIGHT_PATHS, default="disk")
    if "weights" in raw and name not in WEIGHTS_POOLS:
        c.fail(
            p + "weights",
            f"only the pools whose vLLM workers serve the trainer's weights ({', '.join(WEIGHTS_POOLS)}) take it; "
            "remove it",
        )
    if weights == "broadcast":
        for key in BROADCAST_ENGINE_KEYS:
            if key in engine_args:
                c.fail(
                    f"{p}engine_args.{key}",
                    'weights = "broadcast" sets it (the pearl_gloo receiver); remove it, or use weights = "disk"',
                )
    rdzv_port = env.get("PEARL_RDZV_PORT")
    if isinstance(rdzv_port, str) and not (rdzv_port.isdigit() and 1024 <= int(rdzv_port) <= 65535):
        c.fail(f"{p}env.PEARL_RDZV_PORT", f"must be a TCP port from 1024 to 65535, got {rdzv_port!r}")
    if len(c.problems) > before:
        return None
    return PoolSpec(
        name=name,
        nodes=nodes,
        gpus_per_node=gpus,
        partition=partition,
        time_limit=time_limit,
        account=account,
        qos=qos,
        cpus_per_task=cpus,
        mem=mem,
        constraint=constraint,
        exclude=exclude,
        max_nodes=max_nodes,
        pending_timeout_s=pending_timeout,
        requeue=requeue,
        preempt_signal=signal,
        preempt_notice_s=notice,
        command=tuple(command) if command else None,
        train_command=tuple(train_command) if train_command else None,
        engine_args=dict(engine_args),
        env={k: str(v) for k, v in env.items()},
        weights=weights,
    )


def _path(c: _Checker, key: str, raw: str | None, base: Path) -> Path | None:
    """``raw`` resolved against the spec's directory; None (and a problem) when it cannot be used: the
    resolved path (the spec's directory and ``~`` included) must be free of control characters too."""
    if raw is None:
        return None
    try:
        path = (base / os.path.expanduser(raw)).resolve()
    except (OSError, ValueError, RuntimeError) as exc:
        c.fail(key, f"cannot resolve path {raw!r}: {exc}")
        return None
    if not c.no_control(key, str(path)):
        return None
    if len(str(path)) > MAX_PATH_CHARS:
        c.fail(key, f"must be a path of at most {MAX_PATH_CHARS} characters, got {len(str(path))}")
        return None
    return path


def parse_spec(
    data: dict[str, Any], source: Path, known_policies: tuple[str, ...], *, model_on_this_host: bool = True
) -> RunSpec:
    """Validate a decoded TOML document. Raises SpecError listing every problem. ``model_on_this_host=False``
    (`launch --dry-run`): a model path missing here is a warning in ``RunSpec.warnings``, not a problem — it may
    exist only on the compute nodes; a real launch refuses it."""
    c = _Checker()
    warnings: list[str] = []
    base = source.parent
    c.unknown_keys(data, ("run", "pools", "router"), "")
    run = c.table(data, "run", "", required=True) or {}
    c.unknown_keys(run, _RUN_KEYS, "run.")
    name = c.string(
        run,
        "name",
        "run.",
        required=True,
        pattern=_NAME_RE,
        what="a name of letters, digits, '-' or '_' (max 40), starting with a letter",
    )
    model_raw = c.string(run, "model", "run.", required=True, what="a path to the model directory")
    model = _path(c, "run.model", model_raw, base)
    if model is not None:
        try:
            if not model.exists() and not model_on_this_host:
                warnings.append(f"run.model: path {model} does not exist on this host (it may exist only on the "
                                "compute nodes); a real launch refuses it")  # fmt: skip
            elif not model.exists():
                c.fail("run.model", f"path {model} does not exist; give the model directory (HF format)")
            elif not os.access(model, os.R_OK):
                c.fail("run.model", f"path {model} is not readable")
        except OSError as exc:
            c.fail("run.model", f"cannot use path {model}: {exc.strerror or exc}")
    run_dir_raw = c.string(run, "run_dir", "run.", required=True, what="a directory for logs and checkpoints")
    run_dir = _path(c, "run.run_dir", run_dir_raw, base)
    try:
        if run_dir is not None and any(ch.isspace() for ch in str(run_dir)):
            c.fail("run.run_dir", f"{str(run_dir)!r} contains whitespace: Slurm's #SBATCH --output line would be "
                   "split there; use a directory path without spaces")  # fmt: skip
        elif run_dir is not None and run_dir.exists() and not run_dir.is_dir():
            c.fail("run.run_dir", f"{run_dir} exists and is not a directory")
    except OSError as exc:
        c.fail("run.run_dir", f"cannot use path {run_dir}: {exc.strerror or exc}")
    policy = c.choice(run, "policy", "run.", known_policies, default="never")
    backend = c.choice(run, "backend", "run.", BACKENDS, default="auto")
    poll = c.number(
        run, "poll_interval_s", "run.", minimum=1.0, maximum=MAX_POLL_INTERVAL_S, default=vocabulary.POLL_INTERVAL_S
    )
    engine = c.choice(run, "engine", "run.", ENGINES, default="vllm")
    engine_profile = _engine_profile(c, run, engine, base)

    router_raw = c.table(data, "router", "") or {}
    c.unknown_keys(router_raw, ("enabled", "port", "policy"), "router.")
    router = RouterSpec(
        enabled=c.boolean(router_raw, "enabled", "router.", default=True),
        port=c.integer(router_raw, "port", "router.", minimum=0, maximum=65535, default=0),
        policy=c.choice(router_raw, "policy", "router.", ROUTER_POLICIES, default="consistent_hash"),
    )

    pools_raw = c.table(data, "pools", "", required=True) or {}
    pools: dict[str, PoolSpec] = {}
    for pname, praw in pools_raw.items():
        if pname not in POOL_KINDS:
            close = _closest(pname, POOL_KINDS)
            hint = f" (did you mean {close!r}?)" if close else ""
            c.fail(f"pools.{pname}", f"unknown pool{hint}; valid pools: {', '.join(POOL_KINDS)}")
            continue
        if not isinstance(praw, dict):
            c.fail(f"pools.{pname}", f"must be a table, got {type(praw).__name__}")
            continue
        pool = _check_pool(c, pname, praw)
        if pool is not None:
            pools[pname] = pool
    if isinstance(data.get("pools"), dict):
        if vocabulary.PoolKind.TRAINER not in pools_raw:
            c.fail("pools.trainer", "is required: an RL run needs a trainer pool")
        if not any(k in pools_raw for k in GENERATION_POOLS):
            c.fail("pools", "needs a rollout or an elastic pool to generate with")
    if engine == vocabulary.ServingEngine.PACED:
        _check_paced_pools(c, pools)
    if c.problems:
        raise SpecError(str(source), c.problems)
    return RunSpec(
        name=name,
        model=model,
        run_dir=run_dir,
        policy=policy,
        backend=backend,
        poll_interval_s=poll,
        pools=_borrowed_engine_args(pools),
        source=source.resolve(),
        router=router,
        engine=str(engine),
        engine_profile=engine_profile,
        warnings=tuple(warnings),
    )


def _borrowed_engine_args(pools: dict[str, PoolSpec]) -> dict[str, PoolSpec]:
    """A trainer pool that sets no ``engine_args`` gets its rollout pool's (else its elastic pool's): the vLLM
    workers on its borrowed GPUs then serve what the rollout workers serve (the same ``max_model_len``, so a
    turn that fits one fits the other)."""
    trainer = pools.get(vocabulary.PoolKind.TRAINER)
    source = pools.get(vocabulary.PoolKind.ROLLOUT) or pools.get(vocabulary.PoolKind.ELASTIC)
    if trainer is None or trainer.engine_args or source is None or not source.engine_args:
        return pools
    return {**pools, vocabulary.PoolKind.TRAINER: replace(trainer, engine_args=dict(source.engine_args))}


def _engine_profile(c: _Checker, run: dict, engine: str | None, base: Path) -> Path | None:
    """``[run] engine_profile``: required with ``engine = "paced"`` (a profile TOML that loads), refused without."""
    paced = engine == vocabulary.ServingEngine.PACED
    raw = c.string(run, "engine_profile", "run.", required=paced, what="a path to a profile TOML (examples/profiles)")
    if raw is None:
        return None
    if not paced:
        c.fail("run.engine_profile", 'is read only with engine = "paced"; remove it, or set engine = "paced"')
        return None
    path = _path(c, "run.engine_profile", raw, base)
    if path is not None:
        from pearlctl.planner.profile import ProfileError, load

        try:
            load(path)
        except ProfileError as exc:
            c.fail("run.engine_profile", str(exc))
    return path


def _check_paced_pools(c: _Checker, pools: dict[str, PoolSpec]) -> None:
    """A paced run's pools use only what the paced engine does: its engine_args (the trainer's too: they start the
    workers on its lent GPUs), weights from disk."""
    for name, pool in pools.items():
        unknown = sorted(set(pool.engine_args) - set(vocabulary.PACED_ENGINE_ARGS))
        if unknown:
            c.fail(
                f"pools.{name}.engine_args",
                f'{", ".join(unknown)} mean nothing to the paced engine (run.engine = "paced"); it reads '
                f"{', '.join(vocabulary.PACED_ENGINE_ARGS)}",
            )
        if pool.weights != "disk":
            c.fail(f"pools.{name}.weights", 'the paced engine reloads weights from disk only: use weights = "disk"')


def load_spec(
    path: str | Path,
    known_policies: tuple[str, ...],
    overrides: dict[str, Any] | None = None,
    *,
    model_on_this_host: bool = True,
) -> RunSpec:
    """Read and validate a spec file (``model_on_this_host``: ``parse_spec``'s). Unreadable or malformed files
    raise SpecError too.

    ``overrides`` replace keys of ``[run]`` (command-line ``--name``, ``--run-dir``, ``--backend``) before
    validation, so they are checked like the file; give paths in them absolute.
    """
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise SpecError(str(source), [SpecProblem("<file>", f"cannot read: {exc.strerror or exc}")]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(source), [SpecProblem("<file>", f"not valid TOML: {exc}")]) from exc
    if overrides:
        run = data.get("run")
        if isinstance(run, dict):
            run.update(overrides)
    return parse_spec(data, source, known_policies, model_on_this_host=model_on_this_host)
