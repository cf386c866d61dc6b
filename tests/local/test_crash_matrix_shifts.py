"""Crash matrix of the shifts between the policy and the judge on the real daemon process: a rollout GPU switched to
the run's judge (REWARD: a generative reward model, the reward pool's model) and back, with the daemon SIGKILLed
once the effect of a step that acts on the agent was issued (DRAIN, START, WAKE; STOP and SLEEP have no effect of
their own), in both directions: the shift that restarts (an operator's, not kept warm) and the shifts that park
the leaving worker asleep and start or wake the coming one (a policy's; the cases run in order on one GPU, so the
first to the judge starts it and each later one wakes what the one before parked). The router's steps are killed
in tests/engines/test_crash_matrix_daemon.py; every step boundary of every shift plan is crashed by the state-level
matrix, tests/unit/test_crash_matrix_pools.py.

The run, on the local backend with the paced engine in vLLM's place (docs/paced.md: what is checked is the daemon's,
the agent's and the gateway's; so it runs beside the suite's chains, not in them, tests/conftest.py): a rollout pool
of two tasks of one (stand-in) GPU each — task 0's GPU shifts, task 1's serves the policy throughout — and a reward
pool of one task whose judge serves throughout. Two loads run through the run's one base URL from before the shift
until after the new daemon converged: the policy's turns and the judge's requests (by the judge's model name). A new
daemon takes over the same state; the test checks that it converges (the transition DONE, each step journaled once,
the effect re-issued), that one engine was started (the shifted GPU's, with the other role's model: its /v1/models
says which) or none where the one parked there woke, that a leaving worker that parks sleeps in its model's place on
the GPU, that the gateway routes the shifted worker in its new role's router, that no policy turn and no judge
request was lost or answered twice (sent = completed, none failed), that no policy turn ever reached a judge nor a
judge request a policy worker, and that what was in flight on the leaving worker when its drain ended (requests
outlast its 0.2-s drain) was continued on the worker of its role that stayed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pearlctl.agent.engines.vllm_endpoints import parse_metrics
from pearlctl.daemon.transitions import PLANS, PlanKind
from pearlctl.router import service
from pearlctl.state.rows import Allocation, Worker
from pearlctl.vocabulary import StepKind
from tests.conftest import REPO, wait_for
from tests.engines.conftest import PACED_RUN, TINY_MODEL, local_run_spec
from tests.engines.crash_harness import Harness
from tests.engines.load import Load, prompts

RUN = "shifts"
POINT = "after_effect"
JUDGE = REPO / "examples" / "models" / "tiny-judge"
MOVED, KEPT = 0, 1  # the rollout task whose GPU shifts, and the one whose worker serves the policy throughout
SHIFTS = {"REWARD": "ROLLOUT", "ROLLOUT": "REWARD"}  # to -> from
# a shift that restarts (an operator's, not kept warm), killed after each step whose effect is the agent's (STOP
# has none of its own: DRAIN's desired-state write stops the engine), one per direction
CASES = [("REWARD", StepKind.DRAIN), ("ROLLOUT", StepKind.START)]
# the shifts that park (a policy's), in order on the one GPU: the first to the judge starts it, then each wakes
# what the last parked; killed after DRAIN (it parks the leaving worker), START or WAKE (SLEEP has no effect)
PARKING = [
    ("REWARD", PlanKind.SWITCH_SLEEP, StepKind.START),
    ("ROLLOUT", PlanKind.SWITCH_WAKE, StepKind.WAKE),
    ("REWARD", PlanKind.SWITCH_WAKE, StepKind.DRAIN),
    ("ROLLOUT", PlanKind.SWITCH_WAKE, StepKind.DRAIN),
    ("REWARD", PlanKind.SWITCH_WAKE, StepKind.WAKE),
]
PROMPTS = prompts(4, repeat=2)
TOKENS = 300  # about 1.2 s a request on the paced profile: far longer than the leaving worker's drain


def spec(d: Path, paced: bool) -> str:
    assert paced, "the shift matrix runs on the paced engine"
    pools = f"""
[pools.rollout]                # two tasks of one GPU each: task 0's GPU shifts, task 1's serves the policy
nodes = 2
gpus_per_node = 1
env = {{ PEARL_DRAIN_TIMEOUT_S = "0.2" }}  # a leaving worker's agent aborts what still runs after 0.2 s

