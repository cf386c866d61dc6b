"""Worker handles: the agent's view of one engine process group, and reconciliation to desired state.

A handle starts without blocking, reports its state from probes (process alive? health endpoint?),
and stops by draining first. ``Reconciler.apply`` makes the set of running handles match what the
daemon asked for: start what is missing, retire what is no longer wanted (in the background, so the
heartbeat never waits for a drain), restart a failed worker after a back-off.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Protocol

from pearlctl.agent.identity import Identity

log = logging.getLogger("pearlctl.agent")

RESTART_BACKOFF_S = 10.0


def engine_device() -> str:
    """``gpu`` when an NVIDIA driver is loaded here, else ``cpu`` (``PEARL_ENGINE_DEVICE`` overrides).
    Decided without importing torch: that import takes seconds and would stall the agent's heartbeats."""
    forced = os.environ.get("PEARL_ENGINE_DEVICE")
    if forced in ("cpu", "gpu"):
        return forced
    return "gpu" if Path("/proc/driver/nvidia/version").exists() else "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the agent dies (PR_SET_PDEATHSIG), so an engine never
    outlives a SIGKILLed agent even though it runs in its own session (torchrun ranks do too).
    The signal follows the parent *thread* that forked: the agent forks from its main thread."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1


class WorkerHandle(Protocol):
    key: str
    role: str
    engine: str
    gpus: tuple[int, ...]

    def start(self) -> None: ...

    def state(self) -> str: ...

    def stop(self, drain_timeout: float) -> None: ...

    def report(self) -> dict: ...


def identity(handle: WorkerHandle) -> dict:
    """What every worker report starts with: which worker, on which GPUs, in which state."""
    return {
        "key": handle.key,
        "role": handle.role,
        "engine": handle.engine,
        "gpus": list(handle.gpus),
        "state": handle.state(),
    }


