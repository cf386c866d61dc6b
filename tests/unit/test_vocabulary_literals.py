"""Roles and pool kinds are spelled in one place: pearlctl/vocabulary.py. A new role or pool (a generative reward
model, say) is added there and every layer sees it, which holds only while no other code spells their values
as string literals (``g.pool == "trainer"``, ``role="ROLLOUT"``): it uses ``PoolKind.TRAINER``, ``Role.ROLLOUT``
or a vocabulary tuple (``GENERATION_POOLS``, ``GENERATION_ROLES``, ...) instead; nor does it list them by hand
(``(Role.PREFILL, Role.DECODE)``): a group of roles or pools is named in the vocabulary and used
(`test_no_module_but_the_vocabulary_spells_out_a_list_of_roles_or_pools`).

The scan: every string constant in pearlctl/ (the shipped policies included; vocabulary.py aside) equal to a
``PoolKind`` or ``Role`` value, outside docstrings and the text of f-strings (comments are not in the AST). A
literal that is not about a pool or role at all (a column name, a policy's name) is in ``ALLOWED``, keyed by path
and value (never a line number, so edits elsewhere in the file keep it), with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pearlctl.vocabulary import PoolKind, Role

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("pearlctl",)
VOCABULARY = "pearlctl/vocabulary.py"
VALUES = frozenset(v.value for v in PoolKind) | frozenset(v.value for v in Role)

# (path, value) -> why that file's literal of that value is not a pool or role
ALLOWED: dict[tuple[str, str], str] = {
    ("pearlctl/state/schema.py", "trainer"): "TRAINER_REPORT: the runs table's column of the trainer's report",
    ("pearlctl/state/schema.py", "rollout"): "ROLLOUT_PROGRESS: the runs table's column of the driver's progress",
    ("pearlctl/daemon/main.py", "elastic"): "the status document's elastic section (a `status --json` field)",
    ("pearlctl/cli/render.py", "elastic"): "the status document's elastic section (a `status --json` field)",
    ("pearlctl/cli/status.py", "elastic"): "the status document's elastic section (a `status --json` field)",
    ("pearlctl/policies/shipped/elastic.py", "elastic"): "the policy's NAME, not a pool",
}


def literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``source`` equal to a pool kind's or role's value, outside
    docstrings and f-string text."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        ):
            skip.add(id(node.body[0].value))  # a docstring
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # f-string text (its {expressions} are scanned)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES
        if id(node) not in skip
    )


def _hits() -> list[tuple[str, int, str]]:
    out = []
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel != VOCABULARY:
                out += [(rel, line, value) for line, value in literals(path.read_text())]
    return out


def test_no_role_or_pool_literal_outside_the_vocabulary():
    hits = _hits()
    bad = [f"{path}:{line} {value}" for path, line, value in hits if (path, value) not in ALLOWED]
    assert not bad, (
        "role or pool values spelled as string literals (use pearlctl.vocabulary's PoolKind / Role members or its "
        "tuples; a literal that is not about a pool or role goes in ALLOWED with the reason):\n" + "\n".join(bad)
    )
    stale = sorted(set(ALLOWED) - {(path, value) for path, _, value in hits})
    assert not stale, f"ALLOWED entries that match no literal any more: {stale}"


def test_the_scan_catches_a_new_literal():
    source = '''"""A docstring that says trainer and ROLLOUT is not code."""


def f(x):
    """elastic"""
    label = f"pool elastic: {x.pool}"
    if x.pool == "elastic":
        return {"trainer": x, "role": "ROLLOUT"}, label
'''
    assert literals(source) == [(7, "elastic"), (8, "ROLLOUT"), (8, "trainer")]
    # the same values in docstrings and f-string text only: nothing
    assert literals('"""trainer"""\nlabel = f"ROLLOUT {x}"\n') == []


# -- and no list of them spelled out by hand (members or literals): a group is named in the vocabulary -------------
WORDS = VALUES
ENUMS = {"Role", "PoolKind"}


def _member(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in ENUMS
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in WORDS


def literal_lists(source: str) -> list[tuple[int, str]]:
    """(line, the literal) of every collection literal in ``source`` that spells out two or more roles or pools and
    nothing else (a starred group may join them)."""
    tree = ast.parse(source)
    naming = set()  # the right-hand tuples of ``a, b = X, Y``: several names given at once
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            if any(isinstance(t, ast.Tuple) and len(t.elts) == len(node.value.elts) for t in node.targets):
                naming.add(id(node.value))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Tuple | ast.List | ast.Set) or id(node) in naming:
            continue
        members = [e for e in node.elts if not isinstance(e, ast.Starred)]
        if len(members) >= 2 and all(_member(e) for e in members):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_but_the_vocabulary_spells_out_a_list_of_roles_or_pools() -> None:
    """A tuple, list or set that spells out two or more roles or pool kinds (``(Role.PREFILL, Role.DECODE)``,
    ``[PoolKind.ROLLOUT, PoolKind.ELASTIC]``) is a list a new role would have to be added to by hand: the group is
    named in the vocabulary (``GENERATION_ROLES``, ``PD_ROLES``, ``RESTING_ROLES``, ``SERVED_ROLES``,
    ``GENERATION_POOLS``, ...) and used. Naming several single constants at once (``a, b = X, Y``) is not a list."""
    found = [
        f"{path.relative_to(REPO).as_posix()}:{line}: {text}"
        for root in SCANNED
        for path in sorted((REPO / root).rglob("*.py"))
        if path.relative_to(REPO).as_posix() != VOCABULARY
        for line, text in literal_lists(path.read_text())
    ]
    assert found == [], "roles or pools listed by hand (name the group in pearlctl/vocabulary.py):\n" + "\n".join(found)


def test_the_check_finds_a_list_written_by_hand_and_lets_groups_and_single_names_pass() -> None:
    assert [t for _, t in literal_lists("x = (Role.PREFILL, Role.DECODE)\n")] == ["(Role.PREFILL, Role.DECODE)"]
    assert literal_lists("ok = role in {'ROLLOUT', 'REWARD'}\n") == [(1, "{'ROLLOUT', 'REWARD'}")]
    assert literal_lists("y = [PoolKind.ROLLOUT, *more, PoolKind.ELASTIC]\n") != []
    assert literal_lists("z = (*PD_ROLES, Role.REWARD)\n") == []  # a group and one more: named, not listed
    assert literal_lists("a, b = PoolKind.ROLLOUT, PoolKind.ELASTIC\n") == []
    assert literal_lists("w = ('ROLLOUT', 3)\n") == []
