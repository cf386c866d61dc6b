"""The runs part of the Store (``store.runs``): a run, its pools and its nodes.

What it guarantees: a run is created with its pools and one REQUESTED allocation per pool node in one write
transaction, journaled (``run.created``, ``allocation.requested``), or not at all; a run's id and name are
unique (``DuplicateRun``); a pool names a known kind and role (``InvalidWrite`` otherwise). Writes go through
the core's transaction (pearlctl/state/core.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pearlctl.state.core import Core, Row, check_role, encode_json, values
from pearlctl.state.db import insert, plain
from pearlctl.state.errors import DuplicateRun, InvalidWrite, NotFound
from pearlctl.state.machines import PoolKind, machine

BACKENDS = ("slurm", "local")
# Keys a pool dict passed to ``create`` may carry (pools columns minus id, run_id, job_id).
POOL_REQUIRED = frozenset({"name", "kind", "role", "nodes", "gpus_per_node", "job_name"})
POOL_OPTIONAL = frozenset({"partition"})


class Runs:
    """Runs, pools and nodes: created with a run, read by everyone."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def create(
        self,
        *,
        run_id: str,
        name: str,
        spec: Mapping[str, Any],
        spec_path: str | None,
        run_dir: str | None,
        backend: str,
        policy: str | None,
        pools: Sequence[Mapping[str, Any]],
    ) -> None:
        """Record a run (CREATED), its pools, and one REQUESTED allocation per pool node, atomically."""
        if backend not in BACKENDS:
            raise InvalidWrite(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        checked = [_check_pool(pool) for pool in pools]
        with self._core._write() as conn:
            clash = conn.execute("SELECT id, name FROM runs WHERE id = ? OR name = ?", (run_id, name)).fetchone()
            if clash is not None:
                raise DuplicateRun(f"a run with id {clash[0]!r} / name {clash[1]!r} already exists")
            now = self._core._clock()
            run_state = machine("runs").initial
            conn.execute(
                "INSERT INTO runs (id, name, state, version, spec, spec_path, run_dir, backend, policy,"
                " created_at, updated_at) VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, name, run_state, encode_json(spec), spec_path, run_dir, backend, policy, now, now),
            )
            self._core._journal(
                conn,
                now,
                run_id,
                "runs",
                run_id,
                "run.created",
                to_state=run_state,
                data={"name": name, "backend": backend, "pools": [p["name"] for p in checked]},
            )
            for pool in checked:
                pool_id = insert(conn, "pools", {"run_id": run_id, **pool})
                for index in range(pool["nodes"]):
                    self._core._create(
                        conn,
                        "allocations",
                        run_id,
                        {"run_id": run_id, "pool_id": pool_id, "array_index": index},
                        "allocation.requested",
                        now=now,
                        data={"pool": pool["name"], "array_index": index},
                    )

    def get(self, run_id: str) -> Row:
        rows = self._core._query("SELECT * FROM runs WHERE id = ?", (run_id,), table="runs")
        if not rows:
            raise NotFound(f"no run with id {run_id!r}")
        return rows[0]

    def find(self, name_or_id: str) -> Row | None:
        """The run with that id, else the run with that name, else None."""
        rows = self._core._query(
            "SELECT * FROM runs WHERE id = ? OR name = ? ORDER BY id = ? DESC LIMIT 1",
            (name_or_id, name_or_id, name_or_id),
            table="runs",
        )
        return rows[0] if rows else None

    def all(self) -> list[Row]:
        return self._core._query("SELECT * FROM runs ORDER BY created_at, id", table="runs")

    def pools(self, run_id: str) -> list[Row]:
        return self._core._query("SELECT * FROM pools WHERE run_id = ? ORDER BY id", (run_id,))

    def nodes(self, run_id: str) -> list[Row]:
        return self._core._query("SELECT * FROM nodes WHERE run_id = ? ORDER BY name", (run_id,))


def _check_pool(pool: Mapping[str, Any]) -> dict[str, Any]:
    missing = sorted(POOL_REQUIRED - pool.keys())
    unknown = sorted(pool.keys() - POOL_REQUIRED - POOL_OPTIONAL)
    if missing or unknown:
        raise InvalidWrite(
            f"pool {pool.get('name', '?')!r}: missing {missing}, unknown {unknown}; "
            f"keys are {sorted(POOL_REQUIRED | POOL_OPTIONAL)}"
        )
    if pool["kind"] not in values(PoolKind):
        raise InvalidWrite(f"pool {pool['name']!r}: kind {pool['kind']!r} is not one of {', '.join(PoolKind)}")
    check_role(pool["role"])
    if not isinstance(pool["nodes"], int) or pool["nodes"] < 1:
        raise InvalidWrite(f"pool {pool['name']!r}: nodes must be an int >= 1, got {pool['nodes']!r}")
    return {"partition": None, **{k: plain(v) for k, v in pool.items()}}
