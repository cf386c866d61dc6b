"""The paced trainer: a trainer whose compute is sleeping, for control-plane scale tests and benchmarks.

It is the trainer's counterpart of the paced engine (pearlctl.agent.engines.paced, docs/paced.md): the real
``TrainerHook`` (the same phases, the same channel to the daemon, the same release, reclaim, ack, signal and
checkpoint handling) driving a stand-in for a DeepSpeed engine whose training step, offload, reload and weight
export take the seconds given on the command line, on timers. One process costs almost no CPU, so a run's
trainer can take part in a scale test or a benchmark of the control plane on a machine without GPUs. It is
never the trainer of a real run: it trains nothing::

    python -m pearlctl.trainer.paced --model models/tiny --out RUN/trainer --rollouts file:RUN/rollouts \\
        --channel daemon --steps 20 --train-step-s 30 --offload-s 2 --reload-s 3 --export-s 4

What it guarantees:

- **The same hook calls, in the same order, and the same log events as examples/grpo/train.py**'s main loop
  with ``--rollouts file:DIR``: ``hook.resume``; per step ``hook.wait_until`` on ``DIR/step-NNNNNN.jsonl``
  (serving the daemon's commands while it waits, with the same expected wait: none before the first measured
  wait, then the moving average ``0.7 * previous + 0.3 * measured``), ``hook.ensure_reclaimed``,
  ``hook.phase("training")``, the step, ``hook.export_weights(OUT/weights, version=str(step))``, the pruning
  of old versions, ``hook.should_stop`` / ``hook.checkpoint_and_exit`` on USR2 or TERM. ``OUT/train.jsonl``
  holds one JSON object per line, ``{"event", "ts", ...}``, as train.py's: ``start``, ``resume``, ``step``,
  ``release`` / ``reclaim`` (the hook's results, with their timings), ``checkpoint``, ``done``.
- **Sleeps instead of compute.** A training step sleeps ``--train-step-s``; a release's ``offload_states``
  sleeps ``--offload-s`` and a reclaim's ``reload_states`` ``--reload-s`` (so the release and reclaim
  results report at least those times); a weight export writes a real HF-style directory (the base
  model's config and tokenizer files, a ``model.safetensors`` of a few zeros, ``pearl_weight_version.txt``,
  then ``LATEST``: the hook's own export) and then sleeps ``--export-s``. The paced engine reloads from such a
  directory and uses only its name.
- **It never trains on lent GPUs**: a training step while the stand-in engine is offloaded raises (the
  hook's invariant, checked rather than assumed).
- **Checkpoints resume**: a checkpoint is a small JSON file (``checkpoints/global_stepN/paced_state.json``
  and ``checkpoints/latest``, DeepSpeed's layout) holding the step, so a trainer stopped by a signal and
  started again continues from its last checkpointed step, as train.py does.

Ranks: started plainly it is a world of one (the hook's rank agreement needs no all-reduce then); started
by torchrun (a multi-node trainer pool, ``WORLD_SIZE`` > 1) each rank joins a gloo process group, the hook
agrees across ranks as with DeepSpeed, and rank 0 alone logs and prunes old weight versions.

What it leaves out: a model, a loss, gradients and GPU memory. In a ``step`` event ``loss``, ``tokens`` and
``logp_gap`` are null; ``reward_mean``, ``groups`` (the batch file's lines) and ``samples`` (the lengths of
their ``rewards`` lists; null when a line has none) come from the batch file, which is otherwise not
checked: token ids are not read. ``timings.export_s`` is the export and its sleep together (the hook's own
time for the files is ``export_files_s``).

Import-light: importing this module imports neither torch nor deepspeed; torch is imported at start-up by
the stand-in's first ``state_dict`` (so the first export's pacing does not include torch's import), and
never at import time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pearlctl.host.runfiles import write_atomic
from pearlctl.trainer.events import EventLog
from pearlctl.trainer.weights import prune_weights

if TYPE_CHECKING:
    from pearlctl.trainer.hook import TrainerHook

STATE_FILE = "paced_state.json"
"""A checkpoint's one file, in ``<ckpt_dir>/<tag>/``: ``{"global_steps", "client_state"}``."""
PACED_TENSOR = "paced.weight"
"""The one tensor of the stand-in's state dict, a few zeros: what ``model.safetensors`` of an export holds."""


