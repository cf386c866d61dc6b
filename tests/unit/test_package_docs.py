"""Every package's docstring lists its modules: a newcomer reads a package's ``__init__`` and finds each module
and subpackage named once, with what it is for, and nothing that is not there.

The list is the docstring's lines that begin ``- ``name``: a name there that is no module fails, and so does a
module (or subpackage) the list leaves out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pearlctl"
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py") if "__pycache__" not in p.parts)
_ITEM = re.compile(r"^\s*- ``([A-Za-z_][A-Za-z0-9_]*)``", re.M)


def listed(docstring: str) -> list[str]:
    """The names a package docstring's list gives (lines beginning ``- ``name``)."""
    return _ITEM.findall(docstring)


def members(package: Path) -> set[str]:
    """The package's modules and subpackages, by name."""
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    return modules | subpackages


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_package_docstring_lists_exactly_its_modules(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    names = listed(doc)
    assert len(names) == len(set(names)), f"{package.name}: a module listed twice: {names}"
    have = members(package)
    assert not set(names) - have, f"{package}: the docstring lists what is not there: {sorted(set(names) - have)}"
    assert not have - set(names), f"{package}: the docstring does not list {sorted(have - set(names))}"


def test_the_list_is_read_from_its_own_lines_only() -> None:
    doc = "Intro naming ``store`` in prose.\n\n- ``db``: opening it;\n  - ``machines``: the enums\n"
    assert listed(doc) == ["db", "machines"]
    assert members(ROOT / "state") >= {"db", "machines", "store"}
