"""`pearlctl logs RUN [TARGET] [-f] [--tail N]`: the log files a run wrote on the shared filesystem.

No TARGET lists them (target, path, size, modified). A TARGET prints one: ``trainer[0]`` (a pool's array
task), ``rollout`` (every task of the pool, each line prefixed with its target), ``daemon``, ``router`` or a
worker id (or key). ``-f`` follows like ``tail -f``, across requeues (pearlctl.host.logfiles says how). It reads
the state through a read-only store and never touches the scheduler."""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import typer
from rich.table import Table

from pearlctl.cli.app import app
from pearlctl.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_USAGE,
    emit_json,
    err,
    exits,
    fail,
    open_store,
    out,
    quiet_broken_pipe,
    resolve_run,
    stdout_broken,
)
from pearlctl.host import logfiles

FOLLOW_TAIL = 100
POLL_S = 0.25
RESCAN_S = 1.0


def _modified(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _write(lines: Iterable[tuple[str, str]], prefix: bool) -> None:
    for target, line in lines:
        sys.stdout.write(f"{target} | {line}\n" if prefix else f"{line}\n")
    sys.stdout.flush()


def _listing(files: list[logfiles.LogFile], json_out: bool) -> None:
    rows = []
    for f in files:
        try:
            st = f.path.stat()
        except OSError:
            continue
        rows.append(
            {"target": f.target, "kind": f.kind, "path": str(f.path), "size": st.st_size, "modified": st.st_mtime}
        )
    if json_out:
        emit_json(rows)
        return
    if not rows:
        out.print("no log files yet", markup=False)
        return
    table = Table(box=None)
    for col in ("target", "path", "size", "modified"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(r["target"], r["path"], str(r["size"]), _modified(r["modified"]))
    out.print(table)


def _print_files(files: list[logfiles.LogFile], tail: int | None, prefix: bool) -> None:
    """Each target's files in turn, oldest first (a header before each when it has several); with ``tail``,
    the last ``tail`` lines of each target."""
    by_target: dict[str, list[Path]] = {}
    for f in files:
        by_target.setdefault(f.target, []).append(f.path)
    for target, paths in by_target.items():
        lines: list[tuple[str, str]] = []
        for path in paths:
            header = [(target, f"==> {path} <==")] if len(paths) > 1 else []
            try:
                if tail is None:
                    _write(header, prefix)
                    _write(((target, line) for line in logfiles.with_markers(logfiles.read_lines(path))), prefix)
                else:
                    lines += header + [
                        (target, line) for line in logfiles.with_markers(logfiles.tail_lines(path, tail))
                    ]
            except OSError as exc:
                err.print(f"cannot read {path}: {exc}", markup=False)
        if tail:
            _write(lines[-tail:], prefix)


def _follow(rescan, tail: int, prefix: bool) -> None:
    follower = logfiles.Follower(rescan)
    _write(follower.start(tail), prefix)
    files = rescan()
    follower.rescan = lambda: files
    last_scan = time.monotonic()
    while True:
        time.sleep(POLL_S)
        if time.monotonic() - last_scan >= RESCAN_S:
            files, last_scan = rescan(), time.monotonic()
        lines = follower.poll()
        if lines:
            _write(lines, prefix)
        elif stdout_broken():  # nothing written for a while: notice a reader that went away anyway
            quiet_broken_pipe()
            raise typer.Exit(EXIT_BROKEN_PIPE)


@app.command("logs")
def logs(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run id or name."),
    target: str | None = typer.Argument(
        None,
        metavar="[TARGET]",
        help="pool\\[i] (one task), a pool (all its tasks), daemon, router, or a worker id; none: list the files.",
    ),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing what is written (Ctrl-C stops)."),
    tail: int | None = typer.Option(None, "--tail", "-n", min=0, help="Print the last N lines (-f: 100)."),
    json_out: bool = typer.Option(
        False, "--json", help="With no TARGET: one JSON list (target, kind, path, size, modified)."
    ),
) -> None:
    """Print a run's log files: a pool task's, the daemon's, the router's or a worker's."""
    with exits():
        store = open_store(readonly=True)
        try:
            run = resolve_run(store, run_ref)
            run_dir = run.get("run_dir") or "."
            pools = [p["name"] for p in store.runs.pools(run["id"])]
            allocations = [a.to_dict() for a in store.fleet.allocations(run["id"])]  # logfiles reads plain rows
            workers = [w.to_dict() for w in store.fleet.workers(run["id"])]
        finally:
            store.close()

        def scan() -> list[logfiles.LogFile]:
            return logfiles.discover(run_dir, pools, allocations, workers)

        files = scan()
        if target is None:
            if follow:
                raise fail("-f needs a TARGET (pearlctl logs RUN shows the targets)", EXIT_USAGE)
            _listing(files, json_out)
            return
        if not logfiles.is_known(target, pools, allocations, workers) and not logfiles.select(files, target, workers):
            known = sorted(dict.fromkeys([f.target for f in files] + logfiles.known_targets(pools, allocations, [])))
            raise fail(f"run {run['id']} has no log target {target!r}; targets: {', '.join(known)}", EXIT_USAGE)
        prefix = target in pools  # a whole pool: say which task each line comes from
        chosen = logfiles.select(files, target, workers)
        if not follow:
            if not chosen:
                err.print(f"no log file for {target} yet (under {Path(run_dir, 'logs')})", markup=False)
            _print_files(chosen, tail, prefix)
            return
        if not chosen:
            err.print(f"waiting for a log file for {target} (under {Path(run_dir, 'logs')})", markup=False)
        try:
            _follow(lambda: logfiles.select(scan(), target, workers), FOLLOW_TAIL if tail is None else tail, prefix)
        except KeyboardInterrupt:
            return
