"""The house rule on size: no module in pearlctl/ over 600 lines, no function over 80 lines, no class over 25
methods, unless the offender's own docstring (the module's, the function's or the class's) has a line starting
``Size:`` that says why.

Sizes as ``ast`` gives them: a module's lines are its newlines; a function's, ``end_lineno - lineno + 1`` from its
``def`` (decorators not counted); a class's methods, the functions directly in its body.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pearlctl"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CLASS_METHODS = 25
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def excused(node: ast.AST) -> bool:
    """The node's own docstring has a line starting ``Size:`` (saying why it is as large as it is)."""
    doc = ast.get_docstring(node) or ""
    return any(line.strip().startswith("Size:") for line in doc.splitlines())


def oversized(sources: Iterable[tuple[str, str]]) -> list[str]:
    """Every module, function and class over the house limits in ``sources`` (path, source text) and not excused,
    each named with its size."""
    found = []
    for path, source in sources:
        tree = ast.parse(source, filename=path)
        lines = source.count("\n")
        if lines > MAX_MODULE_LINES and not excused(tree):
            found.append(f"{path}: module of {lines} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, _FUNCTIONS):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES and not excused(node):
                    found.append(
                        f"{path}:{node.lineno}: function {node.name} of {size} lines (limit {MAX_FUNCTION_LINES})"
                    )
            elif isinstance(node, ast.ClassDef):
                methods = sum(isinstance(x, _FUNCTIONS) for x in node.body)
                if methods > MAX_CLASS_METHODS and not excused(node):
                    found.append(
                        f"{path}:{node.lineno}: class {node.name} of {methods} methods (limit {MAX_CLASS_METHODS})"
                    )
    return found


def package_sources() -> list[tuple[str, str]]:
    return [
        (str(p.relative_to(REPO)), p.read_text()) for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
    ]


def test_nothing_in_pearlctl_is_over_the_house_limits() -> None:
    sources = package_sources()
    assert len(sources) > 50  # the walk found the package
    found = oversized(sources)
    assert not found, "over the house size limits (split it, or say why in a 'Size:' line of its docstring):\n" + (
        "\n".join(found)
    )


def _function(name: str, body_lines: int, doc: str = "") -> str:
    head = f"def {name}():\n" + (f'    """{doc}"""\n' if doc else "")
    return head + "".join(f"    x{i} = {i}\n" for i in range(body_lines))


def test_the_check_names_each_offender_and_its_size_and_takes_a_size_line_as_the_reason() -> None:
    long = _function("long", 80)  # 81 lines with its def
    fits = _function("fits", 79)  # 80: at the limit
    why = _function("why", 90, doc="Big on purpose.\n\n    Size: one table, kept whole to read at once.\n    ")
    wide = "class Wide:\n" + "".join(f"    def m{i}(self):\n        pass\n" for i in range(26))
    wide_at = (long + fits + why).count("\n") + 1
    assert oversized([("a.py", long + fits + why + wide)]) == [
        "a.py:1: function long of 81 lines (limit 80)",
        f"a.py:{wide_at}: class Wide of 26 methods (limit 25)",
    ]
    module = "".join(f"y{i} = {i}\n" for i in range(601))
    assert oversized([("m.py", module)]) == ["m.py: module of 601 lines (limit 600)"]
    assert oversized([("m.py", '"""Generated.\n\nSize: a generated table."""\n' + module)]) == []
    assert oversized([("m.py", module[: module.index("y600")])]) == []  # 600 lines: at the limit
