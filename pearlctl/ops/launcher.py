"""Launch and cancel a run: validate against the cluster, record intent, submit, record Slurm ids.

Order of writes (crash safety, docs/architecture.md): the run, its pools and one REQUESTED allocation per array
task are written *before* anything is submitted; each pool's Slurm id is recorded right after its
``sbatch`` returns. A launch that crashed in between is finished by launching the same run again:
pools without an id are first looked up by job name (``pearl.<run_id>.<pool>``) and adopted, so no
pool is ever submitted twice. A failed submission cancels what was already submitted and leaves the
run FAILED with every allocation ENDED.

``grow_request`` is the submission of one more task of a pool, built from the same request as its launch
(pearlctl.daemon.elastic grows the elastic pool with it); ``cancel`` ends those added tasks too, each
being its own job.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pearlctl.backends import Backend, BackendError
from pearlctl.config import DEFAULT_PENDING_TIMEOUT_S, PoolSpec, RunSpec, SpecError, SpecProblem
from pearlctl.config.spec import judge_model
from pearlctl.host.home import REPO_ROOT, WORKER_SCRIPT
from pearlctl.host.runfiles import ensure_secret
from pearlctl.ops.watcher import sync_run
from pearlctl.slurm.script import SubmitRequest, job_name, render_script
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import RunState
from pearlctl.state.store import Store
from pearlctl.trainer.broadcast import BROADCAST_ENV, server_engine_args
from pearlctl.vocabulary import POOL_KINDS, PoolKind, ServingEngine, one_job_of_nodes

POOL_ORDER = tuple(str(k) for k in POOL_KINDS)  # the trainer first


class LaunchError(Exception):
    """The launch could not go on; ``exit_code`` is the CLI's documented code for it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def check_against_cluster(spec: RunSpec, backend: Backend) -> None:
    """Partition names, GPUs per node and node counts checked against what the scheduler reports."""
    if backend.name == "local":
        return  # one node, engines on CPU: partitions and GPU counts do not apply (docs/backends.md)
    parts = backend.partitions()
    default = next((p.name for p in parts.values() if p.default), None)
    problems: list[SpecProblem] = []
    for pool in spec.pools.values():
        key = f"pools.{pool.name}"
        name = pool.partition or default
        if name is None:
            problems.append(SpecProblem(f"{key}.partition", f"no default partition; choose one of {', '.join(parts)}"))
            continue
        info = parts.get(name)
        if info is None:
            problems.append(
                SpecProblem(f"{key}.partition", f"sinfo knows no partition {name!r}; valid: {', '.join(sorted(parts))}")
            )
            continue
        if pool.gpus_per_node > info.max_gpus_per_node:
            problems.append(
                SpecProblem(
                    f"{key}.gpus_per_node",
                    f"{pool.gpus_per_node} GPUs, but nodes of partition {name!r} have at most {info.max_gpus_per_node}",
                )
            )
        if pool.name != PoolKind.ELASTIC and pool.nodes > info.nodes:
            problems.append(
                SpecProblem(
                    f"{key}.nodes", f"{pool.nodes} nodes, but partition {name!r} has {info.nodes}: it could never start"
                )
            )
    if problems:
        raise SpecError(str(spec.source), problems)


def requests_for(spec: RunSpec, run_id: str) -> list[SubmitRequest]:
    pools = [spec.pools[name] for name in POOL_ORDER if name in spec.pools]
    if any(p.weights == "broadcast" for p in pools):  # the trainer's rank 0 sends each version (docs/weights.md)
        pools = [
            dataclasses.replace(p, env={BROADCAST_ENV: "1", **p.env}) if p.name == PoolKind.TRAINER else p
            for p in pools
        ]
    engine = {"engine": spec.engine, "engine_profile": str(spec.engine_profile) if spec.engine_profile else None}
    local = _local_models(spec.to_dict())
    return [
        _pool_request(
            p, run_id=run_id, run_dir=str(spec.run_dir), model=p.model or str(spec.model), local_models=local, **engine
        )
        for p in pools
    ]


