"""``python -m pearlctl.router``: the run's router process — vllm-router bound to 127.0.0.1 as a child, and
the gateway (pearlctl.router.gateway) on the public host and port in front of it.

    python -m pearlctl.router --run-dir DIR --host H --port P --key-file F [--policy consistent_hash]
        [--retry-for-s S] [--request-timeout-s S] [--worker URL[=VERSION][@ROLE] ...] [--detach]

The daemon starts it through pearlctl.router.service.start, which adds ``--detach``; run by hand it stays
in the foreground. Guarantees:

- **Errors before anything runs.** An unreadable or empty key file, or a port already taken, exits 2 with
  a one-line message naming it, before anything is forked or started.
- **Detached.** With ``--detach`` the process forks once, the launcher exits 0 at once, and the gateway
  continues in a new session (its own process group), re-parented to init: whoever started it (the
  daemon) can crash or be killed without taking the data plane down.
- **vllm-router never outlives the gateway.** It runs as the gateway's child, in its process group, with
  ``PR_SET_PDEATHSIG(SIGKILL)`` set between fork and exec (Linux; set from the main thread, which lives as
  long as the gateway). If vllm-router exits on its own, the gateway starts it again on the same port
  (back-off from 0.5 s to 10 s) and puts every member back into it (its membership lives in memory).
- **Prefill-decode.** While the members include at least one PREFILL and one DECODE worker, a second
  vllm-router runs as the gateway's child in PD mode (``--vllm-pd-disaggregation`` with static
  ``--prefill``/``--decode`` lists, the same death signal, set from the control plane's thread, which also
  lives as long as the gateway serves), started by `PdRouterChild.launch` on a fresh
  loopback port for each new set of lists: 0.1.17 refuses ``/add_worker`` in PD mode, so a change of the
  pairs starts a new one, which takes the new requests once ready while the one it replaces finishes what
  runs through it (pearlctl.router.routing: make before break). One that exits is replaced within a second.
- **A control plane of its own.** ``/health``, ``/pearl/workers`` and ``/pearl/stats`` are served a second
  time on a socket of their own (same host, a free port), on the control plane's thread and event loop
  (pearlctl.router.control.ControlPlane), where membership changes run: a batch of thousands of turns on
  the public socket does not delay them. The daemon's router keeper uses it.
- **The record.** Once both answer, the gateway writes ``RUN_DIR/.pearl/router.json``
  (pearlctl.router.service.RouterRecord: pid, start ticks, base URL, router URL, control URL) atomically,
  and removes it on the way out (SIGTERM/SIGINT: the gateway stops serving, then the control plane and its
  PD routers, then vllm-router).

vllm-router's flags, and why (facts in the shared router-facts notes, checked against 0.1.17):
``--policy consistent_hash`` keeps a session (``X-Session-ID``) on one worker; removing a worker moves only
its sessions (the PD router uses ``round_robin``: in PD mode 0.1.17 hands its policies the body only, never
the headers, so there is no session to keep). ``--worker-startup-check-interval 1`` (default 30 s delays
every ``/add_worker``, and a PD router's start); a PD router waits at most `PD_READY_S` for its workers.
``--health-check-interval-secs 1``: a dead worker leaves routing after about 3 failed checks, not 3 minutes.
``--request-timeout-secs`` above the gateway's own per-attempt bound. ``--disable-retries``: with
``consistent_hash`` the router's retries go back to the same dead worker (measured: 5 retries in 0.42 s,
all to the killed worker, then HTTP 500), they re-run a request whole on any worker, and streams are never
retried; the gateway retries instead, with its own time bound, continuing from the tokens already
generated and counting every attempt in the answer. ``--api-key`` is NOT used: in 0.1.17 it is only sent
to workers for intra-node data-parallel routing and does not protect the router's own endpoints (measured:
``/v1/completions`` and ``/add_worker`` answered 200 without it), so vllm-router listens on 127.0.0.1 only
and the gateway is the one door. Its Prometheus exporter gets a free loopback port (the default, 29000,
would collide between runs on one host). It logs warnings only (``RouterChild.environment``): its own
``--log-level`` leaves a line per routed request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pearlctl.host.processes import die_with_parent, proc_start_ticks
from pearlctl.router import service
from pearlctl.router.membership import ROLES, ValidationError, WorkerIn, WorkerSet, describe
from pearlctl.vocabulary import Role

if TYPE_CHECKING:
    import uvicorn

    from pearlctl.router.gateway import Gateway
    from pearlctl.router.routing import PdLists

log = logging.getLogger("pearlctl.router")

ROUTER_READY_S = 30.0
RESTART_BACKOFF_S = (0.5, 10.0)
PD_READY_S = 20.0  # a PD router's start: its workers answered /health just before, so seconds at most
PD_CHECK_S = 0.5


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pearlctl.router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path, help="the run directory (router.json goes to .pearl/)")
    ap.add_argument("--host", default="0.0.0.0", help="where the gateway listens (default: every interface)")
    ap.add_argument("--port", type=int, default=0, help="the gateway's port (0: any free one; the record says)")
    ap.add_argument("--key-file", type=Path, help="the router key (default: RUN_DIR/.pearl/router.key)")
    ap.add_argument("--advertise-host", help="the host name clients use (default: --host, or this host's name)")
    ap.add_argument(
        "--policy",
        default="consistent_hash",
        choices=("consistent_hash", "sticky_least_loaded", "round_robin", "random", "power_of_two", "cache_aware"),
        help="vllm-router's policy (consistent_hash: X-Session-ID keeps an episode on one worker)",
    )
    ap.add_argument("--retry-for-s", type=float, default=service.DEFAULT_RETRY_FOR_S)
    ap.add_argument("--request-timeout-s", type=float, default=service.DEFAULT_REQUEST_TIMEOUT_S)
    ap.add_argument("--health-check-interval-s", type=float, default=1.0)
    ap.add_argument(
        "--worker",
        action="append",
        default=[],
        help="an initial member: URL[=WEIGHT_VERSION][@ROLE], ROLE one of ROLLOUT (default), PREFILL, DECODE",
    )
    ap.add_argument("--launch-id", help="names the start call that made this process (in the record)")
    ap.add_argument("--log", help="the log file this process writes to (recorded only)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--detach", action="store_true", help="fork into a new session and return at once")
    return ap.parse_args(argv)


# Connections waiting to be accepted: a synchronous batch opens thousands at once (each episode's first turn), and
# a connection the full queue drops waits for the client's SYN to be sent again (1, 3, 7, 15 s...). The kernel
# caps it at net.core.somaxconn (4096 on current Linux).
LISTEN_BACKLOG = 65535
# How long an idle caller's connection stays open: longer than `RolloutClient` keeps one (pearlctl.router.client
# KEEPALIVE_S), so the client, not the gateway, ends it and never sends on a connection being closed.
KEEP_ALIVE_S = 75


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: without it a response's head and body, written apart, meet Nagle's
    # algorithm and the client's delayed ACK, 40 ms per request (measured; uvicorn sets it only on sockets
    # it binds itself)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def parse_worker(spec: str) -> WorkerIn:
    """``URL[=WEIGHT_VERSION][@ROLE]`` (``--worker``) as the admin API's body; raises ValidationError naming
    the field, or ValueError for an unknown role."""
    rest, at, role = spec.rpartition("@")
    if not at:
        rest, role = spec, Role.ROLLOUT
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {', '.join(ROLES)}")
    url, _, version = rest.partition("=")
    return WorkerIn(url=url, weight_version=version or None, role=role, wait_s=5.0)


class RouterChild:
    """vllm-router as the gateway's child on a loopback port: the regular one for the gateway's whole life,
    or (``pd``) one in PD mode for fixed prefill and decode lists."""

    def __init__(self, args: argparse.Namespace, pd: PdLists | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.pd = pd
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        a = self.args
        if self.pd is None:
            mode = ["--policy", a.policy, "--worker-startup-timeout-secs", "60"]
        else:
            mode = ["--vllm-pd-disaggregation", "--policy", "round_robin"]
            for url in self.pd.prefill:
                mode += ["--prefill", url]
            for url in self.pd.decode:
                mode += ["--decode", url]
            mode += ["--worker-startup-timeout-secs", str(int(PD_READY_S))]
        return [
            sys.executable,
            "-m",
            "vllm_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *mode,
            "--worker-startup-check-interval",
            "1",
            "--health-check-interval-secs",
            str(max(1, round(a.health_check_interval_s))),
            "--request-timeout-secs",
            str(int(a.request_timeout_s) + 60),
            "--disable-retries",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(_free_port()),
            "--log-level",
            "warning",
        ]

    @staticmethod
    def environment() -> dict[str, str]:
        """vllm-router's environment: ours, with ``RUST_LOG=warn`` unless it is set. vllm-router 0.1.17 logs three
        INFO lines for every request it routes whatever ``--log-level`` says (measured: ``--log-level warning``
        left them, ``RUST_LOG=warn`` stops them), and the run's router log must not grow with the requests."""
        return {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG") or "warn"}

    def start(self) -> None:
        argv = self.command()
        log.info("starting vllm-router%s: %s", " (PD)" if self.pd else "", " ".join(argv))
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            preexec_fn=die_with_parent(signal.SIGKILL),
            close_fds=True,
        )
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=1.0) as http:
            while True:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    raise RuntimeError(f"vllm-router exited with code {code} before answering {self.url}/liveness")
                try:
                    if (await http.get(self.url + "/liveness")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"vllm-router did not answer {self.url}/liveness within {timeout:.0f} s")
                await asyncio.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PdRouterChild:
    """A `RouterChild` started on the control plane as the gateway sees it: in PD mode a PD router
    (pearlctl.router.routing.PdRouter), without ``lists`` the judge router (pearlctl.router.routing.JudgeRouter)."""

    def __init__(self, child: RouterChild, lists: PdLists | None):
        self.child, self.url, self.lists = child, child.url, lists

    @classmethod
    async def launch(cls, args: argparse.Namespace, lists: PdLists | None) -> PdRouterChild:
        """Start one and return it once it answers ``/liveness`` (in PD mode 0.1.17 answers only after every
        listed worker's ``/health``); RuntimeError, with nothing left running, otherwise. Runs on the
        control plane's thread (pearlctl.router.control.ControlPlane), which lives as long as the gateway
        serves: the child's death signal follows the thread that forked it."""
        child = RouterChild(args, pd=lists)
        child.start()
        try:
            await child.wait_ready(PD_READY_S if lists is not None else ROUTER_READY_S)
        except RuntimeError:
            await asyncio.to_thread(child.stop)
            raise
        return cls(child, lists)

    def alive(self) -> bool:
        return self.child.alive()

    async def stop(self) -> None:
        await asyncio.to_thread(self.child.stop)


