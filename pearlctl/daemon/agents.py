"""The agents' side of the controller: what agents report, and how it is folded into state.

Agents register once per process (``register``) and then heartbeat (``heartbeat``) with the workers
they actually run. The controller records that truth in state and answers with the workers the
allocation should run (pearlctl.daemon.desired); a heartbeat that repeats its allocation's last report to
unchanged state is answered from memory (``remembered``). When each agent was heard, and the loss of a silent
one, are pearlctl.daemon.liveness's. Every write carries the daemon's lease epoch, so a deposed daemon cannot
write; every answer carries it, so agents can ignore an older one.

Every method takes a typed, validated body (pearlctl.api.bodies); what an agent may do is bounded by
its allocation credential: it reports for its own allocation only, and its workers' URLs must name its
own node. A lent GPU's desired worker carries the return deadline down to the agent, which returns the
GPU by itself if this daemon cannot be reached by then (pearlctl.agent.__main__); its report of such a
return is journaled here.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
from urllib.parse import urlsplit

from pearlctl.api import bodies
from pearlctl.daemon.desired import Desired, desired_hash
from pearlctl.daemon.liveness import Liveness, move_gpus
from pearlctl.daemon.metrics import latency_histogram
from pearlctl.daemon.shared import ControlError, Side
from pearlctl.state.errors import NotFound
from pearlctl.state.machines import MACHINES
from pearlctl.state.machines import AllocationState as A
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.machines import WorkerState as W
from pearlctl.vocabulary import GENERATION_ROLES, Engine, PoolKind

log = logging.getLogger("pearlctl.daemon")


def allocation_credential(secret: str, run_id: str, allocation_id: int) -> str:
    """The credential of one allocation's agent: derived from the run's token, so a restarted daemon
    knows it without storing it, and useless for any other allocation or run."""
    msg = f"pearl-allocation:{run_id}:{allocation_id}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def edge_path(table: str, old: str, new: str) -> list[str]:
    """The shortest chain of legal states from ``old`` to ``new`` (excluding ``old``); [] if none."""
    edges = MACHINES[table].edges
    queue = collections.deque([(old, [])])
    seen = {old}
    while queue:
        state, path = queue.popleft()
        for a, b in edges:
            if a == state and b not in seen:
                if b == new:
                    return [*path, b]
                seen.add(b)
                queue.append((b, [*path, b]))
    return []


def _report_key(body: bodies.Heartbeat) -> str | None:
    """What a heartbeat reports, as a key to tell a repeated report by; None for one that must always be
    folded (self-returns to journal)."""
    return None if body.self_returns else body.model_dump_json(include={"workers", "draining"})


class Agents(Side):
    """The agents' side: registrations, heartbeats (folded into state, answered with desired workers, held as
    long polls) and the routable workers the rollout driver asks for. ``liveness`` hears the agents;
    ``desired`` says what they should run."""

    def __init__(self, shared, liveness: Liveness, desired: Desired) -> None:
        super().__init__(shared)
        self.liveness, self.desired = liveness, desired
        # heartbeats answered from memory (the same report to the same state) and folded into state: /metrics
        self.heartbeats: collections.Counter[str] = collections.Counter()
        # each heartbeat's handling, from its arrival to its answer (a long poll's hold left out): /metrics
        self.heartbeat_seconds = latency_histogram(
            "pearl_daemon_heartbeat_duration_seconds", "agent heartbeat handling, arrival to answer (hold left out)"
        )
        self._refused: dict[int, str] = {}  # allocation -> the last error its refused report got (logged once)
        # allocation -> (its state's fingerprint, its report, desired workers, their hash) of its last fold
        self._answered: dict[int, tuple[tuple | None, str | None, list[dict], str]] = {}

    def _allocation(self, job_id: str, task_id: int) -> dict:
        for a in self.store.fleet.allocations(self.run_id):
            if a.job_id == job_id and a.array_index == task_id:
                return a
        raise ControlError(f"run {self.run_id} has no allocation for job {job_id} task {task_id}", 404)

    def register(self, body: bodies.Register) -> dict:
        """An agent starts (or restarts): bind it to its allocation and its GPUs; hand it the allocation's
        credential, the only one its heartbeats are accepted with."""
        with self.lock:
            alloc = self._allocation(body.job_id, body.task_id)
            if alloc.state in (A.ENDED, A.REQUESTED):
                raise ControlError(f"allocation {alloc.id} is {alloc.state}: not accepting agents", 409)
            if alloc.node and body.node != alloc.node:
                raise ControlError(
                    f"allocation {alloc.id} runs on node {alloc.node} (Slurm says), not {body.node}", 403
                )
            pool = self._pool_of(alloc)
            gpus = list(body.gpus)
            if not gpus and pool["gpus_per_node"]:
                gpus = list(range(pool["gpus_per_node"]))  # no device list in the environment (local backend)
            self.store.update_fields(
                "allocations",
                alloc.id,
                epoch=self.epoch,
                event="agent registered",
                data={"pid": body.pid, "node": body.node, "host": body.host, "gpus": gpus},
                agent_pid=body.pid,
                agent_host=body.host or body.node,
                agent_seen_at=self.clock(),
            )
            self.store.fleet.upsert_node_gpus(self.run_id, alloc.id, body.node, gpus, pool["role"], epoch=self.epoch)
            return {
                "allocation_id": alloc.id,
                "credential": allocation_credential(self.secret, self.run_id, alloc.id),
                "epoch": self.epoch,
                "heartbeat_s": self.heartbeat_s,
            }

    def _own_allocation(self, alloc_id: int) -> dict:
        try:
            alloc = self.store.fleet.allocation(alloc_id)
        except NotFound:
            alloc = None
        if alloc is None or alloc.run_id != self.run_id:
            raise ControlError(f"run {self.run_id} has no allocation {alloc_id}: register again", 404)
        return alloc

    def _check_urls(self, alloc: dict, body: bodies.Heartbeat) -> None:
        """Workers' URLs must name the allocation's own node (or its agent's host): nobody routes rollout
        traffic elsewhere by reporting a worker."""
        if all(w.url is None for w in body.workers):
            return
        hosts = {h.lower() for h in (alloc.node, alloc.agent_host) if h}
        hosts |= {n["name"].lower() for n in self._nodes_of(alloc.id)}
        for w in body.workers:
            if w.url is not None and (urlsplit(w.url).hostname or "").lower() not in hosts:
                raise ControlError(
                    f"worker {w.key}: url {w.url} is not on allocation {alloc.id}'s node "
                    f"({', '.join(sorted(hosts)) or 'unknown'})",
                    403,
                )

    def _nodes_of(self, alloc_id: int) -> list[dict]:
        ids = {g.node_id for g in self.store.fleet.gpus(self.run_id, allocation_id=alloc_id)}
        return [self.store.get("nodes", i) for i in sorted(ids)]

    def heartbeat(self, body: bodies.Heartbeat, allocation_id: int) -> dict:
        """Record what the agent runs; answer with what it should run (never held: see ``report``)."""
        return self.report(body, allocation_id)[0]

    def report(self, body: bodies.Heartbeat, allocation_id: int) -> tuple[dict, int]:
        """Record what the agent runs; answer with what it should run, and the number of long-poll passes
        published before the answer was made (``hold`` waits from there).

        Most heartbeats repeat the allocation's last report to a state that has not changed for it since
        (``store.fleet.fingerprint``: its row, GPUs and workers, the open transitions, the weights):
        folding it in again would write nothing and answer the same, so such a heartbeat only notes the time and
        answers from memory — one indexed query, no write. That is what lets one daemon hear 512 agents a
        second while other allocations change. An allocation with lent GPUs is always folded: its answer
        carries the return deadline, which depends on measured return times too.
        """
        if body.allocation_id != allocation_id:
            raise ControlError(
                f"this credential is allocation {allocation_id}'s; it cannot report for allocation "
                f"{body.allocation_id}",
                403,
            )
        alloc_id = allocation_id
        self.liveness.heard(alloc_id)
        remembered = self.remembered(body, alloc_id)
        if remembered is not None:
            return remembered
        report = _report_key(body)
        with self.lock:
            passes = self.long_polls.passes
            self.heartbeats["folded"] += 1
            with self.store.atomic():  # one commit for the whole report: one wait for the disk, not one a row
                desired, changed = self._fold(alloc_id, body)
            if body.leaving:
                self._answered.pop(alloc_id, None)
                self.wake.set()  # its GPUs left: the control loop looks now
                return self._answer([], None), passes
            digest = desired_hash(desired)
            if any("return_deadline" in w for w in desired):
                self._answered.pop(alloc_id, None)
            else:
                self._answered[alloc_id] = (self.store.fleet.fingerprint(alloc_id), report, desired, digest)
        if changed:
            self.wake.set()  # a worker moved: a transition step may complete now
        return self._answer(desired, digest), passes

    def remembered(self, body: bodies.Heartbeat, allocation_id: int) -> tuple[dict, int] | None:
        """``report``'s answer to a heartbeat that repeats its allocation's last report to unchanged state, from
        memory: no decision lock (a tick in progress holds it for its whole decision), no write, one indexed
        read on a connection of its own — cheap enough for the control API to call in its event loop. None
        when the heartbeat must be folded into state (``report``)."""
        last = self._answered.get(allocation_id)
        if last is None or body.allocation_id != allocation_id or body.leaving:
            return None
        passes = self.long_polls.passes
        key = _report_key(body)
        if key is None or last[:2] != (self.store.fleet.fingerprint(allocation_id), key):
            return None
        self.heartbeats["remembered"] += 1  # heard already: on arrival (the API) or by ``report``
        return self._answer(last[2], last[3]), passes

    def refused_report(self, allocation_id: int, error: str) -> None:
        """An agent's report was refused as invalid (422, naming the field): a bug in that agent or in what
        this daemon told it, and the agent will send the same again. Counted (``/metrics``: heartbeats,
        path "refused") and logged once per allocation and error, not once per heartbeat (no lock, no I/O
        but the log: called in the event loop)."""
        self.heartbeats["refused"] += 1
        if self._refused.get(allocation_id) != error:
            self._refused[allocation_id] = error
            log.error("refused a report of allocation %s's agent (it will repeat it): %s", allocation_id, error)

    async def hold(self, body: bodies.Heartbeat, allocation_id: int, reported: tuple[dict, int]) -> dict:
        """Long poll: an agent that sent the ``desired_hash`` of its last answer and ``wait_s`` is held (in the
        event loop) until its desired workers change or ``wait_s``, at most one heartbeat interval, passes, so
        a transition's effect reaches the agent in milliseconds, not a heartbeat later."""
        answer, passes = reported
        wait = min(body.wait_s, self.heartbeat_s)
        if wait <= 0 or body.desired_hash is None or body.desired_hash != answer["desired_hash"]:
            return answer
        changed = await self.long_polls.hold(allocation_id, answer["desired_hash"], passes, wait)
        return self._answer(*(changed or (answer["desired"], answer["desired_hash"])))  # loop_age_s as of now

    def _fold(self, alloc_id: int, body: bodies.Heartbeat) -> tuple[list[dict], bool]:
        """Fold an agent's report into state (under the lock): its workers, its self-returns, its draining
        or leaving. Returns the allocation's desired workers and whether anything moved."""
        alloc = self._own_allocation(alloc_id)
        self._check_urls(alloc, body)
        # a preemption seen by Slurm (GPUs DRAINING), or the elastic pool asking the task to leave, keeps
        # this allocation's workers out of routing
        gpus = self.store.fleet.gpus(self.run_id, allocation_id=alloc_id)
        draining = alloc.drain_requested_at is not None or any(g.state == G.DRAINING for g in gpus)
        moving = self._moving_places(alloc_id, gpus) if body.workers else set()
        lent = {g.idx for g in gpus if g.borrowed}
        changed = [self._record_worker(alloc, report, draining, moving, lent) for report in body.workers]
        for r in body.self_returns:
            self.store.journal_event(
                self.run_id,
                "allocations",
                alloc_id,
                "agent returned lent GPUs itself",
                data={**r.model_dump(mode="json"), "late_s": round(r.at - r.deadline, 3)},
                epoch=self.epoch,
            )
            changed.append(True)
        if body.leaving:
            # The agent is going away (scancel, end of the allocation or of its grace time): its GPUs
            # leave with it from this moment, whatever Slurm says a poll later.
            # GONE, not LOST: nothing about them is unknown
            move_gpus(self, alloc_id, (G.UP, G.DRAINING, G.LOST), G.GONE, "agent leaving")
            return [], True
        if body.draining:
            changed.append(self._drain(alloc_id))
        else:
            move_gpus(self, alloc_id, (G.LOST,), G.UP, "agent reporting again")
        return [w.as_dict() for w in self.desired.of(alloc_id)], any(changed)

    def _answer(self, desired: list[dict], digest: str | None) -> dict:
        return {
            "epoch": self.epoch,
            "desired": desired,
            "desired_hash": digest,
            "heartbeat_s": self.heartbeat_s,
            # how long ago the control loop last ran: an agent treats a daemon whose loop is stuck like one
            # it cannot reach (its lent GPUs' return must not wait on it)
            "loop_age_s": round(max(0.0, self.clock() - self.loop_at), 3),
        }

    def _drain(self, alloc_id: int) -> bool:
        """A preemption notice reached the agent: its GPUs are leaving and its workers take no new
        requests from now on, before the drain ends and before Slurm's next poll says so."""
        hit = move_gpus(self, alloc_id, (G.UP, G.LOST), G.DRAINING, "agent draining")
        for w in self.store.fleet.workers(self.run_id, allocation_id=alloc_id):
            if w.routable:
                self.store.update_fields("workers", w.id, epoch=self.epoch, event="agent draining", routable=0)
                hit = True
        return hit

    def _moving_places(self, alloc_id: int, gpus: list[dict]) -> set[tuple[int, int]]:
        """(allocation, GPU index) of the allocation's GPUs (``gpus``, its rows) that an open transition is moving."""
        ids: set[int] = set()
        for t in self.store.transitions.open(self.run_id):
            ids.update(t.gpu_ids)
        if not ids:
            return set()
        return {(alloc_id, g.idx) for g in gpus if g.id in ids}

    def _record_worker(
        self, alloc: dict, report: bodies.WorkerReport, draining: bool, moving: set[tuple[int, int]], lent: set[int]
    ) -> bool:
        """Fold one reported worker into state: create it, move it along legal edges, keep its facts.
        Returns whether its state moved. ``moving``: GPUs an open transition moves (their workers are
        routed by its REGISTER / DEREGISTER steps only); ``lent``: the allocation's GPU indices lent now."""
        key, state = report.key, report.state
        fields = {k: v for k in ("url", "pid", "weight_version", "ready_s") if (v := getattr(report, k)) is not None}
        worker = self._current_row(alloc, report)
        created = worker is None
        # a fact that changed moves the worker too: VERIFY waits for the trainer's weights, which a worker that
        # reloads them reports with no change of state
        facts_moved = not created and any(getattr(worker, k) != v for k, v in fields.items())
        if worker is None:
            if state in (W.STOPPED, W.FAILED):
                return False
            wid = self.store.fleet.add_worker(
                run_id=self.run_id,
                allocation_id=alloc.id,
                role=report.role,
                engine=report.engine,
                epoch=self.epoch,
                **fields,
            )
            self.store.update_fields("workers", wid, epoch=self.epoch, worker_key=key, gpu_idx=list(report.gpus))
            worker = self.store.fleet.worker(wid)
        elif facts_moved:
            version = fields.get("weight_version")
            loaded = version is not None and version != worker.weight_version  # journaled: when it began to serve it
            event, data = ("serving weights", {"version": version}) if loaded else (None, None)
            if event is None and fields.get("ready_s") is not None and worker.ready_s is None:
                event, data = "cold start measured", {"ready_s": fields["ready_s"]}  # a cost, journaled
            self.store.update_fields("workers", worker.id, epoch=self.epoch, event=event, data=data, **fields)
        current = worker.state
        moved = created or facts_moved or current != state
        if current != state:
            path = edge_path("workers", current, state)
            if not path:
                self.store.journal_event(
                    self.run_id,
                    "workers",
                    str(worker.id),
                    "unexpected report",
                    data={"state": current, "reported": state},
                    epoch=self.epoch,
                )
            for step in path:
                self.store.set_state(
                    "workers",
                    worker.id,
                    expect=current,
                    to=step,
                    epoch=self.epoch,
                    event="agent reported",
                    data={"reported": state, **({"error": report.error} if report.error and step == W.FAILED else {})},
                )
                current = step
        on_lent = not lent.isdisjoint(report.gpus)
        if report.engine == Engine.VLLM and (self._pool_of(alloc)["name"] != PoolKind.TRAINER or on_lent):
            # a worker of a rollout/elastic/reward pool, or on trainer GPUs lent now, takes traffic while READY
            # (and not draining for a preemption) — unless a transition moves its GPUs: then its REGISTER and
            # DEREGISTER steps decide (this may only take it out). So a worker that a lent GPU's agent started
            # again after a crash serves again, as on a rollout GPU. A judge (REWARD) takes only the requests that
            # name its model: the run's router keeps it apart (pearlctl/router/routing.py).
            routable = int(current == W.READY and not draining)
            held = any((alloc.id, i) in moving for i in report.gpus)
            if routable != self.store.fleet.worker(worker.id).routable and not (held and routable):
                self.store.update_fields("workers", worker.id, epoch=self.epoch, routable=routable)
        return moved

    def _current_row(self, alloc: dict, report: bodies.WorkerReport):
        """The row that ``report`` folds into: ends a row whose process was replaced, archives an ended row
        that a new process reuses the key of (then None: the caller creates a fresh row)."""
        key, state = report.key, report.state
        worker = next(
            (w for w in self.store.fleet.workers(self.run_id, allocation_id=alloc.id) if w.worker_key == key),
            None,
        )
        replaced = (
            worker is not None
            and worker.state not in (W.STOPPED, W.FAILED)
            and report.pid is not None
            and worker.pid not in (None, report.pid)
        )
        if replaced:
            # another process under the key (the allocation ran again after a requeue, or its agent restarted
            # the engine): the row's process is gone — it ends here, and the new process gets a row of its own
            ended = W.STOPPED if edge_path("workers", worker.state, W.STOPPED) else W.FAILED
            for step in edge_path("workers", worker.state, ended):
                self.store.set_state(
                    "workers",
                    worker.id,
                    expect=self.store.fleet.worker(worker.id).state,
                    to=step,
                    epoch=self.epoch,
                    event="replaced by a new process",
                    data={"pid": worker.pid, "new_pid": report.pid},
                )
            worker = self.store.fleet.worker(worker.id)
        if worker is not None and worker.state in (W.STOPPED, W.FAILED) and state not in (W.STOPPED, W.FAILED):
            # a new process under a key whose last one ended (a second borrow, a requeue): archive the old row
            self.store.update_fields("workers", worker.id, epoch=self.epoch, worker_key=f"{key}#{worker.id}")
            worker = None
        return worker

    def _pool_of(self, alloc: dict) -> dict:
        return next(p for p in self.store.runs.pools(self.run_id) if p["id"] == alloc.pool_id)

    def routable_workers(self) -> dict:
        """READY, registered rollout workers (the policy's, never a judge): where rollout clients may send requests
        now. ``seen_at``: when the worker's agent last reported (a client that saw a worker fail trusts it again
        after that).

        ``joining``: how many workers are on their way to serving rollouts — the GPUs of open (PLANNED or
        RUNNING) transitions to ROLLOUT, PREFILL or DECODE (a borrow, start, wake or switch), one worker per
        allocation and role as ``desired`` runs them. A driver about to launch a batch waits a little for them
        (pearlctl/router/client.py, RolloutClient.wait_for_joining)."""
        allocations = self.store.fleet.allocations(self.run_id, cached=True)  # the times: ours are newer than its
        seen = {a.id: self.liveness.heard_at(a) for a in allocations}
        workers = [
            {
                "id": w.id,
                "url": w.url,
                "role": w.role,
                "weight_version": w.weight_version,
                "seen_at": seen.get(w.allocation_id),
            }
            for w in self.store.fleet.workers(self.run_id)
            if w.routable and w.state == W.READY and w.url and w.role in GENERATION_ROLES
        ]
        moving = [
            t
            for t in self.store.transitions.all(self.run_id, states=(T.PLANNED, T.RUNNING))
            if t.to_role in GENERATION_ROLES
        ]
        joining = 0
        if moving:  # the GPU rows only then: most answers have nothing joining
            alloc_of = {g.id: g.allocation_id for g in self.store.fleet.gpus(self.run_id)}
            joining = len({(alloc_of.get(i), t.to_role) for t in moving for i in t.gpu_ids})
        return {"epoch": self.epoch, "workers": workers, "joining": joining}
