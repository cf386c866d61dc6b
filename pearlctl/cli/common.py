"""What every command shares: the error-to-exit-code mapping, stderr console, opening state."""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from pearlctl import home
from pearlctl.backends import BackendError
from pearlctl.config import SpecError
from pearlctl.daemon.client import DaemonUnavailable
from pearlctl.launcher import LaunchError
from pearlctl.state.errors import StateError
from pearlctl.state.store import Store

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SCHEDULER, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_DOCTOR = 0, 1, 2, 3, 4, 5, 6
EXIT_NO_DAEMON = 7
EXIT_TIMEOUT = 124

err = Console(stderr=True, highlight=False, emoji=False, width=None if sys.stderr.isatty() else 200)
# Piped output gets a wide console (rich would assume 80 columns and truncate ids); a terminal keeps its width.
out = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 200)


def emit_json(doc) -> None:
    """Machine output: plain JSON on stdout, never wrapped or styled by rich."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit_json_line(doc) -> None:
    """One compact JSON document per line (for --watch --json)."""
    sys.stdout.write(json.dumps(doc, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)
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
    except StateError as exc:
        raise fail(f"state: {exc}", EXIT_CONFLICT) from None
    except Exception:  # a bug: show it all
        err.print(traceback.format_exc(), markup=False)
        raise typer.Exit(EXIT_INTERNAL) from None


def open_store(readonly: bool = False) -> Store:
    return Store.open(home.state_db(), readonly=readonly)


def resolve_run(store: Store, ref: str | None) -> dict:
    """A run by id or name; the newest run when ``ref`` is None."""
    if ref is None:
        runs = store.list_runs()
        if not runs:
            raise fail("no runs yet; start one with `pearlctl launch RUN.toml`", EXIT_NOT_FOUND)
        return max(runs, key=lambda r: r["created_at"])
    run = store.find_run(ref)
    if run is None:
        known = ", ".join(r["name"] for r in store.list_runs()) or "none"
        raise fail(f"no run {ref!r}; known runs: {known}", EXIT_NOT_FOUND)
    return run
