"""The operations the CLI and the daemon both call: launching and cancelling a run, watching its allocations,
checking the host, measuring a worker, sweeping simulations, and rebuilding a run's timeline. One layer
(docs/architecture.md, "Layers"): below the daemon, above the backends and everything they use.

Modules:

- ``launcher`` — launch and cancel a run: validate against the cluster, record intent, submit, record Slurm ids.
- ``watcher`` — the allocation watcher: one batched poll of the scheduler, folded into state.
- ``doctor`` — `pearlctl doctor`'s checks, each a value the CLI renders.
- ``profiling`` — measure a running vLLM worker into a planner Profile; transition costs from the journal.
- ``sweep`` — `pearlctl simulate --sweep`: scenario × seed × policy as a submitit job array, merged.
- ``timeline`` — a real run's GPU roles over time, rebuilt from its journal (pure).
"""
