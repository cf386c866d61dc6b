"""The control API's boundaries against a real daemon process: one test per reproduced defect.

Each test starts ``python -m pearlctl daemon RUN --foreground`` in a subprocess, on a run created in a
temporary state directory with the **local backend** and no Slurm at all: the run's two allocations (a
trainer with 2 GPUs, a rollout task with 1) point at a fake local job whose task is a real process group
(``sleep``), so the daemon's own Slurm poller sees them RUNNING on this host, exactly as it would a task
the local backend started. Then it sends raw HTTP, exactly what a buggy or hostile client could send,
and asserts the answer and what state holds afterwards (read through a read-only Store).

- defect 2: bodies of the wrong type or size are refused at the edge (422 naming the field, 413) and
  never reach state or stop the control loop;
- defect 5: an agent's credential is bound to its own allocation (it cannot make another allocation's
  GPUs leave, the run token is no agent credential), and a worker's URL must be on its own node;
- an unknown allocation with a well-formed credential is a 404, the answer agents re-register on.

The ``test_found_*`` tests reproduce defects the fuzz test (tests/local/test_api_fuzz.py) found: a draining
report from an agent whose GPUs were judged LOST, a worker key colliding with an archived one, malformed
engine profiles, policy names that are paths, and allocation headers of non-ASCII digits — each a 500 (or
code execution) where a 4xx or a 200 is due.

``LiveRun`` and ``live_run`` are shared with tests/local/test_api_fuzz.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from pearlctl.daemon.agents import allocation_credential
from pearlctl.host.processes import proc_start_ticks
from pearlctl.host.runfiles import ensure_secret, read_address
from pearlctl.state.store import Store
from tests import factories
from tests.conftest import REPO, alive, wait_for

RUN_ID = "bnd"
NODE = socket.gethostname()  # what the local backend reports as every task's node
TICKS = re.compile(r"^pearl_daemon_ticks_total (\S+)$", re.M)
TICK_ERRORS = re.compile(r"^pearl_daemon_tick_errors_total (\S+)$", re.M)
API_ERRORS = re.compile(r"^pearl_daemon_api_errors_total (\S+)$", re.M)
REFUSED = re.compile(r'^pearl_daemon_heartbeats_total\{path="refused"\} (\S+)$', re.M)


class LiveRun:
    """A run on the local backend with a real daemon process serving it (see the module docstring)."""

    def __init__(self, tmp_path: Path, *, heartbeat_s: float = 0.5, policy: str = "never"):
        self.state_dir = tmp_path / "state"
        self.run_dir = tmp_path / "run"
        self.db = self.state_dir / "state.db"
        self.heartbeat_s = heartbeat_s
        self.env = {**os.environ, "PEARL_STATE_DIR": str(self.state_dir)}
        self.env.pop("PEARL_FAULT", None)
        # the "array tasks": one real process group, as the local backend starts them
        self.task = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        with Store.open(self.db) as store:
            spec = {"poll_interval_s": 1.0, "router": {"enabled": False}}  # the data plane is tested elsewhere
            pools = [
                factories.pool("trainer", "TRAIN", gpus_per_node=2, run_id=RUN_ID),
                factories.pool("rollout", "ROLLOUT", run_id=RUN_ID),
            ]
            factories.create_run(store, self.run_dir, pools, run_id=RUN_ID, spec=spec, backend="local", policy=policy)
            store.set_state("runs", RUN_ID, expect="CREATED", to="SUBMITTING", event="test")
            self.jobs: dict[str, str] = {}
            for alloc in store.fleet.allocations(RUN_ID):
                job_id = f"local-{alloc.pool[:4]}{alloc.id:04d}"
                self._fake_local_job(job_id, f"pearl.{RUN_ID}.{alloc.pool}")
                store.set_state("allocations", alloc.id, expect="REQUESTED", to="PENDING", event="t", job_id=job_id)
                # as the watcher folds the first poll of a RUNNING task: node and GPUs (0..n-1 locally)
                store.set_state("allocations", alloc.id, expect="PENDING", to="RUNNING", event="t", node=NODE)
                pool = next(p for p in store.runs.pools(RUN_ID) if p["id"] == alloc.pool_id)
                store.fleet.upsert_node_gpus(RUN_ID, alloc.id, NODE, list(range(pool["gpus_per_node"])), pool["role"])
                self.jobs[alloc.pool] = job_id
            store.set_state("runs", RUN_ID, expect="SUBMITTING", to="ACTIVE", event="test")
            self.allocations = {a.pool: a for a in store.fleet.allocations(RUN_ID)}
        self.secret = ensure_secret(self.run_dir)
        self.log_path = tmp_path / "daemon.log"
        self.proc: subprocess.Popen | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    def _fake_local_job(self, job_id: str, name: str) -> None:
        jdir = self.state_dir / "local-jobs" / job_id
        jdir.mkdir(parents=True)
        (jdir / "meta.json").write_text(json.dumps({"name": name, "array_size": 1, "submitted_at": time.time()}))
        (jdir / "task-0.pid").write_text(f"{self.task.pid} {proc_start_ticks(self.task.pid)}\n")

    # -- the daemon process -----------------------------------------------------------------------
    def start(self) -> None:
        argv = [sys.executable, "-m", "pearlctl", "daemon", RUN_ID, "--foreground", "--host", "127.0.0.1"]
        argv += ["--heartbeat-s", str(self.heartbeat_s), "--lease-ttl-s", "20"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            address = read_address(self.run_dir) or {}
            if address.get("pid") == self.proc.pid:
                self.url = address["url"]
                self.epoch = address["epoch"]
                break
            assert self.proc.poll() is None, f"the daemon exited at start:\n{self.log()}"
            time.sleep(0.1)
        else:
            raise AssertionError(f"the daemon did not serve within 60 s:\n{self.log()}")
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(10.0))
        # the control loop runs: its tick counter moves
        first = self.ticks()
        wait_until(lambda: self.ticks() > first, 10, what="the control loop ticks")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and alive(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if getattr(self, "http", None) is not None:
            self.http.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.task.poll() is None:
            os.killpg(self.task.pid, signal.SIGKILL)
            self.task.wait(5)

    # -- requests ---------------------------------------------------------------------------------
    def headers(self, *, token: str | None = None, run_id: str | None = RUN_ID, allocation: int | None = None) -> dict:
        h = {"Authorization": f"Bearer {self.secret if token is None else token}"}
        if run_id is not None:
            h["X-Pearl-Run"] = run_id
        if allocation is not None:
            h["X-Pearl-Allocation"] = str(allocation)
        return h

    def post(self, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None) -> httpx.Response:
        content = raw if raw is not None else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers if headers is not None else self.headers())}
        return self.http.post(path, content=content, headers=h)

    def get(self, path: str, *, headers: dict | None = None) -> httpx.Response:
        return self.http.get(path, headers=headers if headers is not None else self.headers())

    def register(self, pool: str, **extra) -> dict:
        alloc = self.allocations[pool]
        body = {"job_id": alloc.job_id, "task_id": alloc.array_index, "node": NODE, **extra}
        resp = self.post("/v1/agents/register", body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def agent_headers(self, registered: dict) -> dict:
        return self.headers(token=registered["credential"], allocation=registered["allocation_id"])

    def metrics(self) -> str:
        resp = self.get("/metrics")
        assert resp.status_code == 200, resp.text
        return resp.text

    def ticks(self) -> float:
        return float(TICKS.search(self.metrics()).group(1))

    def tick_errors(self) -> float:
        return float(TICK_ERRORS.search(self.metrics()).group(1))

    def api_errors(self) -> float:
        return float(API_ERRORS.search(self.metrics()).group(1))

    def read(self) -> Store:
        """State as any reader sees it (the daemon is its only writer)."""
        return Store.open(self.db, readonly=True)


def wait_until(fn, timeout: float, *, what: str, every: float = 0.1):
    try:
        return wait_for(fn, timeout, every)
    except AssertionError:
        raise AssertionError(f"{what}: not within {timeout}s") from None


@pytest.fixture
def live_run(tmp_path):
    run = LiveRun(tmp_path)
    try:
        yield run
    finally:
        run.stop()


def state_bytes(run: LiveRun) -> int:
    """The state database on disk: the main file and its write-ahead log."""
    return sum(p.stat().st_size for p in (run.db, Path(f"{run.db}-wal")) if p.exists())


def gpu_states(run: LiveRun, pool: str) -> set[str]:
    with run.read() as store:
        return {g.state for g in store.fleet.gpus(RUN_ID) if g.pool == pool}


def assert_ticking(run: LiveRun) -> None:
    """The control loop goes on, without tick errors."""
    seen = run.ticks()
    wait_until(lambda: run.ticks() > seen, 10, what="the control loop keeps ticking")
    assert run.tick_errors() == 0, run.log()


# -- defect 2: wrong types and sizes stop at the edge -----------------------------------------------------------
def test_defect2_wrong_types_and_sizes_are_refused_at_the_edge(live_run):
    run = live_run
    ok = run.post("/v1/trainer/phase", {"phase": "training", "step": 3, "expected_wait_s": 12.5})
    assert ok.status_code == 200, ok.text
    with run.read() as store:
        trainer_before = store.runs.get(RUN_ID)["trainer"]

    # a wait that is not a number: 422 naming the field; nothing stored; the loop and the process go on
    bad = run.post("/v1/trainer/phase", {"phase": "waiting", "expected_wait_s": "x"})
    assert bad.status_code == 422, bad.text
    assert "expected_wait_s" in bad.json()["error"]
    assert_ticking(run)
    time.sleep(3)
    assert run.alive(), run.log()
    assert run.get("/v1/health").status_code == 200
    assert_ticking(run)
    with run.read() as store:
        assert store.runs.get(RUN_ID)["trainer"] == trainer_before

    # the rollout driver's counts are integers
    for field in ("queued", "tokens"):
        bad = run.post("/v1/rollout/progress", {field: "x"})
        assert bad.status_code == 422, bad.text
        assert field in bad.json()["error"]
    # ... and its tool times are seconds, given, none negative, and nothing unknown beside them
    for tools in ({"slowest_s": -1.0}, {}, {"slowest_s": 3.0, "mean_s": 1.0}, {"slowest_s": "x"}):
        bad = run.post("/v1/rollout/progress", {"tools": tools})
        assert bad.status_code == 422 and "tools." in bad.json()["error"], bad.text
    good = run.post("/v1/rollout/progress", {"queued": 4, "generating": 2, "tokens": 1234})
    assert good.status_code == 200, good.text
    with run.read() as store:
        rollout = store.runs.get(RUN_ID)["rollout"]
    assert (rollout["queued"], rollout["generating"], rollout["tokens"]) == (4, 2, 1234)

    # registration: a task id that is not an integer, an allocation that does not exist
    trainer = run.allocations["trainer"]
    bad = run.post("/v1/agents/register", {"job_id": trainer.job_id, "task_id": "abc", "node": NODE})
    assert bad.status_code == 422 and "task_id" in bad.json()["error"], bad.text
    for job_id, task_id in (("local-nope0000", 0), (trainer.job_id, 7)):
        missing = run.post("/v1/agents/register", {"job_id": job_id, "task_id": task_id, "node": NODE})
        assert missing.status_code == 404, missing.text

    # heartbeats: a worker's GPUs and role, the long-poll wait
    agent = run.register("rollout")
    headers = run.agent_headers(agent)
    worker = {"key": "rollout-0", "role": "ROLLOUT", "engine": "vllm", "state": "STARTING", "gpus": [0]}
    for changed, field in (({"gpus": ["x"]}, "gpus"), ({"role": "EVIL"}, "role")):
        body = {"allocation_id": agent["allocation_id"], "workers": [{**worker, **changed}]}
        bad = run.post("/v1/agents/heartbeat", body, headers=headers)
        assert bad.status_code == 422, bad.text
        assert f"workers.0.{field}" in bad.json()["error"]
    bad = run.post("/v1/agents/heartbeat", {"allocation_id": agent["allocation_id"], "wait_s": "x"}, headers=headers)
    assert bad.status_code == 422 and "wait_s" in bad.json()["error"], bad.text
    with run.read() as store:
        assert store.fleet.workers(RUN_ID) == []  # no refused report left a worker behind
    # an agent repeats a refused report at every heartbeat: each is counted, each distinct error logged once
    repeated = {"allocation_id": agent["allocation_id"], "workers": [{**worker, "gpus": [0, 0]}]}
    for _ in range(5):
        bad = run.post("/v1/agents/heartbeat", repeated, headers=headers)
        assert bad.status_code == 422 and "distinct" in bad.json()["error"], bad.text
    assert float(REFUSED.search(run.metrics()).group(1)) == 8
    logged = [line for line in run.log_path.read_text().splitlines() if "refused a report of allocation" in line]
    assert len(logged) == 4 and "distinct" in logged[-1], logged

    # a 30 MiB phase report: 413, and state did not grow with it
    before = state_bytes(run)
    huge = json.dumps({"phase": "waiting", "metrics": {"blob": "x" * (30 * 1024 * 1024)}}).encode()
    try:
        status = run.post("/v1/trainer/phase", raw=huge).status_code
    except httpx.HTTPError:  # the daemon may answer 413 and close before 30 MiB are written: ask again
        status = None
    if status is None:
        with httpx.Client(base_url=run.url, timeout=10) as fresh:
            resp = fresh.post("/v1/trainer/phase", content=huge, headers=run.headers())
        status = resp.status_code
    assert status == 413
    assert state_bytes(run) - before < 1024 * 1024
    with run.read() as store:
        assert store.runs.get(RUN_ID)["trainer"] == trainer_before
    assert run.alive() and run.api_errors() == 0, run.log()
    assert_ticking(run)


# -- defect 5: an agent's credential is its allocation's only ---------------------------------------------------
def test_defect5_agent_credentials_are_bound_to_their_allocation_and_node(live_run):
    run = live_run
    trainer_id = run.allocations["trainer"].id
    agent = run.register("rollout")  # the rollout allocation's agent; the trainer's never registered
    own = run.agent_headers(agent)
    assert gpu_states(run, "trainer") == {"UP"}

    # its own credential, reporting for the trainer's allocation: refused, the trainer's GPUs stay
    leave = {"allocation_id": trainer_id, "leaving": True}
    assert run.post("/v1/agents/heartbeat", leave, headers=own).status_code == 403
    # ... nor by naming the trainer's allocation in the header with its own credential
    as_trainer = run.headers(token=agent["credential"], allocation=trainer_id)
    assert run.post("/v1/agents/heartbeat", leave, headers=as_trainer).status_code == 403
    # the run token is no agent credential, with or without an allocation header
    for headers in (run.headers(allocation=trainer_id), run.headers()):
        status = run.post("/v1/agents/heartbeat", leave, headers=headers).status_code
        assert status in (401, 403), status
    assert gpu_states(run, "trainer") == {"UP"}
    with run.read() as store:
        assert not [j for j in store.journal.read(RUN_ID) if j["event"] == "agent leaving"]

    # a worker whose URL is not on the allocation's node: refused, never routable, never stored
    evil = {"key": "rollout-0", "role": "ROLLOUT", "engine": "vllm", "state": "READY", "gpus": [0]}
    evil["url"] = "http://evil.example:1"
    refused = run.post(
        "/v1/agents/heartbeat", {"allocation_id": agent["allocation_id"], "workers": [evil]}, headers=own
    )
    assert refused.status_code == 403, refused.text
    assert "evil.example" in refused.json()["error"]
    workers = run.get("/v1/workers")
    assert workers.status_code == 200 and workers.json()["workers"] == []
    with run.read() as store:
        assert not [w for w in store.fleet.workers(RUN_ID) if w.url and "evil" in w.url]
        assert store.fleet.workers(RUN_ID) == []

    # the same worker on its own node is accepted and routable: the refusal was about the URL
    evil["url"] = f"http://{NODE}:8000"
    accepted = run.post(
        "/v1/agents/heartbeat", {"allocation_id": agent["allocation_id"], "workers": [evil]}, headers=own
    )
    assert accepted.status_code == 200, accepted.text
    assert [w["url"] for w in run.get("/v1/workers").json()["workers"]] == [f"http://{NODE}:8000"]
    assert gpu_states(run, "trainer") == {"UP"}
    assert run.alive() and run.api_errors() == 0, run.log()


# -- agents re-register on 404 ---------------------------------------------------------------------------------
def test_a_heartbeat_for_an_allocation_that_does_not_exist_is_404(live_run):
    run = live_run
    credential = allocation_credential(run.secret, RUN_ID, 99999)  # well-formed: the daemon derives the same
    headers = run.headers(token=credential, allocation=99999)
    resp = run.post("/v1/agents/heartbeat", {"allocation_id": 99999}, headers=headers)
    assert resp.status_code == 404, resp.text
    assert "register again" in resp.json()["error"]
    # a wrong credential for that id stays a 403: the 404 is only for a credential the daemon issued
    wrong = run.headers(token="0" * 64, allocation=99999)
    assert run.post("/v1/agents/heartbeat", {"allocation_id": 99999}, headers=wrong).status_code == 403
    assert run.alive() and run.api_errors() == 0


def test_every_heartbeat_and_tick_is_in_the_daemons_latency_histograms(live_run):
    """``pearl_daemon_heartbeat_duration_seconds`` counts each heartbeat's handling (the first folded, the
    repeats answered from memory) and ``pearl_daemon_tick_duration_seconds`` each tick, over the daemon's life."""
    run = live_run
    agent = run.register("rollout")
    count = re.compile(r"^pearl_daemon_heartbeat_duration_seconds_count (\S+)$", re.M)
    before = float(count.search(run.metrics()).group(1))
    body = {"allocation_id": agent["allocation_id"], "wait_s": 0}
    for _ in range(5):
        assert run.post("/v1/agents/heartbeat", body, headers=run.agent_headers(agent)).status_code == 200
    text = run.metrics()
    assert float(count.search(text).group(1)) == before + 5
    ticks = float(TICKS.search(text).group(1))
    timed = float(re.search(r"^pearl_daemon_tick_duration_seconds_count (\S+)$", text, re.M).group(1))
    assert ticks > 0 and ticks - 1 <= timed <= ticks  # a tick may end between its count and its timing
    slowest = re.search(r'^pearl_daemon_heartbeat_duration_seconds_bucket\{le="10.0"\} (\S+)$', text, re.M)
    assert float(slowest.group(1)) == before + 5  # each lands in a bucket


