"""The return guarantee on the real local Slurm cluster: a real 2-rank DeepSpeed trainer (CPU), rollout on the paced
engine (docs/paced.md: what is checked here is the agent's, the trainer hook's and the daemon's), the reference
rollout driver and the daemon lending a trainer GPU under the greedy policy: the daemon SIGKILLed and kept down
while a GPU is lent. The agent on the trainer's node returns the GPU by itself, the trainer reclaims on the node
and trains its next step within the deadline plus one return's time; then a supervised daemon comes up within
seconds, journals what happened and converges, and a SIGKILL of the supervised daemon is followed by a new one
within seconds.

(With vLLM on the lent GPU, the end-to-end borrow's run checks the rest on real engines:
tests/integration/test_borrow_e2e.py SIGKILLs its daemon once the trainer has offloaded and a GPU is lent — a new
daemon finishes the borrow with one vLLM started — and freezes slurmctld for 60 s while a GPU is lent.)

Times are judged from recorded timestamps (state, journal, the trainer's log), not the test's clock.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.state.store import Store
from tests.conftest import REPO, Pearlctl, alive, wait_for
from tests.engines.conftest import PACED_RUN
from tests.integration.test_borrow_e2e import spec_text as e2e_spec

STEPS = 3
HEARTBEAT = "1"
pytestmark = pytest.mark.timeout(1500)  # a tiny run of 3 steps with a real trainer: minutes, not seconds


def spec_text(run_dir: Path, name: str) -> str:
    return e2e_spec(run_dir, name=name, steps=STEPS, run_extra=PACED_RUN)


class Run:
    def __init__(self, pc: Pearlctl, d: Path, name: str):
        self.pc, self.d, self.name = pc, d, name
        self.run_dir = d / "run"
        self.state_db = Path(pc.env["PEARL_STATE_DIR"]) / "state.db"

    def status(self) -> dict:
        return self.pc.json("status", self.name)

    def journal(self) -> list[dict]:
        return self.pc.json("journal", self.name)

    def driver(self, run_id: str, tool_s: float = 12) -> subprocess.Popen:
        """The reference driver, 16 episodes a step, 4 at a time, ``tool_s`` per tool call: a batch of about four
        tool calls, 48 s, in which a cold borrow and its return as the daemon estimates them before it measured one
        (27 and 5 s, 2 s of slack: pearlctl.daemon.borrowing, pearlctl.planner.budget) fit. (At 8 s a batch took
        31-33 s: the greedy policy lent only when a busy machine made it longer, and a quiet run failed.)"""
        args = ["--run-dir", str(self.run_dir), "--run-id", run_id, "--out", str(self.run_dir / "rollouts"),
                "--steps", str(STEPS), "--prompts", "4", "--group-size", "4", "--concurrency", "4",
                "--tool-latency-s", str(tool_s), "--tool-latency-dist", "fixed"]  # fmt: skip
        log = open(self.run_dir / "driver.log", "w")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(
            [sys.executable, str(REPO / "examples/grpo/rollout.py"), *args], stdout=log, stderr=log, env=self.pc.env
        )

    def lent(self) -> list[dict]:
        return [g for g in self.status()["gpus"] if g["borrowed"]]

    def trainer_events(self) -> list[dict]:
        log = self.run_dir / "trainer" / "train.jsonl"
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    def trained_all(self) -> list[dict] | None:
        events = self.trainer_events()
        return events if any(e["event"] == "done" for e in events) else None

    def return_cost(self) -> float:
        """The daemon's own running estimate of one return (its deadline rules use the same number)."""
        from pearlctl.daemon.policy_view import PolicyInputs

        with Store.open(self.state_db, readonly=True) as store:
            run_id = store.runs.find(self.name)["id"]
            return PolicyInputs(store, run_id).cost("return")


@pytest.fixture
def tiny_run(slurm_cluster, tmp_path, request):
    slurm_cluster.cancel_all()
    name = request.param
    d = slurm_cluster.new_shared_dir(name)
    (d / "run.toml").write_text(spec_text(d / "run", name))
    pc = Pearlctl(tmp_path / "state", slurm_cluster.env)
    pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
    run = Run(pc, d, name)
    procs: list[subprocess.Popen] = []
    yield run, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
    _stop_daemons(run.run_dir)
    slurm_cluster.cancel_all()


