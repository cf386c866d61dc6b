"""End to end on the local Slurm cluster with real engines: a DeepSpeed trainer (2 CPU ranks) and a
vLLM rollout worker, the daemon, the reference rollout driver (multi-turn episodes with a tool), and
borrowing under the greedy policy: an idle trainer GPU becomes a serving vLLM worker and comes back
(the worker parked asleep and woken for the next borrow), weights sync every step, and the trainer
loses no step. The trainer gives no hint of its first wait: with the run's rollout worker profiled, the
daemon lends into the first batch on its prediction of that batch, and every return deadline is met.

One run carries two faults, each checked as its own test once did on a run of its own:

- the first daemon SIGKILLs itself right after the INTENT of the first START; a second one takes over and
  finishes that borrow without starting a second vLLM;
- the return guarantee with slurmctld frozen (SIGSTOP) while a GPU is lent and every agent heartbeats, for 60 s
  and then until a return is done: the daemon stays up and keeps its lease, nothing is marked LOST, the return
  is made during the freeze and every return deadline is met, every step is trained, and after SIGCONT the
  Slurm view converges.

Times are judged from recorded timestamps (state, journal, the trainer's log), not the test's clock."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.state.machines import OPEN_TRANSITION_STATES
from tests.conftest import REPO, Pearlctl, alive, wait_for
from tests.engines.conftest import PLACEHOLDER
from tests.integration.conftest import spec_run

# two steps: a cold borrow and its return (the worker parked asleep) in the first; in the second, served on the
# first step's weights, a warm borrow when the wait allows one
STEPS = 2
# 16 episodes a step, 4 at a time, with a 20-s tool call each: a batch of about 85 s, which the daemon
# predicts long enough for a cold borrow and its return as estimated before any was measured (62 s and 5 s)
TOOL_S = 20


ROLLOUT_POOL = """
[pools.rollout]
partition = "debug"
nodes = 1
gpus_per_node = 1
engine_args = { max_model_len = 512 }
"""


def spec_text(
    run_dir: Path,
    *,
    name: str = "e2e",
    steps: int = STEPS,
    train_args: tuple[str, ...] = (),
    generation_pools: str = ROLLOUT_POOL,
    policy: str = "never",
    trainer: bool | str = True,
    nodes: int = 1,
    trainer_pool: str = 'partition = "debug"',
    run_extra: str = "",
) -> str:
    """The tiny run on the bundled cluster: a 2-rank DeepSpeed trainer on 2 GPUs reading rollout batches from
    RUN_DIR/rollouts, and one vLLM rollout worker (or ``generation_pools``: TOML of rollout/elastic pools);
    ``train_args`` go to examples/grpo/train.py. ``trainer=False``: the trainer task holds its 2 GPUs with a
    placeholder process instead, for tests of the rollout side that do not need training; ``trainer="paced"``:
    the paced trainer (pearlctl.trainer.paced: the real hook, 1-s steps) on one rank, for tests of the control
    plane that need a trainer's phases and weights but not its training. ``nodes``: that
    many such nodes as one trainer (one job; torchrun without --standalone); ``trainer_pool``: its other keys;
    ``run_extra``: more ``[run]`` keys (``PACED``: the paced engine in vLLM's place)."""
    py = sys.executable
    train = [
        py,
        "-m",
        "torch.distributed.run",
        *(["--standalone"] if nodes == 1 else []),
        "--nproc_per_node",
        "2",
        str(REPO / "examples/grpo/train.py"),
        "--model",
        str(REPO / "examples/models/tiny"),
        "--steps",
        str(steps),
        "--out",
        str(run_dir / "trainer"),
        "--rollouts",
        f"file:{run_dir / 'rollouts'}",
        "--channel",
        "daemon",
        *train_args,
    ]
    if trainer == "paced":
        train = [py, "-m", "pearlctl.trainer.paced", *train[train.index("--model") :], "--train-step-s", "1"]
    elif not trainer:
        train = PLACEHOLDER
    return f"""
[run]
name = "{name}"
model = "{REPO / "examples/models/tiny"}"
run_dir = "{run_dir}"
poll_interval_s = 2
policy = "{policy}"
{run_extra}
[pools.trainer]
{trainer_pool}
nodes = {nodes}
gpus_per_node = 2
env = {{ OMP_NUM_THREADS = "1" }}
train_command = {json.dumps(train)}
{generation_pools}"""


def profile(pc: Pearlctl, name: str) -> None:
    """Measure the run's serving rollout worker into its profile (``pearlctl profile``, a short sweep): what
    the daemon predicts the first batch with, before the trainer measured a wait."""

    def serving():
        workers = pc.json("status", name, "--no-sync")["workers"]
        return any(w["state"] == "READY" and w["role"] == "ROLLOUT" and w["url"] for w in workers)

    wait_for(serving, 240)
    pc("profile", name, "--batches", "1,4", "--contexts", "32", "--repeats", "1", timeout=600)


def assert_first_batch_lent_and_deadlines_met(doc: dict, journal: list[dict]) -> dict:
    """The first borrow was planned before the first train step began — from state's and the journal's times
    — on the daemon's prediction (the trainer reported no wait), and every return met its deadline. Returns
    the times, for the log."""
    train1 = min(
        j["ts"]
        for j in journal
        if j["event"] == "trainer phase" and (j["data"] or {}).get("phase") == "training" and j["data"]["step"] == 1
    )
    borrows = sorted((t for t in doc["transitions"] if t["kind"] == "borrow"), key=lambda t: t["created_at"])
    assert borrows and borrows[0]["created_at"] < train1, (borrows[:1], train1)
    assert borrows[0]["detail"]["wait_from"] == "prediction", borrows[0]["detail"]
    returns = [t for t in doc["transitions"] if t["kind"] == "return" and t["state"] == "DONE"]
    verdicts = [j["event"] for j in journal if j["event"] in ("deadline met", "deadline missed")]
    assert returns and verdicts == ["deadline met"] * len(returns), (verdicts, len(returns))
    return {"first_lend_before_train_s": round(train1 - borrows[0]["created_at"], 3), "returns": len(returns)}


@pytest.fixture
def e2e(slurm_cluster, tmp_path):
    with spec_run(slurm_cluster, tmp_path / "state", "e2e", spec_text) as run:
        yield run


def serving_lent(pc: Pearlctl, name: str) -> list[dict]:
    """Lent GPUs whose borrow is DONE (the vLLM worker on them serves), and no transition is moving."""
    doc = pc.json("status", name)
    moving = any(t["state"] in OPEN_TRANSITION_STATES for t in doc["transitions"])
    borrowed = any(t["kind"] == "borrow" and t["state"] == "DONE" for t in doc["transitions"])
    lent = [g for g in doc["gpus"] if g["borrowed"]]
    return lent if borrowed and not moving else []


FREEZE_S = 60


def returned_since(pc, run: str, since: float) -> bool:
    """A return of a lent GPU finished after ``since`` (status reads the state only while the daemon holds its
    lease: it asks Slurm nothing)."""
    return any(
        t["kind"] == "return" and t["state"] == "DONE" and t["updated_at"] >= since
        for t in pc.json("status", run)["transitions"]
    )


@pytest.mark.timeout(1200)  # two batches of ~85 s, the launch, the profile, a daemon's restart, a freeze of 60+ s
def test_borrow_end_to_end_with_real_engines_through_a_daemon_crash_and_a_frozen_slurmctld(e2e, slurm_cluster):
    pc, d = e2e
    run_dir = d / "run"
    pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
    # The first daemon SIGKILLs itself right after writing the INTENT of the first START (vLLM on a lent
    # GPU); a second daemon takes over and must finish that borrow without starting a second vLLM.
    faulty = Pearlctl(pc.env["PEARL_STATE_DIR"], dict(pc.env, PEARL_FAULT="after_intent:START"))
    first = json.loads(faulty("daemon", "e2e", "--heartbeat-s", "1", "--lease-ttl-s", "3", "--json").stdout)
    profile(pc, "e2e")  # no PEARL_FIRST_WAIT_S: the first batch's wait is the daemon's prediction
    pc("borrow", "e2e", "--policy", "greedy", "--gpus", "1")
    run_id = pc.json("status", "e2e")["run"]["id"]
    restarted = []

    def restart_after_crash():
        while alive(first["pid"]):
            time.sleep(0.2)
        for _ in range(50):  # the lease of the killed daemon must expire first
            out = pc("daemon", "e2e", "--heartbeat-s", "1", "--lease-ttl-s", "3", "--json", check=None)
            if out.returncode == 0:
                restarted.append(json.loads(out.stdout))
                return
            time.sleep(0.5)

    threading.Thread(target=restart_after_crash, daemon=True).start()
    driver_log = open(run_dir / "driver.log", "w")  # noqa: SIM115 (closed below)
    driver = subprocess.Popen(
        [sys.executable, str(REPO / "examples/grpo/rollout.py"), "--run-dir", str(run_dir), "--run-id", run_id,
         "--out", str(run_dir / "rollouts"), "--steps", str(STEPS), "--prompts", "4", "--group-size", "4",
         "--concurrency", "4", "--tool-latency-s", str(TOOL_S), "--tool-latency-dist", "fixed"],
        stdout=driver_log, stderr=subprocess.STDOUT, env=pc.env,
    )  # fmt: skip
    try:
        # once the (restarted) daemon's borrow is done and a trainer GPU serves rollout: slurmctld frozen
        wait_for(lambda: serving_lent(pc, "e2e"), 400, every=0.5)
        assert restarted, "no second daemon took over from the one that crashed in the first START"
        daemon = restarted[0]
        ctld = int((slurm_cluster.dir / "pids" / "slurmctld.pid").read_text())
        os.kill(ctld, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            time.sleep(FREEZE_S)  # past the Slurm polls' 30-s timeout
            # and frozen until the batch's end has brought a return (the lent GPU may have joined early in it)
            wait_for(lambda: returned_since(pc, "e2e", frozen_at), 300, every=1)
            assert alive(daemon["pid"]), "the daemon died while slurmctld was frozen"
        finally:
            thawing_at = time.time()  # before the SIGCONT: slurmctld answers nothing sooner
            os.kill(ctld, signal.SIGCONT)
        thawed_at = time.time()
        assert driver.wait(600) == 0, (run_dir / "driver.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        driver_log.close()

    # the trainer trained every step, in order, with finite losses (no step lost to a borrow)
    log = run_dir / "trainer" / "train.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and '"done"' not in (log.read_text() if log.exists() else ""):
        time.sleep(1)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) for e in steps)
    releases = [e for e in events if e["event"] == "release" and e["ok"]]
    reclaims = [e for e in events if e["event"] == "reclaim" and e["ok"]]
    assert releases and len(reclaims) >= len(releases)

    doc = pc.json("status", "e2e")
    borrows = [t for t in doc["transitions"] if t["kind"] == "borrow" and t["state"] == "DONE"]
    returns = [t for t in doc["transitions"] if t["kind"] == "return" and t["state"] == "DONE"]
    assert borrows and returns, doc["transitions"]
    trainer_alloc = next(a["id"] for a in doc["allocations"] if a["pool"] == "trainer")
    borrowed = [w for w in doc["workers"] if w["allocation_id"] == trainer_alloc and w["role"] == "ROLLOUT"]
    # one vLLM process for every borrow: started cold once, parked asleep on each return, woken after
    assert len(borrowed) == 1 and borrowed[0]["state"] == "SLEEPING" and not borrowed[0]["routable"]
    plans = [(t["detail"] or {}).get("plan") for t in doc["transitions"] if t["state"] == "DONE"]
    assert plans[:2] == ["borrow", "return_sleep"] and set(plans[2:]) <= {"borrow_warm", "return_sleep"}
    assert not any(g["borrowed"] for g in doc["gpus"])  # every lent GPU is back with the trainer
    assert all(a["state"] == "RUNNING" for a in doc["allocations"])  # the Slurm view converged after the thaw

    # the borrowed worker served episodes, and every step after the first ran on the previous step's weights
    served = {}
    for step in range(1, STEPS + 1):
        groups = [json.loads(x) for x in (run_dir / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()]
        served[step] = [s for g in groups for s in g["served_by"]]
    borrowed_urls = {w["url"] for w in borrowed}
    assert any(s["worker"] in borrowed_urls for ss in served.values() for s in ss)
    for step in range(2, STEPS + 1):
        assert {s["weight_version"] for s in served[step]} == {str(step - 1)}

    # the crash happened where it was meant to, a second daemon finished the job, and no engine started twice
    assert daemon["epoch"] > first["epoch"]
    assert "PEARL_FAULT after_intent:START" in (run_dir / "logs" / "daemon.log").read_text()
    assert len(borrowed) == 1  # the restarted daemon did not start a second vLLM on the lent GPU

    journal = pc.json("journal", "e2e")
    assert any(j["event"] == "effect re-issued after restart" for j in journal)
    lending = assert_first_batch_lent_and_deadlines_met(doc, journal)
    done_kinds = [j["data"]["kind"] for j in journal if j["entity"] == "steps" and j["event"] == "step.intent"]
    assert done_kinds[:4] == ["OFFLOAD", "START", "VERIFY", "REGISTER"]

    # the freeze: the second daemon kept its lease (nobody acquired it after it, it was never deposed) and
    # outlived it; nothing was marked LOST; a return was made while slurmctld was frozen; Slurm polls failed
    # meanwhile (journaled, not fatal) and recovered after SIGCONT
    assert alive(daemon["pid"]) and read_address(run_dir)["epoch"] == daemon["epoch"]
    epochs = {j["epoch"] for j in journal if j["event"] == "lease.acquired"}
    assert epochs <= {first["epoch"], daemon["epoch"]}, epochs
    lost = [j for j in journal if j.get("to_state") == "LOST"]
    assert not lost, lost
    assert any(frozen_at <= t["updated_at"] <= thawed_at for t in returns), (frozen_at, thawed_at, returns)
    assert any(j["event"] == "poll error" for j in journal)
    recovered = wait_for(lambda: [j for j in pc.json("journal", "e2e") if j["event"] == "poll recovered"], 60)
    # after the thaw began (a poll blocked on the frozen slurmctld may finish, and journal its recovery, before
    # the test's own clock is read after the SIGCONT)
    assert recovered[-1]["ts"] >= thawing_at
    print(
        json.dumps(
            {
                "borrows": len(borrows),
                "returns": len(returns),
                "deadline": [j["event"] for j in journal if j["event"].startswith("deadline")],
                **lending,
            }
        )
    )
