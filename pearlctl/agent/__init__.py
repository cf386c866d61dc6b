"""What runs inside an allocation: one agent per array task (node).

The agent is the only part of pearlctl that starts engine processes (docs/architecture.md). Its modules:

- ``__main__``: ``python -m pearlctl.agent``, the per-node agent process started by jobs/worker.sh;
- ``client``: its side of the control API — register, heartbeat, and finding the daemon again;
- ``identity``: the node, GPUs and Slurm task it runs as, read from the environment (pure);
- ``workers``: worker handles (one engine process group each: a vLLM server or a command);
- ``reconciler``: reconciliation of the running workers to the daemon's desired state, and the return of lent GPUs
  without the daemon;
- ``engines``: the engine adapters (vLLM, the paced engine).
"""
