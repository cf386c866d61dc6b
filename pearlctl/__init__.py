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
- ``sim``: the trace-driven simulator.

Modules:

- ``__main__``: ``python -m pearlctl``;
- ``vocabulary``: roles, pool kinds, step kinds and engines, defined once;
- ``config``: the run spec and its validation;
- ``home``: where pearlctl keeps files on the head node, and the shipped policies;
- ``policies``: loading a policy by name (the daemon and the simulator alike);
- ``launcher``: launch and cancel a run (validate, record intent, submit);
- ``watcher``: the allocation watcher (one batched poll of the scheduler, folded into state);
- ``doctor``: the checks of ``pearlctl doctor``;
- ``profiling``: a running vLLM worker measured into a planner profile;
- ``sweep``: ``pearlctl simulate --sweep`` as a submitit job array;
- ``runfiles``: the files of a run directory pearlctl reads and writes;
- ``logfiles``: where a run's processes write their logs;
- ``processes``: child processes that die with their parent (the one death-signal setup);
- ``timeline``: a real run's GPU roles over time, from its journal.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pearlctl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
