"""The one client of a run's control API: used by the CLI, the agents, the trainer hook and rollout clients.

- **Finding the daemon.** Its address is ``.pearl/daemon.json`` in the run directory (pearlctl.host.runfiles);
  a failed connection re-reads it once, so a daemon restarted on another port is found again.
- **Credentials.** Requests carry the run's token, or, once an agent is bound to its allocation
  (``bind``), that allocation's own credential, which the daemon accepts for that allocation only.
- **Fencing.** Every answer carries the daemon's lease epoch. An answer from an older epoch than one
  already seen comes from a deposed daemon: it is refused (``DaemonUnavailable``), never acted on.
- **Errors are values a caller can branch on.** ``DaemonUnavailable`` (nobody answered, or a deposed
  daemon did) and ``DaemonRefusal`` (the daemon answered 4xx/5xx, with its message and status);
  ``try_call`` turns the first into ``None`` for callers that carry on without a daemon.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import httpx

from pearlctl.host.runfiles import read_address, read_secret

log = logging.getLogger("pearlctl.api")

RUN_HEADER = "X-Pearl-Run"
ALLOCATION_HEADER = "X-Pearl-Allocation"


class DaemonUnavailable(Exception):
    """The run has no reachable daemon (never started, stopped, unreachable, or deposed)."""


class DaemonRefusal(Exception):
    """The daemon answered with an error; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ControlClient:
    """``run_dir``: the run directory (shared filesystem); ``run_id``: the run's id.

    ``timeout`` bounds connecting and each request; ``read_timeout`` (default: ``timeout``) bounds waiting
    for an answer, longer for agents that long-poll. Thread-safe."""

    def __init__(
        self, run_dir: str, run_id: str, *, timeout: float = 5.0, read_timeout: float | None = None, retries: int = 1
    ):
        self.run_dir, self.run_id = str(run_dir), run_id
        self.epoch_seen = 0
        self.allocation_id: int | None = None
        self._credential: str | None = None
        self._url: str | None = None
        self._lock = threading.Lock()
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, read=read_timeout or timeout),
            transport=httpx.HTTPTransport(retries=retries),
        )

    # -- identity ---------------------------------------------------------------------------------
    def bind(self, allocation_id: int, credential: str) -> None:
        """From now on act as this allocation's agent, with the credential its registration returned."""
        self.allocation_id, self._credential = allocation_id, credential

    def unbind(self) -> None:
        self.allocation_id, self._credential = None, None

    def _headers(self, as_run: bool) -> dict[str, str]:
        headers = {RUN_HEADER: self.run_id}
        if self._credential is not None and not as_run:
            headers["Authorization"] = f"Bearer {self._credential}"
            headers[ALLOCATION_HEADER] = str(self.allocation_id)
        else:
            try:
                headers["Authorization"] = f"Bearer {read_secret(self.run_dir)}"
            except OSError as exc:
                raise DaemonUnavailable(f"cannot read the run's token in {self.run_dir}/.pearl: {exc}") from None
        return headers

    def address(self, fresh: bool = False) -> str:
        if self._url is None or fresh:
            address = read_address(self.run_dir)
            if not address or not isinstance(address.get("url"), str):
                raise DaemonUnavailable(f"run {self.run_id} has no daemon address in {self.run_dir}/.pearl")
            self._url = address["url"]
        return self._url

    # -- calls ------------------------------------------------------------------------------------
    def call(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = None, as_run: bool = False
    ) -> dict:
        """One request; the answer's JSON object. ``body``: a dict or a pydantic model of pearlctl.api.bodies.
        ``as_run``: use the run's token even when bound to an allocation (registration)."""
        payload = body.model_dump(mode="json", exclude_none=True) if hasattr(body, "model_dump") else body
        last: Exception | None = None
        for fresh in (False, True):
            url = self.address(fresh)
            try:
                resp = self._http.request(
                    method,
                    url + path,
                    json=payload,
                    headers=self._headers(as_run),
                    **({"timeout": timeout} if timeout is not None else {}),
                )
            except (httpx.HTTPError, OSError) as exc:
                last = exc
                continue
            return self._answer(resp, path)
        raise DaemonUnavailable(f"the daemon of run {self.run_id} does not answer at {self._url} ({last})")

    def try_call(self, method: str, path: str, body: Any = None, **kw: Any) -> dict | None:
        """``call``, with ``None`` for an unavailable daemon (refusals still raise)."""
        try:
            return self.call(method, path, body, **kw)
        except DaemonUnavailable as exc:
            log.debug("%s", exc)
            return None

    def _answer(self, resp: httpx.Response, path: str) -> dict:
        try:
            doc = resp.json()
        except ValueError:
            doc = None
        if resp.status_code >= 400:
            message = doc.get("error") if isinstance(doc, dict) and doc.get("error") else resp.text[:500]
            raise DaemonRefusal(f"{path}: {message}", resp.status_code)
        if not isinstance(doc, dict):
            raise DaemonRefusal(f"{path}: the daemon answered something that is not a JSON object", resp.status_code)
        epoch = doc.get("epoch")
        if isinstance(epoch, int):
            with self._lock:
                if epoch < self.epoch_seen:
                    raise DaemonUnavailable(
                        f"ignoring an answer from epoch {epoch} (seen {self.epoch_seen}): a deposed daemon"
                    )
                self.epoch_seen = epoch
        return doc

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
