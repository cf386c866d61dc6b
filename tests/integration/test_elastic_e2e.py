"""Live elasticity end to end on the local Slurm cluster: a trainer, serving workers on elastic (preemptible)
tasks behind the run's router, the daemon, and the reference rollout driver (multi-turn episodes with a tool)
sending every turn through the router's one OpenAI-compatible endpoint.

- The daemon grows the elastic pool from 1 task to 3 while a batch runs (policy ``elastic``: it wants every
  elastic GPU it can get) and shrinks it back when the batch ends: drain, then scancel. Sizing is the control
  plane's logic: paced engines and the paced trainer (pearlctl.trainer.paced) run it.
- A high-priority job preempts an elastic task while its worker serves: no episode is lost, the router stops
  routing to the worker before it dies, the pool shrinks in state, and the requeued task re-joins the router.
- The same with a hard kill (a partition with GraceTime 0), and with ``scancel`` of a fixed rollout task. All three
  on the paced engine (docs/paced.md), since what they check is the control plane's: the notice reaches the agent,
  the worker leaves the router and is drained or dies, the episodes continue elsewhere. vLLM's own drain and abort
  are tests/engines' (test_engine_contract.py, and the agent draining a leaving real worker under load in
  test_pd_switch_daemon.py and test_crash_matrix_moves.py).

The preemption and scancel tests are about the rollout side: their trainer task holds its GPUs with a
placeholder process rather than training (the DeepSpeed ranks would only compete for the 2 cores).

Each test prints the episodes expected and completed and the number of turns the router's gateway continued
on another worker. Elastic tasks ask for all 8 CPUs of a node (``cpus_per_task = 8``) so each runs on a node
of its own: a preemption then hits exactly one of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.router import service
from pearlctl.state.store import Store
from tests.conftest import REPO, Pearlctl, alive, wait_for
from tests.engines.conftest import PACED_RUN as PACED
from tests.integration.test_borrow_e2e import spec_text

pytestmark = pytest.mark.timeout(1500)

ENGINE = "engine_args = { max_model_len = 512 }"


def elastic_pool(*, nodes: int, max_nodes: int, partition: str = "preempt", notice_s: int = 10) -> str:
    return f"""
