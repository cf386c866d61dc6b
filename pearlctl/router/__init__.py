"""The run's rollout data plane as pearlctl owns it (docs/router.md has the design): one vllm-router per run
behind a gateway.

- ``gateway``: the run's one OpenAI-compatible endpoint — its credential, continuation of interrupted
  sequences, weight-version tags;
- ``text``: the text of a continued turn, detokenized exactly as the uninterrupted run would have it;
- ``membership``: the gateway's admin API the daemon drives membership with, as typed bodies and a client;
- ``service``: starting, finding again and stopping a run's router process, and its files;
- ``__main__``: ``python -m pearlctl.router``, the process (gateway, with vllm-router as its child);
- ``client``: a thin rollout client of the gateway for agent loops.
"""
