"""Policy `greedy`: lend every idle trainer GPU (up to the cap) whenever the trainer waits for rollouts
long enough for a borrow and its return to fit in the wait; give them back only when they must go.

It weighs nothing else — not whether rollout needs the GPUs, not what they would gain — so it needs no
engine profile: the cost-aware policy is `pearl`. The pool rules (trainer waiting, ``max_lend``, a borrow
plus its return fitting before the trainer's deadline, with a slack) are the planner's
(pearlctl.planner.budget), shared with every policy. Loaded by name; pure: ``decide(snapshot)``.
"""

from __future__ import annotations

from dataclasses import replace

from pearlctl.planner import plan, view
from pearlctl.planner.model import Plan, Snapshot

NAME = "greedy"


def decide(snapshot: Snapshot) -> Plan | None:
    current = plan.current_target(snapshot)
    lend = view.lendable(snapshot)
    target = replace(current, rollout_gpus=current.rollout_gpus + len(lend), lend=current.lend + len(lend))
    why = f"greedy: lend {len(lend)} idle trainer GPU(s)" if lend else "greedy"
    return plan.make_if_moves(snapshot, target, why=why)
