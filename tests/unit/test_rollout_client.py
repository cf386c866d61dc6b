"""RolloutClient, a thin client of the run's gateway, at one seam: the gateway's HTTP (httpx.MockTransport
answering as pearlctl.router.gateway does), the daemon's answers (a fake ControlClient) and time (a fake
clock whose sleep advances it), so back-off runs without waiting. What the gateway itself does (routing,
continuation, weight-version tags) is tested in tests/unit/test_gateway.py.

Also: the reference driver writes a step whole or not at all, and VllmWorker.stop aborts what a failed
drain leaves in flight before it stops the server, within the drain timeout it is given. (The driver's token
ids, logprobs and weight versions per turn: tests/unit/test_rollout_batches.py.)
"""

from __future__ import annotations

import dataclasses
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
from pearlctl.router import service
from pearlctl.router.client import JOIN_WAIT_S, Completion, RolloutClient, TurnFailed, TurnRefused
from tests.conftest import REPO, CharTokenizer, load_example

T0 = 1_700_000_000.0
A, B = "http://a:8000", "http://b:8000"
GW = "http://gw:8100"
KEY = "rollout-key"


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


class Daemon:
    """Stands in for ControlClient: ``GET /v1/workers`` answers ``listing()`` (None: unreachable) and, when
    ``joining`` is given, ``joining()`` workers on their way (as pearlctl.daemon.controller answers)."""

    def __init__(self, listing: Callable[[], list[dict] | None] = lambda: [], joining: Callable[[], int] | None = None):
        self.listing, self.joining = listing, joining
        self.asked = 0
        self.progress: list[dict] = []

    def try_call(self, method: str, path: str, body: dict | None = None, **kw) -> dict | None:
        if path == "/v1/workers":
            self.asked += 1
            workers = self.listing()
            if workers is None:
                return None
            return {"epoch": 1, "workers": workers, **({"joining": self.joining()} if self.joining else {})}
        self.progress.append(body or {})
        return {"epoch": 1}

    def close(self) -> None:
        pass


def answer(text: str = " 4", ids: tuple[int, ...] = (7, 8), reason: str = "length", pearl: dict | None = None):
    doc = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {"index": 0, "text": text, "finish_reason": reason, "token_ids": list(ids), "prompt_token_ids": [1, 2]}
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 2 + len(ids)},
    }
    if pearl is not None:
        doc["pearl"] = pearl
    return httpx.Response(200, json=doc)


def gateway_error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "x", "code": status}})


