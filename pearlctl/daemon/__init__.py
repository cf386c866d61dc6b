"""The daemon: the single writer of a run's state while it runs (docs/architecture.md, "Who writes state").

- ``lease``: one daemon per run, fenced by an epoch that every write and every command carries;
- ``controller``: what the daemon knows and decides — agent registrations, heartbeats, reported
  workers, desired workers per allocation, agent loss;
- ``decision_lock``: the lock every decision and fold takes, timed (a long hold is logged with where it was taken);
- ``slowlog``: slow ticks and lock holds, logged one line at most every 10 s (the longest, and how many);
- ``api``: the authenticated HTTP control API agents, the trainer hook and the CLI talk to;
- ``main``: the process — lease, HTTP server thread, and the observe → decide → act loop.
"""
