"""What every benchmark's ``--check`` shares: named targets, moving one (``--target NAME=VALUE``), the verdict
printed one line per target, a summary file for tests/benchmarks/run_all.py, and a generated block in a doc.

A benchmark defines its targets as named constants with their reason, builds ``Target``s from them, and at the
end calls ``verdict``: each target's measured value against its limit, ``held`` or ``MISSED`` with a one-line
reason; with ``--check`` the exit status is 1 on any miss. ``--target NAME=VALUE`` moves a target (to show that
``--check`` fails when one is out of reach: docs/benchmarks.md, "All benchmarks at once").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Target:
    name: str  # what --target NAME=VALUE moves
    limit: float
    unit: str  # printed after the numbers ("ms", "%", "s", "" for a count or a ratio)
    why: str  # the reason or the citation
    at_least: bool = False  # the measured value must be >= limit (else <= limit)

    def holds(self, measured: float) -> bool:
        if math.isnan(measured):
            return False
        return measured >= self.limit if self.at_least else measured <= self.limit

    def describe(self) -> str:
        return f"{'>=' if self.at_least else '<='} {_num(self.limit)}{_unit(self.unit)}"


def summary_line(results: list[tuple[Target, float]]) -> str:
    """The targets in one line for a doc: ``name <= limit: measured, held; …``."""
    return "; ".join(
        f"{t.name} {t.describe()}: {_num(v)}{_unit(t.unit)}, {'held' if t.holds(v) else 'MISSED'}" for t, v in results
    )


def _num(x: float) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _unit(unit: str) -> str:
    return "" if not unit else unit if unit == "%" else f" {unit}"


def add_arguments(ap: argparse.ArgumentParser, targets: list[Target]) -> None:
    names = ", ".join(f"{t.name} ({t.describe()})" for t in targets)
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"move a target (repeatable), e.g. to show --check failing; the targets: {names}".replace("%", "%%"),
    )
    ap.add_argument("--summary", metavar="FILE", help="write the targets and the measured values there (JSON)")


def resolve(ap: argparse.ArgumentParser, args: argparse.Namespace, targets: list[Target]) -> dict[str, Target]:
    """The targets by name, with ``--target`` overrides applied (an unknown name is a usage error)."""
    out = {t.name: t for t in targets}
    for item in args.target:
        name, sep, value = item.partition("=")
        if not sep or name not in out:
            ap.error(f"--target {item!r}: expected NAME=VALUE with NAME one of {', '.join(out)}")
        try:
            out[name] = replace(out[name], limit=float(value))
        except ValueError:
            ap.error(f"--target {item!r}: {value!r} is not a number")
    return out


def verdict(
    benchmark: str,
    results: list[tuple[Target, float]],
    *,
    check: bool,
    summary: str | None,
    moved: list[str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Print one line per target (to ``out``, stdout by default), write the summary file, and return the exit
    status (1: ``check`` and a miss)."""
    out = out or sys.stdout
    rows = []
    print(file=out)
    for target, measured in results:
        held = target.holds(measured)
        line = (
            f"target {target.name}: {_num(measured)}{_unit(target.unit)}, target {target.describe()} — "
            f"{'held' if held else 'MISSED'}"
        )
        print(line + ("" if held else f" ({target.why})"), file=out)
        rows.append(
            {
                "name": target.name,
                "limit": target.limit,
                "at_least": target.at_least,
                "unit": target.unit,
                "measured": None if math.isnan(measured) else measured,
                "held": held,
                "why": target.why,
            }
        )
    missed = [r["name"] for r in rows if not r["held"]]
    print(f"{benchmark}: {'every target held' if not missed else 'MISSED ' + ', '.join(missed)}", file=out)
    if summary:
        Path(summary).write_text(json.dumps({"benchmark": benchmark, "targets": rows, "moved": moved or []}))
    return 1 if check and missed else 0


def commit(exclude: Path | None = None) -> str:
    """The commit the numbers were measured at, and whether tracked files differed from it (``exclude``: a file
    the benchmark itself rewrites, which does not count)."""
    skip = [f":!{exclude.relative_to(REPO)}"] if exclude is not None else []
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *skip],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def stamp() -> str:
    """When, at which commit and on what machine a result was measured (one line for a doc)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{when} at {commit()}, {os.cpu_count()} cores, load average {load:.2f} at the end"


def write_block(doc: Path, name: str, body: str) -> None:
    """Replace what lies between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in ``doc`` with ``body``."""
    text = doc.read_text()
    begin, end = f"<!-- {name} -->\n", f"<!-- /{name} -->"
    head, sep, rest = text.partition(begin)
    old, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(f"{doc} has no {begin.strip()} … {end} block to write")
    doc.write_text(head + begin + body.rstrip("\n") + "\n" + end + tail)
