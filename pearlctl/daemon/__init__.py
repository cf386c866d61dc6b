"""The daemon: the single writer of a run's state while it runs (docs/architecture.md, "Who writes state").
Its lease (one daemon per run, fenced by an epoch that every write and every command carries) is kept by
``pearlctl.state.store``; the modules here:

- ``main``: the process — lease, HTTP server thread, and the observe → decide → act loop;
- ``api``: the authenticated HTTP control API agents, the trainer hook and the CLI talk to;
- ``controller``: the controller — the shared state and the three sides below, one per caller;
- ``shared``: the state the sides share (store, epoch, clock, decision lock, long polls) and their base class;
- ``agents``: the agents' side — registrations, heartbeats and the workers they report, folded into state;
- ``desired``: the workers each allocation should run, derived from state and published to held long polls;
- ``liveness``: when each agent was last heard from, the loss window, and a silent agent's GPUs and workers LOST;
- ``trainer_side``: the trainer's side — the hook's phase and acks, the rollout driver's progress;
- ``operator``: the operator's side — borrow, return, move, profile;
- ``borrowing``: the run's policy, live — whole plans carried out as transitions, lent GPUs returned in time;
- ``policy_view``: what the policy sees — the planner's snapshot of the run built from state, with its inputs;
- ``elastic``: growing and shrinking the elastic pool to the number of tasks the policy wants (its driver; shrink);
- ``elastic_grow``: the elastic pool's growth — intent-first sbatch, adoption after a crash, pending bound, back-off;
- ``elastic_state``: the elastic pool as state holds it — its snapshot, its size history, ``elastic_view`` for status;
- ``transitions``: the executor of checkpointed role transitions (plans of steps, rollbacks);
- ``effects``: what each transition step does and how it is proven (``STEPS``);
- ``routing``: the run's router (gateway + vllm-router), started or adopted, its membership kept;
- ``weights``: which workers the trainer broadcasts a new weight version to;
- ``decision_lock``: the lock every decision and fold takes, timed (a long hold is logged with where it was taken);
- ``longpoll``: held requests (long polls) waiting in the API's event loop, not in a thread each;
- ``slowlog``: slow ticks and lock holds, logged one line at most every 10 s (the longest, and how many);
- ``metrics``: Prometheus metrics of a run, read from state at scrape time;
- ``client``: how the CLI reaches a run's daemon (one request, through the shared control-API client);
- ``supervise``: ``python -m pearlctl.daemon.supervise``, which keeps a run's daemon up.
"""
