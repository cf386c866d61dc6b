"""The controller's shared state: what the daemon's three sides (its agents', its trainer's and its operator's,
pearlctl.daemon.controller) read and write together, and the base class that gives each side its view of it.

Every write carries the daemon's lease epoch, so a deposed daemon cannot write; every answer carries it, so
agents can ignore an older one. One decision lock (``lock``) orders every fold and write of the three sides
and the control loop; the policy's own decision is made with it released (pearlctl.daemon.borrowing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pearlctl.daemon.decision_lock import DecisionLock
from pearlctl.daemon.longpoll import LongPolls
from pearlctl.state.store import Store
from pearlctl.vocabulary import HEARTBEAT_S

if TYPE_CHECKING:
    from pearlctl.daemon.borrowing import Borrowing

# heartbeat intervals without news before an agent's GPUs are LOST (its loss window: pearlctl.daemon.liveness);
# the default of ``Shared`` and of ``DaemonSettings``
LOST_AFTER = 2.0


class ControlError(Exception):
    """A request the controller refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Shared:
    """The state the daemon's sides share: the store and the run, the lease epoch, the clock, the decision lock,
    the control loop's wake-up event, the held long polls, the run's policy (``borrowing``, set by the daemon)
    and the heartbeat interval agents are told."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        epoch: int,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        lost_after: float = LOST_AFTER,
        secret: str = "",
        on_deposed: Callable[[str], None] = lambda why: None,
        clock=time.time,
    ):
        self.store, self.run_id, self.epoch = store, run_id, epoch
        self.heartbeat_s, self.lost_after, self.clock = heartbeat_s, lost_after, clock
        self.secret, self.on_deposed = secret, on_deposed
        self.loop_at = clock()  # when the control loop last ticked (answers say how long ago)
        self.api_errors = 0  # requests answered 500 (a bug): /metrics
        self.borrowing: Borrowing | None = None  # set by the daemon: pearlctl.daemon.borrowing.Borrowing
        self.long_polls = LongPolls()  # held heartbeats and trainer reports, answered after passes (notify)
        self.wake = threading.Event()  # set when a report may let the control loop make progress
        # one decision at a time: HTTP threads and the control loop share state (reentrant: borrow() plans)
        # times its holds: a long one is logged with where it was taken and how much of it was committing state
        self.lock = DecisionLock(commits=store.commits_on_this_thread)


def _shared(name: str) -> Any:
    return property(lambda side: getattr(side.shared, name), doc=f"the shared ``{name}``")


class Side:
    """One caller's side of the controller over the shared state: reads it by the same names."""

    def __init__(self, shared: Shared):
        self.shared = shared

    store = _shared("store")
    run_id = _shared("run_id")
    epoch = _shared("epoch")
    clock = _shared("clock")
    lock = _shared("lock")
    wake = _shared("wake")
    long_polls = _shared("long_polls")
    borrowing = _shared("borrowing")
    heartbeat_s = _shared("heartbeat_s")
    lost_after = _shared("lost_after")
    secret = _shared("secret")
    loop_at = _shared("loop_at")
