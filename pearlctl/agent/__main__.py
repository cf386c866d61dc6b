"""`python -m pearlctl.agent`: the per-node agent process started by jobs/worker.sh.

Logs one JSON line per event on stdout (the task's log): ``start`` with its identity, ``drain`` when
the preemption signal arrives (with the seconds it took to drain), ``stop`` on SIGTERM/SIGINT.
It exits 0 on SIGTERM so a clean stop is told apart from a crash.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from pearlctl.agent.identity import identity_from_env


def _log(event: str, **data) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "event": event, **data}), flush=True)


def main() -> int:
    me = identity_from_env()
    preempt_sig = getattr(signal, "SIG" + os.environ.get("PEARL_PREEMPT_SIGNAL", "USR2"))
    state = {"draining": False, "stop": False}

    def on_preempt(signum, frame):
        if not state["draining"]:
            state["draining"] = True
            t0 = time.monotonic()
            # No engine runs yet in this agent: draining is immediate. With engines, this is where
            # workers are removed from the router and their in-flight requests finish or move.
            _log("drain", reason="preemption notice", drain_s=round(time.monotonic() - t0, 6))

    def on_stop(signum, frame):
        # Slurm (and the local backend) signal the whole process group, and worker.sh forwards the
        # same signal again: ignore repeats so a clean stop is not turned into death by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        state["stop"] = True

    signal.signal(preempt_sig, on_preempt)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    _log("start", **me.as_dict(), pid=os.getpid())
    while not state["stop"]:
        signal.pause() if hasattr(signal, "pause") else time.sleep(1)
    _log("stop", draining=state["draining"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
