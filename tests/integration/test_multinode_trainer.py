"""A trainer of two nodes on the local Slurm cluster: one real DeepSpeed job of world size 4 (2 nodes x 2 ranks on
CPU, torchrun's c10d rendezvous at node 0, set up by the agents), one agent per node, rollout workers on the paced
engine (docs/paced.md: what is checked here is the trainer's and the control plane's; vLLM's side of a borrow, its
weight reload included, is tests/integration/test_borrow_e2e.py's), the daemon and the reference rollout driver.

- The trainer trains as one job: every start says world size 4, the losses are finite, the steps contiguous.
- Borrowing works per node: the greedy policy lends one trainer GPU, every rank offloads (the hook's
  agreement spans both nodes), the rollout worker runs on the lent GPU's node only, and it comes back with
  every deadline met. It loads each new version from its node's weight store in shared memory, which the
  trainer's ranks on that node wrote, never from the shared disk (its agent's log says where from).
- A preemption requeues the whole job (a high-priority job takes one of its nodes, borrowing turned off and nothing
  lent by then): both nodes stop, the ranks checkpoint jointly on the notice, and the requeued job resumes at the
  step after the checkpoint.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pearlctl.state.machines import OPEN_TRANSITION_STATES
from tests.conftest import REPO, wait_for
from tests.engines.conftest import PACED_RUN
from tests.integration.conftest import spec_run
from tests.integration.test_borrow_e2e import spec_text as borrow_spec

# a real 4-rank trainer on a 2-core machine
pytestmark = pytest.mark.timeout(1500)

STEPS = 5


def spec_text(run_dir: Path) -> str:
    """The borrow e2e's tiny run with a trainer of 2 nodes, preemptible and requeued."""
    return borrow_spec(
        run_dir,
        name="mn",
        steps=STEPS,
        nodes=2,
        trainer_pool='partition = "preempt"\nrequeue = true\npreempt_notice_s = 10',
        run_extra=PACED_RUN,
    )


@pytest.fixture
def mn(slurm_cluster, tmp_path):
    with spec_run(slurm_cluster, tmp_path / "state", "mn", spec_text) as run:
        yield run


def train_events(run_dir: Path) -> list[dict]:
    log = run_dir / "trainer" / "train.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_two_node_trainer_trains_as_one_job_lends_one_node_and_resumes_after_a_requeue(mn, slurm_cluster):
    pc, d = mn
    run_dir = d / "run"
    pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
    doc = pc.json("status", "mn")
    trainer = [a for a in doc["allocations"] if a["pool"] == "trainer"]
    assert len({a["job_id"] for a in trainer}) == 1 and sorted(a["array_index"] for a in trainer) == [0, 1]
    assert len({a["node"] for a in trainer}) == 2, trainer  # one job, two nodes, one allocation per node
    pc("daemon", "mn", "--heartbeat-s", "1", "--json")
    pc("borrow", "mn", "--policy", "greedy", "--gpus", "1")
    run_id = doc["run"]["id"]
    driver = subprocess.Popen(
        [sys.executable, str(REPO / "examples/grpo/rollout.py"), "--run-dir", str(run_dir), "--run-id", run_id,
         "--out", str(run_dir / "rollouts"), "--steps", str(STEPS), "--prompts", "4", "--group-size", "4",
         "--concurrency", "4", "--tool-latency-s", "12", "--tool-latency-dist", "fixed"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=pc.env,
    )  # fmt: skip
    try:
        # a borrow done and returned (a cold start may first be rolled back at its deadline on this busy machine,
        # and parked: the next borrow wakes it), then preempt the job, with steps left to train after the resume,
        # through the trainer's node that does not run the rollout pool
        def lent_and_back():
            t = pc.json("status", "mn")["transitions"]
            done = {x["kind"] for x in t if x["state"] == "DONE"}
            steps = [e["step"] for e in train_events(run_dir) if e["event"] == "step"]
            assert not steps or steps[-1] < STEPS - 1, "no borrow came back early enough to preempt mid-run"
            return {"borrow", "return"} <= done and steps

        wait_for(lent_and_back, 900, every=2)
        # the preemption under test comes while nothing is lent: the greedy policy would lend again at once, and a
        # GPU lent as the job is preempted is returned only to the requeued trainer (its deadline judged missed)
        pc("borrow", "mn", "--policy", "never")

        def nothing_lent():
            d = pc.json("status", "mn")
            moving = any(t["state"] in OPEN_TRANSITION_STATES for t in d["transitions"])
            return not moving and not any(g["borrowed"] for g in d["gpus"]) and d

        doc = wait_for(nothing_lent, 120, every=1)
        rollout_nodes = {a["node"] for a in doc["allocations"] if a["pool"] == "rollout"}
        victim = next(
            a["node"] for a in doc["allocations"] if a["pool"] == "trainer" and a["node"] not in rollout_nodes
        )
        high = slurm_cluster.run(
            "sbatch", "--parsable", "-p", "high", "-w", victim, "--exclusive", "-o", "/dev/null", "--wrap", "sleep 600"
        ).stdout.strip()  # fmt: skip

        def requeued():
            allocs = [a for a in pc.json("status", "mn")["allocations"] if a["pool"] == "trainer"]
            return all(a["restarts"] >= 1 for a in allocs)

        wait_for(requeued, 180, every=1)
        slurm_cluster.run("scancel", high)
        out, _ = driver.communicate(timeout=900)
        assert driver.returncode == 0, out[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()

    wait_for(lambda: any(e["event"] == "done" for e in train_events(run_dir)), 300, every=1)
    events = train_events(run_dir)
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and {e["world_size"] for e in starts} == {4}  # one job of 4 ranks, run twice
    resume = [e for e in events if e["event"] == "resume"]
    steps = [e for e in events if e["event"] == "step"]
    # the requeued job resumed at the step after the joint checkpoint, and no step was trained twice or lost
    assert resume and starts[1]["first_step"] == resume[-1]["step"] + 1
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) for e in steps)
    releases = [e for e in events if e["event"] == "release" and e["ok"]]
    assert releases, "no rank offloaded for a borrow"

    doc = pc.json("status", "mn")
    trainer_ids = {a["id"] for a in doc["allocations"] if a["pool"] == "trainer"}
    lent = [w for w in doc["workers"] if w["allocation_id"] in trainer_ids and w["role"] == "ROLLOUT"]
    assert lent and len({w["allocation_id"] for w in lent}) == 1, lent  # it served on one node's GPUs only
    # the lent worker loaded every new version from its node's shared-memory store, never from the shared disk
    reloads = [line for p in sorted((run_dir / "logs").glob("trainer-*.log")) for line in p.read_text().splitlines()
               if "now serves weights" in line]  # fmt: skip
    assert reloads and all("from the node-local store /dev/shm/pearl/" in line for line in reloads), reloads
    journal = pc.json("journal", "mn")
    deadlines = [j["event"] for j in journal if j["event"].startswith("deadline")]
    assert deadlines and set(deadlines) == {"deadline met"}, deadlines
    print(json.dumps({"resume": resume[-1]["step"], "deadlines": deadlines, "lent_workers": len(lent)}))
