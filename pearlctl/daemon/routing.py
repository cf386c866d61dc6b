"""The run's router, kept by the daemon: one gateway + vllm-router per run (pearlctl.router), started next to
the daemon or adopted from a previous daemon, started again when it dies, and routing to exactly the
workers state says are routable.

Why next to the daemon: rollout clients anywhere in the cluster must reach one stable address, and the
daemon's host is the one every agent already reaches; a Slurm job of its own would wait in the queue and
move with every requeue. The gateway is detached from the daemon (pearlctl.router.service): a daemon crash
or restart leaves the data plane serving, and the next daemon adopts it.

Membership is a sync, every ``every_s`` and at once when ``wake`` is called (REGISTER and DEREGISTER call it
as they flip ``routable``, so a step waits for one round trip to the router, not for the timer): desired =
state's READY, routable workers (URL → weight version); when it differs from what the router last said it
routes to, the gateway is told the whole set (``RouterMembership.sync``: adds, removes, re-versions), and its
answer is what ``routed`` reports. The transition steps REGISTER and DEREGISTER only flip ``routable`` in
state; their probes wait until ``routed`` agrees (pearlctl.daemon.effects), so a worker drains only once the
router sends it nothing new; a change of ``routed`` calls ``on_change`` (the daemon's control loop looks at
once, and the probe passes).
A restarted router (empty) is given the whole set at once, so membership is rebuilt from state.

``routed`` is the last membership the router reported. Until the first sync it is empty — a REGISTER waits
— and while the router is unreachable it keeps its last value: a DEREGISTER then waits for the router,
never passes on a guess.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pearlctl.router import service
from pearlctl.router.membership import MembershipError, RouterMembership
from pearlctl.state.machines import WorkerState as W
from pearlctl.state.store import Store
from pearlctl.vocabulary import PD_ROLES, Role

log = logging.getLogger("pearlctl.daemon")

# A membership call waits this long for the gateway (on this thread only): when a synchronous batch of thousands
# of turns arrives at once, the gateway's event loop answers seconds late, and a call given up after 5 s was never
# answered until the burst was over (elastic workers joined minutes late in tests/benchmarks/bench_live.py). A
# gateway that is gone is noticed by its process check, not by this timeout.
MEMBERSHIP_TIMEOUT_S = 30.0

CHECK_PROCESS_S = 2.0  # how often the gateway's process and health are checked
REFRESH_S = 5.0  # how often membership is re-read even when nothing changed (a router restarted by the gateway)
ADD_WAIT_S = 5.0  # a READY worker answers /health at once; one that does not is retried next sync
ROUTED_APART = (*PD_ROLES, Role.REWARD)  # the roles the router is told (the rest: ROLLOUT)


def desired_members(store: Store, run_id: str) -> dict[str, str | None]:
    """URL → weight version of every worker the router should send requests to now: READY and routable (a judge
    too: the router routes it apart, ``desired_roles``)."""
    return {
        w.url: (str(w.weight_version) if w.weight_version is not None else None)
        for w in store.fleet.workers(run_id)
        if w.routable and w.state == W.READY and w.url
    }


def desired_roles(store: Store, run_id: str, wanted: dict[str, str | None]) -> dict[str, str]:
    """URL → role of the wanted members that prefill or decode, or judge (REWARD: only requests naming its model
    reach it, never a rollout's); the rest serve colocated, ROLLOUT."""
    return {w.url: w.role for w in store.fleet.workers(run_id) if w.url in wanted and w.role in ROUTED_APART}


class RouterKeeper:
    def __init__(
        self,
        store: Store,
        run_id: str,
        run_dir: str,
        *,
        journal: Callable[[str, dict], None],
        host: str = "0.0.0.0",
        port: int = 0,
        policy: str = "consistent_hash",
        advertise: str | None = None,
        every_s: float = 0.5,
        on_change: Callable[[], None] = lambda: None,
    ):
        self.store, self.run_id, self.run_dir = store, run_id, run_dir
        self.journal = journal  # (event, data) -> a journal row, written under the daemon's lock
        self.host, self.port, self.policy, self.advertise, self.every_s = host, port, policy, advertise, every_s
        self.on_change = on_change  # called when what the router routes to changed
        self._wake = threading.Event()  # set by ``wake``: the loop syncs now
        self.record: service.RouterRecord | None = None
        self.members: dict[str, str | None] = {}  # what the router last said it routes to
        # the members a change in flight asks for: the router may route to them once it answers, so until it has,
        # they count as routed (a DEREGISTER proven meanwhile would let a worker drain and sleep that a stale
        # change then routes to)
        self._asked: set[str] = set()
        self._unsure: set[str] = set()  # what a failed change asked for: the router may have taken it
        self._client: RouterMembership | None = None
        self._checked_at = 0.0
        self._busy_logged = False  # "slow to answer /health" said once per gateway
        self._refreshed_at = 0.0
        self._lock = threading.Lock()

    # -- what the executor's probes read -----------------------------------------------------------
    def routed(self) -> set[str]:
        """What the router said it routes to (REGISTER's proof)."""
        with self._lock:
            return set(self.members)

    def may_route(self) -> set[str]:
        """What the router routes to, or may once the membership change in flight is answered, or may after one that
        failed (DEREGISTER's proof: a worker leaves only once nothing can route to it)."""
        with self._lock:
            return set(self.members) | self._asked | self._unsure

    @property
    def base_url(self) -> str | None:
        return self.record.base_url if self.record else None

    def wake(self) -> None:
        """Sync now (state's routable set changed), not at the next tick of the timer."""
        self._wake.set()

    # -- the process -------------------------------------------------------------------------------
    def ensure_running(self) -> service.RouterRecord:
        """Adopt the run's gateway, or start one (with the members state wants). Raises RouterStartError."""
        record = service.adopt(self.run_dir)
        if record is None and self.record is not None and self._busy(self.record):
            record = self.record
        if record is not None and (self.record is None or record.pid != self.record.pid):
            self.journal("router adopted", {"pid": record.pid, "url": record.base_url})
        if record is None:
            again = self.record is not None
            wanted = desired_members(self.store, self.run_id)
            port = self.record.port if self.record else self.port  # the same address after a restart
            record = service.start(
                self.run_dir,
                self.host,
                port,
                policy=self.policy,
                advertise_host=self.advertise,
                workers=wanted,
                roles=desired_roles(self.store, self.run_id, wanted),
            )
            self.journal(
                "router restarted" if again else "router started",
                {"pid": record.pid, "url": record.base_url, "members": len(wanted)},
            )
            with self._lock:
                self.members = {}  # a new router knows only what it was started with: re-read below
            self._refreshed_at = 0.0
        if self.record is None or record.pid != self.record.pid:
            if self._client is not None:
                self._client.close()
            key = service.read_key(self.run_dir)
            self._client = RouterMembership(record.admin_url, key, timeout=MEMBERSHIP_TIMEOUT_S)
        self.record = record
        self._checked_at = time.monotonic()
        return record

    def _busy(self, record: service.RouterRecord) -> bool:
        """The gateway this keeper works with is still the same live process, only slow to answer ``/health``
        (under a batch of thousands of turns it can take seconds): it stays the run's gateway, and the
        membership calls, with their own timeout, go on. Starting another is refused while it lives
        (service.start) and would cut every turn in flight; a process that is gone is replaced."""
        if not service.same_process(record.pid, record.start_ticks):
            return False
        if not self._busy_logged:
            log.warning("router: the gateway (pid %d) is slow to answer /health; still using it", record.pid)
            self._busy_logged = True
        return True

    def stop(self) -> None:
        """The run is over: its router goes too."""
        if self.record is not None:
            service.stop(self.record, run_dir=self.run_dir)
            self.journal("router stopped", {"pid": self.record.pid})
            self.record = None

    # -- membership --------------------------------------------------------------------------------
    def sync_once(self) -> None:
        """One pass: the process checked now and then, membership made equal to state's when it differs."""
        now = time.monotonic()
        if self.record is None or now - self._checked_at >= CHECK_PROCESS_S:
            self.ensure_running()
        assert self._client is not None
        wanted = desired_members(self.store, self.run_id)
        with self._lock:
            same = wanted == self.members
        if same and now - self._refreshed_at < REFRESH_S:
            return
        if same:
            members = self._client.list()
        else:
            # how each serves: PREFILL/DECODE members are routed in pairs through a PD router (pearlctl.router);
            # the rest default to ROLLOUT (colocated). A worker's role is fixed for its life (a SWITCH starts a
            # new worker), so comparing url -> version above still notices every change of membership.
            with self._lock:
                self._asked = set(wanted)
            try:
                result = self._client.sync(
                    wanted, roles=desired_roles(self.store, self.run_id, wanted), wait_s=ADD_WAIT_S
                )
            except BaseException:
                with self._lock:  # what the router took of it is unknown until a change or a listing answers
                    self._unsure |= self._asked
                    self._asked = set()
                raise
            members = result.members
            if result.failed:
                log.warning("router: could not add %s", result.failed)
        routed = {m.url: m.weight_version for m in members if m.routed is not False}
        with self._lock:
            before, self.members = self.members, routed
            self._asked, self._unsure = set(), set()
        added, removed = sorted(routed.keys() - before.keys()), sorted(before.keys() - routed.keys())
        self._refreshed_at = now
        if added or removed:  # when the router began or stopped sending a worker requests, for the journal
            self.journal("router membership", {"added": added, "removed": removed, "members": len(routed)})
            self.on_change()

    def loop(
        self, stopping: threading.Event, on_ok: Callable[[], None], on_error: Callable[[BaseException], None]
    ) -> None:
        """Sync until ``stopping``; a failed pass (the gateway unreachable, a start that failed, a bug) is
        reported to ``on_error`` and tried again, never fatal to the daemon. A stop is seen within ``every_s``."""
        while not stopping.is_set():
            self._wake.clear()  # a wake from here on is for state this pass may not have read
            try:
                self.sync_once()
                on_ok()
            except (MembershipError, service.RouterStartError, OSError) as exc:
                self._checked_at = 0.0  # look at the process again on the next pass
                on_error(exc)
            except Exception as exc:
                on_error(exc)
            self._wake.wait(self.every_s)
