#!/usr/bin/env python3
"""Benchmark: the real control plane at scale on paced engines, next to the simulator's prediction of the same run.

A shipped scenario, resized to ``--gpus`` and sped up ``--speedup`` times (pearlctl.sim.scale), is run for real on a
local Slurm cluster of ``--gpus / 8`` nodes (scripts/localslurm.py): the daemon, the agents, the gateway and
vllm-router, paced engines (pearlctl.agent.engines.paced, on the scaled profile) on every serving GPU, a paced
trainer (pearlctl.trainer.paced: the scaled train step, offload and reload) through the real trainer hook, and
a driver (tests/benchmarks/live_driver.py) that replays the simulator's own trajectories through the gateway. One
policy after another (``--policies``), each on a fresh run:

- **Elastic churn from the trace.** The simulator's availability trace for the scenario and seed
  (pearlctl.sim.run.make_trace, the very trace the simulation plays) is played on the elastic nodes: a node
  is held by a high-priority job (``-p high --exclusive``) except while a lease grants it; a lease's end
  submits that job again ``notice_s`` before (the partition's grace time), so Slurm preempts the elastic task
  on it for real — the task is signalled, drains, is killed at the end of the grace time and requeued, and
  starts again when the node is granted again.
- **Clock.** Time zero is the driver's start, once the trainer waits and every rollout-pool worker serves — the
  simulator's zero (its rollout pool serves at t = 0). The trace is played from there. A run ends with the
  trainer's last step; samples per second = steps x batch / that time, as the simulator counts them.
- **Counted:** trajectories expected and completed, turns continued on another worker and the tokens recomputed
  for them, return deadlines met and missed (the journal), elastic preemptions and requeues (state), the
  daemon's tick and heartbeat p99 (its ``/metrics`` histograms, interpolated inside the bucket that holds the
  99th percentile, as Prometheus' ``histogram_quantile`` does).

Printed side by side per policy: live and simulated samples per second and their ratio, and the counts. The
simulation runs first, before the cluster is busy::

    python tests/benchmarks/bench_live.py [--scenario examples/scenarios/bursty-elastic-8b.toml] [--gpus 64]
        [--speedup 4] [--steps 4] [--policies static,elastic,pearl] [--keep]

The default speed is 4x: at 5x the first turns of pearl's batches waited 7-11 s on average for the 2-core
development host's cores before the gateway read them, a fifth of a batch (docs/benchmarks.md). Needs root and Slurm
(scripts/install-slurm.sh), as the integration tests do. The machine is shared and noisy:
quote the ratios. docs/benchmarks.md has the table of a run and what differs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.daemon.borrowing import REDECIDE_S  # noqa: E402
from pearlctl.host.runfiles import read_address, read_secret  # noqa: E402
from pearlctl.planner import profile as profiles  # noqa: E402
from pearlctl.router import service as router_service  # noqa: E402
from pearlctl.sim import run as simrun  # noqa: E402
from pearlctl.state.store import Store  # noqa: E402
from tests.benchmarks import _runs, live_driver  # noqa: E402

CLUSTER_DIR = "/tmp/pearl-live"
GRACE_S = 10.0  # the preempt partition's GraceTime (scripts/localslurm.py): Slurm's notice of a preemption
TINY = REPO / "examples" / "models" / "tiny"
PY = sys.executable


def sh(*args: str, env: dict, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])}… exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


class Cluster:
    """The bench's Slurm cluster: ``nodes`` nodes of 8 GPUs in CLUSTER_DIR, and the jobs that hold nodes."""

    def __init__(self, nodes: int, env: dict):
        self.nodes = nodes
        self.env = dict(env)
        up = sh(PY, str(REPO / "scripts/localslurm.py"), "up", "--dir", CLUSTER_DIR, "--nodes", str(nodes), env=env)
        self.env["SLURM_CONF"] = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
        self.holders: dict[str, str] = {}  # node -> the high-priority job holding it

    def hold(self, node: str) -> None:
        """Take ``node`` with a high-priority exclusive job: an elastic task on it is preempted (grace time)."""
        if node in self.holders:
            return
        job = sh("sbatch", "--parsable", "-p", "high", "-w", node, "--exclusive", "-o", "/dev/null", "-J",
                 "pearl-live-hold", "--wrap", "sleep 100000", env=self.env).stdout.strip()  # fmt: skip
        self.holders[node] = job

    def free(self, node: str) -> None:
        job = self.holders.pop(node, None)
        if job is not None:
            sh("scancel", job, env=self.env, check=False)

    def cancel_all(self) -> None:
        sh("scancel", "--user", "root", env=self.env, check=False)
        self.holders.clear()
        deadline = time.time() + 60
        while time.time() < deadline and sh("squeue", "-h", "-o", "%i", env=self.env).stdout.strip():
            time.sleep(1)

    def down(self) -> None:
        sh(PY, str(REPO / "scripts/localslurm.py"), "down", "--dir", CLUSTER_DIR, "--wipe", env=self.env, check=False)


