"""The simulator's gate, as CI runs it: every shipped scenario at its own step count, with and without the
measured model mismatch, on three seeds, with no hint (tests/benchmarks/bench_simulate.py --check): pearl within
0.90 of the oracle over the seeds and 0.85 on its worst, never below static or elastic, nothing above the oracle,
every run trains all its steps — but for the misses the benchmark lists as open, with their reasons — and
docs/simulator-results.md still holds the numbers. Takes minutes (its CPU time is printed and documented in
docs/simulator-results.md): deselect with ``-m "not gate"`` while iterating."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gate
@pytest.mark.timeout(3600)
def test_the_simulator_gate_passes():
    # beside the engine tests (an xdist worker, tests/conftest.py) one process, so that it takes one core at most
    jobs = ["--jobs", "1"] if os.environ.get("PYTEST_XDIST_WORKER") else []
    proc = subprocess.run(
        [sys.executable, "tests/benchmarks/bench_simulate.py", "--check", *jobs],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3500,
    )
    gate = [line for line in proc.stdout.splitlines() if line.startswith("GATE:")]
    assert proc.returncode == 0, "\n".join(gate) or proc.stderr[-3000:]
    assert gate and gate[-1].startswith("GATE: passed")
