"""The paced engine (pearlctl/agent/engines/paced.py and its parts) in process, through its HTTP app: tokens that a
continuation reproduces, the profile's pacing (never faster than the model), the batch cap, the prefix cache,
and bad requests answered with a clear 4xx (hypothesis), never a 500. Its vLLM contract is checked against
the real engine in tests/engines/test_engine_contract.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from pearlctl.agent.engines import paced
from pearlctl.agent.engines.paced_batch import PacedEngine
from pearlctl.agent.engines.paced_tokens import Vocab
from pearlctl.agent.engines.vllm_endpoints import parse_metrics
from pearlctl.planner.profile import load
from tests.conftest import REPO, wait_for

PROFILE = Path(__file__).resolve().parents[1] / "data" / "paced-fast.toml"


TINY = Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny"
VOCAB_TINY = Vocab(str(TINY))


def client_for(max_num_seqs: int | None = None, model: str = "tiny") -> TestClient:
    argv = ["--model", model, "--served-model-name", "tiny", "--profile", str(PROFILE), "--port", "1"]
    argv += ["--max-model-len", "512"]
    app, asgi = paced.build(paced.parse_args(argv + (["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else [])))
    app.ready_at = 0.0  # no start delay in process
    return TestClient(asgi)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with client_for() as c:
        yield c
        # a test that failed while the engine was paused leaves requests held, and the client's exit waits for every
        # request in flight: end them (answered "abort") and resume
        c.post("/abort_requests", json={})
        c.post("/resume")


def complete(c: TestClient, prompt, max_tokens: int, **extra) -> dict:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_continuation_from_token_ids_generates_what_the_whole_request_does(client: TestClient) -> None:
    whole = complete(client, "the model calls a tool", 40, return_token_ids=True)["choices"][0]
    first = complete(client, "the model calls a tool", 15, return_token_ids=True)["choices"][0]
    rest = complete(client, first["prompt_token_ids"] + first["token_ids"], 25, return_token_ids=True)["choices"][0]
    assert first["token_ids"] + rest["token_ids"] == whole["token_ids"]
    assert first["text"] + rest["text"] == whole["text"]
    assert len(whole["token_ids"]) == 40 and whole["finish_reason"] == "length"
    assert (
        first["token_ids"] != complete(client, "another prompt", 15, return_token_ids=True)["choices"][0]["token_ids"]
    )


def test_with_the_models_tokenizer_a_continued_turns_text_is_what_the_gateway_mirrors() -> None:
    """With a tokenizer.json in the model directory the engine draws ids from that vocabulary and decodes them as
    vLLM does; the gateway's text for a continued turn (pearlctl/router/text.py) then equals the whole turn's."""
    from tokenizers import Tokenizer

    from pearlctl.router.text import TextMirror

    with client_for(model=str(TINY)) as c:
        whole = complete(c, "the model calls a tool", 60, return_token_ids=True)["choices"][0]
        first = complete(c, "the model calls a tool", 23, return_token_ids=True)["choices"][0]
        rest = complete(c, first["prompt_token_ids"] + first["token_ids"], 37, return_token_ids=True)["choices"][0]
        assert c.get("/v1/models").json()["data"][0]["root"] == str(TINY)
    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert whole["prompt_token_ids"] == tokenizer.encode("the model calls a tool").ids
    assert max(whole["token_ids"]) > 255  # drawn from the model's vocabulary, not bytes
    assert first["token_ids"] + rest["token_ids"] == whole["token_ids"]
    mirror = TextMirror(tokenizer, first["prompt_token_ids"], first["token_ids"], skip_special=True)
    assert first["text"] + mirror.text(rest["token_ids"]) == whole["text"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 2047), min_size=1, max_size=40), states=st.lists(st.integers(0, 2**64 - 1)))
def test_the_text_of_generated_ids_is_what_a_decode_stream_primed_with_the_prompt_gives(prompt, states) -> None:
    """The engine looks up the text of its generated ids after the first (`paced_tokens.Decoder`): each piece equals a
    ``DecodeStream``'s, as vLLM and the gateway decode, whatever bytes the prompt ends in."""
    from tokenizers.decoders import DecodeStream

    vocab = VOCAB_TINY
    ids = [vocab.pick(state) for state in states]
    assert set(ids) <= set(vocab.table)  # generated ids are standalone
    stream = DecodeStream(ids=list(prompt), skip_special_tokens=True)
    assert vocab.decoder(prompt).pieces(ids) == [stream.step(vocab.tokenizer, t) or "" for t in ids]