class Gateway:
    """The gateway's HTTP: ``serve(body, headers)`` answers a completion while ``up``; otherwise connections
    are refused. Every completion request is recorded."""

    def __init__(self, serve: Callable[[dict, dict], httpx.Response] = lambda b, h: answer(), key: str = KEY) -> None:
        self.serve, self.key = serve, key
        self.up = True
        self.origins: set[str] = {GW}
        self.requests: list[tuple[str, dict, dict]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if not self.up or origin not in self.origins:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.headers.get("authorization") != f"Bearer {self.key}":
            return gateway_error(401, "wrong key in Authorization: Bearer")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        self.requests.append((origin, body, dict(request.headers)))
        return self.serve(body, dict(request.headers))


def make_client(gateway: Gateway, t: FakeTime, daemon: Daemon | None = None, **kw) -> RolloutClient:
    kw.setdefault("base_url", GW + "/v1")
    kw.setdefault("api_key", KEY)
    return RolloutClient(
        "/nonexistent" if "run_dir" not in kw else kw.pop("run_dir"),
        "run",
        control=daemon or Daemon(),  # type: ignore[arg-type]
        http=httpx.Client(transport=httpx.MockTransport(gateway.handle)),
        clock=t.clock,
        sleep=t.sleep,
        **kw,
    )


# -- one turn: one request, one answer ------------------------------------------------------------------
def test_a_turn_is_one_request_with_the_key_the_session_and_the_time_left() -> None:
    t, gw = FakeTime(), Gateway()
    client = make_client(gw, t, retry_for_s=90)
    c = client.complete("s7-p1-g2", "2 + 2 =", max_tokens=8, temperature=0.0, stop=["\n"], extra={"seed": 3})
    ((origin, body, headers),) = gw.requests
    assert origin == GW
    assert headers["x-session-id"] == "s7-p1-g2" and float(headers["x-pearl-retry-for-s"]) == 90.0
    assert body == {
        "model": "tiny",
        "prompt": "2 + 2 =",
        "max_tokens": 8,
        "temperature": 0.0,
        "stop": ["\n"],
        "seed": 3,
        "return_token_ids": True,
    }
    assert (c.text, c.tokens, c.token_ids, c.prompt_token_ids, c.finish_reason) == (" 4", 2, [7, 8], [1, 2], "length")
    assert client.counts["tokens"] == 2 and client.counts["generating"] == 0


def test_the_completion_carries_the_gateways_parts_weight_versions_and_continuations() -> None:
    t = FakeTime()
    pearl = {
        "parts": [
            {"tokens": 3, "finish_reason": "abort", "weight_version": "7", "version_from": "membership", "worker": A},
            {"tokens": 5, "finish_reason": "length", "weight_version": "8", "version_from": "membership", "worker": B},
        ],
        "continued": 1,
        "attempts": 3,
        "weight_versions": ["7", "8"],
        "timing": {"received": 1000.25, "answered": 1003.5},
    }
    gw = Gateway(lambda b, h: answer("The sum is 4.", tuple(range(8)), pearl=pearl))
    c = make_client(gw, t).complete("s", "p", max_tokens=8)
    assert isinstance(c, Completion)
    assert (c.worker, c.weight_version, c.continued, c.retries, c.tokens) == (B, "8", 1, 2, 8)
    assert c.parts == pearl["parts"] and c.weight_versions == ["7", "8"]
    assert c.gateway_span == (1000.25, 1003.5)
    broken = {**pearl, "timing": {"received": "soon"}}  # not two times: no span, and no failed turn
    c = make_client(Gateway(lambda b, h: answer(pearl=broken)), t).complete("s", "p", max_tokens=2)
    assert c.gateway_span is None
    flags = {**pearl, "timing": {"received": True, "answered": 2.5}}  # a bool is no time
    c = make_client(Gateway(lambda b, h: answer(pearl=flags)), t).complete("s", "p", max_tokens=2)
    assert c.gateway_span is None


def test_a_token_id_prompt_and_logprobs_go_through_and_the_sampled_logprobs_come_back() -> None:
    """A prompt of token ids is sent as such, ``logprobs`` rides in ``extra``, and the answer's
    ``logprobs.token_logprobs`` (the gateway joins a continued turn's parts) become `Completion.logprobs`."""
    lp = {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -1.25, 0.0], "top_logprobs": [], "text_offset": [0, 1, 2]}

    def serve(body: dict, headers: dict) -> httpx.Response:
        resp = answer("abc", (7, 8, 9))
        doc = json.loads(resp.content)
        doc["choices"][0]["logprobs"] = lp
        doc["choices"][0]["prompt_token_ids"] = body["prompt"]
        return httpx.Response(200, json=doc)

    gw = Gateway(serve)
    c = make_client(gw, FakeTime()).complete("s", [1, 5, 9], max_tokens=3, extra={"logprobs": 0})
    ((_, body, _),) = gw.requests
    assert body["prompt"] == [1, 5, 9] and body["logprobs"] == 0 and body["return_token_ids"] is True
    assert c.token_ids == [7, 8, 9] and c.prompt_token_ids == [1, 5, 9] and c.logprobs == [-0.5, -1.25, 0.0]
    plain = make_client(Gateway(), FakeTime()).complete("s", [1], max_tokens=2)
    assert plain.logprobs is None  # not asked for: none (never an empty list that would look like 0 tokens)


def test_an_ambiguous_part_has_no_version_and_no_worker() -> None:
    pearl = {"parts": [{"tokens": 2, "weight_version": None, "version_from": "ambiguous", "candidates": ["3", "4"]}]}
    c = make_client(Gateway(lambda b, h: answer(pearl=pearl)), FakeTime()).complete("s", "p", max_tokens=2)
    assert (c.worker, c.weight_version, c.parts[0]["candidates"]) == (None, None, ["3", "4"])


