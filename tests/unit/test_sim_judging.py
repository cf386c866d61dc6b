"""The simulator's judge (pearlctl.sim.judging) and a run with one (pearlctl.sim.run): one verdict per trajectory,
asked when it finishes, prefill-heavy on the judge's own profile, a batch complete only once judged, and verdicts
in flight on a judge that leaves sent again — never lost, never judged twice."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pearlctl.planner.profile import load as load_profile
from pearlctl.sim import scenario as sc
from pearlctl.sim.judging import DECODING, JUDGED, PREFILLING, WAITING, Judges
from pearlctl.sim.run import run_policy
from tests.unit.test_sim_scenario import ANY_VALUE

REPO = Path(__file__).resolve().parents[2]
PROFILE = load_profile(REPO / "examples/profiles/qwen3-8b-h200.toml")


def judges(n: int, *, rubric: int = 0, verdict: int = 1, mismatch=sc.NO_MISMATCH) -> Judges:
    judge = sc.Judge(PROFILE, REPO / "examples/profiles/qwen3-8b-h200.toml", rubric, verdict)
    return Judges(judge, n, mismatch, seed=1)


def test_a_verdict_is_asked_when_its_trajectory_finishes_and_its_prefill_reads_the_whole_trajectory():
    j = judges(2, rubric=100)
    j.submit(np.array([0, 1]), np.array([0.0, 10.0]), np.array([24_000.0 - 100, 48_000.0 - 100]))
    assert list(j.state) == [WAITING, WAITING]
    j.step(0.0, 0.5, workers=1)  # trajectory 1's verdict cannot start before it finished
    assert j.state[0] == PREFILLING and j.state[1] == WAITING
    t = 0.5
    while j.state[0] != JUDGED:
        j.step(t, 0.5, workers=1)
        t += 0.5
    # 24,000 tokens (trajectory and rubric) at 24,000 tokens/s, then one token of decode
    assert j.judged_at[0] == pytest.approx(1.0 + PROFILE.decode.itl(1, 24_000.0), rel=1e-6)
    while j.state[1] != JUDGED:
        j.step(t, 0.5, workers=1)
        t += 0.5
    assert j.judged_at[1] >= 10.0 + 2.0 and j.stats["verdicts"] == 2
    assert j.stats["prefill_tokens"] == pytest.approx(72_000.0)


def test_a_longer_verdict_decodes_its_tokens_and_more_judges_judge_faster():
    def time_to_judge(workers: int, verdict: int) -> float:
        j = judges(64, verdict=verdict)
        j.submit(np.arange(64), np.zeros(64), np.full(64, 8_000.0))
        t = 0.0
        while j.counts()[2] < 64:
            j.step(t, 0.5, workers)
            t += 0.5
            assert t < 3600
        return float(np.nanmax(j.judged_at))

    assert time_to_judge(2, 1) < 0.6 * time_to_judge(1, 1)
    assert time_to_judge(1, 256) > time_to_judge(1, 1) + 256 * PROFILE.decode.itl(1, 8_000.0)


def test_a_judge_that_leaves_sends_its_share_of_the_verdicts_in_flight_again_and_none_is_lost_or_doubled():
    j = judges(8)
    j.submit(np.arange(8), np.zeros(8), np.full(8, 200_000.0))  # long reads: all in flight at once
    j.step(0.0, 0.5, workers=2)
    assert j.counts() == (0, 8, 0)
    j.step(0.5, 0.5, workers=1)  # one of the two judges left: half the verdicts in flight go back to the queue
    waiting, judging, done = j.counts()
    assert (waiting, judging, done) == (4, 4, 0) and j.stats["resent"] == 4
    resent = np.flatnonzero(j.state == WAITING)
    assert (j.left[resent] == j.tokens[resent]).all() and (j.ready_at[resent] == pytest.approx(1.5))
    t = 1.0
    while j.counts()[2] < 8:
        j.step(t, 0.5, workers=1)
        t += 0.5
        assert t < 3600
    assert (j.state == JUDGED).all() and j.stats["verdicts"] == 8
    assert not ((j.state == DECODING) | (j.state == PREFILLING)).any()


def test_without_a_judge_serving_nothing_is_judged_and_nothing_is_lost():
    j = judges(4)
    j.submit(np.arange(4), np.zeros(4), np.full(4, 1_000.0))
    for k in range(10):
        j.step(k * 0.5, 0.5, workers=0)
    assert j.counts() == (4, 0, 0)
    j.step(5.0, 0.5, workers=1)
    j.step(5.5, 0.5, workers=1)
    assert j.counts()[2] == 4


def genrm(tmp_path: Path, reward_gpus: int, rubric: int = 400, verdict: int = 1) -> sc.Scenario:
    """bursty-elastic-8b with a judge of the policy's size on ``reward_gpus`` GPUs."""
    s = sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml")
    judge = sc.Judge(s.profile, s.profile_path, rubric, verdict)
    return replace(s, cluster=replace(s.cluster, reward_gpus=reward_gpus), judge=judge, steps=3)


