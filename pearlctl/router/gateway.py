"""The run's one OpenAI-compatible endpoint: an ASGI app in front of vllm-router that adds what vllm-router
lacks — the run's credential, continuation of interrupted sequences, weight-version tags — and the admin
API through which the daemon sets which workers the router routes to.

Routes (docs/router.md has the whole contract):

  POST /v1/completions, /v1/chat/completions   proxied through vllm-router (regular or PD), continued
  GET  /v1/models                              proxied
  GET  /health                                 no credential: is the router up, how many workers, the PD router
  GET/POST/PUT/DELETE /pearl/workers           membership (pearlctl.router.membership: bodies and client)
  GET  /pearl/stats                            counters: requests, continued, retried, gave up

Guarantees:
- **Credential.** Every route but ``/health`` needs ``Authorization: Bearer <router key>`` (compared in
  constant time, never logged, never forwarded: the caller's Authorization header does not reach the
  router or the workers). Without it: 401 with an OpenAI-shaped JSON error naming what is missing.
- **Sessions.** ``X-Session-ID`` is forwarded to vllm-router (its ``consistent_hash`` policy keeps a
  session on one worker). Absent the header, it is taken from the body's ``session`` field (pearlctl's,
  removed before forwarding) or else from the OpenAI ``user`` field (kept).
- **One complete answer.** A single-choice request (``n`` 1, one prompt, no ``echo``; chat without tools
  or structured output) that a worker interrupts — vLLM's ``finish_reason: "abort"`` with partial output
  (a drain's ``/abort_requests``), a broken connection or stream (a killed worker), a 5xx, no worker for a
  moment — is continued through the router on another worker: the prompt's token ids (vLLM returns them
  with ``return_token_ids``, which the gateway always asks for) plus the token ids generated so far become
  the new prompt, with the remaining ``max_tokens`` (``min_tokens`` less what was generated). A chat turn
  continues through ``/v1/completions`` on the chat prompt's token ids and is answered chat-shaped. The
  caller gets ONE response (one stream that goes on, or one body): texts (the continued parts' detokenized
  by the gateway, pearlctl.router.text) and token ids joined, logprobs
  joined (text offsets shifted), usage summed, and a ``pearl`` field recording every part's token count
  and weight version, how many times it was continued and how many attempts it took. Greedy decoding
  continued from token ids gives exactly the tokens of an uninterrupted run (tests/engines/test_router_engine.py
  checks it against real vLLM); penalties on generated tokens (presence/frequency) and stop strings that
  straddle an interruption are the documented exceptions. Requests that cannot be continued are re-sent
  whole (``pearl.restarted``) while nothing has been streamed to the caller.
- **Time-bounded.** A turn is retried with jittered exponential back-off (none after an abort that made
  progress) until ``retry_for_s`` (per request: header ``X-Pearl-Retry-For-S``) has passed since its last
  progress (its start, or the last token received); then the caller gets HTTP 503 with a JSON error naming
  the time, the attempts and the last error — mid-stream, an error event and ``[DONE]``. One upstream
  attempt is bounded by ``request_timeout_s``. Nothing is dropped silently and nothing hangs.
- **The request's own fault is not retried.** An upstream 4xx other than 408/429 (400, 404, 413, 422...)
  is passed through at once, status and body.
- **Weight versions.** vLLM 0.32's OpenAI answers do not say which weights produced them and vllm-router
  does not say which worker served a request. A part is tagged with the version a worker states in the
  response header ``X-Pearl-Weight-Version`` when there is one; otherwise with the members' version when
  every member in the router during that part served the same version (``version_from: "membership"``);
  otherwise it is marked ``version_from: "ambiguous"`` with the candidate versions, never guessed.
- **Prefill-decode.** Members have a role (ROLLOUT, PREFILL, DECODE). While there is at least one PREFILL
  and one DECODE member, a second vllm-router in PD mode (started through ``pd_launcher``) routes a request
  through a prefill and a decode worker; it takes the sessions its workers' share of all workers covers
  (`pd_share`, `choose_pd`: a session stays on one side), the regular vllm-router (ROLLOUT members) the
  rest. vllm-router 0.1.17 in PD mode has static lists only, so a change of the pairs starts a new PD
  router, and membership changes make before they break: the new router is ready, and the regular router
  has every worker it must take over, before new requests follow the new plan; the PD router it replaces is
  stopped only once no attempt runs through it, so a change of membership breaks no request (a worker's
  drain aborting its requests is what moves them, continued as above). PREFILL and DECODE members that no
  PD router serves — half a pair, or a pair whose PD router could not start (retried with back-off) or
  exited (replaced) — serve whole requests through the regular router: a vLLM server with a KV connector
  prefills locally when no KV is handed to it.
- **A control plane apart from the data plane.** Run as a process (pearlctl.router.__main__), the gateway
  serves ``/health``, ``/pearl/workers`` and ``/pearl/stats`` a second time on a socket of their own, served
  by `ControlPlane` on its own thread and event loop, and every membership change (the routers' lists, the PD
  routers, the workers' ``/health`` checks) runs on that loop with its own HTTP client. A synchronous batch
  of thousands of turns keeps the data plane's loop busy for tens of seconds; a membership change or a
  return's DEREGISTER sent to the control socket does not wait behind it. The same routes on the public
  socket hand their work to the control loop too (one owner of membership state). Members are shared
  between the two threads behind a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import socket
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import anyio
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pearlctl.router.membership import (
    WORKERS_PATH,
    ValidationError,
    WorkerIn,
    WorkerRef,
    WorkerSet,
    describe,
)
from pearlctl.router.text import TextMirror, Tokenizers, mirrorable
from pearlctl.vocabulary import Role

log = logging.getLogger("pearlctl.router.gateway")

SESSION_HEADER = "x-session-id"
RETRY_FOR_HEADER = "x-pearl-retry-for-s"
VERSION_HEADER = "x-pearl-weight-version"  # a worker that states which weights served a request
WORKER_HEADER = "x-pearl-worker"  # ... and which worker it is
FORWARDED_HEADERS = ("x-request-id",)  # besides X-Session-ID: nothing else of the caller's reaches upstream
MAX_BODY_BYTES = 32 * 1024 * 1024  # prompts as token ids of a long context: a few MiB
MAX_SESSION_CHARS = 256
RETRYABLE_4XX = (408, 429)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's default, and vLLM 0.32's
# Fields of a chat request that a /v1/completions continuation keeps (the rest is chat-only: messages,
# tools, templates, response formats; or set by the gateway: prompt, max_tokens, min_tokens, logprobs).
CHAT_TO_COMPLETION = tuple(
    "model temperature top_p top_k min_p seed stop stop_token_ids ignore_eos skip_special_tokens "
    "spaces_between_special_tokens include_stop_str_in_output repetition_penalty presence_penalty "
    "frequency_penalty length_penalty logit_bias allowed_token_ids bad_words user priority stream "
    "stream_options cache_salt vllm_xargs return_tokens_as_token_ids".split()
)
# Fields of a completions request that a continuation drops (it sets its own, or they applied to the prompt).
COMPLETION_DROPPED = tuple(
    "prompt max_tokens min_tokens echo suffix prompt_logprobs truncate_prompt_tokens request_id "
    "add_special_tokens".split()
)
STRUCTURED = tuple(
    "response_format structured_outputs guided_json guided_regex guided_choice guided_grammar "
    "guided_decoding_backend".split()
)


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


# -- errors ------------------------------------------------------------------------------------------
def error(status: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    """An OpenAI-shaped error answer: ``{"error": {"message", "type", "code", ...}}``."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status, **extra}}, status)


class _Refused(Exception):
    """The request's own fault (an upstream 4xx): passed through as is."""

    def __init__(self, status: int, body: bytes, media_type: str | None):
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.media_type = status, body, media_type

    def response(self) -> Response:
        return Response(self.body, self.status, media_type=self.media_type or "application/json")


