"""TRL's GRPOTrainer with DeepSpeed ZeRO-2 on two CPU ranks, under pearlctl's hook (examples/trl; docs/trl.md).

The example's script (examples/trl/train_grpo.py) with two ranks started directly, the tiny model, and in place
of the run's daemon and gateway: a channel that asks for a release at the first waiting point and a reclaim once
released, and a rollout client that answers every prompt with the digits of a sum (right for even requests).
Checked: both ranks exit 0 after 2 steps; the release offloaded the DeepSpeed engine's states on both ranks
(ZeRO-2 ``offload_states``) while the batch generated and the reclaim brought them back before training; one
weight export per step (version = global step); TRL corrected with the sampled logprobs.

Runs under the engine lock (tests/engines/conftest.py) and kills the ranks it started, by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import deepspeed  # noqa: F401  (installed by scripts/setup, TRL as the trl extra: missing fails, never skips)
import trl  # noqa: F401

from tests.engines.conftest import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "models" / "tiny"

DRIVER = """
import json, re, sys, time
from pathlib import Path
sys.path[:0] = [{repo!r}, {repo!r} + "/examples/trl"]
import train_grpo
from transformers import AutoTokenizer

out, tiny = Path({out!r}), {tiny!r}
tok = AutoTokenizer.from_pretrained(tiny)
rank = int(__import__("os").environ["RANK"])


class Completion:
    def __init__(self, ids, logprobs):
        self.token_ids, self.logprobs, self.weight_version, self.tokens = ids, logprobs, None, len(ids)


class StandInClient:
    count = 0

    def workers(self, force=False):  # one worker, serving the latest export (as the daemon's sync would)
        latest = out / "weights" / "LATEST"
        return [{{"url": "http://stand-in", "weight_version": latest.read_text().strip() if latest.exists() else None}}]

    def wait_for_joining(self, join_wait_s=15.0):
        return 0.0

    def complete(self, session, prompt, *, max_tokens, temperature=1.0, stop=None, extra=None):
        a, b = map(int, re.findall(r"(\\d+) \\+ (\\d+) =", tok.decode(prompt))[0])
        StandInClient.count += 1
        time.sleep(0.05)
        ids = tok(f" {{a + b + StandInClient.count % 2}}<|im_end|>", add_special_tokens=False)["input_ids"]
        return Completion(ids, [-7.6] * len(ids))


class ScriptedChannel:
    repeats_commands = False

    def __init__(self):
        self.sent = set()

    def _log(self, kind, doc):
        with (out / f"channel-{{rank}}.jsonl").open("a") as f:
            f.write(json.dumps({{"kind": kind, **doc}}) + "\\n")

    def report(self, event):
        self._log("event", event)
        if event["phase"] == "waiting" and not event["released"] and "release-1" not in self.sent:
            self.sent.add("release-1")
            return {{"command": "release", "command_id": "release-1"}}
        if event["released"] and "reclaim-1" not in self.sent:
            self.sent.add("reclaim-1")
            return {{"command": "reclaim", "command_id": "reclaim-1"}}
        return None

    def ack(self, command_id, result):
        self._log("ack", {{"command_id": command_id, "result": result}})


sys.exit(train_grpo.main(
    ["--model", tiny, "--out", str(out), "--steps", "2", "--zero", "2", "--prompts", "2", "--group-size", "4"],
    client=StandInClient(), channel=ScriptedChannel(), weights_dir=out / "weights",
))
"""


def test_grpo_trainer_zero2_two_ranks_lends_its_gpus_while_the_batch_generates(tmp_path, engine_lock):
    out = tmp_path / "out"
    out.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), out=str(out), tiny=str(TINY)))
    port = free_port()
    procs, logs = [], []
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for env_key in ("PEARL_RUN_DIR", "PEARL_RUN_ID"):
        base.pop(env_key, None)
    t0 = time.monotonic()
    try:
        for rank in range(2):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
            logs.append(tmp_path / f"rank{rank}.log")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(driver)],
                    env=env,
                    cwd=REPO,
                    stdout=logs[-1].open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    took = time.monotonic() - t0
    assert codes == [0, 0], "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in logs)

    events = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    assert start["world_size"] == 2 and start["zero"] == 2 and start["rollout"] == "pearlctl"
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2]

    channel = [json.loads(line) for line in (out / "channel-0.jsonl").read_text().splitlines()]
    acks = {c["command_id"]: c["result"] for c in channel if c["kind"] == "ack"}
    assert set(acks) == {"release-1", "reclaim-1"}
    release, reclaim = acks["release-1"], acks["reclaim-1"]
    assert release["ok"] and release["mode"] == "offload" and release["freed_by"] == "offload_states"
    assert release["zero_stage"] == 2 and reclaim["ok"] and reclaim["mode"] == "offload"
    phases = [(c["phase"], c["step"], c["released"]) for c in channel if c["kind"] == "event"]
    assert ("waiting", 1, True) in phases  # lent while the first batch generated
    after = phases.index(("training", 1, False), 1)  # then training, with the GPUs back
    assert all(not released for _, _, released in phases[after:])
    assert not (out / "channel-1.jsonl").exists()  # only rank 0 talks to the channel

    assert (out / "weights" / "LATEST").read_text().strip() == "2"
    assert sorted(p.name for p in (out / "weights").iterdir() if p.is_dir()) == ["1", "2"]
    print(
        json.dumps({"seconds": round(took, 1), "release_s": release["max_rank_s"], "reclaim_s": reclaim["max_rank_s"]})
    )
