"""The trainer hook with real DeepSpeed ranks on CPU: the example GRPO trainer (examples/grpo/train.py),
two ranks started directly (the fastest way: docs/architecture.md, "Engines on a CPU-only machine"), the tiny
model.

- training really changes the weights and the loss stays finite;
- release/reclaim mid-training through a file channel: all ranks offload, training blocks until the
  reclaim, and no step is lost;
- USR2 to both ranks: joint checkpoint, exit 0; a restart resumes at the next step and its losses match
  an uninterrupted run;
- the exported weight directory loads with transformers and matches the base model's shapes and dtypes;
- a malformed rollout batch stops both ranks with exit status 2 and a ``bad batch`` event naming the line and
  the field (docs/rollout-batches.md), not a traceback from deep in the loss.

Every test runs under the engine lock (tests/engines/conftest.py: an exclusive flock on
/tmp/pearl-engine.lock, shared with the vLLM tests; the machine has 2 cores) and kills the ranks it
started, by PID, whatever happens. Each test's ranks finish in well under 60 s.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import deepspeed  # noqa: F401  (installed by scripts/setup: a missing engine fails, never skips)
import pytest
import transformers  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "grpo" / "train.py"
TINY = REPO / "examples" / "models" / "tiny"
if str(TRAIN.parent) not in sys.path:
    sys.path.insert(0, str(TRAIN.parent))

import token_batch as tb  # noqa: E402  (examples/grpo: the rollout batch format)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Two trainer ranks started directly (no launcher), each in its own session, logs in the run dir."""

    def __init__(self, out: Path, *args: str, world_size: int = 2):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for rank in range(world_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
                TOKENIZERS_PARALLELISM="false",
            )
            log = out / f"rank{rank}.{len(list(out.glob(f'rank{rank}.*.log')))}.log"
            self.logs.append(log)
            with log.open("w") as f:
                cmd = [sys.executable, str(TRAIN), "--model", str(TINY), "--out", str(out), *args]
                self.procs.append(
                    subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
                )

    def wait(self, timeout: float = 60) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"ranks did not finish within {timeout} s\n{self.tail()}")
        return codes

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(10)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def tail(self, n: int = 40) -> str:
        return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-n:]) for log in self.logs)


@pytest.fixture
def ranks(engine_lock):  # engine_lock: tests/engines/conftest.py
    """Start ranks with ``ranks(out, *args)``; every rank started is killed (by PID) at teardown."""
    started: list[Ranks] = []

    def start(out: Path, *args: str) -> Ranks:
        r = Ranks(out, *args)
        started.append(r)
        return r

    yield start
    for r in started:
        r.kill()


def events(out: Path, kind: str | None = None) -> list[dict]:
    path = out / "train.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["event"] == kind]


def wait_for(predicate, timeout: float, what: str, ranks: Ranks | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if ranks is not None and not ranks.alive():
            pytest.fail(f"ranks exited while waiting for {what}\n{ranks.tail()}")
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}" + (f"\n{ranks.tail()}" if ranks else ""))


