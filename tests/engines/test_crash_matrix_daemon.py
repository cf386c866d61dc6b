"""Crash matrix on the real daemon process, with real engines — a 2-rank DeepSpeed trainer and vLLM workers on the tiny
model (the paced engine in vLLM's place for the kills DEFAULT_KILLS leaves out, docs/paced.md), started by a real
agent (local backend: process groups on this machine): the daemon is SIGKILLed once the effect of a step of a cold
borrow, a stopping return, a warm borrow or a parking return was issued, for every kind of step these transitions
have (see CASES). After each kill a new daemon takes over the same state; the test checks that it converges (the
transition DONE, each step journaled once), that no vLLM process was started twice, that the trainer got its GPUs
back, and that the journal says the effect was re-issued.

The kill is ``PEARL_FAULT=POINT:SEQ:KIND`` (pearlctl.daemon.main.fault_from_env). Cases run in an order that chains
them: a borrow case leaves a GPU lent for the return case after it; a test that finds its precondition missing (a GPU
lent or not, a worker parked or not) sets it up first without a fault. The pool transitions (retire, wake, switch,
start) have their own matrix: tests/engines/test_crash_matrix_moves.py; elastic growth and shrink:
tests/engines/test_crash_matrix_elastic.py. The three share their harness (the run launched, the daemon killed and
started again, what state says): tests/engines/crash_harness.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearlctl.daemon.transitions import PLANS
from pearlctl.state.rows import Gpu
from tests.conftest import wait_for
from tests.engines.conftest import waiting_trainer_spec
from tests.engines.crash_harness import Harness

# Where a restarted daemon cannot know whether a step's effect happened: its INTENT is durable and its effect was
# issued, with no DONE. (After the intent and before the effect, the new daemon re-issues an effect that never
# happened: the same path, minus the risk of doing it twice; tests/integration/test_borrow_e2e.py kills there at a
# START.) Every step of every transition kind is killed at all four boundaries by the state-level matrices
# (tests/unit/test_crash_matrix.py, tests/unit/test_crash_matrix_pools.py), which run the same daemon code with
# the agent and trainer simulated; here real engines prove that no process is started twice.
POINT = "after_effect"
RUN = "crash"
# (plan, step kind) in the order they run: every step kind of the four plans once (VERIFY is a probe: no effect),
# each where its effect does something real — OFFLOAD/RELOAD the trainer's, START/WAKE/SLEEP/STOP an engine's,
# REGISTER/DEREGISTER the router's, DRAIN the agent's. The effect code of a step kind is the same in every plan.
KILLS = (
    ("borrow", "OFFLOAD"),
    ("return", "STOP"),
    ("borrow", "START"),
    ("return", "RELOAD"),
    ("borrow", "REGISTER"),
    ("return_sleep", "DEREGISTER"),  # parks the worker for the warm borrow after it
    ("borrow_warm", "WAKE"),
    ("return_sleep", "DRAIN"),
    ("return_sleep", "SLEEP"),
)
# The kills made with vLLM on the lent GPUs (the others run the paced engine there, docs/paced.md, in a second run:
# what they check is the daemon's and the agent's): the step kinds whose effect only these plans have (OFFLOAD,
# RELOAD, REGISTER, DEREGISTER) and a warm borrow's WAKE. They chain without a set-up move. The pool-transition
# matrix's default kills cover the other kinds (DRAIN, SLEEP, STOP, START, WAKE) on real engines;
# tests/engines/test_crash_matrix_moves.py checks that together they cover every step kind with an effect.
DEFAULT_KILLS = (("borrow", "OFFLOAD"), ("return", "RELOAD"), ("borrow", "REGISTER"), ("return_sleep", "DEREGISTER"),
                 ("borrow_warm", "WAKE"))  # fmt: skip


def cases() -> list[tuple[str, int, str, str]]:
    """(plan, seq, kind, point) of each kill, in KILLS' order."""
    return [(plan, list(PLANS[plan]).index(kind), kind, POINT) for plan, kind in KILLS]


CASES = cases()


def spec(d: Path, paced: bool = False) -> str:
    pools = """
[pools.rollout]                # no GPU, so no worker: every vLLM here runs on a lent trainer GPU
nodes = 1
gpus_per_node = 0
"""
    return waiting_trainer_spec(d, RUN, pools, first_wait_s=36000, paced=paced)


class BorrowHarness(Harness):
    """The run of the borrow matrix: its lent and parked GPUs, its trainer's events, its borrows and returns."""

    def lent(self) -> list[Gpu]:
        return [g for g in self.store.fleet.gpus(self.run_id) if g.borrowed]

    def parked(self) -> list[Gpu]:
        return [g for g in self.store.fleet.gpus(self.run_id) if g.worker_id is not None and not g.borrowed]

    def trainer_events(self) -> list[dict]:
        path = self.run_dir / "trainer" / "train.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    # -- moving GPUs ----------------------------------------------------------------------------------
    def trigger(self, plan: str) -> None:
        if plan in ("borrow", "borrow_warm"):
            extra = ["--stop-on-return"] if plan == "borrow" else []
            self.pc("borrow", RUN, "--policy", "greedy", "--gpus", "1", *extra)
        else:
            self.pc("return", RUN, *(["--keep-warm"] if plan == "return_sleep" else []))

    def ensure(self, plan: str) -> None:
        """Bring the run where a transition of ``plan`` is what happens next."""
        if not self.daemon_alive():
            self.start_daemon()
        wants_parked = plan == "borrow_warm"
        if plan in ("borrow", "borrow_warm"):
            if self.lent():
                self.move("return_sleep" if wants_parked else "return")
            if wants_parked and not self.parked():
                self.move("borrow")
                self.move("return_sleep")
            assert bool(self.parked()) == wants_parked, f"{plan}: parked worker {'missing' if wants_parked else 'left'}"
        elif not self.lent():
            self.move("borrow_warm" if self.parked() else "borrow")


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    """The run, its daemon and its trainer waiting: lent GPUs serve with vLLM (under the engine lock), or
    (``request.param == "paced"``) the paced engine."""
    with BorrowHarness.launched(request, tmp_path_factory, RUN, spec, "crash") as h:
        # the trainer is up and waiting for its first batch, with the long wait it announced
        wait_for(lambda: (h.store.runs.get(h.run_id).get("trainer") or {}).get("phase") == "waiting", 180)
        yield h


