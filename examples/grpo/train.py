#!/usr/bin/env python3
"""A small GRPO-style trainer that really trains a (tiny) HF causal LM with DeepSpeed, using pearlctl's hook.

Each step: wait for a rollout batch — GRPO groups of token-level trajectories (token_batch.py; the schema is
docs/rollout-batches.md) — normalise rewards within each group (advantage = (r - mean) / (std + eps)), and
minimise the policy-gradient loss over the tokens the policy sampled (mask 1; prompt and tool-output
tokens are context only). The trainer never re-tokenizes: it trains on the exact ids the sampler produced,
``prompt_ids + completion_ids``. The sampler's logprobs are used, not just recorded: each sampled token's
term is weighted by the truncated importance ratio ``min(exp(log p_train - log p_sampled), --tis-cap)``
(detached), which corrects for the sampler differing from the trainer (another dtype or kernels, a turn
sampled by an older weight version); ``--tis-cap 0`` turns the weight off. With one update per batch there
is no PPO clipping and no KL term. The loss is
``-sum over sampled tokens of w * log p(token) * advantage / sampled tokens``; each step logs ``logp_gap``,
the mean of ``log p_train - log p_sampled`` over them (0 when trainer and sampler agree). Then export the
weights (version = step) for the rollout workers and report "waiting" with the expected wait for the next
batch. Between steps pearlctl may borrow the GPUs (``release``/``reclaim`` through the hook's channel);
USR2/TERM checkpoint jointly.

Rollout sources (both give the same token-level groups):

- ``synthetic``: rank 0 samples completions from the model itself (HF generate, keeping each sampled token's
  logprob from the raw logits) for "a + b =" prompts and scores them by rule (1 for the right sum, partial
  credit for digits); works standalone.
- ``file:DIR``: the batch for step N is ``DIR/step-00000N.jsonl``, one group per line (examples/grpo/rollout.py
  writes it, to a temporary name then renamed; the trainer waits for it, serving pearlctl's commands
  meanwhile). A batch is parsed and checked whole before training: a malformed line stops the trainer with
  exit status 2 and a ``bad batch`` line naming the file, the line and the field.

Run (two CPU ranks, from the repository root)::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/grpo/train.py \\
        --model examples/models/tiny --steps 5 --out /tmp/grpo-run

or start each rank directly with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (faster).
Logs JSON lines on rank 0's stdout and in ``OUT/train.jsonl``: ``start``, ``resume``, ``step`` (loss,
reward_mean, timings), ``release``/``reclaim`` results, ``checkpoint``, ``done``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: unset, 2 CPU ranks run ~14x slower

import argparse
import ctypes
import random
import re
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

T_PROCESS_START = time.monotonic()

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (REPO, HERE):  # run as a script from a checkout; token_batch.py sits next to this file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from token_batch import BatchError, Group, Sampled, read_batch, trajectory_from_turns  # noqa: E402


def die_with_parent() -> None:
    """torchrun starts each rank in its own session: without this a killed launcher leaves ranks training."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="HF model directory (config, weights, tokenizer)")
    p.add_argument("--steps", type=int, default=5, help="train until this step number (a resumed run continues)")
    p.add_argument("--out", required=True, type=Path, help="run directory: checkpoints/, weights/, train.jsonl")
    p.add_argument("--zero", type=int, default=2, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only on signals)")
    p.add_argument("--rollouts", default="synthetic", help="synthetic | file:DIR")
    p.add_argument("--channel", default="none", help="pearlctl control channel: none | daemon | file:DIR")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prompts", type=int, default=4, help="synthetic: prompts per step (groups)")
    p.add_argument("--group-size", type=int, default=4, help="synthetic: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=8, help="synthetic: completion length")
    p.add_argument("--max-completion-tokens", type=int, default=128, help="longer completions are cut")
    p.add_argument(
        "--tis-cap",
        type=float,
        default=2.0,
        help="cap of the truncated importance weight exp(log p_train - log p_sampled) per sampled token "
        "(0: no weight, the sampled logprobs are only compared, in logp_gap)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-weights", type=int, default=3, help="exported weight versions kept on disk")
    p.add_argument("--release-mode", default="offload", choices=("offload", "checkpoint"))
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.2,  # the hook's own default: each poll is a report to the daemon and a collective of the ranks
        help="seconds between channel polls while waiting (a release or reclaim waits at most this long)",
    )
    p.add_argument("--timeout", type=float, default=300, help="collective timeout (s): a hung peer fails this fast")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- rewards and advantages
