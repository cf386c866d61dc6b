"""RolloutClient at one seam: the daemon's membership answers (a fake ControlClient), the workers' HTTP
(httpx.MockTransport) and time (a fake clock whose sleep advances it), so back-off runs without waiting.

Also: the reference driver writes a step whole or not at all, and VllmWorker.stop aborts what a failed
drain leaves in flight before it stops the server, within the drain timeout it is given.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from pearlctl.api.client import DaemonRefusal
from pearlctl.router.client import Completion, RolloutClient, TurnFailed, TurnRefused

REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0
DEAD, A, B = "http://dead:8000", "http://a:8000", "http://b:8000"


class FakeTime:
    def __init__(self) -> None:
        self.now = T0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Membership:
    """Stands in for ControlClient: ``GET /v1/workers`` answers ``listing()`` (None: unreachable)."""

    def __init__(self, listing: Callable[[], list[dict] | None]):
        self.listing = listing
        self.asked = 0
        self.progress: list[dict] = []

    def try_call(self, method: str, path: str, body: dict | None = None, **kw) -> dict | None:
        if path == "/v1/workers":
            self.asked += 1
            workers = self.listing()
            return None if workers is None else {"epoch": 1, "workers": workers}
        self.progress.append(body or {})
        return {"epoch": 1}

    def close(self) -> None:
        pass


def worker(url: str, seen_at: float | None = None, version: str = "1") -> dict:
    w = {"id": hash(url) % 100, "url": url, "role": "ROLLOUT", "weight_version": version}
    if seen_at is not None:
        w["seen_at"] = seen_at
    return w


def answer(text: str, tokens: int, reason: str = "length") -> httpx.Response:
    return httpx.Response(
        200,
        json={"choices": [{"text": text, "finish_reason": reason}], "usage": {"completion_tokens": tokens}},
    )


class Workers:
    """The workers' HTTP: ``serve[url](body)`` answers a completion; a URL not in ``serve`` refuses
    connections (a dead worker, a closed port). Every completion request is recorded."""

    def __init__(self) -> None:
        self.serve: dict[str, Callable[[dict], httpx.Response]] = {}
        self.requests: list[tuple[str, dict]] = []
        self.attempts: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.attempts.append(url)
        if url not in self.serve:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        self.requests.append((url, body))
        return self.serve[url](body)

    def to(self, url: str) -> list[dict]:
        return [body for u, body in self.requests if u == url]


def ok(text: str = " 4", tokens: int = 2) -> Callable[[dict], httpx.Response]:
    return lambda body: answer(text, tokens)


def make_client(listing, workers: Workers, t: FakeTime, **kw) -> tuple[RolloutClient, Membership]:
    membership = Membership(listing)
    client = RolloutClient(
        "/nonexistent",
        "run",
        control=membership,  # type: ignore[arg-type]
        http=httpx.Client(transport=httpx.MockTransport(workers.handle)),
        clock=t.clock,
        sleep=t.sleep,
        **kw,
    )
    return client, membership


# -- the defect: a daemon still listing a dead worker -----------------------------------------------
def test_dead_worker_listed_then_a_live_one_every_turn_completes() -> None:
    """The daemon lists only a dead worker for 30 s, then a live one too: no turn is lost (the old client
    raised NoWorkers after 4 attempts and 19 ms)."""
    t, workers = FakeTime(), Workers()
    workers.serve[A] = ok()

    def listing() -> list[dict]:
        return [worker(DEAD, T0 - 100)] + ([worker(A, t.now)] if t.now >= T0 + 30 else [])

    client, _ = make_client(listing, workers, t, retry_for_s=600)
    t_real = time.monotonic()
    done = [client.complete(f"s{i}", "2 + 2 =", max_tokens=2) for i in range(4)]
    assert time.monotonic() - t_real < 5  # fake time: the back-off does not sleep for real
    assert all(c.worker == A and c.text == " 4" for c in done)
    assert t.now >= T0 + 30  # the first turn waited for the live worker, it did not give up
    assert done[0].retries >= 2
    # the dead worker was tried once, then excluded: never again while the daemon had no news of it
    assert workers.attempts.count(DEAD) == 1
    assert DEAD in client.excluded()
    # jittered exponential back-off, bounded
    assert all(0 <= s <= client.backoff_max_s for s in t.sleeps)
    assert len(set(t.sleeps)) > 1


def test_no_worker_at_all_for_a_while_then_one() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = ok()
    client, membership = make_client(lambda: [worker(A, t.now)] if t.now >= T0 + 100 else [], workers, t)
    c = client.complete("s", "p", max_tokens=2)
    assert c.worker == A and t.now >= T0 + 100
    assert membership.asked >= 10  # membership is asked again before every retry


# -- exclusion until the daemon confirms -------------------------------------------------------------
def test_failed_worker_excluded_until_its_agent_reports_after_the_failure() -> None:
    t, workers = FakeTime(), Workers()
    state = {"a_seen": T0 - 1.0, "a_ok": False}

    def a(body: dict) -> httpx.Response:
        if not state["a_ok"]:
            return httpx.Response(500, text="engine dead")
        return answer(" A", 2)

    workers.serve[A], workers.serve[B] = a, ok(" B")
    client, _ = make_client(lambda: [worker(A, state["a_seen"]), worker(B, t.now)], workers, t, refresh_s=2.0)

    first = client.complete("s0", "p", max_tokens=2)  # round robin starts at A: it fails, the turn moves
    assert first.worker == B and first.retries == 1
    failed_at = client.excluded()[A]
    state["a_ok"] = True  # A works again, but nobody has said so yet

    for i in range(1, 6):
        t.sleep(3.0)  # membership is stale: asked again at each pick
        state["a_seen"] = failed_at - 0.5  # a report from before the failure proves nothing
        assert client.complete(f"s{i}", "p", max_tokens=2).worker == B
    assert A in client.excluded()
    assert len(workers.to(A)) == 1  # only the failed request

    t.sleep(3.0)
    state["a_seen"] = t.now  # its agent reported after the failure: back in rotation
    served = {client.complete(f"n{i}", "p", max_tokens=2).worker for i in range(4)}
    assert client.excluded() == {}
    assert served == {A, B}


def test_missing_seen_at_counts_as_zero_and_a_worker_the_daemon_drops_is_forgotten() -> None:
    t, workers = FakeTime(), Workers()
    listed = {"a": True}
    workers.serve[B] = ok(" B")

    def listing() -> list[dict]:
        return ([worker(A)] if listed["a"] else []) + [worker(B)]  # an older daemon: no seen_at

    client, _ = make_client(listing, workers, t, refresh_s=2.0)
    assert client.complete("s0", "p", max_tokens=2).worker == B  # A (dead) failed first
    workers.serve[A] = ok(" A")  # restarted on the same address
    t.sleep(3.0)
    assert client.complete("s1", "p", max_tokens=2).worker == B  # seen_at 0: still excluded
    assert A in client.excluded()
    listed["a"] = False
    t.sleep(3.0)
    client.workers()
    assert client.excluded() == {}  # the daemon dropped it: forgotten
    listed["a"] = True
    t.sleep(3.0)
    assert {client.complete(f"n{i}", "p", max_tokens=2).worker for i in range(4)} == {A, B}


def test_a_session_stuck_to_an_excluded_worker_moves() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A], workers.serve[B] = ok(" A"), ok(" B")
    client, _ = make_client(lambda: [worker(A, T0), worker(B, T0)], workers, t)
    assert client.complete("sticky", "turn 1", max_tokens=2).worker == A
    assert client.complete("sticky", "turn 2", max_tokens=2).worker == A  # sticks
    assert client.complete("warm", "x", max_tokens=2).worker == B  # round robin
    workers.serve[A] = lambda body: httpx.Response(503, text="shutting down")
    other = client.complete("other", "x", max_tokens=2)  # round robin: A, which fails; the turn moves
    assert (other.worker, other.retries) == (B, 1)
    before = len(workers.to(A))
    assert client.complete("sticky", "turn 3", max_tokens=2).worker == B
    assert len(workers.to(A)) == before  # not tried again on the excluded worker


# -- the time bound --------------------------------------------------------------------------------
def test_the_time_bound_raises_a_clear_error() -> None:
    t, workers = FakeTime(), Workers()
    client, _ = make_client(lambda: [worker(DEAD, T0 - 100)], workers, t, retry_for_s=60)
    t_real = time.monotonic()
    with pytest.raises(TurnFailed) as info:
        client.complete("s7-p1-g2", "p", max_tokens=2)
    assert time.monotonic() - t_real < 5
    err = info.value
    assert 60 <= err.seconds <= 60 + client.backoff_max_s
    assert 60 <= t.now - T0 <= 60 + client.backoff_max_s
    assert err.attempts > 4
    message = str(err)
    assert "s7-p1-g2" in message and f"{err.attempts} attempt" in message and "60." in message
    assert "no routable rollout worker" in message  # the last error: the dead one is excluded


def test_a_refused_request_fails_at_once() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = lambda body: httpx.Response(400, json={"error": "maximum context length is 512"})
    client, _ = make_client(lambda: [worker(A, T0)], workers, t)
    with pytest.raises(TurnRefused, match="maximum context length"):
        client.complete("s", "p", max_tokens=2)
    assert t.sleeps == [] and client.excluded() == {}


# -- an aborted response is continued, not redone -----------------------------------------------------
def test_an_aborted_turn_is_continued_elsewhere_with_the_tokens_left() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = lambda body: answer("The sum", 3, "abort")  # a drain that ran out of time
    workers.serve[B] = lambda body: answer(" is 4.", 5, "length")
    client, _ = make_client(lambda: [worker(A, T0, "7"), worker(B, T0, "7")], workers, t)
    c = client.complete("s", "2 + 2 = ?", max_tokens=8, stop=["<|im_end|>"])
    assert isinstance(c, Completion)
    assert (c.text, c.tokens, c.worker, c.continued, c.finish_reason) == ("The sum is 4.", 8, B, 1, "length")
    assert c.parts == [
        {"worker": A, "weight_version": "7", "tokens": 3},
        {"worker": B, "weight_version": "7", "tokens": 5},
    ]
    (sent_b,) = workers.to(B)
    assert sent_b["prompt"] == "2 + 2 = ?The sum" and sent_b["max_tokens"] == 5
    assert sent_b["stop"] == ["<|im_end|>"]
    assert workers.to(A)[0]["max_tokens"] == 8
    assert sum(t.sleeps) == 0  # no back-off after an abort: the rest goes elsewhere at once
    assert A in client.excluded()
    assert client.counts["tokens"] == 8 and client.counts["generating"] == 0


def test_an_aborted_turn_at_its_budget_needs_no_continuation() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = lambda body: answer("abcd", 4, "abort")
    client, _ = make_client(lambda: [worker(A, T0)], workers, t)
    c = client.complete("s", "p", max_tokens=4)
    assert (c.text, c.tokens, c.finish_reason, c.continued) == ("abcd", 4, "length", 0)


def test_an_abort_before_any_output_redoes_the_turn_whole() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = lambda body: answer("", 0, "abort")
    workers.serve[B] = lambda body: answer("full", 6, "stop")
    client, _ = make_client(lambda: [worker(A, T0), worker(B, T0)], workers, t)
    c = client.complete("s", "p", max_tokens=6)
    assert (c.text, c.tokens, c.worker, c.finish_reason) == ("full", 6, B, "stop")
    assert workers.to(B)[0]["prompt"] == "p" and workers.to(B)[0]["max_tokens"] == 6


def test_two_aborts_in_a_row_join_three_parts() -> None:
    t, workers = FakeTime(), Workers()
    C = "http://c:8000"
    parts = iter([answer("one ", 2, "abort"), answer("two ", 2, "abort"), answer("three", 3, "stop")])
    for url in (A, B, C):
        workers.serve[url] = lambda body: next(parts)
    client, _ = make_client(lambda: [worker(A, T0), worker(B, T0), worker(C, T0)], workers, t)
    c = client.complete("s", "p:", max_tokens=10)
    assert (c.text, c.tokens, c.continued, c.retries, c.finish_reason) == ("one two three", 7, 2, 2, "stop")
    sent = [(url, body["prompt"], body["max_tokens"]) for url, body in workers.requests]
    assert [(p, m) for _, p, m in sent] == [("p:", 10), ("p:one ", 8), ("p:one two ", 6)]
    assert len({url for url, _, _ in sent}) == 3  # each part on another worker
    assert c.worker == sent[-1][0]


# -- the daemon ---------------------------------------------------------------------------------------
def test_an_unreachable_or_refusing_daemon_keeps_the_last_list_and_progress_never_raises() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = ok()
    mode = {"v": "ok"}

    def listing() -> list[dict] | None:
        if mode["v"] == "refuse":
            raise DaemonRefusal("/v1/workers: restarting", 503)
        return None if mode["v"] == "down" else [worker(A, T0)]

    client, membership = make_client(listing, workers, t, refresh_s=1.0)
    assert [w["url"] for w in client.workers()] == [A]
    for mode["v"] in ("down", "refuse"):
        t.sleep(2.0)
        assert [w["url"] for w in client.workers()] == [A]
        assert client.complete("s", "p", max_tokens=2).worker == A
    client.report_progress(step=3, work={"trajectories": 1})
    assert membership.progress[-1]["step"] == 3 and membership.progress[-1]["work"] == {"trajectories": 1}


def test_membership_is_cached_for_refresh_s() -> None:
    t, workers = FakeTime(), Workers()
    workers.serve[A] = ok()
    client, membership = make_client(lambda: [worker(A, T0)], workers, t, refresh_s=2.0)
    for i in range(5):
        client.complete(f"s{i}", "p", max_tokens=2)
    assert membership.asked == 1
    t.sleep(2.5)
    client.complete("s9", "p", max_tokens=2)
    assert membership.asked == 2


# -- the reference driver: a step is written whole or not at all ----------------------------------------
def load_driver():
    spec = importlib.util.spec_from_file_location("grpo_rollout_driver", REPO / "examples/grpo/rollout.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class ScriptedClient:
    """The driver's view of a RolloutClient; ``fail`` names the sessions whose first turn fails."""

    def __init__(self, fail: set[str]):
        self.fail = fail
        self.counts = {"queued": 0, "generating": 0, "tool_wait": 0, "done": 0, "tokens": 0}

    def count(self, key: str, delta: int = 1) -> None:
        self.counts[key] += delta

    def complete(self, session: str, prompt: str, **kw) -> Completion:
        if session in self.fail:
            raise TurnFailed(session, 600.0, 123, httpx.ConnectError("refused"))
        return Completion(" 5", 2, A, "1", 0, "stop")


