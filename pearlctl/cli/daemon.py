"""`pearlctl daemon RUN`: start the run's daemon (detached, or in the foreground for debugging)."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import typer

from pearlctl.backends import open_backend
from pearlctl.cli.app import app
from pearlctl.cli.common import (
    EXIT_CONFLICT,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    emit_json,
    err,
    exits,
    fail,
    open_store,
    resolve_run,
)
from pearlctl.host import home
from pearlctl.host.runfiles import read_address
from pearlctl.ops import launcher
from pearlctl.vocabulary import HEARTBEAT_S

if TYPE_CHECKING:
    from pearlctl.daemon.main import DaemonSettings
    from pearlctl.state.store import Store


@app.command()
def daemon(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    foreground: bool = typer.Option(False, "--foreground", help="Stay in the foreground and log to stderr."),
    slurm: bool = typer.Option(False, "--slurm", help="Run the daemon as a small Slurm job (1 CPU, no GPU)."),
    partition: str = typer.Option(None, "--partition", help="--slurm: the partition of the daemon's job."),
    nodelist: str = typer.Option(
        None, "--nodelist", help="--slurm: the node to run on; it must hold the state directory on local disk."
    ),
    time_limit: str = typer.Option(None, "--time", help="--slurm: the job's time limit (default: the partition's)."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address the control API binds to."),
    port: int = typer.Option(0, "--port", help="Port of the control API (0: any free port)."),
    advertise: str = typer.Option(None, "--advertise", help="Host name agents should use (default: this host)."),
    heartbeat_s: float = typer.Option(HEARTBEAT_S, "--heartbeat-s", help="Agent heartbeat interval."),
    lease_ttl_s: float = typer.Option(
        45.0, "--lease-ttl-s", help="How long the run's lease outlives a stalled daemon (> a Slurm command's 30 s)."
    ),
    supervise: bool = typer.Option(
        False, "--supervise", help="Restart the daemon whenever it dies (a supervisor process runs it)."
    ),
    systemd_unit: bool = typer.Option(
        False, "--systemd-unit", help="Print a systemd user unit that runs and restarts this daemon; start nothing."
    ),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds to wait until the daemon serves."),
    json_out: bool = typer.Option(False, "--json", help="Print where the daemon listens as JSON."),
) -> None:
    """Run the daemon of RUN: the single writer of its state, serving agents on an authenticated API.

    Detached by default (log in the run directory's logs/daemon.log); ``--supervise`` restarts it whenever
    it dies; ``--slurm`` submits it as a requeueable job named ``pearl.<run>.daemon`` instead, supervised
    inside the job (log logs/daemon-<jobid>.log), which `pearlctl cancel` ends too. ``--systemd-unit``
    prints a unit for the head node's systemd instead. Either way this command returns once the daemon
    serves, printing its address."""
    with exits():
        from pearlctl.config import slurm_option_problems
        from pearlctl.daemon.main import DaemonSettings  # the server: only this command

        bad = slurm_option_problems(partition=partition, nodelist=nodelist, time_limit=time_limit)
        if bad:  # --partition/--nodelist/--time are checked like a spec's values, before anything is opened
            raise fail("; ".join(str(p) for p in bad), EXIT_USAGE)
        store = open_store()
        run = resolve_run(store, run_ref)
        settings = DaemonSettings(
            host=host,
            port=port,
            advertise=advertise,
            heartbeat_s=heartbeat_s,
            lease_ttl_s=lease_ttl_s,
            own_process=foreground,  # the daemon's own process: the detached, supervised and Slurm ones too
        )
        if foreground and (supervise or systemd_unit or slurm):
            raise fail(
                "--foreground runs this daemon here, unsupervised: drop --supervise/--slurm/--systemd-unit", EXIT_USAGE
            )
        if foreground:
            _serve_here(store, run, settings)
            return
        store.close()
        before = read_address(run["run_dir"]) or {}
        argv = [sys.executable, "-m", "pearlctl", "daemon", run["id"], "--foreground", "--host", host]
        argv += ["--port", str(port), "--heartbeat-s", str(heartbeat_s), "--lease-ttl-s", str(lease_ttl_s)]
        if advertise:
            argv += ["--advertise", advertise]
        if systemd_unit:
            print(_systemd_unit(run, argv))
            return
        if supervise or slurm:  # inside a Slurm job the supervisor restarts a crashed daemon in place
            argv = [sys.executable, "-m", "pearlctl.daemon.supervise", "--", *argv]
        if slurm:
            starting = _submit_to_slurm(
                run, argv, before, partition=partition, nodelist=nodelist, time_limit=time_limit
            )
        else:
            starting = _spawn_detached(run, argv, before, supervise=supervise)
        _await_address(run, starting, timeout=timeout, json_out=json_out)


def _serve_here(store: Store, run: dict, settings: DaemonSettings) -> None:
    """--foreground: this process is the daemon, logging to stderr, until it stops (exit 4 when it may not
    start or must stop: its lease is held elsewhere or lost, or its control API did not start)."""
    from pearlctl.daemon.main import Daemon, DaemonRefused

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    d = Daemon(store, open_backend(run["backend"], state_dir=str(home.state_dir())), run["id"], settings)
    d.install_signal_handlers()
    try:
        d.run()
    except DaemonRefused as exc:
        raise fail(str(exc), EXIT_CONFLICT) from None
    finally:
        store.close()


class _Starting(NamedTuple):
    """A daemon on its way up, started elsewhere: its log, its new address once it serves (``started``), why it
    will not (``gone``), and how often to look."""

    log_path: Path
    started: Callable[[], dict | None]
    gone: Callable[[], str | None]
    poll_s: float


def _submit_to_slurm(
    run: dict, argv: list[str], before: dict, *, partition: str | None, nodelist: str | None, time_limit: str | None
) -> _Starting:
    """--slurm: the supervised daemon as a small Slurm job; it serves once its job's address is written."""
    if run["backend"] != "slurm":
        raise fail(f"run {run['id']} uses the {run['backend']} backend; --slurm needs a Slurm run", EXIT_USAGE)
    backend = open_backend("slurm", state_dir=str(home.state_dir()))
    env = {k: v for k, v in os.environ.items() if k.startswith("PEARL_") and k != "PEARL_FAULT"}
    env["PEARL_STATE_DIR"] = str(home.state_dir())
    req = launcher.daemon_request(
        run, tuple(argv), env=env, partition=partition, nodelist=nodelist, time_limit=time_limit
    )
    try:
        job_id = launcher.submit_daemon(backend, req)
    except launcher.LaunchError as exc:
        raise fail(str(exc), exc.exit_code) from None
    log_path = Path(run["run_dir"], "logs", f"daemon-{job_id}.log")
    err.print(f"submitted the daemon of {run['id']} as Slurm job {job_id} ({req.job_name})")

    def started() -> dict | None:
        address = read_address(run["run_dir"]) or {}
        return address if address.get("slurm_job_id") == job_id and address != before else None

    def gone() -> str | None:
        ended = [r for r in backend.poll([job_id]) if r.phase == "ENDED"]
        return f"the daemon's job {job_id} ended ({ended[0].state}); see {log_path}" if ended else None

    return _Starting(log_path, started, gone, poll_s=1.0)  # one squeue a second at most


def _spawn_detached(run: dict, argv: list[str], before: dict, *, supervise: bool) -> _Starting:
    """The daemon (or its supervisor) as a process of its own session, logging to logs/daemon.log."""
    from pearlctl.host.processes import process_alive as alive

    log_path = Path(run["run_dir"], "logs", "daemon.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def started() -> dict | None:
        address = read_address(run["run_dir"]) or {}
        if address == before or not address.get("pid"):
            return None
        # supervised, the daemon is the supervisor's child: any new address of a live daemon will do
        return address if address["pid"] == proc.pid or (supervise and alive(address["pid"])) else None

    def gone() -> str | None:
        if proc.poll() is None:
            return None
        if proc.returncode == EXIT_CONFLICT:
            raise fail("the daemon refused to start:\n" + _tail(log_path), EXIT_CONFLICT)
        return "the daemon exited at start:\n" + _tail(log_path)

    return _Starting(log_path, started, gone, poll_s=0.2)


def _await_address(run: dict, starting: _Starting, *, timeout: float, json_out: bool) -> None:
    """Waits until the daemon serves and prints where (exit 1 when it dies first, 124 after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        address = starting.started()
        if address:
            if json_out:
                emit_json(address)
            else:
                err.print(f"daemon of {run['id']} running (pid {address['pid']}), log {starting.log_path}")
                print(address["url"])
            return
        why = starting.gone()
        if why:
            raise fail(why, 1)
        time.sleep(starting.poll_s)
    tail = _tail(starting.log_path)
    raise fail(
        f"the daemon did not write its address within {timeout:g}s; see {starting.log_path}"
        + (f", which ends:\n{tail}" if tail else ""),
        EXIT_TIMEOUT,
    )


def _systemd_unit(run: dict, argv: list[str]) -> str:
    """A systemd user unit (``~/.config/systemd/user/pearl-<run>.service``) that keeps the daemon up."""
    env = "".join(
        f"Environment={k}={shlex.quote(v)}\n" for k, v in sorted(os.environ.items()) if k.startswith("PEARL_")
    )
    return (
        f"# pearlctl daemon of run {run['id']}: systemctl --user enable --now pearl-{run['id']}.service\n"
        "[Unit]\n"
        f"Description=pearlctl daemon of run {run['id']}\n"
        "After=network-online.target\n"
        "StartLimitIntervalSec=0\n\n"  # never give up restarting (a lease conflict or a crash loop)
        "[Service]\n"
        f"ExecStart={shlex.join(argv)}\n"
        f"{env}"
        "Restart=on-failure\n"
        "RestartSec=1\n"
        "KillSignal=SIGTERM\n\n"
        "[Install]\n"
        "WantedBy=default.target"
    )


def _tail(path: Path, lines: int = 5) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
