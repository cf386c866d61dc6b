"""The TRL example's pearlctl glue (examples/trl/pearl_trl.py; docs/trl.md): the callback's hook calls at a
Trainer's step boundaries, the ``rollout_func`` output TRL 1.16 requires, and a real GRPOTrainer run of 2 steps
on the tiny model with generation through a stand-in of the run's gateway, a borrow (release, then reclaim)
during the first batch's generation, a weight export per step, and TRL's importance-sampling correction fed
by the sampled logprobs. Needs TRL (the ``trl`` extra, which scripts/setup installs)."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import trl  # noqa: F401  (the trl extra, installed by scripts/setup: missing fails, never skips)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "models" / "tiny"
for _path in (REPO / "examples" / "trl",):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import pearl_trl  # noqa: E402


def test_importing_trl_at_collection_leaves_the_vllm_log_level_to_the_servers_the_tests_start(monkeypatch):
    """``import trl`` (above) sets VLLM_LOGGING_LEVEL=ERROR in this process; tests/conftest.py puts the environment
    back after collection, else every vLLM server a later test starts here would log nothing at INFO."""
    import os

    from trl import _compat

    from tests.conftest import ENV_AT_START

    assert os.environ.get("VLLM_LOGGING_LEVEL") == ENV_AT_START.get("VLLM_LOGGING_LEVEL")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    _compat._patch_vllm_logging()  # what the import ran: TRL still does it
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"


# ---------------------------------------------------------------------- stand-ins
class FakeHook:
    """Records the hook calls the glue makes (every call is collective on a real hook)."""

    def __init__(self, engine=None, **kwargs):
        self.engine, self.kwargs = engine, kwargs
        self.calls: list[tuple] = []
        self.waits: list[tuple] = []  # (phase, expected_wait_s) of each phase() report
        self.stop = False
        self.weight_version = None
        self.zero_stage = 0

    def save_on_signal(self, ckpt_dir):
        self.calls.append(("save_on_signal", Path(ckpt_dir).name))

    def ensure_reclaimed(self):
        self.calls.append(("ensure_reclaimed",))

    def phase(self, name, *, step, expected_wait_s=None):
        self.calls.append(("phase", name, step))
        self.waits.append((name, expected_wait_s))

    def export_weights(self, out_dir, version):
        self.calls.append(("export_weights", Path(out_dir).name, version))
        self.weight_version = version

    def should_stop(self):
        self.calls.append(("should_stop",))
        return self.stop


def fake_trainer(tmp_path: Path, step: int = 0, **args) -> SimpleNamespace:
    defaults = dict(output_dir=str(tmp_path / "out"), max_completion_length=8, temperature=1.0, top_p=1.0, top_k=0,
                    min_p=None, repetition_penalty=1.0)  # fmt: skip
    return SimpleNamespace(
        args=SimpleNamespace(**{**defaults, **args}),
        state=SimpleNamespace(global_step=step),
        accelerator=SimpleNamespace(is_main_process=True, process_index=0, device="cpu"),
        num_generations=2,
        eos_token_ids=[2],
        rollout_func=None,
        callbacks=[],
        add_callback=lambda cb: None,
    )


class FakeCompletion(SimpleNamespace):
    pass


class FakeClient:
    """RolloutClient's surface the glue uses. ``answer(prompt_ids) -> (ids, logprobs)``; the workers serve
    ``version`` (None: the base weights)."""

    def __init__(self, answer=None, version: str | None = None):
        self.answer = answer or (lambda prompt_ids: ([5, 6, 2], [-0.5, -0.25, -0.125]))
        self.version = version
        self.requests: list[dict] = []
        self.asked_workers = 0

    def workers(self, force: bool = False):
        self.asked_workers += 1
        return [{"url": "http://w0", "weight_version": self.version}]

    def wait_for_joining(self, join_wait_s: float = 15.0) -> float:
        return 0.0

    def complete(self, session, prompt, *, max_tokens, temperature=1.0, stop=None, extra=None):
        self.requests.append({"session": session, "prompt": list(prompt), "max_tokens": max_tokens,
                              "temperature": temperature, "extra": dict(extra or {})})  # fmt: skip
        ids, logprobs = self.answer(list(prompt))
        return FakeCompletion(token_ids=ids, logprobs=logprobs, weight_version=self.version, tokens=len(ids))


class ScriptedChannel:
    """The daemon's side of a borrow: a release at the first waiting report, a reclaim once released."""

    repeats_commands = False

    def __init__(self):
        self.events: list[dict] = []
        self.acks: list[tuple[str, dict]] = []
        self.sent: set[str] = set()

    def report(self, event):
        self.events.append(dict(event))
        if event["phase"] == "waiting" and not event["released"] and "release-1" not in self.sent:
            self.sent.add("release-1")
            return {"command": "release", "command_id": "release-1"}
        if event["released"] and "reclaim-1" not in self.sent:
            self.sent.add("reclaim-1")
            return {"command": "reclaim", "command_id": "reclaim-1"}
        return None

    def ack(self, command_id, result):
        self.acks.append((command_id, result))