def driver_args(**kw) -> SimpleNamespace:
    base = dict(seed=0, prompts=3, group_size=2, max_tokens=4, tool_latency_s=0.0, tool_latency_dist="fixed")
    return SimpleNamespace(**{**base, **kw})


def test_driver_step_whole_or_failed_loudly() -> None:
    driver = load_driver()
    args = driver_args()
    with ThreadPoolExecutor(4) as pool:
        groups = driver.run_step(ScriptedClient(set()), 1, args, pool, driver.Remaining(args))
        assert [len(g["completions"]) for g in groups] == [2, 2, 2]
        with pytest.raises(driver.StepFailed, match=r"episode s2-p1-g0 failed: turn of session s2-p1-g0"):
            driver.run_step(ScriptedClient({"s2-p1-g0"}), 2, args, pool, driver.Remaining(args))


def test_driver_exits_1_and_writes_no_batch_when_an_episode_fails(tmp_path: Path, monkeypatch, capsys) -> None:
    driver = load_driver()
    monkeypatch.setattr(driver, "RolloutClient", lambda *a, **kw: ScriptedClientWithProgress({"s1-p0-g1"}))
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(driver.os, "_exit", fake_exit)
    argv = ["--run-dir", str(tmp_path), "--run-id", "r", "--out", str(tmp_path / "out"), "--steps", "1"]
    with pytest.raises(SystemExit):
        driver.main([*argv, "--tool-latency-s", "0"])
    assert exits == [1]
    assert list((tmp_path / "out").iterdir()) == []
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "rollout step failed" and "s1-p0-g1" in events[-1]["error"]