[pools.elastic]
partition = "{partition}"
nodes = {nodes}
max_nodes = {max_nodes}
gpus_per_node = 1
cpus_per_task = 8
pending_timeout_s = 120
preempt_notice_s = {notice_s}
{ENGINE}
"""


ROLLOUT2 = f"""
[pools.rollout]
partition = "debug"
nodes = 2
gpus_per_node = 1
cpus_per_task = 8
{ENGINE}
"""


class Run:
    def __init__(self, pc: Pearlctl, d: Path, name: str):
        self.pc, self.d, self.name = pc, d, name
        self.run_dir = d / "run"
        self.db = Path(pc.env["PEARL_STATE_DIR"]) / "state.db"
        self.driver: subprocess.Popen | None = None

    @property
    def run_id(self) -> str:
        return self.pc.json("status", self.name)["run"]["id"]

    def status(self) -> dict:
        return self.pc.json("status", self.name)

    def start_driver(self, *, steps: int, prompts: int, group: int, tool_s: float, max_tokens: int = 16) -> None:
        argv = [
            sys.executable, str(REPO / "examples/grpo/rollout.py"), "--run-dir", str(self.run_dir),
            "--run-id", self.run_id, "--out", str(self.run_dir / "rollouts"), "--steps", str(steps),
            "--prompts", str(prompts), "--group-size", str(group), "--concurrency", "8",
            "--tool-latency-s", str(tool_s), "--tool-latency-dist", "fixed", "--max-tokens", str(max_tokens),
        ]  # fmt: skip
        self.expected = steps * prompts * group
        log = open(self.run_dir / "logs" / "driver.log", "w")  # noqa: SIM115 (closed with the process)
        self.driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.pc.env})

    def finish_driver(self, timeout: float) -> int:
        assert self.driver is not None
        try:
            return self.driver.wait(timeout)
        except subprocess.TimeoutExpired:
            self.driver.kill()
            raise AssertionError(f"the driver did not finish in {timeout}s:\n{self.driver_log()}") from None

    def driver_log(self) -> str:
        return (self.run_dir / "logs" / "driver.log").read_text()[-4000:]

    def completed(self) -> int:
        n = 0
        for f in sorted((self.run_dir / "rollouts").glob("step-*.jsonl")):
            n += sum(len(json.loads(line)["rewards"]) for line in f.read_text().splitlines())
        return n

    def gateway_stats(self) -> dict:
        record = service.read_record(self.run_dir)
        key = service.read_key(self.run_dir)
        return httpx.get(record.url + "/pearl/stats", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()

    def journal(self) -> list[dict]:
        with Store.open(self.db, readonly=True) as store:
            return store.journal.read(self.run_id)

    def workers(self) -> list[dict]:
        with Store.open(self.db, readonly=True) as store:
            return store.fleet.workers(self.run_id)

    def allocations(self) -> list[dict]:
        with Store.open(self.db, readonly=True) as store:
            return store.fleet.allocations(self.run_id)


@pytest.fixture
def make_run(slurm_cluster, tmp_path):
    made: list[Run] = []

    def make(
        name: str,
        generation_pools: str,
        policy: str = "never",
        steps: int = 2,
        trainer: bool | str = True,
        paced: bool = False,
    ) -> Run:
        slurm_cluster.cancel_all()
        d = slurm_cluster.new_shared_dir(name)
        text = spec_text(
            d / "run",
            name=name,
            steps=steps,
            generation_pools=generation_pools,
            policy=policy,
            trainer=trainer,
            run_extra=PACED if paced else "",
        )
        (d / "run.toml").write_text(text)
        run = Run(Pearlctl(tmp_path / "state", slurm_cluster.env), d, name)
        run.pc("launch", str(d / "run.toml"), "--wait", "--timeout", "120")
        run.daemon = json.loads(run.pc("daemon", name, "--heartbeat-s", "1", "--json").stdout)
        made.append(run)
        return run

    yield make
    for run in made:
        if run.driver is not None and run.driver.poll() is None:
            run.driver.kill()
        run.pc("cancel", run.name, check=None)
        address = read_address(run.run_dir)
        if address and alive(address["pid"]):
            os.kill(address["pid"], signal.SIGTERM)
    slurm_cluster.cancel_all()


def routed_out_before_gone(run: Run, url: str, worker_id: int, journal: list[dict]) -> tuple[float, float]:
    """(when the router stopped routing to the worker at ``url``, when the worker stopped) from the journal."""
    removed = next(
        j["ts"] for j in journal if j["event"] == "router membership" and url in (j["data"] or {}).get("removed", [])
    )
    ended = ("STOPPED", "LOST", "FAILED")
    gone = next(
        j["ts"]
        for j in journal
        if j["entity"] == "workers" and j["entity_id"] == str(worker_id) and j["to_state"] in ended
    )
    return removed, gone


def test_the_elastic_pool_grows_for_a_batch_and_shrinks_when_it_ends(make_run):
    # elastic sizing is the control plane's: paced engines and the paced trainer (docs/paced.md)
    run = make_run("grow", elastic_pool(nodes=1, max_nodes=3), policy="elastic", steps=1, trainer="paced", paced=True)
    run.start_driver(steps=1, prompts=8, group=4, tool_s=20.0)

    def three_running():
        view = run.status().get("elastic") or {}
        return view.get("running") == 3

    wait_for(three_running, 300, every=2)  # grown while the first batch runs
    assert run.finish_driver(900) == 0, run.driver_log()
    stats = run.gateway_stats()

    def back_to_one():
        view = run.status().get("elastic") or {}
        return view.get("size") == 1 and view.get("running") == 1

    wait_for(back_to_one, 240, every=2)  # the batch ended: the two added tasks drained, then scancelled
    journal = run.journal()
    completed = run.completed()
    added = [a for a in run.allocations() if a.array_index >= 1 and a.started_at]
    print(json.dumps({"expected": run.expected, "completed": completed, "migrated": stats.get("continued_requests"),
                      "added_tasks": len(added), "gateway": stats}))  # fmt: skip
    assert completed == run.expected

    wanted = [j["data"] for j in journal if j["event"] == "elastic wanted"]
    assert any(w["asked"] >= 3 for w in wanted), wanted  # the policy asked for the whole pool
    sizes = [j["data"] for j in journal if j["event"] == "elastic size"]
    assert max(s["running"] for s in sizes) == 3 and sizes[-1]["size"] == 1, sizes
    assert len(added) >= 2
    workers = run.workers()
    for a in added:
        events = [j["event"] for j in journal if j["entity"] == "allocations" and j["entity_id"] == str(a.id)]
        if a.state == "ENDED" and "elastic scancel" in events:
            assert events.index("elastic drain") < events.index("elastic scancel"), events
        # its worker served through the router, and left it before it stopped
        for w in (w for w in workers if w.allocation_id == a.id and w.url):
            assert any(
                w.url in (j["data"] or {}).get("added", []) for j in journal if j["event"] == "router membership"
            )
            if w.state == "STOPPED":
                removed, gone = routed_out_before_gone(run, w.url, w.id, journal)
                assert removed <= gone, (w, removed, gone)
    left = [a["state"] for a in run.status()["allocations"] if a["pool"] == "elastic" and a["state"] != "ENDED"]
    assert left == ["RUNNING"], left


@pytest.mark.parametrize("partition", ["preempt", "preempt0"], ids=["grace-10s", "grace-0-hard-kill"])
def test_a_preempted_elastic_task_loses_no_episode_and_rejoins_the_router(make_run, slurm_cluster, partition):
    pool = elastic_pool(nodes=2, max_nodes=2, partition=partition)
    run = make_run(f"pre{partition[-1]}", pool, steps=1, trainer=False, paced=True)

    def two_serving():
        doc = run.status()
        ready = [w for w in doc["workers"] if w["state"] == "READY" and w["routable"]]
        return ready if len(ready) == 2 else None

    wait_for(two_serving, 300, every=2)
    run.start_driver(steps=1, prompts=8, group=4, tool_s=6.0, max_tokens=128)

    def generating():
        doc = run.status()
        return (doc["run"].get("rollout") or {}).get("generating")

    wait_for(generating, 120, every=0.5)
    doc = run.status()
    victim = next(a for a in doc["allocations"] if a["pool"] == "elastic" and a["array_index"] == 1)
    victim_worker = next(w for w in doc["workers"] if w["allocation_id"] == victim["id"] and w["state"] == "READY")
    high = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "-p",
        "high",
        "-w",
        victim["node"],
        "--exclusive",
        "-o",
        "/dev/null",
        "--wrap",
        "sleep 600",
    ).stdout.strip()

    def requeued():
        a = next(a for a in run.allocations() if a.id == victim["id"])
        return a if a.restarts >= 1 and a.state in ("PENDING", "REQUESTED") else None

    wait_for(requeued, 180, every=1)
    view = run.status().get("elastic") or {}
    assert view.get("running") == 1, view  # the pool shrank in state
    slurm_cluster.run("scancel", high)

    def rejoined():
        workers = [w for w in run.workers() if w.allocation_id == victim["id"] and w.id != victim_worker["id"]]
        return [w for w in workers if w.state == "READY" and w.routable]

    back = wait_for(rejoined, 300, every=2)
    assert run.finish_driver(900) == 0, run.driver_log()
    stats = run.gateway_stats()
    journal = run.journal()
    completed = run.completed()
    print(json.dumps({"partition": partition, "expected": run.expected, "completed": completed,
                      "migrated": stats.get("continued_requests"), "gateway": stats}))  # fmt: skip
    assert completed == run.expected
    removed, gone = routed_out_before_gone(run, victim_worker["url"], victim_worker["id"], journal)
    if partition == "preempt":
        # with a grace time, the router stopped routing to the preempted worker before it died
        assert removed <= gone, (removed, gone)
    else:
        # a hard kill gives no time to leave the router first: the router drops the dead worker within a
        # membership sync, and the gateway retried or continued what it had sent there (nothing was lost)
        assert removed - gone < 2.0, (removed, gone)
    # the requeued task's new worker re-joined the router
    assert any(back[0].url in (j["data"] or {}).get("added", []) for j in journal if j["event"] == "router membership")
    assert stats.get("gave_up", 0) == 0


def test_scancel_of_a_fixed_rollout_task_mid_step_loses_no_episode(make_run, slurm_cluster):
    # the control plane's side of a lost task (the router drops it, the gateway continues its turns elsewhere) on the
    # paced engine, as the preemption cases above
    run = make_run("cut", ROLLOUT2, steps=1, trainer=False, paced=True)

    def two_serving():
        ready = [w for w in run.status()["workers"] if w["state"] == "READY" and w["routable"]]
        return ready if len(ready) == 2 else None

    wait_for(two_serving, 300, every=2)
    run.start_driver(steps=1, prompts=8, group=4, tool_s=6.0, max_tokens=128)
    wait_for(lambda: (run.status()["run"].get("rollout") or {}).get("generating"), 120, every=0.5)
    doc = run.status()
    victim = next(a for a in doc["allocations"] if a["pool"] == "rollout" and a["array_index"] == 1)
    worker = next(w for w in doc["workers"] if w["allocation_id"] == victim["id"] and w["state"] == "READY")
    slurm_cluster.run("scancel", f"{victim['job_id']}_{victim['array_index']}")
    assert run.finish_driver(900) == 0, run.driver_log()
    stats = run.gateway_stats()
    completed = run.completed()
    print(json.dumps({"expected": run.expected, "completed": completed, "migrated": stats.get("continued_requests"),
                      "gateway": stats}))  # fmt: skip
    assert completed == run.expected
    journal = run.journal()
    assert any(
        worker["url"] in (j["data"] or {}).get("removed", []) for j in journal if j["event"] == "router membership"
    )
    assert stats.get("gave_up", 0) == 0
