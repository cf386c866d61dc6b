"""A rollout client for agent loops: a thin client of the run's gateway (pearlctl.router.gateway), the one
authenticated OpenAI-compatible endpoint in front of the run's rollout workers.

- **Where.** The gateway's base URL and key come from the constructor, else from the environment
  (``PEARL_ROUTER_URL``, e.g. ``http://head:8100/v1``, and ``PEARL_ROUTER_KEY``), else from the run
  directory (``.pearl/router.json`` and ``.pearl/router.key``, written by pearlctl.router.service). A
  gateway that stops answering is looked up again in the run directory (restarted on another port).
- **What the gateway does, not this client.** Picking a worker (vllm-router, ``X-Session-ID`` keeps an
  episode on one), moving a turn when a worker leaves, continuing an aborted or broken turn from its
  token ids on another worker, and tagging each part with its weight version. The client sends one
  ``/v1/completions`` request per turn and reads ONE answer: text, token ids, the prompt's token ids, the
  sampled tokens' logprobs (when the request asks vLLM for ``logprobs``), finish reason, and the gateway's
  ``pearl`` record (parts with weight versions, continuations, attempts). A continued turn's ids and
  logprobs are the parts' joined in order by the gateway: each token's logprob is the one the worker that
  sampled it returned, and ``parts`` says how many tokens each part made under which weight version.
- **A turn is bounded in time.** Each request tells the gateway how long it may retry
  (``X-Pearl-Retry-For-S``: what is left of ``retry_for_s``). The client itself retries only what the
  gateway could not: the gateway unreachable or answering 502/503/504, with jittered exponential back-off,
  until ``retry_for_s`` has passed since the turn began; then `TurnFailed` names the session, the time, the
  attempts and the last error. A 4xx (the request itself is wrong, or the key) raises `TurnRefused` at once.
- **Progress** (queued / generating / tool_wait / done, tokens) goes to the daemon through the run's one
  control-API client (pearlctl.api.client.ControlClient), as before; ``workers()`` is the daemon's list of
  routable workers with their weight versions (what an on-policy driver waits on), and ``joining`` how many
  more are on their way (a borrow, start, wake or switch in progress): ``wait_for_joining`` holds a batch's
  launch back for them, at most ``JOIN_WAIT_S`` by default, so that its first turns spread over them too.

Time is injectable (``clock``: unix seconds, ``sleep``) so tests run the back-off without waiting.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import orjson
from tenacity import RetryCallState, RetryError, Retrying, retry_if_exception_type, wait_random_exponential
from tenacity.stop import stop_base

from pearlctl.api.client import ControlClient, DaemonRefusal
from pearlctl.router import service
from pearlctl.router.app import RETRY_FOR_HEADER, SESSION_HEADER

log = logging.getLogger("pearlctl.router")
_T = TypeVar("_T")

URL_ENV, KEY_ENV = "PEARL_ROUTER_URL", "PEARL_ROUTER_KEY"
RETRIED_STATUSES = (502, 503, 504)  # the gateway unreachable behind a proxy, or it gave up: ask again
# How long a batch's launch waits at most for workers that are joining (examples/grpo/rollout.py --join-wait-s).
# The simulator's drivers wait as long (pearlctl/sim/scenario.py JOIN_WAIT_S; tests/unit/test_sim_run.py
# checks that the two agree).
JOIN_WAIT_S = 15.0
POOLS = 16  # connection pools to the gateway, used in turn (RolloutClient.__init__ says why)
POOL_KEEPALIVE = 64  # idle connections each pool keeps
# How long an idle connection to the gateway is kept (httpx's default is 5 s): across a synchronous run's training
# step, so that the next batch's thousands of first turns reuse their connections rather than all connect to the
# gateway at once. Below the gateway's keep-alive (pearlctl.router.__main__ KEEP_ALIVE_S, 75 s).
KEEPALIVE_S = 60.0
JOIN_POLL_S = 0.2


class TurnFailed(Exception):
    """A turn could not be completed within the client's time bound (``retry_for_s``)."""

    def __init__(self, session: str, seconds: float, attempts: int, last: BaseException | None):
        self.session, self.seconds, self.attempts, self.last = session, seconds, attempts, last
        super().__init__(
            f"turn of session {session} not completed after {seconds:.1f} s and {attempts} attempt(s); "
            f"last error: {type(last).__name__ if last else 'none'}: {last}"
        )