async def _watch_pd(gateway, stopping: asyncio.Event) -> None:
    """Let the gateway replace a PD router that exited, or retry one that could not start."""
    while not stopping.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=PD_CHECK_S)
        if stopping.is_set():
            return
        try:
            await gateway.routers.check_pd()
        except Exception as exc:  # never fatal: tried again on the next tick
            log.error("checking the PD router failed: %s", exc)


async def _watch_router(
    router: RouterChild, gateway, stopping: asyncio.Event, restarted: Callable[[], None] = lambda: None
) -> None:
    """Start vllm-router again whenever it exits while the gateway serves, re-register the members, and
    call ``restarted`` (the record names the new vllm-router's pid)."""
    backoff = RESTART_BACKOFF_S[0]
    while not stopping.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=0.5)
        if stopping.is_set() or router.alive():
            continue
        code = router.proc.returncode if router.proc else None
        log.error("vllm-router exited (code %s): starting it again in %.1f s", code, backoff)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
        try:
            router.start()
            await router.wait_ready(ROUTER_READY_S)
        except (OSError, RuntimeError) as exc:
            log.error("vllm-router restart failed: %s", exc)
            continue
        failed = await gateway.routers.reregister()
        log.warning("vllm-router restarted; members re-registered%s", f" except {failed}" if failed else "")
        restarted()
        backoff = RESTART_BACKOFF_S[0]


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:  # uvicorn's choice too when it runs the loop itself; optional
        import uvloop

        return uvloop.new_event_loop
    except ImportError:
        return None


