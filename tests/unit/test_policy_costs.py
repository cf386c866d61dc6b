"""The transition costs a run's policy plans with (pearlctl/daemon/policy_view.py, ``PolicyInputs.costs`` and
``judge_costs``), read from a real SQLite state: journaled steps first, else the cold starts the workers' agents
measured at launch, else the profile's; the judge's engine's apart from the policy's."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.daemon.policy_view import PolicyInputs
from pearlctl.planner.profile import TransitionCosts
from pearlctl.state.store import Store
from tests import factories

BASE = TransitionCosts(start_s=60.0, stop_s=5.0, wake_s=3.0)
SPEC = {"model": "/m/policy", "pools": {"rollout": {}, "reward": {"model": "/m/judge"}}}


def journal_move(store: Store, gpu: int, kind: str, from_role: str, to_role: str, steps: dict[str, float]) -> None:
    """A DONE transition of ``gpu`` with DONE steps that took the given seconds each."""
    tid = store.transitions.add(run_id="r", kind=kind, from_role=from_role, to_role=to_role, gpu_ids=[gpu])
    store.set_state("transitions", tid, expect="PLANNED", to="RUNNING", event="go")
    for seq, (step, seconds) in enumerate(steps.items()):
        detail = {"started_at": 100.0, "finished_at": 100.0 + seconds}
        sid = store.transitions.add_step(
            transition_id=tid, seq=seq, kind=step, idempotency_key=f"{tid}:{seq}", detail=detail
        )
        store.set_state("steps", sid, expect="INTENT", to="DONE", event="done")
    store.set_state("transitions", tid, expect="RUNNING", to="DONE", event="done")


def test_launch_cold_starts_price_a_start_until_one_is_journaled_and_the_judges_engine_keeps_its_own(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    factories.create_run(store, tmp_path, [factories.pool("rollout", "ROLLOUT"), factories.pool("reward", "REWARD")],
                         spec=SPEC)  # fmt: skip
    rollout, reward = factories.run_all(store)
    store.fleet.upsert_node_gpus("r", rollout.id, "n0", [0], "ROLLOUT")
    gpu = store.fleet.gpus("r", allocation_id=rollout.id)[0].id
    inputs = PolicyInputs(store, "r")
    assert inputs.costs(BASE) == BASE and inputs.judge_costs(BASE) == BASE  # nothing measured: the profile's
    assert inputs.has_judge()

    # the workers a launch started, as their agents measured them: the median of each engine's last five
    for seconds in (40.0, 9.0, 11.0, 10.0, 12.0, 30.0):
        store.fleet.add_worker(run_id="r", allocation_id=rollout.id, role="ROLLOUT", engine="vllm", ready_s=seconds)
    store.fleet.add_worker(run_id="r", allocation_id=reward.id, role="REWARD", engine="vllm", ready_s=21.0)
    store.fleet.add_worker(run_id="r", allocation_id=rollout.id, role="ROLLOUT", engine="vllm")  # not ready yet
    assert inputs.costs(BASE).start_s == 11.0  # of 9, 11, 10, 12, 30 (the 40-s one is older than the last five)
    assert inputs.judge_costs(BASE).start_s == 21.0

    # a shift to the judge: the policy's engine stopped, the judge's started; each engine's estimate is its own
    journal_move(store, gpu, "switch", "ROLLOUT", "REWARD", {"STOP": 2.0, "START": 14.0})
    policy, judge = inputs.costs(BASE), inputs.judge_costs(BASE)
    assert (policy.stop_s, policy.start_s) == (2.0, 11.0)
    assert (judge.stop_s, judge.start_s) == (BASE.stop_s, 14.0)
    # and back: the judge's engine stopped, the policy's started (its journaled start replaces the launch's)
    journal_move(store, gpu, "switch", "REWARD", "ROLLOUT", {"STOP": 4.0, "START": 8.0})
    policy, judge = inputs.costs(BASE), inputs.judge_costs(BASE)
    assert (policy.stop_s, policy.start_s, judge.stop_s, judge.start_s) == (2.0, 8.0, 4.0, 14.0)
    assert judge.offload_s == policy.offload_s and judge.reload_s == policy.reload_s  # the trainer's, shared


def test_a_run_without_a_judge_plans_with_no_judge_costs(tmp_path: Path):
    store = Store.open(tmp_path / "state.db")
    factories.create_run(store, tmp_path, [factories.pool("rollout", "ROLLOUT")], spec={"model": "/m/policy"})
    factories.run_all(store)
    inputs = PolicyInputs(store, "r")
    assert not inputs.has_judge() and inputs.snapshot(1000.0).judge_costs is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), 1e8])
def test_a_worker_report_with_a_bad_cold_start_is_refused_by_name(bad: float):
    from pydantic import ValidationError

    from pearlctl.api import bodies

    report = {"key": "w0", "role": "ROLLOUT", "engine": "vllm", "state": "READY", "ready_s": bad}
    with pytest.raises(ValidationError, match="ready_s"):
        bodies.WorkerReport.model_validate(report)


def test_the_judges_profile_is_stored_apart_and_its_costs_are_the_judges_engines_base(tmp_path: Path):
    """``pearlctl profile --judge`` (POST /v1/profile with ``judge``): stored beside the policy's profile, never in
    its place; the judge's engine costs not measured yet are its profile's; a run without a judge refuses it."""
    from pearlctl.api import bodies
    from pearlctl.daemon.controller import ControlError, Controller
    from pearlctl.planner import profile as profiles

    def daemon_on(d: Path, spec: dict):
        d.mkdir(parents=True, exist_ok=True)
        store = Store.open(d / "state.db")
        pools = [factories.pool(name, name.upper()) for name in spec["pools"]]
        factories.create_run(store, d, pools, spec=spec)
        return Controller(store, "r", None), store

    decode = {"weights_s": 0.01, "seq_s": 0.0, "kv_s_per_token": 0.0}
    costs = TransitionCosts(start_s=48.0, wake_s=6.0)
    judge = factories.profile("judge", decode=decode, prefill_tok_s=5e3, kv_capacity_tokens=10**5, costs=costs)
    controller, store = daemon_on(tmp_path, SPEC)
    answer = controller.operator.set_profile(bodies.ProfileBody(profile=profiles.to_dict(judge), judge=True))
    assert answer["judge"] and store.runs.get("r").get("profile") is None
    inputs = PolicyInputs(store, "r")
    assert inputs.judge_profile() == judge
    assert (inputs.judge_costs(BASE).start_s, inputs.judge_costs(BASE).wake_s) == (48.0, 6.0)
    assert inputs.costs(BASE) == BASE  # the policy's are not the judge's

    alone, _ = daemon_on(tmp_path / "alone", {"model": "/m/policy", "pools": {"rollout": {}}})
    with pytest.raises(ControlError, match=r"has no judge \(\[pools.reward\]\)"):
        alone.operator.set_profile(bodies.ProfileBody(profile=profiles.to_dict(judge), judge=True))
