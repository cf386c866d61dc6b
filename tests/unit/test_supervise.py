"""The daemon's supervisor (pearlctl.daemon.supervise) with real child processes and a recorded sleep: a
crash is restarted after a back-off that doubles, a lease conflict (exit 5) is a stand-by, not a crash,
and a clean exit ends the supervisor."""

from __future__ import annotations

import sys

from pearlctl.daemon.supervise import BACKOFF_MIN_S, STANDBY_S, supervise


def child(tmp_path, exits: list[int]) -> list[str]:
    """A child that exits with the next code of ``exits`` each time it runs (its runs counted in a file)."""
    counter = tmp_path / "runs"
    code = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = int(p.read_text()) if p.exists() else 0; "
        f"p.write_text(str(n + 1)); sys.exit({exits!r}[n])"
    )
    return [sys.executable, "-c", code, str(counter)]


def test_crashes_are_restarted_with_a_doubling_back_off_until_a_clean_exit(tmp_path):
    slept: list[float] = []
    assert supervise(child(tmp_path, [1, -9 % 256, 1, 0]), sleep=slept.append) == 0
    assert (tmp_path / "runs").read_text() == "4"
    assert slept == [BACKOFF_MIN_S, 2 * BACKOFF_MIN_S, 4 * BACKOFF_MIN_S]


def test_a_lease_held_elsewhere_is_a_stand_by_and_resets_the_back_off(tmp_path):
    slept: list[float] = []
    assert supervise(child(tmp_path, [1, 5, 1, 0]), sleep=slept.append) == 0
    assert slept == [BACKOFF_MIN_S, STANDBY_S, BACKOFF_MIN_S]
