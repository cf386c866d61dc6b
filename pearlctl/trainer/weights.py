"""The trainer hook's weight export: live weights written as HuggingFace directories vLLM can reload.

``WeightExport`` is the mixin of :class:`pearlctl.trainer.hook.TrainerHook` that provides
``export_weights(out_dir, version)``. The layout it writes, which the rollout side reads::

    out_dir/<version>/config.json, model.safetensors, pearl_weight_version.txt (WEIGHT_VERSION_FILE),
                      and the base model directory's non-weight files (tokenizer, chat template, ...)
    out_dir/LATEST    (LATEST_WEIGHTS_FILE): the latest version's name, one line

Each node's copy (the node's weight store, pearlctl.host.weight_store): when the node's agent gives the ranks
``PEARL_WEIGHT_STORE`` (the store's ``weights/`` directory, in shared memory), local rank 0 of every node writes
the same layout there too, keeping the newest ``NODE_STORE_KEEP`` versions and every version a live worker pins.
vLLM workers on that node reload from it, with no shared-disk read; the shared-disk export stays, for workers on
other nodes (their agents copy it into their own node's store once) and as the fallback. Under ZeRO-3 only rank
0 holds the whole state, so only rank 0's node gets a copy.

Across nodes (opt-in, ``[pools.rollout] weights = "broadcast"``): when the launcher gave the trainer
``PEARL_WEIGHTS_BROADCAST=1`` and the hook's channel can name the targets (``DaemonChannel.broadcast_targets``),
rank 0 also sends each version over gloo to the vLLM workers on nodes without a trainer rank
(pearlctl.trainer.broadcast, ``WeightBroadcaster``), after the disk export and before the barrier, so before the
hook's next report publishes the version. A failed send is logged and recorded (``last_export["broadcast"]``);
the export itself never fails for it, and the workers not reached reload from the disk.

Guarantees:

- **Never half a directory.** Rank 0 writes into a temporary directory in ``out_dir`` and renames it into
  place; a re-export of the same version renames the old one aside first (``_swap_in``), so a reader sees
  the old directory, the new one, or for an instant none. ``LATEST`` is written to a temporary name and
  renamed (``runfiles.write_atomic``), after the directory is in place.
- **Done on every rank when it returns.** The export ends with a barrier over the ranks; ZeRO-3 gathers
  the parameters on every rank (``_zero3_consolidated_16bit_state_dict``).
- A version is one path component of ``[A-Za-z0-9._+-]`` (``_SAFE_VERSION``); anything else is refused.
- ``model.safetensors`` is made readable by others (safetensors writes 0600; the workers may run as
  another user).

Import-light: importing this module imports neither torch, deepspeed nor safetensors; they are imported
inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from pearlctl.host.runfiles import write_atomic
from pearlctl.host.weight_store import LATEST_WEIGHTS_FILE as LATEST_WEIGHTS_FILE  # the layout's names, as before
from pearlctl.host.weight_store import NODE_STORE_KEEP as NODE_STORE_KEEP
from pearlctl.host.weight_store import WEIGHT_VERSION_FILE as WEIGHT_VERSION_FILE
from pearlctl.host.weight_store import NodeStore
from pearlctl.host.weight_store import stored_version as stored_version
from pearlctl.trainer.broadcast import WeightBroadcaster, broadcast_enabled

# Files of a base model directory that an export copies (tokenizer, chat template, generation config):
# everything except weights, which the export writes itself.
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|gguf)$|.*\.(safetensors|bin)\.index\.json$")
_SAFE_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


class WeightExport:
    """``export_weights`` (mixin of ``TrainerHook``, which sets the attributes below; ``_barrier`` is
    ``RankAgreement``'s)."""

    engine: Any
    rank: int
    zero_stage: int  # TrainerHook's property
    base_model_dir: Path | None
    weight_version: str | None
    last_export: dict | None
    _broadcaster: WeightBroadcaster | None = None  # rank 0, when the run broadcasts: the targets' group

    def export_weights(
        self,
        out_dir: str | os.PathLike,
        version: str,
        *,
        base_model_dir: str | os.PathLike | None = None,
        dtype: Any = None,
    ) -> Path:
        """Write the live weights as an HF directory vLLM's ``reload_weights`` can take. Collective.

        ``out_dir/<version>/``: ``config.json``, ``model.safetensors``, the tokenizer and other non-weight
        files of the base model directory, and ``pearl_weight_version.txt``; then ``out_dir/LATEST`` names
        the version. Rank 0 writes into a temporary directory and renames it, so readers never see half a
        directory (a re-export of the same version swaps the old one out). ZeRO 0-2 read
        ``module.state_dict()``; ZeRO-3 gathers with ``_zero3_consolidated_16bit_state_dict()`` (every
        rank). Tensors are cast to ``dtype``, default the base config's dtype. Timings: ``last_export``.
        """
        version = str(version)
        if not _SAFE_VERSION.match(version):
            raise ValueError(f"version must be one path component of [A-Za-z0-9._+-], not {version!r}")
        out = Path(out_dir)
        final = out / version
        base = Path(base_model_dir) if base_model_dir is not None else self.base_model_dir
        store = node_store_writer()
        t0 = time.monotonic()
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # whole on rank 0 only
        else:  # replicated on every rank: rank 0 and each node's store writer read their own copy
            state = self.engine.module.state_dict() if self.rank == 0 or store is not None else None
        if self.rank != 0 and not state:
            store = None  # ZeRO-3: only rank 0 holds the whole state; other nodes' workers read the disk export
        gather_s = time.monotonic() - t0
        write_s = store_s = 0.0
        store_error = None
        broadcast = None
        if self.rank == 0 or store is not None:
            t = time.monotonic()
            config = self._export_config(base)
            target = _torch_dtype(dtype) if dtype is not None else _torch_dtype(_config_dtype(config))
            tensors = {}
            for name, tensor in state.items():
                # A real copy on the host: GPU tensors come over, host tensors are cloned, so tied weights
                # do not share storage (safetensors refuses shared tensors) and training may go on.
                tensors[name] = tensor.detach().to(device="cpu", dtype=target or tensor.dtype, copy=True).contiguous()
            if target is not None:
                dtype_name = str(target).removeprefix("torch.")
                config["dtype"] = dtype_name
                if "torch_dtype" in config:
                    config["torch_dtype"] = dtype_name
            if self.rank == 0:
                _write_version(out, version, tensors, config, base)
            write_s = time.monotonic() - t
            if self.rank == 0:  # opt-in: before the version is published, so workers that get it need no reload
                broadcast = self._broadcast(tensors, version)
            if store is not None:  # this node's copy, in shared memory: its vLLM workers read no shared disk
                t = time.monotonic()
                try:
                    _write_version(store, version, tensors, config, base)
                    NodeStore.of_versions(store).prune(keep=NODE_STORE_KEEP)
                except OSError as exc:  # a full or missing tmpfs: this node's workers read the disk export
                    store_error = f"{type(exc).__name__}: {exc}"
                    store = None
                store_s = time.monotonic() - t
            del tensors
        del state
        self._barrier()  # when export_weights returns on any rank, the directory (and every node's copy) is there
        self.weight_version = version
        self.last_export = {
            "version": version,
            "path": str(final),
            "gather_s": round(gather_s, 6),
            "write_s": round(write_s, 6),
            "node_store": str(store / version) if store is not None else None,
            "node_store_s": round(store_s, 6),
            "node_store_error": store_error,
            "export_s": round(time.monotonic() - t0, 6),
        }
        if broadcast is not None:
            self.last_export["broadcast"] = broadcast
        return final

    def _broadcast(self, tensors: dict, version: str) -> dict | None:
        """Rank 0: send the version to the channel's broadcast targets (module docstring); None when off."""
        targets = getattr(getattr(self, "channel", None), "broadcast_targets", None)
        if targets is None or not broadcast_enabled():
            return None
        broadcaster = getattr(self, "_broadcaster", None)
        if broadcaster is None:
            broadcaster = self._broadcaster = WeightBroadcaster(targets)
        return broadcaster.send(tensors, version)

    def _export_config(self, base: Path | None) -> dict:
        if base is not None and (base / "config.json").exists():
            return json.loads((base / "config.json").read_text())
        config = getattr(self.engine.module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            raise ValueError("export_weights needs base_model_dir (the module has no HF config)")
        return config.to_dict()


def node_store_writer() -> Path | None:
    """This node's weight store's versions (``PEARL_WEIGHT_STORE``, set by the node's agent:
    pearlctl.host.weight_store) when this rank writes them: local rank 0 of each node. None otherwise."""
    store = os.environ.get("PEARL_WEIGHT_STORE")
    return Path(store) if store and os.environ.get("LOCAL_RANK", "0") == "0" else None


def _write_version(out: Path, version: str, tensors: dict, config: dict, base: Path | None) -> Path:
    """``out/<version>/`` and ``out/LATEST``, whole or not at all (see the module's guarantees)."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / version
    tmp = out / f".{version}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if base is not None:
            for f in sorted(base.iterdir()):
                if f.is_file() and not _WEIGHT_FILE.match(f.name) and f.name not in ("config.json",):
                    shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes 0600; workers may be another user
        (tmp / WEIGHT_VERSION_FILE).write_text(version + "\n")
        _swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(out / LATEST_WEIGHTS_FILE, version + "\n", mode=0o644)
    return final


def _config_dtype(config: dict) -> str | None:
    return config.get("dtype") or config.get("torch_dtype")


def _torch_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = getattr(torch, names.get(str(dtype), str(dtype)), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename a finished directory into place. An existing one is renamed aside first and removed after,
    so a reader sees the old directory, the new one, or (for an instant) none — never half of one."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def prune_weights(weights_dir: Path, *, keep: int, rank: int = 0) -> None:
    """Keep the ``keep`` highest numbered versions in ``weights_dir`` (0: keep all); rank 0 alone prunes."""
    if rank != 0 or keep <= 0:
        return
    versions = sorted((p for p in weights_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
