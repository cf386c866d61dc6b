"""scripts/localslurm.py gives its daemons ports no outgoing connection can be holding.

The last CI run lost 26 tests to a restarted slurmctld dying with "Address already in use": the cluster kept
the port block of an earlier run, inside the kernel's ephemeral range, and a client connection held one of its
ports as a local port. These tests pin the choice of ports, at the seam of the kernel's range.
"""

from __future__ import annotations

import errno
import importlib.util
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def localslurm(monkeypatch):
    spec = importlib.util.spec_from_file_location("localslurm", REPO / "scripts" / "localslurm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_block_inside_the_ephemeral_range_is_not_usable(localslurm, monkeypatch):
    monkeypatch.setattr(localslurm, "ephemeral_ports", lambda: (32768, 60999))
    assert not localslurm.block_usable(35808, 8)  # the block the failed CI run reused
    assert not localslurm.block_usable(32760, 16)  # straddles the range's start


def test_picked_blocks_lie_outside_the_ephemeral_range(localslurm, monkeypatch):
    monkeypatch.setattr(localslurm, "ephemeral_ports", lambda: (32768, 60999))
    for d in ("/tmp/pearl-slurm-test", "/tmp/pearl-slurm", "/tmp/x", "/srv/cluster-a"):
        base = localslurm.pick_port_block(Path(d), 8)
        assert all(not 32768 <= p <= 60999 for p in range(base, base + 8)), (d, base)


def test_a_held_port_is_skipped(localslurm, monkeypatch):
    monkeypatch.setattr(localslurm, "ephemeral_ports", lambda: (32768, 60999))
    d = Path("/tmp/pearl-slurm-ports-test")
    base = localslurm.pick_port_block(d, 8)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", base + 3))
            s.listen()
        except OSError as exc:  # another process took it since the pick (tests run beside this one): held all the same
            if exc.errno != errno.EADDRINUSE:
                raise
        assert not localslurm.block_usable(base, 8)
        again = localslurm.pick_port_block(d, 8)
    assert not again <= base + 3 < again + 8


def test_a_restart_moves_off_a_block_that_is_no_longer_usable(localslurm, monkeypatch, tmp_path):
    monkeypatch.setattr(localslurm, "ephemeral_ports", lambda: (32768, 60999))
    cluster = localslurm.Cluster(tmp_path / "c")
    cluster.meta_path.parent.mkdir(parents=True)
    cluster.meta_path.write_text('{"nodes": 4, "gpus": 8, "accounting": true, "port_base": 35808}')
    meta = cluster.write_config(4, 8, accounting=False, min_job_age=600)
    assert meta["port_base"] != 35808
    assert all(not 32768 <= p <= 60999 for p in [meta["slurmctld_port"], *meta["slurmd_ports"]])
    again = cluster.write_config(4, 8, accounting=False, min_job_age=600)
    assert again["port_base"] == meta["port_base"]  # a usable block is kept across restarts
