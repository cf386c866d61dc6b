"""The errors the state package raises.

Every refusal of a write is a ``StateError``, so a caller can tell "the state said no" from a bug or an
I/O problem (those stay ``sqlite3`` errors). Each error carries the facts the caller needs to decide what
to do next (re-read and retry, give up the lease, fix the caller) as attributes, and says them in its
message.
"""

from __future__ import annotations

from collections.abc import Iterable


class StateError(Exception):
    """Base of every refusal raised by ``pearlctl.state``."""


class IllegalTransition(StateError):
    """The requested (old, new) state pair is not an edge of the table's state machine."""

    def __init__(self, table: str, old: str, new: str, allowed: Iterable[str], note: str = "") -> None:
        self.table, self.old, self.new = table, old, new
        self.allowed = tuple(str(s) for s in allowed)
        nexts = ", ".join(self.allowed) or "none (terminal state)"
        message = f"{table}: {old} -> {new} is not an allowed transition; from {old} allowed: {nexts}"
        super().__init__(f"{message}; {note}" if note else message)


class StaleWrite(StateError):
    """A compare-and-set found the row in another state or at another version than expected.

    Nothing was written. Re-read the row and decide again.
    """

    def __init__(
        self,
        table: str,
        row_id: int | str,
        *,
        expected_state: str,
        expected_version: int | None,
        current_state: str,
        current_version: int,
    ) -> None:
        self.table, self.row_id = table, row_id
        self.expected_state, self.expected_version = expected_state, expected_version
        self.current_state, self.current_version = current_state, current_version
        expected = expected_state if expected_version is None else f"{expected_state} v{expected_version}"
        super().__init__(
            f"{table} {row_id}: expected {expected}, but it is {current_state} v{current_version}; nothing was written"
        )


class StaleEpoch(StateError):
    """The writer's lease epoch is not the lease's current epoch: another holder took over (fencing)."""

    def __init__(self, lease: str, epoch: int, current_epoch: int) -> None:
        self.lease, self.epoch, self.current_epoch = lease, epoch, current_epoch
        super().__init__(
            f"lease {lease!r} is at epoch {current_epoch}, this writer holds epoch {epoch}; "
            "it must stop writing (another holder took over)"
        )


class DuplicateRun(StateError):
    """A run with that name (or id) already exists."""


class DuplicateStep(StateError):
    """A step with that idempotency key (or that seq in its transition) already exists."""


class NotFound(StateError, LookupError):
    """The row asked for does not exist."""


class InvalidWrite(StateError, ValueError):
    """The caller asked for a write the schema cannot express (unknown column, bad role, ...)."""


class ReadOnlyStore(StateError):
    """A write was attempted through a store opened with ``readonly=True``."""


class IncompatibleSchema(StateError):
    """The database's schema version is not one this code can use (newer code wrote it, or not migrated)."""

    def __init__(self, path: str, found: int, known: int, advice: str) -> None:
        self.path, self.found, self.known = path, found, known
        super().__init__(
            f"state database {path} is at schema version {found}; this pearlctl knows versions up to {known}. {advice}"
        )


class StateUnavailable(StateError):
    """The state database cannot be used at all: not a database (corrupted or overwritten), on a read-only
    directory or file, on a full disk, or unreadable. ``problem`` says which, ``advice`` what to do; the
    message is one line naming the path."""

    def __init__(self, path: str, problem: str, advice: str) -> None:
        self.path, self.problem, self.advice = path, problem, advice
        super().__init__(f"state database {path}: {problem}; {advice}")
