"""The planner: pure functions of a snapshot (docs/planner.md). No I/O, no clock, no state access — the
daemon and the simulator (pearlctl.sim) call the same code with the snapshots they build.

- ``model``    the vocabulary: Snapshot (GPUs, rollout work, trainer), Deployment, Target, Move, Plan
- ``profile``  engine performance and transition costs (Profile), loaded from and saved to TOML files
- ``predict``  rollout batch completion time for a deployment, with tool waits and a straggler floor
- ``choose``   the PD mode and ratio and the GPUs to use that minimise predicted time
- ``budget``   which GPUs may serve now: lending limits, return deadlines, allocations about to end
- ``diff``     the smallest set of moves from the current assignment to a target
- ``plan``     a target turned into a priced Plan (completion with and without it, moving time included)
- ``view``     what the planner derives from one snapshot more than once, computed once per snapshot
- ``correct``  the predictor's running correction, learned from how far recent batches were from it
"""
