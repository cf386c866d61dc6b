"""The CLI end to end on the local backend: real process groups, real state, no Slurm needed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import alive, write_spec

POOLS = """
[pools.trainer]
nodes = 1
gpus_per_node = 1
[pools.rollout]
nodes = 2
gpus_per_node = 0
"""


def spec(tmp_path: Path, model_dir: Path, name: str = "loc") -> Path:
    return write_spec(
        tmp_path / f"{name}.toml", name=name, model=model_dir, run_dir=tmp_path / "run", pools=POOLS, backend="local"
    )


def agent_pids(run_dir: Path) -> list[int]:
    pids = []
    for log in (run_dir / "logs").glob("*.log"):
        for line in log.read_text().splitlines():
            if line.startswith("{") and json.loads(line)["event"] == "start":
                pids.append(json.loads(line)["pid"])
    return pids


def test_launch_status_cancel_on_the_local_backend(pearlctl, tmp_path, model_dir):
    out = pearlctl("launch", str(spec(tmp_path, model_dir)), "--wait", "--timeout", "60", "--json")
    launched = json.loads(out.stdout)
    assert launched["backend"] == "local" and launched["running"] is True
    doc = pearlctl.json("status", "loc")
    assert set(doc) >= {"run", "pools", "allocations", "gpus", "workers", "transitions"}
    assert doc["run"]["state"] == "ACTIVE"
    assert sorted((a["pool"], a["array_index"], a["state"]) for a in doc["allocations"]) == [
        ("rollout", 0, "RUNNING"),
        ("rollout", 1, "RUNNING"),
        ("trainer", 0, "RUNNING"),
    ]
    assert [(g["pool"], g["role"], g["state"]) for g in doc["gpus"]] == [("trainer", "TRAIN", "UP")]
    # every task's agent really started, with its pool and task id
    deadline = time.time() + 20
    while len(agent_pids(tmp_path / "run")) < 3 and time.time() < deadline:
        time.sleep(0.2)
    pids = agent_pids(tmp_path / "run")
    assert len(pids) == 3 and all(alive(p) for p in pids)

    cancelled = pearlctl("cancel", "loc")
    assert "CANCELLED" in cancelled.stdout
    doc = pearlctl.json("status", "loc")
    assert doc["run"]["state"] == "CANCELLED"
    assert {a["state"] for a in doc["allocations"]} == {"ENDED"}
    assert {a["slurm_state"] for a in doc["allocations"]} == {"CANCELLED"}
    assert not any(alive(p) for p in pids)
    # the journal tells the story in order
    assert pearlctl("launch", str(spec(tmp_path, model_dir)), check=5).returncode == 5


def test_dry_run_prints_scripts_and_writes_nothing(pearlctl, tmp_path, model_dir):
    out = pearlctl("launch", str(spec(tmp_path, model_dir)), "--dry-run")
    assert out.stdout.count("#SBATCH --array=") == 2
    assert "#SBATCH --array=0-1" in out.stdout
    assert not (tmp_path / "state").exists()
    assert not (tmp_path / "run").exists()


def test_dry_run_with_a_model_missing_here_warns_and_prints_while_a_launch_refuses(pearlctl, tmp_path, model_dir):
    """The model may exist only on the compute nodes: --dry-run prints the scripts with a warning naming the path;
    a real launch refuses it (exit 2, naming run.model) and writes nothing."""
    path = spec(tmp_path, model_dir)
    missing = tmp_path / "only-on-the-nodes"
    path.write_text(path.read_text().replace(str(model_dir), str(missing)))
    out = pearlctl("launch", str(path), "--dry-run")
    assert out.stdout.count("#SBATCH --array=") == 2
    assert "warning: run.model" in out.stderr and str(missing) in out.stderr
    out = pearlctl("launch", str(path), check=2)
    assert "run.model" in out.stderr and "does not exist" in out.stderr and out.stdout == ""
    assert not (tmp_path / "state").exists() and not (tmp_path / "run").exists()


def test_bad_spec_exits_2_naming_the_key_and_writes_nothing(pearlctl, tmp_path, model_dir):
    path = spec(tmp_path, model_dir)
    path.write_text(path.read_text().replace("gpus_per_node = 1", "gpus_per_nod = 1"))
    out = pearlctl("launch", str(path), check=2)
    assert "pools.trainer.gpus_per_nod" in out.stderr and "gpus_per_node" in out.stderr
    assert out.stdout == ""
    assert not (tmp_path / "state").exists()


def test_unknown_run_exits_4_and_status_without_runs_says_how_to_start(pearlctl):
    assert "no run 'nope'" in pearlctl("status", "nope", check=4).stderr
    assert "pearlctl launch" in pearlctl("status", check=4).stderr


def test_version_and_doctor(pearlctl):
    assert pearlctl("--version").stdout.startswith("pearlctl ")
    out = pearlctl("doctor", "--json", check=None)
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["policies"]["status"] == "ok"
    assert checks["state file"]["status"] == "ok"
    assert out.returncode in (0, 6)
    assert (out.returncode == 6) == any(c["status"] == "fail" for c in checks.values())


def test_status_watch_json_streams_one_document_per_interval(pearlctl, tmp_path, model_dir):
    import subprocess
    import sys

    pearlctl("launch", str(spec(tmp_path, model_dir, "w")), "--wait", "--timeout", "60")
    try:
        watch = subprocess.Popen(
            [sys.executable, "-m", "pearlctl", "status", "w", "--watch", "--json"],
            stdout=subprocess.PIPE,
            text=True,
            env=pearlctl.env,
        )
        started = time.monotonic()
        lines = [watch.stdout.readline() for _ in range(3)]
        elapsed = time.monotonic() - started
        watch.terminate()
        watch.wait(10)
        docs = [json.loads(line) for line in lines]
        assert all(d["run"]["name"] == "w" and len(d["allocations"]) == 3 for d in docs)
        assert elapsed >= 1.5  # three documents are two poll intervals (1 s each) apart
    finally:
        pearlctl("cancel", "w")
