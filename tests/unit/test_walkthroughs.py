"""The walk-throughs of docs/architecture.md ("Extending pearlctl": adding a role, adding a transition kind), kept
true by following them.

Each walk-through step names a file, then what in it: a name in backquotes after a file's path is defined in that
file (``citations`` reads them so, one paragraph or numbered step at a time). So:

- every file the walk-throughs name exists, and every name they cite is in the file before it (a class or
  function defined there, not imported);
- "adding a transition kind" is followed for real: a made-up kind (``restart``: a worker restarted in place, with
  a new step kind ``HEALTH`` before it is routed again) is registered in the places the walk-through names, and
  only those (``REGISTER`` knows how to register it in each place it may name; a place the walk-through leaves
  out is left out here too), then run by the daemon's own executor and effects against a real Store, with the
  agent and the router simulated at their seams (tests/crash_harness.py), to DONE, and with its health check
  failing through its rollback. A place the executor needs that the walk-through does not name fails the test
  (``test_a_walkthrough_that_leaves_out_a_place_fails_the_test`` shows it for each place, one at a time);
- "adding a role": every role and pool kind has its entry in the per-role and per-pool tables the walk-through
  names.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import pytest

from pearlctl.daemon import effects, transitions
from pearlctl.daemon.effects import DaemonEffects, StepAction
from pearlctl.daemon.transitions import Outcome, PlanKind, TransitionDetail
from pearlctl.state.store import Store
from pearlctl.vocabulary import MoveKind, PoolKind, Role, StepKind
from tests import factories
from tests.crash_harness import Clock, Restarts, SimAgent, SimRouter

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
ROLE, TRANSITION = "Adding a role", "Adding a transition kind"

_SPAN = re.compile(r"`([^`]+)`")
_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+$")  # a repository path: a folder and a file at least
_NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")  # a name, or a dotted one (a class's method)
_BLOCK = re.compile(r"\n\s*\n|\n(?=\d+\. )")  # paragraphs, and each numbered step on its own


def section(title: str) -> str:
    """The text of docs/architecture.md's ``### <title>``, up to the next heading."""
    text = DOC.read_text()
    start = text.index(f"\n### {title}\n")
    end = re.compile(r"^#", re.M).search(text, start + 5)
    return text[start : end.start() if end else len(text)]


