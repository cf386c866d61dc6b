"""Token-level rollout batches (examples/grpo/token_batch.py; docs/rollout-batches.md) at their two edges.

- the trainer's edge: a batch line parses into a typed `Group` or fails with a `BatchError` that names the
  line and the field — for each invariant of the schema, and (hypothesis) for any value put anywhere in a
  valid line: never another exception; a valid group survives a dump and a parse unchanged;
- the trainer's input (train.pack): the ids it trains on are the trajectory's ids, unchanged, and the loss
  mask and sampled logprobs sit exactly on the sampled tokens, also when a completion is cut;
- the driver (examples/grpo/rollout.py) with a scripted client: turn 2 is sent as the token ids of turn 1's
  prompt + turn 1's sampled ids + the tool message, the trajectory records what was sampled with its logprobs
  and versions (a continued turn's parts too), and an answer without logprobs or with a drifted prompt fails
  the step instead of writing it;
- the synthetic source (train.SyntheticRollouts) gives the same format, and its logprobs are the model's.

The same chain against a real vLLM server: tests/engines/test_rollout_tokens_engine.py.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pearlctl.router.client import Completion
from pearlctl.router.judge import CANDIDATES, RUBRIC, VERDICT_PROMPT, JudgeClient, Mode, p_first
from tests.conftest import GRPO_EXAMPLE as GRPO
from tests.conftest import REPO, CharTokenizer, load_example

if str(GRPO) not in sys.path:
    sys.path.insert(0, str(GRPO))

import token_batch as tb  # noqa: E402

train = load_example("grpo_train_for_batches", GRPO / "train.py")
driver = load_example("grpo_rollout_for_batches", GRPO / "rollout.py")


def two_turns(v1: str | None = "3", v2: str | None = "3") -> tb.Trajectory:
    return tb.trajectory_from_turns(
        [1, 10, 11],
        [
            tb.Sampled(
                [20, 21, 2], [-0.5, -1.0, -0.25], v1, (tb.Part(tokens=3, weight_version=v1),), "stop", "http://a"
            ),
            [30, 31, 32],
            tb.Sampled([40, 41], [-2.0, -0.125], v2, finish_reason="length"),
        ],
    )


def group_doc() -> dict:
    g = tb.Group(
        prompt="1 + 2 =",
        rewards=(1.0, 0.0),
        trajectories=(two_turns(), two_turns("3", "4")),
        completions=("3", "no"),
        served_by=({"worker": "http://a", "weight_version": "3"}, {"worker": None, "weight_version": "4"}),
        judged_by=(
            tb.Judged(mode="verdict", model="judge", worker="http://j", score=1.0, requests=1),
            tb.Judged(mode="critique", model="judge", score=0.0, requests=2),
        ),
    )
    return json.loads(tb.dump_group(g))


# -- the format ---------------------------------------------------------------------------------------
def test_a_trajectory_is_the_episode_as_one_sequence_with_the_mask_on_the_sampled_tokens() -> None:
    t = two_turns()
    assert t.prompt_ids == (1, 10, 11)
    assert t.completion_ids == (20, 21, 2, 30, 31, 32, 40, 41)
    assert t.mask == (1, 1, 1, 0, 0, 0, 1, 1)
    assert t.logprobs == (-0.5, -1.0, -0.25, -2.0, -0.125)
    assert [(u.start, u.tokens, u.weight_version) for u in t.turns] == [(0, 3, "3"), (6, 2, "3")]


def test_a_group_survives_a_dump_and_a_parse_unchanged() -> None:
    line = json.dumps(group_doc())
    g = tb.parse_group(line)
    assert tb.parse_group(tb.dump_group(g)) == g
    assert g.trajectories[1].turns[1].weight_version == "4" and g.served_by[0]["worker"] == "http://a"


def _set(path: tuple, value):
    def mutate(d: dict) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


T0 = ("trajectories", 0)
MALFORMED = [
    ("missing rewards", lambda d: d.pop("rewards"), "rewards: Field required"),
    ("a reward as text", _set(("rewards", 0), "1"), "rewards.0: Input should be a valid number"),
    ("one reward short", lambda d: d["rewards"].pop(), "1 reward(s) for 2 trajectories"),
    ("no trajectories", _set(("trajectories",), []), "trajectories: Tuple should have at least 1 item"),
    ("a bool token id", _set((*T0, "prompt_ids", 1), True), "trajectories.0.prompt_ids.1: Input should be a valid int"),
    (
        "a negative token id",
        _set((*T0, "completion_ids", 0), -3),
        "trajectories.0.completion_ids.0: Input should be greater",
    ),
    (
        "a float token id",
        _set((*T0, "completion_ids", 0), 20.0),
        "trajectories.0.completion_ids.0: Input should be a valid int",
    ),
    ("an empty prompt", _set((*T0, "prompt_ids"), []), "trajectories.0.prompt_ids: Tuple should have at least 1"),
    ("a mask bit of 2", _set((*T0, "mask", 0), 2), "trajectories.0.mask.0: Input should be less than or equal to 1"),
    ("a short mask", lambda d: d["trajectories"][0]["mask"].pop(), "mask has 7 entries, completion_ids 8"),
    ("a logprob missing", lambda d: d["trajectories"][0]["logprobs"].pop(), "logprobs has 4 entries, mask has 5"),
    ("a positive logprob", _set((*T0, "logprobs", 2), 0.5), "trajectories.0.logprobs.2: Input should be less than"),
    (
        "a logprob as null",
        _set((*T0, "logprobs", 2), None),
        "trajectories.0.logprobs.2: Input should be a valid number",
    ),
    ("a mask off a turn", _set((*T0, "mask", 3), 1), "logprobs has 5 entries, mask has 6"),
    (
        "the mask moved",
        lambda d: d["trajectories"][0].update(mask=[1, 1, 0, 1, 0, 0, 1, 1]),
        "mask is 0 at completion position 2, where the turns say a sampled token",
    ),
    (
        "overlapping turns",
        _set((*T0, "turns", 1, "start"), 2),
        "turns.1 starts at 2, before the previous turn ends (3)",
    ),
    ("a turn past the end", _set((*T0, "turns", 1, "tokens"), 5), "turns.1 ends at 11, past completion_ids (8 tokens)"),
    ("no turns", _set((*T0, "turns"), []), "trajectories.0.turns: Tuple should have at least 1 item"),
    (
        "a version as a number",
        _set((*T0, "turns", 0, "weight_version"), 3),
        "turns.0.weight_version: Input should be a valid string",
    ),
    (
        "parts that do not add up",
        _set((*T0, "turns", 0, "parts", 0, "tokens"), 2),
        "parts add up to 2 token(s), the turn has 3",
    ),
    ("a completion text short", lambda d: d["completions"].pop(), "1 completion text(s) for 2 trajectories"),
    ("a verdict short", lambda d: d["judged_by"].pop(), "1 verdict(s) for 2 trajectories"),
    (
        "a reward not its verdict",
        _set(("rewards", 1), 0.5),
        "rewards.1 is 0.5, but the judge scored that trajectory 0.0",
    ),
    ("a score above 1", _set(("judged_by", 0, "score"), 1.5), "judged_by.0.score: Input should be less than or equal"),
    ("an unknown mode", _set(("judged_by", 0, "mode"), "vibes"), "judged_by.0.mode: Input should be 'verdict' or"),
]


@pytest.mark.parametrize(("why", "mutate", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_line_is_a_batch_error_naming_the_line_and_the_field(why, mutate, message) -> None:
    bad = group_doc()
    mutate(bad)
    text = json.dumps(group_doc()) + "\n\n" + json.dumps(bad) + "\n"
    with pytest.raises(tb.BatchError) as err:
        tb.parse_batch(text, "step-000001.jsonl")
    assert str(err.value).startswith("step-000001.jsonl line 3: "), str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no group in the batch"),
        ('{"prompt": "1 + 2 ="', "line 1: not JSON"),
        ("[1, 2]", "line 1: a group is a JSON object, not list"),
        ('{"prompt": "p", "rewards": [1], "completions": ["x"]}', "line 1: trajectories: missing — a text-only batch"),
        ('{"prompt": "p", "rewards": [NaN], "trajectories": []}', "rewards.0: Input should be a finite number"),
    ],
)
def test_a_batch_that_is_not_token_groups_is_a_batch_error(text: str, message: str) -> None:
    with pytest.raises(tb.BatchError, match="^b"):
        tb.parse_batch(text, "b")
    with pytest.raises(tb.BatchError) as err:
        tb.parse_batch(text, "b")
    assert message in str(err.value)


def test_read_batch_names_the_file(tmp_path: Path) -> None:
    path = tb.write_batch(tmp_path, 7, [tb.parse_group(json.dumps(group_doc()))])
    assert path.name == "step-000007.jsonl" and len(tb.read_batch(path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["step-000007.jsonl"]  # no temporary file left
    path.write_text(path.read_text() + '{"prompt": 3}\n')
    with pytest.raises(tb.BatchError, match=rf"^{path} line 2: prompt: Input should be a valid string"):
        tb.read_batch(path)
    with pytest.raises(tb.BatchError, match="cannot be read"):
        tb.read_batch(tmp_path / "step-000008.jsonl")


# -- properties ----------------------------------------------------------------------------------------
ids_st = st.lists(st.integers(0, 5000), max_size=6)
versions = st.sampled_from([None, "0", "1", "7"])


@st.composite
def sampled_st(draw) -> tb.Sampled:
    ids = draw(st.lists(st.integers(0, 5000), min_size=0, max_size=6))
    lps = [draw(st.floats(-50.0, 0.0, allow_nan=False)) for _ in ids]
    cut = draw(st.integers(0, len(ids)))
    parts = draw(
        st.sampled_from(
            [(), (tb.Part(tokens=len(ids), weight_version="1"),)]
            + ([(tb.Part(tokens=cut, weight_version="1"), tb.Part(tokens=len(ids) - cut, weight_version="2"))])
        )
    )
    return tb.Sampled(ids, lps, tb.turn_version(parts, draw(versions)), parts)


@st.composite
def trajectory_st(draw) -> tb.Trajectory:
    segments = [draw(sampled_st())]
    for _ in range(draw(st.integers(0, 3))):
        segments += [draw(ids_st), draw(sampled_st())]
    return tb.trajectory_from_turns(draw(st.lists(st.integers(0, 5000), min_size=1, max_size=6)), segments)


@st.composite
def group_st(draw) -> tb.Group:
    trajectories = tuple(draw(st.lists(trajectory_st(), min_size=1, max_size=4)))
    rewards = tuple(draw(st.floats(-2, 2, allow_nan=False)) for _ in trajectories)
    return tb.Group(prompt=draw(st.text(max_size=20)), rewards=rewards, trajectories=trajectories)


@settings(max_examples=150, deadline=None)
@given(group_st())
def test_property_every_built_group_round_trips_and_keeps_its_invariants(g: tb.Group) -> None:
    assert tb.parse_group(tb.dump_group(g)) == g
    for t in g.trajectories:
        assert len(t.mask) == len(t.completion_ids) and len(t.logprobs) == sum(t.mask)
        assert sum(u.tokens for u in t.turns) == sum(t.mask)
        for u in t.turns:
            assert all(t.mask[u.start : u.start + u.tokens])
            if u.parts and len({p.weight_version for p in u.parts}) > 1:
                assert u.weight_version is None  # a turn sampled by two versions has no one version


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _paths(doc, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_any_value_anywhere_parses_or_is_a_batch_error_never_a_crash(data) -> None:
    doc = group_doc()
    path = data.draw(st.sampled_from(_paths(doc)))
    value = data.draw(json_values)
    bad = copy.deepcopy(doc)
    _set(path, value)(bad)
    try:
        g = tb.parse_batch(json.dumps(bad), "b")[0]
    except tb.BatchError as exc:
        assert str(exc).startswith("b line 1: ")
    else:  # accepted: then it keeps every invariant the trainer relies on
        for t in g.trajectories:
            assert len(t.mask) == len(t.completion_ids) and len(t.logprobs) == sum(t.mask)
            assert all(math.isfinite(v) and v <= 0 for v in t.logprobs)


# -- the trainer's input -------------------------------------------------------------------------------
def test_the_trainer_trains_on_the_sampled_ids_with_the_mask_and_logprobs_on_them() -> None:
    g = tb.parse_group(json.dumps(group_doc()))
    batch = train.pack([g], max_completion_tokens=128, pad_id=0)
    assert batch is not None and batch["ids"].shape[0] == 2
    assert batch["adv"].flatten().tolist() == pytest.approx([1.0, -1.0], abs=1e-3)
    for row, t in enumerate(g.trajectories):
        seq = list(t.prompt_ids + t.completion_ids)
        assert batch["ids"][row, : len(seq)].tolist() == seq  # the ids as sampled: nothing re-tokenized
        assert batch["attn"][row].sum().item() == len(seq)
        at = [k for k in range(batch["mask"].shape[1]) if batch["mask"][row, k] == 1]
        # logits at k predict token k + 1: exactly the mask-1 completion tokens, with their sampler's logprobs
        assert [batch["ids"][row, k + 1].item() for k in at] == [
            c for c, m in zip(t.completion_ids, t.mask, strict=True) if m
        ]
        assert batch["sampled"][row, at].tolist() == pytest.approx(list(t.logprobs))
        assert batch["sampled"][row].abs().sum().item() == pytest.approx(sum(abs(v) for v in t.logprobs))


def test_a_cut_completion_keeps_mask_and_logprobs_aligned_and_equal_rewards_teach_nothing() -> None:
    g = tb.parse_group(json.dumps(group_doc()))
    batch = train.pack([g], max_completion_tokens=4, pad_id=0)  # turn 1 (3 tokens) and one tool token
    assert batch is not None and batch["ids"].shape[1] == 3 + 4
    assert batch["mask"][0].tolist() == [0, 0, 1, 1, 1, 0]
    assert batch["sampled"][0, 2:5].tolist() == pytest.approx([-0.5, -1.0, -0.25])
    same = tb.Group(prompt="p", rewards=(0.5, 0.5), trajectories=g.trajectories)
    assert train.pack([same], 128, 0) is None


# -- the driver ----------------------------------------------------------------------------------------
class ScriptedClient:
    """Answers each turn with the next scripted (token ids, logprobs, parts) and records the prompts sent."""

    def __init__(self, answers: list[tuple[list[int], list[float] | None, list[dict]]], echo: bool = True):
        self.answers, self.echo = list(answers), echo
        self.sent: list[list[int]] = []
        self.extra: list[dict] = []
        self.counts = {"queued": 0, "generating": 0, "tool_wait": 0, "done": 0, "tokens": 0}

    def count(self, key: str, delta: int = 1) -> None:
        self.counts[key] += delta

    def complete(self, session: str, prompt, *, max_tokens: int, extra=None, **kw) -> Completion:
        assert isinstance(prompt, list) and all(type(t) is int for t in prompt), "a turn is sent as token ids"
        self.sent.append(list(prompt))
        self.extra.append(dict(extra or {}))
        ids, lps, parts = self.answers.pop(0)
        version = parts[-1]["weight_version"] if parts else "5"
        return Completion(
            "x",
            len(ids),
            "http://w",
            version,
            0,
            "stop" if ids and ids[-1] == 2 else "length",
            parts=parts,
            token_ids=ids,
            logprobs=lps,
            prompt_token_ids=list(prompt) if self.echo else [9, 9],
        )


ARGS = SimpleNamespace(
    seed=0, prompts=1, group_size=1, max_tokens=4, tool_latency_s=0.0, tool_latency_dist="fixed", on_policy=True
)


def run_episode(client: ScriptedClient) -> dict:
    import random

    remaining = driver.Remaining(ARGS)
    remaining.start(["s1-p0-g0"])
    return driver.episode(client, driver.Encoder(CharTokenizer()), "s1-p0-g0", 3, 4, ARGS, random.Random(0), remaining)


def test_turn_two_is_sent_as_turn_one_prompt_plus_its_sampled_ids_plus_the_tool_ids() -> None:
    encode = driver.Encoder(CharTokenizer())
    one = [([50, 51, 2], [-0.1, -0.2, -0.3], []), ([60, 61], [-1.0, -2.0], [])]
    client = ScriptedClient(one)
    result = run_episode(client)
    prompt_ids = encode(driver.USER.format("3 + 4 ="))
    tool_ids = encode(driver.TOOL.format("calc(3,4) = 7"))  # turn 1 ended with <|im_end|>: nothing added
    assert client.sent == [prompt_ids, prompt_ids + [50, 51, 2] + tool_ids]
    # every turn asks for the sampled token's logprob and ends at <|im_end|>
    assert all(e == {"logprobs": 0, "stop_token_ids": [2]} for e in client.extra)
    t = result["trajectory"]
    assert t.prompt_ids == tuple(prompt_ids)
    assert t.completion_ids == (50, 51, 2, *tool_ids, 60, 61)
    assert t.mask == (1, 1, 1, *[0] * len(tool_ids), 1, 1)
    assert t.logprobs == (-0.1, -0.2, -0.3, -1.0, -2.0)
    assert [u.weight_version for u in t.turns] == ["5", "5"]

    cut = ScriptedClient([([50, 51], [-0.1, -0.2], []), ([60], [-1.0], [])])  # turn 1 ran out of tokens
    run_episode(cut)
    assert cut.sent[1] == prompt_ids + [50, 51] + encode(driver.END + driver.TOOL.format("calc(3,4) = 7"))


def test_a_continued_turn_keeps_its_parts_and_has_no_single_version_when_they_differ() -> None:
    parts = [{"tokens": 1, "weight_version": "1", "worker": "a"}, {"tokens": 2, "weight_version": "2"}]
    client = ScriptedClient([([50, 51, 52], [-0.1, -0.2, -0.3], parts), ([60], [-1.0], [])])
    t = run_episode(client)["trajectory"]
    first = t.turns[0]
    assert first.weight_version is None and [(p.tokens, p.weight_version) for p in first.parts] == [(1, "1"), (2, "2")]
    assert t.logprobs[:3] == (-0.1, -0.2, -0.3)  # each token's logprob as the worker that sampled it returned it
    same = [{"tokens": 1, "weight_version": "2"}, {"tokens": 2, "weight_version": "2"}]
    assert (
        run_episode(ScriptedClient([([50, 51, 52], [-0.1] * 3, same), ([60], [-1.0], [])]))["trajectory"]
        .turns[0]
        .weight_version
        == "2"
    )


@pytest.mark.parametrize(
    ("answers", "echo", "message"),
    [
        ([([50, 51], None, [])], True, "logprobs of the sampled tokens: none"),
        ([([50, 51], [-0.1, None], [])], True, "logprobs of the sampled tokens: 1 of 2"),
        ([([50, 51], [-0.1, -0.2], [])], False, "the worker saw 2 prompt ids, not the"),
    ],
    ids=["no logprobs", "a logprob missing", "a drifted prompt"],
)
def test_a_turn_that_cannot_be_trained_on_fails_the_step_and_nothing_is_written(answers, echo, message) -> None:
    with ThreadPoolExecutor(1) as pool, pytest.raises(driver.StepFailed, match=message):
        driver.run_step(
            ScriptedClient(answers * 2, echo=echo),
            driver.Encoder(CharTokenizer()),
            1,
            ARGS,
            pool,
            driver.Remaining(ARGS),
        )


def test_a_step_of_the_driver_is_a_batch_the_trainer_parses(tmp_path: Path) -> None:
    args = SimpleNamespace(**{**vars(ARGS), "prompts": 2, "group_size": 3})
    answers = [([50, 2], [-0.1, -0.2], []), ([60], [-1.0], [])] * 6
    with ThreadPoolExecutor(2) as pool:
        groups = driver.run_step(
            ScriptedClient(answers), driver.Encoder(CharTokenizer()), 1, args, pool, driver.Remaining(args)
        )
    path = tb.write_batch(tmp_path, 1, groups)
    parsed = tb.read_batch(path)
    assert parsed == groups and [len(g.trajectories) for g in parsed] == [3, 3]
    assert all(s["weight_version"] == "5" for g in parsed for s in g.served_by)  # as before, for tools that read it


class JudgedClient(ScriptedClient):
    """Also answers the judge's verdict requests (``request``): P(yes) from the prompt logprobs of the two
    candidates, ``-len(task)/10`` for yes and ``-1`` for no, so each trajectory's verdict is its own; records the
    trajectories judged. ``refuse``: the critique it answers has no score."""

    def __init__(self, answers, refuse: bool = False):
        super().__init__(answers)
        self.judged: list[str] = []
        self.refuse = refuse
        self.lock = threading.Lock()

    def complete(self, *a, **kw):
        with self.lock:
            return super().complete(*a, **kw)

    def request(self, session: str, body: dict) -> dict:
        with self.lock:
            self.judged.append(session.removeprefix("judge-"))
        if self.refuse:
            return {"choices": [{"index": 0, "text": "no idea"}]}
        yes = -len(body["prompt"][0]) / 100
        choices = []
        for i, logprob in enumerate((yes, -1.0)):
            ids = [1, 2, 3 + i]
            choices.append(
                {"index": i, "prompt_token_ids": ids, "prompt_logprobs": [None, {"2": -0.1}, {str(3 + i): logprob}]}
            )
        return {
            "choices": choices,
            "pearl": {"parts": [{"tokens": 1, "worker": "http://judge", "weight_version": None}]},
        }


def run_judged_step(client: JudgedClient, args, mode: Mode = Mode.VERDICT) -> list:
    judge = JudgeClient(client, "tiny-judge", mode=mode, attempts=2)  # type: ignore[arg-type]
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(2) as judge_pool:
        judging = driver.Judging(judge, judge_pool)
        groups = driver.run_step(
            client, driver.Encoder(CharTokenizer()), 1, args, pool, driver.Remaining(args), judging
        )
    assert judge.queue.counts() == {"waiting": 0, "judging": 0, "done": len(client.judged), "failed": 0}
    return groups


def test_with_a_judge_each_trajectory_is_judged_once_and_its_verdict_is_its_reward(tmp_path: Path) -> None:
    args = SimpleNamespace(**{**vars(ARGS), "prompts": 2, "group_size": 3})
    client = JudgedClient([([50, 2], [-0.1, -0.2], []), ([60], [-1.0], [])] * 6)
    groups = run_judged_step(client, args)
    sessions = [f"s1-p{p}-g{g}" for p in range(2) for g in range(3)]
    assert sorted(client.judged) == sessions  # every trajectory, once
    for g in groups:
        assert len(g.judged_by) == 3 and all(
            j.model == "tiny-judge" and j.worker == "http://judge" for j in g.judged_by
        )
        assert g.rewards == tuple(j.score for j in g.judged_by)
        asked = [VERDICT_PROMPT.format(task=g.prompt, answer=c, rubric=RUBRIC) + CANDIDATES[0] for c in g.completions]
        assert g.rewards == tuple(p_first(-len(a) / 100, -1.0) for a in asked)  # the judge's verdict, not the rule's
    assert tb.read_batch(tb.write_batch(tmp_path, 1, groups)) == groups


def test_a_verdict_that_cannot_be_had_fails_the_step_naming_the_trajectory() -> None:
    args = SimpleNamespace(**{**vars(ARGS), "prompts": 1, "group_size": 2})
    client = JudgedClient([([50, 2], [-0.1, -0.2], []), ([60], [-1.0], [])] * 2, refuse=True)
    with pytest.raises(
        driver.StepFailed, match=r"step 1: the verdict on s1-p0-g\d failed: trajectory s1-p0-g\d: no score"
    ):
        run_judged_step(client, args, Mode.CRITIQUE)


# -- the synthetic source ------------------------------------------------------------------------------
def test_the_synthetic_source_gives_token_groups_whose_logprobs_are_the_models() -> None:
    import torch
    import transformers

    model_dir = REPO / "examples" / "models" / "tiny"
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = SimpleNamespace(module=model, device=torch.device("cpu"), zero_optimization_stage=lambda: 2)
    args = SimpleNamespace(seed=0, prompts=2, group_size=3, max_new_tokens=6)
    source = train.SyntheticRollouts(engine, tok, args, rank=0, world_size=1)
    groups = source._generate(["1 + 2 =", "30 + 40 ="], step=3)
    reparsed = tb.parse_batch("".join(tb.dump_group(g) + "\n" for g in groups))
    assert reparsed == groups and [len(g.trajectories) for g in groups] == [3, 3]
    model.eval()
    for g in groups:
        for t in g.trajectories:
            assert [u.weight_version for u in t.turns] == ["2"] and t.prompt_ids == tuple(tok(g.prompt)["input_ids"])
            assert 1 <= len(t.completion_ids) <= 6 and all(t.mask)
            ids = torch.tensor([t.prompt_ids + t.completion_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            start = len(t.prompt_ids) - 1
            scored = [logp[start + k, c].item() for k, c in enumerate(t.completion_ids)]
            assert scored == pytest.approx(list(t.logprobs), abs=1e-4)  # the recorded logprobs are the model's
