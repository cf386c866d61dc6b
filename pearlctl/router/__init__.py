"""The run's rollout data plane as pearlctl owns it: one vllm-router per run behind a gateway that adds the
run's credential, continuation of interrupted sequences and weight-version tags (``gateway``), the process
and its files (``service``, ``python -m pearlctl.router``), the admin API the daemon drives membership with
(``membership``), and a thin rollout client of the gateway (``client``). docs/router.md has the design."""
