"""The `pearlctl` command line. Commands render; decisions live in the modules they call.

- ``launch``: validate a run spec, submit one job per pool, record it in state;
- ``status``: a run's pools, allocations, nodes, GPUs, workers and progress;
- ``ls``: every run in the state;
- ``cancel``: end a run's jobs;
- ``logs``: the log files a run wrote;
- ``journal``: what pearlctl intended, did and observed for a run;
- ``borrow``: ``borrow`` and ``return`` — lend idle trainer GPUs to rollout under a policy, and stop;
- ``move``: an operator's move of rollout or elastic GPUs;
- ``daemon``: start a run's daemon;
- ``profile``: measure a serving worker into an engine profile;
- ``simulate``: policies against a scenario's simulated cluster;
- ``doctor``: what works on this machine;
- ``common``: the error-to-exit-code mapping, the stderr console, opening state;
- ``render``: state rendered for people (tables) and machines (JSON), pure;
- ``app``: the Typer app and its root options, which every command module registers on.

Results go to stdout (``--json`` on every read), progress and logs to stderr. Exit codes
(docs/cli.md keeps the same table, and tests check it):

  0  success
  1  internal error (a bug: please report it with the traceback)
  2  bad input: an invalid run spec or command-line arguments; nothing was written
  3  the scheduler failed or could not be reached (Slurm command error, local process error)
  4  no such run
  5  conflict: the run exists already, or state changed under us; re-read and retry
  6  `doctor` found a failing check (its warnings exit 0)
  7  the run's daemon is not running or does not answer (`borrow`, `return`, `move`)
  8  the state database cannot be used: corrupted, read-only, or its disk is full (the message names it)
  9  `move --wait`: the transition failed or was rolled back (`pearlctl journal RUN` says why)
  124 `launch --wait` or `cancel` timed out (the run goes on; `status` shows where it is)
  141 stdout was closed by its reader (`pearlctl status --json | head -1`): the command stops quietly
"""

from __future__ import annotations

import sys

from pearlctl.cli import (  # (they register their commands on app)
    borrow,
    cancel,
    daemon,
    doctor,
    journal,
    launch,
    logs,
    ls,
    move,
    profile,
    simulate,
    status,
)
from pearlctl.cli.app import app

__all__ = [
    "app",
    "main",
    "borrow",
    "cancel",
    "daemon",
    "doctor",
    "journal",
    "launch",
    "logs",
    "ls",
    "move",
    "profile",
    "simulate",
    "status",
]


def main() -> None:
    from pearlctl.cli.common import EXIT_BROKEN_PIPE, quiet_broken_pipe

    try:
        try:
            app()
        finally:
            sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's last flush
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `pearlctl ... | head -1`: stop quietly, as a shell pipeline expects
        quiet_broken_pipe()
        sys.exit(EXIT_BROKEN_PIPE)
