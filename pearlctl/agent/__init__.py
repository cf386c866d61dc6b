"""What runs inside an allocation: one agent per array task (node).

The agent is the only part of pearlctl that starts engine processes. Today it identifies its node
and GPUs from Slurm's environment, holds the allocation, and turns the preemption notice into a drain
(logged with timestamps). Engine adapters, heartbeats to the daemon and desired-state reconciliation
plug in here (docs/architecture.md, "How the daemon plugs in").
"""
