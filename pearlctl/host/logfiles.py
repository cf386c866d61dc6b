"""Where a run's processes write their logs, and reading them as `pearlctl logs` does. Pure: no state, no
Slurm; the caller passes the rows it read (pools, allocations, workers) and the run directory.

The files, all under ``RUN_DIR/logs/`` on the shared filesystem:

- ``{pool}-{job}_{index}.log`` — one array task of a pool (sbatch ``--output=RUN_DIR/logs/{pool}-%A_%a.log``
  with ``--open-mode=append``, pearlctl.slurm.script; the local backend writes the same names). A requeued
  task keeps its job id and index, so it appends to the same file; jobs/worker.sh starts each run of the
  task with ``pearl-worker TS start task=... restart=N``, which is how a restart is told apart. An elastic
  pool's added task is a new job (a new file, a new index).
- ``daemon.log`` (a detached daemon) and ``daemon-{job}.log`` (a daemon run as a Slurm job), pearlctl.cli.daemon.
- ``router.log``, pearlctl.router.service.
- ``vllm-{job}_{index}-{key}.log`` and ``train-{job}_{index}-{key}.log`` — one engine worker of an
  allocation (pearlctl.agent.workers), named by the worker's key; a requeued allocation's new process
  under the same key appends to the same file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

START_RE = re.compile(r"^pearl-worker \S+ start task=\S+ .*?\brestart=(\d+)\b")
TARGET_RE = re.compile(r"^(?P<pool>[^\[\]]+)\[(?P<index>\d+)\]$")
WORKER_PREFIX = {"vllm": "vllm", "deepspeed": "train"}


@dataclass(frozen=True)
class LogFile:
    target: str  # what `pearlctl logs RUN TARGET` names: "trainer[0]", "daemon", "router", "7" (a worker id)
    kind: str  # "pool", "daemon", "router" or "worker"
    path: Path
    pool: str | None = None
    index: int | None = None
    job: str | None = None
    worker: int | None = None


def requeue_marker(line: str) -> str | None:
    """The marker line to print before ``line`` when it is the wrapper's start line of a restarted task."""
    m = START_RE.match(line)
    if m and int(m.group(1)) > 0:
        return f"==> requeued (restart {int(m.group(1))}) <=="
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def worker_log(run_dir: str | os.PathLike, worker: dict, alloc: dict | None) -> Path | None:
    """The file a worker row's process writes (None when its allocation has no job id or key yet)."""
    key = (worker.get("worker_key") or "").split("#", 1)[0]
    if not key or alloc is None or not alloc.get("job_id"):
        return None
    prefix = WORKER_PREFIX.get(str(worker.get("engine")), str(worker.get("engine")))
    return Path(run_dir, "logs", f"{prefix}-{alloc['job_id']}_{alloc['array_index']}-{key}.log")


def discover(
    run_dir: str | os.PathLike,
    pools: Iterable[str],
    allocations: Sequence[dict] = (),
    workers: Sequence[dict] = (),
) -> list[LogFile]:
    """The log files that exist in the run directory, grouped by target, oldest first within a target."""
    logs = Path(run_dir, "logs")
    found: list[LogFile] = []
    claimed: set[Path] = set()
    by_alloc = {a["id"]: a for a in allocations}
    for w in workers:
        path = worker_log(run_dir, w, by_alloc.get(w.get("allocation_id")))
        if path is not None and path.is_file():
            found.append(LogFile(str(w["id"]), "worker", path, worker=int(w["id"])))
            claimed.add(path)
    try:
        names = sorted(p.name for p in logs.iterdir() if p.is_file())
    except OSError:
        names = []
    pool_names = sorted(set(pools), key=len, reverse=True)  # "roll-out-…" is pool "roll-out", not "roll"
    for name in names:
        path = logs / name
        if path in claimed:
            continue
        if name == "router.log":
            found.append(LogFile("router", "router", path))
        elif name == "daemon.log" or re.fullmatch(r"daemon-[^/]+\.log", name):
            found.append(LogFile("daemon", "daemon", path))
        else:
            for pool in pool_names:
                m = re.fullmatch(re.escape(pool) + r"-(?P<job>.+)_(?P<index>\d+)\.log", name)
                if m:
                    index = int(m.group("index"))
                    found.append(LogFile(f"{pool}[{index}]", "pool", path, pool, index, m.group("job")))
                    break
    order = {"pool": 0, "worker": 1, "daemon": 2, "router": 3}
    return sorted(
        found,
        key=lambda f: (order[f.kind], f.pool or "", f.index or 0, f.worker or 0, _mtime(f.path), f.path.name),
    )


