"""The paced trainer (pearlctl.trainer.paced): the real trainer hook with sleeps for compute.

Each test runs ``main`` in this process (in the main thread: the hook installs its signal handlers there)
over a ``FileChannel``, with a controller thread playing the daemon and the rollout driver; durations are
tens of milliseconds. Pacing is checked from the timings the trainer reports, never the test's wall clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pearlctl.trainer import FileChannel
from pearlctl.trainer.paced import batch_summary, main, parse_args

pytestmark = pytest.mark.timeout(60)

TRAIN_S = 0.05
OFFLOAD_S = 0.12
RELOAD_S = 0.08
EXPORT_S = 0.05
POLL_S = 0.02


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """No hint, store or world from the environment; the hook's signal handlers are undone after each test."""
    for name in ("PEARL_FIRST_WAIT_S", "PEARL_WEIGHT_STORE", "PEARL_WEIGHTS_BROADCAST", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def run(tmp_path):
    """The paths of one paced run: a model directory, the rollout directory, the channel and the run dir."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["PacedTest"], "dtype": "float32"}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_text("the base weights: never copied into an export")
    (tmp_path / "rollouts").mkdir()

    class Run:
        root = tmp_path
        model_dir = model
        rollouts = tmp_path / "rollouts"
        channel_dir = tmp_path / "channel"
        out = tmp_path / "out"

        def argv(self, steps: int = 3, *extra: str) -> list[str]:
            return [
                "--model", str(self.model_dir), "--out", str(self.out), "--steps", str(steps),
                "--rollouts", f"file:{self.rollouts}", "--channel", f"file:{self.channel_dir}",
                "--train-step-s", str(TRAIN_S), "--offload-s", str(OFFLOAD_S), "--reload-s", str(RELOAD_S),
                "--export-s", str(EXPORT_S), "--poll-interval", str(POLL_S), *extra,
            ]  # fmt: skip

        def batch(self, step: int) -> None:
            """Two groups of three samples, rewards 0, 0.5, 1 (mean 0.5), written as a driver does: renamed in."""
            lines = [json.dumps({"prompt": f"p{i}", "rewards": [0, 0.5, 1], "trajectories": []}) for i in range(2)]
            tmp = self.rollouts / f".step-{step}.tmp"
            tmp.write_text("\n".join(lines) + "\n")
            os.replace(tmp, self.rollouts / f"step-{step:06d}.jsonl")

        def log(self) -> list[dict]:
            return [json.loads(line) for line in (self.out / "train.jsonl").read_text().splitlines()]

        def reports(self) -> list[dict]:
            """The hook's reports so far (the last line may be half written: skipped)."""
            path = self.channel_dir / "events.jsonl"
            found = []
            for line in path.read_text().splitlines() if path.exists() else []:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    pass
            return found

        def wait_report(self, predicate: Callable[[dict], bool], timeout: float = 10.0) -> dict:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for event in self.reports():
                    if predicate(event):
                        return event
                time.sleep(0.01)
            raise TimeoutError("the trainer made no such report")

    return Run()


def run_main(argv: list[str], controller: Callable[[], None] | None = None) -> int:
    """``main(argv)`` here, with ``controller`` in a thread. A failing controller stops the trainer (TERM: it
    checkpoints and exits), so a broken behaviour fails the test instead of hanging it; its error is raised."""
    errors: list[BaseException] = []

    def control() -> None:
        try:
            controller()
        except BaseException as exc:
            errors.append(exc)
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=control, daemon=True) if controller else None
    if thread:
        thread.start()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    if thread:
        thread.join(10)
    if errors:
        raise errors[0]
    return rc


def steps_of(log: list[dict]) -> list[int]:
    return [e["step"] for e in log if e["event"] == "step"]


