"""`pearlctl status` names the rollout rate it shows: the tokens between the driver's last two progress reports
over the time between them (the daemon's ``run.rollout.tokens_per_s``), not tokens over the rollout's wall time
(which scripts/demo prints at its end, named so)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.cli.render import status_tables
from pearlctl.daemon.controller import Controller
from pearlctl.state.store import Store
from pearlctl.state.views import run_document
from tests.conftest import FakeClock, running_run


def test_status_shows_the_rate_between_the_last_two_reports_and_says_so(tmp_path: Path):
    clock = FakeClock(1_000_000.0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        running_run(store, tmp_path, pool="rollout", role="ROLLOUT", nodes=1)
        controller = Controller(store, "r", None, clock=clock)
        controller.trainer.rollout_progress(parse(bodies.Progress, {"generating": 4, "tokens": 1_000}))
        clock.now += 100.0  # a long tool wait: no tokens
        controller.trainer.rollout_progress(parse(bodies.Progress, {"generating": 4, "tokens": 1_000}))
        clock.now += 2.0
        controller.trainer.rollout_progress(parse(bodies.Progress, {"generating": 4, "tokens": 1_096}))
        doc = run_document(store, "r")
    assert doc["run"]["rollout"]["tokens_per_s"] == 48.0  # (1,096 - 1,000) / 2 s: the last two reports only
    console = Console(width=300, record=True)
    console.print(status_tables(doc))
    assert "1096 tokens; 48.0 tok/s between the driver's last two reports" in console.export_text()


def test_the_judge_queue_is_kept_shown_exported_and_given_to_the_planner(tmp_path: Path):
    """A driver that scores with a judge reports its queue beside its counts: the daemon keeps it (with the verdicts
    per second between the last two reports), status shows it, /metrics exports it, and the planner's snapshot
    carries it as the judge's demand. A report without it (a driver without a judge) leaves it out of all four."""
    from pearlctl.daemon import metrics
    from pearlctl.daemon.policy_view import PolicyInputs
    from pearlctl.planner.model import Judging

    clock = FakeClock(1_000_000.0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        running_run(store, tmp_path, pool="rollout", role="ROLLOUT", nodes=1)
        controller = Controller(store, "r", None, clock=clock)
        controller.trainer.rollout_progress(parse(bodies.Progress, {"done": 3}))
        assert PolicyInputs(store, "r").snapshot(clock.now).judging == Judging()
        assert b"pearl_judge" not in metrics.render(store, "r")
        judge = {"waiting": 5, "judging": 2, "done": 9, "failed": 1}
        controller.trainer.rollout_progress(parse(bodies.Progress, {"done": 16, "judge": judge}))
        clock.now += 2.0
        controller.trainer.rollout_progress(parse(bodies.Progress, {"done": 16, "judge": {**judge, "done": 13}}))
        doc = run_document(store, "r")
        snapshot = PolicyInputs(store, "r").snapshot(clock.now)
        exported = metrics.render(store, "r").decode()
    assert doc["run"]["rollout"]["judge"] == {**judge, "done": 13} and doc["run"]["rollout"]["verdicts_per_s"] == 2.0
    bodies.parse(bodies.Progress, {k: doc["run"]["rollout"][k] for k in ("done", "judge")})  # stored as it was sent
    # no judge worker serves in this run: the rate is not the judges' capacity (busy needs every GPU judging busy)
    assert snapshot.judging == Judging(waiting=5, judging=2, done=13, failed=1, verdicts_per_s=2.0, busy=False)
    assert snapshot.judging.backlog == 7
    console = Console(width=300, record=True)
    console.print(status_tables(doc))
    assert "judge: waiting 5, judging 2, done 13, failed 1; 2.0 verdicts/s" in console.export_text()
    assert 'pearl_judge_trajectories{state="waiting"} 5.0' in exported
    assert 'pearl_judge_trajectories{state="failed"} 1.0' in exported
    assert "pearl_judge_verdicts_per_second 2.0" in exported


def test_the_judges_rate_is_their_capacity_only_when_every_gpu_judging_had_work_at_three_reports_in_a_row(
    tmp_path: Path,
):
    """``busy``: every GPU judging (READY reward workers' GPUs) had work — verdicts waiting, or one in flight per GPU
    — at both reports the rate is from and at the one before (``JUDGE_BUSY_REPORTS``: the first window after they
    filled up counts only the verdicts begun before it); ``capacity_per_judge_s``: the most a busy rate showed per
    GPU judging, kept while the judges run dry (between batches)."""
    from pearlctl.daemon.policy_view import PolicyInputs

    clock = FakeClock(1_000_000.0)
    with Store.open(tmp_path / "s.db", clock=clock) as store:
        running_run(store, tmp_path, pool="reward", role="REWARD", nodes=2)
        for a in store.fleet.allocations("r"):  # two judges, one GPU each, serving
            wid = store.fleet.add_worker(run_id="r", allocation_id=a.id, role="REWARD", engine="vllm", url=None)
            store.update_fields("workers", wid, gpu_idx=[0])
            store.set_state("workers", wid, expect="STARTING", to="READY", event="t")
        trainer = Controller(store, "r", None, clock=clock).trainer

        def report(waiting: int, judging: int, done: int) -> object:
            clock.now += 5.0
            q = {"waiting": waiting, "judging": judging, "done": done, "failed": 0}
            trainer.rollout_progress(parse(bodies.Progress, {"done": 0, "judge": q}))
            return PolicyInputs(store, "r").snapshot(clock.now).judging

        report(0, 1, 0)  # one verdict in flight on two judges: one is idle
        first = report(0, 2, 5)  # both busy now, but not at the report before
        assert first.verdicts_per_s == 1.0 and not first.busy and first.capacity_per_judge_s == 0.0
        filling = report(30, 2, 15)  # busy at both reports, not at the one before: the judges were filling up
        assert filling.verdicts_per_s == 2.0 and not filling.busy and filling.capacity_per_judge_s == 0.0
        busy = report(30, 2, 35)  # busy at three reports in a row: 20 verdicts in 5 s over 2 GPUs
        assert busy.busy and busy.verdicts_per_s == 4.0 and busy.capacity_per_judge_s == 2.0
        dry = report(0, 0, 40)  # the queue ran dry: the rate is not the capacity, which is kept
        assert not dry.busy and dry.verdicts_per_s == 1.0 and dry.capacity_per_judge_s == 2.0
