"""Run spec validation: every problem is reported with its key path and what would be valid."""

from pathlib import Path

import pytest

from pearlctl.config import SpecError, load_spec, parse_spec

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


def test_pending_timeout_defaults_on_elastic_pools_only(spec_dir):
    spec = load_spec(write(spec_dir, GOOD), POLICIES)
    assert spec.pools["elastic"].pending_timeout_s == 300.0
    assert spec.pools["rollout"].pending_timeout_s is None and spec.pools["trainer"].pending_timeout_s is None
    tuned = load_spec(
        write(spec_dir, GOOD.replace('partition = "preempt"', 'partition = "preempt"\npending_timeout_s = 45')),
        POLICIES,
    )
    assert tuned.pools["elastic"].pending_timeout_s == 45.0
    assert tuned.to_dict()["pools"]["elastic"]["pending_timeout_s"] == 45.0  # recorded with the run


@pytest.mark.parametrize(
    "value, words",
    [("5", ">= 10 and <= 86400"), ("86401", ">= 10 and <= 86400"), ("nan", "finite"), ('"5m"', "a number")],
)
def test_pending_timeout_is_a_bounded_finite_number(spec_dir, value, words):
    found = problems(
        spec_dir, GOOD.replace('partition = "preempt"', f'partition = "preempt"\npending_timeout_s = {value}')
    )
    assert words in found["pools.elastic.pending_timeout_s"], found


def test_pending_timeout_only_on_elastic(spec_dir):
    text = GOOD.replace("[pools.rollout]\nnodes = 2", "[pools.rollout]\nnodes = 2\npending_timeout_s = 60")
    assert "only an elastic pool" in problems(spec_dir, text)["pools.rollout.pending_timeout_s"]


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
    from pearlctl import policies

    root = Path(__file__).resolve().parents[2] / "examples"
    specs = sorted(root.glob("*.toml"))
    assert specs, "examples/*.toml missing"
    for path in specs:
        # the tiny model is built by scripts/build-tiny-model.py; stand in an empty directory for it
        spec = load_spec(path, policies.known_policies(), {"model": str(tmp_path)})
        assert "trainer" in spec.pools


# --- control characters, full-string matching, upper bounds (issue 8) -----------------------------------


def data(**pool_overrides) -> dict:
    """A valid spec as a decoded document (model "m" under the spec's directory), trainer pool overridden."""
    return {
        "run": {"name": "t1", "model": "m", "run_dir": "runs/t1"},
        "pools": {
            "trainer": {"nodes": 1, "gpus_per_node": 1, **pool_overrides},
            "rollout": {"nodes": 1, "gpus_per_node": 0},
        },
    }


def parse_problems(spec_dir: Path, doc: dict) -> dict[str, str]:
    (spec_dir / "m").mkdir(exist_ok=True)
    with pytest.raises(SpecError) as info:
        parse_spec(doc, spec_dir / "run.toml", POLICIES)
    return {p.key: p.message for p in info.value.problems}


def test_a_newline_after_a_valid_name_is_refused(spec_dir):
    # `$` matches before a final newline: the old check let "t1\n" through into `#SBATCH --job-name`
    found = problems(spec_dir, GOOD.replace('name = "t1"', 'name = "t1\\n"'))
    assert "control characters" in found["run.name"] and "'t1\\n'" in found["run.name"]


def test_a_run_dir_with_whitespace_is_refused_before_sbatch_could_split_it(spec_dir):
    found = problems(spec_dir, GOOD.replace('run_dir = "runs/t1"', 'run_dir = "runs/t1 --partition=high"'))
    assert "whitespace" in found["run.run_dir"]


@pytest.mark.parametrize(
    "old,new,key",
    [
        ('run_dir = "runs/t1"', 'run_dir = "runs/t1\\necho pwned"', "run.run_dir"),
        ('model = "model"', 'model = "model\\n"', "run.model"),
        ('partition = "debug"', 'partition = "debug\\n"', "pools.trainer.partition"),
        ('partition = "preempt"', 'partition = "pre\\tempt"', "pools.elastic.partition"),
        ('time_limit = "01:00:00"', 'time_limit = "01:00:00\\n"', "pools.trainer.time_limit"),
        ('OMP_NUM_THREADS = "1"', 'OMP_NUM_THREADS = "1\\nrm -rf /"', "pools.trainer.env.OMP_NUM_THREADS"),
        ('OMP_NUM_THREADS = "1"', '"A\\n" = "1"', "pools.trainer.env.A\\n"),
        ("max_model_len = 512,", 'max_model_len = "512\\u0007",', "pools.rollout.engine_args.max_model_len"),
    ],
)
def test_control_characters_are_refused_in_every_string(spec_dir, old, new, key):
    assert old in GOOD
    found = problems(spec_dir, GOOD.replace(old, new, 1))
    assert key in found, found
    assert "\n" not in key and "\n" not in found[key]  # each problem prints on one line


