"""The running job's re-planning across decisions: each change is reviewed against what the new split
measured, one that did not deliver is undone, and the direction it moved is barred until the lengths move.

`planner.replan.replan` judges one window at a time with a calibrated cost model that sees the mean response
length only; a change it recommends can lose (more rollout instances do not shorten a long tail). The review
is measured, not modelled: on the new split's second window (steps run while the pools changed left out; the
first window holds the catch-up after the switch's pause), its wall seconds per step are compared with what
the old split would have taken at the lengths now measured, which is the old split's measured seconds per
step scaled by the old split's calibrated model from the lengths then to the lengths now (the drift is the
model's, the level is the measurement's). When the new split is slower by more than `UNDO_SHORTFALL_SHARE`
of `replan_min_gain` and the difference over the steps left pays for a switch back, the change is undone and
growing the pool it grew is barred until the mean response length has moved `BAR_LIFT_SHARE` from where the
bar was set. An undo is not itself reviewed (no ping-pong).

`libra.controller.replanner` (the runtime) and `planner.sim.policies` (its replay) both decide through
`OnlineReplanning.decide`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from planner.plan import Candidate
from planner.replan import (
    Observation,
    ReplanDecision,
    ReplanPolicy,
    replan,
    switch_cost_s,
    with_response_tokens,
)
from planner.search import evaluate
from planner.workload import PlannerInputs

REVIEW_WINDOW = 2  # the change is judged on the target's second window: the first holds the catch-up after
# the switch's pause (the rollout pool kept generating while training re-formed, so the next steps run on
# buffered batches and look fast)
UNDO_SHORTFALL_SHARE = 0.5  # undo when steps are slower by more than this share of replan_min_gain: the
# review is measured, where the hysteresis band also covers the cost model's error
BAR_LIFT_SHARE = 0.25  # a bar holds until the mean response length moves this share from where it was set
Pool = Literal["rollout", "training"]


@dataclass(frozen=True)
class Change:
    """A change the re-planner made, kept until the new split has run `REVIEW_WINDOW` windows."""

    step: int
    source: Candidate
    target: Candidate
    calibrated: PlannerInputs  # the cost model calibrated on the source split's window
    source_step_wall_s: float  # measured wall seconds per step on the source split
    source_response_tokens: float  # mean response length of that window
    predicted_gain: float
    windows_seen: int = 0  # windows the target has run so far


@dataclass(frozen=True)
class Bar:
    """Growing `pool` is declined until the mean response length leaves `response_tokens` by BAR_LIFT_SHARE."""

    pool: Pool
    step: int
    response_tokens: float
    why: str

    def holds(self, mean_response_tokens: float) -> bool:
        if self.response_tokens <= 0:
            return False
        return abs(mean_response_tokens / self.response_tokens - 1.0) <= BAR_LIFT_SHARE


@dataclass(frozen=True)
class Review:
    """The measured verdict on a change: the new split's seconds per step against the old split's expected."""

    measured_step_s: float
    kept_step_s: float  # the old split's expected seconds per step at the lengths now measured
    shortfall: float  # measured / kept - 1 (positive: the change made steps slower)
    undo: bool
    reason: str
    switch_back_s: float = 0.0  # seconds a switch back would cost (0: not priced, the change delivered)
    won_back_s: float = 0.0  # seconds a switch back would win over the steps left


def grown_pool(current: Candidate, target: Candidate) -> Pool | None:
    if target.rollout_gpus > current.rollout_gpus:
        return "rollout"
    if target.train_gpus > current.train_gpus:
        return "training"
    return None


def _step_s_at(inputs: PlannerInputs, candidate: Candidate, response_tokens: float) -> float:
    return evaluate(with_response_tokens(inputs, response_tokens), candidate, check_thresholds=False).step_s


def review(change: Change, obs: Observation, policy: ReplanPolicy) -> Review:
    """Did `change` deliver? `obs` is a window run on its target only."""
    measured = float(obs.step_wall_s or 0.0)
    then = _step_s_at(change.calibrated, change.source, change.source_response_tokens)
    now = _step_s_at(change.calibrated, change.source, obs.mean_response_tokens)
    kept = change.source_step_wall_s * (now / then if then > 0 else 1.0)
    shortfall = measured / kept - 1.0 if kept > 0 else 0.0
    figures = (f"{change.target.label()} measured {measured:.2f} s/step; {change.source.label()} would take "
               f"{kept:.2f} s/step at a mean response of {obs.mean_response_tokens:.0f} tokens")
    if shortfall <= policy.min_gain * UNDO_SHORTFALL_SHARE:
        return Review(measured, kept, shortfall, False, f"the change at step {change.step} delivered ({figures})")
    cost = switch_cost_s(change.calibrated, change.target, change.source)
    lost = policy.horizon_steps * (measured - kept)
    if lost <= cost:
        return Review(measured, kept, shortfall, False,
                      f"the change at step {change.step} made steps {shortfall:.1%} slower ({figures}), but a switch "
                      f"back ({cost:.0f} s) costs more than the {lost:.0f} s it would win back over "
                      f"{policy.horizon_steps} steps", cost, lost)
    return Review(measured, kept, shortfall, True,
                  f"undo the change at step {change.step}: steps are {shortfall:.1%} slower, not "
                  f"{change.predicted_gain:+.1%} faster ({figures}); winning back {lost:.0f} s over "
                  f"{policy.horizon_steps} steps for a {cost:.0f} s switch", cost, lost)


@dataclass
class OnlineReplanning:
    """The re-planner's memory between decisions: the last change (to review) and the bars in force."""

    inputs: PlannerInputs
    last_change: Change | None = None
    bars: list[Bar] = field(default_factory=list)
    reviews: list[Review] = field(default_factory=list)

    def decide(self, step: int, current: Candidate, obs: Observation, policy: ReplanPolicy,
               inputs: PlannerInputs | None = None) -> ReplanDecision:
        """The decision for a window run on `current` only (`inputs`: this decision's inputs, e.g. with
        measured switch costs; the instance's otherwise)."""
        inputs = inputs or self.inputs
        change, self.last_change = self.last_change, None
        if change is not None and change.target == current and obs.step_wall_s:
            if change.windows_seen + 1 < REVIEW_WINDOW:
                self.last_change = replace(change, windows_seen=change.windows_seen + 1)
            else:
                verdict = review(change, obs, policy)
                self.reviews.append(verdict)
                if verdict.undo:
                    return self._undo(step, change, verdict, current, obs)
        self.bars = [b for b in self.bars if b.holds(obs.mean_response_tokens)]
        decision = replan(inputs, current, obs, policy)
        if not decision.change:
            return decision
        grows = grown_pool(current, decision.target.candidate)
        bar = next((b for b in self.bars if b.pool == grows), None)
        if bar is not None:
            return replace(decision, change=False, target=decision.current,
                           reason=f"predicted gain {decision.predicted_gain:+.1%} declined: growing the {bar.pool} "
                                  f"pool is barred since step {bar.step} ({bar.why}) until the mean response "
                                  f"length leaves {bar.response_tokens:.0f} tokens by {BAR_LIFT_SHARE:.0%}")
        if obs.step_wall_s:
            self.last_change = Change(step, current, decision.target.candidate, decision.calibrated,
                                      obs.step_wall_s, obs.mean_response_tokens, decision.predicted_gain)
        return decision

    def _undo(self, step: int, change: Change, verdict: Review, current: Candidate,
              obs: Observation) -> ReplanDecision:
        grows = grown_pool(change.source, change.target)
        if grows is not None:
            self.bars = [b for b in self.bars if b.pool != grows]
            self.bars.append(Bar(grows, step, obs.mean_response_tokens,
                                 f"growing it at step {change.step} made steps {verdict.shortfall:.1%} slower"))
        # the source window's calibration at the lengths now measured (the record's predicted figures)
        calibrated = with_response_tokens(change.calibrated, obs.mean_response_tokens)
        now = evaluate(calibrated, current, check_thresholds=False)
        back = evaluate(calibrated, change.source, check_thresholds=False)
        return ReplanDecision(True, verdict.reason, now, back, verdict.shortfall, verdict.switch_back_s,
                              verdict.won_back_s, calibrated, back, undo=True)
