"""`pearlctl logs` against the real local Slurm cluster: a launched task's log shows the wrapper's start line,
and `logs -f` marks a requeued task (``scontrol requeue``: Slurm appends to the same %A_%a file)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

from tests.conftest import REPO, Pearlctl, wait_for, write_spec

# elastic is the requeueable pool (#SBATCH --requeue); trainer and rollout are --no-requeue
POOLS = """
[pools.trainer]
partition = "debug"
nodes = 1
gpus_per_node = 1
[pools.elastic]
partition = "preempt"
nodes = 1
gpus_per_node = 1
"""


def test_logs_show_the_start_line_and_follow_marks_a_requeue(tmp_path, slurm_cluster, model_dir):
    slurm_cluster.cancel_all()
    pc = Pearlctl(tmp_path / "state", slurm_cluster.env)
    d = slurm_cluster.new_shared_dir("logs")
    path = write_spec(d / "lg.toml", name="lg", model=model_dir, run_dir=d / "run", pools=POOLS, backend="slurm")
    launched = json.loads(pc("launch", str(path), "--wait", "--timeout", "60", "--json").stdout)
    proc = None
    try:
        shown = wait_for(lambda: "pearl-worker" in (out := pc("logs", "lg", "trainer[0]").stdout) and out, 30)
        assert "start task=" in shown and "restart=0" in shown
        listed = {r["target"] for r in json.loads(pc("logs", "lg", "--json").stdout)}
        assert {"trainer[0]", "elastic[0]"} <= listed

        proc = subprocess.Popen(
            [sys.executable, "-m", "pearlctl", "logs", "lg", "elastic[0]", "-f"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=pc.env,
            cwd=REPO,
        )
        slurm_cluster.run("scontrol", "requeue", f"{launched['job_ids']['elastic']}_0")
        seen, deadline = b"", time.monotonic() + 120
        fd = proc.stdout.fileno()
        while b"==> requeued (restart 1) <==" not in seen and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                seen += os.read(fd, 65536)
        assert b"==> requeued (restart 1) <==" in seen, seen.decode(errors="replace")[-2000:]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        pc("cancel", "lg", check=None)
        slurm_cluster.cancel_all()
