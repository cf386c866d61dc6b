"""The control API's request bodies as typed values (pydantic): parsed at the edge, or refused.

Every route of the daemon (pearlctl.daemon.api) parses its body into one of these models before the
controller sees it, so nothing unvalidated reaches state: wrong types, out-of-range numbers, NaN and
infinities, unknown fields, oversized lists and strings are a 422 naming the field. Clients build the
same models, so both sides agree on one definition.

Bounds are generous for real runs and small enough that one report cannot bloat state: the daemon also
caps the whole body (``MAX_BODY_BYTES``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from pearlctl.planner.model import Work
from pearlctl.vocabulary import SERVED_ROLES, Engine, Role

__all__ = [
    "MAX_BODY_BYTES",
    "Ack",
    "Borrow",
    "GpuId",
    "GpuRef",
    "Heartbeat",
    "Move",
    "Progress",
    "ProfileBody",
    "Register",
    "ReturnNow",
    "SelfReturn",
    "TrainerPhase",
    "ValidationError",
    "WorkerReport",
    "as_text",
    "describe",
    "parse",
]

MAX_BODY_BYTES = 256 * 1024  # a heartbeat of 64 workers is a few KiB; a phase report with metrics, less

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _printable(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (newlines, tabs, NUL ...)")
    return value


TEXT_MAX = 256
Text = Annotated[str, Field(max_length=TEXT_MAX), AfterValidator(_printable)]


def as_text(value: str) -> str:
    """``value`` made into what a ``Text`` field takes: control characters (colour escapes, newlines) as
    spaces, cut to its length. For a sender that quotes a log."""
    return _CONTROL.sub(" ", value)[:TEXT_MAX]


Path = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_printable)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")]  # ids, keys, versions
HostName = Annotated[str, Field(pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,252})$")]
Count = Annotated[int, Field(ge=0, le=10**12)]
Seconds = Annotated[float, Field(ge=0, le=10**7, allow_inf_nan=False)]
Timestamp = Annotated[float, Field(ge=0, le=10**11, allow_inf_nan=False)]
GpuIndex = Annotated[int, Field(ge=0, le=1023)]
Id = Annotated[int, Field(ge=1, le=2**62)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _distinct(gpus: list[int]) -> list[int]:
    if len(set(gpus)) != len(gpus):
        raise ValueError("GPU indices must be distinct")
    return gpus


Gpus = Annotated[list[GpuIndex], Field(max_length=64), AfterValidator(_distinct)]


# -- agents ---------------------------------------------------------------------------------------------
class Register(Body):
    job_id: Annotated[str, Field(pattern=r"^[0-9A-Za-z_.-]{1,64}$")]
    task_id: Annotated[int, Field(ge=0, le=10**6)]
    node: HostName
    host: HostName | None = None  # the agent's own host name (workers' URLs use it)
    pool: Name | None = None
    gpus: Gpus = []
    restarts: Annotated[int, Field(ge=0, le=10**6)] = 0
    pid: Annotated[int, Field(ge=1, le=2**31)] | None = None


WorkerStateName = Literal["STARTING", "READY", "DRAINING", "SLEEPING", "STOPPED", "FAILED", "LOST"]


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError("must be http(s)://HOST:PORT")
    if parts.port is None or not 1 <= parts.port <= 65535:
        raise ValueError("must name a port 1-65535")
    return url


class WorkerReport(Body):
    # "#" is not allowed: the daemon archives a finished worker's row as "<key>#<id>"
    key: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,63}$")]
    role: Role
    engine: Engine
    gpus: Gpus = []
    state: WorkerStateName
    url: Annotated[str, Field(max_length=300), AfterValidator(_http_url)] | None = None
    pid: Annotated[int, Field(ge=1, le=2**31)] | None = None
    weight_version: Name | None = None
    error: Text | None = None  # a FAILED worker's exit status and the end of its log (journaled by the daemon)
    ready_s: Seconds | None = None  # its cold start: from its process's start to its first healthy answer


class SelfReturn(Body):
    """A return the agent made by itself, because the daemon could not be reached by a lent GPU's deadline."""

    gpus: Gpus
    worker_key: Annotated[str, Field(max_length=80)]
    deadline: Timestamp
    at: Timestamp
    how: Literal["stopped", "parked"]


# Silence shorter than this never counts as loss, whatever the heartbeat rate: the daemon's judgement of an
# agent (LOST) and an agent's judgement of the daemon (returning lent GPUs itself) both use it.
MIN_LOSS_WINDOW_S = 2.0


class Heartbeat(Body):
    allocation_id: Id
    workers: Annotated[list[WorkerReport], Field(max_length=64)] = []
    leaving: bool = False
    draining: bool = False  # a preemption notice arrived: the agent drains its workers and keeps reporting
    desired_hash: Annotated[str, Field(pattern=r"^[0-9a-f]{1,64}$")] | None = None
    wait_s: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = 0.0
    epoch_seen: Annotated[int, Field(ge=0, le=2**62)] = 0
    self_returns: Annotated[list[SelfReturn], Field(max_length=64)] = []


