"""The trainer hook: what a DeepSpeed training loop calls so pearlctl can borrow its GPUs between steps.

While the trainer waits for rollouts its GPUs sit idle; the daemon may lend them to vLLM rollout workers
and must get them back before the next step. The loop tells the daemon where it is (``phase``), and at
the points where it is safe the daemon's command — ``release`` or ``reclaim`` — is carried out on every
rank at the same moment::

    hook = TrainerHook(engine, channel=channel, ckpt_dir=run_dir / "checkpoints", base_model_dir=model)
    hook.save_on_signal(run_dir / "checkpoints")          # Slurm preemption (USR2) and TERM
    step = hook.resume()                                   # 0 on a fresh run
    while step < steps:
        step += 1
        hook.phase("waiting", step=step, expected_wait_s=eta)   # a release may happen here
        batch = wait_for_rollouts()       # or hook.wait_until(ready, step=step): serves commands while waiting
        hook.ensure_reclaimed()           # top of every train step: blocks while the GPUs are lent out
        hook.phase("training", step=step)
        ...forward, backward, engine.step()...
        hook.export_weights(run_dir / "weights", version=str(step))
        if hook.should_stop():
            hook.checkpoint_and_exit()

Invariants:

- **Every rank acts on the same decision at the same point.** Only rank 0 talks to the channel; its
  decision travels to all ranks in one tiny all-reduce (MAX over a 5-element tensor that also carries
  the stop flag, a readiness flag and a call-site id, so ranks that call hook methods in different
  orders fail loudly instead of agreeing on garbage). Hence every method except ``released`` and the
  channel classes is *collective*: call it on every rank, in the same order.
- **The trainer never trains on released GPUs.** ``release`` is carried out only at waiting points
  (``phase("waiting")``, ``wait_until``, ``ensure_reclaimed``); a release that arrives with
  ``phase("training")`` is held until the next waiting point, and ``phase("training")`` while released
  blocks like ``ensure_reclaimed``.
- **A held release is carried out only while it is still wanted.** It is held once per command id (one
  already held, or already carried out, is not held again). A reclaim — arriving, or carried out — drops
  every held release: it belonged to a transition that has been undone. At a waiting point the channel's
  answer wins: when it answers a command, held releases are dropped and the answer is acted on instead;
  when it answers nothing, a channel that repeats the command it wants on every report
  (``repeats_commands = True``: the daemon's, which repeats its pending OFFLOAD step) has confirmed
  nothing, so its held releases are dropped too, and a channel that delivers each command once
  (``FileChannel``; the unit tests' queue channel) gets its oldest held release carried out. A dropped release is not
  acked (a daemon that still wants it asks again). Without this a release of an undone transition was
  carried out with nothing lent, and ``ensure_reclaimed`` waited forever for a reclaim that never came.
- **The ack means all ranks are done.** Release and reclaim end with an all-reduce of their duration, so
  rank 0 acks (and the daemon starts a vLLM worker on the GPUs) only after every rank has offloaded.
- **Idempotent by command id.** A release while released, or a reclaim while not released, is a no-op;
  a command id seen before is answered with the stored result and not carried out again (an HTTP retry).
- **A daemon that is down never stops training.** A channel error counts as "no command". (While the
  GPUs are lent out, the hook keeps polling: only the daemon knows when vLLM has left them — or the node:
  past a lent GPU's return deadline with the daemon unreachable, the node's agent stops or parks the lent
  worker itself and writes a node-local return file, which ``DaemonChannel`` turns into a reclaim with
  the id ``local-return:<returned_at>``, no daemon in the path; see pearlctl.trainer.channel.)
- **Signals only set a flag.** The ranks agree at the next collective; a joint checkpoint follows.

DeepSpeed 0.19.8 facts the hook is shaped by (docs/architecture.md, "Engines on a CPU-only machine"; the
code that follows them is pearlctl.trainer.offload):
``offload_states`` / ``reload_states`` exist for ZeRO-1/2/3 only, and ZeRO-3's needs DeepSpeed's FusedAdam;
ZeRO-0 (and ZeRO-3 with another optimizer) release by checkpoint instead. On a CPU-only machine offloading
moves CPU to CPU: the call flow is real, the memory release is not.

Where the parts live: this module holds the hook's command handling (phases, the channel, release and
reclaim, signals and checkpoints); its rank agreement, engine offload and weight export are mixins from
pearlctl.trainer.agreement, pearlctl.trainer.offload and pearlctl.trainer.weights, and the channel contract
is pearlctl.trainer.control.

Import-light: importing this module imports neither torch nor deepspeed; torch is imported inside the
methods that need it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pearlctl.trainer.agreement import (
    _CODE_OF,
    _NONE,
    _RECLAIM,
    _RELEASE_OFFLOAD,
    _SITE_PHASE,
    _SITE_RECLAIM_WAIT,
    _SITE_STOP,
    _SITE_WAIT_UNTIL,
    RankAgreement,
    _destroy_process_group,
    _dist_rank_world,
)
from pearlctl.trainer.control import ControlChannel, NullChannel
from pearlctl.trainer.offload import EngineOffload, _safe_zero_stage
from pearlctl.trainer.weights import WeightExport

log = logging.getLogger("pearlctl.trainer")

PHASES = ("training", "waiting")
"""What ``phase()`` accepts. Events also carry ``"stopped"`` once, from ``checkpoint_and_exit``."""
COMMANDS = ("release", "reclaim")
RELEASE_MODES = ("offload", "checkpoint")
FIRST_WAIT_ENV = "PEARL_FIRST_WAIT_S"
"""A user's hint of the first batch's wait, in seconds (unset: none). With no hint, the daemon predicts the batch
in flight from the run's profile and the driver's work report; a hint is for a trainer whose rollout reports no
work (e.g. a run with no rollout GPU before the first borrow). A run spec sets it in ``[pools.trainer] env``."""


def _non_negative(value: Any, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds >= 0.0 and seconds != float("inf")):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    return seconds


def first_wait_hint() -> float | None:
    """``$PEARL_FIRST_WAIT_S`` as seconds, or None when unset or empty; a ValueError naming it when not a number."""
    raw = os.environ.get(FIRST_WAIT_ENV, "").strip()
    return _non_negative(raw, FIRST_WAIT_ENV) if raw else None


class TrainerHook(RankAgreement, EngineOffload, WeightExport):
    """See the module docstring. ``engine`` is a DeepSpeed engine (``deepspeed.initialize``'s first value).

    Keyword arguments beyond the brief's three: ``ckpt_dir`` (checkpoints for ``release(mode=
    "checkpoint")``, ``checkpoint_and_exit`` and ``resume``; ``save_on_signal`` sets it too),
    ``base_model_dir`` (config and tokenizer files copied into weight exports), ``release_mode``
    (used when a release command names none), ``poll_interval_s`` (how often a blocked or waiting
    trainer asks the channel), ``on_command`` (called on every rank with ``{"command", "command_id",
    "result"}`` after a command was carried out: for the loop's log), ``first_wait_s`` (a hint of the first
    batch's wait, default ``$PEARL_FIRST_WAIT_S``: see ``FIRST_WAIT_ENV``), and ``all_reduce_max`` — the one
    seam unit tests replace: a function that takes this rank's list of floats and returns the
    element-wise maximum over all ranks.
    """

    def __init__(
        self,
        engine: Any,
        *,
        channel: ControlChannel | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        ckpt_dir: str | os.PathLike | None = None,
        base_model_dir: str | os.PathLike | None = None,
        release_mode: str = "offload",
        poll_interval_s: float = 0.2,
        all_reduce_max: Callable[[list[float]], list[float]] | None = None,
        on_command: Callable[[dict], None] | None = None,
        first_wait_s: float | None = None,
    ) -> None:
        if release_mode not in RELEASE_MODES:
            raise ValueError(f"release_mode must be one of {RELEASE_MODES}, not {release_mode!r}")
        self.engine = engine
        self.channel: ControlChannel = channel if channel is not None else NullChannel()
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
        self.base_model_dir = Path(base_model_dir) if base_model_dir is not None else None
        self.release_mode = release_mode
        self.poll_interval_s = poll_interval_s
        self._all_reduce_max = all_reduce_max
        self.on_command = on_command
        self.step: int | None = None  # the step of the latest phase() report
        self.weight_version: str | None = None  # the latest export
        self.last_export: dict | None = None  # timings of the latest export
        self._released: dict | None = None  # how we released: mode, ckpt_dir, tag, how
        self._signal: int | None = None  # set by the signal handler only
        self._stop_agreed = False
        self._deferred: OrderedDict[str, dict] = OrderedDict()  # rank 0: releases held while training, by id
        self._handled: OrderedDict[str, dict] = OrderedDict()  # rank 0: command_id -> result
        # a user's hint of the first batch's wait (``first_wait_s``, else $PEARL_FIRST_WAIT_S; none by default):
        # reported, counted down, by the waiting reports of the first step that waits which give no expected wait
        self.first_wait_s = first_wait_hint() if first_wait_s is None else _non_negative(first_wait_s, "first_wait_s")
        self._first_wait: tuple[int, float] | None = None  # (the first step that waited, when it began)

    # ------------------------------------------------------------------ state
    @property
    def released(self) -> bool:
        """True while the GPUs are lent out (offloaded or checkpointed and freed)."""
        return self._released is not None

    @property
    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage())

    # ------------------------------------------------------------------ phases and commands
    def phase(
        self, name: str, *, step: int, expected_wait_s: float | None = None, metrics: dict | None = None
    ) -> dict | None:
        """Report where the loop is; carry out the daemon's command, if any, on every rank. Collective.

        Returns ``{"command", "command_id", "result"}`` for a command carried out here, else ``None``.
        ``phase("training")`` never releases (a release then waits for the next waiting point), and
        blocks until reclaimed if called while released.
        """
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {name!r}")
        self.step = step
        if name == "training" and self.released:
            log.warning("phase('training') while released: blocking until reclaimed (call ensure_reclaimed first)")
            self.ensure_reclaimed()
        cmd, code = None, _NONE
        if self.rank == 0:
            if name == "waiting":
                expected_wait_s = self._or_first_wait(step, expected_wait_s)
            event = self._event(name, step=step, expected_wait_s=expected_wait_s, metrics=metrics)
            cmd, code = self._poll(event, can_release=name == "waiting")
        code, _ready = self._agree(_SITE_PHASE, code)
        return self._carry_out(code, cmd)

    def wait_until(
        self,
        ready: Callable[[], bool],
        *,
        step: int,
        expected_wait_s: float | None = None,
        metrics: dict | None = None,
        poll_interval_s: float | None = None,
    ) -> bool:
        """Wait (reporting "waiting" and serving commands) until ``ready()`` on rank 0 says so. Collective.

        ``ready`` is evaluated on rank 0 only (e.g. "the rollout batch file exists"). Returns True when
        ready — possibly still released: call ``ensure_reclaimed()`` before training — or False as soon
        as the ranks agreed to stop (a signal arrived; the caller checkpoints and exits).
        """
        poll = self.poll_interval_s if poll_interval_s is None else poll_interval_s
        self.step = step
        t0 = time.monotonic()
        while True:
            cmd, code, is_ready = None, _NONE, 0
            if self.rank == 0:
                is_ready = 1 if ready() else 0
                left = None if expected_wait_s is None else max(0.0, expected_wait_s - (time.monotonic() - t0))
                event = self._event(
                    "waiting", step=step, expected_wait_s=self._or_first_wait(step, left), metrics=metrics
                )
                if not is_ready:
                    event["wait_s"] = poll  # long poll: a command reaches us as soon as there is one
                t = time.monotonic()
                cmd, code = self._poll(event, can_release=True)
                rest = poll - (time.monotonic() - t)  # what a daemon that held the report did not wait
            code, agreed_ready = self._agree(_SITE_WAIT_UNTIL, code, ready=is_ready)
            self._carry_out(code, cmd)
            if self._stop_agreed:
                return False
            if agreed_ready:
                return True
            if self.rank == 0 and cmd is None and rest > 0:
                time.sleep(rest)

    def ensure_reclaimed(self) -> dict | None:
        """Call at the top of every train step. Returns at once when not released (no collective);
        else blocks, polling the channel, until a ``reclaim`` arrives and is carried out.

        A stop agreed while released (a signal) ends here: joint checkpoint and exit, without taking the
        lent GPUs back (``checkpoint_and_exit``). Returns ``{"blocked_s", "reclaim"}`` after a block.
        """
        if not self.released:
            return None
        t0 = time.monotonic()
        outcome = None
        while self.released:
            cmd, code = None, _NONE
            if self.rank == 0:
                event = self._event("waiting", step=self.step, blocked_s=round(time.monotonic() - t0, 3))
                event["wait_s"] = self.poll_interval_s  # long poll: the reclaim reaches us as soon as it is asked
                t = time.monotonic()
                cmd, code = self._poll(event, can_release=True)
                rest = self.poll_interval_s - (time.monotonic() - t)
            code, _ready = self._agree(_SITE_RECLAIM_WAIT, code)
            done = self._carry_out(code, cmd)
            if done is not None and done["command"] == "reclaim":
                outcome = done
            if self._stop_agreed and self.released:
                self.checkpoint_and_exit()
            if self.rank == 0 and self.released and done is None and rest > 0:
                time.sleep(rest)
        return {"blocked_s": round(time.monotonic() - t0, 6), "reclaim": outcome}

    # ------------------------------------------------------------------ release / reclaim
    def release(self, mode: str | None = None, ckpt_dir: str | os.PathLike | None = None) -> dict:
        """Give the GPUs up. Collective (every rank calls it). Idempotent: a second call is a no-op.

        ``offload`` (ZeRO-1/2/3): ``engine.offload_states()`` — optimizer states, fp32 master and bf16
        parameters, gradients move to host memory. ``checkpoint`` (and ZeRO-0, or ZeRO-3 without
        FusedAdam, where offloading is not possible): ``save_checkpoint`` into ``ckpt_dir``, then free what
        can be freed (offload_states where it works; else gradients dropped, optimizer states to host).
        Returns timings in seconds (``total_s`` this rank, ``max_rank_s`` the slowest rank) and, on CUDA,
        ``memory_before``/``memory_after`` (``torch.cuda.memory_allocated``).
        """
        if self.released:
            return {"noop": True, "released": True, "mode": self._released["mode"]}
        mode = mode or self.release_mode
        if mode not in RELEASE_MODES:
            raise ValueError(f"release mode must be one of {RELEASE_MODES}, not {mode!r}")
        ckpt = Path(ckpt_dir) if ckpt_dir is not None else self.ckpt_dir
        result: dict[str, Any] = {"noop": False, "zero_stage": self.zero_stage, "requested_mode": mode}
        cannot = self._cannot_offload()
        if mode == "offload" and cannot:
            if ckpt is None:
                raise RuntimeError(f"cannot offload ({cannot}) and no ckpt_dir to release by checkpoint")
            mode, result["fallback"] = "checkpoint", cannot
        if mode == "checkpoint" and ckpt is None:
            raise ValueError("release(mode='checkpoint') needs ckpt_dir (argument, constructor, or save_on_signal)")
        result["mode"] = mode
        t0 = time.monotonic()
        result["memory_before"] = self._device_memory()
        tag = None
        if mode == "checkpoint":
            tag = f"global_step{self.engine.global_steps}"
            t = time.monotonic()
            client_state = {"step": self.engine.global_steps, "pearl_release": True}
            self.engine.save_checkpoint(str(ckpt), tag=tag, client_state=client_state)
            result["checkpoint_s"] = round(time.monotonic() - t, 6)
            result["checkpoint"] = str(ckpt / tag)
        t = time.monotonic()
        how = self._free()
        result["offload_s" if mode == "offload" else "free_s"] = round(time.monotonic() - t, 6)
        result["freed_by"] = how
        result["memory_after"] = self._device_memory()
        self._released = {"mode": mode, "ckpt_dir": ckpt, "tag": tag, "how": how}
        result["total_s"] = round(time.monotonic() - t0, 6)
        result["max_rank_s"] = round(self._max_over_ranks(result["total_s"]), 6)
        result["released"] = True
        return result

    def reclaim(self) -> dict:
        """Take the GPUs back. Collective. A no-op when not released.

        After ``offload``: ``engine.reload_states()``. After ``checkpoint``: undo the free, then
        ``load_checkpoint`` of the release checkpoint (the state the trainer released with) — except on
        ZeRO-3, where DeepSpeed cannot load into a live partitioned engine and the kept state is used.
        """
        self._drop_held("a reclaim")  # they belonged to a transition that has been undone
        if not self.released:
            return {"noop": True, "released": False}
        rel = self._released
        result: dict[str, Any] = {"noop": False, "mode": rel["mode"], "zero_stage": self.zero_stage}
        t0 = time.monotonic()
        result["memory_before"] = self._device_memory()
        t = time.monotonic()
        self._unfree(rel["how"])
        result["reload_s"] = round(time.monotonic() - t, 6)
        if rel["mode"] == "checkpoint" and self.zero_stage == 3:
            # DeepSpeed: under ZeRO-3 load_checkpoint right after save_checkpoint needs a fresh engine (the
            # module is partitioned). The in-process state was kept, so there is nothing to restore; the
            # checkpoint is what a restarted trainer resumes from.
            result["load_skipped"] = "ZeRO-3 cannot load_checkpoint into a live engine; in-process state was kept"
        elif rel["mode"] == "checkpoint":
            t = time.monotonic()
            path, _client = self.engine.load_checkpoint(str(rel["ckpt_dir"]), tag=rel["tag"])
            if path is None:
                raise RuntimeError(f"load_checkpoint found no checkpoint {rel['tag']} in {rel['ckpt_dir']}")
            result["load_s"] = round(time.monotonic() - t, 6)
        result["memory_after"] = self._device_memory()
        self._released = None
        result["total_s"] = round(time.monotonic() - t0, 6)
        result["max_rank_s"] = round(self._max_over_ranks(result["total_s"]), 6)
        result["released"] = False
        return result

    # ------------------------------------------------------------------ signals and checkpoints
    def save_on_signal(self, ckpt_dir: str | os.PathLike, signals: Sequence[str] = ("USR2", "TERM")) -> None:
        """Install flag-only handlers (main thread only). Slurm sends USR2 before preemption
        (``--signal=B:USR2@T``) and TERM at the end; the checkpoint happens at the next step boundary."""
        self.ckpt_dir = Path(ckpt_dir)
        for name in signals:
            signum = getattr(signal, name if name.startswith("SIG") else "SIG" + name)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is None:
            self._signal = signum

    def should_stop(self) -> bool:
        """True on every rank once any rank got a signal. Collective (one all-reduce at the step boundary)."""
        if self._stop_agreed:
            return True
        self._agree(_SITE_STOP, _NONE)
        return self._stop_agreed

    def checkpoint(self, step: int | None = None, ckpt_dir: str | os.PathLike | None = None) -> dict:
        """Joint checkpoint (every rank calls it): tag ``global_step{N}``, ``client_state["step"] = step``
        (default: the engine's completed optimizer steps). Returns ``{"path", "step", "save_s"}``."""
        ckpt = Path(ckpt_dir) if ckpt_dir is not None else self.ckpt_dir
        if ckpt is None:
            raise ValueError("checkpoint needs ckpt_dir (argument, constructor, or save_on_signal)")
        step = self.engine.global_steps if step is None else step
        tag = f"global_step{self.engine.global_steps}"
        t = time.monotonic()
        self.engine.save_checkpoint(str(ckpt), tag=tag, client_state={"step": step})
        return {"path": str(ckpt / tag), "step": step, "save_s": round(time.monotonic() - t, 6)}

    def checkpoint_and_exit(
        self, step: int | None = None, ckpt_dir: str | os.PathLike | None = None, exit_code: int = 0
    ) -> NoReturn:
        """Joint checkpoint on every rank, report ``"stopped"``, then ``sys.exit(exit_code)``.

        While released the lent GPUs are not taken back: DeepSpeed saves from host memory (offloaded
        states), so a preempted job does not fight the rollout worker for GPU memory.
        """
        info = self.checkpoint(step, ckpt_dir)
        self._barrier()
        if self.rank == 0:
            signame = signal.Signals(self._signal).name if self._signal else None
            event = self._event("stopped", step=info["step"], metrics={"checkpoint": info, "signal": signame})
            try:
                self.channel.report(event)
            except Exception as exc:  # the daemon being down must not block the exit
                log.warning("could not report the stop to the daemon: %s", exc)
        log.info("checkpoint %s at step %s (%.3f s); exit %d", info["path"], info["step"], info["save_s"], exit_code)
        sys.stdout.flush()
        _destroy_process_group()  # else a rank may abort in teardown ("terminate called ...")
        sys.exit(exit_code)

    def resume(self, ckpt_dir: str | os.PathLike | None = None) -> int:
        """Load the latest checkpoint in ``ckpt_dir`` (every rank calls it); return its step, 0 if none."""
        ckpt = Path(ckpt_dir) if ckpt_dir is not None else self.ckpt_dir
        if ckpt is None:
            raise ValueError("resume needs ckpt_dir (argument, constructor, or save_on_signal)")
        self.ckpt_dir = ckpt
        if not (ckpt / "latest").exists():
            return 0
        path, client_state = self.engine.load_checkpoint(str(ckpt))
        if path is None:
            raise RuntimeError(f"load_checkpoint could not load the checkpoint named by {ckpt / 'latest'}")
        return int((client_state or {}).get("step", self.engine.global_steps))

    # ------------------------------------------------------------------ internals: the channel
    def _or_first_wait(self, step: int, expected_wait_s: float | None) -> float | None:
        """The loop's expected wait; when it gives none in the first step that waits, the user's first-wait hint
        (if any), counted down from that step's first waiting report."""
        if self._first_wait is None:
            self._first_wait = (step, time.monotonic())
        first_step, since = self._first_wait
        if expected_wait_s is not None or self.first_wait_s is None or step != first_step:
            return expected_wait_s
        return max(0.0, self.first_wait_s - (time.monotonic() - since))

    def _event(self, phase: str, *, step: int | None, expected_wait_s: float | None = None, **extra: Any) -> dict:
        event = {
            "phase": phase,
            "step": step,
            "expected_wait_s": None if expected_wait_s is None else round(float(expected_wait_s), 3),
            "metrics": extra.pop("metrics", None),
            "released": self.released,
            "release_mode": self._released["mode"] if self._released else None,
            "weight_version": self.weight_version,
            "world_size": self.world_size,
            "zero_stage": _safe_zero_stage(self.engine),
            "ts": round(time.time(), 3),
        }
        event.update(extra)
        return event

    def _poll(self, event: dict, *, can_release: bool) -> tuple[dict | None, int]:
        """Rank 0: report, and turn the answer (or a held release) into a decision code."""
        try:
            answer = self.channel.report(event)
        except Exception as exc:
            log.warning("trainer channel report failed (treated as no command): %s", exc)
            answer = None
        if answer is not None and answer.get("command") is None:
            answer = None
        if answer is not None and answer.get("command") == "reclaim":
            self._drop_held(f"reclaim {answer.get('command_id')}")
        if can_release and self._deferred:
            # The channel's answer at a waiting point wins over what was held (module docstring).
            if answer is not None:
                self._drop_held(f"the channel now answers {answer.get('command')} {answer.get('command_id')}")
            elif getattr(self.channel, "repeats_commands", False):
                self._drop_held("the channel, which repeats what it wants, asks for nothing now")
        cmd = self._triage(answer) if answer is not None else None
        if cmd is not None and cmd["command"] == "release" and not can_release:
            self._hold(cmd)  # never release in the middle of a training step
            cmd = None
        if cmd is None and can_release:
            cmd = self._next_held()
        if cmd is None:
            return None, _NONE
        if cmd["command"] == "reclaim":
            return cmd, _RECLAIM
        return cmd, _CODE_OF[("release", cmd["_mode"])]

    def _hold(self, cmd: dict) -> None:
        """Rank 0: hold a release until the next waiting point, once per command id."""
        command_id = cmd["command_id"]
        if command_id in self._deferred or command_id in self._handled:
            return
        self._deferred[command_id] = cmd
        log.info("release %s held until the next waiting point", command_id)

    def _next_held(self) -> dict | None:
        """Rank 0: the oldest held release not carried out since, or None."""
        while self._deferred:
            _command_id, cmd = self._deferred.popitem(last=False)
            if cmd["command_id"] not in self._handled:
                return cmd
        return None

    def _drop_held(self, why: str) -> None:
        if self._deferred:
            log.info("held release(s) %s dropped: %s", ", ".join(self._deferred), why)
            self._deferred.clear()

    def _triage(self, cmd: dict) -> dict | None:
        """Rank 0: validate a command; answer repeats and invalid ones at once. Returns what to carry out."""
        cmd = dict(cmd)
        command_id = str(cmd.get("command_id") or uuid.uuid4().hex[:12])
        cmd["command_id"] = command_id
        if command_id in self._handled:  # a retry of a command already carried out: same answer
            self._ack(command_id, self._handled[command_id])
            return None
        error = None
        name = cmd.get("command")
        if name not in COMMANDS:
            error = f"unknown command {name!r}; expected one of {COMMANDS}"
        elif name == "release":
            mode = cmd.get("mode") or self.release_mode
            if mode not in RELEASE_MODES:
                error = f"unknown release mode {mode!r}; expected one of {RELEASE_MODES}"
            elif (mode == "checkpoint" or self._cannot_offload()) and self.ckpt_dir is None:
                error = "release by checkpoint needs the trainer's ckpt_dir, and it has none"
            cmd["_mode"] = mode
        if error is not None:
            self._ack(command_id, {"ok": False, "command": name, "error": error})
            return None
        return cmd

    def _carry_out(self, code: int, cmd: dict | None) -> dict | None:
        """Every rank: act on the agreed decision; rank 0 acks once all ranks are done."""
        if code == _NONE:
            return None
        name = "reclaim" if code == _RECLAIM else "release"
        try:
            if code == _RECLAIM:
                result = self.reclaim()
            else:
                result = self.release(mode="offload" if code == _RELEASE_OFFLOAD else "checkpoint")
        except Exception as exc:
            if self.rank == 0 and cmd is not None:
                self._ack(cmd["command_id"], {"ok": False, "command": name, "error": f"{type(exc).__name__}: {exc}"})
            raise
        result = {"ok": True, "command": name, **result}
        command_id = cmd["command_id"] if cmd is not None else None
        if self.rank == 0 and command_id is not None:
            self._handled[command_id] = result
            while len(self._handled) > 256:
                self._handled.popitem(last=False)
            self._ack(command_id, result)
        done = {"command": name, "command_id": command_id, "result": result}
        if self.on_command is not None:
            self.on_command(done)
        return done

    def _ack(self, command_id: str, result: dict) -> None:
        try:
            self.channel.ack(command_id, result)
        except Exception as exc:
            log.warning("trainer channel ack of %s failed: %s", command_id, exc)
