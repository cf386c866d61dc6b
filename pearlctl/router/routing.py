"""Which vllm-router serves an attempt, and keeping the vllm-routers' worker lists what the members say:
the regular one (for the gateway's whole life), for prefill-decode a PD router started and retired as the
pairs change, and for a generative reward model a judge router started with the first REWARD member.

Guarantees (**the judge**):
- REWARD members (a reward pool's judges) are routed by the judge router only, never by the regular or a PD
  router: no policy turn reaches a judge. A request whose ``model`` is a model a judge serves and the policy's
  workers do not (learned from each member's ``/v1/models`` when it joins, and remembered) goes to the judge
  router, every other request to the policy's routers. While no judge router serves, a judge request's attempt
  fails as a connection error would (the gateway retries it within its retry window), so it never reaches a
  policy worker.

Guarantees (**prefill-decode**):
- Members have a role (ROLLOUT, PREFILL, DECODE). While there is at least one PREFILL and one DECODE member,
  a second vllm-router in PD mode (started through ``pd_launcher``) routes a request through a prefill and a
  decode worker; it takes the sessions its workers' share of all workers covers (`pd_share`, `choose_pd`: a
  session stays on one side), the regular vllm-router (ROLLOUT members) the rest.
- vllm-router 0.1.17 in PD mode has static lists only, so a change of the pairs starts a new PD router, and
  membership changes make before they break (`Routers.reconcile`): the new router is ready, and the regular
  router has every worker it must take over, before new requests follow the new plan; the PD router it
  replaces is stopped only once no attempt runs through it, so a change of membership breaks no request (a
  worker's drain aborting its requests is what moves them, continued by pearlctl.router.gateway).
- PREFILL and DECODE members that no PD router serves — half a pair, or a pair whose PD router could not
  start (retried with back-off) or exited (replaced) — serve whole requests through the regular router: a
  vLLM server with a KV connector prefills locally when no KV is handed to it.
- Every change of the routers runs on the control plane's loop (pearlctl.router.control), one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from pearlctl.router.control_loop import ControlLoop
from pearlctl.router.members import Members
from pearlctl.vocabulary import GENERATION_ROLES, Role

log = logging.getLogger("pearlctl.router.gateway")  # one name for the gateway's lines, whichever module logs them


@dataclass(frozen=True)
class PdLists:
    """The static ``--prefill`` / ``--decode`` lists of a vllm-router in PD mode (sorted URLs)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    def urls(self) -> frozenset[str]:
        return frozenset(self.prefill) | frozenset(self.decode)

    def doc(self) -> dict:
        return {"prefill": list(self.prefill), "decode": list(self.decode)}


def pd_lists(roles: Mapping[str, str]) -> PdLists | None:
    """The PD router's lists for members with these roles; None unless there is at least one PREFILL and one
    DECODE member (half a pair cannot serve disaggregated)."""
    prefill = tuple(sorted(u for u, r in roles.items() if r == Role.PREFILL))
    decode = tuple(sorted(u for u, r in roles.items() if r == Role.DECODE))
    return PdLists(prefill, decode) if prefill and decode else None


def regular_members(roles: Mapping[str, str], serving: PdLists | None) -> set[str]:
    """The members the regular-mode vllm-router routes to: every ROLLOUT member, and every PREFILL or DECODE
    member that no PD router serves (a lone half of a pair, or both while the PD router is down): a vLLM
    server with a KV connector still serves whole requests, prefilling locally. Never a judge (REWARD)."""
    in_pd = serving.urls() if serving is not None else frozenset()
    return {u for u, r in roles.items() if r in GENERATION_ROLES and u not in in_pd}


def judge_members(roles: Mapping[str, str]) -> set[str]:
    """The members the judge router routes to: the REWARD ones."""
    return {u for u, r in roles.items() if r == Role.REWARD}


def pd_share(regular: int, serving: PdLists | None) -> float:
    """The share of sessions sent through the PD router: its workers' share of all routed workers (each
    worker counts as one unit of capacity), 0 without a PD router, 1 without regular members."""
    if serving is None:
        return 0.0
    pd = len(serving.prefill) + len(serving.decode)
    return pd / (pd + regular)


def choose_pd(session: str | None, share: float, draw: Callable[[], float] = random.random) -> bool:
    """Whether one attempt goes through the PD router. A session always lands on the same side for a given
    share (its CRC-32 as a point in [0, 1)), so an episode's turns keep their prefix caches; a request
    without a session is drawn at random."""
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    point = zlib.crc32(session.encode()) / 2**32 if session else draw()
    return point < share


