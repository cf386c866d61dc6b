"""The judge's client (pearlctl.router.judge) at one seam, the gateway's HTTP (tests/unit/test_rollout_client.py's
fake gateway): what each scoring mode asks the judge, how a verdict is read from the answer, and that a critique
without a readable score is retried and then an error naming the trajectory, never a score of zero. A real judge
(vLLM on the tiny judge model) answers the same requests in tests/integration/test_weight_broadcast_slurm.py."""

from __future__ import annotations

import math

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pearlctl.router.client import TurnRefused
from pearlctl.router.judge import (
    JudgeClient,
    JudgeError,
    Mode,
    Queue,
    VerdictUnparsed,
    candidate_logprobs,
    p_first,
    parse_score,
    score_regex,
)
from tests.unit.test_rollout_client import FakeTime, Gateway, make_client

PEARL = {"parts": [{"tokens": 1, "worker": "http://judge-w1:8000", "weight_version": None}], "attempts": 1}


def prompt_logprobs(ids: list[int], logprob) -> list:
    """vLLM's shape: None first, then per position a map of the prompt token (as a JSON key) to its logprob."""
    return [None] + [{str(t): {"logprob": logprob(i, t), "rank": 1, "decoded_token": "?"}} for i, t in enumerate(ids)][
        1:
    ]


def verdict_answer(yes_ids: list[int], no_ids: list[int], logprob=lambda i, t: -1.0) -> httpx.Response:
    choices = [
        {
            "index": i,
            "text": "",
            "finish_reason": "length",
            "prompt_token_ids": ids,
            "prompt_logprobs": prompt_logprobs(ids, logprob),
        }
        for i, ids in enumerate((yes_ids, no_ids))
    ]
    return httpx.Response(200, json={"choices": choices, "usage": {}, "pearl": PEARL})


def critique_answer(text: str) -> httpx.Response:
    choice = {"index": 0, "text": text, "finish_reason": "stop"}
    return httpx.Response(200, json={"choices": [choice], "usage": {}, "pearl": PEARL})


def test_a_verdict_is_p_yes_from_one_request_for_both_candidates_prompt_logprobs() -> None:
    """Both candidates in one request, scored as prompts (no sampling, one token generated): P(yes) is the yes
    suffix's probability over both, each the sum of its tokens' logprobs after the prompts' common prefix."""
    # the shared prompt is 5 tokens; " yes" is two tokens (logprobs -0.5, -0.25), " no" one (-2.0)
    lp = {(5, 90): -0.5, (6, 91): -0.25, (5, 80): -2.0}
    gw = Gateway(
        lambda b, h: verdict_answer([1, 2, 3, 4, 9, 90, 91], [1, 2, 3, 4, 9, 80], lambda i, t: lp.get((i, t), -7.0))
    )
    judge = JudgeClient(make_client(gw, FakeTime()), "judge-model")
    judge.enqueue()
    v = judge.score("s1-p0-g0", "2 + 2 =", "4")
    ((_, body, headers),) = gw.requests
    assert body["model"] == "judge-model" and body["max_tokens"] == 1 and body["temperature"] == 0.0
    assert body["prompt_logprobs"] == 0 and body["return_token_ids"] is True
    assert [p.endswith(c) for p, c in zip(body["prompt"], (" yes", " no"), strict=True)] == [True, True]
    assert "Task: 2 + 2 =" in body["prompt"][0] and "Answer: 4" in body["prompt"][0]
    assert headers["x-session-id"] == "judge-s1-p0-g0"
    assert v.score == pytest.approx(math.exp(-0.75) / (math.exp(-0.75) + math.exp(-2.0)))
    assert (v.mode, v.model, v.worker, v.weight_version, v.requests) == (
        Mode.VERDICT,
        "judge-model",
        "http://judge-w1:8000",
        None,
        1,
    )
    assert judge.queue.counts() == {"waiting": 0, "judging": 0, "done": 1, "failed": 0}


def test_a_tokenizer_that_merges_a_candidate_with_the_prompt_is_compared_from_where_the_two_differ() -> None:
    """ " yes" merged with the prompt's last token into one token: the two differ from that position, and both
    candidates are scored from there (the same conditioning), not from a fixed prompt length."""
    yes, no = [1, 2, 77], [1, 2, 3, 80]  # 77 = "<last prompt token> yes" merged; 3 80 = the same token, then " no"
    lp = {(2, 77): -3.0, (2, 3): -1.5, (3, 80): -1.5}
    judge = JudgeClient(
        make_client(
            Gateway(lambda b, h: verdict_answer(yes, no, lambda i, t: lp[(i, t)] if (i, t) in lp else -9.0)), FakeTime()
        ),
        "j",
    )
    assert judge.score("t", "q", "a").score == pytest.approx(0.5)  # -3.0 against -1.5 + -1.5


def test_an_answer_without_prompt_logprobs_is_an_error_naming_the_trajectory_not_a_score() -> None:
    def serve(b, h):
        return httpx.Response(200, json={"choices": [{"index": 0, "text": ""}, {"index": 1, "text": ""}], "usage": {}})

    judge = JudgeClient(make_client(Gateway(serve), FakeTime()), "j")
    judge.enqueue()
    with pytest.raises(JudgeError, match="trajectory s3-p1-g0: .*prompt logprobs"):
        judge.score("s3-p1-g0", "q", "a")
    assert judge.queue.counts() == {"waiting": 0, "judging": 0, "done": 0, "failed": 1}


