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
trainer's weights reaches it (by broadcast or reload), and none of the policy's turns reaches it. The driver runs
with ``--reward judge``: each trajectory is scored by the judge through the run's one endpoint (which lists both
models) as it finishes, once: trajectories expected = judged = trained, and the judge's vLLM counts exactly the
verdicts' requests. The daemon kept the judge queue (status). Every node of the run holds the judge's model in its
weight store (each pool's agent copied it there as it started: pearlctl.host.weight_store). Through the same
endpoint the judge's two scoring modes answer for real (pearlctl.router.judge): a verdict's logprobs are the judge
model's own (checked against transformers on the same weights), a constrained critique ends in a readable score,
and an unconstrained one from this random-weight judge is an error naming its trajectory, never a score.
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


def scoring_modes_answer_for_real(run_dir: Path, judge_url: str) -> None:
    """The judge's client against the real judge through the run's gateway (pearlctl.router.judge)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pearlctl.router.client import RolloutClient
    from pearlctl.router.judge import (
        CANDIDATES,
        RUBRIC,
        VERDICT_PROMPT,
        JudgeClient,
        Mode,
        VerdictUnparsed,
        candidate_logprobs,
        p_first,
    )

    with RolloutClient(str(run_dir), None, model=str(JUDGE), retry_for_s=60) as client:
        # a verdict: the logprobs it is made of are the judge model's own, position by position
        task, answer = "17 + 25 =", "42"
        verdict = JudgeClient(client, str(JUDGE)).score("s9-p0-g0", task, answer)
        asked = VERDICT_PROMPT.format(task=task, answer=answer, rubric=RUBRIC)
        body = {
            "prompt": [asked + c for c in CANDIDATES],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        doc = client.request("check", body)
        yes, no = candidate_logprobs(doc["choices"])
        assert verdict.score == pytest.approx(p_first(yes, no), abs=1e-3) and verdict.worker == judge_url  # the same
        tok, model = (
            AutoTokenizer.from_pretrained(JUDGE),
            AutoModelForCausalLM.from_pretrained(JUDGE, dtype=torch.float32),
        )
        expected, pair = [], [c["prompt_token_ids"] for c in doc["choices"]]
        common = next(i for i, (a, b) in enumerate(zip(*pair, strict=False)) if a != b)  # where the candidates begin
        for choice in sorted(doc["choices"], key=lambda c: c["index"]):
            ids = choice["prompt_token_ids"]
            assert ids == tok(asked + CANDIDATES[choice["index"]])["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            expected.append(sum(logp[i - 1, ids[i]].item() for i in range(common, len(ids))))
        assert yes == pytest.approx(expected[0], abs=0.05) and no == pytest.approx(expected[1], abs=0.05)  # bf16
        # a critique forced to end in a score line is scored; left free, this random judge writes none: an error
        critique = JudgeClient(client, str(JUDGE), mode=Mode.CRITIQUE, constrained=True, max_tokens=24)
        scored = critique.score("s9-p0-g1", task, answer)
        assert 0 <= scored.score <= 1 and scored.requests == 1 and "Score: " in scored.text, scored
        free = JudgeClient(client, str(JUDGE), mode=Mode.CRITIQUE, attempts=2, max_tokens=16)
        with pytest.raises(VerdictUnparsed, match="trajectory s9-p0-g2: no score could be read in 2 critique"):
            free.score("s9-p0-g2", task, answer)


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
         "--group-size", "4", "--concurrency", "4", "--reward", "judge"],
        capture_output=True, text=True, timeout=600, env=pc.env,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr[-3000:]

    log = run_dir / "trainer" / "train.jsonl"
    wait_for(lambda: log.exists() and '"done"' in log.read_text(), 180, every=1)
    events = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(math.isfinite(e["loss"]) for e in steps)
    # --reward judge: every trajectory judged once, as it finished, by the judge; trained on with its verdict
    rolled = [json.loads(x) for x in driver.stdout.splitlines() if '"rollout step"' in x]
    assert [(e["step"], e["judged"], e["judge_models"]) for e in rolled] == [(s, 16, [str(JUDGE)]) for s in range(1, 4)]
    assert [(e["trajectories"], e["judged"]) for e in steps] == [(16, 16)] * STEPS  # expected = judged = trained

    # every version the rollout worker served after the first step came over gloo from trainer rank 0
    sent = {  # what trainer rank 0's export says it broadcast with each version (the example trainer's step event)
        e["broadcast"]["version"]: (e["broadcast"]["tensors"], e["broadcast"]["bytes"])
        for e in steps
        if (e.get("broadcast") or {}).get("sent") and e["broadcast"]["workers"] == 1
    }
    served, servers, verdicts = {}, set(), []
    for step in range(1, STEPS + 1):
        groups = [json.loads(x) for x in (run_dir / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()]
        served[step] = {s["weight_version"] for g in groups for s in g["served_by"]}
        servers |= {s["worker"] for g in groups for s in g["served_by"]}
        verdicts += [(r, j) for g in groups for r, j in zip(g["rewards"], g["judged_by"], strict=True)]
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
    # the judge's model in the weight store of every node of the run (pearlctl.host.weight_store): each pool's agent
    # copied it there as it started, so a GPU of any pool shifting to the judge loads it from its own node
    for pool, node in nodes.items():
        copies = list(Path("/dev/shm/pearl", doc["run"]["id"], node, "models").glob(f"{JUDGE.name}-*/config.json"))
        assert copies, (pool, node)
    assert len(verdicts) == 16 * STEPS and all(r == j["score"] and 0 < r < 1 for r, j in verdicts), verdicts
    assert {(j["mode"], j["model"], j["worker"], j["weight_version"]) for _, j in verdicts} == {
        ("verdict", str(JUDGE), judge["url"], None)
    }
    # its vLLM finished the verdicts' requests and nothing else (a verdict asks for two prompts: two requests in vLLM)
    assert judged(judge["url"]) == 2 * len(verdicts)
    queue = pc.json("status", "bcast")["run"]["rollout"]["judge"]
    assert {k: queue[k] for k in ("waiting", "judging", "done", "failed")} == {
        "waiting": 0, "judging": 0, "done": 16 * STEPS, "failed": 0
    }  # fmt: skip
    record, auth = service.read_record(run_dir), {"Authorization": f"Bearer {service.read_key(run_dir)}"}
    members = httpx.get(record.url + "/pearl/workers", headers=auth, timeout=10).json()["workers"]
    assert {m["url"]: m["router"] for m in members}[judge["url"]] == "judge", members
    listed = httpx.get(record.url + "/v1/models", headers=auth, timeout=10).json()["data"]
    assert str(JUDGE) in [m["id"] for m in listed] and len(listed) == 2, listed
    asked = {"model": str(JUDGE), "prompt": "Is 2 + 2 = 4? Answer yes or no:", "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        answer = httpx.post(record.url + "/v1/completions", json=asked, headers=auth, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == str(JUDGE), answer.text
    assert judged(judge["url"]) == 2 * len(verdicts) + 3  # the judge answered exactly the requests naming it
    scoring_modes_answer_for_real(run_dir, judge["url"])
    print(json.dumps({"nodes": nodes, "sent": sent, "served": {k: sorted(v) for k, v in served.items()}}))
