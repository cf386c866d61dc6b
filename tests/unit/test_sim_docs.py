"""Docs that cannot drift: docs/simulator-results.md is generated (tests/benchmarks/bench_simulate.py
--write-docs) for every shipped scenario at its own step count, with and without the measured model mismatch,
with the command and the commit; the gate (bench_simulate.py --check, tests/unit/test_sim_gate.py) fails when
its numbers no longer hold; and every ratio docs/simulator.md or the README quotes is one of its numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pearlctl.sim import scenario as sc

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/simulator-results.md"
SCENARIOS = sorted((REPO / "examples/scenarios").glob("*.toml"))
QUOTING = [REPO / "docs/simulator.md", REPO / "README.md"]
# what reads as a simulator ratio: 1.37× (pearl/static, pearl/elastic) or 0.887 (X/oracle)
RATIO = re.compile(r"(?<![\d.])(\d+\.\d\d×|0\.\d{3})(?![\d])")


def _held() -> dict:
    m = re.search(r"<!-- results\n(.*?)\n-->", RESULTS.read_text(), re.S)
    assert m, f"{RESULTS} has no results block: run tests/benchmarks/bench_simulate.py --write-docs"
    return json.loads(m.group(1))


def test_the_results_hold_every_shipped_scenario_at_its_own_length_with_and_without_mismatch():
    held = _held()
    assert "bench_simulate.py --write-docs" in held["command"] and held["commit"] != "unknown"
    text = RESULTS.read_text()
    assert f"`{held['command']}`" in text and f"at commit {held['commit']}" in text
    for path in SCENARIOS:
        s = sc.load(path)
        h = held["scenarios"][s.name]
        assert h["steps"] == s.steps
        for m in ("none", "measured"):
            variants = {"pearl-uncorrected", "pearl-no-first-wait"}
            assert {"pearl/static", "pearl/elastic", "pearl/oracle"} | {f"pearl/{v}" for v in variants} <= set(
                h[m]["ratios"]
            )
            assert set(h[m]["samples_per_s"]) >= {"static", "elastic", "pearl", "oracle"} | variants


def test_every_ratio_the_docs_quote_comes_from_the_generated_results():
    results = RESULTS.read_text()
    for doc in QUOTING:
        for quoted in RATIO.findall(doc.read_text()):
            assert quoted in results, f"{doc.relative_to(REPO)} quotes {quoted}, which docs/simulator-results.md lacks"
