"""`pearlctl profile RUN`: measure a serving vLLM worker of the run into an engine profile (decode speed vs
batch and context, prefill speed, KV capacity; transition costs from the journal), store it through the
daemon for the planner, and import or export profile files."""

from __future__ import annotations

from pathlib import Path

import httpx
import typer

from pearlctl.cli.app import app
from pearlctl.cli.common import (
    EXIT_NOT_FOUND,
    EXIT_SCHEDULER,
    EXIT_USAGE,
    emit_json,
    err,
    exits,
    fail,
    open_store,
    out,
    resolve_run,
)
from pearlctl.daemon.client import DaemonRefusal, call
from pearlctl.planner import profile as profiles
from pearlctl.vocabulary import GENERATION_ROLES, PoolKind, Role


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise fail(
            f"{what} must be a comma-separated list of positive integers (got {text!r}), e.g. 1,2,4,8", EXIT_USAGE
        )
    return values


@app.command()
def profile(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    worker: str = typer.Option(None, "--worker", help="URL or worker key to measure (default: a serving worker)."),
    batches: str = typer.Option("1,2,4,8,16", "--batches", help="Decode batch sizes to measure."),
    contexts: str = typer.Option("32,256", "--contexts", help="Prompt lengths (tokens) to measure decode at."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Measurements per point (medians are kept)."),
    name: str = typer.Option(None, "--name", help="Profile name (default: <run>-<worker>)."),
    out_file: Path = typer.Option(None, "--out", help="Also write the profile to this TOML file."),
    import_file: Path = typer.Option(None, "--import", help="Store this profile file instead of measuring."),
    export_file: Path = typer.Option(None, "--export", help="Write the run's stored profile to this file; no change."),
    json_out: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
    judge: bool = typer.Option(
        False,
        "--judge",
        help="The run's judge's profile (a REWARD worker, its own model): measure, import or export it.",
    ),
    slurm: bool = typer.Option(
        False, "--slurm", help="Profile on a compute node: a Slurm job starts vLLM for the run's model and measures it."
    ),
    partition: str = typer.Option(None, "--partition", help="--slurm: the job's partition (default: the pool's)."),
    nodelist: str = typer.Option(None, "--nodelist", help="--slurm: the node(s) the job may run on."),
    time_limit: str = typer.Option(None, "--time", help="--slurm: the job's time limit (default 30 minutes)."),
    gpus: int = typer.Option(1, "--gpus", min=0, help="--slurm: GPUs the job asks for (--gres=gpu:N)."),
) -> None:
    """Measure a rollout worker (or import a profile file) and store it as the run's profile; --export reads it.
    With --judge, the same for the run's judge (a REWARD worker): its profile is kept apart from the policy's."""
    with exits():
        if judge and slurm:
            raise fail("--slurm measures the policy's model; --judge measures a judge serving in the run", EXIT_USAGE)
        if slurm:
            from pearlctl.config import slurm_option_problems

            clash = [o for o, v in (("--worker", worker), ("--import", import_file), ("--export", export_file)) if v]
            if clash:
                raise fail(f"--slurm measures a vLLM server it starts itself: not with {', '.join(clash)}", EXIT_USAGE)
            bad = slurm_option_problems(partition=partition, nodelist=nodelist, time_limit=time_limit)
            if bad:
                raise fail("; ".join(str(p) for p in bad), EXIT_USAGE)
        elif partition or nodelist or time_limit or gpus != 1:
            raise fail("--partition, --nodelist, --time and --gpus only go with --slurm", EXIT_USAGE)
        run, workers, pool_of, steps = _read_run(run_ref)
        column, whose = ("judge_profile", "judge's profile") if judge else ("profile", "profile")
        if export_file is not None:
            if not run.get(column):
                again = f"pearlctl profile {run['name']}{' --judge' if judge else ''}"
                raise fail(f"run {run['id']} has no {whose} yet; measure one with `{again}`", 4)
            export_file.write_text(profiles.dumps(profiles.from_dict(run[column])))
            err.print(f"wrote the {whose} of {run['id']} to {export_file}")
            return
        if import_file is not None:
            try:
                prof = profiles.load(import_file)
            except profiles.ProfileError as exc:
                raise fail(str(exc), EXIT_USAGE) from None
        elif slurm:
            prof = _measure_on_slurm(
                run, steps, batches, contexts, repeats, name, partition, nodelist, time_limit, gpus
            )
        else:
            prof = _measure(run, workers, pool_of, steps, worker, batches, contexts, repeats, name, judge)
        try:
            call(run, "POST", "/v1/profile", {"profile": profiles.to_dict(prof), "judge": judge})
        except DaemonRefusal as exc:
            raise fail(f"the daemon refused the profile: {exc}", EXIT_USAGE) from None
        if out_file is not None:
            out_file.write_text(profiles.dumps(prof))
            err.print(f"wrote {out_file}")
        if json_out:
            emit_json(profiles.to_dict(prof))
            return
        d = prof.decode
        out.print(
            f"{prof.name}: decode itl = {d.weights_s * 1e3:.3f} ms + {d.seq_s * 1e3:.4f} ms*B"
            f" + {d.kv_s_per_token * 1e6:.4f} us*B*L; prefill {prof.prefill_tok_s:.0f} tok/s;"
            f" KV {prof.kv_capacity_tokens} tokens (stored as the {whose} of run {run['id']})",
            markup=False,
        )


def _read_run(run_ref: str) -> tuple[dict, list, dict, list[dict]]:
    """From the state database: the run, its workers, each allocation's pool (by allocation id) and its journaled
    transition steps, each with its transition's roles (the policy's profile takes the policy's engine's costs only)."""
    store = open_store(readonly=True)
    try:
        run = resolve_run(store, run_ref)
        workers = store.fleet.workers(run["id"])
        pool_of = {a.id: a.pool for a in store.fleet.allocations(run["id"])}
        steps = [
            {**s.to_dict(), "from_role": t.from_role, "to_role": t.to_role}
            for t in store.transitions.all(run["id"])
            for s in store.transitions.steps(t.id)
        ]
    finally:
        store.close()
    return run, workers, pool_of, steps


def _measure(run, workers, pool_of, steps, worker, batches, contexts, repeats, name, judge) -> profiles.Profile:
    from pearlctl.ops import profiling  # its fit needs numpy: imported by the commands that measure, not by every one

    # measured on a worker serving the policy, or with --judge the judge (each its own model)
    roles, what = ((Role.REWARD,), "the judge") if judge else (GENERATION_ROLES, "the policy")
    serving = [w for w in workers if w.state == "READY" and w.url and w.role in roles]
    if worker:
        serving = [w for w in serving if worker in (w.url, w.worker_key)]
    if not serving:
        known = ", ".join(f"{w.worker_key} ({w.url}, {w.state})" for w in workers if w.url) or "none"
        raise fail(f"no vLLM worker {worker or ''} serving {what} in run {run['id']}; workers: {known}", EXIT_NOT_FOUND)
    w = serving[0]
    starts = [x.ready_s for x in workers if x.role in roles and x.ready_s is not None]  # its engine's cold starts
    try:
        model = httpx.get(w.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        metrics = httpx.get(w.url + "/metrics", timeout=10).text
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise fail(f"worker {w.url} does not answer as a vLLM server: {exc}", 3) from None
    err.print(f"measuring {w.worker_key} at {w.url} (model {model}); this takes a minute or two")
    pool = PoolKind.REWARD if judge else pool_of.get(w.allocation_id)  # a judge runs the reward pool's engine args
    engine_args = (run["spec"].get("pools", {}).get(pool) or {}).get("engine_args") or {}
    try:
        with profiling.WorkerProbe(w.url, model) as probe:
            measurement = profiling.measure(
                probe,
                batches=_int_list(batches, "--batches"),
                contexts=_int_list(contexts, "--contexts"),
                repeats=repeats,
                metrics_text=metrics,
            )
        return profiling.build_profile(
            measurement,
            name=name or f"{run['name']}-{w.worker_key}",
            model=model if judge else run["spec"].get("model", model),
            hardware=f"worker {w.worker_key} of run {run['id']} ({w.url})",
            costs=profiles.measured_costs(steps, starts, judge=judge),
            max_num_seqs=int(engine_args.get("max_num_seqs", 256)),
            gpus_per_worker=len(w.gpu_idx or []),
            source=f"on {w.url}",
        )
    except profiling.ProfilingError as exc:  # one line, as the --slurm path's: nothing is stored
        raise fail(f"profiling {w.worker_key} at {w.url}: {exc}", EXIT_USAGE) from None


def _measure_on_slurm(run, steps, batches, contexts, repeats, name, partition, nodelist, time_limit, gpus):
    """--slurm: the daemon must answer first (it stores the profile), then one Slurm job measures."""
    from pearlctl.ops import profiling

    b, c = _int_list(batches, "--batches"), _int_list(contexts, "--contexts")
    call(run, "GET", "/v1/health")  # exit 7 now rather than after the job ran
    err.print(f"submitting a profiling job for run {run['id']} (model {run['spec'].get('model')}); minutes")
    try:
        return profiling.profile_on_slurm(
            run,
            steps,
            batches=b,
            contexts=c,
            repeats=repeats,
            name=name,
            partition=partition,
            nodelist=nodelist,
            time_limit=time_limit,
            gpus=gpus,
            progress=lambda line: err.print(line, markup=False),
        )
    except profiling.RemoteProfilingError as exc:
        raise fail(str(exc), EXIT_SCHEDULER) from None
    except profiling.ProfilingError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