# -- the time bound ----------------------------------------------------------------------------------------
def test_an_unreachable_gateway_is_retried_with_back_off_until_it_answers() -> None:
    t, gw = FakeTime(), Gateway()
    gw.up = False
    sent_left: list[float] = []

    def serve(body: dict, headers: dict) -> httpx.Response:
        sent_left.append(float(headers["x-pearl-retry-for-s"]))
        return answer()

    gw.serve = serve
    client = make_client(gw, t, retry_for_s=600)
    original = t.sleep

    def sleep(seconds: float) -> None:
        original(seconds)
        gw.up = t.now >= T0 + 30  # the gateway is back after 30 s (a restart)

    client._sleep = sleep
    t_real = time.monotonic()
    c = client.complete("s", "p", max_tokens=2)
    assert time.monotonic() - t_real < 5  # fake time: the back-off does not sleep for real
    assert t.now >= T0 + 30 and c.retries >= 2
    assert all(0 <= s <= client.backoff_max_s for s in t.sleeps) and len(set(t.sleeps)) > 1
    assert sent_left and 600 - (t.now - T0) - 1 <= sent_left[0] <= 600 - 30  # it says how much time is left


def test_a_gateway_that_keeps_giving_up_makes_the_turn_fail_at_the_clients_bound() -> None:
    t = FakeTime()
    gw = Gateway(lambda b, h: gateway_error(503, "no worker completed this request: gave up after 12 attempt(s)"))
    client = make_client(gw, t, retry_for_s=60)
    with pytest.raises(TurnFailed) as info:
        client.complete("s7-p1-g2", "p", max_tokens=2)
    err = info.value
    assert not isinstance(err, TurnRefused)
    assert 60 <= err.seconds <= 60 + client.backoff_max_s and err.attempts > 4
    message = str(err)
    assert "s7-p1-g2" in message and f"{err.attempts} attempt" in message and "60." in message
    assert "gave up after 12 attempt(s)" in message  # the gateway's own account


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_a_refused_request_fails_at_once(status: int) -> None:
    t = FakeTime()
    gw = Gateway(lambda b, h: gateway_error(status, "maximum context length is 512"))
    client = make_client(gw, t)
    with pytest.raises(TurnRefused, match="maximum context length"):
        client.complete("s", "p", max_tokens=2)
    assert t.sleeps == [] and len(gw.requests) == 1


def test_a_wrong_key_is_refused_at_once_with_the_gateways_reason() -> None:
    t = FakeTime()
    client = make_client(Gateway(), t, api_key="stale")
    with pytest.raises(TurnRefused, match="wrong key"):
        client.complete("s", "p", max_tokens=2)
    assert t.sleeps == []


# -- finding the gateway -----------------------------------------------------------------------------------------
def test_the_gateway_is_found_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEARL_ROUTER_URL", GW + "/v1")
    monkeypatch.setenv("PEARL_ROUTER_KEY", KEY)
    gw = Gateway()
    client = make_client(gw, FakeTime(), base_url=None, api_key=None)
    assert client.complete("s", "p", max_tokens=2).text == " 4" and len(gw.requests) == 1


def test_the_gateway_is_found_in_the_run_directory_and_again_after_a_restart(tmp_path: Path) -> None:
    key = service.ensure_key(tmp_path)
    assert oct(service.key_path(tmp_path).stat().st_mode & 0o777) == "0o600"
    record = service.RouterRecord(
        pid=1,
        start_ticks=1,
        url=GW,
        base_url=GW + "/v1",
        router_url="http://127.0.0.1:1",
        host="0.0.0.0",
        port=8100,
        started_at=T0,
    )
    service.write_record(tmp_path, record)
    gw = Gateway(key=key)
    t = FakeTime()
    client = make_client(gw, t, run_dir=str(tmp_path), base_url=None, api_key=None)
    client.complete("s", "p", max_tokens=2)
    moved = "http://gw:8200"  # the gateway restarted on another port and wrote its record again
    gw.origins = {moved}
    service.write_record(tmp_path, dataclasses.replace(record, url=moved, base_url=moved + "/v1"))
    client.complete("s", "p", max_tokens=2)
    assert [origin for origin, _, _ in gw.requests] == [GW, moved]


def test_no_gateway_anywhere_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEARL_ROUTER_URL", raising=False)
    monkeypatch.delenv("PEARL_ROUTER_KEY", raising=False)
    client = RolloutClient(http=httpx.Client(transport=httpx.MockTransport(Gateway().handle)))
    with pytest.raises(ValueError, match="PEARL_ROUTER_URL and PEARL_ROUTER_KEY"):
        client.complete("s", "p", max_tokens=2)


def test_a_run_whose_gateway_has_not_started_yet_is_waited_for(tmp_path: Path) -> None:
    t = FakeTime()
    service.ensure_key(tmp_path)
    client = make_client(Gateway(), t, run_dir=str(tmp_path), base_url=None, api_key=None, retry_for_s=5)
    with pytest.raises(TurnFailed, match="no router gateway record"):
        client.complete("s", "p", max_tokens=2)
    assert t.now - T0 >= 5