@pytest.mark.parametrize("key", ["command", "train_command"])
def test_control_characters_are_refused_in_argv_elements(spec_dir, key):
    found = parse_problems(spec_dir, data(**{key: ["python", "-c", "print(1)\nimport os"]}))
    assert "control characters" in found[f"pools.trainer.{key}[2]"]


def test_control_characters_in_account_qos_mem_and_engine_arg_keys_and_lists(spec_dir):
    found = parse_problems(
        spec_dir,
        data(account="a\r", qos="q\x7f", mem="16G\n", engine_args={"k\n": 1, "flags": ["a", "b\x00"]}),
    )
    assert {"pools.trainer.account", "pools.trainer.qos", "pools.trainer.mem"} <= set(found)
    assert "pools.trainer.engine_args.k\\n" in found
    assert "control characters" in found["pools.trainer.engine_args.flags"]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("nodes", 2**63 - 1, "<= 4096"),
        ("nodes", 4097, "<= 4096"),
        ("gpus_per_node", 65, "<= 64"),
        ("cpus_per_task", 4097, "<= 4096"),
        ("preempt_notice_s", 86401, "<= 65535"),
        ("time_limit", "99999999-00", "at most 365 days"),
        ("time_limit", "366-00:00:00", "at most 365 days"),
        ("mem", "99999999999T", "at most 64T"),
    ],
)
def test_counts_and_times_have_upper_bounds(spec_dir, field, value, words):
    found = parse_problems(spec_dir, data(**{field: value}))
    assert words in found[f"pools.trainer.{field}"], found


def test_max_nodes_has_an_upper_bound(spec_dir):
    doc = data()
    doc["pools"]["elastic"] = {"nodes": 1, "gpus_per_node": 0, "max_nodes": 2**63 - 1}
    assert "<= 4096" in parse_problems(spec_dir, doc)["pools.elastic.max_nodes"]


def test_bounds_themselves_are_accepted(spec_dir):
    (spec_dir / "m").mkdir()
    doc = data(nodes=4096, gpus_per_node=64, cpus_per_task=4096, preempt_notice_s=65535, time_limit="365-00:00:00")
    doc["run"]["poll_interval_s"] = 3600
    doc["pools"]["trainer"]["mem"] = "64T"
    spec = parse_spec(doc, spec_dir / "run.toml", POLICIES)
    assert spec.pools["trainer"].nodes == 4096 and spec.poll_interval_s == 3600.0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+inf"])
def test_poll_interval_must_be_finite(spec_dir, value):
    # TOML has nan and inf literals: `nan < 1` is False, so nan used to pass the >= 1 check
    found = problems(spec_dir, GOOD.replace('policy = "never"', f'policy = "never"\npoll_interval_s = {value}'))
    assert "finite" in found["run.poll_interval_s"], found


def test_poll_interval_has_an_upper_bound(spec_dir):
    found = problems(spec_dir, GOOD.replace('policy = "never"', 'policy = "never"\npoll_interval_s = 3601'))
    assert "<= 3600" in found["run.poll_interval_s"]


def test_engine_args_must_be_finite_and_flat(spec_dir):
    found = parse_problems(spec_dir, data(engine_args={"a": float("nan"), "b": [float("inf")], "c": [[1]]}))
    assert "finite" in found["pools.trainer.engine_args.a"]
    assert {"pools.trainer.engine_args.b", "pools.trainer.engine_args.c"} <= set(found)


def test_train_command_braces_must_be_placeholders(spec_dir):
    found = parse_problems(spec_dir, data(train_command=["{python}", "{0}", "{run_dir.x}", "{", "{{literal}}"]))
    assert set(k for k in found if k.startswith("pools.trainer.train_command")) == {
        "pools.trainer.train_command[1]",
        "pools.trainer.train_command[2]",
        "pools.trainer.train_command[3]",
    }


