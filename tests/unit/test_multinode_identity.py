"""A trainer of several nodes is one job with one agent per node (pearlctl.slurm.script): who each agent is
(pearlctl.agent.identity), the rendezvous its torchrun gets, the node the watcher binds each allocation to
(pearlctl.ops.watcher.node_of), what the launcher submits and what the spec refuses. Pure, no cluster; the real
cluster runs it in tests/integration/test_multinode_trainer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pearlctl.agent.identity import RDZV_PORT_BASE, RDZV_PORT_SPAN, identity_from_env
from pearlctl.cli.render import slurm_id
from pearlctl.config import SpecError, load_spec
from pearlctl.ops.launcher import requests_for
from pearlctl.ops.watcher import node_of
from pearlctl.slurm.records import JobRecord

GANG_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
    "SLURMD_NODENAME": "gpu7",
    "SLURM_RESTART_COUNT": "2",
}


def test_a_task_of_a_multi_node_job_is_its_node_rank_of_the_jobs_nodes():
    me = identity_from_env(GANG_TASK)
    assert (me.job_id, me.task_id, me.nnodes, me.node, me.rdzv_host) == ("4242", 1, 2, "gpu7", "10.1.2.3")


def test_every_node_of_a_job_gets_the_same_rendezvous_and_its_own_rank():
    envs = [identity_from_env({**GANG_TASK, "SLURM_NODEID": str(r)}).rendezvous_env() for r in (0, 1)]
    assert [e["PET_NODE_RANK"] for e in envs] == ["0", "1"]
    shared = [{k: v for k, v in e.items() if k != "PET_NODE_RANK"} for e in envs]
    assert shared[0] == shared[1]
    assert shared[0]["PET_NNODES"] == "2" and shared[0]["PET_RDZV_BACKEND"] == "c10d"
    host, port = shared[0]["PET_RDZV_ENDPOINT"].rsplit(":", 1)
    assert host == "10.1.2.3" and RDZV_PORT_BASE <= int(port) < RDZV_PORT_BASE + RDZV_PORT_SPAN
    assert shared[0]["PET_RDZV_ID"] == "pearl-4242-2"  # a requeued job rendezvouses afresh


def test_an_array_task_or_a_one_node_job_gets_no_rendezvous():
    array = {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9", "SLURM_NODEID": "0",
             "SLURM_JOB_NUM_NODES": "1"}  # fmt: skip
    me = identity_from_env(array)
    assert (me.job_id, me.task_id, me.nnodes) == ("7", 3, 1) and me.rendezvous_env() == {}
    assert identity_from_env({"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "1"}).rendezvous_env() == {}


def test_the_pools_env_can_name_the_rendezvous_host_and_port():
    me = identity_from_env({**GANG_TASK, "PEARL_RDZV_HOST": "gpu7-ib0", "PEARL_RDZV_PORT": "31000"})
    assert me.rendezvous_env()["PET_RDZV_ENDPOINT"] == "gpu7-ib0:31000"


def test_the_local_backends_nodes_are_ranks_on_this_machine():
    me = identity_from_env({"PEARL_LOCAL_JOB_ID": "local-ab", "PEARL_LOCAL_TASK_ID": "1", "PEARL_LOCAL_NNODES": "3"})
    assert (me.task_id, me.nnodes) == (1, 3)
    assert me.rendezvous_env()["PET_RDZV_ENDPOINT"].startswith("127.0.0.1:")


def test_garbage_in_the_environment_gives_a_one_node_identity_not_a_crash():
    me = identity_from_env({"SLURM_JOB_ID": "1", "SLURM_NODEID": "x", "SLURM_JOB_NUM_NODES": "-3"})
    assert (me.task_id, me.nnodes) == (0, 1)


def test_each_allocation_of_a_multi_node_job_is_bound_to_its_own_node():
    whole = JobRecord(job_id="5", array_task_id=None, state="RUNNING", nodes=("gpu1", "gpu3"))
    assert [node_of(whole, i) for i in (0, 1, 2)] == ["gpu1", "gpu3", None]
    task = JobRecord(job_id="5", array_task_id=1, state="RUNNING", nodes=("gpu2",))
    assert node_of(task, 1) == "gpu2"


SPEC = """
[run]
name = "mn"
model = "{model}"
run_dir = "{run_dir}"
[pools.trainer]
nodes = {nodes}
gpus_per_node = 2
train_command = {train}
[pools.rollout]
nodes = 1
gpus_per_node = 1
"""


def spec(tmp_path: Path, nodes: int, train: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    path = tmp_path / "run.toml"
    path.write_text(SPEC.format(model=tmp_path / "m", run_dir=tmp_path / "run", nodes=nodes, train=train))
    return load_spec(path, ("never",))


def test_the_launcher_submits_a_trainer_of_several_nodes_as_one_job_and_other_pools_as_arrays(tmp_path):
    reqs = {
        r.pool: r for r in requests_for(spec(tmp_path, 2, '["python", "-m", "torch.distributed.run", "t.py"]'), "mn-1")
    }
    assert (reqs["trainer"].gang, reqs["trainer"].array, reqs["trainer"].array_size) == (True, False, 2)
    assert (reqs["rollout"].gang, reqs["rollout"].array) == (False, True)
    one = requests_for(spec(tmp_path, 1, '["python", "t.py"]'), "mn-2")[0]
    assert (one.gang, one.array) == (False, True)  # one node: an array of one task, as before


def test_standalone_torchrun_in_a_trainer_of_several_nodes_is_refused_by_name(tmp_path):
    train = '["python", "-m", "torch.distributed.run", "--standalone", "t.py"]'
    with pytest.raises(SpecError) as err:
        spec(tmp_path, 2, train)
    assert "pools.trainer.train_command" in str(err.value) and "--standalone" in str(err.value)
    spec(tmp_path, 1, train)  # one node: standalone is right


@pytest.mark.parametrize("port", ["80", "70000", "x", "29500 "])
def test_a_rendezvous_port_that_is_no_tcp_port_is_refused_by_name(tmp_path, port):
    path = tmp_path / "run.toml"
    spec(tmp_path, 2, '["python", "t.py"]')  # writes the spec
    path.write_text(
        path.read_text().replace("[pools.rollout]", f'env = {{ PEARL_RDZV_PORT = "{port}" }}\n[pools.rollout]')
    )
    with pytest.raises(SpecError) as err:
        load_spec(path, ("never",))
    assert "pools.trainer.env.PEARL_RDZV_PORT" in str(err.value) and "1024 to 65535" in str(err.value)


def test_status_names_a_node_of_the_multi_node_trainer_by_its_job_and_an_array_task_by_job_and_task():
    pools = [{"name": "trainer", "nodes": 2}, {"name": "rollout", "nodes": 2}]
    node1 = {"pool": "trainer", "job_id": "7", "array_index": 1}
    task1 = {"pool": "rollout", "job_id": "8", "array_index": 1}
    assert slurm_id(node1, pools) == "7"  # `scancel 7_1` names no job: the trainer is not an array
    assert slurm_id(task1, pools) == "8_1"
    assert slurm_id({**node1, "job_id": None}, pools) == "-"
    one = [{"name": "trainer", "nodes": 1}]  # a one-node trainer is an array of one task
    assert slurm_id({**node1, "array_index": 0}, one) == "7_0"