# -- found by the fuzz test (tests/local/test_api_fuzz.py): each a 500 or worse today ---------------------------
def test_found_a_draining_report_from_an_agent_judged_lost_is_accepted(live_run):
    """An agent silent for longer than the loss window (a network blip, a daemon restart) has its GPUs
    marked LOST; when its next heartbeat says it is draining (a preemption notice), the daemon must take
    it — not answer 500 (IllegalTransition LOST -> DRAINING) on every heartbeat of the drain."""
    run = live_run
    agent = run.register("rollout")
    wait_until(lambda: gpu_states(run, "rollout") == {"LOST"}, 10, what="the silent agent's GPU is LOST")
    body = {"allocation_id": agent["allocation_id"], "draining": True}
    resp = run.post("/v1/agents/heartbeat", body, headers=run.agent_headers(agent))
    assert resp.status_code == 200, f"{resp.status_code} {resp.text}\n{run.log()}"
    assert gpu_states(run, "rollout") == {"DRAINING"}
    assert run.api_errors() == 0


def test_a_worker_key_shaped_like_an_archived_one_is_refused_and_breaks_nothing(live_run):
    """A worker whose process ended is archived under ``<key>#<id>`` when a new process reports that key.
    Agents cannot report keys of that shape (422, the field named): before, such a key collided with the
    archived row and every later heartbeat of the agent was an IntegrityError (500)."""
    run = live_run
    agent = run.register("rollout")
    headers = run.agent_headers(agent)

    def report(key: str, state: str) -> httpx.Response:
        worker = {"key": key, "role": "ROLLOUT", "engine": "vllm", "state": state, "gpus": [0]}
        return run.post(
            "/v1/agents/heartbeat", {"allocation_id": agent["allocation_id"], "workers": [worker]}, headers=headers
        )

    assert report("rollout-0", "READY").status_code == 200
    with run.read() as store:
        (first,) = [w.id for w in store.fleet.workers(RUN_ID) if w.worker_key == "rollout-0"]
    assert report("rollout-0", "STOPPED").status_code == 200
    refused = report(f"rollout-0#{first}", "READY")  # a key shaped like an archived one
    assert refused.status_code == 422 and "workers.0.key" in refused.json()["error"]
    again = report("rollout-0", "STARTING")  # a new process under the first key: the old row is archived
    assert again.status_code == 200, f"{again.status_code} {again.text}\n{run.log()}"
    with run.read() as store:
        states = {w.worker_key: w.state for w in store.fleet.workers(RUN_ID)}
    assert states["rollout-0"] == "STARTING" and states[f"rollout-0#{first}"] == "STOPPED"
    assert run.api_errors() == 0


