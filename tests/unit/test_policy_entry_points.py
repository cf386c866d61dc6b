"""Third-party policies through the ``pearlctl.policies`` entry-point group (pearlctl.policies): a real
distribution's metadata (a dist-info folder with an entry_points.txt) on sys.path, as ``pip install`` of a
package that declares ``[project.entry-points."pearlctl.policies"]`` leaves it. Loaded by name; a name is never
a path; precedence ``$PEARL_POLICY_PATH`` folders, then entry points, then the shipped policies."""

from __future__ import annotations

import textwrap

import pytest

from pearlctl import policies
from pearlctl.ops import doctor
from pearlctl.policies import PolicyError, load_policy

ENTRY_POINTS = """\
[pearlctl.policies]
tpgood = tp_good
tpobject = tp_good:POLICY
tpbad = tp_bad
tpbroken = tp_missing_module
static = tp_good
../evil = tp_good
"""


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """A distribution ``tp-policies`` installed in a site folder of its own: modules tp_good (decide, and an
    object POLICY with decide) and tp_bad (no decide)."""
    site = tmp_path / "site"
    (site / "tp_policies-1.0.dist-info").mkdir(parents=True)
    (site / "tp_policies-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tp-policies\nVersion: 1.0\n"
    )
    (site / "tp_policies-1.0.dist-info" / "entry_points.txt").write_text(ENTRY_POINTS)
    (site / "tp_good.py").write_text(
        textwrap.dedent(
            """
            def decide(snapshot):
                return None

            class _Policy:
                def decide(self, snapshot):
                    return None

            POLICY = _Policy()
            """
        )
    )
    (site / "tp_bad.py").write_text("def plan(snapshot):\n    return None\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("PEARL_POLICY_PATH", raising=False)
    monkeypatch.setattr(policies, "_loaded", {})  # each test loads afresh
    return site


def test_a_third_party_policy_loads_by_its_entry_point_name(third_party):
    module = load_policy("tpgood")
    assert module.__name__ == "tp_good" and module.__file__ == str(third_party / "tp_good.py")
    assert module.decide(None) is None
    obj = load_policy("tpobject")  # an object with decide, not a module
    assert type(obj).__name__ == "_Policy" and obj.decide(None) is None
    assert load_policy("tpgood") is module  # once per process
    known = policies.known_policies()
    assert {"tpgood", "tpobject", "tpbad", "tpbroken"} <= set(known)
    assert {"never", "greedy", "static", "pearl", "elastic"} <= set(known)  # the shipped ones still there


def test_an_entry_point_without_decide_is_refused_naming_it(third_party):
    with pytest.raises(PolicyError) as err:
        load_policy("tpbad")
    msg = str(err.value)
    assert "policy tpbad" in msg and "'tp_bad'" in msg and "tp-policies" in msg and "pearlctl.policies" in msg
    assert "no decide(snapshot)" in msg


def test_an_entry_point_that_fails_to_import_is_refused_naming_it(third_party):
    with pytest.raises(PolicyError, match=r"policy tpbroken .*tp_missing_module.*failed to load: ModuleNotFoundError"):
        load_policy("tpbroken")


def test_a_name_is_never_a_path_even_for_an_entry_point(third_party):
    """An entry point whose name is not a policy name is not listed and cannot be loaded."""
    assert "../evil" not in policies.known_policies()
    with pytest.raises(PolicyError, match="is not a policy name"):
        load_policy("../evil")


def test_precedence_policy_path_then_entry_points_then_shipped(third_party, tmp_path, monkeypatch):
    # an entry point beats a shipped policy of the same name
    static = load_policy("static")
    assert static.__name__ == "tp_good"
    assert dict(policies.policy_sources())["static"] == "entry point tp_good of tp-policies"
    # a $PEARL_POLICY_PATH file beats an entry point
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "tpgood.py").write_text("def decide(snapshot):\n    return None\n")
    monkeypatch.setenv("PEARL_POLICY_PATH", str(folder))
    monkeypatch.setattr(policies, "_loaded", {})
    assert load_policy("tpgood").__file__ == str(folder / "tpgood.py")
    assert dict(policies.policy_sources())["tpgood"] == str(folder / "tpgood.py")
    # with neither, the shipped file
    assert load_policy("pearl").__file__ == str(policies.SHIPPED_POLICIES_DIR / "pearl.py")


def test_doctor_says_where_each_policy_comes_from(third_party):
    check = doctor.check_policies()
    assert check.status == doctor.OK
    assert "tpgood from entry point tp_good of tp-policies" in check.detail
    assert f"in {policies.SHIPPED_POLICIES_DIR}" in check.detail
