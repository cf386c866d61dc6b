"""The transitions part of the Store (``store.transitions``): role transitions and their steps.

What it guarantees: a transition is recorded PLANNED over GPUs of its run only; a step's intent is durable
before its effect runs, unique by idempotency key and by seq within its transition (``DuplicateStep``), and
only while its transition is open; every write is one transaction of the core (pearlctl/state/core.py) with
its journal row, fenced by the caller's epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pearlctl.state.core import Core, check_role, encode_json, values
from pearlctl.state.errors import DuplicateStep, InvalidWrite, NotFound
from pearlctl.state.machines import OPEN_TRANSITION_STATES, StepKind
from pearlctl.state.rows import MoveStep, Step, Transition


class Transitions:
    """Transitions and steps: what the executor writes (intent before effect) and the daemon reads."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def all(
        self, run_id: str, *, states: Iterable[str] | None = None, kind: str | None = None, last: int | None = None
    ) -> list[Transition]:
        """The run's transitions, oldest first: only those in ``states`` and of ``kind`` when given, only the
        ``last`` n when given. The daemon's loop asks for the open ones and the latest few, never the whole
        history, which grows by a few rows per training step."""
        sql, params = "SELECT * FROM transitions WHERE run_id = ?", [run_id]
        if states is not None:
            wanted = sorted(states)
            sql += f" AND state IN ({', '.join('?' * len(wanted))})"
            params += wanted
        if kind is not None:
            sql += " AND kind = ?"
            params.append(kind)
        if last is None:
            return self._core._typed(Transition, sql + " ORDER BY id", params)
        return self._core._typed(Transition, sql + " ORDER BY id DESC LIMIT ?", [*params, last])[::-1]

    def open(self, run_id: str) -> list[Transition]:
        return self.all(run_id, states=OPEN_TRANSITION_STATES)

    def get(self, transition_id: int) -> Transition:
        return self._core.get(Transition.TABLE, transition_id)

    def add(
        self,
        *,
        run_id: str,
        kind: str,
        from_role: str,
        to_role: str,
        gpu_ids: Sequence[int],
        epoch: int | None = None,
    ) -> int:
        """Record a planned role transition (PLANNED) of GPUs of the run; returns its id."""
        check_role(from_role)
        check_role(to_role)
        ids = sorted(set(gpu_ids))
        with self._core._write() as conn:
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
                raise NotFound(f"no run with id {run_id!r}")
            self._core._fence(conn, run_id, epoch)
            placeholders = ", ".join("?" * len(ids))
            known = {
                r[0]
                for r in conn.execute(
                    f"SELECT id FROM gpus WHERE run_id = ? AND id IN ({placeholders})", (run_id, *ids)
                )
            }
            if missing := [i for i in ids if i not in known]:
                raise InvalidWrite(f"run {run_id!r} has no GPUs with ids {missing}")
            now = self._core._clock()
            return self._core._create(
                conn,
                "transitions",
                run_id,
                {
                    "run_id": run_id,
                    "kind": kind,
                    "from_role": from_role,
                    "to_role": to_role,
                    "gpu_ids": encode_json(ids),
                    "created_at": now,
                },
                "transition.planned",
                now=now,
                epoch=epoch,
                data={"kind": kind, "from_role": from_role, "to_role": to_role, "gpu_ids": ids},
            )

    def steps(self, transition_id: int) -> list[Step]:
        return self._core._typed(Step, "SELECT * FROM steps WHERE transition_id = ? ORDER BY seq", (transition_id,))

    def step(self, step_id: int) -> Step:
        return self._core.get(Step.TABLE, step_id)

    def step_by_key(self, run_id: str, key: str) -> Step | None:
        """The run's step with this idempotency key (a trainer command's id is its step's key)."""
        rows = self._core._typed(
            Step,
            "SELECT steps.* FROM steps JOIN transitions ON transitions.id = steps.transition_id "
            "WHERE steps.idempotency_key = ? AND transitions.run_id = ?",
            (key, run_id),
        )
        return rows[0] if rows else None

    def recent_steps(self, run_id: str, *, state: str, per_kind: int) -> list[MoveStep]:
        """The run's latest ``per_kind`` steps in ``state`` of each step kind and move (the roles its transition
        moved between: a start of the judge's engine is not one of the policy's), oldest first, each with those
        roles (running estimates of step durations)."""
        return self._core._typed(
            MoveStep,
            "SELECT * FROM (SELECT steps.*, transitions.from_role, transitions.to_role, ROW_NUMBER() OVER"
            " (PARTITION BY steps.kind, transitions.from_role, transitions.to_role ORDER BY steps.id DESC) AS n"
            " FROM steps JOIN transitions ON transitions.id = steps.transition_id"
            " WHERE transitions.run_id = ? AND steps.state = ?) WHERE n <= ? ORDER BY id",
            (run_id, state, per_kind),
        )

    def add_step(
        self,
        *,
        transition_id: int,
        seq: int,
        kind: str,
        idempotency_key: str,
        detail: Mapping[str, Any] | None = None,
        epoch: int | None = None,
    ) -> int:
        """Durably record a step's INTENT before its effect runs; returns its id.

        ``DuplicateStep`` if the key (or the seq within the transition) exists: after a crash the
        caller finds that step with ``steps()`` and probes its effect instead of redoing it.
        """
        if kind not in values(StepKind):
            raise InvalidWrite(f"step kind {kind!r} is not one of {', '.join(StepKind)}")
        with self._core._write() as conn:
            owner = conn.execute("SELECT run_id, state FROM transitions WHERE id = ?", (transition_id,)).fetchone()
            if owner is None:
                raise NotFound(f"no transition with id {transition_id}")
            run_id, transition_state = owner
            self._core._fence(conn, run_id, epoch)
            if transition_state not in OPEN_TRANSITION_STATES:
                raise InvalidWrite(
                    f"transition {transition_id} is {transition_state}; steps can only be "
                    f"added while it is {', '.join(sorted(OPEN_TRANSITION_STATES))}"
                )
            clash = conn.execute(
                "SELECT id, idempotency_key, seq FROM steps WHERE idempotency_key = ?"
                " OR (transition_id = ? AND seq = ?)",
                (idempotency_key, transition_id, seq),
            ).fetchone()
            if clash is not None:
                raise DuplicateStep(
                    f"step {clash[0]} already has key {clash[1]!r} / seq {clash[2]} "
                    f"(asked: key {idempotency_key!r}, seq {seq} of transition {transition_id})"
                )
            now = self._core._clock()
            return self._core._create(
                conn,
                "steps",
                run_id,
                {
                    "transition_id": transition_id,
                    "seq": seq,
                    "kind": kind,
                    "idempotency_key": idempotency_key,
                    "detail": None if detail is None else encode_json(detail),
                },
                "step.intent",
                now=now,
                epoch=epoch,
                data={"transition_id": transition_id, "seq": seq, "kind": kind, "key": idempotency_key},
            )
