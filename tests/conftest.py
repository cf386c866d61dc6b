"""Shared test helpers: run the real `pearlctl` command in a subprocess with its own state directory.

The suite runs on three pytest-xdist workers (``-n 3 --dist loadgroup``, in scripts/test), two of them each running
one chain of tests in order (`pytest_xdist_make_scheduler`, `chain_of`):

- the *engine* chain: every test under tests/engines and the integration tests that serve with real vLLM workers
  (``REAL_ENGINES``) — engines on a 2-core machine must not overlap one another;
- the *control* chain: the other integration tests and the paced cases of tests/engines (a parameter id that
  starts ``paced-``) — the local Slurm cluster and the control plane with paced engines (docs/paced.md) or none,
  and at most a DeepSpeed trainer of the tiny model, mostly waiting on Slurm's and the control plane's timers.

Each chain's worker brings up a Slurm cluster of its own (tests/integration/conftest.py). The third worker takes
the rest. The engine chain is the wall time and runs at the normal CPU priority, the control chain at ``nice`` 5 and
the rest at ``nice`` 10 (their subprocesses too): the overlap is paid by what waits most. ``-n 0`` runs everything
in one process. (Engines and Slurm split by folder, tests/engines against tests/integration, were tried as two
chains: both then started real engines, and each ran about 1.6 times slower beside the other.)

Environment: whatever importing the test modules changed in ``os.environ`` is put back once collection ends
(`pytest_collection_finish`). ``import trl`` sets ``VLLM_LOGGING_LEVEL=ERROR`` in the importing process, and
every vLLM server a test started afterwards would inherit it and log nothing at INFO: the tests that read
what a server logged would then fail only when a TRL test module was collected in the same process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pearlctl.host.processes import process_alive as alive  # noqa: F401  (tests import it from here)
from pearlctl.state.rows import Allocation
from tests import factories

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny.toml"


class Pearlctl:
    def __init__(self, state_dir: Path, env: dict[str, str] | None = None):
        self.env = {**os.environ, "PEARL_STATE_DIR": str(state_dir), **(env or {})}

    def __call__(self, *args: str, check: int | None = 0, timeout: float = 180) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "pearlctl", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=REPO,
        )
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "--json").stdout)


class FakeClock:
    """A clock for state, controllers and executors in unit tests: reads ``now``, moved by hand."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def running_run(store, run_dir: Path, *, pool: str, role: str, nodes: int) -> None:
    """Run "r" (Slurm backend, policy never) with one pool of ``nodes`` tasks of one GPU in ``role``, every task
    RUNNING (job 10 + i on node n{i}) with its GPU registered."""
    factories.create_run(store, run_dir, [factories.pool(pool, role, nodes=nodes)])
    for i, a in enumerate(factories.run_all(store)):
        store.fleet.upsert_node_gpus("r", a.id, f"n{i}", [0], role)


def running_pools(store, run_dir: Path, shapes, *, spec: dict | None = None):
    """Run "r" of pools ``shapes`` ((name, role, nodes, gpus_per_node), ...) with every allocation RUNNING, the
    i-th on node ``n<i>`` as Slurm job ``10 + i``; yields ``(i, allocation, pool name)`` for each, in order."""
    pools = [factories.pool(n, role, nodes=k, gpus_per_node=g) for n, role, k, g in shapes]
    factories.create_run(store, run_dir, pools, spec=spec)
    names = {p["id"]: p["name"] for p in store.runs.pools("r")}
    for i, a in enumerate(factories.run_all(store)):
        yield i, a, names[a.pool_id]


