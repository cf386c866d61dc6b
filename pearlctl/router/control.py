"""The gateway's control plane, apart from its data plane: the thread that serves it, and where membership work
runs.

Run as a process (pearlctl.router.__main__), the gateway serves ``/health``, ``/pearl/workers`` and
``/pearl/stats`` a second time on a socket of their own, served by `ControlPlane` on its own thread and event
loop, and every membership change (the routers' lists, the PD routers, the workers' ``/health`` checks) runs
on that loop with its own HTTP client (pearlctl.router.control_loop, ``ControlLoop``: the handle the gateway's
parts hand that work to, set to this loop once it serves). A synchronous batch of thousands of turns keeps the
data plane's loop busy for tens of seconds; a membership change or a return's DEREGISTER sent to the control
socket does not wait behind it. The same routes on the public socket hand their work to the control loop too
(one owner of membership state). Members are shared between the two threads behind a lock
(pearlctl.router.members).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from pearlctl.router.app import build_control_app

if TYPE_CHECKING:
    from pearlctl.router.gateway import Gateway

log = logging.getLogger("pearlctl.router.gateway")  # one name for the gateway's lines, whichever module logs them


class ControlPlane:
    """The gateway's control plane on a thread of its own: an event loop that owns membership
    (``gateway.control.loop``) and serves `build_control_app` on ``sock``; ``tasks`` (coroutine functions of a
    stop event) run beside it on that loop. `start` returns once it serves; `stop` stops the server, lets
    ``tasks`` end, closes what the control plane owns (`Gateway.close_control`: PD routers are stopped) and
    joins the thread. A PD router started here is a child of this thread, which lives as long as the gateway
    serves (pearlctl.router.__main__: its death signal follows the thread that forked it)."""

    def __init__(
        self,
        gateway: Gateway,
        sock: socket.socket,
        *,
        tasks: Iterable[Callable[[asyncio.Event], Awaitable[None]]] = (),
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ):
        self.gateway, self.sock, self.tasks = gateway, sock, list(tasks)
        self.loop_factory = loop_factory or asyncio.new_event_loop
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._server: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-control", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._started.wait(timeout) or self.error is not None or self.gateway.control.loop is None:
            raise RuntimeError(f"the gateway's control plane did not start: {self.error or 'no answer'}")

    def stop(self, timeout: float = 30.0) -> None:
        loop, server, stopping = self._loop, self._server, self._stopping
        if loop is not None and server is not None and stopping is not None and not loop.is_closed():

            def ask_to_stop() -> None:
                server.should_exit = True
                stopping.set()

            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(ask_to_stop)
        self._thread.join(timeout)

    def _run(self) -> None:
        loop = self.loop_factory()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # said by start(), or logged once the gateway serves
            self.error = exc
            log.error("the gateway's control plane stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._started.set()
            loop.close()

    async def _main(self) -> None:
        import uvicorn

        self._stopping = asyncio.Event()
        self._server = uvicorn.Server(
            uvicorn.Config(
                build_control_app(self.gateway), log_level="warning", access_log=False, lifespan="off",
                timeout_graceful_shutdown=5,
            )
        )  # fmt: skip
        serving = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if serving.done():
                serving.result()
                raise RuntimeError("the control server exited before it served")
            await asyncio.sleep(0.01)
        self.gateway.control.loop = asyncio.get_running_loop()
        background = [asyncio.create_task(task(self._stopping)) for task in self.tasks]
        self._started.set()
        try:
            await serving
        finally:
            self._stopping.set()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.gateway.close_control()
