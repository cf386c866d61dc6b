"""Policy `never`: never borrow trainer GPUs; every GPU keeps the role of its pool.

The fixed-allocation behaviour, and the default. Policies are loaded by name from this directory
(pearlctl.daemon.borrowing.load_policy); the core never imports them. A policy is pure: it sees a
plain dict and returns a number.
"""

NAME = "never"


def borrow_gpus(view: dict) -> int:
    """How many idle trainer GPUs to lend to rollout now: none."""
    return 0
