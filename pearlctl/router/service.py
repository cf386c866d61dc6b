"""Starting, finding again and stopping a run's router process (gateway + vllm-router), and the files in
the run directory that describe it. The daemon calls this; nothing here decides membership.

Files, in the run's control directory ``RUN_DIR/.pearl/`` (pearlctl.host.runfiles: mode 0700, on the shared
filesystem, so rollout clients on compute nodes read them too):

- ``router.key`` — the router's credential: a random token, mode 0600, created once by `ensure_key`.
  Callers send it as ``Authorization: Bearer <token>``; it is never logged.
- ``router.json`` — the `RouterRecord` of the running gateway, written by the gateway itself once it is
  ready (a temporary name, then a rename: a reader never sees half a file), removed when it stops.

Guarantees:
- `start` spawns ``python -m pearlctl.router ... --detach``: the gateway forks away into its own session
  and is re-parented to init, so neither a crash nor a SIGKILL of the daemon takes the data plane down,
  and the daemon never holds a zombie of it. vllm-router runs as the gateway's child with a parent-death
  signal: it never outlives the gateway. `start` returns only once the gateway answers ``/health``, within
  ``ready_timeout_s``, else it raises `RouterStartError` with the log's tail, leaving nothing running.
- `adopt` trusts a record only if its pid is the same process (the start time in ``/proc/<pid>/stat``,
  in clock ticks since boot, matches: a recycled pid never passes) and the gateway answers.
- `stop` signals only that same process: SIGTERM (the gateway stops serving, then its vllm-router), then
  SIGKILL to its process group after ``timeout``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from pearlctl.host.processes import group_alive, proc_start_ticks, signal_group
from pearlctl.host.runfiles import control_dir, write_atomic
from pearlctl.vocabulary import Role

RECORD_NAME = "router.json"
KEY_NAME = "router.key"
DEFAULT_RETRY_FOR_S = 600.0  # how long a turn is retried/continued before the caller gets a 503
DEFAULT_REQUEST_TIMEOUT_S = 1800.0  # one upstream attempt: above the longest generation
LOG_TAIL_BYTES = 4000


class RouterStartError(Exception):
    """The router process did not come up; the message says why and ends with its log's tail."""


@dataclass(frozen=True)
class RouterRecord:
    """Where a run's gateway listens and which process it is (``router.json``)."""

    pid: int  # the gateway (leader of its own process group; vllm-router is its child)
    start_ticks: int  # field 22 of /proc/<pid>/stat: the process's start time in clock ticks since boot
    url: str  # the gateway's root, e.g. http://head:8100 (admin API: url + /pearl/workers)
    base_url: str  # what an OpenAI client takes as base_url: url + /v1
    router_url: str  # vllm-router itself, bound to 127.0.0.1 on the gateway's host
    host: str  # the address the gateway is bound to
    port: int
    started_at: float  # unix time
    router_pid: int | None = None
    launch_id: str | None = None  # names the `start` call that made it
    log: str | None = None
    # the control plane's own socket (health, membership; pearlctl.router.control.ControlPlane), e.g.
    # http://head:41234: answered while the data plane's loop is busy with a batch's turns
    control_url: str | None = None

    @property
    def admin_url(self) -> str:
        """Where health and membership calls go: the control socket, or the gateway's root (an older record)."""
        return self.control_url or self.url

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> RouterRecord:
        known = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        return cls(**known)


# -- files --------------------------------------------------------------------------------------------
def record_path(run_dir: str | os.PathLike) -> Path:
    return control_dir(run_dir) / RECORD_NAME


def key_path(run_dir: str | os.PathLike) -> Path:
    return control_dir(run_dir) / KEY_NAME


