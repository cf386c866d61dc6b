"""The gateway (pearlctl.router: gateway, app, turn, routing, admin) with one seam faked: the upstream HTTP
(vllm-router and the workers' ``/health``), as an ``httpx.MockTransport``. The app itself runs for real
(Starlette, through ``httpx.ASGITransport``).

The fake upstream "decodes" greedily with a deterministic rule — the next token is a function of the whole
sequence — so a continuation from token ids reproduces an uninterrupted run exactly only if the gateway sends
exactly the prompt's ids plus the generated ids, with the right remaining budget. A script says what each
generation request meets: served whole, aborted after k tokens (a drain), a stream broken after k tokens (a
killed worker), a stream held after k tokens until the test lets it go on, a connection refused, or an HTTP
status.

Prefill-decode: the gateway gets a fake PD-router launcher (`Launcher`); each PD router it "starts" is one
more upstream origin (``http://pd-N:9100``) that serves generations like the regular router and lists its
prefill and decode workers, so a test sees which router every attempt went to and when one was stopped.
"""

from __future__ import annotations

import asyncio
import json
import time
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pearlctl.router import admin
from pearlctl.router.app import build_app
from pearlctl.router.gateway import Gateway, GatewayConfig
from pearlctl.router.membership import RouterMembership, ValidationError
from pearlctl.router.routing import PdLists, choose_pd, pd_lists, pd_share, regular_members

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTER = "http://router:9000"
W1, W2 = "http://w1:8000", "http://w2:8000"


def next_token(seq: list[int]) -> int:
    return (seq[-1] * 31 + len(seq) * 7 + 3) % 256 if seq else 1


def greedy(prompt_ids: list[int], n: int) -> list[int]:
    seq = list(prompt_ids)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt_ids) :]


def detok(t: int) -> str:
    return chr(65 + t % 26)


def chat_ids(messages: list[dict]) -> list[int]:
    return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode()) + [200]