[pools.reward]                 # the judge, serving throughout
nodes = 1
gpus_per_node = 1
model = "{JUDGE}"
"""
    return local_run_spec(d, RUN, pools, run_extra=PACED_RUN)


class ShiftHarness(Harness):
    def allocation(self, pool: str, task: int = 0) -> Allocation:
        return next(a for a in self.store.fleet.allocations(self.run_id) if a.pool == pool and a.array_index == task)

    def gpu(self):
        alloc = self.allocation("rollout", MOVED).id
        return next(g for g in self.store.fleet.gpus(self.run_id) if g.allocation_id == alloc)

    def live_workers(self, pool: str = "rollout", task: int = MOVED) -> list[Worker]:
        alloc = self.allocation(pool, task).id
        return [
            w
            for w in self.store.fleet.workers(self.run_id)
            if w.allocation_id == alloc and w.state not in ("STOPPED", "LOST", "FAILED")
        ]

    def serving(self, pool: str, task: int = 0) -> Worker | None:
        live = [w for w in self.live_workers(pool, task) if w.state == "READY" and w.routable]
        return live[0] if len(live) == 1 else None

    def members(self) -> dict[str, str]:
        """The gateway's members: URL -> the router it routes them in ("regular", "judge", ...); none before the
        daemon started the gateway."""
        record = service.read_record(self.run_dir)
        if record is None:
            return {}
        key = service.read_key(self.run_dir)
        doc = httpx.get(record.url + "/pearl/workers", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
        return {m["url"]: m.get("router") for m in doc["workers"] if m.get("routed", True)}

    def trigger(self, to: str) -> None:
        self.pc("move", RUN, "switch", str(self.gpu().id), "--role", to)

    def ensure(self, start: str) -> None:
        if not self.daemon_alive():
            self.start_daemon()
        if self.gpu().role != start:
            self.move(start)


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    with ShiftHarness.launched(request, tmp_path_factory, RUN, spec, "shifts") as h:
        wait_for(lambda: h.serving("rollout", MOVED) and h.serving("rollout", KEPT) and h.serving("reward"), 120)
        # the gateway routes the judge (it knows the judge's model: a request naming it before would be the policy's)
        wait_for(lambda: (w := h.serving("reward")) is not None and h.members().get(w.url) == "judge", 60)
        yield h


def running(url: str) -> float:
    """Requests running on a (paced) engine now, from its /metrics as the agent reads them (0 when it does not
    answer)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return parse_metrics(text).get("num_requests_running", 0)


def models_of(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]