def ensure_key(run_dir: str | os.PathLike) -> str:
    """The router's credential for this run, created (random, mode 0600) if it does not exist yet."""
    path = key_path(run_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        write_atomic(path, secrets.token_urlsafe(32), mode=0o600)
    return read_key(run_dir)


def read_key(run_dir: str | os.PathLike | None = None, *, path: str | os.PathLike | None = None) -> str:
    """The token in ``path`` (default: the run's ``router.key``); an empty file is an error."""
    p = Path(path) if path is not None else key_path(run_dir or ".")
    token = p.read_text().strip()
    if not token:
        raise ValueError(f"the router key file {p} is empty: create it with pearlctl.router.service.ensure_key")
    return token


def read_record(run_dir: str | os.PathLike) -> RouterRecord | None:
    """The record as written, or None if there is none or it is unreadable (checks nothing else)."""
    try:
        doc = json.loads(record_path(run_dir).read_text())
        return RouterRecord.from_doc(doc) if isinstance(doc, dict) else None
    except (OSError, ValueError, TypeError):
        return None


def view(run_dir: str | os.PathLike) -> dict | None:
    """The run's router for people (``pearlctl status``): its base URL, where its key is, whether its process
    runs — read from the run directory, no network call. None when the run never had one."""
    record = read_record(run_dir)
    if record is None:
        return None
    return {
        "base_url": record.base_url,
        "url": record.url,
        "pid": record.pid,
        "running": same_process(record.pid, record.start_ticks),
        "key_file": str(key_path(run_dir)),
        "started_at": record.started_at,
    }


def write_record(run_dir: str | os.PathLike, record: RouterRecord) -> None:
    write_atomic(record_path(run_dir), record.to_json(), mode=0o644)


def remove_record(run_dir: str | os.PathLike, pid: int) -> None:
    """Remove the record if it is still the one of process ``pid`` (a newer gateway's is kept)."""
    current = read_record(run_dir)
    if current is not None and current.pid == pid:
        record_path(run_dir).unlink(missing_ok=True)


# -- processes ----------------------------------------------------------------------------------------
def same_process(pid: int, start_ticks: int) -> bool:
    return pid > 0 and proc_start_ticks(pid) == start_ticks


def health(url: str, *, timeout: float = 2.0) -> dict | None:
    """The gateway's ``GET /health`` document, or None when no gateway answers at ``url``. The document's
    ``ok`` is false (HTTP 503) while the gateway restarts its vllm-router: the gateway itself answers."""
    try:
        # the gateway serves plain HTTP (pearlctl.router.__main__): no CA bundle to load; httpx loads one per
        # client unless told not to verify (30-70 ms), and the router keeper asks this every few seconds
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout, verify=False)
        doc = resp.json()
    except (httpx.HTTPError, ValueError):
        return None
    if resp.status_code not in (200, 503) or not isinstance(doc, dict) or "ok" not in doc:
        return None
    return doc


def adopt(run_dir: str | os.PathLike, *, timeout: float = 2.0) -> RouterRecord | None:
    """The running gateway of this run, or None: the record's pid must be the same process (start ticks)
    and the gateway must answer ``/health`` within ``timeout`` (an answer that its vllm-router is being
    restarted counts: the gateway restarts it itself)."""
    record = read_record(run_dir)
    if record is None or not same_process(record.pid, record.start_ticks):
        return None
    if health(record.admin_url, timeout=timeout) is None:
        return None
    return record


def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"


def _detach(argv: list[str], log: Path, deadline: float, ready_timeout_s: float) -> None:
    """Run the launcher (``argv``, output to ``log``) and wait, until ``deadline``, for it to fork the gateway
    away and exit 0; else `RouterStartError` with the log's tail (a launcher that hangs is killed)."""
    with open(log, "ab") as out:
        out.write(f"# pearlctl: starting {' '.join(argv)}\n".encode())
        out.flush()
        try:
            launcher = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            raise RouterStartError(f"cannot run {argv[0]} -m pearlctl.router: {exc}") from exc
    try:
        code = launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
        raise RouterStartError(
            f"the router launcher (pid {launcher.pid}) did not detach within {ready_timeout_s:.0f} s; "
            f"log {log} ends:\n{_log_tail(log)}"
        ) from None
    if code != 0:
        raise RouterStartError(f"the router launcher exited with code {code}; log {log} ends:\n{_log_tail(log)}")


