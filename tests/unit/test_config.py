"""Run spec validation: every problem is reported with its key path and what would be valid."""

from pathlib import Path

import pytest

from pearlctl.config import SpecError, load_spec

POLICIES = ("never", "greedy")

GOOD = """
[run]
name = "t1"
model = "model"
run_dir = "runs/t1"
policy = "never"

[pools.trainer]
nodes = 1
gpus_per_node = 2
partition = "debug"
time_limit = "01:00:00"
env = { OMP_NUM_THREADS = "1" }

[pools.rollout]
nodes = 2
gpus_per_node = 2
engine_args = { max_model_len = 512, enforce_eager = true }

[pools.elastic]
nodes = 1
max_nodes = 3
gpus_per_node = 2
partition = "preempt"
"""


@pytest.fixture
def spec_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    return tmp_path


def write(spec_dir: Path, text: str) -> Path:
    path = spec_dir / "run.toml"
    path.write_text(text)
    return path


def problems(spec_dir: Path, text: str) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        load_spec(write(spec_dir, text), POLICIES)
    return {p.key: p.message for p in info.value.problems}


def test_good_spec_resolves_paths_against_the_spec_file(spec_dir):
    spec = load_spec(write(spec_dir, GOOD), POLICIES)
    assert spec.model == (spec_dir / "model").resolve()
    assert spec.run_dir == (spec_dir / "runs/t1").resolve()
    assert set(spec.pools) == {"trainer", "rollout", "elastic"}
    assert spec.pools["elastic"].requeue is True and spec.pools["rollout"].requeue is False
    assert spec.pools["trainer"].role == "TRAIN" and spec.pools["elastic"].role == "ROLLOUT"
    assert spec.pools["rollout"].engine_args == {"max_model_len": 512, "enforce_eager": True}


def test_typo_in_a_key_is_named_with_a_suggestion(spec_dir):
    found = problems(
        spec_dir, GOOD.replace('gpus_per_node = 2\npartition = "debug"', 'gpus_per_nod = 2\npartition = "debug"')
    )
    assert "pools.trainer.gpus_per_nod" in found
    assert "did you mean 'gpus_per_node'" in found["pools.trainer.gpus_per_nod"]
    assert "pools.trainer.gpus_per_node" in found  # and the real key is now missing


@pytest.mark.parametrize(
    "old,new,key,words",
    [
        (
            "nodes = 2\ngpus_per_node = 2\nengine",
            "nodes = 2\ngpus_per_node = -1\nengine",
            "pools.rollout.gpus_per_node",
            "integer >= 0",
        ),
        (
            'nodes = 1\ngpus_per_node = 2\npartition = "debug"',
            'nodes = "one"\ngpus_per_node = 2\npartition = "debug"',
            "pools.trainer.nodes",
            "integer >= 1",
        ),
        ('time_limit = "01:00:00"', 'time_limit = "an hour"', "pools.trainer.time_limit", "Slurm time"),
        ('policy = "never"', 'policy = "yolo"', "run.policy", "never, greedy"),
        ('model = "model"', 'model = "nope"', "run.model", "does not exist"),
        ("[pools.elastic]", "[pools.elastc]", "pools.elastc", "did you mean 'elastic'"),
        ("max_nodes = 3", "max_nodes = 0", "pools.elastic.max_nodes", "integer >= 1"),
        ('OMP_NUM_THREADS = "1"', "OMP_NUM_THREADS = 1", "pools.trainer.env.OMP_NUM_THREADS", "string"),
        ('name = "t1"', 'name = "bad name!"', "run.name", "letters, digits"),
    ],
)
def test_bad_values_name_the_key_and_what_is_valid(spec_dir, old, new, key, words):
    assert old in GOOD
    found = problems(spec_dir, GOOD.replace(old, new))
    assert key in found, found
    assert words in found[key]


def test_all_problems_are_reported_at_once(spec_dir):
    text = GOOD.replace('policy = "never"', 'policy = "yolo"').replace('time_limit = "01:00:00"', "time_limit = 5")
    assert {"run.policy", "pools.trainer.time_limit"} <= set(problems(spec_dir, text))


def test_missing_model_and_trainer_pool(spec_dir):
    text = GOOD.replace('model = "model"\n', "")
    text = text[: text.index("[pools.trainer]")] + text[text.index("[pools.rollout]") :]
    found = problems(spec_dir, text)
    assert "required" in found["run.model"]
    assert "trainer pool" in found["pools.trainer"]


def test_max_nodes_only_on_elastic(spec_dir):
    found = problems(spec_dir, GOOD.replace("[pools.rollout]\nnodes = 2", "[pools.rollout]\nnodes = 2\nmax_nodes = 4"))
    assert "only an elastic pool" in found["pools.rollout.max_nodes"]


def test_unreadable_and_malformed_files(spec_dir):
    with pytest.raises(SpecError) as info:
        load_spec(spec_dir / "absent.toml", POLICIES)
    assert info.value.problems[0].key == "<file>" and "cannot read" in info.value.problems[0].message
    with pytest.raises(SpecError) as info:
        load_spec(write(spec_dir, "[run\nname="), POLICIES)
    assert "not valid TOML" in info.value.problems[0].message


def test_overrides_are_validated_like_the_file(spec_dir):
    spec = load_spec(write(spec_dir, GOOD), POLICIES, {"name": "other", "run_dir": "/tmp/x"})
    assert spec.name == "other" and str(spec.run_dir) == "/tmp/x"
    with pytest.raises(SpecError) as info:
        load_spec(write(spec_dir, GOOD), POLICIES, {"name": "no spaces allowed"})
    assert info.value.problems[0].key == "run.name"


def test_shipped_examples_are_valid(tmp_path):
    from pearlctl import home

    root = Path(__file__).resolve().parents[2] / "examples"
    specs = sorted(root.glob("*.toml"))
    assert specs, "examples/*.toml missing"
    for path in specs:
        # the tiny model is built by scripts/build-tiny-model.py; stand in an empty directory for it
        spec = load_spec(path, home.known_policies(), {"model": str(tmp_path)})
        assert "trainer" in spec.pools