def test_the_tiny_models_vocabulary_has_enough_standalone_ids_to_generate_from() -> None:
    assert len(VOCAB_TINY.table) > 1500 and len(VOCAB_TINY.ids) == len(VOCAB_TINY.table)
    assert all(t.isprintable() and t for t in VOCAB_TINY.table.values())


def test_a_stream_carries_the_same_tokens_as_the_whole_answer(client: TestClient) -> None:
    whole = complete(client, "stream me", 30, return_token_ids=True, logprobs=1)["choices"][0]
    ids, text, lps, finish, usage = [], "", [], None, None
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 30, "stream": True, "return_token_ids": True}
    body |= {"logprobs": 1, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        obj = json.loads(e)
        if obj["choices"]:
            ch = obj["choices"][0]
            ids += ch["token_ids"]
            text += ch["text"]
            lps += ch["logprobs"]["token_logprobs"]
            finish = ch["finish_reason"] or finish
        else:
            usage = obj["usage"]
    assert ids == whole["token_ids"] and text == whole["text"] and lps == whole["logprobs"]["token_logprobs"]
    assert finish == "length" and usage["completion_tokens"] == 30


def test_a_reload_changes_the_tokens_and_reloading_the_first_weights_restores_them(client: TestClient) -> None:
    base = complete(client, "weights", 20)["choices"][0]["text"]
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": "/store/v2"}}
    assert client.post("/collective_rpc", json=rpc).status_code == 200
    changed = complete(client, "weights", 20)["choices"][0]["text"]
    rpc["kwargs"]["weights_path"] = "tiny"
    assert client.post("/collective_rpc", json=rpc).status_code == 200
    assert changed != base and complete(client, "weights", 20)["choices"][0]["text"] == base


def test_a_batch_takes_at_least_what_the_profile_says(client: TestClient) -> None:
    """Paced by the profile: B requests of N tokens take N iterations of itl(B) at least (a loaded machine may
    add to it, never take from it), and not many times more."""
    profile = load(PROFILE)
    n, tokens = 8, 200
    done: list[dict] = []

    def one(i: int) -> None:
        done.append(complete(client, f"request {i}", tokens))

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    assert len(done) == n
    floor = tokens * profile.decode.itl(1, 0)  # even alone, a request takes this long
    model = tokens * profile.decode.itl(n, 10 + tokens / 2)
    assert elapsed >= floor, (elapsed, floor)
    assert elapsed < 4 * model + 2.0, (elapsed, model)


def test_a_loop_that_wakes_late_past_a_sequences_end_loses_no_model_time() -> None:
    """A loaded host wakes the engine's loop late; the time it slept past a sequence's end still decodes the rest at
    the smaller batch's pace. A request of 600 tokens next to one of 5, the loop held 1.5 s in its first wait
    between tokens, ends when the profile says (5 iterations of two, 595 of one), not 1.5 s later. Measured by the
    engine's own end time, not when this test looks; a busy machine may wake the loop late again by up to 0.75 s."""
    profile = load(PROFILE)

    async def main() -> float:
        engine = PacedEngine(profile, max_num_seqs=8, max_model_len=4096, weights="w", vocab=Vocab("-"))
        pace, held = engine._pace, []

        async def held_once(seconds: float) -> None:  # the host is busy elsewhere while the engine waits
            if not held:
                held.append(seconds)
                time.sleep(1.5)
            await pace(seconds)

        engine._pace = held_once
        task = asyncio.get_running_loop().create_task(engine.run())
        engine.submit("short", [1, 2, 3], 5)
        long = engine.submit("long", [4, 5, 6], 600)
        while long.ended is None:
            await asyncio.sleep(0.01)
        task.cancel()
        return long.ended - long.arrived

    took = asyncio.run(main())
    model = 5 * profile.decode.itl(2, 304) + 595 * profile.decode.itl(1, 304)
    assert model > 1.5 + 0.5  # the hold ends well before the model does
    assert model <= took < model + 0.75, (took, model)


def test_the_running_batch_is_capped_and_the_rest_wait() -> None:
    with client_for(max_num_seqs=2) as c:
        c.post("/pause", params={"mode": "keep"})
        threads = [threading.Thread(target=complete, args=(c, f"capped {i}", 50)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while parse_metrics(c.get("/metrics").text)["num_requests_waiting"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        c.post("/resume")
        m = wait_for(lambda: (m := parse_metrics(c.get("/metrics").text))["num_requests_running"] and m, 10, every=0.01)
        assert m["num_requests_running"] == 2 and m["num_requests_waiting"] == 2, m
        for t in threads:
            t.join(30)
        m = parse_metrics(c.get("/metrics").text)
        assert m["num_requests_running"] == 0 and m["generation_tokens_total"] == 200


def test_a_next_turn_finds_the_previous_turns_tokens_in_the_prefix_cache(client: TestClient) -> None:
    first = complete(client, "turn one of a session", 30, return_token_ids=True)["choices"][0]
    before = client.get("/metrics").text
    complete(client, first["prompt_token_ids"] + first["token_ids"] + list(b" tool output"), 10)
    after = client.get("/metrics").text

    def counter(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    hits = counter(after, "vllm:prefix_cache_hits_total") - counter(before, "vllm:prefix_cache_hits_total")
    assert hits == len(first["prompt_token_ids"]) + 30


def test_pause_wait_finishes_what_runs_and_holds_what_arrives(client: TestClient) -> None:
    box: list[dict] = []
    t = threading.Thread(target=lambda: box.append(complete(client, "running", 400)))
    t.start()

    def running() -> bool:  # admitted and decoding (not a fixed sleep: on a busy machine it may not even be sent)
        m = parse_metrics(client.get("/metrics").text)
        return m["num_requests_running"] == 1 or m["generation_tokens_total"] > 0

    wait_for(running, 30, every=0.02)
    assert client.post("/pause", params={"mode": "wait"}).status_code == 200  # returns once it finished:
    assert parse_metrics(client.get("/metrics").text)["generation_tokens_total"] == 400  # all its tokens
    t.join(30)  # (its answer reaches the client's thread a moment later on a busy machine)
    assert box and box[0]["choices"][0]["finish_reason"] == "length"
    late: list[dict] = []
    t2 = threading.Thread(target=lambda: late.append(complete(client, "late", 5)))
    t2.start()
    wait_for(lambda: client.get("/load").json()["server_load"] == 1, 30, every=0.02)  # arrived, and held
    time.sleep(0.2)
    assert not late and client.get("/is_paused").json() == {"is_paused": True}
    assert client.get("/load").json()["server_load"] == 1
    client.post("/resume")
    t2.join(10)
    assert late and late[0]["usage"]["completion_tokens"] == 5


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 600) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["tiny", "other", 3]),
        "prompt": json_values,
        "messages": json_values,
        "max_tokens": json_values,
        "stream": json_values,
        "logprobs": json_values,
        "n": json_values,
        "return_token_ids": json_values,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies | json_values, kind=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_request_body_gets_an_answer_or_a_clear_4xx(client: TestClient, body, kind: str) -> None:
    r = client.post(kind, json=body)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # the engine lives on


def test_pause_wait_on_a_paused_engine_returns_at_once_and_keeps_what_it_holds(client: TestClient) -> None:
    client.post("/pause", params={"mode": "keep"})
    box: list[dict] = []
    t = threading.Thread(target=lambda: box.append(complete(client, "held", 5)))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert client.post("/pause", params={"mode": "wait"}).status_code == 200
    assert time.monotonic() - t0 < 2.0 and not box  # nothing runs while paused: nothing to wait for
    client.post("/resume")
    t.join(10)
    assert box and box[0]["usage"]["completion_tokens"] == 5


def test_the_start_is_counted_from_the_process_exec():
    # an engine's own boot is part of its profile's start_s: process_age is the time since this process began
    code = "import time; time.sleep(0.6); from pearlctl.agent.engines.paced import process_age; print(process_age())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert 0.6 <= float(out.stdout) < 30


def test_a_prefill_that_wakes_late_hands_the_time_to_the_decode_after_it() -> None:
    """The loop held 1.5 s in a prefill: the request still ends when the profile says (its prefill, then 600
    iterations), not 1.5 s later; measured by the engine's own end time."""
    profile = load(PROFILE)

    async def main() -> float:
        engine = PacedEngine(profile, max_num_seqs=8, max_model_len=4096, weights="w", vocab=Vocab("-"))
        real_sleep, held = asyncio.sleep, []

        async def held_once(seconds: float) -> None:  # only the engine's prefill sleeps through asyncio.sleep here
            if not held:
                held.append(seconds)
                time.sleep(1.5)
            await real_sleep(seconds)

        task = asyncio.get_running_loop().create_task(engine.run())
        with mock.patch("pearlctl.agent.engines.paced_batch.asyncio.sleep", held_once):
            long = engine.submit("long", list(range(1, 2001)), 600)
            while long.ended is None:
                await real_sleep(0.01)
        task.cancel()
        return long.ended - long.arrived

    took = asyncio.run(main())
    model = 2000 / profile.prefill_tok_s + 600 * profile.decode.itl(1, 2300)
    assert model > 1.5 + 0.5
    assert model <= took < model + 0.75, (took, model)
