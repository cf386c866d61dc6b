"""The trainer's side of the controller: what the trainer hook reports (its phase, its acks of release and
reclaim commands) and the rollout driver's progress, folded into state; the answers the hook long-polls for.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from pearlctl.api import LOCAL_RETURN_PREFIX, ORPHAN_RECLAIM_PREFIX, bodies
from pearlctl.daemon.effects import pending_trainer_command, record_trainer_ack
from pearlctl.daemon.policy_view import work_from_progress
from pearlctl.daemon.shared import ControlError, Side
from pearlctl.state.machines import WorkerState
from pearlctl.state.schema import ROLLOUT_PROGRESS, TRAINER_REPORT
from pearlctl.vocabulary import JUDGE_BUSY_REPORTS, Role


class TrainerSide(Side):
    """The trainer hook's and the rollout driver's reports."""

    def phase(self, body: bodies.TrainerPhase) -> dict:
        """The trainer reports where it is; the answer is the command the current step asks for."""
        return self.report(body)[0]

    def report(self, body: bodies.TrainerPhase) -> tuple[dict, int]:
        """``phase``, and the long polls' passes published before the command was read (``hold``)."""
        with self.lock:
            passes = self.long_polls.passes
            run = self.store.runs.get(self.run_id)
            before = run.get(TRAINER_REPORT) or {}
            now = self.clock()
            report = dict(body.model_dump(mode="json"), reported_at=now)
            new_phase = (before.get("phase"), before.get("step")) != (body.phase, body.step)
            # the expected wait counts from when this wait began, not from each report of it
            report["phase_since"] = now if new_phase else before.get("phase_since", now)
            event = "trainer phase" if new_phase else None
            self.store.update_fields(
                "runs",
                self.run_id,
                epoch=self.epoch,
                event=event,
                data={"phase": body.phase, "step": body.step} if event else None,
                trainer=report,
            )
            # wake the control loop only for what a decision or a probe depends on, not for every poll
            watched = ("phase", "step", "released")
            if any(before.get(k) != report.get(k) for k in watched) or (body.blocked_s is None) != (
                before.get("blocked_s") is None
            ):
                self.wake.set()
            return self._answer(body.released, report["phase_since"]), passes

    def _answer(self, released: bool, phase_since: float) -> dict:
        """The answer to a trainer's report: the command the current step asks for (under the lock)."""
        command = pending_trainer_command(self.store, self.run_id)
        if command["command"] is None and released and self._nothing_lent_or_moving():
            # released, yet no transition holds the GPUs and none is lent: a release nobody wants any more
            # (e.g. a held release carried out after its borrow was rolled back) — take them back
            command = {"command": "reclaim", "command_id": f"{ORPHAN_RECLAIM_PREFIX}{phase_since}"}
        return {"epoch": self.epoch, **command}

    async def hold(self, body: bodies.TrainerPhase, reported: tuple[dict, int]) -> dict:
        """Long poll: a report with ``wait_s`` that got no command is held (in the event loop) until state
        changes and a command is there, or ``wait_s``, at most one heartbeat interval, passes — so an offload or
        a reload reaches a waiting trainer in milliseconds, not at its next poll."""
        answer, passes = reported
        deadline = time.monotonic() + min(body.wait_s, self.heartbeat_s)
        while answer.get("command") is None and (left := deadline - time.monotonic()) > 0:
            if not await self.long_polls.next_pass(passes, left):
                break
            answer, passes = await asyncio.to_thread(self._again, body)
        return answer

    def _again(self, body: bodies.TrainerPhase) -> tuple[dict, int]:
        with self.lock:
            passes = self.long_polls.passes
            since = (self.store.runs.get(self.run_id).get(TRAINER_REPORT) or {}).get("phase_since", self.clock())
            return self._answer(body.released, since), passes

    def _nothing_lent_or_moving(self) -> bool:
        if any(g.borrowed for g in self.store.fleet.gpus(self.run_id)):
            return False
        return not self.store.transitions.open(self.run_id)

    def ack(self, body: bodies.Ack) -> dict:
        with self.lock:
            found = record_trainer_ack(self.store, self.run_id, body.command_id, dict(body.result), self.epoch)
            if not found and body.command_id.startswith((LOCAL_RETURN_PREFIX, ORPHAN_RECLAIM_PREFIX)):
                why = "after the agent's own return" if body.command_id.startswith(LOCAL_RETURN_PREFIX) else "orphan"
                self.store.journal_event(
                    self.run_id,
                    "runs",
                    self.run_id,
                    f"trainer reclaimed ({why})",
                    data={"command_id": body.command_id, "ok": body.result.get("ok")},
                    epoch=self.epoch,
                )
                found = True
            if not found:
                raise ControlError(f"no step {body.command_id!r} in run {self.run_id}", 404)
            self.wake.set()
            return {"epoch": self.epoch, "ok": True}

    def _judge_rate(self, report: dict, before: dict, judge: bodies.JudgeQueue, now: float) -> None:
        """Beside the driver's judge queue (the report is stored as it was sent, a Progress, as with tokens_per_s):
        ``verdicts_per_s`` between this report and the last; ``judge_saturated``: at how many reports in a row, this
        one the last, every GPU judging had work (verdicts waiting, or at least one in flight per GPU; counted up to
        ``JUDGE_BUSY_REPORTS``); ``judge_busy``: saturated at ``JUDGE_BUSY_REPORTS`` reports in a row (both ends of
        the rate's window and the report before it), so the rate is the judges' capacity;
        ``judge_capacity_per_judge_s``: the most verdicts per second per GPU judging that a busy rate showed
        (Judging, what the planner knows of the judge between batches and early in a batch)."""
        workers = self.store.fleet.workers(self.run_id)
        ready = [w for w in workers if w.role == Role.REWARD and w.state == WorkerState.READY]
        gpus = sum(len(w.gpu_idx or ()) or 1 for w in ready)  # per GPU judging, as policies count judges
        saturated = bool(gpus) and (judge.waiting > 0 or judge.judging >= gpus)
        prior = before.get("judge_saturated")
        prior = prior if type(prior) is int else 0  # (an older daemon's bool counts as none)
        report["judge_saturated"] = min(prior + 1, JUDGE_BUSY_REPORTS) if saturated else 0
        report["judge_capacity_per_judge_s"] = before.get("judge_capacity_per_judge_s")
        judged_before, last_at = (before.get("judge") or {}).get("done"), before.get("reported_at")
        if not isinstance(judged_before, int) or not last_at or now <= last_at:
            return
        report["verdicts_per_s"] = rate = round((judge.done - judged_before) / (now - last_at), 2)
        report["judge_busy"] = busy = report["judge_saturated"] >= JUDGE_BUSY_REPORTS
        if busy and rate > 0:
            seen = round(rate / gpus, 3)
            report["judge_capacity_per_judge_s"] = max(seen, report["judge_capacity_per_judge_s"] or 0.0)

    def rollout_progress(self, body: bodies.Progress) -> dict:
        """The rollout driver's counts (queued, generating, tool_wait, done, tokens) and its judge queue (waiting,
        judging, done, failed), when it scores with a judge: kept for status, /metrics and the planner; tokens and
        verdicts per second are derived from successive reports."""
        with self.lock:
            run = self.store.runs.get(self.run_id)
            before = run.get(ROLLOUT_PROGRESS) or {}
            now = self.clock()
            report = body.model_dump(mode="json", exclude={"work"})
            report["reported_at"] = now
            if body.work is not None:  # what the planner predicts with (planner.model.Work's fields)
                report["work"] = dict(body.work)
            # when the work in flight last emptied (the batch's end): kept while it stays empty, None while work
            # is left and before any work was seen (the planner's Trainer.batch_ready compares it with the wait)
            # the batch's work as it began (its first report with work after none): Snapshot.last_batch
            report["batch_work"] = before.get("batch_work")
            if not work_from_progress(report).empty:
                if not before or work_from_progress(before).empty:
                    report["batch_work"] = asdict(work_from_progress(report))
                report["emptied_at"] = None
            elif before and not work_from_progress(before).empty:
                report["emptied_at"] = now
                self.wake.set()  # the batch ended: lent GPUs go back now (Borrowing.tick)
            else:
                report["emptied_at"] = before.get("emptied_at")
            last_tokens, last_at = before.get("tokens"), before.get("reported_at")
            if isinstance(last_tokens, int) and body.tokens is not None and last_at and now > last_at:
                report["tokens_per_s"] = round((body.tokens - last_tokens) / (now - last_at), 2)
            if body.judge is not None:
                self._judge_rate(report, before, body.judge, now)
            # bookkeeping: no agent's desired workers derive from it (held long polls are not woken)
            self.store.update_fields("runs", self.run_id, epoch=self.epoch, bookkeeping=True, rollout=report)
            return {"epoch": self.epoch}
