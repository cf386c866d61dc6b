"""`pearlctl status [RUN]`: runs, pools, allocations with their Slurm state, nodes, GPUs, workers, and the
elastic pool (size now and wanted, pending / running / draining tasks, size history; ``elastic`` in --json).

While no daemon owns the run, status refreshes state itself with one batched poll, at most once per
poll interval across all shells (pearlctl.ops.watcher.maybe_sync); ``--no-sync`` only reads.

It reads through a read-only store, and opens the state read-write only for a refresh that is due. Where
that cannot be done (a read-only state directory, a full disk) it says so in one line on stderr and
shows the state as it is.

``--timeline FILE.png`` draws the run's GPU roles over time, rebuilt from its journal (pearlctl.ops.timeline),
with the drawing ``pearlctl simulate --timeline`` uses, from the run's creation to now (or to its end);
with ``--watch`` it is drawn again at every refresh.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.live import Live

from pearlctl.backends import open_backend
from pearlctl.cli.app import app
from pearlctl.cli.common import EXIT_USAGE, emit_json, emit_json_line, err, exits, fail, open_store, out, resolve_run
from pearlctl.cli.render import runs_table, status_tables
from pearlctl.daemon.elastic_state import elastic_view
from pearlctl.host import home
from pearlctl.ops.watcher import maybe_sync
from pearlctl.router.service import view as router_view
from pearlctl.state.db import sqlite_fault
from pearlctl.state.errors import StateUnavailable
from pearlctl.state.machines import RunState
from pearlctl.state.store import Store, run_lease_name
from pearlctl.state.views import run_document
from pearlctl.vocabulary import POLL_INTERVAL_S


def _sync_due(store: Store, run: dict) -> bool:
    """The tests maybe_sync starts with, made on the read-only store: is a poll wanted now?"""
    if run["state"] not in (RunState.ACTIVE, RunState.CANCELLING, RunState.SUBMITTING):
        return False
    daemon = store.leases.get(run_lease_name(run["id"]))
    if daemon and daemon["expires_at"] > time.time():
        return False
    interval = float(run["spec"].get("poll_interval_s", POLL_INTERVAL_S))
    return time.time() - (run.get("last_poll_at") or 0.0) >= interval * 0.9


_ENDED = (RunState.CANCELLED, RunState.ENDED, RunState.FAILED)


def _timeline(store: Store, run: dict, path: Path) -> str:
    """Draw the run's GPU roles over time (its journal, read through the store) to ``path``."""
    from pearlctl.ops.timeline import reconstruct
    from pearlctl.sim.timeline import draw

    kinds = {p["name"]: p["kind"] for p in store.runs.pools(run["id"])}
    gpus = [dict(g.to_dict(), pool_kind=kinds.get(g.pool)) for g in store.fleet.gpus(run["id"])]
    journal = store.journal.read(run["id"])
    end = time.time()
    if run["state"] in _ENDED:  # when it ended: the journal row that moved it there
        ended = [j["ts"] for j in journal if j["entity"] == "runs" and j["to_state"] == run["state"]]
        end = ended[-1] if ended else run["updated_at"]
    tl = reconstruct(journal, gpus, start=run["created_at"], end=end)
    policy = f", policy {run['policy']}" if run.get("policy") else ""
    heading = f"{run['name']} ({run['backend']}{policy}): {tl.transitions} transitions, {len(tl.gpus)} GPUs"
    title = f"run {run['name']}: GPU roles from its journal ({run['state'].lower()})"
    return str(draw([(heading, tl.samples())], path, title=title, xlabel="minutes since the run was created"))


def _refresh(store: Store, run: dict, sync: bool, warned: set[str], timeline: Path | None = None) -> dict:
    if sync and _sync_due(store, run):
        try:
            writer = open_store()
            try:
                backend = open_backend(run["backend"], state_dir=str(home.state_dir()))
                maybe_sync(writer, backend, writer.runs.get(run["id"]))
            finally:
                writer.close()
        except Exception as exc:
            problem = exc if isinstance(exc, StateUnavailable) else sqlite_fault(exc, home.state_db())
            if problem is None:
                raise
            if str(problem) not in warned:  # --watch: say it once
                warned.add(str(problem))
                err.print(f"warning: not refreshing from the scheduler: {problem}", markup=False)
    doc = run_document(store, run["id"])
    elastic = elastic_view(store, run["id"])
    if elastic is not None:  # the elastic pool: size now and wanted, its tasks, its size history
        doc["elastic"] = elastic
    doc["router"] = router_view(run["run_dir"])  # the run's one OpenAI-compatible endpoint (None: none yet)
    if timeline is not None:
        doc["timeline"] = _timeline(store, doc["run"], timeline)
    return doc


def _watch(
    store: Store,
    run: dict,
    doc: dict,
    sync: bool,
    interval: float,
    json_out: bool,
    warned: set[str],
    timeline: Path | None = None,
) -> None:
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
            doc = _refresh(store, store.runs.get(run["id"]), sync, warned, timeline)
    with Live(status_tables(doc), console=out, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            doc = _refresh(store, store.runs.get(run["id"]), sync, warned, timeline)
            live.update(status_tables(doc))


@app.command()
def status(
    run_ref: str = typer.Argument(None, metavar="[RUN]", help="Run name or id (default: the newest run)."),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="One JSON object: run, pools, allocations, gpus, workers, transitions; elastic with an elastic pool.",
    ),
    watch: bool = typer.Option(
        False, "--watch", "-w", help="Refresh every poll interval (Ctrl-C stops); with --json, one document per line."
    ),
    sync: bool = typer.Option(True, "--sync/--no-sync", help="Poll the scheduler first when no daemon owns the run."),
    timeline: Path = typer.Option(
        None, "--timeline", help="Write a PNG of the run's GPU roles over time (from its journal) to this path."
    ),
) -> None:
    """Show a run's allocations (with Slurm state), nodes, GPUs and roles."""
    with exits():
        if timeline is not None and timeline.suffix.lower() != ".png":
            raise fail(f"--timeline must name a .png file (got {timeline})", EXIT_USAGE)
        store = open_store(readonly=True)
        warned: set[str] = set()
        try:
            run = resolve_run(store, run_ref)
            doc = _refresh(store, run, sync, warned, timeline)
            if json_out and not watch:
                emit_json(doc)
                return
            if not watch:
                if run_ref is None and len(store.runs.all()) > 1:
                    out.print(runs_table(store.runs.all()))
                out.print(status_tables(doc))
                if timeline is not None:
                    out.print(f"timeline: {doc['timeline']}", markup=False)
                return
            interval = float(run["spec"].get("poll_interval_s", POLL_INTERVAL_S))
            try:
                _watch(store, run, doc, sync, interval, json_out, warned, timeline)
            except KeyboardInterrupt:
                err.print("stopped watching")
        finally:
            store.close()
