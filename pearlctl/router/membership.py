"""Which rollout workers the run's router sends requests to: the gateway's admin API, as typed bodies and
the one client the daemon uses to drive it.

The gateway serves ``/pearl/workers`` (pearlctl.router.app; the changes: pearlctl.router.admin) with the same
credential as its OpenAI-compatible routes (``Authorization: Bearer <router key>``):

  GET    /pearl/workers              the members: url, role, weight version, when added, whether it is routed to
  POST   /pearl/workers              `WorkerIn`: add one worker (or change its weight version or role); idempotent
  PUT    /pearl/workers              `WorkerSet`: make the members exactly this set (adds, removes, re-versions)
  DELETE /pearl/workers?url=URL      remove one worker (an unknown URL is no error)

A worker's ``role`` says how it serves: ``ROLLOUT`` (the default: colocated prefill and decode, what every
member was before roles existed), ``PREFILL`` or ``DECODE`` (one half of a disaggregated pair, with vLLM's KV
transfer), ``REWARD`` (a judge: only requests naming its model reach it, through a router of its own). The
gateway routes a request through a prefill and a decode member when it has at least one of each, else to a
colocated one; a lone half serves whole requests (docs/router.md, "Prefill-decode").

Guarantees:
- The bodies are parsed at the gateway's edge into these models (strict, unknown fields refused), and
  this client builds the same models, so both sides agree on one definition (the house style of
  pearlctl.api.bodies). A body the gateway refuses comes back as `MembershipError` naming the field.
- Adding a worker that is not healthy yet waits for it (vllm-router's ``/add_worker`` blocks until the
  worker's ``/health`` answers 200) for at most ``wait_s``; then the gateway answers 504 and the worker
  is not a member. ``PUT`` adds concurrently, so one slow worker does not hold up the others.
- A member is ``routed`` once the vllm-router that serves it lists it: a PREFILL or DECODE member with a
  partner of the other role, the PD router started for their pairs (its start is part of the add, about
  a second; if none could start, the regular one); any other member, the regular one. ``PUT`` changes the
  routers once for the whole set.
- Membership lives in the gateway's memory (and vllm-router's). The gateway re-registers its members with
  a vllm-router it had to restart; after a gateway restart the daemon must ``sync`` again. Calling
  ``sync`` with the daemon's routable set on every change, and now and then, is always safe.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from pearlctl.router import service
from pearlctl.vocabulary import SERVING_ROLES, Role

__all__ = [
    "MAX_WORKERS",
    "Member",
    "MembershipError",
    "ROLES",
    "RouterMembership",
    "SyncResult",
    "ValidationError",
    "WorkerIn",
    "WorkerRef",
    "WorkerSet",
    "describe",
]

MAX_WORKERS = 1024  # a run's rollout workers: far more than any run has, few enough to bound a body
WORKERS_PATH = "/pearl/workers"


def _worker_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError("must be http(s)://HOST:PORT with no path (the worker's root, as vllm-router takes it)")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None or not 1 <= port <= 65535:
        raise ValueError("must name a port 1-65535")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("must not carry a query, a fragment or credentials")
    return url.rstrip("/")


WorkerUrl = Annotated[str, Field(max_length=300), AfterValidator(_worker_url)]
# the vocabulary of pearlctl.api.bodies.Name: what an agent reports as a worker's weight version
Version = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")]
WaitSeconds = Annotated[float, Field(ge=0, le=600, allow_inf_nan=False)]
# how a member serves (pearlctl.vocabulary.SERVING_ROLES: the policy's roles, and REWARD, a judge, routed apart),
# as plain str: WorkerRole is Literal["ROLLOUT", "PREFILL", "DECODE", "REWARD"], its 422s naming the values as a
# body spells them
ROLES: tuple[str, ...] = tuple(str(r) for r in Role if r in SERVING_ROLES)
WorkerRole = Literal[ROLES]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class WorkerIn(_Body):
    """One worker to route to, the weight version it serves (None: unknown) and how it serves (``role``)."""

    url: WorkerUrl
    weight_version: Version | None = None
    role: WorkerRole = Role.ROLLOUT
    wait_s: WaitSeconds = 30.0  # how long the gateway waits for a worker that is not healthy yet


class WorkerSet(_Body):
    """The complete set of workers to route to: the router's members become exactly these."""

    workers: Annotated[list[WorkerIn], Field(max_length=MAX_WORKERS)]
    wait_s: WaitSeconds = 30.0


class WorkerRef(_Body):
    url: WorkerUrl


def describe(exc: ValidationError) -> str:
    """One line per problem (up to 8), each naming the field: what the gateway answers with a 422."""
    parts = []
    for e in exc.errors(include_url=False)[:8]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


