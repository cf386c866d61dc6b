"""A worker that joins mid-batch takes its share of a queue at once: the real gateway and vllm-router
(pearlctl.router) in front of two paced engines (pearlctl.agent.engines.paced, real servers speaking vLLM's API,
each its own process). Sixteen sessions are sent while one worker serves them four at a time; a second worker
joins while some wait. The gateway's rebalance (pearlctl/router/admin.py) has the first worker abort its
continuable requests and continues them through the router on the new ring, so the sessions that now hash to the
second worker finish there. Every answer is the uninterrupted one, token for token, and nothing is lost."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pearlctl.agent.engines.vllm_endpoints import parse_metrics
from pearlctl.router import service
from pearlctl.router.membership import RouterMembership
from pearlctl.vocabulary import JOIN_BALANCE_ABS
from tests.conftest import wait_for
from tests.engines.conftest import PACED_PROFILE, free_port

SESSIONS = 16
SLOTS = 4  # each worker runs at most this many: the rest wait in its queue
TOKENS = 400  # a round of four turns takes about 1.7 s: the queue is still there when the worker joins


@pytest.fixture
def workers(request, tmp_path: Path):
    """Two paced engines on loopback, each saying who it is (``X-Pearl-Worker``), each running at most ``SLOTS``
    sequences (or the test's ``slots`` parameter): their URLs."""
    slots = getattr(request, "param", SLOTS)
    procs, urls = [], []
    for i in range(2):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "pearlctl.agent.engines.paced", "--model", "tiny", "--profile",
                str(PACED_PROFILE), "--port", str(port), "--max-num-seqs", str(slots)]  # fmt: skip
        log = open(tmp_path / f"paced-{i}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append((subprocess.Popen(argv, env={**os.environ, "PEARL_WORKER_URL": url}, stdout=log, stderr=log), log))
        urls.append(url)
    for url in urls:
        wait_for(lambda url=url: _ok(url + "/health"), 30, every=0.1)
    yield urls
    for proc, log in procs:
        proc.terminate()
        proc.wait(10)
        log.close()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def gateway(tmp_path: Path, workers):
    """The run's gateway and vllm-router, routing to the first of ``workers`` only: its record and its key."""
    record = service.start(str(tmp_path), "127.0.0.1", 0, workers={workers[0]: "1"})
    try:
        yield record, service.read_key(tmp_path)
    finally:
        service.stop(record, run_dir=str(tmp_path))


def _metrics(url: str) -> dict:
    """A worker's vLLM gauges, as the agent reads them (``parse_metrics``)."""
    return parse_metrics(httpx.get(url + "/metrics", timeout=2.0).text)


def _waiting(url: str) -> float:
    return _metrics(url).get("num_requests_waiting", 0.0)


@pytest.fixture
def client():
    """One HTTP client for a test's sessions, shared by their threads: a session's start then costs no TLS context
    or connection pool of its own (``httpx.post`` builds both per call, which on a loaded machine spread the
    sessions' arrivals over seconds)."""
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=None)) as c:
        yield c


def _send(
    client: httpx.Client, base_url: str, key: str, sessions: int, answers: dict[int, dict], tokens: int = TOKENS
) -> list[threading.Thread]:
    """One turn of ``tokens`` tokens of each of ``sessions`` sessions through the gateway, each in its thread
    (started): the answers land in ``answers`` by session."""

    def turn(i: int) -> None:
        body = {"model": "tiny", "prompt": [10 + i, 20 + i, 30 + i], "max_tokens": tokens, "return_token_ids": True}
        headers = {"Authorization": f"Bearer {key}", "X-Session-ID": f"episode-{i}"}
        answers[i] = client.post(base_url + "/completions", json=body, headers=headers).json()

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    return threads


