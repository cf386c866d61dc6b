"""Held requests (long polls), waiting in the control API's event loop rather than in a thread each: agents'
heartbeats and the trainer's reports.

An agent that already has its desired workers sends their hash and is held until they change or its wait
ends. Held requests cost no thread here: each is a future in the event loop. After a decision may have
changed state, the control loop computes every allocation's desired workers in one pass and hands the
result over (``publish``, from any thread); only the requests whose allocation's desired workers differ
from what they hold are answered early, with the new ones. Nothing else is woken, so a change to one
allocation does not make 512 agents each look at state.

The trainer, which waits with nothing to do, is held until the next pass (``next_pass``: every pass follows a
change of state), then looks again, so that a command for it (offload, reload) reaches it in milliseconds
rather than at its next poll.

A hold's deadline is a timer that answers it, not a timeout raised into it: most holds end at their deadline
(hundreds a second at 512 agents), and an exception's traceback is a reference cycle only the collector frees.

Guarantees:
- a held request ends by its deadline, answered with what it holds if nothing changed;
- no change is missed between an answer and its hold: each answer is stamped with the number of
  passes published before it (``passes``); a pass published after it that disagrees answers it at once.
"""

from __future__ import annotations

import asyncio
import collections
import threading


class LongPolls:
    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.passes = 0  # passes published so far (read under the controller's lock by heartbeats)
        self._lock = threading.Lock()
        self._latest: tuple[int, dict[int, tuple[list[dict], str]]] = (0, {})  # the newest pass, by allocation
        self._held: dict[int, list[tuple[str, asyncio.Future]]] = collections.defaultdict(list)
        self._any: set[asyncio.Future] = set()  # held until the next pass, whatever it says (``next_pass``)

    def publish(self, desired: dict[int, tuple[list[dict], str]]) -> None:
        """Every allocation's desired workers and their hash, computed in one pass (any thread, under the
        controller's lock so that passes are numbered in the order their state was read)."""
        with self._lock:
            self.passes += 1
            self._latest = (self.passes, desired)
            loop = self.loop
        if loop is not None:  # always: a hold registering right now must be looked at after it registered
            try:
                loop.call_soon_threadsafe(self._answer_changed)
            except RuntimeError:  # the event loop is closed: the daemon is stopping, nobody is held
                pass

    def _answer_changed(self) -> None:
        for future in self._any:
            if not future.done():
                future.set_result(None)
        _, desired = self._latest
        for alloc_id, waiting in list(self._held.items()):
            now = desired.get(alloc_id)
            if now is None:
                continue
            for digest, future in waiting:
                if digest != now[1] and not future.done():
                    future.set_result(now)

    async def hold(self, alloc_id: int, digest: str, after_pass: int, wait_s: float) -> tuple[list[dict], str] | None:
        """Wait up to ``wait_s`` for the allocation's desired workers to differ from ``digest`` (computed with
        ``after_pass`` passes published); the new ones and their hash, or None if they did not change."""
        self.loop = asyncio.get_running_loop()
        seq, desired = self._latest
        now = desired.get(alloc_id)
        if seq > after_pass and now is not None and now[1] != digest:
            return now  # a pass newer than the answer already disagrees
        future = self.loop.create_future()
        entry = (digest, future)
        self._held[alloc_id].append(entry)
        deadline = self.loop.call_later(wait_s, _settle, future, None)
        try:
            return await future
        finally:
            deadline.cancel()
            waiting = self._held[alloc_id]
            waiting.remove(entry)
            if not waiting:
                del self._held[alloc_id]

    async def next_pass(self, after_pass: int, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for a pass published after the first ``after_pass``; whether one was."""
        self.loop = asyncio.get_running_loop()
        if self.passes > after_pass:
            return True
        future = self.loop.create_future()
        self._any.add(future)
        deadline = self.loop.call_later(wait_s, _settle, future, None)
        try:
            if self.passes > after_pass:  # published between the check and the registration
                return True
            await future
            return self.passes > after_pass
        finally:
            deadline.cancel()
            self._any.discard(future)


def _settle(future: asyncio.Future, result: object) -> None:
    """Answer a held request with ``result`` unless something answered it first (a hold's deadline)."""
    if not future.done():
        future.set_result(result)
