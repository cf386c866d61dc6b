"""The gateway's HTTP edge: the Starlette apps, their routes, parsing a request into a turn, and the answers.
The work behind the routes is the gateway's (pearlctl.router.gateway: the turns; pearlctl.router.admin:
membership; pearlctl.router.routing: the routers).

Routes (docs/router.md has the whole contract):

  POST /v1/completions, /v1/chat/completions   proxied through vllm-router (regular or PD), continued
  GET  /v1/models                              proxied
  GET  /health                                 no credential: is the router up, how many workers, the PD router
  GET/POST/PUT/DELETE /pearl/workers           membership (pearlctl.router.membership: bodies and client)
  GET  /pearl/stats                            counters: requests, continued, retried, gave up

`build_app` serves them all; `build_control_app` the last three, for the control plane's own socket
(pearlctl.router.control).

Guarantees:
- **Credential.** Every route but ``/health`` needs ``Authorization: Bearer <router key>`` (compared in
  constant time, never logged, never forwarded: the caller's Authorization header does not reach the
  router or the workers). Without it: 401 with an OpenAI-shaped JSON error naming what is missing.
- **Sessions.** ``X-Session-ID`` is forwarded to vllm-router (its ``consistent_hash`` policy keeps a
  session on one worker). Absent the header, it is taken from the body's ``session`` field (pearlctl's,
  removed before forwarding) or else from the OpenAI ``user`` field (kept).
- **A request the gateway cannot read** (not a JSON object, NaN or Infinity, larger than ``max_body_bytes``,
  a bad session or ``X-Pearl-Retry-For-S``) is answered 400 or 413 before anything is sent upstream.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pearlctl.router.errors import BadRequest, GiveUp, Refused, error
from pearlctl.router.membership import WORKERS_PATH, ValidationError, WorkerIn, WorkerRef, WorkerSet, describe
from pearlctl.router.turn import Turn
from pearlctl.vocabulary import Role

if TYPE_CHECKING:
    from pearlctl.router.gateway import Gateway

log = logging.getLogger("pearlctl.router.gateway")  # one name for the gateway's lines, whichever module logs them

SESSION_HEADER = "x-session-id"
RETRY_FOR_HEADER = "x-pearl-retry-for-s"
FORWARDED_HEADERS = ("x-request-id",)  # besides X-Session-ID: nothing else of the caller's reaches upstream
MAX_SESSION_CHARS = 256


# The data plane's JSON goes through orjson: a turn's body carries its whole context as token ids (the caller's
# request, the upstream request, the upstream answer with prompt_token_ids, the caller's answer), and the
# standard library's encoder and decoder were a third of the gateway's CPU at 64 paced GPUs
# (docs/benchmarks.md, "Live at 64 GPUs"). orjson refuses NaN and Infinity as the standard library's strict
# parse does; it writes a NaN float as null.
class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


# -- reading a request -----------------------------------------------------------------------------------
async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object of at most ``limit`` bytes (`BadRequest` otherwise)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not (declared.isascii() and declared.isdigit()) or int(declared) > limit):
        raise BadRequest(413, f"body larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"body larger than {limit} bytes")
        chunks.append(chunk)
    try:  # NaN and Infinity are not JSON: refused here, not when the request is sent on (a 500)
        doc = orjson.loads(b"".join(chunks) or b"null")
    except ValueError:
        raise BadRequest(400, "body must be a JSON object (an OpenAI request; no NaN or Infinity)") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, "body must be a JSON object (an OpenAI request)")
    return doc


def session_of(request: Request, body: dict) -> str | None:
    """X-Session-ID, else the body's ``session`` (removed), else the OpenAI ``user`` field."""
    session = request.headers.get(SESSION_HEADER)
    from_body = body.pop("session", None)
    if not session:
        if from_body is not None and not isinstance(from_body, str):
            raise BadRequest(400, "session must be a string (or send the X-Session-ID header)")
        session = from_body or (body.get("user") if isinstance(body.get("user"), str) else None)
    if session and (len(session) > MAX_SESSION_CHARS or not session.isascii() or not session.isprintable()):
        raise BadRequest(400, f"session must be printable ASCII of at most {MAX_SESSION_CHARS} characters")
    return session or None


