"""Every value in a shipped scenario says where it comes from.

The rule, for every ``key = value`` line of every examples/scenarios/**/*.toml (every table but ``[sources]``, in
``[scenario]`` every key but ``name``, ``description`` and ``profile``, and in ``[judge]`` every key but
``profile``): the key's *mark* — the comment on its own line (and on the continuation lines of a multi-line
value) together with the comment block directly above it (the contiguous ``#`` lines right before the key, no
blank line between) — must hold at least one of

- a citation of docs/sources.md: a bracketed section id such as ``[4a]``, ``[5]`` or ``[4a, 5]``;
- ``ASSUMPTION`` followed by at least two words saying what is assumed and why;
- ``DERIVED`` followed by at least two words (the arithmetic, or what the value follows from).

Every bracketed section id anywhere in a scenario's comments must be a ``##``/``###`` heading of docs/sources.md
(``## 4. …`` is ``[4]``, ``### 4a. …`` is ``[4a]``). ``EMPTY`` (the cited section has no number) never marks a
value on its own: a mark that says EMPTY must also say ASSUMPTION or DERIVED — what was used instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "examples/scenarios").rglob("*.toml"))  # the GenRM ones in genrm/ too
SOURCES = REPO / "docs/sources.md"

EXEMPT = {("scenario", "name"), ("scenario", "description"), ("scenario", "profile"), ("judge", "profile")}
EXEMPT_TABLES = {"sources"}
HEADING = re.compile(r"^#{2,3}\s+(\d+[a-z]?)\.\s", re.M)
CITATION = re.compile(r"\[(\d+[a-z]?(?:\s*,\s*\d+[a-z]?)*)\]")
MARKER = re.compile(r"\b(ASSUMPTION|DERIVED)\b\W*\w+\W+\w+")
TABLE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.-]+)\s*\]\s*$")
KEY = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*=")


def sections(text: str | None = None) -> set[str]:
    """The section ids docs/sources.md has headings for."""
    return set(HEADING.findall(SOURCES.read_text() if text is None else text))


def _split(line: str) -> tuple[str, str]:
    """(code, comment) of a TOML line: the comment starts at the first ``#`` outside a string."""
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[:i], line[i + 1 :]
        i += 1
    return line, ""


def _depth(code: str) -> int:
    """How many brackets/braces a line's code leaves open (strings ignored)."""
    depth, quote = 0, None
    for c in code:
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
    return depth


def problems(text: str, known: set[str]) -> list[str]:
    """Every way a scenario's text breaks the rule (module docstring); empty when it keeps it."""
    out: list[str] = []
    lines = text.splitlines()
    table = ""
    block: list[str] = []  # the comment lines directly above the current line
    i = 0
    while i < len(lines):
        raw = lines[i]
        code, comment = _split(raw)
        for ref in CITATION.findall(comment):
            for sec in re.split(r"\s*,\s*", ref):
                if sec not in known:
                    out.append(f"line {i + 1}: cites [{sec}], which docs/sources.md has no section for")
        if not code.strip():
            # a comment line joins the block above the next key; a blank line ends it
            block = [*block, comment] if raw.strip() else []
            i += 1
            continue
        m = TABLE.match(code)
        if m:
            table, block = m.group(1), []
            i += 1
            continue
        k = KEY.match(code)
        if not k:
            out.append(f"line {i + 1}: not a key = value line: {raw.strip()!r}")
            block = []
            i += 1
            continue
        key, start = k.group(1), i
        own = [comment]
        depth = _depth(code)
        while depth > 0 and i + 1 < len(lines):  # a value over several lines: its comments are its own
            i += 1
            c2, m2 = _split(lines[i])
            for ref in CITATION.findall(m2):
                for sec in re.split(r"\s*,\s*", ref):
                    if sec not in known:
                        out.append(f"line {i + 1}: cites [{sec}], which docs/sources.md has no section for")
            own.append(m2)
            depth += _depth(c2)
        if table not in EXEMPT_TABLES and (table, key) not in EXEMPT:
            mark = " ".join(block + own)
            cited = any(sec in known for ref in CITATION.findall(mark) for sec in re.split(r"\s*,\s*", ref))
            marked = MARKER.search(mark) is not None
            where = f"line {start + 1} [{table}] {key}"
            if not (cited or marked):
                out.append(f"{where}: no citation of docs/sources.md, no ASSUMPTION and no DERIVED")
            elif "EMPTY" in mark and not marked:
                out.append(f"{where}: EMPTY says the source has no number; say what was used (ASSUMPTION/DERIVED)")
        block = []
        i += 1
    return out


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_value_of_a_shipped_scenario_is_cited_or_marked(path):
    assert problems(path.read_text(), sections()) == []


