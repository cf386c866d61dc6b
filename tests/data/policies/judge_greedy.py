"""Policy `judge_greedy` (a test's, loaded from ``$PEARL_POLICY_PATH``): `greedy` for the judge — lend every idle
trainer GPU the pool rules allow (pearlctl.planner.budget: the trainer waits, ``max_lend``, a borrow and its return
fit before its deadline) to the run's judge (BORROWs to REWARD), and give lent GPUs back once they must go. It
weighs nothing, so a fault run of a loan to the judge need not wait for verdicts to back up
(tests/engines/test_judge_loan_fault.py). Pure: ``decide(snapshot)``."""

from __future__ import annotations

from pearlctl.planner import budget, plan, view
from pearlctl.planner.model import Move, MoveKind, Plan, Role, Snapshot

NAME = "judge_greedy"


def decide(snapshot: Snapshot) -> Plan | None:
    lent = [g for g in snapshot.gpus if g.borrowed]
    current = plan.current_target(snapshot)
    if lent:
        due = tuple(
            view.of(snapshot).move(g, MoveKind.RETURN, Role.TRAIN) for g in lent if budget.must_return(snapshot, g)
        )
        return plan.make(snapshot, current, why="judge_greedy: due back", planned=due) if due else None
    lend = view.lendable(snapshot)[: snapshot.max_lend]
    if not lend:
        return None
    cost = snapshot.costs.borrow_s(warm=False)
    moves = tuple(Move(g.id, MoveKind.BORROW, Role.TRAIN, Role.REWARD, cost) for g in lend)
    return plan.make(
        snapshot, current, why=f"judge_greedy: lend {len(lend)} idle trainer GPU(s) to the judge", planned=moves
    )
