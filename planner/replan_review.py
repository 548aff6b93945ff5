"""The running job's re-planning across decisions: each change is reviewed against what the new split
measured, one that did not deliver is undone, and later predictions for growing the same pool are discounted
by what the model over-predicted.

`planner.replan.replan` judges one window at a time with a calibrated cost model that sees the mean response
length only; a change it recommends can lose (more rollout instances do not shorten a long tail). The review
is measured, not modelled: on the new split's second window (steps run while the pools changed left out; the
first window holds the catch-up after the switch's pause), its wall seconds per step are compared with what
the old split would have taken at the lengths now measured, which is the old split's measured seconds per
step scaled by the old split's calibrated model from the lengths then to the lengths now (the drift is the
model's, the level is the measurement's). When the new split is slower by more than `UNDO_SHORTFALL_SHARE`
of `replan_min_gain` and the difference over the steps left pays for a switch back, the change is undone. An
undo is not itself reviewed (no ping-pong).

Every review also measures the model: the gain it predicted less the gain measured is its over-prediction
for growing that pool (an `OverPrediction`; none when the change delivered what was predicted or more). A
later change that grows the same pool is made only if its predicted gain, less that over-prediction, still
reaches `replan_min_gain`; the next review of such a change replaces the figure. After an undo the
over-prediction exceeds the undone change's whole predicted gain, so growing that pool again takes a
prediction larger by that much.

An undo is a measurement of the change on the workload of its window, and a prediction of the calibrated model
that over-predicted it is no evidence against it: after an undo, the split the job went back to does not grow
the pool the undone change grew (or, for a change that grew no pool, does not go to its target again) until
the mean response length has moved by more than `RETRY_RESPONSE_SHIFT` from the length the undo measured (an
`Undone`). Past that, the workload is another one and the over-prediction discount alone decides. Before, the
discount alone guarded it, and a real job made a change, undid it and made it again when a calibration after
the undo predicted its gain past the discount.

`libra.controller.replanner` (the runtime) and `planner.sim.policies` (its replay) both decide through
`OnlineReplanning.decide`. `OnlineReplanning.to_dict` / `from_dict` carry the memory across a restart of the
controller (the change under review, the over-predictions and the undo that bars its change; the reviews'
history is in the event log): plain JSON, with the cost model calibrated for the change kept as its
constants.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args

from planner.layout import TrainLayout
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
from planner.workload import CostParams, PlannerInputs

REVIEW_WINDOW = 2  # the change is judged on the target's second window: the first holds the catch-up after
# the switch's pause (the rollout pool kept generating while training re-formed, so the next steps run on
# buffered batches and look fast)
UNDO_SHORTFALL_SHARE = 0.5  # undo when steps are slower by more than this share of replan_min_gain: the
# review is measured, where the hysteresis band also covers the cost model's error
RETRY_RESPONSE_SHIFT = 0.25  # an undone change may be made again once the mean response length has moved by
# more than this share from the length its undo measured (the workload the measurement was of)
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
class OverPrediction:
    """The model over-predicted the gain of the change at `step`, which grew `pool`, by `share` (its predicted
    gain less the gain measured)."""

    pool: Pool
    step: int
    share: float


@dataclass(frozen=True)
class Undone:
    """The change at `change_step` was undone at `step`: the job went back to `source` at a mean response of
    `response_tokens`. It is not made again from `source` while the mean response stays within
    `RETRY_RESPONSE_SHIFT` of that."""

    step: int
    change_step: int
    source: Candidate
    target: Candidate
    response_tokens: float

    @property
    def pool(self) -> Pool | None:
        return grown_pool(self.source, self.target)

    def bars(self, current: Candidate, target: Candidate) -> bool:
        """Would going from `current` to `target` make the undone change again?"""
        if current != self.source:
            return False
        pool = self.pool
        return target == self.target if pool is None else grown_pool(current, target) == pool

    def shift(self, response_tokens: float) -> float:
        """How far the mean response has moved from the one the undo measured (a share of it)."""
        if self.response_tokens <= 0:
            return math.inf
        return abs(response_tokens / self.response_tokens - 1.0)


@dataclass(frozen=True)
class Review:
    """The measured verdict on a change: the new split's seconds per step against the old split's expected."""

    change_step: int  # the step the change was decided at
    predicted_gain: float  # the samples/s gain the model predicted for it
    measured_step_s: float
    kept_step_s: float  # the old split's expected seconds per step at the lengths now measured
    shortfall: float  # measured / kept - 1 (positive: the change made steps slower)
    undo: bool
    reason: str
    switch_back_s: float = 0.0  # seconds a switch back would cost (0: not priced, the change delivered)
    won_back_s: float = 0.0  # seconds a switch back would win over the steps left

    @property
    def measured_gain(self) -> float:
        """The samples/s gain the change delivered (samples per step are fixed: kept / measured - 1)."""
        return 1.0 / (1.0 + self.shortfall) - 1.0

    def to_dict(self) -> dict[str, float | int | bool]:
        return {"change_step": self.change_step, "predicted_gain": round(self.predicted_gain, 4),
                "measured_gain": round(self.measured_gain, 4), "measured_step_s": round(self.measured_step_s, 2),
                "kept_step_s": round(self.kept_step_s, 2), "undo": self.undo}


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
        return Review(change.step, change.predicted_gain, measured, kept, shortfall, False,
                      f"the change at step {change.step} delivered ({figures})")
    cost = switch_cost_s(change.calibrated, change.target, change.source)
    lost = policy.horizon_steps * (measured - kept)
    if lost <= cost:
        return Review(change.step, change.predicted_gain, measured, kept, shortfall, False,
                      f"the change at step {change.step} made steps {shortfall:.1%} slower ({figures}), but a switch "
                      f"back ({cost:.0f} s) costs more than the {lost:.0f} s it would win back over "
                      f"{policy.horizon_steps} steps", cost, lost)
    return Review(change.step, change.predicted_gain, measured, kept, shortfall, True,
                  f"undo the change at step {change.step}: steps are {shortfall:.1%} slower, not "
                  f"{change.predicted_gain:+.1%} faster ({figures}); winning back {lost:.0f} s over "
                  f"{policy.horizon_steps} steps for a {cost:.0f} s switch", cost, lost)


@dataclass
class OnlineReplanning:
    """The re-planner's memory between decisions: the last change (to review), the reviews so far and the
    model's over-prediction per pool grown."""

    inputs: PlannerInputs
    last_change: Change | None = None
    reviews: list[Review] = field(default_factory=list)
    last_review: Review | None = None  # the review the last `decide` made (None: it reviewed nothing)
    over_predictions: dict[Pool, OverPrediction] = field(default_factory=dict)
    undone: Undone | None = None  # the last undo, while it bars making its change again

    def decide(self, step: int, current: Candidate, obs: Observation, policy: ReplanPolicy,
               inputs: PlannerInputs | None = None) -> ReplanDecision:
        """The decision for a window run on `current` only (`inputs`: this decision's inputs, e.g. with
        measured switch costs; the instance's otherwise)."""
        inputs = inputs or self.inputs
        change, self.last_change, self.last_review = self.last_change, None, None
        if change is not None and change.target == current and obs.step_wall_s:
            if change.windows_seen + 1 < REVIEW_WINDOW:
                self.last_change = replace(change, windows_seen=change.windows_seen + 1)
            else:
                verdict = review(change, obs, policy)
                self.reviews.append(verdict)
                self.last_review = verdict
                self._measure_the_model(change, verdict)
                if verdict.undo:
                    self.undone = Undone(step, change.step, change.source, change.target, obs.mean_response_tokens)
                    return self._undo(change, verdict, current, obs)
        if self.undone is not None and (current != self.undone.source or self.undone.shift(
                obs.mean_response_tokens) > RETRY_RESPONSE_SHIFT):
            self.undone = None  # the job left the split it went back to, or the workload is another one
        decision = replan(inputs, current, obs, policy)
        if not decision.change:
            return decision
        undone = self.undone
        if undone is not None and undone.bars(current, decision.target.candidate):
            what = f"growing the {undone.pool} pool" if undone.pool else decision.target.candidate.label()
            return replace(decision, change=False, target=decision.current,
                           reason=f"predicted gain {decision.predicted_gain:+.1%} declined: the change at step "
                                  f"{undone.change_step} was undone at step {undone.step} on what it measured at a "
                                  f"mean response of {undone.response_tokens:.0f} tokens; {what} is not tried "
                                  f"again until the mean response moves by more than {RETRY_RESPONSE_SHIFT:.0%} "
                                  f"from that (now {obs.mean_response_tokens:.0f} tokens)")
        grows = grown_pool(current, decision.target.candidate)
        over = self.over_predictions.get(grows) if grows is not None else None
        if over is not None and decision.predicted_gain - over.share < policy.min_gain:
            net = decision.predicted_gain - over.share
            return replace(decision, change=False, target=decision.current,
                           reason=f"predicted gain {decision.predicted_gain:+.1%} declined: the model over-predicted "
                                  f"growing the {over.pool} pool at step {over.step} by {over.share:.1%}; less "
                                  f"that, {net:+.1%} is inside the hysteresis band (replan_min_gain "
                                  f"{policy.min_gain:.1%})")
        if obs.step_wall_s:
            self.last_change = Change(step, current, decision.target.candidate, decision.calibrated,
                                      obs.step_wall_s, obs.mean_response_tokens, decision.predicted_gain)
        return decision

    def drop_change(self) -> None:
        """The change just decided will not run (its request was refused, or recorded only): nothing to review,
        and an undo that will not run bars nothing."""
        if self.undone is not None and self.last_review is not None and self.last_review.undo:
            self.undone = None
        self.last_change = None

    def _measure_the_model(self, change: Change, verdict: Review) -> None:
        """Keep what the model over-predicted for the pool `change` grew (replacing an older figure)."""
        grows = grown_pool(change.source, change.target)
        if grows is None:
            return
        share = verdict.predicted_gain - verdict.measured_gain
        if share > 0:
            self.over_predictions[grows] = OverPrediction(grows, change.step, share)
        else:
            self.over_predictions.pop(grows, None)

    def to_dict(self) -> dict[str, Any]:
        """The memory a restarted controller needs, as plain JSON: the change under review (its calibrated
        model as the cost constants and the expected response length it was calibrated at) and the
        over-predictions."""
        change = self.last_change
        return {
            "last_change": None if change is None else {
                "step": change.step, "source": _candidate_dict(change.source),
                "target": _candidate_dict(change.target), "cost": asdict(change.calibrated.cost),
                "expected_response_tokens": change.calibrated.workload.expected_response_tokens,
                "source_step_wall_s": change.source_step_wall_s,
                "source_response_tokens": change.source_response_tokens,
                "predicted_gain": change.predicted_gain, "windows_seen": change.windows_seen},
            "over_predictions": self.over_predictions_dict(),
            "undone": self.undone_dict(),
        }

    def undone_dict(self) -> dict[str, Any] | None:
        """The undo that bars its change, as plain JSON (None: none)."""
        u = self.undone
        return None if u is None else {
            "step": u.step, "change_step": u.change_step, "source": _candidate_dict(u.source),
            "target": _candidate_dict(u.target), "response_tokens": u.response_tokens}

    def over_predictions_dict(self) -> dict[str, dict[str, float | int]]:
        """The over-predictions as plain JSON, by pool: the step of the change each was measured on, the share."""
        return {pool: {"step": o.step, "share": o.share} for pool, o in sorted(self.over_predictions.items())}

    @classmethod
    def from_dict(cls, inputs: PlannerInputs, data: Any) -> OnlineReplanning:
        """The memory `to_dict` wrote, on `inputs` (the job's); ValueError naming the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"not an object: {type(data).__name__}")
        online = cls(inputs)
        change = data.get("last_change")
        if change is not None:
            c = _object(change, "last_change")
            calibrated = replace(inputs, cost=_cost(c.get("cost"), "last_change.cost"),
                                 workload=replace(inputs.workload, expected_response_tokens=number_field(
                                     c, "expected_response_tokens", "last_change", int)))
            online.last_change = Change(
                number_field(c, "step", "last_change", int), _candidate(c.get("source"), "last_change.source"),
                _candidate(c.get("target"), "last_change.target"), calibrated,
                number_field(c, "source_step_wall_s", "last_change", positive=True),
                number_field(c, "source_response_tokens", "last_change"),
                number_field(c, "predicted_gain", "last_change"), number_field(c, "windows_seen", "last_change", int))
        undone = data.get("undone")
        if undone is not None:
            u = _object(undone, "undone")
            online.undone = Undone(number_field(u, "step", "undone", int), number_field(u, "change_step", "undone", int),
                                   _candidate(u.get("source"), "undone.source"),
                                   _candidate(u.get("target"), "undone.target"),
                                   number_field(u, "response_tokens", "undone"))
        for name, over in _object(data.get("over_predictions", {}), "over_predictions").items():
            pool = next((p for p in get_args(Pool) if p == name), None)
            if pool is None:
                raise ValueError(f"over_predictions: {name!r}: not a pool (rollout, training)")
            where = f"over_predictions.{pool}"
            o = _object(over, where)
            online.over_predictions[pool] = OverPrediction(pool, number_field(o, "step", where, int),
                                                           number_field(o, "share", where))
        return online

    def _undo(self, change: Change, verdict: Review, current: Candidate, obs: Observation) -> ReplanDecision:
        # the source window's calibration at the lengths now measured (the record's predicted figures)
        calibrated = with_response_tokens(change.calibrated, obs.mean_response_tokens)
        now = evaluate(calibrated, current, check_thresholds=False)
        back = evaluate(calibrated, change.source, check_thresholds=False)
        return ReplanDecision(True, verdict.reason, now, back, verdict.shortfall, verdict.switch_back_s,
                              verdict.won_back_s, calibrated, back, undo=True)


def _candidate_dict(candidate: Candidate) -> dict[str, Any]:
    return {"train_gpus": candidate.train_gpus, "rollout_gpus": candidate.rollout_gpus,
            "layout": asdict(candidate.layout), "rollout_tp": candidate.rollout_tp}


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: not an object: {value!r}")
    return value


def number_field(data: dict[str, Any], key: str, where: str = "", kind: type = float,
                 positive: bool = False) -> Any:
    """`data[key]` as a finite `kind` (float, or int: a whole number) at least 0 (above 0 with `positive`);
    ValueError naming `where.key` otherwise."""
    value = data.get(key)
    name = f"{where}.{key}" if where else key
    what = "a whole number" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
            kind is int and value != int(value)):
        raise ValueError(f"{name}: {value!r}: not {what}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: {value!r}: must be {'above' if positive else 'at least'} 0")
    return kind(value)


def _candidate(value: Any, where: str) -> Candidate:
    c = _object(value, where)
    layout = _object(c.get("layout"), f"{where}.layout")
    names = {f.name for f in fields(TrainLayout)}
    if set(layout) - names:
        raise ValueError(f"{where}.layout: unknown fields {sorted(set(layout) - names)}")
    degrees = {k: number_field(layout, k, f"{where}.layout", int, positive=True) for k in layout}
    return Candidate(number_field(c, "train_gpus", where, int), number_field(c, "rollout_gpus", where, int),
                     TrainLayout(**degrees), number_field(c, "rollout_tp", where, int))


def _cost(value: Any, where: str) -> CostParams:
    c = _object(value, where)
    names = {f.name for f in fields(CostParams)}
    if set(c) != names:
        raise ValueError(f"{where}: fields {sorted(set(c) ^ names)} differ from the cost model's")
    return CostParams(**{k: number_field(c, k, where, positive=k.endswith("speed_factor")) for k in c})