# ---------------------------------------------------------------------- arguments
def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0.0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value <= 0.0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, not {text!r}")
    return value


def _at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}{what}, not {text!r}")
        return value

    return parse


def _file_dir(text: str) -> Path:
    root = text.removeprefix("file:")
    if not text.startswith("file:") or not root:
        raise argparse.ArgumentTypeError(
            f"must be file:DIR (the directory a rollout driver writes step-NNNNNN.jsonl into), not {text!r}"
        )
    return Path(root)


def _channel(text: str) -> str:
    if text in ("none", "daemon") or (text.startswith("file:") and text != "file:"):
        return text
    raise argparse.ArgumentTypeError(f"must be none, daemon or file:DIR, not {text!r}")


def _model_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"must be a model directory with a config.json (its non-weight files go into every export), not {text!r}"
        )
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pearlctl.trainer.paced",
        description="A paced trainer: the real trainer hook, with sleeps for compute (control-plane scale tests; "
        "never a real run's trainer).",
    )
    p.add_argument("--model", required=True, type=_model_dir, help="base model directory (config, tokenizer)")
    p.add_argument("--steps", type=_at_least(1, ""), default=5, help="train until this step (a resumed run continues)")
    p.add_argument("--out", required=True, type=Path, help="run directory: checkpoints/, weights/, train.jsonl")
    p.add_argument(
        "--rollouts", required=True, type=_file_dir, help="file:DIR: step N's batch is DIR/step-NNNNNN.jsonl"
    )
    p.add_argument(
        "--channel", default="none", type=_channel, help="pearlctl control channel: none | daemon | file:DIR"
    )
    p.add_argument("--train-step-s", required=True, type=_seconds, help="seconds one training step sleeps")
    p.add_argument("--offload-s", type=_seconds, default=0.0, help="seconds a release's offload sleeps")
    p.add_argument("--reload-s", type=_seconds, default=0.0, help="seconds a reclaim's reload sleeps")
    p.add_argument("--export-s", type=_seconds, default=0.0, help="seconds a weight export sleeps after its files")
    p.add_argument(
        "--keep-weights",
        type=_at_least(0, " (0: keep all)"),
        default=3,
        help="exported weight versions kept on disk (0: all)",
    )
    p.add_argument(
        "--release-mode",
        default="offload",
        choices=("offload", "checkpoint"),
        help="how a release that names no mode is carried out (the hook's release_mode)",
    )
    p.add_argument(
        "--poll-interval",
        type=_positive_seconds,
        default=0.2,  # train.py's and the hook's default
        help="seconds between channel polls while waiting (a release or reclaim waits at most this long)",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------- the stand-in engine
class _PacedModule:
    """``engine.module`` for the export: a state dict of a few zeros. ``config`` is None: the export reads
    the base model's config.json (``--model``)."""

    config = None

    def __init__(self, size: int = 4) -> None:
        self.size = size

    def state_dict(self) -> dict:
        import torch

        return {PACED_TENSOR: torch.zeros(self.size)}


class PacedEngine:
    """What ``TrainerHook`` uses of a DeepSpeed engine, with sleeps for compute.

    ZeRO stage 1, so a release goes the ``offload_states`` route (pearlctl.trainer.offload); the device is
    the CPU, so the hook reports no GPU memory. Checkpoints are ``<dir>/<tag>/paced_state.json`` plus
    ``<dir>/latest`` naming the tag, which is what the hook's ``resume`` looks for.
    """

    device = "cpu"
    optimizer = None

    def __init__(self, *, offload_s: float = 0.0, reload_s: float = 0.0) -> None:
        self.offload_s = offload_s
        self.reload_s = reload_s
        self.global_steps = 0  # completed training steps, as DeepSpeed's engine counts optimizer steps
        self.offloaded = False
        self.module = _PacedModule()

    def zero_optimization_stage(self) -> int:
        return 1

    def offload_states(self) -> None:
        time.sleep(self.offload_s)
        self.offloaded = True

    def reload_states(self) -> None:
        time.sleep(self.reload_s)
        self.offloaded = False

    def train_step(self, seconds: float) -> None:
        if self.offloaded:
            raise RuntimeError("a training step on released GPUs: the hook lets no step train before a reclaim")
        time.sleep(seconds)
        self.global_steps += 1

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None, **_: Any):
        tag = tag or f"global_step{self.global_steps}"
        root = Path(save_dir)
        (root / tag).mkdir(parents=True, exist_ok=True)
        state = {"global_steps": self.global_steps, "client_state": dict(client_state or {})}
        write_atomic(root / tag / STATE_FILE, json.dumps(state) + "\n", mode=0o644)
        write_atomic(root / "latest", tag, mode=0o644)  # after the state: a reader of latest finds the whole checkpoint
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **_: Any) -> tuple[str | None, dict | None]:
        root = Path(load_dir)
        try:
            tag = tag or (root / "latest").read_text().strip()
            state = json.loads((root / tag / STATE_FILE).read_text())
        except FileNotFoundError:
            return None, None
        self.global_steps = int(state["global_steps"])
        return str(root / tag), dict(state.get("client_state") or {})