def test_found_a_malformed_engine_profile_is_a_422_and_stores_nothing(live_run):
    """``POST /v1/profile`` takes free-form JSON (ProfileBody.profile: dict[str, Any]) and hands it to
    planner.profile.from_dict, which raises TypeError/ValueError/AttributeError on tables of the wrong
    type and lets NaN through to a CHECK (json_valid) failure: each a 500 today."""
    run = live_run
    good = tomllib.loads((REPO / "examples" / "profiles" / "qwen3-8b-h200.toml").read_text())

    def with_(path: tuple[str, ...], value) -> dict:
        doc = json.loads(json.dumps(good))
        at = doc
        for k in path[:-1]:
            at = at[k]
        at[path[-1]] = value
        return doc

    bad = {
        "[profile] is a string": with_(("profile",), "ab"),
        "[profile] is a list": with_(("profile",), [1, 2]),
        "[profile.decode] is a number": with_(("profile", "decode"), 5),
        "[profile.costs] is a number": with_(("profile", "costs"), 5),
        "[sources] is a list": with_(("sources",), [1]),
        "decode.seq_s is NaN": with_(("profile", "decode", "seq_s"), math.nan),
        "kv_bytes_per_token is NaN": with_(("profile", "kv_bytes_per_token"), math.nan),
        "decode.weights_s is infinite": with_(("profile", "decode", "weights_s"), math.inf),
    }
    answers = {}
    for why, doc in bad.items():
        resp = run.post("/v1/profile", raw=json.dumps({"profile": doc}, allow_nan=True).encode())
        answers[why] = resp.status_code
    assert answers == dict.fromkeys(bad, 422), "\n".join(f"{why}: {s}" for why, s in answers.items())
    with run.read() as store:
        assert store.runs.get(RUN_ID)["profile"] is None
    assert run.api_errors() == 0
    assert run.post("/v1/profile", {"profile": good}).status_code == 200  # the shipped one is fine


