"""vLLM's OpenAI-compatible server on a CPU-only host, its engine-core process forked rather than spawned:
``python -m pearlctl.agent.engines.vllm_cpu ARGS`` runs what ``python -m vllm.entrypoints.openai.api_server ARGS``
runs (`VllmServer` starts it for ``device = "cpu"``).

Why: vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` whenever it checks a config
(``CpuPlatform.check_and_update_config``), so the API server starts its engine core in a fresh Python that imports
vLLM and torch again: on a 2-core machine about half of the tiny model's 20-s start (docs/architecture.md, "Engines
on a CPU-only machine"). pearlctl runs one engine core per server with the ``uni`` executor (no CPU tensor-parallel
workers, whose OpenMP thread binding is what the spawn protects), and the API server has touched no device and run
no OpenMP region when it starts the engine core, so a fork is safe, as it is vLLM's default on a GPU host.

What it guarantees: after the platform's check the start method is the one the environment asked for (``fork`` in
the adapter's ``CPU_ENV``; ``spawn`` if the caller sets it); the server's arguments, behaviour and exit status are
vLLM's own. Should vLLM's CPU platform lack that method (another vLLM version), nothing is changed and the server
starts as vLLM would.
"""

from __future__ import annotations

import os
import runpy
import sys

SERVER = "vllm.entrypoints.openai.api_server"


def keep_start_method() -> bool:
    """Make vLLM's CPU platform keep the environment's ``VLLM_WORKER_MULTIPROC_METHOD`` after its config check;
    False (nothing changed) when the platform has no such check."""
    from vllm.platforms import cpu

    platform = getattr(cpu, "CpuPlatform", None)
    check = getattr(platform, "check_and_update_config", None)
    wanted = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if check is None or wanted is None:
        return False

    def check_and_keep(cls, vllm_config) -> None:
        check(vllm_config)  # (bound to the platform class already)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = wanted

    platform.check_and_update_config = classmethod(check_and_keep)
    return True


def main() -> None:
    keep_start_method()
    sys.argv[0] = SERVER
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
