"""`pearlctl status RUN --timeline FILE.png` on the local backend: a PNG of the run's GPU roles from its journal."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import write_spec

PNG = b"\x89PNG\r\n\x1a\n"
POOLS = """
[pools.trainer]
nodes = 1
gpus_per_node = 1
[pools.rollout]
nodes = 1
gpus_per_node = 0
"""


def test_status_draws_the_runs_timeline_and_names_it_in_the_json(pearlctl, tmp_path, model_dir):
    path = write_spec(
        tmp_path / "tl.toml", name="tl", model=model_dir, run_dir=tmp_path / "run", pools=POOLS, backend="local"
    )
    pearlctl("launch", str(path), "--wait", "--timeout", "60", "--json")
    try:
        png = tmp_path / "out" / "roles.png"
        doc = json.loads(pearlctl("status", "tl", "--timeline", str(png), "--json").stdout)
        assert doc["timeline"] == str(png) and doc["run"]["name"] == "tl"
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 1000
        text = pearlctl("status", "tl", "--timeline", str(tmp_path / "again.png"), "--no-sync").stdout
        assert f"timeline: {tmp_path / 'again.png'}" in text.replace("\n", "")
        bad = pearlctl("status", "tl", "--timeline", str(tmp_path / "roles.svg"), check=2)
        assert "--timeline must name a .png file" in bad.stderr and not (tmp_path / "roles.svg").exists()
    finally:
        pearlctl("cancel", "tl")
    # an ended run: drawn up to its end
    ended = tmp_path / "ended.png"
    doc = json.loads(pearlctl("status", "tl", "--timeline", str(ended), "--json").stdout)
    assert doc["run"]["state"] == "CANCELLED" and Path(doc["timeline"]).read_bytes()[:8] == PNG
