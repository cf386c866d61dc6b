"""Pure parsers for what Slurm commands print. No I/O here: every function takes text and returns values.

Tested against output recorded from the real local cluster (tests/data/slurm/). Where Slurm 22.05
differs from newer releases (squeue --json ignoring filters, data_parser field shapes), the parser
accepts both shapes and says so next to the code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pearlctl.slurm.records import JobRecord


class ParseError(ValueError):
    """Slurm printed something we cannot read; the message quotes it."""


# --- small shapes ---------------------------------------------------------------------------------


def parse_sbatch_parsable(out: str) -> str:
    """`sbatch --parsable` prints "jobid" or "jobid;cluster"."""
    line = out.strip().splitlines()[-1] if out.strip() else ""
    job_id = line.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise ParseError(f"sbatch --parsable printed {out!r}; expected a job id")
    return job_id


def expand_ranges(spec: str) -> list[int]:
    """'0-3,7,9-10%2' -> [0,1,2,3,7,9,10]. Also accepts surrounding brackets and step '0-10:2'."""
    spec = spec.strip().strip("[]").split("%", 1)[0]
    out: list[int] = []
    if not spec:
        return out
    for part in spec.split(","):
        part = part.strip()
        step = 1
        if ":" in part:
            part, step_s = part.split(":", 1)
            step = int(step_s)
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1, step))
        elif part:
            out.append(int(part))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """'gpu[1-3,5],cpu7' -> ['gpu1','gpu2','gpu3','gpu5','cpu7'], keeping zero padding ('n[01-02]')."""
    nodes: list[str] = []
    for match in re.finditer(r"([^,\[]+)(\[[^\]]*\])?([^,\[]*)", nodelist.strip()):
        prefix, bracket, suffix = match.group(1), match.group(2), match.group(3)
        if not prefix and not bracket:
            continue
        if not bracket:
            nodes.append(prefix + suffix)
            continue
        for part in bracket.strip("[]").split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                nodes.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                nodes.append(prefix + part + suffix)
    return [n for n in nodes if n and n not in ("(null)", "None")]


_GRES_IDX_RE = re.compile(r"gpu(?::[^:(]+)*(?::\d+)?\(IDX:([^)]*)\)")


def parse_gres_indices(gres: str) -> tuple[int, ...]:
    """GPU device indices from a GRES detail: 'gpu:8(IDX:0-7)', 'gpu:a100:2(IDX:0,2)', 'gpu(IDX:N/A)'."""
    match = _GRES_IDX_RE.search(gres)
    if not match or match.group(1) in ("", "N/A"):
        return ()
    return tuple(expand_ranges(match.group(1)))


def parse_gres_count(gres: str) -> int:
    """GPUs per node from a node GRES string: 'gpu:8', 'gpu:a100:4(S:0-1)', '(null)' -> 0."""
    total = 0
    for item in gres.split(","):
        item = item.split("(", 1)[0]
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _array_id(job_id: str) -> tuple[str, int | None, tuple[int, ...]]:
    """'123_4' -> ('123', 4, ()), '123_[4-6%2]' -> ('123', None, (4,5,6)), '123' -> ('123', None, ())."""
    if "_" not in job_id:
        return job_id, None, ()
    base, task = job_id.split("_", 1)
    if task.isdigit():
        return base, int(task), ()
    return base, None, tuple(expand_ranges(task))


# --- scontrol show job -d -o ------------------------------------------------------------------------

_KEY_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_/:]*)=(.*)$")


def _scontrol_fields(line: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Split one `scontrol show job -o` line into fields; with -d, also (node, GRES) pairs.

    Values may contain spaces (Reason, Command, Comment): a token that is not KEY=... belongs to the
    previous value. Keys repeat with -d (Nodes=/GRES= per node): the first wins in the dict, the
    pairs are collected separately.
    """
    fields: dict[str, str] = {}
    node_gres: list[tuple[str, str]] = []
    last_key: str | None = None
    pending_nodes: str | None = None
    for token in line.strip().split(" "):
        match = _KEY_RE.match(token)
        if match is None:
            if last_key is not None:
                fields[last_key] = f"{fields[last_key]} {token}"
            continue
        key, value = match.group(1), match.group(2)
        if key == "Nodes":
            pending_nodes = value
        elif key == "GRES" and pending_nodes is not None:
            node_gres.append((pending_nodes, value))
            pending_nodes = None
        if key not in fields:
            fields[key] = value
            last_key = key
        else:
            last_key = None
    return fields, node_gres