# -- the daemon -------------------------------------------------------------------------------------------------
def test_progress_goes_to_the_daemon_and_never_raises() -> None:
    t = FakeTime()
    mode = {"v": "ok"}

    def listing() -> list[dict] | None:
        if mode["v"] == "refuse":
            raise DaemonRefusal("/v1/workers: restarting", 503)
        return None if mode["v"] == "down" else [{"id": 1, "url": A, "weight_version": "3"}]

    daemon = Daemon(listing)
    client = make_client(Gateway(), t, daemon, refresh_s=1.0)
    assert [w["weight_version"] for w in client.workers()] == ["3"]
    assert client.workers() and daemon.asked == 1  # cached for refresh_s
    for mode["v"] in ("down", "refuse"):
        t.sleep(2.0)
        assert [w["url"] for w in client.workers()] == [A]  # the last known list
    client.count("queued", 3)
    client.report_progress(step=3, work={"trajectories": 1})
    assert daemon.progress[-1]["step"] == 3 and daemon.progress[-1]["work"] == {"trajectories": 1}
    assert daemon.progress[-1]["queued"] == 3


# -- the join wait: a batch's launch waits, briefly, for workers on their way -------------------------------
def test_the_launch_waits_for_joining_workers_until_they_serve() -> None:
    t = FakeTime()
    left = [2, 2, 1, 0]  # the daemon's joining count at each ask: a borrow, then a start, finish
    daemon = Daemon(lambda: [{"url": A, "weight_version": "1"}], joining=lambda: left.pop(0))
    client = make_client(Gateway(), t, daemon)
    waited = client.wait_for_joining(15.0, poll_s=0.5)
    assert waited == pytest.approx(1.5) and t.sleeps == [0.5, 0.5, 0.5]
    assert daemon.asked == 4 and client.joining == 0


def test_the_join_wait_is_bounded() -> None:
    t = FakeTime()
    daemon = Daemon(lambda: [{"url": A}], joining=lambda: 1)  # a worker that never comes up
    client = make_client(Gateway(), t, daemon)
    assert client.wait_for_joining() == pytest.approx(JOIN_WAIT_S)  # then the batch goes to who serves
    assert sum(t.sleeps) == pytest.approx(JOIN_WAIT_S) and max(t.sleeps) <= 0.2 + 1e-9


@pytest.mark.parametrize(
    "daemon, join_wait_s",
    [
        (Daemon(lambda: [{"url": A}], joining=lambda: 3), 0.0),  # 0: the wait is off
        (Daemon(lambda: [{"url": A}]), 15.0),  # a daemon that does not say: nothing to wait for
        (Daemon(lambda: None, joining=lambda: 3), 15.0),  # one that does not answer: neither
    ],
    ids=["off", "no-field", "unreachable"],
)
def test_no_join_wait_when_off_or_when_the_daemon_does_not_say(daemon: Daemon, join_wait_s: float) -> None:
    t = FakeTime()
    client = make_client(Gateway(), t, daemon)
    assert client.wait_for_joining(join_wait_s) == 0.0 and t.sleeps == []


def test_the_driver_waits_for_the_weights_then_for_joining_workers_then_for_their_weights() -> None:
    driver = load_driver()
    t = FakeTime()
    daemon = Daemon()

    def listing() -> list[dict]:
        # ask 1: the serving worker holds the step's weights while a lent one joins; from ask 3 it is routable,
        # first with the weights it was parked with, from ask 5 with the step's
        joined = [{"url": B, "weight_version": "2" if daemon.asked >= 5 else "1"}] if daemon.asked >= 3 else []
        return [{"url": A, "weight_version": "2"}, *joined]

    daemon.listing, daemon.joining = listing, lambda: 1 if daemon.asked < 3 else 0
    client = make_client(Gateway(), t, daemon)
    driver.wait_for_workers(client, "2", timeout_s=5.0, join_wait_s=15.0)
    assert daemon.asked == 5 and t.sleeps == [pytest.approx(0.2)]  # one poll of the join wait
    assert [w["weight_version"] for w in client.workers()] == ["2", "2"]  # both serve the step's first turns


