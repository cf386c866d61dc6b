"""The agent's control-API client (pearlctl.agent.client.DaemonClient) at its one seam, the API call: a
report the daemon refuses as invalid (422) is logged once per distinct error, not at every heartbeat, and
is no contact with a daemon in control; a 404 or 403 makes the agent register again."""

from __future__ import annotations

import logging

from pearlctl.agent.client import DaemonClient
from pearlctl.agent.identity import Identity
from pearlctl.api.client import DaemonRefusal


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def client(tmp_path, answers: list) -> tuple[DaemonClient, Clock]:
    me = Identity(run_id="r", pool="rollout", role="ROLLOUT", job_id="7", task_id=0, node="n1", gpus=(0,), restarts=0)
    clock = Clock()
    c = DaemonClient(me, str(tmp_path), clock=clock)
    c.api.bind(3, "credential")

    def call(method, path, body=None, *, as_run=False):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    c.api.call = call
    return c, clock


def test_a_report_refused_as_invalid_is_logged_once_per_error_and_is_no_contact(tmp_path, caplog):
    invalid = DaemonRefusal("workers.0.gpus: Value error, GPU indices must be distinct", 422)
    other = DaemonRefusal("self_returns.0.gpus: Value error, GPU indices must be distinct", 422)
    c, clock = client(tmp_path, [invalid] * 5 + [other, other, {"loop_age_s": 0.1}])
    with caplog.at_level(logging.WARNING, logger="pearlctl.agent"):
        for _ in range(7):
            clock.now += 1.0
            assert c.heartbeat([]) is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [("workers.0.gpus" in r.getMessage(), "self_returns" in r.getMessage()) for r in errors] == [
        (True, False),
        (False, True),
    ]
    assert c.contact_age() == 7.0 and c.allocation_id == 3  # no contact; still registered
    assert c.heartbeat([]) is not None and c.contact_age() == 0.0


def test_a_heartbeat_the_daemon_does_not_know_makes_the_agent_register_again(tmp_path):
    c, _ = client(tmp_path, [DaemonRefusal("no allocation 3", 404)])
    assert c.heartbeat([]) is None
    assert c.allocation_id is None