# -- the trainer hook -----------------------------------------------------------------------------------
class TrainerPhase(Body):
    """What ``pearlctl.trainer.TrainerHook`` reports (its ``ControlChannel`` docstring)."""

    phase: Literal["training", "waiting", "stopped"]
    step: Annotated[int, Field(ge=0, le=10**12)] | None = None
    expected_wait_s: Seconds | None = None
    metrics: dict[str, Any] | None = None
    released: bool = False
    release_mode: Literal["offload", "checkpoint"] | None = None
    blocked_s: Seconds | None = None
    weight_version: Name | None = None
    weights_path: Path | None = None
    world_size: Annotated[int, Field(ge=1, le=10**6)] | None = None
    zero_stage: Annotated[int, Field(ge=0, le=3)] | None = None
    ts: Timestamp | None = None
    # long poll: with no command for it now, hold the report up to this long (at most a heartbeat) for one
    wait_s: Annotated[float, Field(ge=0, le=60, allow_inf_nan=False)] = 0.0

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, metrics: dict | None) -> dict | None:
        _check_json_finite(metrics, "metrics")
        return metrics


class Ack(Body):
    command_id: Annotated[str, Field(min_length=1, max_length=160), AfterValidator(_printable)]
    result: dict[str, Any]

    @field_validator("result")
    @classmethod
    def _ok_is_bool(cls, result: dict) -> dict:
        if not isinstance(result.get("ok"), bool):
            raise ValueError("result.ok must be true or false")
        _check_json_finite(result, "result")
        return result


# -- operators ------------------------------------------------------------------------------------------
class Borrow(Body):
    # a policy is a name (pearlctl.policies), never a path: the daemon must not run a file it was sent
    policy: Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")]
    gpus: Annotated[int, Field(ge=1, le=10**6)] | None = None
    dry_run: bool = False
    keep_warm: bool = True


class ReturnNow(Body):
    now: bool = False
    keep_warm: bool = False


class GpuRef(Body):
    """A GPU as people name it: its node and its index there (``gpu2:3``, as ``pearlctl status`` lists it)."""

    node: HostName
    index: GpuIndex


class GpuId(Body):
    """A GPU by its id in state (the ``id`` column of ``pearlctl status``): for names that fit several GPUs
    (the local backend gives every task the first GPUs of its one node)."""

    id: Id


# the roles a rollout or elastic GPU can be brought up in by a move: the policy's, or the judge's
ServingRole = Literal[SERVED_ROLES]  # (a tuple subscript is the same as listing its values)


class Move(Body):
    """An operator's move of rollout or elastic GPUs (``pearlctl move``): start or wake them in ``role``
    (default ROLLOUT), retire them (``keep_warm``: park the worker asleep), or switch them to ``role`` (between the
    policy and the judge, ``keep_warm`` parks the leaving worker asleep; one of ``role`` parked there wakes)."""

    kind: Literal["start", "wake", "retire", "switch"]
    gpus: Annotated[list[GpuRef | GpuId], Field(min_length=1, max_length=64)]
    role: ServingRole | None = None
    keep_warm: bool = False


class ProfileBody(Body):
    profile: dict[str, Any]
    judge: bool = False  # the run's judge's profile (its own model), not the policy's

    @field_validator("profile")
    @classmethod
    def _finite_profile(cls, profile: dict) -> dict:
        _check_json_finite(profile, "profile")
        return profile


# -- the rollout driver ---------------------------------------------------------------------------------
_WORK_FIELDS = frozenset(Work.__dataclass_fields__)


class JudgeQueue(Body):
    """The judge queue (pearlctl.router.judge.Queue): trajectories waiting for a verdict, being judged, judged,
    and judge answers that gave none."""

    waiting: Count = 0
    judging: Count = 0
    done: Count = 0
    failed: Count = 0


class ToolTimes(Body):
    """The current batch's tool calls as the rollout driver timed them (pearlctl.planner.correct.Tools): the
    largest sum of tool seconds over its trajectories (the loops its ``work`` reports)."""

    slowest_s: Seconds


class Progress(Body):
    step: Annotated[int, Field(ge=0, le=10**12)] | None = None
    queued: Count | None = None
    generating: Count | None = None
    tool_wait: Count | None = None
    done: Count | None = None
    tokens: Count | None = None
    work: dict[str, Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False, strict=False)]] | None = None
    judge: JudgeQueue | None = None  # a run whose driver scores with a judge: its queue
    tools: ToolTimes | None = None  # a driver that times its tool calls: the batch's (its predictor's correction)

    @field_validator("work")
    @classmethod
    def _work_fields(cls, work: dict | None) -> dict | None:
        if work is not None and (extra := sorted(set(work) - _WORK_FIELDS)):
            raise ValueError(f"unknown field(s) {extra}; known: {', '.join(sorted(_WORK_FIELDS))}")
        return work


def _check_json_finite(value: Any, where: str, depth: int = 0) -> None:
    """Free-form JSON (metrics, ack results) is stored as JSON: no NaN or infinity, bounded nesting."""
    if depth > 8:
        raise ValueError(f"{where}: nested deeper than 8 levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: numbers must be finite, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json_finite(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json_finite(v, f"{where}[{i}]", depth + 1)


def parse(model: type[BaseModel], doc: Any) -> Any:
    """A decoded JSON document as ``model``, exactly as the daemon parses the same bytes off the wire."""
    return model.model_validate_json(json.dumps(doc))


def describe(exc: ValidationError) -> str:
    """One line per problem, each naming the field: what the API answers with a 422."""
    parts = []
    for e in exc.errors(include_url=False)[:8]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)
