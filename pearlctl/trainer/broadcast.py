"""The trainer side of the cross-node weight path: one version's tensors broadcast to vLLM workers over a
torch.distributed gloo group, received through vLLM's own weight-update routes.

vLLM 0.32 has a weight-transfer engine (``--weight-transfer-config``; routes ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/shutdown_weight_transfer_engine``)
whose built-in backends need CUDA. ``pearl_gloo`` is the CPU stand-in: the vLLM side is
:mod:`pearlctl.agent.engines.vllm_gloo`, registered inside the vLLM worker by ``--worker-extension-cls``;
a server the agent starts with ``server_engine_args()`` in its engine args has it. This module is the
sender (docs/weights.md, "Across nodes"):

    sender = GlooWeightSender(["http://node7:8000"], master_address="trainer-node-0")
    sender.connect()                          # once: one gloo group, trainer rank 0 and every worker
    stats = sender.send(state_dict, "3")      # every step: the worker serves version "3" when it returns
    sender.close()

Guarantees:

- **No request runs on half a version.** ``send`` pauses each worker's scheduler (``/pause?mode=keep``: requests
  in flight are frozen, none is lost), calls ``/start_weight_update``, then ``/update_weights`` (names, dtypes,
  shapes) while it broadcasts every tensor from rank 0, then ``/finish_weight_update`` with the version (what the
  server's ``/weight_info`` reports after), then ``/resume``. Frozen requests go on with the new weights, as they
  do after the agent's ``reload_weights``.
- **A failure leaves the label and the pause.** When a step fails, ``send`` raises `TransferError` and does not
  resume: the worker keeps its old version's label, so the agent's ``sync_weights`` (pearlctl.agent.workers) will
  not take the version as broadcast: it finishes an update left open, reloads the version from a file (the disk
  path stays the fallback) and resumes the worker, which until then serves nothing (docs/weights.md).
- **Fails fast on a server without the engine**: ``connect`` asks each worker which transfer backend it has
  (``/collective_rpc pearl_weight_transfer_info``) before any rendezvous, and refuses one without ``pearl_gloo``.
- **No file is written or read**: the bytes go from the trainer's memory to the worker's parameters.
- One rank per worker: each URL is one vLLM server with one worker process (tensor parallel size 1, as on
  CPU). The group is trainer rank 0, then the workers in ``urls`` order (ranks 1..n).
- The sender holds a full state dict: call it on one trainer rank (rank 0; ZeRO-3 gathers first, as
  ``export_weights`` does).

In a run (opt-in: ``[pools.rollout] weights = "broadcast"``, docs/run-spec.md): the launcher gives that pool's
workers ``server_engine_args()`` and the trainer ``PEARL_WEIGHTS_BROADCAST=1`` (``BROADCAST_ENV``); rank 0's
``export_weights`` (pearlctl.trainer.weights) then hands each version to a `WeightBroadcaster`, which asks the
daemon for the targets (``DaemonChannel.broadcast_targets``: ``GET /v1/weights/targets``) and sends the version to
them after the disk export and before the hook's next report publishes it. `WeightBroadcaster.send` never raises:
a failed or partial send is logged and returned, and the workers it did not reach reload from disk as before.

NCCL on GPUs is vLLM's own ``nccl`` backend and its trainer engine (``NCCLTrainerWeightTransferEngine``),
which this module does not replace.

Import-light: stdlib only at import; torch is imported inside the functions that need it. HTTP goes through
``urllib`` (the trainer process has no httpx).

    python -m pearlctl.trainer.broadcast --worker URL [--worker URL ...] --weights HF_DIR --version V
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

BACKEND = "pearl_gloo"
WORKER_EXTENSION = "pearlctl.agent.engines.vllm_gloo.PearlWeightTransferExtension"
INFO_RPC = "pearl_weight_transfer_info"  # the extension's method, through POST /collective_rpc
GROUP_PREFIX = "pearl-weights"
DEFAULT_TIMEOUT_S = 300.0
BROADCAST_ENV = "PEARL_WEIGHTS_BROADCAST"  # "1": the trainer's rank 0 broadcasts each version (set by the launcher)
TIMEOUT_ENV = "PEARL_BROADCAST_TIMEOUT_S"  # the run's bound on each step of a broadcast (default RUN_TIMEOUT_S)
RUN_TIMEOUT_S = 60.0

log = logging.getLogger("pearlctl.trainer")


def server_engine_args() -> dict[str, Any]:
    """The vLLM engine args that give a server the ``pearl_gloo`` receiver (for ``VllmServer(engine_args=...)``,
    which turns them into ``--weight-transfer-config '{"backend":"pearl_gloo"}' --worker-extension-cls ...``)."""
    return {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": WORKER_EXTENSION}


class TransferError(RuntimeError):
    """A worker refused or failed a step of the transfer; the message names the worker and the step."""


class GlooWeightSender:
    """Rank 0 of a gloo group with vLLM workers; ``send`` makes each of them serve one version."""

    def __init__(
        self,
        urls: list[str],
        *,
        master_address: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pause_mode: str = "keep",
    ):
        if not urls:
            raise ValueError("GlooWeightSender needs at least one worker URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.master_address = master_address or socket.gethostname()
        self.timeout_s = float(timeout_s)
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be keep, wait or abort, not {pause_mode!r}")
        self.pause_mode = pause_mode
        self._store: Any = None
        self._group: Any = None
        self.last: dict | None = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.urls)

    def connect(self) -> None:
        """Check every worker has the engine, then form the group: a TCPStore on a free port here, each
        worker's ``/init_weight_transfer_engine`` (its rank: 1 + its index) while this process joins as rank 0."""
        import torch.distributed as dist

        for url in self.urls:
            info = self._post(url, "collective_rpc", {"method": INFO_RPC, "timeout": 30}, timeout=40)
            backends = {(r or {}).get("backend") for r in (info or {}).get("results", [])}
            if backends != {BACKEND}:
                raise TransferError(f"{url} has weight-transfer backend(s) {sorted(map(str, backends))}, not {BACKEND}")
        timeout = timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore("0.0.0.0", 0, self.world_size, True, timeout=timeout, wait_for_workers=False)
        port = self._store.port
        calls = [
            (
                url,
                "init_weight_transfer_engine",
                {
                    "init_info": {
                        "master_address": self.master_address,
                        "master_port": port,
                        "rank_offset": 1 + i,
                        "world_size": self.world_size,
                        "timeout_s": self.timeout_s,
                    }
                },
            )
            for i, url in enumerate(self.urls)
        ]
        threads, errors = self._start(calls)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(GROUP_PREFIX, self._store), 0, self.world_size, timeout)
        self._join(threads, errors)

    def send(self, tensors: Mapping[str, Any], version: str) -> dict:
        """Broadcast ``tensors`` (HF checkpoint names, as ``state_dict()`` gives them) to every worker, which
        loads them through vLLM's layerwise reload and then serves ``version``. Returns timings and sizes."""
        import torch.distributed as dist

        if self._group is None:
            raise TransferError("send before connect")
        t0 = time.monotonic()
        host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        update_info = {
            "names": list(host),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in host.values()],
            "shapes": [list(t.shape) for t in host.values()],
        }
        for url in self.urls:  # no scheduler step may run between start and finish: the layers are being reloaded
            self._post(url, f"pause?mode={self.pause_mode}", None)
            self._post(url, "start_weight_update", None)
        threads, errors = self._start([(url, "update_weights", {"update_info": update_info}) for url in self.urls])
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t = time.monotonic()
        nbytes = 0
        for tensor in host.values():
            if errors:
                break  # a worker failed before receiving: nobody waits on the rest of the broadcast
            self._group.broadcast([tensor], opts).wait()
            nbytes += tensor.numel() * tensor.element_size()
        broadcast_s = time.monotonic() - t
        self._join(threads, errors)
        for url in self.urls:
            self._post(url, "finish_weight_update", {"weight_version": str(version)})
            self._post(url, "resume", None)
        self.last = {
            "version": str(version),
            "tensors": len(host),
            "bytes": nbytes,
            "workers": len(self.urls),
            "broadcast_s": round(broadcast_s, 6),
            "send_s": round(time.monotonic() - t0, 6),
        }
        return self.last

    def close(self) -> None:
        """Release the group on every worker (``/shutdown_weight_transfer_engine``) and here; errors are ignored."""
        if self._group is not None:
            for url in self.urls:
                try:
                    self._post(url, "shutdown_weight_transfer_engine", None, timeout=30)
                except TransferError:
                    pass
        self._group = None
        self._store = None

    def __enter__(self) -> GlooWeightSender:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- HTTP -----------------------------------------------------------------------------------

    def _post(self, url: str, route: str, body: dict | None, *, timeout: float | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            f"{url}/{route}", data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s + 10) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace").strip()
            raise TransferError(f"POST {url}/{route} answered {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise TransferError(f"POST {url}/{route}: {e}") from e
        return json.loads(raw) if raw else None

    def _start(self, calls: list[tuple[str, str, dict]]) -> tuple[list[threading.Thread], list[str]]:
        """The calls that block until this process joins a collective, each on its own thread."""
        errors: list[str] = []

        def call(url: str, route: str, body: dict) -> None:
            try:
                self._post(url, route, body)
            except TransferError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=call, args=c, daemon=True) for c in calls]
        for th in threads:
            th.start()
        return threads, errors

    def _join(self, threads: list[threading.Thread], errors: list[str]) -> None:
        for th in threads:
            th.join(self.timeout_s + 20)
        if errors:
            raise TransferError("; ".join(errors))
        if any(th.is_alive() for th in threads):
            raise TransferError(f"a worker did not answer within {self.timeout_s + 20:g} s")


