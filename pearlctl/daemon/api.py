"""The daemon's HTTP control API (Starlette, served by uvicorn).

Every request must carry ``Authorization: Bearer <run secret>`` and ``X-Pearl-Run: <run id>``:
missing or wrong token → 401, a request meant for another run → 403 (agents of two runs on one
cluster must never cross). The secret is compared in constant time and never logged.

Routes (JSON in, JSON out):
  GET  /v1/health              liveness + the daemon's epoch
  POST /v1/agents/register     an agent binds to its allocation → {allocation_id, epoch, heartbeat_s}
  POST /v1/agents/heartbeat    reported workers in, desired workers out
  GET  /v1/status              the run's state document (what `pearlctl status --json` prints)
  POST /v1/trainer/phase       the trainer hook reports its phase → the command the current step asks for
  POST /v1/trainer/ack         the trainer hook says a command was carried out (or refused)
  POST /v1/borrow              {policy, gpus?, dry_run?}: turn borrowing on (or show the plan)
  POST /v1/return              {now?}: turn borrowing off; lent GPUs go back
  GET  /v1/workers             READY, routable rollout workers (for rollout clients)
  POST /v1/rollout/progress    the rollout driver's counts: queued, generating, tool_wait, done, tokens
  GET  /metrics                Prometheus text format (pearlctl.daemon.metrics)
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pearlctl.daemon.controller import ControlError, Controller
from pearlctl.daemon.metrics import render as render_metrics

RUN_HEADER = "X-Pearl-Run"
# Agents long-poll (one held request each): allow far more concurrent handler threads than anyio's 40.
_LIMITER = anyio.CapacityLimiter(1024)


class _Auth(BaseHTTPMiddleware):
    def __init__(self, app, *, secret: str, run_id: str):
        super().__init__(app)
        self.expected = f"Bearer {secret}".encode()
        self.run_id = run_id

    async def dispatch(self, request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self.expected):
            return JSONResponse({"error": "missing or wrong token (Authorization: Bearer <run secret>)"}, 401)
        if request.headers.get(RUN_HEADER) != self.run_id:
            return JSONResponse({"error": f"this daemon serves run {self.run_id}; set {RUN_HEADER} to it"}, 403)
        return await call_next(request)


def _handler(fn: Callable[[dict], dict]):
    async def endpoint(request: Request):
        try:
            body = await request.json() if request.method == "POST" else {}
        except ValueError:
            return JSONResponse({"error": "body must be JSON"}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "body must be a JSON object"}, 400)
        try:
            # the controller is synchronous (SQLite): run it off the event loop
            return JSONResponse(await anyio.to_thread.run_sync(fn, body, limiter=_LIMITER))
        except ControlError as exc:
            return JSONResponse({"error": str(exc)}, exc.status)
        except KeyError as exc:
            return JSONResponse({"error": f"missing field {exc.args[0]!r}"}, 400)

    return endpoint


def build_app(controller: Controller, *, secret: str, status: Callable[[], dict]) -> Starlette:
    routes = [
        Route(
            "/v1/health",
            _handler(lambda body: {"ok": True, "epoch": controller.epoch, "run_id": controller.run_id}),
            methods=["GET"],
        ),
        Route("/v1/agents/register", _handler(controller.register), methods=["POST"]),
        Route("/v1/agents/heartbeat", _handler(controller.heartbeat), methods=["POST"]),
        Route("/v1/status", _handler(lambda body: status()), methods=["GET"]),
        Route("/v1/trainer/phase", _handler(controller.trainer_phase), methods=["POST"]),
        Route("/v1/trainer/ack", _handler(controller.trainer_ack), methods=["POST"]),
        Route("/v1/borrow", _handler(controller.borrow), methods=["POST"]),
        Route("/v1/return", _handler(controller.give_back), methods=["POST"]),
        Route("/v1/workers", _handler(controller.routable_workers), methods=["GET"]),
        Route("/v1/rollout/progress", _handler(controller.rollout_progress), methods=["POST"]),
        Route("/v1/profile", _handler(controller.set_profile), methods=["POST"]),
    ]

    async def metrics(request: Request):
        body = await anyio.to_thread.run_sync(
            lambda: render_metrics(controller.store, controller.run_id), limiter=_LIMITER
        )
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    routes.append(Route("/metrics", metrics, methods=["GET"]))
    return Starlette(routes=routes, middleware=[Middleware(_Auth, secret=secret, run_id=controller.run_id)])
