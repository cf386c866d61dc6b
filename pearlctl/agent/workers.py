"""Worker handles: the agent's view of one engine process group — a vLLM server (`VllmWorker`: rollout, prefill,
decode or reward, on vLLM or the paced engine) or a plain command (`CommandWorker`: the trainer's ranks).

A handle starts without blocking, reports its state from probes (process alive? health endpoint?), and stops by
draining first. A vLLM worker also parks (asleep on trainer GPUs) and wakes, and serves the weight version it is
asked for, each in the background so that the agent's heartbeat never waits for it. Which handles run is decided
by the reconciler (pearlctl/agent/reconciler.py).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from pearlctl.agent.engines import EngineError, ignore_preempt_signal
from pearlctl.agent.engines.vllm import PacedServer, VllmServer  # at the agent's start, not on a borrow's critical path
from pearlctl.agent.identity import Identity
from pearlctl.api.bodies import as_text
from pearlctl.host.processes import die_with_parent, signal_group
from pearlctl.host.weight_store import NODE_STORE_KEEP, NodeStore
from pearlctl.trainer.broadcast import BACKEND as BROADCAST_BACKEND
from pearlctl.trainer.broadcast import INFO_RPC as BROADCAST_INFO_RPC

log = logging.getLogger("pearlctl.agent")


def _log_end(path: Path) -> str:
    """The last non-empty line of a log, for a one-line failure note."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    except OSError:
        return f"(no log at {path})"
    return f"log {path} ends: {lines[-1].strip()[:300]}" if lines else f"log {path} is empty"


def engine_device() -> str:
    """``gpu`` when an NVIDIA driver is loaded here, else ``cpu`` (``PEARL_ENGINE_DEVICE`` overrides).
    Decided without importing torch: that import takes seconds and would stall the agent's heartbeats."""
    forced = os.environ.get("PEARL_ENGINE_DEVICE")
    if forced in ("cpu", "gpu"):
        return forced
    return "gpu" if Path("/proc/driver/nvidia/version").exists() else "cpu"