def _local_models(stored: dict) -> tuple[str, ...]:
    """The models every node of a run keeps in its weight store (pearlctl.host.weight_store) besides its pool's
    own: the judge's, when the run has one and serves vLLM (any GPU may shift to judging)."""
    judge = judge_model(stored)
    return (judge,) if judge and (stored.get("engine") or ServingEngine.VLLM) == ServingEngine.VLLM else ()


def _pool_request(
    pool: PoolSpec,
    *,
    run_id: str,
    run_dir: str,
    model: str,
    first_task: int = 0,
    engine: str = "vllm",
    engine_profile: str | None = None,
    local_models: tuple[str, ...] = (),
) -> SubmitRequest:
    """The submission of ``pool``: all its launch tasks, or (``first_task``) one task added to it. A trainer
    of several nodes is one multi-node job (``gang``): one distributed trainer, started and requeued whole."""
    gang = one_job_of_nodes(pool.name, pool.nodes) and not first_task
    return SubmitRequest(
        array=not gang,
        gang=gang,
        run_id=run_id,
        pool=pool.name,
        role=pool.role,
        array_size=1 if first_task else pool.nodes,
        gpus_per_node=pool.gpus_per_node,
        run_dir=run_dir,
        model=model,
        python=sys.executable,
        worker_script=str(WORKER_SCRIPT),
        partition=pool.partition,
        time_limit=pool.time_limit,
        account=pool.account,
        qos=pool.qos,
        cpus_per_task=pool.cpus_per_task,
        mem=pool.mem,
        constraint=pool.constraint,
        exclude=pool.exclude,
        requeue=pool.requeue,
        preempt_signal=pool.preempt_signal,
        preempt_notice_s=pool.preempt_notice_s,
        command=pool.command,
        train_command=_expand(pool.train_command, model=model, run_dir=run_dir),
        # weights = "broadcast": the pearl_gloo receiver, so trainer rank 0 can send each version (docs/weights.md)
        engine_args={**pool.engine_args, **server_engine_args()} if pool.weights == "broadcast" else pool.engine_args,
        env=pool.env,
        first_task=first_task,
        engine=engine,
        engine_profile=engine_profile,
        local_models=local_models,
    )


def pool_spec_of(run: dict, pool: str) -> PoolSpec:
    """A pool's spec as the run recorded it at launch (``runs.spec``). Keys a later pearlctl added to
    PoolSpec take their defaults; raises KeyError naming the pool when the run has no such pool."""
    pools = run["spec"].get("pools") or {}
    if pool not in pools:
        raise KeyError(f"run {run['id']} has no pool {pool!r}; its pools: {', '.join(pools) or 'none'}")
    raw = dict(pools[pool])
    known = {f.name for f in dataclasses.fields(PoolSpec)}
    fields = {k: v for k, v in raw.items() if k in known}
    for key in ("command", "train_command"):
        if fields.get(key) is not None:
            fields[key] = tuple(fields[key])
    if pool == PoolKind.ELASTIC and fields.get("pending_timeout_s") is None:
        fields["pending_timeout_s"] = DEFAULT_PENDING_TIMEOUT_S  # a run launched before the key existed
    return PoolSpec(**fields)


def grow_request(run: dict, pool: str, task_index: int) -> SubmitRequest:
    """The submission of one more task of ``pool`` (an elastic pool growing): the same wrapper, environment,
    partition and job name (``pearl.<run_id>.<pool>``) as the pool's launch, as a one-task array whose only
    task is ``task_index`` (``--array=K``), so state keys it ``(its job id, K)`` like every other task."""
    if task_index < 1:
        raise ValueError(f"an added task's index must be >= 1 (index 0 is the launch's), got {task_index}")
    spec = pool_spec_of(run, pool)
    return _pool_request(
        spec,
        run_id=run["id"],
        run_dir=run["run_dir"],
        model=spec.model or str(run["spec"].get("model", "")),
        first_task=task_index,
        engine=run["spec"].get("engine") or "vllm",  # a run launched before the key existed ran vLLM
        engine_profile=run["spec"].get("engine_profile"),
        local_models=_local_models(run["spec"]),
    )


