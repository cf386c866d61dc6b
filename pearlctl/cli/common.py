"""What every command shares: the error-to-exit-code mapping, stderr console, opening state."""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import traceback
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from pearlctl.backends import BackendError
from pearlctl.config import SpecError
from pearlctl.daemon.client import DaemonUnavailable
from pearlctl.host import home
from pearlctl.ops.launcher import LaunchError
from pearlctl.state.db import empty as empty_database
from pearlctl.state.db import sqlite_fault
from pearlctl.state.errors import IncompatibleSchema, StateError, StateUnavailable
from pearlctl.state.store import Store

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SCHEDULER, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_DOCTOR = 0, 1, 2, 3, 4, 5, 6
EXIT_NO_DAEMON = 7
EXIT_STATE = 8  # the state database cannot be used: corrupted, read-only, disk full
EXIT_MOVE_FAILED = 9  # `move --wait`: the transition failed or was rolled back
EXIT_SIMULATION = 10  # `simulate`: a simulation ran out of its memory limit, or its process died
EXIT_TIMEOUT = 124
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (`| head`): 128 + SIGPIPE, what a shell reports


class _Stdout(Console):
    def on_broken_pipe(self) -> None:
        """stdout's reader went away mid-print: stop quietly with EXIT_BROKEN_PIPE (rich would exit 1)."""
        self.quiet = True
        quiet_broken_pipe()
        raise SystemExit(EXIT_BROKEN_PIPE)


err = Console(stderr=True, highlight=False, emoji=False, width=None if sys.stderr.isatty() else 200)
# Piped output gets a wide console (rich would assume 80 columns and truncate ids); a terminal keeps its width.
out = _Stdout(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 200)


def emit_json(doc) -> None:
    """Machine output: plain JSON on stdout, never wrapped or styled by rich."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit_json_line(doc) -> None:
    """One compact JSON document per line (for --watch --json)."""
    sys.stdout.write(json.dumps(doc, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int) -> typer.Exit:
    # soft_wrap: a long message (paths) stays one line when stderr is not a terminal, for grep and logs
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextlib.contextmanager
def exits() -> Iterator[None]:
    """Turn pearlctl's exceptions into a clear message on stderr and the documented exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except SpecError as exc:
        sys.stderr.write(f"{exc}\n")  # unwrapped: one problem per line, key path first
        raise typer.Exit(EXIT_USAGE) from None
    except LaunchError as exc:
        raise fail(str(exc), exc.exit_code) from None
    except BackendError as exc:
        raise fail(f"scheduler: {exc}", EXIT_SCHEDULER) from None
    except DaemonUnavailable as exc:
        raise fail(str(exc), EXIT_NO_DAEMON) from None
    except StateUnavailable as exc:
        raise fail(str(exc), EXIT_STATE) from None
    except StateError as exc:
        raise fail(f"state: {exc}", EXIT_CONFLICT) from None
    except BrokenPipeError:
        if not stdout_broken():
            err.print(traceback.format_exc(), markup=False)
            raise typer.Exit(EXIT_INTERNAL) from None
        quiet_broken_pipe()
        raise typer.Exit(EXIT_BROKEN_PIPE) from None
    except Exception as exc:
        problem = sqlite_fault(exc, home.state_db())  # met on a write, after the database opened (disk full)
        if problem is not None:
            raise fail(str(problem), EXIT_STATE) from None
        err.print(traceback.format_exc(), markup=False)  # a bug: show it all
        raise typer.Exit(EXIT_INTERNAL) from None


def stdout_broken() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def quiet_broken_pipe() -> None:
    """stdout's reader went away (``pearlctl status --json | head -1``): point stdout at /dev/null so that
    no later write or the interpreter's last flush fails again. The caller exits EXIT_BROKEN_PIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def open_store(readonly: bool = False) -> Store:
    """The state store; ``readonly=True`` for commands that only read (``status``, ``journal``): they
    never write, so they work on a read-only state directory and on a full disk.

    A read-only open of a state database that does not exist yet reads an empty one (and creates no
    file), and migrates a database an older pearlctl wrote once, read-write, as any command did before
    reads were read-only. A database that cannot be used raises StateUnavailable (exit 8)."""
    path = home.state_db()
    if not readonly:
        return Store.open(path)
    if not path.exists():  # nothing launched yet: read an empty state, create no file
        return Store(empty_database(), readonly=True)
    try:
        return Store.open(path, readonly=True)
    except IncompatibleSchema as exc:
        if exc.found >= exc.known:
            raise
    Store.open(path).close()  # an older schema: migrate it (raises StateUnavailable where it cannot write)
    return Store.open(path, readonly=True)


def resolve_run(store: Store, ref: str | None) -> dict:
    """A run by id or name; the newest run when ``ref`` is None."""
    if ref is None:
        runs = store.runs.all()
        if not runs:
            raise fail("no runs yet; start one with `pearlctl launch RUN.toml`", EXIT_NOT_FOUND)
        return max(runs, key=lambda r: r["created_at"])
    run = store.runs.find(ref)
    if run is None:
        known = ", ".join(r["name"] for r in store.runs.all()) or "none"
        raise fail(f"no run {ref!r}; known runs: {known}", EXIT_NOT_FOUND)
    return run
