"""What a registration or a poll says an allocation's GPUs are, made so in the ``gpus`` table.

``plan_node_gpus`` is the pure row logic: from the allocation's existing GPU rows and the indices reported
on a node, the changes to make (register, revive, move, gone). ``write_node_gpus`` applies them inside the
caller's write transaction of the Store's core, each with its journal row, state changes by
compare-and-set (the core's ``_cas``, pearlctl/state/core.py). A GPU given a role (registered, or back from
GONE) journals ``gpu.registered`` with that role as ``data.role`` (what pearlctl.ops.timeline reads); a LOST
one back keeps its role and its row names none. Idempotent: reporting the same GPUs again plans no change.
Reached through ``store.fleet.upsert_node_gpus``, which validates, fences and opens the transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pearlctl.state.core import Core
from pearlctl.state.db import insert
from pearlctl.state.machines import GpuState, machine

Existing = Mapping[int, tuple[int, str, int]]  # idx -> (gpu id, state, node id)


@dataclass(frozen=True)
class GpuChange:
    """One change to one GPU row: ``new`` (insert), ``revive`` (GONE/LOST to UP), ``move`` (node), ``gone``."""

    kind: Literal["new", "revive", "move", "gone"]
    idx: int
    gpu_id: int | None = None
    state: str | None = None  # the state a revive or gone expects (compare-and-set)
    columns: dict[str, Any] = field(default_factory=dict)


def plan_node_gpus(existing: Existing, indices: Sequence[int], node_id: int, role: str) -> list[GpuChange]:
    """The changes that make the allocation's GPUs ``indices`` on ``node_id`` (see ``store.fleet.upsert_node_gpus``).

    New indices are registered with ``role``; GONE or LOST ones come back UP (a GONE one, a fresh start, also
    takes ``role`` and is no longer lent nor holds a parked worker); an index reported on another node moves;
    indices no longer reported go GONE. UP and DRAINING rows keep their role."""
    changes: list[GpuChange] = []
    for idx in sorted(indices):
        if idx not in existing:
            changes.append(GpuChange("new", idx))
            continue
        gpu_id, state, old_node_id = existing[idx]
        columns: dict[str, Any] = {"node_id": node_id} if old_node_id != node_id else {}
        if state == GpuState.GONE:  # a fresh start: nothing of the GPU's last allocation holds
            columns.update(role=role, borrowed=0, return_deadline=None, worker_id=None, parked_judge_id=None)
        if state in (GpuState.GONE, GpuState.LOST):
            changes.append(GpuChange("revive", idx, gpu_id, state, columns))
        elif columns:
            changes.append(GpuChange("move", idx, gpu_id, state, columns))
    for idx, (gpu_id, state, _) in existing.items():
        if idx not in indices and state != GpuState.GONE:
            changes.append(GpuChange("gone", idx, gpu_id, state))
    return changes


def write_node_gpus(
    store: Core,
    conn: sqlite3.Connection,
    run_id: str,
    allocation_id: int,
    node: str,
    indices: Sequence[int],
    role: str,
    epoch: int | None,
) -> None:
    """Apply ``plan_node_gpus`` inside ``store``'s open write transaction ``conn`` (already fenced)."""

    now = store._clock()
    conn.execute("INSERT INTO nodes (run_id, name) VALUES (?, ?) ON CONFLICT DO NOTHING", (run_id, node))
    (node_id,) = conn.execute("SELECT id FROM nodes WHERE run_id = ? AND name = ?", (run_id, node)).fetchone()
    existing = {
        idx: (gpu_id, state, old_node_id)
        for gpu_id, idx, state, old_node_id in conn.execute(
            "SELECT id, idx, state, node_id FROM gpus WHERE allocation_id = ?", (allocation_id,)
        )
    }
    where = {"node": node, "allocation_id": allocation_id}
    for change in plan_node_gpus(existing, indices, node_id, role):
        data = {**where, "idx": change.idx}
        if change.kind == "new":
            values = {
                "run_id": run_id,
                "allocation_id": allocation_id,
                "node_id": node_id,
                "idx": change.idx,
                "role": role,
                "state": machine("gpus").initial,
                "version": 1,
                "updated_at": now,
            }
            gpu_id = insert(conn, "gpus", values)
            data["role"] = role
            store._journal(
                conn, now, run_id, "gpus", gpu_id, "gpu.registered", to_state=GpuState.UP, epoch=epoch, data=data
            )
        elif change.kind == "move":
            conn.execute(
                "UPDATE gpus SET node_id = ?, version = version + 1, updated_at = ? WHERE id = ?",
                (node_id, now, change.gpu_id),
            )
            store._journal(conn, now, run_id, "gpus", change.gpu_id, "gpu.moved", epoch=epoch, data=data)
        else:
            to, event = (GpuState.UP, "gpu.registered") if change.kind == "revive" else (GpuState.GONE, "gpu.gone")
            if "role" in change.columns:  # a GONE GPU back: its row names the role it is given, as a new one's
                data["role"] = change.columns["role"]
            store._cas(
                conn,
                "gpus",
                change.gpu_id,
                run_id,
                expect=change.state,
                to=to,
                event=event,
                epoch=epoch,
                data=data,
                columns=change.columns,
            )
