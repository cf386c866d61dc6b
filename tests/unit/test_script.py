"""sbatch scripts rendered from a pool: what Slurm and the worker wrapper will see."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pearlctl.slurm.script import SubmitRequest, render_script, sbatch_directives, worker_env

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def request(**kw) -> SubmitRequest:
    base = dict(
        run_id="tiny-abc123",
        pool="elastic",
        role="ROLLOUT",
        array_size=3,
        gpus_per_node=2,
        run_dir="/runs/tiny",
        model="/models/tiny",
        python="/venv/bin/python",
        worker_script="/repo/jobs/worker.sh",
        partition="preempt",
        time_limit="00:30:00",
        requeue=True,
        preempt_signal="USR2",
        preempt_notice_s=30,
        engine_args={"max_model_len": 512},
        env={"OMP_NUM_THREADS": "1", "WEIRD": "a b'c"},
    )
    base.update(kw)
    return SubmitRequest(**base)


def directives(script: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_elastic_pool_is_a_requeueable_array_with_a_batch_shell_signal():
    d = directives(render_script(request()))
    assert "--array=0-2" in d and "--nodes=1" in d and "--gres=gpu:2" in d
    assert "--requeue" in d and "--partition=preempt" in d and "--time=00:30:00" in d
    assert "--signal=B:USR2@30" in d
    assert "--job-name=pearl.tiny-abc123.elastic" in d
    assert "--output=/runs/tiny/logs/elastic-%A_%a.log" in d and "--open-mode=append" in d


def test_fixed_pool_does_not_requeue_and_cpu_pool_asks_no_gres():
    d = directives(render_script(request(pool="rollout", requeue=False, gpus_per_node=0, partition=None)))
    assert "--no-requeue" in d and "--requeue" not in d
    assert not any(x.startswith("--gres") or x.startswith("--partition") for x in d)


def test_body_exports_env_safely_and_execs_the_worker_wrapper(tmp_path):
    script = render_script(request(command=("python", "train.py", "--lr", "1e-5")))
    body = [line for line in script.splitlines() if not line.startswith("#")]
    assert body[-1] == "exec /bin/bash /repo/jobs/worker.sh python train.py --lr 1e-5"
    # the exports are valid bash and survive quotes and spaces
    exports = "\n".join(line for line in body if line.startswith("export "))
    printed = subprocess.run(
        ["bash", "-c", exports + '\nprintf "%s|%s|%s" "$WEIRD" "$PEARL_ENGINE_ARGS" "$PEARL_POOL"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == 'a b\'c|{"max_model_len": 512}|elastic'


def test_default_payload_is_the_agent():
    last = render_script(request()).splitlines()[-1]
    assert shlex.split(last)[-3:] == ["/venv/bin/python", "-m", "pearlctl.agent"]


# --- defence in depth: nothing with a control character is ever rendered (issue 8) ----------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("run_id", "tiny\nsbatch evil.sh"),
        ("pool", "elastic\n"),
        ("partition", "preempt\necho pwned"),
        ("time_limit", "00:30:00\r"),
        ("account", "acct\n"),
        ("qos", "q\x00"),
        ("mem", "16G\n"),
        ("nodelist", "gpu[1-2]\nx"),
        ("run_dir", "/runs/tiny\ntouch /tmp/pwned #"),
        ("model", "/models/tiny\n"),
        ("python", "/venv/bin/python\x7f"),
        ("worker_script", "/repo/jobs/worker.sh\n"),
        ("preempt_signal", "USR2\n"),
        ("env", {"OMP_NUM_THREADS": "1\nrm -rf /"}),
        ("env", {"A; touch /tmp/x; B": "1"}),
        ("command", ("python", "-c", "1\n2")),
    ],
)
def test_render_refuses_control_characters_anywhere(field, value):
    with pytest.raises(ValueError, match="refusing to render"):
        render_script(request(**{field: value}))


def test_json_values_are_escaped_not_refused():
    # the train command and engine args travel as JSON: a newline in them is written as \\n
    script = render_script(request(train_command=("python", "a\nb"), engine_args={"x": "1\n2"}))
    assert all(line.isprintable() for line in script.splitlines())


def test_directives_refuse_a_newline_in_any_value():
    with pytest.raises(ValueError, match="control character"):
        sbatch_directives(request(partition="preempt\n"))
    with pytest.raises(ValueError, match="array_size"):
        sbatch_directives(request(array_size=0))


def test_directives_refuse_whitespace_that_sbatch_would_split_into_another_option():
    # "#SBATCH --output=/tmp/a --partition=high/logs/..." would hand sbatch a second option
    with pytest.raises(ValueError, match="whitespace"):
        sbatch_directives(request(run_dir="/tmp/a --partition=high"))


def test_drain_timeout_follows_the_preemption_notice():
    assert worker_env(request(preempt_notice_s=30))["PEARL_DRAIN_TIMEOUT_S"] == "25"
    assert worker_env(request(preempt_notice_s=60))["PEARL_DRAIN_TIMEOUT_S"] == "55"
    assert worker_env(request(preempt_notice_s=3))["PEARL_DRAIN_TIMEOUT_S"] == "1"
    # a pool's env may still set it
    assert worker_env(request(env={"PEARL_DRAIN_TIMEOUT_S": "7"}))["PEARL_DRAIN_TIMEOUT_S"] == "7"
    assert "export PEARL_DRAIN_TIMEOUT_S=25" in render_script(request())


# --- the wrappers never glob (issue 8) -----------------------------------------------------------------

ARGV_DUMP = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"


@pytest.fixture
def globbable(tmp_path: Path) -> Path:
    """A working directory where `*` would expand to file names, and a payload that records its argv."""
    for name in ("a.txt", "b.txt", "c.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "dump.py").write_text(ARGV_DUMP)
    return tmp_path


@pytest.mark.parametrize("pool", ["trainer", "rollout", "elastic", "reward"])
def test_by_hand_wrappers_pass_a_star_in_pearl_command_literally(globbable, pool):
    out = globbable / "argv.json"
    env = {
        **os.environ,
        "PEARL_MODEL": str(globbable),
        "PEARL_RUN_DIR": str(globbable / "run"),
        "PEARL_JOBS_DIR": str(JOBS),
        "SLURM_SUBMIT_DIR": str(globbable),
        "PEARL_COMMAND": f"{sys.executable} dump.py {out} * *.txt [ab].txt",
    }
    subprocess.run(["bash", str(JOBS / f"{pool}.sbatch")], cwd=globbable, env=env, check=True, timeout=60)
    assert out.read_text() == '["*", "*.txt", "[ab].txt"]'


def test_worker_wrapper_passes_arguments_literally(globbable):
    out = globbable / "argv.json"
    args = [sys.executable, "dump.py", str(out), "*", "a b", "$HOME", "*.txt"]
    subprocess.run(["bash", str(JOBS / "worker.sh"), *args], cwd=globbable, check=True, timeout=60)
    assert out.read_text() == '["*", "a b", "$HOME", "*.txt"]'


def test_a_rendered_script_passes_a_star_literally(globbable):
    out = globbable / "argv.json"
    req = request(
        worker_script=str(JOBS / "worker.sh"),
        run_dir=str(globbable / "run"),
        command=(sys.executable, "dump.py", str(out), "*", "*.txt", "a b"),
    )
    script = globbable / "pool.sbatch"
    script.write_text(render_script(req))
    subprocess.run(["bash", str(script)], cwd=globbable, check=True, timeout=60)
    assert out.read_text() == '["*", "*.txt", "a b"]'


# -- a trainer of several nodes: one multi-node job ----------------------------------------------------
def gang_request(**kw) -> SubmitRequest:
    return request(**{"pool": "trainer", "role": "TRAIN", "array_size": 2, "array": False, "gang": True, **kw})


def test_a_multi_node_trainer_is_one_job_of_n_nodes_whose_notice_reaches_its_step():
    d = directives(render_script(gang_request()))
    assert "--nodes=2" in d and "--ntasks-per-node=1" in d and "--gres=gpu:2" in d
    assert not any(x.startswith("--array") for x in d)
    # not B: the notice goes to every node's processes (srun's step), not only the batch shell on node 0
    assert "--signal=USR2@30" in d
    assert "--output=/runs/tiny/logs/trainer-%j_%t.log" in d  # {pool}-{job}_{node rank}.log, like an array task


def test_a_multi_node_trainer_sruns_the_worker_wrapper_once_per_node_under_slurm_and_runs_it_without():
    body = [line for line in render_script(gang_request()).splitlines() if not line.startswith("#")]
    worker = "/bin/bash /repo/jobs/worker.sh /venv/bin/python -m pearlctl.agent"
    assert body[-2] == (
        'if [ -n "${SLURM_JOB_ID:-}" ]; then exec srun --ntasks-per-node=1 --open-mode=append '
        f"--output=/runs/tiny/logs/trainer-%j_%t.log {worker}; fi"
    )
    assert body[-1] == f"exec {worker}"  # the local backend runs the script once per node itself


@pytest.mark.parametrize("kw", [{"array": True}, {"first_task": 1, "array": True}, {"array_size": 0}])
def test_a_multi_node_job_that_is_also_an_array_or_has_no_node_is_refused(kw):
    with pytest.raises(ValueError, match="multi-node job"):
        sbatch_directives(gang_request(**kw))


def test_a_notice_before_the_payload_handles_it_does_not_kill_the_payload(tmp_path):
    """The preemption notice (USR2) in the payload's first moments, before it installs a handler: the payload
    lives on (it would have died with status 140, a failed task, not a requeued one); the notice it handles
    once its handler is installed reaches it."""
    payload = tmp_path / "payload.py"
    payload.write_text(
        "import signal, sys, time\n"
        "time.sleep(1.5)  # starting: no handler yet\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR2, lambda *a: got.append(1))\n"
        "print('ready', flush=True)\n"
        "deadline = time.time() + 20\n"
        "while not got and time.time() < deadline:\n"
        "    time.sleep(0.05)\n"
        "sys.exit(0 if got else 3)\n"
    )
    proc = subprocess.Popen(
        ["bash", str(JOBS / "worker.sh"), sys.executable, str(payload)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR2)  # to the wrapper, as Slurm's --signal=B:USR2 does; forwarded at once
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(30) == 0
