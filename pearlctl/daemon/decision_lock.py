"""The daemon's decision lock (``Controller.lock``), timed: every decision and every fold of what agents, the
trainer and Slurm report waits for it, so a long hold is a slow tick and a late heartbeat elsewhere.

`DecisionLock` is a reentrant lock that measures each outermost hold and notes where it was taken (the function
that entered it). A hold of ``slow_s`` or more is logged as a warning — at most one line every ``log_every_s``,
naming the longest such hold since the last line and how many there were — and counted in ``slow_holds``. The
measuring costs two clock reads and a frame lookup per outermost acquisition.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("pearlctl.daemon")

SLOW_HOLD_S = 0.1  # the daemon's targets for a tick and a heartbeat are 100 ms
LOG_EVERY_S = 10.0


class DecisionLock:
    def __init__(
        self,
        *,
        slow_s: float = SLOW_HOLD_S,
        log_every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.RLock()
        self.slow_s, self.log_every_s, self._clock = slow_s, log_every_s, clock
        self._depth = 0  # changed only by the thread that holds the lock
        self._since = 0.0
        self._where = ""
        self.slow_holds = 0  # holds of slow_s or more, over the daemon's life
        self._worst: tuple[float, str] | None = None  # the longest slow hold not yet logged
        self._unlogged = 0
        self._logged_at = float("-inf")

    def acquire(self, blocking: bool = True, timeout: float = -1, *, _frames: int = 1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        if self._depth == 1:
            self._since = self._clock()
            code = sys._getframe(_frames).f_code
            self._where = code.co_qualname
        return True

    def release(self) -> None:
        self._depth -= 1
        if self._depth:
            self._lock.release()
            return
        held, where = self._clock() - self._since, self._where
        self._lock.release()
        if held >= self.slow_s:
            self._slow(held, where)

    def __enter__(self) -> DecisionLock:
        self.acquire(_frames=2)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _slow(self, held: float, where: str) -> None:
        # outside the lock: two threads may both get here; a line too many or a count off by one is harmless
        self.slow_holds += 1
        self._unlogged += 1
        if self._worst is None or held > self._worst[0]:
            self._worst = (held, where)
        now = self._clock()
        if now < self._logged_at + self.log_every_s:
            return
        worst_s, worst_where = self._worst
        others = self._unlogged - 1
        log.warning(
            "decision lock held %.0f ms by %s%s",
            1000 * worst_s,
            worst_where,
            f" (the longest of {others + 1} holds of {1000 * self.slow_s:.0f} ms or more since the last such line)"
            if others
            else "",
        )
        self._worst, self._unlogged, self._logged_at = None, 0, now
