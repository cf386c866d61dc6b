#!/usr/bin/env python3
"""GPU check of the trainer's half of the return guarantee without a daemon: the trainer hook releases its
GPU memory, the node's agent (here: this script, writing the node-local return file exactly as
pearlctl.agent.workers does) says the lent GPU is back, and the hook reclaims through its DaemonChannel with
no daemon anywhere — then trains on.

It needs only CUDA PyTorch (no vLLM, no DeepSpeed): the engine is a small stand-in for a ZeRO-0 DeepSpeed
engine (module, optimizer, device, save/load_checkpoint), so the hook takes its real "optimizer states to
host" path and its checkpoint release. Checked on the GPU:

1. ``release`` frees at least 60% of what the optimizer states and gradients hold (torch.cuda.memory_allocated);
2. with no daemon address at all, ``ensure_reclaimed`` blocks, and returns promptly once the return file
   appears, by a ``local-return:`` reclaim;
3. after the reclaim the memory is back and the parameters equal those released (checkpoint reload);
4. one more optimizer step runs and gives a finite loss.

    python scripts/gpu_smoke_return.py [--hidden 4096] [--layers 4] [--device cpu]

``--device cpu`` runs the same flow without the memory checks (how it is checked where there is no GPU).

Prints one JSON line and exits 0 when every check holds, 1 when one fails, 0 with SKIP without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Engine:
    """What TrainerHook uses of a ZeRO-0 DeepSpeed engine."""

    def __init__(self, torch, hidden: int, layers: int, device: str):
        self.torch = torch
        self.device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        self.module = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)]).to(self.device)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.global_steps = 0

    def zero_optimization_stage(self) -> int:
        return 0

    def step(self, x):
        loss = self.module(x).float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.global_steps += 1
        return float(loss.detach())

    def save_checkpoint(self, path: str, tag: str, client_state: dict) -> None:
        Path(path, tag).mkdir(parents=True, exist_ok=True)
        self.torch.save({"module": self.module.state_dict(), "client": client_state}, Path(path, tag, "model.pt"))

    def load_checkpoint(self, path: str, tag: str):
        doc = self.torch.load(Path(path, tag, "model.pt"), map_location=self.device)
        self.module.load_state_dict(doc["module"])
        return str(Path(path, tag)), doc["client"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("SKIP gpu_smoke_return: torch has no CUDA device")
        return 0
    mem = torch.cuda.memory_allocated if gpu else (lambda: 0)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    from pearlctl.trainer import TrainerHook
    from pearlctl.trainer.channel import DaemonChannel

    work = Path(tempfile.mkdtemp(prefix="pearl-return-smoke-"))
    (work / "run").mkdir()
    return_file = work / "node" / "returned.json"
    engine = Engine(torch, args.hidden, args.layers, args.device)
    x = torch.randn(64, args.hidden, device=engine.device)
    engine.step(x)  # optimizer states exist now
    engine.optimizer.zero_grad(set_to_none=False)
    engine.step(x)
    sync()
    channel = DaemonChannel(str(work / "run"), "smoke", return_file=str(return_file))  # no daemon.json: no daemon
    hook = TrainerHook(engine, channel=channel, rank=0, world_size=1, ckpt_dir=work / "ckpt", poll_interval_s=0.05)
    params_before = [p.detach().clone() for p in engine.module.parameters()]
    checks: dict[str, object] = {"device": torch.cuda.get_device_name(0) if gpu else "cpu"}

    held = mem()
    release = hook.release(mode="checkpoint")
    sync()
    freed = held - mem()
    states = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t))  # fmt: skip
    param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    expected = states + param_bytes  # Adam's two moments (now on the host) and the gradients (dropped)
    checks.update(held_mib=held >> 20, freed_mib=freed >> 20, expected_mib=expected >> 20, release=release["freed_by"])
    ok = freed >= 0.6 * expected or not gpu

    # the node's agent returns the lent GPU while the daemon is unreachable: the hook reclaims by itself
    def agent_returns():
        time.sleep(1.0)
        tmp = return_file.with_name(".returned.json.tmp")
        return_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"returned_at": time.time(), "deadline": time.time(), "gpus": [0],
                                   "worker_key": "rollout-0", "how": "stopped"}))  # fmt: skip
        tmp.replace(return_file)

    threading.Thread(target=agent_returns, daemon=True).start()
    t0 = time.monotonic()
    outcome = hook.ensure_reclaimed()
    waited = time.monotonic() - t0
    sync()
    reclaim = (outcome or {}).get("reclaim") or {}
    checks.update(
        reclaim_command=reclaim.get("command_id"),
        blocked_s=round(waited, 3),
        back_mib=mem() >> 20,
        released=hook.released,
    )
    ok &= str(reclaim.get("command_id", "")).startswith("local-return:") and not hook.released and waited < 10
    ok &= mem() >= held - (param_bytes + (1 << 20)) or not gpu  # states back (grads come with a step)
    same = all(torch.equal(a, b) for a, b in zip(params_before, engine.module.parameters(), strict=True))
    loss = engine.step(x)
    checks.update(params_restored=same, loss_after=loss)
    ok &= same and loss == loss and abs(loss) != float("inf")
    checks["ok"] = bool(ok)
    print(json.dumps(checks))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