def _slurm_time(value: str | None) -> float | None:
    """'2026-11-30T08:20:01' (local time) -> epoch seconds; 'Unknown', 'None', 'N/A' -> None."""
    import datetime as _dt

    if not value or value in ("Unknown", "None", "N/A", "0"):
        return None
    try:
        return _dt.datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def parse_scontrol_jobs(text: str) -> list[JobRecord]:
    """`scontrol show job -d -o` (all jobs, one line each) -> records."""
    records: list[JobRecord] = []
    for line in text.splitlines():
        if not line.strip() or "JobId=" not in line:
            continue
        f, node_gres = _scontrol_fields(line)
        job_id = f.get("JobId", "")
        array_job = f.get("ArrayJobId")
        task = f.get("ArrayTaskId")
        pending: tuple[int, ...] = ()
        task_id: int | None = None
        if array_job:
            job_id = array_job
            if task and task.isdigit():
                task_id = int(task)
            elif task:
                pending = tuple(expand_ranges(task))
        gpus: dict[str, tuple[int, ...]] = {}
        for nodes, gres in node_gres:
            idx = parse_gres_indices(gres)
            for node in expand_nodelist(nodes):
                gpus[node] = idx
        nodelist = f.get("NodeList", "")
        records.append(
            JobRecord(
                job_id=job_id,
                array_task_id=task_id,
                state=f.get("JobState", "UNKNOWN"),
                name=f.get("JobName", ""),
                partition=f.get("Partition", ""),
                reason=f.get("Reason", ""),
                nodes=tuple(expand_nodelist(nodelist)) if nodelist not in ("", "(null)") else (),
                gpus=gpus,
                restarts=int(f.get("Restarts", "0") or 0),
                preempt_time=_slurm_time(f.get("PreemptTime")),
                start_time=_slurm_time(f.get("StartTime")),
                end_time=_slurm_time(f.get("EndTime")),
                exit_code=f.get("ExitCode", ""),
                pending_tasks=pending,
                source="scontrol",
            )
        )
    return records


# --- squeue --json -----------------------------------------------------------------------------------


def _json_value(value: Any) -> float | None:
    """22.05 prints plain numbers; 23.02+ prints {"set": bool, "infinite": bool, "number": n}."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    return float(value)


def _json_time(value: Any) -> float | None:
    """A timestamp; Slurm uses 0 for "not set" (e.g. preempt_time after a requeue)."""
    t = _json_value(value)
    return t if t else None


def _json_state(value: Any) -> str:
    """22.05: "RUNNING"; 23.02+: ["RUNNING"] or ["RUNNING", "COMPLETING"]."""
    if isinstance(value, list):
        return value[0] if value else "UNKNOWN"
    return str(value or "UNKNOWN")


def parse_squeue_json(text: str) -> list[JobRecord]:
    """`squeue --json` -> records for every job in the cluster (22.05 ignores filters: filter later)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParseError(f"squeue --json printed invalid JSON: {exc}: {text[:200]!r}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise ParseError(f"squeue --json printed no 'jobs' list: {text[:200]!r}")
    errors = doc.get("errors") or []
    if errors and not doc["jobs"]:
        # 22.05 exits 0 with an empty job list when slurmctld does not answer (a restart, a stall):
        # that is no answer, not "every job is gone" (which would make the watcher mark them all LOST)
        what = "; ".join(str(e.get("description") or e.get("error") or e) for e in errors if isinstance(e, dict))
        raise ParseError(f"squeue --json reported an error and no jobs: {what or errors!r}")
    records: list[JobRecord] = []
    for job in doc["jobs"]:
        job_id = str(job.get("job_id"))
        # array_job_id is 0 for a plain job; array_task_id is absent/None for an unexpanded pending range.
        array_job = _json_value(job.get("array_job_id"))
        task = _json_value(job.get("array_task_id"))
        task_string = str(job.get("array_task_string") or "")
        task_id: int | None = None
        pending: tuple[int, ...] = ()
        if array_job:
            job_id = str(int(array_job))
            if task is not None:
                task_id = int(task)
            elif task_string:
                pending = tuple(expand_ranges(task_string))
        nodelist = str(job.get("nodes") or "")
        nodes = tuple(expand_nodelist(nodelist)) if nodelist else ()
        gpus: dict[str, tuple[int, ...]] = {}
        detail = job.get("gres_detail") or []
        # gres_detail has one entry per allocated node, in node-list order.
        for node, gres in zip(nodes, detail, strict=False):
            gpus[node] = parse_gres_indices(str(gres))
        records.append(
            JobRecord(
                job_id=job_id,
                array_task_id=task_id,
                state=_json_state(job.get("job_state")),
                name=str(job.get("name") or ""),
                partition=str(job.get("partition") or ""),
                reason=str(job.get("state_reason") or ""),
                nodes=nodes,
                gpus=gpus,
                restarts=int(_json_value(job.get("restart_cnt")) or 0),
                preempt_time=_json_time(job.get("preempt_time")),
                start_time=_json_time(job.get("start_time")),
                end_time=_json_time(job.get("end_time")),
                exit_code=str(job.get("exit_code") or ""),
                pending_tasks=pending,
                source="squeue",
            )
        )
    return records


# --- sacct -P ------------------------------------------------------------------------------------------

SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "NodeList", "Start", "End")


