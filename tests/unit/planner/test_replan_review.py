"""The running job's re-planning across decisions: a change is judged on what the new split measured, one
that did not deliver is undone and not made again on the workload it was measured on, and what the model
over-predicted discounts its next prediction for growing the same pool."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from planner_cases import inputs

from planner.layout import TrainLayout
from planner.plan import Candidate
from planner.replan import Observation, ReplanPolicy
from planner.replan_review import Change, OnlineReplanning, OverPrediction, Undone, review
from planner.search import evaluate, search
from planner.workload import PlannerInputs

POOR = Candidate(train_gpus=8, rollout_gpus=24, layout=TrainLayout(tp=1, pp=2), rollout_tp=2)
POLICY = ReplanPolicy(min_gain=0.05, horizon_steps=200)


def _setup() -> tuple[PlannerInputs, Candidate]:
    inp = inputs("qwen2.5-7b", nodes=4, allocation_granularity_gpus=8, max_head_offpolicyness=1,
                 expected_response_tokens=1024, max_new_tokens=2048, batch_size=48)
    inp = replace(inp, rollout=replace(inp.rollout, reload_method="inplace"))
    plan = search(inp)
    assert plan.chosen is not None
    return inp, plan.chosen.candidate


def _measured(inp: PlannerInputs, candidate: Candidate, wall_factor: float = 1.0,
              response: float | None = None) -> Observation:
    """A window that ran as the model predicts `candidate` at `response` tokens, its steps `wall_factor`
    times as long as predicted."""
    tokens = response if response is not None else inp.workload.response_tokens
    at = replace(inp, workload=replace(inp.workload, expected_response_tokens=int(tokens)))
    ev = evaluate(at, candidate, check_thresholds=False)
    return Observation(rollout_tokens_per_s=ev.rollout["generation_tokens_per_s"], train_step_s=ev.train_side_s,
                       mean_response_tokens=tokens, step_wall_s=ev.step_s * wall_factor)


def _after_a_change() -> tuple[PlannerInputs, Candidate, OnlineReplanning]:
    """A job started on POOR whose re-planner moved it to the planner's split at step 10."""
    inp, chosen = _setup()
    online = OnlineReplanning(inp)
    moved = online.decide(10, POOR, _measured(inp, POOR), POLICY)
    assert moved.change and moved.target.candidate == chosen, moved.reason
    assert online.last_change is not None and online.last_change.source == POOR
    return inp, chosen, online


def _poor_wall(inp: PlannerInputs) -> float:
    return float(_measured(inp, POOR).step_wall_s or 0.0)


@pytest.mark.parametrize(("wall_of_poor", "horizon", "undo", "reason"), [
    pytest.param(0.5, 200, False, "delivered", id="faster-than-keeping-delivered"),
    pytest.param(1.01, 200, False, "delivered", id="inside-the-undo-margin"),
    pytest.param(1.3, 200, True, "undo the change at step 10", id="slower-undone"),
    pytest.param(1.3, 1, False, "costs more", id="slower-but-a-switch-back-does-not-pay"),
])
def test_a_change_is_judged_on_what_the_new_split_measured(wall_of_poor: float, horizon: int, undo: bool,
                                                           reason: str) -> None:
    inp, chosen, online = _after_a_change()
    change = online.last_change
    assert change is not None
    obs = replace(_measured(inp, chosen), step_wall_s=_poor_wall(inp) * wall_of_poor)
    verdict = review(change, obs, replace(POLICY, horizon_steps=horizon))
    assert verdict.kept_step_s == pytest.approx(_poor_wall(inp))  # same lengths: the old split's measurement
    assert verdict.shortfall == pytest.approx(wall_of_poor - 1.0)
    assert verdict.undo is undo
    assert reason in verdict.reason