def vllm_pieces(tok: Tokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    """Each generated token's text as vLLM makes it: a DecodeStream primed with the request's prompt ids."""
    stream = DecodeStream(ids=prompt_ids, skip_special_tokens=True)
    return [stream.step(tok, t) or "" for t in ids]


class FakePd:
    """A PD router the fake launcher "started"."""

    def __init__(self, url: str, lists: PdLists):
        self.url, self.lists = url, lists
        self.stopped = False
        self.dead = False

    def alive(self) -> bool:
        return not (self.stopped or self.dead)

    async def stop(self) -> None:
        self.stopped = True


class Launcher:
    """The gateway's PD-router launcher: ``fail`` launches raise first (a router that never got ready)."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.launched: list[FakePd] = []
        self.fail = 0

    async def __call__(self, lists: PdLists) -> FakePd:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("vllm-router did not answer http://127.0.0.1:1/liveness within 20 s")
        pd = FakePd(f"http://pd-{len(self.launched) + 1}:9100", lists)
        self.launched.append(pd)
        self.upstream.pd_routers[pd.url] = pd
        return pd


class FakeJudge(FakePd):
    """A judge router the fake judge launcher "started": a vllm-router in regular mode with its own workers."""

    def __init__(self, url: str):
        super().__init__(url, PdLists((), ()))
        self.routed: set[str] = set()


class JudgeLauncher:
    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.launched: list[FakeJudge] = []

    async def __call__(self) -> FakeJudge:
        judge = FakeJudge(f"http://judge-router-{len(self.launched) + 1}:9200")
        self.launched.append(judge)
        self.upstream.judge_routers[judge.url] = judge
        return judge


class Upstream:
    """vllm-router and its workers. ``script``: one entry per generation request, consumed in order —
    None (served whole), ("abort", k), ("break", k), ("hold", k, event, then) (a stream: k tokens, then it
    waits for ``event`` and ends with an abort, ``then`` "abort", or goes on to the end, "finish"),
    ("connect",), ("status", code, text)."""

    def __init__(self) -> None:
        self.script: list[Any] = []
        self.requests: list[tuple[str, dict, dict]] = []
        self.via: list[str] = []  # which router each generation request went to
        self.pd_routers: dict[str, FakePd] = {}
        self.judge_routers: dict[str, FakeJudge] = {}  # judge workers' hosts start with "judge": they serve "judge"
        self.router_calls: list[tuple[str, str]] = []
        self.routed: set[str] = set()
        self.unhealthy: set[str] = set()
        self.router_down = False
        self.version_header: str | None = None
        self.omit_prompt_ids = False  # a worker that does not return the prompt's token ids
        # text as vLLM makes it: a tokenizers DecodeStream primed with the request's prompt ids (None: detok)
        self.tokenizer: Tokenizer | None = None
        self.root: str | None = None  # the model directory the workers' /v1/models name
        self.waiting: dict[str, int] = {}  # requests in a worker's queue, as its /metrics says
        self.running: dict[str, int] = {}  # ... and those it runs
        self.no_metrics: set[str] = set()  # workers whose /metrics fails
        self.aborts: list[tuple[str, list[str]]] = []  # each worker's /abort_requests: (worker, request ids)

    def gen_requests(self) -> list[tuple[str, dict, dict]]:
        return self.requests

    async def handle(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        pd = self.pd_routers.get(origin)
        judge = self.judge_routers.get(origin)
        if judge is not None:
            if not judge.alive():
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            if path in ("/add_worker", "/remove_worker"):
                url = request.url.params["url"]
                (judge.routed.add if path == "/add_worker" else judge.routed.discard)(url)
                return httpx.Response(200, text="ok")
            if path == "/workers":
                return httpx.Response(200, json={"workers": [{"url": u, "is_healthy": True} for u in judge.routed]})
            if path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "judge"}]})
        elif pd is not None:
            if not pd.alive():
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            if path in ("/add_worker", "/remove_worker"):  # as 0.1.17 in PD mode
                return httpx.Response(400, text="requires add_prefill_server or add_decode_server")
            if path == "/workers":
                listed = [{"url": u, "worker_type": "prefill", "is_healthy": True} for u in pd.lists.prefill]
                listed += [{"url": u, "worker_type": "decode", "is_healthy": True} for u in pd.lists.decode]
                return httpx.Response(200, json={"workers": listed})
        elif origin != ROUTER:  # a worker's /health, asked by the gateway before adding it
            if origin in self.unhealthy:
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            if path == "/v1/models":
                model = "judge" if request.url.host.startswith("judge") else "tiny"
                entry = {"id": model, "from": origin, **({"root": self.root} if self.root else {})}
                return httpx.Response(200, json={"object": "list", "data": [entry]})
            if path == "/metrics":
                if origin in self.no_metrics:
                    return httpx.Response(500, text="metrics down")
                n, r = self.waiting.get(origin, 0), self.running.get(origin, 0)
                labels = '{engine="0",model_name="tiny"}'
                return httpx.Response(
                    200, text=f"vllm:num_requests_waiting{labels} {n}.0\nvllm:num_requests_running{labels} {r}.0\n"
                )
            if path == "/abort_requests":
                self.aborts.append((origin, json.loads(request.content)["request_ids"]))
            return httpx.Response(200, json={})
        elif self.router_down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if judge is None and path in ("/add_worker", "/remove_worker"):  # a judge router's: above
            url = request.url.params["url"]
            self.router_calls.append((path, url))
            if path == "/add_worker":
                if url in self.routed:
                    return httpx.Response(400, text=f"Worker {url} already exists")
                self.routed.add(url)
            else:
                self.routed.discard(url)
            return httpx.Response(200, text="ok")
        if path == "/workers":
            return httpx.Response(200, json={"workers": [{"url": u, "is_healthy": True} for u in sorted(self.routed)]})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        self.requests.append((path, body, dict(request.headers)))
        self.via.append(origin)
        step = self.script.pop(0) if self.script else None
        if step is not None and step[0] == "connect":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if step is not None and step[0] == "status":
            return httpx.Response(step[1], text=step[2])
        chat = path == "/v1/chat/completions"
        try:  # what vLLM refuses with a 400 (a missing or malformed prompt, a budget that is no count)
            if chat:
                prompt_ids = chat_ids(body["messages"])
                budget = body.get("max_completion_tokens") or body.get("max_tokens") or 16
            else:
                prompt = body["prompt"]
                prompt_ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
                budget = body.get("max_tokens") or 16
            if not all(isinstance(t, int) for t in prompt_ids) or not isinstance(budget, int) or budget < 1:
                raise ValueError("bad prompt or max_tokens")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return httpx.Response(400, json={"error": {"message": f"{type(exc).__name__}: {exc}", "code": 400}})
        hold = step if step is not None and step[0] == "hold" else None
        k = budget if step is None or (hold and hold[3] == "finish") else min(step[1], budget)
        ids = greedy(prompt_ids, k)
        pieces = self._pieces(prompt_ids, ids)
        finish = (
            "length"
            if step is None or (hold and hold[3] == "finish")
            else ("abort" if step[0] in ("abort", "hold") else None)
        )
        headers = {"x-pearl-weight-version": self.version_header} if self.version_header else {}
        want_ids = bool(body.get("return_token_ids"))
        if self.omit_prompt_ids:
            prompt_ids = None
        if body.get("stream"):
            return httpx.Response(
                200,
                headers={**headers, "content-type": "text/event-stream"},
                content=self._events(
                    chat,
                    body,
                    prompt_ids,
                    ids,
                    pieces,
                    finish,
                    want_ids,
                    broken=step is not None and step[0] == "break",
                    hold=(hold[1], hold[2]) if hold else None,
                ),
            )
        return httpx.Response(
            200, headers=headers, json=self._answer(chat, body, prompt_ids, ids, pieces, finish, want_ids)
        )

    def _pieces(self, prompt_ids: list[int], ids: list[int]) -> list[str]:
        """Each generated token's text: ``detok``, or with ``tokenizer`` vLLM's way (pearlctl/router/text.py)."""
        if self.tokenizer is None:
            return [detok(t) for t in ids]
        return vllm_pieces(self.tokenizer, prompt_ids, ids)

    @staticmethod
    def _logprobs(chat: bool, ids: list[int]) -> Any:
        if chat:
            return {
                "content": [
                    {
                        "token": detok(t),
                        "logprob": -t / 100,
                        "bytes": [ord(detok(t))],
                        "top_logprobs": [{"token": detok(t), "logprob": -t / 100, "bytes": [ord(detok(t))]}],
                    }
                    for t in ids
                ]
            }
        return {
            "tokens": [detok(t) for t in ids],
            "token_logprobs": [-t / 100 for t in ids],
            "top_logprobs": [{detok(t): -t / 100} for t in ids],
            "text_offset": list(range(len(ids))),
        }

    def _answer(self, chat, body, prompt_ids, ids, pieces, finish, want_ids) -> dict:
        text = "".join(pieces)
        n_prompt = len(prompt_ids or [])
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)}
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None}
        if want_ids:
            choice["token_ids"] = ids
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = self._logprobs(True, ids) if body.get("logprobs") else None
            doc = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "tiny", "choices": [choice]}
            if want_ids and prompt_ids is not None:
                doc["prompt_token_ids"] = prompt_ids
        else:
            choice["text"] = text
            choice["logprobs"] = self._logprobs(False, ids) if body.get("logprobs") is not None else None
            if want_ids and prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
            doc = {
                "id": f"cmpl-{len(self.requests)}",
                "object": "text_completion",
                "created": 1,
                "model": "tiny",
                "choices": [choice],
            }
        if body.get("n", 1) > 1:
            doc["choices"] = [dict(choice, index=i) for i in range(body["n"])]
        doc["usage"] = usage
        return doc

    async def _events(self, chat, body, prompt_ids, ids, pieces, finish, want_ids, broken, hold=None):
        head = {
            "id": "chatcmpl-1" if chat else f"cmpl-{len(self.requests)}",
            "created": 1,
            "model": "tiny",
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        if chat:
            first = {
                **head,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
            if want_ids and prompt_ids is not None:
                first["prompt_token_ids"] = prompt_ids
            yield f"data: {json.dumps(first)}\n\n".encode()
        for i, t in enumerate(ids):
            if hold is not None and i == hold[0]:
                await hold[1].wait()
            await asyncio.sleep(0)
            c: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                c["delta"] = {"content": pieces[i]}
            else:
                c["text"] = pieces[i]
                if want_ids and i == 0 and prompt_ids is not None:
                    c["prompt_token_ids"] = prompt_ids
            if want_ids:
                c["token_ids"] = [t]
            yield f"data: {json.dumps({**head, 'choices': [c]})}\n\n".encode()
        if hold is not None and len(ids) <= hold[0]:  # held after its last token, before its finish
            await hold[1].wait()
        if broken:
            raise httpx.ReadError("peer closed connection without sending complete message body")
        last: dict[str, Any] = {"index": 0, "finish_reason": finish, **({"delta": {}} if chat else {"text": ""})}
        if want_ids:
            last["token_ids"] = []
        yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n".encode()
        so = body.get("stream_options") or {}
        if so.get("include_usage"):
            n_prompt = len(prompt_ids or [])
            usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)}
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def run(
    scenario: Callable[[Gateway, httpx.AsyncClient, Upstream], Awaitable[None]],
    *,
    pd: bool = False,
    judge: bool = False,
    **config: Any,
) -> Upstream:
    """Run ``scenario`` against a fresh gateway whose upstream is a fresh `Upstream` (``pd``: with the fake
    PD-router launcher, ``gateway.routers.pd_launcher``; ``judge``: with the fake judge-router launcher)."""
    upstream = Upstream()

    async def main() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(upstream.handle))
        cfg = {"retry_for_s": 5.0, "backoff_s": 0.001, "backoff_max_s": 0.01, **config}
        launcher = Launcher(upstream) if pd else None
        judges = JudgeLauncher(upstream) if judge else None
        config_ = GatewayConfig(key=KEY, router_url=ROUTER, **cfg)
        gateway = Gateway(config_, http=http, pd_launcher=launcher, judge_launcher=judges)
        app = build_app(gateway)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            await scenario(gateway, client, upstream)
        await gateway.aclose()

    asyncio.run(main())
    return upstream


def events(resp: httpx.Response) -> list[Any]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def add(
    client: httpx.AsyncClient, url: str, version: str | None = "7", role: str | None = None
) -> httpx.Response:
    body = {"url": url, "weight_version": version, "wait_s": 1.0, **({"role": role} if role else {})}
    return await client.post("/pearl/workers", json=body, headers=AUTH)


# -- the credential -----------------------------------------------------------------------------------
def test_no_or_wrong_key_is_a_401_naming_what_is_missing_and_health_needs_none() -> None:
    async def scenario(gw, client, up):
        for method, path in [
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/pearl/workers"),
            ("POST", "/pearl/workers"),
            ("GET", "/pearl/stats"),
        ]:
            missing = await client.request(method, path, json={"prompt": "x"})
            assert missing.status_code == 401, path
            err = missing.json()["error"]
            assert err["type"] == "authentication_error" and "missing Authorization header" in err["message"]
            assert "Bearer" in err["message"] and "router.key" in err["message"]
            wrong = await client.request(method, path, json={}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and "wrong key" in wrong.json()["error"]["message"]
            scheme = await client.request(method, path, json={}, headers={"Authorization": KEY})
            assert scheme.status_code == 401 and "'Bearer <key>'" in scheme.json()["error"]["message"]
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["router"] == "up"
        assert health.json()["has_workers"] is False
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers=AUTH)
        assert ok.status_code == 200

    up = run(scenario)
    assert len(up.requests) == 1  # nothing unauthenticated went upstream


def test_session_comes_from_the_header_else_the_body_and_the_callers_credential_stays_here() -> None:
    async def scenario(gw, client, up):
        await client.post(
            "/v1/completions",
            json={"prompt": "a", "max_tokens": 2, "session": "ignored"},
            headers={**AUTH, "X-Session-ID": "ep-1", "X-Request-ID": "r-1"},
        )
        await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "session": "ep-2"}, headers=AUTH)
        await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "user": "ep-3"}, headers=AUTH)
        await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers=AUTH)
        bad = await client.post("/v1/completions", json={"prompt": "a", "session": "x\ny"}, headers=AUTH)
        assert bad.status_code == 400 and "session" in bad.json()["error"]["message"]

    up = run(scenario)
    sessions = [h.get("x-session-id") for _, _, h in up.requests]
    assert sessions == ["ep-1", "ep-2", "ep-3", None]
    assert all("authorization" not in h for _, _, h in up.requests)
    assert up.requests[0][2]["x-request-id"] == "r-1"
    assert all("session" not in body for _, body, _ in up.requests)  # pearlctl's field never goes upstream
    assert up.requests[2][1]["user"] == "ep-3"  # the OpenAI field does


# -- continuation ---------------------------------------------------------------------------------------
def test_an_aborted_completion_is_continued_from_its_token_ids_into_one_exact_answer() -> None:
    prompt = "2 + 2 ="

    async def scenario(gw, client, up):
        await add(client, W1)
        await add(client, W2)
        up.script = [("abort", 5)]
        body = {
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "stop": ["\n"],
            "min_tokens": 8,
            "return_token_ids": True,
            "logprobs": 1,
        }
        resp = await client.post("/v1/completions", json=body, headers={**AUTH, "X-Session-ID": "s"})
        assert resp.status_code == 200
        doc = resp.json()
        want = greedy(list(prompt.encode()), 12)
        choice = doc["choices"][0]
        assert choice["token_ids"] == want
        assert choice["prompt_token_ids"] == list(prompt.encode())
        assert choice["text"] == "".join(detok(t) for t in want)
        assert choice["finish_reason"] == "length"
        assert doc["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12}
        lp = choice["logprobs"]
        assert lp["tokens"] == [detok(t) for t in want] and lp["text_offset"] == list(range(12))  # shifted by 5
        pearl = doc["pearl"]
        assert pearl["continued"] == 1 and pearl["attempts"] == 2 and pearl["restarted"] == 0
        assert [p["tokens"] for p in pearl["parts"]] == [5, 7]
        assert [p["finish_reason"] for p in pearl["parts"]] == ["abort", "length"]
        assert all(p["weight_version"] == "7" and p["version_from"] == "membership" for p in pearl["parts"])

    up = run(scenario)
    (p1, b1, h1), (p2, b2, h2) = up.requests
    assert p1 == p2 == "/v1/completions"
    assert b2["prompt"] == list(prompt.encode()) + greedy(list(prompt.encode()), 5)
    assert (b2["max_tokens"], b2["min_tokens"], b2["stop"], b2["temperature"]) == (7, 3, ["\n"], 0)
    assert h1["x-session-id"] == h2["x-session-id"] == "s"  # the session moves with its worker's removal


def test_a_completion_without_max_tokens_is_continued_to_the_default_16_not_beyond() -> None:
    async def scenario(gw, client, up):
        up.script = [("abort", 5)]
        doc = (await client.post("/v1/completions", json={"prompt": "p"}, headers=AUTH)).json()
        assert doc["usage"]["completion_tokens"] == 16 and doc["pearl"]["continued"] == 1

    up = run(scenario)
    assert "max_tokens" not in up.requests[0][1] and up.requests[1][1]["max_tokens"] == 11


def test_an_answer_says_when_the_gateway_had_the_request_and_when_it_answered() -> None:
    """``pearl.timing`` spans the whole turn, its continuation included, inside the caller's round trip."""

    async def scenario(gw, client, up):
        up.script = [("abort", 2)]
        before = time.time()
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4}, headers=AUTH)).json()
        after = time.time()
        timing = doc["pearl"]["timing"]
        assert doc["pearl"]["continued"] == 1
        assert before - 0.001 <= timing["received"] <= timing["answered"] <= after + 0.001

    run(scenario)


