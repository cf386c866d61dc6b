"""The paced engine's HTTP face: the parts of vLLM's OpenAI and dev-mode API pearlctl uses, answered as vLLM
answers them, over one `PacedEngine` (pearlctl/agent/engines/paced_batch.py).

`PacedApp.app` is the Starlette application: request parsing and validation (vLLM's error bodies and codes), whole
and streamed completions and chat completions with token ids and logprobs, the ``X-Pearl-Worker`` and
``X-Pearl-Weight-Version`` headers, and the control routes (pause, sleep, abort, weights, metrics). Every route
list is in `PacedApp.app`; the module doc of pearlctl/agent/engines/paced.py says what each does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pearlctl.agent.engines.paced_batch import UNSET_VERSION, PacedEngine, Seq
from pearlctl.agent.engines.paced_tokens import Vocab, chat_prompt
from pearlctl.agent.engines.vllm_endpoints import PAUSE_MODES

VOCAB = 1 << 20  # token ids a prompt may hold (a real tokenizer's ids pass through: they are only hashed)
DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
WORKER_HEADER = "x-pearl-worker"
VERSION_HEADER = "x-pearl-weight-version"


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def engine_request_id(kind: str, request: Request, body: dict) -> str:
    """The id ``/abort_requests`` knows a request by, as vLLM 0.32 names it: the ``X-Request-Id`` header, else the
    body's ``request_id``, else a random one, prefixed ``chatcmpl-`` (a chat turn) or prefixed ``cmpl-`` and
    suffixed with the prompt's index ``-0`` (a completion: one prompt)."""
    given = body.get("request_id")
    base = request.headers.get("x-request-id") or (given if isinstance(given, str) and given else uuid.uuid4().hex)
    return f"chatcmpl-{base}" if kind == "chat" else f"cmpl-{base}-0"


