"""Render a pool's sbatch script from a request object. Pure: the rendered text is a value that
``launch --dry-run`` prints and ``launch`` submits unchanged.

One pool = one array job; one array task = one node's worker (``--nodes=1`` per task). A trainer pool of
several nodes is instead one multi-node job (``gang``): Slurm starts its nodes together and requeues them
together, which one distributed trainer needs (its ranks rendezvous, and resume from one joint checkpoint).
Its batch script ``srun``s ``jobs/worker.sh`` once per node; task ``t`` (``SLURM_NODEID``) is node rank ``t``
and keys the allocation ``(job id, t)`` like an array task. Its preemption notice goes to the step's
processes, not the batch shell (``srun`` would forward it there anyway): the agent drains, and the workers
it starts ignore that signal unless they handle it (pearlctl.agent.workers). An elastic pool
that grows gets one more single-task array per added task, under the same job name, with the next free
task index (``first_task``: ``--array=K``), so every task of a pool is ``(job id, task index)`` with
task indices unique within the pool (pearlctl.daemon.elastic). The body
exports the worker's environment and execs ``jobs/worker.sh``, the same wrapper the hand-usable
``jobs/*.sbatch`` files exec. Elastic pools get ``--requeue`` and a preemption signal delivered to
the batch shell (``B:``) ahead of the kill; USR1 is never used (NCCL may claim it).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from pearlctl.vocabulary import ServingEngine

# C0 control characters and DEL. A newline in a ``#SBATCH`` line ends sbatch's directives there and
# starts a shell command; none is ever rendered (pearlctl.config refuses them in specs already).
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SubmitRequest:
    run_id: str
    pool: str
    role: str
    array_size: int
    gpus_per_node: int
    run_dir: str
    model: str
    python: str
    worker_script: str  # absolute path of jobs/worker.sh
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    requeue: bool = False
    preempt_signal: str = "USR2"
    preempt_notice_s: int = 60
    command: tuple[str, ...] | None = None
    train_command: tuple[str, ...] | None = None
    engine_args: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    array: bool = True  # False: a single job (the daemon), no --array
    first_task: int = 0  # the first array task index: an elastic pool's added task is --array=K
    nodelist: str | None = None
    gang: bool = False  # the array_size nodes as one multi-node job, an srun task per node (not an array)
    engine: str = (
        ServingEngine.VLLM
    )  # what vLLM workers run: "vllm", or "paced" timed by engine_profile (a profile TOML)
    engine_profile: str | None = None
    # models the node's weight store keeps local besides the pool's own (the judge, on every node that may serve
    # it): PEARL_STORE_MODELS, read by the agent (pearlctl.host.weight_store)
    local_models: tuple[str, ...] = ()

    @property
    def job_name(self) -> str:
        return job_name(self.run_id, self.pool)

    @property
    def log_pattern(self) -> str:
        """The task log's path: ``{pool}-{job}_{task}.log`` for a task of a pool (array task or gang node)."""
        if self.gang:
            return f"{self.run_dir}/logs/{self.pool}-%j_%t.log"
        return f"{self.run_dir}/logs/{self.pool}-%A_%a.log" if self.array else f"{self.run_dir}/logs/{self.pool}-%j.log"


def job_name(run_id: str, pool: str) -> str:
    """The Slurm job name of a pool: how a crashed launch finds its jobs again."""
    return f"pearl.{run_id}.{pool}"


def array_range(first: int, size: int) -> str:
    """sbatch's ``--array`` value for tasks ``first .. first + size - 1``: ``0-3`` for a launched pool (also
    ``0-0`` for one task, as launches always rendered it), ``K`` for one added task, ``K-L`` for several."""
    if first == 0 or size > 1:
        return f"{first}-{first + size - 1}"
    return str(first)


def _refuse_control(what: str, value: str) -> None:
    if _CONTROL_RE.search(value):
        raise ValueError(
            f"refusing to render the sbatch script: {what} {value!r} contains a control character "
            "(a newline would end the #SBATCH directives and run the rest as a shell command)"
        )


