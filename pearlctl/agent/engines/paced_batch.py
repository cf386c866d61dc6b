"""The paced engine's model of one worker: its continuous batch, prefix cache, pause, sleep and weight reload, on
timers paced by a `Profile` (pearlctl/agent/engines/paced.py says what it keeps of vLLM and what it leaves out).

`PacedEngine` is what the HTTP face (pearlctl/agent/engines/paced_http.py) submits requests to and controls; it
knows nothing of HTTP. Each request is a `Seq` whose tokens it hands out as the profile's time passes (by the
clock: a loaded machine delays its answers but does not slow its model), and whose ``changed`` event it sets on
every new token and at its end.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pearlctl.agent.engines.paced_tokens import Decoder, Vocab, logprob, started, state_of, token_bytes, weights_seed
from pearlctl.planner.profile import Profile

QUANTUM_S = 0.05  # the longest the loop sleeps between handing out tokens while requests run
PREFILL_CHUNK_TOKENS = 8192  # prompt tokens prefilled per iteration, over the requests waiting for it
UNSET_VERSION = "default"  # vLLM's weight label until one is set
SLEEP_STATES = {1: "weights_offloaded", 2: "discard_all"}


@dataclass(eq=False)
class Seq:
    """One request in the engine."""

    rid: str
    prompt: list[int]
    max_tokens: int
    state: int  # rolling state after the prompt and every token generated so far
    arrived: float
    rolling: Any = None  # the hash behind ``state`` (hashlib), made at admission
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    prefill_left: int = 0
    reserved: int = 0
    finish: str | None = None
    ended: float | None = None  # the clock when its last token was handed out
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    decoder: Decoder | None = None  # made when its text is first asked for
    pieces: list[str] = field(default_factory=list)  # the text of each generated id decoded so far

    def text(self, vocab: Vocab, lo: int, hi: int) -> list[str]:
        """The text pieces of generated ids lo..hi (decoding up to hi first)."""
        if len(self.pieces) < hi:
            if self.decoder is None:
                self.decoder = vocab.decoder(self.prompt)
            self.pieces += self.decoder.pieces(self.out[len(self.pieces) : hi])
        return self.pieces[lo:hi]

    @property
    def context(self) -> int:
        return len(self.prompt) + len(self.out)

    def emit(self, n: int, pick: Callable[[int], int]) -> None:
        state, out, lps, rolling = self.state, self.out, self.lps, self.rolling
        for _ in range(n):
            tok = pick(state)
            out.append(tok)
            lps.append(logprob(state))
            rolling.update(tok.to_bytes(4, "little"))
            state = state_of(rolling)
        self.state = state
        if n:
            self.changed.set()

    def end(self, reason: str) -> None:
        if self.finish is None:
            self.finish = reason
            self.changed.set()


class PacedEngine:
    """One worker's continuous batch, paced by a profile (the module doc)."""

    def __init__(self, profile: Profile, *, max_num_seqs: int, max_model_len: int, weights: str, vocab: Vocab):
        self.profile = profile
        self.vocab = vocab
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.kv_capacity = int(profile.kv_capacity_tokens)
        self.weights = weights
        self.seed = weights_seed(weights)
        self.version = UNSET_VERSION
        self.waiting: collections.deque[Seq] = collections.deque()
        self.held: list[Seq] = []  # arrived while a pause(wait) drains: let in at resume
        self.running: list[Seq] = []
        self.by_id: dict[str, Seq] = {}
        self.reserved = 0
        # prefix cache: (length, rolling state) of finished sequences -> tokens, least recently used first
        self.cache: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self.lengths: collections.Counter[int] = collections.Counter()  # the cache's lengths, with their entries
        self.cached = 0
        self.paused = False
        self.draining = False  # pause(wait): running and waiting requests finish, new ones are held
        self.sleep_level = 0
        self.busy_until = 0.0  # a sleep, wake or reload in progress: no iteration before then
        self.wake = asyncio.Event()
        self.carry = 0.0
        self.prompt_tokens = 0
        self.cache_queries = 0  # prompt tokens looked up in the prefix cache, and those found (vLLM's counters)
        self.cache_hits = 0
        self.generation_tokens = 0
        self.steps = 0
        self.itl_sum = 0.0
        self.itl_count = 0
        self.e2e_sum = 0.0  # seconds from a request's arrival to its last token, over the requests that finished
        self.e2e_count = 0
        self.task: asyncio.Task | None = None

    # -- requests ------------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list[int], max_tokens: int, arrived: float | None = None) -> Seq:
        arrived = time.monotonic() if arrived is None else arrived
        seq = Seq(rid, prompt, max_tokens, 0, arrived)  # its state after the prompt: worked out at admission
        self.by_id[rid] = seq
        if self.draining:
            self.held.append(seq)
        else:
            self.waiting.append(seq)
        self.wake.set()
        return seq

    def abort(self, ids: list[str] | None = None) -> int:
        """End the requests (all in flight, or those ids) with finish reason "abort" and what they made."""
        chosen = list(self.by_id.values()) if not ids else [self.by_id[i] for i in ids if i in self.by_id]
        for seq in chosen:
            self._drop(seq)
            seq.end("abort")
        self.wake.set()
        return len(chosen)

    def forget(self, seq: Seq) -> None:
        """A request whose client went away: vLLM aborts it."""
        if seq.finish is None:
            self._drop(seq)
            seq.end("abort")
        self.by_id.pop(seq.rid, None)

    def _drop(self, seq: Seq) -> None:
        for queue in (self.waiting, self.held):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.reserved -= seq.reserved
            self._remember(seq)
        self.by_id.pop(seq.rid, None)

    # -- prefix cache ---------------------------------------------------------------------------
    def _remember(self, seq: Seq) -> None:
        if seq.prefill_left:
            return  # never prefilled: nothing of it is in the cache
        key = (seq.context, seq.state)
        if key in self.cache:
            self.cache.move_to_end(key)
            return
        self.cache[key] = seq.context
        self.lengths[seq.context] += 1
        self.cached += seq.context
        self._trim_cache()

    def _trim_cache(self) -> None:
        while self.cache and self.cached > self.kv_capacity - self.reserved:
            (n, _), _ = self.cache.popitem(last=False)
            self.cached -= n
            self.lengths[n] -= 1
            if not self.lengths[n]:
                del self.lengths[n]

    def _clear_cache(self) -> None:
        self.cache.clear()
        self.lengths.clear()
        self.cached = 0

    def _read_prompt(self, prompt: list[int]) -> tuple[Any, int]:
        """One pass over `prompt`: the rolling hash after it, and the longest prefix of it the cache holds (its
        tokens; 0 if none). The hash is checked at the cache's lengths only."""
        data = token_bytes(prompt)
        rolling, best, at = started(self.seed), 0, 0
        for k in sorted(n for n in self.lengths if n <= len(prompt)):
            rolling.update(data[4 * at : 4 * k])
            at = k
            key = (k, state_of(rolling))
            if key in self.cache:
                best = k
                self.cache.move_to_end(key)
        rolling.update(data[4 * at :])
        return rolling, best

    # -- the loop -------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and not self.paused:
            seq = self.waiting[0]
            need = len(seq.prompt) + seq.max_tokens
            if self.reserved + need > self.kv_capacity and self.running:
                return  # head-of-line blocking, as vLLM's waiting queue
            self.waiting.popleft()
            seq.rolling, cached = self._read_prompt(seq.prompt)
            seq.state = state_of(seq.rolling)
            hit = min(cached, len(seq.prompt) - 1)
            seq.prefill_left = len(seq.prompt) - hit
            self.cache_queries += len(seq.prompt)
            self.cache_hits += hit
            seq.reserved = need
            self.reserved += need
            self.prompt_tokens += len(seq.prompt)
            self.running.append(seq)
        self._trim_cache()

    def _finish(self, seq: Seq) -> None:
        seq.ended = time.monotonic()
        self.e2e_sum += seq.ended - seq.arrived
        self.e2e_count += 1
        self.running.remove(seq)
        self.reserved -= seq.reserved
        self.by_id.pop(seq.rid, None)
        self._remember(seq)
        seq.end("length")

    async def _pace(self, seconds: float) -> None:
        """Sleep `seconds`, or less if something arrives or changes (the wake event)."""
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=max(seconds, 0.0))
        except TimeoutError:
            pass

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            if now < self.busy_until:
                await asyncio.sleep(self.busy_until - now)
                continue
            self._admit()
            if self.paused or not self.running:
                if self.draining and not self.running and not self.waiting:
                    self.paused = True
                if not self.running:
                    self.carry = 0.0  # an idle engine owes no time to what arrives next
                self.wake.clear()
                await self.wake.wait()
                continue
            prefilling = [s for s in self.running if s.prefill_left > 0]
            if prefilling:
                budget, plan = PREFILL_CHUNK_TOKENS, []
                for s in prefilling:
                    n = min(s.prefill_left, budget)
                    plan.append((s, n))
                    budget -= n
                    if budget <= 0:
                        break
                want = sum(n for _, n in plan) / self.profile.prefill_tok_s
                t0 = time.monotonic()
                await asyncio.sleep(want)
                self.carry += max(time.monotonic() - t0 - want, 0.0)  # woken late: the decode after gets the time
                for s, n in plan:
                    s.prefill_left -= n
                continue
            itl = self._itl()
            to_next_end = min(s.max_tokens - len(s.out) for s in self.running)
            t0 = time.monotonic()
            await self._pace(min(to_next_end * itl, max(QUANTUM_S, itl)) - self.carry)
            if not self.running:
                continue
            elapsed = time.monotonic() - t0 + self.carry
            if self.paused and not self.draining:
                self.carry = min(elapsed, itl)
                continue
            # What the time bought, end by end: a loop that woke late (a loaded host) past a sequence's end
            # hands the rest of the time to the smaller batch after it, at that batch's pace, rather than lose it.
            while self.running:
                left = min(s.max_tokens - len(s.out) for s in self.running)
                steps = min(int(elapsed / itl), left)
                if steps <= 0:
                    break
                self._decode(steps, itl)
                elapsed -= steps * itl
                if steps < left or not self.running:
                    break
                itl = self._itl()
            self.carry = min(max(elapsed, 0.0), itl)

    def _itl(self) -> float:
        """One iteration of the running batch: the profile's decode time at its size and mean context."""
        batch = len(self.running)
        return self.profile.decode.itl(batch, sum(s.context for s in self.running) / batch)

    def _decode(self, steps: int, itl: float) -> None:
        """``steps`` iterations of the running batch at ``itl`` each: every sequence gets ``steps`` tokens."""
        served = list(self.running)  # an abort during the wait took its request out: it got no tokens
        for s in served:
            s.emit(steps, self.vocab.pick)
            if len(s.out) >= s.max_tokens:
                self._finish(s)
        self.generation_tokens += steps * len(served)
        self.steps += steps
        self.itl_sum += steps * itl * len(served)
        self.itl_count += steps * len(served)

    # -- control --------------------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        if mode == "abort":
            self.abort()
            self.paused = True
        elif mode == "keep":
            self.paused = True
        elif not self.paused:  # wait: what is in flight finishes, what arrives is held (paused: nothing runs)
            self.draining = True
            self.wake.set()
            while self.running or self.waiting:
                await asyncio.sleep(0.01)
            self.paused = True
        self.wake.set()

    def resume(self) -> None:
        self.paused = False
        self.draining = False
        self.waiting.extend(self.held)
        self.held.clear()
        self.wake.set()

    async def busy(self, seconds: float) -> None:
        """A sleep, wake or reload: the engine does nothing else for `seconds`."""
        self.busy_until = max(self.busy_until, time.monotonic() + seconds)
        await asyncio.sleep(seconds)

    async def reload(self, path: str) -> None:
        was_paused = self.paused
        self.paused = True
        await self.busy(self.profile.costs.weight_sync_s)
        self.weights, self.seed = path, weights_seed(path)
        self._clear_cache()  # cached KV was computed with other weights
        self.paused = was_paused
        self.wake.set()

    @property
    def sleep_state(self) -> str:
        return SLEEP_STATES.get(self.sleep_level, "awake")

    def metrics(self) -> str:
        running = len(self.running)
        waiting = len(self.waiting) + len(self.held)
        lines = [
            ("gauge", "vllm:num_requests_running", running),
            ("gauge", "vllm:num_requests_waiting", waiting),
            ("gauge", "vllm:kv_cache_usage_perc", self.reserved / self.kv_capacity),
            ("counter", "vllm:prompt_tokens_total", self.prompt_tokens),
            ("counter", "vllm:generation_tokens_total", self.generation_tokens),
            ("counter", "vllm:prefix_cache_queries_total", self.cache_queries),
            ("counter", "vllm:prefix_cache_hits_total", self.cache_hits),
            ("summary", "vllm:inter_token_latency_seconds_sum", self.itl_sum),
            ("summary", "vllm:inter_token_latency_seconds_count", self.itl_count),
            ("summary", "vllm:e2e_request_latency_seconds_sum", self.e2e_sum),
            ("summary", "vllm:e2e_request_latency_seconds_count", self.e2e_count),
            ("histogram", "vllm:iteration_tokens_total_count", self.steps),
        ]
        out = []
        for kind, name, value in lines:
            family = name.removesuffix("_sum").removesuffix("_count") if kind in ("summary", "histogram") else name
            family = family.removesuffix("_total") if kind == "counter" else family
            if not any(f"# TYPE {family} " in o for o in out):
                out.append(f"# TYPE {family} {kind}")
            out.append(f"{name} {float(value)!r}")
        out.append("# TYPE vllm:engine_sleep_state gauge")
        for state in ("awake", *SLEEP_STATES.values()):
            out.append(f'vllm:engine_sleep_state{{sleep_state="{state}"}} {1.0 if state == self.sleep_state else 0.0}')
        return "\n".join(out) + "\n"
