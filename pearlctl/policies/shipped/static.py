"""Policy `static`: the fixed-resource baseline (ROLL-like). Rollout runs on the rollout pool only, colocated
prefill + decode, with every whole worker the pool holds; idle rollout-pool GPUs are started (or woken).
It never borrows trainer GPUs and never uses elastic GPUs: lent or elastic GPUs still serving (left by
another policy) are returned or retired. No gating — the target does not depend on the work.

Loaded by name (pearlctl.policies.load_policy); pure: ``decide(snapshot) -> Plan | None``.
"""

from __future__ import annotations

from pearlctl.planner import plan, view
from pearlctl.planner.choose import choose
from pearlctl.planner.model import Mode, Plan, Snapshot, Target

NAME = "static"


def decide(snapshot: Snapshot) -> Plan | None:
    gpus = view.may_serve(snapshot, elastic=False, borrow=False)
    choice = choose(snapshot, gpus, modes=(Mode.COLOCATED,))
    # no whole worker to serve on: still return lent GPUs and retire the rest
    target = choice.target if choice is not None else Target(Mode.COLOCATED, rollout_gpus=0)
    return plan.make_if_moves(snapshot, target, why="static: the rollout pool, colocated")
