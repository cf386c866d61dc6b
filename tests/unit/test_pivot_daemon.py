"""Policy `pivot` carried out by the daemon: its objects for real against a real SQLite state (controller, executor,
effects, the control loop), the agents and the router's membership simulated at their seams
(tests/crash_harness.py). The rollout driver's reports drive it: verdicts backing up in a batch's tail shift a
rollout GPU to the judge (a SWITCH transition to REWARD, its worker told the judge's model), and once nothing is
left to judge and no rollout work remains, the GPU goes back to rollout. Each shift is one journaled transition
carrying pivot's reason. (The policy's rules themselves: tests/unit/test_pivot_policy.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.planner import profile as profiles
from pearlctl.planner.profile import TransitionCosts
from pearlctl.state.store import Store
from tests import factories
from tests.crash_harness import Clock, Daemon, SimAgent, SimRouter

SPEC = {"model": "/m/policy", "pools": {"rollout": {}, "reward": {"model": "/m/judge"}}}
PROFILE = factories.profile(
    "pivot-daemon",
    decode={"weights_s": 0.005, "seq_s": 2e-5, "kv_s_per_token": 4e-8},
    prefill_tok_s=20_000,
    kv_capacity_tokens=200_000,
    costs=TransitionCosts(role_switch_s=5.0),
    gpus_per_worker=1,
)
# a borrow (offload and a cold start) dearer than nothing but cheaper than a switch, as on this CPU
LENDING = factories.profile(
    "pivot-lending",
    decode={"weights_s": 0.005, "seq_s": 2e-5, "kv_s_per_token": 4e-8},
    prefill_tok_s=20_000,
    kv_capacity_tokens=200_000,
    costs=TransitionCosts(start_s=15.0, stop_s=3.0, offload_s=1.0, role_switch_s=18.0),
    gpus_per_worker=1,
)
TAIL = {"turns_left": 1, "decode_tokens_per_turn": 100, "context_tokens": 1_000, "tool_latency_s": 0.5}


def test_pivot_shifts_a_rollout_gpu_to_the_judge_when_verdicts_back_up_and_back_when_all_is_judged(tmp_path: Path):
    clock, router = Clock(), SimRouter()
    store = Store.open(tmp_path / "state.db", clock=clock)  # one clock: pivot reads when the last plan was made
    pools = [factories.pool("rollout", "ROLLOUT", nodes=2), factories.pool("reward", "REWARD")]
    factories.create_run(store, tmp_path, pools, spec=SPEC)
    allocs = factories.run_all(store)  # jobs 10, 11 (rollout tasks) and 12 (the judge) on nodes n0, n1, n2
    daemon = Daemon(store, allocs[0].id, 1, clock, router)
    agents = []
    for i, a in enumerate(allocs):
        register = {"job_id": str(10 + i), "task_id": a.array_index, "node": f"n{i}", "gpus": [0], "pid": 1}
        daemon.controller.agents.register(parse(bodies.Register, register))
        agents.append((SimpleNamespace(controller=daemon.controller, alloc_id=a.id), SimAgent(router, host=f"n{i}")))
    store.update_fields("runs", "r", profile=profiles.to_dict(PROFILE), borrow={"policy": "pivot", "max_gpus": None})

    def loop(until, report=lambda: None) -> None:
        for _ in range(120):
            report()
            for view, agent in agents:
                agent.tick(view)
            router.sync(store)
            daemon.borrowing.tick(daemon.controller.lock)
            clock.t += 1.0
            if until():
                return
        raise AssertionError(f"did not converge: {[(t.kind, t.to_role, t.state) for t in store.transitions.all('r')]}")

    serving = lambda: sum(w.routable for w in store.fleet.workers("r"))  # noqa: E731
    loop(lambda: serving() == 3)
    assert store.transitions.all("r") == []  # nothing to judge: nothing shifts

    done = iter(range(0, 10_000, 2))  # two verdicts a second, 200 waiting: one judge needs 100 s

    def backed_up() -> None:
        judge = {"waiting": 200, "judging": 4, "done": next(done), "failed": 0}
        progress = {"generating": 4, "done": 60, "tokens": 1000, "work": {"trajectories": 4, **TAIL}, "judge": judge}
        daemon.controller.trainer.rollout_progress(parse(bodies.Progress, progress))

    def shifted(to: str):
        ts = [t for t in store.transitions.all("r") if t.to_role == to and t.state == "DONE"]
        return ts[-1] if ts else None

    loop(lambda: shifted("REWARD"), backed_up)
    there = shifted("REWARD")
    assert there.kind == "switch" and there.from_role == "ROLLOUT" and "verdicts back up" in there.detail["why"]
    (gpu,) = there.gpu_ids
    moved = store.fleet.gpu(gpu)
    assert moved.pool == "rollout" and moved.role == "REWARD"
    (want,) = daemon.controller.desired.of(moved.allocation_id)
    assert (want.role, want.model) == ("REWARD", "/m/judge")
    assert len(store.transitions.all("r")) == 1  # one shift: the next decision saw the judge and held

    def all_judged() -> None:
        judge = {"waiting": 0, "judging": 0, "done": 264, "failed": 0}
        progress = {"generating": 0, "done": 64, "tokens": 1200, "work": {"trajectories": 0}, "judge": judge}
        daemon.controller.trainer.rollout_progress(parse(bodies.Progress, progress))

    loop(lambda: shifted("ROLLOUT"), all_judged)
    back = shifted("ROLLOUT")
    assert back.gpu_ids == (gpu,) and "nothing to judge" in back.detail["why"]
    assert store.fleet.gpu(gpu).role == "ROLLOUT"
    assert [(t.from_role, t.to_role) for t in store.transitions.all("r")] == [
        ("ROLLOUT", "REWARD"),
        ("REWARD", "ROLLOUT"),
    ]
    store.close()


def test_pivot_lends_an_idle_trainer_gpu_to_the_judge_and_the_trainer_gets_it_back(tmp_path: Path):
    """The trainer waits, its GPU idle: verdicts backing up borrow it for the judge (a BORROW to REWARD: the trainer
    offloads, its agent starts the judge's model there with the borrow's return deadline), and once nothing waits
    for a verdict it goes back (a RETURN: the judge drains, the trainer reloads)."""
    from tests.unit.test_crash_matrix import SimTrainer

    clock, router = Clock(), SimRouter()
    store = Store.open(tmp_path / "state.db", clock=clock)
    pools = [
        factories.pool("trainer", "TRAIN"),
        factories.pool("rollout", "ROLLOUT", nodes=2),
        factories.pool("reward", "REWARD"),
    ]
    factories.create_run(store, tmp_path, pools, spec=SPEC)
    allocs = factories.run_all(store)  # the trainer (job 10), two rollout tasks, the judge
    daemon = Daemon(store, allocs[0].id, 1, clock, router)
    agents, trainer = [], SimTrainer()
    for i, a in enumerate(allocs):
        register = {"job_id": str(10 + i), "task_id": a.array_index, "node": f"n{i}", "gpus": [0], "pid": 1}
        daemon.controller.agents.register(parse(bodies.Register, register))
        agents.append((SimpleNamespace(controller=daemon.controller, alloc_id=a.id), SimAgent(router, host=f"n{i}")))
    store.update_fields("runs", "r", profile=profiles.to_dict(LENDING), borrow={"policy": "pivot", "max_gpus": None})
    done = iter(range(0, 10_000, 2))

    def loop(until, report) -> None:
        for _ in range(120):
            report()
            trainer.tick(SimpleNamespace(controller=daemon.controller))
            for view, agent in agents:
                agent.tick(view)
            router.sync(store)
            daemon.borrowing.tick(daemon.controller.lock)
            clock.t += 1.0
            if until():
                return
        raise AssertionError(f"did not converge: {[(t.kind, t.to_role, t.state) for t in store.transitions.all('r')]}")

    def progress(waiting: int, work: int) -> None:
        judge = {"waiting": waiting, "judging": 4 if waiting else 0, "done": next(done), "failed": 0}
        body = {"generating": work, "done": 60, "tokens": 1000, "work": {"trajectories": work, **TAIL}, "judge": judge}
        daemon.controller.trainer.rollout_progress(parse(bodies.Progress, body))

    def finished(kind: str):
        ts = [t for t in store.transitions.all("r") if t.kind == kind and t.state == "DONE"]
        return ts[-1] if ts else None

    loop(lambda: finished("borrow"), lambda: progress(200, 4))
    lent = finished("borrow")
    assert lent.to_role == "REWARD" and lent.detail["return_deadline"] is not None
    (gpu,) = lent.gpu_ids
    assert store.fleet.gpu(gpu).pool == "trainer" and store.fleet.gpu(gpu).role == "REWARD"
    judge = [w for w in daemon.controller.desired.of(allocs[0].id) if w.role == "REWARD"]
    assert [(w.model, w.return_deadline) for w in judge] == [("/m/judge", lent.detail["return_deadline"])]
    assert trainer.released
    assert [t.kind for t in store.transitions.all("r")] == ["borrow"]  # lent first: no rollout GPU shifted

    loop(lambda: finished("return"), lambda: progress(0, 2))
    back = finished("return")
    assert back.gpu_ids == (gpu,) and back.from_role == "REWARD"
    assert store.fleet.gpu(gpu).role == "TRAIN" and not store.fleet.gpu(gpu).borrowed and not trainer.released
    store.close()