def spec_text(args, scenario, policy: str, run_dir: Path, profile_file: Path) -> str:
    c, p = scenario.cluster, scenario.profile
    per = c.gpus_per_node
    trainer_nodes = c.trainer_gpus // per
    paced = [
        "--steps", str(scenario.steps), "--out", f"{run_dir}/trainer", "--rollouts", f"file:{run_dir}/rollouts",
        "--channel", "daemon", "--model", str(TINY), "--train-step-s", f"{scenario.training.train_step_s:.6f}",
        "--offload-s", f"{p.costs.offload_s:.6f}", "--reload-s", f"{p.costs.reload_s:.6f}", "--export-s", "0",
    ]  # fmt: skip
    launcher = ["-m", "torch.distributed.run", *(["--standalone"] if trainer_nodes == 1 else []), "--nproc_per_node",
                "1", "-m", "pearlctl.trainer.paced"]  # fmt: skip
    train = json.dumps(["{python}", *launcher, *paced])
    engine = (
        f"engine_args = {{ max_num_seqs = {p.max_num_seqs}, max_model_len = {scenario.workload.max_context_tokens} }}"
    )
    elastic = c.elastic_gpus // per
    return f"""
[run]
name = "live-{policy}"
model = "{TINY}"
run_dir = "{run_dir}"
policy = "{policy}"
backend = "slurm"
poll_interval_s = 1
engine = "paced"
engine_profile = "{profile_file}"

[pools.trainer]
partition = "debug"
nodes = {trainer_nodes}
gpus_per_node = {per}
cpus_per_task = 8
env = {{ OMP_NUM_THREADS = "1" }}
train_command = {train}

[pools.rollout]
partition = "debug"
nodes = {c.rollout_gpus // per}
gpus_per_node = {per}
cpus_per_task = 8
{engine}
""" + (
        f"""
[pools.elastic]
partition = "preempt"
nodes = {elastic}
max_nodes = {elastic}
gpus_per_node = {per}
cpus_per_task = 8
preempt_notice_s = {int(GRACE_S)}
{engine}
"""
        if elastic
        else ""
    )


