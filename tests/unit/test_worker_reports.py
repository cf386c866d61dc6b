"""What the daemon makes of a vLLM worker by its role and its reports, against a real SQLite state and the daemon's
own objects.

A reward pool's worker (a generative reward model, role REWARD) is never treated as one of the policy's workers:
it joins the run's router as a judge (REWARD, routed apart: pearlctl.router.routing), never as a rollout worker,
and is not among the workers rollout clients are given; it is never handed the trainer's weights, VERIFY does not
wait for it to serve them, and the planner does not count its GPU as rollout capacity. Each assertion is made
beside a rollout worker that is treated as the policy's, so a rule that ignored roles fails here. And a report
whose only news is the weights a worker now serves wakes the control loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.policy_view import _serves
from pearlctl.daemon.routing import desired_members, desired_roles
from pearlctl.state.store import Store
from pearlctl.vocabulary import Engine, Role
from tests import factories

NOW = 1_000_000.0


@pytest.fixture
def run(tmp_path: Path):
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        pools = [
            factories.pool("trainer", "TRAIN"),
            factories.pool("rollout", "ROLLOUT"),
            factories.pool("reward", "REWARD"),
        ]
        factories.create_run(store, tmp_path, pools)
        trainer, rollout, reward = factories.run_all(store)
        for alloc, role in ((trainer, "TRAIN"), (rollout, "ROLLOUT"), (reward, "REWARD")):
            store.fleet.upsert_node_gpus("r", alloc.id, f"n-{role.lower()}", [0], role)
        store.update_fields("runs", "r", trainer={"weight_version": "7", "weights_path": "/w/7"})
        controller = Controller(store, "r", None, clock=lambda: NOW)
        yield store, controller, rollout.id, reward.id


def report(controller: Controller, alloc_id: int, role: str, url: str, version: str | None = None) -> None:
    worker = bodies.WorkerReport(
        key=f"{role.lower()}-0",
        role=Role(role),
        engine=Engine.VLLM,
        gpus=[0],
        state="READY",
        url=url,
        pid=1234,
        weight_version=version,
    )
    controller.agents.report(bodies.Heartbeat(allocation_id=alloc_id, workers=[worker]), alloc_id)


def test_only_the_policys_workers_are_handed_the_trainers_weights(run):
    store, controller, rollout, reward = run
    (policy,) = controller.desired.of(rollout)
    (judge,) = controller.desired.of(reward)
    assert (policy.role, policy.weights) == ("ROLLOUT", {"version": "7", "path": "/w/7"})
    assert (judge.role, judge.weights) == ("REWARD", None)


def test_a_ready_judge_joins_the_router_as_a_judge_and_never_reaches_rollout_clients(run):
    store, controller, rollout, reward = run
    report(controller, rollout, "ROLLOUT", "http://n-rollout:8000", "7")
    report(controller, reward, "REWARD", "http://n-reward:8000")
    wanted = desired_members(store, "r")
    assert wanted == {"http://n-rollout:8000": "7", "http://n-reward:8000": None}
    assert desired_roles(store, "r", wanted) == {"http://n-reward:8000": "REWARD"}  # the rollout worker: ROLLOUT
    assert [w["url"] for w in controller.agents.routable_workers()["workers"]] == ["http://n-rollout:8000"]


def test_verify_of_gpus_brought_up_as_judges_does_not_wait_for_the_policys_weights(run):
    """VERIFY of a transition that brings the reward pool's GPU up as a judge: proven once the judge is READY,
    though it serves no version of the policy's weights (it never will); the same probe for the rollout pool's
    GPU waits until its worker serves the trainer's version."""
    store, controller, rollout, reward = run
    report(controller, reward, "REWARD", "http://n-reward:8000")
    report(controller, rollout, "ROLLOUT", "http://n-rollout:8000", "6")
    effects = DaemonEffects(store, "r", None)
    by_pool = {g.pool: g for g in store.fleet.gpus("r")}
    judging = store.transitions.add(
        run_id="r", kind="start", from_role="IDLE", to_role="REWARD", gpu_ids=[by_pool["reward"].id]
    )
    serving = store.transitions.add(
        run_id="r", kind="start", from_role="IDLE", to_role="ROLLOUT", gpu_ids=[by_pool["rollout"].id]
    )
    assert effects._verified(store.transitions.get(judging), "k") == "done"
    assert effects._verified(store.transitions.get(serving), "k") == "pending"
    report(controller, rollout, "ROLLOUT", "http://n-rollout:8000", "7")
    assert effects._verified(store.transitions.get(serving), "k") == "done"


