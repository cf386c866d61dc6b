"""Policies: finding one by name and loading it, for the daemon and the simulator alike, so both run the same
module; the shipped ones are in ``pearlctl/policies/shipped/``.

A policy defines ``decide(snapshot: pearlctl.planner.model.Snapshot) -> pearlctl.planner.model.Plan | None``:
the plan to apply now, or None to keep the current assignment. It must be pure: the simulator calls it
thousands of times in simulated time, and the daemon once per tick. A name is looked up, first match wins:

1. a file ``<name>.py`` in a folder of ``$PEARL_POLICY_PATH`` (colon-separated, in order);
2. an entry point ``<name>`` in the group ``pearlctl.policies`` of an installed distribution (a third-party
   package's ``[project.entry-points."pearlctl.policies"] mypolicy = "mypkg.policy"``), pointing to a module
   or an object that has ``decide``;
3. a shipped policy: ``<name>.py`` in ``pearlctl/policies/shipped/`` (found with importlib.resources wherever
   pearlctl is installed).

Listing them (:func:`known_policies`, :func:`policy_sources`) never imports a policy. A name is a name, never a
path: a name sent to the daemon must not make it run an arbitrary file.

Modules:

- ``shipped`` — the shipped policies (never, static, elastic, greedy, pearl, pivot), one module each.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

ENTRY_POINT_GROUP = "pearlctl.policies"
POLICY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
# A plain folder: pearlctl is never run zipped.
SHIPPED_POLICIES_DIR = Path(str(resources.files("pearlctl.policies.shipped")))


class PolicyError(Exception):
    pass


def path_policy_dirs() -> list[Path]:
    """The folders of ``$PEARL_POLICY_PATH``, in order."""
    return [Path(p) for p in os.environ.get("PEARL_POLICY_PATH", "").split(":") if p]


def policy_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The ``pearlctl.policies`` entry points of installed distributions whose names are policy names, by name
    (the first one importlib.metadata lists wins a name two distributions register)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if POLICY_NAME.fullmatch(ep.name):
            found.setdefault(ep.name, ep)
    return found


def _file_policies(d: Path) -> list[str]:
    if not d.is_dir():
        return []
    return [p.stem for p in sorted(d.glob("*.py")) if not p.name.startswith("_") and POLICY_NAME.fullmatch(p.stem)]


def policy_sources() -> list[tuple[str, str]]:
    """Every policy name with where it comes from (a file path, or ``entry point VALUE of DIST``), in the order
    of precedence: ``$PEARL_POLICY_PATH`` folders, then entry points, then the shipped policies. A name found
    twice is the first one's."""
    found: dict[str, str] = {}
    for d in path_policy_dirs():
        for name in _file_policies(d):
            found.setdefault(name, str(d / f"{name}.py"))
    for name, ep in sorted(policy_entry_points().items()):
        dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
        found.setdefault(name, f"entry point {ep.value} of {dist}")
    for name in _file_policies(SHIPPED_POLICIES_DIR):
        found.setdefault(name, str(SHIPPED_POLICIES_DIR / f"{name}.py"))
    return list(found.items())


def known_policies() -> tuple[str, ...]:
    return tuple(name for name, _ in policy_sources())


_loaded: dict[str, Any] = {}


def _from_file(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"pearl_policy_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "decide", None)):
        raise PolicyError(f"policy {name} ({path}) defines no decide(snapshot)")
    return module


def _from_entry_point(name: str, ep) -> Any:
    dist = ep.dist.name if ep.dist is not None else "an unknown distribution"
    where = f"entry point {name} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} of {dist}"
    try:
        policy = ep.load()
    except Exception as exc:  # an installed package's import error is the finding
        raise PolicyError(f"policy {name} ({where}) failed to load: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(policy, "decide", None)):
        raise PolicyError(f"policy {name} ({where}) has no decide(snapshot)")
    return policy


def load_policy(name: str) -> Any:
    """The policy ``name``, a module or an object with ``decide`` (loaded once per process); PolicyError
    names the known ones."""
    if name in _loaded:
        return _loaded[name]
    if not isinstance(name, str) or not POLICY_NAME.fullmatch(name):
        raise PolicyError(f"policy {name!r} is not a policy name (letters, digits, '-', '_'); known: "
                          f"{', '.join(known_policies())}")  # fmt: skip
    policy = None
    for d in path_policy_dirs():
        if (d / f"{name}.py").is_file():
            policy = _from_file(name, d / f"{name}.py")
            break
    else:
        ep = policy_entry_points().get(name)
        if ep is not None:
            policy = _from_entry_point(name, ep)
        elif (SHIPPED_POLICIES_DIR / f"{name}.py").is_file():
            policy = _from_file(name, SHIPPED_POLICIES_DIR / f"{name}.py")
    if policy is None:
        raise PolicyError(f"no policy {name!r}; known: {', '.join(known_policies())}")
    _loaded[name] = policy
    return policy
