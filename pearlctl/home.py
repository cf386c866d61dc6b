"""Where pearlctl keeps files on the machine it runs on (the head node).

The state database must live on local disk, never on NFS (SQLite locking over NFS is unreliable):
``$PEARL_STATE_DIR`` if set, else ``$XDG_STATE_HOME/pearlctl``, else ``~/.local/state/pearlctl``.
Policies are found by name in ``$PEARL_POLICY_PATH`` (colon-separated folders), then among the
``pearlctl.policies`` entry points of installed distributions, then among the shipped ones; the core never
imports a policy module to list them.

The shipped policies and the sbatch wrappers live in the repository's top-level ``policies/`` and ``jobs/``
(their one copy). pyproject.toml installs them as the packages ``pearlctl._shipped_policies`` and
``pearlctl._shipped_jobs`` (a wheel copies them in; an editable install maps the names onto the folders), so
they are found with importlib.resources wherever pearlctl is installed and whatever the working directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from importlib import resources
from pathlib import Path

# The source checkout, for ``{repo}`` in a spec's commands (examples/); not where policies or jobs are found.
REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINT_GROUP = "pearlctl.policies"
# A name, never a path: a name sent to the daemon must not make it run an arbitrary file.
POLICY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def _package_dir(package: str) -> Path:
    """The folder of an installed package of pearlctl's (a plain folder: pearlctl is never run zipped, and
    sbatch must exec ``worker.sh`` from a file)."""
    return Path(str(resources.files(package)))


SHIPPED_POLICIES_DIR = _package_dir("pearlctl._shipped_policies")
JOBS_DIR = _package_dir("pearlctl._shipped_jobs")
WORKER_SCRIPT = JOBS_DIR / "worker.sh"


def state_dir() -> Path:
    if os.environ.get("PEARL_STATE_DIR"):
        return Path(os.environ["PEARL_STATE_DIR"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "pearlctl"


def state_db() -> Path:
    return state_dir() / "state.db"


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