@pytest.mark.parametrize("policy", ["static", "pearl"])
def test_a_run_with_a_judge_trains_every_step_each_trajectory_judged_once_after_it_finished(tmp_path, policy):
    s = genrm(tmp_path, 2)
    r = run_policy(s, policy)
    assert r.finished and r.steps == 3
    assert r.judge["verdicts"] == 3 * s.workload.batch_size  # expected = judged = trained
    assert r.gpu_seconds_by_role["REWARD"] > 0


def test_a_batch_waits_for_its_verdicts_so_fewer_judges_make_a_slower_run(tmp_path):
    one = run_policy(replace(genrm(tmp_path, 1, rubric=20_000), steps=2), "static")
    eight = run_policy(replace(genrm(tmp_path, 8, rubric=20_000), steps=2), "static")
    plain = run_policy(
        replace(genrm(tmp_path, 1), judge=None, steps=2, cluster=replace(genrm(tmp_path, 1).cluster, reward_gpus=0)),
        "static",
    )
    assert one.samples_per_s < eight.samples_per_s <= plain.samples_per_s
    assert one.judge["verdicts"] == eight.judge["verdicts"] == 2 * 1024 and plain.judge == {}


def test_a_judge_needs_a_reward_pool_and_a_reward_pool_needs_a_judge(tmp_path):
    base = (REPO / "examples/scenarios/bursty-elastic-8b.toml").read_text()
    profile = (REPO / "examples/profiles/qwen3-8b-h200.toml").as_posix()
    text = base.replace("../profiles/", f"{REPO.as_posix()}/examples/profiles/")
    with pytest.raises(sc.ScenarioError, match=r"\[cluster\] reward_gpus: must be > 0 with a \[judge\]"):
        sc.from_dict(_toml(text + f'\n[judge]\nprofile = "{profile}"\n'), base=tmp_path)
    with pytest.raises(sc.ScenarioError, match=r"\[cluster\] reward_gpus: needs a \[judge\] table"):
        sc.from_dict(_toml(text.replace("[cluster]\n", "[cluster]\nreward_gpus = 2\n")), base=tmp_path)
    with pytest.raises(sc.ScenarioError, match=r"\[judge\] profile: "):
        bad = text.replace("[cluster]\n", "[cluster]\nreward_gpus = 2\n") + '\n[judge]\nprofile = "nope.toml"\n'
        sc.from_dict(_toml(bad), base=tmp_path)
    with pytest.raises(sc.ScenarioError, match=r"\[judge\]: unknown key\(s\) verdicts"):
        bad = (
            text.replace("[cluster]\n", "[cluster]\nreward_gpus = 2\n")
            + f'\n[judge]\nprofile = "{profile}"\nverdicts = 2\n'
        )
        sc.from_dict(_toml(bad), base=tmp_path)
    ok = sc.from_dict(
        _toml(text.replace("[cluster]\n", "[cluster]\nreward_gpus = 2\n") + f'\n[judge]\nprofile = "{profile}"\n'),
        base=tmp_path,
    )
    assert ok.cluster.reward_gpus == 2 and ok.judge.verdict_tokens == 1 and ok.judge.rubric_tokens == 0