def test_concurrent_sessions_share_one_client() -> None:
    """Turns from several threads: every one completes, the counters balance."""
    t = FakeTime()
    rng = random.Random(0)
    gw = Gateway(lambda b, h: answer("x", (1,)) if rng.random() > 0.3 else gateway_error(503, "gave up"))
    client = make_client(gw, t)
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda i: client.complete(f"s{i}", "p", max_tokens=1), range(40)))
    assert len(done) == 40 and all(c.tokens == 1 for c in done)
    assert client.counts["generating"] == 0 and client.counts["tokens"] == 40
    assert {h["x-session-id"] for _, _, h in gw.requests} == {f"s{i}" for i in range(40)}


# -- the reference driver: a step is written whole or not at all ----------------------------------------
def load_driver():
    return load_example("grpo_rollout_driver", REPO / "examples/grpo/rollout.py")


class ScriptedClient:
    """The driver's view of a RolloutClient; ``fail`` names the sessions whose first turn fails."""

    def __init__(self, fail: set[str]):
        self.fail = fail
        self.counts = {"queued": 0, "generating": 0, "tool_wait": 0, "done": 0, "tokens": 0}

    def count(self, key: str, delta: int = 1) -> None:
        self.counts[key] += delta

    def complete(self, session: str, prompt: list[int], **kw) -> Completion:
        if session in self.fail:
            raise TurnFailed(session, 600.0, 123, httpx.ConnectError("refused"))
        return Completion(" 5", 2, A, "1", 0, "stop", token_ids=[5, 2], logprobs=[-0.5, -0.1], prompt_token_ids=prompt)


def driver_args(**kw) -> SimpleNamespace:
    base = dict(seed=0, prompts=3, group_size=2, max_tokens=4, tool_latency_s=0.0, tool_latency_dist="fixed")
    return SimpleNamespace(**{**base, **kw})


def test_driver_step_whole_or_failed_loudly() -> None:
    driver = load_driver()
    args = driver_args()
    encode = driver.Encoder(CharTokenizer())
    with ThreadPoolExecutor(4) as pool:
        groups = driver.run_step(ScriptedClient(set()), encode, 1, args, pool, driver.Remaining(args))
        assert [len(g.trajectories) for g in groups] == [2, 2, 2] == [len(g.rewards) for g in groups]
        with pytest.raises(driver.StepFailed, match=r"episode s2-p1-g0 failed: turn of session s2-p1-g0"):
            driver.run_step(ScriptedClient({"s2-p1-g0"}), encode, 2, args, pool, driver.Remaining(args))


def test_driver_exits_1_and_writes_no_batch_when_an_episode_fails(tmp_path: Path, monkeypatch, capsys) -> None:
    driver = load_driver()
    monkeypatch.setattr(driver, "RolloutClient", lambda *a, **kw: ScriptedClientWithProgress({"s1-p0-g1"}))
    monkeypatch.setattr(driver, "load_tokenizer", lambda args, client: driver.Encoder(CharTokenizer()))
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
    def report_progress(self, step=None, work=None, judge=None, tools=None) -> None:
        pass

    def workers(self, force: bool = False) -> list[dict]:
        return []

    def wait_for_joining(self, join_wait_s: float = JOIN_WAIT_S, **kw) -> float:
        return 0.0


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
    w.key, w.server, w._stopping, w._stopped, w.store = "r0", server, False, False, None
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


def test_more_turns_than_a_single_pool_would_take_are_in_flight_at_once() -> None:
    """Episodes on many threads share one client: 150 turns sent at once all reach the gateway together (a
    real HTTP server on loopback that answers none until all 150 are there), where one httpx pool with its
    default limits would hold the 101st back until an answer came — and none would come."""
    import http.server
    import threading

    n = 150
    here = threading.Barrier(n + 1)
    body = answer().content

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            try:
                here.wait(timeout=20)  # every turn in flight at once, or a broken barrier
            except threading.BrokenBarrierError:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 2 * n  # every connection accepted at once (socketserver's default backlog is 5)
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = RolloutClient(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key=KEY, model="m", retry_for_s=30)
    try:
        with ThreadPoolExecutor(n) as pool:
            turns = [pool.submit(client.complete, f"s{i}", [1, 2], max_tokens=2) for i in range(n)]
            here.wait(timeout=30)  # raises if fewer than 150 arrived together
            assert [t.result(timeout=30).token_ids for t in turns] == [[7, 8]] * n
    finally:
        client.close()
        server.shutdown()