def load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# ---------------------------------------------------------------------- (a) it really trains
def test_synthetic_training_changes_weights_and_loss_is_finite(ranks, tmp_path):
    out = tmp_path / "run"
    r = ranks(out, "--steps", "4", "--zero", "2", "--keep-weights", "0")
    assert r.wait(60) == [0, 0], r.tail()
    steps = events(out, "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps), steps
    assert all(s["tokens"] > 0 for s in steps), "no step had a completion token with a non-zero advantage"
    assert [s["weight_version"] for s in steps] == ["1", "2", "3", "4"]
    first = load_safetensors(out / "weights" / "1" / "model.safetensors")
    last = load_safetensors(out / "weights" / "4" / "model.safetensors")
    assert first.keys() == last.keys()
    changed = [k for k in first if not (first[k] == last[k]).all()]
    assert changed, "weights did not change between step 1 and step 4"
    assert (out / "weights" / "LATEST").read_text().strip() == "4"


# ---------------------------------------------------------------------- (b) release / reclaim
@pytest.mark.parametrize(
    ("zero", "dtype", "expect_mode", "expect_freed"),
    [("2", "bf16", "offload", "offload_states"), ("0", "fp32", "checkpoint", "optimizer_states_to_host")],
    ids=["zero2-offload", "zero0-checkpoint"],
)
def test_release_blocks_training_until_reclaim_and_no_step_is_lost(
    ranks, tmp_path, zero, dtype, expect_mode, expect_freed
):
    from pearlctl.trainer import FileChannel

    out = tmp_path / "run"
    channel = FileChannel(tmp_path / "channel")
    steps_total = 6
    r = ranks(
        out,
        "--steps", str(steps_total), "--zero", zero, "--dtype", dtype,
        "--channel", f"file:{channel.root}", "--poll-interval", "0.05",
    )  # fmt: skip
    wait_for(lambda: any(e["phase"] == "training" and e["step"] == 2 for e in channel.read_events()), 60, "step 2", r)

    release_id = channel.send("release")
    ack = channel.wait_ack(release_id, timeout=30)
    assert ack["ok"], ack
    assert ack["command"] == "release"
    assert ack["mode"] == expect_mode
    assert ack["freed_by"] == expect_freed
    assert ack["max_rank_s"] >= ack["total_s"] > 0
    if expect_mode == "checkpoint":
        assert ack["fallback"].startswith("ZeRO-0"), ack  # ZeRO-0 cannot offload: released by checkpoint
        assert (out / "checkpoints" / "latest").exists()

    # Released: the trainer blocks in ensure_reclaimed and keeps asking the daemon; no step happens.
    steps_at_release = len(events(out, "step"))
    wait_for(lambda: any(e.get("blocked_s") for e in channel.read_events()), 10, "a blocked poll", r)
    time.sleep(1.5)
    assert len(events(out, "step")) == steps_at_release, "trained while released"
    blocked = [e for e in channel.read_events() if e.get("blocked_s") is not None]
    assert all(e["released"] and e["phase"] == "waiting" for e in blocked)
    assert len(blocked) >= 5, "the blocked trainer stopped polling"
    assert r.alive()

    # A repeated release (an HTTP retry) is answered with the first result and not carried out again.
    channel.send("release", command_id=release_id)
    reclaim_id = channel.send("reclaim")
    reclaim = channel.wait_ack(reclaim_id, timeout=30)
    assert reclaim["ok"] and reclaim["command"] == "reclaim" and reclaim["mode"] == expect_mode, reclaim
    if expect_mode == "checkpoint":
        assert reclaim["load_s"] > 0

    assert r.wait(60) == [0, 0], r.tail()
    rows = events(out)
    steps = [e["step"] for e in rows if e["event"] == "step"]
    assert steps == list(range(1, steps_total + 1)), "a step was lost or repeated"
    assert all(math.isfinite(e["loss"]) for e in rows if e["event"] == "step")
    kinds = [e["event"] for e in rows if e["event"] in ("step", "release", "reclaim")]
    assert kinds.count("release") == 1 and kinds.count("reclaim") == 1, kinds
    assert kinds.index("release") < kinds.index("reclaim")
    assert kinds[kinds.index("release") + 1] == "reclaim", "a step ran between release and reclaim"
    assert channel.read_ack(release_id)["total_s"] == ack["total_s"]  # the retry got the stored answer


def write_batch(root: Path, step: int, groups: list[dict]) -> None:
    """What a rollout driver does: write the step's batch under a temporary name, then rename it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step-{step:06d}.tmp"
    tmp.write_text("".join(json.dumps(g) + "\n" for g in groups))
    tmp.rename(root / f"step-{step:06d}.jsonl")


def token_group(prompt: str, rewards: list[float], seed: int) -> dict:
    """A token-level group of two-turn trajectories (ids of the tiny model's vocabulary), as a driver writes it."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 2048) for _ in range(n)]

    def turn(n: int) -> tb.Sampled:
        return tb.Sampled(ids(n), [-rng.uniform(0.5, 8.0) for _ in range(n)], "0")

    trajectories = tuple(tb.trajectory_from_turns(ids(8), [turn(4), ids(6), turn(3)]) for _ in rewards)
    return json.loads(tb.dump_group(tb.Group(prompt=prompt, rewards=tuple(rewards), trajectories=trajectories)))


def test_file_rollouts_release_while_waiting_for_the_batch(ranks, tmp_path):
    from pearlctl.trainer import FileChannel

    rollouts, out = tmp_path / "rollouts", tmp_path / "run"
    channel = FileChannel(tmp_path / "channel")
    groups = [
        token_group(f"{a} + {b} =", [1, 0.2, 0, 0.3], seed=a * 100 + b) for a, b in ((1, 2), (30, 4), (5, 60), (7, 7))
    ]
    write_batch(rollouts, 1, groups)
    r = ranks(out, "--steps", "2", "--rollouts", f"file:{rollouts}", "--channel", f"file:{channel.root}",
              "--poll-interval", "0.05")  # fmt: skip
    waiting = wait_for(
        lambda: [e for e in channel.read_events() if e["phase"] == "waiting" and e["step"] == 2], 60, "the wait", r
    )
    assert waiting[0]["weight_version"] == "1" and waiting[0]["expected_wait_s"] is not None
    ack = channel.wait_ack(channel.send("release"), timeout=30)  # served while waiting for the batch
    assert ack["ok"] and ack["mode"] == "offload"
    write_batch(rollouts, 2, groups)
    time.sleep(1.0)
    assert [e["step"] for e in events(out, "step")] == [1], "trained on released GPUs"
    assert channel.wait_ack(channel.send("reclaim"), timeout=30)["ok"]
    assert r.wait(60) == [0, 0], r.tail()
    steps = events(out, "step")
    assert [e["step"] for e in steps] == [1, 2] and all(math.isfinite(e["loss"]) for e in steps)
    assert steps[0]["reward_mean"] == pytest.approx(0.375)
    assert steps[0]["tokens"] == 4 * 4 * 7  # the mask-1 tokens of every trajectory: 4 groups of 4, 7 sampled each
    assert all(math.isfinite(e["logp_gap"]) for e in steps)


def test_a_malformed_batch_stops_the_ranks_with_the_field_named(ranks, tmp_path):
    rollouts, out = tmp_path / "rollouts", tmp_path / "run"
    good = token_group("1 + 2 =", [1, 0], seed=1)
    bad = token_group("3 + 4 =", [1, 0], seed=2)
    bad["trajectories"][1]["logprobs"].pop()
    write_batch(rollouts, 1, [good, bad])
    r = ranks(out, "--steps", "1", "--rollouts", f"file:{rollouts}", "--poll-interval", "0.05")
    assert r.wait(60) == [2, 2], r.tail()
    (event,) = events(out, "bad batch")
    assert event["step"] == 1 and "step-000001.jsonl line 2: trajectories.1" in event["error"], event
    assert "logprobs has 6 entries, mask has 7 sampled token(s)" in event["error"]
    assert events(out, "step") == [] and "Traceback" not in r.tail()


# ---------------------------------------------------------------------- (c) signals, joint checkpoint, resume
def test_usr2_checkpoints_jointly_and_resume_matches_an_uninterrupted_run(ranks, tmp_path):
    args = ("--steps", "8", "--zero", "2", "--seed", "3")
    ref_out = tmp_path / "uninterrupted"
    ref = ranks(ref_out, *args)
    assert ref.wait(60) == [0, 0], ref.tail()
    reference = {e["step"]: e["loss"] for e in events(ref_out, "step")}
    assert sorted(reference) == list(range(1, 9))

    out = tmp_path / "interrupted"
    r = ranks(out, *args)
    wait_for(lambda: len(events(out, "step")) >= 3, 60, "step 3", r)
    r.signal(signal.SIGUSR2)
    assert r.wait(30) == [0, 0], r.tail()  # a clean, joint exit
    stopped_at = events(out, "checkpoint")[-1]["step"]
    assert 3 <= stopped_at < 8, "the signal came too late to test a resume"
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped_at}"
    assert [e["step"] for e in events(out, "step")] == list(range(1, stopped_at + 1))

    again = ranks(out, *args)
    assert again.wait(60) == [0, 0], again.tail()
    assert events(out, "resume")[-1]["step"] == stopped_at
    steps = events(out, "step")
    assert [e["step"] for e in steps] == list(range(1, 9)), "resumed at the wrong step"
    for e in steps:
        assert e["loss"] == pytest.approx(reference[e["step"]], rel=1e-6, abs=1e-9), e


def test_preempted_while_released_checkpoints_without_reclaiming_and_resumes_exactly(ranks, tmp_path):
    """Slurm's USR2 arrives while the GPUs are lent out: the ranks checkpoint from the offloaded (host)
    state without taking the GPUs back, and a restart continues as if nothing happened."""
    from pearlctl.trainer import FileChannel

    args = ("--steps", "6", "--zero", "2", "--seed", "5")
    ref_out = tmp_path / "uninterrupted"
    assert ranks(ref_out, *args).wait(60) == [0, 0]
    reference = {e["step"]: e["loss"] for e in events(ref_out, "step")}

    out, channel = tmp_path / "run", FileChannel(tmp_path / "channel")
    r = ranks(out, *args, "--channel", f"file:{channel.root}", "--poll-interval", "0.05")
    wait_for(lambda: any(e["phase"] == "training" and e["step"] == 2 for e in channel.read_events()), 60, "step 2", r)
    assert channel.wait_ack(channel.send("release"), timeout=30)["ok"]
    wait_for(lambda: any(e.get("blocked_s") for e in channel.read_events()), 10, "a blocked poll", r)
    r.signal(signal.SIGUSR2)
    assert r.wait(30) == [0, 0], r.tail()
    stopped = [e for e in channel.read_events() if e["phase"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["released"] is True  # checkpointed while still released
    assert not events(out, "reclaim")
    done = [e["step"] for e in events(out, "step")]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{done[-1]}"

    again = ranks(out, *args)
    assert again.wait(60) == [0, 0], again.tail()
    assert events(out, "resume")[-1]["step"] == done[-1]
    steps = events(out, "step")
    assert [e["step"] for e in steps] == list(range(1, 7))
    for e in steps:
        assert e["loss"] == pytest.approx(reference[e["step"]], rel=1e-6, abs=1e-9), e


# ---------------------------------------------------------------------- (d) weight export
@pytest.mark.parametrize("zero", ["2", "3"])
def test_exported_weights_load_with_transformers_and_match_the_base_model(ranks, tmp_path, zero):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    r = ranks(out, "--steps", "1", "--zero", zero)
    assert r.wait(60) == [0, 0], r.tail()
    export = out / "weights" / "1"
    assert (export / "pearl_weight_version.txt").read_text().strip() == "1"
    assert not [p for p in (out / "weights").iterdir() if p.name.startswith(".")], "temporary directory left"

    base = load_safetensors(TINY / "model.safetensors")
    exported = load_safetensors(export / "model.safetensors")
    assert exported.keys() == base.keys()
    for name, tensor in base.items():
        assert exported[name].shape == tensor.shape, name
        assert exported[name].dtype == tensor.dtype == torch.bfloat16, name

    model = AutoModelForCausalLM.from_pretrained(export)  # what vLLM's loader reads: config + safetensors
    base_model = AutoModelForCausalLM.from_pretrained(TINY)
    assert model.config.to_dict()["dtype"] == base_model.config.to_dict()["dtype"]
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), base_model.named_parameters(), strict=True):
        assert n1 == n2 and p1.shape == p2.shape and p1.dtype == p2.dtype
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert oct((export / "model.safetensors").stat().st_mode & 0o777) == "0o644"
