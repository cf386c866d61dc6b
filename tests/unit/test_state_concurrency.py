"""Concurrency of the state database across processes (spawn), as the daemon and CLI readers use it.

- 8 read-only readers poll ``list_runs()``/``allocations()`` while a writer makes 200 guarded writes:
  WAL + busy_timeout mean zero "database is locked" errors, and readers only ever see committed rows.
- Two writers at once both succeed: ``BEGIN IMMEDIATE`` queues the second behind the first.

Kept out of test_state_store.py so spawned children import little.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from pearlctl.state.store import Store

READERS = 8
WRITES = 200
TIMEOUT_S = 60.0


def _read_until_stopped(path: str, run_id: str, stop: Event, results: Any) -> None:
    reads, locked, other, versions = 0, 0, [], []
    store = Store.open(path, readonly=True)
    try:
        while True:
            try:
                runs = store.runs.all()
                allocations = store.fleet.allocations(run_id)
                assert [r["id"] for r in runs] == [run_id] and len(allocations) == 4
                versions.append(allocations[0].version)
                reads += 1
            except Exception as exc:  # counted, not raised: the parent asserts on the totals
                if "locked" in str(exc) or "busy" in str(exc):
                    locked += 1
                else:
                    other.append(traceback.format_exc())
            if reads == 1:
                results.put(("ready", None))
            if stop.is_set() and reads >= 2:
                break
    finally:
        store.close()
    results.put(("reader", (reads, locked, other, versions)))


def _write(path: str, allocation_id: int, writes: int, go: Event, results: Any) -> None:
    """Alternate PENDING <-> RUNNING (both edges exist) and field updates; report failures."""
    done, errors = 0, []
    go.wait(TIMEOUT_S)
    with Store.open(path) as store:
        state = "PENDING"
        for i in range(writes):
            try:
                if i % 2 == 0:
                    nxt = "RUNNING" if state == "PENDING" else "PENDING"
                    store.set_state("allocations", allocation_id, expect=state, to=nxt, event="test.flip")
                    state = nxt
                else:
                    store.update_fields("allocations", allocation_id, event="test.seen", restarts=i)
                done += 1
            except Exception:
                errors.append(traceback.format_exc())
    results.put(("writer", (allocation_id, done, errors)))


def _setup(path: Path) -> tuple[str, list[int]]:
    from tests import factories  # here, not at the top: the spawned children import this module

    with Store.open(path) as store:
        pools = [factories.pool("rollout", "ROLLOUT", nodes=4, run_id="r1")]
        factories.create_run(store, path.parent, pools, run_id="r1", backend="local")
        ids = [a.id for a in store.fleet.allocations("r1")]
        for allocation_id in ids:
            store.set_state("allocations", allocation_id, expect="REQUESTED", to="PENDING", event="sbatch")
    return "r1", ids


def _collect(results: Any, kind: str, n: int) -> list[Any]:
    got = []
    while len(got) < n:
        tag, value = results.get(timeout=TIMEOUT_S)
        if tag == kind:
            got.append(value)
    return got


def test_readers_never_see_locked_while_a_writer_writes(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    path = tmp_path / "state.db"
    run_id, ids = _setup(path)
    results, stop, go = ctx.Queue(), ctx.Event(), ctx.Event()
    readers = [ctx.Process(target=_read_until_stopped, args=(str(path), run_id, stop, results)) for _ in range(READERS)]
    writer = ctx.Process(target=_write, args=(str(path), ids[0], WRITES, go, results))
    for p in [*readers, writer]:
        p.start()
    try:
        _collect(results, "ready", READERS)  # every reader is reading before the writer starts
        go.set()
        ((_, done, write_errors),) = _collect(results, "writer", 1)
        stop.set()
        read_results = _collect(results, "reader", READERS)
    finally:
        stop.set()
        go.set()
        for p in [*readers, writer]:
            p.join(TIMEOUT_S)
    assert write_errors == [] and done == WRITES
    assert all(reads >= 2 for reads, *_ in read_results)
    assert sum(locked for _, locked, *_ in read_results) == 0
    assert [o for _, _, other, _ in read_results for o in other] == []
    for *_, versions in read_results:
        assert versions == sorted(versions)  # each reader sees committed writes in order, never a rollback
    seen = {v for *_, versions in read_results for v in versions}
    assert seen & set(range(3, 2 + WRITES)), "readers never overlapped the writes"
    with Store.open(path, readonly=True) as store:
        assert store.fleet.allocation(ids[0]).version == 2 + WRITES  # created, PENDING, then 200 writes


def test_two_writers_are_serialised_and_both_succeed(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    path = tmp_path / "state.db"
    _, ids = _setup(path)
    results, go = ctx.Queue(), ctx.Event()
    writers = [ctx.Process(target=_write, args=(str(path), ids[i], 100, go, results)) for i in (1, 2)]
    for p in writers:
        p.start()
    try:
        go.set()
        outcomes = _collect(results, "writer", 2)
    finally:
        go.set()
        for p in writers:
            p.join(TIMEOUT_S)
    assert sorted((a, done, errs) for a, done, errs in outcomes) == [(ids[1], 100, []), (ids[2], 100, [])]
    with Store.open(path, readonly=True) as store:
        assert [store.fleet.allocation(ids[i]).version for i in (1, 2)] == [102, 102]
        flips = [e for e in store.journal.read(run_id="r1") if e["event"] == "test.flip"]
        assert len(flips) == 100  # 50 per writer, none lost
