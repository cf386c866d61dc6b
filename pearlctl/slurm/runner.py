"""The one seam through which pearlctl runs external commands.

Every Slurm command goes through a :class:`CommandRunner`: argv lists only (never a shell string), a
timeout on every call, and the result as a value. Unit tests replace the runner with a recorded one;
integration tests use :class:`SubprocessRunner` against the real local cluster.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandNotFound(Exception):
    def __init__(self, argv: tuple[str, ...]):
        self.argv = argv
        super().__init__(f"{argv[0]}: command not found (is Slurm installed and on PATH?)")


class CommandTimeout(Exception):
    def __init__(self, argv: tuple[str, ...], timeout: float):
        self.argv = argv
        self.timeout = timeout
        super().__init__(f"{' '.join(argv)} did not answer within {timeout:g}s")


class CommandRunner(Protocol):
    def run(self, argv: list[str], *, timeout: float, input: str | None = None) -> CommandResult: ...


class SubprocessRunner:
    """Runs commands for real; raises CommandNotFound / CommandTimeout, never returns half a result."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = env

    def run(self, argv: list[str], *, timeout: float, input: str | None = None) -> CommandResult:
        args = tuple(argv)
        try:
            proc = subprocess.run(
                args, input=input, capture_output=True, text=True, timeout=timeout, env=self.env, check=False
            )
        except FileNotFoundError as exc:
            raise CommandNotFound(args) from exc
        except subprocess.TimeoutExpired as exc:
            raise CommandTimeout(args, timeout) from exc
        return CommandResult(args, proc.returncode, proc.stdout, proc.stderr)
