"""The state machines as data: shape of the edge tables, reachability, and check_edge's refusals.

The walk of every edge through a real database is in test_state_store.py; this file needs no SQLite.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum

import pytest

from pearlctl.state.errors import IllegalTransition, StateError
from pearlctl.state.machines import MACHINES, Machine, PoolKind, Role, StepKind, check_edge

TABLES = ("runs", "allocations", "gpus", "workers", "transitions", "steps")

# Decided on purpose; a change here is a design change (update docs/architecture.md with it).
TERMINAL = {
    "runs": {"CANCELLED", "ENDED", "FAILED"},
    "allocations": {"ENDED"},
    "gpus": set(),  # GONE -> UP: a requeued allocation registers the same device index again
    "workers": {"STOPPED", "FAILED"},  # a restart is a new worker row
    "transitions": {"DONE", "ROLLED_BACK"},
    "steps": {"DONE", "FAILED"},  # a retry is a new step with a new key
}
INITIAL = {
    "runs": "CREATED",
    "allocations": "REQUESTED",
    "gpus": "UP",
    "workers": "STARTING",
    "transitions": "PLANNED",
    "steps": "INTENT",
}

EDGES = [(table, old, new) for table in TABLES for (old, new) in MACHINES[table].edges]
NON_EDGES = [
    (table, old, new)
    for table in TABLES
    for old in MACHINES[table].states
    for new in MACHINES[table].states
    if (old, new) not in MACHINES[table].edges
]


def reachable(m: Machine) -> set[StrEnum]:
    seen = {m.initial}
    todo = deque([m.initial])
    while todo:
        for nxt in m.next_states(todo.popleft()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_registry_names_the_stateful_tables() -> None:
    assert tuple(MACHINES) == TABLES
    for table in TABLES:
        states, edges = MACHINES[table]  # unpacks as (enum, edges)
        assert issubclass(states, StrEnum) and isinstance(edges, dict)


@pytest.mark.parametrize("table", TABLES)
def test_state_values_are_their_upper_case_names(table: str) -> None:
    for state in MACHINES[table].states:
        assert state.value == state.name and state.name.isupper()


def test_vocabulary_enums() -> None:
    assert [k.value for k in PoolKind] == ["trainer", "rollout", "elastic", "reward"]
    assert [r.value for r in Role] == ["TRAIN", "ROLLOUT", "PREFILL", "DECODE", "REWARD", "IDLE"]
    # every step kind is one a transition runs: a kind no plan uses would have no row in the effects' table
    from pearlctl.daemon.effects import STEPS
    from pearlctl.daemon.transitions import PLANS

    assert set(StepKind) == set(STEPS) == {k for plan in PLANS.values() for k in plan}


@pytest.mark.parametrize("table", TABLES)
def test_edges_are_typed_commented_and_never_loops(table: str) -> None:
    m = MACHINES[table]
    for (old, new), why in m.edges.items():
        assert isinstance(old, m.states) and isinstance(new, m.states), (old, new)
        assert old != new, f"{table}: {old} -> {new} is a same-state edge"
        assert isinstance(why, str) and len(why.split()) >= 3, f"{table}: {old} -> {new} needs a reason"


@pytest.mark.parametrize("table", TABLES)
def test_initial_state_and_every_state_reachable(table: str) -> None:
    m = MACHINES[table]
    assert m.initial == INITIAL[table]
    assert reachable(m) == set(m.states)


@pytest.mark.parametrize("table", TABLES)
def test_terminal_states(table: str) -> None:
    assert {str(s) for s in MACHINES[table].terminal()} == TERMINAL[table]


@pytest.mark.parametrize(("table", "old", "new"), EDGES)
def test_check_edge_accepts_every_edge(table: str, old: str, new: str) -> None:
    check_edge(table, old, new)
    check_edge(table, str(old), str(new))  # plain strings, as read back from SQLite


@pytest.mark.parametrize(("table", "old", "new"), NON_EDGES)
def test_check_edge_refuses_every_non_edge(table: str, old: str, new: str) -> None:
    with pytest.raises(IllegalTransition) as refused:
        check_edge(table, old, new)
    err = refused.value
    allowed = MACHINES[table].next_states(old)
    assert (err.table, err.old, err.new) == (table, old, new)
    assert err.allowed == tuple(str(s) for s in allowed)
    message = str(err)
    assert table in message and f"{old} -> {new}" in message
    for state in allowed:
        assert str(state) in message
    if not allowed:
        assert "terminal" in message


def test_known_edges_from_the_brief() -> None:
    must = {
        "allocations": [
            ("REQUESTED", "PENDING"), ("REQUESTED", "ENDED"), ("PENDING", "RUNNING"), ("PENDING", "ENDED"),
            ("RUNNING", "PREEMPTING"), ("RUNNING", "PENDING"), ("PREEMPTING", "PENDING"),
            ("PREEMPTING", "ENDED"), ("RUNNING", "ENDED"), ("PENDING", "LOST"), ("RUNNING", "LOST"),
            ("PREEMPTING", "LOST"), ("LOST", "RUNNING"), ("LOST", "PENDING"), ("LOST", "ENDED"),
        ],
        "runs": [
            ("CREATED", "SUBMITTING"), ("SUBMITTING", "ACTIVE"), ("SUBMITTING", "FAILED"),
            ("CREATED", "FAILED"), ("ACTIVE", "CANCELLING"), ("SUBMITTING", "CANCELLING"),
            ("CANCELLING", "CANCELLED"), ("ACTIVE", "ENDED"),
        ],
        "steps": [("INTENT", "DONE"), ("INTENT", "FAILED"), ("INTENT", "HELD")],
    }  # fmt: skip
    for table, edges in must.items():
        for old, new in edges:
            check_edge(table, old, new)


def test_unknown_state_is_refused_and_named() -> None:
    with pytest.raises(IllegalTransition, match="'RUNING' is not a state of allocations"):
        check_edge("allocations", "PENDING", "RUNING")
    with pytest.raises(IllegalTransition, match="'BOGUS' is not a state of runs"):
        check_edge("runs", "BOGUS", "ACTIVE")


def test_unknown_table_is_a_state_error() -> None:
    with pytest.raises(StateError, match="no state machine") as refused:
        check_edge("pools", "A", "B")
    assert not isinstance(refused.value, IllegalTransition)
