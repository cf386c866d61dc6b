"""`pearlctl cancel RUN`: scancel every job of the run and wait until state says they ended; the run's router
stops with it."""

from __future__ import annotations

import typer

from pearlctl.backends import open_backend
from pearlctl.cli.app import app
from pearlctl.cli.common import EXIT_TIMEOUT, emit_json, err, exits, open_store, out, resolve_run
from pearlctl.host import home
from pearlctl.ops import launcher
from pearlctl.router import service as router_service


@app.command()
def cancel(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds to wait for Slurm to end the jobs."),
    json_out: bool = typer.Option(
        False, "--json", help="Print one JSON object: id, name, state, all_ended (also on a timeout, exit 124)."
    ),
) -> None:
    """Cancel every allocation of a run; the run ends CANCELLED with every allocation ENDED."""
    with exits():
        store = open_store()
        try:
            run = resolve_run(store, run_ref)
            backend = open_backend(run["backend"], state_dir=str(home.state_dir()))
            err.print(f"cancelling {run['id']} ({run['state']})")
            done = launcher.cancel(store, backend, run["id"], timeout=timeout)
            run = store.runs.get(run["id"])
        finally:
            store.close()
        _stop_router(run)
        if json_out:
            emit_json({"id": run["id"], "name": run["name"], "state": run["state"], "all_ended": bool(done)})
        if not done:
            err.print(f"Slurm has not ended every job after {timeout:g}s; run `pearlctl cancel {run['name']}` again")
            raise typer.Exit(EXIT_TIMEOUT)
        if not json_out:
            out.print(f"{run['id']} {run['state']}", markup=False)


def _stop_router(run: dict) -> None:
    """The run's router serves nobody once the run is cancelled. Its daemon stops it when it sees the run
    over; this stops it too when the daemon is gone (the gateway outlives a daemon by design). Only a
    gateway running on this host can be stopped from here."""
    record = router_service.read_record(run["run_dir"]) if run.get("run_dir") else None
    if record is None:
        return
    if router_service.same_process(record.pid, record.start_ticks):
        router_service.stop(record, run_dir=run["run_dir"])
        err.print(f"stopped the run's router (pid {record.pid}, {record.base_url})")
    else:
        err.print(
            f"the run's router (pid {record.pid}) is no live process on this host; "
            "if it runs elsewhere, its daemon stops it"
        )