def test_the_planner_does_not_count_a_judges_gpu_as_rollout_capacity(run):
    store, controller, rollout, reward = run
    by_pool = {g.pool: g for g in store.fleet.gpus("r")}
    assert _serves(by_pool["rollout"]) and not _serves(by_pool["reward"]) and not _serves(by_pool["trainer"])


def test_a_worker_that_reports_new_weights_wakes_the_control_loop_and_is_journaled(run):
    """A reload changes no state, only the version a worker serves: that report still wakes the control loop (a
    VERIFY waiting for those weights passes now, not a tick later), and the journal says when the worker began
    to serve them. A report that repeats the version does neither."""
    store, controller, rollout, reward = run
    report(controller, rollout, "ROLLOUT", "http://n-rollout:8000", "6")
    controller.wake.clear()
    report(controller, rollout, "ROLLOUT", "http://n-rollout:8000", "6")
    assert not controller.wake.is_set()
    report(controller, rollout, "ROLLOUT", "http://n-rollout:8000", "7")
    assert controller.wake.is_set()
    (worker,) = [w for w in store.fleet.workers("r") if w.role == "ROLLOUT"]
    loaded = store.journal.entity_events("workers", worker.id, ["serving weights"])
    assert [e["data"]["version"] for e in loaded] == ["7"]


# -- a GPU shifted between the policy and the judge --------------------------------------------------------------
SPEC = {
    "model": "/m/policy",
    "pools": {
        "rollout": {"engine_args": {"max_model_len": 4096}},
        "reward": {"model": "/m/judge", "engine_args": {"max_model_len": 8192}},
    },
}


def shifted_run(store: Store, tmp_path: Path, spec: dict) -> tuple[int, int]:
    pools = [factories.pool("rollout", "ROLLOUT", nodes=2), factories.pool("reward", "REWARD")]
    factories.create_run(store, tmp_path, pools, spec=spec)
    first, second, reward = factories.run_all(store)
    store.fleet.upsert_node_gpus("r", first.id, "n0", [0], "ROLLOUT")
    store.fleet.upsert_node_gpus("r", second.id, "n1", [0], "REWARD")  # a rollout GPU shifted to the judge
    store.fleet.upsert_node_gpus("r", reward.id, "n2", [0], "ROLLOUT")  # the judge's GPU shifted to the policy
    return first.id, second.id, reward.id


def test_a_shifted_gpu_serves_the_other_roles_model_with_that_pools_engine_args(tmp_path: Path):
    """A judge on a rollout pool's GPU serves the reward pool's model with its engine args, and the policy on the
    reward pool's GPU the run's model with the rollout pool's: the agent of each allocation is told (its own
    PEARL_MODEL is its pool's). A worker in its own pool's role is told nothing new (its desired state is as
    before: no model key)."""
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        first, second, reward = shifted_run(store, tmp_path, SPEC)
        controller = Controller(store, "r", None, clock=lambda: NOW)
        (own,) = controller.desired.of(first)
        (judge,) = controller.desired.of(second)
        (policy,) = controller.desired.of(reward)
        assert (own.model, own.engine_args, "model" in own.as_dict()) == (None, None, False)
        assert (judge.role, judge.model, judge.engine_args) == ("REWARD", "/m/judge", {"max_model_len": 8192})
        assert judge.as_dict()["model"] == "/m/judge" and judge.weights is None  # never the policy's weights
        assert (policy.role, policy.model, policy.engine_args) == ("ROLLOUT", "/m/policy", {"max_model_len": 4096})
        assert controller.desired.all()[second] == [judge]