def test_token_ids_are_asked_for_upstream_but_not_returned_unless_the_caller_asked() -> None:
    async def scenario(gw, client, up):
        up.script = [("abort", 2)]
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4}, headers=AUTH)).json()
        assert "token_ids" not in doc["choices"][0] and "prompt_token_ids" not in doc["choices"][0]
        assert doc["choices"][0]["text"] == "".join(detok(t) for t in greedy(list(b"p"), 4))
        assert doc["pearl"]["continued"] == 1

    up = run(scenario)
    assert all(body["return_token_ids"] is True for _, body, _ in up.requests)


def test_an_aborted_chat_turn_continues_through_completions_and_is_answered_chat_shaped() -> None:
    messages = [{"role": "user", "content": "hello"}]

    async def scenario(gw, client, up):
        up.script = [("abort", 4)]
        body = {
            "messages": messages,
            "max_completion_tokens": 10,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
            "return_token_ids": True,
            "tools": [],
            "seed": 3,
        }
        doc = (await client.post("/v1/chat/completions", json=body, headers=AUTH)).json()
        want = greedy(chat_ids(messages), 10)
        choice = doc["choices"][0]
        assert doc["object"] == "chat.completion" and doc["id"] == "chatcmpl-1"
        assert choice["message"] == {"role": "assistant", "content": "".join(detok(t) for t in want)}
        assert choice["token_ids"] == want and doc["prompt_token_ids"] == chat_ids(messages)
        assert choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [detok(t) for t in want]
        assert [e["logprob"] for e in content] == [-t / 100 for t in want]
        assert all(len(e["top_logprobs"]) == 1 and e["bytes"] for e in content)  # converted: chat's shape
        assert doc["pearl"]["continued"] == 1 and doc["usage"]["completion_tokens"] == 10

    up = run(scenario)
    (p1, b1, _), (p2, b2, _) = up.requests
    assert (p1, p2) == ("/v1/chat/completions", "/v1/completions")
    assert b2["prompt"] == chat_ids(messages) + greedy(chat_ids(messages), 4)
    assert b2["max_tokens"] == 6 and b2["logprobs"] == 1 and b2["seed"] == 3
    assert "messages" not in b2 and "tools" not in b2 and "max_completion_tokens" not in b2


