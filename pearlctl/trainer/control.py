"""The trainer hook's control channel: the contract between rank 0 and whoever commands it, and the
channels that need no daemon.

``ControlChannel`` is the protocol the hook talks through (its docstring specifies the events and the
commands). The implementations:

- ``NullChannel`` — no daemon: never commands. The hook still works (signals, checkpoints, export).
- ``FileChannel`` — a directory both sides write: the example trainer's ``--channel file:DIR``, and tests
  that run the ranks as separate processes. One machine only: NFS attribute caching delays new files by
  seconds.
- ``DaemonChannel`` (pearlctl.trainer.channel) — the run's daemon over the control API, and the node's
  return file; the production channel. It lives apart because it needs the control-API client.

Guarantees of ``FileChannel``: every file is written to a temporary name and renamed, so no side reads
half a file; each command is taken exactly once (renamed into ``commands/taken/``), in name order (names
start with the send time in nanoseconds).

Import-light: importing this module imports neither torch nor deepspeed, nor the control-API client.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pearlctl.host.runfiles import write_atomic


@runtime_checkable
class ControlChannel(Protocol):
    """How rank 0 talks to the daemon. Implementations must be safe to call from the training thread.

    ``report(event)`` sends where the trainer is and returns a command, or ``None``. An event is::

        {"phase": "training" | "waiting" | "stopped", "step": int, "expected_wait_s": float | None,
         "metrics": dict | None, "released": bool, "release_mode": "offload" | "checkpoint" | None,
         "blocked_s": float | None,  # set while ensure_reclaimed blocks
         "weight_version": str | None, "world_size": int, "zero_stage": int | None, "ts": unix seconds,
         "wait_s": float}  # only while waiting: the channel may hold the report up to this long for a command

    A channel that cannot hold a report answers at once and the hook sleeps the rest of its poll interval.

    A command is ``{"command": "release" | "reclaim" | None, "command_id": str, "mode": "offload" |
    "checkpoint"}`` (``mode`` only for release, optional: the hook's ``release_mode`` by default).
    ``{"command": None}`` and ``None`` both mean "nothing to do".

    Optional attribute ``repeats_commands`` (default False): True when ``report`` answers the command the
    controller wants on every report until it is acked (the daemon does). For such a channel, no command
    at a waiting point means "no release wanted now", and the hook drops the releases it held.

    ``ack(command_id, result)`` is called once the command was carried out on every rank (or refused):
    ``result`` has ``"ok": bool``, ``"command"``, the timings of ``release()``/``reclaim()``, and
    ``"error"`` when not ok.
    """

    def report(self, event: dict) -> dict | None: ...

    def ack(self, command_id: str, result: dict) -> None: ...


class NullChannel:
    """No daemon: never commands. The hook still works (signals, checkpoints, export)."""

    def report(self, event: dict) -> dict | None:
        return None

    def ack(self, command_id: str, result: dict) -> None:
        return None


class FileChannel:
    """A directory both sides can write: for tests that run the ranks as separate processes.

    Layout: ``events.jsonl`` (one reported event per line), ``commands/*.json`` (taken in name order,
    each exactly once: the trainer renames it into ``commands/taken/``), ``acks/<command_id>.json``.
    Every file is written to a temporary name and renamed, so no side reads half a file. Not for
    production across nodes: NFS attribute caching delays new files by seconds; the daemon uses HTTP
    (docs/architecture.md, "The control API").
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.commands_dir = self.root / "commands"
        self.taken_dir = self.commands_dir / "taken"
        self.acks_dir = self.root / "acks"
        self.events_file = self.root / "events.jsonl"
        for d in (self.taken_dir, self.acks_dir):
            d.mkdir(parents=True, exist_ok=True)

    # trainer side
    def report(self, event: dict) -> dict | None:
        with self.events_file.open("a") as f:
            f.write(json.dumps(event) + "\n")
        for path in sorted(self.commands_dir.glob("*.json")):
            taken = self.taken_dir / path.name
            try:
                os.rename(path, taken)
            except FileNotFoundError:  # another reader took it
                continue
            return json.loads(taken.read_text())
        return None

    def ack(self, command_id: str, result: dict) -> None:
        write_atomic(self.acks_dir / f"{_safe_name(command_id)}.json", json.dumps(result), mode=0o644)

    # controller side
    def send(self, command: str | None, *, command_id: str | None = None, **fields: Any) -> str:
        command_id = command_id or uuid.uuid4().hex[:12]
        body = json.dumps({"command": command, "command_id": command_id, **fields})
        write_atomic(self.commands_dir / f"{time.time_ns():020d}-{_safe_name(command_id)}.json", body, mode=0o644)
        return command_id

    def read_events(self) -> list[dict]:
        if not self.events_file.exists():
            return []
        lines = self.events_file.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def read_ack(self, command_id: str) -> dict | None:
        path = self.acks_dir / f"{_safe_name(command_id)}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def wait_ack(self, command_id: str, timeout: float = 30.0, poll_s: float = 0.05) -> dict:
        deadline = time.monotonic() + timeout
        while (result := self.read_ack(command_id)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ack for command {command_id} within {timeout} s")
            time.sleep(poll_s)
        return result


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128]
