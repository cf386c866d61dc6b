"""A trainer GPU lent to the run's judge (a generative reward model, REWARD) under faults of the daemon, on real
processes: SIGKILLed once the effect of the loan's START was issued (a new daemon finishes the loan; one judge
engine started), and — the return guarantee's fault run with a trainer GPU judging — SIGKILLed and kept down while
the GPU is lent.

The fault run: the daemon SIGKILLed and kept down while an idle trainer GPU judges. The agent on the trainer's
node returns the GPU by itself by its deadline (it stops the judge there), the trainer reclaims on its node, and
every judge request sent through the run's base URL meanwhile is answered once — what the lent judge had in flight
is sent again (or continued) by the gateway to the reward pool's judge. A new daemon then journals the agent's own
return and finishes it in state.

The run, on the local backend: the real 2-rank DeepSpeed trainer (CPU), waiting for a first batch that never comes
with a first-wait hint of ``WAIT_S`` (the trainer hook's ``PEARL_FIRST_WAIT_S``: the loan's deadline), no rollout
GPU, a reward pool of one (stand-in) GPU whose judge serves throughout, and the paced engine in vLLM's place
(docs/paced.md: what is checked is the agent's, the trainer hook's, the gateway's and the daemon's). The loan is
made by the test policy ``judge_greedy`` (tests/data/policies/judge_greedy.py: `greedy` for the judge), so the test
does not wait for verdicts to back up. The same guarantee for a GPU lent to rollout, on real Slurm:
tests/integration/test_return_guarantee.py.

Times are judged from recorded timestamps (state, the trainer's log), not the test's clock.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from pearlctl.daemon.policy_view import PolicyInputs
from pearlctl.daemon.transitions import PLANS, PlanKind
from pearlctl.host.runfiles import read_address
from pearlctl.state.rows import Gpu, Worker
from tests.conftest import REPO, alive, wait_for
from tests.engines.conftest import waiting_trainer_spec
from tests.engines.crash_harness import Harness
from tests.engines.load import Load, prompts

RUN = "judgeloan"
JUDGE = REPO / "examples" / "models" / "tiny-judge"
POLICIES = REPO / "tests" / "data" / "policies"
# the trainer's announced first wait, the loan's deadline: a cold borrow and its return as the daemon prices them
# before it measured one (offload 2 s and start 25 s, sleep 3 s and reload 2 s, 2 s of slack) fit in it
WAIT_S = 60
PROMPTS = prompts(4, repeat=2)
TOKENS = 200  # under a second a request on the paced profile


def spec(d: Path, paced: bool) -> str:
    assert paced, "the judge's loan fault runs run on the paced engine"
    pools = f"""
