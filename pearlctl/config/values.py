"""The forms and bounds of a spec's values: Slurm words, times, memory sizes, node lists, and the upper bound
of every count. Pure functions and constants, shared by the spec's tables (pearlctl.config.tables) and by
the command-line options that take the same Slurm values (``slurm_option_problems``).

Every pattern is matched against the whole string (``fullmatch``): ``re.match`` with ``^...$`` lets a final
newline through (``$`` matches before it), and one newline in a rendered ``#SBATCH`` line ends the directives
and starts a shell command.
"""

from __future__ import annotations

import re

from pearlctl import vocabulary
from pearlctl.config.problems import SpecProblem

NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,39}")
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; "UNLIMITED" / "INFINITE" too.
TIME_RE = re.compile(r"(\d{1,6}-\d{1,6}(:\d{1,6}){0,2}|\d{1,6}(:\d{1,6}){0,2}|UNLIMITED|INFINITE)")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SLURM_WORD_RE = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
# A Slurm hostlist: names, ranges and lists, e.g. ``gpu[1-3,7],head``.
HOSTLIST_RE = re.compile(r"[A-Za-z0-9_.,\[\]-]{1,1024}")
# a Slurm feature expression (sbatch --constraint): features joined by & | , with [ ] ( ) grouping and *N counts
CONSTRAINT_RE = re.compile(r"[A-Za-z0-9_.+&|,*\[\]()-]{1,1024}")
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

# The choices of a spec's keys that take one of a few words.
BACKENDS = ("auto", "slurm", "local")
ENGINES = tuple(str(e) for e in vocabulary.ServingEngine)
ROUTER_POLICIES = ("consistent_hash", "sticky_least_loaded", "round_robin", "power_of_two", "random", "cache_aware")
# USR1 is left alone on purpose: NCCL may use it (submitit notes the same).
PREEMPT_SIGNALS = ("USR2", "TERM", "INT", "HUP", "URG")
# [pools.<vllm pool>] weights: "disk" (every worker reloads each version from the node-local store or the shared
# disk: the default) or "broadcast" (its workers get the pearl_gloo receiver, and trainer rank 0 sends each
# version to those on nodes without a trainer rank before it is published; docs/weights.md)
WEIGHT_PATHS = ("disk", "broadcast")
WEIGHTS_POOLS = tuple(str(k) for k in vocabulary.GENERATION_POOLS)  # the pools whose vLLM workers serve weights
# engine_args keys the broadcast sets itself (pearlctl.trainer.broadcast.server_engine_args)
BROADCAST_ENGINE_KEYS = ("weight_transfer_config", "worker_extension_cls")

TIME_WHAT = "a Slurm time (MM, HH:MM:SS, D-HH:MM:SS or UNLIMITED) of at most 365 days"
HOSTLIST_WHAT = "a Slurm node list like gpu[1-3],head (letters, digits, '.', '_', '-', ',', '[', ']')"
CONSTRAINT_WHAT = "a Slurm feature expression like a100|h100 or [rack1|rack2]&nvlink"
MEM_WHAT = "a Slurm memory size like 16G, at most 64T"
CONTROL_WHAT = "must not contain control characters (newline, tab, \\x00-\\x1f, \\x7f)"


def has_control(value: str) -> bool:
    """Whether ``value`` holds a control character (\\x00-\\x1f or \\x7f): never allowed in a spec."""
    return _CONTROL_RE.search(value) is not None


def printable_key(key: str) -> str:
    """A key path as it can be printed on one line: control characters escaped (``\\n``)."""
    return _CONTROL_RE.sub(lambda m: repr(m.group())[1:-1], key)


def time_limit_seconds(value: str) -> int | None:
    """Seconds of a Slurm ``--time`` value (None for UNLIMITED/INFINITE). Assumes ``TIME_RE`` matched."""
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
    if not TIME_RE.fullmatch(value):
        return False
    seconds = time_limit_seconds(value)
    return seconds is None or seconds <= MAX_TIME_LIMIT_S


def mem_ok(value: str) -> bool:
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
    if partition is not None and not SLURM_WORD_RE.fullmatch(partition):
        problems.append(SpecProblem("--partition", f"must be a Slurm partition name, got {partition!r}"))
    if nodelist is not None and not HOSTLIST_RE.fullmatch(nodelist):
        problems.append(SpecProblem("--nodelist", f"must be {HOSTLIST_WHAT}, got {nodelist!r}"))
    if time_limit is not None and not time_limit_ok(time_limit):
        problems.append(SpecProblem("--time", f"must be {TIME_WHAT}, got {time_limit!r}"))
    return problems
