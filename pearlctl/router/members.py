"""The workers the gateway routes to, as the gateway holds them: each member's URL, role and weight version,
and a short history of membership states, so that a part of a turn can be attributed to the weights that
served it. Changed on the control plane's thread (pearlctl.router.admin), read on the data plane's.

Guarantees:
- **Shared behind a lock.** Every read returns a copy, safe to iterate while membership changes.
- **Weight versions, never guessed.** vLLM 0.32's OpenAI answers do not say which weights produced them and
  vllm-router does not say which worker served a request. A part is tagged with the version a worker states
  in the response header ``X-Pearl-Weight-Version`` when there is one; otherwise with the members' version
  when every member in the router during that part served the same version (``version_from:
  "membership"``); otherwise it is marked ``version_from: "ambiguous"`` with the candidate versions.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pearlctl.vocabulary import Role


@dataclass
class MemberRecord:
    """One worker the gateway routes to: its role, the weights it serves, when it was added (unix time)."""

    url: str
    weight_version: str | None
    added_at: float
    role: str = Role.ROLLOUT

    def doc(self) -> dict:
        return {"url": self.url, "role": self.role, "weight_version": self.weight_version, "added_at": self.added_at}


class Members:
    """The workers the gateway routes to, with their roles and weight versions, and a short history of
    membership states so a part can be attributed to the versions that could have served it."""

    HISTORY = 4096

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        # changed on the control plane's thread, read on the data plane's (pearlctl.router.control)
        self._lock = threading.RLock()
        self.by_url: dict[str, MemberRecord] = {}
        self.change = 0
        # each state: the change, and each member's (url, weight version, whether it is a judge)
        self._states: deque[tuple[int, frozenset[tuple[str, str | None, bool]]]] = deque(
            [(0, frozenset())], self.HISTORY
        )

    def _changed(self) -> None:
        self.change += 1
        members = frozenset((m.url, m.weight_version, m.role == Role.REWARD) for m in self.by_url.values())
        self._states.append((self.change, members))

    def set(self, url: str, version: str | None, role: str = Role.ROLLOUT) -> tuple[MemberRecord, bool, bool]:
        """Add, re-version or re-role; returns (member, added, version or role changed)."""
        with self._lock:
            old = self.by_url.get(url)
            if old is not None and old.weight_version == version and old.role == role:
                return old, False, False
            member = MemberRecord(url, version, self.clock(), role)
            self.by_url[url] = member
            self._changed()
            return member, old is None, old is not None

    def put(self, member: MemberRecord) -> None:
        """Put a member back as it was (an update that could not be routed is undone)."""
        with self._lock:
            self.by_url[member.url] = member
            self._changed()

    def drop(self, url: str) -> bool:
        with self._lock:
            if self.by_url.pop(url, None) is None:
                return False
            self._changed()
            return True

    def roles(self) -> dict[str, str]:
        with self._lock:
            return {u: m.role for u, m in self.by_url.items()}

    def urls(self) -> list[str]:
        """The members' URLs, sorted (a copy: safe to iterate while membership changes)."""
        with self._lock:
            return sorted(self.by_url)

    def members(self) -> list[MemberRecord]:
        with self._lock:
            return list(self.by_url.values())

    def mark(self) -> int:
        return self.change

    def attribute(
        self, since: int, header_version: str | None, header_worker: str | None, *, judge: bool = False
    ) -> dict:
        """Who served a part that ran from membership change ``since`` until now: one of the policy's members, or
        (``judge``: the request named a judge's model) one of the judges."""
        if header_version:
            out = {"weight_version": header_version, "version_from": "worker"}
            if header_worker:
                out["worker"] = header_worker
            return out
        with self._lock:
            states = list(self._states)
        versions: set = set()
        urls: set = set()
        oldest = states[0][0]
        for change, members in states:
            if change >= since or since < oldest:  # history too short for this part: every state kept is a candidate
                for url, version, judged in members:
                    if judged == judge:
                        versions.add(version)
                        urls.add(url)
        out: dict[str, Any] = {}
        if header_worker:  # the worker said who it is, though not which weights (vLLM's label was never set)
            out["worker"] = header_worker
        elif len(urls) == 1:
            out["worker"] = next(iter(urls))
        if len(versions) == 1 and None not in versions:
            out.update(weight_version=next(iter(versions)), version_from="membership")
        elif not versions:
            out.update(weight_version=None, version_from="unknown")
        else:
            out.update(
                weight_version=None,
                version_from="ambiguous",
                candidates=sorted(v if v is not None else "unknown" for v in versions),
            )
        return out
