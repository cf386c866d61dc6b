"""`pearlctl ls [--json]` and `pearlctl cancel RUN --json` end to end on the local backend (real process
groups, real state)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import write_spec

POOLS = """
[pools.trainer]
nodes = 1
gpus_per_node = 1
[pools.rollout]
nodes = 1
gpus_per_node = 0
"""

FIELDS = {"id", "name", "state", "backend", "policy", "created_at", "updated_at", "run_dir", "spec_path"}


def launch(pearlctl, tmp_path: Path, model_dir: Path, name: str) -> dict:
    path = write_spec(
        tmp_path / f"{name}.toml", name=name, model=model_dir, run_dir=tmp_path / name, pools=POOLS, backend="local"
    )
    return json.loads(pearlctl("launch", str(path), "--json").stdout)


def test_ls_without_runs_exits_0_with_an_empty_list_and_says_how_to_start_one(pearlctl, tmp_path):
    assert json.loads(pearlctl("ls", "--json").stdout) == []
    plain = pearlctl("ls")
    assert plain.stdout.strip() == "no runs yet; start one with `pearlctl launch RUN.toml`"
    assert not (tmp_path / "state").exists()  # a read: no state file is created


def test_ls_lists_every_run_and_cancel_json_prints_one_object(pearlctl, tmp_path, model_dir):
    first = launch(pearlctl, tmp_path, model_dir, "one")
    second = launch(pearlctl, tmp_path, model_dir, "two")
    try:
        runs = json.loads(pearlctl("ls", "--json").stdout)
        assert [set(r) for r in runs] == [FIELDS, FIELDS]
        assert [(r["id"], r["name"], r["backend"], r["run_dir"]) for r in runs] == [
            (first["run_id"], "one", "local", str(tmp_path / "one")),
            (second["run_id"], "two", "local", str(tmp_path / "two")),
        ]
        assert {r["state"] for r in runs} <= {"SUBMITTING", "ACTIVE"}
        assert runs[0]["created_at"] <= runs[1]["created_at"]
        plain = pearlctl("ls").stdout
        header = plain.splitlines()[0].split()
        assert header == ["id", "name", "state", "backend", "policy", "created", "run_dir"]
        assert "one" in plain and "two" in plain and str(tmp_path / "two") in plain

        cancelled = pearlctl("cancel", "one", "--json")
        assert json.loads(cancelled.stdout) == {
            "id": first["run_id"],
            "name": "one",
            "state": "CANCELLED",
            "all_ended": True,
        }
        states = {r["name"]: r["state"] for r in json.loads(pearlctl("ls", "--json").stdout)}
        assert states["one"] == "CANCELLED" and states["two"] != "CANCELLED"
        assert pearlctl("cancel", "nope", "--json", check=4).stdout == ""
    finally:
        pearlctl("cancel", "two", check=None)
        pearlctl("cancel", "one", check=None)
