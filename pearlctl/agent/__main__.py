"""`python -m pearlctl.agent`: the per-node agent process started by jobs/worker.sh.

It registers with the run's daemon, heartbeats every interval with the workers it runs, and
reconciles its engine processes to the desired state each answer carries. While the daemon is
unreachable it keeps its workers running and keeps trying (a daemon restart kills no worker) — with one
exception that makes the return guarantee independent of the daemon: a worker on lent trainer GPUs
whose return must start (the ``return_by`` its desired state carries) while no daemon in control has
answered for a loss window is stopped here, and the trainer on this node learns it from a node-local
file (``PEARL_RETURN_FILE``) and reclaims; the daemon is told at the next heartbeat that reaches it.
On the preemption signal it drains and stops its workers within the pool's notice
(``PEARL_DRAIN_TIMEOUT_S``) in the background, reporting all along (``draining``: the daemon takes the
workers out of the router at once); on SIGTERM it stops them too (workers never outlive the
allocation), says it is leaving, and exits 0.

It logs one JSON line per event on stdout (the task's log): ``start``, ``registered``,
``daemon unreachable``, ``self return``, ``drain``, ``drained`` (with seconds), ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from pearlctl.agent.client import DaemonClient
from pearlctl.agent.identity import identity_from_env
from pearlctl.agent.reconciler import Reconciler
from pearlctl.api.bodies import MIN_LOSS_WINDOW_S
from pearlctl.vocabulary import HEARTBEAT_S

POLL_UNSETTLED_S = 0.05  # how often a starting or draining worker is probed (READY is noticed this fast)
RETURN_WATCH_S = 0.5  # how often the return watchdog looks at lent GPUs' deadlines
LOSS_WINDOW = 2.0  # heartbeat intervals without a daemon in control before the agent returns lent GPUs itself


def _log(event: str, **data) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "event": event, **data}), flush=True)


class Signals:
    """What the agent's signal handlers tell its loop: stop (SIGTERM, SIGINT), drain (the preemption signal), and
    ``wake``, which cuts the loop's wait short when either arrives."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.draining = threading.Event()
        self.wake = threading.Event()

    def install(self, preempt_sig: int) -> None:
        def on_preempt(signum, frame):
            self.draining.set()
            self.wake.set()

        def on_stop(signum, frame):
            # Slurm (and the local backend) signal the whole process group, and worker.sh forwards the
            # same signal again: ignore repeats so a clean stop is not turned into death by signal.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self.stop.set()
            self.wake.set()

        signal.signal(preempt_sig, on_preempt)
        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)


