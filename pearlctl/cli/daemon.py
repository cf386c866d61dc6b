"""`pearlctl daemon RUN`: start the run's daemon (detached, or in the foreground for debugging)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import typer

from pearlctl import home
from pearlctl.backends import open_backend
from pearlctl.cli import app
from pearlctl.cli.common import EXIT_CONFLICT, EXIT_TIMEOUT, emit_json, err, exits, fail, open_store, resolve_run
from pearlctl.daemon.main import Daemon, DaemonRefused, DaemonSettings
from pearlctl.runfiles import read_address


@app.command()
def daemon(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    foreground: bool = typer.Option(False, "--foreground", help="Stay in the foreground and log to stderr."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address the control API binds to."),
    port: int = typer.Option(0, "--port", help="Port of the control API (0: any free port)."),
    advertise: str = typer.Option(None, "--advertise", help="Host name agents should use (default: this host)."),
    heartbeat_s: float = typer.Option(2.0, "--heartbeat-s", help="Agent heartbeat interval."),
    lease_ttl_s: float = typer.Option(6.0, "--lease-ttl-s", help="How long the run's lease outlives a stalled daemon."),
    json_out: bool = typer.Option(False, "--json", help="Print where the daemon listens as JSON."),
) -> None:
    """Run the daemon of RUN: the single writer of its state, serving agents on an authenticated API."""
    with exits():
        store = open_store()
        run = resolve_run(store, run_ref)
        settings = DaemonSettings(
            host=host, port=port, advertise=advertise, heartbeat_s=heartbeat_s, lease_ttl_s=lease_ttl_s
        )
        if foreground:
            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
            d = Daemon(store, open_backend(run["backend"], state_dir=str(home.state_dir())), run["id"], settings)
            d.install_signal_handlers()
            try:
                d.run()
            except DaemonRefused as exc:
                raise fail(str(exc), EXIT_CONFLICT) from None
            finally:
                store.close()
            return
        store.close()
        before = read_address(run["run_dir"]) or {}
        log_path = Path(run["run_dir"], "logs", "daemon.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "pearlctl",
            "daemon",
            run["id"],
            "--foreground",
            "--host",
            host,
            "--port",
            str(port),
            "--heartbeat-s",
            str(heartbeat_s),
            "--lease-ttl-s",
            str(lease_ttl_s),
        ]
        if advertise:
            argv += ["--advertise", advertise]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            address = read_address(run["run_dir"]) or {}
            if address.get("pid") == proc.pid and address != before:
                if json_out:
                    emit_json(address)
                else:
                    err.print(f"daemon of {run['id']} running (pid {proc.pid}), log {log_path}")
                    print(address["url"])
                return
            if proc.poll() is not None:
                tail = log_path.read_text().splitlines()[-5:]
                raise fail(
                    "the daemon exited at start:\n" + "\n".join(tail),
                    EXIT_CONFLICT if proc.returncode == EXIT_CONFLICT else proc.returncode or 1,
                )
            time.sleep(0.1)
        raise fail(f"the daemon did not write its address within 30s; see {log_path}", EXIT_TIMEOUT)
