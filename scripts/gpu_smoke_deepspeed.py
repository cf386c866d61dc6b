#!/usr/bin/env python3
"""GPU smoke test of the trainer hook's release/reclaim on real DeepSpeed: does offloading free memory?

On a CPU-only machine ``offload_states`` moves CPU to CPU, so only a GPU shows whether a released trainer
really gives its memory back. This builds a small random Llama (about 120M parameters: bf16 weights,
fp32 master weights and Adam states are GiBs, so the difference is plain), trains two steps with
ZeRO-2 (torch AdamW: no JIT compile; ``--zero 3`` needs DeepSpeed's FusedAdam, JIT-compiled on first
use), then through ``pearlctl.trainer.TrainerHook`` releases (``engine.offload_states()``), reclaims
(``engine.reload_states()``), trains one more step and exports the weights. It prints a table of
``torch.cuda.memory_allocated()`` and timings and fails unless offloading freed most of the memory and
reloading brought it back. One GPU, one rank, well under 3 minutes.

    python scripts/gpu_smoke_deepspeed.py [--zero 2] [--hidden 1024] [--layers 8] [--json]

Exits 0 with a "SKIP" line when CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--min-freed", type=float, default=0.6, help="offload must free at least this share")
    p.add_argument("--json", action="store_true", help="also print the measurements as one JSON line")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the same flow on CPU (gloo; no memory check): to test this script on a machine without a GPU",
    )
    return p.parse_args()


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:8.3f}"


def main() -> int:
    args = parse_args()
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed (gpu_smoke_deepspeed needs torch and deepspeed)")
        return 0
    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    if not cuda and not args.cpu_dry_run:
        print("SKIP: CUDA is not available; gpu_smoke_deepspeed measures GPU memory and needs a GPU")
        return 0

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(port))

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from pearlctl.trainer import TrainerHook

    t_start = time.monotonic()
    if not cuda:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}  # skip a 50-80 s JIT compile on CPU
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    if cuda:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
    if args.zero < 3:
        optimizer["params"]["torch_adam"] = True  # ZeRO-3's offload_states needs DeepSpeed's FusedAdam
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.zero},
        "optimizer": optimizer,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    hook = TrainerHook(engine, rank=0, world_size=1)
    init_s = time.monotonic() - t_start

    def train_step() -> float:
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss.item())

    rows: list[tuple[str, int, int, float | None]] = []

    def mark(point: str, seconds: float | None = None) -> None:
        if cuda:
            torch.cuda.synchronize()
            rows.append((point, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), seconds))
        else:
            rows.append((point, 0, 0, seconds))

    losses = [train_step(), train_step()]
    mark("after 2 train steps")
    released = hook.release(mode="offload")
    mark("after offload_states", released["total_s"])
    reclaimed = hook.reclaim()
    mark("after reload_states", reclaimed["total_s"])
    losses.append(train_step())
    mark("after 1 more train step")

    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        hook.export_weights(tmp, "smoke", dtype="bfloat16")
        export_s = time.monotonic() - t
        export_bytes = (Path(tmp) / "smoke" / "model.safetensors").stat().st_size

    before, offloaded, reloaded = rows[0][1], rows[1][1], rows[2][1]
    freed = (before - offloaded) / before if before else 0.0
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU dry run (no memory check)"
    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, {device_name}")
    print(f"model: {n_params / 1e6:.1f}M parameters, ZeRO-{args.zero}, bf16, init {init_s:.1f} s")
    print(f"{'point':<26} {'allocated GiB':>14} {'reserved GiB':>13} {'seconds':>9}")
    for name, alloc, reserved, secs in rows:
        print(f"{name:<26} {gib(alloc):>14} {gib(reserved):>13} {'-' if secs is None else f'{secs:9.4f}':>9}")
    print(f"offload freed {freed:.1%} of allocated memory; export {export_bytes / 2**20:.0f} MiB in {export_s:.3f} s")
    print(f"losses: {[round(x, 4) for x in losses]}")
    if args.json:
        print(json.dumps({
            "params": n_params, "zero": args.zero, "rows": rows, "freed_share": freed,
            "release": released, "reclaim": reclaimed, "export_s": export_s, "losses": losses,
        }))  # fmt: skip

    failures = []
    if cuda and freed < args.min_freed:
        failures.append(f"offload freed only {freed:.1%} (< {args.min_freed:.0%}) of allocated GPU memory")
    if cuda and abs(reloaded - before) > 0.1 * before:
        failures.append(f"reload brought back {gib(reloaded).strip()} GiB, expected about {gib(before).strip()}")
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        failures.append(f"non-finite loss: {losses}")
    for failure in failures:
        print("FAIL:", failure)
    if not failures and cuda:
        print("OK: offload_states frees GPU memory and reload_states restores it; training continues")
    elif not failures:
        print("OK (CPU dry run): release, reclaim, another step and the export ran; memory was not checked")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
