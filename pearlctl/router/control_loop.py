"""Where a membership call of the gateway runs, and the HTTP client it uses (``ControlLoop``): the handle the
gateway's parts (pearlctl.router.gateway, pearlctl.router.routing, pearlctl.router.admin) hand membership work
to, on the control plane's loop once pearlctl.router.control's ``ControlPlane`` serves it.

Guarantees: a call handed over from another loop runs on the control plane's loop and is awaited there, so
membership state has one owner; with no control plane (the app served on one loop, as in the unit tests) it
runs on the caller's loop with the data plane's client. The control plane's own client is made on its loop
and closed there (``aclose``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx


class ControlLoop:
    """Where a membership call runs and the HTTP client it uses. ``loop``: the control plane's, set by
    `ControlPlane` once it serves; None (the app served in one loop, as in the unit tests): on the caller's
    loop with the data plane's client."""

    def __init__(self, data_http: httpx.AsyncClient):
        self.loop: asyncio.AbstractEventLoop | None = None
        self._data_http = data_http
        self._client: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        """The client of a membership call: the control plane's own on its loop, else the data plane's."""
        if self.loop is None or asyncio.get_running_loop() is not self.loop:
            return self._data_http
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0))
        return self._client

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` on the control plane's loop (from the data plane's: handed over and
        awaited); on this loop when there is no control plane or this is it."""
        loop = self.loop
        if loop is None or asyncio.get_running_loop() is loop:
            return await fn(*args, **kwargs)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), loop))

    async def aclose(self) -> None:
        """Close the control plane's own client (on its loop)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
