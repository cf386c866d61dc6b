"""Docs that cannot drift: docs/simulator-results.md is generated (tests/benchmarks/bench_simulate.py
--write-docs) for every shipped scenario at its own step count, with and without the measured model mismatch,
with the command and the commit; the gate (bench_simulate.py --check, tests/unit/test_sim_gate.py) fails when
its numbers no longer hold; and every number docs/simulator.md or the README quotes from it is its own cell.

How a doc quotes a number. Whatever reads as a simulator number — a ratio with ``×`` (``1.52×``, ``1.328×``,
a range ``2.17–2.79×``) or a number with three decimals (``0.956``, ``1.000``) — is followed at once (after a
closing ``**`` if bold) by a citation, an HTML comment the rendered page does not show:

- ``<!-- cell SCENARIO MISMATCH KEY -->``: the ratio KEY (``pearl/static``, ``pearl/oracle``, …; its mean over
  the seeds, or with ``@worst`` its worst seed) of SCENARIO at MISMATCH (``none`` or ``measured``) in the results
  block of docs/simulator-results.md, equal at the precision quoted (``1.328×`` is the cell formatted with three
  decimals). SCENARIO or MISMATCH may be ``*`` (every one), with ``except SCENARIO MISMATCH`` pairs after the key.
  The prose must say it too: the quoted number's sentence names the scenario (``*``: "every scenario") and the
  mismatch ("no mismatch", "measured"; ``*``: "either mismatch"), and its paragraph or bullet names the ratio
  (``KEY_WORDS``);
- ``<!-- const NAME -->``: ``pearlctl.sim.scenario.NAME`` (the measured mismatch's bias and spread);
- ``<!-- published -->``: a published reference, quoted as docs/sources.md quotes it.

A citation with no number before it fails too, so a marker cannot outlive its number."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pearlctl.sim import scenario as sc

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/simulator-results.md"
SOURCES = REPO / "docs/sources.md"
SCENARIOS = sorted((REPO / "examples/scenarios").glob("*.toml"))
QUOTING = [REPO / "docs/simulator.md", REPO / "README.md"]
# what reads as a simulator number: 1.37× or 1.328× (a ratio), 2.17–2.79× (a range), 0.887 or 1.000 (three decimals)
NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+(?:–\d+\.\d+)?×|\d\.\d{3}(?![\d×]))")
CITATION = re.compile(r"(?:\*\*)?<!--\s*(cell|const|published)\b(.*?)-->")  # right after the number
MARKER = re.compile(r"<!--\s*(?:cell|const|published)\b.*?-->")
SENTENCE_END = re.compile(r"[.!?](?=\s)|\n\s*\n|\n- ")
BLOCK_END = re.compile(r"\n\s*\n|\n- ")
MISMATCH_WORDS = {"none": ("no mismatch",), "measured": ("measured",), "*": ("either mismatch", "both mismatches")}
EVERY_SCENARIO = ("every scenario", "each scenario", "all scenarios", "any scenario")
KEY_WORDS = {  # how the prose names a ratio (else: the key itself)
    "pearl/oracle": "oracle",
    "static/oracle": "oracle",
    "elastic/oracle": "oracle",
    "pearl/pearl-uncorrected": "correction",
    "pearl/pearl-no-first-wait": "first wait",
}


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
        assert len(h["seeds"]) >= 3 and h["seeds"][0] == s.seed  # the scenario's own seed and the next ones
        for m in ("none", "measured"):
            for part in ("ratios", "worst"):  # the mean over the seeds, and the worst seed
                assert {"pearl/static", "pearl/elastic", "pearl/oracle"} <= set(h[m][part])
            assert set(h[m]["samples_per_s"]) >= {"static", "elastic", "pearl", "oracle"}


def _around(text: str, start: int, end: int, bound: re.Pattern) -> str:
    """The text around [start, end) up to ``bound`` on either side, citations left out, lines joined."""
    before = [m.end() for m in bound.finditer(text, 0, start)]
    after = bound.search(text, end)
    return " ".join(MARKER.sub("", text[before[-1] if before else 0 : after.start() if after else len(text)]).split())


def _equal(quoted: str, value: float) -> bool:
    digits = quoted.removesuffix("×")
    return f"{value:.{len(digits.split('.')[1])}f}" == digits


def cited(text: str, held: dict, *, consts: object = sc, published: str = "") -> list[str]:
    """What is wrong with the numbers ``text`` quotes (the module doc): [] when each is its own cell."""
    problems: list[str] = []
    used: set[int] = set()
    for m in NUMBER.finditer(text):
        quoted = m.group(1)
        where = f"line {text.count(chr(10), 0, m.start()) + 1}: {quoted}"
        c = CITATION.match(text, m.end())
        if not c:
            problems.append(f"{where} cites no cell: write {quoted}<!-- cell SCENARIO MISMATCH KEY --> (or const, "
                            "published: tests/unit/test_sim_docs.py)")  # fmt: skip
            continue
        used.add(c.start() + c.group(0).index("<!--"))
        kind, args = c.group(1), c.group(2).split()
        if kind == "published":
            if quoted not in published:
                problems.append(f"{where} is cited as published but docs/sources.md does not quote it")
            continue
        if "–" in quoted:
            problems.append(f"{where}: a range can only be a published reference")
            continue
        if kind == "const":
            value = getattr(consts, args[0], None) if len(args) == 1 else None
            if not isinstance(value, float) or not _equal(quoted, value):
                problems.append(f"{where} is not pearlctl.sim.scenario.{' '.join(args)} ({value})")
            continue
        if len(args) < 3 or (len(args) - 3) % 3 or any(a != "except" for a in args[3::3]):
            problems.append(f"{where}: expected <!-- cell SCENARIO MISMATCH KEY [except SCENARIO MISMATCH]... -->")
            continue
        scenario, mismatch, key = args[:3]
        key, _, part = key.partition("@")  # KEY@worst: the ratio's worst seed, else its mean over the seeds
        part = "worst" if part == "worst" else "ratios"
        excepted = {(args[i + 1], args[i + 2]) for i in range(3, len(args), 3)}
        scenarios = sorted(held["scenarios"]) if scenario == "*" else [scenario]
        mismatches = ["none", "measured"] if mismatch == "*" else [mismatch]
        cells = [(s, mm) for s in scenarios for mm in mismatches if (s, mm) not in excepted]
        ratios = {(s, mm): held["scenarios"].get(s, {}).get(mm, {}).get(part, {}) for s, mm in cells}
        missing = [f"{s} {mm}" for (s, mm), r in ratios.items() if key not in r]
        if missing or mismatch not in MISMATCH_WORDS or not cells:
            problems.append(f"{where}: docs/simulator-results.md has no cell {key} at {', '.join(missing) or args}")
            continue
        for s, mm in cells:
            value = held["scenarios"][s][mm][part][key]
            if not _equal(quoted, value):
                problems.append(f"{where} is cited as {s} {mm} {key}, whose cell is {value}")
        sentence = _around(text, m.start(), m.end(), SENTENCE_END)
        block = _around(text, m.start(), m.end(), BLOCK_END)
        named = any(w in sentence for w in EVERY_SCENARIO) if scenario == "*" else scenario in sentence
        if not named:
            problems.append(f"{where}: its sentence does not name {'every scenario' if scenario == '*' else scenario}")
        if not any(w in sentence for w in MISMATCH_WORDS[mismatch]):
            problems.append(f"{where}: its sentence does not say {' or '.join(MISMATCH_WORDS[mismatch])!r}")
        if KEY_WORDS.get(key, key) not in block:
            problems.append(f"{where}: its paragraph does not name the ratio ({KEY_WORDS.get(key, key)!r})")
    for marker in MARKER.finditer(text):
        if marker.start() not in used:
            line = text.count("\n", 0, marker.start()) + 1
            problems.append(f"line {line}: {marker.group(0)} follows no quoted number")
    return problems


def test_every_number_the_docs_quote_is_its_own_cell_of_the_generated_results():
    held, published = _held(), SOURCES.read_text()
    for doc in QUOTING:
        problems = cited(doc.read_text(), held, published=published)
        assert not problems, f"{doc.relative_to(REPO)}:\n" + "\n".join(problems)


KEYS = ("pearl/static", "pearl/oracle", "pearl/pearl-no-first-wait")
HELD = {  # a results block of two scenarios, for the checks below
    "scenarios": {
        "alpha-8b": {
            "none": {"ratios": dict(zip(KEYS, (1.9855, 0.9561, 1.3278), strict=True))},
            "measured": {"ratios": dict(zip(KEYS, (1.9813, 0.9356, 1.0747), strict=True))},
        },
        "beta-30b": {
            "none": {"ratios": dict(zip(KEYS, (2.0111, 0.8811, 1.0737), strict=True))},
            "measured": {"ratios": dict(zip(KEYS, (2.0187, 0.8681, 1.1325), strict=True))},
        },
    }
}


def test_a_number_quoted_from_its_own_cell_passes():
    text = (
        "- **pearl/static**: 1.99×<!-- cell alpha-8b none pearl/static --> in alpha-8b and "
        "2.02×<!-- cell beta-30b measured pearl/static --> in beta-30b at the measured mismatch, with no mismatch "
        "for alpha-8b.\n"
        "- The first wait is worth 1.328×<!-- cell alpha-8b none pearl/pearl-no-first-wait --> in alpha-8b with no "
        "mismatch, where pearl reaches 0.956<!-- cell alpha-8b none pearl/oracle --> of the oracle.\n"
        "- pearl/static is 2.0×<!-- cell * * pearl/static except alpha-8b none except alpha-8b measured --> in every "
        "scenario at either mismatch but alpha-8b; bias **1.334**<!-- const MEASURED_BIAS -->; PEARL "
        "2.17–2.79×<!-- published --> over ROLL.\n"
    )
    assert cited(text, HELD, published="PEARL | 2.17–2.79× vs fixed-resource ROLL") == []


def test_a_number_from_the_wrong_cell_fails():
    # the number is beta-30b's (1.074), the citation and the prose say alpha-8b's measured cell (1.075)
    text = "The first wait is worth 1.074×<!-- cell alpha-8b measured pearl/pearl-no-first-wait --> in alpha-8b " \
           "at the measured mismatch."  # fmt: skip
    assert cited(text, HELD) == [
        "line 1: 1.074× is cited as alpha-8b measured pearl/pearl-no-first-wait, whose cell is 1.0747"
    ]
    # the other mismatch's cell of the right scenario and ratio fails the same way
    assert cited(text.replace("1.074×", "1.328×"), HELD)
    # a three-decimal number is checked at three decimals: 1.33× would pass where 1.327× does not
    wrong = "Worth 1.327×<!-- cell alpha-8b none pearl/pearl-no-first-wait --> in alpha-8b, no mismatch (first wait)."
    assert cited(wrong, HELD) == [
        "line 1: 1.327× is cited as alpha-8b none pearl/pearl-no-first-wait, whose cell is 1.3278"
    ]
    assert cited(wrong.replace("1.327×", "1.33×"), HELD) == []


def test_every_cell_a_wildcard_covers_must_hold():
    text = "pearl/static: 2.01×<!-- cell * * pearl/static except alpha-8b none --> in every scenario, either mismatch."
    assert cited(text, HELD) == [
        "line 1: 2.01× is cited as alpha-8b measured pearl/static, whose cell is 1.9813",
        "line 1: 2.01× is cited as beta-30b measured pearl/static, whose cell is 2.0187",
    ]
    assert cited(text.replace("alpha-8b none", "alpha-8b none except alpha-8b measured"), HELD) == [
        "line 1: 2.01× is cited as beta-30b measured pearl/static, whose cell is 2.0187"
    ]


def test_a_number_without_its_citation_or_whose_prose_names_another_cell_fails():
    assert cited("pearl reaches 0.956 of the oracle in alpha-8b with no mismatch.", HELD)[0].startswith(
        "line 1: 0.956 cites no cell"
    )
    # the citation is right, the prose names another scenario, another mismatch, another ratio
    text = "pearl/static: 1.99×<!-- cell alpha-8b none pearl/static --> in beta-30b at the measured mismatch."
    assert cited(text, HELD) == [
        "line 1: 1.99×: its sentence does not name alpha-8b",
        "line 1: 1.99×: its sentence does not say 'no mismatch'",
    ]
    text = "pearl reaches 0.956<!-- cell alpha-8b none pearl/oracle --> of the static run in alpha-8b with no mismatch."
    assert cited(text, HELD) == ["line 1: 0.956: its paragraph does not name the ratio ('oracle')"]


def test_unknown_cells_constants_unpublished_numbers_and_stray_markers_fail():
    assert cited("x 1.99×<!-- cell gamma none pearl/static --> in gamma with no mismatch", HELD) == [
        "line 1: 1.99×: docs/simulator-results.md has no cell pearl/static at gamma none"
    ]
    assert cited("spread **0.117**<!-- const MEASURED_SPREAD -->", HELD) == [
        f"line 1: 0.117 is not pearlctl.sim.scenario.MEASURED_SPREAD ({sc.MEASURED_SPREAD})"
    ]
    assert cited("PEARL 2.17–2.80×<!-- published -->", HELD, published="PEARL 2.17–2.79×") == [
        "line 1: 2.17–2.80× is cited as published but docs/sources.md does not quote it"
    ]
    assert cited("a sentence <!-- cell alpha-8b none pearl/static --> with no number.", HELD) == [
        "line 1: <!-- cell alpha-8b none pearl/static --> follows no quoted number"
    ]