@pytest.fixture(autouse=True)
def _no_pearl_env(monkeypatch):
    monkeypatch.delenv("PEARL_RUN_DIR", raising=False)
    monkeypatch.delenv("PEARL_RUN_ID", raising=False)


@pytest.fixture
def keep_signals():
    """The hook installs USR2/TERM handlers; the test process gets its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


# ---------------------------------------------------------------------- the callback
def make_callback(tmp_path, trainer, **kwargs):
    hooks = []

    def factory(engine, **kw):
        hooks.append(FakeHook(engine, **kw))
        return hooks[-1]

    cb = pearl_trl.PearlCallback(trainer, model_dir=TINY, hook_factory=factory, **kwargs)
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    cb.on_train_begin(trainer.args, trainer.state, control)
    return cb, hooks[0], control


def test_callback_marks_training_and_exports_each_step_with_the_global_step_as_version(tmp_path):
    trainer = fake_trainer(tmp_path)
    cb, hook, control = make_callback(tmp_path, trainer, weights_dir=tmp_path / "weights")
    assert isinstance(hook.engine, pearl_trl.TorchEngine)  # no DeepSpeed: the adapter, ZeRO-0
    assert (
        hook.kwargs["base_model_dir"] == TINY
        and hook.kwargs["ckpt_dir"] == Path(trainer.args.output_dir) / "pearl-release"
    )
    assert hook.calls == [("save_on_signal", "pearl-release")]
    hook.calls.clear()
    (tmp_path / "weights").mkdir()
    for step in (1, 2):
        cb.on_step_begin(trainer.args, trainer.state, control)
        trainer.state.global_step = step  # the Trainer's optimizer step
        cb.on_step_end(trainer.args, trainer.state, control)
    assert hook.calls == [
        ("ensure_reclaimed",), ("phase", "training", 1), ("export_weights", "weights", "1"), ("should_stop",),
        ("ensure_reclaimed",), ("phase", "training", 2), ("export_weights", "weights", "2"), ("should_stop",),
    ]  # fmt: skip
    assert not control.should_save and not control.should_training_stop


def test_callback_without_pearlctl_exports_nothing_and_uses_a_null_channel(tmp_path):
    trainer = fake_trainer(tmp_path)
    cb, hook, control = make_callback(tmp_path, trainer)
    assert cb.weights_dir is None and type(hook.kwargs["channel"]).__name__ == "NullChannel"
    cb.on_step_begin(trainer.args, trainer.state, control)
    trainer.state.global_step = 1
    cb.on_step_end(trainer.args, trainer.state, control)
    assert [c[0] for c in hook.calls[1:]] == ["ensure_reclaimed", "phase", "should_stop"]


def test_a_signal_saves_the_step_and_stops_the_trainer(tmp_path):
    trainer = fake_trainer(tmp_path)
    cb, hook, control = make_callback(tmp_path, trainer)
    hook.stop = True  # any rank got USR2/TERM: the ranks agree at the step end
    trainer.state.global_step = 3
    cb.on_step_end(trainer.args, trainer.state, control)
    assert control.should_save and control.should_training_stop


def test_last_checkpoint_is_the_newest_complete_one(tmp_path):
    assert pearl_trl.last_checkpoint(tmp_path) is None
    for n in (2, 10, 7):
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-12").mkdir()  # being written: no trainer_state.json yet
    assert pearl_trl.last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


# ---------------------------------------------------------------------- the rollout function
def test_rollout_func_returns_trls_keys_one_completion_per_prompt_in_order(tmp_path):
    from transformers import AutoTokenizer

    trainer = fake_trainer(tmp_path, step=2, top_p=0.9)
    trainer.processing_class = AutoTokenizer.from_pretrained(TINY)
    cb, hook, _ = make_callback(tmp_path, trainer)
    hook.calls.clear()
    answers = {}

    def answer(prompt_ids):
        n = len(answers)
        answers[n] = prompt_ids
        return [10 + n, 2], [-1.0 - n, -0.5]

    client = FakeClient(answer, version="2")
    rollout = pearl_trl.RouterRollout(client, cb, concurrency=1, poll_interval_s=0.001)
    prompts = ["3 + 4 =", "3 + 4 =", "1 + 1 =", "1 + 1 ="]  # TRL's RepeatSampler: each prompt num_generations times
    out = rollout(prompts, trainer)

    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "weight_version"}
    assert all(len(v) == len(prompts) for v in out.values())
    assert out["prompt_ids"][0] == trainer.processing_class(text="3 + 4 =")["input_ids"]  # as TRL tokenizes text
    assert out["completion_ids"] == [[10 + i, 2] for i in range(4)]
    assert out["logprobs"] == [[-1.0 - i, -0.5] for i in range(4)]
    assert out["weight_version"] == ["2"] * 4
    # a group (one prompt's num_generations completions) shares a session; sampling follows TRL's config
    assert [r["session"] for r in client.requests] == ["trl-s3-r0-g0", "trl-s3-r0-g0", "trl-s3-r0-g1", "trl-s3-r0-g1"]
    r = client.requests[0]
    assert r["max_tokens"] == 8 and r["temperature"] == 1.0
    assert r["extra"] == {"logprobs": 0, "stop_token_ids": [2], "top_p": 0.9}
    # on-policy: step 3 waited for version "2"; the trainer reported waiting, then took its GPUs back to train
    assert client.asked_workers >= 1
    assert hook.calls[0] == ("phase", "waiting", 3)
    assert hook.calls[-2:] == [("ensure_reclaimed",), ("phase", "training", 3)]
    assert rollout.expected_wait_s is not None  # the next batch's wait is announced to the daemon


def test_the_waiting_reports_count_the_expected_wait_down_then_announce_the_measured_one(tmp_path):
    from transformers import AutoTokenizer

    trainer = fake_trainer(tmp_path)
    trainer.processing_class = AutoTokenizer.from_pretrained(TINY)
    cb, hook, _ = make_callback(tmp_path, trainer)

    def slow(prompt_ids):
        time.sleep(0.05)
        return [5, 2], [-1.0, -1.0]

    rollout = pearl_trl.RouterRollout(FakeClient(slow), cb, concurrency=1, poll_interval_s=0.01)
    rollout.expected_wait_s = 30.0  # as if an earlier batch had been measured
    rollout(["1 + 1 =", "1 + 1 ="], trainer)
    waiting = [w for name, w in hook.waits if name == "waiting"]
    assert len(waiting) >= 3 and waiting == sorted(waiting, reverse=True) and 29.0 < waiting[-1] < waiting[0] <= 30.0
    assert rollout.expected_wait_s == pytest.approx(0.7 * 30.0 + 0.3 * rollout.last["wait_s"], abs=0.01)


def test_a_failed_batch_raises_once_the_gpus_are_back(tmp_path):
    from transformers import AutoTokenizer

    trainer = fake_trainer(tmp_path)
    trainer.processing_class = AutoTokenizer.from_pretrained(TINY)
    cb, hook, _ = make_callback(tmp_path, trainer)

    def answer(prompt_ids):
        return [5, 2], None  # no logprobs: TRL could not correct with them

    rollout = pearl_trl.RouterRollout(FakeClient(answer), cb, poll_interval_s=0.001)
    with pytest.raises(pearl_trl.RolloutFailed, match="step 1: BadCompletion"):
        rollout(["1 + 1 =", "1 + 1 ="], trainer)
    assert hook.calls[-2:] == [("ensure_reclaimed",), ("phase", "training", 1)]


def test_rollout_func_tokenizes_a_conversation_with_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    messages = [{"role": "user", "content": "3 + 4 ="}]
    ids = pearl_trl.tokenize_prompt(tok, messages)
    assert ids == list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )


@pytest.mark.parametrize(
    "ids, logprobs, why",
    [([], [], "no token ids"), ([5, 2], None, "logprobs of the sampled tokens: none"),
     ([5, 2], [-1.0], "1 of 2"), ([5, 2], [-1.0, None], "1 of 2")],
)  # fmt: skip
def test_an_answer_without_ids_or_one_logprob_per_token_is_refused(ids, logprobs, why):
    with pytest.raises(pearl_trl.BadCompletion, match=re.escape(why)):
        pearl_trl.completions_to_rollout([[1]], [FakeCompletion(token_ids=ids, logprobs=logprobs, weight_version=None)])


def test_sampled_logprobs_turn_on_trls_correction_without_a_vllm_of_its_own(tmp_path):
    trainer = fake_trainer(tmp_path)
    trainer.use_vllm, trainer.vllm_mode = False, "colocate"  # TRL 1.16's defaults
    pearl_trl.use_sampled_logprobs(trainer)
    assert trainer.use_vllm is True and trainer.vllm_mode == "server"
    assert trainer.vllm_generation.sync_weights() is None  # the weights reach the workers through pearlctl


def test_attach_refuses_tools_whose_later_turns_trl_would_generate_on_the_trainer(tmp_path):
    trainer = fake_trainer(tmp_path)
    trainer.tools = [len]
    with pytest.raises(ValueError, match="post-tool turns"):
        pearl_trl.attach(trainer, client=FakeClient(), channel=ScriptedChannel())


def test_the_shipped_spec_runs_the_example_as_the_trainer_with_a_rollout_pool():
    from pearlctl.config import load_spec

    spec = load_spec(REPO / "examples/trl/tiny.toml", ("never", "greedy", "pearl", "static", "elastic"))
    argv = spec.pools["trainer"].train_command
    assert "{repo}/examples/trl/train_grpo.py" in argv and argv[argv.index("--zero") + 1] == "2"
    assert "rollout" in spec.pools


# ---------------------------------------------------------------------- a real GRPOTrainer, 2 steps
def sum_answer(tok):
    """A stand-in worker: the right sum for even requests, a wrong one for odd, so every group has a spread of
    rewards; each sampled token's logprob near the untrained tiny model's (its vocabulary is 2048)."""
    count = [0]

    def answer(prompt_ids):
        a, b = map(int, re.findall(r"(\d+) \+ (\d+) =", tok.decode(prompt_ids))[0])
        count[0] += 1
        text = f" {a + b if count[0] % 2 == 0 else a + b + 1}<|im_end|>"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return ids, [-7.6] * len(ids)

    return answer


@pytest.mark.timeout(240)
def test_grpo_trainer_two_steps_with_a_borrow_while_the_first_batch_generates(tmp_path, keep_signals):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO / "examples" / "trl"))
    import train_grpo

    out = tmp_path / "out"
    tok = AutoTokenizer.from_pretrained(TINY)
    config = GRPOConfig(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, beta=0.0, bf16=False, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32),
        reward_funcs=[train_grpo.sum_reward],
        args=config,
        train_dataset=train_grpo.prompts_dataset(32, 0),
        processing_class=tok,
    )
    client, channel = FakeClient(sum_answer(tok)), ScriptedChannel()
    pearl = pearl_trl.attach(trainer, model_dir=TINY, client=client, channel=channel, weights_dir=out / "weights")
    pearl.poll_interval_s = 0.01
    trainer.rollout_func.poll_interval_s = 0.01
    trainer.rollout_func.weights_timeout_s = 0.2  # the stand-in workers never change version

    trainer.train()

    assert trainer.state.global_step == 2
    assert len(client.requests) == 2 * 8  # per step: 8 completions (2 prompts x 4), one request each
    # the borrow: released at the first waiting point (ZeRO-0: by checkpoint), reclaimed before training
    assert [e["command"] for e in pearl.events] == ["release", "reclaim"]
    assert [a[0] for a in channel.acks] == ["release-1", "reclaim-1"] and all(a[1]["ok"] for a in channel.acks)
    assert channel.acks[0][1]["mode"] == "checkpoint" and (out / "pearl-release" / "latest").exists()
    phases = [(e["phase"], e["step"], e["released"]) for e in channel.events]
    assert phases[0] == ("training", 1, False)  # on_step_begin, before the batch is generated
    assert ("waiting", 1, True) in phases and ("training", 2, False) in phases
    first_training_after_borrow = phases.index(("training", 1, False), 1)
    assert all(not released for _, _, released in phases[first_training_after_borrow:])
    # weights: one export per optimizer step, version = global step, the base model's tokenizer alongside
    assert (out / "weights" / "LATEST").read_text().strip() == "2"
    assert sorted(p.name for p in (out / "weights").iterdir() if p.is_dir()) == ["1", "2"]
    assert (out / "weights" / "2" / "tokenizer.json").exists()
    # each report names the latest export, whose path the daemon syncs to the workers
    assert next(e for e in channel.events if (e["phase"], e["step"]) == ("training", 2))["weight_version"] == "1"
    # TRL trained on the sampled tokens and corrected with their logprobs (its use_vllm path)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(isinstance(h["loss"], float) for h in logged)
    assert all("sampling/sampling_logp_difference/mean" in h for h in logged)
    assert any(h["reward_std"] > 0 for h in logged)
    json.dumps(logged)  # plain numbers