def test_a_stream_aborted_then_broken_continues_as_one_stream() -> None:
    async def scenario(gw, client, up):
        up.script = [("abort", 3), ("break", 4)]
        body = {
            "prompt": "xyz",
            "max_tokens": 11,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        resp = await client.post("/v1/completions", json=body, headers=AUTH)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        evs = events(resp)
        assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
        chunks = [e for e in evs[:-1] if e["choices"]]
        got = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
        assert got == greedy(list(b"xyz"), 11)
        assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(detok(t) for t in got)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finishes == ["length"]  # the aborts are not the caller's business
        assert len({c["id"] for c in chunks}) == 1  # one response id throughout
        assert sum("prompt_token_ids" in c["choices"][0] for c in chunks) == 1
        pearl = [e for e in evs[:-1] if "pearl" in e][0]["pearl"]
        assert pearl["continued"] == 2 and [p["tokens"] for p in pearl["parts"]] == [3, 4, 4]
        usage = [e for e in evs[:-1] if not e["choices"]]
        assert [u["usage"]["completion_tokens"] for u in usage] == [11]

    up = run(scenario)
    assert [body["max_tokens"] for _, body, _ in up.requests] == [11, 8, 4]
    assert all(body["stream"] for _, body, _ in up.requests)


def test_a_chat_stream_continues_chat_shaped() -> None:
    messages = [{"role": "user", "content": "hi"}]

    async def scenario(gw, client, up):
        up.script = [("break", 2)]
        body = {"messages": messages, "max_tokens": 6, "stream": True}
        evs = events(await client.post("/v1/chat/completions", json=body, headers=AUTH))
        chunks = [e for e in evs[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == "".join(detok(t) for t in greedy(chat_ids(messages), 6))
        assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["pearl"]["continued"] == 1

    run(scenario)


TINY = Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny"  # built by scripts/setup


def vllm_text(tok: Tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    return "".join(vllm_pieces(tok, prompt_ids, ids))


@pytest.mark.parametrize("stream", [True, False])
def test_a_turn_interrupted_inside_a_character_is_continued_with_the_uninterrupted_text(stream: bool) -> None:
    """The fake makes text as vLLM does (a DecodeStream primed with the request's prompt): a continuation whose
    prompt ends inside a UTF-8 character would repeat the prompt's text. The gateway's own detokenization
    (pearlctl/router/text.py) gives the caller the uninterrupted text at every boundary, and without a
    tokenizer for the model the same boundaries show the fault (so this test can fail)."""
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    messages = [{"role": "user", "content": "la mer, 海 🌊"}]
    n = 24
    prompt = chat_ids(messages)
    ids = greedy(prompt, n)
    whole = vllm_text(tok, prompt, ids)
    split = [
        k for k in range(1, n) if vllm_text(tok, prompt, ids[:k]) + vllm_text(tok, prompt + ids[:k], ids[k:]) != whole
    ]
    assert split, "no boundary splits a character: nothing would be tested"

    def caller_text(resp: httpx.Response) -> str:
        if not stream:
            return resp.json()["choices"][0]["message"]["content"]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in events(resp)[:-1])

    for root, boundaries in ((str(TINY), range(1, n)), (None, split)):
        texts: dict[int, str] = {}

        async def scenario(gw, client, up, root=root, boundaries=boundaries, texts=texts):
            up.tokenizer, up.root = tok, root
            await add(client, W1)
            for k in boundaries:
                up.script = [("abort", k)]
                body = {"messages": messages, "max_tokens": n, "stream": stream}
                texts[k] = caller_text(await client.post("/v1/chat/completions", json=body, headers=AUTH))

        run(scenario)
        if root is not None:
            assert all(t == whole for t in texts.values()), [k for k, t in texts.items() if t != whole]
        else:  # vLLM's text kept: the fault shows at the boundaries inside a character
            assert all(texts[k] != whole for k in split)


def test_without_the_prompts_token_ids_a_turn_is_redone_whole_or_ends_with_an_error_never_repeats() -> None:
    async def scenario(gw, client, up):
        up.omit_prompt_ids = True
        up.script = [("abort", 2)]
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 5}, headers=AUTH)).json()
        assert doc["choices"][0]["text"] == "".join(detok(t) for t in greedy(list(b"p"), 5))
        assert doc["pearl"]["restarted"] == 1 and doc["pearl"]["continued"] == 0
        up.script = [("break", 2)]
        evs = events(await client.post("/v1/completions", json={"prompt": "p", "stream": True}, headers=AUTH))
        assert [e["choices"][0]["text"] for e in evs[:2]] == [detok(t) for t in greedy(list(b"p"), 2)]
        assert evs[2]["error"]["type"] == "pearl_not_continuable" and evs[3:] == ["[DONE]"]

    run(scenario)


def test_an_abort_exactly_at_the_budget_needs_no_continuation() -> None:
    async def scenario(gw, client, up):
        up.script = [("abort", 4)]
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4}, headers=AUTH)).json()
        assert doc["choices"][0]["finish_reason"] == "length" and doc["pearl"]["continued"] == 0

    assert len(run(scenario).requests) == 1


def test_a_request_that_cannot_be_continued_is_sent_again_whole() -> None:
    async def scenario(gw, client, up):
        up.script = [("abort", 2)]
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4, "n": 2}, headers=AUTH)).json()
        assert (
            len(doc["choices"]) == 2 and doc["pearl"]["restarted"] == 1 and doc["pearl"]["not_continuable"] == "n > 1"
        )

    up = run(scenario)
    assert [body for _, body, _ in up.requests] == [{"prompt": "p", "max_tokens": 4, "n": 2}] * 2


# -- failures: retried, passed through, given up -----------------------------------------------------
def test_refused_connections_and_5xx_are_retried_until_a_worker_answers() -> None:
    async def scenario(gw, client, up):
        up.script = [
            ("connect",),
            ("status", 500, "Request failed: error sending request"),
            ("status", 503, "No available workers (all circuits open or unhealthy)"),
        ]
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3}, headers=AUTH)).json()
        assert doc["choices"][0]["text"] and doc["pearl"]["attempts"] == 4 and doc["pearl"]["continued"] == 0

    run(scenario)


@pytest.mark.parametrize("status", [400, 404, 413, 422])
@pytest.mark.parametrize("stream", [False, True])
def test_the_requests_own_fault_passes_through_at_once(status: int, stream: bool) -> None:
    async def scenario(gw, client, up):
        up.script = [("status", status, '{"error": {"message": "maximum context length is 512"}}')]
        resp = await client.post("/v1/completions", json={"prompt": "p", "stream": stream}, headers=AUTH)
        assert resp.status_code == status and "maximum context length" in resp.text

    assert len(run(scenario).requests) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_no_worker_for_longer_than_retry_for_is_a_503_naming_time_attempts_and_last_error(stream: bool) -> None:
    async def scenario(gw, client, up):
        up.script = [("status", 503, "No available workers (all circuits open or unhealthy)")] * 10_000
        t0 = time.monotonic()
        resp = await client.post(
            "/v1/completions", json={"prompt": "p", "stream": stream}, headers={**AUTH, "X-Pearl-Retry-For-S": "0.3"}
        )
        took = time.monotonic() - t0
        # gives up once retry_for has passed (10,000 scripted refusals at 50 ms would take over 8 minutes); the
        # upper bound leaves room for a busy machine
        assert resp.status_code == 503 and 0.3 <= took < 10
        err = resp.json()["error"]
        assert err["type"] == "pearl_retry_exhausted" and err["attempts"] > 3 and err["retry_for_s"] == 0.3
        assert "No available workers" in err["last_error"] and f"after {err['attempts']} attempt(s)" in err["message"]
        assert 0.3 <= err["seconds"] <= took and "retry_for_s 0.3" in err["message"]

    run(scenario, backoff_max_s=0.05)


def test_a_stream_that_cannot_go_on_ends_with_an_error_event_not_silence() -> None:
    async def scenario(gw, client, up):
        up.script = [("break", 3)] + [("connect",)] * 10_000
        resp = await client.post(
            "/v1/completions",
            json={"prompt": "p", "max_tokens": 9, "stream": True},
            headers={**AUTH, "X-Pearl-Retry-For-S": "0.2"},
        )
        evs = events(resp)
        assert resp.status_code == 200 and evs[-1] == "[DONE]"
        assert sum(1 for e in evs[:-1] if "choices" in e) == 3  # what was generated reached the caller
        assert evs[-2]["error"]["type"] == "pearl_retry_exhausted" and "ConnectError" in evs[-2]["error"]["last_error"]

    run(scenario, backoff_max_s=0.05)


def test_the_retry_window_restarts_with_progress() -> None:
    async def scenario(gw, client, up):
        # each part makes progress, then the worker goes: 6 interruptions over more than retry_for_s
        up.script = [("abort", 1), ("status", 503, "none"), ("abort", 1)] * 3
        doc = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 8}, headers=AUTH)).json()
        assert doc["pearl"]["continued"] == 6 and doc["usage"]["completion_tokens"] == 8

    run(scenario, retry_for_s=1.0)


def test_bad_bodies_and_headers_are_refused_at_the_edge() -> None:
    async def scenario(gw, client, up):
        r = await client.post("/v1/completions", content=b"{not json", headers=AUTH)
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json=[1, 2], headers=AUTH)
        assert r.status_code == 400
        r = await client.post("/v1/completions", content=b"x" * 2048, headers=AUTH)
        assert r.status_code == 413 and "1024 bytes" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "p"}, headers={**AUTH, "X-Pearl-Retry-For-S": "-1"})
        assert r.status_code == 400 and "X-Pearl-Retry-For-S".lower() in r.json()["error"]["message"]

    assert run(scenario, max_body_bytes=1024).requests == []


