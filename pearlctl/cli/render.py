"""Rendering of state for people (rich tables) and machines (JSON). Pure functions of dicts."""

from __future__ import annotations

import datetime as dt
import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pearlctl.state.schema import ROLLOUT_PROGRESS, TRAINER_REPORT
from pearlctl.vocabulary import ServingEngine, one_job_of_nodes

STATE_STYLE = {
    "RUNNING": "green",
    "ACTIVE": "green",
    "UP": "green",
    "READY": "green",
    "DONE": "green",
    "PENDING": "yellow",
    "REQUESTED": "yellow",
    "SUBMITTING": "yellow",
    "STARTING": "yellow",
    "PREEMPTING": "magenta",
    "DRAINING": "magenta",
    "CANCELLING": "magenta",
    "LOST": "bold red",
    "FAILED": "bold red",
    "ENDED": "dim",
    "CANCELLED": "dim",
    "GONE": "dim",
    "STOPPED": "dim",
}


def _state(value: str | None) -> Text:
    return Text(str(value or "-"), style=STATE_STYLE.get(str(value), ""))


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def _ago(ts: float | None) -> str:
    if not ts:
        return "never"
    return f"{max(0.0, time.time() - ts):.0f}s ago"


def slurm_id(alloc: dict, pools: list[dict]) -> str:
    """How Slurm names an allocation (what ``scancel`` takes): an array task ``job_task``, or the job itself
    for a node of a multi-node job; ``-`` before it is submitted."""
    if not alloc["job_id"]:
        return "-"
    pool = next((p for p in pools if p["name"] == alloc["pool"]), None)
    if pool and one_job_of_nodes(pool["name"], pool["nodes"]):
        return str(alloc["job_id"])
    return f"{alloc['job_id']}_{alloc['array_index']}"


SHOWN_FAILURES = 3  # the latest failed workers whose reasons status shows (a crash loop makes one per restart)


def status_tables(doc: dict) -> Group:
    """A run's state document (pearlctl.state.views.run_document) for people: the run's head line, its router,
    one table each for its pools, allocations and GPUs, its elastic pool, its workers, then one line each for
    its transitions, the trainer, the rollout and the predictor."""
    parts = [_head(doc["run"]), *router_parts(doc), _pools_table(doc), _allocations_table(doc), _gpus_table(doc)]
    parts += elastic_parts(doc.get("elastic"))
    parts += _workers_parts(doc)
    parts += _transitions_lines(doc["transitions"])
    parts += _progress_lines(doc["run"])
    return Group(*parts)


def _head(run: dict) -> Table:
    """The run's name, id, state, backend, policy and last poll (and a warning when its engine is paced)."""
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text(f"run {run['name']}", style="bold"),
        Text(run["id"]),
        _state(run["state"]),
        Text(f"backend {run['backend']}"),
        Text(f"policy {run['policy']}"),
        Text(f"polled {_ago(run.get('last_poll_at'))}"),
    )
    spec = run.get("spec") or {}
    if spec.get("engine") == ServingEngine.PACED:  # never a real run: say so where the run is named
        head.add_row(Text(f"engine paced (no model): timing from {spec.get('engine_profile')}", style="yellow"))
    return head


def _pools_table(doc: dict) -> Table:
    """One row per pool: its job, partition and size, its role, and how many of its allocations run."""
    pools = Table(title="pools", title_justify="left")
    for col in ("pool", "job", "partition", "nodes x GPUs", "role", "running"):
        pools.add_column(col)
    for p in doc["pools"]:
        running = sum(1 for a in doc["allocations"] if a["pool_id"] == p["id"] and a["state"] == "RUNNING")
        pools.add_row(
            p["name"],
            p["job_id"] or "-",
            p["partition"] or "(default)",
            f"{p['nodes']} x {p['gpus_per_node']}",
            p["role"],
            f"{running}/{p['nodes']}",
        )
    return pools


