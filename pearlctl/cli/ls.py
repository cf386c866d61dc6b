"""`pearlctl ls`: every run in the state, oldest first (id, name, state, backend, policy, created, run_dir).
It reads through a read-only store, like `status`."""

from __future__ import annotations

import datetime as dt

import typer
from rich.table import Table
from rich.text import Text

from pearlctl.cli.app import app
from pearlctl.cli.common import emit_json, exits, open_store, out
from pearlctl.cli.render import STATE_STYLE

FIELDS = ("id", "name", "state", "backend", "policy", "created_at", "updated_at", "run_dir", "spec_path")


def _created(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


@app.command("ls")
def ls(
    json_out: bool = typer.Option(
        False, "--json", help="One JSON list, one object per run: " + ", ".join(FIELDS) + " (times: epoch seconds)."
    ),
) -> None:
    """List every run: id, name, state, backend, policy, created, run directory."""
    with exits():
        store = open_store(readonly=True)
        try:
            runs = sorted(store.runs.all(), key=lambda r: (r["created_at"], r["id"]))
        finally:
            store.close()
        if json_out:
            emit_json([{key: r.get(key) for key in FIELDS} for r in runs])
            return
        if not runs:
            out.print("no runs yet; start one with `pearlctl launch RUN.toml`", markup=False)
            return
        table = Table(box=None)
        for col in ("id", "name", "state", "backend", "policy", "created", "run_dir"):
            table.add_column(col, no_wrap=col in ("id", "name"))
        for r in runs:
            table.add_row(
                r["id"],
                r["name"],
                Text(str(r["state"]), style=STATE_STYLE.get(str(r["state"]), "")),
                r["backend"],
                r.get("policy") or "-",
                _created(r["created_at"]),
                r.get("run_dir") or "-",
            )
        out.print(table)
