"""The agent's side of the control API: register, heartbeat, and finding the daemon again.

Built on the one control-API client (pearlctl.api.client): the daemon's address is re-read whenever a
request fails (a restarted daemon moves), answers from an older epoch than one seen are ignored.
Registration uses the run's token and returns this allocation's own credential; every heartbeat uses
that credential, which the daemon accepts for this allocation only. The daemon knowing us no more
(404) or refusing our credential (403) means: register again.

It never raises for an unreachable daemon: the agent's workers keep running meanwhile, and
``contact_age`` tells the agent how long the daemon has been out of reach (or stuck: an answer whose
control loop has not ticked for a while counts as no answer), which is what the agent's own return of
lent GPUs is decided on.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from pearlctl.agent.identity import Identity
from pearlctl.api import bodies
from pearlctl.api.client import ControlClient, DaemonRefusal, DaemonUnavailable

log = logging.getLogger("pearlctl.agent")

# A daemon whose control loop has not ticked for this long does not decide anything: treat it as absent.
STUCK_LOOP_S = 10.0


class DaemonClient:
    def __init__(self, me: Identity, run_dir: str, *, timeout: float = 5.0, clock=time.monotonic):
        self.me, self.run_dir = me, run_dir
        # the read timeout covers a long poll (held up to one heartbeat interval) with room to spare
        self.api = ControlClient(run_dir, me.run_id, timeout=timeout, read_timeout=timeout + 30.0, retries=2)
        self.desired_hash: str | None = None
        self.clock = clock
        self.in_control_at = clock()  # the last answer from a daemon whose control loop was running
        self._refused: str | None = None  # the last refusal of a report as invalid (logged once)

    @property
    def allocation_id(self) -> int | None:
        return self.api.allocation_id

    @property
    def epoch_seen(self) -> int:
        return self.api.epoch_seen

    def contact_age(self) -> float:
        """Seconds since the last answer of a daemon in control."""
        return self.clock() - self.in_control_at

    def _post(self, path: str, body, *, as_run: bool = False) -> dict | None:
        try:
            answer = self.api.call("POST", path, body, as_run=as_run)
        except DaemonUnavailable as exc:
            log.debug("%s", exc)
            return None
        except DaemonRefusal as exc:
            if exc.status in (403, 404) and path != "/v1/agents/register":
                self.api.unbind()  # the daemon does not know us (new state?) or our credential: register again
            if exc.status == 422:  # the report itself is invalid (a bug): it will be refused again, say so once
                if self._refused != str(exc):
                    self._refused = str(exc)
                    log.error("daemon refused %s as invalid (%s); every retry will be: %s", path, exc.status, exc)
            else:
                log.warning("daemon refused %s: %s %s", path, exc.status, exc)
            return None
        if float(answer.get("loop_age_s") or 0.0) < STUCK_LOOP_S:
            self.in_control_at = self.clock()
        return answer

    def register(self) -> dict | None:
        body = bodies.Register(
            job_id=self.me.job_id,
            task_id=self.me.task_id,
            pool=self.me.pool or None,
            node=self.me.node,
            host=socket.gethostname(),
            gpus=list(self.me.gpus),
            restarts=self.me.restarts,
            pid=os.getpid(),
        )
        answer = self._post("/v1/agents/register", body, as_run=True)
        if answer is not None:
            self.api.bind(int(answer["allocation_id"]), str(answer["credential"]))
            self.in_control_at = self.clock()
        return answer

    def heartbeat(
        self,
        workers: list[dict],
        *,
        leaving: bool = False,
        draining: bool = False,
        wait_s: float = 0.0,
        self_returns: list[dict] | None = None,
    ) -> dict | None:
        """Report ``workers``; ``draining``: a preemption notice arrived (the GPUs are leaving, the workers
        take no new requests); ``leaving``: this agent's GPUs are going away now."""
        if self.api.allocation_id is None and self.register() is None:
            return None
        body: dict = {"allocation_id": self.api.allocation_id, "workers": workers, "epoch_seen": self.epoch_seen}
        if self_returns:
            body["self_returns"] = self_returns
        if leaving:
            body["leaving"] = True
        elif draining:
            body["draining"] = True
        elif self.desired_hash is not None and wait_s > 0:
            body.update(desired_hash=self.desired_hash, wait_s=wait_s)  # long poll: held until it changes
        answer = self._post("/v1/agents/heartbeat", body)
        if answer is not None:
            self.desired_hash = answer.get("desired_hash")
        return answer

    def close(self) -> None:
        self.api.close()