def sum_reward(prompt: str, completion: str) -> float:
    """1.0 when the completion contains the right sum of an "a + b =" prompt; else partial credit: 0.1 for
    any digits, plus up to 0.4 for the longest right prefix of the answer among the digit runs."""
    m = re.search(r"(\d+)\s*\+\s*(\d+)\s*=", prompt)
    if m is None:
        return 0.0
    answer = str(int(m.group(1)) + int(m.group(2)))
    if re.search(rf"(?<!\d){answer}(?!\d)", completion):
        return 1.0
    runs = re.findall(r"\d+", completion)
    if not runs:
        return 0.0
    best = max(len(os.path.commonprefix([run, answer])) for run in runs)
    return 0.1 + 0.4 * best / len(answer)


def group_advantages(rewards: list[float], eps: float = 1e-4) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    return [(r - mean) / (std + eps) for r in rewards]


# ---------------------------------------------------------------------- rollout sources
class SyntheticRollouts:
    """Rank 0 samples from the model itself and broadcasts the batch. Deterministic per step (prompts and
    sampling are seeded by step), so a resumed run sees the batches an uninterrupted run would."""

    def __init__(self, engine, tokenizer, args, rank: int, world_size: int):
        self.engine, self.tok, self.args = engine, tokenizer, args
        self.rank, self.world_size = rank, world_size

    def next_batch(self, hook, step: int, expected_wait_s: float | None) -> list[Group] | None:
        import torch.distributed as dist

        hook.phase("waiting", step=step, expected_wait_s=expected_wait_s)  # the daemon may release here
        if hook.should_stop():
            return None
        hook.ensure_reclaimed()  # generating needs the weights back
        rng = random.Random(self.args.seed * 1_000_003 + step)
        prompts = [f"{rng.randint(0, 99)} + {rng.randint(0, 99)} =" for _ in range(self.args.prompts)]
        if self.engine.zero_optimization_stage() == 3:
            # ZeRO-3 forwards are collective (parameters are gathered layer by layer): every rank generates
            # the same batch in lockstep, with the same seed, so no broadcast is needed.
            return self._generate(prompts, step)
        groups = self._generate(prompts, step) if self.rank == 0 else None
        if self.world_size > 1:
            box = [groups]
            dist.broadcast_object_list(box, src=0)
            groups = box[0]
        return groups

    def _generate(self, prompts: list[str], step: int) -> list[Group]:
        import torch

        module = self.engine.module
        with torch.no_grad():
            module.eval()
            torch.manual_seed(self.args.seed * 1_000_003 + step)
            self.tok.padding_side = "left"
            enc = self.tok(prompts, return_tensors="pt", padding=True).to(self.engine.device)
            out = module.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=self.args.max_new_tokens,
                num_return_sequences=self.args.group_size,
                pad_token_id=self.tok.pad_token_id,
                eos_token_id=self.tok.eos_token_id,
                return_dict_in_generate=True,
                output_logits=True,  # raw logits: the sampled tokens' logprobs, as vLLM's default logprobs mode
            )
            module.train()
            width = enc["input_ids"].shape[1]
            new = out.sequences[:, width:]
            steps = torch.stack(out.logits, dim=1).float()  # [sequences, new tokens, vocab]
            logp = torch.log_softmax(steps, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        version = str(step - 1)  # the weights after step - 1's update (exported as that version)
        groups = []
        for i, prompt in enumerate(prompts):
            keep = enc["attention_mask"][i].bool()
            prompt_ids = [int(t) for t in enc["input_ids"][i][keep].tolist()]  # without the left padding
            trajectories, completions = [], []
            for j in range(i * self.args.group_size, (i + 1) * self.args.group_size):
                ids = [int(t) for t in new[j].tolist()]
                if self.tok.eos_token_id in ids:  # finished: the eos is sampled, the padding after it is not
                    ids = ids[: ids.index(self.tok.eos_token_id) + 1]
                turn = Sampled(ids, [float(v) for v in logp[j, : len(ids)].tolist()], version, finish_reason=None)
                trajectories.append(trajectory_from_turns(prompt_ids, [turn]))
                completions.append(self.tok.decode(ids, skip_special_tokens=True))
            groups.append(
                Group(
                    prompt=prompt,
                    rewards=tuple(sum_reward(prompt, c) for c in completions),
                    trajectories=tuple(trajectories),
                    completions=tuple(completions),
                )
            )
        return groups


class FileRollouts:
    """Reads ``DIR/step-NNNNNN.jsonl`` written (atomically, by rename) by a rollout driver, parsed into typed
    groups (`token_batch.read_batch`): `BatchError` names the line and the field of a malformed one."""

    def __init__(self, root: Path, poll_interval_s: float):
        self.root = root
        self.poll_interval_s = poll_interval_s

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:06d}.jsonl"

    def next_batch(self, hook, step: int, expected_wait_s: float | None) -> list[Group] | None:
        path = self.path(step)
        ready = hook.wait_until(
            path.exists, step=step, expected_wait_s=expected_wait_s, poll_interval_s=self.poll_interval_s
        )
        if not ready:
            return None  # the ranks agreed to stop while waiting
        hook.ensure_reclaimed()
        return read_batch(path)


