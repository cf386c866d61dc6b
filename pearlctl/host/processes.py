"""Processes this host started or names by pid: the one place for the rules every starter and every stopper
shares (the agent's engines and commands, the router's gateway and vllm-router, the local backend's tasks, the
records that name a process by pid). Standard library only, Linux's ``/proc`` and signals.

``die_with_parent(signum)`` is a ``preexec_fn`` for ``subprocess.Popen``: a child that must not outlive the
process that started it. Between fork and exec the child asks the kernel (Linux ``PR_SET_PDEATHSIG``) for
``signum`` when the *thread* that forked it exits, and sends the signal to itself at once if that parent is
already gone (it died between the fork and the request). ``prctl`` is resolved in the parent: the child only
calls it (the child of a busy process gets little CPU, and a start may be on a borrow's critical path). ``then``
runs in the child after it (the agent's: ignore the pool's preemption signal). Elsewhere than Linux there is no
death signal: the result is ``then`` alone. The signal is the caller's, with its reason: SIGTERM where the child
shuts its own children down on it (vLLM's API server stops its engine core), SIGKILL where nothing it runs
needs a clean exit (a command's process group, vllm-router).

``process_alive(pid)``: whether a process runs, for the records that name a process by pid (the daemon's address
file, the node weight store's pins and agents). ``proc_start_ticks(pid)``: its start time (``/proc/<pid>/stat``
field 22, clock ticks since boot), which with the pid names one process: a record that keeps both never takes a
recycled pid for its process (the router's record, the local backend's tasks). Both count a zombie (exited, not
reaped yet) as gone: it runs nothing.

``signal_group(pgid, sig)`` and ``group_alive(pgid)``: a process group (a child started in a session of its own,
``start_new_session``, with all it started), for stopping it whole. A group that is gone is no error to signal;
one whose processes this process may not signal is left alone, and counts as alive (it exists).
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
    return _live_stat(pid) is not None


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22); None when there is
    no such live process (a zombie counts as gone)."""
    fields = _live_stat(pid)
    return None if fields is None else int(fields[19])  # field 22


def _live_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields from the third (the state) on; None when there is no such process, or it is
    a zombie (Z) or dead (X)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces and parentheses: split after the last ')'
    fields = raw.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone, or none of whose processes this process may
    signal, is left as it is."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a process (a zombie, or one this process may not signal, counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
