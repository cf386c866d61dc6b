"""`pearlctl launch RUN.toml`: validate, submit one array job per pool, record it all in state."""

from __future__ import annotations

from pathlib import Path

import typer

from pearlctl import policies
from pearlctl.backends import open_backend
from pearlctl.cli.app import app
from pearlctl.cli.common import EXIT_TIMEOUT, emit_json, err, exits, open_store, out
from pearlctl.config import load_spec
from pearlctl.host import home
from pearlctl.ops import launcher


@app.command()
def launch(
    spec_file: Path = typer.Argument(..., help="The run spec (TOML), e.g. examples/tiny.toml."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the exact sbatch scripts; submit and write nothing."),
    name: str = typer.Option(None, "--name", help="Override run.name."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Override run.run_dir."),
    backend: str = typer.Option(None, "--backend", help="Override run.backend: auto, slurm or local."),
    wait: bool = typer.Option(False, "--wait", help="Wait until every allocation runs, showing progress."),
    timeout: float = typer.Option(600.0, "--timeout", help="With --wait: give up waiting after this many seconds."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Submit a run: one Slurm array job per pool, one array task per node."""
    with exits():
        overrides = {
            "name": name,
            "backend": backend,
            "run_dir": str(run_dir.resolve()) if run_dir is not None else None,
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        spec = load_spec(spec_file, policies.known_policies(), given, model_on_this_host=not dry_run)
        sched = open_backend(spec.backend, state_dir=str(home.state_dir()))
        err.print(f"backend: {sched.name}")
        for warning in spec.warnings:
            err.print(f"warning: {warning}", markup=False)
        if dry_run:
            scripts = launcher.dry_run(spec, sched)
            if json_out:
                emit_json({"backend": sched.name, "scripts": dict(scripts)})
            else:
                for pool, script in scripts:
                    out.print(f"# ---- pool {pool} ----", markup=False)
                    out.print(script, markup=False, end="")
            return
        launcher.check_against_cluster(spec, sched)
        store = open_store()
        try:
            result = launcher.launch(spec, store, sched, log=lambda m: err.print(m, markup=False))
            ok = True
            if wait:
                with err.status("waiting for allocations") as spinner:

                    def show(counts: dict[str, int]) -> None:
                        spinner.update(
                            "waiting for allocations: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                        )

                    ok = launcher.wait_running(
                        store, sched, result.run_id, timeout=timeout, interval=spec.poll_interval_s, progress=show
                    )
        finally:
            store.close()
        payload = {
            "run_id": result.run_id,
            "backend": sched.name,
            "job_ids": result.job_ids,
            "adopted": result.adopted,
            "running": ok if wait else None,
        }
        if json_out:
            emit_json(payload)
        else:
            out.print(
                f"launched {result.run_id}: " + ", ".join(f"{p}={j}" for p, j in result.job_ids.items()), markup=False
            )
        if wait and not ok:
            err.print(
                f"not every allocation is running after {timeout:g}s; `pearlctl status {result.run_id}` shows why"
            )
            raise typer.Exit(EXIT_TIMEOUT)
