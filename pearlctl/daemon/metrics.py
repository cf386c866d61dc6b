"""Prometheus metrics of a run, read from state at scrape time (so they can never drift from it).

Served by the daemon at ``GET /metrics`` (authenticated like every route: scrape with a bearer token).

- ``pearl_gpus{role,state,borrowed}``: GPUs by role
- ``pearl_transitions_total{kind,state}`` and ``pearl_transition_seconds{kind}`` (completed ones)
- ``pearl_return_deadline_misses_total`` / ``pearl_return_deadlines_met_total``
- ``pearl_rollout_tokens_total``, ``pearl_rollout_tokens_per_second``, ``pearl_rollout_episodes{state}``
- ``pearl_workers{role,state}``
- ``pearl_daemon_ticks_total``, ``pearl_daemon_tick_errors_total``, ``pearl_daemon_tick_seconds{quantile}``,
  ``pearl_daemon_polls_total``, ``pearl_daemon_poll_errors_total``, ``pearl_daemon_lease_renewals_total``,
  ``pearl_daemon_api_errors_total``, ``pearl_daemon_heartbeats_total{path}``: the daemon's own health (a
  tick or poll that failed is counted and journaled, and the daemon goes on; a heartbeat is answered from
  memory when it repeats its last report to unchanged state, else folded into state)
- ``pearl_daemon_tick_duration_seconds`` and ``pearl_daemon_heartbeat_duration_seconds``: histograms over the
  daemon's life of its control-loop ticks and of the handling of each agent heartbeat (from its arrival to its
  answer, a long poll's hold left out): their p99 is the daemon's reaction time under load;
  ``pearl_daemon_tick_cpu_seconds``: the control loop's thread's CPU time in each tick (a tick much longer than
  its CPU time waited: for the decision lock, the disk, a core — the daemon logs such a tick's phases);
  ``pearl_daemon_commit_duration_seconds``: each commit of state by the daemon (SQLite's COMMIT, which waits for
  the disk with synchronous=FULL)
"""

from __future__ import annotations

from collections import Counter

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pearlctl.planner.model import MoveKind
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.schema import ROLLOUT_PROGRESS
from pearlctl.state.store import Store

BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
# the daemon's own latencies: a tick or a heartbeat's handling, from a millisecond to seconds; fine enough around
# the 100-ms targets that a p99 read from the buckets is within 25 ms of the true one
LATENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0
)  # fmt: skip


def latency_histogram(name: str, documentation: str) -> Histogram:
    """A histogram of the daemon's own latencies, registered nowhere: the run's collector yields it."""
    return Histogram(name, documentation, buckets=LATENCY_BUCKETS, registry=None)


