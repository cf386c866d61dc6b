"""A run's trajectories as the engine's modules see them: the phases a trajectory goes through, the work drawn
for each (``Draws``: every turn's tokens and tool latency, and under a model mismatch its true speed factors),
and the two conventions the vectorised modules (``pearlctl.sim.engine``, ``routing``, ``batching``) share.

A trajectory is a chain of turns: prefill the new tokens (the prompt, then each tool's output), decode the
turn's response, wait on a tool, repeat. Phases: PENDING (its batch not launched) → WAIT (ready, needs a
decode slot) → PREFILL → [XFER: KV transfer to a decode worker, disaggregated only] → DECODE → TOOL → WAIT …
→ DONE.

Guarantees: the work is drawn up front from the scenario's distributions, so each policy faces the same
trajectories; a mismatch changes only the truth (tool latencies, per-turn speed factors), never the drawn work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pearlctl.sim.scenario import Mismatch, Workload

# Trajectory phases.
PENDING, WAIT, PREFILL, XFER, DECODE, TOOL, DONE = range(7)
RUNNING = (PREFILL, XFER, DECODE)  # hold a batch slot and a KV reservation on their worker (contiguous codes)

# Up to this many sequences, a step's bookkeeping runs element by element (numpy's per-call cost dominates).
FEW = 16


def group_starts(keys: np.ndarray) -> np.ndarray:
    """For sorted ``keys``, the index where each element's group (run of equal keys) starts."""
    return keys.searchsorted(keys)


@dataclass(frozen=True)
class Draws:
    """Every trajectory's work, drawn once per run (read-only; shared by engine clones)."""

    turns: np.ndarray  # int, >= 1
    prompt: np.ndarray  # tokens
    response: np.ndarray  # [N, max_turns] tokens generated per turn
    tool_output: np.ndarray  # [N, max_turns] tokens each tool returns
    tool_latency: np.ndarray  # [N, max_turns] seconds
    # Model mismatch (pearlctl.sim.scenario.Mismatch): per turn, how much longer than the profile says its decode
    # iterations and its prefill really take (None: exactly as the profile says).
    decode_scale: np.ndarray | None = None  # [N, max_turns]
    prefill_scale: np.ndarray | None = None  # [N, max_turns]

    @property
    def n(self) -> int:
        return len(self.turns)


def draw(workload: Workload, n: int, rng: np.random.Generator) -> Draws:
    turns = np.maximum(1, np.rint(workload.turns.sample(rng, n))).astype(np.int32)
    t_max = int(turns.max())
    cap = float(workload.max_context_tokens)
    return Draws(
        turns=turns,
        prompt=np.minimum(np.rint(workload.prompt_tokens.sample(rng, n)), cap / 2).clip(1),
        response=np.rint(workload.response_tokens.sample(rng, (n, t_max))).clip(1).astype(np.float32),
        tool_output=np.rint(workload.tool_output_tokens.sample(rng, (n, t_max))).clip(0).astype(np.float32),
        tool_latency=workload.tool_latency_s.sample(rng, (n, t_max)).astype(np.float32),
    )


def with_mismatch(draws: Draws, mismatch: Mismatch, rng: np.random.Generator) -> Draws:
    """The true work under ``mismatch``: tool calls take ``bias`` x a per-call factor longer than drawn, and
    each turn's decode and prefill get their factors (the engine applies them). The workload's own draws are
    unchanged, so runs with and without a mismatch face the same trajectories."""
    if mismatch.zero:
        return draws
    shape = draws.response.shape
    decode = mismatch.decode.factors(rng, shape).astype(np.float32)
    prefill = mismatch.prefill.factors(rng, shape).astype(np.float32)
    tool = mismatch.tool_latency.factors(rng, shape).astype(np.float32)
    return replace(
        draws,
        tool_latency=draws.tool_latency * tool,
        decode_scale=None if mismatch.decode.zero else decode,
        prefill_scale=None if mismatch.prefill.zero else prefill,
    )
