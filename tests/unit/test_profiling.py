"""Profiles: the decode-model fit, KV capacity from vLLM metrics, transition costs from the journal, and
the profile file format (round trip, errors that name the key)."""

from __future__ import annotations

import pytest

from pearlctl.ops.profiling import (
    DecodePoint,
    ProfilingError,
    WorkerProbe,
    engine_counters,
    engine_decode,
    fit_decode,
    kv_capacity,
    measure,
)
from pearlctl.planner import profile as profiles
from pearlctl.planner.profile import DecodeModel, Profile, ProfileError, step_costs


def test_fit_recovers_the_decode_model_it_was_measured_from():
    truth = DecodeModel(weights_s=0.004, seq_s=0.0003, kv_s_per_token=2e-7)
    points = [DecodePoint(b, ctx, truth.itl(b, ctx)) for b in (1, 2, 4, 8) for ctx in (64, 512)]
    fit = fit_decode(points)
    assert fit.weights_s == pytest.approx(0.004, rel=1e-6)
    assert fit.seq_s == pytest.approx(0.0003, rel=1e-6)
    assert fit.kv_s_per_token == pytest.approx(2e-7, rel=1e-6)


def test_fit_keeps_coefficients_non_negative():
    # noisy points where plain least squares would give a negative per-token KV term
    points = [
        DecodePoint(1, 32, 0.010),
        DecodePoint(4, 32, 0.012),
        DecodePoint(1, 256, 0.0101),
        DecodePoint(4, 256, 0.0119),
    ]
    fit = fit_decode(points)
    assert fit.weights_s > 0 and fit.seq_s >= 0 and fit.kv_s_per_token == 0


def test_fit_needs_two_batch_sizes():
    # requests sent together that the engine ran one at a time (a loaded machine): said, with what it ran
    with pytest.raises(ProfilingError, match="two batch sizes at least; the engine ran batch 1 only"):
        fit_decode([DecodePoint(1, 32, 0.01), DecodePoint(1, 256, 0.012)])


METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_cpu_blocks="None",num_gpu_blocks="2048"} 1.0
"""


def test_kv_capacity_is_blocks_times_block_size():
    assert kv_capacity(METRICS) == 2048 * 16
    assert kv_capacity("# nothing here\n") is None


def test_step_costs_are_medians_of_done_steps_by_kind():
    def step(kind, seconds, state="DONE"):
        return {"kind": kind, "state": state, "detail": {"started_at": 100.0, "finished_at": 100.0 + seconds}}

    costs = step_costs([step("START", 18), step("START", 20), step("START", 40), step("WAKE", 1.5),
                        step("OFFLOAD", 0.8), step("START", 999, state="FAILED"), step("DRAIN", 3)])  # fmt: skip
    assert costs == pytest.approx({"start_s": 20, "wake_s": 1.5, "offload_s": 0.8})


def test_step_costs_split_the_judges_engine_from_the_policys():
    """A start or a wake is the engine of the role a move goes to, a stop or a sleep the one it leaves; an offload
    and a reload are the trainer's (never the judge's)."""

    def step(kind, seconds, from_role, to_role):
        detail = {"started_at": 0.0, "finished_at": seconds}
        return {"kind": kind, "state": "DONE", "detail": detail, "from_role": from_role, "to_role": to_role}

    steps = [step("STOP", 2, "ROLLOUT", "REWARD"), step("START", 30, "ROLLOUT", "REWARD"),
             step("OFFLOAD", 1, "TRAIN", "REWARD"), step("WAKE", 4, "TRAIN", "REWARD"),
             step("SLEEP", 3, "REWARD", "TRAIN"), step("RELOAD", 1.5, "REWARD", "TRAIN"),
             step("START", 10, "IDLE", "ROLLOUT"), step("STOP", 6, "REWARD", "ROLLOUT")]  # fmt: skip
    assert step_costs(steps, judge=True) == {"start_s": 30, "wake_s": 4, "sleep_s": 3, "stop_s": 6}
    assert step_costs(steps, judge=False) == {"stop_s": 2, "offload_s": 1, "reload_s": 1.5, "start_s": 10}
    assert step_costs(steps)["start_s"] == 20  # both engines' (the median of 30 and 10)


def test_a_start_never_journaled_is_priced_at_the_workers_measured_cold_starts():
    from pearlctl.planner.profile import measured_costs

    stop = {"kind": "STOP", "state": "DONE", "detail": {"started_at": 0.0, "finished_at": 4.0},
            "from_role": "ROLLOUT", "to_role": "REWARD"}  # fmt: skip
    start = {**stop, "kind": "START", "detail": {"started_at": 0.0, "finished_at": 30.0}}
    starts = [60.0, 9.0, 11.0, 10.0, 12.0, 40.0]  # oldest first: the median of the last five is 11
    assert measured_costs([stop], starts, judge=False) == {"stop_s": 4.0, "start_s": 11.0}
    assert measured_costs([stop, start], starts, judge=True) == {"start_s": 30.0}  # the judge's own, journaled
    assert measured_costs([stop], [], judge=False) == {"stop_s": 4.0}  # nothing measured: the profile's stays


def _profile(**kw) -> Profile:
    base = dict(
        name="p",
        model="m",
        hardware="h",
        decode=DecodeModel(
            weights_s=0.005, seq_s=0.0001, kv_s_per_token=1e-7, experts_s=0.0002, moe_experts=128, moe_top_k=8
        ),  # fmt: skip
        prefill_tok_s=20000.0,
        kv_capacity_tokens=300000,
        sources={"decode": "somewhere"},
    )
    return Profile(**(base | kw))


def test_profile_file_round_trips(tmp_path):
    p = _profile()
    path = tmp_path / "p.toml"
    path.write_text(profiles.dumps(p))
    assert profiles.load(path) == p


def test_profile_file_errors_name_the_key_and_the_known_ones(tmp_path):
    text = profiles.dumps(_profile()).replace("kv_capacity_tokens", "kv_tokens")
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=r"unknown key\(s\) kv_tokens; known: .*kv_capacity_tokens"):
        profiles.load(path)
    with pytest.raises(ProfileError, match="prefill_tok_s must be > 0"):
        _profile(prefill_tok_s=0.0)


@pytest.mark.parametrize("field", ["request_overhead_s", "request_serial_s"])
@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf"), "5 ms", None])
def test_a_request_cost_that_is_not_a_finite_number_at_least_0_is_refused_by_name(field, bad):
    doc = profiles.to_dict(_profile())
    doc["profile"][field] = bad
    with pytest.raises(ProfileError, match=rf"{field} must be a finite number >= 0 \(got "):
        profiles.from_dict(doc)


def test_moe_decode_grows_far_less_with_batch_than_dense():
    moe = _profile().decode
    dense = DecodeModel(weights_s=moe.itl(1, 0) - moe.seq_s, seq_s=moe.seq_s, kv_s_per_token=moe.kv_s_per_token)
    assert moe.itl(1, 0) == pytest.approx(dense.itl(1, 0))
    assert moe.tok_s(64, 0) / moe.tok_s(1, 0) < 0.5 * dense.tok_s(64, 0) / dense.tok_s(1, 0)


def _counters_text(itl_sum: float, itl_count: float, tokens: float, steps: float) -> str:
    return f"""# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_sum}
vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {itl_count}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} {tokens * 3}
vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}
"""


def test_engine_decode_is_the_difference_of_the_engines_counters():
    before = engine_counters(_counters_text(1.0, 100, 1000, 400))
    after = engine_counters(_counters_text(1.0 + 0.5, 100 + 100, 1000 + 120, 400 + 40))
    batch, itl = engine_decode(before, after)
    assert batch == pytest.approx(3.0)  # 120 tokens in 40 steps
    assert itl == pytest.approx(0.005)
    assert engine_decode({}, after) is None  # a worker without metrics
    assert engine_decode(after, after) is None  # nothing decoded in between


class _SerialWorker(WorkerProbe):
    """A worker at the probe's seams whose API server takes 30 ms of each request one at a time, so that B
    requests sent together never decode more than 3 at once; the engine's counters say so."""

    SERIAL, OVERHEAD, PREFILL = 0.03, 0.05, 10_000.0
    TRUTH = DecodeModel(weights_s=0.004, seq_s=0.001, kv_s_per_token=0.0)

    def __init__(self):
        super().__init__("http://worker", "m", get=self._metrics)
        self.c = {"itl_sum": 0.0, "itl_count": 0.0, "tokens": 0.0, "steps": 0.0}

    def _metrics(self, path: str) -> str:
        assert path == "/metrics"
        return _counters_text(self.c["itl_sum"], self.c["itl_count"], self.c["tokens"], self.c["steps"])

    def complete(self, prompt_tokens: int, max_tokens: int, *, offset: int = 0) -> float:
        return self.batch(1, prompt_tokens, max_tokens, offset=offset)

    def batch(self, batch: int, prompt_tokens: int, max_tokens: int, *, offset: int) -> float:
        ran = min(batch, 3)
        itl = self.TRUTH.itl(ran, prompt_tokens + max_tokens)
        self.c["tokens"] += batch * max_tokens
        self.c["steps"] += batch * max_tokens / ran
        self.c["itl_count"] += batch * (max_tokens - 1)
        self.c["itl_sum"] += batch * (max_tokens - 1) * itl
        return self.OVERHEAD + (batch - 1) * self.SERIAL + prompt_tokens / self.PREFILL + max_tokens * itl


