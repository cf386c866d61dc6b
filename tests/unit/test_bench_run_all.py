"""tests/benchmarks/run_all.py against fake benchmarks (small scripts built on tests/benchmarks/_targets.py, as
the real ones are): a held target exits 0, a target moved past reach exits 1 and is named, a benchmark that
crashes or has only an exit status (the simulator's gate) is judged by it, and the docs flag reaches the script."""

from __future__ import annotations

import argparse
import fcntl
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "benchmarks"))

import run_all  # noqa: E402

from tests.benchmarks import _targets  # noqa: E402

FAKE = f"""
import argparse, sys
sys.path.insert(0, {str(REPO)!r})
from tests.benchmarks import _targets
TARGETS = [_targets.Target("speed_ms", 10.0, "ms", "fast enough"), _targets.Target("errors", 0, "", "none")]
ap = argparse.ArgumentParser()
ap.add_argument("--write-docs", action="store_true")
_targets.add_arguments(ap, TARGETS)
args = ap.parse_args()
targets = _targets.resolve(ap, args, TARGETS)
if args.write_docs:
    print("WROTE DOCS")
sys.exit(_targets.verdict("fake", [(targets["speed_ms"], 4.2), (targets["errors"], 0.0)], check=args.check,
                          summary=args.summary, moved=args.target))
"""


@pytest.fixture
def benches(tmp_path: Path, monkeypatch) -> dict:
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(run_all, "LOCK", str(tmp_path / "engine.lock"))
    monkeypatch.setattr(run_all, "SETTLE_S", 0.0)  # no waiting for a quiet machine (test_settle checks it)
    (tmp_path / "fake.py").write_text(FAKE)
    (tmp_path / "gate.py").write_text("import sys\nprint('GATE: FAILED (1 s)')\nsys.exit(1)\n")
    (tmp_path / "crash.py").write_text("raise RuntimeError('boom')\n")
    return {
        "fake": run_all.Benchmark("fake.py"),
        "gate": run_all.Benchmark("gate.py", targets=False),
        "crash": run_all.Benchmark("crash.py"),
        "locked": run_all.Benchmark("fake.py", lock=True),
    }


def test_held_targets_exit_0_and_the_table_lists_each_target(benches, capsys):
    assert run_all.main(["--check", "--only", "fake", "--no-docs"], benches) == 0
    out = capsys.readouterr().out
    assert "| fake | speed_ms <= 10 ms | 4.2 ms | held |" in out
    assert "| fake | errors <= 0 | 0 | held |" in out
    assert "every target held (fake)" in out
    assert "WROTE DOCS" not in out


def test_a_target_moved_past_reach_exits_1_and_is_named(benches, capsys):
    assert run_all.main(["--check", "--only", "fake", "--target", "fake.speed_ms=1"], benches) == 1
    out = capsys.readouterr().out
    assert "| fake | speed_ms <= 1 ms | 4.2 ms | MISSED |" in out
    assert out.rstrip().endswith("MISSED: fake (speed_ms)")
    assert "WROTE DOCS" not in out  # a moved target writes no docs


def test_without_check_a_miss_is_reported_but_exits_0(benches, capsys):
    assert run_all.main(["--only", "fake", "--target", "fake.speed_ms=1"], benches) == 0
    assert "MISSED: fake (speed_ms)" in capsys.readouterr().out


def test_docs_are_written_unless_no_docs(benches, capsys):
    assert run_all.main(["--check", "--only", "fake"], benches) == 0
    assert "WROTE DOCS" in capsys.readouterr().out
    assert run_all.main(["--check", "--only", "fake", "--no-docs", "gate"], benches) == 0  # another one's docs
    assert "WROTE DOCS" in capsys.readouterr().out
    assert run_all.main(["--check", "--only", "fake", "--no-docs", "fake"], benches) == 0
    assert "WROTE DOCS" not in capsys.readouterr().out


def test_a_gate_judged_by_its_exit_status_and_a_crash_are_misses(benches, capsys):
    assert run_all.main(["--check", "--no-docs"], benches) == 1
    out = capsys.readouterr().out
    assert "| gate | gate (its rules: gate.py) | FAILED (1 s) | MISSED |" in out
    assert "| crash | finishes | exit status 1, no verdict | MISSED |" in out
    assert "MISSED: gate (gate); crash (finishes)" in out


def test_unknown_names_and_targets_are_usage_errors(benches):
    for argv in (
        ["--only", "nope"],
        ["--target", "gate.x=1"],  # the gate has no targets
        ["--target", "fake.speed_ms"],  # no value
        ["--only", "gate", "--target", "fake.speed_ms=1"],  # not run
        ["--no-docs", "nope"],
    ):
        with pytest.raises(SystemExit) as exc:
            run_all.main(argv, benches)
        assert exc.value.code == 2, argv


def test_a_locked_benchmark_waits_for_the_engine_lock_and_its_wall_time_leaves_the_wait_out(benches, capsys):
    with open(run_all.LOCK, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an engine test holds it ...
        threading.Timer(1.5, held.close).start()  # ... and lets go 1.5 s later
        assert run_all.main(["--check", "--only", "locked", "--no-docs"], benches) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| locked | speed_ms"))
    assert row.endswith(" s waiting for the engine lock) |")
    waited = row.split("|")[-2].split(", +")[-1]
    assert int(waited.split()[0]) >= 1


def test_settle_waits_for_the_load_average_to_fall_and_no_longer_than_its_limit():
    clock = [0.0]

    def sleep(s: float) -> None:
        clock[0] += s

    def falling():  # 2.0, 1.5, 1.0, 0.5, ... one step per 5-s sleep
        return (max(2.0 - clock[0] / 10, 0.0), 0.0, 0.0)

    waited, load = run_all.settle(60, 0.5, loadavg=falling, sleep=sleep, clock=lambda: clock[0])
    assert (waited, load) == (15.0, 0.5)
    clock[0] = 0.0
    waited, load = run_all.settle(12, 0.5, loadavg=lambda: (3.0, 0, 0), sleep=sleep, clock=lambda: clock[0])
    assert waited == 15.0 and load == 3.0  # gave up at the first check past its 12 s
    clock[0] = 0.0
    assert run_all.settle(60, 0.5, loadavg=lambda: (0.1, 0, 0), sleep=sleep, clock=lambda: clock[0]) == (0.0, 0.1)


def test_a_benchmarks_help_lists_its_targets_percent_units_included():
    ap = argparse.ArgumentParser()
    _targets.add_arguments(ap, [_targets.Target("error_pct", 15.0, "%", "within 15%")])
    assert "error_pct (<= 15%)" in " ".join(ap.format_help().split())
