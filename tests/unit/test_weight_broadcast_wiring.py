"""The opt-in broadcast of each weight version in a run (docs/weights.md, "In a run"): the spec setting
``[pools.<pool>] weights``, what the launcher gives the workers and the trainer for it, the daemon's choice of
targets (``GET /v1/weights/targets``, from a real SQLite state and through the real app), the trainer channel's
ask, and the trainer's send from ``export_weights`` with its fallback when the send fails. Fakes only at the
HTTP seam: the workers are stand-in servers that receive over a real gloo group (test_weight_broadcast.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearlctl.config import SpecError, load_spec
from pearlctl.daemon.weights import broadcast_targets
from pearlctl.ops.launcher import grow_request, requests_for
from pearlctl.slurm.script import worker_env
from pearlctl.state.store import Store
from pearlctl.trainer.broadcast import BROADCAST_ENV, WeightBroadcaster, server_engine_args
from pearlctl.trainer.channel import DaemonChannel
from tests.conftest import running_pools
from tests.unit.test_trainer_hook_unit import FakeEngine, QueueChannel, TinyModule, hook_for
from tests.unit.test_weight_broadcast import StandInServer

SPEC = """
[run]
name = "b1"
model = "model"
run_dir = "runs/b1"

[pools.trainer]
nodes = 1
gpus_per_node = 1
{trainer}

[pools.rollout]
nodes = 2
gpus_per_node = 0
engine_args = {{ max_model_len = 512 }}
{rollout}

