"""Weights by broadcast across Slurm nodes, with real engines: a 2-rank DeepSpeed trainer on one node of the local
cluster and a vLLM rollout worker of a ``weights = "broadcast"`` pool on another (the pools' ``exclude`` keeps the
trainer on gpu1 and the rollout pool off it), the daemon and the reference rollout driver.

Each version the trainer exports reaches the worker over a gloo group from trainer rank 0 before it is published
(pearlctl.trainer.broadcast): the trainer's step events count the tensors sent, the worker's vLLM log the same
tensors received, its agent says it serves the version from the broadcast with no reload, and vLLM's disk reload
never ran. The trainer trains every step, and every step after the first is generated on the previous step's
weights. (The node-local store is keyed by Slurm node name, so the cluster's nodes, one machine, are told apart.)

Beside them a reward pool serves a judge (a generative reward model: the tiny judge, examples/models/tiny-judge,
shaped unlike the policy) with vLLM, and it is never the policy's: it serves its own model, no version of the
trainer's weights reaches it (by broadcast or reload), and none of the policy's turns reaches it. Through the
run's one endpoint, which lists both models, the requests naming the judge's model, and only those, are answered
by it (its vLLM counts exactly them).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pearlctl.router import service
from tests.conftest import REPO, wait_for
from tests.integration.conftest import spec_run
from tests.integration.test_borrow_e2e import ROLLOUT_POOL
from tests.integration.test_borrow_e2e import spec_text as borrow_spec

pytestmark = pytest.mark.timeout(900)

STEPS = 3


JUDGE = REPO / "examples" / "models" / "tiny-judge"
REWARD_POOL = f"""
[pools.reward]
partition = "debug"
nodes = 1
gpus_per_node = 1
exclude = "gpu1"
model = "{JUDGE}"
engine_args = {{ max_model_len = 512 }}
"""


def spec_text(run_dir: Path) -> str:
    return borrow_spec(
        run_dir,
        name="bcast",
        steps=STEPS,
        trainer_pool='partition = "debug"\nexclude = "gpu[2-4]"',
        generation_pools=ROLLOUT_POOL + 'weights = "broadcast"\nexclude = "gpu1"\n' + REWARD_POOL,
    )


@pytest.fixture
def bcast(slurm_cluster, tmp_path):
    with spec_run(slurm_cluster, tmp_path / "state", "bcast", spec_text) as run:
        yield run


def judged(url: str) -> float:
    """The requests a vLLM server finished (``vllm:request_success_total``, every finish reason)."""
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", metrics, re.M))


def lines(run_dir: Path, pattern: str, needle: str) -> list[str]:
    return [x for p in sorted((run_dir / "logs").glob(pattern)) for x in p.read_text().splitlines() if needle in x]


def test_a_rollout_worker_on_another_node_serves_each_version_the_trainer_broadcast_and_a_judge_none(bcast):
    pc, d = bcast
    run_dir = d / "run"
    pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
    doc = pc.json("status", "bcast")
    nodes = {a["pool"]: a["node"] for a in doc["allocations"]}
    assert nodes["trainer"] == "gpu1" and nodes["rollout"] != "gpu1", nodes  # each pool's exclude held
    pc("daemon", "bcast", "--heartbeat-s", "1", "--json")
    driver = subprocess.run(
        [sys.executable, str(REPO / "examples/grpo/rollout.py"), "--run-dir", str(run_dir), "--run-id",
         doc["run"]["id"], "--out", str(run_dir / "rollouts"), "--steps", str(STEPS), "--prompts", "4",
         "--group-size", "4", "--concurrency", "4"],
        capture_output=True, text=True, timeout=600, env=pc.env,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr[-3000:]

    log = run_dir / "trainer" / "train.jsonl"
    wait_for(lambda: log.exists() and '"done"' in log.read_text(), 180, every=1)
    events = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) for e in steps)

    # every version the rollout worker served after the first step came over gloo from trainer rank 0
    sent = {  # what trainer rank 0's export says it broadcast with each version (the example trainer's step event)
        e["broadcast"]["version"]: (e["broadcast"]["tensors"], e["broadcast"]["bytes"])
        for e in steps
        if (e.get("broadcast") or {}).get("sent") and e["broadcast"]["workers"] == 1
    }
    served, servers = {}, set()
    for step in range(1, STEPS + 1):
        groups = [json.loads(x) for x in (run_dir / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()]
        served[step] = {s["weight_version"] for g in groups for s in g["served_by"]}
        servers |= {s["worker"] for g in groups for s in g["served_by"]}
    for step in range(2, STEPS + 1):
        assert served[step] == {str(step - 1)}, served
    versions = {str(v) for v in range(1, STEPS)}
    assert versions <= set(sent), sent
    received = lines(run_dir, "vllm-*rollout*.log", "over gloo")
    for v in versions:
        tensors, size = sent[v]
        assert any(f"received {tensors} tensors ({size} bytes) over gloo" in x for x in received), received
    from_broadcast = lines(run_dir, "rollout-*.log", "from the trainer's broadcast (no reload)")
    assert {m.group(1) for x in from_broadcast if (m := re.search(r"now serves weights (\S+) from", x))} >= versions
    assert not lines(run_dir, "vllm-*rollout*.log", "Reloading weights inplace")  # vLLM never read a checkpoint

    # the judge beside them: its own model, no policy weights, no policy traffic; called by its model's name
    (judge,) = [w for w in pc.json("status", "bcast")["workers"] if w["role"] == "REWARD"]
    assert judge["state"] == "READY" and judge["weight_version"] is None, judge
    models = httpx.get(judge["url"] + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [str(JUDGE)], models
    assert not lines(run_dir, "vllm-*reward*.log", "Reloading weights inplace")
    assert not lines(run_dir, "vllm-*reward*.log", "over gloo")
    assert not lines(run_dir, "reward-*.log", "now serves weights")
    assert servers and judge["url"] not in servers, servers
    assert judged(judge["url"]) == 0  # no rollout turn reached it
    record, auth = service.read_record(run_dir), {"Authorization": f"Bearer {service.read_key(run_dir)}"}
    members = httpx.get(record.url + "/pearl/workers", headers=auth, timeout=10).json()["workers"]
    assert {m["url"]: m["router"] for m in members}[judge["url"]] == "judge", members
    listed = httpx.get(record.url + "/v1/models", headers=auth, timeout=10).json()["data"]
    assert str(JUDGE) in [m["id"] for m in listed] and len(listed) == 2, listed
    asked = {"model": str(JUDGE), "prompt": "Is 2 + 2 = 4? Answer yes or no:", "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        answer = httpx.post(record.url + "/v1/completions", json=asked, headers=auth, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == str(JUDGE), answer.text
    assert judged(judge["url"]) == 3  # the judge answered exactly the requests naming it
    print(json.dumps({"nodes": nodes, "sent": sent, "served": {k: sorted(v) for k, v in served.items()}}))
