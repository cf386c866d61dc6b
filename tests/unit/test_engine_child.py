"""An engine process started by the agent (``pearlctl.host.processes.die_with_parent``, as
pearlctl.agent.engines.vllm starts vLLM) ignores the pool's preemption signal and dies when the agent that started it
dies. Real processes: a stand-in agent starts
``sleep`` the way the agent starts vLLM, and is SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

AGENT = textwrap.dedent(
    """
    import signal, subprocess, time
    from pearlctl.agent.engines import ignore_preempt_signal
    from pearlctl.host.processes import die_with_parent
    preexec = die_with_parent(signal.SIGTERM, then=ignore_preempt_signal)
    child = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=preexec)
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its new parent's reap counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_ignores_the_preemption_signal_and_dies_with_its_agent():
    env = {**os.environ, "PEARL_PREEMPT_SIGNAL": "USR2"}
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True, env=env)
    child = None
    try:
        child = int(agent.stdout.readline())
        os.kill(child, signal.SIGUSR2)  # sleep's default action for it is to exit: ignored, it runs on
        time.sleep(0.3)
        assert not gone(child), "the engine died of the preemption signal the agent handles for it"
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 5.0
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), "the engine outlived its agent"
    finally:
        agent.kill()
        agent.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):  # gone already
                os.kill(child, signal.SIGKILL)
