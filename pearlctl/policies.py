"""Load a policy by name — for the daemon and the simulator alike, so both run the same module.

A policy is a Python file ``<name>.py`` in ``$PEARL_POLICY_PATH`` (colon-separated folders, searched
first) or the repository's ``policies/``; the core never imports one directly. It defines
``decide(snapshot: pearlctl.planner.model.Snapshot) -> pearlctl.planner.model.Plan | None``: the plan to
apply now, or None to keep the current assignment. It must be pure: the simulator calls it thousands of
times in simulated time, and the daemon once per tick.
"""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

from pearlctl import home


class PolicyError(Exception):
    pass


_loaded: dict[str, ModuleType] = {}
# A name, never a path: a name sent to the daemon must not make it run an arbitrary file.
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def load_policy(name: str) -> ModuleType:
    """The policy module ``name`` (loaded once per process); PolicyError names the known ones."""
    if name in _loaded:
        return _loaded[name]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PolicyError(f"policy {name!r} is not a policy name (letters, digits, '-', '_'); known: "
                          f"{', '.join(home.known_policies())}")  # fmt: skip
    for d in home.policy_dirs():
        path = d / f"{name}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(f"pearl_policy_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if not callable(getattr(module, "decide", None)):
                raise PolicyError(f"policy {name} ({path}) defines no decide(snapshot)")
            _loaded[name] = module
            return module
    raise PolicyError(f"no policy {name!r}; known: {', '.join(home.known_policies())}")