def _move_run(
    store: Store, run_id: str, *, to: str, event: str, expect: str | None = None, data: dict | None = None
) -> None:
    """Move the run to ``to``, compare-and-set on the version just read and on ``expect`` (default: the
    state just read), so a concurrent writer makes this fail loudly (StaleWrite) instead of being undone."""
    run = store.runs.get(run_id)
    store.set_state(
        "runs", run_id, expect=expect or run["state"], expect_version=run["version"], to=to, event=event, data=data
    )


def expand_command(argv: tuple[str, ...] | None, spec: RunSpec) -> tuple[str, ...] | None:
    """Fill ``{python}``, ``{repo}``, ``{model}`` and ``{run_dir}`` in a pool's command, so a shipped spec
    needs no absolute paths. Other braces are left alone."""
    return _expand(argv, model=str(spec.model), run_dir=str(spec.run_dir))


def _expand(argv: tuple[str, ...] | None, *, model: str, run_dir: str) -> tuple[str, ...] | None:
    if not argv:
        return argv
    values = {"python": sys.executable, "repo": str(REPO_ROOT), "model": model, "run_dir": run_dir}

    class Keep(dict):
        def __missing__(self, key):
            return "{" + key + "}"

    return tuple(a.format_map(Keep(values)) for a in argv)


def new_run_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


@dataclass
class LaunchResult:
    run_id: str
    adopted: list[str]
    job_ids: dict[str, str]


def launch(
    spec: RunSpec, store: Store, backend: Backend, *, log: Callable[[str], None] = lambda m: None
) -> LaunchResult:
    """Submit every pool of a validated spec; returns the run id and each pool's job id."""
    existing = store.runs.find(spec.name)
    if existing is not None and existing["state"] not in (RunState.CREATED, RunState.SUBMITTING):
        raise LaunchError(
            f"run {spec.name!r} already exists ({existing['id']}, {existing['state']}); "
            "choose another name with --name",
            5,
        )
    resuming = existing is not None
    if resuming:
        run_id = existing["id"]
        log(f"resuming the launch of {run_id} (state {existing['state']}): adopting what was submitted")
    else:
        run_id = new_run_id(spec.name)
    reqs = requests_for(spec, run_id)
    Path(spec.run_dir, "logs").mkdir(parents=True, exist_ok=True)
    Path(spec.run_dir, "jobs").mkdir(parents=True, exist_ok=True)
    ensure_secret(spec.run_dir)  # the run's API token (mode 0600) for the daemon, agents and trainer hook
    if not resuming:
        _create_run(spec, store, backend, run_id, reqs)
    if store.runs.get(run_id)["state"] == RunState.CREATED:
        _move_run(store, run_id, expect=RunState.CREATED, to=RunState.SUBMITTING, event="submitting")
    pools = {p["name"]: p for p in store.runs.pools(run_id)}
    adopted: list[str] = []
    job_ids: dict[str, str] = {}
    try:
        for req in reqs:
            pool = pools[req.pool]
            job_id = pool["job_id"]
            if job_id is None and resuming:
                found = backend.find_by_name(job_name(run_id, req.pool))
                if found:
                    job_id = found[0].job_id
                    adopted.append(req.pool)
                    store.update_fields("pools", pool["id"], event="adopted", data={"job_id": job_id}, job_id=job_id)
            if job_id is None:
                script = render_script(req)
                Path(spec.run_dir, "jobs", f"{req.pool}.sbatch").write_text(script)
                job_id = backend.submit(req, script)
                store.update_fields("pools", pool["id"], event="submitted", data={"job_id": job_id}, job_id=job_id)
                log(f"submitted pool {req.pool}: job {job_id} ({req.array_size} task(s))")
            job_ids[req.pool] = job_id
            for alloc in store.fleet.allocations(run_id):
                if alloc.pool_id == pool["id"] and alloc.state == A.REQUESTED:
                    store.set_state(
                        "allocations",
                        alloc.id,
                        expect=A.REQUESTED,
                        expect_version=alloc.version,
                        to=A.PENDING,
                        event="submitted",
                        job_id=job_id,
                    )
    except BackendError as exc:
        _abort(store, backend, run_id, job_ids, str(exc))
        raise LaunchError(f"submission failed, run {run_id} cancelled: {exc}", 3) from exc
    _move_run(
        store, run_id, expect=RunState.SUBMITTING, to=RunState.ACTIVE, event="submitted", data={"job_ids": job_ids}
    )
    return LaunchResult(run_id, adopted, job_ids)


