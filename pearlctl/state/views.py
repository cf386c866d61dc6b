"""Read-only compositions of state that several readers share (the CLI, the daemon's API)."""

from __future__ import annotations

from pearlctl.state.machines import StepState as S
from pearlctl.state.machines import TransitionState as T
from pearlctl.state.rows import Transition
from pearlctl.state.store import Store


def run_document(store: Store, run_id: str) -> dict:
    """The status document: stable top-level keys, values straight from state. A FAILED worker carries
    ``error``: why, as its agent reported it (journaled on its move to FAILED)."""
    reasons = store.journal.failure_reasons(run_id)
    return {
        "run": store.runs.get(run_id),
        "pools": store.runs.pools(run_id),
        "allocations": [a.to_dict() for a in store.fleet.allocations(run_id)],
        "nodes": store.runs.nodes(run_id),
        "gpus": [g.to_dict() for g in store.fleet.gpus(run_id)],
        "workers": [_with_error(w.to_dict(), reasons.get(w.id)) for w in store.fleet.workers(run_id)],
        "transitions": [_with_current_step(store, t) for t in store.transitions.all(run_id)],
    }


def _with_error(worker: dict, error: str | None) -> dict:
    return worker if error is None else dict(worker, error=error)


def _with_current_step(store: Store, t: Transition) -> dict:
    """A transition with ``current_step``: the kind of its first step not DONE (None when finished)."""
    if t.state in (T.DONE, T.ROLLED_BACK, T.FAILED):
        return dict(t.to_dict(), current_step=None)
    pending = [s for s in store.transitions.steps(t.id) if s.state != S.DONE]
    return dict(t.to_dict(), current_step=pending[-1].kind if pending else None)
