#!/usr/bin/env python3
"""Benchmark: one daemon for a 4,096-GPU run. Not a test: it prints a markdown table and the targets.

The real daemon (``pearlctl.daemon.main.Daemon``: its uvicorn control API, control loop, lease renewer and
Slurm poller, the ``pearl`` policy deciding in its ticks) runs in its own process against a run of 512
allocations × 8 GPUs (a trainer pool of 64 nodes, a rollout pool of 448). The scheduler is the one thing
not real: the backend answers every poll with all 512 tasks RUNNING (the seam the daemon's unit tests use),
and the run's router is off (the data plane is benchmarked in bench_dataplane.py).

In this process, 512 fake agents — one per allocation, over real HTTP on loopback, as
``pearlctl.agent`` does — register, report the workers the daemon desires (READY at once), and then
heartbeat with long polls (held up to the heartbeat interval, 1 s), so each one sends about one heartbeat
a second. A rollout driver reports the batch's progress every second.

The daemon runs as ``pearlctl daemon --foreground`` runs it (``own_process``: its heap settled for the
collector after its first tick, pearlctl/daemon/main.py ``settle_heap``). The fake agents run in one process
on uvloop, with the daemon's collector settings: their own pauses would otherwise be counted as the daemon's.

Measured:
- heartbeat latency: a long poll answered unchanged was held for the interval it asked for, so its latency
  is its round trip minus that hold; a heartbeat that was not held (its report changed something) counts
  its whole round trip; beside it, the same in the daemon (from the request's arrival in the app to its
  answer, less the hold), so that the agents' process's share shows;
- the daemon's collector pauses (``gc.callbacks``), by generation;
- the control loop's tick durations (recorded by the daemon process, written at its exit);
- agents falsely LOST (every agent heartbeats throughout, so any LOST GPU is false), from the state;
- the daemon's RSS (peak) and CPU (seconds of user+system per second of wall time).

Targets (issue: one daemon for 4,096 GPUs; named constants below with their reasons): no agent falsely LOST;
tick p99 < 100 ms; heartbeat p99 < 50 ms; no failed request or tick. ``--check`` exits 1 when one is missed,
``--target NAME=VALUE`` moves one, ``--write-docs`` writes the table into docs/benchmarks.md.

    python tests/benchmarks/bench_daemon_load.py [--agents 512] [--gpus-per-node 8] [--seconds 120]
        [--check] [--target NAME=VALUE] [--write-docs]
        [--profile FILE]   # cProfile of the control loop's ticks after the warm-up, for pstats
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.daemon.main import GC_THRESHOLDS  # noqa: E402
from tests.benchmarks import _targets  # noqa: E402

HEARTBEAT_S = 1.0
TRAINER_SHARE = 8  # one allocation in 8 is the trainer's
DOC = REPO / "docs" / "benchmarks.md"
# The targets (issues "one daemon for 4,096 GPUs" and "a house a newcomer can live in"; docs/benchmarks.md). A
# tick is when the daemon reacts — a lent GPU's return before the trainer's deadline, a worker's desired state —
# so its p99 under 100 ms; a heartbeat never waits for a decision (the policy decides off the lock), so its p99
# under 50 ms, a twentieth of the 1-s interval; every agent heartbeats throughout, so any LOST GPU is false, and no
# request may fail.
TICK_P99_MS = 100.0
HEARTBEAT_P99_MS = 50.0
TARGETS = [
    _targets.Target("false_lost", 0, "", "no agent falsely LOST: every agent heartbeats throughout"),
    _targets.Target("tick_p99_ms", TICK_P99_MS, "ms", "control-loop tick p99: the daemon reacts in its ticks"),
    _targets.Target("heartbeat_p99_ms", HEARTBEAT_P99_MS, "ms", "heartbeat p99: a twentieth of the 1-s interval"),
    _targets.Target("errors", 0, "", "no failed request, no failed tick"),
]


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the daemon process ------------------------------------------------------------------------------------
def create_run(state_db: str, run_dir: str, agents: int, gpus_per_node: int) -> None:
    from pearlctl.planner.profile import DecodeModel, Profile, to_dict
    from pearlctl.state.store import Store
    from tests import factories

    trainer = max(1, agents // TRAINER_SHARE)
    pools = [
        factories.pool("trainer", "TRAIN", nodes=trainer, gpus_per_node=gpus_per_node, run_id="load"),
        factories.pool("rollout", "ROLLOUT", nodes=agents - trainer, gpus_per_node=gpus_per_node, run_id="load"),
    ]
    spec = {"poll_interval_s": 5.0, "router": {"enabled": False}}
    with Store.open(state_db) as store:
        factories.create_run(store, Path(run_dir), pools, run_id="load", spec=spec, policy="pearl")
        for i, a in enumerate(store.fleet.allocations("load")):
            factories.submit(store, a.id, "1000" if a.pool == "trainer" else "2000")
            factories.start(store, a.id, f"n{i:04d}")
        profile = Profile(
            name="load",
            model="dense-8b",
            hardware="h100",
            decode=DecodeModel(weights_s=0.005, seq_s=2e-5, kv_s_per_token=4.4e-8),
            prefill_tok_s=20_000,
            kv_capacity_tokens=270_000,
        )
        store.update_fields("runs", "load", event="profile stored", profile=to_dict(profile))


class AllRunning:
    """The scheduler at the daemon's backend seam: every task of every job RUNNING on its own node."""

    name = "fake"

    def __init__(self, nodes: dict[tuple[str, int], str]):
        self.nodes, self.started = nodes, time.time() - 60

    def poll(self, job_ids):
        from pearlctl.slurm.records import JobRecord

        return [
            JobRecord(job_id=j, array_task_id=t, state="RUNNING", nodes=(node,), start_time=self.started, source="fake")
            for (j, t), node in self.nodes.items()
            if j in job_ids
        ]

    def partitions(self):
        return {}

    def find_by_name(self, job_name):
        return []

    def submit(self, req, script):
        raise RuntimeError("this benchmark submits nothing")

    def cancel(self, job_ids):
        pass

    def cancel_tasks(self, tasks):
        pass


