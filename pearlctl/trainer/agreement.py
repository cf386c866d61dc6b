"""The trainer hook's rank agreement: every torch.distributed rank acts on the same decision at the same point.

Only rank 0 talks to the control channel; what it decided (nothing, release by offload, release by
checkpoint, reclaim) travels to every rank in one all-reduce MAX over a 5-element float tensor
``[decision, stop, ready, site, -site]``, where ``stop`` is any rank's signal flag, ``ready`` rank 0's
readiness (``wait_until``) and ``site`` the hook method each rank is in. ``RankAgreement`` is the mixin of
:class:`pearlctl.trainer.hook.TrainerHook` that does it.

Guarantees:

- **Same decision, same point.** Non-zero ranks contribute 0 for the decision and readiness, so the MAX
  is rank 0's value; the stop flag is the MAX over all ranks, so one rank's signal stops every rank.
- **Out of step fails loudly.** Ranks calling hook methods in different orders see max(site) != min(site)
  (``-max(-site)``) and raise ``RuntimeError`` on every rank, instead of agreeing on garbage.
- **Timings and barriers are collectives too**: the slowest rank's release/reclaim time
  (``_max_over_ranks``) and the barrier that ends an export or precedes a stop go through the same call.
- A world of one needs no all-reduce; ``all_reduce_max`` (the hook's argument) replaces torch.distributed
  in unit tests.

Import-light: importing this module imports neither torch nor deepspeed; torch is imported inside
``_reduce_max``, and torch.distributed is only looked up in ``sys.modules``, never imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# The decision carried by the all-reduce (slot 0).
_NONE, _RELEASE_OFFLOAD, _RELEASE_CHECKPOINT, _RECLAIM = 0, 1, 2, 3
_CODE_OF = {("release", "offload"): _RELEASE_OFFLOAD, ("release", "checkpoint"): _RELEASE_CHECKPOINT}
# Call sites, so a rank calling hook methods out of order is detected (slots 3 and 4: site and -site).
_SITE_PHASE, _SITE_RECLAIM_WAIT, _SITE_WAIT_UNTIL, _SITE_STOP, _SITE_TIMING, _SITE_BARRIER = 1, 2, 3, 4, 5, 6
_SITE_NAMES = {
    _SITE_PHASE: "phase()",
    _SITE_RECLAIM_WAIT: "ensure_reclaimed()",
    _SITE_WAIT_UNTIL: "wait_until()",
    _SITE_STOP: "should_stop()",
    _SITE_TIMING: "release()/reclaim()",
    _SITE_BARRIER: "export_weights()/checkpoint_and_exit()",
}


class RankAgreement:
    """The hook's collectives (mixin of ``TrainerHook``, which sets the attributes below)."""

    rank: int
    world_size: int
    _signal: int | None  # set by the signal handler only
    _stop_agreed: bool
    _all_reduce_max: Callable[[list[float]], list[float]] | None

    def _agree(self, site: int, code: int, *, ready: int = 0) -> tuple[int, bool]:
        """One all-reduce MAX: rank 0's decision, anyone's stop flag, rank 0's readiness."""
        stop = 1 if self._signal is not None else 0
        out = self._collective(site, code if self.rank == 0 else 0, stop, ready if self.rank == 0 else 0)
        if out[1] > 0:
            self._stop_agreed = True
        return int(out[0]), out[2] > 0

    def _max_over_ranks(self, value: float) -> float:
        return self._collective(_SITE_TIMING, value, 0, 0)[0]

    def _barrier(self) -> None:
        self._collective(_SITE_BARRIER, 0, 0, 0)

    def _collective(self, site: int, a: float, b: float, c: float) -> list[float]:
        """All-reduce MAX of ``[a, b, c, site, -site]`` (always 5 values). If the ranks are at different call
        sites, max(site) != -max(-site) = min(site): fail loudly rather than agree on garbage."""
        out = self._reduce_max([float(a), float(b), float(c), float(site), float(-site)])
        if out[3] != -out[4]:
            sites = sorted({_SITE_NAMES.get(int(out[3]), "?"), _SITE_NAMES.get(int(-out[4]), "?")})
            raise RuntimeError(
                f"trainer hook ranks out of step: rank {self.rank} is in {_SITE_NAMES[site]}, the ranks are in "
                f"{' and '.join(sites)}; call the hook's methods on every rank in the same order"
            )
        return out

    def _reduce_max(self, values: list[float]) -> list[float]:
        if self._all_reduce_max is not None:
            return list(self._all_reduce_max(values))
        if self.world_size <= 1:
            return values
        import torch
        import torch.distributed as dist

        device = "cpu"
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


def _dist_rank_world() -> tuple[int, int]:
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
