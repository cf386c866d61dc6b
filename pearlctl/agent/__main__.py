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


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    me = identity_from_env()
    run_dir = os.environ.get("PEARL_RUN_DIR", ".")
    preempt_sig = getattr(signal, "SIG" + os.environ.get("PEARL_PREEMPT_SIGNAL", "USR2"))
    grace_s = float(os.environ.get("PEARL_DRAIN_TIMEOUT_S", "8"))
    stop = threading.Event()
    draining = threading.Event()
    wake = threading.Event()  # cuts the heartbeat wait short when a signal arrives

    def on_preempt(signum, frame):
        draining.set()
        wake.set()

    def on_stop(signum, frame):
        # Slurm (and the local backend) signal the whole process group, and worker.sh forwards the
        # same signal again: ignore repeats so a clean stop is not turned into death by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        wake.set()

    signal.signal(preempt_sig, on_preempt)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    _log("start", **me.as_dict(), pid=os.getpid())

    client = DaemonClient(me, run_dir)
    workers = Reconciler(me, run_dir, drain_timeout=grace_s)
    interval, reachable = HEARTBEAT_S, None  # until the daemon says
    drain_started: float | None = None
    drained = False
    last_sent: list[dict] | None = None
    last_sent_at = 0.0

    def watch_returns() -> None:
        """The return guarantee without the daemon: once the daemon has been out of reach (or stuck) for
        a loss window, a lent GPU whose return must start within that window is returned here, whatever
        the main loop is blocked on (a heartbeat to a frozen daemon waits for its timeout)."""
        while not stop.wait(RETURN_WATCH_S):
            window = max(LOSS_WINDOW * interval, MIN_LOSS_WINDOW_S) + 1.0
            if client.contact_age() > window:
                # start one window before return_by: noticing the daemon's absence took that long
                for key in workers.return_lent(early_s=window):
                    _log("self return", worker=key, contact_age_s=round(client.contact_age(), 3))
                    wake.set()

    threading.Thread(target=watch_returns, name="return-watch", daemon=True).start()
    while not stop.is_set():
        if draining.is_set() and drain_started is None:
            # a preemption notice: drain in the background and keep reporting, so the daemon takes the
            # workers out of the router now and never mistakes a draining agent for a lost one
            drain_started = time.monotonic()
            workers.retire_all()
            _log("drain", reason="preemption notice", timeout_s=grace_s)
        workers.catch_up()  # a worker READY since the last answer loads the weights it was asked for
        report = workers.report()
        # a weight reload in flight: watched closely too, so that its end (the new version) is told at once
        settled = all(w["state"] in ("READY", "SLEEPING", "STOPPED") for w in report) and not workers.reloading()
        returns = workers.take_self_returns()
        if not returns and not settled and report == last_sent and time.monotonic() - last_sent_at < interval:
            # a worker is starting, draining or reloading: watch it closely, but tell the daemon only what changed
            wake.wait(POLL_UNSETTLED_S)
            wake.clear()
            continue
        # settled: long poll, the daemon answers as soon as this allocation's desired state moves
        answer = client.heartbeat(
            report,
            draining=draining.is_set(),
            wait_s=interval if settled and not draining.is_set() else 0.0,
            self_returns=returns,
        )
        last_sent, last_sent_at = report, time.monotonic()
        if answer is None:
            workers.put_back_self_returns(returns)  # not delivered: report them next time
            if reachable is not False:
                _log("daemon unreachable", workers=len(workers.workers))
            reachable = False
            wake.wait(interval)  # keep the workers; try again (the daemon may be restarting)
        else:
            workers.delivered(report)
            if reachable is not True:
                _log("registered", allocation_id=client.allocation_id, epoch=client.epoch_seen)
            reachable = True
            interval = float(answer.get("heartbeat_s", interval))
            if not draining.is_set():
                workers.apply(answer.get("desired", []))
            elif drain_started is not None and not drained and workers.settled():
                _log("drained", drain_s=round(time.monotonic() - drain_started, 3))
                drained = True  # logged once
        wake.clear()
    seconds = workers.stop_all(grace_s)
    workers.clear_weight_store()
    client.heartbeat(workers.report(), leaving=True)
    _log("stop", draining=draining.is_set(), stop_s=round(seconds, 3))
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
