"""Load a policy by name — for the daemon and the simulator alike, so both run the same module.

A policy defines ``decide(snapshot: pearlctl.planner.model.Snapshot) -> pearlctl.planner.model.Plan | None``:
the plan to apply now, or None to keep the current assignment. It must be pure: the simulator calls it
thousands of times in simulated time, and the daemon once per tick. A name is looked up, first match wins:

1. a file ``<name>.py`` in a folder of ``$PEARL_POLICY_PATH`` (colon-separated, in order);
2. an entry point ``<name>`` in the group ``pearlctl.policies`` of an installed distribution (a third-party
   package's ``[project.entry-points."pearlctl.policies"] mypolicy = "mypkg.policy"``), pointing to a module
   or an object that has ``decide``;
3. a shipped policy: ``<name>.py`` in the repository's ``policies/``, installed as
   ``pearlctl._shipped_policies`` (pearlctl.home).

The core never imports a policy to list them (pearlctl.home.known_policies). A name is a name, never a path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pearlctl import home


class PolicyError(Exception):
    pass


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
    where = f"entry point {name} = {ep.value!r} in group {home.ENTRY_POINT_GROUP!r} of {dist}"
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
    if not isinstance(name, str) or not home.POLICY_NAME.fullmatch(name):
        raise PolicyError(f"policy {name!r} is not a policy name (letters, digits, '-', '_'); known: "
                          f"{', '.join(home.known_policies())}")  # fmt: skip
    policy = None
    for d in home.path_policy_dirs():
        if (d / f"{name}.py").is_file():
            policy = _from_file(name, d / f"{name}.py")
            break
    else:
        ep = home.policy_entry_points().get(name)
        if ep is not None:
            policy = _from_entry_point(name, ep)
        elif (home.SHIPPED_POLICIES_DIR / f"{name}.py").is_file():
            policy = _from_file(name, home.SHIPPED_POLICIES_DIR / f"{name}.py")
    if policy is None:
        raise PolicyError(f"no policy {name!r}; known: {', '.join(home.known_policies())}")
    _loaded[name] = policy
    return policy
