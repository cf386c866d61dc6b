"""A parked worker turns away what reaches it: a worker on the paced engine (pearlctl.agent.engines.paced, a real
server speaking vLLM's API) is parked by its agent's `VllmWorker` — drained briefly, what still runs aborted, then
asleep — and a request sent to it afterwards (a router that had not yet taken it out) is aborted at the agent's next
heartbeat, with the answer a client continues elsewhere, instead of waiting in the sleeping engine for good."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pearlctl.agent.identity import Identity
from pearlctl.agent.workers import VllmWorker
from tests.conftest import wait_for
from tests.engines.conftest import PACED_PROFILE, TINY_MODEL


@pytest.fixture
def w(tmp_path, monkeypatch) -> Iterator[VllmWorker]:
    """A worker of a lent trainer GPU on the paced engine, READY; stopped at the end."""
    monkeypatch.setenv("PEARL_SHM_DIR", str(tmp_path / "shm"))
    me = Identity(run_id="r", pool="trainer", role="TRAIN", job_id="7", task_id=0, node="n1", gpus=(0,), restarts=0)
    worker = VllmWorker(
        "rollout-0", "ROLLOUT", (0,), me, str(tmp_path), str(TINY_MODEL), {}, paced_profile=str(PACED_PROFILE)
    )
    worker.start()
    try:
        wait_for(lambda: worker.state() == "READY", 60, every=0.2)
        yield worker
    finally:
        worker.stop(5.0)


def send(w: VllmWorker, max_tokens: int) -> tuple[threading.Thread, list]:
    """A turn sent to the worker on a thread of its own; its answer lands in the list."""
    answer: list = []
    body = {"model": str(TINY_MODEL), "prompt": [5, 6, 7, 8], "max_tokens": max_tokens}
    sender = threading.Thread(
        target=lambda: answer.append(httpx.post(f"{w.server.url}/v1/completions", json=body, timeout=60)),
        daemon=True,
    )
    sender.start()
    return sender, answer


def test_a_request_that_reaches_a_parked_worker_is_aborted_at_the_next_heartbeat(w):
    w.park(drain_timeout=10)
    wait_for(lambda: w.state() == "SLEEPING", 30, every=0.1)
    sender, answer = send(w, max_tokens=8)
    wait_for(lambda: w.server.metrics()["num_requests_waiting"] > 0, 10, every=0.1)
    time.sleep(1.0)
    assert not answer  # it waits in the sleeping engine
    w.park(drain_timeout=10)  # the next heartbeat still wants it parked
    sender.join(10)
    assert answer and answer[0].status_code == 200, answer
    assert answer[0].json()["choices"][0]["finish_reason"] == "abort"
    assert w.state() == "SLEEPING"  # still parked for the next borrow


def test_a_worker_parked_mid_turn_aborts_it_with_its_tokens_at_once_rather_than_waiting_for_its_end(w):
    """A return parks the lent worker once the router no longer lists it: what it still runs is answered
    ``abort`` with the tokens made so far (its client continues it elsewhere) within ``PARK_DRAIN_S`` and the
    abort, not after the turn's end or the agent's whole drain timeout — a return has a deadline."""
    sender, answer = send(w, max_tokens=1500)  # ~6 s of decode
    wait_for(lambda: w.server.metrics()["num_requests_running"] > 0, 10, every=0.05)
    time.sleep(0.5)
    parked_at = time.monotonic()
    w.park(drain_timeout=30)
    wait_for(lambda: w.state() == "SLEEPING", 30, every=0.05)
    took = time.monotonic() - parked_at
    sender.join(10)
    assert answer and answer[0].status_code == 200, answer
    choice = answer[0].json()["choices"][0]
    made = answer[0].json()["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "abort" and 0 < made < 1500, (choice["finish_reason"], made)
    assert took < VllmWorker.PARK_DRAIN_S + VllmWorker.ABORT_MAX_S + 1.0, took


def test_a_park_asked_for_while_the_worker_wakes_puts_it_back_to_sleep_without_serving(w):
    """A warm borrow wakes a parked worker; its rollback (or the next return) parks it again while the wake is still
    in flight. The park is not dropped: the worker goes back to sleep once awake, and is never READY in between
    (before: the park was ignored and the worker stayed awake until some later heartbeat asked again)."""
    w.park(drain_timeout=10)
    wait_for(lambda: w.state() == "SLEEPING", 30, every=0.05)
    w.unpark()
    w.park(drain_timeout=10)  # the next heartbeat wants it parked again, while the wake runs
    seen = set()
    deadline = time.monotonic() + 3.0  # the paced profile wakes in 0.2 s and sleeps in 0.2 s
    while time.monotonic() < deadline:
        seen.add(w.state())
        time.sleep(0.01)
    assert "READY" not in seen, seen
    assert w.state() == "SLEEPING" and w.server.is_sleeping()
