"""The daemon's decision lock (``Shared.lock`` in pearlctl.daemon.shared), timed: every fold of what agents, the
trainer and Slurm report, and every write of a decision, waits for it, so a long hold is a slow tick and a late
heartbeat elsewhere (the policy's decision itself is made with it released: pearlctl.daemon.borrowing).

`DecisionLock` is a reentrant lock that measures each outermost hold and notes where it was taken (the function
that entered it). A hold of ``slow_s`` or more is counted in ``slow_holds`` and logged through a `SlowLog` (one line
at most every ``log_every_s``, naming the longest such hold since the last line and, given ``commits`` — the state
store's ``commits_on_this_thread`` —, how many writes the holder committed and how long their commits took). The
measuring costs two clock reads, two counter reads and a frame lookup per outermost acquisition.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from pearlctl.daemon.slowlog import LOG_EVERY_S, SLOW_S, SlowLog


class DecisionLock:
    def __init__(
        self,
        *,
        slow_s: float = SLOW_S,
        log_every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        commits: Callable[[], tuple[int, float]] | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._commits = commits
        self._commits_at = (0, 0.0)  # the holder's commits when it took the lock
        self._slow = SlowLog("holds", slow_s=slow_s, every_s=log_every_s, clock=clock)
        self._depth = 0  # changed only by the thread that holds the lock
        self._since = 0.0
        self._where = ""

    @property
    def slow_holds(self) -> int:
        """Holds of ``slow_s`` or more, over the daemon's life."""
        return self._slow.count

    def acquire(self, blocking: bool = True, timeout: float = -1, *, _frames: int = 1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        if self._depth == 1:
            self._since = self._clock()
            self._where = sys._getframe(_frames).f_code.co_qualname
            if self._commits is not None:
                self._commits_at = self._commits()
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth:
            self._lock.release()
            return
        held, where = self._clock() - self._since, self._where
        disk = ""
        if self._commits is not None and held >= self._slow.slow_s:
            (n0, s0), (n1, s1) = self._commits_at, self._commits()
            disk = f" ({n1 - n0} commits of state, {1000 * (s1 - s0):.0f} ms in them)"
        self._lock.release()
        self._slow.note(held, lambda: f"decision lock held {1000 * held:.0f} ms by {where}{disk}")

    def __enter__(self) -> DecisionLock:
        self.acquire(_frames=2)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
