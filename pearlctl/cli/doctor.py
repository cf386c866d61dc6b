"""`pearlctl doctor`: what works on this machine, and what to do about what does not."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from pearlctl.cli.app import app
from pearlctl.cli.common import EXIT_DOCTOR, emit_json, exits, out
from pearlctl.ops.doctor import FAIL, run_checks

STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@app.command()
def doctor(json_out: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
    """Check Slurm reachability and version, engines, and the state file. Exit 6 if a check fails."""
    with exits():
        checks = run_checks()
        if json_out:
            emit_json([c.__dict__ for c in checks])
        else:
            table = Table(show_header=False, box=None)
            for c in checks:
                table.add_row(c.name, Text(c.status, style=STYLE[c.status]), Text(c.detail))
            out.print(table)
        if any(c.status == FAIL for c in checks):
            raise typer.Exit(EXIT_DOCTOR)