def test_the_old_split_is_expected_at_the_lengths_now_measured() -> None:
    """Lengths grew by half since the change: the old split's measured seconds per step are scaled by its
    calibrated model's step time at the new lengths over the old."""
    inp, chosen, online = _after_a_change()
    change = online.last_change
    assert change is not None
    longer = 1.5 * inp.workload.response_tokens
    obs = _measured(inp, chosen, response=longer)
    verdict = review(change, obs, POLICY)
    scaled = [evaluate(replace(change.calibrated, workload=replace(change.calibrated.workload,
                                                                   expected_response_tokens=int(t))),
                       POOR, check_thresholds=False).step_s for t in (inp.workload.response_tokens, longer)]
    assert scaled[1] > scaled[0]
    assert verdict.kept_step_s == pytest.approx(_poor_wall(inp) * scaled[1] / scaled[0])


def test_a_change_is_reviewed_on_the_second_window_and_undone_once() -> None:
    inp, chosen, online = _after_a_change()
    slower = replace(_measured(inp, chosen), step_wall_s=1.3 * _poor_wall(inp))
    first = online.decide(20, chosen, slower, POLICY)  # the catch-up window after the pause: not judged
    assert not first.undo and not online.reviews
    undone = online.decide(30, chosen, slower, POLICY)
    assert undone.change and undone.undo and undone.target.candidate == POOR, undone.reason
    assert list(online.over_predictions) == ["training"]
    assert online.last_change is None  # an undo is not itself reviewed


def _undone() -> tuple[PlannerInputs, Candidate, OnlineReplanning, float]:
    """The change at step 10 undone at step 30 (its steps measured 1.3x the old split's); its predicted gain."""
    inp, chosen, online = _after_a_change()
    predicted = online.last_change.predicted_gain if online.last_change else 0.0
    slower = replace(_measured(inp, chosen), step_wall_s=1.3 * _poor_wall(inp))
    online.decide(20, chosen, slower, POLICY)
    assert online.decide(30, chosen, slower, POLICY).undo
    return inp, chosen, online, predicted


def test_an_undo_remembers_what_the_model_over_predicted_and_the_workload_it_measured() -> None:
    inp, chosen, online, predicted = _undone()
    over = online.over_predictions["training"]
    assert (over.step, over.pool) == (10, "training")
    assert over.share == pytest.approx(predicted - (1 / 1.3 - 1))
    undone = online.undone
    assert undone is not None and (undone.step, undone.change_step, undone.source, undone.target) == (
        30, 10, POOR, chosen)
    assert undone.pool == "training" and undone.response_tokens == inp.workload.response_tokens


@pytest.mark.parametrize(("response_of_undo", "over_share", "made", "reason"), [
    pytest.param(1.0, None, False, "the change at step 10 was undone at step 30", id="same-workload-barred"),
    pytest.param(1.0, 0.0, False, "the change at step 10 was undone at step 30",
                 id="same-workload-barred-even-where-the-discount-passes"),
    pytest.param(1.2, 0.0, False, "the change at step 10 was undone at step 30", id="a-fifth-longer-still-barred"),
    pytest.param(0.78, 0.0, False, "the change at step 10 was undone at step 30", id="shorter-inside-the-band"),
    pytest.param(1.5, None, False, "over-predicted growing the training pool at step 10",
                 id="another-workload-discounted-by-the-over-prediction"),
    pytest.param(1.5, 0.0, True, "", id="another-workload-past-the-discount-made"),
    pytest.param(0.7, 0.0, True, "", id="shorter-past-the-band-made"),
])
def test_an_undone_change_is_not_made_again_on_the_workload_it_was_measured_on(
        response_of_undo: float, over_share: float | None, made: bool, reason: str) -> None:
    """After the undo, growing training from the split the job went back to is declined while the mean
    response stays within a quarter of the length the undo measured, whatever the prediction; past that, the
    prediction less what the model over-predicted decides (`over_share`: that figure set for the case; None:
    the one the undo measured, which exceeds the undone change's whole predicted gain)."""
    inp, chosen, online, predicted = _undone()
    if over_share is not None:
        online.over_predictions["training"] = OverPrediction("training", 10, over_share)
    response = response_of_undo * inp.workload.response_tokens
    decision = online.decide(40, POOR, _measured(inp, POOR, response=response), POLICY)
    assert decision.change is made, decision.reason
    assert reason in decision.reason
    if made:
        assert decision.target.candidate.train_gpus > POOR.train_gpus and online.undone is None
    else:
        assert decision.target.candidate == POOR and decision.predicted_gain >= POLICY.min_gain
    if response_of_undo == 1.0:
        assert decision.predicted_gain == pytest.approx(predicted)