def node_events(scenario, horizon_s: float) -> list[tuple[float, str, str]]:
    """The trace as (t, node, "free" | "hold") on the elastic nodes, up to ``horizon_s``: a lease frees its node at
    its start and holds it again at its notice (its end less the grace time). The simulator's own trace
    (``make_trace``): one drawn for another horizon is another trace."""
    c = scenario.cluster
    first_slot = c.trainer_gpus + c.rollout_gpus
    first_node = first_slot // c.gpus_per_node + 1
    out = []
    for lease in simrun.make_trace(scenario).leases:
        for node in sorted({(g - first_slot) // c.gpus_per_node for g in lease.gpus}):
            name = f"gpu{first_node + node}"
            out.append((lease.start, name, "free"))
            if lease.end != float("inf"):
                out.append((lease.notice_at, name, "hold"))
    return sorted(e for e in out if e[0] <= horizon_s)


def play(cluster: Cluster, events, t0: float, stop: threading.Event, log: list) -> None:
    for t, node, what in events:
        if stop.wait(max(0.0, t0 + t - time.time())):
            return
        (cluster.free if what == "free" else cluster.hold)(node)
        log.append((round(time.time() - t0, 2), node, what))


class Live:
    def __init__(self, state_dir: Path, run_dir: Path, name: str, env: dict):
        self.db, self.run_dir, self.name, self.env = state_dir / "state.db", run_dir, name, env

    def pc(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return sh(PY, "-m", "pearlctl", *args, env=self.env, check=check, timeout=timeout)

    def run_id(self) -> str:
        with Store.open(self.db, readonly=True) as store:
            return store.runs.find(self.name)["id"]

    def serving(self, pool: str) -> int:
        with Store.open(self.db, readonly=True) as store:
            rid = store.runs.find(self.name)["id"]
            allocs = {a.id: a.pool for a in store.fleet.allocations(rid)}
            return sum(
                1 for w in store.fleet.workers(rid) if w.state == "READY" and allocs.get(w.allocation_id) == pool
            )

    def train_events(self) -> list[dict]:
        f = self.run_dir / "trainer" / "train.jsonl"
        return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []

    def metrics(self) -> str:
        address = read_address(self.run_dir)
        headers = {"Authorization": f"Bearer {read_secret(self.run_dir)}", "X-Pearl-Run": self.run_id()}
        return httpx.get(address["url"] + "/metrics", headers=headers, timeout=30).text


def p99_ms(metrics: str, name: str) -> float:
    """The 99th percentile (ms) of a histogram from its buckets, interpolated linearly inside the bucket that
    holds it (Prometheus' ``histogram_quantile``); inf beyond the last bucket, nan with no observation."""
    rows = re.findall(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', metrics, re.M)
    bounds = [(float(le), float(n)) for le, n in rows]
    total = bounds[-1][1] if bounds else 0.0
    if not total:
        return float("nan")
    rank = 0.99 * total
    i = bisect.bisect_left([n for _, n in bounds], rank)
    upper, count = bounds[i]
    lower, below = bounds[i - 1] if i else (0.0, 0.0)
    if upper == float("inf"):
        return float("inf")
    return 1000.0 * (lower + (upper - lower) * (rank - below) / max(count - below, 1e-9))


# what the host's cores did during a run, by process class (the first substring of a process's command line that
# matches names its class; the rest is "other")
CPU_CLASSES = (
    ("engines", "pearlctl.agent.engines.paced"),
    ("gateway", "pearlctl.router"),
    ("vllm-router", "vllm-router"),
    ("driver", "live_driver.py"),
    ("trainer", "pearlctl.trainer.paced"),
    ("agents", "pearlctl.agent"),
    ("daemon", "pearlctl daemon"),
    ("daemon", "pearlctl.daemon"),
    ("slurm", "slurm"),
)
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_by_pid() -> dict[int, tuple[str, float]]:
    """Every live process's (class, CPU seconds so far: user + system, its own only)."""
    out: dict[int, tuple[str, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        kind = next((k for k, needle in CPU_CLASSES if needle in cmd), "other")
        out[int(entry.name)] = (kind, (int(fields[11]) + int(fields[12])) / TICKS)
    return out


class CpuMeter:
    """The CPU seconds each process class used between `start` and `stop`, sampled every ``every`` seconds (a
    process that ends between two samples loses at most its last interval)."""

    def __init__(self, every: float = 1.0):
        self.every, self._stop = every, threading.Event()
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.wall = 0.0

    def start(self) -> None:
        self.first = {pid: cpu for pid, (_, cpu) in _cpu_by_pid().items()}
        self._t0 = time.time()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.last.update(_cpu_by_pid())

    def stop(self) -> dict[str, float]:
        """Cores busy on average per class over the window (CPU seconds / wall seconds), and their sum."""
        self._stop.set()
        self._thread.join()
        self.last.update(_cpu_by_pid())
        wall = max(time.time() - self._t0, 1e-9)
        used: dict[str, float] = {}
        for pid, (kind, cpu) in self.last.items():
            used[kind] = used.get(kind, 0.0) + cpu - self.first.get(pid, 0.0)
        cores = {k: round(v / wall, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1])}
        cores["total"] = round(sum(used.values()) / wall, 2)
        return cores


def wait(fn, timeout: float, what: str, every: float = 1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise SystemExit(f"bench_live: {what}: not within {timeout:.0f} s")


def run_live(args, scenario, policy: str, cluster: Cluster, work: Path, profile_file: Path) -> dict:
    c = scenario.cluster
    per = c.gpus_per_node
    first_elastic = (c.trainer_gpus + c.rollout_gpus) // per + 1
    elastic_nodes = [f"gpu{first_elastic + i}" for i in range(c.elastic_gpus // per)]
    cluster.cancel_all()
    for node in elastic_nodes:  # held until the trace grants them
        cluster.hold(node)
    run_dir = work / policy / "run"
    run_dir.mkdir(parents=True)
    spec = work / policy / "run.toml"
    spec.write_text(spec_text(args, scenario, policy, run_dir, profile_file))
    env = dict(cluster.env, PEARL_STATE_DIR=str(work / policy / "state"))
    live = Live(work / policy / "state", run_dir, f"live-{policy}", env)
    live.pc("launch", str(spec))
    live.pc("daemon", live.name, "--heartbeat-s", str(args.heartbeat_s))
    # the profile the planner predicts with and whose gpus_per_worker the daemon starts workers of, as a user
    # imports a measured one: every policy gets it
    live.pc("profile", live.name, "--import", str(profile_file))
    run_id = live.run_id()
    workers = c.rollout_gpus // scenario.profile.gpus_per_worker
    wait(lambda: live.serving("rollout") >= workers, 600, "the rollout pool serves")
    wait(lambda: any(e["event"] == "start" for e in live.train_events()), 600, "the trainer starts")

    events = node_events(scenario, horizon_s=args.horizon_s)
    stop, played = threading.Event(), []
    argv = [
        PY, str(REPO / "tests/benchmarks/live_driver.py"), "--scenario", str(args.scenario), "--gpus", str(args.gpus),
        "--speedup", str(args.speedup), "--control-interval-s", str(REDECIDE_S), "--notice-s", str(GRACE_S),
        "--steps", str(args.steps), "--run-dir", str(run_dir), "--run-id", run_id, "--out", str(run_dir / "rollouts"),
        "--weights", str(run_dir / "trainer" / "weights"), "--procs", str(args.procs),
        "--trace", str(run_dir / "logs" / "trajectories.jsonl"),
    ]  # fmt: skip
    meter = CpuMeter()
    meter.start()
    t0 = time.time()
    player = threading.Thread(target=play, args=(cluster, events, t0, stop, played), daemon=True)
    player.start()
    log = run_dir / "logs" / "driver.log"
    with log.open("w") as out:  # a file, not a pipe: nothing the driver leaves behind can hold this run up
        driver = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_s)
    stop.set()
    lines = log.read_text().splitlines()
    result = next((json.loads(x) for x in lines if x.startswith('{"event": "rollout')), {})
    if driver.returncode != 0:
        print("\n".join(lines[-30:]), file=sys.stderr)
    done = wait(
        lambda: next((e for e in live.train_events() if e["event"] == "done"), None), 300, "the trainer finishes"
    )
    cores = meter.stop()
    steps = [e for e in live.train_events() if e["event"] == "step"]
    end = max(e["ts"] for e in steps)
    metrics = live.metrics()
    with Store.open(live.db, readonly=True) as store:
        journal = store.journal.read(run_id)
        allocations = store.fleet.allocations(run_id)
        transitions = store.transitions.all(run_id)
    elastic = [a for a in allocations if a.pool == "elastic"]
    out = {
        "policy": policy,
        "samples_per_s": len(steps) * scenario.workload.batch_size / (end - t0),
        "seconds": end - t0,
        "steps": len(steps),
        "trained_all": done is not None and len(steps) == scenario.steps,
        "expected": result.get("expected"),
        "completed": result.get("completed"),
        "continued": result.get("continued"),
        "recomputed": result.get("recomputed"),
        "deadlines_met": sum(1 for j in journal if j["event"] == "deadline met"),
        "deadlines_missed": sum(1 for j in journal if j["event"] == "deadline missed"),
        "transitions": sum(1 for t in transitions if t.state == "DONE"),
        "preemptions": sum(1 for t, _, what in played if what == "hold" and t <= end - t0),
        "requeues": sum(int(a.restarts or 0) for a in elastic),
        "tick_p99_ms": p99_ms(metrics, "pearl_daemon_tick_duration_seconds"),
        "tick_cpu_p99_ms": p99_ms(metrics, "pearl_daemon_tick_cpu_seconds"),  # far below the tick's: it waited
        "heartbeat_p99_ms": p99_ms(metrics, "pearl_daemon_heartbeat_duration_seconds"),
        "commit_p99_ms": p99_ms(metrics, "pearl_daemon_commit_duration_seconds"),  # the disk, under the engines' logs
        "driver_exit": driver.returncode,
        "batches": result.get("batches"),
        "cores_busy": cores,
    }
    out["turn_seconds"] = turn_seconds(run_dir)
    live.pc("cancel", live.name, check=False)
    _runs.stop_daemon(run_dir)
    return out


def turn_seconds(run_dir: Path) -> dict:
    """Where the turns' time went, summed over every turn of the run: the driver's round trips (its trace) and the
    parts of them before and after the gateway's handler (``pearl.timing``), the gateway's time from a turn's
    arrival to its answer and the part of it spent waiting for vllm-router (``/pearl/stats``). Each engine's own
    (from a request's arrival to its last token) is in its log's last line when it stops."""
    out: dict = {}
    trace = run_dir / "logs" / "trajectories.jsonl"
    if trace.exists():
        turns = [t for line in trace.read_text().splitlines() for t in json.loads(line)["turns"]]
        out["driver"], out["turns"] = round(sum(t[1] for t in turns), 1), len(turns)
        spans = [t for t in turns if len(t) > 6 and t[6]]  # the gateway's span, seconds after the send
        if spans:  # the driver's round trips split: before the gateway's handler, in it, after it
            out["before_gateway"] = round(sum(t[6][0] for t in spans), 1)
            out["after_gateway"] = round(sum(t[1] - t[6][1] for t in spans), 1)
    record = router_service.read_record(run_dir)
    if record is not None:
        headers = {"Authorization": f"Bearer {router_service.read_key(run_dir)}"}
        try:
            stats = httpx.get(record.url + "/pearl/stats", headers=headers, timeout=30).json()
            out["gateway"], out["upstream"] = stats["seconds"]["turns"], stats["seconds"]["upstream"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            out["gateway_error"] = str(exc)
    return out


def table(rows: list[dict]) -> str:
    head = (
        "| policy | live samples/s | simulated | live / sim | trajectories done / expected | continued turns "
        "(tokens recomputed) | deadlines met / missed | preemptions, requeues | tick p99 | heartbeat p99 | commit p99 |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['samples_per_s']:.2f} | {r['sim_samples_per_s']:.2f} | {r['ratio']:.2f} | "
            f"{r['completed']} / {r['expected']} | {r['continued']} ({r['recomputed']}) | "
            f"{r['deadlines_met']} / {r['deadlines_missed']} | {r['preemptions']}, {r['requeues']} | "
            f"{r['tick_p99_ms']:.0f} ms | {r['heartbeat_p99_ms']:.1f} ms | {r['commit_p99_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", type=Path, default=REPO / "examples/scenarios/bursty-elastic-8b.toml")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--speedup", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--policies", default="static,elastic,pearl")
    ap.add_argument("--procs", type=int, default=4, help="the driver's episode processes")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--horizon-s", type=float, default=3600.0, help="how much of the trace is played at most")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="one policy's driver at most")
    ap.add_argument("--keep", action="store_true", help="leave the cluster and the runs' directories")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]

    ns = argparse.Namespace(
        scenario=args.scenario, gpus=args.gpus, speedup=args.speedup, control_interval_s=REDECIDE_S,
        notice_s=GRACE_S, steps=args.steps, seed=args.seed,
    )  # fmt: skip
    scenario = live_driver.build_scenario(ns)
    print(f"{scenario.name}: {scenario.cluster}, batch {scenario.workload.batch_size}, {scenario.steps} steps, "
          f"train step {scenario.training.train_step_s:.2f} s", flush=True)  # fmt: skip
    t = time.time()
    sim = {p: simrun.run_policy(scenario, p) for p in policies}
    said = ", ".join(f"{p} {r.samples_per_s:.2f}/s in {r.sim_time_s:.0f} s" for p, r in sim.items())
    print(f"simulated in {time.time() - t:.0f} s: {said}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="pearl-live-"))
    profile_file = work / "profile.toml"
    profile_file.write_text(profiles.dumps(scenario.profile))
    cluster = Cluster(scenario.cluster.trainer_gpus // 8 + scenario.cluster.rollout_gpus // 8
                      + scenario.cluster.elastic_gpus // 8, dict(os.environ))  # fmt: skip
    rows = []
    try:
        for policy in policies:
            row = run_live(args, scenario, policy, cluster, work, profile_file)
            row["sim_samples_per_s"] = sim[policy].samples_per_s
            row["ratio"] = row["samples_per_s"] / sim[policy].samples_per_s
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        cluster.cancel_all()
        if not args.keep:
            cluster.down()
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    live_rank = sorted(rows, key=lambda r: -r["samples_per_s"])
    sim_rank = sorted(rows, key=lambda r: -r["sim_samples_per_s"])
    print(f"ranking live: {' > '.join(r['policy'] for r in live_rank)}; "
          f"simulated: {' > '.join(r['policy'] for r in sim_rank)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
