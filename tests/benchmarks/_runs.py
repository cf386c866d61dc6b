"""What the benchmarks that launch a run share when they end it: its daemon stopped (the run's address file names
its pid), whatever state the run was left in."""

from __future__ import annotations

import os
import signal
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