def test_the_kills_cover_every_step_kind_with_an_effect():
    kinds = {k for p in ("borrow", "return", "borrow_warm", "return_sleep") for k in PLANS[p]} - {"VERIFY"}
    assert {kind for _, _, kind, _ in CASES} == kinds


def test_the_default_kills_chain_in_kills_order():
    assert [k for k in KILLS if k in DEFAULT_KILLS] == list(DEFAULT_KILLS)


@pytest.mark.parametrize(
    ("harness", "case"),
    # each engine's cases together (one run each), in KILLS' order within each
    [
        pytest.param(engine, (p, s, k, pt), id=f"{'paced-' if engine == 'paced' else ''}{p}-{s}{k}-{pt}")
        for engine in ("vllm", "paced")
        for p, s, k, pt in CASES
        if ((p, k) in DEFAULT_KILLS) == (engine == "vllm")
    ],
    indirect=["harness"],
    scope="module",  # one run per engine: cases of one engine share it, chained
)
def test_daemon_killed_at_step_boundary_converges(harness, case):
    h = harness
    plan, seq, kind, point = case
    h.ensure(plan)
    fault = f"{point}:{seq}:{kind}"
    starts_before = h.vllm_starts()
    n_before = len(h.transitions())
    releases_before = sum(e["event"] == "release" and e["ok"] for e in h.trainer_events())
    broken_before = sum(j["event"] == "lease.broken" for j in h.store.journal.read(h.run_id))

    first = h.start_daemon(fault)
    h.trigger(plan)
    log = h.killed(first)  # the fault killed it
    assert f"PEARL_FAULT {fault}: SIGKILL" in log

    second = h.start_daemon()  # takes over at once: the dead holder's lease is broken, not waited out
    assert second["epoch"] > first["epoch"]
    t = wait_for(lambda: len(h.transitions()) > n_before and h.settled(), 180)

    # it converged: the transition the first daemon planned ran to the end, each step journaled once
    assert (t.detail or {}).get("plan", t.kind) == plan and t.state == "DONE", t
    steps = h.store.transitions.steps(t.id)
    assert [(s.seq, s.kind, s.state) for s in steps] == [(i, k, "DONE") for i, k in enumerate(PLANS[plan])]
    journal = h.store.journal.read(h.run_id)
    intents = [j for j in journal if j["entity"] == "steps" and j["event"] == "step.intent"]
    keys = [j["data"]["key"] for j in intents if j["data"]["transition_id"] == t.id]
    assert len(keys) == len(set(keys)) == len(PLANS[plan])

    # no engine started twice: a cold borrow started exactly one vLLM process, any other case none
    assert h.vllm_starts() - starts_before == (1 if plan == "borrow" else 0)
    workers = [w for w in h.store.fleet.workers(h.run_id) if w.role == "ROLLOUT"]
    live = [w for w in workers if w.state not in ("STOPPED", "LOST", "FAILED")]
    assert len(live) <= 1, live

    if plan.startswith("borrow"):
        assert len(h.lent()) == 1 and live and live[0].state == "READY" and live[0].routable
        if plan == "borrow":  # its agent measured its cold start (a start's estimate): the START step spans it
            start = next(s for s in steps if s.kind == "START")
            assert 0 < live[0].ready_s <= start.detail["finished_at"] - start.detail["started_at"]
        releases = sum(e["event"] == "release" and e["ok"] for e in h.trainer_events())
        assert releases == releases_before + 1  # the trainer offloaded once, not twice
    else:  # the trainer has its GPUs back, and the worker is parked asleep or stopped as asked
        assert not h.lent() and not (h.store.runs.get(h.run_id).get("trainer") or {}).get("released")
        events = h.trainer_events()
        last_release = max(i for i, e in enumerate(events) if e["event"] == "release")
        assert any(e["event"] == "reclaim" and e["ok"] for e in events[last_release:])
        if plan == "return_sleep":
            assert len(live) == 1 and live[0].state == "SLEEPING" and not live[0].routable
        else:
            assert not live

    # the journal tells it: the effect of the step the first daemon died on was issued again (idempotently)
    key = f"{t.id}:{seq}:{kind}"
    assert any(j["event"] == "effect re-issued after restart" and j["entity_id"] == key for j in journal), key
    # the second daemon did not wait the lease out: it saw the holder's process gone and broke the lease
    assert sum(j["event"] == "lease.broken" for j in journal) == broken_before + 1
