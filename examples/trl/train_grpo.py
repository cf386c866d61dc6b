#!/usr/bin/env python3
"""TRL's GRPOTrainer on the tiny model, under pearlctl: "a + b =" prompts, the sum reward of examples/grpo.

The pearlctl part is one call, ``pearl_trl.attach(trainer, model_dir=...)`` (pearl_trl.py; docs/trl.md):
the hook as a Trainer callback (phases, a weight export per step with version = global step, a checkpoint
on USR2/TERM), and under pearlctl (``PEARL_RUN_DIR``/``PEARL_RUN_ID`` set by the agent) generation through
the run's rollout workers, during which the trainer's GPUs can be lent. Outside pearlctl TRL generates
itself (``model.generate``), so the script also runs alone::

    OMP_NUM_THREADS=1 python examples/trl/train_grpo.py --model examples/models/tiny --out /tmp/trl-run --steps 2

Two ranks with DeepSpeed ZeRO-2 (``--zero 2``; the Trainer hands ``ds_config`` to accelerate)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/trl/train_grpo.py --model examples/models/tiny --out /tmp/trl-run --steps 2 --zero 2

Each step's batch is ``--prompts`` prompts x ``--group-size`` completions, split over the ranks. Rank 0
writes JSON lines to stdout and ``OUT/train.jsonl``: ``start``, one ``step`` per optimizer step (loss,
reward, the weight version exported, whether the GPUs were lent while the batch generated), ``done``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: unset, 2 CPU ranks run many times slower
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental" in TRL 1.16

import argparse
import json
import random
import sys
import time
from pathlib import Path

T_START = time.monotonic()
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (REPO, HERE, REPO / "examples" / "grpo"):  # run as a script from a checkout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from transformers import TrainerCallback  # noqa: E402

USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # ChatML, as examples/grpo/rollout.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="HF model directory (config, weights, tokenizer)")
    p.add_argument("--out", required=True, type=Path, help="output_dir: checkpoints, weights/, train.jsonl")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (a resumed run continues to this step)")
    p.add_argument("--zero", type=int, default=-1, choices=(-1, 0, 1, 2, 3), help="DeepSpeed ZeRO stage; -1: none")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only on signals)")
    return p.parse_args(argv)


def prompts_dataset(n: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict(
        {"prompt": [USER.format(f"{rng.randint(0, 99)} + {rng.randint(0, 99)} =") for _ in range(n)]}
    )


def sum_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """examples/grpo/train.py's rule (1 for the right sum, partial credit for digits), in TRL's signature."""
    from train import sum_reward as rule  # examples/grpo/train.py

    return [rule(p, c) for p, c in zip(prompts, completions, strict=True)]


def ds_config(zero: int, lr: float) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": zero},
        "bf16": {"enabled": "auto"},
        # torch's AdamW: DeepSpeed's own Adam ops would be JIT-compiled (minutes) on first use
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
        "steps_per_print": 1_000_000,
    }


def cpu_deepspeed_state() -> None:
    """DeepSpeed ranks on a machine without accelerators, through accelerate 1.15 (the Trainer's ``deepspeed=``):
    ``PartialState`` picks a backend only for an accelerator or for ``cpu=True`` (gloo), and ``AcceleratorState``
    turns DeepSpeed on only when not ``cpu``; so with ``deepspeed=`` it has no backend, counts one process while
    DeepSpeed's process group has two, and TRL's first gather fails ("ProcessGroupGloo::allgather: invalid output
    tensor list"). The state is made here instead, with gloo and DeepSpeed, and the Trainer told to use it
    (``accelerator_config={"use_configured_state": True}``)."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def main(argv: list[str] | None = None, **attach_kwargs) -> int:
    """``attach_kwargs`` go to ``pearl_trl.attach`` (tests give a stand-in rollout client and channel)."""
    args = parse_args(argv)
    import pearl_trl
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = args.prompts * args.group_size
    if per_step % world:
        raise SystemExit(f"--prompts x --group-size ({per_step}) must divide over {world} ranks")
    if args.zero >= 0:
        from train import skip_shm_comm_build  # examples/grpo/train.py: no 50-80 s JIT build of an unused op

        skip_shm_comm_build()
    cuda = torch.cuda.is_available()
    accelerator_config = None
    if args.zero >= 0 and not cuda and world > 1:
        cpu_deepspeed_state()
        accelerator_config = {"use_configured_state": True}
    config = GRPOConfig(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=per_step // world,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        beta=0.0,
        bf16=cuda,  # on CPU the tiny model trains in fp32
        logging_steps=1,
        save_strategy="steps" if args.save_every else "no",
        save_steps=args.save_every or 500,
        report_to="none",
        seed=args.seed,
        deepspeed=ds_config(args.zero, args.lr) if args.zero >= 0 else None,
        disable_tqdm=True,
        accelerator_config=accelerator_config,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[sum_reward],
        args=config,
        train_dataset=prompts_dataset(args.prompts * args.steps * 4, args.seed),
        processing_class=tokenizer,
    )
    pearl = pearl_trl.attach(trainer, model_dir=args.model, **attach_kwargs)  # the pearlctl part: one line
    trainer.add_callback(JsonLog(trainer, pearl, args.out / "train.jsonl"))
    trainer.train(resume_from_checkpoint=pearl_trl.last_checkpoint(args.out))
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():  # else a rank may abort in teardown (examples/grpo/train.py)
        torch.distributed.destroy_process_group()
    return 0


class JsonLog(TrainerCallback):
    """Rank 0's JSON lines (module docstring)."""

    def __init__(self, trainer, pearl, path: Path):
        self.trainer, self.pearl, self.path = trainer, pearl, path

    def _say(self, event: str, **data) -> None:
        if not self.trainer.accelerator.is_main_process:
            return
        line = json.dumps({"event": event, "ts": round(time.time(), 3), **data})
        print(line, flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(line + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        trainer, hook = self.trainer, self.pearl.hook
        self._say(
            "start",
            world_size=trainer.accelerator.num_processes,
            zero=hook.zero_stage if getattr(trainer, "is_deepspeed_enabled", False) else None,
            rollout="pearlctl" if trainer.rollout_func is not None else "trl",
            first_step=state.global_step + 1,
            init_s=round(time.monotonic() - T_START, 3),
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:
            return
        rollout = getattr(self.trainer.rollout_func, "last", None) or {}
        self._say(
            "step",
            step=state.global_step,
            loss=logs.get("loss"),
            reward_mean=logs.get("reward"),
            weight_version=self.pearl.hook.weight_version,
            commands=[e["command"] for e in self.pearl.events],  # release/reclaim carried out so far
            wait_s=rollout.get("wait_s"),
            since_start_s=round(time.monotonic() - T_START, 3),
        )

    def on_train_end(self, args, state, control, **kwargs):
        self._say("done", step=state.global_step, commands=len(self.pearl.events))


if __name__ == "__main__":
    sys.exit(main())