TP4 = replace(POOR, rollout_tp=4)  # the same GPU counts, another rollout TP: a change that grows no pool
MORE_ROLLOUT = replace(POOR, train_gpus=4, rollout_gpus=28)
MORE_TRAINING = replace(POOR, train_gpus=16, rollout_gpus=16)


@pytest.mark.parametrize(("undone_target", "current", "target", "barred"), [
    pytest.param(MORE_TRAINING, POOR, MORE_TRAINING, True, id="grow-training-again"),
    pytest.param(MORE_TRAINING, POOR, replace(MORE_TRAINING, train_gpus=24, rollout_gpus=8), True,
                 id="grow-training-further"),
    pytest.param(MORE_TRAINING, POOR, MORE_ROLLOUT, False, id="grow-the-other-pool"),
    pytest.param(MORE_TRAINING, TP4, MORE_TRAINING, False, id="from-another-split"),
    pytest.param(TP4, POOR, TP4, True, id="no-pool-grown-the-same-target"),
    pytest.param(TP4, POOR, replace(POOR, rollout_tp=8), False, id="no-pool-grown-another-target"),
])
def test_what_an_undo_bars(undone_target: Candidate, current: Candidate, target: Candidate, barred: bool) -> None:
    """From the split the job went back to, an undo bars growing the pool its change grew (any amount), or,
    for a change that grew no pool, its own target; nothing from another split."""
    assert Undone(30, 10, POOR, undone_target, 1024.0).bars(current, target) is barred


def test_the_undo_bars_nothing_once_the_job_left_the_split_it_went_back_to() -> None:
    """An operator (or the undo's refusal) put the job on another split: the measurement was of the change
    from the old split, and a later change from another split is judged by the discount alone."""
    inp, chosen, online, _ = _undone()
    other = Candidate(train_gpus=16, rollout_gpus=16, layout=POOR.layout, rollout_tp=POOR.rollout_tp)
    online.decide(40, other, _measured(inp, other), POLICY)
    assert online.undone is None


def test_an_undo_that_will_not_run_bars_nothing() -> None:
    inp, chosen, online = _after_a_change()
    slower = replace(_measured(inp, chosen), step_wall_s=1.3 * _poor_wall(inp))
    online.decide(20, chosen, slower, POLICY)
    assert online.decide(30, chosen, slower, POLICY).undo and online.undone is not None
    online.drop_change()  # the undo's request was refused
    assert online.undone is None


@pytest.mark.parametrize(("wall_of_poor", "kept"), [
    pytest.param(1.0 / 1.02, True, id="delivered-less-than-predicted"),
    pytest.param(0.5, False, id="delivered-more-than-predicted"),
])
def test_each_review_measures_the_model(wall_of_poor: float, kept: bool) -> None:
    """A change kept after its review still measures the model: a gain below the predicted one is an
    over-prediction for the pool it grew; a gain beyond it clears the figure (the model is not trusted more)."""
    inp, chosen, online = _after_a_change()
    predicted = online.last_change.predicted_gain if online.last_change else 0.0
    online.over_predictions["training"] = OverPrediction("training", 1, 0.5)  # older: this review replaces it
    obs = replace(_measured(inp, chosen), step_wall_s=wall_of_poor * _poor_wall(inp))
    online.decide(20, chosen, obs, POLICY)
    assert not online.decide(30, chosen, obs, POLICY).undo
    assert ("training" in online.over_predictions) is kept
    if kept:
        over = online.over_predictions["training"]
        assert (over.pool, over.step) == ("training", 10)
        assert over.share == pytest.approx(predicted - 0.02)


