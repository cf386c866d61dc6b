"""Where pearlctl keeps files on the machine it runs on (the head node).

The state database must live on local disk, never on NFS (SQLite locking over NFS is unreliable):
``$PEARL_STATE_DIR`` if set, else ``$XDG_STATE_HOME/pearlctl``, else ``~/.local/state/pearlctl``.
Policies are found by name in ``$PEARL_POLICY_PATH`` (colon-separated) and then the shipped
``policies/`` directory; the core never imports a policy module to list them.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
JOBS_DIR = REPO_ROOT / "jobs"
WORKER_SCRIPT = JOBS_DIR / "worker.sh"


def state_dir() -> Path:
    if os.environ.get("PEARL_STATE_DIR"):
        return Path(os.environ["PEARL_STATE_DIR"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "pearlctl"


def state_db() -> Path:
    return state_dir() / "state.db"


def policy_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("PEARL_POLICY_PATH", "").split(":") if p]
    return extra + [REPO_ROOT / "policies"]


def known_policies() -> tuple[str, ...]:
    names: list[str] = []
    for d in policy_dirs():
        if d.is_dir():
            names += [p.stem for p in sorted(d.glob("*.py")) if not p.name.startswith("_")]
    return tuple(dict.fromkeys(names))