def test_found_a_policy_name_cannot_name_a_file_outside_the_policy_folders(live_run, tmp_path):
    """``POST /v1/borrow`` loads ``<policy dir>/<name>.py`` with the name as sent: an absolute path or
    ``../`` executes any Python file on the head node inside the daemon (``../pearlctl/__main__`` runs the
    CLI in it and ends in SystemExit), and a name longer than a file name is an OSError (500)."""
    run = live_run
    marker = tmp_path / "executed"
    evil = tmp_path / "outside" / "evil.py"
    evil.parent.mkdir()
    evil.write_text(f"open({str(marker)!r}, 'w').write('ran')\n\ndef decide(snapshot):\n    return None\n")
    relative = os.path.relpath(evil.with_suffix(""), REPO / "pearlctl" / "policies" / "shipped")
    answers = {}
    for name in (str(evil.with_suffix("")), relative, "p" * 300):
        resp = run.post("/v1/borrow", {"policy": name, "dry_run": True})
        answers[name[:40]] = resp.status_code
    assert all(s in (400, 422) for s in answers.values()), answers
    assert not marker.exists(), "the daemon executed a Python file named by a request"
    assert run.api_errors() == 0


def test_found_an_allocation_header_of_non_ascii_digits_is_a_401_not_a_500(live_run):
    """``_Gate.check`` accepts an ``X-Pearl-Allocation`` that ``str.isdigit()`` likes, then calls ``int()``
    on it: "²" (latin-1 0xB2) is a digit to isdigit and not to int — a 500 before any credential is
    checked, from anyone who can reach the port."""
    run = live_run
    answers = {}
    for value in (b"\xb2", b"1\xb3", b"\xb9\xb2"):
        headers = {"Authorization": "Bearer x", "X-Pearl-Run": RUN_ID, "X-Pearl-Allocation": value}
        resp = run.http.post("/v1/agents/heartbeat", content=b'{"allocation_id": 2}', headers=headers)
        answers[value] = resp.status_code
    assert answers == dict.fromkeys(answers, 401), answers
    assert run.api_errors() == 0