class VllmWorker:
    """A vLLM server (rollout, prefill, decode or reward) on some of the allocation's GPUs."""

    engine = "vllm"

    def __init__(
        self, key: str, role: str, gpus: tuple[int, ...], me: Identity, run_dir: str, model: str, engine_args: dict
    ):
        from pearlctl.agent.engines.vllm import VllmServer

        self.key, self.role, self.gpus = key, role, gpus
        log_path = Path(run_dir, "logs", f"vllm-{me.job_id}_{me.task_id}-{key}.log")
        self.server = VllmServer(
            model,
            port=free_port(),
            role=role,
            gpus=list(gpus),
            engine_args=engine_args,
            log_path=log_path,
            host="0.0.0.0",
            device=engine_device(),
        )
        self._stopping = False
        self._stopped = False
        self._sleep_state: str | None = None
        self.weight_version: str | None = None

    def start(self) -> None:
        self.server.start()

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
            return "READY" if self.server.health() else "STARTING"
        except Exception:
            return "STARTING"

    def park(self, drain_timeout: float) -> None:
        """Drain, then sleep (level 1: on a GPU the weights go to host memory and the KV cache is freed),
        in the background. Idempotent."""
        if self._sleep_state is not None or self._stopping:
            return
        self._sleep_state = "DRAINING"

        def run() -> None:
            try:
                self.server.drain(drain_timeout)
                self.server.sleep(level=1)
                self._sleep_state = "SLEEPING"
            except Exception as exc:
                log.warning("parking %s failed (%s): stopping it instead", self.key, exc)
                self.stop(drain_timeout)

        threading.Thread(target=run, name=f"park-{self.key}", daemon=True).start()

    def unpark(self) -> None:
        """Wake a parked worker in the background (READY once awake and resumed). Idempotent."""
        if self._sleep_state != "SLEEPING":
            return
        self._sleep_state = "WAKING"

        def run() -> None:
            try:
                self.server.wake_up()
                self.server.resume()  # drain() left the scheduler paused
                self._sleep_state = None
            except Exception as exc:
                log.warning("waking %s failed (%s): stopping it", self.key, exc)
                self.stop(5.0)

        threading.Thread(target=run, name=f"wake-{self.key}", daemon=True).start()

    def sync_weights(self, weights: dict | None) -> None:
        """Reload weights from the trainer's export when the desired version differs from the served one."""
        if not weights or weights.get("version") in (None, self.weight_version) or self.state() != "READY":
            return
        seconds = self.server.reload_weights(weights["path"])
        self.server.set_weight_version(str(weights["version"]))
        self.weight_version = str(weights["version"])
        log.warning("worker %s now serves weights %s (reload %.3fs)", self.key, self.weight_version, seconds)

    def stop(self, drain_timeout: float) -> None:
        self._stopping = True
        try:
            if self.server.alive():
                self.server.drain(drain_timeout)
        except Exception as exc:  # a drain that fails still ends in a stop
            log.warning("drain of %s failed: %s", self.key, exc)
        self.server.stop()
        self._stopped = True

    def report(self) -> dict:
        return {
            **identity(self),
            # the server listens on every interface; clients on other nodes reach it by this host's name
            "url": f"http://{socket.gethostname()}:{self.server.port}",
            "pid": self.server.pid,
            "weight_version": self.weight_version,
        }


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
                preexec_fn=die_with_parent,
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
        os.killpg(self.proc.pid, signal.SIGTERM)  # ranks checkpoint on TERM (pearlctl.trainer)
        try:
            self.proc.wait(drain_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def report(self) -> dict:
        return {**identity(self), "pid": self.proc.pid if self.proc else None}


class Reconciler:
    def __init__(self, me: Identity, run_dir: str, env: dict[str, str] | None = None, *, drain_timeout: float = 30.0):
        self.me, self.run_dir = me, run_dir
        self.env = dict(os.environ if env is None else env)
        self.drain_timeout = drain_timeout
        self.workers: dict[str, WorkerHandle] = {}
        self.retiring: dict[str, WorkerHandle] = {}
        self.failed_at: dict[str, float] = {}

    def _make(self, want: dict) -> WorkerHandle | None:
        gpus = tuple(want["gpus"])
        if want["engine"] == "vllm":
            args = json.loads(self.env.get("PEARL_ENGINE_ARGS") or "{}")
            return VllmWorker(want["key"], want["role"], gpus, self.me, self.run_dir, self.env["PEARL_MODEL"], args)
        argv = json.loads(self.env.get("PEARL_TRAIN_COMMAND") or "null")
        if not argv:
            return None  # this trainer pool runs no training command under the agent
        return CommandWorker(
            want["key"],
            want["role"],
            gpus,
            self.me,
            self.run_dir,
            argv,
            {"PEARL_ALLOCATION_GPUS": ",".join(map(str, gpus))},
        )

    def apply(self, desired: list[dict]) -> None:
        wanted = {d["key"]: d for d in desired if d.get("state", "RUNNING") in ("RUNNING", "SLEEPING")}
        for key in list(self.workers):
            if key not in wanted:
                self.retire(key)
        now = time.monotonic()
        for key, want in wanted.items():
            handle = self.workers.get(key)
            if want.get("state") == "SLEEPING":
                if isinstance(handle, VllmWorker):  # parked on trainer GPUs: asleep until the next borrow
                    handle.park(self.drain_timeout)
                continue  # nothing running under that key: nothing to park
            if handle is not None and handle.state() == "FAILED":
                if now - self.failed_at.setdefault(key, now) < RESTART_BACKOFF_S:
                    continue
                log.warning("restarting failed worker %s", key)
                self.workers.pop(key)
                handle = None
            if handle is None and key not in self.retiring:
                handle = self._make(want)
                if handle is None:
                    continue
                self.failed_at.pop(key, None)
                handle.start()
                self.workers[key] = handle
            if isinstance(handle, VllmWorker):
                handle.unpark()
                try:
                    handle.sync_weights(want.get("weights"))
                except Exception as exc:  # a failed reload keeps the old weights; the next heartbeat retries
                    log.warning("weight reload of %s failed: %s", key, exc)

    def retire(self, key: str) -> None:
        handle = self.workers.pop(key)
        self.retiring[key] = handle

        def run() -> None:
            handle.stop(self.drain_timeout)

        threading.Thread(target=run, name=f"retire-{key}", daemon=True).start()

    def report(self) -> list[dict]:
        """Every worker's state; a retired one until the daemon has seen it STOPPED or FAILED."""
        return [h.report() for h in self.workers.values()] + [h.report() for h in self.retiring.values()]

    def delivered(self, report: list[dict]) -> None:
        """The daemon has this report: retired workers it saw ended need not be reported again."""
        for r in report:
            if r["state"] in ("STOPPED", "FAILED") and r["key"] in self.retiring:
                del self.retiring[r["key"]]

    def stop_all(self, drain_timeout: float) -> float:
        """Drain and stop every worker (preemption notice or shutdown); returns the seconds it took."""
        t0 = time.monotonic()
        threads = []
        for key in list(self.workers):
            handle = self.workers.pop(key)
            self.retiring[key] = handle
            t = threading.Thread(target=handle.stop, args=(drain_timeout,), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(drain_timeout + 15)
        return time.monotonic() - t0
