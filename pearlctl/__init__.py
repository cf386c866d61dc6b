"""pearlctl: a Slurm control plane for agentic RL post-training.

The package is layered (docs/architecture.md, checked by import-linter in CI): ``cli`` renders, ``daemon``
decides, ``state`` alone touches SQLite, ``slurm`` alone runs Slurm commands, ``agent`` alone starts
engines, ``planner`` and ``sim`` are pure.

Packages:

- ``cli``: the command line;
- ``daemon``: the run's daemon (decides, the single writer of its state);
- ``api``: the control API's bodies and its one client;
- ``state``: the durable state (SQLite);
- ``slurm``: everything said to Slurm;
- ``backends``: where allocations come from (Slurm, or local process groups);
- ``agent``: what runs on a compute node and starts engines;
- ``router``: the run's rollout data plane (gateway + vllm-router);
- ``trainer``: the trainer hook a training loop calls;
- ``planner``: pure planning (prediction, PD choice, moves);
- ``policies``: finding and loading a policy by name, and the shipped policies;
- ``sim``: the trace-driven simulator;
- ``ops``: the operations the CLI and the daemon call (launch, watch, doctor, profile, sweep, timeline);
- ``host``: the head node's and the run directory's files and processes.

Modules:

- ``__main__``: ``python -m pearlctl``;
- ``vocabulary``: roles, pool kinds, step kinds and engines, defined once;
- ``config``: the run spec and its validation.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pearlctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
