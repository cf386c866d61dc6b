"""The daemon process: take the run's lease, serve the control API, and run three timers.

Invariants:
- one daemon per run: the lease ``run:<run_id>`` is taken or the daemon refuses to start, naming the
  holder; its epoch fences every write (state, journal and the Slurm poller's) and is stamped on every
  answer;
- the daemon never owns engine processes: stopping or killing it leaves every worker running, and a
  restarted daemon re-attaches through the agents' next heartbeats;
- nothing slow sits in the path of a decision. Three threads, each on its own timer:
  * the **lease** renewer (every ``lease_ttl_s / 6``); the TTL is longer than a Slurm command may take,
    and renewing never waits for Slurm or for a decision;
  * the **Slurm poller**: one batched poll per ``poll_interval_s``, run with no lock held (a frozen
    slurmctld blocks only this thread), folded into state under the decision lock;
  * the **control loop**: agent loss, transitions, return deadlines, the policy — every ``tick_s``, or
    at once when a report arrives (the policy only when what it decides from changed, or at least every
    ``borrowing.REDECIDE_S``: pearlctl.daemon.borrowing);
- a tick or a poll that fails is isolated: its error is journaled (once per distinct error) and counted
  in ``/metrics``, and the next one runs. Only a lost lease (``StaleEpoch``: another daemon took over)
  stops the daemon, and then at once.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import uvicorn
from prometheus_client import Histogram

from pearlctl.backends import Backend, BackendError
from pearlctl.daemon.api import build_app
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.elastic import ElasticPool
from pearlctl.daemon.elastic_state import elastic_view
from pearlctl.daemon.metrics import latency_histogram
from pearlctl.daemon.routing import RouterKeeper
from pearlctl.daemon.shared import LOST_AFTER
from pearlctl.daemon.slowlog import SlowLog
from pearlctl.daemon.transitions import Executor
from pearlctl.host.processes import process_alive
from pearlctl.host.runfiles import ensure_secret, write_address
from pearlctl.ops.watcher import apply_poll, poll_run
from pearlctl.router.service import view as router_view
from pearlctl.slurm.client import DEFAULT_TIMEOUT_S
from pearlctl.state.errors import StaleEpoch, StaleWrite
from pearlctl.state.machines import RunState
from pearlctl.state.store import Store, run_lease_name
from pearlctl.state.views import run_document
from pearlctl.vocabulary import HEARTBEAT_S, POLL_INTERVAL_S

log = logging.getLogger("pearlctl.daemon")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
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


class DaemonRefused(Exception):
    """The daemon cannot start or must stop (lease held elsewhere, or lost)."""


# A Slurm command may take this long; the lease outlives it.
SLURM_COMMAND_TIMEOUT_S = DEFAULT_TIMEOUT_S


@dataclass
class DaemonSettings:
    host: str = "0.0.0.0"
    port: int = 0
    advertise: str | None = None  # host name agents use; default: this host's name
    heartbeat_s: float = HEARTBEAT_S
    lost_after: float = LOST_AFTER  # heartbeat intervals without news before an agent's GPUs are LOST
    lease_ttl_s: float = 45.0  # > SLURM_COMMAND_TIMEOUT_S; renewed every lease_ttl_s / 6 on its own thread
    tick_s: float = 0.5
    # this process is the daemon's own (``pearlctl daemon --foreground``): after its first tick, its heap is
    # settled for the collector (``settle_heap``); never in a process that only hosts a daemon (the tests)
    own_process: bool = False


# CPython's cyclic collector, set for a daemon that holds every agent's long poll for a heartbeat interval. A
# held request's objects live that long; with the default middle generation (collected every 10 young
# collections: about every 0.4 s under 512 agents' heartbeats) they were promoted to the old one, and every
# collection of the old generation walks the whole heap with the GIL held: the event loop stood still for
# 110 ms, a few times a minute, at 4,096 GPUs (docs/benchmarks.md, "One daemon, 4,096 GPUs"). Collected every
# 100 young collections, the middle generation holds them until they are freed.
GC_THRESHOLDS = (700, 100, 10)


def settle_heap() -> None:
    """Once the daemon runs (its modules imported, its first tick done): collect, freeze what is alive (the
    modules, the run's configuration: ``gc.freeze``, never walked by a collection again) and set
    ``GC_THRESHOLDS``. For the daemon's own process only: what is frozen and later dropped in a cycle is never
    collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class DaemonStats:
    """What the daemon counts about itself (``/metrics``: pearl_daemon_*)."""

    ticks: int = 0
    tick_errors: int = 0
    polls: int = 0
    poll_errors: int = 0
    lease_renewals: int = 0
    tick_seconds: list[float] = field(default_factory=list)  # the last 256 ticks' durations
    tick_duration: Histogram = field(  # every tick's, over the daemon's life
        default_factory=lambda: latency_histogram("pearl_daemon_tick_duration_seconds", "control-loop tick durations")
    )
    tick_cpu: Histogram = field(  # the CPU time of the control loop's thread in each tick
        default_factory=lambda: latency_histogram("pearl_daemon_tick_cpu_seconds", "control-loop tick thread CPU time")
    )
    commit_duration: Histogram = field(  # every commit of state by this daemon: the disk's latency under load
        default_factory=lambda: latency_histogram("pearl_daemon_commit_duration_seconds", "state commit durations")
    )
    # ticks of 100 ms or more (pearlctl.daemon.slowlog): counted, and logged with their phases
    slow_tick_log: SlowLog = field(default_factory=lambda: SlowLog("ticks"), repr=False)
    last_tick_at: float = 0.0
    last_poll_at: float = 0.0

    @property
    def slow_ticks(self) -> int:
        return self.slow_tick_log.count


class Daemon:
    def __init__(self, store: Store, backend: Backend, run_id: str, settings: DaemonSettings | None = None):
        self.store, self.backend, self.run_id = store, backend, run_id
        self.settings = settings or DaemonSettings()
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.stopping = threading.Event()
        self.epoch: int | None = None
        self.url: str | None = None
        self.deposed: str | None = None  # why this daemon must stop: its lease is gone
        self.stats = DaemonStats()
        store.on_commit = self.stats.commit_duration.observe
        self._server: uvicorn.Server | None = None
        self._errors: dict[str, str] = {}  # last error journaled per source ("tick", "poll"), to journal changes only
        self._stop_recorded = False  # "daemon stopped" journaled and the lease released (once)
        self._stop_lock = threading.Lock()
        # the signal wakeup fd's two ends (install_signal_handlers); the stop thread reads the first
        self._signals: socket.socket | None = None
        self._signal_writer: socket.socket | None = None
        self._signal_at: float | None = None  # when the stop thread read SIGTERM/SIGINT (monotonic)

    def acquire(self) -> int:
        name = run_lease_name(self.run_id)
        epoch = self.store.leases.acquire(name, self.holder, self.settings.lease_ttl_s)
        if epoch is None and self._break_dead_holder(name):
            epoch = self.store.leases.acquire(name, self.holder, self.settings.lease_ttl_s)
        if epoch is None:
            held = self.store.leases.get(name) or {}
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
        held = self.store.leases.get(name)
        if not held:
            return False
        host, _, pid = str(held["holder"]).rpartition(":")
        if host != socket.gethostname() or not pid.isdigit() or process_alive(int(pid)):
            return False
        return self.store.leases.break_held(name, held["holder"], held["epoch"], f"process {pid} on {host} is gone")

    def start_server(self, controller: Controller, secret: str) -> str:
        app = build_app(
            controller,
            secret=secret,
            status=self._status,
            stats=lambda: self.stats,
        )
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

    def _status(self) -> dict:
        """``GET /v1/status``: the run's state, its elastic pool and its router."""
        doc = run_document(self.store, self.run_id)
        elastic = elastic_view(self.store, self.run_id)
        if elastic is not None:
            doc["elastic"] = elastic
        doc["router"] = router_view(doc["run"]["run_dir"])
        return doc

    # -- the three timers -------------------------------------------------------------------------
    def depose(self, why: str) -> None:
        """Another daemon holds the lease now: stop at once (called from any thread). After the stop is
        recorded the lease is released on purpose, and a successor taking it deposes nobody."""
        if self.deposed is None and not self._stop_recorded:
            self.deposed = why
            log.error("deposed: %s", why)
        self.stopping.set()

    def _renew_lease(self) -> None:
        every = min(5.0, max(0.2, self.settings.lease_ttl_s / 6))
        name = run_lease_name(self.run_id)
        while not self.stopping.wait(every):
            try:
                if not self.store.leases.renew(name, self.holder, self.epoch, self.settings.lease_ttl_s):
                    if self.stopping.is_set():  # released on the way out, not taken
                        return
                    self.depose(f"lost the lease of run {self.run_id} (epoch {self.epoch}): another daemon took over")
                    return
                self.stats.lease_renewals += 1
            except Exception as exc:  # a busy or failing disk: the lease is still ours until it expires
                log.warning("lease renewal failed (retrying): %s", exc)

    def _poll_slurm(self, controller: Controller, poll_s: float, elastic: ElasticPool | None = None) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                poll = poll_run(self.store, self.backend, self.run_id)  # no lock held: Slurm may be slow
                for attempt in range(3):
                    try:
                        with controller.lock:  # the same writer discipline as every other write
                            report = apply_poll(self.store, self.run_id, poll, epoch=self.epoch)
                        break
                    except StaleWrite:  # cannot happen under the lock, unless a write bypasses it: re-read
                        if attempt == 2:
                            raise
                if elastic is not None:
                    self._size_elastic(controller, elastic)
                self.stats.polls += 1
                self.stats.last_poll_at = time.time()
                if report.events:
                    controller.wake.set()
                self._recovered("poll")
            except StaleEpoch as exc:
                self.depose(str(exc))
                return
            except Exception as exc:  # a Slurm hiccup (BackendError), or a bug: never fatal
                self.stats.poll_errors += 1
                self._journal_error("poll", exc)
            self.stopping.wait(max(0.0, poll_s - (time.monotonic() - started)))

    @staticmethod
    def _size_elastic(controller: Controller, elastic: ElasticPool) -> None:
        """How many tasks the elastic pool should hold (the policy's what-if plan, decided under the lock);
        then the pool is made to hold them — sbatch and scancel with no lock held."""
        with controller.lock:
            sizing = elastic.sizing()
            if sizing is not None and controller.borrowing is not None:
                wanted, why = controller.borrowing.elastic_wanted(time.time(), **sizing)
                elastic.want(wanted, why)
        if sizing is not None:
            elastic.reconcile()

    def _tick(self, controller: Controller, borrowing: Borrowing) -> bool:
        """One pass of the control loop; False when the run is over. Errors are isolated here."""
        t0, cpu0, commits0 = time.monotonic(), time.thread_time(), self.store.commits_on_this_thread()
        marks: list[tuple[str, float]] = []  # (phase, when it ended): a slow tick's log line says where it went
        try:
            if self.store.runs.get(self.run_id)["state"] in RUN_OVER:
                log.warning("run %s is over: the daemon stops", self.run_id)
                return False
            controller.liveness.check_agents()
            marks.append(("check_agents", time.monotonic()))
            borrowing.tick(controller.lock, mark=lambda phase: marks.append((phase, time.monotonic())))
            self._recovered("tick")
        except StaleEpoch as exc:
            self.depose(str(exc))
        except Exception as exc:  # a bug or a fault we do not know yet: journal it, count it, go on
            self.stats.tick_errors += 1
            self._journal_error("tick", exc)
        finally:
            self.stats.ticks += 1
            self.stats.last_tick_at = controller.loop_at = time.time()
            took = time.monotonic() - t0
            self.stats.tick_seconds = [*self.stats.tick_seconds[-255:], took]
            self.stats.tick_duration.observe(took)
            cpu = time.thread_time() - cpu0
            self.stats.tick_cpu.observe(cpu)
            (n0, s0), (n1, s1) = commits0, self.store.commits_on_this_thread()
            commits = (n1 - n0, s1 - s0)
            self.stats.slow_tick_log.note(took, lambda: self._tick_line(took, cpu, commits, t0, marks))
        controller.desired.notify()  # desired state may have changed: long-polling agents look now
        return True

    @staticmethod
    def _tick_line(
        took: float, cpu: float, commits: tuple[int, float], t0: float, marks: list[tuple[str, float]]
    ) -> str:
        """A slow tick's log line: its phases' wall times, its thread's CPU time and its commits of state (a tick
        slow with little CPU waited: for the decision lock, for SQLite's disk, for a core)."""
        phases, last = [], t0
        for name, at in marks:
            phases.append(f"{name} {1000 * (at - last):.0f} ms")
            last = at
        n, in_commits = commits
        return (
            f"slow tick: {1000 * took:.0f} ms ({', '.join(phases)}; its thread's CPU {1000 * cpu:.0f} ms;"
            f" {n} commits of state, {1000 * in_commits:.0f} ms in them)"
        )

    def _journal_error(self, source: str, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"[:2000]
        log.warning("%s failed: %s", source, text, exc_info=not isinstance(exc, BackendError))
        if self._errors.get(source) == text:
            return  # the same error again: counted, not journaled again
        self._errors[source] = text
        try:
            self.store.journal_event(
                self.run_id, "runs", self.run_id, f"{source} error", data={"error": text}, epoch=self.epoch
            )
        except StaleEpoch as fenced:
            self.depose(str(fenced))
        except Exception as again:  # the journal itself failing (disk full): the log has it
            log.warning("could not journal the %s error: %s", source, again)

    def _recovered(self, source: str) -> None:
        if self._errors.pop(source, None) is not None:
            self.store.journal_event(self.run_id, "runs", self.run_id, f"{source} recovered", epoch=self.epoch)

    # -- the process ------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or ``stopping`` is set). Workers are never touched on the way out.
        Raises ``DaemonRefused`` when the lease is held elsewhere or was lost."""
        run = self.store.runs.get(self.run_id)
        poll_s = float(run["spec"].get("poll_interval_s", POLL_INTERVAL_S))
        if self.settings.lease_ttl_s <= SLURM_COMMAND_TIMEOUT_S:
            log.warning(
                "lease TTL %.0fs is not longer than a Slurm command may take (%.0fs): a stalled daemon is "
                "presumed dead sooner than a slow slurmctld answers",
                self.settings.lease_ttl_s,
                SLURM_COMMAND_TIMEOUT_S,
            )
        epoch = self.acquire()
        # the lease is renewed from now on: nothing below (the API's start, the router's) may outlast its TTL
        renewer = threading.Thread(target=self._renew_lease, name="pearl-lease", daemon=True)
        renewer.start()
        try:
            controller, borrowing, router, threads = self._start(run, epoch, poll_s)
        except BaseException:
            self.stopping.set()  # the renewer stops too
            raise
        for t in threads:
            t.start()
        # the stop is recorded and the lease released as soon as SIGTERM arrives, not when the tick in
        # progress ends: Slurm SIGKILLs a daemon job KillWait seconds after its SIGTERM, and a tick waiting
        # on a slow slurmctld can take longer than that
        threading.Thread(target=self._record_stop_when_told, args=(epoch,), name="pearl-stop", daemon=True).start()
        over = False
        try:
            while not self.stopping.is_set():
                if not self._tick(controller, borrowing):
                    over = True
                    break
                if self.settings.own_process and self.stats.ticks == 1:
                    settle_heap()
                controller.wake.wait(self.settings.tick_s)  # a report or an ack cuts the wait short
                controller.wake.clear()
        finally:
            # recorded before anything else, for the same reason: stopping the router can outlast KillWait
            self._record_stop(epoch, stopping_router=over and router is not None)
            self.stopping.set()
            if router is not None:
                router.wake()  # its loop sees the stop now
            if self._server is not None:
                self._server.should_exit = True
            if over and router is not None:  # the run is over: its data plane goes too (a restart keeps it)
                try:
                    router.stop()  # its "router stopped" event may be refused now that the lease is released
                except Exception as exc:
                    log.warning("router stop: %s", exc)
        if self.deposed is not None:
            raise DaemonRefused(self.deposed)

    def _record_stop_when_told(self, epoch: int) -> None:
        """Wait for SIGTERM/SIGINT (or ``stopping``), then record the stop. The signal is read from the wakeup
        fd that Python's C-level handler writes at once, so the stop is recorded even while the main thread
        is inside a long C call (where the Python-level handler has not run yet)."""
        got = None
        while True:
            if self._signals is not None:
                try:  # once stopping, one last look without waiting: the byte is there before the flag
                    if select.select([self._signals], [], [], 0.0 if self.stopping.is_set() else 0.5)[0]:
                        got = next((b for b in self._signals.recv(64) if b in STOP_SIGNALS), None)
                except OSError:  # the socket closed under us: fall back to the event
                    self._signals = None
            elif not self.stopping.is_set():
                self.stopping.wait(1.0)
            if got is not None or self.stopping.is_set():
                break
        if got is not None:
            self._signal_at = self._signal_at or time.monotonic()
            log.warning("%s received: stopping", signal.Signals(got).name)
        self._record_stop(epoch, stopping_router=False)
        self.stopping.set()

    def _record_stop(self, epoch: int, *, stopping_router: bool) -> None:
        """Journal "daemon stopped" and release the lease, once (from the stop thread or the loop's end), and
        log how long after the signal. A deposed daemon records nothing: the lease and the run are another's."""
        with self._stop_lock:
            if self._stop_recorded or self.deposed is not None:
                return
            self._stop_recorded = True
            try:
                data = {"holder": self.holder, **({"router": "stopping"} if stopping_router else {})}
                self.store.journal_event(self.run_id, "runs", self.run_id, "daemon stopped", data=data, epoch=epoch)
                self.store.leases.release(run_lease_name(self.run_id), self.holder)
            except Exception as exc:
                log.warning("could not record the stop: %s", exc)
                return
            if self._signal_at is not None:
                after = time.monotonic() - self._signal_at
                log.warning("stop recorded and lease released %.3fs after the signal", after)

    def _on_signal(self, signum, frame) -> None:
        self._signal_at = self._signal_at or time.monotonic()  # only an assignment: safe in a signal handler
        self.stopping.set()

    def _start(self, run: dict, epoch: int, poll_s: float):
        """Everything the control loop needs, with the lease already held and renewed: the controller, the
        control API, the router, the executor; the threads to start. The address is written as soon as the API
        serves; the router's gateway (three processes to start, seconds on a loaded head node) is started or
        adopted after it, still before the control loop runs."""
        t0 = time.monotonic()
        self.store.journal_event(
            self.run_id, "runs", self.run_id, "daemon started", data={"holder": self.holder}, epoch=epoch
        )
        controller = Controller(
            self.store,
            self.run_id,
            epoch,
            heartbeat_s=self.settings.heartbeat_s,
            lost_after=self.settings.lost_after,
            secret=ensure_secret(run["run_dir"]),
            on_deposed=self.depose,
        )
        self.url = self.start_server(controller, controller.secret)
        router = self._router(run, controller, epoch)  # not started yet: see below
        effects = DaemonEffects(
            self.store,
            self.run_id,
            epoch,
            router=router.routed if router else None,
            router_may_route=router.may_route if router else None,
            router_wake=router.wake if router else lambda: None,
        )
        executor = Executor(self.store, effects, run_id=self.run_id, epoch=epoch)
        controller.borrowing = borrowing = Borrowing(self.store, executor, self.run_id)
        executor.fault = fault_from_env(os.environ.get("PEARL_FAULT"))
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
        controller.liveness.published()  # agents find it from now: their loss is judged from here
        log.warning(
            "daemon for %s serving on %s (epoch %s), %.1fs after taking the lease",
            self.run_id,
            self.url,
            epoch,
            time.monotonic() - t0,
        )
        if router is not None:
            self._sync_router(router)
        elastic = ElasticPool(
            self.store,
            self.backend,
            self.run_id,
            epoch=epoch,
            lock=controller.lock,
            routed=router.routed if router is not None else None,
            fault=executor.fault,
        )
        threads = [
            threading.Thread(
                target=self._poll_slurm,
                args=(controller, poll_s, elastic if elastic.enabled else None),
                name="pearl-slurm",
                daemon=True,
            ),
        ]
        if router is not None:
            threads.append(
                threading.Thread(
                    target=router.loop,
                    args=(self.stopping, lambda: self._recovered("router"), lambda e: self._journal_error("router", e)),
                    name="pearl-router",
                    daemon=True,
                )
            )
        return controller, borrowing, router, threads

    def _router(self, run: dict, controller: Controller, epoch: int) -> RouterKeeper | None:
        """The run's router keeper (None when the spec turns the router off); its gateway is not touched yet
        (``_sync_router``)."""
        spec = run["spec"].get("router") or {}
        if not spec.get("enabled", True):
            return None

        def journal(event: str, data: dict) -> None:
            with controller.lock:
                self.store.journal_event(self.run_id, "runs", self.run_id, event, data=data, epoch=epoch)

        keeper = RouterKeeper(
            self.store,
            self.run_id,
            run["run_dir"],
            journal=journal,
            on_change=controller.wake.set,  # a REGISTER or DEREGISTER probe may pass now
            host=self.settings.host,
            port=int(spec.get("port", 0)),
            policy=str(spec.get("policy", "consistent_hash")),
            advertise=urlsplit(self.url).hostname if self.url else None,
        )
        return keeper

    def _sync_router(self, keeper: RouterKeeper) -> None:
        """The gateway started or adopted and synced once, before the control loop runs; a failure here is
        journaled and retried by the router thread, never fatal."""
        t0 = time.monotonic()
        try:
            keeper.sync_once()
        except Exception as exc:
            self._journal_error("router", exc)
        log.warning("router: %s in %.1fs", keeper.base_url or "not serving yet", time.monotonic() - t0)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the daemon (call from the main thread, before ``run``). Besides the Python-level
        handler, the signal number goes to a wakeup fd that the stop thread reads (``_record_stop_when_told``)."""
        read, write = socket.socketpair()
        write.setblocking(False)
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        self._signals, self._signal_writer = read, write
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
