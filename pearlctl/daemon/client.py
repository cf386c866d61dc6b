"""How the CLI reaches a run's daemon: one request, through the shared control-API client."""

from __future__ import annotations

from pearlctl.api.client import ControlClient, DaemonRefusal, DaemonUnavailable

__all__ = ["DaemonRefusal", "DaemonUnavailable", "call"]


def call(run: dict, method: str, path: str, body: dict | None = None, *, timeout: float = 15.0) -> dict:
    with ControlClient(run["run_dir"], run["id"], timeout=timeout) as client:
        try:
            return client.call(method, path, body)
        except DaemonUnavailable as exc:
            raise DaemonUnavailable(f"{exc}; start it with `pearlctl daemon {run['name']}`") from None