def retry_for(request: Request, default: float, most: float) -> float:
    """The turn's retry window: ``X-Pearl-Retry-For-S`` (0 to ``most`` seconds), else ``default``."""
    raw = request.headers.get(RETRY_FOR_HEADER)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= most:
        raise BadRequest(400, f"{RETRY_FOR_HEADER} must be seconds from 0 to {most:g}")
    return value


def upstream_headers(request: Request, session: str | None) -> dict[str, str]:
    """The headers an attempt sends upstream: the session and `FORWARDED_HEADERS`, nothing else of the caller's."""
    headers = {"content-type": "application/json"}
    if session:
        headers[SESSION_HEADER] = session
    for name in FORWARDED_HEADERS:
        if request.headers.get(name):
            headers[name] = request.headers[name]
    return headers


def _parse(model: type[BaseModel], doc: dict) -> Any:
    try:
        return model.model_validate_json(json.dumps(doc))
    except ValidationError as exc:
        raise BadRequest(422, describe(exc)) from None


# -- the routes ------------------------------------------------------------------------------------------
class Routes:
    """The route handlers over one `Gateway` (its state, its turns, its membership)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self._key = gateway.config.key.encode()

    def check_key(self, request: Request) -> JSONResponse | None:
        """None when the request carries the router key; else the 401 to answer (counted)."""
        given = request.headers.get("authorization")
        hint = "the run's router key (RUN_DIR/.pearl/router.key; OpenAI clients: api_key=<key>)"
        stats = self.gateway.stats
        if not given:
            stats["unauthorized"] += 1
            return error(
                401,
                f"missing Authorization header: send 'Authorization: Bearer <key>' with {hint}",
                "authentication_error",
            )
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            stats["unauthorized"] += 1
            return error(401, f"Authorization must be 'Bearer <key>' with {hint}", "authentication_error")
        if not hmac.compare_digest(token.strip().encode(), self._key):
            stats["unauthorized"] += 1
            return error(401, f"wrong key in Authorization: Bearer: use {hint}", "authentication_error")
        return None

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def generate(self, request: Request, kind: str) -> Response:
        """A completion or chat turn: one body, or one stream (pearlctl.router.gateway)."""
        received = time.time()
        refused = self.check_key(request)
        if refused is not None:
            return refused
        gateway, config = self.gateway, self.gateway.config
        gateway.stats["requests"] += 1
        try:
            body = await read_json(request, config.max_body_bytes)
            session = session_of(request, body)
            turn = Turn(kind, body, session, retry_for(request, config.retry_for_s, config.max_retry_for_s))
        except BadRequest as exc:
            return error(exc.status, str(exc), "invalid_request_error")
        headers = upstream_headers(request, session)
        if turn.stream:
            return await self._stream(turn, headers)
        arrived = time.monotonic()
        try:
            doc = await gateway.complete(turn, headers)
        except (Refused, GiveUp) as exc:
            return self._failed(exc)
        gateway.count(turn)
        gateway.seconds["turns"] += time.monotonic() - arrived
        # when the gateway had the request and when it answered (unix seconds): a caller's round trip less
        # this span is the time its request and answer spent outside the gateway's handler
        doc["pearl"]["timing"] = {"received": round(received, 4), "answered": round(time.time(), 4)}
        return OrjsonResponse(doc)

    async def _stream(self, turn: Turn, headers: dict[str, str]) -> Response:
        """A streamed turn: its status is known once the first event is (a refusal or a 503 before it)."""
        gateway = self.gateway
        gen = gateway.stream(turn, headers) if turn.continuable else gateway.stream_whole(turn, headers)
        try:
            first = await gen.__anext__()
        except (Refused, GiveUp) as exc:
            return self._failed(exc)
        except StopAsyncIteration:
            return error(502, "the router's stream ended before any event", "upstream_error")

        async def body_iter() -> AsyncIterator[bytes]:
            yield first
            async for piece in gen:
                yield piece
            gateway.count(turn)

        return StreamingResponse(body_iter(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    def _failed(self, exc: Refused | GiveUp) -> Response:
        """A turn that ended before any answer: refused as the upstream said, or given up (counted)."""
        if isinstance(exc, Refused):
            self.gateway.stats["refused"] += 1
        else:
            self.gateway.stats["gave_up"] += 1
            log.warning("gave up: %s", exc)
        return exc.response()

    async def models(self, request: Request) -> Response:
        """The model list, as the serving router answers it, with the judges' models after the policy's; when the
        router cannot (down, or no worker it counts healthy yet, as right after a membership change), as the first
        of the policy's member workers that does."""
        refused = self.check_key(request)
        if refused is not None:
            return refused
        http = self.gateway.http
        try:
            resp = await http.get(self.gateway.routers.models_url() + "/v1/models", timeout=10.0)
            failure = None if resp.status_code == 200 else (resp.status_code, resp.text[:300])
        except httpx.HTTPError as exc:
            resp, failure = None, (503, f"does not answer ({type(exc).__name__}: {exc})")
        if failure is None and resp is not None:
            return Response(await self._with_judges(resp.content), 200, media_type="application/json")
        policy = sorted(u for u, role in self.gateway.members.roles().items() if role != Role.REWARD)
        for url in policy:  # the policy's list comes first: a judge's would name its model to rollout clients
            try:
                direct = await http.get(url + "/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            if direct.status_code == 200:
                return Response(direct.content, 200, media_type="application/json")
        status, text = failure
        if resp is None:
            return error(503, f"the router {text}, nor does any member worker", "router_unavailable")
        return error(status if status >= 400 else 502, f"the router answered {status}: {text}", "upstream_error")

    async def _with_judges(self, listed: bytes) -> bytes:
        """A router's model list with the judge router's models appended (those not in it already); the list
        as it was when there is no judge router, when it names no model of the policy (rollout clients take the
        first model listed), or when either list cannot be read."""
        judge = self.gateway.routers.judge
        if judge is None or not judge.alive():
            return listed
        try:
            doc = orjson.loads(listed)
            if not doc["data"]:
                return listed
            resp = await self.gateway.http.get(judge.url + "/v1/models", timeout=10.0)
            extra = orjson.loads(resp.content)["data"] if resp.status_code == 200 else []
            data = doc["data"]
            have = {e.get("id") for e in data if isinstance(e, dict)}
            data.extend(e for e in extra if isinstance(e, dict) and e.get("id") not in have)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return listed
        return orjson.dumps(doc)

    async def health(self, request: Request) -> Response:
        doc, status = await self.gateway.control.run(self.gateway.routers.health_doc)
        return JSONResponse(doc, status)

    async def workers(self, request: Request) -> Response:
        """``/pearl/workers`` (pearlctl.router.membership), run on the control plane's loop."""
        refused = self.check_key(request)
        if refused is not None:
            return refused
        control, admin = self.gateway.control, self.gateway.admin
        try:
            if request.method == "GET":
                docs = await control.run(admin.member_docs)
                return JSONResponse({"workers": docs, "change": self.gateway.members.change})
            if request.method == "DELETE":
                ref = _parse(WorkerRef, {"url": request.query_params.get("url", "")})
                return JSONResponse(await control.run(admin.remove, ref.url))
            doc = await read_json(request, self.gateway.config.max_body_bytes)
            if request.method == "POST":
                status, answer = await control.run(admin.add, _parse(WorkerIn, doc))
                return JSONResponse(answer, status)
            return JSONResponse(await control.run(admin.sync, _parse(WorkerSet, doc)))
        except BadRequest as exc:
            return error(exc.status, str(exc), "invalid_request_error")

    async def stats(self, request: Request) -> Response:
        refused = self.check_key(request)
        if refused is not None:
            return refused
        gateway = self.gateway
        seconds = {k: round(v, 3) for k, v in gateway.seconds.items()}
        return JSONResponse(
            {
                **gateway.stats,
                "seconds": seconds,
                "members": len(gateway.members.by_url),
                "pd": dict(gateway.routers.pd_info),
            }
        )

    def control_routes(self) -> list[Route]:
        """Health, membership, counters: the routes both sockets serve."""
        return [
            Route("/health", self.health, methods=["GET"]),
            Route(WORKERS_PATH, self.workers, methods=["GET", "POST", "PUT", "DELETE"]),
            Route("/pearl/stats", self.stats, methods=["GET"]),
        ]


def build_app(gateway: Gateway) -> Starlette:
    """The gateway's public app: the OpenAI routes and the control routes."""
    routes = Routes(gateway)
    return Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            *routes.control_routes(),
        ]
    )


def build_control_app(gateway: Gateway) -> Starlette:
    """The control plane's routes (pearlctl.router.control.ControlPlane): health, membership, counters; no
    completion."""
    return Starlette(routes=Routes(gateway).control_routes())
