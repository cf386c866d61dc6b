"""State-file faults and closed pipes, through the real CLI: one line saying what is wrong, never a traceback.

A corrupted state file, a read-only state directory and a full disk each exit 8 (docs/cli.md) with the
path and what to do; read commands (`status`, `journal`) still read a read-only or full state. A reader
that closes stdout early (`pearlctl status --json | head -1`) stops the command quietly with 141.

The read-only directory is a read-only bind mount and the full disk a small tmpfs: tests run as root,
where chmod does not stop writes. Both are skipped where mounting is not allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pearlctl.state.store import Store
from tests import factories
from tests.conftest import REPO, Pearlctl, assert_quiet_on_broken_pipe, write_spec

EXIT_USAGE, EXIT_STATE, EXIT_BROKEN_PIPE = 2, 8, 141


def create_run(state_dir: Path, run_dir: Path, *, nodes: int = 1, active: bool = False) -> None:
    """Run "r" on the local backend: one rollout pool of ``nodes`` allocations, polled every second."""
    with Store.open(state_dir / "state.db") as store:
        spec = {"poll_interval_s": 1, "router": {"enabled": False}}
        pools = [factories.pool("rollout", "ROLLOUT", nodes=nodes, gpus_per_node=0)]
        factories.create_run(store, run_dir, pools, spec=spec, spec_path="r.toml", backend="local")
        if active:
            for to in ("SUBMITTING", "ACTIVE"):
                run = store.runs.get("r")
                store.set_state("runs", "r", expect=run["state"], expect_version=run["version"], to=to, event="t")


def assert_clean_failure(proc: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def mount(*args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")


def umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def refuses_writes(directory: Path) -> bool:
    try:
        (directory / "probe").write_text("x")
    except OSError:
        return True
    (directory / "probe").unlink()
    return False


# --- a corrupted state file -----------------------------------------------------------------------------


def test_a_state_file_overwritten_with_garbage(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    db = state / "state.db"
    db.write_bytes(b"this is not a database\n" * 200)
    pearlctl = Pearlctl(state)
    for args in (["status"], ["status", "r", "--json"], ["journal", "r"], ["cancel", "r"]):
        proc = pearlctl(*args, check=None)
        assert_clean_failure(proc, EXIT_STATE, str(db), "not a pearlctl state database", "mv ")
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line
    assert db.read_bytes().startswith(b"this is not a database")  # left as it was


# --- a read-only state directory ------------------------------------------------------------------------


@pytest.fixture
def readonly_state(tmp_path):
    """A state directory holding run "r" (ACTIVE, a poll due), then mounted read-only over itself."""
    state = tmp_path / "state"
    state.mkdir()
    create_run(state, tmp_path / "run", active=True)
    mount("--bind", str(state), str(state))
    try:
        mount("-o", "remount,bind,ro", str(state))
        assert refuses_writes(state), "the read-only bind mount accepted a write"
        yield state
    finally:
        umount(state)


def test_reads_work_on_a_read_only_state_directory_and_say_why_nothing_is_refreshed(readonly_state):
    pearlctl = Pearlctl(readonly_state)
    proc = pearlctl("status", "r", "--json", check=None)
    assert_clean_failure(proc, 0, "warning: not refreshing", "read-only", str(readonly_state))
    assert json.loads(proc.stdout)["run"]["id"] == "r"
    proc = pearlctl("status", "r", "--no-sync", check=None)
    assert_clean_failure(proc, 0)
    assert "warning" not in proc.stderr  # nothing to refresh, nothing to say
    proc = pearlctl("journal", "r", "--json", check=None)
    assert_clean_failure(proc, 0)
    assert json.loads(proc.stdout)


def test_writes_to_a_read_only_state_directory_exit_8_naming_it(readonly_state, tmp_path):
    pearlctl = Pearlctl(readonly_state)
    proc = pearlctl("cancel", "r", "--timeout", "5", check=None)
    assert_clean_failure(proc, EXIT_STATE, str(readonly_state), "read-only", "PEARL_STATE_DIR")
    # a state directory that does not exist yet, under a read-only one
    proc = Pearlctl(readonly_state / "sub")("cancel", "r", check=None)
    assert_clean_failure(proc, EXIT_STATE, str(readonly_state), "PEARL_STATE_DIR")


def test_a_read_only_state_file_in_a_writable_directory(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    create_run(state, tmp_path / "run", active=True)
    db = state / "state.db"
    mount("--bind", str(db), str(db))
    try:
        mount("-o", "remount,bind,ro", str(db))
        proc = Pearlctl(state)("cancel", "r", "--timeout", "5", check=None)
        assert_clean_failure(proc, EXIT_STATE, str(db), "read-only")
        proc = Pearlctl(state)("status", "r", "--no-sync", "--json", check=None)
        assert_clean_failure(proc, 0)
    finally:
        umount(db)


# --- a full disk ----------------------------------------------------------------------------------------


@pytest.fixture
def full_state(tmp_path):
    """A 1 MiB tmpfs as the state directory, holding run "r" (ACTIVE, a poll due), then filled up."""
    state = tmp_path / "state"
    state.mkdir()
    mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(state))
    try:
        create_run(state, tmp_path / "run", active=True)
        subprocess.run(["dd", "if=/dev/zero", f"of={state / 'filler'}", "bs=4k"], capture_output=True)
        assert os.statvfs(state).f_bavail == 0
        yield state
    finally:
        umount(state)


def test_a_full_disk_exits_8_on_write_and_still_reads(full_state, tmp_path, model_dir):
    pearlctl = Pearlctl(full_state)
    spec = write_spec(
        tmp_path / "f.toml",
        name="f",
        model=model_dir,
        run_dir=tmp_path / "frun",
        backend="local",
        pools="[pools.trainer]\nnodes = 1\ngpus_per_node = 1\n[pools.rollout]\nnodes = 1\ngpus_per_node = 0\n",
    )
    proc = pearlctl("launch", str(spec), check=None)
    assert_clean_failure(proc, EXIT_STATE, str(full_state), "full", "free space")
    proc = pearlctl("status", "r", "--json", check=None)
    assert_clean_failure(proc, 0, "warning: not refreshing", "full")
    assert json.loads(proc.stdout)["run"]["id"] == "r"


def test_a_full_disk_with_no_state_yet(tmp_path, model_dir):
    state = tmp_path / "state"
    state.mkdir()
    mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(state))
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={state / 'filler'}", "bs=4k"], capture_output=True)
        proc = Pearlctl(state / "sub")("cancel", "r", check=None)
        assert_clean_failure(proc, EXIT_STATE, str(state), "full")
    finally:
        umount(state)


# --- stdout closed by its reader ------------------------------------------------------------------------


@pytest.fixture
def big_run(tmp_path) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    create_run(state, tmp_path / "run", nodes=1000)  # documents far larger than a pipe's buffer
    return state


@pytest.mark.parametrize(
    "command", ["status r --json --no-sync", "status r --no-sync", "journal r", "journal r --json"]
)
@pytest.mark.parametrize("unbuffered", [False, True])
def test_output_piped_into_head_stops_quietly(big_run, command, unbuffered):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PEARL_STATE_DIR"] = str(big_run)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    cmd = f"set -o pipefail; {sys.executable} -m pearlctl {command} | head -1"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert len(proc.stdout.splitlines()) == 1
    assert proc.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    # 141, as a shell reports SIGPIPE; unbuffered, CPython may drop the rest of one large write silently: 0
    assert proc.returncode == EXIT_BROKEN_PIPE or (unbuffered and proc.returncode == 0), proc.returncode


def test_watch_stops_quietly_when_the_reader_goes_away(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    create_run(state, tmp_path / "run")
    env = {**os.environ, "PEARL_STATE_DIR": str(state)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pearlctl", "status", "r", "--watch", "--json", "--no-sync"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        first = proc.stdout.readline()
        assert json.loads(first)["run"]["id"] == "r"
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    # the reader goes away; the next refresh (1 s) writes into a closed pipe
    assert_quiet_on_broken_pipe(proc, 30, EXIT_BROKEN_PIPE)


# --- the daemon's own sbatch options --------------------------------------------------------------------


@pytest.mark.parametrize(
    "option,value",
    [
        ("--partition", "debug\necho pwned"),
        ("--nodelist", "gpu1\n#SBATCH --x"),
        ("--nodelist", "gpu1;rm"),
        ("--time", "10\n"),
        ("--time", "99999999"),
    ],
)
def test_daemon_slurm_options_are_validated(tmp_path, option, value):
    proc = Pearlctl(tmp_path / "state")("daemon", "r", "--slurm", option, value, check=None)
    assert_clean_failure(proc, EXIT_USAGE, option)
    assert not (tmp_path / "state").exists()  # refused before the state was opened


def test_daemon_accepts_a_hostlist(tmp_path):
    # valid options get past validation: the run is then looked up (none here: exit 4)
    proc = Pearlctl(tmp_path / "state")(
        "daemon", "r", "--slurm", "--partition", "debug", "--nodelist", "gpu[1-3],head", "--time", "1-00:00", check=None
    )
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["bogus", "gpu2:0"], ["KIND 'bogus'", "start, wake, retire, switch"]),
        (["retire", "gpu2"], ["GPU 'gpu2'", "NODE:INDEX"]),
        (["switch", "gpu2:0", "--role", "TRAIN"], ["--role 'TRAIN'", "ROLLOUT, PREFILL, DECODE"]),
    ],
)
def test_move_with_bad_arguments_exits_2_naming_what_would_be_right(tmp_path, args, words):
    state_dir = tmp_path / "state"
    create_run(state_dir, tmp_path / "run")
    proc = Pearlctl(state_dir)("move", "r", *args, check=None)
    assert_clean_failure(proc, EXIT_USAGE, *words)
