"""The agent's side of the control API: register, heartbeat, and finding the daemon again.

The daemon may be down or restarted on another port at any time. The client re-reads the run's
``.pearl/daemon.json`` whenever a request fails, re-registers when the daemon no longer knows it, and
never raises for an unreachable daemon: the agent's workers keep running meanwhile (design.md §2).
Answers stamped with an epoch older than one already seen come from a deposed daemon and are ignored.
"""

from __future__ import annotations

import logging

import httpx

from pearlctl.agent.identity import Identity
from pearlctl.runfiles import read_address, read_secret

log = logging.getLogger("pearlctl.agent")


class DaemonClient:
    def __init__(self, me: Identity, run_dir: str, *, timeout: float = 5.0):
        self.me, self.run_dir, self.timeout = me, run_dir, timeout
        self.url: str | None = None
        self.allocation_id: int | None = None
        self.epoch_seen = 0
        self.desired_hash: str | None = None
        # the read timeout covers a long poll (held up to one heartbeat interval) with room to spare
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, read=timeout + 30.0), transport=httpx.HTTPTransport(retries=2)
        )

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {read_secret(self.run_dir)}", "X-Pearl-Run": self.me.run_id}

    def _post(self, path: str, body: dict) -> dict | None:
        """POST to the daemon; None when it cannot be reached (the caller carries on)."""
        for attempt in range(2):
            if self.url is None or attempt == 1:
                address = read_address(self.run_dir)
                if not address:
                    return None
                self.url = address["url"]
            try:
                resp = self._http.post(self.url + path, json=body, headers=self._headers())
            except (httpx.HTTPError, OSError) as exc:
                log.debug("daemon unreachable at %s: %s", self.url, exc)
                continue
            if resp.status_code == 404 and path != "/v1/agents/register":
                self.allocation_id = None  # the daemon does not know us (new state?): register again
                return None
            if resp.status_code >= 400:
                log.warning("daemon refused %s: %s %s", path, resp.status_code, resp.text[:200])
                return None
            answer = resp.json()
            epoch = int(answer.get("epoch", 0))
            if epoch < self.epoch_seen:
                log.warning("ignoring an answer from epoch %s (seen %s): a deposed daemon", epoch, self.epoch_seen)
                return None
            self.epoch_seen = epoch
            return answer
        return None

    def register(self) -> dict | None:
        answer = self._post(
            "/v1/agents/register",
            {
                "job_id": self.me.job_id,
                "task_id": self.me.task_id,
                "pool": self.me.pool,
                "node": self.me.node,
                "gpus": list(self.me.gpus),
                "restarts": self.me.restarts,
                "pid": self._pid(),
            },
        )
        if answer is not None:
            self.allocation_id = int(answer["allocation_id"])
        return answer

    def heartbeat(self, workers: list[dict], *, leaving: bool = False, wait_s: float = 0.0) -> dict | None:
        """Report ``workers``; ``leaving`` tells the daemon this agent's GPUs are going away now."""
        if self.allocation_id is None and self.register() is None:
            return None
        body = {"allocation_id": self.allocation_id, "workers": workers, "epoch_seen": self.epoch_seen}
        if leaving:
            body["leaving"] = True
        elif self.desired_hash is not None and wait_s > 0:
            body.update(desired_hash=self.desired_hash, wait_s=wait_s)  # long poll: held until it changes
        answer = self._post("/v1/agents/heartbeat", body)
        if answer is not None:
            self.desired_hash = answer.get("desired_hash")
        return answer

    @staticmethod
    def _pid() -> int:
        import os

        return os.getpid()

    def close(self) -> None:
        self._http.close()
