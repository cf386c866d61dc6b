"""`pearlctl doctor` against the real local cluster: the Slurm settings preemption handling needs, read from
`scontrol show config` and `scontrol show partition`. The bundled cluster (scripts/localslurm.py) has them
all: SlurmctldParameters=preempt_send_user_signal, PreemptType=preempt/partition_prio,
PreemptMode=REQUEUE (debug and high override it with OFF), and GraceTime=10 on the partition preempt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tests.conftest import Pearlctl

if TYPE_CHECKING:  # the fixture's type; conftest is not importable as a module
    from conftest import SlurmCluster


def test_doctor_reports_the_bundled_clusters_preemption_settings(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    pearlctl = Pearlctl(tmp_path / "state", env=slurm_cluster.env)
    out = pearlctl("doctor", "--json", check=None)
    checks = {c["name"]: c for c in json.loads(out.stdout)}

    assert checks["slurmctld"]["status"] == "ok", checks
    assert checks["preempt signal"] == {
        "name": "preempt signal",
        "status": "ok",
        "detail": "SlurmctldParameters=preempt_send_user_signal",
    }
    assert checks["preempt type"]["status"] == "ok"
    assert checks["preempt type"]["detail"] == "PreemptType=preempt/partition_prio"
    mode = checks["preempt mode"]
    assert mode["status"] == "ok"
    assert mode["detail"].startswith("PreemptMode=REQUEUE cluster-wide; partitions that override it:")
    assert "debug (OFF)" in mode["detail"] and "high (OFF)" in mode["detail"]
    assert "preempt " not in mode["detail"].split(":", 1)[1]  # preempt and preempt0 requeue: no override
    grace = checks["grace time"]
    assert grace["status"] == "ok"
    assert "debug 0 s, preempt 10 s, preempt0 0 s, high 0 s" in grace["detail"]
    assert "preempt_notice_s (default 60) must not exceed its partition's GraceTime" in grace["detail"]
    assert "slurm config" not in checks  # SLURM_CONF points at the cluster
    # warnings never fail doctor: exit 6 only for a failing check
    assert (out.returncode == 6) == any(c["status"] == "fail" for c in checks.values()), out.stderr
