"""The Global Resource Planner's entry point: `plan(inputs)` validates the inputs, searches, and adds what the
search leaves to `planner.advice` (warnings on the chosen plan, the configured split as a baseline, options
that change a dominating phase, and for an infeasible job what to change).
"""

from __future__ import annotations

import time

from planner import advice
from planner.plan import Plan
from planner.search import evaluate, pinned_candidate, search_validated
from planner.workload import PlannerInputs


def plan(inputs: PlannerInputs) -> Plan:
    """Plan a job: the best feasible split and layouts with alternatives, pruned candidates and advice.
    `search_s` is the time of the search proper (advice re-runs the search and is not counted)."""
    inputs.validate()
    started = time.perf_counter()
    result = search_validated(inputs)
    result.search_s = time.perf_counter() - started
    if result.strategy == "configured":
        if result.chosen is not None:
            result.warnings += advice.plan_warnings(inputs, result.chosen)
        if not result.feasible:
            result.suggestions += advice.configured_advice(inputs)
    else:
        pinned = pinned_candidate(inputs)
        if pinned is not None and pinned.train_gpus > 0 and pinned.rollout_gpus > 0:
            result.baseline = evaluate(inputs, pinned)
        if not result.splits:
            result.suggestions = advice.no_split_advice(inputs)
        elif not result.feasible:
            result.suggestions = advice.infeasible_advice(inputs, result)
        elif result.chosen is not None:
            result.warnings = advice.plan_warnings(inputs, result.chosen)
    result.phase_advice = advice.phase_advice(inputs, result)
    return result
