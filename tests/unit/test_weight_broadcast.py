"""The cross-node weight path without vLLM: the sender (pearlctl.trainer.broadcast) against a stand-in server
that answers vLLM's weight-update routes and receives over a real gloo group; the server flags that give a
vLLM server the receiver; and the agent's sync_weights adopting a broadcast version instead of reloading.
The same path with a real vLLM server: tests/engines/test_weight_transfer_engine.py."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pearlctl.agent.engines import EngineError
from pearlctl.trainer.broadcast import BACKEND, GROUP_PREFIX, GlooWeightSender, TransferError, server_engine_args


class StandInServer:
    """Answers the routes a vLLM server with the ``pearl_gloo`` receiver answers, and receives like it does:
    ``/init_weight_transfer_engine`` joins the group at its rank, ``/update_weights`` takes each broadcast."""

    def __init__(self, backend: str | None = BACKEND):
        self.backend = backend
        self.calls: list[str] = []
        self.received: dict = {}
        self.version: str | None = None
        self.group = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                route, _, query = self.path.strip("/").partition("?")
                if route == "pause":
                    assert query == "mode=keep"  # frozen, not aborted
                outer.calls.append(route)
                out = getattr(outer, route)(body)
                data = json.dumps(out or {}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def collective_rpc(self, body):
        assert body["method"] == "pearl_weight_transfer_info"
        return {"results": [{"backend": self.backend}]}

    def init_weight_transfer_engine(self, body):
        import torch.distributed as dist

        info = body["init_info"]
        timeout = timedelta(seconds=info["timeout_s"])
        store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"], False, timeout=timeout)
        self.rank = info["rank_offset"]
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(GROUP_PREFIX, store), self.rank, info["world_size"], timeout
        )

    def pause(self, body):
        pass

    def resume(self, body):
        pass

    def start_weight_update(self, body):
        pass

    def update_weights(self, body):
        import torch
        import torch.distributed as dist

        info = body["update_info"]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
            buf = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast([buf], opts).wait()
            self.received[name] = buf

    def finish_weight_update(self, body):
        self.version = body["weight_version"]

    def shutdown_weight_transfer_engine(self, body):
        self.group = None

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_sender_broadcasts_every_tensor_to_every_worker_through_the_update_routes_then_names_the_version():
    import torch

    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 16, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16),
        "model.norm.weight": torch.randn(16).t(),
        "lm_head.weight": torch.randn(64, 16)[:, ::2],  # not contiguous: sent as its values
    }
    workers = [StandInServer(), StandInServer()]
    try:
        with GlooWeightSender([w.url for w in workers], master_address="127.0.0.1", timeout_s=30) as sender:
            stats = sender.send(tensors, "7")
        for rank, w in enumerate(workers, start=1):
            assert w.rank == rank
            expected = [
                "collective_rpc",
                "init_weight_transfer_engine",
                "pause",
                "start_weight_update",
                "update_weights",
                "finish_weight_update",
                "resume",
                "shutdown_weight_transfer_engine",
            ]
            assert w.calls == expected
            assert w.version == "7"
            assert list(w.received) == list(tensors)
            for name, t in tensors.items():
                assert w.received[name].dtype == t.dtype and torch.equal(w.received[name], t)
        assert stats["tensors"] == 4 and stats["workers"] == 2
        assert stats["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    finally:
        for w in workers:
            w.close()


def test_the_sender_refuses_a_server_without_the_receiver_before_any_rendezvous():
    plain = StandInServer(backend=None)
    try:
        sender = GlooWeightSender([plain.url], master_address="127.0.0.1", timeout_s=5)
        with pytest.raises(TransferError, match="not pearl_gloo"):
            sender.connect()
        assert plain.calls == ["collective_rpc"]
    finally:
        plain.close()


def test_server_engine_args_give_a_vllm_server_the_receiver():
    from pearlctl.agent.engines.vllm import VllmServer

    srv = VllmServer(
        "/models/tiny", port=8100, role="ROLLOUT", gpus=[], engine_args=server_engine_args(), log_path=Path("/x.log")
    )
    argv = srv.command()
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend":"pearl_gloo"}'
    extension = argv[argv.index("--worker-extension-cls") + 1]
    module, _, name = extension.rpartition(".")
    assert (Path(__file__).parents[2] / (module.replace(".", "/") + ".py")).read_text().count(f"class {name}:") == 1


class LabelledServer:
    """A worker's server seam: the label the server reports, its receiver's state, and what it was asked."""

    def __init__(self, label: str | None, *, update_active: bool = False, paused: bool = False):
        self.label = label
        self.update_active = update_active
        self.paused = paused
        self.reloaded: list[str] = []
        self.asked = 0
        self.calls: list[str] = []

    def _json(self, method, path, body=None, timeout=None):
        assert (method, path, body["method"]) == ("POST", "/collective_rpc", "pearl_weight_transfer_info")
        if self.label is None:
            raise EngineError("POST /collective_rpc: no answer")
        return {"results": [{"backend": BACKEND, "update_active": self.update_active}]}

    def _call(self, method, path, body=None, timeout=None):
        assert (method, path) == ("POST", "/finish_weight_update")
        assert self.update_active, "finish only a session a sender left open"
        self.update_active = False
        self.calls.append("finish")

    def is_paused(self):
        return self.paused

    def resume(self):
        assert self.reloaded, "resumed before the version was reloaded"
        self.paused = False
        self.calls.append("resume")

    def weight_version(self):
        self.asked += 1
        if self.label is None:
            raise EngineError("GET /weight_info: no answer")
        return self.label

    def reload_weights(self, path):
        assert not self.update_active, "vLLM's reload fails while a weight update is open"
        self.reloaded.append(str(path))
        self.calls.append("reload")
        return 0.01

    def set_weight_version(self, version):
        self.label = version


def worker(tmp_path, monkeypatch, engine_args):
    from pearlctl.agent.identity import Identity
    from pearlctl.agent.workers import VllmWorker

    monkeypatch.setenv("PEARL_ENGINE_DEVICE", "cpu")
    monkeypatch.setenv("PEARL_SHM_DIR", str(tmp_path / "shm"))
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="7", task_id=0, node="n9", gpus=(0,), restarts=0)
    w = VllmWorker("rollout-0", "ROLLOUT", (0,), me, str(tmp_path), "/models/tiny", engine_args)
    w.state = lambda: "READY"
    return w


def test_a_worker_adopts_a_version_the_trainer_broadcast_and_reloads_any_other_from_disk(tmp_path, monkeypatch):
    w = worker(tmp_path, monkeypatch, server_engine_args())
    assert w.receives_broadcast
    w.server = LabelledServer("3")  # the trainer's /finish_weight_update named version 3
    w.sync_weights({"version": "3", "path": str(tmp_path / "disk" / "3")})
    assert w.server.reloaded == [] and w.weight_version == "3"
    w.sync_weights({"version": "4", "path": str(tmp_path / "disk" / "4")})  # not broadcast (or not finished)
    assert w.server.reloaded == [str(tmp_path / "disk" / "4")] and w.weight_version == "4"
    w.server.label = None  # the label cannot be read: the file path, not a guess
    w.sync_weights({"version": "5", "path": str(tmp_path / "disk" / "5")})
    assert w.server.reloaded[-1] == str(tmp_path / "disk" / "5") and w.weight_version == "5"


def test_a_worker_without_the_receiver_never_asks_its_server_for_a_pushed_version(tmp_path, monkeypatch):
    w = worker(tmp_path, monkeypatch, {})
    assert not w.receives_broadcast
    w.server = LabelledServer("3")
    w.sync_weights({"version": "3", "path": str(tmp_path / "disk" / "3")})
    assert w.server.asked == 0 and w.server.reloaded == [str(tmp_path / "disk" / "3")]


def test_after_a_broadcast_that_failed_a_worker_finishes_the_open_update_reloads_from_disk_and_resumes(
    tmp_path, monkeypatch
):
    w = worker(tmp_path, monkeypatch, server_engine_args())
    # the sender died between /start_weight_update and /finish_weight_update: old label, paused, update open
    w.server = LabelledServer("3", update_active=True, paused=True)
    w.weight_version = "3"
    w.sync_weights({"version": "4", "path": str(tmp_path / "disk" / "4")})
    assert w.server.calls == ["finish", "reload", "resume"]
    assert w.server.reloaded == [str(tmp_path / "disk" / "4")] and w.server.label == "4" and not w.server.paused
    # receiving failed inside the worker (the receiver closed the update itself): reload, then resume
    w.server = LabelledServer("4", paused=True)
    w.sync_weights({"version": "5", "path": str(tmp_path / "disk" / "5")})
    assert w.server.calls == ["reload", "resume"]
    # a worker that is not paused is not resumed
    w.server = LabelledServer("5")
    w.sync_weights({"version": "6", "path": str(tmp_path / "disk" / "6")})
    assert w.server.calls == ["reload"]