# ---------------------------------------------------------------------- the log and the batches
def batch_path(root: Path, step: int) -> Path:
    """The name examples/grpo/train.py's FileRollouts waits for."""
    return root / f"step-{step:06d}.jsonl"


def batch_summary(path: Path) -> dict:
    """``groups`` (non-blank lines), ``samples`` (the lengths of their ``rewards`` lists; None when a line has
    no list of finite numbers there) and ``reward_mean``. One JSON parse per line; nothing else is checked."""
    groups, rewards, whole = 0, [], True
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            groups += 1
            try:
                got = json.loads(line).get("rewards")
            except (ValueError, AttributeError):
                got = None
            if isinstance(got, list) and all(_is_reward(r) for r in got):
                rewards.extend(float(r) for r in got)
            else:
                whole = False
    return {
        "groups": groups,
        "samples": len(rewards) if whole else None,
        "reward_mean": sum(rewards) / len(rewards) if whole and rewards else None,
    }


def _is_reward(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _make_channel(spec: str, out: Path):
    from pearlctl.trainer import FileChannel, NullChannel

    if spec.startswith("file:"):
        return FileChannel(spec.removeprefix("file:"))
    if spec == "daemon":  # the run's daemon (PEARL_RUN_DIR / PEARL_RUN_ID, set by the agent), as train.py
        from pearlctl.trainer.channel import DaemonChannel

        return DaemonChannel(weights_dir=out / "weights")
    return NullChannel()


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    args = parse_args(argv)
    rank, world_size = _init_world()
    args.out.mkdir(parents=True, exist_ok=True)
    say = EventLog(args.out / "train.jsonl" if rank == 0 else None)
    engine = PacedEngine(offload_s=args.offload_s, reload_s=args.reload_s)
    engine.module.state_dict()  # imports torch now, at start-up, not inside step 1's paced export

    ckpt_dir = args.out / "checkpoints"
    hook = _make_hook(args, engine, rank, world_size, ckpt_dir, say)
    t = time.monotonic()
    step = hook.resume(ckpt_dir)
    if step:
        say("resume", step=step, load_s=round(time.monotonic() - t, 6))
    pacing = {k: getattr(args, k) for k in ("train_step_s", "offload_s", "reload_s", "export_s")}
    say("start", rank=rank, world_size=world_size, zero=1, dtype=None, first_step=step + 1,
        init_s=round(time.monotonic() - t_start, 3), paced=pacing)  # fmt: skip

    weights_dir = args.out / "weights"
    # as train.py: none before a wait was measured, then a moving average of the measured waits
    expected_wait: float | None = None
    while step < args.steps:
        step += 1
        t_wait = time.monotonic()
        released_before = hook.released
        batch = _next_batch(hook, args, step, expected_wait, say)
        wait_s = time.monotonic() - t_wait
        expected_wait = wait_s if expected_wait is None else 0.7 * expected_wait + 0.3 * wait_s

        hook.ensure_reclaimed()
        hook.phase("training", step=step)
        t_train = time.monotonic()
        engine.train_step(args.train_step_s)
        train_s = time.monotonic() - t_train

        t_export = time.monotonic()
        hook.export_weights(weights_dir, version=str(step))
        time.sleep(args.export_s)
        export_s = time.monotonic() - t_export
        prune_weights(weights_dir, keep=args.keep_weights, rank=rank)
        say(
            "step",
            step=step,
            loss=None,
            tokens=None,
            logp_gap=None,
            reward_mean=batch["reward_mean"],
            groups=batch["groups"],
            samples=batch["samples"],
            global_steps=engine.global_steps,
            weight_version=hook.weight_version,
            was_released=released_before,
            timings={
                "wait_s": round(wait_s, 4),
                "train_s": round(train_s, 4),
                "export_s": round(export_s, 4),
                "export_files_s": hook.last_export["export_s"],
                "since_start_s": round(time.monotonic() - t_start, 3),
            },
        )
        if hook.should_stop():
            say("checkpoint", step=step, reason="signal")
            hook.checkpoint_and_exit(step)
    say("done", step=step)
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def _make_hook(
    args: argparse.Namespace, engine: PacedEngine, rank: int, world_size: int, ckpt_dir: Path, say: EventLog
) -> TrainerHook:
    """The real ``TrainerHook`` over the stand-in engine, as train.py makes it: the channel ``--channel`` names,
    checkpoints in ``ckpt_dir`` (one saved on USR2 or TERM), and each command it carries out logged as an event."""
    from pearlctl.trainer import TrainerHook

    hook = TrainerHook(
        engine,
        channel=_make_channel(args.channel, args.out),
        rank=rank,
        world_size=world_size,
        ckpt_dir=ckpt_dir,
        base_model_dir=args.model,
        release_mode=args.release_mode,
        poll_interval_s=args.poll_interval,
        on_command=lambda done: say(done["command"], command_id=done["command_id"], **done["result"]),
    )
    hook.save_on_signal(ckpt_dir)
    return hook


def _next_batch(
    hook: TrainerHook, args: argparse.Namespace, step: int, expected_wait: float | None, say: EventLog
) -> dict:
    """train.py's FileRollouts.next_batch: wait for step ``step``'s batch serving the daemon's commands, take the
    GPUs back, read the batch (`batch_summary`). A signal while waiting checkpoints the last finished step and
    exits."""
    path = batch_path(args.rollouts, step)
    ready = hook.wait_until(path.exists, step=step, expected_wait_s=expected_wait, poll_interval_s=args.poll_interval)
    if not ready:  # a signal arrived while waiting: the last finished step is step - 1
        say("checkpoint", step=step - 1, reason="signal")
        hook.checkpoint_and_exit(step - 1)
    hook.ensure_reclaimed()
    return batch_summary(path)


def _init_world() -> tuple[int, int]:
    """(rank, world size): a world of one without torchrun; under torchrun (``WORLD_SIZE`` > 1, a multi-node
    trainer pool) a gloo process group from torchrun's environment, for the hook's rank agreement."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1").strip() or "1")
    except ValueError:
        raise SystemExit(f"WORLD_SIZE must be a whole number, not {os.environ['WORLD_SIZE']!r}") from None
    if world_size <= 1:
        return 0, 1
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one process, almost no CPU
    sys.exit(main())
