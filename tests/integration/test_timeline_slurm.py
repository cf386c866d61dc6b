"""`pearlctl status RUN --timeline FILE.png` against the real local Slurm cluster: a small run (no engines),
its GPUs registered from Slurm's GRES detail, drawn from its journal while it runs and after it is cancelled."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import Pearlctl, write_spec

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = """
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 2
[pools.rollout]
partition = "debug"
nodes = 1
gpus_per_node = 2
"""


def test_status_timeline_of_a_slurm_run(tmp_path, cluster, model_dir):
    pc = Pearlctl(tmp_path / "state", cluster.env)
    d = cluster.new_shared_dir("tl")
    path = write_spec(
        d / "tl.toml", name="tl", model=model_dir, run_dir=d / "run", pools=SMALL, backend="slurm", poll=2.0
    )
    pc("launch", str(path), "--wait", "--timeout", "60")
    try:
        png = tmp_path / "roles.png"
        doc = json.loads(pc("status", "tl", "--timeline", str(png), "--json").stdout)
        assert doc["timeline"] == str(png) and png.read_bytes()[:8] == PNG
        assert len([g for g in doc["gpus"] if g["state"] == "UP"]) == 4
    finally:
        pc("cancel", "tl")
    doc = json.loads(pc("status", "tl", "--timeline", str(tmp_path / "ended.png"), "--json").stdout)
    assert doc["run"]["state"] == "CANCELLED" and Path(doc["timeline"]).read_bytes()[:8] == PNG
