"""The control API shared by the daemon (server) and everybody who talks to it (clients).

- ``bodies``: every request body as a typed, bounded pydantic model;
- ``client``: ``ControlClient``, the one client (CLI, agents, trainer hook, rollout clients).

Trainer command ids that no transition step issued (the daemon journals their acks instead of attaching
them to a step) are named here, where the trainer's channel and the daemon both find them.
"""

LOCAL_RETURN_PREFIX = "local-return:"  # the agent returned lent GPUs itself; the hook reclaimed on the node
ORPHAN_RECLAIM_PREFIX = "orphan-reclaim:"  # the trainer is released with nothing lent and nothing moving
