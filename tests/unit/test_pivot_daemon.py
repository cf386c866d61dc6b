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
BIG = {"turns_left": 4, "decode_tokens_per_turn": 400, "context_tokens": 4_000, "tool_latency_s": 1}


class World:
    """Run "r" of ``pools`` under pivot with ``profile``, every allocation RUNNING (the i-th as job ``10 + i`` on node
    ``n<i>``) with a simulated agent each, the daemon's objects on one fake clock (the store's too: pivot reads when
    the last plan was made), and ``trainer``, a simulated trainer hook, when the run has one."""

    def __init__(self, tmp_path: Path, pools: list[dict], profile, trainer=None):
        self.clock, self.router, self.trainer = Clock(), SimRouter(), trainer
        self.store = Store.open(tmp_path / "state.db", clock=self.clock)
        factories.create_run(self.store, tmp_path, pools, spec=SPEC)
        self.allocs = factories.run_all(self.store)
        self.daemon = Daemon(self.store, self.allocs[0].id, 1, self.clock, self.router)
        self.agents = []
        for i, a in enumerate(self.allocs):
            register = {"job_id": str(10 + i), "task_id": a.array_index, "node": f"n{i}", "gpus": [0], "pid": 1}
            self.daemon.controller.agents.register(parse(bodies.Register, register))
            view = SimpleNamespace(controller=self.daemon.controller, alloc_id=a.id)
            # a worker is READY a tick (a second) after its start, and its agent reports that cold start
            self.agents.append((view, SimAgent(self.router, host=f"n{i}", ready_s=1.0)))
        borrow = {"policy": "pivot", "max_gpus": None}
        self.store.update_fields("runs", "r", profile=profiles.to_dict(profile), borrow=borrow)

    def loop(self, until, report=lambda: None) -> None:
        """Each simulated second: the driver's ``report``, the trainer, the agents, the router, the control loop."""
        for _ in range(120):
            report()
            if self.trainer is not None:
                self.trainer.tick(SimpleNamespace(controller=self.daemon.controller))
            for view, agent in self.agents:
                agent.tick(view)
            self.router.sync(self.store)
            self.daemon.borrowing.tick(self.daemon.controller.lock)
            self.clock.t += 1.0
            if until():
                return
        moved = [(t.kind, t.to_role, t.state) for t in self.store.transitions.all("r")]
        raise AssertionError(f"did not converge: {moved}")

    def progress(self, body: dict) -> None:
        self.daemon.controller.trainer.rollout_progress(parse(bodies.Progress, body))

    def finished(self, kind: str, to_role: str | None = None):
        """The latest DONE transition of ``kind`` (toward ``to_role``), or None."""
        ts = [
            t
            for t in self.store.transitions.all("r")
            if t.kind == kind and t.state == "DONE" and (to_role is None or t.to_role == to_role)
        ]
        return ts[-1] if ts else None


