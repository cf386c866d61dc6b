"""What a simulation reports: per policy, RL steps per hour and samples per second, GPU-seconds by role,
transitions made and the trainer delay caused by late returns; ratios between policies.

The JSON shape is a contract (``pearlctl simulate --json``; tests and the benchmark read it)::

    {"scenario": str, "steps": int, "seed": int, "mismatch": str,
     "policies": {NAME: {"samples_per_s": float, "steps_per_hour": float, "trainer_delay_s": float,
                         "transitions": int, "gpu_seconds_by_role": {ROLE: float}, ...more keys,
                         "judge": {"verdicts": float, "resent": float, "prefill_tokens": float} (a judge ran)}},
     "ratios": {"pearl/static": float, ...}}

Ratios compare samples per second: every pair with ``pivot`` (``pivot/X``) when pivot ran (a run with a judge),
else with ``pearl`` when pearl ran, else with the first policy; ``X/oracle`` for every policy when the oracle ran.
"""

from __future__ import annotations

from pearlctl.sim.run import RunResult
from pearlctl.sim.scenario import Scenario


def policy_doc(r: RunResult) -> dict:
    return {
        "samples_per_s": round(r.samples_per_s, 4),
        "steps_per_hour": round(r.steps_per_hour, 4),
        "trainer_delay_s": round(r.trainer_delay_s, 1),
        "transitions": r.transitions,
        "gpu_seconds_by_role": r.gpu_seconds_by_role,
        "finished": r.finished,
        "steps": r.steps,
        "samples": r.samples,
        "sim_time_s": round(r.sim_time_s, 1),
        "forced_returns": r.forced_returns,
        "refused_moves": r.refusals,
        "plans": r.plans,
        "preemptions": r.preemptions,
        "batch_rollout_s": [round(x, 1) for x in r.batch_rollout_s],
        "engine": {k: round(v, 1) for k, v in r.engine.items()},
        # the predictor's running correction as the run left it: batches checked, overall measured/predicted
        "predictor": {
            "checks": r.predictor_checks,
            "ratio": None if r.predictor_ratio is None else round(r.predictor_ratio, 4),
        },
        **({"oracle_choice": r.oracle_choice} if r.oracle_choice else {}),  # the oracle's winning candidate
        **({"chosen": r.chosen} if r.chosen else {}),  # disaggregated's split
        # a run with a judge: verdicts given, sent again (a judge left), tokens the judges read
        **({"judge": {k: round(v, 1) for k, v in r.judge.items()}} if r.judge else {}),
    }


def ratios(results: dict[str, RunResult]) -> dict[str, float]:
    names = list(results)
    if not names:
        return {}
    head = next((p for p in ("pivot", "pearl") if p in results), names[0])
    out: dict[str, float] = {}

    def ratio(a: str, b: str) -> None:
        sb = results[b].samples_per_s
        if a != b and f"{a}/{b}" not in out:
            out[f"{a}/{b}"] = round(results[a].samples_per_s / sb, 4) if sb > 0 else float("inf")

    for other in names:
        ratio(head, other)
    if "oracle" in results:
        for name in names:
            ratio(name, "oracle")
    return out


def to_json(scenario: Scenario, results: dict[str, RunResult]) -> dict:
    return {
        "scenario": scenario.name,
        "steps": scenario.steps,
        "seed": scenario.seed,
        "mismatch": scenario.mismatch.label(),
        "batch_size": scenario.workload.batch_size,
        "training": scenario.training.mode,
        "policies": {name: policy_doc(r) for name, r in results.items()},
        "ratios": ratios(results),
    }