def _create_run(spec: RunSpec, store: Store, backend: Backend, run_id: str, reqs: list[SubmitRequest]) -> None:
    """Write the run's row and one pool row per job request (the first launch of ``spec``)."""
    store.runs.create(
        run_id=run_id,
        name=spec.name,
        spec=spec.to_dict(),
        spec_path=str(spec.source),
        run_dir=str(spec.run_dir),
        backend=backend.name,
        policy=spec.policy,
        pools=[
            {
                "name": r.pool,
                "kind": r.pool,
                "role": r.role,
                "partition": r.partition,
                "nodes": r.array_size,
                "gpus_per_node": r.gpus_per_node,
                "job_name": r.job_name,
            }
            for r in reqs
        ],
    )


def _abort(store: Store, backend: Backend, run_id: str, job_ids: dict[str, str], why: str) -> None:
    try:
        backend.cancel(list(job_ids.values()))
    except BackendError:
        pass  # reported below through the journal; the allocations are ended either way
    for alloc in store.fleet.allocations(run_id):
        if alloc.state in (A.REQUESTED, A.PENDING):
            store.set_state(
                "allocations",
                alloc.id,
                expect=alloc.state,
                expect_version=alloc.version,
                to=A.ENDED,
                event="launch failed",
                data={"why": why},
            )
    _move_run(store, run_id, to=RunState.FAILED, event="launch failed", data={"why": why, "cancelled": job_ids})


