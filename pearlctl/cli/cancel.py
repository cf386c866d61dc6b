"""`pearlctl cancel RUN`: scancel every job of the run and wait until state says they ended."""

from __future__ import annotations

import typer

from pearlctl import home, launcher
from pearlctl.backends import open_backend
from pearlctl.cli import app
from pearlctl.cli.common import EXIT_TIMEOUT, err, exits, open_store, out, resolve_run


@app.command()
def cancel(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for Slurm to end the jobs."),
) -> None:
    """Cancel every allocation of a run; the run ends CANCELLED with every allocation ENDED."""
    with exits():
        store = open_store()
        try:
            run = resolve_run(store, run_ref)
            backend = open_backend(run["backend"], state_dir=str(home.state_dir()))
            err.print(f"cancelling {run['id']} ({run['state']})")
            done = launcher.cancel(store, backend, run["id"], timeout=timeout)
            run = store.get_run(run["id"])
        finally:
            store.close()
        if not done:
            err.print(f"Slurm has not ended every job after {timeout:g}s; run `pearlctl cancel {run['name']}` again")
            raise typer.Exit(EXIT_TIMEOUT)
        out.print(f"{run['id']} {run['state']}", markup=False)
