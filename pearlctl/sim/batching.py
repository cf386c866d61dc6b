"""Continuous batching on the simulated engine workers: how far a tick takes each running sequence — its prefill,
then its decode — at the profile's speeds times the turn's true factors (``Batching``, one per
``pearlctl.sim.engine.Engine``, which owns the trajectories and what happens at the end of a prefill or a turn).

- **Prefill shares the worker in colocated mode.** A ROLLOUT worker first spends its tick on its own prefill
  queue (FIFO, at ``prefill_tok_s``), and only the rest of the tick decodes: prefill interferes with decode. In
  disaggregated mode PREFILL workers serve one shared FIFO, then the KV crosses at ``kv_transfer_gb_s`` before
  the DECODE worker picks the sequence up.
- **Decode grows less than linearly with batch.** Each iteration of a worker's batch takes
  ``profile.decode.itl(B, mean context)`` — the planner's own formula and numbers, so a dense model's
  throughput saturates with KV reads and an MoE's with the experts the batch touches. A lone straggler decodes
  at ``1 / itl(1, L)`` tokens/s: no configuration can finish it faster.
- **The truth may differ from the profile**: under a model mismatch each turn's decode iterations and prefill
  take that turn's factor (``Engine.dscale``, ``Engine.pscale``) times what the profile says.

Guarantees, for speed without a change of result: the iteration time comes from two tables over batch sizes
built once per engine (``vector_itl``), checked at construction to equal ``DecodeModel.itl`` bit for bit; a few
sequences (up to ``FEW``) are handled element by element with the same arithmetic in the same order.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pearlctl.planner.profile import DecodeModel, Profile
from pearlctl.sim.trajectories import DECODE, FEW, PREFILL, group_starts


class BatchedEngine(Protocol):
    """What ``Batching`` reads and writes of its engine (``pearlctl.sim.engine.Engine``): the window of trajectories in
    flight, the workers' roles as prefill sees them, the trajectories' arrays a tick advances, the counters, and
    the engine's own steps at the end of a prefill or a turn."""

    lo: int
    hi: int
    w_role: np.ndarray
    n_prefill: int  # routable PREFILL workers (the shared prefill FIFO runs on them)
    prefills_own: np.ndarray  # per worker: it prefills its own sequences
    phase: np.ndarray
    run_w: np.ndarray
    ready_at: np.ndarray
    ctx: np.ndarray
    dec_left: np.ndarray
    pf_left: np.ndarray
    pf_total: np.ndarray
    pscale: np.ndarray | None
    dscale: np.ndarray | None
    stats: dict[str, float]

    def prefilled(self, i) -> None: ...

    def transfer(self, i: np.ndarray, until: np.ndarray) -> None: ...

    def end_turns(self, i: np.ndarray, end: np.ndarray) -> None: ...

    def end_turn(self, i: int, end: float) -> None: ...