# -- long polls: held in the event loop, answered when their own desired workers change ------------------------
def test_a_held_heartbeat_is_answered_as_soon_as_its_desired_workers_change_and_not_before(tmp_path):
    """Over real HTTP to the real daemon process: a rollout agent's long poll (heartbeat interval 5 s) is held
    while nothing changes for it, and answered within a tick of the trainer's new weight export (the vLLM
    worker's desired weights change); the trainer's agent, whose desired workers did not change, stays held."""
    import concurrent.futures

    run = LiveRun(tmp_path, heartbeat_s=5.0)
    try:
        agents = {pool: run.register(pool) for pool in ("rollout", "trainer")}
        hashes = {}
        for pool, agent in agents.items():
            first = run.post("/v1/agents/heartbeat", {"allocation_id": agent["allocation_id"]},
                             headers=run.agent_headers(agent))  # fmt: skip
            assert first.status_code == 200, first.text
            hashes[pool] = first.json()["desired_hash"]

        def held(pool: str) -> tuple[float, dict]:
            agent = agents[pool]
            body = {"allocation_id": agent["allocation_id"], "desired_hash": hashes[pool], "wait_s": 5.0}
            started = time.monotonic()
            resp = run.post("/v1/agents/heartbeat", body, headers=run.agent_headers(agent))
            assert resp.status_code == 200, resp.text
            return time.monotonic() - started, resp.json()

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rollout, trainer = pool.submit(held, "rollout"), pool.submit(held, "trainer")
            time.sleep(1.0)
            assert not rollout.done() and not trainer.done()  # nothing changed for either: both held
            changed_at = time.monotonic()
            phase = {"phase": "training", "step": 1, "weight_version": "v2", "weights_path": str(tmp_path / "w2")}
            assert run.post("/v1/trainer/phase", phase).status_code == 200
            took, answer = rollout.result(timeout=10)
            answered_after = time.monotonic() - changed_at
            assert answer["desired_hash"] != hashes["rollout"]
            assert [w["weights"] for w in answer["desired"]] == [{"version": "v2", "path": str(tmp_path / "w2")}]
            assert answered_after < 3.5, answered_after  # a tick (0.5 s) and a pass, not the 5-s hold
            assert not trainer.done()  # the DeepSpeed worker's desired state did not change: still held
            took, answer = trainer.result(timeout=10)
            assert answer["desired_hash"] == hashes["trainer"] and took >= 4.5
        assert run.alive() and run.api_errors() == 0, run.log()
    finally:
        run.stop()