class PacedApp:
    """The HTTP face of one `PacedEngine`."""

    def __init__(self, engine: PacedEngine, *, model: str, served_name: str, ready_at: float):
        self.engine = engine
        self.model = model
        self.served_name = served_name
        self.ready_at = ready_at
        self.load = 0
        self.serial = asyncio.Lock()
        self.worker = os.environ.get("PEARL_WORKER_URL", "")

    def headers(self) -> dict[str, str]:
        out = {}
        if self.worker:
            out[WORKER_HEADER] = self.worker
        if self.engine.version != UNSET_VERSION:
            out[VERSION_HEADER] = self.engine.version
        return out

    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at and self.engine.task is not None and not self.engine.task.done()

    # -- parsing --------------------------------------------------------------------------------
    def parse(self, kind: str, body: Any) -> tuple[list[int], int, dict]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, self.served_name):
            raise BadRequest(f"The model `{model}` does not exist.", 404)
        if body.get("n") not in (None, 1):
            raise BadRequest("the paced engine generates one sequence per request (n = 1)")
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise BadRequest("messages must be a list of objects with role and content")
            prompt = self.engine.vocab.encode(chat_prompt(messages))
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
                raw = raw[0]
            if isinstance(raw, str):
                prompt = self.engine.vocab.encode(raw)
            elif isinstance(raw, list) and raw and all(type(t) is int and 0 <= t < VOCAB for t in raw):
                prompt = list(raw)
            else:
                raise BadRequest(f"prompt must be a string or one list of token ids in 0..{VOCAB - 1}")
            mt = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if not prompt:
            raise BadRequest("the prompt is empty")
        room = self.engine.max_model_len - len(prompt)
        if mt is None:
            mt = room
        if type(mt) is not int or mt < 1:
            raise BadRequest(f"max_tokens must be an integer >= 1, got {mt!r}")
        if mt > room:
            raise BadRequest(
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested {len(prompt) + mt} tokens ({len(prompt)} in the messages, {mt} in the completion)."
            )
        so = body.get("stream_options")
        lp = body.get("logprobs")
        opts = {
            "stream": bool(body.get("stream")),
            "usage": bool(isinstance(so, dict) and so.get("include_usage")),
            "ids": bool(body.get("return_token_ids")),
            "logprobs": bool(lp) if kind == "chat" else lp is not None,
        }
        return prompt, mt, opts

    # -- answers --------------------------------------------------------------------------------
    def whole(self, kind: str, seq: Seq, opts: dict, created: int) -> dict:
        vocab = self.engine.vocab
        text = "".join(seq.text(vocab, 0, len(seq.out)))
        ids = opts["ids"]
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "tool_calls": []},
                "logprobs": chat_logprobs(vocab, seq, 0, len(seq.out)) if opts["logprobs"] else None,
                "finish_reason": seq.finish,
                "stop_reason": None,
                "token_ids": list(seq.out) if ids else None,
            }
            doc = {"id": seq.rid, "object": "chat.completion", "created": created, "model": self.served_name}
            doc["choices"] = [choice]
            doc["prompt_token_ids"] = list(seq.prompt) if ids else None
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": completion_logprobs(vocab, seq, 0, len(seq.out), 0) if opts["logprobs"] else None,
                "finish_reason": seq.finish,
                "stop_reason": None,
                "prompt_token_ids": list(seq.prompt) if ids else None,
                "token_ids": list(seq.out) if ids else None,
            }
            doc = {"id": seq.rid, "object": "text_completion", "created": created, "model": self.served_name}
            doc["choices"] = [choice]
        doc["usage"] = usage(seq)
        return doc

    async def chunks(self, kind: str, seq: Seq, opts: dict, created: int) -> AsyncIterator[bytes]:
        chat = kind == "chat"
        vocab = self.engine.vocab
        head = {
            "id": seq.rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.served_name,
        }
        sent = 0
        first = True
        try:
            if chat:
                event: dict[str, Any] = {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                if opts["ids"]:
                    event["prompt_token_ids"] = list(seq.prompt)
                yield _sse(event)
            while True:
                await seq.changed.wait()
                seq.changed.clear()
                hi, finish = len(seq.out), seq.finish
                if hi > sent or finish is not None:
                    choice: dict[str, Any] = {"index": 0}
                    before = sum(len(p) for p in seq.text(vocab, 0, sent))  # the text's offset
                    text = "".join(seq.text(vocab, sent, hi))
                    if chat:
                        choice["delta"] = {"content": text} if hi > sent else {}
                        choice["logprobs"] = chat_logprobs(vocab, seq, sent, hi) if opts["logprobs"] else None
                    else:
                        choice["text"] = text
                        choice["logprobs"] = (
                            completion_logprobs(vocab, seq, sent, hi, before) if opts["logprobs"] else None
                        )
                    choice["finish_reason"] = finish
                    choice["stop_reason"] = None
                    if opts["ids"]:
                        choice["token_ids"] = list(seq.out[sent:hi])
                        if first and not chat:
                            choice["prompt_token_ids"] = list(seq.prompt)
                    first = False
                    sent = hi
                    yield _sse({**head, "choices": [choice]})
                if finish is not None:
                    break
            if opts["usage"]:
                yield _sse({**head, "choices": [], "usage": usage(seq)})
            yield b"data: [DONE]\n\n"
        finally:
            self.engine.forget(seq)
            self.load -= 1

    async def generate(self, request: Request, kind: str) -> Response:
        if not self.ready():
            return _error(503, "the engine is starting", "ServiceUnavailable")
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        try:
            prompt, max_tokens, opts = self.parse(kind, body)
        except BadRequest as exc:
            return _error(exc.status, str(exc), "NotFoundError" if exc.status == 404 else "BadRequestError")
        self.load += 1
        handed = False
        arrived = time.monotonic()
        try:
            profile = self.engine.profile
            async with self.serial:
                await asyncio.sleep(profile.request_serial_s)
            await asyncio.sleep(max(profile.request_overhead_s - profile.request_serial_s, 0.0))
            seq = self.engine.submit(engine_request_id(kind, request, body), prompt, max_tokens, arrived)
            created = int(time.time())
            if opts["stream"]:
                handed = True  # the stream's generator ends the request and the load
                return StreamingResponse(
                    self.chunks(kind, seq, opts, created), media_type="text/event-stream", headers=self.headers()
                )
            gone = asyncio.ensure_future(_disconnected(request))
            done = asyncio.ensure_future(_finished(seq))
            await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            done.cancel()
            gone_first = seq.finish is None  # the client went away: vLLM aborts the request
            self.engine.forget(seq)
            if gone_first:
                return Response(status_code=499)
            return Response(
                orjson.dumps(self.whole(kind, seq, opts, created)),
                media_type="application/json",
                headers=self.headers(),
            )
        finally:
            if not handed:
                self.load -= 1

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.ready() else 503)

    async def models(self, request: Request) -> Response:
        entry = {
            "id": self.served_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pearlctl-paced",
            "root": self.model,  # as vLLM's: a driver and the gateway read the model's tokenizer from it
            "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}", "BadRequestError")
        await self.engine.pause(mode)
        return JSONResponse({})

    async def resume(self, request: Request) -> Response:
        self.engine.resume()
        return JSONResponse({})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.engine.paused})

    async def sleep(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            level = -1
        if level not in (0, 1, 2) or mode not in PAUSE_MODES:
            return _error(400, f"level must be 0, 1 or 2 and mode one of {', '.join(PAUSE_MODES)}", "BadRequestError")
        await self.engine.pause(mode)
        await self.engine.busy(self.engine.profile.costs.sleep_s)
        self.engine.sleep_level = max(level, 1)
        return JSONResponse({})

    async def wake_up(self, request: Request) -> Response:
        if self.engine.sleep_level:
            await self.engine.busy(self.engine.profile.costs.wake_s)
        self.engine.sleep_level = 0
        self.engine.resume()
        return JSONResponse({"status": "awake"})

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(self.engine.sleep_level) or self.engine.paused})

    async def abort_requests(self, request: Request) -> Response:
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return _error(400, "request_ids must be a list of strings", "BadRequestError")
        return JSONResponse({"aborted": self.engine.abort(ids)})

    async def collective_rpc(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        if not isinstance(body, dict) or body.get("method") != "reload_weights":
            return _error(400, "the paced engine runs only the reload_weights method", "BadRequestError")
        path = (body.get("kwargs") or {}).get("weights_path") if isinstance(body.get("kwargs"), dict) else None
        if not isinstance(path, str) or not path:
            return _error(400, "reload_weights needs kwargs.weights_path (a directory)", "BadRequestError")
        await self.engine.reload(path)
        return JSONResponse({"results": [None]})

    async def update_weight_version(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str) or not version:
            return _error(400, "new_version must be a non-empty string", "BadRequestError")
        self.engine.version = version
        return JSONResponse({})

    async def weight_info(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.engine.version, "weights": self.engine.weights})

    async def load_route(self, request: Request) -> Response:
        return JSONResponse({"server_load": self.load})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.engine.metrics(), media_type="text/plain; version=0.0.4")

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            return await self.generate(request, "completions")

        async def chat(request: Request) -> Response:
            return await self.generate(request, "chat")

        routes = [
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", self.health),
            Route("/load", self.load_route),
            Route("/metrics", self.metrics),
            Route("/pause", self.pause, methods=["POST"]),
            Route("/resume", self.resume, methods=["POST"]),
            Route("/is_paused", self.is_paused),
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping),
            Route("/abort_requests", self.abort_requests, methods=["POST"]),
            Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
            Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
            Route("/weight_info", self.weight_info),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.engine.task = asyncio.create_task(self.engine.run())
            yield
            self.engine.task.cancel()

        return Starlette(routes=routes, lifespan=lifespan)


