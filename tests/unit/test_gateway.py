"""The gateway (pearlctl.router.gateway) with one seam faked: the upstream HTTP (vllm-router and the workers'
``/health``), as an ``httpx.MockTransport``. The app itself runs for real (Starlette, through
``httpx.ASGITransport``).

The fake upstream "decodes" greedily with a deterministic rule — the next token is a function of the whole
sequence — so a continuation from token ids reproduces an uninterrupted run exactly only if the gateway sends
exactly the prompt's ids plus the generated ids, with the right remaining budget. A script says what each
generation request meets: served whole, aborted after k tokens (a drain), a stream broken after k tokens (a
killed worker), a connection refused, or an HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from pearlctl.router.gateway import Gateway, GatewayConfig, build_app

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


class Upstream:
    """vllm-router and its workers. ``script``: one entry per generation request, consumed in order —
    None (served whole), ("abort", k), ("break", k), ("connect",), ("status", code, text)."""

    def __init__(self) -> None:
        self.script: list[Any] = []
        self.requests: list[tuple[str, dict, dict]] = []
        self.router_calls: list[tuple[str, str]] = []
        self.routed: set[str] = set()
        self.unhealthy: set[str] = set()
        self.router_down = False
        self.version_header: str | None = None
        self.omit_prompt_ids = False  # a worker that does not return the prompt's token ids

    def gen_requests(self) -> list[tuple[str, dict, dict]]:
        return self.requests

    async def handle(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        if origin != ROUTER:  # a worker's /health, asked by the gateway before adding it
            if origin in self.unhealthy:
                raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
            return httpx.Response(200, json={})
        if self.router_down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if path in ("/add_worker", "/remove_worker"):
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
        step = self.script.pop(0) if self.script else None
        if step is not None and step[0] == "connect":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if step is not None and step[0] == "status":
            return httpx.Response(step[1], text=step[2])
        chat = path == "/v1/chat/completions"
        if chat:
            prompt_ids = chat_ids(body["messages"])
            budget = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        else:
            prompt = body["prompt"]
            prompt_ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
            budget = body.get("max_tokens") or 16
        k = budget if step is None else min(step[1], budget)
        ids = greedy(prompt_ids, k)
        finish = "length" if step is None else ("abort" if step[0] == "abort" else None)
        headers = {"x-pearl-weight-version": self.version_header} if self.version_header else {}
        want_ids = bool(body.get("return_token_ids"))
        if self.omit_prompt_ids:
            prompt_ids = None
        if body.get("stream"):
            return httpx.Response(
                200,
                headers={**headers, "content-type": "text/event-stream"},
                content=self._events(
                    chat, body, prompt_ids, ids, finish, want_ids, broken=step is not None and step[0] == "break"
                ),
            )
        return httpx.Response(200, headers=headers, json=self._answer(chat, body, prompt_ids, ids, finish, want_ids))

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

    def _answer(self, chat, body, prompt_ids, ids, finish, want_ids) -> dict:
        text = "".join(detok(t) for t in ids)
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

    async def _events(self, chat, body, prompt_ids, ids, finish, want_ids, broken):
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
            await asyncio.sleep(0)
            c: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                c["delta"] = {"content": detok(t)}
            else:
                c["text"] = detok(t)
                if want_ids and i == 0 and prompt_ids is not None:
                    c["prompt_token_ids"] = prompt_ids
            if want_ids:
                c["token_ids"] = [t]
            yield f"data: {json.dumps({**head, 'choices': [c]})}\n\n".encode()
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


def run(scenario: Callable[[Gateway, httpx.AsyncClient, Upstream], Awaitable[None]], **config: Any) -> Upstream:
    """Run ``scenario`` against a fresh gateway whose upstream is a fresh `Upstream`."""
    upstream = Upstream()

    async def main() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(upstream.handle))
        cfg = {"retry_for_s": 5.0, "backoff_s": 0.001, "backoff_max_s": 0.01, **config}
        gateway = Gateway(GatewayConfig(key=KEY, router_url=ROUTER, **cfg), http=http)
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


async def add(client: httpx.AsyncClient, url: str, version: str | None = "7") -> httpx.Response:
    return await client.post(
        "/pearl/workers", json={"url": url, "weight_version": version, "wait_s": 1.0}, headers=AUTH
    )


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
        assert resp.status_code == 503 and 0.3 <= took < 1.5
        err = resp.json()["error"]
        assert err["type"] == "pearl_retry_exhausted" and err["attempts"] > 3 and err["retry_for_s"] == 0.3
        assert "No available workers" in err["last_error"] and f"after {err['attempts']} attempt(s)" in err["message"]
        assert 0.3 <= err["seconds"] < 1.5 and "retry_for_s 0.3" in err["message"]

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
        assert await gw.reregister() == []
        assert up.routed == {W1, W2}

    run(scenario)


def test_health_says_when_the_router_is_down_and_models_pass_through() -> None:
    async def scenario(gw, client, up):
        models = await client.get("/v1/models", headers=AUTH)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        up.router_down = True
        down = await client.get("/health")
        assert down.status_code == 503 and down.json()["router"] == "down"
        models = await client.get("/v1/models", headers=AUTH)
        assert models.status_code == 503 and "router does not answer" in models.json()["error"]["message"]

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
