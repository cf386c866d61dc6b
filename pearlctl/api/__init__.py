"""The control API shared by the daemon (server) and everybody who talks to it (clients).

- ``bodies``: every request body as a typed, bounded pydantic model;
- ``client``: ``ControlClient``, the one client (CLI, agents, trainer hook, rollout clients).
"""