def parse_sacct(text: str) -> list[JobRecord]:
    """`sacct -X -n -P --format=<SACCT_FIELDS>` -> records (the last line for a job id wins)."""
    records: dict[tuple[str, int | None], JobRecord] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS):
            raise ParseError(f"sacct line has {len(parts)} fields, expected {len(SACCT_FIELDS)}: {line!r}")
        row = dict(zip(SACCT_FIELDS, parts, strict=True))
        base, task, pending = _array_id(row["JobID"])
        nodelist = row["NodeList"]
        rec = JobRecord(
            job_id=base,
            array_task_id=task,
            state=row["State"],
            nodes=tuple(expand_nodelist(nodelist)) if nodelist and nodelist != "None assigned" else (),
            start_time=_slurm_time(row["Start"]),
            end_time=_slurm_time(row["End"]),
            exit_code=row["ExitCode"],
            pending_tasks=pending,
            source="sacct",
        )
        records[rec.key] = rec
    return list(records.values())


# --- sinfo ---------------------------------------------------------------------------------------------

SINFO_FORMAT = "%P|%a|%D|%G|%l"


@dataclass(frozen=True)
class PartitionInfo:
    name: str
    available: bool
    nodes: int
    max_gpus_per_node: int
    default: bool = False
    time_limit: str = ""


def parse_sinfo(text: str) -> dict[str, PartitionInfo]:
    """`sinfo -h -o '%P|%a|%D|%G|%l'` -> partitions (one line per partition and GRES group)."""
    parts: dict[str, PartitionInfo] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 5:
            raise ParseError(f"sinfo line has {len(fields)} fields, expected 5: {line!r}")
        raw_name, avail, count, gres, limit = fields
        default = raw_name.endswith("*")
        name = raw_name.rstrip("*")
        prev = parts.get(name)
        nodes = int(count) + (prev.nodes if prev else 0)
        gpus = max(parse_gres_count(gres), prev.max_gpus_per_node if prev else 0)
        parts[name] = PartitionInfo(
            name=name,
            available=avail == "up" or bool(prev and prev.available),
            nodes=nodes,
            max_gpus_per_node=gpus,
            default=default or bool(prev and prev.default),
            time_limit=limit,
        )
    return parts


# --- scontrol show config / scontrol show partition -o -------------------------------------------------

_CONFIG_LINE_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)\s*=\s?(.*)$")


def parse_scontrol_config(text: str) -> dict[str, str]:
    """`scontrol show config` -> {key: value} for its ``Key   = Value`` lines (the first of a repeated key
    wins: plugin sections after the main one repeat some names). Headers and blank lines are skipped."""
    config: dict[str, str] = {}
    for line in text.splitlines():
        match = _CONFIG_LINE_RE.match(line.strip())
        if match and match.group(1) not in config:
            config[match.group(1)] = match.group(2).strip()
    return config


@dataclass(frozen=True)
class PartitionConfig:
    """What `scontrol show partition -o` says of one partition that preemption handling needs."""

    name: str
    preempt_mode: str
    grace_time_s: int
    priority_tier: int


def parse_scontrol_partitions(text: str) -> list[PartitionConfig]:
    """`scontrol show partition -o` (one line per partition) -> partitions, in the order Slurm lists them."""
    parts: list[PartitionConfig] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields, _ = _scontrol_fields(line)
        if "PartitionName" not in fields:
            raise ParseError(f"scontrol show partition line has no PartitionName: {line!r}")
        try:
            grace = int(fields.get("GraceTime", "0"))
            tier = int(fields.get("PriorityTier", "1"))
        except ValueError:
            raise ParseError(f"scontrol show partition: GraceTime/PriorityTier not integers: {line!r}") from None
        parts.append(PartitionConfig(fields["PartitionName"], fields.get("PreemptMode", ""), grace, tier))
    return parts
