"""Slow events the daemon logs without flooding its log: a control-loop tick, a hold of the decision lock.

`SlowLog.note` takes an event's duration; one of ``slow_s`` or more is counted, and one warning line at most every
``every_s`` describes the longest such event since the last line and says how many there were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("pearlctl.daemon")

SLOW_S = 0.1  # the daemon's targets for a tick and a heartbeat are 100 ms
LOG_EVERY_S = 10.0


class SlowLog:
    def __init__(
        self,
        what: str,
        *,
        slow_s: float = SLOW_S,
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.slow_s, self.every_s, self._clock = what, slow_s, every_s, clock
        self.count = 0  # slow events, over the daemon's life
        self._worst: tuple[float, str] | None = None  # the longest slow event not yet logged, and its line
        self._unlogged = 0
        self._logged_at = float("-inf")

    def note(self, seconds: float, describe: Callable[[], str]) -> None:
        """An event of ``seconds``; ``describe()`` gives its line (called only for the longest slow one)."""
        if seconds < self.slow_s:
            return
        # callers may be on several threads: a line too many or a count off by one is harmless
        self.count += 1
        self._unlogged += 1
        if self._worst is None or seconds > self._worst[0]:
            self._worst = (seconds, describe())
        now = self._clock()
        if now < self._logged_at + self.every_s:
            return
        n, line = self._unlogged, self._worst[1]
        more = f" (the longest of {n} {self.what} of {1000 * self.slow_s:.0f} ms or more since the last such line)"
        log.warning("%s%s", line, more if n > 1 else "")
        self._worst, self._unlogged, self._logged_at = None, 0, now
