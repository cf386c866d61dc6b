"""The trace-driven simulator (docs/simulator.md): a scenario's cluster, elastic trace, engines and RL loop in
simulated time, driving the daemon's own planner and policies. ``scenario`` (the file), ``availability`` (the
elastic trace), ``engine`` (the truth model), ``run`` (the loop), ``oracle`` (the upper bound), ``report``
and ``timeline`` (the output)."""