NoWorkers = TurnFailed  # the former name


class TurnRefused(TurnFailed):
    """The gateway refused the request itself (HTTP 4xx: a bad request, or a wrong key): retrying would not help."""


@dataclass
class Completion:
    text: str
    tokens: int
    worker: str | None  # the worker that finished the turn, when the gateway could tell (else None)
    weight_version: str | None  # the weight version of the turn's last part (None: unknown or ambiguous)
    retries: int  # attempts beyond the first, the gateway's and this client's (continuations included)
    finish_reason: str | None = None
    continued: int = 0  # how many times an interrupted turn was continued from its tokens on another worker
    parts: list[dict] = field(default_factory=list)  # per part: tokens, weight_version, version_from, worker?
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)  # every version that produced a part
    # per token of ``token_ids``: the logprob vLLM returned for the sampled token (``logprobs.token_logprobs``);
    # None when the request did not ask for logprobs (``extra={"logprobs": 0}`` asks for the sampled token's)
    logprobs: list[float | None] | None = None
    # when the gateway had the request and when it answered (unix seconds; pearl.timing), when it said so
    gateway_span: tuple[float, float] | None = None


# -- retryable outcomes of one attempt (internal) ---------------------------------------------------
class _Retry(Exception):
    pass


class _Refused(Exception):
    """The gateway refused the request itself: not retried."""


class _StopAfterDelay(stop_base):
    """tenacity's ``stop_after_delay`` measured on the client's clock (tenacity reads ``time.monotonic``
    itself, which a test cannot advance)."""

    def __init__(self, max_delay: float, clock: Callable[[], float], started: float):
        self.max_delay, self.clock, self.started = max_delay, clock, started

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.clock() - self.started >= self.max_delay


