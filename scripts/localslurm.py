#!/usr/bin/env python3
"""Bring up / tear down a real multi-node Slurm cluster on this one machine (stdlib only).

    python3 scripts/localslurm.py up     [--dir /tmp/pearl-slurm] [--nodes 4] [--gpus 8] [--accounting]
                                         [--min-job-age 600] [--timeout 60]
    python3 scripts/localslurm.py down   [--dir ...] [--wipe]
    python3 scripts/localslurm.py status [--dir ...]
    python3 scripts/localslurm.py env    [--dir ...]

Everything lives in DIR: a private munged (own key/socket), slurm.conf + gres.conf (nodes gpu[1-N] on
127.0.0.1, fake GPUs symlinked to /dev/null), slurmctld, one `slurmd -N gpuK` per node and, with
--accounting, a private MariaDB + slurmdbd so that `sacct` works. Nothing in /etc is touched; clients only
need `SLURM_CONF=DIR/etc/slurm.conf` (printed as the last stdout line of `up` and by `env`).

Daemons run in the foreground of their own session, detached from this script; their PIDs are recorded in
DIR/pids/ and `down` stops exactly those PIDs (SIGTERM, then SIGKILL), never anything found by name. A
recorded PID is only signalled if the process still carries this cluster's marker in its environment.

Needs root and the packages from scripts/install-slurm.sh. docs/backends.md describes the cluster and
the Slurm 22.05 behaviour it shows.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = "/tmp/pearl-slurm"
CLUSTER_NAME = "pearl"
MARKER_ENV = "PEARL_LOCALSLURM_DIR"
SBIN_PATHS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
UP_STATES = {"idle", "allocated", "mixed", "completing", "alloc", "mix", "comp"}
DB_USER = "slurm"
DB_PASS = "pearl-local"

_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[localslurm {time.monotonic() - _T0:6.2f}s] {msg}", file=sys.stderr, flush=True)


class ClusterError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------- helpers


def which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN_PATHS)
    return shutil.which(name, path=path)


def need(name: str) -> str:
    p = which(name)
    if p is None:
        raise ClusterError(f"'{name}' not found: install Slurm with `sudo scripts/install-slurm.sh`")
    return p


def tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no {path})"
    return "\n".join(f"    {line}" for line in lines[-n:])


def port_free(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default when unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    return 32768, 60999


def block_usable(base: int, count: int) -> bool:
    """True if ports base..base+count-1 are all free and all outside the ephemeral range.

    A daemon's fixed port must not lie in the ephemeral range: any outgoing connection on the machine
    (a test's HTTP client, a vLLM server's) may hold it as its local port when the daemon restarts, and
    slurmctld then dies with "Address already in use".
    """
    lo, hi = ephemeral_ports()
    ports = range(base, base + count)
    return all(not lo <= p <= hi for p in ports) and all(port_free(p) for p in ports)


def pick_port_block(d: Path, count: int) -> int:
    """A usable block (see block_usable) of `count` ports, starting at a place derived from DIR."""
    bases = range(10000, 65536 - count, 64)
    h = int(hashlib.sha256(str(d).encode()).hexdigest(), 16)
    start = h % len(bases)
    for i in range(len(bases)):
        base = bases[(start + i) % len(bases)]
        if block_usable(base, count):
            return base
    raise ClusterError("no free block of TCP ports outside the ephemeral range found")


def tcp_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def unix_open(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(0.5)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_for(what: str, pred, timeout: float, logs: list[Path], procs: dict | None = None) -> None:
    """Poll pred() until true; fail early (with log tails) if one of procs {name: Popen} exits."""
    procs = procs or {}
    deadline = time.monotonic() + timeout
    dead: list[str] = []
    while time.monotonic() < deadline:
        if pred():
            return
        dead = [f"{n} (exit {p.returncode})" for n, p in procs.items() if p.poll() is not None]
        if dead:
            break
        time.sleep(0.1)
    detail = "\n".join(f"  --- {p}:\n{tail(p)}" for p in logs)
    state = f"not ready: {', '.join(dead)} exited" if dead else f"not ready after {timeout:.0f}s"
    raise ClusterError(f"{what} {state}\n{detail}")


# --------------------------------------------------------------------------------------------- cluster


class Cluster:
    def __init__(self, d: str | os.PathLike):
        self.dir = Path(os.path.abspath(d))
        self.etc = self.dir / "etc"
        self.conf = self.etc / "slurm.conf"
        self.pids = self.dir / "pids"
        self.logs = self.dir / "log"
        self.run = self.dir / "run"
        self.spool = self.dir / "spool"
        self.munge_dir = self.dir / "munge"
        self.munge_sock = self.munge_dir / "munge.sock"
        self.db_dir = self.dir / "db"
        self.db_sock = self.run / "mysqld.sock"
        self.meta_path = self.dir / "cluster.json"

    # ---- metadata
    def meta(self) -> dict | None:
        try:
            return json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env[MARKER_ENV] = str(self.dir)
        env["PATH"] = env.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN_PATHS)
        return env

    def export_line(self) -> str:
        return f"export SLURM_CONF={self.conf}"

    # ---- pids
    def recorded(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.pids.is_dir():
            for f in sorted(self.pids.glob("*.pid")):
                with contextlib.suppress(ValueError, OSError):
                    out[f.stem] = int(f.read_text().strip())
        return out

    def ours(self, pid: int) -> bool:
        """True if pid is alive (not a zombie) and was started by this cluster (marker in its environ)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            return False
        return f"{MARKER_ENV}={self.dir}".encode() in environ

    # ---- config
    def write_config(self, nodes: int, gpus: int, accounting: bool, min_job_age: int) -> dict:
        old = self.meta() or {}
        nports = nodes + 3  # slurmctld, slurmdbd, mariadb, one per slurmd
        base = old.get("port_base")
        if base is None or not block_usable(base, max(nports, 8)):
            base = pick_port_block(self.dir, max(nports, 8))
        meta = {
            "nodes": nodes,
            "gpus": gpus,
            "accounting": accounting,
            "min_job_age": min_job_age,
            "port_base": base,
            "slurmctld_port": base,
            "slurmdbd_port": base + 1,
            "mariadb_port": base + 2,
            "slurmd_ports": [base + 3 + i for i in range(nodes)],
        }
        d = self.dir
        for sub in (
            self.etc,
            self.pids,
            self.logs,
            self.run,
            self.spool,
            self.spool / "ctld",
            self.munge_dir,
            d / "dev",
            d / "tmp",
        ):
            sub.mkdir(parents=True, exist_ok=True)
            os.chmod(sub, 0o755)
        os.chmod(d, 0o755)
        for i in range(nodes):
            (self.spool / f"gpu{i + 1}").mkdir(exist_ok=True)
        for i in range(max(gpus, 1)):
            link = d / "dev" / f"nvidia{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")

        key = self.etc / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

        cpus = max(8, gpus)
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_sock},cred_expire=10\n"
        node_lines = "".join(
            f"NodeName=gpu{i + 1} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus} "
            f"RealMemory=16000{f' Gres=gpu:{gpus}' if gpus else ''} State=UNKNOWN\n"
            for i, p in enumerate(meta["slurmd_ports"])
        )
        if accounting:
            acct = (
                "AccountingStorageType=accounting_storage/slurmdbd\n"
                f"AccountingStorageHost=localhost\nAccountingStoragePort={meta['slurmdbd_port']}\n"
                # 22.05 authenticates to slurmdbd with the munge socket named here, not AuthInfo's
                f"AccountingStoragePass={self.munge_sock}\n"
                "JobAcctGatherType=jobacct_gather/none\n"
            )
            # GPUs in TRES= / tres_alloc_str like a real GPU cluster (slurmctld refuses this without slurmdbd)
            acct += "AccountingStorageTRES=gres/gpu\n" if gpus else ""
        else:
            acct = "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
        self.conf.write_text(
            f"""# Generated by scripts/localslurm.py -- private local test cluster in {d}
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={meta["slurmctld_port"]}
SlurmUser=root
SlurmdUser=root
{auth}StateSaveLocation={self.spool / "ctld"}
SlurmdSpoolDir={self.spool}/%n
SlurmctldPidFile={self.run / "slurmctld.pid"}
SlurmdPidFile={self.run}/slurmd-%n.pid
SlurmctldLogFile={self.logs / "slurmctld.log"}
SlurmdLogFile={self.logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
SlurmctldParameters=preempt_send_user_signal
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
KillWait=5
ReturnToService=2
MinJobAge={min_job_age}
InactiveLimit=0
SlurmdTimeout=300
GresTypes=gpu
{acct}
{node_lines}
PartitionName=debug   Nodes=ALL Default=YES PriorityTier=1  PreemptMode=OFF     MaxTime=INFINITE State=UP
PartitionName=preempt Nodes=ALL PriorityTier=1  PreemptMode=REQUEUE GraceTime=10 MaxTime=INFINITE State=UP
PartitionName=preempt0 Nodes=ALL PriorityTier=1 PreemptMode=REQUEUE GraceTime=0 MaxTime=INFINITE State=UP
PartitionName=high    Nodes=ALL PriorityTier=10 PreemptMode=OFF     MaxTime=INFINITE State=UP
"""
        )
        last = max(gpus - 1, 0)
        files = f"{d}/dev/nvidia[0-{last}]" if gpus > 1 else f"{d}/dev/nvidia0"
        gres = f"NodeName=gpu[1-{nodes}] Name=gpu File={files}\n" if gpus else ""
        (self.etc / "gres.conf").write_text(f"AutoDetect=off\n{gres}")
        dbd = self.etc / "slurmdbd.conf"
        if accounting:
            self.db_dir.mkdir(exist_ok=True)
            dbd.write_text(
                f"""# Generated by scripts/localslurm.py
{auth}DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={meta["slurmdbd_port"]}
SlurmUser=root
PidFile={self.run / "slurmdbd.pid"}
LogFile={self.logs / "slurmdbd.log"}
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={meta["mariadb_port"]}
StorageUser={DB_USER}
StoragePass={DB_PASS}
StorageLoc=slurm_acct_db
"""
            )
            os.chmod(dbd, 0o600)
        elif dbd.exists():
            dbd.unlink()
        self.meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        return meta

    # ---- processes
    def spawn(self, name: str, argv: list[str], logfile: Path) -> subprocess.Popen:
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=str(self.dir),
                start_new_session=True,
                close_fds=True,
            )
        (self.pids / f"{name}.pid").write_text(f"{proc.pid}\n")
        log(f"started {name} (pid {proc.pid})")
        return proc

    def slurm(self, *args: str, timeout: float = 20, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout, check=check)

    def node_states(self) -> dict[str, str]:
        try:
            r = self.slurm(need("sinfo"), "-h", "-N", "-o", "%N %T", timeout=5)
        except subprocess.TimeoutExpired:
            return {}
        if r.returncode != 0:
            return {}
        out = {}
        for line in r.stdout.split("\n"):
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1]
        return out

    def healthy(self) -> tuple[bool, str]:
        meta = self.meta()
        if meta is None or not self.conf.exists():
            return False, f"no cluster in {self.dir}"
        want = ["munged", "slurmctld"] + [f"slurmd-gpu{i + 1}" for i in range(meta["nodes"])]
        if meta.get("accounting"):
            want += ["mariadb", "slurmdbd"]
        rec = self.recorded()
        dead = [n for n in want if n not in rec or not self.ours(rec[n])]
        if dead:
            return False, f"daemons not running: {', '.join(dead)}"
        states = self.node_states()
        nodes = [f"gpu{i + 1}" for i in range(meta["nodes"])]
        bad = {n: states.get(n, "missing") for n in nodes if states.get(n) not in UP_STATES}
        if bad:
            return False, "nodes not up: " + ", ".join(f"{n}={s}" for n, s in bad.items())
        acct = " accounting=on" if meta.get("accounting") else ""
        return True, f"up: {len(nodes)} nodes x {meta['gpus']} gpus{acct} in {self.dir}"

    # ---- up
    def up(self, nodes: int, gpus: int, accounting: bool, timeout: float, min_job_age: int = 600) -> None:
        if len(str(self.munge_sock)) >= 100 or len(str(self.db_sock)) >= 100:
            raise ClusterError(f"--dir {self.dir} is too long for unix socket paths (<108 bytes); use a short one")
        anc = self.dir.parent
        while True:
            if anc.exists() and not os.stat(anc).st_mode & 0o001:
                raise ClusterError(f"{anc} is not world-executable; munged refuses it. Use e.g. /tmp/pearl-slurm")
            if anc == anc.parent:
                break
            anc = anc.parent
        for b in ("munged", "slurmctld", "slurmd", "sinfo"):
            need(b)
        if accounting:
            for b in ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr"):
                need(b)

        meta = self.meta()
        ok, why = self.healthy()
        shape = (nodes, gpus, accounting, min_job_age)
        if ok and meta and (meta["nodes"], meta["gpus"], meta["accounting"], meta.get("min_job_age", 600)) == shape:
            log(f"already {why}")
            return
        if any(self.ours(p) for p in self.recorded().values()):
            log(f"cluster in {self.dir} not usable as asked ({why if not ok else 'different shape'}); restarting")
            self.down()
        elif meta is not None:
            self.down(quiet=True)  # nothing recorded is alive: still sweep job processes a crash left behind
        fresh = not (self.spool / "ctld" / "node_state").exists()
        log(
            f"{'starting' if fresh else 'restarting'} cluster in {self.dir}: {nodes} nodes x {gpus} gpus, "
            f"accounting={'on' if accounting else 'off'}"
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.write_config(nodes, gpus, accounting, min_job_age)
        for f in self.pids.glob("*.pid"):
            f.unlink()
        try:
            self._start(meta, timeout)
        except BaseException:
            log("start failed; stopping what was started")
            self.down(quiet=True)
            raise

    def _start(self, meta: dict, timeout: float) -> None:
        # munged
        with contextlib.suppress(FileNotFoundError):
            self.munge_sock.unlink()
        munged = self.spawn(
            "munged",
            [
                need("munged"),
                "-F",
                "--force",
                f"--socket={self.munge_sock}",
                f"--key-file={self.etc / 'munge.key'}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
                f"--log-file={self.logs / 'munged.log'}",
            ],
            self.logs / "munged.out",
        )
        wait_for(
            "munged",
            lambda: unix_open(self.munge_sock),
            15,
            [self.logs / "munged.log", self.logs / "munged.out"],
            procs={"munged": munged},
        )

        if meta["accounting"]:
            self._start_accounting(meta, timeout)

        ctld = self.spawn(
            "slurmctld", [need("slurmctld"), "-D", "-i", "-f", str(self.conf)], self.logs / "slurmctld.out"
        )
        procs = {"slurmctld": ctld}
        for i in range(meta["nodes"]):
            name = f"gpu{i + 1}"
            procs[f"slurmd -N {name}"] = self.spawn(
                f"slurmd-{name}",
                [need("slurmd"), "-D", "-N", name, "-f", str(self.conf)],
                self.logs / f"slurmd-{name}.out",
            )
        nodes = [f"gpu{i + 1}" for i in range(meta["nodes"])]

        def all_idle() -> bool:
            states = self.node_states()
            return all(states.get(n) in UP_STATES for n in nodes)

        logs = [self.logs / "slurmctld.log", self.logs / "slurmd-gpu1.log", self.logs / "slurmd-gpu1.out"]
        wait_for(f"nodes {','.join(nodes)}", all_idle, timeout, logs, procs=procs)
        log(f"cluster up: {self.healthy()[1]}")

    def _start_accounting(self, meta: dict, timeout: float) -> None:
        mlog = self.logs / "mariadb.log"
        if not (self.db_dir / "mysql").is_dir():
            log("initialising private MariaDB datadir")
            r = subprocess.run(
                [
                    need("mariadb-install-db"),
                    "--no-defaults",
                    f"--datadir={self.db_dir}",
                    "--user=root",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--skip-name-resolve",
                ],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=120,
            )
            if r.returncode != 0:
                raise ClusterError(f"mariadb-install-db failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        with contextlib.suppress(FileNotFoundError):
            self.db_sock.unlink()
        db = self.spawn(
            "mariadb",
            [
                need("mariadbd"),
                "--no-defaults",
                f"--datadir={self.db_dir}",
                f"--socket={self.db_sock}",
                f"--port={meta['mariadb_port']}",
                "--bind-address=127.0.0.1",
                f"--pid-file={self.run / 'mariadb.pid'}",
                f"--log-error={mlog}",
                "--user=root",
                "--skip-name-resolve",
                "--skip-log-bin",
                f"--tmpdir={self.dir / 'tmp'}",
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=16M",
                "--innodb-flush-log-at-trx-commit=0",
                "--innodb-lock-wait-timeout=900",
                "--performance-schema=OFF",
                "--max-connections=50",
            ],
            self.logs / "mariadb.out",
        )
        wait_for(
            "mariadb",
            lambda: tcp_open(meta["mariadb_port"]) and unix_open(self.db_sock),
            timeout,
            [mlog, self.logs / "mariadb.out"],
            procs={"mariadbd": db},
        )
        sql = (
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}'; "
            f"GRANT ALL ON slurm_acct_db.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;"
        )
        r = subprocess.run(
            [need("mariadb"), "--no-defaults", f"--socket={self.db_sock}", "-uroot", "-e", sql],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            raise ClusterError(f"creating the slurm DB user failed: {r.stderr.strip()}")
        dbd = self.spawn("slurmdbd", [need("slurmdbd"), "-D"], self.logs / "slurmdbd.out")
        wait_for(
            "slurmdbd",
            lambda: tcp_open(meta["slurmdbd_port"]),
            timeout,
            [self.logs / "slurmdbd.log", self.logs / "slurmdbd.out"],
            procs={"slurmdbd": dbd},
        )
        r = self.slurm(need("sacctmgr"), "-n", "-P", "show", "cluster", "format=cluster")
        if CLUSTER_NAME not in r.stdout.split():
            r = self.slurm(need("sacctmgr"), "-i", "add", "cluster", CLUSTER_NAME)
            if r.returncode != 0:
                raise ClusterError(f"sacctmgr add cluster failed: {r.stdout}{r.stderr}")
            log(f"registered cluster '{CLUSTER_NAME}' with slurmdbd")

    # ---- down
    def cancel_jobs(self, timeout: float = 20) -> None:
        """Cancel every job of this cluster and wait until none is left running/completing."""
        sq, sc = which("squeue"), which("scancel")
        if not (sq and sc):
            return
        try:
            r = self.slurm(sq, "-h", "-o", "%A", timeout=5)
            ids = sorted(set(r.stdout.split())) if r.returncode == 0 else []
            if not ids:
                return
            log(f"cancelling {len(ids)} job(s)")
            self.slurm(sc, *ids, timeout=10)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                r = self.slurm(sq, "-h", "-o", "%A", timeout=5)
                if r.returncode != 0 or not r.stdout.strip():
                    return
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            pass

    def job_processes(self) -> list[int]:
        """Processes left by this cluster's jobs: every slurmstepd started by our slurmds (it inherits their
        marker environment variable), everything in its session, and all their descendants."""
        procs: dict[int, tuple[int, int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] not in ("Z", "X"):
                    procs[int(entry)] = (int(stat[1]), int(stat[3]))  # ppid, session id
            except (OSError, IndexError, ValueError):
                continue
        daemons = set(self.recorded().values())
        roots = {pid for pid in procs if pid not in daemons and pid != os.getpid() and self.ours(pid)}
        sids = {procs[pid][1] for pid in roots if procs[pid][1] == pid}  # session leaders (slurmstepd)
        found = set(roots) | {pid for pid, (_, sid) in procs.items() if sid in sids}
        grew = True
        while grew:
            more = {pid for pid, (ppid, _) in procs.items() if ppid in found and pid not in found}
            found |= more
            grew = bool(more)
        return sorted(found - daemons - {os.getpid()})

    def _stop(self, pids: dict[str, int], timeout: float) -> None:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = {n: p for n, p in pids.items() if alive(p)}
            if pids:
                time.sleep(0.05)
        for n, pid in pids.items():
            log(f"{n} (pid {pid}) ignored SIGTERM for {timeout:.0f}s: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def down(self, timeout: float = 15, quiet: bool = False) -> None:
        rec = self.recorded()
        if "slurmctld" in rec and self.ours(rec["slurmctld"]):
            self.cancel_jobs()
        order = [
            [n for n in rec if n.startswith("slurmd-")] + ["slurmctld"],
            ["slurmdbd"],
            ["mariadb"],
            ["munged"],
        ]
        stopped = 0
        for group in order:
            pids = {n: rec[n] for n in group if n in rec and self.ours(rec[n])}
            stopped += len(pids)
            self._stop(pids, timeout)
            if "slurmctld" in group:
                leftovers = self.job_processes()
                if leftovers:
                    log(f"stopping {len(leftovers)} leftover job process(es): {leftovers}")
                    self._stop({f"job process {p}": p for p in leftovers}, 3)
        if self.pids.is_dir():
            for f in self.pids.glob("*.pid"):
                f.unlink()
        if not quiet:
            log(f"stopped {stopped} daemon(s) in {self.dir}" if stopped else f"nothing running in {self.dir}")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# --------------------------------------------------------------------------------------------- main


@contextlib.contextmanager
def locked(d: Path):
    """Serialise concurrent up/down calls on the same DIR (e.g. parallel pytest sessions)."""
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("up", "down", "status", "env"):
        p = sub.add_parser(name)
        p.add_argument("--dir", default=os.environ.get("PEARL_SLURM_DIR", DEFAULT_DIR))
        if name == "up":
            p.add_argument("--nodes", type=int, default=4)
            p.add_argument("--gpus", type=int, default=8)
            p.add_argument("--accounting", action="store_true", help="private MariaDB + slurmdbd (sacct)")
            p.add_argument(
                "--min-job-age",
                type=int,
                default=600,
                help="MinJobAge: seconds finished jobs stay in squeue/scontrol (slurmctld purges every ~60 s)",
            )
            p.add_argument("--timeout", type=float, default=60, help="seconds to wait for all nodes idle")
        if name == "down":
            p.add_argument("--wipe", action="store_true", help="remove DIR afterwards")
            p.add_argument("--timeout", type=float, default=15, help="seconds between SIGTERM and SIGKILL")
    a = ap.parse_args(argv)
    c = Cluster(a.dir)
    try:
        if a.cmd == "env":
            print(c.export_line())
            return 0
        if a.cmd == "status":
            ok, why = c.healthy()
            print(why)
            return 0 if ok else 1
        if a.cmd == "down":
            if not c.dir.exists():
                leftovers = c.job_processes()  # jobs of a cluster whose DIR was removed under it
                if leftovers:
                    log(f"stopping {len(leftovers)} leftover job process(es) of {c.dir}: {leftovers}")
                    c._stop({f"job process {p}": p for p in leftovers}, 5)
                log(f"nothing in {c.dir}")
                return 0
            with locked(c.dir):
                c.down(timeout=a.timeout)
            if a.wipe:
                shutil.rmtree(c.dir, ignore_errors=True)
                log(f"removed {c.dir}")
            return 0
        if a.cmd == "up":
            if os.geteuid() != 0:
                raise ClusterError("must run as root (SlurmUser=root, private daemons)")
            if a.nodes < 1 or a.gpus < 0:
                raise ClusterError("--nodes must be >= 1 and --gpus >= 0")
            with locked(c.dir):
                c.up(a.nodes, a.gpus, a.accounting, a.timeout, a.min_job_age)
            print(c.export_line(), flush=True)
            return 0
    except ClusterError as e:
        log(f"ERROR: {e}")
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
