"""`python -m pearlctl.daemon.supervise -- ARGV...`: keep a run's daemon up.

The daemon must come back after a crash, and the head node often has no systemd for users. This is the
smallest supervisor that does the job, and the one both ``pearlctl daemon RUN --supervise`` (a detached
process on the head node) and ``pearlctl daemon RUN --slurm`` (inside the daemon's Slurm job, which is
also ``--requeue``: a lost node brings the job back) run:

- it runs ARGV (``python -m pearlctl daemon RUN --foreground ...``) as a child, and runs it again whenever
  it exits with anything but 0, after a back-off (0.5 s, doubling to 10 s; reset after a minute up). A
  restarted daemon takes the lease at once (a dead holder on the same host is broken, not waited out:
  pearlctl.daemon.main) and converges from state and the agents' next heartbeats;
- exit 0 means the daemon stopped on purpose (SIGTERM, the run is over): the supervisor exits 0 too;
- SIGTERM or SIGINT to the supervisor is passed to the daemon, which stops cleanly; then it exits;
- exit 5 (another daemon holds the lease) is not a crash: the supervisor stands by, retrying every
  10 s, so it takes over when that daemon is gone.

It never touches state and never kills workers. Where systemd user units exist, the same job is
``pearlctl daemon RUN --systemd-unit`` (a unit with ``Restart=on-failure``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

EXIT_CONFLICT = 5  # pearlctl.cli.common: another daemon holds the lease
BACKOFF_MIN_S, BACKOFF_MAX_S, STEADY_S, STANDBY_S = 0.5, 10.0, 60.0, 10.0


def _log(event: str, **data) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "supervisor": event, **data}), file=sys.stderr, flush=True)


def supervise(argv: list[str], *, sleep=time.sleep, stopping: threading.Event | None = None) -> int:
    stopping = stopping or threading.Event()
    child: list[subprocess.Popen] = []

    def forward(signum, frame):
        stopping.set()
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
        # Slurm's early warning (--signal=B:USR2@T, forwarded by jobs/worker.sh) means "the job may end
        # soon", not "stop": the daemon keeps serving until TERM. Ignored here, and by the daemon (inherited).
        previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        return _run(argv, child, sleep, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(argv: list[str], child: list[subprocess.Popen], sleep, stopping: threading.Event) -> int:
    backoff, restarts = BACKOFF_MIN_S, 0
    while not stopping.is_set():
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        child[:] = [proc]
        _log("started", pid=proc.pid, restarts=restarts)
        rc = proc.wait()
        if rc == 0 or stopping.is_set():
            _log("stopped", rc=rc)
            return 0
        up = time.monotonic() - started
        if up > STEADY_S:
            backoff = BACKOFF_MIN_S
        standby = rc == EXIT_CONFLICT
        wait = STANDBY_S if standby else backoff
        _log("daemon exited", rc=rc, up_s=round(up, 3), restart_in_s=wait)
        sleep(wait)
        backoff = BACKOFF_MIN_S if standby else min(BACKOFF_MAX_S, backoff * 2)
        restarts += 1
    return 0


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m pearlctl.daemon.supervise -- ARGV...", file=sys.stderr)
        return 2
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
