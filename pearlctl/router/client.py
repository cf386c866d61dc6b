"""A rollout client for agent loops: OpenAI-compatible completions against the run's routable workers.

- Membership comes from the daemon (``GET /v1/workers``: READY workers that are registered), refreshed
  every ``refresh_s`` and whenever a request fails — a worker that is draining stops getting new
  requests as soon as its DEREGISTER step runs.
- An episode (``session``) sticks to one worker across its turns (its prefix stays in that worker's KV
  cache); if the worker fails or leaves, the turn is re-sent whole to another worker (nothing lost, the
  work of that turn is redone).
- Every completion says which worker served it and which weight version that worker reported.
- Progress (queued / generating / tool_wait / done, tokens) is reported to the daemon.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import httpx

from pearlctl.runfiles import read_address, read_secret

log = logging.getLogger("pearlctl.router")


class NoWorkers(Exception):
    pass


@dataclass
class Completion:
    text: str
    tokens: int
    worker: str
    weight_version: str | None
    retries: int


class RolloutClient:
    def __init__(
        self,
        run_dir: str,
        run_id: str,
        *,
        refresh_s: float = 2.0,
        timeout: float = 120.0,
        wait_for_workers_s: float = 300.0,
    ):
        self.run_dir, self.run_id = run_dir, run_id
        self.refresh_s, self.wait_for_workers_s = refresh_s, wait_for_workers_s
        self._http = httpx.Client(timeout=timeout)
        self._workers: list[dict] = []
        self._refreshed = 0.0
        self._rr = itertools.count()
        self._sessions: dict[str, str] = {}
        self._models: dict[str, str] = {}
        self._lock = threading.Lock()
        self.counts = {"queued": 0, "generating": 0, "tool_wait": 0, "done": 0, "tokens": 0}

    # -- the daemon -------------------------------------------------------------------------------
    def _daemon(self, method: str, path: str, body: dict | None = None) -> dict | None:
        address = read_address(self.run_dir)
        if not address:
            return None
        try:
            resp = self._http.request(
                method,
                address["url"] + path,
                json=body,
                timeout=5,
                headers={"Authorization": f"Bearer {read_secret(self.run_dir)}", "X-Pearl-Run": self.run_id},
            )
            return resp.json() if resp.status_code < 400 else None
        except (httpx.HTTPError, OSError, ValueError):
            return None

    def workers(self, *, force: bool = False) -> list[dict]:
        with self._lock:
            if force or time.monotonic() - self._refreshed > self.refresh_s:
                answer = self._daemon("GET", "/v1/workers")
                if answer is not None:
                    self._workers = answer["workers"]
                    self._refreshed = time.monotonic()
            return list(self._workers)

    def report_progress(self, step: int | None = None, work: dict | None = None) -> None:
        """Send the counts, and ``work`` — the remaining batch as the planner's Work fields (turns left,
        tokens per turn, tool latency…) — when the driver knows it: cost-aware policies predict with it."""
        with self._lock:
            body = dict(self.counts, step=step)
        if work is not None:
            body["work"] = work
        self._daemon("POST", "/v1/rollout/progress", body)

    def count(self, key: str, delta: int = 1) -> None:
        with self._lock:
            self.counts[key] += delta

    # -- requests ---------------------------------------------------------------------------------
    def _pick(self, session: str) -> dict:
        deadline = time.monotonic() + self.wait_for_workers_s
        while True:
            live = self.workers()
            by_url = {w["url"]: w for w in live}
            url = self._sessions.get(session)
            if url in by_url:
                return by_url[url]
            if live:
                w = live[next(self._rr) % len(live)]
                self._sessions[session] = w["url"]
                return w
            if time.monotonic() > deadline:
                raise NoWorkers(f"no routable rollout worker for {self.wait_for_workers_s:g}s")
            time.sleep(0.5)
            self.workers(force=True)

    def _model(self, url: str) -> str:
        if url not in self._models:
            self._models[url] = self._http.get(url + "/v1/models").json()["data"][0]["id"]
        return self._models[url]

    def complete(
        self,
        session: str,
        prompt: str,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        stop: list[str] | None = None,
        attempts: int = 4,
    ) -> Completion:
        """One turn of an episode; re-sent to another worker if its worker fails or leaves."""
        last: Exception | None = None
        for attempt in range(attempts):
            w = self._pick(session)
            self.count("generating")
            try:
                resp = self._http.post(
                    w["url"] + "/v1/completions",
                    json={
                        "model": self._model(w["url"]),
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "temperature": temperature,
                        "stop": stop or [],
                    },
                )
                resp.raise_for_status()
                choice = resp.json()["choices"][0]
                if choice.get("finish_reason") == "abort":  # aborted by a drain: redo the turn elsewhere
                    raise httpx.HTTPError("aborted by a drain")
                tokens = resp.json().get("usage", {}).get("completion_tokens", 0)
                self.count("tokens", tokens)
                return Completion(choice["text"], tokens, w["url"], w.get("weight_version"), attempt)
            except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
                last = exc
                log.warning("turn of %s failed on %s (%s); moving it", session, w["url"], exc)
                self._sessions.pop(session, None)
                self.workers(force=True)
            finally:
                self.count("generating", -1)
        raise NoWorkers(f"turn of {session} failed {attempts} times; last error: {last}")
