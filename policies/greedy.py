"""Policy `greedy`: lend every idle trainer GPU (up to the cap) whenever the trainer waits for
rollouts long enough for a borrow and its return to fit in the wait.

``view`` (built by the daemon): ``phase`` ("training" | "waiting"), ``wait_left_s`` (seconds of the
trainer's reported wait still ahead), ``idle_gpus`` (trainer GPUs not lent), ``max_gpus`` (cap from
`pearlctl borrow --gpus`, or None), ``borrow_cost_s`` and ``return_cost_s`` (running estimates from
past transitions). It weighs nothing else: the cost-aware `pearl` policy comes with the planner.
"""

NAME = "greedy"
MARGIN_S = 2.0  # slack for a slow poll or a slow agent


def borrow_gpus(view: dict) -> int:
    if view["phase"] != "waiting" or view["idle_gpus"] <= 0:
        return 0
    if view["wait_left_s"] <= view["borrow_cost_s"] + view["return_cost_s"] + MARGIN_S:
        return 0  # the GPUs could not do any rollout work before they must go back
    cap = view["max_gpus"] if view["max_gpus"] is not None else view["idle_gpus"]
    return max(0, min(cap, view["idle_gpus"]))
