"""The trainer hook's engine offload: how a DeepSpeed engine gives its GPU memory up and takes it back.

``EngineOffload`` is the mixin of :class:`pearlctl.trainer.hook.TrainerHook` that frees the engine's GPU
memory on release and restores it on reclaim; the hook decides when (and checkpoints first when releasing
by checkpoint). DeepSpeed 0.19.8 facts it is shaped by (docs/architecture.md, "Engines on a CPU-only
machine"): ``offload_states`` / ``reload_states`` exist for ZeRO-1/2/3 only, and ZeRO-3's needs
DeepSpeed's FusedAdam; ZeRO-0 (and ZeRO-3 with another optimizer) release by checkpoint instead. On a
CPU-only machine offloading moves CPU to CPU: the call flow is real, the memory release is not.

Guarantees:

- ``_free`` uses ``engine.offload_states()`` where DeepSpeed supports it (``_cannot_offload`` is None);
  elsewhere it drops the gradients and moves the optimizer's states to host memory, leaving the
  parameters in place (with a bf16/fp16 wrapper they are views into flat buffers). ``_unfree`` takes the
  same route back (``_free``'s return value names it): ``reload_states``, or the optimizer's states back
  to the engine's device; dropped gradients come back with the next backward.
- Moving the optimizer's states does what DeepSpeed's ``offload_optimizer_states`` does, without
  importing deepspeed.

Import-light: importing this module imports neither torch nor deepspeed; torch is imported inside the
functions that need it, or only looked up in ``sys.modules`` (``_empty_cache``).
"""

from __future__ import annotations

import sys
from typing import Any


class EngineOffload:
    """Freeing and restoring the engine's GPU memory (mixin of ``TrainerHook``, which sets ``engine``)."""

    engine: Any
    zero_stage: int  # TrainerHook's property

    def _cannot_offload(self) -> str | None:
        """Why offload_states cannot be used on this engine, or None."""
        stage = self.zero_stage
        if stage == 0:
            return "ZeRO-0 has no offload_states (DeepSpeed 0.19.8)"
        if stage == 3:
            inner = getattr(self.engine.optimizer, "optimizer", None)
            if type(inner).__name__ != "FusedAdam":
                return f"ZeRO-3 offload_states needs DeepSpeed's FusedAdam, not {type(inner).__name__}"
        return None

    def _free(self) -> str:
        if self._cannot_offload() is None:
            self.engine.offload_states()
            return "offload_states"
        # ZeRO-0 (or ZeRO-3 without FusedAdam): drop gradients, move the optimizer's states to host memory.
        # Parameters stay: with a bf16/fp16 wrapper they are views into flat buffers.
        opt = self.engine.optimizer
        if hasattr(opt, "zero_grad"):
            try:
                opt.zero_grad(set_to_none=True)
            except TypeError:
                opt.zero_grad()
        _move_optimizer_states(_innermost_optimizer(opt), "cpu")
        _empty_cache()
        return "optimizer_states_to_host"

    def _unfree(self, how: str) -> None:
        if how == "offload_states":
            self.engine.reload_states()
        else:
            _move_optimizer_states(_innermost_optimizer(self.engine.optimizer), str(self.engine.device))

    def _device_memory(self) -> int | None:
        device = getattr(self.engine, "device", None)
        if device is None or "cuda" not in str(device):
            return None
        import torch

        return int(torch.cuda.memory_allocated(device))


def _safe_zero_stage(engine: Any) -> int | None:
    try:
        return int(engine.zero_optimization_stage())
    except Exception:
        return None


def _innermost_optimizer(opt: Any) -> Any:
    """The torch optimizer under DeepSpeed's wrappers (BF16_Optimizer, FP16_Optimizer, ...)."""
    import torch

    for _ in range(8):
        if isinstance(opt, torch.optim.Optimizer) or getattr(opt, "optimizer", None) is None:
            break
        opt = opt.optimizer
    return opt


def _move_optimizer_states(opt: Any, device: str) -> None:
    """What DeepSpeed's offload_optimizer_states does, without importing deepspeed: every tensor in
    ``optimizer.state`` moves to ``device``."""
    import torch

    for state in getattr(opt, "state", {}).values():
        for key, value in state.items():
            if torch.is_tensor(value) and str(value.device) != device:
                state[key] = value.to(device)


def _empty_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
