"""What the daemon tells a trainer allocation's agent to run while one of its GPUs is lent
(pearlctl.daemon.desired.Desired.of), against a real SQLite state: the TRAIN worker keeps every
GPU of the allocation, once each and with no deadline; the vLLM worker on the lent GPU carries the deadline
and ``return_by``. A requeued job's GPUs that went while lent come back as the trainer's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor
from pearlctl.state.store import Store
from tests import factories

NOW = 1_000_000.0


@pytest.fixture
def trainer(tmp_path: Path):
    with Store.open(tmp_path / "s.db", clock=lambda: NOW) as store:
        factories.create_run(store, tmp_path, [factories.pool("trainer", "TRAIN", gpus_per_node=2)], policy="greedy")
        (a,) = factories.run_all(store)
        store.fleet.upsert_node_gpus("r", a.id, "n0", [0, 1], "TRAIN")
        controller = Controller(store, "r", None, clock=lambda: NOW)
        ex = Executor(store, DaemonEffects(store, "r", None), run_id="r", epoch=None, clock=lambda: NOW)
        controller.borrowing = Borrowing(store, ex, "r", clock=lambda: NOW)
        yield store, controller, a.id


def view(controller: Controller, alloc_id: int) -> list[tuple]:
    return [(d.key, d.role, d.gpus, d.return_deadline, d.return_by) for d in controller.desired.of(alloc_id)]


def test_a_lent_gpu_is_served_with_its_deadline_and_stays_the_trainers(trainer):
    store, controller, alloc = trainer
    lent = store.fleet.gpus("r")[1]
    store.update_fields("gpus", lent.id, event="role set", role="ROLLOUT", borrowed=1, return_deadline=NOW + 60)
    (rollout, train) = view(controller, alloc)  # by role
    assert train == ("train-0", "TRAIN", (0, 1), None, None)
    key, role, gpus, deadline, by = rollout
    assert (key, role, gpus, deadline) == ("rollout-1", "ROLLOUT", (1,), NOW + 60)
    assert by == round(NOW + 60 - controller.borrowing.inputs.cost("return"), 3)


def test_a_gpu_back_from_a_requeue_while_lent_is_the_trainers_alone(trainer):
    store, controller, alloc = trainer
    lent = store.fleet.gpus("r")[1]
    store.update_fields("gpus", lent.id, event="role set", role="ROLLOUT", borrowed=1, return_deadline=NOW + 60)
    # the job preempted and requeued: its GPUs went, and came back with the new allocation's agent
    for g in store.fleet.gpus("r"):
        store.set_state("gpus", g.id, expect="UP", to="DRAINING", event="t")
        store.set_state("gpus", g.id, expect="DRAINING", to="GONE", event="t")
    store.fleet.upsert_node_gpus("r", alloc, "n1", [0, 1], "TRAIN")
    assert view(controller, alloc) == [("train-0", "TRAIN", (0, 1), None, None)]
    # and were a TRAIN GPU ever flagged lent, the TRAIN worker still gets each GPU once and no deadline
    store.update_fields("gpus", lent.id, borrowed=1, return_deadline=NOW + 60)
    assert view(controller, alloc) == [("train-0", "TRAIN", (0, 1), None, None)]


def test_lent_gpus_become_workers_of_the_profiles_tensor_parallel_size(trainer):
    """With an engine profile the run's vLLM workers have its ``gpus_per_worker`` GPUs each, as the planner
    counts them: a 4-GPU trainer lending three GPUs at TP 1 serves three workers (each with the deadline),
    at TP 2 one worker of two of them (the GPU left over serves nothing); the TRAIN worker keeps every GPU.
    Without a profile, one worker of all the lent GPUs."""
    store, controller, alloc = trainer
    store.fleet.upsert_node_gpus("r", alloc, "n0", [0, 1, 2, 3], "TRAIN")
    for g in store.fleet.gpus("r")[1:]:
        store.update_fields("gpus", g.id, event="role set", role="ROLLOUT", borrowed=1, return_deadline=NOW + 60)
    train = ("train-0", "TRAIN", (0, 1, 2, 3), None, None)
    assert [v[:3] for v in view(controller, alloc)] == [("rollout-1", "ROLLOUT", (1, 2, 3)), train[:3]]

    from pearlctl.planner import profile as profiles

    doc = profiles.to_dict(profiles.load(Path(__file__).parents[2] / "examples/profiles/qwen3-8b-h200.toml"))
    store.update_fields("runs", "r", profile=doc)
    got = view(controller, alloc)
    assert [v[:3] for v in got] == [("rollout-1", "ROLLOUT", (1,)), ("rollout-2", "ROLLOUT", (2,)),
                                    ("rollout-3", "ROLLOUT", (3,)), train[:3]]  # fmt: skip
    assert all(v[3] == NOW + 60 for v in got[:3])
    store.update_fields("runs", "r", profile={**doc, "gpus_per_worker": 2})
    assert [v[:3] for v in view(controller, alloc)] == [("rollout-1", "ROLLOUT", (1, 2)), train[:3]]
