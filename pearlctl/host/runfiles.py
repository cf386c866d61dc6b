"""The files of a run directory that pearlctl itself reads and writes, and how.

The run directory is on the shared filesystem: the head node and every compute node see it. It holds
what survives processes (logs, rendered scripts, checkpoints, weights) and two small control files:

- ``.pearl/secret`` — the run's API token, created once at launch, mode 0600, never logged. The daemon
  requires it on every request; agents and the trainer hook read it from here.
- ``.pearl/daemon.json`` — where the daemon listens (``{"url", "pid", "host", "epoch", "started_at"}``).
  Agents re-read it when a request fails, so a restarted daemon on another port is found again.

Files are written to a temporary name and renamed, so a reader never sees half a file. Signalling
itself goes over HTTP, not through files: NFS attribute caching would delay it by seconds.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path

CONTROL_DIR = ".pearl"


def control_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CONTROL_DIR


def secret_path(run_dir: str | os.PathLike) -> Path:
    return control_dir(run_dir) / "secret"


def address_path(run_dir: str | os.PathLike) -> Path:
    return control_dir(run_dir) / "daemon.json"


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def ensure_secret(run_dir: str | os.PathLike) -> str:
    """The run's token, created (mode 0600) if it does not exist yet."""
    path = secret_path(run_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        write_atomic(path, secrets.token_urlsafe(32), mode=0o600)
    return read_secret(run_dir)


def read_secret(run_dir: str | os.PathLike) -> str:
    return secret_path(run_dir).read_text().strip()


def write_address(run_dir: str | os.PathLike, address: dict) -> None:
    write_atomic(address_path(run_dir), json.dumps(address), mode=0o644)


def read_address(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads(address_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
