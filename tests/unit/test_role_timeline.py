"""pearlctl.ops.timeline: a run's GPU roles over time rebuilt from journal rows (hand-built, and a real store's)."""

from __future__ import annotations

from pearlctl.ops.timeline import CATEGORIES, Span, reconstruct
from pearlctl.state.store import Store
from tests import factories
from tests.conftest import create_trainer_run

TRAINER = {"id": 1, "role": "TRAIN", "state": "UP", "pool": "trainer", "node": "n1", "idx": 0}
ROLLOUT = {"id": 2, "role": "ROLLOUT", "state": "UP", "pool": "rollout", "node": "n2", "idx": 0}


def registered(ts, gid, role=None):
    return j(ts, "gpus", gid, "gpu.registered", to_state="UP", data={"role": role} if role else {"idx": 0})


def gpu_state(ts, gid, to):
    return j(ts, "gpus", gid, "allocation ended", to_state=to)


def planned(ts, tid, gpu_ids, from_role, to_role, kind="borrow"):
    data = {"kind": kind, "from_role": from_role, "to_role": to_role, "gpu_ids": gpu_ids}
    return j(ts, "transitions", tid, "transition.planned", to_state="PLANNED", data=data)


def moved(ts, tid, to):
    return j(ts, "transitions", tid, "completed", to_state=to)


def j(ts, entity, entity_id, event, *, to_state=None, data=None):
    return {"ts": ts, "entity": entity, "entity_id": str(entity_id), "event": event, "to_state": to_state, "data": data}


def test_a_trainer_gpu_lent_to_rollout_and_back():
    rows = [
        registered(10, 1, "TRAIN"),
        planned(20, 5, [1], "TRAIN", "ROLLOUT"),
        moved(20, 5, "RUNNING"),
        moved(30, 5, "DONE"),
        planned(50, 6, [1], "ROLLOUT", "TRAIN", kind="return"),
        moved(51, 6, "RUNNING"),
        moved(55, 6, "DONE"),
        j(56, "transitions", 6, "deadline met", data={"lateness_s": -3}),  # an event, no state: nothing moves
    ]
    tl = reconstruct(rows, [TRAINER], start=0, end=100)
    assert tl.gpus[1] == [
        Span(10, 20, "TRAIN"),
        Span(20, 30, "TRANSITION"),
        Span(30, 51, "ROLLOUT"),
        Span(51, 55, "TRANSITION"),
        Span(55, 100, "TRAIN"),
    ]
    assert tl.transitions == 2 and tl.labels == {1: "n1:0"}


def test_a_gpu_going_gone_leaves_the_picture_and_comes_back_in_its_pools_role(tmp_path):
    """A GONE GPU back is a fresh start: its ``gpu.registered`` row names the role it is given (its pool's), and
    the timeline has it in that role from that row on, whatever role a step had given it before. LOST keeps its
    role (its workers may still run); GONE is absent. Every time is a journal row's, not the wall clock's."""
    from pearlctl.daemon.effects import ROLE_SET

    clock = iter(float(t) for t in range(1000, 2000))
    with Store.open(tmp_path / "state.db", clock=lambda: next(clock)) as store:
        factories.create_run(store, tmp_path / "run", [factories.pool("rollout", "ROLLOUT")])
        (pool,) = store.runs.pools("r")
        alloc = store.fleet.allocations("r")[0]
        store.fleet.upsert_node_gpus("r", alloc.id, "n1", [0], pool["role"])
        gid = store.fleet.gpus("r")[0].id
        store.update_fields("gpus", gid, event=ROLE_SET, data={"step": "3:1:START"}, role="PREFILL")  # a switch
        store.set_state("gpus", gid, expect="UP", to="LOST", event="agent quiet")
        store.fleet.upsert_node_gpus("r", alloc.id, "n1", [], pool["role"])  # LOST -> GONE
        store.fleet.upsert_node_gpus("r", alloc.id, "n1", [0], pool["role"])  # GONE -> UP: back
        journal = store.journal.read("r")
        gpus = [g.to_dict() for g in store.fleet.gpus("r")]
        created = store.runs.get("r")["created_at"]
    rows = [r for r in journal if r["entity"] == "gpus"]
    registered_at, role_at, lost_at, gone_at, back_at = (r["ts"] - created for r in rows)
    assert [(r["event"], r["to_state"]) for r in rows] == [
        ("gpu.registered", "UP"),
        (ROLE_SET, None),
        ("agent quiet", "LOST"),
        ("gpu.gone", "GONE"),
        ("gpu.registered", "UP"),
    ]
    assert rows[-1]["data"] == {"node": "n1", "allocation_id": alloc.id, "idx": 0, "role": "ROLLOUT"}
    tl = reconstruct(journal, gpus, start=created, end=created + back_at + 10)
    assert tl.gpus[gid] == [
        Span(registered_at, role_at, "ROLLOUT"),
        Span(role_at, gone_at, "PREFILL"),  # LOST in between: still PREFILL
        Span(back_at, back_at + 10, "ROLLOUT"),  # back: its pool's role, from its registration row on
    ]
    samples = dict(tl.samples())
    assert [(samples[t]["ROLLOUT"], samples[t]["PREFILL"]) for t in (registered_at, role_at, gone_at, back_at)] == [
        (1, 0),
        (0, 1),
        (0, 0),
        (1, 0),
    ]
    assert lost_at not in samples  # LOST changes nothing drawn


