"""The harness the engine-level crash matrices share: tests/engines/test_crash_matrix_daemon.py (the trainer's
borrows and returns), tests/engines/test_crash_matrix_moves.py (the pool transitions) and
tests/engines/test_crash_matrix_elastic.py (elastic growth and shrink).

`Harness.launched` launches a run on the local backend (every task a process group on this machine, running the
real agent and real engines, or the paced engine, docs/paced.md) and starts its daemon; `Harness.start_daemon`
starts a daemon as ``pearlctl daemon`` does, with a ``PEARL_FAULT`` (pearlctl.daemon.main.fault_from_env) that
SIGKILLs it at one boundary, after which the next one takes over the same state. The harness reads what state
(a read-only Store), the journal and the run's logs say. Each matrix subclasses it with what is its own: how its
cases are triggered and brought to their start, and what it reads beyond transitions, journal and vLLM starts.

The unit crash matrices have a harness of their own, tests/crash_harness.py: the same daemon code in one process,
with the agents, the trainer and the router simulated, and a crash raised at a step boundary instead of a SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Self

import pytest

from pearlctl.host.runfiles import read_address
from pearlctl.router import service
from pearlctl.state.rows import Allocation, Transition
from pearlctl.state.store import Store
from tests.conftest import Pearlctl, alive, wait_for

# The killed daemon's lease must still be unexpired when the next one starts, so that the takeover shows it broken
# (the holder's process is gone), not waited out: with a 30-s TTL a loaded machine (the kill, then the new
# daemon's imports) let it lapse first, and there was nothing left to break.
LEASE_TTL_S = "120"
OPEN = ("PLANNED", "RUNNING", "ROLLING_BACK")  # a transition in one of these states is still moving


class Harness:
    """A launched run, its daemon, and what state says about it (see the module's docstring)."""

    def __init__(self, pc: Pearlctl, run_dir: Path, run: str):
        self.pc, self.run_dir, self.run = pc, run_dir, run
        self.state_dir = Path(pc.env["PEARL_STATE_DIR"])
        self.store = Store.open(self.state_dir / "state.db", readonly=True)
        self.run_id = pc.json("status", run, "--no-sync")["run"]["id"]

    @classmethod
    @contextlib.contextmanager
    def launched(
        cls,
        request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory,
        run: str,
        spec: Callable[[Path, bool], str],
        name: str,
    ) -> Iterator[Self]:
        """Run ``run`` launched from ``spec(dir, paced)`` with its daemon started: on vLLM (under the engine lock),
        or (``request.param == "paced"``) the paced engine. The run is cancelled (and its router stopped) whatever
        happens in the block."""
        paced = getattr(request, "param", "vllm") == "paced"
        if not paced:
            request.getfixturevalue("engine_lock")
        d = tmp_path_factory.mktemp(f"{name}-paced" if paced else name)
        (d / "run.toml").write_text(spec(d, paced))
        pc = Pearlctl(d / "state", {"CUDA_VISIBLE_DEVICES": "0,1"})  # the local backend's (stand-in) GPUs
        pc("launch", str(d / "run.toml"), "--wait", "--timeout", "60")
        h = cls(pc, d / "run", run)
        try:
            h.start_daemon()
            yield h
        finally:
            h.stop_daemon()
            pc("cancel", run, check=None)
            record = service.read_record(h.run_dir)
            if record is not None:  # the run's router outlives its daemons by design: stopped here, with the run
                service.stop(record, run_dir=h.run_dir)
            h.store.close()

    # -- the daemon ---------------------------------------------------------------------------------
    def start_daemon(self, fault: str | None = None) -> dict:
        """Stop the daemon running, if any, and start one (with ``PEARL_FAULT=fault``): what it printed."""
        self.stop_daemon()
        env = {k: v for k, v in self.pc.env.items() if k != "PEARL_FAULT"}
        if fault:
            env["PEARL_FAULT"] = fault
        pc = Pearlctl(self.state_dir, env)
        return json.loads(pc("daemon", self.run, "--heartbeat-s", "1", "--lease-ttl-s", LEASE_TTL_S, "--json").stdout)

    def stop_daemon(self) -> None:
        address = read_address(self.run_dir)
        if address and alive(address["pid"]):
            os.kill(address["pid"], signal.SIGTERM)
            wait_for(lambda: not alive(address["pid"]), 30, every=0.1)

    def daemon_alive(self) -> bool:
        address = read_address(self.run_dir)
        return bool(address and alive(address["pid"]))

    def killed(self, daemon: dict) -> str:
        """Wait until its fault killed ``daemon`` (as start_daemon returned it); the daemon log then."""
        wait_for(lambda: not alive(daemon["pid"]), 120, every=0.1)
        return (self.run_dir / "logs" / "daemon.log").read_text()

    # -- what state, the journal and the logs say ---------------------------------------------------
    def transitions(self) -> list[Transition]:
        return self.store.transitions.all(self.run_id)

    def open_transitions(self) -> list[Transition]:
        return [t for t in self.transitions() if t.state in OPEN]

    def settled(self) -> Transition | None:
        """The last transition once nothing is moving (None while one is open, or before the first)."""
        ts = self.transitions()
        if any(t.state in OPEN for t in ts):
            return None
        return ts[-1] if ts else None

    def journal(self) -> list[dict]:
        return self.store.journal.read(self.run_id)

    def vllm_starts(self, alloc: Allocation | None = None) -> int:
        """vLLM processes ever started by agents (of one allocation): one "starting" line per process in its logs."""
        pattern = f"vllm-{alloc.job_id}_{alloc.array_index}-*.log" if alloc else "vllm-*.log"
        return sum(p.read_text().count("# pearlctl: starting") for p in (self.run_dir / "logs").glob(pattern))

    # -- moving GPUs (the matrices whose cases are transitions) -------------------------------------
    def trigger(self, plan: str) -> None:
        """Ask for a transition of ``plan``: each such matrix says how."""
        raise NotImplementedError

    def move(self, plan: str) -> Transition:
        """Run one transition to the end under a daemon without a fault (setting up a precondition)."""
        before = len(self.transitions())
        self.trigger(plan)
        return wait_for(lambda: len(self.transitions()) > before and self.settled(), 180)