def _gateway(args: argparse.Namespace, key: str, router: RouterChild) -> Gateway:
    """The gateway in front of ``router``, starting PD routers as this process's children."""
    from pearlctl.router.gateway import Gateway, GatewayConfig

    config = GatewayConfig(
        key=key, router_url=router.url, retry_for_s=args.retry_for_s, request_timeout_s=args.request_timeout_s
    )
    return Gateway(
        config,
        pd_launcher=lambda lists: PdRouterChild.launch(args, lists),
        judge_launcher=lambda: PdRouterChild.launch(args, None),
    )


def _public_server(gateway: Gateway) -> uvicorn.Server:
    """The server of the gateway's public socket (the OpenAI routes and the control routes)."""
    import uvicorn

    from pearlctl.router.app import build_app

    return uvicorn.Server(
        uvicorn.Config(
            build_app(gateway),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            backlog=LISTEN_BACKLOG,  # uvicorn listens again on the socket it is given, with its own (2048)
            timeout_graceful_shutdown=5,
        )
    )


def _record(
    args: argparse.Namespace, router: RouterChild, sock: socket.socket, control_sock: socket.socket, advertise: str
) -> service.RouterRecord:
    """Write the record of this gateway (``RUN_DIR/.pearl/router.json``) and return it."""
    pid = os.getpid()
    port = sock.getsockname()[1]
    root = f"http://{advertise}:{port}"
    control_url = f"http://{advertise}:{control_sock.getsockname()[1]}"
    record = service.RouterRecord(
        pid=pid,
        start_ticks=proc_start_ticks(pid) or 0,
        url=root,
        base_url=root + "/v1",
        router_url=router.url,
        host=args.host,
        port=port,
        started_at=time.time(),
        router_pid=router.proc.pid if router.proc else None,
        launch_id=args.launch_id,
        log=args.log,
        control_url=control_url,
    )
    service.write_record(args.run_dir, record)
    log.info(
        "gateway on %s, control on %s (vllm-router %s); record %s",
        root,
        control_url,
        router.url,
        service.record_path(args.run_dir),
    )
    return record