def test_pivot_shifts_a_rollout_gpu_to_the_judge_when_verdicts_back_up_and_back_when_all_is_judged(tmp_path: Path):
    w = World(tmp_path, [factories.pool("rollout", "ROLLOUT", nodes=2), factories.pool("reward", "REWARD")], PROFILE)
    store = w.store
    w.loop(lambda: sum(x.routable for x in store.fleet.workers("r")) == 3)
    assert store.transitions.all("r") == []  # nothing to judge: nothing shifts

    done = iter(range(0, 10_000, 2))  # two verdicts a second, 200 waiting: one judge needs 100 s
    # the batch began big (its first report: Snapshot.last_batch), so that a GPU back in rollout pays for the next
    w.progress({"generating": 256, "done": 0, "tokens": 0, "work": {"trajectories": 256, **BIG}})

    def backed_up() -> None:
        judge = {"waiting": 200, "judging": 4, "done": next(done), "failed": 0}
        w.progress({"generating": 4, "done": 60, "tokens": 1000, "work": {"trajectories": 4, **TAIL}, "judge": judge})

    w.loop(lambda: w.finished("switch", "REWARD"), backed_up)
    there = w.finished("switch", "REWARD")
    assert there.from_role == "ROLLOUT" and "verdicts back up" in there.detail["why"]
    (gpu,) = there.gpu_ids
    moved = store.fleet.gpu(gpu)
    assert moved.pool == "rollout" and moved.role == "REWARD"
    # the policy's engine parked asleep on the GPU (workers are kept warm), the judge's started beside it
    assert there.detail["plan"] == "switch_sleep"
    want = sorted(w.daemon.controller.desired.of(moved.allocation_id), key=lambda d: d.role)
    assert [(d.role, d.state, d.model) for d in want] == [
        ("REWARD", "RUNNING", "/m/judge"),
        ("ROLLOUT", "SLEEPING", None),
    ]
    assert len(store.transitions.all("r")) == 1  # one shift: the next decision saw the judge and held

    def all_judged() -> None:
        judge = {"waiting": 0, "judging": 0, "done": 264, "failed": 0}
        w.progress({"generating": 0, "done": 64, "tokens": 1200, "work": {"trajectories": 0}, "judge": judge})

    w.loop(lambda: w.finished("switch", "ROLLOUT"), all_judged)
    back = w.finished("switch", "ROLLOUT")
    assert back.gpu_ids == (gpu,) and "nothing to judge" in back.detail["why"]
    assert back.detail["plan"] == "switch_wake"  # the parked policy worker wakes; the judge parks in its turn
    assert store.fleet.gpu(gpu).role == "ROLLOUT" and store.fleet.gpu(gpu).parked_judge_id is not None
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

    pools = [
        factories.pool("trainer", "TRAIN"),
        factories.pool("rollout", "ROLLOUT", nodes=2),
        factories.pool("reward", "REWARD"),
    ]
    w = World(tmp_path, pools, LENDING, trainer=SimTrainer())  # the trainer (job 10), two rollout tasks, the judge
    store, trainer = w.store, w.trainer
    done = iter(range(0, 10_000, 2))

    def progress(waiting: int, work: int) -> None:
        judge = {"waiting": waiting, "judging": 4 if waiting else 0, "done": next(done), "failed": 0}
        w.progress(
            {"generating": work, "done": 60, "tokens": 1000, "work": {"trajectories": work, **TAIL}, "judge": judge}
        )

    w.loop(lambda: w.finished("borrow"), lambda: progress(200, 4))
    lent = w.finished("borrow")
    assert lent.to_role == "REWARD" and lent.detail["return_deadline"] is not None
    (gpu,) = lent.gpu_ids
    assert store.fleet.gpu(gpu).pool == "trainer" and store.fleet.gpu(gpu).role == "REWARD"
    judge = [x for x in w.daemon.controller.desired.of(w.allocs[0].id) if x.role == "REWARD"]
    assert [(x.model, x.return_deadline) for x in judge] == [("/m/judge", lent.detail["return_deadline"])]
    assert trainer.released
    assert [t.kind for t in store.transitions.all("r")] == ["borrow"]  # lent first: no rollout GPU shifted

    w.loop(lambda: w.finished("return"), lambda: progress(0, 2))
    back = w.finished("return")
    assert back.gpu_ids == (gpu,) and back.from_role == "REWARD"
    assert store.fleet.gpu(gpu).role == "TRAIN" and not store.fleet.gpu(gpu).borrowed and not trainer.released
    store.close()


def test_pivot_moves_a_reward_pool_judge_to_rollout_while_the_other_keeps_up_and_wakes_it_when_verdicts_back_up(
    tmp_path: Path,
):
    """A reward pool of two judges and a rollout pool of one GPU, a big batch in flight: one judge keeps up (one
    verdict in flight, ten a second), so pivot switches a reward pool's GPU to the policy (its judge parks asleep,
    the policy's worker starts with the run's model); when verdicts back up in the tail it judges again, its judge
    woken rather than started."""
    pools = [factories.pool("rollout", "ROLLOUT", nodes=1), factories.pool("reward", "REWARD", nodes=2)]
    w = World(tmp_path, pools, PROFILE)
    store = w.store
    w.loop(lambda: sum(x.routable for x in store.fleet.workers("r")) == 3)
    judged = [0]  # verdicts given so far

    def driver(per_s: int, waiting: int, progress: dict):
        """The driver's report each second: ``per_s`` more verdicts given, ``waiting`` waiting, one in flight."""

        def report() -> None:
            judged[0] += per_s
            w.progress({**progress, "judge": {"waiting": waiting, "judging": 1, "done": judged[0], "failed": 0}})

        return report

    keeping_up = driver(10, 0, {"generating": 256, "done": 0, "tokens": 0, "work": {"trajectories": 256, **BIG}})
    w.loop(lambda: w.finished("switch", "ROLLOUT"), keeping_up)
    there = w.finished("switch", "ROLLOUT")
    (gpu,) = there.gpu_ids
    moved = store.fleet.gpu(gpu)
    assert moved.pool == "reward" and moved.role == "ROLLOUT" and "keep up" in there.detail["why"]
    assert there.detail["plan"] == "switch_sleep"
    want = sorted(w.daemon.controller.desired.of(moved.allocation_id), key=lambda d: d.role)
    assert [(d.role, d.state, d.model) for d in want] == [
        ("REWARD", "SLEEPING", None),  # the reward pool's agent's own model
        ("ROLLOUT", "RUNNING", "/m/policy"),  # the run's, told to the agent (pearlctl.daemon.desired)
    ]
    assert sum(g.role == "REWARD" for g in store.fleet.gpus("r")) == 1  # the other judge stays

    backed_up = driver(2, 200, {"generating": 4, "done": 252, "tokens": 1000, "work": {"trajectories": 4, **TAIL}})
    w.loop(lambda: w.finished("switch", "REWARD"), backed_up)
    back = w.finished("switch", "REWARD")
    assert back.gpu_ids == (gpu,) and "verdicts back up" in back.detail["why"]
    assert back.detail["plan"] == "switch_wake"  # its judge wakes; the policy's worker parks in its turn
    assert store.fleet.gpu(gpu).role == "REWARD"
    store.close()