def broadcast_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether this trainer broadcasts each version (``PEARL_WEIGHTS_BROADCAST=1``, set by the launcher when a
    pool of the run has ``weights = "broadcast"``)."""
    return (os.environ if env is None else env).get(BROADCAST_ENV, "") == "1"


class WeightBroadcaster:
    """What trainer rank 0 keeps across versions: the targets' group, formed again when the targets change.

    ``targets``: a function returning the workers to send to, each ``{"id": ..., "url": ...}`` (the daemon's
    ``GET /v1/weights/targets``, through ``DaemonChannel.broadcast_targets``; ``[]`` when it cannot be asked).
    ``send`` never raises: it returns what happened (``sent``, ``workers``, timings, or ``error``). After a
    failure the group is closed, so the next version forms a new one; the workers it did not reach keep their
    old label and reload the version from the node-local store or the disk once it is published
    (pearlctl.agent.workers, ``VllmWorker.sync_weights``). ``make_sender`` is the seam tests replace."""

    def __init__(
        self,
        targets: Callable[[], list[dict]],
        *,
        timeout_s: float | None = None,
        master_address: str | None = None,
        make_sender: Callable[..., Any] | None = None,
    ):
        self.targets = targets
        if timeout_s is None:
            try:
                timeout_s = float(os.environ.get(TIMEOUT_ENV) or RUN_TIMEOUT_S)
            except ValueError:
                timeout_s = RUN_TIMEOUT_S
        self.timeout_s = timeout_s
        self.master_address = master_address
        self.make_sender = make_sender or GlooWeightSender
        self._sender: Any = None
        self._members: tuple = ()  # (worker id, url) of the group's workers, in rank order

    def send(self, tensors: Mapping[str, Any], version: str) -> dict:
        t0 = time.monotonic()
        try:
            targets = list(self.targets() or [])
        except Exception as exc:  # the channel answers [] on failure; anything else must not stop the export
            targets = []
            log.warning(
                "weight broadcast of %s: no targets (%s: %s); workers read the disk", version, type(exc).__name__, exc
            )
        members = tuple(sorted({(t.get("id"), str(t["url"]).rstrip("/")) for t in targets if t.get("url")}))
        if not members:
            self.close()
            return {"version": str(version), "sent": False, "workers": 0}
        stage = "connect"
        try:
            if members != self._members or self._sender is None:
                self.close()  # a gloo group has a fixed size: another set of workers needs a new group
                self._sender = self.make_sender(
                    [url for _, url in members], master_address=self.master_address, timeout_s=self.timeout_s
                )
                self._sender.connect()
                self._members = members
            stage = "send"
            stats = dict(self._sender.send(tensors, str(version)))
        except Exception as exc:
            error = f"{stage}: {type(exc).__name__}: {exc}"
            log.warning(
                "weight broadcast of %s to %d worker(s) failed (%s); they reload it from the node-local store or "
                "the disk once it is published",
                version,
                len(members),
                error,
            )
            self.close()
            return {
                "version": str(version),
                "sent": False,
                "workers": len(members),
                "error": error[:500],
                "send_s": round(time.monotonic() - t0, 6),
            }
        log.info(
            "weight broadcast of %s: %s tensors (%s bytes) to %d worker(s) over gloo in %.3fs",
            version,
            stats.get("tensors"),
            stats.get("bytes"),
            len(members),
            time.monotonic() - t0,
        )
        return {
            **stats,
            "version": str(version),
            "sent": True,
            "workers": len(members),
            "urls": [u for _, u in members],
        }

    def close(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as exc:
                log.warning("closing the weight broadcast group failed: %s", exc)
        self._sender = None
        self._members = ()


def load_hf_dir(directory: str | Path) -> dict:
    """Every tensor of an HF directory's safetensors files (what ``export_weights`` writes)."""
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Broadcast one weight version to vLLM workers over gloo.")
    ap.add_argument("--worker", action="append", required=True, help="a worker's base URL (repeat for more)")
    ap.add_argument("--weights", required=True, help="an HF directory whose safetensors are the version")
    ap.add_argument("--version", required=True)
    ap.add_argument("--master-address", default=None, help="this host's address as the workers reach it")
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    args = ap.parse_args(argv)
    tensors = load_hf_dir(args.weights)
    with GlooWeightSender(args.worker, master_address=args.master_address, timeout_s=args.timeout_s) as sender:
        stats = sender.send(tensors, args.version)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
