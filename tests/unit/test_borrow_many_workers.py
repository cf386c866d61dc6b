"""A borrow of several GPUs that become several vLLM workers (the engine profile's ``gpus_per_worker`` = 1), whose
agent starts them one at a time: every step that brings GPUs up is proven for all of them, not for the first one
up (a REGISTER that ran while only one existed would route one and wait for good on the others), a return that
parks them leaves each GPU its own worker asleep, and the next borrow wakes every one and starts none.

The daemon's own objects (controller, executor, effects, borrowing) run for real against a real SQLite state; the
agent and the trainer are simulated at the HTTP-handler seam, as in tests/unit/test_crash_matrix.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.planner import profile as profiles
from pearlctl.state.store import Store
from tests.conftest import create_trainer_run
from tests.crash_harness import Clock, SimAgent
from tests.unit.test_crash_matrix import SimTrainer, run_until, transitions


class OneAtATime(SimAgent):
    """An agent that starts at most one new worker per heartbeat (a node's engines come up at different times)."""

    def tick(self, daemon) -> None:
        before = set(self.running)
        super().tick(daemon)
        for key in sorted(set(self.running) - before)[1:]:  # only the first new one started this time
            del self.running[key]
            self.starts[key] -= 1


@pytest.fixture
def world(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    alloc = create_trainer_run(store, tmp_path, job_id="7")
    store.set_state("allocations", alloc.id, expect="PENDING", to="RUNNING", event="t", node="gpu1")
    doc = profiles.to_dict(profiles.load(Path(__file__).parents[2] / "examples/profiles/qwen3-8b-h100.toml"))
    store.update_fields("runs", "r", profile={**doc, "gpus_per_worker": 1})
    yield store, alloc.id
    store.close()


def test_a_borrow_of_two_gpus_serves_both_workers_parks_each_on_its_gpu_and_wakes_both(world):
    store, alloc_id = world
    clock, agent, trainer = Clock(), OneAtATime(), SimTrainer()

    def completed(kind, n):
        return lambda store: sum(t.state == "DONE" for t in transitions(store, kind)) >= n

    for n, (plan, settings) in enumerate(
        [
            ("borrow", {"policy": "greedy", "max_gpus": 2, "keep_warm": True}),
            ("return_sleep", {"policy": "never", "max_gpus": None, "keep_warm": True}),
            ("borrow_warm", {"policy": "greedy", "max_gpus": 2, "keep_warm": True}),
        ]
    ):
        store.update_fields("runs", "r", borrow=settings)
        kind = "borrow" if plan.startswith("borrow") else "return"
        run_until(store, alloc_id, clock, agent, trainer, crash_at=None, done=completed(kind, n // 2 + 1), limit=60)
        last = transitions(store, kind)[-1]
        assert (last.detail or {}).get("plan") == plan and len(last.gpu_ids) == 2
        workers = [w for w in store.fleet.workers("r") if w.role == "ROLLOUT" and w.state not in ("STOPPED",)]
        if kind == "borrow":  # both serve and are routed, not only the first one up
            assert sorted(w.gpu_idx for w in workers) == [(0,), (1,)]
            assert all(w.state == "READY" and w.routable for w in workers), workers
        else:  # each GPU keeps its own worker, asleep
            parked = {g.idx: g.worker_id for g in store.fleet.gpus("r")}
            assert {w.gpu_idx[0]: w.id for w in workers} == parked
            assert all(w.state == "SLEEPING" for w in workers)
    # the warm borrow woke both: one start each for two borrows
    assert agent.starts == {"rollout-0": 1, "rollout-1": 1, "train-0": 1}
    assert all(t.state == "DONE" for t in store.transitions.all("r"))
