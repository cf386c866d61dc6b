"""The run's rollout data plane as pearlctl owns it (docs/router.md has the design): one vllm-router per run
behind a gateway.

- ``gateway``: the run's one OpenAI-compatible endpoint — its state, and each turn's attempts upstream until
  one complete answer (retries, continuation of interrupted sequences);
- ``turn``: one turn's parts folded into the caller's one answer, and what a continuation asks for;
- ``text``: the text of a continued turn, detokenized exactly as the uninterrupted run would have it;
- ``routing``: which vllm-router an attempt goes to, prefill-decode (PD routers started and retired), and
  keeping the routers' worker lists what the members say;
- ``members``: the gateway's members, their roles and weight versions, and which weights served a part;
- ``admin``: the membership changes the admin API makes (add once healthy, remove, sync);
- ``app``: the gateway's HTTP edge — routes, the credential, sessions, request parsing, answers;
- ``errors``: how a request fails as its caller sees it (refused, given up, bad request);
- ``control``: the gateway's control plane, apart from its data plane — its thread, its socket's routes;
- ``control_loop``: where a membership call runs and the client it uses, as the gateway's parts hand it over;
- ``membership``: the gateway's admin API the daemon drives membership with, as typed bodies and a client;
- ``service``: starting, finding again and stopping a run's router process, and its files;
- ``__main__``: ``python -m pearlctl.router``, the process (gateway, with vllm-router as its child);
- ``client``: a thin rollout client of the gateway for agent loops;
- ``judge``: scoring finished trajectories with the run's judge through the gateway (verdict or critique).
"""
