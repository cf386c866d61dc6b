"""`pearlctl move RUN KIND GPU...`: an operator's move of rollout, elastic or reward GPUs — start or wake a worker
on them, retire it, or switch it to another role (prefill, decode, colocated rollout, or the judge: REWARD). The
run's daemon carries it out as a journaled transition, exactly as it carries out a policy's move."""

from __future__ import annotations

import time

import typer

from pearlctl.cli.app import app
from pearlctl.cli.common import (
    EXIT_CONFLICT,
    EXIT_MOVE_FAILED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    emit_json,
    err,
    exits,
    fail,
    open_store,
    resolve_run,
)
from pearlctl.daemon.client import DaemonRefusal, call
from pearlctl.state.machines import TransitionState as T
from pearlctl.vocabulary import SERVED_ROLES

KINDS = ("start", "wake", "retire", "switch")
ROLES = SERVED_ROLES


def _gpu_ref(text: str) -> dict:
    if text.isdigit():
        return {"id": int(text)}
    node, sep, index = text.rpartition(":")
    if not sep or not node or not index.isdigit():
        raise fail(
            f"GPU {text!r}: expected NODE:INDEX or the GPU's id, as `pearlctl status` lists them (gpu2:0, 7)",
            EXIT_USAGE,
        )
    return {"node": node, "index": int(index)}


@app.command()
def move(
    run_ref: str = typer.Argument(..., metavar="RUN", help="Run name or id."),
    kind: str = typer.Argument(..., metavar="KIND", help="start, wake, retire or switch."),
    gpus: list[str] = typer.Argument(..., metavar="GPU...", help="GPUs as NODE:INDEX or id (`pearlctl status`)."),
    role: str = typer.Option(
        None,
        "--role",
        help="start, wake, switch: serve as ROLLOUT (default), PREFILL or DECODE, or REWARD (the run's judge).",
    ),
    keep_warm: bool = typer.Option(
        False,
        "--keep-warm",
        help="retire, or switch between the policy and the judge: park the leaving worker asleep instead of "
        "stopping it.",
    ),
    wait: bool = typer.Option(False, "--wait", help="Wait until the transition ends."),
    timeout: float = typer.Option(600.0, "--timeout", help="With --wait: give up waiting after this many seconds."),
    json_out: bool = typer.Option(False, "--json", help="Print the answer as JSON."),
) -> None:
    """Move rollout or elastic GPUs by hand: the daemon runs it as a transition (INTENT, effect, probe; a
    failed start, wake or switch is rolled back). A policy that is on may undo it at its next plan; with
    borrowing off (`pearlctl return`) the move stays."""
    with exits():
        if kind not in KINDS:
            raise fail(f"KIND {kind!r}: expected one of {', '.join(KINDS)}", EXIT_USAGE)
        if role is not None and role.upper() not in ROLES:
            raise fail(f"--role {role!r}: expected one of {', '.join(ROLES)}", EXIT_USAGE)
        refs = [_gpu_ref(g) for g in gpus]
        store = open_store(readonly=True)  # the daemon writes; the CLI finds the run and watches
        try:
            run = resolve_run(store, run_ref)
            body = {"kind": kind, "gpus": refs, "role": role.upper() if role else None, "keep_warm": keep_warm}
            try:
                answer = call(run, "POST", "/v1/moves", body)
            except DaemonRefusal as exc:
                code = EXIT_CONFLICT if exc.status == 409 else EXIT_USAGE if exc.status in (400, 404, 422) else 1
                raise fail(str(exc), code) from None
            err.print(
                f"{answer['plan']} of {', '.join(answer['gpus'])} ({answer['from_role']} -> {answer['to_role']}): "
                f"transition {answer['transition_id']}"
                + (f"; policy {answer['policy']} is on and may undo it" if answer["policy"] != "never" else ""),
                markup=False,
            )
            if wait:
                answer["state"] = _wait(store, answer["transition_id"], timeout)
        finally:
            store.close()
        if json_out:
            emit_json(answer)
        if wait and answer["state"] != T.DONE:
            raise fail(
                f"transition {answer['transition_id']} ended {answer['state']}: "
                f"`pearlctl journal {run['id']}` says why",
                EXIT_MOVE_FAILED,
            )


def _wait(store, tid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = store.transitions.get(tid).state
        if state not in (T.PLANNED, T.RUNNING, T.ROLLING_BACK):
            return state
        if time.monotonic() >= deadline:
            raise fail(f"transition {tid} is still {state} after {timeout:g}s (it goes on)", EXIT_TIMEOUT)
        time.sleep(0.5)
