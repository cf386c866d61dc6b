"""The trainer hook: what a DeepSpeed training loop calls so pearlctl can borrow its GPUs between steps.

The public API of this package, for training loops (ours and third parties'): import from here::

    from pearlctl.trainer import NullChannel, TrainerHook
    from pearlctl.trainer.channel import DaemonChannel      # the run's daemon (needs the control-API client)

    hook = TrainerHook(engine, channel=DaemonChannel(weights_dir=run_dir / "weights"), ckpt_dir=...)

The modules, by concern:

- ``hook`` — ``TrainerHook``: phases, the daemon's release/reclaim commands, signals, checkpoints; its
  docstring is the hook's manual (usage and invariants).
- ``agreement`` — the rank agreement: one all-reduce that makes every rank act on rank 0's decision at
  the same point, and fails loudly when ranks are out of step.
- ``offload`` — freeing and restoring a DeepSpeed engine's GPU memory (``offload_states`` or optimizer
  states to host).
- ``weights`` — ``export_weights``: HuggingFace directories with a version file and ``LATEST``, swapped in
  atomically.
- ``control`` — the ``ControlChannel`` contract, ``NullChannel`` and ``FileChannel``.
- ``channel`` — ``DaemonChannel``, the production channel to the run's daemon and the node's return file.
- ``events`` — ``EventLog``: a trainer's ``train.jsonl``, one JSON event per line.
- ``broadcast`` — the trainer side of the cross-node weight path: a version's tensors broadcast to vLLM workers.
- ``paced`` — the paced trainer (``python -m pearlctl.trainer.paced``): the real hook, with sleeps for compute.

Import-light: importing this package imports neither torch nor deepspeed, nor the control-API client;
torch is imported inside the methods that need it.
"""

from __future__ import annotations

from pearlctl.trainer.control import ControlChannel, FileChannel, NullChannel
from pearlctl.trainer.hook import COMMANDS, PHASES, RELEASE_MODES, TrainerHook
from pearlctl.trainer.weights import LATEST_WEIGHTS_FILE as LATEST_WEIGHTS_FILE  # importable from here, as before
from pearlctl.trainer.weights import WEIGHT_VERSION_FILE as WEIGHT_VERSION_FILE

__all__ = [
    "COMMANDS",
    "PHASES",
    "RELEASE_MODES",
    "ControlChannel",
    "FileChannel",
    "NullChannel",
    "TrainerHook",
]