class Batching:
    """The prefill queues and decode batches of one engine's workers (``profile``'s speeds)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._itl = vector_itl(profile.decode)
        self._itl_by_batch: tuple[np.ndarray, np.ndarray] | None = None  # (``itl``'s tables)

    def prefill(self, e: BatchedEngine, t0: float, avail: float) -> tuple[np.ndarray, bool]:
        """Run the prefill queues for ``avail`` seconds from ``t0``: the seconds each worker spent on prefill, and
        whether some sequence still prefills."""
        n_w = len(e.w_role)
        p_time = np.zeros(n_w)
        s = slice(e.lo, e.hi)
        pf = (e.phase[s] == PREFILL).nonzero()[0]
        if not pf.size:
            return p_time, False
        pf += e.lo
        left = pf.size
        rate = self.profile.prefill_tok_s
        # The shared prefill FIFO runs on the routable PREFILL workers (a draining one takes nothing new).
        n_prefill = e.n_prefill
        pw = e.run_w[pf]
        local = e.prefills_own[pw]

        # Work is counted in profile-seconds x rate: under a mismatch a turn's tokens take ``prefill_scale`` times
        # as long as the profile says.
        loc = pf[local]
        if 0 < loc.size <= FEW:
            p_time, done = self._prefill_few(e, loc, pw[local], rate * avail, n_w)
            left -= done
        elif loc.size:
            w = pw[local]
            by = np.lexsort((e.ready_at[loc], w))
            loc, w = loc[by], w[by]
            scale = _scale(e.pscale, loc)
            pf_left = e.pf_left[loc]
            need = pf_left if scale is None else pf_left * scale
            cs = np.zeros(loc.size + 1)
            np.add.accumulate(need, out=cs[1:])
            before = cs[1:] - need - cs[group_starts(w)]
            work = np.minimum(np.maximum(rate * avail - before, 0.0), need)
            tokens = work if scale is None else work / scale
            pf_left = pf_left - tokens
            e.pf_left[loc] = pf_left
            e.stats["prefill_tokens"] += float(tokens.sum())
            p_time = np.bincount(w, work, n_w) / rate
            fin = pf_left <= 1e-6
            doneidx = loc[fin]
            e.prefilled(doneidx)
            left -= doneidx.size

        pool = pf[~local] if loc.size < pf.size else pf[:0]
        if pool.size and n_prefill:
            pool = pool[e.ready_at[pool].argsort(kind="stable")]
            budget = rate * n_prefill * avail
            scale = _scale(e.pscale, pool)
            pf_left = e.pf_left[pool]
            need = pf_left if scale is None else pf_left * scale
            cs = need.cumsum()
            before = cs - need
            work = np.minimum(np.maximum(budget - before, 0.0), need)
            tokens = work if scale is None else work / scale
            pf_left = pf_left - tokens
            e.pf_left[pool] = pf_left
            e.stats["prefill_tokens"] += float(tokens.sum())
            fin = pf_left <= 1e-6
            doneidx = pool[fin]
            if doneidx.size:
                at = t0 + np.minimum(cs[fin] / budget, 1.0) * avail
                e.transfer(doneidx, at + self.profile.kv_transfer_s(e.pf_total[doneidx]))
                left -= doneidx.size
        return p_time, left > 0

    def _prefill_few(self, e: BatchedEngine, loc: np.ndarray, w: np.ndarray, budget: float, n_w: int):
        """``prefill``'s colocated queues for a few sequences, element by element (the same arithmetic in the same
        order as its vector form): each worker prefills its own FIFO for ``budget`` profile-token-seconds. The
        seconds each worker spent and how many sequences finished."""
        rate = self.profile.prefill_tok_s
        at, ws, ready = loc.tolist(), w.tolist(), e.ready_at[loc].tolist()
        left = e.pf_left[loc].tolist()
        scale = _scale(e.pscale, loc)
        scales = None if scale is None else scale.tolist()
        spent: dict[int, float] = {}
        tokens = []
        cs = base = 0.0  # the running total of the work asked, and where this worker's queue started in it
        cur = -1
        done = 0
        for j in sorted(range(len(at)), key=lambda j: (ws[j], ready[j])):
            k = ws[j]
            if k != cur:
                cur, base = k, cs
            need = left[j] if scales is None else left[j] * scales[j]
            cs += need
            work = min(max(budget - (cs - need - base), 0.0), need)
            tok = work if scales is None else work / scales[j]
            tokens.append(tok)
            spent[k] = spent.get(k, 0.0) + work
            i = at[j]
            rest = left[j] - tok
            e.pf_left[i] = rest
            if rest <= 1e-6:
                e.prefilled(i)
                done += 1
        e.stats["prefill_tokens"] += float(np.add.reduce(np.array(tokens)))
        p_time = np.zeros(n_w)
        for k, x in spent.items():
            p_time[k] = x / rate
        return p_time, done

    def decode(self, e: BatchedEngine, t0: float, avail: float, p_time: np.ndarray) -> None:
        """Decode every worker's batch for what ``avail`` seconds from ``t0`` leave after its prefill (``p_time``);
        a sequence that finishes its turn's response ends its turn then (``Engine.end_turns``)."""
        s = slice(e.lo, e.hi)
        d = (e.phase[s] == DECODE).nonzero()[0]
        if not d.size:
            return
        d += e.lo
        n_w = len(e.w_role)
        w = e.run_w[d]
        batch = np.bincount(w, minlength=n_w)
        ctx = e.ctx[d]
        ctx_sum = np.bincount(w, ctx, n_w)
        # The planner's own decode model: sublinear in batch, MoE experts, the batch-1 straggler floor.
        itl = self.itl(batch, ctx_sum)
        decode_time = np.maximum(avail - p_time, 0.0)
        iters = (decode_time / itl)[w]
        left = e.dec_left[d]
        # Under a mismatch a turn's tokens each take ``decode_scale`` of its worker's iterations.
        scale = None if e.dscale is None else e.dscale[d]
        adv = np.minimum(left, iters if scale is None else iters / scale)
        ctx = ctx + adv
        e.ctx[d] = ctx
        rest = left - adv
        e.dec_left[d] = rest
        e.stats["decode_tokens"] += float(np.add.reduce(adv))
        fin = rest <= 1e-6
        done = np.count_nonzero(fin)
        if not done:
            return
        if done <= FEW:  # element by element (the same arithmetic)
            for j in fin.nonzero()[0].tolist():
                k = w.item(j)
                took = left.item(j) * itl.item(k)
                e.end_turn(d.item(j), t0 + p_time.item(k) + (took if scale is None else took * scale.item(j)))
            return
        wf = w[fin]
        took = left[fin] * itl[wf]
        e.end_turns(d[fin], t0 + p_time[wf] + (took if scale is None else took * scale[fin]))

    def itl(self, batch: np.ndarray, ctx_sum: np.ndarray) -> np.ndarray:
        """Each worker's decode iteration, ``profile.decode.itl(batch, mean context)`` (inf: no batch)."""
        if self._itl is None:  # a decode model of its own: asked worker by worker
            itl_of = self.profile.decode.itl
            bc = zip(batch.tolist(), ctx_sum.tolist(), strict=True)
            return np.array([itl_of(float(b), c / b) if b else np.inf for b, c in bc])
        if self._itl_by_batch is None:  # (a batch is at most max_num_seqs)
            self._itl_by_batch = self._itl(max(self.profile.max_num_seqs, 1))
        fixed, per_ctx = self._itl_by_batch
        try:
            fixed, per_ctx = fixed[batch], per_ctx[batch]
        except IndexError:  # a batch above max_num_seqs
            self._itl_by_batch = fixed, per_ctx = self._itl(int(batch.max()))
            fixed, per_ctx = fixed[batch], per_ctx[batch]
        return fixed + per_ctx * np.maximum(ctx_sum / np.maximum(batch, 1), 0.0)


