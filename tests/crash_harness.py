"""The harness the unit crash matrices share (tests/unit/test_crash_matrix.py for the trainer's borrows and
returns, tests/unit/test_crash_matrix_pools.py for the transitions a plan makes on rollout and elastic pools).

The daemon's own objects (controller, executor, effects, borrowing) run for real against a real SQLite state;
a "crash" is a ``Crash`` raised from the executor's fault hook at one step boundary, after which ``Restarts``
drops every daemon object and builds new ones with the next epoch, as a restart does. Agents, the trainer and
the router's membership are simulated at their seams (the HTTP handlers; the set of routed URLs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from pearlctl.api import bodies
from pearlctl.api.bodies import parse
from pearlctl.daemon.borrowing import Borrowing
from pearlctl.daemon.controller import Controller
from pearlctl.daemon.effects import DaemonEffects
from pearlctl.daemon.transitions import Executor
from pearlctl.state.store import Store

POINTS = ("before_intent", "after_intent", "after_effect", "after_done")


class Crash(Exception):
    pass


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


class SimRouter:
    """The router's membership, synced from state's routable workers one tick late (as the daemon's
    membership sync does)."""

    def __init__(self):
        self.urls: set[str] = set()

    def sync(self, store: Store) -> None:
        self.urls = {w.url for w in store.fleet.workers("r") if w.routable and w.state == "READY" and w.url}

    def view(self) -> set[str]:
        return set(self.urls)


class SimAgent:
    """An agent on ``host``: reports its workers, starts what desired state adds (counted; READY a tick later,
    reporting ``ready_s`` as its cold start if given), parks and wakes what it asks to sleep or run, stops what it
    drops. With a ``router``, it records any worker it had to
    drain while the router still routed to it."""

    def __init__(self, router: SimRouter | None = None, *, host: str = "gpu1", ready_s: float | None = None):
        self.router, self.host = router, host
        self.ready_s = ready_s  # the cold start a started worker reports once READY, as a real agent measures it
        self.running: dict[str, dict] = {}
        self.starts: dict[str, int] = {}
        self.models: dict[str, str | None] = {}  # key -> the model its last start was told to serve (None: the pool's)
        self.drained_while_routed: list[str] = []

    def tick(self, daemon: Daemon) -> None:
        report = [dict(w) for w in self.running.values()]
        answer = daemon.controller.agents.heartbeat(
            parse(bodies.Heartbeat, {"allocation_id": daemon.alloc_id, "workers": report}), daemon.alloc_id
        )
        for w in self.running.values():  # what was starting becomes READY; STOPPED ones are gone
            if w["state"] == "STARTING":
                w["state"] = "READY"
                if self.ready_s is not None:
                    w["ready_s"] = self.ready_s
        self.running = {k: w for k, w in self.running.items() if w["state"] != "STOPPED"}
        wanted = {d["key"]: d for d in answer["desired"]}
        for key, d in wanted.items():
            w = self.running.get(key)
            if d["state"] == "SLEEPING":
                if w is not None and w["state"] != "SLEEPING":
                    self._leaving(w)
                    w["state"] = "SLEEPING"
            elif w is None:
                self.starts[key] = self.starts.get(key, 0) + 1
                self.models[key] = d.get("model")
                self.running[key] = {
                    "key": key,
                    "role": d["role"],
                    "engine": d["engine"],
                    "gpus": d["gpus"],
                    "state": "STARTING",
                    "url": f"http://{self.host}:{self._port()}",
                }
            elif w["state"] == "SLEEPING":
                w["state"] = "READY"  # woken
        for key, w in self.running.items():
            if key not in wanted and w["state"] != "STOPPED":
                self._leaving(w)
                w["state"] = "STOPPED"

    def _port(self) -> int:
        # the trainer matrix numbers by worker key, the pools matrix (with a router) by start
        return 9000 + (sum(self.starts.values()) if self.router is not None else len(self.starts))

    def _leaving(self, w: dict) -> None:
        if self.router is not None and w["state"] == "READY" and w["url"] in self.router.urls:
            self.drained_while_routed.append(w["key"])


class Daemon:
    """The daemon's objects for run "r" at ``epoch``; ``crash_at`` becomes the executor's fault hook."""

    def __init__(self, store: Store, alloc_id: int, epoch: int, clock: Clock, router: SimRouter | None = None,
                 crash_at=None):  # fmt: skip
        self.alloc_id = alloc_id
        self.controller = Controller(store, "r", epoch, clock=clock)
        effects = DaemonEffects(store, "r", epoch, router=router.view if router is not None else None)
        self.executor = Executor(store, effects, run_id="r", epoch=epoch, clock=clock)
        self.controller.borrowing = self.borrowing = Borrowing(store, self.executor, "r", clock=clock)
        if crash_at is not None:
            self.executor.fault = crash_at


def crash_once(
    store: Store, point: str, step: str, plan: str, to_role: str | None = None
) -> tuple[Callable, list[str]]:
    """A fault hook that raises ``Crash`` the first time step ``step`` of a ``plan`` transition (toward ``to_role``,
    when given) reaches ``point``, and the list of keys it fired at (empty until it does)."""
    fired: list[str] = []

    def crash_at(at, key):
        tid, _, step_kind = key.split(":")
        t = store.transitions.get(int(tid))
        detail = t.detail or {}
        if to_role is not None and t.to_role != to_role:
            return
        if not fired and at == point and step_kind == step and detail.get("plan") == plan:
            fired.append(key)
            raise Crash(key)

    return crash_at, fired


class Restarts:
    """A daemon that restarts (a new ``Daemon``, the next epoch, nothing carried over) each time it crashes,
    registered with the agent ``register`` describes; ``crashes`` counts the restarts."""

    def __init__(self, store: Store, alloc_id: int, clock: Clock, register: dict, *, router=None, crash_at=None):
        self.store, self.alloc_id, self.clock, self.router = store, alloc_id, clock, router
        self.epochs = itertools.count(1)
        self.crashes = 0
        self.daemon = Daemon(store, alloc_id, next(self.epochs), clock, router, crash_at)
        self.daemon.controller.agents.register(parse(bodies.Register, register))

    def run_until(self, tick: Callable[[Daemon], None], until: Callable[[], object], limit: int = 200) -> None:
        """Each second: ``tick`` the simulated parts, then the borrowing loop; stop once ``until()`` holds."""
        for _ in range(limit):
            try:
                tick(self.daemon)
                with self.daemon.controller.lock:
                    self.daemon.borrowing.tick()
            except Crash:
                self.crashes += 1
                self.daemon = Daemon(self.store, self.alloc_id, next(self.epochs), self.clock, self.router)
            self.clock.t += 1.0
            if until():
                return
        raise AssertionError("did not converge")