def sbatch_directives(req: SubmitRequest) -> list[str]:
    """The ``#SBATCH`` options of ``req``. Raises ValueError when a value holds a control character."""
    if req.array and req.array_size < 1:
        raise ValueError(f"refusing to render the sbatch script: array_size must be >= 1, got {req.array_size}")
    if req.first_task < 0 or (req.first_task and not req.array):
        raise ValueError(
            f"refusing to render the sbatch script: first_task must be >= 0 and needs an array, got {req.first_task}"
        )
    if req.gang and (req.array or req.first_task or req.array_size < 1):
        raise ValueError(
            "refusing to render the sbatch script: a multi-node job (gang) is one job, not an array, "
            f"with at least one node; got array={req.array}, first_task={req.first_task}, nodes={req.array_size}"
        )
    d = [f"--job-name={req.job_name}"]
    if req.array:
        d.append(f"--array={array_range(req.first_task, req.array_size)}")
    d += [f"--nodes={req.array_size if req.gang else 1}", "--ntasks-per-node=1"]
    if req.gpus_per_node:
        d.append(f"--gres=gpu:{req.gpus_per_node}")
    for flag, value in (
        ("partition", req.partition),
        ("time", req.time_limit),
        ("account", req.account),
        ("qos", req.qos),
        ("cpus-per-task", req.cpus_per_task),
        ("mem", req.mem),
        ("constraint", req.constraint),
        ("exclude", req.exclude),
        ("nodelist", req.nodelist),
    ):
        if value is not None:
            d.append(f"--{flag}={value}")
    d += [
        f"--output={req.log_pattern}",
        "--open-mode=append",  # a requeued task appends to its log instead of truncating it
        "--requeue" if req.requeue else "--no-requeue",
        # a gang job's notice goes to its srun step (every node's worker.sh, agent and workers); an array
        # task's to its batch shell, which is worker.sh
        f"--signal={'' if req.gang else 'B:'}{req.preempt_signal}@{req.preempt_notice_s}",
    ]
    for directive in d:
        _refuse_control("the directive", directive)
        if any(c.isspace() for c in directive):
            # sbatch splits a directive line on whitespace: "--output=/a b" would pass "b" as an option
            raise ValueError(
                f"refusing to render the sbatch script: the directive {directive!r} contains whitespace, "
                "which sbatch would split into another option; use a path without spaces"
            )
    return d


def worker_env(req: SubmitRequest) -> dict[str, str]:
    env = {
        "PEARL_RUN_ID": req.run_id,
        "PEARL_POOL": req.pool,
        "PEARL_ROLE": req.role,
        "PEARL_RUN_DIR": req.run_dir,
        "PEARL_MODEL": req.model,
        "PEARL_PYTHON": req.python,
        "PEARL_PREEMPT_SIGNAL": req.preempt_signal,
        "PEARL_ENGINE_ARGS": json.dumps(req.engine_args, sort_keys=True),
        # the agent drains its workers within the preemption notice, keeping a margin for the stop itself
        "PEARL_DRAIN_TIMEOUT_S": str(max(1, req.preempt_notice_s - 5)),
    }
    if req.train_command:
        env["PEARL_TRAIN_COMMAND"] = json.dumps(list(req.train_command))
    if req.local_models:
        env["PEARL_STORE_MODELS"] = json.dumps(list(req.local_models))
    if req.engine != ServingEngine.VLLM:
        env["PEARL_ENGINE"] = req.engine
        env["PEARL_ENGINE_PROFILE"] = req.engine_profile or ""
    env.update(req.env)
    return env


def render_script(req: SubmitRequest) -> str:
    """The whole sbatch script. Raises ValueError, rendering nothing, when any value that would be
    written into it (a directive, an exported variable, the command) holds a control character."""
    for what, value in (("run id", req.run_id), ("pool", req.pool)):
        _refuse_control(what, value)
    directives = sbatch_directives(req)
    env = worker_env(req)
    for k, v in env.items():
        if not _ENV_NAME_RE.fullmatch(k):
            raise ValueError(f"refusing to render the sbatch script: {k!r} is not an environment variable name")
        _refuse_control(f"the value of {k}", v)
    command = req.command or (req.python, "-m", "pearlctl.agent")
    for arg in (req.worker_script, *command):
        _refuse_control("the command argument", arg)
    lines = [
        "#!/bin/bash",
        f"# pearlctl: pool '{req.pool}' of run '{req.run_id}' ({req.array_size} node(s) x {req.gpus_per_node} GPU(s)).",
        "# One array task = one node's worker. Rendered by `pearlctl launch`; jobs/README.md explains it."
        if not req.gang
        else "# One job of several nodes, one srun task = one node's worker. Rendered by `pearlctl launch`;"
        " jobs/README.md explains it.",
    ]
    lines += [f"#SBATCH {d}" for d in directives]
    lines.append("")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    worker = f"/bin/bash {shlex.quote(req.worker_script)} {shlex.join(command)}"
    if req.gang:
        # one task per node; Slurm's SLURM_NODEID is the node's rank. Without Slurm (the local backend runs
        # this script once per node itself, PEARL_LOCAL_TASK_ID the rank) there is no srun.
        srun = f"srun --ntasks-per-node=1 --open-mode=append --output={shlex.quote(req.log_pattern)}"
        lines.append(f'if [ -n "${{SLURM_JOB_ID:-}}" ]; then exec {srun} {worker}; fi')
    lines.append(f"exec {worker}")
    return "\n".join(lines) + "\n"