class PdRouter(Protocol):
    """A running vllm-router in PD mode with fixed lists (``python -m pearlctl.router`` starts them as
    children: pearlctl.router.__main__.PdRouterChild)."""

    url: str
    lists: PdLists

    def alive(self) -> bool: ...

    async def stop(self) -> None: ...


# starts a PD router for these lists and returns it once it routes; raises (any exception) when it cannot
PdLauncher = Callable[[PdLists], Awaitable[PdRouter]]


class JudgeRouter(Protocol):
    """A running vllm-router in regular mode for the judges (``python -m pearlctl.router`` starts it as a child
    with the first REWARD member); its workers are added and removed like the regular router's."""

    url: str

    def alive(self) -> bool: ...

    async def stop(self) -> None: ...


# starts a judge router and returns it once it answers; raises (any exception) when it cannot
JudgeLauncher = Callable[[], Awaitable[JudgeRouter]]


class RoutersConfig(Protocol):
    """What the routers read of the gateway's configuration (pearlctl.router.gateway.GatewayConfig): the regular
    vllm-router's URL, how long one attempt may take (a retired PD router is stopped once no attempt runs through
    it, at the latest that long after), and the back-off before launching again a PD router that failed."""

    router_url: str
    request_timeout_s: float
    pd_retry_s: float
    pd_retry_max_s: float


class NoJudgeRouter(httpx.ConnectError):
    """A judge's request while no judge router serves: the attempt fails as if the router could not be reached
    (the gateway retries it), never sent to the policy's routers."""