# -- weight versions --------------------------------------------------------------------------------------
def test_weight_versions_from_the_worker_else_an_unambiguous_membership_else_marked_ambiguous() -> None:
    async def scenario(gw, client, up):
        await add(client, W1, "3")
        one = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=AUTH)).json()
        assert one["pearl"]["parts"] == [
            {"tokens": 2, "finish_reason": "length", "worker": W1, "weight_version": "3", "version_from": "membership"}
        ]
        await add(client, W2, "4")
        two = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=AUTH)).json()
        part = two["pearl"]["parts"][0]
        assert part["weight_version"] is None and part["version_from"] == "ambiguous"
        assert part["candidates"] == ["3", "4"] and "worker" not in part and two["pearl"]["ambiguous"] is True
        up.version_header = "4"
        said = (await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=AUTH)).json()
        assert said["pearl"]["parts"][0]["weight_version"] == "4" and said["pearl"]["weight_versions"] == ["4"]
        assert said["pearl"]["parts"][0]["version_from"] == "worker"

    run(scenario)


def test_a_worker_removed_during_a_part_keeps_its_version_a_candidate() -> None:
    async def scenario(gw, client, up):
        await add(client, W1, "3")
        since = gw.members.mark()
        await client.delete("/pearl/workers", params={"url": W1}, headers=AUTH)
        await add(client, W2, "4")
        who = gw.members.attribute(since, None, None)
        assert who["version_from"] == "ambiguous" and who["candidates"] == ["3", "4"]
        assert gw.members.attribute(gw.members.mark(), None, None)["weight_version"] == "4"

    run(scenario)


# -- membership (the admin API) ------------------------------------------------------------------------------
def test_admin_api_adds_removes_and_syncs_workers_in_the_router() -> None:
    async def scenario(gw, client, up):
        r = await add(client, W1, "1")
        assert r.status_code == 200 and r.json()["added"] is True and up.routed == {W1}
        again = await add(client, W1, "2")  # vllm-router says "already exists": a re-version, no error
        assert again.status_code == 200 and again.json()["updated"] is True
        listed = (await client.get("/pearl/workers", headers=AUTH)).json()["workers"]
        assert [(w["url"], w["weight_version"], w["routed"], w["healthy"]) for w in listed] == [(W1, "2", True, True)]
        up.unhealthy.add(W2)
        sick = await client.post("/pearl/workers", json={"url": W2, "wait_s": 0.3}, headers=AUTH)
        assert sick.status_code == 504 and "not 200 within 0.3 s" in sick.json()["error"]["message"]
        assert W2 not in up.routed and ("/add_worker", W2) not in up.router_calls  # never routed to
        up.unhealthy.clear()
        W3 = "http://w3:8000"
        synced = await client.put(
            "/pearl/workers",
            json={"workers": [{"url": W2, "weight_version": "2"}, {"url": W3, "weight_version": "2"}], "wait_s": 1},
            headers=AUTH,
        )
        assert synced.status_code == 200
        doc = synced.json()
        assert sorted(doc["added"]) == [W2, W3] and doc["removed"] == [W1] and doc["failed"] == {}
        assert up.routed == {W2, W3}
        gone = await client.delete("/pearl/workers", params={"url": W3}, headers=AUTH)
        assert gone.json() == {"removed": True} and up.routed == {W2}
        unknown = await client.delete("/pearl/workers", params={"url": W3}, headers=AUTH)
        assert unknown.json() == {"removed": False}
        health = (await client.get("/health")).json()
        assert health["members"] == 1 and health["has_workers"] is True

    run(scenario)


def test_sync_leaves_settled_members_alone_and_adds_back_one_the_router_lost() -> None:
    async def scenario(gw, client, up):
        await add(client, W1, "1")
        await add(client, W2, "1")
        up.router_calls.clear()
        both = {"workers": [{"url": W1, "weight_version": "1"}, {"url": W2, "weight_version": "2"}]}
        doc = (await client.put("/pearl/workers", json=both, headers=AUTH)).json()
        assert (doc["added"], doc["updated"], doc["removed"]) == ([], [W2], [])
        assert up.router_calls == [("/add_worker", W2)]  # W1, settled, was not touched
        up.routed.discard(W1)  # the router lost it (a restart whose re-registration failed)
        await client.put("/pearl/workers", json=both, headers=AUTH)
        assert up.routed == {W1, W2}

    run(scenario)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"url": "w1:8000"}, "url"),
        ({"url": "http://w1"}, "url"),
        ({"url": "http://w1:8000/v1"}, "url"),
        ({"url": "http://w1:8000", "weight_version": "a b"}, "weight_version"),
        ({"url": "http://w1:8000", "wait_s": 1e9}, "wait_s"),
        ({"url": "http://w1:8000", "colour": "red"}, "colour"),
        ({"url": "http://w1:8000", "role": "TRAIN"}, "role"),
        ({"url": "http://w1:8000", "role": "prefill"}, "role"),
    ],
)
def test_admin_bodies_are_typed_and_refusals_name_the_field(body: dict, field: str) -> None:
    async def scenario(gw, client, up):
        r = await client.post("/pearl/workers", json=body, headers=AUTH)
        assert r.status_code == 422 and r.json()["error"]["message"].startswith(field)

    assert run(scenario).router_calls == []


def test_reregister_puts_every_member_back_into_a_restarted_router() -> None:
    async def scenario(gw, client, up):
        await add(client, W1)
        await add(client, W2)
        up.routed.clear()  # vllm-router restarted: its membership was in memory
        assert await gw.routers.reregister() == []
        assert up.routed == {W1, W2}

    run(scenario)


def test_health_says_when_the_router_is_down_and_models_pass_through() -> None:
    async def scenario(gw, client, up):
        models = await client.get("/v1/models", headers=AUTH)
        assert models.status_code == 200 and models.json()["data"][0] == {"id": "tiny"}  # the router's answer
        await add(client, W1)
        up.router_down = True
        down = await client.get("/health")
        assert down.status_code == 503 and down.json()["router"] == "down"
        models = await client.get("/v1/models", headers=AUTH)  # a member worker answers in the router's place
        assert models.status_code == 200 and models.json()["data"][0] == {"id": "tiny", "from": W1}
        up.unhealthy.add(W1)
        models = await client.get("/v1/models", headers=AUTH)
        assert models.status_code == 503
        assert "router does not answer" in models.json()["error"]["message"]
        assert "nor does any member worker" in models.json()["error"]["message"]

    run(scenario)


@settings(max_examples=200, deadline=None)
@given(
    noise=st.lists(st.text(st.characters(blacklist_categories=("Cc", "Zl", "Zp")), max_size=40), max_size=8),
    values=st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=4),
)
def test_a_workers_metrics_text_is_read_for_its_gauge_alone_and_never_raises(noise, values) -> None:
    """What a worker's /metrics says crosses into the gateway's rebalance: any text is read without raising, the
    gauge's label sets are summed, and other lines — a longer name sharing its prefix, a malformed value — count
    nothing."""
    lines = [*noise, "vllm:num_requests_running_total 99.0", "vllm:num_requests_running{x} not-a-number"]
    lines += [f'vllm:num_requests_running{{engine="{i}"}} {v!r}' for i, v in enumerate(values)]
    text = "\n".join(lines)
    clean = [line for line in noise if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_running "))]
    if not clean:  # random noise that happens to be the gauge is summed too, by design: leave those draws out
        assert admin._gauge(text, admin.RUNNING_METRIC) == pytest.approx(sum(values))
    admin._gauge("".join(noise), admin.WAITING_METRIC)  # never raises


def test_a_join_aborts_on_a_member_with_no_queue_only_when_it_is_imbalanced_against_the_idlest() -> None:
    """The rebalance at a join also asks an older member with no queue, when its load (running + waiting) passes
    vllm-router's own cache_aware imbalance test against the idlest member's (pearlctl.vocabulary.imbalanced:
    more than 64 above it and 1.5x it); a member at the threshold, or whose /metrics cannot be read, is left
    alone."""

    async def scenario(gw, client, up):
        w3, w4 = "http://w3:8000", "http://w4:8000"
        for url in (W1, W2, w3):
            await add(client, url)
        go_on = asyncio.Event()
        up.script = [("hold", 3, go_on, "abort")]
        body = {"prompt": "xyz", "max_tokens": 9, "stream": True}
        turn = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=AUTH))
        while not up.requests:
            await asyncio.sleep(0.01)
        ids = gw.upstream_ids()
        # W1 runs 65 above the joined worker (imbalanced), W2 exactly 64 above it (not), w3 cannot say
        up.running.update({W1: 65, W2: 64, w3: 500})
        up.no_metrics.add(w3)
        assert (await add(client, w4)).status_code == 200
        for _ in range(200):
            if gw.stats["rebalances"]:
                break
            await asyncio.sleep(0.01)
        assert up.aborts == [(W1, ids)] and gw.stats["rebalance_aborts"] == 1
        go_on.set()
        await turn
        # the idlest member sets the bar: with one at 40, 100 is not more than 64 above it
        up.aborts.clear()
        up.running.update({W1: 100, W2: 40})
        up.no_metrics.clear()
        up.running[w3] = 0
        up.running["http://w5:8000"] = 0
        up.script = [("hold", 3, go_on := asyncio.Event(), "abort")]
        turn = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=AUTH))
        while len(up.requests) < 2:
            await asyncio.sleep(0.01)
        up.running.update({w3: 40, w4: 40, "http://w5:8000": 40})  # no idle member anywhere
        assert (await add(client, "http://w5:8000")).status_code == 200
        await asyncio.sleep(0.1)
        assert up.aborts == [] and gw.stats["rebalances"] == 1
        go_on.set()
        await turn

    run(scenario)


