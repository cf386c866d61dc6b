"""The daemon's controller: its shared state (pearlctl.daemon.shared) and its three sides, split by who calls
them — ``agents`` (pearlctl.daemon.agents: registrations, heartbeats; with ``desired``, pearlctl.daemon.desired:
the workers each allocation should run, and ``liveness``, pearlctl.daemon.liveness: agent loss),
``trainer`` (pearlctl.daemon.trainer_side: the trainer hook's phase and acks, the rollout driver's progress)
and ``operator`` (pearlctl.daemon.operator: borrow, return, move, profile).

Every method takes a typed, validated body (pearlctl.api.bodies); what an agent may do is bounded by its
allocation credential (pearlctl.daemon.agents).
"""

from __future__ import annotations

from typing import Any

from pearlctl.daemon.agents import Agents
from pearlctl.daemon.desired import Desired
from pearlctl.daemon.liveness import Liveness
from pearlctl.daemon.operator import Operator
from pearlctl.daemon.shared import ControlError, Shared
from pearlctl.daemon.trainer_side import TrainerSide
from pearlctl.state.store import Store

__all__ = ["ControlError", "Controller"]


class Controller(Shared):
    """The shared state, and each caller's side of it."""

    def __init__(self, store: Store, run_id: str, epoch: int, **options: Any):
        """``options``: the shared state's (``Shared``: heartbeat_s, lost_after, secret, on_deposed, clock)."""
        super().__init__(store, run_id, epoch, **options)
        self.liveness = Liveness(self)
        self.desired = Desired(self)
        self.agents = Agents(self, self.liveness, self.desired)
        self.trainer = TrainerSide(self)
        self.operator = Operator(self)
