"""Policy `never`: no borrowing. Lent GPUs go back (the daemon returns them as soon as borrowing is turned
off); nothing is lent. Loaded by name; pure: ``decide(snapshot)``."""

from __future__ import annotations

from dataclasses import replace

from pearlctl.planner import plan
from pearlctl.planner.model import Plan, Snapshot

NAME = "never"


def decide(snapshot: Snapshot) -> Plan | None:
    current = plan.current_target(snapshot)
    if not current.lend:
        return None
    back = replace(current, rollout_gpus=current.rollout_gpus - current.lend, lend=0)
    return plan.make(snapshot, back, why="never: every lent GPU goes back")
