"""The run's one OpenAI-compatible endpoint: a gateway in front of vllm-router that adds what vllm-router
lacks — the run's credential, continuation of interrupted sequences, weight-version tags — and the admin
API through which the daemon sets which workers the router routes to. This module is its state (`Gateway`)
and its data plane: each turn's attempts upstream, continued until one complete answer.

The rest of the gateway, by concern (docs/router.md has the whole contract):

- pearlctl.router.app: the HTTP edge (routes, the credential, sessions, parsing, answers);
- pearlctl.router.turn: one turn's parts folded into one answer, and what a continuation asks for;
- pearlctl.router.routing: which vllm-router an attempt goes to, prefill-decode, the routers' lists;
- pearlctl.router.members and pearlctl.router.admin: the members, their weight versions, their changes;
- pearlctl.router.control and pearlctl.router.control_loop: the control plane's thread, and the loop and
  client membership work is handed to, apart from this data plane.

Guarantees:
- **One complete answer.** A single-choice request that a worker interrupts — vLLM's ``finish_reason:
  "abort"`` with partial output (a drain's ``/abort_requests``), a broken connection or stream (a killed
  worker), a 5xx, no worker for a moment — is continued through the router on another worker from the token
  ids generated so far (pearlctl.router.turn), and the caller gets ONE response (one stream that goes on, or
  one body). Requests that cannot be continued are re-sent whole (``pearl.restarted``) while nothing has been
  streamed to the caller.
- **Time-bounded.** A turn is retried with jittered exponential back-off (none after an abort that made
  progress) until ``retry_for_s`` (per request: header ``X-Pearl-Retry-For-S``) has passed since its last
  progress (its start, or the last token received); then the caller gets HTTP 503 with a JSON error naming
  the time, the attempts and the last error — mid-stream, an error event and ``[DONE]``. One upstream
  attempt is bounded by ``request_timeout_s``. Nothing is dropped silently and nothing hangs.
- **The request's own fault is not retried.** An upstream 4xx other than 408/429 (400, 404, 413, 422...)
  is passed through at once, status and body (pearlctl.router.errors).
- **Weight versions.** Every part is tagged with the weights that served it, or marked ambiguous, never
  guessed (pearlctl.router.members, ``Members.attribute``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import anyio
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from pearlctl.router.admin import MemberAdmin
from pearlctl.router.control_loop import ControlLoop
from pearlctl.router.errors import GiveUp, Refused, is_refusal
from pearlctl.router.members import Members
from pearlctl.router.routing import JudgeLauncher, PdLauncher, Routers
from pearlctl.router.text import TextMirror, Tokenizers, mirrorable
from pearlctl.router.turn import Turn, sse

log = logging.getLogger("pearlctl.router.gateway")

VERSION_HEADER = "x-pearl-weight-version"  # a worker that states which weights served a request
WORKER_HEADER = "x-pearl-worker"  # ... and which worker it is
MAX_BODY_BYTES = 32 * 1024 * 1024  # prompts as token ids of a long context: a few MiB


def _upstream_session() -> aiohttp.ClientSession:
    """The data plane's aiohttp session, made on the loop of its first request: no cap on connections."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


@dataclass
class GatewayConfig:
    key: str  # the router key callers present
    router_url: str  # vllm-router, e.g. http://127.0.0.1:PORT
    retry_for_s: float = 600.0
    request_timeout_s: float = 1800.0
    backoff_s: float = 0.05  # the first back-off window (full jitter, doubling)
    backoff_max_s: float = 2.0
    max_retry_for_s: float = 3600.0  # the most a caller may ask for with X-Pearl-Retry-For-S
    max_body_bytes: int = MAX_BODY_BYTES
    pd_retry_s: float = 2.0  # the first wait before launching a PD router again for lists that failed (doubling)
    pd_retry_max_s: float = 60.0


def _model(body: dict) -> str | None:
    """The model a request names (a judge's goes to the judge router: pearlctl.router.routing)."""
    model = body.get("model")
    return model if isinstance(model, str) else None


class _StreamBroke(Exception):
    """An upstream stream ended without a finish, or sent an error event."""


