"""The daemon's HTTP control API (Starlette, served by uvicorn).

Who may call what (credentials):
- every request names its run (``X-Pearl-Run``); one meant for another run is refused (403): agents of
  two runs on one cluster never cross;
- the **run token** (``.pearl/secret`` in the run directory, ``Authorization: Bearer <token>``) is the
  operator's and the run's processes' credential: the CLI, the trainer hook, rollout drivers, and an
  agent registering;
- an **allocation credential**, handed to an agent by ``/v1/agents/register`` (``X-Pearl-Allocation:
  <id>`` plus ``Authorization: Bearer <credential>``), is the only credential ``/v1/agents/heartbeat``
  accepts, and only for that allocation: a report for another allocation is refused (403).
Tokens are compared in constant time and never logged.

Every body is parsed at the edge into a typed model (pearlctl.api.bodies) before the controller sees
it: not JSON → 400, a field of the wrong type, out of range, unknown or oversized → 422 naming the field,
a body over ``MAX_BODY_BYTES`` → 413, an unknown allocation or step → 404. A request never makes the
daemon answer 500 for what it sent, and never stops it: an unexpected error is logged, counted and
answered 500 without leaving the process.

Routes (JSON in, JSON out):
  GET  /v1/health              liveness + the daemon's epoch
  POST /v1/agents/register     an agent binds to its allocation → {allocation_id, credential, epoch, heartbeat_s}
  POST /v1/agents/heartbeat    reported workers in, desired workers out (allocation credential)
  GET  /v1/status              the run's state document (what `pearlctl status --json` prints)
  POST /v1/trainer/phase       the trainer hook reports its phase → the command the current step asks for
  POST /v1/trainer/ack         the trainer hook says a command was carried out (or refused)
  POST /v1/borrow              {policy, gpus?, dry_run?, keep_warm?}: turn borrowing on (or show the plan)
  POST /v1/return              {now?, keep_warm?}: turn borrowing off; lent GPUs go back
  GET  /v1/workers             READY, routable rollout workers (for rollout clients)
  GET  /v1/weights/targets     the workers trainer rank 0 broadcasts each version to (pearlctl.daemon.weights)
  POST /v1/rollout/progress    the rollout driver's counts: queued, generating, tool_wait, done, tokens; and
                               its judge queue (judge: waiting, judging, done, failed) when it has a judge
  POST /v1/profile             store the run's engine profile
  GET  /metrics                Prometheus text format (pearlctl.daemon.metrics)
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pearlctl.api import bodies
from pearlctl.api.client import ALLOCATION_HEADER, RUN_HEADER
from pearlctl.daemon.agents import Agents, allocation_credential
from pearlctl.daemon.controller import ControlError, Controller
from pearlctl.daemon.metrics import render as render_metrics
from pearlctl.daemon.operator import Operator
from pearlctl.daemon.weights import broadcast_targets
from pearlctl.state.errors import NotFound, StaleEpoch

log = logging.getLogger("pearlctl.daemon")

# Handler threads: a held long poll waits in the event loop, not in one (pearlctl.daemon.longpoll), but 512
# agents' reports may arrive at once; anyio's default is 40.
_LIMITER = anyio.CapacityLimiter(256)


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class _Gate:
    """Authentication and the body size limit, before anything is parsed."""

    def __init__(self, secret: str, run_id: str):
        self.secret, self.run_id = secret, run_id
        self.run_token = f"Bearer {secret}"

    def check(self, request: Request, *, agent: bool) -> int | None:
        """Returns the allocation id an agent credential is bound to (agent routes), else None."""
        given = request.headers.get("authorization", "")
        if not agent:
            if not _same(given, self.run_token):
                raise _Refused(401, "missing or wrong token (Authorization: Bearer <run token>)")
        else:
            raw = request.headers.get(ALLOCATION_HEADER, "")
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
                raise _Refused(
                    401,
                    f"agent reports need {ALLOCATION_HEADER}: <allocation id> and that allocation's credential "
                    "(from /v1/agents/register)",
                )
            if not _same(given, "Bearer " + allocation_credential(self.secret, self.run_id, int(raw))):
                raise _Refused(403, f"wrong credential for allocation {raw}: register again")
        if request.headers.get(RUN_HEADER) != self.run_id:
            raise _Refused(403, f"this daemon serves run {self.run_id}; set {RUN_HEADER} to it")
        return int(raw) if agent else None

    @staticmethod
    async def body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and (
            not (declared.isascii() and declared.isdigit()) or int(declared) > bodies.MAX_BODY_BYTES
        ):
            raise _Refused(413, f"body larger than {bodies.MAX_BODY_BYTES} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > bodies.MAX_BODY_BYTES:
                raise _Refused(413, f"body larger than {bodies.MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def _parse(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:
        return model.model_validate_json(raw or b"{}")
    except bodies.ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise _Refused(400, "body must be a JSON object") from None
        raise _Refused(422, bodies.describe(exc)) from None


def build_app(
    controller: Controller,
    *,
    secret: str,
    status: Callable[[], dict],
    stats: Callable[[], Any] | None = None,
) -> Starlette:
    """The daemon's app: the routes of this module's docstring, grouped by who calls them — anyone holding the
    run token reading (health, status, metrics), the agents, the trainer and its rollout driver, the operator."""
    gate = _Gate(secret, controller.run_id)
    route = functools.partial(_route, controller, gate)
    routes = [
        *_read_routes(route, controller, gate, status, stats),
        *_agent_routes(route, controller.agents),
        *_trainer_routes(route, controller),
        *_operator_routes(route, controller.operator),
    ]
    return Starlette(routes=routes)


def _route(
    controller: Controller,
    gate: _Gate,
    path: str,
    fn: Callable[..., dict],
    model: type[BaseModel] | None = None,
    *,
    method: str = "POST",
    agent: bool = False,
    then: Callable[..., Awaitable[dict]] | None = None,
    fast: Callable[..., Any] | None = None,
) -> Route:
    """One JSON route: the gate checks the request's credential (an allocation's when ``agent``, which is
    then passed on last) and body size, the body is parsed into ``model``, and a refusal or failure is
    answered as this module's docstring says.

    ``fn`` runs in a handler thread (the controller is synchronous: SQLite), unless ``fast``, called
    first in the event loop with the same arguments (it must never block), answers; ``then``, if given, is
    awaited in the event loop with the same arguments and that result, and answers instead (a long poll's
    hold)."""

    async def endpoint(request: Request):
        allocation = None
        try:
            allocation = gate.check(request, agent=agent)
            raw = await gate.body(request)
            args: list[Any] = []
            if model is not None:
                args.append(_parse(model, raw))
            if agent:
                args.append(allocation)
            # an agent is alive from its request's arrival to its answer, however long it waits
            with controller.liveness.arrived(allocation) if agent else contextlib.nullcontext():
                t0 = time.monotonic()
                result = fast(*args) if fast is not None else None
                if result is None:
                    result = await anyio.to_thread.run_sync(lambda: fn(*args), limiter=_LIMITER)
                if agent:
                    controller.agents.heartbeat_seconds.observe(time.monotonic() - t0)
                if then is not None:
                    result = await then(*args, result)
            return JSONResponse(result)
        except _Refused as exc:
            if allocation is not None and exc.status == 422:
                controller.agents.refused_report(allocation, str(exc))
            return JSONResponse({"error": str(exc)}, exc.status)
        except ControlError as exc:
            return JSONResponse({"error": str(exc)}, exc.status)
        except NotFound as exc:
            return JSONResponse({"error": str(exc)}, 404)
        except StaleEpoch as exc:  # another daemon holds the lease: this one stops
            controller.on_deposed(str(exc))
            return JSONResponse({"error": f"this daemon was deposed ({exc}); ask again"}, 503)
        except Exception as exc:  # a bug: answer, log, count, never die
            controller.api_errors += 1
            log.exception("%s %s failed", request.method, path)
            return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, 500)

    return Route(path, endpoint, methods=[method])


def _read_routes(
    route: Callable[..., Route],
    controller: Controller,
    gate: _Gate,
    status: Callable[[], dict],
    stats: Callable[[], Any] | None,
) -> list[Route]:
    """What anyone holding the run token reads: liveness, the state document, the Prometheus metrics."""

    async def metrics(request: Request):
        try:
            gate.check(request, agent=False)
        except _Refused as exc:
            return JSONResponse({"error": str(exc)}, exc.status)
        body = await anyio.to_thread.run_sync(
            lambda: render_metrics(controller.store, controller.run_id, stats() if stats else None, controller),
            limiter=_LIMITER,
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return [
        route("/v1/health", lambda: {"ok": True, "epoch": controller.epoch, "run_id": controller.run_id}, method="GET"),
        route("/v1/status", status, method="GET"),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _agent_routes(route: Callable[..., Route], agents: Agents) -> list[Route]:
    """The agents' side (pearlctl.daemon.agents): registering, heartbeats, and the READY routable rollout
    workers it knows of (for rollout clients)."""
    return [
        route("/v1/agents/register", agents.register, bodies.Register),
        route(
            "/v1/agents/heartbeat",
            agents.report,
            bodies.Heartbeat,
            agent=True,
            then=agents.hold,
            fast=agents.remembered,  # a repeated report: from memory, no thread
        ),
        route("/v1/workers", agents.routable_workers, method="GET"),
    ]


def _trainer_routes(route: Callable[..., Route], controller: Controller) -> list[Route]:
    """The trainer's side (pearlctl.daemon.trainer_side): the hook's phase and acks, the rollout driver's
    progress; and the workers trainer rank 0 broadcasts weights to (pearlctl.daemon.weights)."""
    trainer = controller.trainer
    return [
        route("/v1/trainer/phase", trainer.report, bodies.TrainerPhase, then=trainer.hold),
        route("/v1/trainer/ack", trainer.ack, bodies.Ack),
        route(
            "/v1/weights/targets",
            lambda: {"epoch": controller.epoch, **broadcast_targets(controller.store, controller.run_id)},
            method="GET",
        ),
        route("/v1/rollout/progress", trainer.rollout_progress, bodies.Progress),
    ]


def _operator_routes(route: Callable[..., Route], operator: Operator) -> list[Route]:
    """The operator's side (pearlctl.daemon.operator): borrow, return, move, the engine profile."""
    return [
        route("/v1/borrow", operator.borrow, bodies.Borrow),
        route("/v1/return", operator.give_back, bodies.ReturnNow),
        route("/v1/moves", operator.move, bodies.Move),
        route("/v1/profile", operator.set_profile, bodies.ProfileBody),
    ]