def _toml(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def judge_bound(tmp_path: Path) -> sc.Scenario:
    """A run whose batches wait on the judge: one judging GPU reads every trajectory and a 20,000-token rubric."""
    return replace(genrm(tmp_path, 1, rubric=20_000), steps=2)


def test_moves_to_and_from_the_judge_cost_what_its_engine_costs():
    from pearlctl.planner.model import Move, MoveKind, Role
    from pearlctl.sim.migration import ABORT_S
    from pearlctl.sim.run import Sim

    s = genrm(Path("."), 2)
    judge_costs = replace(PROFILE.costs, start_s=90.0, wake_s=4.0, sleep_s=2.5, stop_s=7.0)
    s = replace(s, judge=replace(s.judge, profile=replace(PROFILE, costs=judge_costs)))
    sim = Sim(s, "static", None)
    c = s.profile.costs
    rollout = next(g for g in sim.gpus if g.pool == "rollout")
    reward = next(g for g in sim.gpus if g.pool == "reward")
    trainer = sim.gpus[0]
    # a rollout GPU shifted to the judge: the policy's engine parks asleep there, the judge's starts cold; back, the
    # judge parks and the policy wakes (with the newest weights: training moved on meanwhile); to the judge again,
    # the policy parks and the judge wakes
    assert sim.moves.apply(Move(rollout.id, MoveKind.SWITCH, Role.ROLLOUT, Role.REWARD, 0.0), 0.0)
    assert rollout.role == Role.REWARD and rollout.busy_until == pytest.approx(c.sleep_s + 90.0 + ABORT_S)
    assert rollout.parked and not rollout.parked_judge
    sim.version += 1
    assert sim.moves.apply(Move(rollout.id, MoveKind.SWITCH, Role.REWARD, Role.ROLLOUT, 0.0), 100.0)
    sync = s.training.weight_sync_s
    assert rollout.busy_until == pytest.approx(100.0 + 2.5 + c.wake_s + sync + ABORT_S) and rollout.parked_judge
    assert not rollout.parked and rollout.version == sim.version
    assert sim.moves.apply(Move(rollout.id, MoveKind.SWITCH, Role.ROLLOUT, Role.REWARD, 0.0), 200.0)
    assert rollout.busy_until == pytest.approx(200.0 + c.sleep_s + 4.0 + ABORT_S) and rollout.parked
    # the reward pool's judge serves the policy as a shifted one does: its judge parks, the policy starts cold
    # (none sleeps there) with the newest weights; back, the judge wakes
    assert sim.moves.apply(Move(reward.id, MoveKind.SWITCH, Role.REWARD, Role.ROLLOUT, 0.0), 300.0)
    assert reward.busy_until == pytest.approx(300.0 + 2.5 + c.start_s + ABORT_S) and reward.parked_judge
    assert reward.role == Role.ROLLOUT and not reward.parked and reward.version == sim.version
    assert sim.moves.apply(Move(reward.id, MoveKind.SWITCH, Role.ROLLOUT, Role.REWARD, 0.0), 400.0)
    assert reward.busy_until == pytest.approx(400.0 + c.sleep_s + 4.0 + ABORT_S) and reward.parked
    assert sim.moves.refusals == {}
    # a trainer GPU lent to the judge: cold, then parked asleep on return, then woken
    assert sim.moves.apply(Move(trainer.id, MoveKind.BORROW, Role.TRAIN, Role.REWARD, 0.0), 0.0)
    assert trainer.busy_until == pytest.approx(c.offload_s + 90.0)
    assert sim.moves.apply(Move(trainer.id, MoveKind.RETURN, Role.REWARD, Role.TRAIN, 0.0), 100.0)
    assert trainer.parked_judge and not trainer.parked
    assert trainer.busy_until == pytest.approx(100.0 + 2.5 + c.reload_s + ABORT_S)
    assert sim.moves.apply(Move(trainer.id, MoveKind.BORROW, Role.TRAIN, Role.REWARD, 0.0), 200.0)
    assert trainer.busy_until == pytest.approx(200.0 + c.offload_s + 4.0) and not trainer.parked_judge
    # the policy plans with each engine's own running estimates, as the daemon's: the judge's starts, wakes and
    # sleeps are not the policy's, the trainer's offload and reload are both's
    policy, judge = sim.moves.costs(), sim.moves.judge_costs()
    assert (policy.start_s, policy.stop_s, policy.wake_s, policy.sleep_s) == (c.start_s, c.stop_s, c.wake_s, c.sleep_s)
    assert (judge.start_s, judge.wake_s, judge.sleep_s, judge.stop_s) == (90.0, 4.0, 2.5, 7.0)
    assert judge.offload_s == policy.offload_s == c.offload_s


def test_pivot_shifts_gpus_to_a_judge_that_holds_batches_back_and_beats_the_best_fixed_split(tmp_path):
    from pearlctl.sim.compare import compare

    s = judge_bound(tmp_path)
    r = compare(s, ["static", "disaggregated", "pivot"], workers=1)
    verdicts = s.steps * s.workload.batch_size
    assert all(x.finished and x.judge["verdicts"] == verdicts for x in r.values())  # expected = judged = trained
    assert r["pivot"].samples_per_s > r["disaggregated"].samples_per_s > r["static"].samples_per_s
    assert r["pivot"].transitions > 0 and r["disaggregated"].chosen.endswith("GPUs judging")
    assert r["pivot"].gpu_seconds_by_role["REWARD"] > r["static"].gpu_seconds_by_role["REWARD"]


def test_colocated_time_shares_every_generation_gpu_and_judges_a_batch_once_its_rollouts_are_done(tmp_path):
    """Every rollout and reward GPU serves the policy, then the judge, then the policy: no verdict is judged while a
    trajectory of its batch is still rolling out (the run is synchronous), and each switch costs both models'
    sleep and wake on every GPU."""
    from pearlctl.sim.baselines import TimeShared
    from pearlctl.sim.run import Sim

    s = judge_bound(tmp_path)
    sim = Sim(s, "colocated", None)
    sim.controller = TimeShared(sim)
    r = sim.run()
    assert r.finished and r.judge["verdicts"] == s.steps * s.workload.batch_size
    shared = [g for g in sim.gpus if g.pool in ("rollout", "reward")]
    assert len(shared) == s.cluster.rollout_gpus + s.cluster.reward_gpus
    for lo in range(0, s.steps * s.workload.batch_size, s.workload.batch_size):
        hi = lo + s.workload.batch_size
        assert np.nanmin(sim.judges.judged_at[lo:hi]) > np.nanmax(sim.engine.done_at[lo:hi])
    # each batch: to the judge and back (the last batch: to the judge only), every shared GPU
    assert r.transitions == (2 * s.steps - 1) * len(shared)
    assert r.gpu_seconds_by_role["REWARD"] > 0 and r.gpu_seconds_by_role["TRANSITION"] > 0
    assert r.trainer_delay_s == 0 and r.forced_returns == 0  # the trainer keeps its GPUs


def test_the_oracle_of_a_run_with_a_judge_bounds_every_compared_deployment(tmp_path):
    """It replays pivot's, colocated's and disaggregated's roles at no cost (the judge's included), and judges every
    trajectory once."""
    from pearlctl.sim.compare import compare

    s = judge_bound(tmp_path)
    r = compare(s, ["colocated", "disaggregated", "pivot", "oracle"], workers=1)
    verdicts = s.steps * s.workload.batch_size
    assert all(x.finished and x.judge["verdicts"] == verdicts for x in r.values())
    best = max(r[p].samples_per_s for p in ("colocated", "disaggregated", "pivot"))
    assert r["oracle"].samples_per_s >= best
    assert r["oracle"].oracle_choice.startswith("replay of ")


def test_a_split_schedule_is_renumbered_into_the_scenarios_gpus():
    """The k-th rollout-or-reward GPU of the split is the k-th of the scenario; the trainer's and the elastic GPUs
    (numbered between the rollout and the reward pools) keep theirs."""
    from pearlctl.planner.model import Role
    from pearlctl.sim.baselines import renumbered
    from pearlctl.sim.gpus import Schedule

    c = sc.Cluster(trainer_gpus=2, rollout_gpus=4, elastic_gpus=3, reward_gpus=1, gpus_per_node=8)
    split = replace(c, rollout_gpus=2, reward_gpus=3)  # trainer 0-1, rollout 2-3, elastic 4-6, reward 7-9
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    got = renumbered(Schedule(changes=[(0.0, i, Role.IDLE) for i in ids]), split, c)
    # the scenario: trainer 0-1, rollout 2-5, elastic 6-8, reward 9
    assert [i for _, i, _ in got.changes] == [0, 1, 2, 3, 6, 7, 8, 4, 5, 9]


def test_the_baselines_need_a_judge():
    from pearlctl.sim.compare import SimulationError, compare

    for baseline in ("colocated", "disaggregated"):
        with pytest.raises(SimulationError, match="has no \\[judge\\]"):
            compare(sc.load(REPO / "examples/scenarios/bursty-elastic-8b.toml"), [baseline])


def test_the_cli_compares_with_the_best_fixed_split_and_reports_the_judge():
    import json
    import subprocess
    import sys

    path = REPO / "examples/scenarios/genrm/genrm-same-size-8b.toml"
    argv = [sys.executable, "-m", "pearlctl", "simulate", str(path), "--compare", "disaggregated,pivot", "--steps", "1"]
    proc = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    batch = doc["batch_size"]
    assert all(p["judge"]["verdicts"] == batch and p["finished"] for p in doc["policies"].values())
    assert doc["policies"]["disaggregated"]["chosen"].endswith("of 16 GPUs judging")
    assert set(doc["ratios"]) == {"pivot/disaggregated"}
    table = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert table.returncode == 0 and "judge GPU-h" in table.stdout and "pivot/disaggregated" in table.stdout
    unknown = subprocess.run([*argv[:5], "--policy", "hybrid"], capture_output=True, text=True, cwd=REPO)
    assert unknown.returncode == 2 and "oracle, colocated, disaggregated" in unknown.stderr


_ANY = st.one_of(ANY_VALUE, st.none())  # None: the key left out


@settings(max_examples=150, deadline=None)
@given(key=st.sampled_from(["rubric_tokens", "verdict_tokens", "reward_gpus", "profile"]), value=_ANY)
@example(key="profile", value="\x00")  # no file's path: it once escaped as a ValueError
def test_any_judge_key_loads_as_a_valid_value_or_is_refused_by_name(key, value):
    """The judge's keys, whatever they hold: a scenario that loads has a judge of valid counts; any other is a
    ScenarioError naming the key (no other exception, no judge of negative or fractional tokens)."""
    import tomllib

    text = (REPO / "examples/scenarios/genrm/genrm-same-size-8b.toml").read_text()
    doc = tomllib.loads(text)
    table, path = ("cluster", ("cluster", "reward_gpus")) if key == "reward_gpus" else ("judge", ("judge", key))
    if value is None:
        doc[table].pop(key, None)
    else:
        doc[table][key] = value
    try:
        s = sc.from_dict(doc, base=REPO / "examples/scenarios/genrm")
    except sc.ScenarioError as err:
        assert f"[{path[0]}] {path[1]}" in str(err) or (key == "profile" and "[judge]" in str(err)), str(err)
        return
    j = s.judge
    assert s.cluster.reward_gpus >= 1 and j.rubric_tokens >= 0 and j.verdict_tokens >= 1
    assert all(type(x) is int for x in (s.cluster.reward_gpus, j.rubric_tokens, j.verdict_tokens))