_HANDED: collections.deque[int] = collections.deque(maxlen=1024)  # ports free_port gave out lately, newest last
_HANDED_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port free now and not handed out by this process lately: the kernel can give one ephemeral port to two
    binds in a row once the first is closed, and an agent starting several workers at once would start two servers on
    it (one fails: "address already in use")."""
    with _HANDED_LOCK:
        for _ in range(64):
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            if port not in _HANDED:
                break
        _HANDED.append(port)
        return port


def kv_shared_dir(run_dir: str) -> Path:
    """Where a run's PREFILL and DECODE vLLM workers pass KV to each other on CPU: vLLM's ExampleConnector
    writes a prefill's KV as files and the decode reads them (on a GPU, NIXL moves KV and no directory is
    used). One directory for the whole run, so both halves of a pair use the same one whichever allocation
    started them; it is in the run directory, which every node mounts (pearlctl.host.runfiles), so a pair also
    works across nodes — slowly, through the shared filesystem. Limits (docs/router.md, "Prefill-decode"):
    the files are keyed by prompt tokens only and never removed."""
    return Path(run_dir, "kv-shared")


class WorkerHandle(Protocol):
    key: str
    role: str
    engine: str
    gpus: tuple[int, ...]

    def start(self) -> None: ...

    def state(self) -> str: ...

    def stop(self, drain_timeout: float) -> None: ...

    def report(self) -> dict: ...

    def failure(self) -> str: ...


def identity(handle: WorkerHandle) -> dict:
    """What every worker report starts with: which worker, on which GPUs, in which state (and, FAILED, why:
    one printable line of at most 256 characters, as the control API takes it)."""
    state = handle.state()
    out = {"key": handle.key, "role": handle.role, "engine": handle.engine, "gpus": list(handle.gpus), "state": state}
    if state == "FAILED":
        out["error"] = as_text(handle.failure())
    return out


class VllmWorker:
    """A vLLM server (rollout, prefill, decode or reward) on some of the allocation's GPUs."""

    engine = "vllm"
    # stop(): of the drain timeout, this share (at most STOP_RESERVE_MAX_S) is kept for aborting what is
    # still in flight (at most ABORT_MAX_S) and the SIGTERM; the stop gets at least STOP_MIN_S before SIGKILL
    STOP_RESERVE_SHARE = 0.25
    STOP_RESERVE_MAX_S = 5.0
    ABORT_MAX_S = 2.0
    STOP_MIN_S = 1.0
    # park(): a worker is parked once out of the router (a return's or a retire's DEREGISTER is proven by the
    # router's membership), so what it runs then is all it will run. Answers about to end get this long; the
    # rest is aborted and its clients continue it on another worker with the tokens made so far (the gateway,
    # pearlctl.router.gateway). A return has a deadline, and the planner prices a leave as that abort and the
    # continuation's re-prefill (pearlctl.sim.engine ABORT_S, pearlctl/policies/shipped/pearl.py `_migration_s`),
    # never as waiting for long turns to end: a drain of the whole drain timeout made a return take 6-10 s, not 1.
    PARK_DRAIN_S = 0.5

    def __init__(
        self,
        key: str,
        role: str,
        gpus: tuple[int, ...],
        me: Identity,
        run_dir: str,
        model: str,
        engine_args: dict,
        *,
        paced_profile: str | None = None,
        served_model_name: str | None = None,
        store: NodeStore | None = None,
    ):
        self.key, self.role, self.gpus = key, role, gpus
        log_path = Path(run_dir, "logs", f"vllm-{me.job_id}_{me.task_id}-{key}.log")
        common: dict[str, Any] = {
            "port": free_port(),
            "role": role,
            "gpus": list(gpus),
            "engine_args": engine_args,
            "log_path": log_path,
            "host": "0.0.0.0",
            "kv_shared_dir": kv_shared_dir(run_dir),  # the run's, not this worker's: PREFILL and DECODE meet there
        }
        # a run with engine = "paced" (pearlctl.config): the paced engine speaks vLLM's API in vLLM's place
        self.server = (
            PacedServer(model, profile=paced_profile, **common)
            if paced_profile
            else VllmServer(model, device=engine_device(), served_model_name=served_model_name, **common)
        )
        # the URL this worker is reported under, also stated in its answers' headers (vllm_headers)
        self.server.env["PEARL_WORKER_URL"] = self.url
        self._stopping = False
        self._stopped = False
        self._sleep_state: str | None = None
        self._turning_away = threading.Lock()  # held while a check of the parked worker for requests runs
        self._park_again = False  # parked again while a wake runs: back to sleep once awake (`unpark`)
        self._reloading = threading.Lock()  # held while a weight sync runs (in the background: `sync_weights_soon`)
        self.weight_version: str | None = None
        # this node's weight store (pearlctl.host.weight_store): versions are reloaded from it, and what this
        # worker's engine uses from it is pinned there while it lives (``_pin``)
        self.store = store
        self._model = model
        # started with the pearl_gloo receiver (pearlctl.trainer.broadcast.server_engine_args): the trainer may push
        self.receives_broadcast = (engine_args.get("weight_transfer_config") or {}).get("backend") == BROADCAST_BACKEND

    @property
    def url(self) -> str:
        # the server listens on every interface; clients on other nodes reach it by this host's name
        return f"http://{socket.gethostname()}:{self.server.port}"

    def start(self) -> None:
        self.server.start()
        if self.store is not None:  # a model loaded from the store (the judge) stays there while this engine lives
            self._pin(self._model)

    def _pin(self, path: str) -> None:
        if self.store is not None and self.server.pid is not None:  # (a path outside the store pins nothing)
            try:
                self.store.pin(self.server.pid, path)
            except OSError as exc:  # the store is a cache: a pin that cannot be written costs a later prune's care
                log.warning("worker %s: cannot pin %s in the node store (%s)", self.key, path, exc)

    def state(self) -> str:
        if self._stopped:
            return "STOPPED"
        if self._stopping:
            return "DRAINING"
        if not self.server.alive():
            return "FAILED"
        if self._sleep_state is not None:  # parking or waking: "DRAINING", "SLEEPING" or "WAKING"
            return "SLEEPING" if self._sleep_state == "WAKING" else self._sleep_state
        try:
            return "READY" if self.server.is_ready() else "STARTING"
        except Exception:
            return "STARTING"

    def park(self, drain_timeout: float) -> None:
        """Drain briefly (``PARK_DRAIN_S``, within ``drain_timeout``), abort what still runs, then sleep (level 1:
        on a GPU the weights go to host memory and the KV cache is freed), in the background. Idempotent: called
        again once asleep (every heartbeat that wants it parked), it turns away whatever reached the sleeping
        worker — in the background too, one check at a time, so that a server slow to answer never holds up the
        heartbeat that called it."""
        if self._sleep_state == "SLEEPING" and not self._stopping and self.server.alive():
            if self._turning_away.acquire(blocking=False):
                threading.Thread(target=self._turn_away, name=f"turn-away-{self.key}", daemon=True).start()
        if self._sleep_state == "WAKING":  # the wake in flight ends asleep again (`unpark`), never serving
            self._park_again = True
            return
        if self._sleep_state is not None or self._stopping:
            return
        self._sleep_state = "DRAINING"

        def run() -> None:
            try:
                if not self.server.drain(min(drain_timeout, self.PARK_DRAIN_S)) and self.server.alive():
                    aborted = self.server.abort_in_flight(timeout=self.ABORT_MAX_S)
                    log.warning("parking %s: aborted %d request(s) in flight (continued elsewhere)", self.key, aborted)
                self.server.sleep(level=1)
                self._sleep_state = "SLEEPING"
            except Exception as exc:
                log.warning("parking %s failed (%s): stopping it instead", self.key, exc)
                self.stop(drain_timeout)

        threading.Thread(target=run, name=f"park-{self.key}", daemon=True).start()

    def _turn_away(self) -> None:
        """A parked worker serves nothing. A request that reached it all the same (a router that had not yet
        taken it out) would wait in the sleeping engine for good: it is aborted, and its client continues it
        elsewhere from the answer's tokens (pearlctl.router). Runs holding ``_turning_away``, which it releases."""
        try:
            m = self.server.metrics(timeout=2.0)
            if m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0) > 0:
                n = self.server.abort_requests(timeout=2.0)
                log.warning("parked worker %s was sent %d request(s): aborted, to be continued elsewhere", self.key, n)
        except Exception as exc:  # asked again at the next heartbeat
            log.warning("could not check parked worker %s for requests: %s", self.key, exc)
        finally:
            self._turning_away.release()

    def unpark(self) -> None:
        """Wake a parked worker in the background (READY once awake and resumed). Idempotent."""
        if self._sleep_state != "SLEEPING":
            return
        self._sleep_state = "WAKING"
        self._park_again = False

        def run() -> None:
            try:
                self.server.wake_up()
                if self._park_again:  # the desired state went back to parked while it woke
                    self.server.sleep(level=1)
                    self._sleep_state = "SLEEPING"
                    return
                self.server.resume()  # drain() left the scheduler paused
                self._sleep_state = None
            except Exception as exc:
                log.warning("waking %s failed (%s): stopping it", self.key, exc)
                self.stop(5.0)

        threading.Thread(target=run, name=f"wake-{self.key}", daemon=True).start()

    def sync_weights_soon(self, weights: dict | None) -> bool:
        """`sync_weights` in the background when the worker is READY and behind ``weights``, unless one runs
        already (the next call after it ends tries again): a reload takes seconds (a whole model's weights), and
        the agent's heartbeat must not wait for it — an agent silent for its loss window is LOST. Returns whether
        one was started."""
        if not self._behind(weights) or not self._reloading.acquire(blocking=False):
            return False
        if self.state() != "READY":  # starting or waking: `Reconciler.catch_up` calls again once it is READY
            self._reloading.release()
            return False

        def run() -> None:
            try:
                self.sync_weights(weights)
            except Exception as exc:  # the old weights stay; the next apply or catch-up tries again
                log.warning("weight reload of %s failed: %s", self.key, exc)
            finally:
                self._reloading.release()

        threading.Thread(target=run, name=f"reload-{self.key}", daemon=True).start()
        return True

    @property
    def reloading(self) -> bool:
        return self._reloading.locked()

    def _behind(self, weights: dict | None) -> bool:
        """Whether ``weights`` (a desired worker's) name a version this worker does not serve."""
        return (weights or {}).get("version") not in (None, self.weight_version)

    def sync_weights(self, weights: dict | None) -> None:
        """Serve the desired version when it differs from the served one: adopt it with no reload when the
        trainer already broadcast it into this server (pearlctl.trainer.broadcast: the server's ``/weight_info``
        names it, which vLLM sets only at the end of a whole transfer), else reload from this node's weight store
        when the version is there (written by a trainer rank on this node), else from the export on shared disk
        (``weights["path"]``, the fallback). The log line names the source."""
        if not self._behind(weights) or self.state() != "READY":
            return
        version = str(weights["version"])
        paused = False
        if self.receives_broadcast:
            if self._pushed_version() == version:
                self.weight_version = version
                log.warning(
                    "worker %s now serves weights %s from the trainer's broadcast (no reload)", self.key, version
                )
                return
            paused = self._end_failed_broadcast()
        # this node's copy: written there by a trainer rank on this node, or copied from the shared-disk export once
        # for every worker of the node; the export itself when the store cannot hold it
        local = self.store.fetch_version(version, weights["path"], keep=NODE_STORE_KEEP) if self.store else None
        source, path = ("node-local store", str(local)) if local is not None else ("shared disk", weights["path"])
        seconds = self.server.reload_weights(path)
        self._pin(path)
        self.server.set_weight_version(version)
        if paused:  # left paused by a broadcast that failed: it serves again, on the version just reloaded
            self.server.resume()
        self.weight_version = version
        log.warning(
            "worker %s now serves weights %s from the %s %s (reload %.3fs)", self.key, version, source, path, seconds
        )

    def _pushed_version(self) -> str | None:
        """The version label the server reports (set by the trainer's ``/finish_weight_update``), None when it
        does not answer: then the version is reloaded from a file, as without a broadcast."""
        try:
            return self.server.weight_version()
        except EngineError as exc:
            log.warning("worker %s: cannot read its weight version (%s): reloading from a file", self.key, exc)
            return None

    def _end_failed_broadcast(self) -> bool:
        """Before a file reload on a worker with the receiver: finish a weight update a sender started and did
        not finish (vLLM's reload fails while one is open), and say whether the scheduler is paused (a sender
        pauses it for the update and resumes it only after a whole one: a READY worker is paused by nothing else).
        The version's file reload then replaces whatever mix of versions the failure left."""
        try:
            info = self.server._json(
                "POST", "/collective_rpc", body={"method": BROADCAST_INFO_RPC, "timeout": 30}, timeout=40
            )
            if any((r or {}).get("update_active") for r in (info or {}).get("results", [])):
                self.server._call("POST", "/finish_weight_update", body={}, timeout=300)
                log.warning("worker %s: finished a weight update its sender left open", self.key)
            return self.server.is_paused()
        except EngineError as exc:
            log.warning("worker %s: cannot check for a failed broadcast (%s)", self.key, exc)
            return False

    def stop(self, drain_timeout: float) -> None:
        """Drain, then stop, all within ``drain_timeout`` (the agent's ``PEARL_DRAIN_TIMEOUT_S``, from the
        pool's ``preempt_notice_s``). A drain that fails or runs out of time does not just SIGTERM: what
        is still in flight is aborted first, so clients get ``finish_reason: "abort"`` with their partial
        output and continue it on another worker (pearlctl.router.client), instead of a dropped connection."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout
        # keep a share of the time for the abort and the SIGTERM after a drain that does not finish
        reserve = min(self.STOP_RESERVE_MAX_S, drain_timeout * self.STOP_RESERVE_SHARE)
        if self.server.alive():
            drained = False
            try:
                drained = self.server.drain(max(0.1, drain_timeout - reserve))
            except Exception as exc:  # a drain that fails still ends in a stop
                log.warning("drain of %s failed: %s", self.key, exc)
            if not drained and self.server.alive():
                try:
                    left = deadline - time.monotonic()
                    aborted = self.server.abort_in_flight(timeout=max(0.5, min(self.ABORT_MAX_S, left / 2)))
                    log.warning(
                        "drain of %s did not finish in time: aborted %d request(s) in flight", self.key, aborted
                    )
                except Exception as exc:
                    log.warning("aborting the requests in flight on %s failed: %s", self.key, exc)
        pid = self.server.pid if self.store is not None else None  # its pin in the node's store goes with it
        self.server.stop(timeout=max(self.STOP_MIN_S, deadline - time.monotonic()))
        self._stopped = True
        if self.store is not None and pid is not None:
            self.store.unpin(pid)

    def report(self) -> dict:
        return {
            **identity(self),
            "url": self.url,
            "pid": self.server.pid,
            "weight_version": self.weight_version,
            "ready_s": None if self.server.ready_s is None else round(self.server.ready_s, 3),
        }

    def failure(self) -> str:
        """Why the server is not running: its exit status and the end of its log."""
        return f"exit {self.server.returncode}; {_log_end(self.server.log_path)}"


class CommandWorker:
    """A worker that is a plain command in its own process group (trainer ranks: torchrun/deepspeed)."""

    engine = "deepspeed"

    def __init__(
        self,
        key: str,
        role: str,
        gpus: tuple[int, ...],
        me: Identity,
        run_dir: str,
        argv: list[str],
        env: dict[str, str],
    ):
        self.key, self.role, self.gpus, self.argv = key, role, gpus, argv
        self.env = env
        self.log_path = Path(run_dir, "logs", f"train-{me.job_id}_{me.task_id}-{key}.log")
        self.proc: subprocess.Popen | None = None
        self._stopped = False

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **self.env, CUDA_VISIBLE_DEVICES=",".join(map(str, self.gpus)))
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                # SIGKILL: a command (torchrun and its ranks) never outlives a SIGKILLed agent, though it runs in
                # its own session; the agent forks from its main thread
                preexec_fn=die_with_parent(signal.SIGKILL, then=ignore_preempt_signal),
            )

    def state(self) -> str:
        if self.proc is None:
            return "STARTING"
        rc = self.proc.poll()
        if rc is None:
            return "READY"
        return "STOPPED" if rc == 0 or self._stopped else "FAILED"

    def stop(self, drain_timeout: float) -> None:
        self._stopped = True
        if self.proc is None or self.proc.poll() is not None:
            return
        signal_group(self.proc.pid, signal.SIGTERM)  # ranks checkpoint on TERM (pearlctl.trainer)
        try:
            self.proc.wait(drain_timeout)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def report(self) -> dict:
        return {**identity(self), "pid": self.proc.pid if self.proc else None}

    def failure(self) -> str:
        """Why the command is not running: its exit status and the end of its log."""
        return f"exit {self.proc.returncode if self.proc else None}; {_log_end(self.log_path)}"
