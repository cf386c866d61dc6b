"""A rollout client for agent loops: OpenAI-compatible completions against the run's routable workers.

- Membership comes from the daemon (``GET /v1/workers`` through the run's one control-API client,
  `pearlctl.api.client.ControlClient`: READY, routable workers, each ``{id, url, role, weight_version,
  seen_at}``), refreshed every ``refresh_s`` and before every retry. A worker that is draining stops
  getting new requests as soon as its DEREGISTER step runs.
- An episode (``session``) sticks to one worker across its turns (its prefix stays in that worker's KV
  cache) until that worker fails or leaves; then it moves.
- **A turn is retried for a time, not a number of attempts.** A failed request (connection refused,
  timeout, 5xx, an unreadable answer) or no routable worker at all is retried with jittered exponential
  back-off (tenacity's ``wait_random_exponential``) until ``retry_for_s`` has passed since the turn began;
  only then does `complete` raise `TurnFailed`, naming the session, the time, the attempts and the last
  error. A 400/413/422 answer (the request itself is wrong) raises `TurnRefused` at once.
- **A worker that failed a request is excluded** from picking until the daemon confirms it: until the
  daemon no longer lists its URL (it is then forgotten), or lists it with a ``seen_at`` (the unix time of
  its agent's latest report, 0 when the daemon does not say) later than the failure — its agent has
  checked it since. Clocks of the rollout nodes and the head node are assumed NTP-synchronised.
- **An aborted turn is continued, not redone.** A drain that runs out of time aborts what is in flight:
  vLLM answers ``finish_reason: "abort"`` with the partial text. The client sends the rest of the turn to
  another worker — the prompt plus the partial text as the new prompt, ``max_tokens`` less the tokens
  already produced — and returns ONE `Completion`: the texts joined, the tokens summed.
- Every completion says which worker finished it and which weight version that worker reported.
- Progress (queued / generating / tool_wait / done, tokens) is reported to the daemon.

Time is injectable (``clock``: unix seconds, ``sleep``) so tests run the back-off without waiting.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import RetryCallState, RetryError, Retrying, retry_if_exception_type, wait_random_exponential
from tenacity.stop import stop_base

from pearlctl.api.client import ControlClient, DaemonRefusal

log = logging.getLogger("pearlctl.router")

REFUSED_STATUSES = (400, 413, 422)  # the request itself is wrong: no worker will serve it


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
    """A worker refused the request itself (HTTP 400/413/422): retrying would not help."""


@dataclass
class Completion:
    text: str
    tokens: int
    worker: str  # the URL of the worker that finished the turn
    weight_version: str | None  # the weight version that worker reported
    retries: int  # attempts beyond the first (continuations of an aborted turn included)
    finish_reason: str | None = None
    continued: int = 0  # how many times an aborted partial response was continued elsewhere
    parts: list[dict] = field(default_factory=list)  # per part: worker, weight_version, tokens


# -- retryable outcomes of one attempt (internal) ---------------------------------------------------
class _Retry(Exception):
    pass


class _NoRoute(_Retry):
    """No worker can be picked now (none listed, or every listed one excluded)."""


class _WorkerFailed(_Retry):
    """The picked worker failed the request; it is excluded until the daemon confirms it."""


class _Refused(Exception):
    """The worker refused the request itself: not retried."""


class _Aborted(_Retry):
    """The worker aborted the request (a drain); its partial output is kept, the rest goes elsewhere."""


@dataclass
class _Turn:
    prompt: str
    max_tokens: int
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    parts: list[dict] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class _StopAfterDelay(stop_base):
    """tenacity's ``stop_after_delay`` measured on the client's clock (tenacity reads ``time.monotonic``
    itself, which a test cannot advance)."""

    def __init__(self, max_delay: float, clock: Callable[[], float], started: float):
        self.max_delay, self.clock, self.started = max_delay, clock, started

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self.clock() - self.started >= self.max_delay


class RolloutClient:
    """``retry_for_s``: how long one turn may take, retries included, before `TurnFailed`.
    ``backoff_s``/``backoff_max_s``: the first and the largest back-off window (full jitter).
    ``control``: the daemon's client (default: ``ControlClient(run_dir, run_id)``); ``http``: the client for
    the workers (default: a new ``httpx.Client(timeout=timeout)``). ``clock``/``sleep``: unix time and
    sleep, for tests."""

    def __init__(
        self,
        run_dir: str,
        run_id: str,
        *,
        refresh_s: float = 2.0,
        timeout: float = 120.0,
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
        self._control = control if control is not None else ControlClient(run_dir, run_id)
        self._http = http if http is not None else httpx.Client(timeout=timeout)
        self._clock, self._sleep = clock, sleep
        self._workers: list[dict] = []
        self._asked: float | None = None  # clock() when the daemon was last asked for its workers
        self._generation = 0  # how many times it was asked
        self._excluded: dict[str, float] = {}  # url -> clock() of its latest failure
        self._rr = itertools.count()
        self._sessions: dict[str, str] = {}
        self._models: dict[str, str] = {}
        self._lock = threading.Lock()  # the state above
        self._refresh_lock = threading.Lock()  # one membership request at a time
        self.counts = {"queued": 0, "generating": 0, "tool_wait": 0, "done": 0, "tokens": 0}

    def close(self) -> None:
        self._http.close()
        self._control.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the daemon -------------------------------------------------------------------------------
    def _daemon(self, method: str, path: str, body: dict | None = None) -> dict | None:
        """The daemon's answer; None when it is unreachable or refuses (logged)."""
        try:
            return self._control.try_call(method, path, body)
        except DaemonRefusal as exc:
            log.warning("the daemon refused %s %s: %s", method, path, exc)
            return None

    def workers(self, *, force: bool = False) -> list[dict]:
        """The daemon's routable workers (excluded ones included), asked again when last asked more than
        ``refresh_s`` ago or when ``force``; the last known list while the daemon does not answer."""
        with self._lock:
            generation = self._generation
            if not force and self._asked is not None and self._clock() - self._asked <= self.refresh_s:
                return list(self._workers)
        with self._refresh_lock:
            with self._lock:
                if self._generation != generation:  # another thread asked while we waited: its answer will do
                    return list(self._workers)
                self._asked = self._clock()
            answer = self._daemon("GET", "/v1/workers")
            with self._lock:
                self._generation += 1
                if answer is not None and isinstance(answer.get("workers"), list):
                    self._workers = [w for w in answer["workers"] if isinstance(w, dict) and w.get("url")]
                    self._confirm(self._workers)
                return list(self._workers)

    def _confirm(self, listed: list[dict]) -> None:
        """End the exclusions the daemon's fresh list settles (under ``_lock``)."""
        seen = {w["url"]: _seen_at(w) for w in listed}
        for url, failed_at in list(self._excluded.items()):
            if url not in seen:
                del self._excluded[url]
                self._models.pop(url, None)
                log.info("worker %s is no longer listed: forgotten", url)
            elif seen[url] > failed_at:
                del self._excluded[url]
                log.warning("worker %s reported by its agent since it failed: back in rotation", url)

    def excluded(self) -> dict[str, float]:
        """Worker URLs excluded from picking, with the time of their latest failure."""
        with self._lock:
            return dict(self._excluded)

    def report_progress(self, step: int | None = None, work: dict | None = None) -> None:
        """Send the counts, and ``work`` — the remaining batch as the planner's Work fields (turns left,
        tokens per turn, tool latency…) — when the driver knows it: cost-aware policies predict with it.
        Never raises: progress is advice."""
        with self._lock:
            body = dict(self.counts, step=step)
        if work is not None:
            body["work"] = work
        self._daemon("POST", "/v1/rollout/progress", body)

    def count(self, key: str, delta: int = 1) -> None:
        with self._lock:
            self.counts[key] += delta

    # -- requests ---------------------------------------------------------------------------------
    def _pick(self, session: str, *, force: bool) -> dict:
        listed = self.workers(force=force)
        with self._lock:
            eligible = [w for w in listed if w["url"] not in self._excluded]
            url = self._sessions.get(session)
            for w in eligible:
                if w["url"] == url:
                    return w
            if not eligible:
                what = f"all {len(listed)} listed excluded after failing" if listed else "none listed"
                raise _NoRoute(f"no routable rollout worker ({what})")
            w = eligible[next(self._rr) % len(eligible)]
            self._sessions[session] = w["url"]
            return w

    def _exclude(self, url: str, session: str) -> None:
        with self._lock:
            self._excluded[url] = max(self._excluded.get(url, 0.0), self._clock())
            if self._sessions.get(session) == url:
                del self._sessions[session]
            self._models.pop(url, None)

    def _model(self, url: str) -> str:
        with self._lock:
            model = self._models.get(url)
        if model is None:
            resp = self._http.get(url + "/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
            with self._lock:
                self._models[url] = model
        return model

    def _attempt(self, session: str, turn: _Turn, attempt: int, sampling: dict) -> Completion:
        w = self._pick(session, force=attempt > 1)
        url = w["url"]
        self.count("generating")
        try:
            try:
                resp = self._http.post(
                    url + "/v1/completions",
                    json={
                        **sampling,
                        "model": self._model(url),
                        "prompt": turn.prompt + turn.text,
                        "max_tokens": turn.max_tokens - turn.tokens,
                    },
                )
            finally:
                self.count("generating", -1)
            if resp.status_code in REFUSED_STATUSES:
                raise _Refused(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
            resp.raise_for_status()
            doc = resp.json()
            choice = doc["choices"][0]
            text, reason = str(choice["text"]), choice.get("finish_reason")
            tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
        except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            self._exclude(url, session)
            log.warning(
                "turn of %s failed on %s (%s: %s): worker excluded, turn moves", session, url, type(exc).__name__, exc
            )
            raise _WorkerFailed(f"{url}: {type(exc).__name__}: {exc}") from exc
        self.count("tokens", tokens)
        turn.texts.append(text)
        turn.tokens += tokens
        turn.parts.append({"worker": url, "weight_version": w.get("weight_version"), "tokens": tokens})
        if reason == "abort" and turn.tokens < turn.max_tokens:
            self._exclude(url, session)
            log.warning(
                "turn of %s aborted on %s after %d tokens (a drain): continuing it elsewhere", session, url, turn.tokens
            )
            raise _Aborted(f"{url}: aborted after {turn.tokens} of {turn.max_tokens} tokens")
        if reason == "abort":
            reason = "length"  # aborted exactly at its budget: nothing left to generate
        return Completion(
            turn.text,
            turn.tokens,
            url,
            w.get("weight_version"),
            attempt - 1,
            reason,
            continued=len(turn.texts) - 1,
            parts=list(turn.parts),
        )

    def _wait(self, retry_state: RetryCallState, started: float) -> float:
        """Full-jitter exponential back-off, none after an abort (the rest goes to another worker now),
        never past the time bound."""
        outcome = retry_state.outcome
        if outcome is not None and isinstance(outcome.exception(), _Aborted):
            return 0.0
        backoff = wait_random_exponential(multiplier=self.backoff_s, max=self.backoff_max_s)(retry_state)
        return max(0.0, min(backoff, self.retry_for_s - (self._clock() - started)))

    def complete(
        self,
        session: str,
        prompt: str,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        stop: list[str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Completion:
        """One turn of an episode. Retried on other workers with back-off until it completes or
        ``retry_for_s`` has passed (then `TurnFailed`); an aborted turn is continued, not redone.
        ``extra``: more fields of the completions request (``seed``, ``ignore_eos``…)."""
        turn = _Turn(prompt, max_tokens)
        sampling = {**(extra or {}), "temperature": temperature, "stop": stop or []}
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

        retrying = Retrying(
            stop=_StopAfterDelay(self.retry_for_s, self._clock, started),
            wait=lambda rs: self._wait(rs, started),
            retry=retry_if_exception_type(_Retry),
            sleep=self._sleep,
            before_sleep=before_sleep,
        )
        n = 0
        try:
            for attempt in retrying:
                n = attempt.retry_state.attempt_number
                with attempt:
                    return self._attempt(session, turn, n, sampling)
        except RetryError as err:
            last = err.last_attempt.exception()
            raise TurnFailed(session, self._clock() - started, err.last_attempt.attempt_number, last) from last
        except _Refused as err:
            raise TurnRefused(session, self._clock() - started, n, err) from err
        raise AssertionError("unreachable: tenacity either returns an attempt's result or raises")


def _seen_at(worker: dict) -> float:
    try:
        return float(worker.get("seen_at") or 0.0)
    except (TypeError, ValueError):
        return 0.0