def citations(title: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The paths the walk-through ``title`` names, and (path, name) for each name it cites after a path."""
    return read(section(title))


def read(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The paths ``text`` names, and (path, name) for each name it cites after a path of the same paragraph or
    numbered step (the names before a step's first path say what the step is about, not where it is)."""
    paths, names = [], []
    for block in _BLOCK.split(text):
        where = None
        for span in _SPAN.findall(block):
            if _PATH.match(span):
                paths.append(span)
                where = span
            elif where is not None and _NAME.match(span):
                names.append((where, span))
    return paths, names


def module_of(path: str):
    assert path.endswith(".py"), f"a name is cited after {path}, which is no Python module"
    return importlib.import_module(path.removesuffix(".py").replace("/", "."))


def resolve(path: str, name: str):
    """What ``name`` is in the module at ``path``: a class or function defined there, or any other attribute."""
    module = module_of(path)
    head, *rest = name.split(".")
    assert hasattr(module, head), f"{path} has no {head}"
    obj = getattr(module, head)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        assert obj.__module__ == module.__name__, f"{head} is imported by {path}, defined in {obj.__module__}"
    for part in rest:
        assert hasattr(obj, part), f"{path}: {head} has no {part}"
        obj = getattr(obj, part)
    return obj


# -- the walk-throughs name what is there -----------------------------------------------------------------------


@pytest.mark.parametrize("title", [ROLE, TRANSITION])
def test_every_file_a_walkthrough_names_exists(title):
    paths, _ = citations(title)
    assert len(paths) >= 10, f"{title}: the walk-through names files as `path`"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/architecture.md, {title}, names files that are not there: {missing}"


@pytest.mark.parametrize("title", [ROLE, TRANSITION])
def test_every_name_a_walkthrough_cites_is_in_the_file_before_it(title):
    _, names = citations(title)
    assert len(names) >= 15, f"{title}: the walk-through cites names after their file"
    wrong = []
    for path, name in names:
        try:
            resolve(path, name)
        except AssertionError as e:
            wrong.append(f"{name} ({path}): {e}")
    assert not wrong, f"docs/architecture.md, {title}, cites names that are not where it says:\n" + "\n".join(wrong)


def test_the_reading_takes_names_after_their_path_in_each_step():
    text = "The `A`.\n\n1. `a/b.py`: the `X` row (`Y.z`), `[pools.<k>]`\n2. The `W` of `c/d.py` and `e/f.py`'s `V`\n"
    assert read(text) == (["a/b.py", "c/d.py", "e/f.py"], [("a/b.py", "X"), ("a/b.py", "Y.z"), ("e/f.py", "V")])


# -- adding a transition kind, followed -------------------------------------------------------------------------

NEW_KIND, NEW_STEP = "restart", "HEALTH"


@dataclass(frozen=True, kw_only=True)
class RestartDetail(TransitionDetail):
    """The made-up kind's detail: why its worker is restarted."""

    because: str | None = None


def add_member(monkeypatch, enum: type[StrEnum], name: str, value: str) -> None:
    """Add a member to ``enum`` in place for this test, as if the walk-through's edit had been made: every module
    that imported the enum sees it (by name, by value, in iteration). Undone in reverse order, the member maps
    first, so the enum lets its attribute go."""
    member = str.__new__(enum, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum
    monkeypatch.setattr(enum, name, member, raising=False)  # set while it is no member yet: an enum refuses after
    monkeypatch.setattr(enum, "_member_map_", {**enum._member_map_, name: member})
    monkeypatch.setattr(enum, "_value2member_map_", {**enum._value2member_map_, value: member})
    monkeypatch.setattr(enum, "_member_names_", [*enum._member_names_, name])


class Health:
    """The new step's probe: what the (simulated) worker's health check answers."""

    def __init__(self):
        self.answer = Outcome.DONE
        self.probed = 0

    def __call__(self, fx: DaemonEffects, t, key: str) -> Outcome:
        self.probed += 1
        return self.answer


def _plan() -> tuple[StepKind, ...]:
    k = StepKind
    return (k.DEREGISTER, k.DRAIN, k.STOP, k.START, k.VERIFY, k(NEW_STEP), k.REGISTER)


# How to register the new kind in each place the walk-through may name, in the order they depend on each other.
# Each takes (monkeypatch, health probe); a value is looked up by its string, so a place the walk-through leaves out
# (the enum member, say) fails where it is first needed.
REGISTER: dict[tuple[str, str], Callable] = {
    ("pearlctl/vocabulary.py", "MoveKind"): lambda mp, h: add_member(mp, MoveKind, NEW_KIND.upper(), NEW_KIND),
    ("pearlctl/daemon/transitions.py", "PlanKind"): lambda mp, h: add_member(mp, PlanKind, NEW_KIND.upper(), NEW_KIND),
    ("pearlctl/vocabulary.py", "StepKind"): lambda mp, h: add_member(mp, StepKind, NEW_STEP, NEW_STEP),
    ("pearlctl/daemon/transitions.py", "PLANS"): lambda mp, h: mp.setitem(
        transitions.PLANS, PlanKind(NEW_KIND), _plan()
    ),
    ("pearlctl/daemon/transitions.py", "KIND_ROLES"): lambda mp, h: mp.setitem(
        transitions.KIND_ROLES,
        MoveKind(NEW_KIND),
        (None, None),  # the worker's own role, both ends
    ),
    ("pearlctl/daemon/transitions.py", "ROLLBACKS"): lambda mp, h: mp.setitem(
        transitions.ROLLBACKS,
        MoveKind(NEW_KIND),
        PlanKind.RETIRE,  # a worker that is not healthy stops
    ),
    ("pearlctl/daemon/transitions.py", "DETAILS"): lambda mp, h: mp.setitem(
        transitions.DETAILS, MoveKind(NEW_KIND), RestartDetail
    ),
    ("pearlctl/daemon/effects.py", "STEPS"): lambda mp, h: mp.setitem(
        effects.STEPS, StepKind(NEW_STEP), StepAction(DaemonEffects._nothing, h, "—", "the health check answers")
    ),
}
# Names the transition walk-through cites in the executor's files that are no place to register a kind: what a
# place holds, or an example of one.
MENTIONED: dict[tuple[str, str], str] = {
    ("pearlctl/daemon/transitions.py", "PlanKind.BORROW_WARM"): "an example of a plan variant",
    ("pearlctl/daemon/transitions.py", "TransitionDetail"): "what a DETAILS model extends",
    ("pearlctl/daemon/transitions.py", "BorrowDetail"): "an example of a DETAILS model",
    ("pearlctl/daemon/effects.py", "StepAction"): "what a STEPS row is",
}
EXECUTOR_FILES = {path for path, _ in REGISTER}


def follow_transition_walkthrough(monkeypatch, health: Health) -> None:
    """Register the new kind in the places "adding a transition kind" names, and only those."""
    _, cited = citations(TRANSITION)
    places = [p for p in cited if p[0] in EXECUTOR_FILES]
    unknown = [p for p in places if p not in REGISTER and p not in MENTIONED]
    assert not unknown, f"the walk-through names places this test does not follow: {unknown} (add them to REGISTER)"
    for place in REGISTER:
        if place in places:
            REGISTER[place](monkeypatch, health)


@pytest.fixture
def world(tmp_path: Path):
    """A rollout pool of one GPU on gpu2, its worker up and routed: a daemon (controller, executor, effects, the
    policy loop with policy "never") over a real Store, its agent and router simulated."""
    store = Store.open(tmp_path / "state.db")
    factories.create_run(store, tmp_path, [factories.pool(PoolKind.ROLLOUT, Role.ROLLOUT)], spec_path="r.toml")
    alloc = store.fleet.allocations("r")[0]
    factories.submit(store, alloc.id, "8")
    factories.start(store, alloc.id, "gpu2")
    router = SimRouter()
    agent = SimAgent(router, host="gpu2")
    register = {"job_id": "8", "task_id": 0, "node": "gpu2", "gpus": [0], "pid": 1}
    daemon = Restarts(store, alloc.id, Clock(), register, router=router)

    def loop(until) -> None:
        def tick(d) -> None:
            agent.tick(d)
            router.sync(store)

        daemon.run_until(tick, until)

    loop(lambda: router.urls)  # the pool's worker comes up at launch, routed once READY
    yield store, daemon, agent, router, loop
    store.close()


def restart(world, monkeypatch, health: Health) -> int:
    """Follow the walk-through, plan a restart of the pool's GPU and run the daemon until it ends: its id."""
    store, daemon, _, _, loop = world
    follow_transition_walkthrough(monkeypatch, health)
    gpu = store.fleet.gpus("r")[0].id
    with daemon.daemon.controller.lock:
        tid = daemon.daemon.executor.plan(
            MoveKind(NEW_KIND),
            [gpu],
            detail=RestartDetail(because="test"),
            from_role=Role.ROLLOUT,
            to_role=Role.ROLLOUT,
        )
    loop(lambda: store.transitions.get(tid).state in ("DONE", "FAILED", "ROLLED_BACK"))
    return tid


def steps(store, tid) -> list[tuple[int, str, str]]:
    return [(s.seq, s.kind, s.state) for s in sorted(store.transitions.steps(tid), key=lambda s: s.seq)]


def test_a_new_transition_kind_added_as_the_walkthrough_says_runs_to_done(world, monkeypatch):
    store, _, agent, router, loop = world
    health = Health()
    tid = restart(world, monkeypatch, health)
    t = store.transitions.get(tid)
    assert t.state == "DONE"
    assert steps(store, tid) == [(i, k, "DONE") for i, k in enumerate(_plan())]
    assert health.probed >= 1
    detail = TransitionDetail.of(t)
    assert type(detail) is RestartDetail and detail.because == "test"
    # the worker went down and came up again in its role: started twice (at launch, by the restart), never drained
    # while the router still sent it requests, routed again
    assert agent.starts == {"rollout-0": 2}
    assert agent.drained_while_routed == []
    loop(lambda: router.urls)
    live = [w for w in store.fleet.workers("r") if w.state not in ("STOPPED", "FAILED", "LOST")]
    assert [(w.role, w.state, w.routable) for w in live] == [(Role.ROLLOUT, "READY", 1)]
    assert store.fleet.gpus("r")[0].role == Role.ROLLOUT


def test_a_new_transition_kind_that_fails_rolls_back_as_the_walkthrough_says(world, monkeypatch):
    store, _, agent, router, _ = world
    health = Health()
    health.answer = Outcome.FAILED
    tid = restart(world, monkeypatch, health)
    assert store.transitions.get(tid).state == "ROLLED_BACK"
    plan, rollback = _plan(), transitions.PLANS[PlanKind.RETIRE]
    health_at = plan.index(StepKind(NEW_STEP))
    assert steps(store, tid) == [
        *((i, k, "DONE") for i, k in enumerate(plan[:health_at])),
        (health_at, NEW_STEP, "FAILED"),
        *((transitions.ROLLBACK_SEQ + i, k, "DONE") for i, k in enumerate(rollback)),
    ]
    # never routed again: the GPU is IDLE with nothing running on it
    assert store.fleet.gpus("r")[0].role == Role.IDLE
    assert not [w for w in store.fleet.workers("r") if w.state not in ("STOPPED", "FAILED", "LOST")]
    assert not router.urls and agent.drained_while_routed == []


# What the run does without each place: the walk-through would not pass (the failing variant, so the rollback runs).
WITHOUT: dict[str, tuple[type[Exception], str]] = {
    "MoveKind": (ValueError, "not a valid MoveKind"),
    "PlanKind": (ValueError, "not a valid PlanKind"),
    "StepKind": (ValueError, "not a valid StepKind"),
    "PLANS": (KeyError, NEW_KIND),  # the executor finds no steps for it
    "KIND_ROLES": (KeyError, NEW_KIND),  # nor the roles it moves between
    "DETAILS": (TypeError, "RestartDetail"),  # its detail is refused as another kind's
    "STEPS": (KeyError, NEW_STEP),  # the effects find no action for the new step
    "ROLLBACKS": (AssertionError, "FAILED"),  # nothing compensates: it ends FAILED, for a person
}


def test_each_place_is_needed_so_a_walkthrough_that_leaves_one_out_fails():
    assert {name for _, name in REGISTER} == set(WITHOUT)


@pytest.mark.parametrize("left_out", list(REGISTER), ids=lambda p: p[1])
def test_a_walkthrough_that_leaves_out_a_place_fails_the_test(world, monkeypatch, left_out):
    """The walk-through as it is, less one place: the new kind does not run (so the tests above fail)."""
    full = citations(TRANSITION)
    less, whole = (full[0], [p for p in full[1] if p != left_out]), citations
    monkeypatch.setattr(f"{__name__}.citations", lambda title: less if title == TRANSITION else whole(title))
    health = Health()
    health.answer = Outcome.FAILED
    error, match = WITHOUT[left_out[1]]
    with pytest.raises(error, match=match):
        tid = restart(world, monkeypatch, health)
        state = world[0].transitions.get(tid).state
        assert state == "ROLLED_BACK", state


# -- adding a role, checked -------------------------------------------------------------------------------------


def _role_tables() -> list[tuple[str, str, set, set, str]]:
    """(file, table, what it has, what it must have, why) for the tables of the role walk-through that list roles
    or pool kinds one by one."""
    from pearlctl import vocabulary as v
    from pearlctl.config import tables
    from pearlctl.planner import diff
    from pearlctl.sim import gpus, timeline

    every_role, every_pool, generating = set(v.Role), set(v.PoolKind), set(v.GENERATION_ROLES)
    return [
        ("pearlctl/vocabulary.py", "ENGINE_FOR_ROLE", set(v.ENGINE_FOR_ROLE), every_role - {v.Role.IDLE},
         "every role but IDLE runs an engine"),
        ("pearlctl/vocabulary.py", "DEFAULT_ROLE", set(v.DEFAULT_ROLE), every_pool, "a pool's GPUs start in a role"),
        ("pearlctl/vocabulary.py", "SERVING_ROLES", set(v.SERVING_ROLES), generating,
         "a role that generates rollouts is served by vLLM"),
        ("pearlctl/config/tables.py", "Pools", set(tables.Pools.model_fields), every_pool,
         "every pool kind has its [pools.<kind>] table"),
        ("pearlctl/planner/diff.py", "_ROLES", set(diff._ROLES), generating, "the planner moves GPUs between them"),
        ("pearlctl/sim/gpus.py", "ENGINE_ROLE", set(gpus.ENGINE_ROLE), generating, "the simulator serves them"),
        ("pearlctl/sim/gpus.py", "CATEGORIES", set(gpus.CATEGORIES) & every_role, every_role,
         "a GPU-seconds column per role"),
        ("pearlctl/sim/timeline.py", "COLORS", set(timeline.COLORS), set(gpus.CATEGORIES), "a colour per column"),
    ]  # fmt: skip


def test_every_role_and_pool_kind_has_its_entry_in_the_tables_the_role_walkthrough_names():
    _, cited = citations(ROLE)
    for path, table, have, want, why in _role_tables():
        assert (path, table) in cited, f"the role walk-through does not name {table} ({path})"
        assert want <= have, f"{path} {table} lacks {sorted(want - have)}: {why}"