class _GiveUp(Exception):
    def __init__(self, doc: dict):
        super().__init__(doc["message"])
        self.doc = doc

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.doc}, 503)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _StreamBroke(Exception):
    """An upstream stream ended without a finish, or sent an error event."""


# -- membership ------------------------------------------------------------------------------------------
@dataclass
class _Member:
    url: str
    weight_version: str | None
    added_at: float
    role: str = Role.ROLLOUT

    def doc(self) -> dict:
        return {"url": self.url, "role": self.role, "weight_version": self.weight_version, "added_at": self.added_at}


class Members:
    """The workers the gateway routes to, with their roles and weight versions, and a short history of
    membership states so a part can be attributed to the versions that could have served it."""

    HISTORY = 4096

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        # changed on the control plane's thread, read on the data plane's (Gateway.control_loop)
        self._lock = threading.RLock()
        self.by_url: dict[str, _Member] = {}
        self.change = 0
        self._states: deque[tuple[int, frozenset, frozenset]] = deque([(0, frozenset(), frozenset())], self.HISTORY)

    def _changed(self) -> None:
        self.change += 1
        versions = frozenset(m.weight_version for m in self.by_url.values())
        self._states.append((self.change, versions, frozenset(self.by_url)))

    def set(self, url: str, version: str | None, role: str = Role.ROLLOUT) -> tuple[_Member, bool, bool]:
        """Add, re-version or re-role; returns (member, added, version or role changed)."""
        with self._lock:
            old = self.by_url.get(url)
            if old is not None and old.weight_version == version and old.role == role:
                return old, False, False
            member = _Member(url, version, self.clock(), role)
            self.by_url[url] = member
            self._changed()
            return member, old is None, old is not None

    def put(self, member: _Member) -> None:
        """Put a member back as it was (an update that could not be routed is undone)."""
        with self._lock:
            self.by_url[member.url] = member
            self._changed()

    def drop(self, url: str) -> bool:
        with self._lock:
            if self.by_url.pop(url, None) is None:
                return False
            self._changed()
            return True

    def roles(self) -> dict[str, str]:
        with self._lock:
            return {u: m.role for u, m in self.by_url.items()}

    def urls(self) -> list[str]:
        """The members' URLs, sorted (a copy: safe to iterate while membership changes)."""
        with self._lock:
            return sorted(self.by_url)

    def members(self) -> list[_Member]:
        with self._lock:
            return list(self.by_url.values())

    def mark(self) -> int:
        return self.change

    def attribute(self, since: int, header_version: str | None, header_worker: str | None) -> dict:
        """Who served a part that ran from membership change ``since`` until now."""
        if header_version:
            out = {"weight_version": header_version, "version_from": "worker"}
            if header_worker:
                out["worker"] = header_worker
            return out
        with self._lock:
            states = list(self._states)
        versions: set = set()
        urls: set = set()
        oldest = states[0][0]
        for change, vs, us in states:
            if change >= since:
                versions |= vs
                urls |= us
        if since < oldest:  # history too short for this part: every state kept is a candidate
            for _, vs, us in states:
                versions |= vs
                urls |= us
        out: dict[str, Any] = {}
        if header_worker:  # the worker said who it is, though not which weights (vLLM's label was never set)
            out["worker"] = header_worker
        elif len(urls) == 1:
            out["worker"] = next(iter(urls))
        if len(versions) == 1 and None not in versions:
            out.update(weight_version=next(iter(versions)), version_from="membership")
        elif not versions:
            out.update(weight_version=None, version_from="unknown")
        else:
            out.update(
                weight_version=None,
                version_from="ambiguous",
                candidates=sorted(v if v is not None else "unknown" for v in versions),
            )
        return out