def test_a_change_that_was_not_carried_out_is_not_reviewed() -> None:
    """Refused, recorded only, or overridden by an operator: the split is not the change's target."""
    inp, chosen, online = _after_a_change()
    other = Candidate(train_gpus=16, rollout_gpus=16, layout=chosen.layout, rollout_tp=chosen.rollout_tp)
    online.decide(20, other, replace(_measured(inp, other), step_wall_s=10 * _poor_wall(inp)), POLICY)
    assert not online.reviews


def test_a_change_records_what_it_is_judged_against() -> None:
    inp, chosen, online = _after_a_change()
    change = online.last_change
    assert isinstance(change, Change)
    assert (change.step, change.target, change.windows_seen) == (10, chosen, 0)
    assert change.source_step_wall_s == pytest.approx(_poor_wall(inp))
    assert change.source_response_tokens == inp.workload.response_tokens


def test_an_undo_is_priced_at_the_lengths_now_measured() -> None:
    inp, chosen, online = _after_a_change()
    longer = 1.5 * inp.workload.response_tokens
    slower = replace(_measured(inp, chosen, response=longer), step_wall_s=3.0 * _poor_wall(inp))
    online.decide(20, chosen, slower, POLICY)
    undone = online.decide(30, chosen, slower, POLICY)
    assert undone.undo, undone.reason
    assert undone.calibrated.workload.expected_response_tokens == int(longer)
    assert undone.target.candidate == POOR and undone.current.candidate == chosen


def test_the_memory_survives_a_round_trip_through_json() -> None:
    """What a restarted controller reads back decides as the memory it was written from: the change under
    review (its calibrated model included) and the over-predictions."""
    inp, chosen, online = _after_a_change()
    online.over_predictions["rollout"] = OverPrediction("rollout", 4, 0.07)
    copy = OnlineReplanning.from_dict(inp, json.loads(json.dumps(online.to_dict())))
    assert copy.last_change == online.last_change and copy.over_predictions == online.over_predictions
    assert copy.undone is None and online.to_dict()["undone"] is None
    slower = replace(_measured(inp, chosen), step_wall_s=1.3 * _poor_wall(inp))
    for memory in (online, copy):
        memory.decide(20, chosen, slower, POLICY)
    original, restored = (m.decide(30, chosen, slower, POLICY) for m in (online, copy))
    assert restored.undo and restored.reason == original.reason
    assert copy.over_predictions == online.over_predictions
    again = OnlineReplanning.from_dict(inp, json.loads(json.dumps(copy.to_dict())))
    assert again.undone == copy.undone and copy.undone is not None  # the undo's bar survives a restart too
    decisions = [m.decide(40, POOR, _measured(inp, POOR), POLICY) for m in (copy, again)]
    assert not decisions[1].change and decisions[1].reason == decisions[0].reason


@pytest.mark.parametrize(("data", "problem"), [
    pytest.param([], "not an object", id="a-list"),
    pytest.param({"last_change": {"step": 1}}, "last_change.cost: not an object", id="a-change-without-its-model"),
    pytest.param({"over_predictions": {"rollout": {"step": "3", "share": 0.1}}}, "over_predictions.rollout.step",
                 id="a-step-as-text"),
    pytest.param({"over_predictions": {"rollout": {"step": 3, "share": True}}}, "over_predictions.rollout.share",
                 id="a-share-as-boolean"),
    pytest.param({"over_predictions": {"rollout": {"step": float("inf"), "share": 0.1}}},
                 "over_predictions.rollout.step: inf: not a whole number", id="an-infinite-step"),
    pytest.param({"over_predictions": {"rollout": {"step": -2, "share": 0.1}}}, "step: -2: must be at least 0",
                 id="a-negative-step"),
    pytest.param({"undone": {"step": 9, "change_step": 3, "response_tokens": 40.0}}, "undone.source: not an object",
                 id="an-undo-without-its-split"),
    pytest.param({"undone": "step 9"}, "undone: not an object", id="an-undo-as-text"),
])
def test_a_damaged_memory_names_what_is_wrong(data: object, problem: str) -> None:
    inp, _ = _setup()
    with pytest.raises(ValueError, match=problem):
        OnlineReplanning.from_dict(inp, data)
