"""Integration tests run against a real multi-node Slurm cluster on this machine (scripts/localslurm.py).

The session fixture `slurm_cluster` brings the cluster up once (4 nodes x 8 fake GPUs, partitions debug /
preempt / high, slurmdbd accounting so `sacct` works), points SLURM_CONF at it for the whole session and
tears it down at the end. Settings (environment):

    PEARL_TEST_SLURM_DIR   cluster directory (default /tmp/pearl-slurm-test; keep it short: munge socket);
                           under xdist each worker has its own cluster, in DIR-<worker> (tests/conftest.py: the
                           engine chain and the control chain run side by side)
    PEARL_TEST_SLURM_KEEP  "1": leave the cluster up (and its logs) after the session

A cluster that was already up in that directory before the session is reused and left up.
Missing Slurm binaries are a test failure (never a skip): run `sudo scripts/install-slurm.sh`.
Every test under tests/integration is marked `integration` (select/deselect with `-m`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCALSLURM = REPO / "scripts" / "localslurm.py"
DEFAULT_DIR = "/tmp/pearl-slurm-test"
SBIN = ("/usr/sbin", "/sbin")
REQUIRED = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "squeue",
    "scontrol",
    "scancel",
    "sinfo",
    "sacct",
    "sacctmgr",
    "slurmdbd",
    "mariadbd",
    "mariadb-install-db",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session: only mark the ones under tests/integration.
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> Path:
        """A directory every node (and the test) can read and write: for job outputs and markers."""
        p = self.dir / "shared"
        p.mkdir(mode=0o755, exist_ok=True)
        return p

    def new_shared_dir(self, prefix: str = "t") -> Path:
        p = self.shared / f"{prefix}-{uuid.uuid4().hex[:8]}"
        p.mkdir(mode=0o755)
        return p

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sbatch, squeue, ...) against this cluster."""
        env = {**os.environ, **self.env}
        r = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def active_jobs(self) -> list[str]:
        """Ids of jobs that are pending, running, completing, ... (what plain `squeue` lists)."""
        return self.run("squeue", "-h", "-o", "%A").stdout.split()

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job in this cluster and wait until none is left pending/running/completing."""
        ids = sorted(set(self.active_jobs()))
        if ids:
            self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout
        while self.active_jobs():
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs still active {timeout:.0f}s after scancel:\n" + self.run("squeue").stdout)
            time.sleep(0.2)

    def accounting(
        self, job_id: str, fields: str, complete: Callable[[list[list[str]]], bool], timeout: float = 30
    ) -> list[list[str]]:
        """``sacct -X`` rows (``fields`` split) of job/array `job_id` once `complete(rows)` holds, or the last
        rows read after `timeout` s. slurmctld sends job records to slurmdbd asynchronously, so right after a
        job ends the database may not hold its tasks yet, or only a placeholder row (named "allocation")."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.run("sacct", "-X", "-n", "-P", f"--format={fields}", "-j", job_id).stdout
            rows = [line.split("|") for line in out.split()]
            if complete(rows) or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)

    def wait_job_states(self, job_id: str, done: set[str], timeout: float = 60) -> dict[str, str]:
        """Wait until every task of job/array `job_id` is in one of `done` (scontrol show job states)."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
            states = {}
            for line in out.splitlines():
                fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                if "JobId" in fields:
                    states[fields["JobId"]] = fields.get("JobState", "?")
            if states and all(s in done for s in states.values()):
                return states
            time.sleep(0.25)
        raise AssertionError(f"job {job_id} not in {done} after {timeout:.0f}s: {states}")


def _missing_binaries() -> list[str]:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
    return [b for b in REQUIRED if shutil.which(b, path=path) is None]


def _localslurm(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOCALSLURM), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    missing = _missing_binaries()
    if missing:
        pytest.fail(
            f"Slurm is not installed (missing: {', '.join(missing)}). "
            "Run `sudo scripts/install-slurm.sh` once, then rerun the integration tests.",
            pytrace=False,
        )
    if os.geteuid() != 0:
        pytest.fail(
            "the local Slurm cluster runs its daemons as root: run the integration tests as root", pytrace=False
        )
    d = Path(os.environ.get("PEARL_TEST_SLURM_DIR", DEFAULT_DIR))
    if worker := os.environ.get("PYTEST_XDIST_WORKER"):
        d = d.with_name(f"{d.name}-{worker}")
    already_up = _localslurm("status", "--dir", str(d), timeout=30).returncode == 0
    r = _localslurm("up", "--dir", str(d), "--nodes", "4", "--gpus", "8", "--accounting")
    if r.returncode != 0:
        pytest.fail(f"scripts/localslurm.py up --dir {d} failed ({r.returncode}):\n{r.stderr}", pytrace=False)
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("export SLURM_CONF="), r.stdout
    conf = Path(lines[-1].split("=", 1)[1])
    cluster = SlurmCluster(dir=d, conf=conf, env={"SLURM_CONF": str(conf)})

    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if not already_up and os.environ.get("PEARL_TEST_SLURM_KEEP") != "1":
            down = _localslurm("down", "--dir", str(d), "--wipe", timeout=120)
            if down.returncode != 0:
                print(f"localslurm down failed: {down.stderr}", file=sys.stderr)


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The bundled cluster with no job left from an earlier test, before and after this one."""
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()


@contextlib.contextmanager
def spec_run(
    cluster: SlurmCluster, state_dir: Path, prefix: str, spec: Callable[[Path], str]
) -> Iterator[tuple[object, Path]]:
    """A run spec on the cluster, not launched yet: ``(pearlctl, dir)`` with ``dir/run.toml`` = ``spec(dir /
    "run")`` in a fresh shared directory, and ``pearlctl`` a CLI on state under ``state_dir``. Before and
    after, every job is cancelled; after, the run's daemon is stopped too. A test that fails prints the end of
    each of the run's logs (its captured output)."""
    from pearlctl.host.runfiles import read_address
    from tests.conftest import Pearlctl, alive

    cluster.cancel_all()
    d = cluster.new_shared_dir(prefix)
    (d / "run.toml").write_text(spec(d / "run"))
    try:
        yield Pearlctl(state_dir, cluster.env), d
    except BaseException:
        _print_log_tails(d / "run")  # the shared directory goes when the cluster is wiped: say what it held
        raise
    finally:
        address = read_address(d / "run")
        if address and alive(address["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(address["pid"], signal.SIGTERM)
        cluster.cancel_all()


def _print_log_tails(run_dir: Path, lines: int = 60) -> None:
    """The last ``lines`` lines of each log of a run (its logs/ and its trainer's train.jsonl), to stdout."""
    for path in sorted([*run_dir.glob("logs/*.log"), *run_dir.glob("trainer/*.jsonl")]):
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- {path} (last {len(tail)} lines) -----", *tail, sep="\n")