@dataclass
class _Part:
    """What one streamed attempt brought: its tokens, its finish, the caller's last chunk held back for the
    ``pearl`` field, why it broke, and who served it (the response headers; the membership change it began at)."""

    since: int
    tokens: int = 0
    finish: str | None = None
    last_chunk: dict | None = None
    broke: str = ""
    stated: tuple[str | None, str | None] = (None, None)
    failed: bool = False  # answered a retryable status: nothing of it to keep


class Gateway:
    """The gateway's state — configuration, the upstream client (vllm-router), the members, the routers,
    counters — and its data plane: a turn's attempts, until one complete answer."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        http: httpx.AsyncClient | None = None,
        pd_launcher: PdLauncher | None = None,
        judge_launcher: JudgeLauncher | None = None,
    ):
        self.config = config
        # The data plane's upstream client: httpx's API (its exceptions, its MockTransport in the unit tests) over
        # aiohttp's connection pool and C HTTP parser (httpx-aiohttp's transport, as openai-python's aiohttp
        # client). httpcore 1.0's pool scans every connection it holds for each request it adds or ends, with a
        # readability syscall per idle one (O(connections^2); encode/httpcore#1035): a batch's 2,336 first turns at
        # once spent a third of the gateway's loop in httpx and httpcore (py-spy of the live bench's gateway), and
        # 64 pools used in turn did not make batches shorter; aiohttp's pool does not scan its connections. No cap
        # on connections (``limit=0``): a synchronous batch has thousands of turns in flight.
        self.http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=10.0),
            transport=AiohttpTransport(client=_upstream_session),
        )
        self.stats = {
            k: 0
            for k in (
                "requests",
                "completed",
                "continued_requests",
                "continuations",
                "restarted",
                "retried_attempts",
                "gave_up",
                "refused",
                "unauthorized",
                "attempts_regular",
                "attempts_pd",
                "attempts_judge",
            )
        }
        # where a non-streamed turn's time went, summed over the completed ones: from its arrival to its answer,
        # and the part of it its attempts waited for vllm-router (the rest is this process: backoff, queueing
        # for the event loop, parsing)
        self.seconds = {"turns": 0.0, "upstream": 0.0}
        self.members = Members()
        # The control plane's loop (pearlctl.router.control): membership runs there, with its own client; until
        # a control plane serves, on the caller's loop with the data plane's client (the unit tests).
        self.control = ControlLoop(self.http)
        self.routers = Routers(config, self.members, self.control, self.stats, pd_launcher, judge_launcher)
        # The engine request ids of the continuable attempts upstream now: a join's rebalance aborts them by id
        # (pearlctl.router.admin), and each is continued on the new ring. Added and removed on the data plane's
        # loop, read on the control plane's.
        self._upstream: Counter[str] = Counter()  # (a caller's X-Request-Id may name several)
        self._upstream_lock = threading.Lock()
        self.admin = MemberAdmin(self.members, self.routers, self.control, self.upstream_ids, self.stats)
        self.tokenizers = Tokenizers()  # for the text of continued turns (pearlctl.router.text)
        self._model_roots: dict[str, str] = {}  # served model name -> its directory (``root`` in /v1/models)
        self._unmirrored: set[tuple[str, str]] = set()  # why a model's continued turns keep vLLM's text: said once each

    async def aclose(self) -> None:
        """Stop every PD router (the one serving and those still draining) unless a control plane owns them
        (`close_control`), then the upstream clients."""
        if self.control.loop is None:
            await self.close_control()
        await self.http.aclose()

    async def close_control(self) -> None:
        """On the control plane's loop: stop every PD router and the control client."""
        await self.routers.close()
        await self.control.aclose()

    def count(self, turn: Turn) -> None:
        """Count a turn the caller got whole."""
        self.stats["completed"] += 1
        self.stats["continuations"] += turn.continued
        self.stats["continued_requests"] += 1 if turn.continued else 0
        self.stats["restarted"] += turn.restarted

    def upstream_ids(self) -> list[str]:
        """The engine request ids of the continuable attempts upstream now (a copy)."""
        with self._upstream_lock:
            return list(self._upstream)

    @contextlib.contextmanager
    def _upstream_id(self, turn: Turn, path: str, body: dict, headers: dict[str, str]) -> Iterator[None]:
        """An attempt of a continuable turn carries a request id (vLLM's ``request_id``: the caller's
        ``X-Request-Id`` when it sent one, which vLLM prefers, else one of the gateway's), kept while the attempt is
        upstream under the name vLLM 0.32 gives it (``cmpl-<id>-0`` for a completion's one prompt,
        ``chatcmpl-<id>`` for a chat turn), so that a join's rebalance aborts exactly these: an abort of a request
        that cannot be continued would lose its work."""
        if not turn.continuable:
            yield
            return
        given = headers.get("x-request-id") or f"pearl-{uuid.uuid4().hex}"
        body["request_id"] = given
        rid = f"chatcmpl-{given}" if path.endswith("/chat/completions") else f"cmpl-{given}-0"
        with self._upstream_lock:
            self._upstream[rid] += 1
        try:
            yield
        finally:
            with self._upstream_lock:
                self._upstream[rid] -= 1
                if not self._upstream[rid]:
                    del self._upstream[rid]

    # -- attempts ---------------------------------------------------------------------------------
    async def before_attempt(self, turn: Turn) -> None:
        """Back off (full jitter, doubling; none after an abort that made progress); `GiveUp` once the
        turn's retry window since its last progress has passed."""
        if turn.attempts == 0:
            return
        now = time.monotonic()
        deadline = turn.progress_at + turn.retry_for_s
        if now >= deadline:
            raise turn.give_up()
        wait = 0.0
        if not turn.no_wait:
            window = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** max(0, turn.failures_in_row - 1))
            wait = random.uniform(0, window)
        if wait > 0:
            await asyncio.sleep(min(wait, deadline - now))
        if time.monotonic() >= turn.progress_at + turn.retry_for_s:
            raise turn.give_up()
        self.stats["retried_attempts"] += 1

    @contextlib.asynccontextmanager
    async def _open_stream(self, session: str | None, path: str, body: dict, headers: dict[str, str]):
        with self.routers.through(session, _model(body)) as base:
            async with self.http.stream("POST", base + path, content=orjson.dumps(body), headers=headers) as resp:
                yield resp

    async def mirror_text(self, turn: Turn) -> None:
        """Before a turn's first continuation: detokenize its continued parts here (pearlctl.router.text),
        when the model's tokenizer can be read and the request allows it; else they keep vLLM's text."""
        if turn.mirror_tried:
            return
        turn.mirror_tried = True
        model = str(turn.body.get("model") or "")
        why = mirrorable(turn.body)
        root = None
        if why is None and (turn.prompt_ids is None or len(turn.ids) != turn.tokens):
            why = "the first part did not return every token id"
        if why is None:
            root = await self._model_root(model)
            why = None if root is not None else "no member worker names the model's directory"
        tokenizer = await anyio.to_thread.run_sync(self.tokenizers.get, root) if root is not None else None
        if tokenizer is None:
            if why is not None and (model, why) not in self._unmirrored:
                self._unmirrored.add((model, why))
                log.warning("continued turns of model %r keep vLLM's text: %s", model, why)
            return
        skip_special = turn.body.get("skip_special_tokens") is not False
        turn.mirror = TextMirror(tokenizer, turn.prompt_ids or [], turn.ids, skip_special)

    async def _model_root(self, model: str) -> str | None:
        """The directory a served model was loaded from, as a member worker's /v1/models says (kept)."""
        if model in self._model_roots:
            return self._model_roots[model]
        for url in self.members.urls():  # 2 s each: a member on a dead node must not hold a continuation
            try:
                doc = (await self.http.get(url + "/v1/models", timeout=2.0)).json()
            except (httpx.HTTPError, ValueError):
                continue
            entries = doc.get("data") if isinstance(doc, dict) else None
            for entry in entries if isinstance(entries, list) else []:
                if isinstance(entry, dict) and (entry.get("id") == model or not model):
                    # a worker that loaded the model from its node's weight store (pearlctl.host.weight_store) names
                    # a directory of its own node; its served name is then the model's shared directory
                    names = [n for n in (entry.get("root"), entry.get("id")) if isinstance(n, str) and n]
                    root = next((n for n in names if os.path.isdir(n)), names[0] if names else None)
                    if root is not None:
                        self._model_roots[model] = root
                        return root
        return None

    async def complete(self, turn: Turn, headers: dict[str, str]) -> dict:
        """A whole non-streaming answer (or `Refused` / `GiveUp`)."""
        while True:
            await self.before_attempt(turn)
            path, body, continuation = turn.request()
            if continuation:
                await self.mirror_text(turn)
            turn.attempts += 1
            since = self.members.mark()
            try:
                sent = time.monotonic()
                with (
                    self._upstream_id(turn, path, body, headers),
                    self.routers.through(turn.session, _model(body)) as base,
                ):
                    resp = await self.http.post(base + path, content=orjson.dumps(body), headers=headers)
            except httpx.HTTPError as exc:
                turn.failed(f"{type(exc).__name__}: {exc}".strip())
                continue
            finally:
                self.seconds["upstream"] += time.monotonic() - sent
            if resp.status_code != 200:
                if is_refusal(resp.status_code):
                    raise Refused(resp.status_code, resp.content, resp.headers.get("content-type"))
                turn.failed(f"HTTP {resp.status_code} from the router: {resp.text[:300]}")
                continue
            stated = (resp.headers.get(VERSION_HEADER), resp.headers.get(WORKER_HEADER))
            who = self.members.attribute(since, *stated, judge=self.routers.for_judge(_model(turn.body)))
            if not turn.continuable:
                try:
                    doc = orjson.loads(resp.content)
                    reasons = [c.get("finish_reason") for c in doc["choices"]]
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    turn.failed(f"an unreadable answer ({type(exc).__name__}: {exc})")
                    continue
                if "abort" in reasons:  # cannot be continued: sent again whole
                    turn.restarted += 1
                    turn.failed(f"the worker aborted the request ({turn.why_not}: sent again whole)")
                    continue
                usage = doc.get("usage") or {}
                turn.add_part(int(usage.get("completion_tokens") or 0), reasons[0] if reasons else None, who)
                doc["pearl"] = turn.pearl()
                return doc
            try:
                tokens, finish = turn.take_answer(orjson.loads(resp.content), continuation)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
                turn.failed(f"an unreadable answer ({type(exc).__name__}: {exc})")
                continue
            left = turn.remaining()
            if finish == "abort" and left is not None and left <= 0:
                finish = "length"
            turn.add_part(tokens, finish, who)
            if finish == "abort" or finish is None:
                turn.interrupted(f"the worker aborted the request after {tokens} token(s) (a drain)", tokens)
                continue
            return turn.answer(finish)

    async def stream(self, turn: Turn, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The caller's one stream, continued across parts; raises `Refused` / `GiveUp` only before its
        first byte, and afterwards ends with an error event and ``[DONE]``."""
        while True:
            try:
                await self.before_attempt(turn)
            except GiveUp as exc:
                if not turn.emitted:
                    raise
                yield sse({"error": exc.doc})
                yield sse("[DONE]")
                return
            path, body, continuation = turn.request()
            if continuation:
                await self.mirror_text(turn)
            body["stream"] = True
            turn.attempts += 1
            part = _Part(since=self.members.mark())
            try:
                with self._upstream_id(turn, path, body, headers):
                    async with contextlib.aclosing(
                        self._stream_part(turn, part, path, body, headers, continuation)
                    ) as events:
                        async for event in events:
                            yield event
            except Refused as exc:
                if not turn.emitted:
                    raise
                message = exc.body.decode(errors="replace")[:500]
                yield sse({"error": {"message": message, "type": "upstream_error", "code": exc.status}})
                yield sse("[DONE]")
                return
            except (httpx.HTTPError, ValueError, _StreamBroke) as exc:
                part.broke = f"the stream broke ({type(exc).__name__}: {exc})".strip()
            if part.failed:
                continue
            last = self._end_of_part(turn, part)
            if last is not None:
                for event in last:
                    yield event
                return

    async def _stream_part(
        self, turn: Turn, part: _Part, path: str, body: dict, headers: dict[str, str], continuation: bool
    ) -> AsyncIterator[bytes]:
        """One streamed attempt: the caller's events as they come, and what the attempt brought in ``part``.
        Raises `Refused` (the request's own fault), and what breaks a stream (httpx's errors, an unreadable
        event, `_StreamBroke`); a retryable status sets ``part.failed``."""
        async with self._open_stream(turn.session, path, body, headers) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                if is_refusal(resp.status_code):
                    raise Refused(resp.status_code, raw, resp.headers.get("content-type"))
                turn.failed(f"HTTP {resp.status_code} from the router: {raw.decode(errors='replace')[:300]}")
                part.failed = True
                return
            part.stated = (resp.headers.get(VERSION_HEADER), resp.headers.get(WORKER_HEADER))
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = orjson.loads(data)
                if not isinstance(obj, dict):
                    raise _StreamBroke("an event that is not a JSON object")
                if "error" in obj and not obj.get("choices"):
                    raise _StreamBroke(f"an error event: {json.dumps(obj['error'])[:300]}")
                chunk, n, fin = turn.take_chunk(obj, continuation)
                part.tokens += n
                if fin is not None:
                    left = turn.remaining()
                    part.finish = "length" if fin == "abort" and left is not None and left <= 0 else fin
                    if part.finish != "abort":
                        part.last_chunk = chunk  # held back for the pearl field; a usage event may follow
                        continue
                if chunk is not None:
                    turn.emitted = True
                    yield sse(chunk)

    def _end_of_part(self, turn: Turn, part: _Part) -> list[bytes] | None:
        """After a streamed part: the stream's last events when the turn ends (finished, or it cannot go on
        without repeating what the caller has); None when it goes on (`Turn.interrupted`)."""
        judge = self.routers.for_judge(_model(turn.body))
        turn.add_part(part.tokens, part.finish, self.members.attribute(part.since, *part.stated, judge=judge))
        if part.finish is not None and part.finish != "abort":
            turn.emitted = True
            return [*(sse(out) for out in turn.final_chunks(part.last_chunk, part.finish)), sse("[DONE]")]
        if part.finish == "abort":
            why = f"the worker aborted the request after {part.tokens} token(s) (a drain)"
        else:
            why = part.broke or "the stream ended without a finish_reason"
        if turn.emitted and turn.tokens > 0 and turn.prompt_ids is None:  # cannot continue, must not repeat
            message = (
                f"{why}; the worker did not return the prompt's token ids, so the part already streamed cannot "
                "be continued"
            )
            return [sse({"error": {"message": message, "type": "pearl_not_continuable", "code": 502}}), sse("[DONE]")]
        turn.interrupted(why, part.tokens)
        return None

    async def stream_whole(self, turn: Turn, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """A stream that cannot be continued (``turn.why_not``): passed through byte for byte; sent again
        whole while nothing has reached the caller, an error event and ``[DONE]`` if it breaks after."""
        while True:
            await self.before_attempt(turn)
            path, body, _ = turn.request()
            turn.attempts += 1
            try:
                async with self._open_stream(turn.session, path, body, headers) as resp:
                    if resp.status_code != 200:
                        raw = await resp.aread()
                        if is_refusal(resp.status_code):
                            raise Refused(resp.status_code, raw, resp.headers.get("content-type"))
                        turn.failed(f"HTTP {resp.status_code} from the router: {raw.decode(errors='replace')[:300]}")
                        continue
                    async for piece in resp.aiter_raw():
                        turn.emitted = True
                        yield piece
                    return
            except httpx.HTTPError as exc:
                why = f"the stream broke ({type(exc).__name__}: {exc})".strip()
                if not turn.emitted:
                    turn.failed(why)
                    continue
                yield sse(
                    {
                        "error": {
                            "message": f"{why}; this request ({turn.why_not}) cannot be continued and "
                            "part of it was already streamed",
                            "type": "pearl_not_continuable",
                            "code": 502,
                        }
                    }
                )
                yield sse("[DONE]")
                return
