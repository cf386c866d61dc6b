"""`pearlctl borrow RUN --policy NAME` and `pearlctl return RUN`: lend idle trainer GPUs to rollout, and
take them back. Both go through the run's daemon, which executes the transitions."""

from __future__ import annotations

import typer

from pearlctl.cli.app import app
from pearlctl.cli.common import EXIT_USAGE, emit_json, err, exits, fail, open_store, out, resolve_run
from pearlctl.daemon.client import DaemonRefusal, call


def _run(run_ref: str) -> dict:
    store = open_store(readonly=True)  # the daemon writes; the CLI only finds the run
    try:
        return resolve_run(store, run_ref)
    finally:
        store.close()


@app.command()
def borrow(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    policy: str = typer.Option(
        ..., "--policy", help="Policy name (shipped, in $PEARL_POLICY_PATH, or an entry point), e.g. greedy."
    ),
    gpus: int = typer.Option(None, "--gpus", min=1, help="Lend at most this many trainer GPUs."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what the policy would lend now; change nothing."),
    stop_on_return: bool = typer.Option(
        False, "--stop-on-return", help="Stop a returned vLLM worker instead of parking it asleep for the next borrow."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the answer as JSON."),
) -> None:
    """Turn on borrowing of idle trainer GPUs under a policy (the daemon returns them before the deadline)."""
    with exits():
        run = _run(run_ref)
        try:
            answer = call(
                run,
                "POST",
                "/v1/borrow",
                {"policy": policy, "gpus": gpus, "dry_run": dry_run, "keep_warm": not stop_on_return},
            )
        except DaemonRefusal as exc:
            raise fail(str(exc), EXIT_USAGE if exc.status == 400 else 1) from None
        if json_out:
            emit_json(answer)
        elif dry_run:
            plan = answer["plan"]
            view = answer["view"]
            if plan is None:
                out.print(
                    f"policy {policy} would lend nothing now (trainer {view['phase'] or 'has not reported'}, "
                    f"{view['wait_left_s']:.1f}s of wait left, {view['idle_gpus']} idle GPU(s))",
                    markup=False,
                )
            else:
                gpus_s = ", ".join(f"{n}:{i}" for n, i in plan["gpus"])
                out.print(
                    f"policy {policy} would lend {len(plan['gpus'])} GPU(s) [{gpus_s}] until "
                    f"{plan['return_deadline']:.1f} ({view['wait_left_s']:.1f}s from now)",
                    markup=False,
                )
            _print_whole_plan(policy, answer.get("whole_plan") or {})
        else:
            err.print(f"borrowing on for {run['id']}: policy {policy}" + (f", at most {gpus} GPU(s)" if gpus else ""))


def _print_whole_plan(policy: str, whole: dict) -> None:
    """Every move of the policy's plan and the transitions the daemon would run for them."""
    moves = whole.get("moves") or []
    if not moves:
        out.print(f"policy {policy} would move no GPU now", markup=False)
        return
    before, after = whole.get("predicted_s") or (None, None)
    if before is not None:
        out.print(
            f"whole plan ({whole.get('why')}): batch predicted {before:.1f}s now, {after:.1f}s with the plan",
            markup=False,
        )
    for m in moves:
        out.print(
            f"  {m['kind']:<7} gpu {m['node']}:{m['gpu']} ({m['pool']}) {m['from']} -> {m['to']}  ~{m['cost_s']:.1f}s",
            markup=False,
        )
    for t in whole.get("transitions") or []:
        out.print(
            f"  transition {t['plan']} on allocation {t['allocation_id']}: GPUs {t['gpu_ids']} "
            f"{t['from_role']} -> {t['to_role']}",
            markup=False,
        )


@app.command(name="return")
def give_back(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    now: bool = typer.Option(False, "--now", help="Also abort a borrow that is still starting."),
    keep_warm: bool = typer.Option(
        False, "--keep-warm", help="Park the returned vLLM workers asleep for a later borrow instead of stopping them."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the answer as JSON."),
) -> None:
    """Turn borrowing off (policy never): every lent trainer GPU goes back to training, its vLLM worker
    stopped (or parked asleep with --keep-warm)."""
    with exits():
        run = _run(run_ref)
        answer = call(run, "POST", "/v1/return", {"now": now, "keep_warm": keep_warm})
        if json_out:
            emit_json(answer)
        else:
            err.print(
                f"returning {len(answer['lent_gpus'])} lent GPU(s) of {run['id']}"
                + (f"; aborted borrow(s) {answer['aborted']}" if answer["aborted"] else "")
            )