class RunCollector:
    def __init__(self, store: Store, run_id: str, stats=None, controller=None):
        self.store, self.run_id, self.stats, self.controller = store, run_id, stats, controller

    def _daemon(self):
        st = self.stats
        for name, value, text in (
            ("ticks", st.ticks, "control-loop ticks"),
            ("tick_errors", st.tick_errors, "ticks that failed (journaled as 'tick error')"),
            ("polls", st.polls, "Slurm polls folded into state"),
            ("poll_errors", st.poll_errors, "Slurm polls that failed (journaled as 'poll error')"),
            ("lease_renewals", st.lease_renewals, "lease renewals"),
        ):
            yield CounterMetricFamily(f"pearl_daemon_{name}", text, value=value)
        if self.controller is not None:
            yield CounterMetricFamily(
                "pearl_daemon_api_errors", "requests answered 500 (bugs)", value=self.controller.api_errors
            )
            heartbeats = CounterMetricFamily(
                "pearl_daemon_heartbeats",
                "agent heartbeats: answered from memory (the same report to the same state), folded into state,"
                " or refused as invalid (422: a bug; the daemon's log names the field)",
                labels=["path"],
            )
            for path in ("remembered", "folded", "refused"):
                heartbeats.add_metric([path], self.controller.agents.heartbeats[path])
            yield heartbeats
            yield from self.controller.agents.heartbeat_seconds.collect()
        yield from st.tick_duration.collect()
        yield from st.tick_cpu.collect()
        yield from st.commit_duration.collect()
        durations = sorted(st.tick_seconds)
        quantiles = GaugeMetricFamily("pearl_daemon_tick_seconds", "recent tick durations", labels=["quantile"])
        for q in (0.5, 0.99):
            quantiles.add_metric(
                [str(q)], durations[min(len(durations) - 1, int(q * len(durations)))] if durations else 0
            )
        yield quantiles

    def collect(self):
        if self.stats is not None:
            yield from self._daemon()
        run = self.store.runs.get(self.run_id)
        gpus = GaugeMetricFamily(
            "pearl_gpus", "GPUs of the run by role and state", labels=["role", "state", "borrowed"]
        )
        for (role, state, borrowed), n in Counter(
            (g.role, g.state, str(bool(g.borrowed)).lower()) for g in self.store.fleet.gpus(self.run_id)
        ).items():
            gpus.add_metric([role, state, borrowed], n)
        yield gpus
        workers = GaugeMetricFamily("pearl_workers", "workers by role and state", labels=["role", "state"])
        for (role, state), n in Counter((w.role, w.state) for w in self.store.fleet.workers(self.run_id)).items():
            workers.add_metric([role, state], n)
        yield workers
        transitions = self.store.transitions.all(self.run_id)
        total = CounterMetricFamily("pearl_transitions", "role transitions by kind and state", labels=["kind", "state"])
        for (kind, state), n in Counter((t.kind, t.state) for t in transitions).items():
            total.add_metric([kind, state], n)
        yield total
        for kind in (MoveKind.BORROW, MoveKind.RETURN):
            done = [t.updated_at - t.created_at for t in transitions if t.kind == kind and t.state == T.DONE]
            buckets = [(str(b), sum(1 for d in done if d <= b)) for b in BUCKETS] + [("+Inf", len(done))]
            hist = HistogramMetricFamily(
                "pearl_transition_seconds", "duration of completed transitions", labels=["kind"]
            )
            hist.add_metric([kind], buckets, sum(done))
            yield hist
        events = Counter(j["event"] for j in self.store.journal.read(self.run_id) if j["entity"] == "transitions")
        yield CounterMetricFamily(
            "pearl_return_deadline_misses",
            "returns that finished after their deadline",
            value=events["deadline missed"],
        )
        yield CounterMetricFamily(
            "pearl_return_deadlines_met", "returns that finished in time", value=events["deadline met"]
        )
        rollout = run.get(ROLLOUT_PROGRESS) or {}
        yield GaugeMetricFamily(
            "pearl_rollout_tokens_total", "tokens generated (rollout driver's count)", value=rollout.get("tokens") or 0
        )
        yield GaugeMetricFamily(
            "pearl_rollout_tokens_per_second",
            "rollout tokens per second between the driver's last two progress reports",
            value=rollout.get("tokens_per_s") or 0,
        )
        episodes = GaugeMetricFamily("pearl_rollout_episodes", "episodes by state", labels=["state"])
        for state in ("queued", "generating", "tool_wait", "done"):
            episodes.add_metric([state], rollout.get(state) or 0)
        yield episodes
        judge = rollout.get("judge") or {}
        if judge:  # a run whose driver scores with a judge (pearlctl.router.judge)
            queue = GaugeMetricFamily(
                "pearl_judge_trajectories",
                "the judge queue: trajectories waiting for a verdict, being judged, judged; failed: judge answers "
                "without a verdict (each retried)",
                labels=["state"],
            )
            for state in ("waiting", "judging", "done", "failed"):
                queue.add_metric([state], judge.get(state) or 0)
            yield queue
            yield GaugeMetricFamily(
                "pearl_judge_verdicts_per_second",
                "verdicts per second between the driver's last two progress reports",
                value=rollout.get("verdicts_per_s") or 0,
            )


def render(store: Store, run_id: str, stats=None, controller=None) -> bytes:
    """``stats``: the daemon's DaemonStats (pearlctl.daemon.main); ``controller``: for its API error count."""
    registry = CollectorRegistry()
    registry.register(RunCollector(store, run_id, stats, controller))
    return generate_latest(registry)
