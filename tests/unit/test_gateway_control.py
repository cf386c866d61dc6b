"""The gateway's control plane (pearlctl.router.control.ControlPlane) on its own thread and event loop: a
membership change sent to its socket is made, and answered, while the data plane's loop cannot run at all.

Real sockets and real servers on loopback: the gateway's public app (uvicorn) in the test's own event loop,
the control plane as the gateway process starts it, and one stand-in at the upstream seam that plays
vllm-router (``/add_worker``, ``/remove_worker``, ``/workers``) and a worker (``/health``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pearlctl.router.app import build_app
from pearlctl.router.control import ControlPlane
from pearlctl.router.gateway import Gateway, GatewayConfig

KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def _url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


class StandIn:
    """vllm-router and a worker in one server on its own thread: what it was asked to add and remove."""

    def __init__(self) -> None:
        self.routed: list[str] = []
        self.calls: list[str] = []

        async def add(request: Request) -> JSONResponse:
            url = request.query_params["url"]
            self.calls.append(f"add {url}")
            if url not in self.routed:
                self.routed.append(url)
            return JSONResponse({})

        async def remove(request: Request) -> JSONResponse:
            url = request.query_params["url"]
            self.calls.append(f"remove {url}")
            if url in self.routed:
                self.routed.remove(url)
            return JSONResponse({})

        async def workers(request: Request) -> JSONResponse:
            return JSONResponse({"workers": [{"url": u, "is_healthy": True} for u in self.routed]})

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({})

        app = Starlette(
            routes=[
                Route("/add_worker", add, methods=["POST"]),
                Route("/remove_worker", remove, methods=["POST"]),
                Route("/workers", workers),
                Route("/health", health),
            ]
        )
        self.sock = _listening()
        self.url = _url(self.sock)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_membership_is_changed_and_answered_while_the_data_planes_loop_is_blocked() -> None:
    stand_in = StandIn()
    worker = stand_in.url  # the stand-in answers the worker's /health too
    gateway = Gateway(GatewayConfig(key=KEY, router_url=stand_in.url))
    control_sock, public_sock = _listening(), _listening()
    control = ControlPlane(gateway, control_sock)
    control.start()
    answered: dict = {}
    got_answer = threading.Event()

    def add_through_the_control_socket() -> None:
        t0 = time.monotonic()
        resp = httpx.post(
            _url(control_sock) + "/pearl/workers", json={"url": worker, "weight_version": "7"}, headers=AUTH, timeout=30
        )
        answered.update(status=resp.status_code, doc=resp.json(), took=time.monotonic() - t0)
        got_answer.set()

    async def data_plane() -> tuple[int, dict]:
        server = uvicorn.Server(uvicorn.Config(build_app(gateway), log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[public_sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        caller = threading.Thread(target=add_through_the_control_socket)
        caller.start()
        # The data plane's loop runs nothing (a flood of turns, in the small) until the answer has come, or for
        # 60 s: an answer that needed this loop could only come after it (no wall-clock bound to miss when the
        # machine is busy).
        got_answer.wait(60)
        blocked_for = dict(answered)
        caller.join(30)
        # the public socket's routes hand their work to the control plane and see the same members
        async with httpx.AsyncClient(base_url=_url(public_sock), headers=AUTH) as client:
            listed = (await client.get("/pearl/workers")).json()
            removed = await client.request("DELETE", "/pearl/workers", params={"url": worker})
        server.should_exit = True
        await serving
        return blocked_for, listed, removed.status_code

    try:
        blocked_for, listed, removed = asyncio.run(data_plane())
    finally:
        control.stop()
        stand_in.stop()
    # answered while the data plane's loop was still blocked, and the router was told
    assert blocked_for.get("status") == 200, (blocked_for, answered)
    assert blocked_for["doc"]["added"] is True, blocked_for
    assert f"add {worker}" in stand_in.calls
    assert [w["url"] for w in listed["workers"]] == [worker] and listed["workers"][0]["weight_version"] == "7"
    assert removed == 200 and stand_in.routed == [] and f"remove {worker}" in stand_in.calls
    assert not control._thread.is_alive()  # stop() ended the control plane's thread


def test_a_control_plane_whose_socket_cannot_serve_says_so_at_start() -> None:
    gateway = Gateway(GatewayConfig(key=KEY, router_url="http://127.0.0.1:9"))
    closed = _listening()
    closed.close()
    control = ControlPlane(gateway, closed)
    try:
        control.start(timeout=10)
    except RuntimeError as exc:
        assert "control plane did not start" in str(exc)
    else:
        raise AssertionError("a control plane on a closed socket started")
    finally:
        control.stop()
