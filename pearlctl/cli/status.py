"""`pearlctl status [RUN]`: runs, pools, allocations with their Slurm state, nodes, GPUs, workers.

While no daemon owns the run, status refreshes state itself with one batched poll, at most once per
poll interval across all shells (pearlctl.watcher.maybe_sync); ``--no-sync`` only reads.
"""

from __future__ import annotations

import json
import time

import typer
from rich.console import Group
from rich.live import Live

from pearlctl import home
from pearlctl.backends import open_backend
from pearlctl.cli import app
from pearlctl.cli.common import emit_json, err, exits, open_store, out, resolve_run
from pearlctl.cli.render import runs_table, status_document, status_tables
from pearlctl.state.store import Store
from pearlctl.watcher import maybe_sync


def _document(store: Store, run_id: str) -> dict:
    return status_document(
        store.get_run(run_id),
        store.pools(run_id),
        store.allocations(run_id),
        store.gpus(run_id),
        store.workers(run_id),
        store.transitions(run_id),
        store.nodes(run_id),
    )


def _refresh(store: Store, run: dict, sync: bool) -> dict:
    if sync:
        backend = open_backend(run["backend"], state_dir=str(home.state_dir()))
        maybe_sync(store, backend, run)
    return _document(store, run["id"])


@app.command()
def status(
    run_ref: str = typer.Argument(None, metavar="[RUN]", help="Run name or id (default: the newest run)."),
    json_out: bool = typer.Option(
        False, "--json", help="One JSON object: run, pools, allocations, gpus, workers, transitions."
    ),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh live every poll interval (Ctrl-C to stop)."),
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
            with Live(status_tables(doc), console=out, refresh_per_second=4) as live:
                try:
                    while True:
                        time.sleep(interval)
                        run = store.get_run(run["id"])
                        doc = _refresh(store, run, sync)
                        live.update(Group(status_tables(doc)) if not json_out else json.dumps(doc, default=str))
                except KeyboardInterrupt:
                    err.print("stopped watching")
        finally:
            store.close()