def _join_and_check(
    record, key: str, w1: str, w2: str, threads, answers: dict[int, dict], sessions: int, tokens: int = TOKENS
) -> list[int]:
    """``w2`` joins while ``sessions`` sessions run on ``w1``: every session is answered once, whole; the join
    asked one member to abort (``rebalances``, ``rebalance_aborts``); the sessions that now hash to ``w2`` finished
    there, each aborted on ``w1`` (from its queue, or mid-decode and then continued) and sent again. Returns
    them."""
    with RouterMembership(record.url, key) as members:
        members.add(w2, "1")
    for t in threads:
        t.join(120)
    assert sorted(answers) == list(range(sessions))
    stats = httpx.get(record.url + "/pearl/stats", headers={"Authorization": f"Bearer {key}"}).json()
    assert stats["rebalances"] == 1 and stats["rebalance_aborts"] == 1  # one join, one member asked
    finished_on = {i: a["pearl"]["parts"][-1].get("worker") for i, a in answers.items()}
    moved = [i for i, w in finished_on.items() if w == w2]
    assert moved and set(finished_on.values()) == {w1, w2}, finished_on
    assert all(answers[i]["pearl"]["attempts"] >= 2 for i in moved)
    for a in answers.values():
        assert a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == tokens
    return moved


def test_a_worker_that_joins_takes_the_sessions_that_hash_to_it_from_the_queue_and_every_answer_is_exact(
    workers, gateway, client
):
    w1, w2 = workers
    record, key = gateway
    answers: dict[int, dict] = {}
    threads = _send(client, record.base_url, key, SESSIONS, answers)
    # a queue: four run, more wait (under load not all sixteen may have arrived yet: the first wait suffices)
    wait_for(lambda: _waiting(w1) >= SLOTS, 60, every=0.05)
    moved = _join_and_check(record, key, w1, w2, threads, answers, SESSIONS)

    # every answer is the uninterrupted one: the same prompt sent straight to a worker, never interrupted
    for i in moved[:3] + [i for i in range(SESSIONS) if i not in moved][:3]:
        body = {"model": "tiny", "prompt": [10 + i, 20 + i, 30 + i], "max_tokens": TOKENS, "return_token_ids": True}
        direct = httpx.post(w2 + "/v1/completions", json=body, timeout=60).json()
        assert answers[i]["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"], i

    # a join while no member has a queue asks nothing
    with RouterMembership(record.url, key) as members:
        members.remove(w2)
        members.add(w2, "1")
    time.sleep(0.3)
    stats = httpx.get(record.url + "/pearl/stats", headers={"Authorization": f"Bearer {key}"}).json()
    assert stats["rebalances"] == 1


BUSY = JOIN_BALANCE_ABS + 8  # sessions one worker runs at once, none waiting: imbalanced against an idle worker
# a turn long enough that all BUSY are in flight at once on a loaded machine, short enough that their KV fits the
# profile's 65,536 tokens (72 x 803): at BUSY running a step takes 4 ms + 72 x 0.05 ms, so a turn of 800 tokens
# lasts about 6 s (400 lasted 3 s, and on CI the last sessions had not arrived when the first finished)
BUSY_TOKENS = 800


@pytest.mark.parametrize("workers", [2 * BUSY], indirect=True)
def test_a_worker_that_joins_takes_its_share_of_a_member_that_runs_far_more_than_it_with_no_queue(
    workers, gateway, client
):
    """A member with no queue but ``BUSY`` sequences running is imbalanced against the joining worker by
    vllm-router's own test (pearlctl.vocabulary.imbalanced): it is rebalanced too, and the sessions that now hash
    to the joined worker finish there, every answer whole."""
    w1, w2 = workers
    record, key = gateway
    answers: dict[int, dict] = {}
    threads = _send(client, record.base_url, key, BUSY, answers, BUSY_TOKENS)
    wait_for(lambda: _metrics(w1).get("num_requests_running", 0.0) >= BUSY, 60, every=0.05)
    assert _waiting(w1) == 0  # no queue: the rule before this one left such a member alone
    _join_and_check(record, key, w1, w2, threads, answers, BUSY, BUSY_TOKENS)
