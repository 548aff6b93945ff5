"""Online re-planning: calibrate the cost model with what the running job measures, search again, and
recommend a new split only when it pays.

Calibration scales the rollout and training speed factors so the current candidate's predicted rollout
tokens/s and training-side seconds equal the observed ones, moves the weight-reload constant so one publish
takes as long as measured, and replaces the expected response length by the observed mean projected along
its trend (half the horizon ahead, or `projection_steps`). A change is recommended only if the
predicted throughput gain is at least `min_gain` (hysteresis: a change back needs the same margin the
other way, so estimates that wobble inside the band never flap) and the step time saved over the horizon
exceeds the switch cost (rollout instances restart, training pool re-forms).

The pools' idle shares are a check on the calibrated model: a move that gives GPUs to the pool that idled
clearly more than the other over the window contradicts what was measured (that pool was not what held the
step back) and is declined, whatever the model predicts.
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
    queue_depth: float = 0.0  # mean finished samples waiting for a training step at the step boundaries
    rollout_idle_share: float | None = None  # share of the window no generation was in flight (None: unknown)
    train_idle_share: float | None = None  # share of the window the training pool was not stepping
    weight_sync_s: float | None = None  # seconds of one weight publish to the rollout pool (None: not measured)
    step_wall_s: float | None = None  # wall seconds per step over the window (None: not measured)

IDLE_EVIDENCE_MARGIN = 0.1  # idle shares closer than this say nothing about which pool held the step back


@dataclass(frozen=True)
class ReplanPolicy:
    """`replan_min_gain`, the horizon over which a switch must pay off, and what may change."""

    min_gain: float = 0.05
    horizon_steps: int = 50
    allow_train_layout_change: bool = True
    allow_train_resize: bool = True
    allow_rollout_tp_change: bool = True
    projection_steps: int = 0  # steps ahead the response-length trend is projected (0: half the horizon)

    @classmethod
    def of_running_job(cls, step: int, total_steps: int, interval_steps: int, min_gain: float,
                       allow_train_resize: bool) -> ReplanPolicy:
        """The policy of a job's online re-planning after `step` of `total_steps` (the runtime's re-planner,
        and the simulator's replay of it): a switch must pay back within the steps left; the response-length
        trend is projected one interval ahead (from the middle of this window to the middle of the next); the
        training layout and the rollout TP are kept: only the current layout's step time and the current TP's
        generation rate are measured, so another's would be the model's guess alone (the calibration scales
        one speed factor per pool, which a TP change does not carry over: a job moved to another TP saw the
        old TP predicted faster again one interval later and moved back)."""
        return cls(min_gain=min_gain, horizon_steps=max(1, total_steps - step), allow_train_layout_change=False,
                   allow_train_resize=allow_train_resize, allow_rollout_tp_change=False,
                   projection_steps=interval_steps)


@dataclass(frozen=True)
class ReplanDecision:
    """Recommendation for the runtime. `target` equals `current` when `change` is False; `best` is the best
    alternative the search found, taken or not (None when the search found none)."""

    change: bool
    reason: str
    current: Evaluation
    target: Evaluation
    predicted_gain: float
    switch_cost_s: float
    time_saved_s: float
    calibrated: PlannerInputs
    best: Evaluation | None = None
    undo: bool = False  # the change undoes the last one, which did not deliver (`planner.replan_review`)


def calibrate(inputs: PlannerInputs, current: Candidate, obs: Observation, horizon_steps: int,
              projection_steps: int = 0) -> PlannerInputs:
    """Inputs whose cost model reproduces the observed rates (and weight sync time, when measured) for
    `current`; the response length is the observed mean projected `projection_steps` along its trend (half
    the horizon when 0)."""
    ahead = projection_steps if projection_steps > 0 else horizon_steps / 2.0
    calibrated = with_response_tokens(inputs, obs.mean_response_tokens + obs.response_tokens_per_step * ahead)
    if obs.weight_sync_s is not None:
        calibrated = _calibrate_weight_sync(calibrated, current, obs.weight_sync_s)
    for _ in range(CALIBRATION_ROUNDS):
        ev = evaluate(calibrated, current, check_thresholds=False)
        cost = calibrated.cost
        rollout_factor = cost.rollout_speed_factor
        train_factor = cost.train_speed_factor
        if obs.rollout_tokens_per_s > 0 and ev.rollout["generation_tokens_per_s"] > 0:
            rollout_factor *= obs.rollout_tokens_per_s / ev.rollout["generation_tokens_per_s"]
        if obs.train_step_s > 0 and ev.train_side_s > 0:
            train_factor *= ev.train_side_s / obs.train_step_s
        calibrated = replace(calibrated, cost=replace(cost, rollout_speed_factor=rollout_factor,
                                                      train_speed_factor=train_factor))
    return calibrated


def with_response_tokens(inputs: PlannerInputs, tokens: float) -> PlannerInputs:
    """`inputs` expecting responses of `tokens` tokens (rounded, at least 1, at most `max_new_tokens`)."""
    w = inputs.workload
    response = int(round(min(float(w.max_new_tokens), max(1.0, tokens))))
    return replace(inputs, workload=replace(w, expected_response_tokens=response))


def _calibrate_weight_sync(inputs: PlannerInputs, current: Candidate, measured_s: float) -> PlannerInputs:
    """The reload constant of the configured reload method moved so one publish takes `measured_s`."""
    predicted = evaluate(inputs, current, check_thresholds=False).rollout["weight_sync_s"] * inputs.workload.sync_interval
    cost = inputs.cost
    if inputs.rollout.reload_method == "inplace":
        cost = replace(cost, weight_reload_inplace_s=max(0.0, cost.weight_reload_inplace_s + measured_s - predicted))
    else:
        cost = replace(cost, weight_reload_restart_s=max(0.0, cost.weight_reload_restart_s + measured_s - predicted))
    return replace(inputs, cost=cost)


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


def idle_contradiction(obs: Observation, current: Candidate, target: Candidate) -> str:
    """Why the measured idle shares speak against moving from `current` to `target` ("" when they do not)."""
    if obs.rollout_idle_share is None or obs.train_idle_share is None:
        return ""
    shares = {"rollout": obs.rollout_idle_share, "training": obs.train_idle_share}
    grows = "rollout" if target.rollout_gpus > current.rollout_gpus else \
        "training" if target.train_gpus > current.train_gpus else ""
    if not grows:
        return ""
    other = "training" if grows == "rollout" else "rollout"
    if shares[grows] - shares[other] <= IDLE_EVIDENCE_MARGIN:
        return ""
    return (f"the {grows} pool idled {shares[grows]:.0%} of the window and the {other} pool {shares[other]:.0%}: "
            f"growing the {grows} pool contradicts the measurement")


def _restricted(inputs: PlannerInputs, current: Candidate, policy: ReplanPolicy) -> PlannerInputs:
    s = replace(inputs.space, strategy="grp", pinned=None)
    lay = current.layout
    if not policy.allow_train_layout_change:
        s = replace(s, allowed_tp=(lay.tp,), allowed_pp=(lay.pp,), allowed_cp=(lay.cp,), allowed_ep=(lay.ep,))
    if not policy.allow_rollout_tp_change:
        s = replace(s, allowed_rollout_tp=(current.rollout_tp,))
    if not policy.allow_train_resize:
        s = replace(s, allocation_granularity_gpus=current.train_gpus, min_train_gpus=current.train_gpus,
                    min_rollout_gpus=inputs.cluster.total_gpus - current.train_gpus)
    return replace(inputs, space=s)


def replan(inputs: PlannerInputs, current: Candidate, obs: Observation, policy: ReplanPolicy) -> ReplanDecision:
    """Recommend keeping `current` or moving to a better split, from observed metrics."""
    calibrated = calibrate(inputs, current, obs, policy.horizon_steps, policy.projection_steps)
    now = evaluate(calibrated, current, check_thresholds=False)

    def keep(reason: str, gain: float = 0.0, cost: float = 0.0, saved: float = 0.0,
             best: Evaluation | None = None) -> ReplanDecision:
        return ReplanDecision(False, reason, now, now, gain, cost, saved, calibrated, best)

    plan = search_validated(_restricted(calibrated, current, policy))
    if not plan.feasible or plan.chosen is None:
        return keep("no feasible alternative under the calibrated model")
    best = plan.chosen
    if best.candidate == current:
        return keep("the current split is still the best", best=best)
    gain = best.samples_per_s / now.samples_per_s - 1.0
    cost = switch_cost_s(calibrated, current, best.candidate)
    saved = policy.horizon_steps * (now.step_s - best.step_s)
    if gain < policy.min_gain:
        return keep(f"predicted gain {gain:+.1%} is inside the hysteresis band (replan_min_gain "
                    f"{policy.min_gain:.1%})", gain, cost, saved, best)
    if saved <= cost:
        return keep(f"saves {saved:.0f} s over {policy.horizon_steps} steps, less than the {cost:.0f} s switch",
                    gain, cost, saved, best)
    contradiction = idle_contradiction(obs, current, best.candidate)
    if contradiction:
        return keep(f"predicted gain {gain:+.1%} declined: {contradiction}", gain, cost, saved, best)
    return ReplanDecision(True, f"{gain:+.1%} samples/s; saves {saved:.0f} s over {policy.horizon_steps} steps "
                                f"for a {cost:.0f} s switch", now, best, gain, cost, saved, calibrated, best)