def test_a_join_aborts_by_id_only_the_continuable_attempts_and_only_on_members_with_a_queue() -> None:
    """The rebalance at a join (pearlctl.router.admin): an older member with requests waiting is asked to abort
    the gateway's continuable attempts by their engine ids; an attempt that cannot be continued is never named,
    and a join while no member has a queue asks nothing."""

    async def scenario(gw, client, up):
        await add(client, W1)
        go_on = asyncio.Event()
        up.script = [("hold", 3, go_on, "abort"), ("hold", 2, go_on, "finish")]
        body = {"prompt": "xyz", "max_tokens": 9, "stream": True}
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True, "tools": tools}
        turns = [
            asyncio.ensure_future(client.post("/v1/completions", json=body, headers=AUTH)),
            asyncio.ensure_future(client.post("/v1/chat/completions", json=chat, headers=AUTH)),
        ]
        while len(up.requests) < 2:
            await asyncio.sleep(0.01)
        given = up.requests[0][1]["request_id"]
        assert given.startswith("pearl-") and "request_id" not in up.requests[1][1]  # only the continuable one
        assert gw.upstream_ids() == [f"cmpl-{given}-0"]
        up.waiting[W1] = 3
        assert (await add(client, W2)).status_code == 200
        for _ in range(200):
            if gw.stats["rebalances"]:
                break
            await asyncio.sleep(0.01)
        assert up.aborts == [(W1, [f"cmpl-{given}-0"])] and gw.stats["rebalance_aborts"] == 1
        go_on.set()
        first, second = await asyncio.gather(*turns)
        chunks = [e for e in events(first)[:-1] if e.get("choices")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(detok(t) for t in greedy(list(b"xyz"), 9))
        assert [e for e in events(first)[:-1] if "pearl" in e][0]["pearl"]["continued"] == 1
        assert second.status_code == 200 and events(second)[-1] == "[DONE]"
        assert gw.upstream_ids() == []  # none upstream any more
        up.waiting.clear()
        assert (await add(client, "http://w3:8000")).status_code == 200  # a join with no queue anywhere
        await asyncio.sleep(0.05)
        assert len(up.aborts) == 1 and gw.stats["rebalances"] == 1

    run(scenario)


def test_stats_count_continued_and_given_up_requests() -> None:
    async def scenario(gw, client, up):
        up.script = [("abort", 1)]
        await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3}, headers=AUTH)
        up.script = [("connect",)] * 1000
        await client.post("/v1/completions", json={"prompt": "p"}, headers={**AUTH, "X-Pearl-Retry-For-S": "0.05"})
        stats = (await client.get("/pearl/stats", headers=AUTH)).json()
        assert stats["requests"] == 2 and stats["completed"] == 1 and stats["continuations"] == 1
        assert stats["continued_requests"] == 1 and stats["gave_up"] == 1

    run(scenario)


# -- prefill-decode --------------------------------------------------------------------------------------------
P1, P2, D1, D2 = "http://p1:8000", "http://p2:8000", "http://d1:8000", "http://d2:8000"


def test_the_pd_plan_needs_a_whole_pair_and_a_lone_half_serves_whole_requests() -> None:
    roles = {W1: "ROLLOUT", P1: "PREFILL"}
    assert pd_lists(roles) is None
    assert regular_members(roles, None) == {W1, P1}  # half a pair serves colocated
    roles |= {D2: "DECODE", D1: "DECODE", P2: "PREFILL"}
    lists = pd_lists(roles)
    assert lists == PdLists((P1, P2), (D1, D2))
    assert regular_members(roles, lists) == {W1}
    assert regular_members(roles, None) == {W1, P1, P2, D1, D2}  # no PD router (yet): all of them colocated
    assert pd_share(1, lists) == 0.8 and pd_share(0, lists) == 1.0 and pd_share(3, None) == 0.0


def test_the_pd_share_is_kept_per_session_and_drawn_without_one() -> None:
    assert not choose_pd("s", 0.0) and choose_pd("s", 1.0)
    sessions = [f"episode-{i}" for i in range(2000)]
    picks = [choose_pd(s, 0.25) for s in sessions]
    assert picks == [choose_pd(s, 0.25) for s in sessions]  # a session stays on its side
    assert 0.2 < sum(picks) / len(picks) < 0.3
    assert choose_pd(None, 0.5, draw=lambda: 0.49) and not choose_pd(None, 0.5, draw=lambda: 0.51)


def test_members_with_roles_go_through_a_pd_router_while_a_pair_exists() -> None:
    async def scenario(gw, client, up):
        assert (await add(client, W1)).json()["worker"]["role"] == "ROLLOUT"  # the default: colocated
        r = await add(client, P1, role="PREFILL")
        assert r.status_code == 200 and r.json()["worker"]["role"] == "PREFILL"
        assert up.routed == {W1, P1} and gw.routers.pd is None and gw.routers.pd_launcher.launched == []  # half a pair
        r = await add(client, D1, role="DECODE")
        assert r.status_code == 200
        [pd] = gw.routers.pd_launcher.launched
        assert pd.lists == PdLists((P1,), (D1,)) and gw.routers.pd is pd
        assert up.routed == {W1}  # the pair left the regular router once the PD router took it over
        listed = {w["url"]: w for w in (await client.get("/pearl/workers", headers=AUTH)).json()["workers"]}
        assert {u: (w["role"], w["router"], w["routed"]) for u, w in listed.items()} == {
            W1: ("ROLLOUT", "regular", True),
            P1: ("PREFILL", "pd", True),
            D1: ("DECODE", "pd", True),
        }
        health = (await client.get("/health")).json()
        assert health["pd"]["router"]["healthy_prefill"] == 1 and health["pd"]["launches"] == 1

        async def send(session: str) -> None:
            r = await client.post(
                "/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers={**AUTH, "X-Session-ID": session}
            )
            assert r.status_code == 200

        sessions = [f"s{i}" for i in range(60)]
        for s in sessions:
            await send(s)
        first = list(up.via)
        assert {pd.url, ROUTER} == set(first) and 25 < first.count(pd.url) < 55  # 2 of 3 workers are the pair's
        for s in sessions:
            await send(s)
        assert up.via[60:] == first  # each session kept its side

        await client.delete("/pearl/workers", params={"url": W1}, headers=AUTH)
        up.via.clear()
        await send("s0")
        await send("s1")
        assert up.via == [pd.url, pd.url] and up.routed == set()  # only the pair is left

        await client.delete("/pearl/workers", params={"url": D1}, headers=AUTH)
        assert gw.routers.pd is None and up.routed == {P1}  # half a pair again: it serves whole requests
        await asyncio.sleep(0.05)
        assert pd.stopped  # nothing ran through it any more
        up.via.clear()
        await send("s0")
        assert up.via == [ROUTER]
        stats = (await client.get("/pearl/stats", headers=AUTH)).json()
        assert stats["attempts_pd"] == 2 * first.count(pd.url) + 2
        assert stats["attempts_regular"] == 2 * first.count(ROUTER) + 1

    run(scenario, pd=True)


