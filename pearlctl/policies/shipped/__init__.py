"""The shipped policies, one module per policy, loaded by name from their files (pearlctl.policies); the core
never imports one to list them.

Modules:

- ``never`` — no borrowing: lent GPUs go back, nothing is lent.
- ``static`` — the fixed-resource baseline: the rollout pool only, colocated prefill + decode.
- ``elastic`` — the elastic baseline: the rollout pool plus every elastic GPU granted now; never borrows.
- ``greedy`` — lends every idle trainer GPU whenever the trainer's wait fits a borrow and its return.
- ``pearl`` — elastic capacity, borrowed trainer GPUs and adaptive prefill–decode, with cost-aware gating.
- ``pivot`` — pearl, and shifts of rollout GPUs to the run's judge (a generative reward model) and back when the
  verdicts' demand makes them pay.
"""
