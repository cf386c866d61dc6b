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
