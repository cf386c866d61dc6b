"""The trainer hook's weight export: live weights written as HuggingFace directories vLLM can reload.

``WeightExport`` is the mixin of :class:`pearlctl.trainer.hook.TrainerHook` that provides
``export_weights(out_dir, version)``. The layout it writes, which the rollout side reads::

    out_dir/<version>/config.json, model.safetensors, pearl_weight_version.txt (WEIGHT_VERSION_FILE),
                      and the base model directory's non-weight files (tokenizer, chat template, ...)
    out_dir/LATEST    (LATEST_WEIGHTS_FILE): the latest version's name, one line

Guarantees:

- **Never half a directory.** Rank 0 writes into a temporary directory in ``out_dir`` and renames it into
  place; a re-export of the same version renames the old one aside first (``_swap_in``), so a reader sees
  the old directory, the new one, or for an instant none. ``LATEST`` is written to a temporary name and
  renamed (``_write_atomic``), after the directory is in place.
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

WEIGHT_VERSION_FILE = "pearl_weight_version.txt"
LATEST_WEIGHTS_FILE = "LATEST"

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
        t0 = time.monotonic()
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self.engine.module.state_dict() if self.rank == 0 else None
        gather_s = time.monotonic() - t0
        write_s = 0.0
        if self.rank == 0:
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
            out.mkdir(parents=True, exist_ok=True)
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
            _write_atomic(out / LATEST_WEIGHTS_FILE, version + "\n")
            del tensors
            write_s = time.monotonic() - t
        del state
        self._barrier()  # when export_weights returns on any rank, the directory is there
        self.weight_version = version
        self.last_export = {
            "version": version,
            "path": str(final),
            "gather_s": round(gather_s, 6),
            "write_s": round(write_s, 6),
            "export_s": round(time.monotonic() - t0, 6),
        }
        return final

    def _export_config(self, base: Path | None) -> dict:
        if base is not None and (base / "config.json").exists():
            return json.loads((base / "config.json").read_text())
        config = getattr(self.engine.module, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            raise ValueError("export_weights needs base_model_dir (the module has no HF config)")
        return config.to_dict()


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


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
