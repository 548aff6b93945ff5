"""Online re-planning: calibrate the cost model with what the running job measures, search again, and
recommend a new split only when it pays.

Calibration scales the rollout and training speed factors so the current candidate's predicted rollout
tokens/s and training-side seconds equal the observed ones, and replaces the expected response length by
the observed mean projected half a horizon ahead along its trend. A change is recommended only if the
predicted throughput gain is at least `min_gain` (hysteresis: a change back needs the same margin the
other way, so estimates that wobble inside the band never flap) and the step time saved over the horizon
exceeds the switch cost (rollout instances restart, training pool re-forms).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.plan import Candidate, Evaluation
from planner.search import evaluate, search_validated
from planner.workload import PlannerInputs

CALIBRATION_ROUNDS = 4


@dataclass(frozen=True)
class Observation:
    """Metrics of the running job over the last re-planning window."""

    rollout_tokens_per_s: float  # generated tokens per second over the whole rollout pool
    train_step_s: float  # log-prob recomputation + training seconds per step
    mean_response_tokens: float  # mean response length over the window
    response_tokens_per_step: float = 0.0  # trend: change of the mean response length per step


@dataclass(frozen=True)
class ReplanPolicy:
    """`replan_min_gain`, the horizon over which a switch must pay off, and what may change."""

    min_gain: float = 0.05
    horizon_steps: int = 50
    allow_train_layout_change: bool = True
    allow_train_resize: bool = True


@dataclass(frozen=True)
class ReplanDecision:
    """Recommendation for the runtime. `target` equals `current` when `change` is False."""

    change: bool
    reason: str
    current: Evaluation
    target: Evaluation
    predicted_gain: float
    switch_cost_s: float
    time_saved_s: float
    calibrated: PlannerInputs


def calibrate(inputs: PlannerInputs, current: Candidate, obs: Observation, horizon_steps: int) -> PlannerInputs:
    """Inputs whose cost model reproduces the observed rates for `current`."""
    w = inputs.workload
    projected = obs.mean_response_tokens + obs.response_tokens_per_step * horizon_steps / 2.0
    response = int(round(min(float(w.max_new_tokens), max(1.0, projected))))
    calibrated = replace(inputs, workload=replace(w, expected_response_tokens=response))
    for _ in range(CALIBRATION_ROUNDS):
        ev = evaluate(calibrated, current, check_thresholds=False)
        cost = calibrated.cost
        rollout_factor = cost.rollout_speed_factor
        train_factor = cost.train_speed_factor
        if obs.rollout_tokens_per_s > 0 and ev.rollout["tokens_per_s"] > 0:
            rollout_factor *= obs.rollout_tokens_per_s / ev.rollout["tokens_per_s"]
        if obs.train_step_s > 0 and ev.train_side_s > 0:
            train_factor *= ev.train_side_s / obs.train_step_s
        calibrated = replace(calibrated, cost=replace(cost, rollout_speed_factor=rollout_factor,
                                                      train_speed_factor=train_factor))
    return calibrated


def switch_cost_s(inputs: PlannerInputs, current: Candidate, target: Candidate) -> float:
    """Seconds of progress lost switching; the rollout and training changes proceed in parallel."""
    rollout_changes = (current.rollout_gpus, current.rollout_tp) != (target.rollout_gpus, target.rollout_tp)
    train_changes = (current.train_gpus, current.layout) != (target.train_gpus, target.layout)
    cost = 0.0
    if rollout_changes:
        cost = max(cost, inputs.cost.rollout_restart_s)
    if train_changes:
        cost = max(cost, inputs.cost.train_restart_s)
    return cost


def _restricted(inputs: PlannerInputs, current: Candidate, policy: ReplanPolicy) -> PlannerInputs:
    s = replace(inputs.space, strategy="grp", pinned=None)
    lay = current.layout
    if not policy.allow_train_layout_change:
        s = replace(s, allowed_tp=(lay.tp,), allowed_pp=(lay.pp,), allowed_cp=(lay.cp,), allowed_ep=(lay.ep,))
    if not policy.allow_train_resize:
        s = replace(s, allocation_granularity_gpus=current.train_gpus, min_train_gpus=current.train_gpus,
                    min_rollout_gpus=inputs.cluster.total_gpus - current.train_gpus)
    return replace(inputs, space=s)


def replan(inputs: PlannerInputs, current: Candidate, obs: Observation, policy: ReplanPolicy) -> ReplanDecision:
    """Recommend keeping `current` or moving to a better split, from observed metrics."""
    calibrated = calibrate(inputs, current, obs, policy.horizon_steps)
    now = evaluate(calibrated, current, check_thresholds=False)

    def keep(reason: str, gain: float = 0.0, cost: float = 0.0, saved: float = 0.0) -> ReplanDecision:
        return ReplanDecision(False, reason, now, now, gain, cost, saved, calibrated)

    plan = search_validated(_restricted(calibrated, current, policy))
    if not plan.feasible or plan.chosen is None:
        return keep("no feasible alternative under the calibrated model")
    best = plan.chosen
    if best.candidate == current:
        return keep("the current split is still the best")
    gain = best.samples_per_s / now.samples_per_s - 1.0
    cost = switch_cost_s(calibrated, current, best.candidate)
    saved = policy.horizon_steps * (now.step_s - best.step_s)
    if gain < policy.min_gain:
        return keep(f"predicted gain {gain:+.1%} is inside the hysteresis band (replan_min_gain "
                    f"{policy.min_gain:.1%})", gain, cost, saved)
    if saved <= cost:
        return keep(f"saves {saved:.0f} s over {policy.horizon_steps} steps, less than the {cost:.0f} s switch",
                    gain, cost, saved)
    return ReplanDecision(True, f"{gain:+.1%} samples/s; saves {saved:.0f} s over {policy.horizon_steps} steps "
                                f"for a {cost:.0f} s switch", now, best, gain, cost, saved, calibrated)
