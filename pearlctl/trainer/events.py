"""A trainer's event log: one JSON object per line, ``{"event", "ts", ...}``, on stdout and appended to a file.

What examples/grpo/train.py and the paced trainer (pearlctl.trainer.paced) write as ``OUT/train.jsonl``, and what
tests and benchmarks read back. A log with no path (a rank other than 0) writes nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, path: Path | None):
        self.path = path

    def __call__(self, event: str, **data: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "ts": round(time.time(), 3), **data})
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