def crash_a_shift(h: ShiftHarness, to: str, plan: PlanKind, kind: StepKind, *, keep_warm: bool) -> None:
    """Shift the GPU to ``to`` by a transition of ``plan`` with the daemon SIGKILLed once ``kind``'s effect was
    issued, a new daemon taking over; check what the module's docstring says (and, for a plan that parks, that the
    leaving worker sleeps parked on the GPU and that a woken worker is the one parked there: no engine started)."""
    seq = PLANS[plan].index(kind)
    fault = f"{POINT}:{seq}:{kind}"
    starts_before, n_before = h.vllm_starts(), len(h.transitions())
    kept, judge = h.serving("rollout", KEPT), h.serving("reward")
    assert kept is not None and judge is not None
    (leaving,) = [w for w in h.live_workers() if w.state != "SLEEPING"]
    parked = h.gpu().parked_for(to)  # the coming role's worker asleep here, which a wake serves
    assert (parked is not None) == (plan == PlanKind.SWITCH_WAKE), (plan, h.gpu())

    first = h.start_daemon(fault)
    with (
        Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=2) as policy,
        Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=2, model=str(JUDGE)) as judging,
    ):
        policy.wait_turns(2)
        judging.wait_turns(1)
        h.pc("move", RUN, "switch", str(h.gpu().id), "--role", to, *(["--keep-warm"] if keep_warm else []))
        assert f"PEARL_FAULT {fault}: SIGKILL" in h.killed(first)
        second = h.start_daemon()
        assert second["epoch"] > first["epoch"]
        t = wait_for(lambda: len(h.transitions()) > n_before and h.settled(), 240)

        assert (t.detail or {}).get("plan") == plan and t.state == "DONE" and t.to_role == to, t
        steps = h.store.transitions.steps(t.id)
        assert [(s.seq, s.kind, s.state) for s in steps] == [(i, k, "DONE") for i, k in enumerate(PLANS[plan])]
        journal = h.store.journal.read(h.run_id)
        key = f"{t.id}:{seq}:{kind}"
        assert any(j["event"] == "effect re-issued after restart" and j["entity_id"] == key for j in journal), key

        # one engine started, or none where the parked one woke: the shifted GPU's, serving the other role's model,
        # routed in that role's router
        assert h.vllm_starts() - starts_before == (0 if parked is not None else 1)
        (moved,) = [w for w in h.live_workers() if w.state != "SLEEPING"]
        assert (moved.role, moved.state, moved.routable) == (to, "READY", 1)
        if parked is not None:
            assert moved.id == parked
        assert models_of(moved.url) == [str(JUDGE) if to == "REWARD" else str(TINY_MODEL)]
        router = "judge" if to == "REWARD" else "regular"
        wait_for(lambda: h.members().get(moved.url) == router, 30)
        assert h.members().get(leaving.url) is None  # the worker that left is in no router
        asleep = [w for w in h.live_workers() if w.state == "SLEEPING"]
        if plan == PlanKind.SWITCH:  # the leaving worker stopped
            assert asleep == []
        else:  # it sleeps parked on the GPU in its model's place, and the coming role's place is free
            assert [(w.id, w.role) for w in asleep] == [(leaving.id, SHIFTS[to])]
            assert h.gpu().parked_for(SHIFTS[to]) == leaving.id and h.gpu().parked_for(to) is None, h.gpu()
        assert wait_for(lambda: h.serving("rollout", KEPT), 30).id == kept.id
        assert h.serving("reward").id == judge.id
        policy.wait_turns(1)  # both roles still answer through the run's base URL
        judging.wait_turns(1)

    print(f"\n{plan} to {to}, killed {POINT} {seq}:{kind}: policy {policy.counts()}; judge {judging.counts()}")
    # nothing lost, nothing answered twice: every turn and every judge request sent completed once
    assert policy.errors == [] and policy.sent == len(policy.done), policy.counts()
    assert judging.errors == [] and judging.sent == len(judging.done), judging.counts()
    # each role's requests reached that role's workers only
    judges = {judge.url} | ({moved.url} if to == "REWARD" else {leaving.url})
    assert not {w for o in policy.done for w in o["workers"]} & judges
    assert {w for o in judging.done for w in o["workers"]} <= judges
    # what was in flight on the GPU that left its role was continued on the role's worker that stayed
    stayed = {"ROLLOUT": kept.url, "REWARD": judge.url}[SHIFTS[to]]
    interrupted = policy.continued() if to == "REWARD" else judging.continued()
    assert all(o["workers"][0] == leaving.url and o["workers"][-1] == stayed for o in interrupted), interrupted
    assert not (judging.continued() if to == "REWARD" else policy.continued())  # nothing left the other role


@pytest.mark.parametrize(
    ("harness", "case"),
    [pytest.param("paced", c, id=f"paced-to_{c[0]}-{c[1]}") for c in CASES],
    indirect=["harness"],
    scope="module",
)
def test_daemon_killed_during_a_shift_between_the_policy_and_the_judge_converges_and_loses_nothing(harness, case):
    to, kind = case
    harness.ensure(SHIFTS[to])
    crash_a_shift(harness, to, PlanKind.SWITCH, kind, keep_warm=False)


@pytest.mark.parametrize(
    ("harness", "case"),
    [pytest.param("paced", c, id=f"paced-to_{c[0]}-{c[1]}-{c[2]}") for c in PARKING],
    indirect=["harness"],
    scope="module",
)
def test_daemon_killed_during_a_shift_that_parks_converges_wakes_what_sleeps_and_loses_nothing(harness, case):
    """The shifts a policy makes (workers kept warm): the first to the judge parks the policy's worker and starts
    the judge, every later one parks the leaving worker and wakes the one parked there (the cases run in order on
    one GPU, each from where the last left it)."""
    to, plan, kind = case
    assert harness.gpu().role == SHIFTS[to], harness.gpu()
    crash_a_shift(harness, to, plan, kind, keep_warm=True)