def _allocations_table(doc: dict) -> Table:
    """One row per allocation: its Slurm id and state, node, restarts, and why it is in its state."""
    allocs = Table(title="allocations", title_justify="left")
    for col in ("allocation", "slurm id", "state", "slurm state", "node", "restarts", "reason", "since"):
        allocs.add_column(col)
    for a in doc["allocations"]:
        sid = slurm_id(a, doc["pools"])
        reason = a.get("reason") or ""
        allocs.add_row(
            f"{a['pool']}[{a['array_index']}]",
            sid,
            _state(a["state"]),
            a.get("slurm_state") or "-",
            a.get("node") or "-",
            str(a.get("restarts") or 0),
            "" if reason == "None" else reason,
            _when(a.get("updated_at")),
        )
    return allocs


def _gpus_table(doc: dict) -> Table:
    """One row per GPU still there (not GONE): where it is, its pool, role and state, and whether it is lent."""
    gpus = Table(title="gpus", title_justify="left")
    for col in ("id", "node", "gpu", "pool", "role", "state", "borrowed", "return by"):
        gpus.add_column(col)
    for g in doc["gpus"]:
        if g["state"] == "GONE":
            continue
        gpus.add_row(
            str(g["id"]),
            g["node"],
            str(g["idx"]),
            g.get("pool") or "-",
            g["role"],
            _state(g["state"]),
            "yes" if g.get("borrowed") else "",
            _when(g.get("return_deadline")),
        )
    return gpus


def _workers_parts(doc: dict) -> list:
    """The workers' table and why the latest failed ones failed; a line saying there are none yet otherwise."""
    parts: list = []
    if doc["workers"]:
        workers = Table(title="workers", title_justify="left")
        for col in ("id", "role", "engine", "state", "url", "weights"):
            workers.add_column(col)
        for w in doc["workers"]:
            workers.add_row(
                str(w["id"]),
                w["role"],
                w["engine"],
                _state(w["state"]),
                w.get("url") or "-",
                w.get("weight_version") or "-",
            )
        parts.append(workers)
        failed = [w for w in doc["workers"] if w.get("error")]  # FAILED workers: why, as their agents reported it
        if len(failed) > SHOWN_FAILURES:
            parts.append(
                Text(
                    f"{len(failed) - SHOWN_FAILURES} earlier failed workers: pearlctl journal {doc['run']['name']}",
                    style="dim",
                )
            )
        for w in failed[-SHOWN_FAILURES:]:
            parts.append(Text(f"worker {w['id']} failed: {w['error']}", style="red"))
    else:
        parts.append(Text("workers: none (engines start with the daemon)", style="dim"))
    return parts


def _transitions_lines(transitions: list[dict]) -> list[Text]:
    """How many transitions run, are done and were made; one line per running one (its step, its deadline)."""
    running = [t for t in transitions if t["state"] in ("PLANNED", "RUNNING", "ROLLING_BACK")]
    done = [t for t in transitions if t["state"] == "DONE"]
    parts = [Text(f"transitions: {len(running)} running, {len(done)} done, {len(transitions)} in all", style="dim")]
    for t in running:
        current = t.get("current_step") or "-"
        deadline = (t.get("detail") or {}).get("return_deadline")
        parts.append(
            Text(
                f"  #{t['id']} {t['kind']} {t['from_role']}->{t['to_role']} {t['state']} at {current}"
                + (f", return by {_when(deadline)}" if deadline else "")
            )
        )
    return parts