def test_a_judge_that_refuses_the_request_is_not_retried_or_scored() -> None:
    gw = Gateway(lambda b, h: httpx.Response(404, json={"error": {"message": "The model `j` does not exist."}}))
    with pytest.raises(TurnRefused, match="does not exist"):
        JudgeClient(make_client(gw, FakeTime()), "j").score("t", "q", "a")
    assert len(gw.requests) == 1


def test_a_critique_is_retried_with_another_seed_until_its_score_can_be_read() -> None:
    texts = iter(["fine work, no score", "Score: eleven", "Good.\nScore: 7"])
    gw = Gateway(lambda b, h: critique_answer(next(texts)))
    judge = JudgeClient(make_client(gw, FakeTime()), "j", mode=Mode.CRITIQUE, attempts=3, max_tokens=32)
    judge.enqueue()
    v = judge.score("s2-p0-g1", "2 + 3 =", "5")
    assert (v.score, v.requests, v.text, v.mode) == (0.7, 3, "Good.\nScore: 7", Mode.CRITIQUE)
    seeds = [b["seed"] for _, b, _ in gw.requests]
    assert len(set(seeds)) == 3 and all(
        b["max_tokens"] == 32 and "structured_outputs" not in b for _, b, _ in gw.requests
    )
    assert judge.queue.counts() == {"waiting": 0, "judging": 0, "done": 1, "failed": 2}
    # the same trajectory asks the same requests again (a re-sent request is the same one)
    again = Gateway(lambda b, h: critique_answer("Score: 3"))
    JudgeClient(make_client(again, FakeTime()), "j", mode=Mode.CRITIQUE).score("s2-p0-g1", "2 + 3 =", "5")
    assert again.requests[0][1]["seed"] == seeds[0]


def test_a_critique_never_scored_is_an_error_with_the_trajectorys_id_never_a_zero() -> None:
    gw = Gateway(lambda b, h: critique_answer("I cannot say."))
    judge = JudgeClient(make_client(gw, FakeTime()), "j", mode=Mode.CRITIQUE, attempts=2)
    judge.enqueue()
    with pytest.raises(VerdictUnparsed, match="trajectory s9-p3-g2: no score could be read in 2 critique") as err:
        judge.score("s9-p3-g2", "q", "a")
    assert err.value.trajectory == "s9-p3-g2" and len(gw.requests) == 2
    assert judge.queue.counts() == {"waiting": 0, "judging": 0, "done": 0, "failed": 2}


def test_a_constrained_critique_asks_for_a_regex_that_ends_in_a_score_line() -> None:
    gw = Gateway(lambda b, h: critique_answer("ok\nScore: 10"))
    v = JudgeClient(make_client(gw, FakeTime()), "j", mode=Mode.CRITIQUE, constrained=True, scale=10).score(
        "t", "q", "a"
    )
    assert v.score == 1.0 and gw.requests[0][1]["structured_outputs"] == {"regex": score_regex(10, 64)}


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"attempts": 0}, "at least 1"), ({"scale": 0}, "at least 1"), ({"candidates": (" y", " y")}, "must differ")],
)
def test_bad_settings_are_refused_by_name(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        JudgeClient(make_client(Gateway(), FakeTime()), "j", **kw)


# -- the parsing, on any input --------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 20), st.integers(0, 20), st.from_regex(r"[A-Za-z ,.]{0,40}", fullmatch=True))
def test_every_answer_the_constraint_allows_has_a_score_that_parses(scale, n, prefix) -> None:
    import re

    n = min(n, scale)
    text = f"{prefix}\nScore: {n}"
    if re.fullmatch(score_regex(scale, 64), text):
        assert parse_score(text, scale) == n
    assert re.fullmatch(score_regex(scale, 64), f"\nScore: {scale}")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.integers(1, 100))
def test_parse_score_reads_the_last_score_in_range_or_nothing(text, scale) -> None:
    value = parse_score(text, scale)
    assert value is None or 0 <= value <= scale


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSONISH)
def test_any_malformed_answer_is_a_judge_error_never_a_score_or_a_crash(doc) -> None:
    gw = Gateway(lambda b, h: httpx.Response(200, json={"choices": doc, "usage": {}}))
    try:
        v = JudgeClient(make_client(gw, FakeTime()), "j").score("t", "q", "a")
    except JudgeError:
        return
    assert 0.0 <= v.score <= 1.0  # a document that happens to be well formed


@given(
    st.floats(allow_nan=False, max_value=0.0) | st.just(-math.inf),
    st.floats(allow_nan=False, max_value=0.0) | st.just(-math.inf),
)
def test_p_first_is_a_probability_and_symmetric(a, b) -> None:
    p = p_first(a, b)
    assert 0.0 <= p <= 1.0 and p + p_first(b, a) == pytest.approx(1.0)


def test_candidate_logprobs_refuses_candidates_that_are_the_start_of_each_other() -> None:
    choices = verdict_answer([1, 2, 3], [1, 2, 3, 4]).json()["choices"]
    with pytest.raises(ValueError, match="start of the other"):
        candidate_logprobs(choices)


def test_the_queue_counts_are_one_snapshot() -> None:
    q = Queue()
    q.add(waiting=3)
    q.add(waiting=-1, judging=1)
    assert q.counts() == {"waiting": 2, "judging": 1, "done": 0, "failed": 0}