def test_the_sections_the_scenarios_cite_are_headings_of_docs_sources():
    known = sections()
    assert {"0", "1a", "3d", "4", "4a", "4b", "5", "6", "7"} <= known
    assert "4z" not in known


GOOD = """\
# a scenario (this comment is no key's)

[scenario]
name = "x"
description = "y"
profile = "p.toml"
steps = 3                  # ASSUMPTION: a few steps, cheap to run

[cluster]
# one 8-GPU node [4a]
trainer_gpus = 8
rollout_gpus = 8           # [4a, 5]
elastic_gpus = 0           # DERIVED: no pool, see above

[availability]
events = [
    {at_s = 0.0, grant = 8},   # ASSUMPTION: a node at launch
]

[training]
# Step time is EMPTY [5]. DERIVED: 1e17 FLOP at 40% MFU
train_step_s = 60.0

[sources]
steps = "anything"
"""


def test_the_checker_passes_a_scenario_that_keeps_the_rule():
    assert problems(GOOD, sections()) == []


@pytest.mark.parametrize(
    "edit, message",
    [
        # an unmarked key
        (("rollout_gpus = 8           # [4a, 5]", "rollout_gpus = 8"), "[cluster] rollout_gpus: no citation"),
        # a comment that is not a citation or a marker does not mark
        (("rollout_gpus = 8           # [4a, 5]", "rollout_gpus = 8  # a node"), "[cluster] rollout_gpus: no citation"),
        # a section docs/sources.md does not have
        (("rollout_gpus = 8           # [4a, 5]", "rollout_gpus = 8  # [4z]"), "cites [4z], which docs/sources.md"),
        # a marker word with no reason
        (("steps = 3                  # ASSUMPTION: a few steps, cheap to run", "steps = 3  # ASSUMPTION"), "steps"),
        # a comment block separated by a blank line is not the key's
        (("# one 8-GPU node [4a]\ntrainer_gpus = 8", "# one 8-GPU node [4a]\n\ntrainer_gpus = 8"), "trainer_gpus"),
        # a block above one key does not mark the key after it
        (("elastic_gpus = 0           # DERIVED: no pool, see above", "elastic_gpus = 0"), "elastic_gpus"),
        # EMPTY with a citation but nothing used instead
        (
            ("# Step time is EMPTY [5]. DERIVED: 1e17 FLOP at 40% MFU", "# Step time is EMPTY [5]."),
            "[training] train_step_s: EMPTY says the source has no number",
        ),
        # the continuation of a multi-line value is checked for citations too
        (("# ASSUMPTION: a node at launch", "# ASSUMPTION: a node at launch [9]"), "cites [9]"),
        # [scenario] keys other than name, description and profile need marks
        (("steps = 3                  # ASSUMPTION: a few steps, cheap to run", "steps = 3"), "[scenario] steps"),
    ],
)
def test_the_checker_fails_a_scenario_that_breaks_the_rule(edit, message):
    old, new = edit
    assert old in GOOD
    found = problems(GOOD.replace(old, new), sections())
    assert any(message in p for p in found), found
