"""The trace-driven simulator: see pearlctl/sim/README or docs/simulator.md."""
