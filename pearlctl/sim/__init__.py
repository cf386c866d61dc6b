"""The trace-driven simulator (docs/simulator.md): a scenario's cluster, elastic trace, engines and RL loop in
simulated time, driving the daemon's own planner and policies.

- ``scenario``: a scenario, loaded from its file into the values the simulator runs;
- ``scenario_schema``: the scenario file's tables as strict pydantic models, and every problem in words;
- ``availability``: the elastic-capacity trace (grants, preemption notices, preemptions);
- ``trajectories``: a run's trajectories: their phases, and the work drawn for each (under a mismatch, its truth);
- ``engine``: the truth model of the rollout engines, tick by tick;
- ``routing``: the engines' router: which worker a waiting request goes to, and when its queue admits it;
- ``batching``: continuous batching on the engine workers: how far a tick takes each prefill and decode;
- ``migration``: the engines' migrations: the sequences of a worker that leaves, the queues a join rebalances;
- ``judging``: the truth model of the judge (a generative reward model): one verdict per finished trajectory;
- ``run``: the RL loop in simulated time, driving a policy as the daemon does;
- ``snapshot``: what the policy sees of a simulation, as the daemon's snapshot shows it;
- ``correction``: the predictor's running correction, kept and applied as the daemon does;
- ``moves``: the policy's plans carried out on the simulated GPUs, each move at its true cost;
- ``gpus``: the simulated GPUs, their roles passed on to the engines, the GPU-second census, the schedule;
- ``oracle``: the upper bound on the compared policies;
- ``baselines``: the fixed deployments of a run with a judge: ``colocated`` (time-shared), ``disaggregated`` (split);
- ``compare``: policies side by side, or any one by name (the oracle and the baselines too), each in a process under
  a memory limit;
- ``scale``: a scenario at another size and speed, the twin of a live run on paced engines;
- ``report``: what a simulation reports (throughput, GPU-seconds by role, costs);
- ``timeline``: a picture of GPU roles over simulated time.
"""
