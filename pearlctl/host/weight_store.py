"""A node's weight store: the models this node's vLLM workers load, kept in node-local memory so that a worker
that starts, shifts role or takes a new policy version reads no shared disk on the way.

One store per run and node (``NodeStore.for_node``: ``<PEARL_SHM_DIR, else /dev/shm, else the temporary
directory>/pearl/<run>/<node>/``), shared by every agent of the run on that node (a trainer job and a rollout job
may share a node), laid out as::

    weights/<version>/   the policy's exported versions, the trainer's export layout (pearlctl.trainer.weights):
                         written by the trainer's local rank 0 on a trainer node (``PEARL_WEIGHT_STORE`` is this
                         directory), copied from the shared-disk export on any other node (``fetch_version``)
    weights/LATEST       the newest version the trainer wrote here
    models/<name>/       a model that never changes (the judge), copied once from shared disk (``fetch_model``)
    pins/<pid>           what the live engine process <pid> serves or holds parked (one path)
    agents/<pid>         the live agents of the run on this node

Guarantees:

- **Never half a model.** Every copy is made under a hidden temporary name and renamed into place, one copier per
  model at a time (a lock file); a reader sees the whole directory or none. A policy version counts only once
  its version file names it (``stored_version``). The trainer's export of a version on its node takes no lock:
  a copy that finds the version put in place meanwhile uses that one.
- **Pruning never removes a model in use.** ``prune`` keeps the newest ``keep`` versions and every version a live
  engine process has pinned (a worker serving it, or parked with it); a pin whose process is gone is dropped.
  Models of ``models/`` are never pruned: they go with the store.
- **It lives as long as the run's allocations on the node.** The store is removed when the last live agent of
  the run on the node leaves (``leave``); an agent that crashed and was started again in its allocation finds
  it whole (only its dead pins and registration are dropped).
- **Bounded.** A copy is made only if ``HEADROOM`` of the space free on the store's filesystem (it is RAM the
  engines also need) stays free after it: a copy never takes more than the rest, so copies alone never fill the
  filesystem, whatever else already uses it. A model that does not fit, or a copy that fails, is one log line and
  the worker reads shared disk, as without a store.

Import-light and below every layer (pearlctl.host): the standard library and pearlctl.host only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from pearlctl.host.processes import process_alive
from pearlctl.host.runfiles import write_atomic

log = logging.getLogger("pearlctl.store")

WEIGHT_VERSION_FILE = "pearl_weight_version.txt"  # in a version's directory: the version it holds, written last
LATEST_WEIGHTS_FILE = "LATEST"
NODE_STORE_KEEP = 2  # the policy's versions a store keeps besides pinned ones: the one being served and the next
HEADROOM = 0.25  # of the space free before a copy that stays free after it: the store is RAM the engines also need


def stored_version(directory: str | os.PathLike) -> str | None:
    """The version a finished export directory holds (its ``WEIGHT_VERSION_FILE``), None if it is not one."""
    try:
        return (Path(directory) / WEIGHT_VERSION_FILE).read_text().strip() or None
    except OSError:
        return None


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


class NodeStore:
    """The store of one run on one node (the module's layout and guarantees)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.versions = self.root / "weights"
        self.models = self.root / "models"
        self._pins = self.root / "pins"
        self._agents = self.root / "agents"

    @classmethod
    def for_node(cls, run_id: str, node: str) -> NodeStore:
        """The store of ``run_id`` on ``node``: shared memory (``/dev/shm``) where the node has it, else the system's
        temporary directory; ``PEARL_SHM_DIR`` overrides. Keyed by node name as well as run, so the nodes of one
        test machine (several slurmd) keep separate stores."""
        base = os.environ.get("PEARL_SHM_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        return cls(Path(base, "pearl", run_id or "run", node))

    @classmethod
    def of_versions(cls, versions: str | os.PathLike) -> NodeStore:
        """The store whose ``weights/`` directory is ``versions`` (the trainer's ``PEARL_WEIGHT_STORE``)."""
        return cls(Path(versions).parent)

    # -- reading ------------------------------------------------------------------------------------------------

    def version(self, version: str) -> Path | None:
        """The local copy of the policy's ``version``, None when the store has no whole one."""
        path = self.versions / version
        return path if stored_version(path) == version else None

    def model(self, source: str | os.PathLike) -> Path | None:
        """The local copy of the model directory ``source``, None when the store has none."""
        path = self.models / self._model_name(source)
        return path if path.is_dir() else None

    @staticmethod
    def _model_name(source: str | os.PathLike) -> str:
        # its directory's name, for a reader, and a digest of its whole path: two models of one name stay apart
        resolved = os.path.abspath(source)
        return f"{Path(resolved).name or 'model'}-{hashlib.sha1(resolved.encode()).hexdigest()[:10]}"

    # -- copying from shared disk -------------------------------------------------------------------------------

    def fetch_version(self, version: str, source: str | os.PathLike, *, keep: int) -> Path | None:
        """The local copy of the policy's ``version``, copied from its shared-disk export ``source`` if the store
        lacks it (then versions beyond the newest ``keep`` that no one pins are pruned); None when it cannot be
        (no whole export there, no room, a failed copy: logged): the caller reads ``source``."""
        if (have := self.version(version)) is not None:
            return have
        if stored_version(source) != version:
            return None
        path = self._copy(Path(source), self.versions / version, what=f"weights {version}")
        if path is None or stored_version(path) != version:
            return None
        self.prune(keep=keep)
        return path

    def fetch_model(self, source: str | os.PathLike) -> Path | None:
        """The local copy of the model directory ``source``, copied once if the store lacks it; None when it cannot
        be (``source`` is not a local directory — a hub name —, no room, a failed copy: logged)."""
        if (have := self.model(source)) is not None:
            return have
        if not Path(source).is_dir():
            return None
        return self._copy(Path(source), self.models / self._model_name(source), what=f"model {source}")

    def _copy(self, source: Path, final: Path, *, what: str) -> Path | None:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with self._locked(final.parent / f".{final.name}.lock"):
                if final.is_dir():  # another copier finished it while this one waited
                    return final
                need, usage = _size(source), shutil.disk_usage(final.parent)
                if need > (1 - HEADROOM) * usage.free:
                    log.warning(
                        "node store %s: %s (%.1f MiB) does not fit (%.1f MiB free, %.0f%% of it kept free): read "
                        "from shared disk",
                        self.root,
                        what,
                        need / 2**20,
                        usage.free / 2**20,
                        100 * HEADROOM,
                    )
                    return None
                tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                try:
                    shutil.copytree(source, tmp, symlinks=False)
                    try:
                        os.rename(tmp, final)
                    except OSError:
                        # a writer that takes no lock (the trainer's export of the same version on this node) put
                        # a whole one in place meanwhile: that one serves
                        if not final.is_dir():
                            raise
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                return final
        except OSError as exc:
            log.warning("node store %s: cannot copy %s (%s): read from shared disk", self.root, what, exc)
            return None

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- pins and pruning ---------------------------------------------------------------------------------------

    def pin(self, pid: int, path: str | os.PathLike) -> None:
        """Engine process ``pid`` now uses ``path`` (its one pin: a later pin replaces it). A path outside the
        store pins nothing here (it is forgotten)."""
        self.unpin(pid)
        if not Path(path).is_relative_to(self.root):
            return
        write_atomic(self._pins / str(pid), json.dumps({"path": str(path)}), mode=0o644)

    def unpin(self, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self._pins / str(pid)).unlink()

    def pinned(self) -> set[Path]:
        """The paths live processes pin; a pin whose process is gone (or that cannot be read) is dropped."""
        out: set[Path] = set()
        for f in self._pins.iterdir() if self._pins.is_dir() else ():
            if not f.name.isdigit():
                continue
            try:
                path = Path(json.loads(f.read_text())["path"])
            except (OSError, ValueError, KeyError, TypeError):
                path = None
            if path is not None and process_alive(int(f.name)):
                out.add(path)
            else:
                with contextlib.suppress(OSError):
                    f.unlink()
        return out

    def prune(self, *, keep: int) -> list[str]:
        """Remove the policy's versions but the newest ``keep`` (by modification time) and every pinned one; the
        versions removed. ``keep`` ≤ 0 keeps every version."""
        if keep <= 0 or not self.versions.is_dir():
            return []
        versions = sorted(
            (d for d in self.versions.iterdir() if d.is_dir() and not d.name.startswith(".")),
            key=lambda d: d.stat().st_mtime,
        )
        pinned = self.pinned()
        removed = []
        for old in versions[:-keep]:
            if old not in pinned:
                shutil.rmtree(old, ignore_errors=True)
                removed.append(old.name)
        return removed

    # -- the agents that share it -------------------------------------------------------------------------------

    def join(self, pid: int) -> None:
        """Agent ``pid`` of the run runs on this node (the store stays while one does)."""
        with self._locked(self._guard()):
            self._agents.mkdir(parents=True, exist_ok=True)
            (self._agents / str(pid)).touch()

    def leave(self, pid: int) -> bool:
        """Agent ``pid`` leaves (its allocation ends): the store is removed if no live agent of the run is left on
        the node. Whether it was."""
        with self._locked(self._guard()):
            with contextlib.suppress(FileNotFoundError):
                (self._agents / str(pid)).unlink()
            agents = self._agents.iterdir() if self._agents.is_dir() else ()
            live = [a for a in agents if a.name.isdigit() and process_alive(int(a.name))]
            if live:
                return False
            shutil.rmtree(self.root, ignore_errors=True)
            return True

    def _guard(self) -> Path:
        # beside the store, not in it: removing the store keeps the lock its removers hold
        self.root.parent.mkdir(parents=True, exist_ok=True)
        return self.root.parent / f".{self.root.name}.lock"
