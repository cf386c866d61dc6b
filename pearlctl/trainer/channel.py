"""The trainer hook's channel to the run's daemon over the control API, and to its node's return file.

``DaemonChannel`` implements :class:`pearlctl.trainer.ControlChannel` on the project's one control-API
client (:class:`pearlctl.api.client.ControlClient`): ``report`` posts the event to ``/v1/trainer/phase``
and returns the command the daemon's current transition step asks for; ``ack`` posts to
``/v1/trainer/ack``. A daemon that cannot be reached means "no command", and a refusal (4xx/5xx) too,
with a warning: training never stops because the control plane is down. ``ack`` never raises. The
daemon's address and the run's token are read from the run directory (``.pearl/``), re-read after a
failure (a restarted daemon moves). The daemon repeats the command it wants on every report until it is
acked (``repeats_commands``), which the hook relies on to drop releases it held that are no longer wanted.

**The return file: the GPUs come back with the daemon down.** When the daemon cannot be reached past a
lent GPU's return deadline, the agent on the node stops (or parks asleep) the lent vLLM worker by itself
and then writes a node-local file, whose path it gives the trainer's process in ``PEARL_RETURN_FILE``.
The contract, for both sides:

- The agent writes it atomically (a temporary name in the same directory, then rename), only after the
  lent worker is stopped or asleep, as a JSON object::

      {"returned_at": <unix s>, "deadline": <unix s>, "gpus": [<device index>, ...],
       "worker_key": "<key>", "how": "stopped" | "parked"}

- ``report(event)`` with ``event["released"]`` true first looks for the file (a stat; before any request
  to the daemon, which may be down). If it is there, it is renamed to ``<path>.taken-<returned_at>`` and
  the answer is ``{"command": "reclaim", "command_id": "local-return:<returned_at>"}``, without talking to
  the daemon. ``<returned_at>`` is the file's value written as an integer when it is whole (``1700000000``)
  and as Python's ``repr`` of the float otherwise (``1700000000.25``). The hook carries the reclaim out as
  any other; its ack goes to the daemon through ``ack`` (lost while the daemon is down; the daemon takes
  ``local-return:*`` acks later).
- While not released, the file is left alone (nothing to reclaim).
- A stale file — one returned before this trainer's latest release, which the channel knows from the
  release's first ack: ``returned_at < release ack time - 1 s`` (the agent and the trainer share the
  node's clock; 1 s covers whole-second stamps) — is renamed to ``<path>.stale-<returned_at>`` and
  ignored: it belongs to a lending the daemon already ended, and taking it would reload the trainer on
  GPUs that a new worker may hold. A file that is not valid JSON (the contract forbids it) still counts
  as a return, stamped with its modification time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from pearlctl.api import LOCAL_RETURN_PREFIX
from pearlctl.api.client import ControlClient, DaemonRefusal

log = logging.getLogger("pearlctl.trainer")

RETURN_FILE_ENV = "PEARL_RETURN_FILE"
_STALE_SLACK_S = 1.0
_FROM_ENV: Any = object()


class DaemonChannel:
    repeats_commands = True
    """The daemon answers its pending trainer command on every report until it is acked."""

    def __init__(
        self,
        run_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        *,
        weights_dir: str | os.PathLike | None = None,
        timeout: float = 5.0,
        return_file: str | os.PathLike | None = _FROM_ENV,
    ):
        """``weights_dir``: where the hook's ``export_weights`` writes (``<weights_dir>/<version>/``); with
        it, every report tells the daemon the path of the version to sync to the rollout workers.
        ``return_file``: the node's return file (module docstring); default ``$PEARL_RETURN_FILE``, and
        ``None`` (or an empty variable) turns the feature off."""
        self.weights_dir = weights_dir
        self.run_dir = os.fspath(run_dir) if run_dir is not None else os.environ["PEARL_RUN_DIR"]
        self.run_id = run_id or os.environ["PEARL_RUN_ID"]
        if return_file is _FROM_ENV:
            return_file = os.environ.get(RETURN_FILE_ENV)
        self.return_file: str | None = os.fspath(return_file) if return_file else None
        self.timeout = timeout
        self._client = ControlClient(self.run_dir, self.run_id, timeout=timeout)
        self._release_id: str | None = None  # the latest release acked, and when it first was
        self._released_at: float | None = None

    # -- the daemon ---------------------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> dict | None:
        try:  # a long poll (``wait_s``) is held by the daemon up to that long on top of the answer's time
            return self._client.try_call("POST", path, body, timeout=self.timeout + float(body.get("wait_s") or 0))
        except DaemonRefusal as exc:
            log.warning("daemon refused %s (%s): %s", path, exc.status, exc)
        except Exception as exc:  # whatever it is, the trainer goes on
            log.warning("trainer channel %s failed: %s: %s", path, type(exc).__name__, exc)
        return None

    def report(self, event: dict) -> dict | None:
        if event.get("released") and self.return_file is not None:
            local = self._take_return_file()
            if local is not None:
                return local
        if self.weights_dir is not None and event.get("weight_version") is not None:
            event = dict(event, weights_path=os.path.join(os.fspath(self.weights_dir), str(event["weight_version"])))
        answer = self._post("/v1/trainer/phase", event)
        if not answer or answer.get("command") is None:
            return None
        return {k: answer[k] for k in ("command", "command_id", "mode") if answer.get(k) is not None}

    def broadcast_targets(self) -> list[dict]:
        """The vLLM workers trainer rank 0 broadcasts each version to (``GET /v1/weights/targets``: READY,
        routable, started with the receiver, on nodes without a trainer rank), each ``{"id", "url", ...}``.
        ``[]`` when the daemon cannot be asked or refuses: those workers then read the disk, as by default."""
        try:
            answer = self._client.try_call("GET", "/v1/weights/targets")
        except DaemonRefusal as exc:
            log.warning("daemon refused /v1/weights/targets (%s): %s", exc.status, exc)
            return []
        except Exception as exc:  # whatever it is, the trainer goes on
            log.warning("trainer channel /v1/weights/targets failed: %s: %s", type(exc).__name__, exc)
            return []
        workers = (answer or {}).get("workers")
        if not isinstance(workers, list):
            return []
        return [w for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]

    def ack(self, command_id: str, result: dict) -> None:
        try:
            if result.get("command") == "release" and result.get("ok"):
                if command_id != self._release_id:  # a re-ack of the same release keeps its first time
                    self._release_id, self._released_at = command_id, time.time()
            elif result.get("command") == "reclaim" and result.get("ok"):
                self._release_id, self._released_at = None, None
        except Exception:  # a strange result must not stop the ack
            pass
        self._post("/v1/trainer/ack", {"command_id": command_id, "result": result})

    def close(self) -> None:
        self._client.close()

    # -- the node's return file -----------------------------------------------------------------------
    def _take_return_file(self) -> dict | None:
        """The local reclaim if the agent returned the lent GPUs by itself, else None (module docstring)."""
        path = self.return_file
        assert path is not None
        try:
            with open(path) as f:
                text = f.read()
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the return file %s: %s", path, exc)
            return None
        try:
            doc = json.loads(text)
            returned_at = float(doc["returned_at"])
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("return file %s is not the agent's JSON (%s); taking it as a return at %s", path, exc, mtime)
            doc, returned_at = {}, mtime
        stamp = _stamp(returned_at)
        if self._released_at is not None and returned_at < self._released_at - _STALE_SLACK_S:
            log.warning(
                "return file %s is stale (returned at %s, before this trainer's release at %.3f): ignored",
                path,
                stamp,
                self._released_at,
            )
            _rename_quietly(path, f"{path}.stale-{stamp}")
            return None
        try:
            os.replace(path, f"{path}.taken-{stamp}")
        except FileNotFoundError:  # taken meanwhile
            return None
        except OSError as exc:
            log.warning("cannot rename the return file %s (%s); reclaiming anyway", path, exc)
        log.warning(
            "the node's agent returned the lent GPUs itself (%s worker %s, GPUs %s, deadline %s): reclaiming "
            "without the daemon",
            doc.get("how"),
            doc.get("worker_key"),
            doc.get("gpus"),
            doc.get("deadline"),
        )
        return {"command": "reclaim", "command_id": f"{LOCAL_RETURN_PREFIX}{stamp}"}


def _stamp(t: float) -> str:
    return str(int(t)) if float(t).is_integer() else repr(float(t))


def _rename_quietly(src: str, dst: str) -> None:
    try:
        os.replace(src, dst)
    except OSError as exc:
        log.warning("cannot rename %s: %s", src, exc)
