"""Where pearlctl keeps files on the machine it runs on (the head node).

The state database must live on local disk, never on NFS (SQLite locking over NFS is unreliable):
``$PEARL_STATE_DIR`` if set, else ``$XDG_STATE_HOME/pearlctl``, else ``~/.local/state/pearlctl``.
The sbatch wrappers live in the repository's top-level ``jobs/`` (their one copy). pyproject.toml installs
them as the package ``pearlctl._shipped_jobs`` (a wheel copies them in; an editable install maps the name onto
the folder), so they are found with importlib.resources wherever pearlctl is installed and whatever the
working directory. (Policies are found by pearlctl.policies.)
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

# The source checkout, for ``{repo}`` in a spec's commands (examples/); not where policies or jobs are found.
REPO_ROOT = Path(__file__).resolve().parents[2]


def _package_dir(package: str) -> Path:
    """The folder of an installed package of pearlctl's (a plain folder: pearlctl is never run zipped, and
    sbatch must exec ``worker.sh`` from a file)."""
    return Path(str(resources.files(package)))


JOBS_DIR = _package_dir("pearlctl._shipped_jobs")
WORKER_SCRIPT = JOBS_DIR / "worker.sh"


def state_dir() -> Path:
    if os.environ.get("PEARL_STATE_DIR"):
        return Path(os.environ["PEARL_STATE_DIR"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "pearlctl"


def state_db() -> Path:
    return state_dir() / "state.db"