# ---------------------------------------------------------------------- the policy-gradient step
def pack(groups: list[Group], max_completion_tokens: int, pad_id: int) -> dict | None:
    """The trainer's input for these groups, from their token ids as sampled (never re-tokenized): per
    trajectory with a non-zero advantage and a sampled token, ``ids`` = ``prompt_ids + completion_ids`` (the
    completion cut at ``max_completion_tokens``), right-padded; ``mask[i, t]`` = 1 where the logits at
    position t predict a sampled token (token t + 1 is mask 1), and ``sampled[i, t]`` its sampler's logprob;
    ``adv`` one advantage per row. None when no row is left."""
    import torch

    rows = []
    for g in groups:
        for tr, a in zip(g.trajectories, group_advantages(list(g.rewards)), strict=True):
            completion = tr.completion_ids[:max_completion_tokens]
            bits = tr.mask[: len(completion)]
            if a == 0.0 or not any(bits):
                continue
            rows.append((tr.prompt_ids, completion, bits, tr.logprobs[: sum(bits)], a))
    if not rows:
        return None
    width = max(len(p) + len(c) for p, c, _, _, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    sampled = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (prompt, completion, bits, logprobs, _) in enumerate(rows):
        seq = list(prompt) + list(completion)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        at = [len(prompt) - 1 + k for k, bit in enumerate(bits) if bit]  # logits at t predict token t + 1
        mask[i, at] = 1.0
        sampled[i, at] = torch.tensor(logprobs, dtype=torch.float32)
    adv = torch.tensor([r[4] for r in rows], dtype=torch.float32).unsqueeze(1)
    return {"ids": ids, "attn": attn, "mask": mask, "sampled": sampled, "adv": adv}


def pg_loss(engine, groups: list[Group], max_completion_tokens: int, pad_id: int, tis_cap: float = 2.0):
    """Loss on this rank's groups: -sum(w * logp * advantage) / sampled tokens, w the truncated importance
    weight min(exp(logp - logp_sampled), tis_cap) (1 when tis_cap is 0). Returns (loss, tokens, gap), gap the
    sum over sampled tokens of logp - logp_sampled."""
    import torch

    device = engine.device
    batch = pack(groups, max_completion_tokens, pad_id)
    if batch is None:  # nothing to learn on this rank: a zero loss that still runs backward (ZeRO's hooks)
        logits = engine(input_ids=torch.tensor([[pad_id]], device=device)).logits
        return logits.float().sum() * 0.0, 0, 0.0
    ids, attn, mask = batch["ids"].to(device), batch["attn"].to(device), batch["mask"].to(device)
    sampled, adv = batch["sampled"].to(device), batch["adv"].to(device)
    logits = engine(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    gap = (logp.detach() - sampled) * mask
    weight = torch.exp(gap).clamp(max=tis_cap) if tis_cap > 0 else torch.ones_like(gap)
    tokens = mask.sum()
    loss = -(weight * logp * adv * mask).sum() / tokens.clamp(min=1.0)
    return loss, int(tokens.item()), float(gap.sum().item())


# ---------------------------------------------------------------------- main
def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,  # the loop batches itself: one forward per rank per step
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": args.dtype == "bf16"},
        # torch's AdamW: DeepSpeed's own Adam ops would be JIT-compiled (minutes) on first use.
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
    }


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op (``deepspeed_shm_comm``,
    50-80 s) on the first distributed start; training does not need it (gloo does the collectives).
    Seeding the op-compatibility table skips both that compile and the probing of every op."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu" and os.environ.get("PEARL_DS_SHM_COMM", "0") != "1":
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pearlctl.trainer import FileChannel, NullChannel, TrainerHook
    from pearlctl.trainer.events import EventLog
    from pearlctl.trainer.weights import prune_weights

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend=None, timeout=timedelta(seconds=args.timeout), verbose=False)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)
    say = EventLog(args.out / "train.jsonl" if rank == 0 else None)

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))

    channel = NullChannel()
    if args.channel.startswith("file:"):
        channel = FileChannel(args.channel.removeprefix("file:"))
    elif args.channel == "daemon":  # the run's daemon (PEARL_RUN_DIR / PEARL_RUN_ID, set by the agent)
        from pearlctl.trainer.channel import DaemonChannel

        channel = DaemonChannel(weights_dir=args.out / "weights")
    elif args.channel != "none":
        raise SystemExit(f"--channel must be none, daemon or file:DIR, not {args.channel!r}")
    ckpt_dir = args.out / "checkpoints"
    hook = TrainerHook(
        engine,
        channel=channel,
        ckpt_dir=ckpt_dir,
        base_model_dir=args.model,
        release_mode=args.release_mode,
        poll_interval_s=args.poll_interval,
        on_command=lambda done: say(done["command"], command_id=done["command_id"], **done["result"]),
    )
    hook.save_on_signal(ckpt_dir)

    if args.tis_cap < 0:
        raise SystemExit(f"--tis-cap must be 0 (off) or positive, not {args.tis_cap}")
    if args.rollouts == "synthetic":
        source = SyntheticRollouts(engine, tokenizer, args, rank, world_size)
    elif args.rollouts.startswith("file:"):
        source = FileRollouts(Path(args.rollouts.removeprefix("file:")), args.poll_interval)
    else:
        raise SystemExit(f"--rollouts must be synthetic or file:DIR, not {args.rollouts!r}")

    t = time.monotonic()
    step = hook.resume(ckpt_dir)
    if step:
        say("resume", step=step, load_s=round(time.monotonic() - t, 6))
    say("start", rank=rank, world_size=world_size, zero=args.zero, dtype=args.dtype, first_step=step + 1,
        init_s=round(time.monotonic() - T_PROCESS_START, 3))  # fmt: skip

    weights_dir = args.out / "weights"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    # none before a wait was measured (the daemon predicts the batch in flight from the run's profile; a user's
    # hint, $PEARL_FIRST_WAIT_S, is the hook's), then a moving average of the measured waits
    expected_wait: float | None = None
    while step < args.steps:
        step += 1
        t_wait = time.monotonic()
        released_before = hook.released
        try:
            groups = source.next_batch(hook, step, expected_wait)
        except BatchError as exc:  # every rank reads the same file and stops the same way
            say("bad batch", step=step, error=str(exc))
            print(f"bad batch: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        if groups is None:  # a signal arrived while waiting: the last finished step is step - 1
            say("checkpoint", step=step - 1, reason="signal")
            hook.checkpoint_and_exit(step - 1)
        wait_s = time.monotonic() - t_wait
        expected_wait = wait_s if expected_wait is None else 0.7 * expected_wait + 0.3 * wait_s

        hook.ensure_reclaimed()
        hook.phase("training", step=step)
        t_train = time.monotonic()
        mine = groups[rank::world_size]
        loss, tokens, gap = pg_loss(engine, mine, args.max_completion_tokens, pad_id, args.tis_cap)
        engine.backward(loss)
        engine.step()
        stats = torch.tensor([loss.item() * tokens, float(tokens), gap], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(stats)
        train_s = time.monotonic() - t_train

        hook.export_weights(weights_dir, version=str(step))
        prune_weights(weights_dir, keep=args.keep_weights, rank=rank)
        rewards = [float(r) for g in groups for r in g.rewards]
        say(
            "step",
            step=step,
            loss=stats[0].item() / max(stats[1].item(), 1.0),
            tokens=int(stats[1].item()),
            logp_gap=stats[2].item() / max(stats[1].item(), 1.0),
            reward_mean=sum(rewards) / max(len(rewards), 1),
            trajectories=len(rewards),  # trained on (those with a zero advantage teach nothing, but were read)
            judged=sum(len(g.judged_by or ()) for g in groups),  # of which a judge scored
            global_steps=engine.global_steps,
            weight_version=hook.weight_version,
            was_released=released_before,
            timings={
                "wait_s": round(wait_s, 4),
                "train_s": round(train_s, 4),
                "export_s": hook.last_export["export_s"],
                "since_start_s": round(time.monotonic() - T_PROCESS_START, 3),
            },
            # rank 0, where the run broadcasts weights (weights = "broadcast"): what it sent, to how many workers
            **({"broadcast": hook.last_export["broadcast"]} if "broadcast" in hook.last_export else {}),
        )
        if args.save_every and step % args.save_every == 0:
            info = hook.checkpoint(step)
            say("checkpoint", step=step, reason="save_every", save_s=info["save_s"])
        if hook.should_stop():
            say("checkpoint", step=step, reason="signal")
            hook.checkpoint_and_exit(step)
    say("done", step=step)
    dist.barrier()
    # Without this, a rank sometimes aborted at interpreter exit ("terminate called without an active
    # exception", SIGABRT) after a clean run: the process group's threads outlived Python's teardown.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