def test_a_new_pair_starts_a_new_pd_router_and_the_old_one_stops_only_after_its_streams_end() -> None:
    async def scenario(gw, client, up):
        synced = await client.put(
            "/pearl/workers",
            json={"workers": [{"url": P1, "role": "PREFILL"}, {"url": D1, "role": "DECODE"}], "wait_s": 1},
            headers=AUTH,
        )
        assert sorted(synced.json()["added"]) == [D1, P1] and up.routed == set()
        [old] = gw.routers.pd_launcher.launched  # one launch for the whole set, not one per worker
        go_on = asyncio.Event()
        up.script = [("hold", 3, go_on, "finish")]
        body = {"prompt": "xyz", "max_tokens": 8, "stream": True, "return_token_ids": True}
        running = asyncio.create_task(client.post("/v1/completions", json=body, headers=AUTH))
        while not up.requests:
            await asyncio.sleep(0.001)
        both = [{"url": P1, "role": "PREFILL"}, {"url": D1, "role": "DECODE"}, {"url": D2, "role": "DECODE"}]
        await client.put("/pearl/workers", json={"workers": both, "wait_s": 1}, headers=AUTH)
        new = gw.routers.pd_launcher.launched[-1]
        assert new.lists == PdLists((P1,), (D1, D2)) and gw.routers.pd is new
        r = await client.post("/v1/completions", json={"prompt": "q", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200 and up.via[-1] == new.url  # new requests: the new router
        await asyncio.sleep(0.1)
        assert not old.stopped  # a stream still runs through the old one
        go_on.set()
        evs = events(await running)
        assert [t for e in evs[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]] == greedy(list(b"xyz"), 8)
        assert up.via[0] == old.url
        for _ in range(100):
            if old.stopped:
                break
            await asyncio.sleep(0.01)
        assert old.stopped and not new.stopped and gw.routers.pd_info["retired"] == 1

    run(scenario, pd=True)


def test_a_turn_aborted_on_a_colocated_worker_that_left_continues_exactly_on_the_pair() -> None:
    async def scenario(gw, client, up):
        await add(client, W1)
        go_on = asyncio.Event()
        up.script = [("hold", 4, go_on, "abort")]
        body = {"prompt": "xyz", "max_tokens": 10, "stream": True, "return_token_ids": True}
        running = asyncio.create_task(client.post("/v1/completions", json=body, headers=AUTH))
        while not up.requests:
            await asyncio.sleep(0.001)
        pair = [{"url": P1, "role": "PREFILL"}, {"url": D1, "role": "DECODE"}]
        await client.put("/pearl/workers", json={"workers": pair, "wait_s": 1}, headers=AUTH)  # W1 leaves
        assert up.routed == set()
        go_on.set()  # ... and its drain aborts the turn after 4 tokens
        evs = events(await running)
        got = [t for e in evs[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
        assert got == greedy(list(b"xyz"), 10)
        pearl = [e for e in evs[:-1] if "pearl" in e][0]["pearl"]
        assert pearl["continued"] == 1 and [p["tokens"] for p in pearl["parts"]] == [4, 6]
        assert up.via == [ROUTER, gw.routers.pd.url]
        assert up.requests[1][1]["prompt"] == list(b"xyz") + greedy(list(b"xyz"), 4)

    run(scenario, pd=True)


def test_a_pd_router_that_does_not_start_leaves_the_pair_colocated_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The routing module's clock runs with real time plus a jump this test makes: the back-off (30 s) is
    # neither outlived by a slow machine before the first check nor waited for before the second.
    ahead = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + ahead[0])
    monkeypatch.setattr("pearlctl.router.routing.time", clock)

    async def scenario(gw, client, up):
        gw.routers.pd_launcher.fail = 1
        pair = {"workers": [{"url": P1, "role": "PREFILL"}, {"url": D1, "role": "DECODE"}], "wait_s": 1}
        doc = (await client.put("/pearl/workers", json=pair, headers=AUTH)).json()
        assert doc["failed"] == {} and gw.routers.pd is None and up.routed == {P1, D1}  # serving, colocated
        assert all(w["router"] == "regular" and w["routed"] for w in doc["workers"])
        health = (await client.get("/health")).json()
        assert health["pd"]["failures"] == 1 and "liveness" in health["pd"]["last_error"]
        await gw.routers.check_pd()  # within the back-off: not tried
        assert gw.routers.pd_launcher.launched == []
        ahead[0] += 31.0  # the back-off has passed
        await gw.routers.check_pd()
        assert gw.routers.pd is not None and up.routed == set()
        gw.routers.pd.dead = True  # the PD router exits: requests meanwhile go to the regular router
        assert gw.routers.upstream(None) == ROUTER
        await gw.routers.check_pd()
        assert (
            len(gw.routers.pd_launcher.launched) == 2
            and gw.routers.pd.alive()
            and gw.routers.pd.lists == PdLists((P1,), (D1,))
        )

    run(scenario, pd=True, pd_retry_s=30.0)


def test_without_a_launcher_prefill_and_decode_members_serve_colocated() -> None:
    async def scenario(gw, client, up):
        await add(client, P1, role="PREFILL")
        await add(client, D1, role="DECODE")
        assert gw.routers.pd is None and up.routed == {P1, D1}
        r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200 and up.via == [ROUTER]

    run(scenario)


def test_the_membership_client_sends_roles_and_refuses_an_unknown_one_before_any_call() -> None:
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"added": [], "removed": [], "updated": [], "failed": {}, "workers": []})

    m = RouterMembership("http://gw:1", KEY, http=httpx.Client(transport=httpx.MockTransport(handler)))
    m.sync({W1: "1", P1: "1"}, roles={P1: "PREFILL"})
    assert [(w["url"], w["role"]) for w in bodies[0]["workers"]] == [(W1, "ROLLOUT"), (P1, "PREFILL")]
    with pytest.raises(ValidationError, match="role"):
        m.sync({P1: "1"}, roles={P1: "TRAIN"})
    assert len(bodies) == 1


def test_the_pd_router_child_gets_static_lists_and_initial_members_carry_roles() -> None:
    from pearlctl.router.__main__ import RouterChild, parse, parse_worker

    args = parse(["--run-dir", "/tmp/run", "--policy", "consistent_hash"])
    argv = RouterChild(args, pd=PdLists((P1, P2), (D1,))).command()
    assert "--vllm-pd-disaggregation" in argv and argv[argv.index("--policy") + 1] == "round_robin"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill"] == [P1, P2]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"] == [D1]
    regular = RouterChild(args).command()
    assert "--vllm-pd-disaggregation" not in regular and regular[regular.index("--policy") + 1] == "consistent_hash"
    assert (parse_worker(f"{P1}=3@PREFILL").role, parse_worker(f"{P1}=3@PREFILL").weight_version) == ("PREFILL", "3")
    assert (parse_worker(W1).role, parse_worker(W1).weight_version) == ("ROLLOUT", None)
    assert parse_worker(f"{D1}@DECODE").role == "DECODE"
    with pytest.raises(ValueError, match="'TRAIN' is not one of ROLLOUT, PREFILL, DECODE"):
        parse_worker(f"{W1}=1@TRAIN")


def test_vllm_router_logs_warnings_only_unless_rust_log_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from pearlctl.router.__main__ import RouterChild

    monkeypatch.delenv("RUST_LOG", raising=False)
    assert RouterChild.environment()["RUST_LOG"] == "warn"  # vllm-router logs every request at INFO otherwise
    monkeypatch.setenv("RUST_LOG", "vllm_router_rs=debug")
    assert RouterChild.environment()["RUST_LOG"] == "vllm_router_rs=debug"  # a user debugging the router


