"""sbatch scripts rendered from a pool: what Slurm and the worker wrapper will see."""

import shlex
import subprocess

from pearlctl.slurm.script import SubmitRequest, render_script


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
