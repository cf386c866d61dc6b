"""A real run's GPU roles over time, rebuilt from its journal (pure: rows in, spans and samples out).

``pearlctl status RUN --timeline FILE.png`` draws what this returns with the simulator's drawing
(pearlctl.sim.timeline), so a run and its simulation can be set side by side.

What the journal says, and what is made of it:

- ``gpus`` rows: ``gpu.registered`` (``to_state`` UP, ``data.role``) brings a GPU in with its role, or back
  from GONE in the role it is given again (its pool's; a LOST one back names none: it keeps its role); any
  other ``to_state`` moves it (GONE: it leaves the picture; UP, DRAINING, LOST: it stays, in its role);
  a field update journaled with ``data.fields.role`` sets its role: every role a transition's steps give a
  GPU is such a row (``role set``, pearlctl.daemon.effects), so a GPU's role is read, never guessed.
- ``transitions`` rows: ``transition.planned`` names the GPUs (``data.gpu_ids``) and the roles
  (``from_role``, ``to_role``). While the transition runs (``to_state`` RUNNING, ROLLING_BACK) its GPUs are
  in TRANSITION, whatever role rows come meanwhile; when it ends they are in the role their last role row
  gave them. A journal written before steps journaled roles has none: there DONE puts them in ``to_role``,
  ROLLED_BACK after running puts a trainer GPU back in TRAIN and any other IDLE (what the compensating return
  or retire leaves), and FAILED leaves them in the role their row has now; a PLANNED transition dropped before
  it ran leaves them as they were either way.

TRAIN is not split into computing and waiting (the simulator's
TRAIN_IDLE): the journal does not record the trainer's phases.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pearlctl.state.machines import GpuState, TransitionState
from pearlctl.vocabulary import PoolKind, Role

TRANSITION = "TRANSITION"
# every category a span can have, in the order they stack
CATEGORIES: tuple[str, ...] = (*(str(r) for r in Role), TRANSITION)
_MOVING = (TransitionState.RUNNING, TransitionState.ROLLING_BACK)


@dataclass(frozen=True)
class Span:
    start: float  # seconds since the timeline's start
    end: float
    category: str  # a role, or TRANSITION


@dataclass
class RoleTimeline:
    start: float  # unix seconds (the run's creation)
    end: float  # unix seconds (now, or the run's end)
    gpus: dict[int, list[Span]] = field(default_factory=dict)  # per GPU id, oldest first, only while present
    labels: dict[int, str] = field(default_factory=dict)  # GPU id -> NODE:INDEX
    transitions: int = 0  # transitions that ran (started), whatever their outcome

    def samples(self) -> list[tuple[float, dict[str, int]]]:
        """GPUs per category at every change, as (seconds since start, counts): the simulator's timeline
        shape, drawn as a step plot. Always at least two points (start and end)."""
        edges = {0.0, self.end - self.start}
        for spans in self.gpus.values():
            for s in spans:
                edges.update((s.start, s.end))
        out = []
        for t in sorted(edges):
            counts = dict.fromkeys(CATEGORIES, 0)
            for spans in self.gpus.values():
                for s in spans:
                    if s.start <= t < s.end or (t == s.end == self.end - self.start and s.start < s.end):
                        counts[s.category] = counts.get(s.category, 0) + 1
                        break
            out.append((t, counts))
        return out


@dataclass
class _Gpu:
    role: str | None = None
    present: bool = False
    moving: set[int] = field(default_factory=set)  # ids of the running transitions that move it
    since: float = 0.0
    open: str | None = None  # the category of the open span (None: not present)
    journaled: bool = False  # a role row was read for it: its role is the journal's, not inferred


def _is_trainer(row: Mapping[str, Any]) -> bool:
    """Whether a GPU row is the trainer's: its ``pool_kind`` where given, else a pool named ``trainer``."""
    return (row.get("pool_kind") or row.get("pool")) == PoolKind.TRAINER