def _progress_lines(run: dict) -> list[Text]:
    """The trainer's last report, the rollout driver's counts and the predictor's correction, each when known."""
    parts = []
    trainer = run.get(TRAINER_REPORT) or {}
    if trainer:
        parts.append(
            Text(
                f"trainer: {trainer.get('phase')} step {trainer.get('step')}"
                + (" (GPUs released)" if trainer.get("released") else "")
                + (f", weights v{trainer['weight_version']}" if trainer.get("weight_version") else "")
            )
        )
    rollout = run.get(ROLLOUT_PROGRESS) or {}
    if rollout:
        # the rate between the driver's last two progress reports (pearlctl.daemon.trainer_side), a second or so
        # apart: how fast it generates lately, not its tokens over the whole rollout's wall time
        rate = rollout.get("tokens_per_s")
        parts.append(
            Text(
                f"rollout: queued {rollout.get('queued')}, generating {rollout.get('generating')}, "
                f"waiting on tools {rollout.get('tool_wait')}, done {rollout.get('done')}, "
                f"{rollout.get('tokens')} tokens"
                + (f"; {rate} tok/s between the driver's last two reports" if rate is not None else "")
            )
        )
    judge = rollout.get("judge") or {}
    if judge:  # pearlctl.router.judge's queue, as the driver reports it
        rate = rollout.get("verdicts_per_s")
        parts.append(
            Text(
                f"judge: waiting {judge.get('waiting')}, judging {judge.get('judging')}, done {judge.get('done')}, "
                f"failed {judge.get('failed')}"
                + (f"; {rate} verdicts/s between the driver's last two reports" if rate is not None else "")
            )
        )
    overall = ((run.get("predictor") or {}).get("all")) or {}
    if overall:  # pearlctl.planner.correct: measured / predicted batch time, what predictions are scaled by
        shapes = len((run.get("predictor") or {}).get("shapes") or {})
        parts.append(
            Text(
                f"predictor: batches took {overall['ratio']:.2f}x the predicted time ({overall['batches']} checked, "
                f"{shapes} shape(s)); predictions are corrected by it"
            )
        )
    return parts


def router_parts(doc: dict) -> list:
    """The run's router: the base URL an OpenAI client takes, its key file, how many workers it routes to."""
    view = doc.get("router")
    if not view:
        return []
    routed = sum(1 for w in doc.get("workers", []) if w.get("routable") and w.get("state") == "READY")
    alive = "" if view["running"] else " — not running (the daemon starts it again)"
    return [
        Text(
            f"router {view['base_url']}  key {view['key_file']}  routing to {routed} worker(s){alive}",
            style="" if view["running"] else "yellow",
        )
    ]


def elastic_parts(view: dict | None) -> list:
    """The elastic pool's section (pearlctl.daemon.elastic_state.elastic_view): its size now, wanted and bounds,
    its live tasks, and how its size changed lately. Nothing for a run without an elastic pool."""
    if not view:
        return []
    wanted = "not set" if view.get("wanted") is None else str(view["wanted"])
    line = (
        f"elastic pool: {view['size']} task(s), wanted {wanted} (min {view['min']}, max {view['max']}): "
        f"{view['running']} running, {view['pending']} pending, {view['draining']} draining"
    )
    for key in ("preempting", "lost"):
        if view.get(key):
            line += f", {view[key]} {key}"
    line += f"; pending bound {view['pending_timeout_s']:g}s"
    if view.get("backoff_until"):
        line += f", growth backing off until {_when(view['backoff_until'])}"
    parts: list = [Text(line, style="bold")]
    if view["tasks"]:
        tasks = Table(title="elastic tasks", title_justify="left")
        for col in ("task", "slurm id", "state", "node", "restarts", "note"):
            tasks.add_column(col)
        for t in view["tasks"]:
            notes = []
            if t.get("draining"):
                notes.append(f"draining since {_when(t.get('drain_requested_at'))}")
            if t.get("pending_since"):
                notes.append(f"pending since {_when(t['pending_since'])}")
            if not t.get("added"):
                notes.append("launched")
            tasks.add_row(
                f"{view['pool']}[{t['array_index']}]",
                t.get("slurm_id") or "-",
                _state("DRAINING" if t.get("draining") else t["state"]),
                t.get("node") or "-",
                str(t.get("restarts") or 0),
                ", ".join(notes),
            )
        parts.append(tasks)
    sizes: list[tuple[float, int]] = []
    for h in view.get("history") or []:
        if not sizes or sizes[-1][1] != h["size"]:
            sizes.append((h["ts"], h["size"]))
    if sizes:
        shown = " -> ".join(f"{n} ({_when(ts)})" for ts, n in sizes[-8:])
        parts.append(Text(f"elastic pool size: {shown}", style="dim"))
    return parts


def runs_table(runs: list[dict]) -> Table:
    table = Table(title="runs", title_justify="left")
    for col in ("name", "id", "state", "backend", "created"):
        table.add_column(col)
    for r in sorted(runs, key=lambda r: r["created_at"]):
        table.add_row(r["name"], r["id"], _state(r["state"]), r["backend"], _when(r["created_at"]))
    return table