# ---------------------------------------------------------------------- a run
def test_trains_on_the_batch_files_and_exports_each_step(run):
    for step in (1, 2, 3):
        run.batch(step)
    assert run_main(run.argv(3, "--keep-weights", "2")) == 0

    log = run.log()
    assert [e["event"] for e in log] == ["start", "step", "step", "step", "done"]
    assert log[0]["first_step"] == 1 and log[0]["paced"]["train_step_s"] == TRAIN_S
    steps = [e for e in log if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert [e["weight_version"] for e in steps] == ["1", "2", "3"]
    for e in steps:
        assert (e["groups"], e["samples"], e["reward_mean"]) == (2, 6, 0.5)
        assert e["loss"] is None and e["was_released"] is False
        assert e["timings"]["train_s"] >= TRAIN_S
        assert e["timings"]["export_s"] >= EXPORT_S
    assert log[-1] == {"event": "done", "ts": log[-1]["ts"], "step": 3}

    weights = run.out / "weights"
    assert (weights / "LATEST").read_text() == "3\n"
    assert (weights / "3" / "pearl_weight_version.txt").read_text() == "3\n"
    assert (weights / "3" / "model.safetensors").stat().st_size > 0
    assert (weights / "3" / "tokenizer.json").read_text() == "{}"  # the base model's files come along
    assert json.loads((weights / "3" / "config.json").read_text())["architectures"] == ["PacedTest"]
    assert sorted(p.name for p in weights.iterdir() if p.is_dir()) == ["2", "3"]  # --keep-weights 2

    reports = run.reports()
    assert [e["step"] for e in reports if e["phase"] == "training"] == [1, 2, 3]
    waiting = [e for e in reports if e["phase"] == "waiting"]
    assert all(e["expected_wait_s"] is None for e in waiting if e["step"] == 1)  # nothing measured yet
    assert all(e["expected_wait_s"] is not None for e in waiting if e["step"] > 1)  # train.py's moving average


def test_a_release_while_waiting_is_carried_out_and_a_reclaim_comes_before_the_next_step(run):
    run.batch(1)
    daemon = FileChannel(run.channel_dir)
    acks: dict[str, dict] = {}

    def controller() -> None:
        run.wait_report(lambda e: e["phase"] == "waiting" and e["step"] == 2)
        daemon.send("release", command_id="r1")
        acks["r1"] = daemon.wait_ack("r1", timeout=10)
        run.batch(2)  # the batch is there, but the GPUs are lent: the trainer must block until the reclaim
        run.wait_report(lambda e: e["step"] == 2 and e.get("blocked_s") is not None)
        daemon.send("reclaim", command_id="c1")
        acks["c1"] = daemon.wait_ack("c1", timeout=10)
        run.batch(3)

    assert run_main(run.argv(3), controller) == 0

    log = run.log()
    assert [e["event"] for e in log] == ["start", "step", "release", "reclaim", "step", "step", "done"]
    assert steps_of(log) == [1, 2, 3]
    release = next(e for e in log if e["event"] == "release")
    reclaim = next(e for e in log if e["event"] == "reclaim")
    assert release["command_id"] == "r1" and release["ok"] and release["freed_by"] == "offload_states"
    assert release["offload_s"] >= OFFLOAD_S  # the paced offload, as the hook timed it
    assert reclaim["command_id"] == "c1" and reclaim["ok"]
    assert reclaim["reload_s"] >= RELOAD_S
    assert acks["r1"]["ok"] and acks["r1"]["offload_s"] >= OFFLOAD_S
    assert acks["c1"]["ok"] and acks["c1"]["reload_s"] >= RELOAD_S

    reports = run.reports()
    assert any(e["released"] for e in reports if e["phase"] == "waiting" and e["step"] == 2)
    assert not any(e["released"] for e in reports if e["phase"] == "training")  # never trained while lent


def test_a_release_by_checkpoint_saves_and_its_reclaim_loads_that_checkpoint(run):
    run.batch(1)
    daemon = FileChannel(run.channel_dir)

    def controller() -> None:
        run.wait_report(lambda e: e["phase"] == "waiting" and e["step"] == 2)
        daemon.send("release", command_id="r1", mode="checkpoint")
        daemon.wait_ack("r1", timeout=10)
        daemon.send("reclaim", command_id="c1")
        daemon.wait_ack("c1", timeout=10)
        run.batch(2)

    assert run_main(run.argv(2), controller) == 0
    log = run.log()
    assert [e["event"] for e in log] == ["start", "step", "release", "reclaim", "step", "done"]
    release, reclaim = log[2], log[3]
    assert release["mode"] == "checkpoint" and release["freed_by"] == "offload_states"
    assert release["free_s"] >= OFFLOAD_S  # a checkpoint release frees by offload_states too (ZeRO-1)
    assert json.loads((Path(release["checkpoint"]) / "paced_state.json").read_text())["global_steps"] == 1
    assert reclaim["mode"] == "checkpoint" and reclaim["reload_s"] >= RELOAD_S and "load_s" in reclaim


# ---------------------------------------------------------------------- signals
def test_term_while_waiting_checkpoints_and_the_next_run_resumes_there(run):
    run.batch(1)

    def controller() -> None:
        run.wait_report(lambda e: e["phase"] == "waiting" and e["step"] == 2)
        os.kill(os.getpid(), signal.SIGTERM)

    assert run_main(run.argv(3), controller) == 0
    first = run.log()
    assert [e["event"] for e in first] == ["start", "step", "checkpoint"]
    assert first[-1]["step"] == 1 and first[-1]["reason"] == "signal"
    assert run.reports()[-1]["phase"] == "stopped" and run.reports()[-1]["step"] == 1
    assert (run.out / "checkpoints" / "latest").exists()

    run.batch(2)
    run.batch(3)
    assert run_main(run.argv(3)) == 0
    second = run.log()[len(first) :]
    assert [e["event"] for e in second] == ["resume", "start", "step", "step", "done"]
    assert second[0]["step"] == 1 and second[1]["first_step"] == 2
    assert steps_of(second) == [2, 3]  # step 1 is not trained again
    assert second[2]["global_steps"] == 2  # the engine's count came back from the checkpoint


def test_term_while_training_finishes_the_step_and_checkpoints_it_before_waiting_again(run):
    for step in (1, 2):
        run.batch(step)

    def controller() -> None:
        run.wait_report(lambda e: e["phase"] == "training" and e["step"] == 1)
        os.kill(os.getpid(), signal.SIGTERM)  # the step sleeps 0.5 s: this lands inside it

    assert run_main([*run.argv(2), "--train-step-s", "0.5"], controller) == 0
    log = run.log()
    assert [e["event"] for e in log] == ["start", "step", "checkpoint"]
    assert log[1]["timings"]["train_s"] >= 0.5  # the signal did not cut the step short
    assert log[2]["step"] == 1 and log[2]["reason"] == "signal"
    assert not [e for e in run.reports() if e["step"] == 2]  # stopped at the step boundary (should_stop)
    assert (run.out / "weights" / "1" / "pearl_weight_version.txt").exists()


# ---------------------------------------------------------------------- arguments
BAD = [
    (["--steps", "0"], "--steps"),
    (["--steps", "two"], "--steps"),
    (["--train-step-s", "-1"], "--train-step-s"),
    (["--train-step-s", "nan"], "--train-step-s"),
    (["--train-step-s", "inf"], "--train-step-s"),
    (["--offload-s", "-0.5"], "--offload-s"),
    (["--reload-s", "soon"], "--reload-s"),
    (["--export-s", "-1"], "--export-s"),
    (["--poll-interval", "0"], "--poll-interval"),
    (["--keep-weights", "-1"], "--keep-weights"),
    (["--rollouts", "synthetic"], "--rollouts"),
    (["--rollouts", "file:"], "--rollouts"),
    (["--channel", "http://daemon"], "--channel"),
    (["--channel", "file:"], "--channel"),
    (["--release-mode", "drop"], "--release-mode"),
]


@pytest.mark.parametrize(("bad", "option"), BAD, ids=[" ".join(b) for b, _ in BAD])
def test_a_bad_value_exits_2_naming_the_option(run, capsys, bad, option):
    run.batch(1)  # without the check, main would run one step and return 0 (or fail another way)
    with pytest.raises(SystemExit) as exc:
        main([*run.argv(1), *bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err
    assert not (run.out / "train.jsonl").exists()


def test_a_model_directory_without_a_config_and_a_missing_pacing_are_refused(run, capsys):
    empty = run.root / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exc:
        main([*run.argv(1), "--model", str(empty)])
    assert (
        exc.value.code == 2
        and "argument --model: must be a model directory with a config.json" in capsys.readouterr().err
    )
    argv = run.argv(1)
    at = argv.index("--train-step-s")
    with pytest.raises(SystemExit) as exc:
        main(argv[:at] + argv[at + 2 :])
    assert exc.value.code == 2 and "--train-step-s" in capsys.readouterr().err


def test_good_values_parse(run):
    args = parse_args([*run.argv(7), "--keep-weights", "0", "--channel", "daemon", "--release-mode", "checkpoint"])
    assert (args.steps, args.keep_weights, args.channel, args.release_mode) == (7, 0, "daemon", "checkpoint")
    assert (args.train_step_s, args.offload_s, args.reload_s, args.export_s) == (TRAIN_S, OFFLOAD_S, RELOAD_S, EXPORT_S)
    assert args.rollouts == run.rollouts and args.poll_interval == POLL_S
    defaults = parse_args(["--model", str(run.model_dir), "--out", "o", "--rollouts", "file:r", "--train-step-s", "0"])
    assert (defaults.steps, defaults.channel, defaults.poll_interval, defaults.keep_weights) == (5, "none", 0.2, 3)
    assert (defaults.offload_s, defaults.reload_s, defaults.export_s) == (0.0, 0.0, 0.0)


def test_the_module_runs_as_a_program_and_imports_no_torch(run):
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    bad = subprocess.run(
        [sys.executable, "-m", "pearlctl.trainer.paced", *run.argv(1), "--offload-s", "-1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2 and "argument --offload-s: must be a finite number of seconds >= 0" in bad.stderr
    code = "import sys, pearlctl.trainer.paced; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_batch_summary_counts_groups_and_samples_and_admits_what_it_cannot_count(tmp_path):
    path = tmp_path / "step-000001.jsonl"
    path.write_text('{"rewards": [1, 0]}\n\n{"rewards": [1]}\n')
    assert batch_summary(path) == {"groups": 2, "samples": 3, "reward_mean": 2 / 3}
    for bad in ("not json", '{"rewards": [NaN]}', '{"rewards": [true]}', "[1, 2]", '{"prompt": "no rewards"}'):
        path.write_text('{"rewards": [1, 0]}\n' + bad + "\n")
        assert batch_summary(path) == {"groups": 2, "samples": None, "reward_mean": None}, bad


def test_two_ranks_under_torchrun_agree_on_a_release_and_rank_0_alone_logs(run):
    """A multi-node trainer pool starts it with torchrun: the ranks join a gloo group, act on rank 0's
    commands together (the hook's agreement), and one log comes out. Two real processes on this machine."""
    run.batch(1)
    daemon = FileChannel(run.channel_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "pearlctl.trainer.paced", *run.argv(3)],
        env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        run.wait_report(lambda e: e["phase"] == "waiting" and e["step"] == 2, timeout=60)
        daemon.send("release", command_id="r1")
        assert daemon.wait_ack("r1", timeout=20)["ok"]
        run.batch(2)
        daemon.send("reclaim", command_id="c1")
        assert daemon.wait_ack("c1", timeout=20)["ok"]
        run.batch(3)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    log = run.log()
    assert [e["event"] for e in log] == ["start", "step", "release", "reclaim", "step", "step", "done"]
    assert log[0]["world_size"] == 2 and log[0]["rank"] == 0
    assert steps_of(log) == [1, 2, 3]
    assert (run.out / "weights" / "LATEST").read_text() == "3\n"