def test_a_spec_in_a_directory_with_a_newline_is_refused(tmp_path):
    odd = tmp_path / "a\nb"
    (odd / "m").mkdir(parents=True)
    found = {}
    with pytest.raises(SpecError) as info:
        parse_spec(data(), odd / "run.toml", POLICIES)
    found = {p.key: p.message for p in info.value.problems}
    assert "control characters" in found["run.model"] and "control characters" in found["run.run_dir"]


def test_daemon_slurm_options_are_checked_like_a_spec():
    from pearlctl.config import slurm_option_problems

    assert slurm_option_problems(partition="debug", nodelist="gpu[1-3],head", time_limit="1-00:00:00") == []
    bad = slurm_option_problems(partition="debug\n", nodelist="gpu1\nid", time_limit="10\n")
    assert [p.key for p in bad] == ["--partition", "--nodelist", "--time"]
    assert all("\n" not in str(p) for p in bad)


def test_constraint_and_exclude_reach_every_task_of_the_pool_as_sbatch_directives(spec_dir):
    from pearlctl.ops.launcher import grow_request, requests_for
    from pearlctl.slurm.script import sbatch_directives

    (spec_dir / "m").mkdir(exist_ok=True)
    doc = data(constraint="[rack1|rack2]&nvlink", exclude="gpu[7-8],head")
    doc["pools"]["elastic"] = {"nodes": 1, "max_nodes": 3, "gpus_per_node": 1, "exclude": "gpu7"}
    spec = parse_spec(doc, spec_dir / "run.toml", POLICIES)
    reqs = {r.pool: sbatch_directives(r) for r in requests_for(spec, "t1-0001")}
    assert "--constraint=[rack1|rack2]&nvlink" in reqs["trainer"] and "--exclude=gpu[7-8],head" in reqs["trainer"]
    assert not any(d.startswith(("--constraint", "--exclude")) for d in reqs["rollout"])
    run = {"id": "t1-0001", "run_dir": str(spec.run_dir), "spec": spec.to_dict()}
    assert "--exclude=gpu7" in sbatch_directives(grow_request(run, "elastic", 1))  # a task the daemon adds later


@pytest.mark.parametrize(
    "key,value",
    [("constraint", "h100 && a100"), ("constraint", "a;rm -rf"), ("exclude", "gpu1 gpu2"), ("exclude", "$(id)")],
)
def test_a_bad_constraint_or_exclude_is_refused_by_name(spec_dir, key, value):
    found = parse_problems(spec_dir, data(**{key: value}))
    assert f"pools.trainer.{key}" in found and "Slurm" in found[f"pools.trainer.{key}"], found


# ---- engine = "paced" ----------------------------------------------------------------------------

PROFILE = Path(__file__).resolve().parents[1] / "data" / "paced-fast.toml"
PACED = GOOD.replace('policy = "never"', f'policy = "never"\nengine = "paced"\nengine_profile = "{PROFILE}"').replace(
    "engine_args = { max_model_len = 512, enforce_eager = true }", "engine_args = { max_model_len = 512 }"
)


def test_a_paced_run_names_its_profile_and_reaches_the_workers_environment(spec_dir):
    from pearlctl.ops.launcher import requests_for
    from pearlctl.slurm.script import worker_env

    spec = load_spec(write(spec_dir, PACED), POLICIES)
    assert spec.engine == "paced" and spec.engine_profile == PROFILE
    assert spec.to_dict()["engine"] == "paced"
    envs = {r.pool: worker_env(r) for r in requests_for(spec, "r1")}
    assert envs["rollout"]["PEARL_ENGINE"] == "paced" and envs["rollout"]["PEARL_ENGINE_PROFILE"] == str(PROFILE)
    plain = {r.pool: worker_env(r) for r in requests_for(load_spec(write(spec_dir, GOOD), POLICIES), "r1")}
    assert "PEARL_ENGINE" not in plain["rollout"] and load_spec(write(spec_dir, GOOD), POLICIES).engine == "vllm"