# -- prefill-decode: which vllm-router serves a request ---------------------------------------------------
@dataclass(frozen=True)
class PdLists:
    """The static ``--prefill`` / ``--decode`` lists of a vllm-router in PD mode (sorted URLs)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    def urls(self) -> frozenset[str]:
        return frozenset(self.prefill) | frozenset(self.decode)

    def doc(self) -> dict:
        return {"prefill": list(self.prefill), "decode": list(self.decode)}


def pd_lists(roles: Mapping[str, str]) -> PdLists | None:
    """The PD router's lists for members with these roles; None unless there is at least one PREFILL and one
    DECODE member (half a pair cannot serve disaggregated)."""
    prefill = tuple(sorted(u for u, r in roles.items() if r == Role.PREFILL))
    decode = tuple(sorted(u for u, r in roles.items() if r == Role.DECODE))
    return PdLists(prefill, decode) if prefill and decode else None


def regular_members(roles: Mapping[str, str], serving: PdLists | None) -> set[str]:
    """The members the regular-mode vllm-router routes to: every ROLLOUT member, and every PREFILL or DECODE
    member that no PD router serves (a lone half of a pair, or both while the PD router is down): a vLLM
    server with a KV connector still serves whole requests, prefilling locally."""
    in_pd = serving.urls() if serving is not None else frozenset()
    return {u for u, r in roles.items() if r == Role.ROLLOUT or u not in in_pd}


def pd_share(regular: int, serving: PdLists | None) -> float:
    """The share of sessions sent through the PD router: its workers' share of all routed workers (each
    worker counts as one unit of capacity), 0 without a PD router, 1 without regular members."""
    if serving is None:
        return 0.0
    pd = len(serving.prefill) + len(serving.decode)
    return pd / (pd + regular)


def choose_pd(session: str | None, share: float, draw: Callable[[], float] = random.random) -> bool:
    """Whether one attempt goes through the PD router. A session always lands on the same side for a given
    share (its CRC-32 as a point in [0, 1)), so an episode's turns keep their prefix caches; a request
    without a session is drawn at random."""
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    point = zlib.crc32(session.encode()) / 2**32 if session else draw()
    return point < share


class PdRouter(Protocol):
    """A running vllm-router in PD mode with fixed lists (``python -m pearlctl.router`` starts them as
    children: pearlctl.router.__main__.PdRouterChild)."""

    url: str
    lists: PdLists

    def alive(self) -> bool: ...

    async def stop(self) -> None: ...


# starts a PD router for these lists and returns it once it routes; raises (any exception) when it cannot
PdLauncher = Callable[[PdLists], Awaitable[PdRouter]]


# -- one turn ------------------------------------------------------------------------------------------
def _continuable(kind: str, body: dict) -> str | None:
    """Why this request cannot be continued from token ids (None: it can)."""
    if body.get("n") not in (None, 1):
        return "n > 1"
    if body.get("best_of") not in (None, 1):
        return "best_of > 1"
    if body.get("echo"):
        return "echo"
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
            return "more than one prompt"
        if body.get("suffix"):
            return "suffix"
        if body.get("prompt_embeds") is not None:
            return "prompt_embeds"
    else:
        if body.get("tools") and body.get("tool_choice", "auto") != "none":
            return "tools"
    for name in STRUCTURED:
        value = body.get(name)
        if value and not (name == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return name
    return None


def _shift_offsets(lp: Any, by: int) -> Any:
    if not isinstance(lp, dict) or not by or not lp.get("text_offset"):
        return lp
    return {**lp, "text_offset": [o + by for o in lp["text_offset"]]}


def chat_logprobs(lp: Any, top: int) -> list[dict]:
    """Completions-style logprobs (tokens, token_logprobs, top_logprobs) as chat ``logprobs.content``."""
    if not isinstance(lp, dict):
        return []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, tok in enumerate(tokens):
        alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        best = sorted(alts.items(), key=lambda kv: -(kv[1] if kv[1] is not None else -1e30))[:top]
        out.append(
            {
                "token": tok,
                "logprob": values[i] if i < len(values) else None,
                "bytes": list(str(tok).encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(str(t).encode("utf-8", errors="replace"))} for t, v in best
                ],
            }
        )
    return out


@dataclass
class Turn:
    """One caller request and everything generated for it so far, across parts."""

    kind: str  # "completions" | "chat"
    body: dict
    session: str | None
    retry_for_s: float
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.stream = bool(self.body.get("stream"))
        self.want_ids = bool(self.body.get("return_token_ids"))
        self.why_not = _continuable(self.kind, self.body)
        if self.kind == "chat":
            mt = self.body.get("max_completion_tokens")
            mt = mt if mt is not None else self.body.get("max_tokens")
        else:
            mt = self.body.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        self.max_tokens: int | None = mt if isinstance(mt, int) and not isinstance(mt, bool) else None
        so = self.body.get("stream_options")
        self.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        lp = self.body.get("logprobs")
        self.top_logprobs = int(self.body.get("top_logprobs") or 0) if self.kind == "chat" else 0
        self.want_logprobs = bool(lp) if self.kind == "chat" else lp is not None
        self.progress_at = self.started
        self.prompt_ids: list[int] | None = None
        self.attempts = 0
        self.failures_in_row = 0
        self.continued = 0
        self.restarted = 0
        self.last_error = ""
        self.parts: list[dict] = []
        self.prefill_tokens = 0
        self.emitted = False  # anything streamed to the caller
        self.sent_prompt_ids = False
        self.no_wait = False  # the next attempt goes at once (an abort that made progress)
        self.mirror: TextMirror | None = None  # the continued parts' text, detokenized here (router/text.py)
        self.mirror_tried = False
        self._reset_output()

    def _reset_output(self) -> None:
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.text_len = 0
        self.part_start_len = 0
        self.tokens = 0  # generated tokens kept (len(ids) when token ids come back)
        self.lp_completion: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        self.lp_chat: list[dict] = []
        self.template: dict | None = None  # the first answer in the caller's shape (non-streaming)
        self.head: dict | None = None  # id, created, model of the caller's answer
        self.prompt_tokens: int | None = None
        self.stop_reason: Any = None

    @property
    def continuable(self) -> bool:
        return self.why_not is None

    def remaining(self) -> int | None:
        return None if self.max_tokens is None else self.max_tokens - self.tokens

    def is_continuation(self) -> bool:
        return self.continuable and self.tokens > 0 and self.prompt_ids is not None

    def request(self) -> tuple[str, dict, bool]:
        """(path, body, is a continuation) of the next upstream attempt."""
        self.part_start_len = self.text_len  # vLLM's text offsets count from the start of a part's output
        if not self.is_continuation():
            body = {k: v for k, v in self.body.items() if k != "session"}
            if self.continuable:
                body["return_token_ids"] = True
            return f"/v1/{'chat/completions' if self.kind == 'chat' else 'completions'}", body, False
        assert self.prompt_ids is not None
        if self.kind == "chat":
            body = {k: self.body[k] for k in CHAT_TO_COMPLETION if k in self.body}
            if self.body.get("logprobs"):
                body["logprobs"] = self.top_logprobs
        else:
            body = {k: v for k, v in self.body.items() if k not in COMPLETION_DROPPED and k != "session"}
        body["prompt"] = self.prompt_ids + self.ids
        left = self.remaining()
        if left is not None:
            body["max_tokens"] = left
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            body["min_tokens"] = max(0, min_tokens - self.tokens)
        body["return_token_ids"] = True
        return "/v1/completions", body, True

    # -- outcomes of an attempt -------------------------------------------------------------------
    def failed(self, why: str) -> None:
        self.last_error = why
        self.failures_in_row += 1
        self.no_wait = False

    def interrupted(self, why: str, part_tokens: int) -> None:
        """A part ended without finishing (an abort, a broken stream): keep what it made, or start over."""
        self.last_error = why
        if part_tokens > 0:
            self.failures_in_row = 0
            self.no_wait = True
        else:
            self.failures_in_row += 1
            self.no_wait = False
        if self.tokens > 0:
            if self.continuable and self.prompt_ids is not None:
                self.continued += 1 if part_tokens > 0 else 0
            else:
                self.restarted += 1
                self._reset_output()
                self.parts = []

    def progress(self, tokens: int) -> None:
        if tokens:
            self.progress_at = time.monotonic()

    def give_up(self) -> _GiveUp:
        waited = time.monotonic() - self.started
        doc = {
            "message": (
                f"no worker completed this request: gave up {waited:.1f} s after it began, "
                f"{time.monotonic() - self.progress_at:.1f} s after its last progress (retry_for_s "
                f"{self.retry_for_s:g}), after {self.attempts} attempt(s) and {self.continued} continuation(s) "
                f"with {self.tokens} token(s) generated; last error: {self.last_error or 'none'}"
            ),
            "type": "pearl_retry_exhausted",
            "code": 503,
            "seconds": round(waited, 3),
            "retry_for_s": self.retry_for_s,
            "attempts": self.attempts,
            "continued": self.continued,
            "tokens_generated": self.tokens,
            "last_error": self.last_error,
        }
        return _GiveUp(doc)

    def add_part(self, tokens: int, finish: str | None, who: dict) -> None:
        if tokens > 0 or finish not in (None, "abort"):
            self.parts.append({"tokens": tokens, "finish_reason": finish, **who})

    def pearl(self) -> dict:
        versions = sorted({p["weight_version"] for p in self.parts if p.get("weight_version")})
        out: dict[str, Any] = {
            "parts": self.parts,
            "continued": self.continued,
            "attempts": self.attempts,
            "restarted": self.restarted,
            "weight_versions": versions,
            "ambiguous": any(p.get("version_from") != "worker" and p.get("weight_version") is None for p in self.parts),
            "prefill_tokens": self.prefill_tokens,
        }
        if self.why_not is not None:
            out["not_continuable"] = self.why_not
        if self.continued:  # who made the continued parts' text (pearlctl.router.text)
            out["continued_text"] = "gateway" if self.mirror is not None else "vllm"
        return out

    def usage(self) -> dict:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt_ids or [])
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}

    # -- non-streaming ----------------------------------------------------------------------------
    def take_answer(self, doc: dict, continuation: bool) -> tuple[int, str | None]:
        """Fold one part's whole answer in; returns (its tokens, its finish_reason)."""
        choice = doc["choices"][0]
        chat_shaped = self.kind == "chat" and not continuation
        if self.template is None and (chat_shaped or self.kind == "completions"):
            self.template = doc
        if self.head is None:
            self.head = {"id": doc.get("id"), "created": doc.get("created"), "model": doc.get("model")}
        usage = doc.get("usage") or {}
        if self.prompt_tokens is None and not continuation and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
        self.prefill_tokens += int(usage.get("prompt_tokens") or 0)
        prompt_ids = doc.get("prompt_token_ids") if chat_shaped else choice.get("prompt_token_ids")
        if self.prompt_ids is None and not continuation and isinstance(prompt_ids, list):
            self.prompt_ids = list(prompt_ids)
        if chat_shaped:
            text = (choice.get("message") or {}).get("content") or ""
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                self.lp_chat.extend(lp.get("content") or [])
        else:
            text = self._text(choice, choice.get("token_ids"), continuation)
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                if self.kind == "chat":
                    self.lp_chat.extend(chat_logprobs(lp, self.top_logprobs))
                else:
                    shifted = _shift_offsets(lp, self.part_start_len)
                    for k in self.lp_completion:
                        self.lp_completion[k].extend(shifted.get(k) or [])
        ids = choice.get("token_ids")
        n = len(ids) if isinstance(ids, list) else int(usage.get("completion_tokens") or 0)
        if isinstance(ids, list):
            self.ids.extend(ids)
        self.texts.append(text)
        self.text_len += len(text)
        self.tokens += n
        self.stop_reason = choice.get("stop_reason")
        self.progress(n)
        return n, choice.get("finish_reason")

    def _text(self, choice: dict, ids: Any, continuation: bool) -> str:
        """A /v1/completions part's text: vLLM's, or for a continued part the mirror's (router/text.py)."""
        if not (continuation and self.mirror is not None and isinstance(ids, list)):
            return choice.get("text") or ""
        finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        by_token = finish == "stop" and not isinstance(stop_reason, str)  # EOS or a stop token id ended it
        if ids and by_token and not self.body.get("include_stop_str_in_output"):
            ids = ids[:-1]  # vLLM does not detokenize that last token
        return self.mirror.text(ids)

    def answer(self, finish: str | None) -> dict:
        """The caller's one body, from every part."""
        # a shallow copy: every field of the template that is changed below is replaced, never mutated
        doc = dict(self.template) if self.template is not None else {}
        choice = dict((doc.get("choices") or [{}])[0])
        text = "".join(self.texts)
        if self.kind == "chat":
            message = dict(choice.get("message") or {"role": "assistant"})
            message["content"] = text
            choice["message"] = message
            choice["logprobs"] = {"content": self.lp_chat} if self.want_logprobs else None
            doc.pop("prompt_token_ids", None)
            if self.want_ids:
                doc["prompt_token_ids"] = self.prompt_ids
        else:
            choice["text"] = text
            choice["logprobs"] = self.lp_completion if self.want_logprobs else None
            choice.pop("prompt_token_ids", None)
            if self.want_ids:
                choice["prompt_token_ids"] = self.prompt_ids
        choice.pop("token_ids", None)
        if self.want_ids:
            choice["token_ids"] = self.ids
        choice["finish_reason"] = finish
        choice["stop_reason"] = self.stop_reason
        choice["index"] = 0
        doc["choices"] = [choice]
        doc.update(self.head or {})
        doc["usage"] = self.usage()
        doc["pearl"] = self.pearl()
        return doc

    # -- streaming --------------------------------------------------------------------------------
    def take_chunk(self, obj: dict, continuation: bool) -> tuple[dict | None, int, str | None]:
        """One upstream stream event → (the caller's chunk or None, tokens in it, its finish_reason)."""
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if isinstance(usage, dict) and not choices:
            if self.prompt_tokens is None and not continuation and isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            self.prefill_tokens += int(usage.get("prompt_tokens") or 0)
            return None, 0, None
        if not choices:
            return None, 0, None
        ch = choices[0]
        chat_shaped = self.kind == "chat" and not continuation
        if self.head is None:
            self.head = {"id": obj.get("id"), "created": obj.get("created"), "model": obj.get("model")}
        prompt_ids = obj.get("prompt_token_ids") if chat_shaped else ch.get("prompt_token_ids")
        if self.prompt_ids is None and not continuation and isinstance(prompt_ids, list):
            self.prompt_ids = list(prompt_ids)
        ids = ch.get("token_ids") if isinstance(ch.get("token_ids"), list) else []
        if chat_shaped:
            delta = ch.get("delta") or {}
            text = delta.get("content") or ""
        else:
            delta = None
            text = self._text(ch, ch.get("token_ids"), continuation)
        lp = ch.get("logprobs")
        n = len(ids) if ids or "token_ids" in ch else (1 if text else 0)
        self.ids.extend(ids)
        self.tokens += n
        self.texts.append(text)
        self.text_len += len(text)
        self.progress(n)
        finish = ch.get("finish_reason")
        if "stop_reason" in ch:
            self.stop_reason = ch.get("stop_reason")
        out_finish = None if finish == "abort" else finish
        role = bool(delta and delta.get("role"))
        if not text and not ids and out_finish is None and not role and not lp:
            return None, n, finish
        head = self.head or {}
        if self.kind == "chat":
            if chat_shaped:
                choice = {k: v for k, v in ch.items() if k not in ("token_ids", "finish_reason")}
            else:
                choice = {"index": 0, "delta": {"content": text}}
                if lp:
                    choice["logprobs"] = {"content": chat_logprobs(lp, self.top_logprobs)}
            obj_name = "chat.completion.chunk"
        else:
            choice = {k: v for k, v in ch.items() if k not in ("token_ids", "prompt_token_ids", "finish_reason")}
            choice["text"] = text
            if lp:
                choice["logprobs"] = _shift_offsets(lp, self.part_start_len)
            obj_name = "text_completion"
        choice["index"] = 0
        choice["finish_reason"] = out_finish
        if self.want_ids:
            choice["token_ids"] = ids
        chunk: dict[str, Any] = {
            "id": head.get("id"),
            "object": obj_name,
            "created": head.get("created"),
            "model": head.get("model"),
            "choices": [choice],
        }
        if self.want_ids and not self.sent_prompt_ids and self.prompt_ids is not None:
            if self.kind == "chat":
                chunk["prompt_token_ids"] = self.prompt_ids
            else:
                choice["prompt_token_ids"] = self.prompt_ids
            self.sent_prompt_ids = True
        return chunk, n, finish

    def final_chunks(self, chunk: dict | None, finish: str) -> list[dict]:
        """The caller's last chunk (with ``pearl``) and, if asked for, the summed usage."""
        head = self.head or {}
        if chunk is None:
            obj_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            empty = {"index": 0, "delta": {}} if self.kind == "chat" else {"index": 0, "text": ""}
            chunk = {
                "id": head.get("id"),
                "object": obj_name,
                "created": head.get("created"),
                "model": head.get("model"),
                "choices": [empty],
            }
        chunk["choices"][0]["finish_reason"] = finish
        chunk["pearl"] = self.pearl()
        out = [chunk]
        if self.include_usage:
            out.append(
                {
                    "id": head.get("id"),
                    "object": chunk["object"],
                    "created": head.get("created"),
                    "model": head.get("model"),
                    "choices": [],
                    "usage": self.usage(),
                }
            )
        return out


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj.encode() if isinstance(obj, str) else orjson.dumps(obj)) + b"\n\n"


