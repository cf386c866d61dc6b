"""A reward pool's judge model (``[pools.reward] model``, docs/run-spec.md): taken by the reward pool only and
refused elsewhere by name, checked as ``[run] model`` is (a missing directory refused; a warning only with
``launch --dry-run``), and given to the reward pool's jobs as their ``PEARL_MODEL`` — the other pools keep the
run's model, the trainer's command its ``{model}`` — and to every pool's jobs as a model their nodes keep local."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pearlctl.config import SpecError, load_spec
from pearlctl.ops.launcher import requests_for
from pearlctl.slurm.script import worker_env

SPEC = """
[run]
name = "j1"
model = "policy"
run_dir = "runs/j1"

[pools.trainer]
nodes = 1
gpus_per_node = 1
train_command = ["{{python}}", "train.py", "--model", "{{model}}"]

[pools.rollout]
nodes = 1
gpus_per_node = 1
{rollout}

[pools.reward]
nodes = 1
gpus_per_node = 1
{reward}
"""


def spec_file(tmp_path: Path, rollout: str = "", reward: str = "") -> Path:
    for d in ("policy", "judge"):
        (tmp_path / d).mkdir(exist_ok=True)
    path = tmp_path / "run.toml"
    path.write_text(SPEC.format(rollout=rollout, reward=reward))
    return path


def problems(path: Path) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_spec(path, ("never",))
    return {p.key: p.message for p in info.value.problems}


def test_the_reward_pool_serves_its_judge_and_the_other_pools_the_policy(tmp_path):
    spec = load_spec(spec_file(tmp_path, reward='model = "judge"'), ("never",))
    assert spec.pools["reward"].model == str(tmp_path / "judge")  # relative to the spec, like [run] model
    assert spec.to_dict()["pools"]["reward"]["model"] == str(tmp_path / "judge")  # recorded for the daemon
    env = {r.pool: worker_env(r) for r in requests_for(spec, "j1-0001")}
    assert env["reward"]["PEARL_MODEL"] == str(tmp_path / "judge")
    assert env["rollout"]["PEARL_MODEL"] == env["trainer"]["PEARL_MODEL"] == str(tmp_path / "policy")
    (train,) = [r for r in requests_for(spec, "j1-0001") if r.pool == "trainer"]
    assert train.train_command[-1] == str(tmp_path / "policy")
    # every node may be asked to judge: each keeps the judge in its weight store (pearlctl.host.weight_store)
    assert {p: json.loads(e["PEARL_STORE_MODELS"]) for p, e in env.items()} == {
        p: [str(tmp_path / "judge")] for p in env
    }
    path = spec_file(tmp_path)
    path.write_text(path.read_text().split("[pools.reward]")[0])  # a run with no judge keeps no other model
    assert all("PEARL_STORE_MODELS" not in worker_env(r) for r in requests_for(load_spec(path, ("never",)), "j2"))


def test_without_a_model_of_its_own_the_reward_pool_serves_the_runs(tmp_path):
    spec = load_spec(spec_file(tmp_path), ("never",))
    (reward,) = [r for r in requests_for(spec, "j1-0001") if r.pool == "reward"]
    assert spec.pools["reward"].model is None and worker_env(reward)["PEARL_MODEL"] == str(tmp_path / "policy")


def test_a_judge_model_elsewhere_or_missing_is_refused_by_name(tmp_path):
    elsewhere = problems(spec_file(tmp_path, rollout='model = "judge"'))
    assert "only a reward pool serves a model of its own" in elsewhere["pools.rollout.model"], elsewhere
    missing = problems(spec_file(tmp_path, reward='model = "nowhere"'))
    assert "does not exist" in missing["pools.reward.model"], missing
    spec = load_spec(spec_file(tmp_path, reward='model = "nowhere"'), ("never",), model_on_this_host=False)
    assert any(w.startswith("pools.reward.model: path") for w in spec.warnings), spec.warnings
