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
    assert snapshot.judging == Judging(waiting=5, judging=2, done=13, failed=1, verdicts_per_s=2.0)
    assert snapshot.judging.backlog == 7
    console = Console(width=300, record=True)
    console.print(status_tables(doc))
    assert "judge: waiting 5, judging 2, done 13, failed 1; 2.0 verdicts/s" in console.export_text()
    assert 'pearl_judge_trajectories{state="waiting"} 5.0' in exported
    assert 'pearl_judge_trajectories{state="failed"} 1.0' in exported
    assert "pearl_judge_verdicts_per_second 2.0" in exported
