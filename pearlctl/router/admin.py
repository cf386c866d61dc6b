"""What the admin API (``/pearl/workers``, pearlctl.router.membership) does to the gateway's members: add a
worker once its ``/health`` answers, remove one, make the members exactly a set, and say how the routers list
each member. Runs on the control plane's loop (pearlctl.router.control).

Guarantees:
- A worker becomes a member only once its ``/health`` answered 200 within its ``wait_s`` (504 otherwise) and
  a vllm-router took it (502 otherwise); a worker that could not be routed is not a member, or keeps its
  previous version and role.
- A set (`MemberAdmin.sync`) is health-checked concurrently and changes the routers once for the whole set.
- A worker removed or re-added while it was awaited is answered 409, never added behind the caller's back.
- **A join rebalances queues and overloaded members.** vllm-router's ``consistent_hash`` sends each request to
  its session's worker at once, where it runs or waits in vLLM's queue even after a worker joins the ring: a
  worker that joins mid-batch would get only new sessions and next turns while older workers hold a queue, or run
  far more sequences than it. So when workers join the regular router, every older member whose ``/metrics``
  shows requests waiting, or whose load (requests running and waiting) is imbalanced against the idlest member's
  by vllm-router's own ``cache_aware`` test (``pearlctl.vocabulary.imbalanced``), is asked to abort the gateway's
  continuable attempts (``/abort_requests`` by their ids: a request that cannot be continued is never aborted
  here); the gateway continues each through the router on the new ring, so the sessions that now hash to a
  joined worker go there, and the others go back to their worker, whose prefix cache holds their context.
  Other members are left alone, and so is a member whose ``/metrics`` cannot be read. It runs beside the admin
  call, never fails it, and is counted in the gateway's stats (``rebalances``, ``rebalance_aborts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import httpx

from pearlctl.router.control_loop import ControlLoop
from pearlctl.router.errors import BadRequest
from pearlctl.router.members import MemberRecord, Members
from pearlctl.router.membership import WorkerIn, WorkerSet
from pearlctl.router.routing import Routers
from pearlctl.vocabulary import Role, imbalanced

log = logging.getLogger("pearlctl.router.gateway")  # one name for the gateway's lines, whichever module logs them


WAITING_METRIC = "vllm:num_requests_waiting"  # vLLM's gauge of the requests in a server's queue
RUNNING_METRIC = "vllm:num_requests_running"  # ... and of those it runs (prefilling or decoding)


def _gauge(text: str, name: str) -> float:
    """The sum of the gauge ``name`` over its label sets in a Prometheus text ``/metrics`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):  # the gauge, not a longer name
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return total


class MemberAdmin:
    """The membership changes of the admin API, over the members and the routers that route to them."""

    def __init__(
        self,
        members: Members,
        routers: Routers,
        control: ControlLoop,
        upstream_ids: Callable[[], list[str]] = list,
        stats: dict[str, int] | None = None,
    ):
        self.members, self.routers, self.control = members, routers, control
        self.upstream_ids = upstream_ids  # the gateway's continuable attempts upstream, by engine request id
        self.stats = stats if stats is not None else {}
        self.stats.update(rebalances=0, rebalance_aborts=0)
        self._wanted: dict[str, int] = {}  # url -> the latest add's ticket (a remove withdraws it)
        self._ticket = 0
        self._rebalancing: set[asyncio.Task] = set()

    async def _wait_healthy(self, url: str, wait_s: float) -> str | None:
        """None once ``url``/health answers 200 within ``wait_s``; else why not."""
        deadline = time.monotonic() + wait_s
        last = "no answer"
        while True:
            try:
                resp = await self.control.http.get(url + "/health", timeout=min(5.0, max(0.5, wait_s)))
                if resp.status_code == 200:
                    return None
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}".strip()
            if time.monotonic() >= deadline:
                return f"{url}/health not 200 within {wait_s:g} s (last: {last})"
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def _admit(
        self, workers: list[WorkerIn], *, gone: Iterable[str] = (), wait_s: float
    ) -> tuple[dict[str, tuple[int, dict]], dict[str, str]]:
        """Add or update ``workers``, each once its ``/health`` answers 200 within its ``wait_s`` (awaited
        concurrently), then route to exactly the members, ``gone`` left out: one change of the routers for
        the whole set. Returns each worker's (HTTP status, answer) and the URLs that could not be taken out of
        the regular router. A worker that could not be routed is not a member (or keeps its previous version
        and role)."""
        tickets: dict[str, int] = {}
        for w in workers:
            self._ticket += 1
            tickets[w.url] = self._wanted[w.url] = self._ticket
        whys = await asyncio.gather(*(self._wait_healthy(w.url, w.wait_s) for w in workers))
        results: dict[str, tuple[int, dict]] = {}
        before: dict[str, MemberRecord | None] = {}
        for w, why in zip(workers, whys, strict=True):
            if self._wanted.get(w.url) != tickets[w.url]:
                message = f"{w.url} was removed or re-added while it was awaited"
                results[w.url] = (409, {"error": {"message": message, "type": "conflict", "code": 409}})
            elif why is not None:
                if w.url not in self.members.by_url:
                    del self._wanted[w.url]
                status = 504 if "not 200 within" in why else 502
                message = f"{w.url} not added: {why}"
                results[w.url] = (status, {"error": {"message": message, "type": "worker_unavailable", "code": status}})
            else:
                before[w.url] = self.members.by_url.get(w.url)
                member, added, changed = self.members.set(w.url, w.weight_version, w.role)
                results[w.url] = (200, {"worker": member.doc(), "added": added, "updated": changed})
        regular = self.routers.regular()
        failed, stuck = await self.routers.reconcile(force=before, gone=gone, wait_s=wait_s)
        now = self.routers.regular()
        if now - regular and now & regular:
            task = asyncio.get_running_loop().create_task(self.rebalance(sorted(now & regular), sorted(now - regular)))
            self._rebalancing.add(task)
            task.add_done_callback(self._rebalancing.discard)
        undone: list[str] = []
        for url, why in failed.items():
            if url not in before or self._wanted.get(url) != tickets[url]:
                continue  # not one of these workers, or removed meanwhile
            prev = before.pop(url)
            if prev is None:
                self.members.drop(url)
                del self._wanted[url]
                undone.append(url)
            else:
                self.members.put(prev)
            message = f"{url} not added: {why}"
            results[url] = (502, {"error": {"message": message, "type": "worker_unavailable", "code": 502}})
        if failed.keys() & tickets.keys():
            _, more = await self.routers.reconcile(gone=undone, wait_s=wait_s)  # a late add must not route
            stuck.update(more)
        for url in before:
            _, doc = results[url]
            if doc["added"] or doc["updated"]:
                m = self.members.by_url[url]
                log.info(
                    "member %s %s (%s, weight version %s)",
                    url,
                    "added" if doc["added"] else "updated",
                    m.role,
                    m.weight_version,
                )
        return results, stuck

    async def rebalance(self, older: list[str], joined: list[str]) -> int:
        """Workers (``joined``) joined the regular router: each of the ``older`` members with requests waiting, or
        imbalanced against the idlest member, aborts the gateway's continuable attempts (the module doc). Returns
        how many members were asked."""
        ids = self.upstream_ids()
        if not ids:
            return 0
        loads = await asyncio.gather(*(self._load(url) for url in [*older, *joined]))
        known = [waiting + running for waiting, running in filter(None, loads)]
        if not known:
            return 0
        least = min(known)
        chosen = [
            (url, load)
            for url, load in zip(older, loads[: len(older)], strict=True)
            if load is not None and (load[0] > 0 or imbalanced(sum(load), least))
        ]
        if not chosen:
            return 0
        done = await asyncio.gather(*(self._abort(url, ids) for url, _ in chosen))
        self.stats["rebalances"] += 1
        self.stats["rebalance_aborts"] += sum(done)
        log.info(
            "rebalance after a join: %d of %d older members had a queue or were imbalanced (%d waiting, %d running; "
            "the idlest member %d); their continuable requests were aborted to be continued on the new ring",
            len(chosen),
            len(older),
            sum(load[0] for _, load in chosen),
            sum(load[1] for _, load in chosen),
            least,
        )
        return len(chosen)

    async def _load(self, url: str) -> tuple[float, float] | None:
        """``url``'s requests waiting and running (vLLM's ``WAITING_METRIC`` and ``RUNNING_METRIC`` gauges); None
        when its ``/metrics`` cannot be read."""
        try:
            resp = await self.control.http.get(url + "/metrics", timeout=2.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return _gauge(resp.text, WAITING_METRIC), _gauge(resp.text, RUNNING_METRIC)

    async def _abort(self, url: str, ids: list[str]) -> int:
        """Ask ``url`` to abort the requests ``ids`` (those it does not hold are no-ops); 1 when it answered."""
        try:
            resp = await self.control.http.post(url + "/abort_requests", json={"request_ids": ids}, timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("rebalance: %s/abort_requests failed (%s)", url, type(exc).__name__)
            return 0
        if resp.status_code != 200:
            log.warning("rebalance: %s/abort_requests answered HTTP %d", url, resp.status_code)
            return 0
        return 1

    async def add(self, worker: WorkerIn) -> tuple[int, dict]:
        """Add one worker (or change its version or role); (HTTP status, answer)."""
        results, _ = await self._admit([worker], wait_s=worker.wait_s)
        return results[worker.url]

    async def remove(self, url: str) -> dict:
        self._wanted.pop(url, None)
        was = self.members.drop(url)
        _, stuck = await self.routers.reconcile(gone=[url])
        if url in stuck:
            raise BadRequest(502, f"{url}: {stuck[url]}")
        if was:
            log.info("member %s removed", url)
        return {"removed": was}

    async def sync(self, wanted: WorkerSet) -> dict:
        target = {w.url: w for w in wanted.workers}
        removed = [u for u in list(self.members.by_url) if u not in target]
        for url in removed:
            self._wanted.pop(url, None)
            self.members.drop(url)
            log.info("member %s removed", url)
        routed = {d["url"] for d in await self.member_docs() if d.get("routed") is not False}
        current = self.members.by_url
        changing = [
            w.model_copy(update={"wait_s": wanted.wait_s})
            for w in target.values()
            if w.url not in current
            or (current[w.url].weight_version, current[w.url].role) != (w.weight_version, w.role)
            or w.url not in routed  # a member a router lost (a failed re-registration) is added again
        ]
        results, stuck = await self._admit(changing, gone=removed, wait_s=wanted.wait_s)
        if stuck:
            raise BadRequest(502, "; ".join(f"{url}: {why}" for url, why in sorted(stuck.items())))
        added, updated, failed = [], [], {}
        for url, (status, doc) in results.items():
            if status != 200:
                failed[url] = doc["error"]["message"]
            elif doc["added"]:
                added.append(url)
            elif doc["updated"]:
                updated.append(url)
        return {
            "added": added,
            "removed": removed,
            "updated": updated,
            "failed": failed,
            "workers": await self.member_docs(),
        }

    async def member_docs(self) -> list[dict]:
        """The members, each with ``router`` (``regular``, ``pd`` or ``judge``: which vllm-router routes to it),
        ``routed`` and ``healthy`` as that router lists it (both left out when it does not answer)."""
        listed = await self.routers.router_workers()
        seen = {str(w.get("url", "")).rstrip("/"): w for w in listed} if listed is not None else None
        pd, pd_seen = await self.routers.pd_listing()
        in_pd = pd.lists.urls() if pd is not None else frozenset()
        judged = await self.routers.judge_listing()
        out = []
        for m in self.members.members():
            doc = m.doc()
            if m.role == Role.REWARD:
                doc["router"] = "judge"
                judge = self.routers.judge
                if judge is not None and not judge.alive():  # as a dead PD router's: not routed, not healthy
                    doc["routed"] = doc["healthy"] = False
                elif judged is not None or judge is None:
                    doc["routed"] = judged is not None and m.url in judged
                    doc["healthy"] = bool((judged or {}).get(m.url, {}).get("is_healthy"))
            elif m.url in in_pd:
                doc["router"] = "pd"
                if pd is not None and not pd.alive():
                    doc["routed"] = doc["healthy"] = False
                elif pd_seen is not None:
                    doc["routed"] = m.url in pd_seen
                    doc["healthy"] = bool(pd_seen[m.url].get("is_healthy")) if m.url in pd_seen else False
            else:
                doc["router"] = "regular"
                if seen is not None:
                    doc["routed"] = m.url in seen
                    doc["healthy"] = bool(seen[m.url].get("is_healthy")) if m.url in seen else False
            out.append(doc)
        return out
