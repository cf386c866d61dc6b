"""The vLLM side of the ``pearl_gloo`` weight transfer: a vLLM ``WeightTransferEngine`` that receives a
version's tensors over a torch.distributed gloo group from trainer rank 0 (pearlctl.trainer.broadcast).

Runs inside the vLLM worker process. A server gets it with the engine args of
``pearlctl.trainer.broadcast.server_engine_args()``: ``--worker-extension-cls`` names
`PearlWeightTransferExtension`, so vLLM imports this module in every worker process before it loads the
model (vllm/v1/worker/worker_base.py, ``init_worker``); the import registers the engine with
``WeightTransferEngineFactory``, and ``--weight-transfer-config '{"backend":"pearl_gloo"}'`` makes the
worker create it after the model loads (vllm/v1/worker/gpu_worker.py, ``load_model``; the CPU worker
inherits it). From then on vLLM's own routes drive it: ``/init_weight_transfer_engine`` (join the group),
``/start_weight_update``, ``/update_weights`` (names, dtypes, shapes; the bytes come over the broadcast),
``/finish_weight_update``, ``/shutdown_weight_transfer_engine``.

Guarantees:

- The tensors are loaded exactly as vLLM's ``reload_weights`` loads a checkpoint: inside
  ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (started and finished by the two routes),
  through the model's ``load_weights``, so what is served equals a server loaded from the same weights on disk.
- No file is read: each tensor is received into a fresh buffer and handed to ``load_weights``.
- Every received version is logged by the worker with its size and time ("received ... over gloo"), and
  ``POST /collective_rpc {"method": "pearl_weight_transfer_info"}`` returns the backend, the last
  transfer's counts and the model path the worker loaded from (which a disk reload would change).
- **A failed transfer leaves a model a file reload can fix**: when receiving fails, vLLM's layerwise reload
  is closed (the layers not received keep their old tensors) and the error is raised; the server's label stays the
  old version. ``update_active`` in ``pearl_weight_transfer_info`` tells an agent that a sender died between
  ``/start_weight_update`` and its ``/finish_weight_update`` (pearlctl.agent.workers ``sync_weights`` then
  finishes it before its reload).
- Needs no accelerator: unlike vLLM's base ``update_weights`` it does not call ``torch.accelerator.synchronize()``
  (gloo's ``wait()`` returns with the bytes in place), which a CPU-only torch refuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.logger import init_logger

from pearlctl.trainer.broadcast import BACKEND, DEFAULT_TIMEOUT_S, GROUP_PREFIX

logger = init_logger("vllm.pearl_gloo")  # under "vllm": vLLM's log handler and level apply


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """``/init_weight_transfer_engine``'s ``init_info``: the trainer's TCPStore and this server's first rank."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """``/update_weights``'s ``update_info``: what rank 0 broadcasts next, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.rank: int | None = None
        self.last: dict | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config
        self.rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            init_info.master_address, init_info.master_port, init_info.world_size, False, timeout=timeout
        )
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore(GROUP_PREFIX, store), self.rank, init_info.world_size, timeout
        )
        logger.info(
            "pearl_gloo weight transfer: rank %d of %d with the trainer at %s:%d",
            self.rank,
            init_info.world_size,
            init_info.master_address,
            init_info.master_port,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class ends with torch.accelerator.synchronize(), which raises without an accelerator
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # The worker ends the update session on this error (no /finish_weight_update can follow), but vLLM's
            # layerwise reload would stay open, with the layers not yet received on the meta device, and a later
            # reload_weights from disk fails ("'Parameter' object has no attribute 'weight_loader'"). Closing it
            # puts back the old tensors of the layers not received: the model holds a mix of versions, under the
            # old label, until the agent reloads the version from a file.
            try:
                self.finish_weight_update()
            except Exception:
                logger.exception("pearl_gloo weight transfer: closing the layerwise reload after a failure failed")
            logger.error("pearl_gloo weight transfer failed: the model holds a mix of versions until reloaded")
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("pearl_gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t0 = time.monotonic()
        nbytes = 0
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            buf = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast([buf], opts).wait()
            nbytes += buf.numel() * buf.element_size()
            self.model.load_weights([(name, buf.to(self.device))])
        seconds = time.monotonic() - t0
        self.last = {"tensors": len(update_info.names), "bytes": nbytes, "receive_s": round(seconds, 6)}
        logger.info(
            "pearl_gloo weight transfer: received %d tensors (%d bytes) over gloo from the trainer in %.3fs",
            len(update_info.names),
            nbytes,
            seconds,
        )

    def shutdown(self) -> None:
        self.group = None


class PearlWeightTransferExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: importing this module registered the
    engine; this method is callable through ``POST /collective_rpc``."""

    def pearl_weight_transfer_info(self) -> dict:
        cfg = self.vllm_config.weight_transfer_config  # type: ignore[attr-defined]
        engine = getattr(self, "weight_transfer_engine", None)
        return {
            "backend": cfg.backend if cfg is not None else None,
            "engine": type(engine).__name__ if engine is not None else None,
            "initialized": getattr(engine, "group", None) is not None,
            # a /start_weight_update without its /finish_weight_update (a sender that died in between)
            "update_active": bool(getattr(self, "_weight_update_active", False)),
            "last": getattr(engine, "last", None),
            "model": self.vllm_config.model_config.model,  # type: ignore[attr-defined]  # a disk reload changes it
        }


def register() -> None:
    """Register the engine under ``pearl_gloo`` (once per process)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


register()