class RolloutClient:
    """``run_dir``/``run_id``: the run (its gateway record and key, its daemon for progress); ``base_url``/
    ``api_key``: the gateway, overriding the environment and the run directory; ``model``: the served model
    name (default: the first the gateway lists). ``timeout``: one request's bound (the longest generation);
    ``retry_for_s``: one turn's bound, retries included; ``backoff_s``/``backoff_max_s``: the first and the
    largest back-off window (full jitter). ``control``: the daemon's client (default:
    ``ControlClient(run_dir, run_id)`` when both are given); ``http``: the client for the gateway.
    ``clock``/``sleep``: unix time and sleep, for tests."""

    def __init__(
        self,
        run_dir: str | None = None,
        run_id: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        model: str | None = None,
        refresh_s: float = 2.0,
        timeout: float = 1800.0,
        retry_for_s: float = 600.0,
        backoff_s: float = 0.1,
        backoff_max_s: float = 5.0,
        control: ControlClient | None = None,
        http: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.run_dir, self.run_id = run_dir, run_id
        self.refresh_s, self.retry_for_s = refresh_s, retry_for_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._given_url = base_url or os.environ.get(URL_ENV) or None
        self._given_key = api_key or os.environ.get(KEY_ENV) or None
        self._model = model
        if control is None and run_dir and run_id:
            control = ControlClient(run_dir, run_id)
        self._control = control
        if http is not None:
            self._pools = [http]
        else:
            # Episodes run on many threads at once. One httpx pool would serialise them: httpcore 1.0's pool
            # takes one lock and scans every connection it holds to assign or release each request
            # (encode/httpcore#1035) — a rollout of ~600 turns in flight per process spent a third of its turns
            # queued on that lock (docs/benchmarks.md). Several pools, one per request in turn, as the gateway's
            # upstream (pearlctl/router/gateway.py); no cap on connections (httpx's default, 100, would queue
            # turns beyond the 100th): the caller's threads bound them.
            tls = httpx.create_ssl_context()  # one for every pool: each would load the CA bundle again
            self._pools = [
                httpx.Client(
                    verify=tls,
                    timeout=httpx.Timeout(timeout, connect=10.0),
                    limits=httpx.Limits(
                        max_connections=None, max_keepalive_connections=POOL_KEEPALIVE, keepalive_expiry=KEEPALIVE_S
                    ),
                )
                for _ in range(POOLS)
            ]
        self._next_pool = itertools.cycle(self._pools)
        self._clock, self._sleep = clock, sleep
        self._endpoint: tuple[str, str] | None = None
        self._workers: list[dict] = []
        self.joining = 0  # workers on their way to serving, as the daemon last said (0: none, or it did not answer)
        self._asked: float | None = None
        self._lock = threading.Lock()
        self.counts = {"queued": 0, "generating": 0, "tool_wait": 0, "done": 0, "tokens": 0}

    @property
    def _http(self) -> httpx.Client:
        """The connection pool of the next request (the pools in turn)."""
        return next(self._next_pool)

    def close(self) -> None:
        for pool in self._pools:
            pool.close()
        if self._control is not None:
            self._control.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the gateway ------------------------------------------------------------------------------
    def endpoint(self, fresh: bool = False) -> tuple[str, str]:
        """(base URL ending in /v1, key). Raises `_Retry` while the run has no gateway record yet."""
        with self._lock:
            if self._endpoint is not None and not fresh:
                return self._endpoint
        url, key = self._given_url, self._given_key
        if url is None and self.run_dir:
            record = service.read_record(self.run_dir)
            if record is None:
                raise _Retry(f"no router gateway record at {service.record_path(self.run_dir)} (not started yet?)")
            url = record.base_url
        if key is None and self.run_dir:
            try:
                key = service.read_key(self.run_dir)
            except (OSError, ValueError) as exc:
                raise _Retry(f"cannot read the router key: {exc}") from None
        if url is None or key is None:
            raise ValueError(
                f"no router gateway: pass base_url and api_key, set {URL_ENV} and {KEY_ENV}, or give the run_dir"
            )
        with self._lock:
            self._endpoint = (url.rstrip("/"), key)
            return self._endpoint

    def model(self) -> str:
        if self._model is None:
            url, key = self.endpoint()
            resp = self._http.get(url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=30.0)
            if resp.status_code != 200:
                failure = _Retry if resp.status_code in RETRIED_STATUSES else _Refused
                raise failure(f"GET {url}/models: HTTP {resp.status_code}: {_message(resp)}")
            self._model = str(resp.json()["data"][0]["id"])
        return self._model

    # -- the daemon -------------------------------------------------------------------------------
    def _daemon(self, method: str, path: str, body: dict | None = None) -> dict | None:
        """The daemon's answer; None when there is none, it is unreachable or it refuses (logged)."""
        if self._control is None:
            return None
        try:
            return self._control.try_call(method, path, body)
        except DaemonRefusal as exc:
            log.warning("the daemon refused %s %s: %s", method, path, exc)
            return None

    def workers(self, *, force: bool = False) -> list[dict]:
        """The daemon's routable workers (``{id, url, role, weight_version, seen_at}``), asked again when
        last asked more than ``refresh_s`` ago or when ``force``; the last known list while the daemon
        does not answer."""
        with self._lock:
            if not force and self._asked is not None and self._clock() - self._asked <= self.refresh_s:
                return list(self._workers)
            self._asked = self._clock()
        answer = self._daemon("GET", "/v1/workers")
        with self._lock:
            if answer is not None and isinstance(answer.get("workers"), list):
                self._workers = [w for w in answer["workers"] if isinstance(w, dict) and w.get("url")]
            joining = answer.get("joining") if answer is not None else None
            # a daemon that does not answer (or predates the field) has nothing joining to wait for
            self.joining = joining if isinstance(joining, int) and not isinstance(joining, bool) else 0
            return list(self._workers)

    def wait_for_joining(self, join_wait_s: float = JOIN_WAIT_S, *, poll_s: float = JOIN_POLL_S) -> float:
        """Before a batch's launch: while the daemon says workers are joining (GPUs in a borrow, start, wake or
        switch toward serving rollouts), wait for them to be routable — at most ``join_wait_s`` (0: not at
        all). A worker that joins after the launch only takes sessions at their next turns (the router's
        consistent hash), so the batch's first turns would all queue at the workers serving at the launch.
        Returns the seconds waited."""
        started = self._clock()
        while join_wait_s > 0:
            self.workers(force=True)
            waited = self._clock() - started
            if self.joining <= 0 or waited >= join_wait_s:
                if self.joining > 0:
                    log.info("launching with %d worker(s) still joining after %.1f s", self.joining, waited)
                return waited
            self._sleep(min(poll_s, join_wait_s - waited))
        return 0.0

    def report_progress(
        self, step: int | None = None, work: dict | None = None, judge: dict | None = None, tools: dict | None = None
    ) -> None:
        """Send the counts, and ``work`` — the remaining batch as the planner's Work fields (turns left,
        tokens per turn, tool latency…) — when the driver knows it: cost-aware policies predict with it;
        ``judge``, the judge queue (pearlctl.router.judge.Queue.counts), when it scores with a judge; and
        ``tools``, the batch's tool calls as the driver timed them (pearlctl.api.bodies.ToolTimes: the largest sum
        of tool seconds over its trajectories), when it times them.
        Never raises: progress is advice."""
        with self._lock:
            body = dict(self.counts, step=step)
        if work is not None:
            body["work"] = work
        if judge is not None:
            body["judge"] = judge
        if tools is not None:
            body["tools"] = tools
        self._daemon("POST", "/v1/rollout/progress", body)

    def count(self, key: str, delta: int = 1) -> None:
        with self._lock:
            self.counts[key] += delta

    # -- requests ---------------------------------------------------------------------------------
    def _post(self, session: str, body: dict, left_s: float, attempt: int, counted: bool) -> dict:
        """One attempt: the gateway's answer as a JSON object (`_Retry` / `_Refused` as the gateway's status
        says). ``counted``: a rollout turn (counted as ``generating`` while in flight; a judge's request is not)."""
        try:
            url, key = self.endpoint(fresh=attempt > 1 and self._given_url is None)
            headers = {
                "Authorization": f"Bearer {key}",
                SESSION_HEADER: session,
                RETRY_FOR_HEADER: f"{max(0.0, left_s):.3f}",
            }
            body = {"model": self.model(), **body}
            if counted:
                self.count("generating")
            try:
                # orjson both ways: a turn's body and answer carry the context's token ids (thousands of them),
                # and the standard library's json took most of a rollout thread's time for them
                resp = self._http.post(
                    url + "/completions",
                    content=orjson.dumps(body),
                    headers={**headers, "Content-Type": "application/json"},
                )
            finally:
                if counted:
                    self.count("generating", -1)
        except httpx.HTTPError as exc:
            raise _Retry(f"the router gateway does not answer: {type(exc).__name__}: {exc}") from exc
        if resp.status_code in RETRIED_STATUSES:
            raise _Retry(f"HTTP {resp.status_code}: {_message(resp)}")
        if resp.status_code != 200:
            raise _Refused(f"HTTP {resp.status_code}: {_message(resp)}")
        try:
            doc = orjson.loads(resp.content)
        except ValueError as exc:
            raise _Retry(f"an unreadable answer from the gateway ({type(exc).__name__}: {exc})") from exc
        if not isinstance(doc, dict):
            raise _Retry(f"an unreadable answer from the gateway (a JSON {type(doc).__name__}, not an object)")
        return doc

    def _attempt(self, session: str, body: dict, left_s: float, attempt: int) -> Completion:
        doc = self._post(session, body, left_s, attempt, counted=True)
        try:
            choice = doc["choices"][0]
            text, reason = str(choice["text"]), choice.get("finish_reason")
            ids = [int(t) for t in choice.get("token_ids") or []]
            tokens = int((doc.get("usage") or {}).get("completion_tokens") or len(ids))
            lp = choice.get("logprobs")
            logprobs = None
            if isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
                logprobs = [None if v is None else float(v) for v in lp["token_logprobs"]]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _Retry(f"an unreadable answer from the gateway ({type(exc).__name__}: {exc})") from exc
        pearl, parts = pearl_record(doc)
        last = parts[-1] if parts else {}
        timing = pearl.get("timing") if isinstance(pearl.get("timing"), dict) else {}
        span = (timing.get("received"), timing.get("answered"))
        self.count("tokens", tokens)
        return Completion(
            text,
            tokens,
            last.get("worker"),
            last.get("weight_version"),
            (attempt - 1) + max(0, int(pearl.get("attempts") or 1) - 1),
            reason,
            continued=int(pearl.get("continued") or 0),
            parts=parts,
            token_ids=ids,
            prompt_token_ids=choice.get("prompt_token_ids"),
            weight_versions=list(pearl.get("weight_versions") or []),
            logprobs=logprobs,
            gateway_span=span if all(type(t) in (int, float) for t in span) else None,  # not bool, not text
        )

    def complete(
        self,
        session: str,
        prompt: str | list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        stop: list[str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Completion:
        """One turn of an episode (``prompt``: text or token ids). Completed by the gateway, continued
        across workers if one leaves; retried here only while the gateway is unreachable or gives up,
        until ``retry_for_s`` has passed (then `TurnFailed`). ``extra``: more fields of the completions
        request (``seed``, ``ignore_eos``, ``logprobs``…)."""
        body = {
            **(extra or {}),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stop": stop or [],
            "return_token_ids": True,
        }
        return self._retrying(session, lambda left, n: self._attempt(session, body, left, n))

    def request(self, session: str, body: Mapping[str, Any]) -> dict:
        """Any ``/v1/completions`` request (``body``; its ``model`` names the model, default the first listed)
        and the gateway's answer as it is, retried and bounded as a turn (`TurnFailed`, `TurnRefused`); not
        counted as rollout progress. A judge's requests (pearlctl.router.judge) go this way."""
        return self._retrying(session, lambda left, n: self._post(session, dict(body), left, n, counted=False))

    def _retrying(self, session: str, attempt: Callable[[float, int], _T]) -> _T:
        """``attempt(seconds left, attempt number)`` until it answers: retried while it raises `_Retry`, for up
        to ``retry_for_s`` (then `TurnFailed`); `_Refused` is `TurnRefused` at once."""
        started = self._clock()

        def before_sleep(rs: RetryCallState) -> None:
            n = rs.attempt_number
            if n & (n - 1) == 0:  # 1, 2, 4, 8…: say it, without a line per attempt
                log.warning(
                    "turn of %s: attempt %d failed (%s); retrying for up to %.0f s more",
                    session,
                    n,
                    rs.outcome.exception() if rs.outcome else None,
                    self.retry_for_s - (self._clock() - started),
                )

        def wait(rs: RetryCallState) -> float:
            backoff = wait_random_exponential(multiplier=self.backoff_s, max=self.backoff_max_s)(rs)
            return max(0.0, min(backoff, self.retry_for_s - (self._clock() - started)))

        retrying = Retrying(
            stop=_StopAfterDelay(self.retry_for_s, self._clock, started),
            wait=wait,
            retry=retry_if_exception_type(_Retry),
            sleep=self._sleep,
            before_sleep=before_sleep,
        )
        n = 0
        try:
            for attempt_ in retrying:
                n = attempt_.retry_state.attempt_number
                with attempt_:
                    return attempt(self.retry_for_s - (self._clock() - started), n)
        except RetryError as err:
            last = err.last_attempt.exception()
            raise TurnFailed(session, self._clock() - started, err.last_attempt.attempt_number, last) from last
        except _Refused as err:
            raise TurnRefused(session, self._clock() - started, n, err) from err
        raise AssertionError("unreachable: tenacity either returns an attempt's result or raises")


def pearl_record(doc: dict) -> tuple[dict, list[dict]]:
    """The gateway's ``pearl`` record of an answer (pearlctl.router.turn: parts, continuations, attempts) and its
    parts, each the tokens one worker made with the weights it served; empty when the answer carries none."""
    pearl = doc.get("pearl") if isinstance(doc.get("pearl"), dict) else {}
    return pearl, [p for p in pearl.get("parts") or [] if isinstance(p, dict)]


def _message(resp: httpx.Response) -> str:
    """The gateway's error message (OpenAI shape), else the start of the body."""
    try:
        doc = resp.json()
    except ValueError:
        return resp.text[:500]
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(err, str):
        return err
    return resp.text[:500]
