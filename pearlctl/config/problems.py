"""What is wrong with a spec: ``SpecProblem`` (one problem, at its key path) and ``SpecError`` (a spec that
cannot be used, with every problem found). The CLI exits 2 on a SpecError (docs/cli.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec: where, and what would be right."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class SpecError(Exception):
    """A spec that cannot be used; carries every problem found."""

    def __init__(self, source: str, problems: list[SpecProblem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid run spec {source}:\n{lines}")
