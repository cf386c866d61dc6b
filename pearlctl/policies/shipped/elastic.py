"""Policy `elastic`: the elastic baseline (RLBoost-like). Rollout runs colocated on the rollout pool plus
every elastic GPU granted now (except one whose allocation ends before a worker could come up on it); it
never borrows trainer GPUs (lent ones left by another policy are returned). No gating: elastic capacity is
used as soon as it is granted and dropped when it goes.

Loaded by name (pearlctl.policies.load_policy); pure: ``decide(snapshot) -> Plan | None``.
"""

from __future__ import annotations

from pearlctl.planner import plan, view
from pearlctl.planner.choose import choose
from pearlctl.planner.model import Mode, Plan, Snapshot, Target

NAME = "elastic"


def decide(snapshot: Snapshot) -> Plan | None:
    gpus = view.may_serve(snapshot, elastic=True, borrow=False)
    choice = choose(snapshot, gpus, modes=(Mode.COLOCATED,))
    # no whole worker to serve on: still return lent GPUs and retire the rest
    target = choice.target if choice is not None else Target(Mode.COLOCATED, rollout_gpus=0)
    return plan.make_if_moves(snapshot, target, why="elastic: rollout + elastic pools, colocated")