def _role_after(g: _Gpu, t: Mapping[str, Any], to: str, row: Mapping[str, Any]) -> str | None:
    """The role of GPU ``g`` (its row ``row``) once the planned transition ``t`` that moved it ended in ``to``."""
    if g.journaled:
        return g.role  # its steps journaled its roles
    if to == TransitionState.DONE:
        return t.get("to_role") or g.role
    if to == TransitionState.ROLLED_BACK and t["ran"]:
        return Role.TRAIN if _is_trainer(row) else Role.IDLE
    if to == TransitionState.FAILED:
        return row.get("role") or g.role
    return g.role


def reconstruct(
    journal: Iterable[Mapping[str, Any]], gpus: Iterable[Mapping[str, Any]], *, start: float, end: float
) -> RoleTimeline:
    """Each GPU's role over ``[start, end]`` (unix seconds) from the run's journal rows (oldest first, as
    ``store.journal.read`` returns them) and its GPU rows (``store.fleet.gpus``: id, role, state, pool, node, idx; a
    ``pool_kind`` key, where given, says which GPUs are the trainer's, else a pool named ``trainer``)."""
    end = max(end, start)
    rows = {int(g["id"]): g for g in gpus}
    tl = RoleTimeline(start=start, end=end)
    tl.labels = {i: f"{g.get('node')}:{g.get('idx')}" for i, g in rows.items()}
    journal = list(journal)
    state: dict[int, _Gpu] = {}
    planned: dict[int, dict[str, Any]] = {}

    def gpu(gid: int) -> _Gpu:
        return state.setdefault(gid, _Gpu())

    def settle(gid: int, at: float) -> None:
        """Close the GPU's open span if its category changed at ``at``, and open the new one."""
        g = gpu(gid)
        now = (TRANSITION if g.moving else g.role or Role.IDLE) if g.present else None
        now = None if now is None else str(now)
        if now == g.open:
            return
        if g.open is not None and at > g.since:
            tl.gpus.setdefault(gid, []).append(Span(g.since - start, at - start, g.open))
        g.open, g.since = now, at

    # GPUs the journal never mentions (rows written without it): there all along, in their row's role
    journaled = {str(j["entity_id"]) for j in journal if j.get("entity") == "gpus"}
    for gid, row in rows.items():
        if str(gid) not in journaled and row.get("state") != GpuState.GONE:
            g = gpu(gid)
            g.role, g.present = row.get("role"), True
            settle(gid, start)
    for j in journal:
        at = min(max(float(j["ts"]), start), end)
        entity, data = j.get("entity"), j.get("data") or {}
        if not str(j.get("entity_id")).isdigit():
            continue
        if entity == "gpus":
            gid = int(j["entity_id"])
            g = gpu(gid)
            if g.role is None:
                g.role = data.get("role") or (rows.get(gid) or {}).get("role")
            if j.get("event") == "gpu.registered" and data.get("role"):
                g.role = data["role"]
            if role := (data.get("fields") or {}).get("role"):
                g.role, g.journaled = role, True
            if j.get("to_state"):
                g.present = j["to_state"] != GpuState.GONE
            settle(gid, at)
        elif entity == "transitions":
            tid = int(j["entity_id"])
            if j.get("event") == "transition.planned":
                planned[tid] = {**data, "ran": False}
                continue
            t, to = planned.get(tid), j.get("to_state")
            if t is None or to is None:
                continue
            ids = [int(i) for i in t.get("gpu_ids") or ()]
            if to in _MOVING:
                if not t["ran"]:
                    tl.transitions += 1
                t["ran"] = True
                for gid in ids:
                    gpu(gid).moving.add(tid)
            else:
                for gid in ids:
                    g = gpu(gid)
                    g.moving.discard(tid)
                    g.role = _role_after(g, t, to, rows.get(gid) or {})
            for gid in ids:
                settle(gid, at)
    for gid, g in state.items():
        if g.open is not None and end > g.since:
            tl.gpus.setdefault(gid, []).append(Span(g.since - start, end - start, g.open))
    return tl