def select(files: Sequence[LogFile], target: str, workers: Sequence[dict] = ()) -> list[LogFile]:
    """The files ``target`` names: ``pool[i]``, a pool (all its tasks), ``daemon``, ``router``, a worker id
    or a worker key."""
    if target in ("daemon", "router"):
        return [f for f in files if f.kind == target]
    if TARGET_RE.match(target):
        return [f for f in files if f.target == target]
    pool = [f for f in files if f.pool == target]
    if pool:
        return pool
    ids = {str(w["id"]) for w in workers if (w.get("worker_key") or "").split("#", 1)[0] == target}
    return [f for f in files if f.kind == "worker" and (f.target == target or f.target in ids)]


def known_targets(pools: Iterable[str], allocations: Sequence[dict], workers: Sequence[dict]) -> list[str]:
    """Every target the run's state names (its files may not exist yet)."""
    names = ["daemon", "router"]
    for pool in pools:
        names.append(pool)
        names += [f"{pool}[{a['array_index']}]" for a in allocations if a.get("pool") == pool]
    names += [str(w["id"]) for w in workers]
    return names


def is_known(target: str, pools: Iterable[str], allocations: Sequence[dict], workers: Sequence[dict]) -> bool:
    if target in known_targets(pools, allocations, workers):
        return True
    return any((w.get("worker_key") or "").split("#", 1)[0] == target for w in workers)


def tail_lines(path: Path, n: int, block: int = 65536) -> list[str]:
    """The last ``n`` lines of a file, read from its end (a vLLM log may be gigabytes)."""
    if n <= 0:
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode(errors="replace").splitlines()
    return lines[-n:]


def read_lines(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:
        for raw in f:
            yield raw.decode(errors="replace").rstrip("\r\n")


def with_markers(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` with a requeue marker before each restarted task's start line."""
    for line in lines:
        marker = requeue_marker(line)
        if marker:
            yield marker
        yield line


@dataclass
class _Stream:
    target: str
    path: Path
    pos: int = 0
    partial: bytes = b""


@dataclass
class Follower:
    """Follows the files one selection names, like ``tail -f``: each ``poll()`` returns the new lines as
    ``(target, line)`` pairs, with marker lines for a restarted task (``==> requeued (restart N) <==``),
    a newer file of the same target (``==> now PATH <==``: the task submitted again under a new job id), a
    new target (``==> new log PATH <==``: an elastic task added) and a truncated file."""

    rescan: Callable[[], list[LogFile]]  # () -> list[LogFile]: the selection's files now
    streams: dict[str, _Stream] = field(default_factory=dict)

    def start(self, tail: int) -> list[tuple[str, str]]:
        """The last ``tail`` lines of each target's newest file; following goes on from their ends."""
        out: list[tuple[str, str]] = []
        for target, path in self._newest().items():
            try:
                size = path.stat().st_size
                out += [(target, line) for line in with_markers(tail_lines(path, tail))]
            except OSError:
                size = 0
            self.streams[target] = _Stream(target, path, pos=size)
        return out

    def _newest(self) -> dict[str, Path]:
        newest: dict[str, Path] = {}
        for f in self.rescan():
            newest[f.target] = f.path  # files come oldest first within a target
        return newest

    def poll(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for target, path in self._newest().items():
            stream = self.streams.get(target)
            if stream is None:
                self.streams[target] = stream = _Stream(target, path)
                out.append((target, f"==> new log {path} <=="))
            elif stream.path != path and _mtime(path) >= _mtime(stream.path):
                out += self._read(stream)  # what the old file still had
                out.append((target, f"==> now {path} <=="))
                stream.path, stream.pos, stream.partial = path, 0, b""
        for stream in self.streams.values():
            out += self._read(stream)
        return out

    def _read(self, stream: _Stream) -> list[tuple[str, str]]:
        try:
            with open(stream.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < stream.pos:
                    stream.pos, stream.partial = 0, b""
                    truncated = [(stream.target, f"==> {stream.path} truncated <==")]
                else:
                    truncated = []
                f.seek(stream.pos)
                data = f.read()
        except OSError:
            return []
        stream.pos += len(data)
        data = stream.partial + data
        *complete, stream.partial = data.split(b"\n")
        lines = (raw.decode(errors="replace").rstrip("\r") for raw in complete)
        return truncated + [(stream.target, line) for line in with_markers(lines)]