# -- fuzz ---------------------------------------------------------------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=24)
)
_json = st.recursive(
    _scalars, lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=8), kids, max_size=3))
)
_urls = st.sampled_from([W1, W2, "http://w3:1", "ftp://x", "http://", "", "http://a b", "x" * 300])
_worker = st.fixed_dictionaries(
    {"url": _urls},
    optional={
        "weight_version": st.one_of(st.none(), st.text(max_size=12), st.integers()),
        "role": st.sampled_from(["ROLLOUT", "PREFILL", "DECODE", "TRAIN", "", 3]),
        "wait_s": st.one_of(st.floats(0, 0.02), st.floats(allow_nan=True), st.integers(-5, 10**9)),
        "extra": _json,
    },
)
_admin = st.one_of(
    st.tuples(st.just("POST"), st.just("/pearl/workers"), st.one_of(_worker, _json)),
    st.tuples(
        st.just("PUT"),
        st.just("/pearl/workers"),
        st.one_of(
            st.fixed_dictionaries({"workers": st.lists(_worker, max_size=3), "wait_s": st.floats(0, 0.02)}), _json
        ),
    ),
    st.tuples(st.just("DELETE"), _urls.map(lambda u: f"/pearl/workers?url={u}"), st.none()),
    st.tuples(st.sampled_from(["POST"]), st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _json),
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(_admin, min_size=1, max_size=8))
def test_any_admin_or_generate_body_is_answered_below_500_and_the_gateway_keeps_serving(calls) -> None:
    """Whatever the membership and generate routes are sent, the answer is a 4xx naming the problem (or a
    success), never a 5xx of the gateway's own; afterwards it still lists its members and serves a turn."""

    async def scenario(gw, client, up):
        for method, path, body in calls:
            content = None if body is None else json.dumps(body, allow_nan=True).encode()
            r = await client.request(method, path, content=content, headers={**AUTH, "X-Pearl-Retry-For-S": "0.05"})
            if r.status_code >= 500:
                # a 502-504 is the upstream's (a worker never healthy, no worker to send a turn to): it names it
                assert r.status_code in (502, 503, 504), (method, path, body, r.status_code, r.text)
                assert r.json()["error"]["message"], r.text
            elif r.status_code >= 400:
                assert r.json()["error"]["message"], r.text
        listed = await client.get("/pearl/workers", headers=AUTH)
        assert listed.status_code == 200
        await client.put("/pearl/workers", json={"workers": [{"url": W1, "wait_s": 1.0}]}, headers=AUTH)
        r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200, r.text

    run(scenario)


def test_found_a_body_with_infinity_is_a_400_not_a_500() -> None:
    """Found by the fuzz test above: ``{"": Infinity}`` parsed (Python's json accepts it) and failed only when the
    gateway sent the request on, as a 500."""

    async def scenario(gw, client, up):
        for raw in (b'{"": Infinity}', b'{"prompt": "p", "temperature": NaN}', b'{"x": -Infinity}'):
            r = await client.post("/v1/completions", content=raw, headers=AUTH)
            assert r.status_code == 400, r.text
            assert "NaN or Infinity" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200, r.text

    run(scenario)


# -- the judge ------------------------------------------------------------------------------------------
J1 = "http://judge-w1:8000"


def test_a_judge_is_routed_apart_by_its_model_and_no_policy_turn_reaches_it() -> None:
    """A REWARD member joins a judge router started for it, never the policy's; a request naming the model the
    judge serves goes there, every other to the policy's router; /v1/models lists both. With the judge router
    gone a judge's request is retried, never sent to the policy's router, and served once the router is back
    (the next check starts another and puts the judge back); a judge that leaves is taken out of it."""

    async def scenario(gw, client, up):
        assert (await add(client, W1)).status_code == 200
        assert (await add(client, J1, version=None, role="REWARD")).status_code == 200
        [judge] = gw.routers.judge_launcher.launched
        assert up.routed == {W1} and judge.routed == {J1} and gw.routers.judge_models == {"judge"}
        served = {}
        for model in ("tiny", "judge", None):
            body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
            r = await client.post("/v1/completions", json=body, headers=AUTH)
            assert r.status_code == 200
            served[model] = r.json()["pearl"]["parts"][0]
        assert up.via == [ROUTER, judge.url, ROUTER]
        # each part attributed among its own router's members: the policy's version, the judge (no version)
        assert served["tiny"]["weight_version"] == served[None]["weight_version"] == "7"
        assert served["tiny"]["worker"] == W1 and served["judge"]["worker"] == J1
        models = (await client.get("/v1/models", headers=AUTH)).json()
        assert [m["id"] for m in models["data"]] == ["tiny", "judge"]
        up.router_down = True  # the list from a member instead: a policy worker's, never a judge's
        assert [m["id"] for m in (await client.get("/v1/models", headers=AUTH)).json()["data"]] == ["tiny"]
        up.router_down = False
        docs = {d["url"]: d for d in (await client.get("/pearl/workers", headers=AUTH)).json()["workers"]}
        assert (docs[J1]["router"], docs[J1]["routed"], docs[W1]["router"]) == ("judge", True, "regular")

        judge.dead = True
        dead = {d["url"]: d for d in (await client.get("/pearl/workers", headers=AUTH)).json()["workers"]}
        assert (dead[J1]["routed"], dead[J1]["healthy"]) == (False, False)  # as a dead PD router's members
        body = {"model": "judge", "prompt": "hi", "max_tokens": 2}
        gone = await client.post("/v1/completions", json=body, headers={**AUTH, "X-Pearl-Retry-For-S": "0.2"})
        assert gone.status_code == 503 and up.via == [ROUTER, judge.url, ROUTER]  # retried, never elsewhere
        await gw.routers.check_pd()
        [_, again] = gw.routers.judge_launcher.launched
        assert again.routed == {J1} and judge.stopped
        assert (await client.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
        assert up.via[-1] == again.url and gw.stats["attempts_judge"] == 2

        await client.delete("/pearl/workers", params={"url": J1}, headers=AUTH)
        assert again.routed == set() and up.routed == {W1}

    run(scenario, judge=True)


def test_a_judge_of_the_policys_own_model_name_is_never_sent_the_policys_turns() -> None:
    """A reward pool with no model of its own serves the policy's model under the policy's name: a request naming it
    is the policy's and goes to the policy's router, never to the judge router (the judge is routed there, apart)."""

    async def scenario(gw, client, up):
        judge_url = "http://w3:8000"  # the fake's workers on hosts not named judge* serve "tiny", the policy's model
        assert (await add(client, W1)).status_code == 200
        assert (await add(client, judge_url, version=None, role="REWARD")).status_code == 200
        [judge] = gw.routers.judge_launcher.launched
        assert judge.routed == {judge_url} and up.routed == {W1}
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200 and up.via == [ROUTER] and gw.stats["attempts_judge"] == 0

    run(scenario, judge=True)


def test_a_judges_structured_output_request_interrupted_is_sent_again_whole_to_a_judge_and_answered_once() -> None:
    """A critique forced into a score line (vLLM's ``structured_outputs``) cannot be continued from token ids (its
    grammar's state is not in them): a judge worker that aborts it is answered by sending it again whole, to the
    judge router again, never to the policy's; the caller gets one answer (pearlctl.router.judge relies on it:
    the request carries its seed, so the second is the same request)."""
    body = {"model": "judge", "prompt": "Critique:", "max_tokens": 4, "seed": 7, "structured_outputs": {"regex": "x"}}

    async def scenario(gw, client, up):
        await add(client, W1)
        await add(client, J1, version=None, role="REWARD")
        [judge] = gw.routers.judge_launcher.launched
        up.script = [("abort", 2)]
        doc = (await client.post("/v1/completions", json=body, headers=AUTH)).json()
        assert len(doc["choices"]) == 1 and doc["choices"][0]["finish_reason"] == "length"
        assert doc["pearl"]["restarted"] == 1 and doc["pearl"]["not_continuable"] == "structured_outputs"
        assert up.via == [judge.url, judge.url]

    up = run(scenario, judge=True)
    assert [b for _, b, _ in up.requests] == [body, body]  # the same request twice, whole