def assert_quiet_on_broken_pipe(proc: subprocess.Popen, timeout: float, exit_code: int) -> None:
    """Close ``proc``'s stdout (its reader goes away) and check that it exits ``exit_code``, with no traceback."""
    try:
        proc.stdout.close()
        code = proc.wait(timeout=timeout)
        stderr = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == exit_code, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def create_serving_run(store, run_dir: Path, *, run_id: str = "q") -> None:
    """Run ``run_id`` (Slurm backend, policy never): a trainer pool of 2 GPUs on node n1 and a rollout pool of
    one GPU on node n2, each GPU registered in its pool's role — for tests that need a serving worker."""
    pools = [factories.pool(name, role, gpus_per_node=n, run_id=run_id)
             for name, role, n in (("trainer", "TRAIN", 2), ("rollout", "ROLLOUT", 1))]  # fmt: skip
    factories.create_run(store, run_dir, pools, run_id=run_id)
    placed = [("n1", [0, 1], "TRAIN"), ("n2", [0], "ROLLOUT")]
    for a, (node, idx, role) in zip(store.fleet.allocations(run_id), placed, strict=True):
        store.fleet.upsert_node_gpus(run_id, a.id, node, idx, role)


def create_trainer_run(store, run_dir: Path, *, job_id: str) -> Allocation:
    """Run "r" (policy greedy) with one trainer allocation of 2 GPUs, submitted as ``job_id`` (PENDING)."""
    pools = [factories.pool("trainer", "TRAIN", gpus_per_node=2)]
    factories.create_run(store, run_dir, pools, spec_path="r.toml", policy="greedy")
    alloc = store.fleet.allocations("r")[0]
    factories.submit(store, alloc.id, job_id)
    return store.fleet.allocation(alloc.id)


GRPO_EXAMPLE = REPO / "examples" / "grpo"