def _await_record(
    run_dir: str | os.PathLike, launch_id: str, log: Path, deadline: float, ready_timeout_s: float
) -> RouterRecord:
    """The record the gateway of ``launch_id`` writes, once that gateway answers ``/health`` ok; by
    ``deadline``, else `RouterStartError` (a gateway that wrote its record but does not answer is stopped)."""
    while True:
        record = read_record(run_dir)
        if record is not None and record.launch_id == launch_id:
            if not same_process(record.pid, record.start_ticks):
                raise RouterStartError(
                    f"the router gateway (pid {record.pid}) exited; log {log} ends:\n{_log_tail(log)}"
                )
            doc = health(record.admin_url, timeout=1.0)
            if doc is not None and doc.get("ok"):
                return record
        if time.monotonic() >= deadline:
            if record is not None and record.launch_id == launch_id:
                stop(record, timeout=5.0)
            raise RouterStartError(
                f"the router gateway did not answer /health within {ready_timeout_s:.0f} s; log {log} ends:\n"
                f"{_log_tail(log)}"
            )
        time.sleep(0.05)


def start(
    run_dir: str | os.PathLike,
    host: str,
    port: int,
    key_file: str | os.PathLike | None = None,
    *,
    policy: str = "consistent_hash",
    advertise_host: str | None = None,
    retry_for_s: float = DEFAULT_RETRY_FOR_S,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    health_check_interval_s: float = 1.0,
    workers: dict[str, str | None] | None = None,
    roles: dict[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    ready_timeout_s: float = 30.0,
    python: str | None = None,
) -> RouterRecord:
    """Start the run's router detached and return its record once it answers ``/health``.

    ``host``/``port``: where the gateway listens (port 0: any free port, named in the record);
    ``key_file``: the credential (default: the run's ``router.key``, created if missing); ``workers``:
    initial members (url -> weight version), each serving as ``roles[url]`` (default ``ROLLOUT``);
    ``log_path``: default ``RUN_DIR/logs/router.log``.
    Refuses (`RouterStartError`) while the recorded gateway of the run is alive: adopt it, or stop it first
    (one that is alive but does not answer is never doubled: ``stop`` it)."""
    running = read_record(run_dir)
    if running is not None and same_process(running.pid, running.start_ticks):
        answering = health(running.admin_url) is not None
        raise RouterStartError(
            f"a router gateway of {run_dir} is running (pid {running.pid}, {running.url}"
            + ("): adopt it" if answering else ", alive but not answering /health): stop it")
            + " rather than start another"
        )
    if key_file is None:
        ensure_key(run_dir)
        key_file = key_path(run_dir)
    log = Path(log_path) if log_path is not None else Path(run_dir) / "logs" / "router.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    launch_id = secrets.token_hex(8)
    argv = [python or sys.executable, "-m", "pearlctl.router", "--run-dir", str(run_dir)]
    for flag, value in (
        ("--host", host),
        ("--port", port),
        ("--key-file", key_file),
        ("--policy", policy),
        ("--retry-for-s", retry_for_s),
        ("--request-timeout-s", request_timeout_s),
        ("--health-check-interval-s", health_check_interval_s),
        ("--launch-id", launch_id),
        ("--log", log),
    ):
        argv += [flag, str(value)]
    argv.append("--detach")
    if advertise_host:
        argv += ["--advertise-host", advertise_host]
    for url, version in (workers or {}).items():
        role = (roles or {}).get(url, Role.ROLLOUT)
        argv += ["--worker", (f"{url}={version}" if version else url) + (f"@{role}" if role != Role.ROLLOUT else "")]
    deadline = time.monotonic() + ready_timeout_s
    _detach(argv, log, deadline, ready_timeout_s)
    return _await_record(run_dir, launch_id, log, deadline, ready_timeout_s)


def stop(record: RouterRecord, *, timeout: float = 10.0, run_dir: str | os.PathLike | None = None) -> bool:
    """Stop the gateway of ``record`` and its vllm-router: SIGTERM to the gateway (it stops serving, then
    stops vllm-router), SIGKILL to its whole process group after ``timeout``. Returns False when that
    process was already gone (a recycled pid is never signalled). With ``run_dir``, also removes the record
    if it is still this gateway's."""
    if not same_process(record.pid, record.start_ticks):
        if run_dir is not None:
            remove_record(run_dir, record.pid)
        return False
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and same_process(record.pid, record.start_ticks):
        time.sleep(0.05)
    if group_alive(record.pid):  # the gateway did not stop in time, or left something of its group behind
        signal_group(record.pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while group_alive(record.pid) and time.monotonic() < end:
        time.sleep(0.05)
    if run_dir is not None:
        remove_record(run_dir, record.pid)
    return True
