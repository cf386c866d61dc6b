"""The simulator's truth model of the judge (a generative reward model; live: pearlctl/router/judge.py and the
example driver's ``--reward judge``): each finished trajectory is read whole by a judge worker and answered with a
short verdict, on the judge's own profile (``Judges``, one per ``pearlctl.sim.run.Sim`` of a scenario with a
``[judge]``).

The model, vectorised over verdicts:

- **One verdict per trajectory, asked the moment it finishes** (the example driver scores each trajectory as soon
  as its episode ends): its context plus the rubric (``rubric_tokens``) to prefill, then ``verdict_tokens`` to
  decode. Verdicts wait first come first served.
- **Prefill-heavy.** The judge workers serving (GPUs in role REWARD, not in transition; the judge's
  ``gpus_per_worker`` each) take waiting verdicts oldest first, at most ``max_num_seqs`` each in flight, and
  prefill them at ``prefill_tok_s`` each (chunked prefill shares a worker's budget among its prefilling verdicts in
  admission order). A verdict whose prefill ends decodes its tokens at the judge's inter-token latency for the
  verdicts decoding beside it on a worker.
- **A judge that leaves loses its share of the verdicts in flight.** They are sent again whole, ``ABORT_S`` later,
  behind those already waiting (the gateway re-sends a judge's request: one with several prompts or structured
  output cannot be continued), so their prefill starts over. Nothing is judged twice or lost.
- **The oracle loses nothing** (``free_migration``): the verdicts of a judge that leaves go on where they were,
  on the judge workers that remain (or when one serves again).
- **The truth may differ from the profile**: under a model mismatch each verdict's prefill and decode take its
  own factors of the scenario's prefill and decode perturbations (drawn from a stream of their own), as the
  policy's turns do. Policies never see them.

Guarantees: deterministic for a scenario; every submitted verdict is judged once (``judged_at``), never before its
trajectory finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pearlctl.sim.migration import ABORT_S

if TYPE_CHECKING:
    from pearlctl.sim.scenario import Judge, Mismatch

NONE, WAITING, PREFILLING, DECODING, JUDGED = range(5)


class Judges:
    """The verdicts of ``n`` trajectories and the judge workers that give them."""

    def __init__(self, judge: Judge, n: int, mismatch: Mismatch, seed: int, free_migration: bool = False):
        self.judge = judge
        self.free_migration = free_migration  # the oracle's world: a judge that leaves hands its verdicts over
        p = judge.profile
        self.prefill_tok_s, self.max_num_seqs, self.gpus_per_worker = p.prefill_tok_s, p.max_num_seqs, p.gpus_per_worker
        self.state = np.full(n, NONE, np.int8)
        self.tokens = np.zeros(n)  # prefill tokens of each verdict's request (the trajectory and the rubric)
        self.left = np.zeros(n)  # prefill tokens left
        self.ready_at = np.full(n, np.inf)  # when it may be admitted (asked, or sent again)
        self.decode_end = np.full(n, np.inf)
        self.judged_at = np.full(n, np.nan)
        rng = np.random.default_rng([seed, 0x1D6E])
        zero = mismatch.prefill.zero and mismatch.decode.zero
        self.prefill_scale = np.ones(n) if zero else mismatch.prefill.factors(rng, n)
        self.decode_scale = np.ones(n) if zero else mismatch.decode.factors(rng, n)
        self._queue = np.zeros(0, np.intp)  # verdicts waiting, oldest first
        self._prefilling = np.zeros(0, np.intp)  # in admission order
        self._decoding = np.zeros(0, np.intp)
        self._workers = 0
        self.stats = {"verdicts": 0, "resent": 0, "prefill_tokens": 0.0}

    # -- what the run loop tells it -----------------------------------------------------------------

    def submit(self, i: np.ndarray, at: np.ndarray, context: np.ndarray) -> None:
        """Trajectories ``i`` finished at ``at`` with ``context`` tokens: their verdicts are asked."""
        if not i.size:
            return
        by = np.lexsort((i, at))
        i, at = i[by], at[by]
        self.state[i] = WAITING
        self.tokens[i] = context[by] + self.judge.rubric_tokens
        self.left[i] = self.tokens[i]
        self.ready_at[i] = at
        self._queue = np.concatenate((self._queue, i))

    def step(self, t: float, dt: float, workers: int) -> None:
        """Advance from ``t`` to ``t + dt`` with ``workers`` judge workers serving."""
        if workers < self._workers:
            self._lose(t, workers)
        self._workers = workers
        if not workers:
            return
        end = t + dt
        self._admit(t, workers)
        self._prefill(t, dt, workers)
        if self._decoding.size:
            done = self.decode_end[self._decoding] <= end
            if done.any():
                finished = self._decoding[done]
                self.state[finished] = JUDGED
                self.judged_at[finished] = self.decode_end[finished]
                self.stats["verdicts"] += int(finished.size)
                self._decoding = self._decoding[~done]

    def _admit(self, t: float, workers: int) -> None:
        room = workers * self.max_num_seqs - self._prefilling.size - self._decoding.size
        if room <= 0 or not self._queue.size:
            return
        # first come first served among those asked by now (a re-sent one waits for its ABORT_S)
        head = np.flatnonzero(self.ready_at[self._queue] <= t)[:room]
        if not head.size:
            return
        taken = self._queue[head]
        keep = np.ones(self._queue.size, bool)
        keep[head] = False
        self._queue = self._queue[keep]
        self.state[taken] = PREFILLING
        self._prefilling = np.concatenate((self._prefilling, taken))

    def _prefill(self, t: float, dt: float, workers: int) -> None:
        """Chunked prefill, oldest first, over the workers' budget; a verdict whose prefill ends starts decoding."""
        i = self._prefilling
        if not i.size:
            return
        need = self.left[i] * self.prefill_scale[i]  # true prefill seconds' worth, in profile tokens
        budget = workers * self.prefill_tok_s * dt
        cum = np.cumsum(need)
        finished = cum <= budget + 1e-9
        n_done = int(np.count_nonzero(finished))
        spent = float(cum[n_done - 1]) if n_done else 0.0
        if n_done < i.size:  # the next one gets what is left of the budget
            j = i[n_done]
            read = max(budget - spent, 0.0) / self.prefill_scale[j]
            self.left[j] -= read
            self.stats["prefill_tokens"] += read
        if not n_done:
            return
        done = i[:n_done]
        self.stats["prefill_tokens"] += float(self.left[done].sum())
        self.left[done] = 0.0
        ends = t + cum[:n_done] / (workers * self.prefill_tok_s)
        decoding = self._decoding.size + n_done
        batch = max(1.0, decoding / workers)
        itl = self.judge.profile.decode.itl(batch, float(self.tokens[done].mean()))
        self.decode_end[done] = ends + self.judge.verdict_tokens * itl * self.decode_scale[done]
        self.state[done] = DECODING
        self._decoding = np.concatenate((self._decoding, done))
        self._prefilling = i[n_done:]

    def _lose(self, t: float, workers: int) -> None:
        """Judge workers left: their share of the verdicts in flight is sent again whole, behind the queue (with
        ``free_migration``, the oracle's, nothing is lost: they go on with what the remaining workers read)."""
        if self.free_migration:
            return
        flight = np.concatenate((self._prefilling, self._decoding))
        if not flight.size:
            return
        k = flight.size if not workers else round(flight.size * (self._workers - workers) / self._workers)
        if not k:
            return
        lost = flight[flight.size - k :]
        gone = np.isin(self._prefilling, lost)
        self._prefilling = self._prefilling[~gone]
        self._decoding = self._decoding[~np.isin(self._decoding, lost)]
        self.state[lost] = WAITING
        self.left[lost] = self.tokens[lost]
        self.decode_end[lost] = np.inf
        self.ready_at[lost] = t + ABORT_S
        self._queue = np.concatenate((self._queue, np.sort(lost)))
        self.stats["resent"] += int(lost.size)

    # -- what the run loop and the policy's view read ----------------------------------------------------

    def all_judged(self, lo: int, hi: int) -> bool:
        return bool((self.state[lo:hi] == JUDGED).all())

    def counts(self) -> tuple[int, int, int]:
        """(waiting, judging, judged): the judge queue as the driver reports it."""
        judging = self._prefilling.size + self._decoding.size
        return int(self._queue.size), int(judging), int(self.stats["verdicts"])