def test_measure_takes_the_batch_the_engine_ran_and_the_serial_part_of_the_overhead():
    m = measure(_SerialWorker(), batches=(1, 2, 4, 8), contexts=(32, 256), repeats=1)
    assert sorted({round(p.batch, 9) for p in m.decode}) == [1, 2, 3]  # 4 and 8 were asked; 3 ran
    for p in m.decode:
        assert p.itl_s == pytest.approx(_SerialWorker.TRUTH.itl(p.batch, 0))
    fit = fit_decode(m.decode)
    assert fit.seq_s == pytest.approx(0.001, rel=1e-6)
    assert m.request_serial_s == pytest.approx(0.03, rel=0.02)  # and a decode step at batch 3, not 1
    assert m.request_overhead_s == pytest.approx(0.05 + 0.004 + 0.001, rel=1e-6)  # + one decode step


class _LoadedWorker(_SerialWorker):
    """Its host is loaded: the first ``serial`` batches of more than one request reach the engine one after another,
    so it runs them one at a time (batch 1, as its counters say)."""

    def __init__(self, serial: int):
        super().__init__()
        self.serial = serial

    def batch(self, batch: int, prompt_tokens: int, max_tokens: int, *, offset: int) -> float:
        if batch > 1 and self.serial > 0:
            self.serial -= 1
            return sum(super(_LoadedWorker, self).batch(1, prompt_tokens, max_tokens, offset=offset + i)
                       for i in range(batch))  # fmt: skip
        return super().batch(batch, prompt_tokens, max_tokens, offset=offset)


def test_a_batch_the_engine_ran_one_at_a_time_is_sent_again():
    m = measure(_LoadedWorker(serial=2), batches=(1, 2), contexts=(32,), repeats=1)
    assert sorted(p.batch for p in m.decode) == [1, 2]  # sent again until it ran together
    fit_decode(m.decode)  # two batch sizes: the decode model fits
    always = measure(_LoadedWorker(serial=10**6), batches=(1, 2), contexts=(32,), repeats=1)
    assert [p.batch for p in always.decode] == [1, 1]  # a few times at most: then what ran is what is kept
    with pytest.raises(ProfilingError, match="ran batch 1 only"):
        fit_decode(always.decode)


def test_measure_without_engine_metrics_falls_back_to_the_asked_batch():
    probe = _SerialWorker()
    probe._get = lambda path: "# no metrics here\n"
    m = measure(probe, batches=(1, 2, 4), contexts=(32,), repeats=1)
    assert [p.batch for p in m.decode] == [1, 2, 4]


class _CountingWorker(_SerialWorker):
    """Records the output length of every batch it is sent."""

    def __init__(self):
        super().__init__()
        self.lengths: list[int] = []

    def batch(self, batch: int, prompt_tokens: int, max_tokens: int, *, offset: int) -> float:
        self.lengths.append(max_tokens)
        return super().batch(batch, prompt_tokens, max_tokens, offset=offset)


def test_measure_sends_the_short_decode_runs_only_when_the_engine_reports_no_counters():
    with_metrics = _CountingWorker()
    measure(with_metrics, batches=(1, 2), contexts=(32,), tokens=(8, 40), repeats=2)
    assert 8 not in with_metrics.lengths and with_metrics.lengths.count(40) == 4  # 2 batches x 2 repeats

    without = _CountingWorker()
    without._get = lambda path: "# no metrics here\n"
    m = measure(without, batches=(1, 2), contexts=(32,), tokens=(8, 40), repeats=2)
    assert without.lengths.count(8) == without.lengths.count(40) == 4
    for p in m.decode:  # the difference of the two lengths still cancels overhead and prefill
        assert p.itl_s == pytest.approx(_SerialWorker.TRUTH.itl(min(p.batch, 3), p.context - 24), rel=1e-6)