def test_samples_count_gpus_per_category_at_every_change():
    rows = [
        registered(0, 1, "TRAIN"),
        registered(0, 2, "IDLE"),
        planned(10, 7, [2], "IDLE", "PREFILL", kind="start"),
        moved(12, 7, "RUNNING"),
        moved(20, 7, "DONE"),
    ]
    tl = reconstruct(rows, [TRAINER, dict(ROLLOUT, role="PREFILL")], start=0, end=30)
    assert tl.gpus[2] == [Span(0, 12, "IDLE"), Span(12, 20, "TRANSITION"), Span(20, 30, "PREFILL")]
    samples = tl.samples()
    assert [t for t, _ in samples] == [0, 12, 20, 30]
    assert all(set(c) == set(CATEGORIES) for _, c in samples)
    picked = [{k: v for k, v in c.items() if v} for _, c in samples]
    assert picked == [
        {"TRAIN": 1, "IDLE": 1},
        {"TRAIN": 1, "TRANSITION": 1},
        {"TRAIN": 1, "PREFILL": 1},
        {"TRAIN": 1, "PREFILL": 1},  # the end: what was there up to it
    ]


def test_rolled_back_dropped_and_failed_transitions():
    rows = [
        registered(0, 1, "TRAIN"),
        registered(0, 2, "ROLLOUT"),
        planned(10, 1, [1], "TRAIN", "ROLLOUT"),
        moved(10, 1, "RUNNING"),
        moved(15, 1, "ROLLING_BACK"),
        moved(18, 1, "ROLLED_BACK"),  # the compensating return: the trainer has its GPU back
        planned(20, 2, [2], "ROLLOUT", "DECODE", kind="switch"),
        moved(21, 2, "ROLLED_BACK"),  # dropped while PLANNED: nothing moved
        planned(30, 3, [2], "ROLLOUT", "PREFILL", kind="switch"),
        moved(30, 3, "RUNNING"),
        moved(35, 3, "FAILED"),  # a person has to look: the role its row has now
    ]
    tl = reconstruct(rows, [TRAINER, dict(ROLLOUT, role="IDLE")], start=0, end=40)
    assert tl.gpus[1] == [Span(0, 10, "TRAIN"), Span(10, 18, "TRANSITION"), Span(18, 40, "TRAIN")]
    assert tl.gpus[2] == [Span(0, 30, "ROLLOUT"), Span(30, 35, "TRANSITION"), Span(35, 40, "IDLE")]
    assert tl.transitions == 2


def test_the_window_clamps_rows_and_gpus_without_journal_rows_are_there_all_along():
    rows = [registered(-5, 1, "TRAIN"), gpu_state(150, 1, "GONE")]
    tl = reconstruct(rows, [TRAINER, ROLLOUT], start=0, end=100)
    assert tl.gpus == {1: [Span(0, 100, "TRAIN")], 2: [Span(0, 100, "ROLLOUT")]}
    assert reconstruct([], [], start=5, end=5).samples() == [(0.0, dict.fromkeys(CATEGORIES, 0))]