[pools.rollout]                # no GPU: the judge's loan is the only move
nodes = 1
gpus_per_node = 0
[pools.reward]                 # the judge, serving throughout
nodes = 1
gpus_per_node = 1
model = "{JUDGE}"
"""
    return waiting_trainer_spec(d, RUN, pools, first_wait_s=WAIT_S, paced=paced)


class LoanHarness(Harness):
    def lent(self) -> list[Gpu]:
        return [g for g in self.store.fleet.gpus(self.run_id) if g.borrowed]

    def judges(self) -> list[Worker]:
        """READY, routed judge workers."""
        return [w for w in self.store.fleet.workers(self.run_id) if w.role == "REWARD" and w.state == "READY"
                and w.routable]  # fmt: skip

    def trainer_events(self) -> list[dict]:
        path = self.run_dir / "trainer" / "train.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def harness(request, tmp_path_factory, monkeypatch):
    """A run of its own per test (its trainer's announced wait is the loans' horizon, and a fault run spends it)."""
    monkeypatch.setenv("PEARL_POLICY_PATH", str(POLICIES))  # the daemon finds judge_greedy there
    with LoanHarness.launched(request, tmp_path_factory, RUN, spec, "judgeloan") as h:
        wait_for(lambda: (h.store.runs.get(h.run_id).get("trainer") or {}).get("phase") == "waiting", 180)
        wait_for(lambda: len(h.judges()) == 1, 60)
        yield h


@pytest.mark.parametrize("harness", ["paced"], indirect=True)
def test_a_trainer_gpu_lent_to_the_judge_comes_back_by_its_deadline_with_the_daemon_down(harness):
    h = harness
    trainer_alloc = next(a.id for a in h.store.fleet.allocations(h.run_id) if a.pool == "trainer")
    (home,) = h.judges()  # the reward pool's judge
    # lent at once (the trainer's wait counts down from when it began: a loan must fit in what is left)
    h.pc("borrow", RUN, "--policy", "judge_greedy", "--gpus", "1")
    with Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=3, model=str(JUDGE)) as judging:
        (gpu,) = wait_for(lambda: (lent := h.lent()) and lent[0].role == "REWARD" and lent, 120)
        loaned = wait_for(lambda: next((w for w in h.judges() if w.allocation_id == trainer_alloc), None), 120)
        # the lent judge serves judge requests through the run's base URL
        wait_for(lambda: any(loaned.url in o["workers"] for o in judging.done), 60)
        deadline = gpu.return_deadline
        one_return = PolicyInputs(h.store, h.run_id).cost("return")
        daemon = read_address(h.run_dir)
        os.kill(daemon["pid"], signal.SIGKILL)  # kept down: nobody restarts it

        def reclaimed() -> list[dict]:
            return [e for e in h.trainer_events() if e["event"] == "reclaim" and e.get("ok")
                    and str(e.get("command_id", "")).startswith("local-return:")]  # fmt: skip

        reclaim = wait_for(reclaimed, deadline - time.time() + one_return + 60, every=0.5)[0]
        judging.wait_turns(3)  # the reward pool's judge answers on
    assert not alive(daemon["pid"])
    print(f"\nreclaimed {reclaim['ts'] - deadline:+.2f} s from the deadline (one return {one_return:.2f} s); "
          f"judge requests {judging.counts()}")  # fmt: skip
    assert reclaim["ts"] <= deadline + one_return, (reclaim, deadline, one_return)
    agent_log = "\n".join(p.read_text() for p in (h.run_dir / "logs").glob("trainer-*.log"))
    assert '"event": "self return"' in agent_log
    # every judge request sent was answered once, by a judge: the lent one or the reward pool's
    assert judging.errors == [] and judging.sent == len(judging.done), judging.counts()
    assert {w for o in judging.done for w in o["workers"]} <= {home.url, loaned.url}
    assert all(o["workers"][-1] == home.url for o in judging.done[-3:])  # after the return: the reward pool's judge

    # a new daemon journals the agent's own return and finishes it in state
    h.start_daemon()
    journaled = wait_for(lambda: [j for j in h.journal() if j["event"] == "agent returned lent GPUs itself"], 60)
    assert journaled[0]["data"]["deadline"] == deadline
    wait_for(lambda: not any(g.id == gpu.id and g.borrowed for g in h.store.fleet.gpus(h.run_id)), 60)


@pytest.mark.parametrize("harness", ["paced"], indirect=True)
def test_daemon_killed_after_a_judge_loans_start_converges_with_one_judge_started_and_no_request_lost(harness):
    """The START of a loan to the judge is the step whose effect is the judge's own (the agent on the trainer's node
    starts the judge's model on the lent GPU; OFFLOAD, REGISTER and the rest are a borrow's, crashed for a loan to
    rollout in tests/engines/test_crash_matrix_daemon.py, and for both roles at every step boundary in state,
    tests/unit/test_crash_matrix_pools.py)."""
    h = harness
    seq = list(PLANS[PlanKind.BORROW]).index("START")
    fault = f"after_effect:{seq}:START"
    starts_before = h.vllm_starts()
    (home,) = h.judges()
    first = h.start_daemon(fault)
    h.pc("borrow", RUN, "--policy", "judge_greedy", "--gpus", "1")
    with Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=3, model=str(JUDGE)) as judging:
        assert f"PEARL_FAULT {fault}: SIGKILL" in h.killed(first)
        second = h.start_daemon()
        assert second["epoch"] > first["epoch"]
        t = wait_for(lambda: h.settled(), 120)
        assert (t.kind, t.to_role, t.state) == ("borrow", "REWARD", "DONE"), t
        assert [(s.kind, s.state) for s in h.store.transitions.steps(t.id)] == [
            (k, "DONE") for k in PLANS[PlanKind.BORROW]
        ]
        key = f"{t.id}:{seq}:START"
        assert any(j["event"] == "effect re-issued after restart" and j["entity_id"] == key for j in h.journal())
        trainer_alloc = next(a.id for a in h.store.fleet.allocations(h.run_id) if a.pool == "trainer")
        loaned = wait_for(lambda: next((w for w in h.judges() if w.allocation_id == trainer_alloc), None), 60)
        wait_for(lambda: any(loaned.url in o["workers"] for o in judging.done), 60)  # the lent judge serves
        judging.wait_turns(2)
    print(f"\nkilled after START's effect: judge requests {judging.counts()}")
    assert h.vllm_starts() - starts_before == 1  # one judge engine started on the lent GPU, not two
    assert judging.errors == [] and judging.sent == len(judging.done), judging.counts()
    assert {w for o in judging.done for w in o["workers"]} <= {home.url, loaned.url}
