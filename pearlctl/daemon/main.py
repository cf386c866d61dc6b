"""The daemon process: take the run's lease, serve the control API, run the control loop.

Invariants (design.md §2):
- one daemon per run: the lease ``run:<run_id>`` is taken or the daemon refuses to start, naming the
  holder; its epoch fences every write and is stamped on every answer;
- the daemon never owns engine processes: stopping or killing it leaves every worker running, and a
  restarted daemon re-attaches through the agents' next heartbeats;
- losing the lease (another daemon took over after ours stalled) stops this daemon at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from pearlctl.backends import Backend, BackendError
from pearlctl.daemon.api import build_app
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor
from pearlctl.runfiles import ensure_secret, write_address
from pearlctl.state.machines import RunState
from pearlctl.state.store import Store, run_lease_name
from pearlctl.state.views import run_document
from pearlctl.watcher import sync_run

log = logging.getLogger("pearlctl.daemon")

RUN_OVER = (RunState.CANCELLED, RunState.ENDED, RunState.FAILED)  # a daemon has nothing left to do


def fault_from_env(spec: str | None):
    """``PEARL_FAULT=POINT:KIND`` or ``POINT:SEQ:KIND`` (e.g. ``after_intent:START``, ``after_done:4:VERIFY``):
    SIGKILL this daemon the first time a step of that kind (at that place in its plan) reaches that
    boundary — for crash tests of the real process. Unset: no fault."""
    if not spec:
        return lambda point, key: None
    point, _, step = spec.partition(":")

    def fault(at: str, key: str) -> None:
        if at == point and key.endswith(":" + step):
            log.warning("PEARL_FAULT %s: SIGKILL at %s of %s", spec, at, key)
            os.kill(os.getpid(), signal.SIGKILL)

    return fault


def process_alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class DaemonRefused(Exception):
    """The daemon cannot start or must stop (lease held elsewhere, or lost)."""


@dataclass
class DaemonSettings:
    host: str = "0.0.0.0"
    port: int = 0
    advertise: str | None = None  # host name agents use; default: this host's name
    heartbeat_s: float = 2.0
    lost_after: float = 2.0  # heartbeat intervals without news before an agent's GPUs are LOST
    lease_ttl_s: float = 6.0
    tick_s: float = 0.5


class Daemon:
    def __init__(self, store: Store, backend: Backend, run_id: str, settings: DaemonSettings | None = None):
        self.store, self.backend, self.run_id = store, backend, run_id
        self.settings = settings or DaemonSettings()
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.stopping = threading.Event()
        self.epoch: int | None = None
        self.url: str | None = None
        self._server: uvicorn.Server | None = None

    def acquire(self) -> int:
        name = run_lease_name(self.run_id)
        epoch = self.store.acquire_lease(name, self.holder, self.settings.lease_ttl_s)
        if epoch is None and self._break_dead_holder(name):
            epoch = self.store.acquire_lease(name, self.holder, self.settings.lease_ttl_s)
        if epoch is None:
            held = self.store.lease(name) or {}
            left = max(0.0, float(held.get("expires_at", 0)) - time.time())
            raise DaemonRefused(
                f"a daemon already runs for run {self.run_id}: {held.get('holder')} (epoch {held.get('epoch')}); "
                f"its lease expires in {left:.1f}s unless renewed. Stop that daemon (SIGTERM to the pid in the "
                "run directory's .pearl/daemon.json) or wait for its lease to expire"
            )
        self.epoch = epoch
        return epoch

    def _break_dead_holder(self, name: str) -> bool:
        """A holder on this host whose process is gone (a crashed daemon) need not be waited out: its lease
        is broken at once, so a restart after a crash takes over in well under the lease's TTL. A holder on
        another host is always waited out — its liveness cannot be seen from here."""
        held = self.store.lease(name)
        if not held:
            return False
        host, _, pid = str(held["holder"]).rpartition(":")
        if host != socket.gethostname() or not pid.isdigit() or process_alive(int(pid)):
            return False
        return self.store.break_lease(name, held["holder"], held["epoch"], f"process {pid} on {host} is gone")

    def start_server(self, controller: Controller, secret: str) -> str:
        app = build_app(controller, secret=secret, status=lambda: run_document(self.store, self.run_id))
        config = uvicorn.Config(
            app, host=self.settings.host, port=self.settings.port, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # signals belong to the main thread's loop
        thread = threading.Thread(target=self._server.run, name="pearl-api", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise DaemonRefused(f"the control API did not start on {self.settings.host}:{self.settings.port}")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        host = self.settings.advertise or (
            self.settings.host if self.settings.host not in ("0.0.0.0", "::") else socket.gethostname()
        )
        return f"http://{host}:{port}"

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or ``stopping`` is set). Workers are never touched on the way out."""
        run = self.store.get_run(self.run_id)
        epoch = self.acquire()
        self.store.journal_event(
            self.run_id, "runs", self.run_id, "daemon started", data={"holder": self.holder}, epoch=epoch
        )
        controller = Controller(
            self.store, self.run_id, epoch, heartbeat_s=self.settings.heartbeat_s, lost_after=self.settings.lost_after
        )
        executor = Executor(self.store, DaemonEffects(self.store, self.run_id, epoch), run_id=self.run_id, epoch=epoch)
        controller.borrowing = borrowing = Borrowing(self.store, executor, self.run_id)
        executor.fault = fault_from_env(os.environ.get("PEARL_FAULT"))
        secret = ensure_secret(run["run_dir"])
        self.url = self.start_server(controller, secret)
        write_address(
            run["run_dir"],
            {
                "url": self.url,
                "pid": os.getpid(),
                "epoch": epoch,
                "holder": self.holder,
                "started_at": time.time(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),  # set when it runs as `pearlctl daemon --slurm`
            },
        )
        log.warning("daemon for %s serving on %s (epoch %s)", self.run_id, self.url, epoch)
        poll_s = float(run["spec"].get("poll_interval_s", 5.0))
        last_poll = 0.0
        try:
            while not self.stopping.is_set():
                if not self.store.renew_lease(
                    run_lease_name(self.run_id), self.holder, epoch, self.settings.lease_ttl_s
                ):
                    raise DaemonRefused(
                        f"lost the lease of run {self.run_id} (epoch {epoch}): another daemon took over"
                    )
                now = time.monotonic()
                if now - last_poll >= poll_s:
                    last_poll = now
                    try:
                        sync_run(self.store, self.backend, self.run_id)
                    except BackendError as exc:  # Slurm hiccups do not stop the daemon
                        log.warning("poll failed: %s", exc)
                if self.store.get_run(self.run_id)["state"] in RUN_OVER:
                    log.warning("run %s is over: the daemon stops", self.run_id)
                    break
                controller.check_agents()
                with controller.lock:
                    borrowing.tick()
                controller.notify()  # desired state may have changed: long-polling agents look now
                controller.wake.wait(self.settings.tick_s)  # a report or an ack cuts the wait short
                controller.wake.clear()
        finally:
            if self._server is not None:
                self._server.should_exit = True
            self.store.journal_event(
                self.run_id, "runs", self.run_id, "daemon stopped", data={"holder": self.holder}, epoch=epoch
            )
            self.store.release_lease(run_lease_name(self.run_id), self.holder)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
