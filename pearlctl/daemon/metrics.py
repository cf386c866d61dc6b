"""Prometheus metrics of a run, read from state at scrape time (so they can never drift from it).

Served by the daemon at ``GET /metrics`` (authenticated like every route: scrape with a bearer token).

- ``pearl_gpus{role,state,borrowed}``: GPUs by role
- ``pearl_transitions_total{kind,state}`` and ``pearl_transition_seconds{kind}`` (completed ones)
- ``pearl_return_deadline_misses_total`` / ``pearl_return_deadlines_met_total``
- ``pearl_rollout_tokens_total``, ``pearl_rollout_tokens_per_second``, ``pearl_rollout_episodes{state}``
- ``pearl_workers{role,state}``
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pearlctl.state.store import Store

BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class RunCollector:
    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id

    def collect(self):
        run = self.store.get_run(self.run_id)
        gpus = GaugeMetricFamily(
            "pearl_gpus", "GPUs of the run by role and state", labels=["role", "state", "borrowed"]
        )
        for (role, state, borrowed), n in Counter(
            (g["role"], g["state"], str(bool(g["borrowed"])).lower()) for g in self.store.gpus(self.run_id)
        ).items():
            gpus.add_metric([role, state, borrowed], n)
        yield gpus
        workers = GaugeMetricFamily("pearl_workers", "workers by role and state", labels=["role", "state"])
        for (role, state), n in Counter((w["role"], w["state"]) for w in self.store.workers(self.run_id)).items():
            workers.add_metric([role, state], n)
        yield workers
        transitions = self.store.transitions(self.run_id)
        total = CounterMetricFamily("pearl_transitions", "role transitions by kind and state", labels=["kind", "state"])
        for (kind, state), n in Counter((t["kind"], t["state"]) for t in transitions).items():
            total.add_metric([kind, state], n)
        yield total
        for kind in ("borrow", "return"):
            done = [
                t["updated_at"] - t["created_at"] for t in transitions if t["kind"] == kind and t["state"] == "DONE"
            ]
            buckets = [(str(b), sum(1 for d in done if d <= b)) for b in BUCKETS] + [("+Inf", len(done))]
            hist = HistogramMetricFamily(
                "pearl_transition_seconds", "duration of completed transitions", labels=["kind"]
            )
            hist.add_metric([kind], buckets, sum(done))
            yield hist
        events = Counter(j["event"] for j in self.store.journal(self.run_id) if j["entity"] == "transitions")
        yield CounterMetricFamily(
            "pearl_return_deadline_misses",
            "returns that finished after their deadline",
            value=events["deadline missed"],
        )
        yield CounterMetricFamily(
            "pearl_return_deadlines_met", "returns that finished in time", value=events["deadline met"]
        )
        rollout = run.get("rollout") or {}
        yield GaugeMetricFamily(
            "pearl_rollout_tokens_total", "tokens generated (rollout driver's count)", value=rollout.get("tokens") or 0
        )
        yield GaugeMetricFamily(
            "pearl_rollout_tokens_per_second", "rollout decode throughput", value=rollout.get("tokens_per_s") or 0
        )
        episodes = GaugeMetricFamily("pearl_rollout_episodes", "episodes by state", labels=["state"])
        for state in ("queued", "generating", "tool_wait", "done"):
            episodes.add_metric([state], rollout.get(state) or 0)
        yield episodes


def render(store: Store, run_id: str) -> bytes:
    registry = CollectorRegistry()
    registry.register(RunCollector(store, run_id))
    return generate_latest(registry)
