"""Child processes that must not outlive the process that started them: the one death-signal setup every
starter shares (the agent's engines and commands, the router's vllm-router).

``die_with_parent(signum)`` is a ``preexec_fn`` for ``subprocess.Popen``. Between fork and exec the child asks
the kernel (Linux ``PR_SET_PDEATHSIG``) for ``signum`` when the *thread* that forked it exits, and sends the
signal to itself at once if that parent is already gone (it died between the fork and the request). ``prctl``
is resolved in the parent: the child only calls it (the child of a busy process gets little CPU, and a start
may be on a borrow's critical path). ``then`` runs in the child after it (the agent's: ignore the pool's
preemption signal). Elsewhere than Linux there is no death signal: the result is ``then`` alone.

``process_alive(pid)``: whether a process runs (and is not a zombie), for the records that name a process by pid
(the daemon's address file, the node weight store's pins and agents).

The signal is the caller's, with its reason: SIGTERM where the child shuts its own children down on it (vLLM's
API server stops its engine core), SIGKILL where nothing it runs needs a clean exit (a command's process group,
vllm-router).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: signal.Signals, *, then: Callable[[], None] | None = None) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return then
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the request
            os.kill(os.getpid(), signum)
        if then is not None:
            then()

    return preexec


def process_alive(pid: int) -> bool:
    """Running and not a zombie (a child that exited and was not reaped yet is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