class ScriptedClientWithProgress(ScriptedClient):
    def report_progress(self, step=None, work=None) -> None:
        pass

    def workers(self, force: bool = False) -> list[dict]:
        return []


# -- VllmWorker.stop: abort what a failed drain leaves, within the drain timeout --------------------------
class FakeServer:
    """Each call takes all the time it is allowed (the worst case), on a fake monotonic clock."""

    def __init__(self, drain: Callable[[float], bool]):
        self._drain = drain
        self.now = 0.0
        self.calls: list[tuple[str, float]] = []

    def monotonic(self) -> float:
        return self.now

    def alive(self) -> bool:
        return True

    def drain(self, timeout: float) -> bool:
        self.calls.append(("drain", timeout))
        return self._drain(timeout)

    def abort_in_flight(self, timeout: float) -> int:
        self.calls.append(("abort", timeout))
        self.now += timeout
        return 3

    def stop(self, timeout: float = 10.0) -> int:
        self.calls.append(("stop", timeout))
        self.now += timeout
        return 0


def vllm_worker(server: FakeServer, monkeypatch: pytest.MonkeyPatch):
    from pearlctl.agent import workers
    from pearlctl.agent.workers import VllmWorker

    monkeypatch.setattr(workers, "time", SimpleNamespace(monotonic=server.monotonic, sleep=time.sleep))
    w = object.__new__(VllmWorker)  # no real server: only stop() is under test
    w.key, w.server, w._stopping, w._stopped = "r0", server, False, False
    return w