def completion_logprobs(vocab: Vocab, seq: Seq, lo: int, hi: int, offset: int) -> dict:
    """A completion's ``logprobs`` for generated ids lo..hi, whose text starts at ``offset`` in the answer's."""
    pieces = seq.text(vocab, lo, hi)
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    tokens = [vocab.piece(t) for t in seq.out[lo:hi]]
    return {
        "text_offset": offsets,
        "token_logprobs": seq.lps[lo:hi],
        "tokens": tokens,
        "top_logprobs": [{t: v} for t, v in zip(tokens, seq.lps[lo:hi], strict=True)],
    }


def chat_logprobs(vocab: Vocab, seq: Seq, lo: int, hi: int) -> dict:
    """A chat completion's ``logprobs`` for generated ids lo..hi."""
    content = []
    for t, v in zip(seq.out[lo:hi], seq.lps[lo:hi], strict=True):
        c = vocab.piece(t)
        b = list(c.encode("utf-8"))
        content.append({"token": c, "logprob": v, "bytes": b, "top_logprobs": [{"token": c, "logprob": v, "bytes": b}]})
    return {"content": content}


def usage(seq: Seq) -> dict:
    p, c = len(seq.prompt), len(seq.out)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": None}


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def _finished(seq: Seq) -> None:
    while seq.finish is None:
        await seq.changed.wait()
        seq.changed.clear()
