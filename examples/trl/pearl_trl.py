"""pearlctl for TRL's GRPOTrainer: the hook as a callback, generation through the run's rollout workers.

A TRL user adds one line after building the trainer (docs/trl.md)::

    trainer = GRPOTrainer(model=MODEL, reward_funcs=[...], args=GRPOConfig(...), train_dataset=dataset)
    pearl_trl.attach(trainer, model_dir=MODEL)      # the hook as a callback; rollouts through the run's workers
    trainer.train(resume_from_checkpoint=pearl_trl.last_checkpoint(trainer.args.output_dir))

What ``attach`` does:

- **The hook as a callback** (`PearlCallback`): pearlctl's `TrainerHook` wraps the trainer's engine (the
  DeepSpeed engine under ``args.deepspeed``, else `TorchEngine`, a small adapter of the plain model and
  optimizer that releases by checkpoint as ZeRO-0 does). Every optimizer step begins with
  ``ensure_reclaimed`` and ``phase("training")`` (``on_step_begin``) and ends with ``export_weights``,
  version = ``state.global_step`` (``on_step_end``), which the daemon syncs to the rollout workers. A
  Slurm preemption (USR2) or TERM sets the hook's flag; at the next step end every rank agrees
  (``should_stop``) and the Trainer saves a checkpoint (``output_dir/checkpoint-N``) and stops; the
  requeued job resumes from it (`last_checkpoint`).
- **Generation through the run's rollout workers** (`RouterRollout`, TRL's ``rollout_func``), under
  pearlctl only (``PEARL_RUN_DIR`` and ``PEARL_RUN_ID`` set by the agent): each completion is one turn
  through the run's gateway (pearlctl.router.client.RolloutClient), sent as token ids, answered with the
  sampled ids and their logprobs. While the workers generate, the trainer reports ``phase("waiting")``
  and serves the daemon's commands, so its GPUs can be lent to rollout and come back before training.
  On-policy: the batch of step N waits until every routable worker serves version N - 1.
- **The sampler's logprobs are used** (`use_sampled_logprobs`): TRL 1.16 applies its importance-sampling
  correction only when ``use_vllm`` is on, which would make it connect to a vLLM server of its own; this
  module turns the flag on after construction, with a weight sync that does nothing (pearlctl syncs
  weights), so ``vllm_importance_sampling_*`` apply to the tokens the workers sampled.

Outside pearlctl (no run directory), ``attach`` adds only the callback (with a channel that never asks for
anything) and TRL generates as it would without it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from pearlctl.trainer import NullChannel, TrainerHook

log = logging.getLogger("pearlctl.trl")

WEIGHTS_TIMEOUT_S = 180.0  # how long a batch waits at most for the workers to serve the previous step's weights
JOIN_WAIT_S = 15.0  # how long a batch's launch waits at most for workers that are joining (RolloutClient)


def under_pearlctl() -> bool:
    """True when the agent started this process (it sets the run's directory and id)."""
    return bool(os.environ.get("PEARL_RUN_DIR") and os.environ.get("PEARL_RUN_ID"))


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` the Trainer saved in ``output_dir`` (a requeued job resumes there), else None."""
    found = []
    for p in Path(output_dir).glob("checkpoint-*"):
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        if m and p.is_dir() and (p / "trainer_state.json").exists():
            found.append((int(m.group(1)), p))
    return str(max(found)[1]) if found else None


# ---------------------------------------------------------------------- the engine the hook drives
class TorchEngine:
    """What `TrainerHook` needs of a DeepSpeed engine, for a Trainer without DeepSpeed: ZeRO stage 0 (so a
    release is a checkpoint, then gradients dropped and the optimizer's states moved to host memory), the
    module, the optimizer, the device, the step count, and a checkpoint of model and optimizer."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def zero_optimization_stage(self) -> int:
        return 0

    @property
    def module(self) -> Any:
        return self.trainer.model

    @property
    def optimizer(self) -> Any:
        return self.trainer.optimizer

    @property
    def device(self) -> Any:
        return self.trainer.accelerator.device

    @property
    def global_steps(self) -> int:
        return int(self.trainer.state.global_step)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict | None = None) -> None:
        import torch

        if self.trainer.accelerator.is_main_process:
            path = Path(save_dir) / tag
            path.mkdir(parents=True, exist_ok=True)
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "client_state": client_state or {},
            }
            torch.save(state, path / "state.pt")
            (Path(save_dir) / "latest").write_text(tag)
        self.trainer.accelerator.wait_for_everyone()

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str | None, dict]:
        import torch

        tag = tag or (Path(load_dir) / "latest").read_text().strip()
        path = Path(load_dir) / tag
        if not (path / "state.pt").exists():
            return None, {}
        state = torch.load(path / "state.pt", map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return str(path), state["client_state"]


def engine_of(trainer: Any) -> Any:
    """The DeepSpeed engine the Trainer prepared, else a `TorchEngine` of its model and optimizer."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return trainer.model_wrapped  # deepspeed.DeepSpeedEngine, set before on_train_begin
    return TorchEngine(trainer)


# ---------------------------------------------------------------------- the callback
class PearlCallback(TrainerCallback):
    """pearlctl's `TrainerHook` at a Trainer's step boundaries (module docstring). Every method runs on every
    rank (the hook's calls are collective); the hook is built at ``on_train_begin``, once the engine exists.

    ``channel``: the hook's control channel (default: the run's daemon under pearlctl, else `NullChannel`);
    ``weights_dir``: where each step's weights are exported (default ``output_dir/weights`` under pearlctl,
    else no export); ``keep_weights``: versions kept there."""

    def __init__(
        self,
        trainer: Any,
        *,
        model_dir: str | os.PathLike | None = None,
        channel: Any = None,
        weights_dir: str | os.PathLike | None = None,
        keep_weights: int = 3,
        poll_interval_s: float = 0.2,
        hook_factory: Callable[..., Any] = TrainerHook,
    ):
        self.trainer = trainer
        self.model_dir = Path(model_dir) if model_dir is not None else None
        out = Path(trainer.args.output_dir)
        if weights_dir is None and under_pearlctl():
            weights_dir = out / "weights"
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        if channel is None and under_pearlctl():
            from pearlctl.trainer.channel import DaemonChannel

            channel = DaemonChannel(weights_dir=self.weights_dir)
        self.channel = channel if channel is not None else NullChannel()
        self.ckpt_dir = out / "pearl-release"  # release by checkpoint (ZeRO-0, ZeRO-3 without FusedAdam)
        self.keep_weights = keep_weights
        self.poll_interval_s = poll_interval_s
        self.hook_factory = hook_factory
        self.hook: Any = None
        self.events: list[dict] = []  # what the hook carried out (release, reclaim), for the log and for tests

    def _on_command(self, done: dict) -> None:
        event = {"command": done["command"], "command_id": done["command_id"], "ok": done["result"].get("ok")}
        self.events.append(event)
        log.info("pearlctl %s %s", done["command"], done["command_id"])

    def on_train_begin(self, args, state, control, **kwargs):
        self.hook = self.hook_factory(
            engine_of(self.trainer),
            channel=self.channel,
            ckpt_dir=self.ckpt_dir,
            base_model_dir=self.model_dir,
            poll_interval_s=self.poll_interval_s,
            on_command=self._on_command,
        )
        self.hook.save_on_signal(self.ckpt_dir)  # USR2 (Slurm preemption) and TERM: a flag, acted on at step end
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self.hook.ensure_reclaimed()  # blocks while the GPUs are lent out
        self.hook.phase("training", step=state.global_step + 1)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.weights_dir is not None:
            self.hook.export_weights(self.weights_dir, version=str(state.global_step))
            self._prune()
        if self.hook.should_stop():  # a signal on any rank: every rank saves at this step and stops
            control.should_save = True
            control.should_training_stop = True
        return control

    def _prune(self) -> None:
        if self.keep_weights <= 0 or not self.trainer.accelerator.is_main_process:
            return
        versions = sorted(
            (p for p in self.weights_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
        )
        for old in versions[: -self.keep_weights]:
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- generation through the run's workers
class RouterRollout:
    """TRL's ``rollout_func``: ``(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs",
    "weight_version"}``, one completion per prompt given. TRL hands each rank its slice of the generation batch,
    each prompt already repeated ``num_generations`` times in a row (its ``RepeatSampler``); the lists come back
    in the same order. ``weight_version`` (an extra field, given to reward functions as a keyword) is the
    version the gateway says sampled each completion.

    While the workers generate (threads), every rank reports ``phase("waiting")`` and serves the daemon's
    commands until every rank's completions are in; then ``ensure_reclaimed`` and ``phase("training")``.
    ``client``: a `pearlctl.router.client.RolloutClient` (or anything with its ``complete``, ``workers`` and
    ``wait_for_joining``); ``callback``: the `PearlCallback` whose hook reports."""

    def __init__(
        self,
        client: Any,
        callback: PearlCallback,
        *,
        concurrency: int = 16,
        on_policy: bool = True,
        weights_timeout_s: float = WEIGHTS_TIMEOUT_S,
        join_wait_s: float = JOIN_WAIT_S,
        poll_interval_s: float = 0.2,
    ):
        self.client, self.callback = client, callback
        self.concurrency, self.on_policy = concurrency, on_policy
        self.weights_timeout_s, self.join_wait_s = weights_timeout_s, join_wait_s
        self.poll_interval_s = poll_interval_s
        # told to the daemon at each waiting report: a moving average of the measured waits; none before the
        # first (the daemon predicts a batch from the work a rollout driver reports, and this rollout reports
        # none, so nothing is lent for the first batch unless the user hints it: $PEARL_FIRST_WAIT_S, read by
        # pearlctl's trainer hook)
        self.expected_wait_s: float | None = None
        self.last: dict = {}  # timings of the latest batch

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        step = int(trainer.state.global_step) + 1
        version = str(step - 1) if self.on_policy and step > 1 else None
        prompt_ids = [tokenize_prompt(trainer.processing_class, p) for p in prompts]
        rank = int(trainer.accelerator.process_index)
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as one:
            future = one.submit(self._generate, trainer, prompt_ids, step, rank, version)
            self._wait(future, trainer, step, t0)
        failure = future.exception()
        if not _all_ranks(failure is None, trainer):  # one rank's failure stops every rank here
            why = f"{type(failure).__name__}: {failure}" if failure else "another rank's batch failed"
            raise RolloutFailed(f"step {step}: {why}") from failure
        out = future.result()
        wait_s = time.monotonic() - t0
        self.expected_wait_s = wait_s if self.expected_wait_s is None else 0.7 * self.expected_wait_s + 0.3 * wait_s
        self.last = {"step": step, "wait_s": round(wait_s, 3), "completions": len(prompts)}
        return out

    def _wait(self, future: Future, trainer: Any, step: int, t0: float) -> None:
        """Every rank: report "waiting" (a release may happen here) until every rank's batch is done; then take
        the GPUs back and report "training". Each report says what is left of the expected wait (counted down
        from ``t0``, as the hook's ``wait_until`` does): the daemon's return deadline is that report's time plus it."""
        hook = self.callback.hook
        expected = self.expected_wait_s
        while True:
            left = None if expected is None else max(0.0, expected - (time.monotonic() - t0))
            hook.phase("waiting", step=step, expected_wait_s=left)
            if _all_ranks(future.done(), trainer):
                break
            time.sleep(self.poll_interval_s)
        hook.ensure_reclaimed()  # the trainer's next forward (old logprobs) needs its GPUs
        hook.phase("training", step=step)

    def _generate(self, trainer: Any, prompt_ids: list[list[int]], step: int, rank: int, version: str | None) -> dict:
        self._wait_for_workers(version)
        self.client.wait_for_joining(self.join_wait_s)
        args = trainer.args
        n = max(1, int(getattr(trainer, "num_generations", 1) or 1))
        extra = sampling_extra(args, eos_token_ids(trainer))

        def one(i: int) -> Any:
            session = f"trl-s{step}-r{rank}-g{i // n}"  # a group on one worker: its prompt's KV cache is shared
            return self.client.complete(
                session, prompt_ids[i], max_tokens=int(args.max_completion_length), temperature=float(args.temperature),
                extra=extra,
            )  # fmt: skip

        with ThreadPoolExecutor(max(1, min(self.concurrency, len(prompt_ids)))) as pool:
            answers = list(pool.map(one, range(len(prompt_ids))))
        return completions_to_rollout(prompt_ids, answers)

    def _wait_for_workers(self, version: str | None) -> None:
        """Before a batch: the daemon lists a routable worker (the run's first workers may still be starting when
        the trainer's first batch begins) and, on-policy, every routable worker serves ``version`` (the previous
        step's export); at most ``weights_timeout_s``, then generate anyway (logged: the turns still retry)."""
        deadline = time.monotonic() + self.weights_timeout_s
        while time.monotonic() < deadline:
            workers = self.client.workers(force=True)
            if workers and (version is None or all(w.get("weight_version") == version for w in workers)):
                return
            time.sleep(0.2)
        want = "a routable worker" if version is None else f"every routable worker on weight version {version}"
        log.warning("generating without %s after %.0f s", want, self.weights_timeout_s)


def tokenize_prompt(tokenizer: Any, prompt: Any) -> list[int]:
    """A prompt's token ids as TRL's own generation makes them: the chat template with the generation prompt for
    a conversation (a list of messages), the tokenizer's ids (special tokens included) for text."""
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = ids["input_ids"]
    else:
        ids = tokenizer(text=prompt)["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def eos_token_ids(trainer: Any) -> list[int]:
    ids = getattr(trainer, "eos_token_ids", None)
    if ids is None:
        eos = trainer.processing_class.eos_token_id
        ids = [eos] if eos is not None else []
    return [int(t) for t in ids]


def sampling_extra(args: Any, stop_ids: list[int]) -> dict:
    """The completions request's sampling fields for TRL's config (``logprobs: 0``: the sampled token's own)."""
    extra: dict = {"logprobs": 0}
    if stop_ids:
        extra["stop_token_ids"] = list(stop_ids)
    if getattr(args, "top_p", 1.0) not in (None, 1.0):
        extra["top_p"] = float(args.top_p)
    if getattr(args, "top_k", 0) not in (None, 0, -1):
        extra["top_k"] = int(args.top_k)
    if getattr(args, "min_p", None) not in (None, 0.0):
        extra["min_p"] = float(args.min_p)
    if getattr(args, "repetition_penalty", 1.0) not in (None, 1.0):
        extra["repetition_penalty"] = float(args.repetition_penalty)
    return extra


class RolloutFailed(Exception):
    """A rank's batch could not be generated (a turn failed within the client's time bound, or an answer was
    unusable); raised on every rank, so that no rank waits for the others in TRL's next collective."""


class BadCompletion(Exception):
    """An answer TRL cannot train on as it is: no token ids, or not one logprob per sampled token."""


def completions_to_rollout(prompt_ids: list[list[int]], answers: list[Any]) -> dict[str, list]:
    """TRL's ``rollout_func`` output from the gateway's answers (`RolloutClient.complete`'s ``Completion``)."""
    if len(answers) != len(prompt_ids):
        raise BadCompletion(f"{len(answers)} answers for {len(prompt_ids)} prompts")
    completion_ids, logprobs, versions = [], [], []
    for i, c in enumerate(answers):
        ids = [int(t) for t in c.token_ids]
        lp = c.logprobs
        if not ids:
            raise BadCompletion(f"completion {i}: no token ids (the gateway's answer lacks token_ids)")
        if lp is None or len(lp) != len(ids) or any(v is None for v in lp):
            got = "none" if lp is None else f"{sum(v is not None for v in lp)} of {len(ids)}"
            raise BadCompletion(f"completion {i}: logprobs of the sampled tokens: {got}")
        completion_ids.append(ids)
        logprobs.append([float(v) for v in lp])
        versions.append(c.weight_version)
    return {
        "prompt_ids": [list(p) for p in prompt_ids],
        "completion_ids": completion_ids,
        "logprobs": logprobs,
        "weight_version": versions,
    }


def _all_ranks(flag: bool, trainer: Any) -> bool:
    """True on every rank when ``flag`` is true on every rank (one all-reduce MIN; no collective for one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    import torch

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=trainer.accelerator.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ---------------------------------------------------------------------- TRL's use of the sampled logprobs
class _WeightsSyncedByPearlctl:
    """Stands for TRL's vLLM backend when generation goes through pearlctl: TRL asks it to sync weights before a
    custom rollout; pearlctl's export (``on_step_end``) and the daemon do that, so there is nothing to do."""

    def sync_weights(self) -> None:
        return None


def use_sampled_logprobs(trainer: Any) -> None:
    """Make TRL 1.16 apply its importance-sampling correction (``vllm_importance_sampling_correction``, mode and
    clips from the config) to the logprobs ``rollout_func`` returned. TRL computes it only when ``use_vllm``;
    set at construction that flag makes TRL start (``vllm_mode="colocate"``, the default) or connect to
    (``"server"``) a vLLM of its own, so it is set here, afterwards. Where TRL reads it then
    (grpo_trainer.py): ``_generate`` calls ``vllm_generation.sync_weights()`` (this module's no-op: pearlctl
    syncs the weights), ``_generate_and_score_completions`` computes the old logprobs and the ratio, and
    ``compute_loss`` multiplies the per-token loss by it. ``vllm_mode`` is set to ``"server"`` so that the one
    colocate-only branch (the tool-call loop's context limit, read from an in-process vLLM) is not taken."""
    trainer.vllm_generation = _WeightsSyncedByPearlctl()
    trainer._last_loaded_step = -1
    trainer.vllm_mode = "server"
    trainer.use_vllm = True


# ---------------------------------------------------------------------- the one call
def attach(
    trainer: Any,
    *,
    model_dir: str | os.PathLike | None = None,
    client: Any = None,
    channel: Any = None,
    weights_dir: str | os.PathLike | None = None,
    sampled_logprobs: bool = True,
    concurrency: int = 16,
    on_policy: bool = True,
) -> PearlCallback:
    """pearlctl for this GRPOTrainer (module docstring). ``model_dir``: the base model directory (its tokenizer
    and config go into each weight export). ``client``: the rollout client (default: a
    `pearlctl.router.client.RolloutClient` of the run under pearlctl; none outside it, and then TRL generates
    itself). Nothing is announced as the first batch's wait (this rollout reports no work for the daemon to
    predict from, so nothing is lent before a wait was measured) unless ``$PEARL_FIRST_WAIT_S`` hints it.
    ``sampled_logprobs``: apply TRL's importance-sampling correction to the workers' logprobs
    (`use_sampled_logprobs`). Returns the callback (its ``hook`` once training began)."""
    if trainer.rollout_func is not None:
        raise ValueError("this GRPOTrainer already has a rollout_func; pearlctl's would replace it")
    if client is None and under_pearlctl():
        from pearlctl.router.client import RolloutClient

        client = RolloutClient(os.environ["PEARL_RUN_DIR"], os.environ["PEARL_RUN_ID"])
    if client is not None and (getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None)):
        # TRL 1.16 runs its tool loop after rollout_func and generates the post-tool turns itself
        # (GRPOTrainer._tool_call_loop -> _generate_single_turn), on the trainer, not on the rollout workers
        raise ValueError(
            "tools/environment_factory with pearlctl's rollout: TRL would generate the post-tool turns on the "
            "trainer; run the turns in a rollout_func of your own through RolloutClient (docs/trl.md)"
        )
    callback = PearlCallback(trainer, model_dir=model_dir, channel=channel, weights_dir=weights_dir)
    trainer.add_callback(callback)
    if client is not None:
        trainer.rollout_func = RouterRollout(client, callback, concurrency=concurrency, on_policy=on_policy)
        if sampled_logprobs:
            use_sampled_logprobs(trainer)
    return callback
