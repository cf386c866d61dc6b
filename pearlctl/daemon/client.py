"""How the CLI reaches a run's daemon: its address and token from the run directory, one request each."""

from __future__ import annotations

import httpx

from pearlctl.runfiles import read_address, read_secret


class DaemonUnavailable(Exception):
    """The run has no reachable daemon (never started, stopped, or its host is unreachable)."""


class DaemonRefusal(Exception):
    """The daemon answered with an error; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def call(run: dict, method: str, path: str, body: dict | None = None, *, timeout: float = 15.0) -> dict:
    address = read_address(run["run_dir"])
    if not address:
        raise DaemonUnavailable(
            f"run {run['id']} has no daemon address; start one with `pearlctl daemon {run['name']}`"
        )
    try:
        resp = httpx.request(
            method,
            address["url"] + path,
            json=body,
            timeout=timeout,
            headers={"Authorization": f"Bearer {read_secret(run['run_dir'])}", "X-Pearl-Run": run["id"]},
        )
    except (httpx.HTTPError, OSError) as exc:
        raise DaemonUnavailable(
            f"the daemon of run {run['id']} at {address['url']} does not answer ({exc}); "
            f"start it with `pearlctl daemon {run['name']}`"
        ) from None
    if resp.status_code >= 400:
        try:
            message = resp.json().get("error", resp.text)
        except ValueError:
            message = resp.text
        raise DaemonRefusal(message, resp.status_code)
    return resp.json()