def test_a_real_store_journal_reads_the_same(tmp_path):
    clock = iter(float(t) for t in range(1000, 2000))
    with Store.open(tmp_path / "state.db", clock=lambda: next(clock)) as store:
        alloc = create_trainer_run(store, tmp_path / "run", job_id="7")
        store.fleet.upsert_node_gpus("r", alloc.id, "n1", [0, 1], "TRAIN")
        lent = store.fleet.gpus("r")[0].id
        tid = store.transitions.add(run_id="r", kind="borrow", from_role="TRAIN", to_role="ROLLOUT", gpu_ids=[lent])
        store.set_state("transitions", tid, expect="PLANNED", to="RUNNING", event="started")
        store.set_state("transitions", tid, expect="RUNNING", to="DONE", event="completed")
        store.fleet.upsert_node_gpus("r", alloc.id, "n1", [0], "TRAIN")  # index 1 went away
        run = store.runs.get("r")
        tl = reconstruct(
            store.journal.read("r"),
            [g.to_dict() for g in store.fleet.gpus("r")],
            start=run["created_at"],
            end=run["created_at"] + 100,
        )
    other = next(g for g in tl.gpus if g != lent)
    assert [s.category for s in tl.gpus[lent]] == ["TRAIN", "TRANSITION", "ROLLOUT"]
    assert [s.category for s in tl.gpus[other]] == ["TRAIN"] and tl.gpus[other][0].end < 100
    assert tl.transitions == 1


def test_a_journaled_role_is_read_not_inferred():
    """Role rows (what a transition's steps journal) decide: a failed switch whose GPU the steps had put in
    PREFILL is PREFILL from its end until a later role row, whatever the row says now."""
    rows = [
        registered(0, 2, "ROLLOUT"),
        planned(10, 3, [2], "ROLLOUT", "PREFILL", kind="switch"),
        moved(10, 3, "RUNNING"),
        j(12, "gpus", 2, "role set", data={"fields": {"role": "PREFILL"}}),  # mid-transition: still TRANSITION
        moved(15, 3, "FAILED"),
        j(30, "gpus", 2, "role set", data={"fields": {"role": "IDLE"}}),
    ]
    tl = reconstruct(rows, [dict(ROLLOUT, role="DECODE")], start=0, end=40)
    assert tl.gpus[2] == [
        Span(0, 10, "ROLLOUT"),
        Span(10, 15, "TRANSITION"),
        Span(15, 30, "PREFILL"),
        Span(30, 40, "IDLE"),
    ]


def test_a_transitions_steps_journal_every_role_they_give(tmp_path):
    """The daemon's effects journal each GPU's role write (``role set``, with the fields written): a borrow's
    START lends the GPU to ROLLOUT, its return's DRAIN gives it back to TRAIN, and the timeline reads both."""
    from pearlctl.daemon.effects import ROLE_SET, DaemonEffects
    from pearlctl.vocabulary import StepKind

    clock = iter(float(t) for t in range(1000, 2000))
    with Store.open(tmp_path / "state.db", clock=lambda: next(clock)) as store:
        alloc = create_trainer_run(store, tmp_path / "run", job_id="7")
        store.fleet.upsert_node_gpus("r", alloc.id, "n1", [0], "TRAIN")
        gid = store.fleet.gpus("r")[0].id
        effects = DaemonEffects(store, "r", None)
        borrow = store.transitions.add(run_id="r", kind="borrow", from_role="TRAIN", to_role="ROLLOUT", gpu_ids=[gid])
        back = store.transitions.add(run_id="r", kind="return", from_role="ROLLOUT", to_role="TRAIN", gpu_ids=[gid])
        effects.do(StepKind.START, store.transitions.get(borrow), f"{borrow}:1:START")
        effects.do(StepKind.START, store.transitions.get(borrow), f"{borrow}:1:START")  # again: no new row
        effects.do(StepKind.DRAIN, store.transitions.get(back), f"{back}:1:DRAIN")
        journal = store.journal.read("r")
        run = store.runs.get("r")
    roles = [(r["data"]["fields"]["role"], r["data"]["step"]) for r in journal if r["event"] == ROLE_SET]
    assert roles == [("ROLLOUT", f"{borrow}:1:START"), ("TRAIN", f"{back}:1:DRAIN")]
    tl = reconstruct(journal, [], start=run["created_at"], end=run["created_at"] + 100)
    assert [s.category for s in tl.gpus[gid]] == ["TRAIN", "ROLLOUT", "TRAIN"]