class Agent:
    """The agent's loop: report the workers to the daemon, apply its answers, drain on a preemption notice, and
    (`watch_returns`, in a thread of its own) return lent GPUs while the daemon is out of reach."""

    def __init__(self, client: DaemonClient, workers: Reconciler, signals: Signals, grace_s: float):
        self.client, self.workers, self.signals, self.grace_s = client, workers, signals, grace_s
        self.interval, self.reachable = HEARTBEAT_S, None  # until the daemon says
        self.drain_started: float | None = None
        self.drained = False
        self.last_sent: list[dict] | None = None
        self.last_sent_at = 0.0

    def watch_returns(self) -> None:
        """The return guarantee without the daemon: once the daemon has been out of reach (or stuck) for
        a loss window, a lent GPU whose return must start within that window is returned here, whatever
        the main loop is blocked on (a heartbeat to a frozen daemon waits for its timeout)."""
        client, workers = self.client, self.workers
        while not self.signals.stop.wait(RETURN_WATCH_S):
            window = max(LOSS_WINDOW * self.interval, MIN_LOSS_WINDOW_S) + 1.0
            if client.contact_age() > window:
                # start one window before return_by: noticing the daemon's absence took that long
                for key in workers.return_lent(early_s=window):
                    _log("self return", worker=key, contact_age_s=round(client.contact_age(), 3))
                    self.signals.wake.set()

    def run(self) -> None:
        while not self.signals.stop.is_set():
            self.step()

    def step(self) -> None:
        """One turn of the loop: a heartbeat when there is something to say (or the interval is up), else a short
        wait while a worker is starting, draining or reloading."""
        workers, draining, wake = self.workers, self.signals.draining, self.signals.wake
        if draining.is_set() and self.drain_started is None:
            # a preemption notice: drain in the background and keep reporting, so the daemon takes the
            # workers out of the router now and never mistakes a draining agent for a lost one
            self.drain_started = time.monotonic()
            workers.retire_all()
            _log("drain", reason="preemption notice", timeout_s=self.grace_s)
        workers.catch_up()  # a worker READY since the last answer loads the weights it was asked for
        report = workers.report()
        # a weight reload in flight: watched closely too, so that its end (the new version) is told at once
        settled = all(w["state"] in ("READY", "SLEEPING", "STOPPED") for w in report) and not workers.reloading()
        returns = workers.take_self_returns()
        if (
            not returns
            and not settled
            and report == self.last_sent
            and time.monotonic() - self.last_sent_at < self.interval
        ):
            # a worker is starting, draining or reloading: watch it closely, but tell the daemon only what changed
            wake.wait(POLL_UNSETTLED_S)
            wake.clear()
            return
        # settled: long poll, the daemon answers as soon as this allocation's desired state moves
        answer = self.client.heartbeat(
            report,
            draining=draining.is_set(),
            wait_s=self.interval if settled and not draining.is_set() else 0.0,
            self_returns=returns,
        )
        self.last_sent, self.last_sent_at = report, time.monotonic()
        if answer is None:
            workers.put_back_self_returns(returns)  # not delivered: report them next time
            if self.reachable is not False:
                _log("daemon unreachable", workers=len(workers.workers))
            self.reachable = False
            wake.wait(self.interval)  # keep the workers; try again (the daemon may be restarting)
        else:
            self.answered(answer, report)
        wake.clear()

    def answered(self, answer: dict, report: list[dict]) -> None:
        """The daemon has this report and answered: apply its desired state (or, draining, note the drain's end)."""
        workers = self.workers
        workers.delivered(report)
        if self.reachable is not True:
            _log("registered", allocation_id=self.client.allocation_id, epoch=self.client.epoch_seen)
        self.reachable = True
        self.interval = float(answer.get("heartbeat_s", self.interval))
        if not self.signals.draining.is_set():
            workers.apply(answer.get("desired", []))
        elif self.drain_started is not None and not self.drained and workers.settled():
            _log("drained", drain_s=round(time.monotonic() - self.drain_started, 3))
            self.drained = True  # logged once

    def leave(self) -> None:
        """Stop every worker (they never outlive the allocation), free the node's weight store, say goodbye."""
        workers = self.workers
        seconds = workers.stop_all(self.grace_s)
        workers.leave_store()
        self.client.heartbeat(workers.report(), leaving=True)
        _log("stop", draining=self.signals.draining.is_set(), stop_s=round(seconds, 3))
        self.client.close()


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    me = identity_from_env()
    run_dir = os.environ.get("PEARL_RUN_DIR", ".")
    preempt_sig = getattr(signal, "SIG" + os.environ.get("PEARL_PREEMPT_SIGNAL", "USR2"))
    grace_s = float(os.environ.get("PEARL_DRAIN_TIMEOUT_S", "8"))
    signals = Signals()
    signals.install(preempt_sig)
    _log("start", **me.as_dict(), pid=os.getpid())

    agent = Agent(DaemonClient(me, run_dir), Reconciler(me, run_dir, drain_timeout=grace_s), signals, grace_s)
    agent.workers.join_store()  # the node's weight store, and the models it keeps local (the judge) copied ahead
    threading.Thread(target=agent.watch_returns, name="return-watch", daemon=True).start()
    agent.run()
    agent.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