def test_a_paced_run_refuses_what_the_paced_engine_would_not_do_by_name(spec_dir):
    found = problems(spec_dir, PACED.replace("max_model_len = 512 }", "max_model_len = 512, enforce_eager = true }"))
    assert "enforce_eager mean nothing to the paced engine" in found["pools.rollout.engine_args"]
    found = problems(spec_dir, PACED.replace(f'engine_profile = "{PROFILE}"', ""))
    assert "run.engine_profile" in found
    found = problems(spec_dir, PACED.replace(str(PROFILE), str(spec_dir / "model")))
    assert "cannot read profile" in found["run.engine_profile"]
    found = problems(spec_dir, PACED.replace('engine = "paced"', 'engine = "vllm"'))
    assert 'read only with engine = "paced"' in found["run.engine_profile"]
    found = problems(spec_dir, PACED.replace('engine = "paced"', 'engine = "sglang"'))
    assert "paced" in found["run.engine"] and "vllm" in found["run.engine"]


def test_a_trainer_without_engine_args_borrows_with_the_rollout_pools(spec_dir):
    """The vLLM workers on a trainer's borrowed GPUs serve as the rollout workers do: a trainer pool that sets
    no engine_args gets the rollout pool's (else the elastic pool's); one that sets its own keeps them."""
    spec = load_spec(write(spec_dir, GOOD), POLICIES)
    assert spec.pools["trainer"].engine_args == {"max_model_len": 512, "enforce_eager": True}
    assert spec.pools["elastic"].engine_args == {}  # only the trainer's borrowed workers inherit
    own = GOOD.replace('env = { OMP_NUM_THREADS = "1" }', "engine_args = { max_model_len = 128 }")
    assert load_spec(write(spec_dir, own), POLICIES).pools["trainer"].engine_args == {"max_model_len": 128}
    no_rollout = GOOD.split("[pools.rollout]")[0] + GOOD.split("enforce_eager = true }")[1].replace(
        'partition = "preempt"', 'partition = "preempt"\nengine_args = { max_num_seqs = 8 }'
    )
    assert load_spec(write(spec_dir, no_rollout), POLICIES).pools["trainer"].engine_args == {"max_num_seqs": 8}


# ---- the tables and the wording (pearlctl/config/tables.py, pearlctl/config/errors.py) --------------------------


def test_every_pool_kind_of_the_vocabulary_has_its_table():
    from pearlctl.config.tables import Pools
    from pearlctl.vocabulary import POOL_KINDS

    assert tuple(Pools.model_fields) == POOL_KINDS
    assert all(Pools.model_fields[kind].annotation.kind == kind for kind in POOL_KINDS)


def test_any_models_errors_are_worded_with_their_key_path_and_what_is_valid():
    """problems_from words any pydantic model's errors the house's way (a TOML file other than the spec, say)."""
    from typing import Annotated, ClassVar, Literal

    from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

    from pearlctl.config.errors import problem, problems_from

    class Leaf(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        key_noun: ClassVar[str] = "thing"
        count: Annotated[int, Field(ge=1, le=9, description="an integer from 1 to 9")]
        rate: Annotated[float, Field(allow_inf_nan=False, description="a rate")] = 1.0
        mode: Annotated[Literal["a", "b"], Field(description="one of a, b")] = "a"

    class Root(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        leaf: Leaf
        other: Leaf | None = None
        env: dict[str, str] = {}

        @field_validator("env")
        @classmethod
        def _port(cls, env: dict[str, str]) -> dict[str, str]:
            if not env.get("PORT", "1").isdigit():
                raise problem("must be a port number", at="PORT")
            return env

    with pytest.raises(ValidationError) as info:
        Root.model_validate(
            {"leaf": {"cont": 1, "rate": float("nan"), "mode": "c"}, "other": 5, "env": {"PORT": "x"}, "extra": 1}
        )
    found = {p.key: p.message for p in problems_from(info.value, Root)}
    assert found == {
        "leaf.count": "is required: an integer from 1 to 9",
        "leaf.cont": "unknown thing (did you mean 'count'?); valid things: count, rate, mode",
        "leaf.rate": "must be a finite number (not nan or inf): a rate, got nan",
        "leaf.mode": "must be one of a, b; got 'c'",
        "other": "must be a table, got int",
        "env.PORT": "must be a port number",
        "extra": "unknown key; valid keys: leaf, other, env",
    }


def test_importing_the_package_leaves_pydantic_until_a_spec_is_read():
    """Every CLI command imports pearlctl.config (SpecError, load_spec): pydantic and the tables' models cost
    their import and build only when a spec is read."""
    import subprocess
    import sys

    code = "import sys, pearlctl.config; print(sorted(m for m in sys.modules if 'pydantic' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
