"""Policy `never`: never borrow trainer GPUs; every GPU keeps the role of its pool.

The fixed-allocation behaviour, and the default. Policies are loaded by name from this directory;
the core never imports them.
"""

NAME = "never"


def borrow_budget(idle_trainer_gpus: int) -> int:
    """How many idle trainer GPUs to lend to rollout now: none."""
    return 0
