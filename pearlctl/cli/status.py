"""`pearlctl status [RUN]`: runs, pools, allocations with their Slurm state, nodes, GPUs, workers.

While no daemon owns the run, status refreshes state itself with one batched poll, at most once per
poll interval across all shells (pearlctl.watcher.maybe_sync); ``--no-sync`` only reads.
"""

from __future__ import annotations

import time

import typer
from rich.live import Live

from pearlctl import home
from pearlctl.backends import open_backend
from pearlctl.cli import app
from pearlctl.cli.common import emit_json, emit_json_line, err, exits, open_store, out, resolve_run
from pearlctl.cli.render import runs_table, status_tables
from pearlctl.state.store import Store
from pearlctl.state.views import run_document
from pearlctl.watcher import maybe_sync


def _refresh(store: Store, run: dict, sync: bool) -> dict:
    if sync:
        backend = open_backend(run["backend"], state_dir=str(home.state_dir()))
        maybe_sync(store, backend, run)
    return run_document(store, run["id"])


def _watch(store: Store, run: dict, doc: dict, sync: bool, interval: float, json_out: bool) -> None:
    """Refresh every poll interval: in place on a terminal; appended (one JSON line each with --json)
    when the output is a pipe or a file, so a log of the run's progress can be kept."""
    if json_out or not out.is_terminal:
        while True:
            if json_out:
                emit_json_line(doc)
            else:
                out.rule(time.strftime("%H:%M:%S"))
                out.print(status_tables(doc))
            time.sleep(interval)
            doc = _refresh(store, store.get_run(run["id"]), sync)
    with Live(status_tables(doc), console=out, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            doc = _refresh(store, store.get_run(run["id"]), sync)
            live.update(status_tables(doc))


@app.command()
def status(
    run_ref: str = typer.Argument(None, metavar="[RUN]", help="Run name or id (default: the newest run)."),
    json_out: bool = typer.Option(
        False, "--json", help="One JSON object: run, pools, allocations, gpus, workers, transitions."
    ),
    watch: bool = typer.Option(
        False, "--watch", "-w", help="Refresh every poll interval (Ctrl-C stops); with --json, one document per line."
    ),
    sync: bool = typer.Option(True, "--sync/--no-sync", help="Poll the scheduler first when no daemon owns the run."),
) -> None:
    """Show a run's allocations (with Slurm state), nodes, GPUs and roles."""
    with exits():
        store = open_store()
        try:
            run = resolve_run(store, run_ref)
            doc = _refresh(store, run, sync)
            if json_out and not watch:
                emit_json(doc)
                return
            if not watch:
                if run_ref is None and len(store.list_runs()) > 1:
                    out.print(runs_table(store.list_runs()))
                out.print(status_tables(doc))
                return
            interval = float(run["spec"].get("poll_interval_s", 5.0))
            try:
                _watch(store, run, doc, sync, interval, json_out)
            except KeyboardInterrupt:
                err.print("stopped watching")
        finally:
            store.close()
