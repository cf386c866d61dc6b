"""Reconciliation: the agent makes the workers it runs match the daemon's desired state, and returns lent GPUs by
itself when it must.

`Reconciler.apply` starts what is missing, retires what is no longer wanted (in the background, so the heartbeat
never waits for a drain), parks and wakes vLLM workers on trainer GPUs, has each worker serve the desired weight
version, and restarts a failed worker after a back-off (`restart_wait`). While the daemon cannot be reached,
`Reconciler.return_lent` stops a worker on lent trainer GPUs in time for its return deadline and tells the trainer
on this node through a node-local file (`return_file`). The workers themselves, one engine process group each,
are in pearlctl/agent/workers.py.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from pearlctl.agent.identity import Identity
from pearlctl.agent.workers import CommandWorker, VllmWorker, WorkerHandle
from pearlctl.host.runfiles import write_atomic
from pearlctl.host.weight_store import NodeStore
from pearlctl.vocabulary import Role, ServingEngine

log = logging.getLogger("pearlctl.agent")

# A worker that fails is restarted after RESTART_BACKOFF_S, and each further failure before it is READY doubles
# the wait, up to RESTART_BACKOFF_MAX_S: an engine that cannot start (a bad engine argument, a missing model)
# does not reload the model every few seconds for ever. A worker that reached READY starts the count afresh.
RESTART_BACKOFF_S = 10.0
RESTART_BACKOFF_MAX_S = 300.0


def restart_wait(failures: int) -> float:
    """Seconds before the restart that follows ``failures`` failures in a row (1 for the first)."""
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** max(0, failures - 1))


def return_file(me: Identity) -> Path:
    """Where this allocation's agent tells its trainer, on the node itself, that it returned lent GPUs
    (node-local: no daemon and no shared filesystem in the path). The trainer gets it as PEARL_RETURN_FILE
    and reads it in pearlctl.trainer.channel."""
    base = os.environ.get("PEARL_NODE_DIR") or os.path.join(tempfile.gettempdir(), "pearl")
    return Path(base, me.run_id or "run", f"{me.job_id}_{me.task_id}", "returned.json")


class Reconciler:
    """Makes the running workers match the daemon's desired state, and returns lent GPUs by itself when it
    must (``return_lent``). Thread-safe: the agent's main loop and its return watchdog both call it."""

    # A return without the daemon stops the lent worker (drain what finishes, abort the rest, SIGTERM,
    # SIGKILL), where the daemon's own return parks it in far less time (its ``return_by`` is the deadline
    # less that parking's measured cost). So the agent's return starts early enough for its stop to end
    # before the deadline: the stop gets SELF_RETURN_STOP_S, and STOP_OVERRUN_S is what a stop may take
    # beyond its budget (VllmWorker.stop's floors for the abort and the SIGTERM, the SIGKILL's reaping).
    SELF_RETURN_STOP_S = 4.0
    STOP_OVERRUN_S = 2.0

    def __init__(self, me: Identity, run_dir: str, env: dict[str, str] | None = None, *, drain_timeout: float = 30.0):
        self.me, self.run_dir = me, run_dir
        self.env = dict(os.environ if env is None else env)
        self.drain_timeout = drain_timeout
        self.workers: dict[str, WorkerHandle] = {}
        self.retiring: dict[str, WorkerHandle] = {}
        self.wanted: dict[str, dict] = {}  # the desired workers the latest apply ran (catch_up reads them)
        self.failed_at: dict[str, float] = {}  # key -> when its current failure was seen (monotonic)
        self.failures: dict[str, int] = {}  # key -> failures in a row since it was last READY
        self.clock = time.monotonic
        self.return_file = return_file(me)
        self.lent: dict[str, dict] = {}  # key -> its desired entry, for workers on lent GPUs (with deadlines)
        self.returned: dict[str, float] = {}  # key -> the deadline of a lending this agent ended itself
        self.self_returns: list[dict] = []  # returns not yet reported to the daemon
        self.store = NodeStore.for_node(me.run_id, me.node)  # this node's weight store, shared by the run's agents
        self._lock = threading.RLock()

    def _make(self, want: dict) -> WorkerHandle | None:
        gpus = tuple(want["gpus"])
        if want["engine"] == "vllm":
            # the model and engine args of this allocation's pool, unless the daemon names others: a role whose model
            # is not the pool's (a judge on a rollout GPU, the policy on a reward pool's: pearlctl.daemon.desired)
            args = want.get("engine_args")
            if not isinstance(args, dict):
                args = json.loads(self.env.get("PEARL_ENGINE_ARGS") or "{}")
            model = want.get("model") or self.env["PEARL_MODEL"]
            if self.env.get("PEARL_ENGINE") == ServingEngine.PACED:
                return VllmWorker(
                    want["key"], want["role"], gpus, self.me, self.run_dir, model, args,
                    paced_profile=self.env.get("PEARL_ENGINE_PROFILE"), store=self.store,
                )  # fmt: skip
            # a model this node's store holds (the judge: ``prefetch``) loads from there, served under its own name
            local = self.store.model(model)
            if local is None and want["role"] == Role.REWARD:
                log.warning("worker %s reads the judge %s from shared disk (not in the store)", want["key"], model)
            return VllmWorker(
                want["key"], want["role"], gpus, self.me, self.run_dir, str(local or model), args,
                served_model_name=model if local is not None else None, store=self.store,
            )  # fmt: skip
        argv = json.loads(self.env.get("PEARL_TRAIN_COMMAND") or "null")
        if not argv:
            return None  # this trainer pool runs no training command under the agent
        return CommandWorker(
            want["key"],
            want["role"],
            gpus,
            self.me,
            self.run_dir,
            argv,
            {
                "PEARL_ALLOCATION_GPUS": ",".join(map(str, gpus)),
                "PEARL_RETURN_FILE": str(self.return_file),
                "PEARL_WEIGHT_STORE": str(self.store.versions),  # this node's copy of each exported version
                **self.me.rendezvous_env(),  # one trainer across the nodes of a multi-node job
            },
        )

    def apply(self, desired: list[dict], now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self.lent = {d["key"]: d for d in desired if d.get("return_deadline") is not None}
            # a lending this agent already ended (or whose deadline passed) is never served again: the
            # daemon's next plan returns the GPUs properly
            self.returned = {
                k: dl for k, dl in self.returned.items() if k in self.lent and self.lent[k]["return_deadline"] == dl
            }
            wanted = {
                d["key"]: d
                for d in desired
                if d.get("state", "RUNNING") in ("RUNNING", "SLEEPING")
                and not (d["key"] in self.lent and (d["key"] in self.returned or d["return_deadline"] <= now))
            }
            self._apply(wanted)

    def _apply(self, wanted: dict[str, dict]) -> None:
        self.wanted = wanted
        for key in list(self.workers):
            if key not in wanted:
                self.retire(key)
        now = self.clock()
        for key, want in wanted.items():
            handle = self.workers.get(key)
            if want.get("state") == "SLEEPING":
                if isinstance(handle, VllmWorker):  # parked on trainer GPUs: asleep until the next borrow
                    handle.park(self.drain_timeout)
                continue  # nothing running under that key: nothing to park
            state = handle.state() if handle is not None else None
            if state == "READY":
                self.failures.pop(key, None)
            if state == "FAILED":
                if key not in self.failed_at:
                    self.failed_at[key] = now
                    self.failures[key] = self.failures.get(key, 0) + 1
                    log.warning(
                        "worker %s failed (%s); failure %d in a row, restarting in %.0fs",
                        key,
                        handle.failure(),
                        self.failures[key],
                        restart_wait(self.failures[key]),
                    )
                if now - self.failed_at[key] < restart_wait(self.failures[key]):
                    continue
                log.warning("restarting failed worker %s", key)
                self.workers.pop(key)
                handle = None
            if handle is None and key not in self.retiring:
                handle = self._make(want)
                if handle is None:
                    continue
                self.failed_at.pop(key, None)
                handle.start()
                self.workers[key] = handle
            if isinstance(handle, VllmWorker):
                handle.unpark()
                handle.sync_weights_soon(want.get("weights"))

    def catch_up(self) -> None:
        """Between the daemon's answers: a vLLM worker that has become READY since the latest apply loads the
        weights that apply asked for now, so its report as READY names them as soon as they load (the daemon's
        VERIFY passes on it) instead of one long poll later. Each worker reloads on its own GPUs in the
        background (`VllmWorker.sync_weights_soon`): a node's workers take the time of one reload, at once (the
        planner's ``weight_sync_s`` is one reload), and the heartbeat goes on meanwhile."""
        with self._lock:
            for key, want in self.wanted.items():
                handle = self.workers.get(key)
                if isinstance(handle, VllmWorker):
                    handle.sync_weights_soon(want.get("weights"))

    def reloading(self) -> bool:
        """Whether a worker's weights are being reloaded (the agent reports as soon as one ends)."""
        with self._lock:
            return any(isinstance(h, VllmWorker) and h.reloading for h in self.workers.values())

    def return_lent(self, now: float | None = None, *, early_s: float = 0.0) -> list[str]:
        """The daemon cannot be reached and a lent GPU's return must start: stop its worker here, then tell
        the trainer on this node (the return file) and, later, the daemon (``self_returns``). Returns the
        keys whose return started. Idempotent: a lending is returned once.

        Starts at the lending's ``return_by``, or earlier where the stop needs more (the class's
        SELF_RETURN_STOP_S and STOP_OVERRUN_S before the deadline). ``early_s``: that much earlier still —
        the time it took to notice that the daemon is gone, so that a daemon lost just before the start
        still costs no lateness."""
        now = time.time() if now is None else now
        started = []
        with self._lock:
            for key, want in self.lent.items():
                deadline = float(want["return_deadline"])
                by = min(
                    float(want.get("return_by") or deadline), deadline - self.SELF_RETURN_STOP_S - self.STOP_OVERRUN_S
                )
                if key in self.returned or now < by - early_s:
                    continue
                self.returned[key] = want["return_deadline"]
                handle = self.workers.pop(key, None)
                if handle is not None:
                    self.retiring[key] = handle
                budget = max(0.5, min(self.drain_timeout, deadline - now - self.STOP_OVERRUN_S))
                threading.Thread(
                    target=self._return_one, args=(key, want, handle, budget), name=f"return-{key}", daemon=True
                ).start()
                started.append(key)
        return started

    def _return_one(self, key: str, want: dict, handle: WorkerHandle | None, budget: float) -> None:
        if handle is not None:
            try:
                handle.stop(budget)
            except Exception as exc:  # stop() kills the process group in the end; note it and go on
                log.warning("stopping lent worker %s failed: %s", key, exc)
        returned = {
            "returned_at": time.time(),
            "deadline": want["return_deadline"],
            "gpus": list(want["gpus"]),
            "worker_key": key,
            "how": "stopped",
        }
        write_atomic(self.return_file, json.dumps(returned), mode=0o644)  # the trainer sees the whole file or none
        with self._lock:
            self.self_returns.append(
                {k: returned[k] for k in ("gpus", "worker_key", "deadline", "how")} | {"at": returned["returned_at"]}
            )
        log.warning("returned lent GPUs %s (worker %s) without the daemon", returned["gpus"], key)

    def take_self_returns(self) -> list[dict]:
        with self._lock:
            out, self.self_returns = self.self_returns, []
            return out

    def put_back_self_returns(self, returns: list[dict]) -> None:
        with self._lock:
            self.self_returns[:0] = returns

    def retire(self, key: str) -> None:
        with self._lock:
            handle = self.workers.pop(key)
            self.retiring[key] = handle

        def run() -> None:
            handle.stop(self.drain_timeout)

        threading.Thread(target=run, name=f"retire-{key}", daemon=True).start()

    def retire_all(self) -> None:
        """Drain and stop every worker in the background (a preemption notice): the agent keeps reporting."""
        with self._lock:
            for key in list(self.workers):
                self.retire(key)

    def settled(self) -> bool:
        """No worker is still draining towards its stop."""
        with self._lock:
            return all(h.state() in ("STOPPED", "FAILED") for h in self.retiring.values())

    def report(self) -> list[dict]:
        """Every worker's state; a retired one until the daemon has seen it STOPPED or FAILED."""
        with self._lock:
            handles = [*self.workers.values(), *self.retiring.values()]
        return [h.report() for h in handles]

    def delivered(self, report: list[dict]) -> None:
        """The daemon has this report: retired workers it saw ended need not be reported again."""
        with self._lock:
            for r in report:
                if r["state"] in ("STOPPED", "FAILED") and r["key"] in self.retiring:
                    del self.retiring[r["key"]]

    def join_store(self) -> None:
        """At the agent's start: this agent uses the node's weight store (it stays while one of the run's agents
        on the node lives), and copies into it, in the background, the models any of its GPUs may be asked to
        serve besides its pool's (``PEARL_STORE_MODELS``: the judge), so that a shift loads from the node."""
        try:
            self.store.join(os.getpid())
        except OSError as exc:
            log.warning("cannot use this node's weight store %s (%s): workers read shared disk", self.store.root, exc)
            return
        try:
            models = [str(m) for m in json.loads(self.env.get("PEARL_STORE_MODELS") or "[]")]
        except (ValueError, TypeError) as exc:
            log.warning("PEARL_STORE_MODELS is not a JSON list of models (%s): nothing copied ahead", exc)
            return
        if models:
            threading.Thread(target=self.prefetch, args=(models,), name="store-prefetch", daemon=True).start()

    def prefetch(self, models: list[str]) -> None:
        for model in models:
            t0 = time.monotonic()
            local = self.store.fetch_model(model)
            if local is not None:
                log.warning("node store: model %s is at %s (%.1f s)", model, local, time.monotonic() - t0)

    def leave_store(self) -> None:
        """At the agent's exit (its allocation ends; its workers have stopped): the node's weight store is freed
        (shared memory is RAM) if no other agent of the run lives on this node."""
        try:
            self.store.leave(os.getpid())
        except OSError as exc:
            log.warning("cannot leave this node's weight store %s (%s)", self.store.root, exc)

    def stop_all(self, drain_timeout: float) -> float:
        """Drain and stop every worker (shutdown); returns the seconds it took."""
        t0 = time.monotonic()
        threads = []
        with self._lock:
            for key in list(self.workers):
                handle = self.workers.pop(key)
                self.retiring[key] = handle
                t = threading.Thread(target=handle.stop, args=(drain_timeout,), daemon=True)
                t.start()
                threads.append(t)
        for t in threads:
            t.join(drain_timeout + 15)
        while not self.settled() and time.monotonic() - t0 < drain_timeout + 15:
            time.sleep(0.1)  # a retirement started earlier (a preemption's drain) is still finishing
        return time.monotonic() - t0