def _stop_daemons(run_dir: Path) -> None:
    address = read_address(run_dir)
    for pid in {address["pid"]} if address else set():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    # a supervisor (its pid is the daemon's parent) stops with its child's clean exit
    time.sleep(1)


def assert_every_step_trained(events: list[dict]) -> None:
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) for e in steps)


@pytest.mark.parametrize("tiny_run", ["down"], indirect=True)
def test_daemon_killed_and_kept_down_while_a_gpu_is_lent(tiny_run):
    run, procs = tiny_run
    first = json.loads(run.pc("daemon", run.name, "--heartbeat-s", HEARTBEAT, "--json").stdout)
    run.pc("borrow", run.name, "--policy", "greedy", "--gpus", "1")
    run_id = run.status()["run"]["id"]
    procs.append(run.driver(run_id))

    # once rollout clients know the workers (step 1 trained: the driver was served) and a GPU is lent again
    wait_for(lambda: [e for e in run.trainer_events() if e["event"] == "step"], 600, every=1)
    lent = wait_for(run.lent, 300, every=0.5)
    os.kill(first["pid"], signal.SIGKILL)  # kept down: nobody restarts it
    deadline = min(g["return_deadline"] for g in lent)
    one_return = run.return_cost()

    # the agent returned the GPU by itself and the trainer reclaimed on its node, in time
    def reclaimed_after_kill():
        return [e for e in run.trainer_events() if e["event"] == "reclaim" and e.get("ok")
                and str(e.get("command_id", "")).startswith("local-return:")]  # fmt: skip

    reclaim = wait_for(reclaimed_after_kill, deadline - time.time() + one_return + 120, every=1)[0]
    assert reclaim["ts"] <= deadline + one_return, (reclaim, deadline, one_return)
    agent_log = "\n".join(p.read_text() for p in (run.run_dir / "logs").glob("trainer-*.log"))
    assert '"event": "self return"' in agent_log
    # the trainer trains its next step (the driver finishes the batch on the rollout pool's worker)
    done = max(
        (e["step"] for e in run.trainer_events() if e["event"] == "step" and e["ts"] <= reclaim["ts"]), default=0
    )
    wait_for(lambda: [e for e in run.trainer_events() if e["event"] == "step" and e["step"] > done], 300)
    assert not alive(first["pid"])

    # supervised, a new daemon is up within seconds and converges: it journals the agent's own return and
    # finishes the return in state
    t0 = time.time()
    second = json.loads(run.pc("daemon", run.name, "--heartbeat-s", HEARTBEAT, "--supervise", "--json").stdout)
    assert second["epoch"] > first["epoch"] and second["started_at"] - t0 < 15
    journaled = wait_for(lambda: [x for x in run.journal() if x["event"] == "agent returned lent GPUs itself"], 60)
    assert journaled[0]["data"]["deadline"] == deadline and journaled[0]["data"]["how"] == "stopped"
    back = wait_for(lambda: (doc := run.status()) and not any(g["borrowed"] for g in doc["gpus"]) and doc, 120)
    assert all(g["state"] == "UP" for g in back["gpus"] if g["pool"] == "trainer")

    # a SIGKILLed supervised daemon is replaced within seconds
    killed_at = time.time()
    os.kill(second["pid"], signal.SIGKILL)
    third = wait_for(
        lambda: (a := read_address(run.run_dir)) and a["pid"] != second["pid"] and alive(a["pid"]) and a, 30, every=0.2
    )
    assert third["epoch"] > second["epoch"] and third["started_at"] - killed_at < 10

    events = wait_for(run.trained_all, 600, every=2)
    assert procs[0].wait(300) == 0, (run.run_dir / "driver.log").read_text()[-3000:]
    assert_every_step_trained(events)
    print(json.dumps({
        "reclaim_minus_deadline_s": round(reclaim["ts"] - deadline, 3), "one_return_s": round(one_return, 3),
        "supervised_start_s": round(second["started_at"] - t0, 3),
        "restart_after_sigkill_s": round(third["started_at"] - killed_at, 3),
    }))  # fmt: skip
    on_trainer = [
        w for w in run.status()["workers"] if w["role"] == "ROLLOUT" and w["allocation_id"] == lent[0]["allocation_id"]
    ]
    assert on_trainer, "the lent GPU never ran a rollout worker"