def _scale(factors: np.ndarray | None, i: np.ndarray) -> np.ndarray | None:
    """How much longer than the profile says trajectories ``i`` take this turn (None: as it says)."""
    return None if factors is None else factors[i]


def vector_itl(decode):
    """``DecodeModel.itl`` by batch size, for the engine's arrays of workers: a function of the largest batch
    ``top`` giving two tables over batch sizes ``b`` = 0 .. top, ``fixed`` and ``per_ctx``, such that ``fixed[b] +
    per_ctx[b] * max(c, 0)`` is ``itl(b, c)`` bit for bit (the same operations in the same order: ``fixed`` holds
    the sum of the terms before the context's, ``per_ctx`` the factor of ``max(c, 0)``), and inf for b = 0 (no
    batch). None when the decode model is not one this matches (the engine then asks ``itl`` worker by worker)."""
    if type(decode) is not DecodeModel:
        return None
    ws, es, ss, ks = decode.weights_s, decode.experts_s, decode.seq_s, decode.kv_s_per_token

    def tables(top: int) -> tuple[np.ndarray, np.ndarray]:
        b = np.arange(top + 1)
        if decode.moe_experts:
            e = np.array([decode.distinct_experts(float(x)) for x in range(top + 1)])
            fixed = ws + es * e + ss * b
        else:
            fixed = ws + ss * b  # ws + es * 0.0 is ws
        fixed[0] = np.inf  # (inf + 0.0 * 0.0: a worker with no batch, mean context 0 / 1)
        return fixed, ks * b

    # A check that DecodeModel.itl is still this formula.
    fixed, per_ctx = tables(255)
    b = np.array([1, 2, 7, 64, 255])
    c = np.array([0.0, 1234.5, 40000.25, 3.0e3 / 7.0, 9.99e4 / 3.0])
    if (fixed[b] + per_ctx[b] * np.maximum(c, 0.0)).tolist() != [
        decode.itl(float(x), y) for x, y in zip(b.tolist(), c.tolist(), strict=True)
    ]:
        return None
    return tables
