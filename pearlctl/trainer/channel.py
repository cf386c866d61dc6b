"""The trainer hook's channel to the run's daemon over the control API.

``DaemonChannel`` implements :class:`pearlctl.trainer.ControlChannel`: ``report`` posts the event to
``/v1/trainer/phase`` and returns the command the daemon's current transition step asks for;
``ack`` posts to ``/v1/trainer/ack``. A daemon that cannot be reached means "no command": training
never stops because the control plane is down. The daemon's address and the run's token are read
from the run directory (``.pearl/``), re-read after a failure (a restarted daemon moves).
"""

from __future__ import annotations

import logging
import os

import httpx

from pearlctl.runfiles import read_address, read_secret

log = logging.getLogger("pearlctl.trainer")


class DaemonChannel:
    def __init__(
        self,
        run_dir: str | None = None,
        run_id: str | None = None,
        *,
        weights_dir: str | os.PathLike | None = None,
        timeout: float = 5.0,
    ):
        """``weights_dir``: where the hook's ``export_weights`` writes (``<weights_dir>/<version>/``); with
        it, every report tells the daemon the path of the version to sync to the rollout workers."""
        self.weights_dir = weights_dir
        self.run_dir = run_dir or os.environ["PEARL_RUN_DIR"]
        self.run_id = run_id or os.environ["PEARL_RUN_ID"]
        self._http = httpx.Client(timeout=timeout)
        self._url: str | None = None

    def _post(self, path: str, body: dict) -> dict | None:
        for fresh in (False, True):
            if self._url is None or fresh:
                address = read_address(self.run_dir)
                if not address:
                    return None
                self._url = address["url"]
            try:
                resp = self._http.post(
                    self._url + path,
                    json=body,
                    headers={"Authorization": f"Bearer {read_secret(self.run_dir)}", "X-Pearl-Run": self.run_id},
                )
            except (httpx.HTTPError, OSError) as exc:
                log.debug("daemon unreachable: %s", exc)
                continue
            if resp.status_code >= 400:
                log.warning("daemon refused %s: %s %s", path, resp.status_code, resp.text[:200])
                return None
            return resp.json()
        return None

    def report(self, event: dict) -> dict | None:
        if self.weights_dir is not None and event.get("weight_version") is not None:
            event = dict(event, weights_path=os.path.join(os.fspath(self.weights_dir), str(event["weight_version"])))
        answer = self._post("/v1/trainer/phase", event)
        if not answer or answer.get("command") is None:
            return None
        return {k: answer[k] for k in ("command", "command_id", "mode") if answer.get(k) is not None}

    def ack(self, command_id: str, result: dict) -> None:
        self._post("/v1/trainer/ack", {"command_id": command_id, "result": result})