def wait_running(
    store: Store,
    backend: Backend,
    run_id: str,
    *,
    timeout: float,
    interval: float,
    progress: Callable[[dict[str, int]], None] = lambda c: None,
) -> bool:
    """Poll until every allocation runs (True) or the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        sync_run(store, backend, run_id)
        counts: dict[str, int] = {}
        for alloc in store.fleet.allocations(run_id):
            counts[alloc.state] = counts.get(alloc.state, 0) + 1
        progress(counts)
        if set(counts) == {A.RUNNING}:
            return True
        if A.ENDED in counts or time.monotonic() >= deadline:
            return False
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def cancel(store: Store, backend: Backend, run_id: str, *, timeout: float = 60.0, interval: float = 1.0) -> bool:
    """scancel every job of the run (one call), then poll until each allocation has ENDED.

    Returns True when the run is CANCELLED. False leaves it CANCELLING (Slurm still ending jobs);
    cancelling again picks up from there.
    """
    run = store.runs.get(run_id)
    if run["state"] in (RunState.CANCELLED, RunState.ENDED, RunState.FAILED):
        return True
    if run["state"] != RunState.CANCELLING:
        _move_run(store, run_id, expect=run["state"], to=RunState.CANCELLING, event="cancel requested")
    # every pool's launch job, and the tasks an elastic pool added (each its own job id, pearlctl.daemon.elastic)
    job_ids = sorted(
        {p["job_id"] for p in store.runs.pools(run_id) if p["job_id"]}
        | {a.job_id for a in store.fleet.allocations(run_id) if a.job_id and a.state != A.ENDED}
    )
    names = [job_name(run_id, DAEMON_POOL)]  # the daemon's job too: SIGTERM stops it cleanly
    # an added task whose job id a crash kept out of state is found by its pool's name
    names += [p["job_name"] for p in store.runs.pools(run_id) if p["kind"] == PoolKind.ELASTIC]
    found = [r.job_id for name in names for r in backend.find_by_name(name) if r.phase != "ENDED"]
    backend.cancel(sorted(set(job_ids) | set(found)))
    for alloc in store.fleet.allocations(run_id):
        if alloc.state == A.REQUESTED:
            store.set_state(
                "allocations",
                alloc.id,
                expect=A.REQUESTED,
                expect_version=alloc.version,
                to=A.ENDED,
                event="cancelled before submission",
            )
    deadline = time.monotonic() + timeout
    while True:
        sync_run(store, backend, run_id)
        live = [a for a in store.fleet.allocations(run_id) if a.state != A.ENDED]
        if all(a.state == A.LOST for a in live):
            for a in live:  # gone from Slurm after scancel: that is the end we asked for
                store.set_state(
                    "allocations",
                    a.id,
                    expect=A.LOST,
                    expect_version=a.version,
                    to=A.ENDED,
                    event="cancelled",
                    data={"was": "LOST"},
                )
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    _move_run(
        store, run_id, expect=RunState.CANCELLING, to=RunState.CANCELLED, event="cancelled", data={"job_ids": job_ids}
    )
    return True


DAEMON_POOL = "daemon"  # the job name of a run's daemon when it runs as a Slurm job: pearl.<run_id>.daemon


def daemon_request(
    run: dict,
    argv: tuple[str, ...],
    *,
    env: dict[str, str],
    partition: str | None = None,
    nodelist: str | None = None,
    time_limit: str | None = None,
) -> SubmitRequest:
    """The daemon of ``run`` as a small Slurm job: one task, one CPU, no GPU, run by the same worker
    wrapper (which forwards scancel's SIGTERM, so the daemon stops cleanly and leaves every worker).
    The state directory must be on that node's local disk: pin the job with ``nodelist``.

    Raises LaunchError (exit 2) for an option that is not a valid Slurm value (checked like a spec's) and
    for an exported variable holding a control character: nothing is ever rendered from either."""
    from pearlctl.config import has_control, slurm_option_problems

    problems = slurm_option_problems(partition=partition, nodelist=nodelist, time_limit=time_limit)
    problems += [
        SpecProblem(
            "$" + (repr(k) if has_control(k) else k),
            "holds a control character (a newline, tab, ...); unset it or fix it to run the daemon job",
        )
        for k, v in env.items()
        if has_control(k) or has_control(v)
    ]
    if problems:
        raise LaunchError("invalid daemon job options: " + "; ".join(str(p) for p in problems), 2)
    return SubmitRequest(
        run_id=run["id"],
        pool=DAEMON_POOL,
        role="DAEMON",
        array_size=1,
        gpus_per_node=0,
        run_dir=run["run_dir"],
        model=run["spec"].get("model", ""),
        python=sys.executable,
        worker_script=str(WORKER_SCRIPT),
        partition=partition,
        time_limit=time_limit,
        cpus_per_task=1,
        command=argv,
        env=env,
        array=False,
        nodelist=nodelist,
        requeue=True,  # a lost node or a preemption brings the daemon's job back (its supervisor restarts crashes)
    )


def submit_daemon(backend: Backend, req: SubmitRequest) -> str:
    """Submit the daemon job unless one of the run's is already queued or running; returns its job id."""
    queued = [r for r in backend.find_by_name(req.job_name) if r.phase != "ENDED"]
    if queued:
        raise LaunchError(
            f"a daemon job of run {req.run_id} is already in Slurm (job {queued[0].job_id}, {queued[0].phase}); "
            "scancel it first, or wait for it to start",
            5,
        )
    return backend.submit(req, render_script(req))


def dry_run(spec: RunSpec, backend: Backend) -> list[tuple[str, str]]:
    """The exact scripts ``launch`` would submit, as (pool, script) pairs. Writes nothing."""
    check_against_cluster(spec, backend)
    run_id = f"{spec.name}-DRYRUN"
    return [(req.pool, render_script(req)) for req in requests_for(spec, run_id)]
