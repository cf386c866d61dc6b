"""The head node's and the run directory's files and processes, below every layer but the vocabulary
(docs/architecture.md, "Layers"): no state, no Slurm, no engines.

Modules:

- ``home`` — where pearlctl keeps files on this machine (the state database on local disk; the sbatch wrappers).
- ``runfiles`` — the files of a run directory pearlctl reads and writes, and the one atomic (fsyncing) write.
- ``logfiles`` — where a run's processes write their logs, and reading them as `pearlctl logs` does.
- ``processes`` — child processes that must not outlive their parent: the one death-signal helper.
- ``weight_store`` — a node's store of the models its vLLM workers load (policy versions, the judge), in node-local
  memory, pruned around what live engines use.
"""
