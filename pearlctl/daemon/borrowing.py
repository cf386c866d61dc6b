"""Borrowing idle trainer GPUs under a policy, and returning them before the trainer needs them.

Each tick: advance open transitions (aborting a borrow whose return deadline is too close); with GPUs
lent, start their return early enough to meet the deadline — the deadline minus the running estimate
of a return's duration — or at once when the trainer blocks waiting for them or borrowing was turned
off; with nothing lent and nothing moving, ask the policy how many idle trainer GPUs to lend.

The return deadline comes from the trainer's own report: when it said it would wait, plus how long it
said. Whether a return met its deadline is journaled (``deadline met`` / ``deadline missed`` with the
lateness) and counted in the metrics.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from types import ModuleType

from pearlctl import home
from pearlctl.daemon.transitions import Executor
from pearlctl.state.machines import GpuState as G
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.store import Store

DEFAULT_COST_S = {"borrow": 30.0, "return": 15.0}  # before any transition was measured (CPU vLLM start ~20 s)


class PolicyError(Exception):
    pass


def load_policy(name: str) -> ModuleType:
    """A policy module by name from $PEARL_POLICY_PATH or policies/; it must define borrow_gpus(view)."""
    for d in home.policy_dirs():
        path = d / f"{name}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(f"pearl_policy_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            if not callable(getattr(module, "borrow_gpus", None)):
                raise PolicyError(f"policy {name} ({path}) defines no borrow_gpus(view)")
            return module
    raise PolicyError(f"no policy {name!r}; known: {', '.join(home.known_policies())}")


class Borrowing:
    def __init__(self, store: Store, executor: Executor, run_id: str, *, clock=time.time):
        self.store, self.executor, self.run_id, self.clock = store, executor, run_id, clock
        self._policies: dict[str, ModuleType] = {}

    def settings(self) -> dict:
        run = self.store.get_run(self.run_id)
        return run.get("borrow") or {"policy": run.get("policy") or "never", "max_gpus": None}

    def cost(self, kind: str) -> float:
        """Running estimate of a transition's duration: the median of the last 5 that completed."""
        done = [
            t["updated_at"] - t["created_at"]
            for t in self.store.transitions(self.run_id)
            if t["kind"] == kind and t["state"] == T.DONE
        ]
        return statistics.median(done[-5:]) if done else DEFAULT_COST_S[kind]

    def trainer_gpus(self) -> list[dict]:
        pools = {p["id"]: p for p in self.store.pools(self.run_id)}
        allocs = {a["id"]: a for a in self.store.allocations(self.run_id)}
        return [
            g
            for g in self.store.gpus(self.run_id)
            if g["state"] == G.UP and pools[allocs[g["allocation_id"]]["pool_id"]]["name"] == "trainer"
        ]

    def view(self, now: float, settings: dict | None = None) -> dict:
        """What a policy sees (pure data). ``settings``: borrowing settings to assume (default: the run's)."""
        trainer = self.store.get_run(self.run_id).get("trainer") or {}
        settings = settings or self.settings()
        wait = trainer.get("expected_wait_s")
        since = trainer.get("phase_since") or trainer.get("reported_at")
        left = (since + wait - now) if wait is not None and since else 0.0
        idle = [g for g in self.trainer_gpus() if not g["borrowed"]]
        return {
            "phase": trainer.get("phase"),
            "wait_left_s": left,
            "idle_gpus": len(idle),
            "max_gpus": settings.get("max_gpus"),
            "borrow_cost_s": self.cost("borrow"),
            "return_cost_s": self.cost("return"),
            "released": bool(trainer.get("released")),
        }

    def plan_borrow(self, now: float, settings: dict | None = None) -> dict | None:
        """What a borrow would do now: GPUs, deadline (None: the policy declines). Pure read.
        ``settings``: borrowing settings to assume (``borrow --dry-run``); default: the run's."""
        settings = settings or self.settings()
        policy = self._policies.get(settings["policy"]) or load_policy(settings["policy"])
        self._policies[settings["policy"]] = policy
        view = self.view(now, settings)
        n = int(policy.borrow_gpus(view))
        if n <= 0:
            return None
        # GPUs where a returned worker sleeps come first: waking it costs far less than a cold start
        idle = sorted(
            (g for g in self.trainer_gpus() if not g["borrowed"]),
            key=lambda g: (g["worker_id"] is None, g["allocation_id"], g["idx"]),
        )
        chosen = idle[:n]
        parked = {g["worker_id"] for g in chosen}
        warm = len(parked) == 1 and None not in parked and self._asleep(parked.pop())
        keep_warm = settings.get("keep_warm", True)
        return {
            "gpu_ids": [g["id"] for g in chosen],
            "gpus": [(g["node"], g["idx"]) for g in chosen],
            "return_deadline": now + view["wait_left_s"],
            "policy": settings["policy"],
            "plan": "borrow_warm" if warm else "borrow",
            "rollback": "return_sleep" if keep_warm else "return",
            "view": view,
        }

    def _unpark(self) -> None:
        """Keeping workers warm was turned off: parked workers are no longer desired (their agents stop them)."""
        for g in self.trainer_gpus():
            if g["worker_id"] is not None and not g["borrowed"]:
                self.store.update_fields(
                    "gpus",
                    g["id"],
                    epoch=self.executor.epoch,
                    event="unparked",
                    data={"worker_id": g["worker_id"]},
                    worker_id=None,
                )

    def _asleep(self, worker_id: int) -> bool:
        return self.store.get("workers", worker_id)["state"] == "SLEEPING"

    def tick(self) -> None:
        now = self.clock()
        moving = self.executor.open_transitions()
        for t in moving:
            deadline = (t.get("detail") or {}).get("return_deadline")
            if t["kind"] == "borrow" and t["state"] == T.RUNNING and deadline and now >= deadline - self.cost("return"):
                self.executor.abort(t["id"], "return deadline reached during the borrow")
            state = self.executor.advance(t["id"])
            if t["kind"] == "return" and state == T.DONE:
                self._judge_return(t)
        if self.executor.open_transitions():
            return
        if not self.settings().get("keep_warm", True):
            self._unpark()
        lent = [g for g in self.trainer_gpus() if g["borrowed"]]
        if lent:
            deadline = min(g["return_deadline"] or now for g in lent)
            trainer = self.store.get_run(self.run_id).get("trainer") or {}
            why = None
            if self.settings()["policy"] == "never":
                why = "borrowing turned off"
            elif trainer.get("blocked_s") is not None:
                why = "the trainer is waiting for its GPUs"
            elif now >= deadline - self.cost("return"):
                why = "return deadline"
            if why:
                plan = "return_sleep" if self.settings().get("keep_warm", True) else "return"
                self.executor.plan(
                    "return", [g["id"] for g in lent], detail={"return_deadline": deadline, "why": why, "plan": plan}
                )
            return
        plan = self.plan_borrow(now)
        if plan is not None:
            self.executor.plan(
                "borrow",
                plan["gpu_ids"],
                detail={k: plan[k] for k in ("return_deadline", "policy", "plan", "rollback")},
            )

    def _judge_return(self, t: dict) -> None:
        deadline = (t.get("detail") or {}).get("return_deadline")
        if deadline is None:
            return
        finished = self.store.get("transitions", t["id"])["updated_at"]
        late = finished - deadline
        self.store.journal_event(
            self.run_id,
            "transitions",
            str(t["id"]),
            "deadline missed" if late > 0 else "deadline met",
            data={"lateness_s": round(late, 3)},
            epoch=self.executor.epoch,
        )