@dataclass(frozen=True)
class Member:
    url: str
    weight_version: str | None
    added_at: float  # unix time the gateway added it (or last changed its version or role)
    routed: bool | None = None  # whether a vllm-router the gateway sends requests to lists it (None: it did not say)
    healthy: bool | None = None  # that vllm-router's health view of it
    role: str = Role.ROLLOUT
    router: str | None = None  # which vllm-router routes to it: "regular" or "pd" (a PREFILL/DECODE pair's)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Member:
        return cls(
            url=str(doc["url"]),
            weight_version=doc.get("weight_version"),
            added_at=float(doc.get("added_at") or 0.0),
            routed=doc.get("routed"),
            healthy=doc.get("healthy"),
            role=str(doc.get("role") or Role.ROLLOUT),
            router=doc.get("router"),
        )


@dataclass(frozen=True)
class SyncResult:
    added: list[str]
    removed: list[str]
    updated: list[str]  # members whose weight version changed
    failed: dict[str, str]  # url -> why it could not be added (not healthy within wait_s, router error)
    members: list[Member]


class MembershipError(Exception):
    """The gateway refused or failed a membership call; ``status`` is its HTTP status (0: unreachable)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RouterMembership:
    """``url``: the gateway's root (``RouterRecord.url``, e.g. ``http://head:8100``); ``key``: the router key.
    Synchronous and thread-safe (one ``httpx.Client``): the daemon calls it from its own threads."""

    def __init__(self, url: str, key: str, *, timeout: float = 10.0, http: httpx.Client | None = None):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {key}"}
        self.timeout = timeout
        self._http = http if http is not None else httpx.Client(timeout=timeout)

    @classmethod
    def for_run(cls, run_dir: str | os.PathLike, **kw: Any) -> RouterMembership:
        """The client of the router that serves this run (its record and key in the run directory)."""
        record = service.read_record(run_dir)
        if record is None:
            raise MembershipError(f"no router record at {service.record_path(run_dir)}: start the router first", 0)
        return cls(record.admin_url, service.read_key(run_dir), **kw)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterMembership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls ------------------------------------------------------------------------------------
    def _call(
        self, method: str, body: BaseModel | None = None, params: dict | None = None, wait_s: float = 0.0
    ) -> dict:
        try:
            resp = self._http.request(
                method,
                self.url + WORKERS_PATH,
                json=body.model_dump(mode="json") if body is not None else None,
                params=params,
                headers=self._headers,
                timeout=self.timeout + wait_s,
            )
        except httpx.HTTPError as exc:
            raise MembershipError(f"the router gateway at {self.url} does not answer: {exc}", 0) from exc
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if resp.status_code >= 400:
            err = doc.get("error") if isinstance(doc, dict) else None
            message = err.get("message") if isinstance(err, dict) else resp.text[:500]
            raise MembershipError(f"{method} {WORKERS_PATH}: HTTP {resp.status_code}: {message}", resp.status_code)
        if not isinstance(doc, dict):
            raise MembershipError(f"{method} {WORKERS_PATH}: the gateway answered something not a JSON object", 502)
        return doc

    def list(self) -> list[Member]:
        return [Member.from_doc(m) for m in self._call("GET")["workers"]]

    def add(
        self, url: str, weight_version: str | None = None, *, role: str = Role.ROLLOUT, wait_s: float = 30.0
    ) -> Member:
        """Route to ``url`` serving as ``role`` (idempotent; a member's weight version and role are updated).
        Raises `MembershipError` (504) when the worker is not healthy within ``wait_s``."""
        body = WorkerIn(url=url, weight_version=weight_version, role=role, wait_s=wait_s)
        return Member.from_doc(self._call("POST", body, wait_s=wait_s)["worker"])

    def remove(self, url: str) -> bool:
        """Stop routing new requests to ``url`` (requests running on it finish there, or are continued
        elsewhere if it aborts them). Returns whether it was a member."""
        WorkerRef(url=url)  # refused here, not by the gateway, if malformed
        return bool(self._call("DELETE", params={"url": url})["removed"])

    def sync(
        self,
        workers: Mapping[str, str | None] | Iterable[tuple[str, str | None]],
        *,
        roles: Mapping[str, str] | None = None,
        wait_s: float = 30.0,
    ) -> SyncResult:
        """Make the members exactly ``workers`` (url -> weight version), each serving as ``roles[url]``
        (``ROLLOUT`` when absent: colocated). Workers that could not be added are in ``failed``; the others
        are members either way. A role outside `ROLES` raises ``ValidationError`` naming it, before any call."""
        items = workers.items() if isinstance(workers, Mapping) else workers
        roles = roles or {}
        body = WorkerSet(
            workers=[
                WorkerIn(url=u, weight_version=v, role=roles.get(u, Role.ROLLOUT), wait_s=wait_s) for u, v in items
            ],
            wait_s=wait_s,
        )
        doc = self._call("PUT", body, wait_s=wait_s)
        return SyncResult(
            added=list(doc.get("added", [])),
            removed=list(doc.get("removed", [])),
            updated=list(doc.get("updated", [])),
            failed=dict(doc.get("failed", {})),
            members=[Member.from_doc(m) for m in doc.get("workers", [])],
        )