def test_a_held_trainer_report_gets_its_release_as_soon_as_a_borrow_asks_for_it(tmp_path):
    """Over real HTTP to the real daemon process: a waiting trainer's report with ``wait_s`` and no command for
    it is held (up to the heartbeat interval, 5 s), and answered with the release within a tick of a borrow
    that needs its GPUs — not at the end of its hold, nor at its next poll (`LongPolls.next_pass`,
    pearlctl/daemon/longpoll.py)."""
    import concurrent.futures

    run = LiveRun(tmp_path, heartbeat_s=5.0)
    try:
        waiting = {"phase": "waiting", "step": 1, "expected_wait_s": 600.0}
        assert run.post("/v1/trainer/phase", waiting).json()["command"] is None

        def held() -> tuple[float, dict]:
            started = time.monotonic()
            resp = run.post("/v1/trainer/phase", {**waiting, "wait_s": 5.0})
            assert resp.status_code == 200, resp.text
            return time.monotonic() - started, resp.json()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            took, answer = pool.submit(held).result(timeout=15)
            assert answer["command"] is None and took >= 4.5  # nothing for it: held for its whole wait
            report = pool.submit(held)
            time.sleep(1.0)
            assert not report.done()
            asked_at = time.monotonic()
            resp = run.post("/v1/borrow", {"policy": "greedy", "gpus": 1})
            assert resp.status_code == 200, resp.text
            took, answer = report.result(timeout=15)
            answered_after = time.monotonic() - asked_at
        assert answer["command"] == "release", answer
        assert answered_after < 2.5, answered_after  # a tick (0.5 s) and a pass, not the 5-s hold
        assert run.alive() and run.api_errors() == 0, run.log()
    finally:
        run.stop()