@pytest.mark.parametrize("harness", ["paced"], indirect=True, scope="module")  # the matrix's run, after its cases
def test_a_judge_worker_killed_mid_request_loses_no_judge_request_and_answers_none_twice(harness):
    """The fault run of a judge: with two judges serving (the reward pool's, and the rollout GPU shifted to the judge),
    the reward pool's judge process is SIGKILLed while judge requests are in flight on it. Every judge request sent
    is answered once: what the killed judge was generating is continued (or sent again whole) on the other judge by
    the gateway, never lost and never answered twice; the agent starts the killed judge again."""
    import os
    import signal

    h = harness
    h.ensure("REWARD")
    judge, shifted = h.serving("reward"), h.serving("rollout", MOVED)
    assert judge is not None and shifted is not None and shifted.role == "REWARD"
    wait_for(lambda: h.members().get(shifted.url) == "judge" and h.members().get(judge.url) == "judge", 30)
    with Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=3, model=str(JUDGE)) as judging:
        judging.wait_turns(2)
        wait_for(lambda: running(judge.url) > 0, 30, every=0.05)  # a request in flight on it
        os.kill(judge.pid, signal.SIGKILL)
        judging.wait_turns(6)
        again = wait_for(lambda: (w := h.serving("reward")) is not None and w.id != judge.id and w, 120)
        judging.wait_turns(1)
    print(f"\njudge killed mid-request: {judging.counts()}")
    assert judging.errors == [] and judging.sent == len(judging.done), judging.counts()
    assert {w for o in judging.done for w in o["workers"]} <= {judge.url, shifted.url, again.url}
    # a request was running on the killed judge (checked before the kill) and every request sent was answered: the
    # one in flight was continued or sent again elsewhere (a request killed before its first token has no part on
    # the killed judge to show for it), never lost
    assert all(o["workers"] and o["workers"][-1] in (shifted.url, again.url, judge.url) for o in judging.done)


@pytest.mark.parametrize("harness", ["paced"], indirect=True, scope="module")  # the matrix's run, after its cases
def test_the_reward_pools_judge_serves_the_policy_and_judges_again_losing_nothing(harness):
    """A reward pool's GPU moves as a rollout GPU does (pivot plans it so, pearlctl/policies/shipped/pivot.py): with
    the shifted rollout GPU judging too, the reward pool's GPU switches to the policy and back, workers kept warm,
    under both loads. Its judge parks asleep and the policy's worker starts there with the run's model, routed in the
    regular router; back, its judge wakes (no engine started) and the policy's parks. Every policy turn and judge
    request sent is answered once, each by a worker of its role."""
    h = harness
    h.ensure("REWARD")  # (a daemon running)
    shifted = h.serving("rollout", MOVED)
    assert shifted is not None and shifted.role == "REWARD"
    reward = h.allocation("reward").id
    gpu = next(g for g in h.store.fleet.gpus(h.run_id) if g.allocation_id == reward)
    judge = h.serving("reward")
    with (
        Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=2) as policy,
        Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=2, model=str(JUDGE)) as judging,
    ):
        policy.wait_turns(1)
        judging.wait_turns(1)
        starts = h.vllm_starts()
        n = len(h.transitions())
        h.pc("move", RUN, "switch", str(gpu.id), "--role", "ROLLOUT", "--keep-warm")
        there = wait_for(lambda: len(h.transitions()) > n and h.settled(), 180)
        assert (there.state, there.to_role, (there.detail or {}).get("plan")) == ("DONE", "ROLLOUT", "switch_sleep")
        assert h.vllm_starts() - starts == 1  # the policy's worker, on the reward pool's GPU
        (serving,) = [w for w in h.live_workers("reward", 0) if w.state == "READY"]
        assert (serving.role, serving.routable) == ("ROLLOUT", 1) and models_of(serving.url) == [str(TINY_MODEL)]
        wait_for(lambda: h.members().get(serving.url) == "regular", 30)
        assert h.store.fleet.gpu(gpu.id).parked_for("REWARD") == judge.id  # its judge sleeps there
        policy.wait_turns(2)
        judging.wait_turns(2)  # the shifted judge judges alone meanwhile

        n = len(h.transitions())
        h.pc("move", RUN, "switch", str(gpu.id), "--role", "REWARD", "--keep-warm")
        back = wait_for(lambda: len(h.transitions()) > n and h.settled(), 180)
        assert (back.state, back.to_role, (back.detail or {}).get("plan")) == ("DONE", "REWARD", "switch_wake")
        assert h.vllm_starts() - starts == 1  # its judge woke: no engine started
        assert wait_for(lambda: h.serving("reward"), 30).id == judge.id
        wait_for(lambda: h.members().get(judge.url) == "judge", 30)
        assert h.store.fleet.gpu(gpu.id).parked_for("ROLLOUT") == serving.id  # the policy's sleeps there now
        policy.wait_turns(1)
        judging.wait_turns(1)
    print(f"\nthe reward pool's GPU to the policy and back: policy {policy.counts()}; judge {judging.counts()}")
    assert policy.errors == [] and policy.sent == len(policy.done), policy.counts()
    assert judging.errors == [] and judging.sent == len(judging.done), judging.counts()
    judges = {judge.url, shifted.url}
    assert not {w for o in policy.done for w in o["workers"]} & judges
    assert {w for o in judging.done for w in o["workers"]} <= judges
