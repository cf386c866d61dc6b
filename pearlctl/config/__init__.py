"""The run spec: a TOML file that describes one RL run (docs/run-spec.md), and its validation.

A spec is validated completely before anything is submitted or written to state: every problem is collected
(not just the first) and reported with its key path (``pools.rollout.gpus_per_node``) and what would be valid;
the CLI exits 2 on it. Relative paths in a spec (``model``, ``run_dir``) are resolved against the directory of
the spec file, the way compose files do, so a spec means the same thing from whatever directory it is launched.

Modules:

- ``load`` — ``load_spec`` and ``parse_spec``: a spec file or decoded document validated into a RunSpec.
- ``tables`` — the spec's TOML tables as strict pydantic models: what each key takes, and the rules between keys.
- ``spec`` — RunSpec, PoolSpec, RouterSpec: a valid spec as the rest of pearlctl reads and records it.
- ``values`` — the forms and bounds of Slurm values (times, memory, node lists), shared with command-line options.
- ``errors`` — pydantic's validation errors in the house's words: ``key.path: problem``, saying what is valid.
- ``problems`` — SpecProblem and SpecError: what is wrong with a spec, and where.
"""

from pearlctl.config.load import load_spec, parse_spec
from pearlctl.config.problems import SpecError, SpecProblem
from pearlctl.config.spec import PoolSpec, RouterSpec, RunSpec
from pearlctl.config.values import (
    DEFAULT_PENDING_TIMEOUT_S,
    ROUTER_POLICIES,
    has_control,
    slurm_option_problems,
    time_limit_seconds,
)

__all__ = [
    "DEFAULT_PENDING_TIMEOUT_S",
    "ROUTER_POLICIES",
    "PoolSpec",
    "RouterSpec",
    "RunSpec",
    "SpecError",
    "SpecProblem",
    "has_control",
    "load_spec",
    "parse_spec",
    "slurm_option_problems",
    "time_limit_seconds",
]