# The data plane's JSON goes through orjson: a turn's body carries its whole context as token ids (the caller's
# request, the upstream request, the upstream answer with prompt_token_ids, the caller's answer), and the
# standard library's encoder and decoder were a third of the gateway's CPU at 64 paced GPUs
# (docs/benchmarks.md, "Live at 64 GPUs"). orjson refuses NaN and Infinity as the standard library's strict
# parse does; it writes a NaN float as null.
class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


# -- the gateway ---------------------------------------------------------------------------------------
class Gateway:
    """The app's state: configuration, the upstream client (vllm-router), the members, counters."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        http: httpx.AsyncClient | None = None,
        pd_launcher: PdLauncher | None = None,
    ):
        self.config = config
        self.router = config.router_url.rstrip("/")  # vllm-router in regular mode, for the gateway's whole life
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
        self.members = Members()
        self._wanted: dict[str, int] = {}  # url -> the latest add's ticket (a remove withdraws it)
        self._ticket = 0
        # PD: without a launcher no PD router ever runs and PREFILL/DECODE members serve whole requests
        self.pd_launcher = pd_launcher
        self.pd: PdRouter | None = None  # the PD router new requests go to
        self._regular: set[str] = set()  # what the gateway has put into the regular vllm-router
        self._plan_lock = asyncio.Lock()  # one change of the routers' membership at a time
        self._inflight: Counter[str] = Counter()  # upstream base URL -> attempts running through it
        self._retiring: set[asyncio.Task] = set()  # tasks that stop a PD router once nothing runs through it
        self._draining: list[PdRouter] = []
        self._pd_failed: tuple[PdLists, float, float] | None = None  # lists, when, back-off
        self.pd_info: dict[str, Any] = {"launches": 0, "failures": 0, "retired": 0, "last_launch_s": None}
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
            )
        }
        # where a non-streamed turn's time went, summed over the completed ones: from its arrival to its answer,
        # and the part of it its attempts waited for vllm-router (the rest is this process: backoff, queueing
        # for the event loop, parsing)
        self.seconds = {"turns": 0.0, "upstream": 0.0}
        self._key = config.key.encode()
        self.tokenizers = Tokenizers()  # for the text of continued turns (pearlctl.router.text)
        self._model_roots: dict[str, str] = {}  # served model name -> its directory (``root`` in /v1/models)
        self._unmirrored: set[tuple[str, str]] = set()  # why a model's continued turns keep vLLM's text: said once each
        # The control plane's loop (ControlPlane): membership runs there, with its own client. None: on the
        # caller's loop with the data plane's clients (the app served in one loop, as in the unit tests).
        self.control_loop: asyncio.AbstractEventLoop | None = None
        self._control_client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        """Stop every PD router (the one serving and those still draining) unless a control plane owns them
        (`close_control`), then the upstream clients."""
        if self.control_loop is None:
            await self.close_control()
        await self.http.aclose()

    async def close_control(self) -> None:
        """On the control plane's loop: stop every PD router and the control client."""
        for task in list(self._retiring):
            task.cancel()
        routers = [self.pd] if self.pd is not None else []
        routers += self._draining
        self.pd = None
        for router in routers:
            with contextlib.suppress(Exception):
                await router.stop()
        if self._control_client is not None:
            await self._control_client.aclose()
            self._control_client = None

    @property
    def control_http(self) -> httpx.AsyncClient:
        """The client of a membership call: the control plane's own on its loop, else the data plane's."""
        if self.control_loop is None or asyncio.get_running_loop() is not self.control_loop:
            return self.http
        if self._control_client is None:
            self._control_client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0))
        return self._control_client

    async def on_control(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` on the control plane's loop (from the data plane's: handed over and
        awaited); on this loop when there is no control plane or this is it."""
        loop = self.control_loop
        if loop is None or asyncio.get_running_loop() is loop:
            return await fn(*args, **kwargs)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), loop))

    # -- the edge ---------------------------------------------------------------------------------
    def check_key(self, request: Request) -> JSONResponse | None:
        given = request.headers.get("authorization")
        hint = "the run's router key (RUN_DIR/.pearl/router.key; OpenAI clients: api_key=<key>)"
        if not given:
            self.stats["unauthorized"] += 1
            return error(
                401,
                f"missing Authorization header: send 'Authorization: Bearer <key>' with {hint}",
                "authentication_error",
            )
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            self.stats["unauthorized"] += 1
            return error(401, f"Authorization must be 'Bearer <key>' with {hint}", "authentication_error")
        if not hmac.compare_digest(token.strip().encode(), self._key):
            self.stats["unauthorized"] += 1
            return error(401, f"wrong key in Authorization: Bearer: use {hint}", "authentication_error")
        return None

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not (declared.isascii() and declared.isdigit()) or int(declared) > limit):
            raise _BadRequest(413, f"body larger than {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _BadRequest(413, f"body larger than {limit} bytes")
            chunks.append(chunk)
        try:  # NaN and Infinity are not JSON: refused here, not when the request is sent on (a 500)
            doc = orjson.loads(b"".join(chunks) or b"null")
        except ValueError:
            raise _BadRequest(400, "body must be a JSON object (an OpenAI request; no NaN or Infinity)") from None
        if not isinstance(doc, dict):
            raise _BadRequest(400, "body must be a JSON object (an OpenAI request)")
        return doc

    def session_of(self, request: Request, body: dict) -> str | None:
        """X-Session-ID, else the body's ``session`` (removed), else the OpenAI ``user`` field."""
        session = request.headers.get(SESSION_HEADER)
        from_body = body.pop("session", None)
        if not session:
            if from_body is not None and not isinstance(from_body, str):
                raise _BadRequest(400, "session must be a string (or send the X-Session-ID header)")
            session = from_body or (body.get("user") if isinstance(body.get("user"), str) else None)
        if session and (len(session) > MAX_SESSION_CHARS or not session.isascii() or not session.isprintable()):
            raise _BadRequest(400, f"session must be printable ASCII of at most {MAX_SESSION_CHARS} characters")
        return session or None

    def retry_for(self, request: Request) -> float:
        raw = request.headers.get(RETRY_FOR_HEADER)
        if raw is None:
            return self.config.retry_for_s
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value <= self.config.max_retry_for_s:
            raise _BadRequest(400, f"{RETRY_FOR_HEADER} must be seconds from 0 to {self.config.max_retry_for_s:g}")
        return value

    def upstream_headers(self, request: Request, session: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if session:
            headers[SESSION_HEADER] = session
        for name in FORWARDED_HEADERS:
            if request.headers.get(name):
                headers[name] = request.headers[name]
        return headers

    # -- attempts ---------------------------------------------------------------------------------
    async def before_attempt(self, turn: Turn) -> None:
        """Back off (full jitter, doubling; none after an abort that made progress); `_GiveUp` once the
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

    def _refusal(self, status: int) -> bool:
        return 400 <= status < 500 and status not in RETRYABLE_4XX

    def upstream(self, session: str | None) -> str:
        """The vllm-router one attempt goes to: the PD router for the sessions its share of the workers
        covers (`pd_share`, `choose_pd`), else the regular one."""
        pd = self.pd
        if pd is None or not pd.alive():
            return self.router
        return pd.url if choose_pd(session, pd_share(len(self._regular), pd.lists)) else self.router

    @contextlib.contextmanager
    def _through(self, session: str | None) -> Iterator[str]:
        """Pick the upstream of one attempt and count the attempt as running through it while it runs (a PD
        router that no longer gets new requests is stopped only once none runs through it)."""
        base = self.upstream(session)
        self.stats["attempts_regular" if base == self.router else "attempts_pd"] += 1
        self._inflight[base] += 1
        try:
            yield base
        finally:
            self._inflight[base] -= 1
            if self._inflight[base] <= 0:
                del self._inflight[base]

    @contextlib.asynccontextmanager
    async def _open_stream(self, session: str | None, path: str, body: dict, headers: dict[str, str]):
        with self._through(session) as base:
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
                    root = entry.get("root") or entry.get("id")
                    if isinstance(root, str) and root:
                        self._model_roots[model] = root
                        return root
        return None

    async def complete(self, turn: Turn, headers: dict[str, str]) -> dict:
        """A whole non-streaming answer (or `_Refused` / `_GiveUp`)."""
        while True:
            await self.before_attempt(turn)
            path, body, continuation = turn.request()
            if continuation:
                await self.mirror_text(turn)
            turn.attempts += 1
            since = self.members.mark()
            try:
                sent = time.monotonic()
                with self._through(turn.session) as base:
                    resp = await self.http.post(base + path, content=orjson.dumps(body), headers=headers)
            except httpx.HTTPError as exc:
                turn.failed(f"{type(exc).__name__}: {exc}".strip())
                continue
            finally:
                self.seconds["upstream"] += time.monotonic() - sent
            if resp.status_code != 200:
                if self._refusal(resp.status_code):
                    raise _Refused(resp.status_code, resp.content, resp.headers.get("content-type"))
                turn.failed(f"HTTP {resp.status_code} from the router: {resp.text[:300]}")
                continue
            who = self.members.attribute(since, resp.headers.get(VERSION_HEADER), resp.headers.get(WORKER_HEADER))
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
        """The caller's one stream, continued across parts; raises `_Refused` / `_GiveUp` only before its
        first byte, and afterwards ends with an error event and ``[DONE]``."""
        while True:
            try:
                await self.before_attempt(turn)
            except _GiveUp as exc:
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
            since = self.members.mark()
            part_tokens, finish, last_chunk, broke = 0, None, None, ""
            stated: tuple[str | None, str | None] = (None, None)
            try:
                async with self._open_stream(turn.session, path, body, headers) as resp:
                    if resp.status_code != 200:
                        raw = await resp.aread()
                        if self._refusal(resp.status_code):
                            raise _Refused(resp.status_code, raw, resp.headers.get("content-type"))
                        turn.failed(f"HTTP {resp.status_code} from the router: {raw.decode(errors='replace')[:300]}")
                        continue
                    stated = (resp.headers.get(VERSION_HEADER), resp.headers.get(WORKER_HEADER))
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
                        part_tokens += n
                        if fin is not None:
                            finish = fin
                            left = turn.remaining()
                            if fin == "abort" and left is not None and left <= 0:
                                finish = "length"
                            if finish != "abort":
                                last_chunk = chunk  # held back for the pearl field; a usage event may follow
                                continue
                        if chunk is not None:
                            turn.emitted = True
                            yield sse(chunk)
            except _Refused as exc:
                if not turn.emitted:
                    raise
                yield sse(
                    {
                        "error": {
                            "message": exc.body.decode(errors="replace")[:500],
                            "type": "upstream_error",
                            "code": exc.status,
                        }
                    }
                )
                yield sse("[DONE]")
                return
            except (httpx.HTTPError, ValueError, _StreamBroke) as exc:
                broke = f"the stream broke ({type(exc).__name__}: {exc})".strip()
            who = self.members.attribute(since, *stated)
            if finish is not None and finish != "abort":
                turn.add_part(part_tokens, finish, who)
                for out in turn.final_chunks(last_chunk, finish):
                    yield sse(out)
                yield sse("[DONE]")
                turn.emitted = True
                return
            turn.add_part(part_tokens, finish, who)
            if finish == "abort":
                why = f"the worker aborted the request after {part_tokens} token(s) (a drain)"
            else:
                why = broke or "the stream ended without a finish_reason"
            if turn.emitted and turn.tokens > 0 and turn.prompt_ids is None:  # cannot continue, must not repeat
                yield sse(
                    {
                        "error": {
                            "message": f"{why}; the worker did not return the prompt's token ids, so the "
                            "part already streamed cannot be continued",
                            "type": "pearl_not_continuable",
                            "code": 502,
                        }
                    }
                )
                yield sse("[DONE]")
                return
            turn.interrupted(why, part_tokens)

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
                        if self._refusal(resp.status_code):
                            raise _Refused(resp.status_code, raw, resp.headers.get("content-type"))
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

    # -- routes -----------------------------------------------------------------------------------
    async def generate(self, request: Request, kind: str) -> Response:
        received = time.time()
        refused = self.check_key(request)
        if refused is not None:
            return refused
        self.stats["requests"] += 1
        try:
            body = await self.read_json(request)
            session = self.session_of(request, body)
            turn = Turn(kind, body, session, self.retry_for(request))
        except _BadRequest as exc:
            return error(exc.status, str(exc), "invalid_request_error")
        headers = self.upstream_headers(request, session)
        if not turn.stream:
            arrived = time.monotonic()
            try:
                doc = await self.complete(turn, headers)
            except _Refused as exc:
                self.stats["refused"] += 1
                return exc.response()
            except _GiveUp as exc:
                self.stats["gave_up"] += 1
                log.warning("gave up: %s", exc)
                return exc.response()
            self._count(turn)
            self.seconds["turns"] += time.monotonic() - arrived
            # when the gateway had the request and when it answered (unix seconds): a caller's round trip less
            # this span is the time its request and answer spent outside the gateway's handler
            doc["pearl"]["timing"] = {"received": round(received, 4), "answered": round(time.time(), 4)}
            return OrjsonResponse(doc)
        gen = self.stream(turn, headers) if turn.continuable else self.stream_whole(turn, headers)
        try:
            first = await gen.__anext__()
        except _Refused as exc:
            self.stats["refused"] += 1
            return exc.response()
        except _GiveUp as exc:
            self.stats["gave_up"] += 1
            log.warning("gave up: %s", exc)
            return exc.response()
        except StopAsyncIteration:
            return error(502, "the router's stream ended before any event", "upstream_error")

        async def body_iter() -> AsyncIterator[bytes]:
            yield first
            async for piece in gen:
                yield piece
            self._count(turn)

        return StreamingResponse(body_iter(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    def _count(self, turn: Turn) -> None:
        self.stats["completed"] += 1
        self.stats["continuations"] += turn.continued
        self.stats["continued_requests"] += 1 if turn.continued else 0
        self.stats["restarted"] += turn.restarted

    async def models(self, request: Request) -> Response:
        """The model list, as the serving router answers it; when the router cannot (down, or no worker
        it counts healthy yet, as right after a membership change), as the first member worker that does."""
        refused = self.check_key(request)
        if refused is not None:
            return refused
        pd = self.pd
        base = pd.url if pd is not None and pd.alive() and not self._regular else self.router
        try:
            resp = await self.http.get(base + "/v1/models", timeout=10.0)
            failure = None if resp.status_code == 200 else (resp.status_code, resp.text[:300])
        except httpx.HTTPError as exc:
            resp, failure = None, (503, f"does not answer ({type(exc).__name__}: {exc})")
        if failure is None and resp is not None:
            return Response(resp.content, 200, media_type="application/json")
        for url in self.members.urls():
            try:
                direct = await self.http.get(url + "/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            if direct.status_code == 200:
                return Response(direct.content, 200, media_type="application/json")
        status, text = failure
        if resp is None:
            return error(503, f"the router {text}, nor does any member worker", "router_unavailable")
        return error(status if status >= 400 else 502, f"the router answered {status}: {text}", "upstream_error")

    async def router_workers(self, base: str | None = None) -> list[dict] | None:
        """A vllm-router's own list of its workers (``GET /workers``): the regular one's, or the one at
        ``base``; None when it does not answer."""
        try:
            resp = await self.control_http.get((base or self.router) + "/workers", timeout=2.0)
            doc = resp.json()
        except (httpx.HTTPError, ValueError):
            return None
        workers = doc.get("workers") if isinstance(doc, dict) else None
        return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else None

    async def _pd_listing(self) -> tuple[PdRouter | None, dict[str, dict] | None]:
        """The serving PD router and its workers by URL (None: no PD router, or it does not answer)."""
        pd = self.pd
        if pd is None or not pd.alive():
            return pd, None
        listed = await self.router_workers(pd.url)
        return pd, ({str(w.get("url", "")).rstrip("/"): w for w in listed} if listed is not None else None)

    async def health(self, request: Request) -> Response:
        doc, status = await self.on_control(self.health_doc)
        return JSONResponse(doc, status)

    async def health_doc(self) -> tuple[dict, int]:
        """``/health``'s document and status (503 while vllm-router does not answer)."""
        listed = await self.router_workers()
        pd, pd_seen = await self._pd_listing()
        pd_doc: dict[str, Any] = {**self.pd_info, "router": None}
        ready_pairs = False
        if pd is not None:
            healthy_pd = {u for u, w in (pd_seen or {}).items() if w.get("is_healthy")}
            pd_doc["router"] = {
                "url": pd.url,
                **pd.lists.doc(),
                "up": pd_seen is not None,
                "healthy_prefill": len(healthy_pd & set(pd.lists.prefill)),
                "healthy_decode": len(healthy_pd & set(pd.lists.decode)),
            }
            ready_pairs = bool(healthy_pd & set(pd.lists.prefill)) and bool(healthy_pd & set(pd.lists.decode))
        if listed is None:
            return {"ok": False, "router": "down", "members": len(self.members.by_url), "pd": pd_doc}, 503
        healthy = sum(1 for w in listed if w.get("is_healthy"))
        return (
            {
                "ok": True,
                "router": "up",
                "members": len(self.members.by_url),
                "workers": len(listed),
                "healthy_workers": healthy,
                "has_workers": healthy > 0 or ready_pairs,
                "pd": pd_doc,
            },
            200,
        )

    # -- membership -------------------------------------------------------------------------------
    async def _wait_healthy(self, url: str, wait_s: float) -> str | None:
        """None once ``url``/health answers 200 within ``wait_s``; else why not."""
        deadline = time.monotonic() + wait_s
        last = "no answer"
        while True:
            try:
                resp = await self.control_http.get(url + "/health", timeout=min(5.0, max(0.5, wait_s)))
                if resp.status_code == 200:
                    return None
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}".strip()
            if time.monotonic() >= deadline:
                return f"{url}/health not 200 within {wait_s:g} s (last: {last})"
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def _router_call(self, what: str, url: str, timeout: float) -> str | None:
        """POST the regular vllm-router's /add_worker or /remove_worker; None on success, else why not."""
        try:
            resp = await self.control_http.post(f"{self.router}/{what}", params={"url": url}, timeout=timeout)
        except httpx.HTTPError as exc:
            return f"the router did not answer {what} ({type(exc).__name__}: {exc})"
        if resp.status_code == 200 or (what == "add_worker" and "already exists" in resp.text):
            return None
        return f"the router answered {what} with HTTP {resp.status_code}: {resp.text[:300]}"

    async def _launch_pd(self, lists: PdLists) -> PdRouter | None:
        """A PD router for ``lists``, ready; None when none can be had now: no launcher, a launch for the same
        lists failed less than its back-off ago, or this launch failed (counted, logged, backed off)."""
        if self.pd_launcher is None:
            return None
        failed = self._pd_failed
        if failed is not None and failed[0] == lists and time.monotonic() < failed[1] + failed[2]:
            return None
        t0 = time.monotonic()
        try:
            router = await self.pd_launcher(lists)
        except Exception as exc:
            again = failed is not None and failed[0] == lists
            backoff = min(self.config.pd_retry_max_s, failed[2] * 2) if again and failed else self.config.pd_retry_s
            self._pd_failed = (lists, time.monotonic(), backoff)
            self.pd_info["failures"] += 1
            self.pd_info["last_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log.error(
                "no PD router for prefill %s, decode %s (%s): they serve whole requests through the regular "
                "router; next try in %.1f s",
                list(lists.prefill),
                list(lists.decode),
                self.pd_info["last_error"],
                backoff,
            )
            return None
        took = time.monotonic() - t0
        self._pd_failed = None
        self.pd_info["launches"] += 1
        self.pd_info["last_launch_s"] = round(took, 3)
        log.info(
            "PD router %s ready in %.2f s: prefill %s, decode %s",
            router.url,
            took,
            list(lists.prefill),
            list(lists.decode),
        )
        return router

    def _retire(self, router: PdRouter) -> None:
        """``router`` gets no new requests; it is stopped once no attempt runs through it any more (at most
        ``request_timeout_s`` later: an attempt is bounded by that)."""
        self._draining.append(router)

        async def drain() -> None:
            t0 = time.monotonic()
            deadline = t0 + self.config.request_timeout_s + 5.0
            try:
                while self._inflight.get(router.url, 0) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                left = self._inflight.get(router.url, 0)
                await router.stop()
                self.pd_info["retired"] += 1
                log.info(
                    "PD router %s stopped %.2f s after its last new request%s",
                    router.url,
                    time.monotonic() - t0,
                    f" ({left} attempt(s) still on it)" if left else "",
                )
            except Exception as exc:  # the gateway goes on; aclose stops what is left
                log.warning("stopping PD router %s failed: %s", router.url, exc)
            finally:
                if router in self._draining:
                    self._draining.remove(router)

        task = asyncio.create_task(drain())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _reconcile(
        self, *, force: Iterable[str] = (), gone: Iterable[str] = (), wait_s: float = 30.0
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Make the two vllm-routers route to exactly what the members say (`pd_lists`, `regular_members`);
        returns (URLs that could not be put into the regular router, URLs that could not be taken out of
        it), each with why.

        Make before break: a new PD router is ready, and the regular router has every worker it must take
        over, before new requests go by the new plan; only then are workers taken out of the regular router
        and the PD router that was replaced retired (stopped once no attempt runs through it). ``force``:
        URLs to add to the regular router again even if the gateway put them there (it may have lost them);
        ``gone``: URLs to take out of it even if the gateway does not know them as its own."""
        async with self._plan_lock:
            roles = self.members.roles()
            want = pd_lists(roles)
            old = self.pd
            new = old
            if want is None:
                new = None
            elif old is None or old.lists != want or not old.alive():
                new = await self._launch_pd(want)  # None: the PD workers serve through the regular router
            target = regular_members(roles, new.lists if new is not None else None)
            forced = set(force)
            failed: dict[str, str] = {}
            for url in sorted(target):
                if url in self._regular and url not in forced:
                    continue
                why = await self._router_call("add_worker", url, timeout=max(5.0, wait_s) + 5.0)
                if why is None:
                    self._regular.add(url)
                else:
                    failed[url] = why
            self.pd = new
            if old is not None and old is not new:
                self._retire(old)
            stuck: dict[str, str] = {}
            for url in sorted((self._regular | set(gone)) - target):
                why = await self._router_call("remove_worker", url, timeout=10.0)
                if why is None:
                    self._regular.discard(url)
                else:
                    stuck[url] = why
            return failed, stuck

    async def _admit(
        self, workers: list[WorkerIn], *, gone: Iterable[str] = (), wait_s: float
    ) -> tuple[dict[str, tuple[int, dict]], dict[str, str]]:
        """Add or update ``workers``, each once its ``/health`` answers 200 within its ``wait_s`` (awaited
        concurrently), then route to exactly the members, ``gone`` left out: one change of the routers for
        the whole set. Returns each worker's (HTTP status, answer) and the URLs that could not be taken out of
        the regular router. A worker that could not be routed is not a member (or keeps its previous version
        and role)."""
        tickets: dict[str, int] = {}
        for w in workers:
            self._ticket += 1
            tickets[w.url] = self._wanted[w.url] = self._ticket
        whys = await asyncio.gather(*(self._wait_healthy(w.url, w.wait_s) for w in workers))
        results: dict[str, tuple[int, dict]] = {}
        before: dict[str, _Member | None] = {}
        for w, why in zip(workers, whys, strict=True):
            if self._wanted.get(w.url) != tickets[w.url]:
                message = f"{w.url} was removed or re-added while it was awaited"
                results[w.url] = (409, {"error": {"message": message, "type": "conflict", "code": 409}})
            elif why is not None:
                if w.url not in self.members.by_url:
                    del self._wanted[w.url]
                status = 504 if "not 200 within" in why else 502
                message = f"{w.url} not added: {why}"
                results[w.url] = (status, {"error": {"message": message, "type": "worker_unavailable", "code": status}})
            else:
                before[w.url] = self.members.by_url.get(w.url)
                member, added, changed = self.members.set(w.url, w.weight_version, w.role)
                results[w.url] = (200, {"worker": member.doc(), "added": added, "updated": changed})
        failed, stuck = await self._reconcile(force=before, gone=gone, wait_s=wait_s)
        undone: list[str] = []
        for url, why in failed.items():
            if url not in before or self._wanted.get(url) != tickets[url]:
                continue  # not one of these workers, or removed meanwhile
            prev = before.pop(url)
            if prev is None:
                self.members.drop(url)
                del self._wanted[url]
                undone.append(url)
            else:
                self.members.put(prev)
            message = f"{url} not added: {why}"
            results[url] = (502, {"error": {"message": message, "type": "worker_unavailable", "code": 502}})
        if failed.keys() & tickets.keys():
            _, more = await self._reconcile(gone=undone, wait_s=wait_s)  # a late add must not route
            stuck.update(more)
        for url in before:
            _, doc = results[url]
            if doc["added"] or doc["updated"]:
                m = self.members.by_url[url]
                log.info(
                    "member %s %s (%s, weight version %s)",
                    url,
                    "added" if doc["added"] else "updated",
                    m.role,
                    m.weight_version,
                )
        return results, stuck

    async def add(self, worker: WorkerIn) -> tuple[int, dict]:
        """Add one worker (or change its version or role); (HTTP status, answer)."""
        results, _ = await self._admit([worker], wait_s=worker.wait_s)
        return results[worker.url]

    async def remove(self, url: str) -> dict:
        self._wanted.pop(url, None)
        was = self.members.drop(url)
        _, stuck = await self._reconcile(gone=[url])
        if url in stuck:
            raise _BadRequest(502, f"{url}: {stuck[url]}")
        if was:
            log.info("member %s removed", url)
        return {"removed": was}

    async def sync(self, wanted: WorkerSet) -> dict:
        target = {w.url: w for w in wanted.workers}
        removed = [u for u in list(self.members.by_url) if u not in target]
        for url in removed:
            self._wanted.pop(url, None)
            self.members.drop(url)
            log.info("member %s removed", url)
        routed = {d["url"] for d in await self.member_docs() if d.get("routed") is not False}
        current = self.members.by_url
        changing = [
            w.model_copy(update={"wait_s": wanted.wait_s})
            for w in target.values()
            if w.url not in current
            or (current[w.url].weight_version, current[w.url].role) != (w.weight_version, w.role)
            or w.url not in routed  # a member a router lost (a failed re-registration) is added again
        ]
        results, stuck = await self._admit(changing, gone=removed, wait_s=wanted.wait_s)
        if stuck:
            raise _BadRequest(502, "; ".join(f"{url}: {why}" for url, why in sorted(stuck.items())))
        added, updated, failed = [], [], {}
        for url, (status, doc) in results.items():
            if status != 200:
                failed[url] = doc["error"]["message"]
            elif doc["added"]:
                added.append(url)
            elif doc["updated"]:
                updated.append(url)
        return {
            "added": added,
            "removed": removed,
            "updated": updated,
            "failed": failed,
            "workers": await self.member_docs(),
        }

    async def member_docs(self) -> list[dict]:
        """The members, each with ``router`` (``regular`` or ``pd``: which vllm-router routes to it),
        ``routed`` and ``healthy`` as that router lists it (both left out when it does not answer)."""
        listed = await self.router_workers()
        seen = {str(w.get("url", "")).rstrip("/"): w for w in listed} if listed is not None else None
        pd, pd_seen = await self._pd_listing()
        in_pd = pd.lists.urls() if pd is not None else frozenset()
        out = []
        for m in self.members.members():
            doc = m.doc()
            if m.url in in_pd:
                doc["router"] = "pd"
                if pd is not None and not pd.alive():
                    doc["routed"] = doc["healthy"] = False
                elif pd_seen is not None:
                    doc["routed"] = m.url in pd_seen
                    doc["healthy"] = bool(pd_seen[m.url].get("is_healthy")) if m.url in pd_seen else False
            else:
                doc["router"] = "regular"
                if seen is not None:
                    doc["routed"] = m.url in seen
                    doc["healthy"] = bool(seen[m.url].get("is_healthy")) if m.url in seen else False
            out.append(doc)
        return out

    async def reregister(self) -> list[str]:
        """Put the regular members back into a regular vllm-router that lost them (restarted); returns the URLs
        that failed."""
        return await self.on_control(self._reregister)

    async def _reregister(self) -> list[str]:
        async with self._plan_lock:
            return [url for url in sorted(self._regular) if await self._router_call("add_worker", url, timeout=30.0)]

    async def check_pd(self) -> None:
        """Called now and then (pearlctl.router.__main__): a PD router that exited is replaced (its workers
        serve through the regular router meanwhile), and lists whose PD router could not be started are tried
        again once their back-off has passed (`_launch_pd`)."""
        await self.on_control(self._check_pd)

    async def _check_pd(self) -> None:
        pd = self.pd
        if pd is not None and not pd.alive():
            log.error("PD router %s exited: starting another", pd.url)
        elif pd is not None or pd_lists(self.members.roles()) is None:
            return  # the PD router runs (`_reconcile` keeps its lists right), or none is wanted
        await self._reconcile()

    async def workers_route(self, request: Request) -> Response:
        refused = self.check_key(request)
        if refused is not None:
            return refused
        try:
            if request.method == "GET":
                docs = await self.on_control(self.member_docs)
                return JSONResponse({"workers": docs, "change": self.members.change})
            if request.method == "DELETE":
                ref = _parse(WorkerRef, {"url": request.query_params.get("url", "")})
                return JSONResponse(await self.on_control(self.remove, ref.url))
            doc = await self.read_json(request)
            if request.method == "POST":
                status, answer = await self.on_control(self.add, _parse(WorkerIn, doc))
                return JSONResponse(answer, status)
            return JSONResponse(await self.on_control(self.sync, _parse(WorkerSet, doc)))
        except _BadRequest as exc:
            return error(exc.status, str(exc), "invalid_request_error")

    async def stats_route(self, request: Request) -> Response:
        refused = self.check_key(request)
        if refused is not None:
            return refused
        seconds = {k: round(v, 3) for k, v in self.seconds.items()}
        return JSONResponse(
            {**self.stats, "seconds": seconds, "members": len(self.members.by_url), "pd": dict(self.pd_info)}
        )


def _parse(model: type[BaseModel], doc: dict) -> Any:
    try:
        return model.model_validate_json(json.dumps(doc))
    except ValidationError as exc:
        raise _BadRequest(422, describe(exc)) from None


def build_control_app(gateway: Gateway) -> Starlette:
    """The control plane's routes (`ControlPlane`): health, membership, counters; no completion."""
    return Starlette(
        routes=[
            Route("/health", gateway.health, methods=["GET"]),
            Route(WORKERS_PATH, gateway.workers_route, methods=["GET", "POST", "PUT", "DELETE"]),
            Route("/pearl/stats", gateway.stats_route, methods=["GET"]),
        ]
    )


class ControlPlane:
    """The gateway's control plane on a thread of its own: an event loop that owns membership
    (``gateway.control_loop``) and serves `build_control_app` on ``sock``; ``tasks`` (coroutine functions of a
    stop event) run beside it on that loop. `start` returns once it serves; `stop` stops the server, lets
    ``tasks`` end, closes what the control plane owns (`Gateway.close_control`: PD routers are stopped) and
    joins the thread. A PD router started here is a child of this thread, which lives as long as the gateway
    serves (pearlctl.router.__main__: its death signal follows the thread that forked it)."""

    def __init__(
        self,
        gateway: Gateway,
        sock: socket.socket,
        *,
        tasks: Iterable[Callable[[asyncio.Event], Awaitable[None]]] = (),
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ):
        self.gateway, self.sock, self.tasks = gateway, sock, list(tasks)
        self.loop_factory = loop_factory or asyncio.new_event_loop
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._server: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-control", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._started.wait(timeout) or self.error is not None or self.gateway.control_loop is None:
            raise RuntimeError(f"the gateway's control plane did not start: {self.error or 'no answer'}")

    def stop(self, timeout: float = 30.0) -> None:
        loop, server, stopping = self._loop, self._server, self._stopping
        if loop is not None and server is not None and stopping is not None and not loop.is_closed():

            def ask_to_stop() -> None:
                server.should_exit = True
                stopping.set()

            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(ask_to_stop)
        self._thread.join(timeout)

    def _run(self) -> None:
        loop = self.loop_factory()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # said by start(), or logged once the gateway serves
            self.error = exc
            log.error("the gateway's control plane stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._started.set()
            loop.close()

    async def _main(self) -> None:
        import uvicorn

        self._stopping = asyncio.Event()
        self._server = uvicorn.Server(
            uvicorn.Config(
                build_control_app(self.gateway), log_level="warning", access_log=False, lifespan="off",
                timeout_graceful_shutdown=5,
            )
        )  # fmt: skip
        serving = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("the control server exited before it served")
            await asyncio.sleep(0.01)
        self.gateway.control_loop = asyncio.get_running_loop()
        background = [asyncio.create_task(task(self._stopping)) for task in self.tasks]
        self._started.set()
        try:
            await serving
        finally:
            self._stopping.set()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.gateway.close_control()


def build_app(gateway: Gateway) -> Starlette:
    async def completions(request: Request) -> Response:
        return await gateway.generate(request, "completions")

    async def chat(request: Request) -> Response:
        return await gateway.generate(request, "chat")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route(WORKERS_PATH, gateway.workers_route, methods=["GET", "POST", "PUT", "DELETE"]),
        Route("/pearl/stats", gateway.stats_route, methods=["GET"]),
    ]
    return Starlette(routes=routes)
