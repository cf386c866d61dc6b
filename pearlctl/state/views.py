"""Read-only compositions of state that several readers share (the CLI, the daemon's API)."""

from __future__ import annotations

from pearlctl.state.store import Store


def run_document(store: Store, run_id: str) -> dict:
    """The status document: stable top-level keys, values straight from state."""
    return {
        "run": store.get_run(run_id),
        "pools": store.pools(run_id),
        "allocations": store.allocations(run_id),
        "nodes": store.nodes(run_id),
        "gpus": store.gpus(run_id),
        "workers": store.workers(run_id),
        "transitions": store.transitions(run_id),
    }
