"""What the benchmarks that launch a run share: ``pearlctl`` run as a command, and the run's daemon stopped when they
end (the run's address file names its pid), whatever state the run was left in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pearlctl.host.runfiles import read_address


def stop_daemon(run_dir: Path) -> None:
    """SIGTERM the run's daemon, if one wrote its address and still runs."""
    address = read_address(run_dir)
    if address:
        try:
            os.kill(address["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass


def pearlctl(env: dict[str, str]):
    """A function running ``pearlctl ARGS...`` with ``env``: its stdout, or the benchmark exits naming the command
    and what it printed."""

    def run(*argv: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "pearlctl", *argv], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"pearlctl {' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    return run