def load_example(name: str, path: Path):
    """A script of examples/ (not a package) imported as module ``name``: each test file its own copy."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class CharTokenizer:
    """A stand-in tokenizer for the rollout driver's environment text: one id per character (3 + its code
    modulo 100); ``<|im_end|>``, the end of a turn, is 2."""

    eos_token_id = 2

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + ord(ch) % 100 for ch in text]}


def wait_for(fn, timeout: float, every: float = 0.5):
    """Call ``fn`` until it returns something truthy (returned) or ``timeout`` seconds pass (AssertionError
    naming the caller's line and what ``fn`` last returned)."""
    import sys
    import time

    started = time.monotonic()
    deadline = started + timeout
    value = None
    while time.monotonic() < deadline:
        value = fn()
        if value:
            _trace_wait(started)
            return value
        time.sleep(every)
    caller = sys._getframe(1)
    raise AssertionError(
        f"condition at {caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno} not met within {timeout}s "
        f"(it last returned {value!r:.300})"
    )


def _trace_wait(started: float) -> None:
    """With PEARL_TEST_TRACE=FILE, append where each wait_for was called and how long it waited: where a slow
    test spends its time."""
    import sys
    import time

    if trace := os.environ.get("PEARL_TEST_TRACE"):
        caller = sys._getframe(2)
        with open(trace, "a") as f:
            print(
                f"{time.strftime('%H:%M:%S')} {caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno} "
                f"waited {time.monotonic() - started:.1f}s",
                file=f,
            )


SERIAL = ("tests/engines/", "tests/integration/")  # node ids of the tests that run in the two chains, in order
# integration tests that serve with real vLLM workers: in the engine chain, with tests/engines. (Those whose only
# real engine is a DeepSpeed trainer of the tiny model — the 2-node trainer, the return guarantee — run in the
# control chain: their ranks mostly wait for batches.)
REAL_ENGINES = (
    "tests/integration/test_borrow_e2e.py",
    "tests/integration/test_submitit_slurm.py::test_profile_on_a_slurm_node_starts_vllm_measures_and_stores",
    "tests/integration/test_weight_broadcast_slurm.py",
)
# the last tests of their chain: the live PD switch keeps both cores decoding for minutes and is the test the other
# chains slow down most (2.3 minutes alone, up to 5 beside them); they have mostly finished by the engine chain's end
LAST_IN_CHAIN = ("tests/engines/test_pd_switch_daemon.py",)
# CPU niceness: the engine chain's tests are the suite's wall time and get the cores first; the control chain's
# mostly wait on timers; the rest (unit tests, the simulator's gate) take what is left
NICE = {"engines": 0, "control": 5, None: 10}
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # this process's xdist worker ("gw0", ...); None without xdist
# this pytest run, inherited by every process its tests start (xdist's workers inherit the controller's): which
# stray routers are this run's to stop (no_router_outlives_its_test), never another run's on the same machine
SESSION = os.environ.setdefault("PEARL_TEST_SESSION", uuid.uuid4().hex)
ENV_AT_START = dict(os.environ)  # before any test module is imported: what collection must leave as it found


def pytest_collection_finish(session: pytest.Session) -> None:
    """Put back what importing the test modules changed in ``os.environ`` (see the module's docstring)."""
    for key in set(os.environ) - set(ENV_AT_START):
        del os.environ[key]
    os.environ.update(ENV_AT_START)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """LAST_IN_CHAIN's tests go last (a stable sort: every other order stays as collected)."""
    items.sort(key=lambda item: item.nodeid.startswith(LAST_IN_CHAIN))


def chain_of(nodeid: str) -> str | None:
    """The chain a test runs in ("engines" or "control"), or None for a test of the third worker."""
    if not nodeid.startswith(SERIAL):
        return None
    if "[paced-" in nodeid:  # a case of tests/engines on the paced engine (the crash matrices' rounds beyond one kill
        return "control"  # per kind of step): no real engine, no engine lock
    if nodeid.startswith("tests/engines/") or nodeid.startswith(REAL_ENGINES):
        return "engines"
    return "control"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: each chain one unit of work (one worker each, in collection order: xdist hands the
    units out in the order their first test was collected, the engine chain first, then the control chain, one
    to a worker), every other test a unit of its own. (xdist's own loadgroup reads ``xdist_group`` marks through
    ``item._nodeid``, which pytest 9 no longer uses for the node id: with it, the groups would silently not
    form.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Chains(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return chain_of(nodeid) or nodeid

    return Chains(config, log)


@pytest.fixture(autouse=True)
def _cpu_priority(request: pytest.FixtureRequest) -> None:
    """Under xdist, a test runs at its chain's niceness (NICE; raising it back needs root, as in CI; without it, it
    stays lower)."""
    if WORKER is None:
        return
    want = NICE[chain_of(request.node.nodeid)]
    if os.getpriority(os.PRIO_PROCESS, 0) != want:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, want)
        except PermissionError:
            pass


def _started_here(pid: int) -> bool:
    """Whether process ``pid`` was started under this pytest process: it inherited this session's
    PEARL_TEST_SESSION and this xdist worker's PYTEST_XDIST_WORKER (none without xdist). A router of another
    pytest run on this machine, or of another worker of this one, is never ours."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
    worker = env.get(b"PYTEST_XDIST_WORKER")
    return env.get(b"PEARL_TEST_SESSION") == SESSION.encode() and (worker.decode() if worker else None) == WORKER


def process_argvs() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process on this machine whose command line can be read now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(entry.name), argv


def router_gateways() -> set[int]:
    """Pids of this machine's run-router gateways (``python -m pearlctl.router``) that this pytest process's tests
    may have started: never another pytest run's, nor (under xdist) another worker's."""
    return {pid for pid, argv in process_argvs() if b"pearlctl.router" in argv and b"-m" in argv and _started_here(pid)}


@pytest.fixture(autouse=True)
def no_router_outlives_its_test():
    """A run's router gateway outlives its daemon by design (a daemon restart adopts it); a test that ends
    without cancelling its run (a killed daemon, a failure) would leave it running. Stop, after each test,
    every gateway the test started (its process group: the gateway and its vllm-router)."""
    before = router_gateways()
    yield
    for pid in router_gateways() - before:
        try:
            os.killpg(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture
def pearlctl(tmp_path: Path) -> Pearlctl:
    return Pearlctl(tmp_path / "state")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A stand-in model directory: launch only checks that the model path exists."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def write_spec(
    path: Path, *, name: str, model: Path, run_dir: Path, pools: str, backend: str = "auto", poll: float = 1
) -> Path:
    path.write_text(f"""
[run]
name = "{name}"
model = "{model}"
run_dir = "{run_dir}"
backend = "{backend}"
poll_interval_s = {poll}
{pools}
""")
    return path