async def _serve(
    args: argparse.Namespace, key: str, sock: socket.socket, control_sock: socket.socket, advertise: str
) -> int:
    from pearlctl.router.control import ControlPlane

    router = RouterChild(args)
    router.start()
    try:
        await router.wait_ready(ROUTER_READY_S)  # a SIGTERM meanwhile stops it (default action)
    except RuntimeError as exc:
        log.error("%s", exc)
        router.stop()
        return 3
    gateway = _gateway(args, key, router)
    # membership, health and the PD routers on their own thread and loop (pearlctl.router.control)
    control = ControlPlane(
        gateway, control_sock, tasks=[lambda stop: _watch_pd(gateway, stop)], loop_factory=_loop_factory()
    )
    try:
        await asyncio.to_thread(control.start)
    except RuntimeError as exc:
        log.error("%s", exc)
        router.stop()
        return 3
    server = _public_server(gateway)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: int, frame: object) -> None:
        server.should_exit = True
        loop.call_soon_threadsafe(stopping.set)  # the watchdog must not start vllm-router again now

    # uvicorn restores the handlers it found and raises the signal again once it has stopped: these make
    # that second delivery a no-op, so the cleanup below (vllm-router, the record) always runs
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    written: list[service.RouterRecord] = []

    def restarted() -> None:
        if written and router.proc is not None:
            written.append(dataclasses.replace(written[-1], router_pid=router.proc.pid))
            service.write_record(args.run_dir, written[-1])

    watchdog = asyncio.create_task(_watch_router(router, gateway, stopping, restarted))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                return 3
            await asyncio.sleep(0.02)
        if args.worker:
            initial = WorkerSet(workers=[parse_worker(spec) for spec in args.worker], wait_s=5.0)
            for url, why in (await gateway.control.run(gateway.admin.sync, initial))["failed"].items():
                log.error("initial worker %s: %s", url, why)
        written.append(_record(args, router, sock, control_sock, advertise))
        await serving
        return 0
    finally:
        stopping.set()
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        await asyncio.to_thread(control.stop)  # the PD routers stop with it
        router.stop()
        service.remove_record(args.run_dir, os.getpid())
        await gateway.aclose()
        log.info("gateway stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    key_file = args.key_file or service.key_path(args.run_dir)
    try:
        key = service.read_key(path=key_file)
    except (OSError, ValueError) as exc:
        print(f"pearlctl.router: cannot read the router key {key_file}: {exc}", file=sys.stderr)
        return 2
    try:
        mode = key_file.stat().st_mode & 0o077
    except OSError:
        mode = 0
    for spec in args.worker:
        try:
            parse_worker(spec)
        except ValidationError as exc:
            print(f"pearlctl.router: --worker {spec}: {describe(exc)} (want URL[=VERSION][@ROLE])", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"pearlctl.router: --worker {spec}: {exc} (want URL[=VERSION][@ROLE])", file=sys.stderr)
            return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"pearlctl.router: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    try:
        control_sock = _bind(args.host, 0)  # the control plane's: any free port, named in the record
    except OSError as exc:
        print(f"pearlctl.router: cannot listen on {args.host} for the control plane: {exc}", file=sys.stderr)
        return 2
    if args.detach:
        if os.fork() > 0:
            os._exit(0)  # the launcher: its caller reaps it at once
        os.setsid()  # the gateway: its own session and process group, re-parented to init
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if mode:
        log.warning("the router key %s is readable by others (mode %o): it should be 0600", key_file, mode)
    advertise = args.advertise_host or (args.host if args.host not in ("0.0.0.0", "::", "") else socket.gethostname())
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_serve(args, key, sock, control_sock, advertise))


if __name__ == "__main__":
    sys.exit(main())