class Routers:
    """The vllm-routers the gateway sends attempts to, and which workers each routes to: the regular one at
    ``config.router_url``, the PD router serving now (``pd``; those it replaced drain, then stop), and the judge
    router (``judge``, with the first REWARD member). ``stats`` is the gateway's counters (``attempts_regular``,
    ``attempts_pd``, ``attempts_judge``)."""

    def __init__(
        self,
        config: RoutersConfig,
        members: Members,
        control: ControlLoop,
        stats: dict[str, int],
        pd_launcher: PdLauncher | None = None,
        judge_launcher: JudgeLauncher | None = None,
    ):
        self.config, self.members, self.control, self.stats = config, members, control, stats
        self.router = config.router_url.rstrip("/")  # vllm-router in regular mode, for the gateway's whole life
        # PD: without a launcher no PD router ever runs and PREFILL/DECODE members serve whole requests
        self.pd_launcher = pd_launcher
        self.pd: PdRouter | None = None  # the PD router new requests go to
        self._regular: set[str] = set()  # what the gateway has put into the regular vllm-router
        self._plan_lock = asyncio.Lock()  # one change of the routers' membership at a time
        self._inflight: Counter[str] = Counter()  # upstream base URL -> attempts running through it
        self._retiring: set[asyncio.Task] = set()  # tasks that stop a PD router once nothing runs through it
        self._draining: list[PdRouter] = []
        self._pd_failed: tuple[PdLists, float, float] | None = None  # lists, when, back-off
        self.pd_info: dict[str, Any] = {"launches": 0, "failures": 0, "retired": 0, "last_launch_s": None}
        # the judge: without a launcher no judge router runs and REWARD members are routed by nothing
        self.judge_launcher = judge_launcher
        self.judge: JudgeRouter | None = None
        self._judged: set[str] = set()  # what the gateway has put into the judge router
        self.judge_models: set[str] = set()  # the models judges serve (a request naming one is a judge's) ...
        self.policy_models: set[str] = set()  # ... unless the policy's workers serve it too: then it is the policy's
        self._models_read: set[str] = set()  # the members whose /v1/models was read
        self._judge_failed: tuple[float, float] | None = None  # when a launch failed, back-off
        self.judge_info: dict[str, Any] = {"launches": 0, "failures": 0}

    def regular(self) -> frozenset[str]:
        """The workers the gateway has put into the regular vllm-router (a copy)."""
        return frozenset(self._regular)

    # -- the data plane: where an attempt goes ------------------------------------------------------
    def for_judge(self, model: str | None) -> bool:
        """Whether a request naming ``model`` is a judge's (it goes to the judge router): a model judges serve and
        the policy's workers do not (a judge of the policy's own model, under the same name, is never called by
        name: policy turns are never sent to it)."""
        return model is not None and model in self.judge_models and model not in self.policy_models

    def upstream(self, session: str | None, model: str | None = None) -> str:
        """The vllm-router one attempt goes to: the judge router for a model a judge serves (`NoJudgeRouter`
        while none serves), else the PD router for the sessions its share of the workers covers (`pd_share`,
        `choose_pd`), else the regular one."""
        if self.for_judge(model):
            judge = self.judge
            if judge is None or not judge.alive():
                raise NoJudgeRouter(f"no judge router serves model {model!r} now")
            return judge.url
        pd = self.pd
        if pd is None or not pd.alive():
            return self.router
        return pd.url if choose_pd(session, pd_share(len(self._regular), pd.lists)) else self.router

    @contextlib.contextmanager
    def through(self, session: str | None, model: str | None = None) -> Iterator[str]:
        """Pick the upstream of one attempt (``model``: the request's) and count the attempt as running through
        it while it runs (a PD router that no longer gets new requests is stopped only once none runs through
        it)."""
        base = self.upstream(session, model)
        judge = self.judge
        kind = "regular" if base == self.router else "judge" if judge is not None and base == judge.url else "pd"
        self.stats[f"attempts_{kind}"] += 1
        self._inflight[base] += 1
        try:
            yield base
        finally:
            self._inflight[base] -= 1
            if self._inflight[base] <= 0:
                del self._inflight[base]

    def models_url(self) -> str:
        """The vllm-router that answers ``/v1/models``: the PD router while it routes to every worker, else the
        regular one."""
        pd = self.pd
        return pd.url if pd is not None and pd.alive() and not self._regular else self.router

    # -- what the routers list --------------------------------------------------------------------------
    async def router_workers(self, base: str | None = None) -> list[dict] | None:
        """A vllm-router's own list of its workers (``GET /workers``): the regular one's, or the one at
        ``base``; None when it does not answer."""
        try:
            resp = await self.control.http.get((base or self.router) + "/workers", timeout=2.0)
            doc = resp.json()
        except (httpx.HTTPError, ValueError):
            return None
        workers = doc.get("workers") if isinstance(doc, dict) else None
        return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else None

    async def judge_listing(self) -> dict[str, dict] | None:
        """The judge router's workers by URL (None: no judge router, or it does not answer)."""
        judge = self.judge
        listed = await self.router_workers(judge.url) if judge is not None and judge.alive() else None
        return {str(w.get("url", "")).rstrip("/"): w for w in listed} if listed is not None else None

    async def pd_listing(self) -> tuple[PdRouter | None, dict[str, dict] | None]:
        """The serving PD router and its workers by URL (None: no PD router, or it does not answer)."""
        pd = self.pd
        if pd is None or not pd.alive():
            return pd, None
        listed = await self.router_workers(pd.url)
        return pd, ({str(w.get("url", "")).rstrip("/"): w for w in listed} if listed is not None else None)

    async def health_doc(self) -> tuple[dict, int]:
        """``/health``'s document and status (503 while vllm-router does not answer)."""
        listed = await self.router_workers()
        pd, pd_seen = await self.pd_listing()
        pd_doc: dict[str, Any] = {**self.pd_info, "router": None}
        ready_pairs = False
        if pd is not None:
            healthy_pd = {u for u, w in (pd_seen or {}).items() if w.get("is_healthy")}
            pd_doc["router"] = {
                "url": pd.url,
                **pd.lists.doc(),
                "up": pd_seen is not None,
                "healthy_prefill": len(healthy_pd & set(pd.lists.prefill)),
                "healthy_decode": len(healthy_pd & set(pd.lists.decode)),
            }
            ready_pairs = bool(healthy_pd & set(pd.lists.prefill)) and bool(healthy_pd & set(pd.lists.decode))
        judge = self.judge
        judge_doc = {**self.judge_info, "router": judge.url if judge is not None else None}
        judge_doc.update(up=judge is not None and judge.alive(), members=len(self._judged))
        judge_doc["models"] = sorted(self.judge_models)
        if listed is None:
            doc = {"ok": False, "router": "down", "members": len(self.members.by_url), "pd": pd_doc, "judge": judge_doc}
            return doc, 503
        healthy = sum(1 for w in listed if w.get("is_healthy"))
        return (
            {
                "ok": True,
                "router": "up",
                "members": len(self.members.by_url),
                "workers": len(listed),
                "healthy_workers": healthy,
                "has_workers": healthy > 0 or ready_pairs,
                "pd": pd_doc,
                "judge": judge_doc,
            },
            200,
        )

    # -- changing them (on the control plane's loop) ----------------------------------------------------
    async def _call(self, what: str, url: str, timeout: float, router: str | None = None) -> str | None:
        """POST the regular vllm-router's (or ``router``'s) /add_worker or /remove_worker; None on success, else
        why not."""
        try:
            resp = await self.control.http.post(f"{router or self.router}/{what}", params={"url": url}, timeout=timeout)
        except httpx.HTTPError as exc:
            return f"the router did not answer {what} ({type(exc).__name__}: {exc})"
        if resp.status_code == 200 or (what == "add_worker" and "already exists" in resp.text):
            return None
        return f"the router answered {what} with HTTP {resp.status_code}: {resp.text[:300]}"

    async def _launch_pd(self, lists: PdLists) -> PdRouter | None:
        """A PD router for ``lists``, ready; None when none can be had now: no launcher, a launch for the same
        lists failed less than its back-off ago, or this launch failed (counted, logged, backed off)."""
        if self.pd_launcher is None:
            return None
        failed = self._pd_failed
        if failed is not None and failed[0] == lists and time.monotonic() < failed[1] + failed[2]:
            return None
        t0 = time.monotonic()
        try:
            router = await self.pd_launcher(lists)
        except Exception as exc:
            again = failed is not None and failed[0] == lists
            backoff = min(self.config.pd_retry_max_s, failed[2] * 2) if again and failed else self.config.pd_retry_s
            self._pd_failed = (lists, time.monotonic(), backoff)
            self.pd_info["failures"] += 1
            self.pd_info["last_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log.error(
                "no PD router for prefill %s, decode %s (%s): they serve whole requests through the regular "
                "router; next try in %.1f s",
                list(lists.prefill),
                list(lists.decode),
                self.pd_info["last_error"],
                backoff,
            )
            return None
        took = time.monotonic() - t0
        self._pd_failed = None
        self.pd_info["launches"] += 1
        self.pd_info["last_launch_s"] = round(took, 3)
        log.info(
            "PD router %s ready in %.2f s: prefill %s, decode %s",
            router.url,
            took,
            list(lists.prefill),
            list(lists.decode),
        )
        return router

    def _retire(self, router: PdRouter) -> None:
        """``router`` gets no new requests; it is stopped once no attempt runs through it any more (at most
        ``request_timeout_s`` later: an attempt is bounded by that)."""
        self._draining.append(router)

        async def drain() -> None:
            t0 = time.monotonic()
            deadline = t0 + self.config.request_timeout_s + 5.0
            try:
                while self._inflight.get(router.url, 0) > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                left = self._inflight.get(router.url, 0)
                await router.stop()
                self.pd_info["retired"] += 1
                log.info(
                    "PD router %s stopped %.2f s after its last new request%s",
                    router.url,
                    time.monotonic() - t0,
                    f" ({left} attempt(s) still on it)" if left else "",
                )
            except Exception as exc:  # the gateway goes on; aclose stops what is left
                log.warning("stopping PD router %s failed: %s", router.url, exc)
            finally:
                if router in self._draining:
                    self._draining.remove(router)

        task = asyncio.create_task(drain())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def reconcile(
        self, *, force: Iterable[str] = (), gone: Iterable[str] = (), wait_s: float = 30.0
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Make the two vllm-routers route to exactly what the members say (`pd_lists`, `regular_members`);
        returns (URLs that could not be put into the regular router, URLs that could not be taken out of
        it), each with why.

        Make before break: a new PD router is ready, and the regular router has every worker it must take
        over, before new requests go by the new plan; only then are workers taken out of the regular router
        and the PD router that was replaced retired (stopped once no attempt runs through it). ``force``:
        URLs to add to the regular router again even if the gateway put them there (it may have lost them);
        ``gone``: URLs to take out of it even if the gateway does not know them as its own."""
        async with self._plan_lock:
            roles = self.members.roles()
            want = pd_lists(roles)
            old = self.pd
            new = old
            if want is None:
                new = None
            elif old is None or old.lists != want or not old.alive():
                new = await self._launch_pd(want)  # None: the PD workers serve through the regular router
            target = regular_members(roles, new.lists if new is not None else None)
            forced = set(force)
            failed: dict[str, str] = {}
            for url in sorted(target):
                if url in self._regular and url not in forced:
                    continue
                why = await self._call("add_worker", url, timeout=max(5.0, wait_s) + 5.0)
                if why is None:
                    self._regular.add(url)
                else:
                    failed[url] = why
            self.pd = new
            if old is not None and old is not new:
                self._retire(old)
            stuck: dict[str, str] = {}
            for url in sorted((self._regular | set(gone)) - target):
                why = await self._call("remove_worker", url, timeout=10.0)
                if why is None:
                    self._regular.discard(url)
                else:
                    stuck[url] = why
            judges = judge_members(roles)
            self._models_read &= set(roles)
            # what the policy serves is never a judge's: read only while there are judges (a run without one asks
            # no member for its models), each policy member once
            for url in sorted(set(roles) - judges - self._models_read) if judges else ():
                self.policy_models |= await self._served_models(url)
                self._models_read.add(url)
            await self._reconcile_judges(judges, forced, failed, stuck, wait_s)
            return failed, stuck

    async def _reconcile_judges(
        self, judges: set[str], forced: set[str], failed: dict[str, str], stuck: dict[str, str], wait_s: float
    ) -> None:
        """The judge router routes to exactly ``judges``: started with the first (and again if it exited, its
        members put back), each judge's models learned as it joins; what could not be added goes to ``failed``,
        what could not be taken out to ``stuck``."""
        judge = self.judge
        if judge is not None and not judge.alive():
            self._judged = set()  # a router that exited routes to nothing: the next one is given every judge
        if judges and (judge is None or not judge.alive()):
            new = await self._launch_judge()
            if new is None:
                failed.update({u: "no judge router could be started" for u in judges})
                return
            if judge is not None:
                await judge.stop()
            self.judge = judge = new
        if judge is None or not judge.alive():
            return
        for url in sorted(judges):
            if url in self._judged and url not in forced:
                continue
            why = await self._call("add_worker", url, timeout=max(5.0, wait_s) + 5.0, router=judge.url)
            if why is None:
                self._judged.add(url)
                self.judge_models |= await self._served_models(url)
            else:
                failed[url] = why
        for url in sorted(self._judged - judges):
            why = await self._call("remove_worker", url, timeout=10.0, router=judge.url)
            if why is None:
                self._judged.discard(url)
            else:
                stuck[url] = why

    async def _served_models(self, url: str) -> set[str]:
        """The model ids a worker serves (its ``/v1/models``); none when it does not answer (a member that joined
        answered ``/health``: its list is read once)."""
        try:
            doc = (await self.control.http.get(url + "/v1/models", timeout=5.0)).json()
        except (httpx.HTTPError, ValueError):
            return set()
        entries = doc.get("data") if isinstance(doc, dict) else None
        return {e["id"] for e in entries or [] if isinstance(e, dict) and isinstance(e.get("id"), str)}

    async def _launch_judge(self) -> JudgeRouter | None:
        """A judge router, ready; None when none can be had now: no launcher, a launch failed less than its
        back-off ago, or this one failed (counted, logged, backed off as a PD router's is)."""
        if self.judge_launcher is None:
            return None
        failed = self._judge_failed
        if failed is not None and time.monotonic() < failed[0] + failed[1]:
            return None
        try:
            judge = await self.judge_launcher()
        except Exception as exc:
            backoff = min(self.config.pd_retry_max_s, failed[1] * 2) if failed else self.config.pd_retry_s
            self._judge_failed = (time.monotonic(), backoff)
            self.judge_info["failures"] += 1
            self.judge_info["last_error"] = f"{type(exc).__name__}: {exc}"[:500]
            log.error("no judge router (%s): next try in %.1f s", self.judge_info["last_error"], backoff)
            return None
        self._judge_failed = None
        self.judge_info["launches"] += 1
        log.info("judge router %s ready", judge.url)
        return judge

    async def reregister(self) -> list[str]:
        """Put the regular members back into a regular vllm-router that lost them (restarted); returns the URLs
        that failed."""
        return await self.control.run(self._reregister)

    async def _reregister(self) -> list[str]:
        async with self._plan_lock:
            return [url for url in sorted(self._regular) if await self._call("add_worker", url, timeout=30.0)]

    async def check_pd(self) -> None:
        """Called now and then (pearlctl.router.__main__): a PD router that exited is replaced (its workers
        serve through the regular router meanwhile), and lists whose PD router could not be started are tried
        again once their back-off has passed (`_launch_pd`); so is a judge router (`_launch_judge`)."""
        await self.control.run(self._check_pd)

    async def _check_pd(self) -> None:
        pd, judge = self.pd, self.judge
        roles = self.members.roles()
        judge_down = bool(judge_members(roles)) and (judge is None or not judge.alive())
        if judge is not None and not judge.alive():
            log.error("judge router %s exited: starting another", judge.url)
        if pd is not None and not pd.alive():
            log.error("PD router %s exited: starting another", pd.url)
        elif not judge_down and (pd is not None or pd_lists(roles) is None):
            return  # the PD router runs (`reconcile` keeps its lists right), or none is wanted; so does the judge's
        await self.reconcile()

    async def close(self) -> None:
        """On the control plane's loop: stop every PD router (the one serving and those still draining)."""
        for task in list(self._retiring):
            task.cancel()
        routers = [r for r in (self.pd, self.judge) if r is not None]
        routers += self._draining
        self.pd = self.judge = None
        for router in routers:
            with contextlib.suppress(Exception):
                await router.stop()