[pools.elastic]
nodes = 1
max_nodes = 2
gpus_per_node = 0
{elastic}
"""


def spec_file(tmp_path: Path, trainer: str = "", rollout: str = "", elastic: str = "") -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "run.toml"
    path.write_text(SPEC.format(trainer=trainer, rollout=rollout, elastic=elastic))
    return path


def problems(tmp_path: Path, **pools: str) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(tmp_path, **pools), ("never",))
    return {p.key: p.message for p in info.value.problems}


# ---------------------------------------------------------------------------------------- the spec setting
def test_weights_is_disk_by_default_and_broadcast_when_asked(tmp_path):
    spec = load_spec(spec_file(tmp_path, rollout='weights = "broadcast"'), ("never",))
    assert spec.pools["rollout"].weights == "broadcast"
    assert spec.pools["elastic"].weights == "disk" and spec.pools["trainer"].weights == "disk"
    assert spec.to_dict()["pools"]["rollout"]["weights"] == "broadcast"  # recorded in runs.spec for the daemon


def test_a_wrong_weights_setting_is_refused_by_name(tmp_path):
    assert "must be one of disk, broadcast" in problems(tmp_path, rollout='weights = "nfs"')["pools.rollout.weights"]
    assert "must be one of" in problems(tmp_path, elastic="weights = true")["pools.elastic.weights"]
    assert "remove it" in problems(tmp_path, trainer='weights = "broadcast"')["pools.trainer.weights"]
    assert "remove it" in problems(tmp_path, trainer='weights = "disk"')["pools.trainer.weights"]
    path = spec_file(tmp_path, rollout='weights = "broadcast"')
    path.write_text(
        path.read_text().replace("max_model_len = 512", 'max_model_len = 512, worker_extension_cls = "my.X"')
    )
    with pytest.raises(SpecError) as info:
        load_spec(path, ("never",))
    clash = {p.key: p.message for p in info.value.problems}
    assert set(clash) == {"pools.rollout.engine_args.worker_extension_cls"}, clash


# ---------------------------------------------------------------------------------------- the launcher
def test_broadcast_gives_the_pools_workers_the_receiver_and_the_trainer_the_switch(tmp_path):
    spec = load_spec(spec_file(tmp_path, rollout='weights = "broadcast"'), ("never",))
    reqs = {r.pool: r for r in requests_for(spec, "b1-0001")}
    assert reqs["rollout"].engine_args == {"max_model_len": 512, **server_engine_args()}
    assert json.loads(worker_env(reqs["rollout"])["PEARL_ENGINE_ARGS"])["weight_transfer_config"] == {
        "backend": "pearl_gloo"
    }
    assert reqs["elastic"].engine_args == {}  # its own setting: disk
    assert worker_env(reqs["trainer"])[BROADCAST_ENV] == "1"
    assert BROADCAST_ENV not in worker_env(reqs["rollout"])
    # a task the daemon adds to a broadcast pool later gets the receiver too (the spec as state recorded it)
    spec2 = load_spec(spec_file(tmp_path, elastic='weights = "broadcast"'), ("never",))
    run = {"id": "b1-0002", "run_dir": str(spec2.run_dir), "spec": spec2.to_dict()}
    assert grow_request(run, "elastic", 1).engine_args == server_engine_args()


def test_without_the_setting_the_launch_is_exactly_as_before(tmp_path):
    spec = load_spec(spec_file(tmp_path), ("never",))
    reqs = {r.pool: r for r in requests_for(spec, "b1-0001")}
    assert reqs["rollout"].engine_args == {"max_model_len": 512}
    assert all(BROADCAST_ENV not in worker_env(r) for r in reqs.values())
    assert all("weight_transfer_config" not in worker_env(r)["PEARL_ENGINE_ARGS"] for r in reqs.values())


# ---------------------------------------------------------------------------------------- the daemon's targets
@pytest.fixture
def state(tmp_path: Path):
    """Trainer on node n0 (a borrowed GPU's vLLM worker runs there too), the broadcast rollout pool on n1 and
    n2, the elastic pool (disk) on n3."""
    spec = {"pools": {"trainer": {}, "rollout": {"weights": "broadcast"}, "elastic": {}}}
    with Store.open(tmp_path / "s.db") as store:
        shapes = (("trainer", "TRAIN", 1, 1), ("rollout", "ROLLOUT", 2, 0), ("elastic", "ROLLOUT", 1, 0))
        workers: dict[str, int] = {}
        for i, a, pool in running_pools(store, tmp_path, shapes, spec=spec):
            if pool == "trainer":
                store.fleet.upsert_node_gpus("r", a.id, "n0", [0], "TRAIN")
            role = "ROLLOUT"
            wid = store.fleet.add_worker(
                run_id="r", allocation_id=a.id, role=role, engine="vllm", url=f"http://n{i}:80"
            )
            store.set_state("workers", wid, expect="STARTING", to="READY", event="t", routable=1)
            workers[f"{pool}{i}"] = wid
        yield store, workers


def test_the_targets_are_the_ready_broadcast_workers_on_nodes_without_a_trainer_rank(state):
    store, workers = state
    answer = broadcast_targets(store, "r")
    assert answer["trainer_nodes"] == ["n0"]
    assert [(t["id"], t["url"]) for t in answer["workers"]] == [
        (workers["rollout1"], "http://n1:80"),
        (workers["rollout2"], "http://n2:80"),
    ]  # not the worker on the trainer's node (it reads the node-local store), not the elastic pool's (disk)
    store.set_state("workers", workers["rollout2"], expect="READY", to="DRAINING", event="t")
    assert [t["id"] for t in broadcast_targets(store, "r")["workers"]] == [workers["rollout1"]]
    store.update_fields("workers", workers["rollout1"], routable=0)
    assert broadcast_targets(store, "r")["workers"] == []


def test_nodes_that_share_a_host_are_told_apart_by_node_name_as_their_stores_are(state):
    """Several slurmd on one machine (the local test cluster): every agent reports the same host, but each node
    has its own node-local store (keyed by node name), so a worker on another node is still a target; the agent's
    host counts only for an allocation with no node name."""
    store, workers = state
    allocations = {a.id: a for a in store.fleet.allocations("r")}
    for a in allocations.values():
        store.update_fields("allocations", a.id, agent_host="same-machine")
    assert [t["id"] for t in broadcast_targets(store, "r")["workers"]] == [workers["rollout1"], workers["rollout2"]]
    rollout2 = next(a for a in allocations.values() if a.node == "n2")
    store.update_fields("allocations", rollout2.id, node=None, agent_host="n0")  # only its host known: n0's
    assert [t["id"] for t in broadcast_targets(store, "r")["workers"]] == [workers["rollout1"]]


def test_the_route_answers_the_targets_through_the_daemons_app(state):
    from starlette.testclient import TestClient

    from pearlctl.api.client import RUN_HEADER
    from pearlctl.daemon.api import build_app
    from pearlctl.daemon.controller import Controller

    store, workers = state
    app = build_app(Controller(store, "r", None), secret="s", status=lambda: {})
    with TestClient(app) as client:
        assert client.get("/v1/weights/targets", headers={RUN_HEADER: "r"}).status_code == 401
        answer = client.get("/v1/weights/targets", headers={RUN_HEADER: "r", "Authorization": "Bearer s"})
    assert answer.status_code == 200
    assert [t["id"] for t in answer.json()["workers"]] == [workers["rollout1"], workers["rollout2"]]


def test_the_channel_asks_the_daemon_and_takes_a_failure_as_no_targets(tmp_path, monkeypatch):
    from pearlctl.api.client import DaemonRefusal

    ch = DaemonChannel(tmp_path, "r", return_file=None, timeout=0.5)
    assert ch.broadcast_targets() == []  # no daemon address: no targets
    calls = []

    def answer(method, path, body=None, **kw):
        calls.append((method, path))
        return {"epoch": 1, "workers": [{"id": 3, "url": "http://n1:80"}, {"id": 4}], "trainer_nodes": []}

    monkeypatch.setattr(ch._client, "try_call", answer)
    assert ch.broadcast_targets() == [{"id": 3, "url": "http://n1:80"}] and calls == [("GET", "/v1/weights/targets")]

    def refuse(method, path, body=None, **kw):
        raise DaemonRefusal("old daemon", 404)

    monkeypatch.setattr(ch._client, "try_call", refuse)
    assert ch.broadcast_targets() == []


# ---------------------------------------------------------------------------------------- the trainer's send
class FailingServer(StandInServer):
    """A worker whose ``/start_weight_update`` fails while ``fail`` is set (the connection is dropped)."""

    fail = True

    def start_weight_update(self, body):
        if self.fail:
            raise RuntimeError("worker gone")


def tiny_hook(tmp_path: Path, channel):
    import torch

    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    engine = FakeEngine()
    engine.module = TinyModule(torch)
    return hook_for(engine, channel=channel, base_model_dir=base)


class TargetChannel(QueueChannel):
    def __init__(self, urls: list[str]):
        super().__init__()
        self.urls = urls
        self.asked = 0

    def broadcast_targets(self) -> list[dict]:
        self.asked += 1
        return [{"id": i, "url": u} for i, u in enumerate(self.urls)]


def test_export_weights_broadcasts_the_version_before_it_is_published(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv(BROADCAST_ENV, "1")
    server = StandInServer()
    try:
        channel = TargetChannel([server.url])
        hook = tiny_hook(tmp_path, channel)
        hook.export_weights(tmp_path / "weights", "5")
        assert server.version == "5" and channel.events == []  # sent, and not yet reported to anyone
        assert torch.equal(server.received["model.norm.weight"], torch.ones(3))
        assert hook.last_export["broadcast"]["sent"] is True and hook.last_export["broadcast"]["workers"] == 1
        assert (tmp_path / "weights" / "5" / "model.safetensors").exists()  # the disk export stays, the fallback
        hook.export_weights(tmp_path / "weights", "6")  # the same group, the next version
        assert server.version == "6" and server.calls.count("init_weight_transfer_engine") == 1
        hook._broadcaster.close()
    finally:
        server.close()


def test_without_the_switch_the_export_asks_nobody(tmp_path, monkeypatch):

    monkeypatch.delenv(BROADCAST_ENV, raising=False)
    channel = TargetChannel(["http://127.0.0.1:9"])
    hook = tiny_hook(tmp_path, channel)
    hook.export_weights(tmp_path / "weights", "1")
    assert channel.asked == 0 and "broadcast" not in hook.last_export


def test_a_failed_send_is_logged_and_the_export_goes_on_and_the_next_version_forms_a_new_group(
    tmp_path, monkeypatch, caplog
):

    monkeypatch.setenv(BROADCAST_ENV, "1")
    good, bad = StandInServer(), FailingServer()
    try:
        channel = TargetChannel([good.url, bad.url])
        hook = tiny_hook(tmp_path, channel)
        with caplog.at_level("WARNING", logger="pearlctl.trainer"):
            out = hook.export_weights(tmp_path / "weights", "1")
        result = hook.last_export["broadcast"]
        assert result["sent"] is False and result["workers"] == 2
        assert result["error"].startswith("send: TransferError")
        assert any("reload it from the node-local store or the disk" in r.getMessage() for r in caplog.records)
        assert out.exists() and hook.weight_version == "1"  # the export is whole: workers reload from it
        assert good.version is None and bad.version is None  # neither was labelled: the agent reloads from disk
        assert good.group is None  # the failed group was shut down on every worker
        bad.fail = False
        hook.export_weights(tmp_path / "weights", "2")
        assert hook.last_export["broadcast"]["sent"] is True
        assert good.version == bad.version == "2" and good.calls.count("init_weight_transfer_engine") == 2
        hook._broadcaster.close()
    finally:
        good.close()
        bad.close()


def test_a_target_without_the_receiver_fails_the_connect_not_the_export():
    server = StandInServer(backend=None)
    try:
        b = WeightBroadcaster(lambda: [{"id": 1, "url": server.url}], timeout_s=10)
        result = b.send({}, "3")
        assert result["sent"] is False and result["error"].startswith("connect: TransferError")
        assert "init_weight_transfer_engine" not in server.calls
        none = WeightBroadcaster(lambda: [], timeout_s=10).send({}, "3")
        assert none == {"version": "3", "sent": False, "workers": 0}

        def broken() -> list[dict]:
            raise OSError("no route")

        assert WeightBroadcaster(broken, timeout_s=10).send({}, "3")["workers"] == 0
    finally:
        server.close()