def daemon_main(state_db: str, out: str, profile: str | None = None, profile_after_s: float = 0.0) -> None:
    import cProfile
    import gc
    import logging

    from pearlctl.daemon.main import Daemon, DaemonSettings
    from pearlctl.state.store import Store

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s daemon %(levelname)s %(message)s")
    store = Store.open(state_db)
    nodes = {(a.job_id, a.array_index): a.node for a in store.fleet.allocations("load")}
    ticks: list[float] = []
    heartbeats: dict = {}
    profiler = cProfile.Profile() if profile else None
    profile_from = time.monotonic() + profile_after_s  # the measured window: registrations are not the steady state

    import pearlctl.daemon.main as daemon_module

    served: list[tuple[float, float]] = []  # (when, seconds from a heartbeat's arrival in the app to its answer)
    build_app = daemon_module.build_app

    def timed_app(*args, **kwargs):
        app = build_app(*args, **kwargs)

        async def timed(scope, receive, send):
            if scope["type"] != "http" or scope["path"] != "/v1/agents/heartbeat":
                return await app(scope, receive, send)
            t = time.perf_counter()
            await app(scope, receive, send)
            served.append((time.time(), time.perf_counter() - t))

        return timed

    daemon_module.build_app = timed_app
    pauses: list[tuple[float, int, float]] = []  # (when, generation, seconds) of each collection
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((time.time(), info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)

    class Timed(Daemon):
        def _tick(self, controller, borrowing):
            heartbeats["counts"] = controller.agents.heartbeats
            heartbeats["passes"] = controller.long_polls
            heartbeats["borrowing"] = borrowing
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                if profiler is None or time.monotonic() < profile_from:
                    return super()._tick(controller, borrowing)
                return profiler.runcall(super()._tick, controller, borrowing)
            finally:  # (when it started, wall seconds, the tick thread's CPU seconds)
                ticks.append((time.time(), time.perf_counter() - t0, time.thread_time() - c0))

    settings = DaemonSettings(
        host="127.0.0.1", advertise="127.0.0.1", heartbeat_s=HEARTBEAT_S, tick_s=0.5, own_process=True
    )
    daemon = Timed(store, AllRunning(nodes), "load", settings)
    daemon.install_signal_handlers()
    try:
        daemon.run()
    finally:
        passes = heartbeats["passes"].passes if "passes" in heartbeats else 0
        policy = heartbeats.get("borrowing")
        doc = {"ticks": ticks, "tick_errors": daemon.stats.tick_errors, "heartbeats": heartbeats.get("counts", {}),
               "passes": passes, "decisions": getattr(policy, "decisions", None),
               "skipped": getattr(policy, "skipped", None), "served": served, "gc": pauses}  # fmt: skip
        Path(out).write_text(json.dumps(doc))
        if profiler is not None:
            profiler.dump_stats(profile)


# -- the fake agents ---------------------------------------------------------------------------------------
class Agents:
    def __init__(self, url: str, secret: str, allocations: list[dict]):
        self.url, self.secret, self.allocations = url, secret, allocations
        self.held: list[float] = []  # latency of long polls answered unchanged (round trip - hold)
        self.plain: list[float] = []  # round trip of heartbeats not held
        self.woken = 0  # long polls answered early with a change
        self.errors: list[str] = []
        self.progress: list[float] = []
        self.stop = asyncio.Event()

    def headers(self, credential: str | None = None, alloc: int | None = None) -> dict:
        h = {"X-Pearl-Run": "load", "content-type": "application/json"}
        if credential is None:
            h["authorization"] = f"Bearer {self.secret}"
        else:
            h.update({"authorization": f"Bearer {credential}", "X-Pearl-Allocation": str(alloc)})
        return h

    async def agent(self, session, alloc: dict, measuring: asyncio.Event) -> None:
        body = {"job_id": alloc["job_id"], "task_id": alloc["array_index"], "node": alloc["node"],
                "gpus": list(range(alloc["gpus"])), "pid": 1000 + alloc["id"]}  # fmt: skip
        async with session.post(f"{self.url}/v1/agents/register", json=body, headers=self.headers()) as r:
            if r.status != 200:
                self.errors.append(f"register {alloc['id']}: {r.status} {await r.text()}")
                return
            reg = await r.json()
        aid, headers = reg["allocation_id"], self.headers(reg["credential"], reg["allocation_id"])
        report: list[dict] = []
        digest = None
        while not self.stop.is_set():
            hb = {"allocation_id": aid, "workers": report, "epoch_seen": reg["epoch"]}
            wait = HEARTBEAT_S if digest is not None else 0.0
            if wait:
                hb.update(desired_hash=digest, wait_s=wait)
            t0 = time.perf_counter()
            try:
                async with session.post(f"{self.url}/v1/agents/heartbeat", json=hb, headers=headers) as r:
                    answer = await r.json()
                    status = r.status
            except Exception as exc:  # noqa: BLE001 — counted, the agent goes on as a real one would
                self.errors.append(f"heartbeat {aid}: {type(exc).__name__}: {exc}")
                await asyncio.sleep(HEARTBEAT_S)
                continue
            rtt = time.perf_counter() - t0
            if status != 200:
                self.errors.append(f"heartbeat {aid}: {status} {answer}")
                await asyncio.sleep(HEARTBEAT_S)
                continue
            if measuring.is_set():
                if not wait:
                    self.plain.append(rtt)
                elif answer["desired_hash"] == digest:
                    self.held.append(max(0.0, rtt - wait))
                else:
                    self.woken += 1
            digest = answer["desired_hash"]
            new = [
                {"key": w["key"], "role": w["role"], "engine": w["engine"], "gpus": w["gpus"],
                 "state": "READY" if w["state"] == "RUNNING" else w["state"], "pid": 10_000 + aid,
                 **({"url": f"http://{alloc['node']}:8000"} if w["engine"] == "vllm" else {})}
                for w in answer["desired"]
            ]  # fmt: skip
            if new != report:
                report, digest = new, None  # a changed report goes out at once, not held

    async def rollout_driver(self, session, measuring: asyncio.Event) -> None:
        step, done = 0, 0
        while not self.stop.is_set():
            done += 50
            body = {"step": step, "queued": 4096, "generating": 2048, "tool_wait": 1024, "done": done,
                    "tokens": done * 400}  # fmt: skip
            t0 = time.perf_counter()
            async with session.post(f"{self.url}/v1/rollout/progress", json=body, headers=self.headers()) as r:
                if r.status != 200:
                    self.errors.append(f"progress: {r.status} {await r.text()}")
            if measuring.is_set():
                self.progress.append(time.perf_counter() - t0)
            await asyncio.sleep(1.0)

    async def run(self, warmup_s: float, seconds: float) -> tuple[float, float]:
        import aiohttp

        measuring = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks = [asyncio.create_task(self.agent(session, a, measuring)) for a in self.allocations]
            tasks.append(asyncio.create_task(self.rollout_driver(session, measuring)))
            await asyncio.sleep(warmup_s)
            gc.collect()  # the agents' process as the daemon's: warm-up garbage gone, the rest frozen
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            measuring.set()
            started, since = time.monotonic(), time.time()
            await asyncio.sleep(seconds)
            self.stop.set()
            wall = time.monotonic() - started
            await asyncio.wait(tasks, timeout=2 * HEARTBEAT_S + 5)
            for task in tasks:  # an agent that died is an error of the benchmark, never a quiet agent less
                if task.done() and not task.cancelled() and task.exception() is not None:
                    self.errors.append(f"agent task failed: {type(task.exception()).__name__}: {task.exception()}")
            return since, wall


def proc_cpu_rss(pid: int) -> tuple[float, int, int]:
    """(user+system CPU seconds, RSS bytes, peak RSS bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return cpu, int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=512)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=120.0)
    # 512 registrations and the workers they create take 10–40 s here: measuring earlier counts their stragglers
    ap.add_argument("--warmup", type=float, default=40.0)
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of the daemon's ticks to FILE (pstats)")
    ap.add_argument("--daemon", nargs=2, metavar=("STATE_DB", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    _targets.add_arguments(ap, TARGETS)
    args = ap.parse_args()
    targets = _targets.resolve(ap, args, TARGETS)
    if args.daemon:
        daemon_main(*args.daemon, profile=args.profile, profile_after_s=args.warmup)
        return 0

    from pearlctl.host.runfiles import read_address, read_secret
    from pearlctl.state.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="pearl-load-"))
    state_db, run_dir, out = str(tmp / "state.db"), tmp / "run", str(tmp / "daemon.json")
    run_dir.mkdir()
    create_run(state_db, str(run_dir), args.agents, args.gpus_per_node)
    log = open(tmp / "daemon.log", "w")  # noqa: SIM115
    argv = [sys.executable, __file__, "--daemon", state_db, out, "--warmup", str(args.warmup)]
    argv += ["--profile", args.profile] if args.profile else []
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while (address := read_address(run_dir)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start: see {tmp / 'daemon.log'}")
            time.sleep(0.1)
        with Store.open(state_db, readonly=True) as store:
            allocations = [{**a.to_dict(), "gpus": args.gpus_per_node} for a in store.fleet.allocations("load")]
        agents = Agents(address["url"], read_secret(run_dir), allocations)
        cpu0, _, _ = proc_cpu_rss(proc.pid)
        import uvloop

        since, wall = uvloop.run(agents.run(args.warmup, args.seconds))
        cpu1, rss, peak = proc_cpu_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    daemon = json.loads(Path(out).read_text())
    with Store.open(state_db, readonly=True) as store:
        lost = [j for j in store.journal.read("load") if j["entity"] == "gpus" and j["to_state"] == "LOST"]
        lost_gpus = sum(1 for g in store.fleet.gpus("load") if g.state == "LOST")
        gpus = len(store.fleet.gpus("load"))
    heartbeats = agents.held + agents.plain
    measured = [t for t in daemon["ticks"] if since <= t[0] <= since + wall]  # the measured window only
    ticks, tick_cpu = [t[1] for t in measured], [t[2] for t in measured]
    window = [x for x in daemon["served"] if since <= x[0] <= since + wall]
    # held: answered after half the interval or more (its hold is the whole interval, by the daemon's clock)
    in_daemon = [max(0.0, took - HEARTBEAT_S) if took >= HEARTBEAT_S / 2 else took for _, took in window]
    pauses = [x for x in daemon["gc"] if since <= x[0] <= since + wall]
    ms = 1000.0
    lines = [
        f"run: {len(allocations)} agents, {gpus} GPUs, heartbeat {HEARTBEAT_S:g} s (long polls), {wall:.0f} s "
        f"measured after a {args.warmup:g}-s warm-up",
        "",
        "| what | n | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, values in (
        ("heartbeat (all)", heartbeats),
        ("heartbeat held (round trip − hold)", agents.held),
        ("heartbeat not held (round trip)", agents.plain),
        ("heartbeat in the daemon (arrival to answer − hold)", in_daemon),
        ("rollout progress report", agents.progress),
        ("control-loop tick", ticks),
        ("control-loop tick: its thread's CPU", tick_cpu),
    ):
        if not values:
            lines.append(f"| {name} | 0 | — | — | — | — |")
            continue
        lines.append(
            f"| {name} | {len(values):,} | {quantile(values, 0.5) * ms:.1f} ms | {quantile(values, 0.9) * ms:.1f} ms "
            f"| {quantile(values, 0.99) * ms:.1f} ms | {max(values) * ms:.1f} ms |"
        )
    rate = len(heartbeats) / wall
    mib = 2**20
    cores = (cpu1 - cpu0) / wall
    lines += [
        "",
        f"heartbeats/s: {rate:.0f}; long polls woken early by a change: {agents.woken}; errors: {len(agents.errors)}; "
        f"the policy decided in {daemon.get('decisions')} ticks and was skipped in {daemon.get('skipped')} (inputs "
        f"unchanged); daemon: CPU {cores:.2f} cores (user+system), RSS {rss / mib:.0f} MiB (peak {peak / mib:.0f} "
        f"MiB); tick errors: {daemon['tick_errors']}; GPUs LOST now: {lost_gpus}; LOST events: {len(lost)}",
    ]
    for generation in (0, 1, 2):
        took = [x[2] for x in pauses if x[1] == generation]
        if took:
            lines.append(
                f"the daemon's collections of generation {generation}: {len(took)}, longest {max(took) * ms:.1f} ms, "
                f"{sum(took) * ms:.0f} ms in all"
            )
    print("\n".join(lines))
    print(f"the daemon's heartbeats (whole run): {dict(daemon['heartbeats'])}; long-poll passes: {daemon['passes']}")
    for e in agents.errors[:5]:
        print("  ", e)
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.2f}")
    print(f"(daemon log: {tmp / 'daemon.log'})")
    results = [
        (targets["false_lost"], float(len(lost) + lost_gpus)),
        (targets["tick_p99_ms"], quantile(ticks, 0.99) * ms),
        (targets["heartbeat_p99_ms"], quantile(heartbeats, 0.99) * ms),
        (targets["errors"], float(len(agents.errors) + daemon["tick_errors"])),
    ]
    status = _targets.verdict("bench_daemon_load", results, check=args.check, summary=args.summary, moved=args.target)
    if args.write_docs:
        held = _targets.summary_line(results)
        command = f"python tests/benchmarks/bench_daemon_load.py --seconds {args.seconds:g} --write-docs"
        _targets.write_block(
            DOC,
            "bench_daemon_load",
            f"`{command}`, {_targets.stamp()}:\n\n" + "\n".join(lines) + f"\n\nTargets: {held}.",
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