@pytest.mark.parametrize("outcome", ["timed-out", "failed"])
@pytest.mark.parametrize("drain_timeout", [8.0, 30.0, 120.0])
def test_stop_aborts_in_flight_requests_when_the_drain_does_not_finish(
    outcome: str, drain_timeout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    def drain(timeout: float) -> bool:
        server.now += timeout  # ran out of time
        if outcome == "failed":
            raise RuntimeError("POST /pause answered 500")
        return False

    server = FakeServer(drain)
    w = vllm_worker(server, monkeypatch)
    w.stop(drain_timeout)
    assert [c for c, _ in server.calls] == ["drain", "abort", "stop"]
    assert server.calls[0][1] >= drain_timeout * 0.75  # most of the time goes to letting requests finish
    assert server.now <= drain_timeout  # the abort and the stop fit in what is left
    assert w.state() == "STOPPED"


def test_stop_after_a_complete_drain_does_not_abort_and_honours_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    def drain(timeout: float) -> bool:
        server.now += 2.0
        return True

    server = FakeServer(drain)
    vllm_worker(server, monkeypatch).stop(8.0)
    assert [c for c, _ in server.calls] == ["drain", "stop"]
    assert server.now <= 8.0


def test_concurrent_sessions_share_one_client() -> None:
    """Turns from several threads: every one completes, the counters balance."""
    t, workers = FakeTime(), Workers()
    rng = random.Random(0)
    workers.serve[A] = lambda body: answer("x", 1) if rng.random() > 0.3 else httpx.Response(502)
    workers.serve[B] = ok("y", 1)
    client, _ = make_client(lambda: [worker(A, t.now), worker(B, t.now)], workers, t, refresh_s=0.0)
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda i: client.complete(f"s{i}", "p", max_tokens=1), range(40)))
    assert len(done) == 40 and all(c.tokens == 1 for c in done)
    assert client.counts["generating"] == 0 and client.counts["tokens"] == 40
