"""The daemon's ``GET /v1/workers`` says how many workers are joining: on their way to serving rollouts (a
borrow, start, wake or switch toward ROLLOUT, PREFILL or DECODE, PLANNED or RUNNING), one per allocation and
role — what a rollout driver waits for, briefly, before it launches a batch (pearlctl/router/client.py,
RolloutClient.wait_for_joining). Counted from a real SQLite state."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.daemon.controller import Controller
from pearlctl.state.store import Store
from tests.conftest import running_pools

NOW = 1_000_000.0


@pytest.fixture
def run(tmp_path: Path):
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        shapes = (("trainer", "TRAIN", 1, 2), ("rollout", "ROLLOUT", 1, 2), ("elastic", "ROLLOUT", 2, 1))
        gpus: dict[str, list[int]] = {}
        for i, a, pool in running_pools(store, tmp_path, shapes):
            count = 1 if pool == "elastic" else 2
            role = {"trainer": "TRAIN", "rollout": "ROLLOUT", "elastic": "IDLE"}[pool]
            store.fleet.upsert_node_gpus("r", a.id, f"n{i}", list(range(count)), role)
            ids = [g.id for g in store.fleet.gpus("r") if g.allocation_id == a.id]
            gpus.setdefault(pool, []).extend(ids)
        yield store, Controller(store, "r", None, clock=lambda: NOW), gpus


def plan(store: Store, kind: str, from_role: str, to_role: str, gpu_ids: list[int], *states: str) -> int:
    tid = store.transitions.add(run_id="r", kind=kind, from_role=from_role, to_role=to_role, gpu_ids=gpu_ids)
    current = "PLANNED"
    for to in states:
        store.set_state("transitions", tid, expect=current, to=to, event="t")
        current = to
    return tid


def joining(controller: Controller) -> int:
    answer = controller.agents.routable_workers()
    assert isinstance(answer["workers"], list)
    return answer["joining"]


def test_nothing_joins_without_an_open_transition_toward_serving(run):
    store, controller, gpus = run
    assert joining(controller) == 0
    # leaving serving, or finished, or failed and undone: nothing joins
    plan(store, "retire", "ROLLOUT", "IDLE", gpus["rollout"][:1], "RUNNING")
    plan(store, "return", "ROLLOUT", "TRAIN", gpus["trainer"], "RUNNING")
    plan(store, "start", "IDLE", "ROLLOUT", gpus["elastic"][:1], "RUNNING", "DONE")
    plan(store, "start", "IDLE", "ROLLOUT", gpus["elastic"][1:], "RUNNING", "ROLLING_BACK")
    plan(store, "wake", "IDLE", "ROLLOUT", gpus["elastic"][1:], "ROLLED_BACK")
    assert joining(controller) == 0


def test_a_borrow_of_two_trainer_gpus_is_one_worker_joining(run):
    store, controller, gpus = run
    tid = plan(store, "borrow", "TRAIN", "ROLLOUT", gpus["trainer"])
    assert joining(controller) == 1  # PLANNED already counts: the daemon is about to run it
    store.set_state("transitions", tid, expect="PLANNED", to="RUNNING", event="t")
    assert joining(controller) == 1
    store.set_state("transitions", tid, expect="RUNNING", to="DONE", event="t")
    assert joining(controller) == 0  # registered: it is a routable worker now


def test_starts_wakes_and_switches_count_one_worker_per_allocation_and_role(run):
    store, controller, gpus = run
    plan(store, "borrow", "TRAIN", "ROLLOUT", gpus["trainer"], "RUNNING")
    plan(store, "start", "IDLE", "ROLLOUT", gpus["elastic"][:1])  # elastic task 1
    plan(store, "wake", "IDLE", "ROLLOUT", gpus["elastic"][1:], "RUNNING")  # elastic task 2
    assert joining(controller) == 3
    # a prefill-decode switch restarts the rollout pool's worker as a PREFILL worker: it joins again
    plan(store, "switch", "ROLLOUT", "PREFILL", gpus["rollout"], "RUNNING")
    assert joining(controller) == 4
    # a second transition of the same allocation toward the same role is the same worker
    plan(store, "start", "IDLE", "PREFILL", gpus["rollout"][1:])
    assert joining(controller) == 4
