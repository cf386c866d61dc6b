"""`pearlctl journal RUN`: the append-only log of what pearlctl intended, did and observed."""

from __future__ import annotations

import datetime as dt
import json

import typer

from pearlctl.cli.app import app
from pearlctl.cli.common import emit_json, exits, open_store, out, resolve_run


@app.command()
def journal(
    run_ref: str = typer.Argument(None, metavar="[RUN]", help="Run name or id (default: the newest run)."),
    json_out: bool = typer.Option(False, "--json", help="Print the entries as a JSON list."),
    since: int = typer.Option(0, "--since", help="Only entries after this journal id."),
) -> None:
    """Print the run's journal: state changes, step intents and outcomes, observations."""
    with exits():
        store = open_store(readonly=True)
        try:
            run = resolve_run(store, run_ref)
            rows = store.journal.read(run["id"], since_id=since)
        finally:
            store.close()
        if json_out:
            emit_json(rows)
            return
        for r in rows:
            when = dt.datetime.fromtimestamp(r["ts"]).strftime("%H:%M:%S.%f")[:-3]
            edge = f" {r['from_state'] or '-'} -> {r['to_state']}" if r["to_state"] else ""
            data = f" {json.dumps(r['data'], default=str)}" if r["data"] else ""
            out.print(f"{r['id']:>6} {when} {r['entity']}:{r['entity_id']} {r['event']}{edge}{data}", markup=False)
