"""Online re-planning: calibration reproduces observations, hysteresis prevents flapping, switches must pay."""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_cases import inputs

from planner.layout import TrainLayout
from planner.plan import Candidate
from planner.replan import Observation, ReplanPolicy, calibrate, replan, switch_cost_s
from planner.search import evaluate, search
from planner.workload import EhpOptions


def _setup():  # type: ignore[no-untyped-def]
    inp = inputs("qwen2.5-7b", nodes=4, allocation_granularity_gpus=8, max_head_offpolicyness=1,
                 expected_response_tokens=1024, max_new_tokens=2048, batch_size=48)
    inp = replace(inp, rollout=replace(inp.rollout, reload_method="inplace"))
    plan = search(inp)
    assert plan.chosen is not None
    return inp, plan.chosen


def _observe_prediction(inp, candidate: Candidate, slow_rollout: float = 1.0, slow_train: float = 1.0,
                        response: float | None = None) -> Observation:  # type: ignore[no-untyped-def]
    ev = evaluate(inp, candidate, check_thresholds=False)
    return Observation(rollout_tokens_per_s=ev.rollout["generation_tokens_per_s"] / slow_rollout,
                       train_step_s=ev.train_side_s * slow_train,
                       mean_response_tokens=response if response is not None else inp.workload.response_tokens)


def test_calibration_reproduces_the_observed_rates() -> None:
    inp, chosen = _setup()
    obs = Observation(rollout_tokens_per_s=12345.0, train_step_s=77.0, mean_response_tokens=900.0)
    cal = calibrate(inp, chosen.candidate, obs, horizon_steps=20)
    ev = evaluate(cal, chosen.candidate, check_thresholds=False)
    assert ev.rollout["generation_tokens_per_s"] == pytest.approx(12345.0, rel=0.02)
    assert ev.train_side_s == pytest.approx(77.0, rel=0.02)
    assert cal.workload.expected_response_tokens == 900


def test_response_length_trend_is_projected_over_half_the_horizon() -> None:
    inp, chosen = _setup()
    obs = Observation(1e4, 50.0, mean_response_tokens=800.0, response_tokens_per_step=10.0)
    cal = calibrate(inp, chosen.candidate, obs, horizon_steps=40)
    assert cal.workload.expected_response_tokens == 1000


def test_matching_observations_keep_the_current_split() -> None:
    inp, chosen = _setup()
    decision = replan(inp, chosen.candidate, _observe_prediction(inp, chosen.candidate), ReplanPolicy())
    assert not decision.change
    assert decision.target.candidate == chosen.candidate


POOR = Candidate(train_gpus=8, rollout_gpus=24, layout=TrainLayout(tp=1, pp=2), rollout_tp=2)


def test_a_starved_training_pool_gets_more_gpus() -> None:
    inp, chosen = _setup()
    obs = _observe_prediction(inp, POOR)
    decision = replan(inp, POOR, obs, ReplanPolicy(min_gain=0.05, horizon_steps=200))
    assert decision.change, decision.reason
    assert decision.target.candidate.train_gpus > POOR.train_gpus
    assert decision.target.candidate == chosen.candidate
    assert decision.predicted_gain >= 0.05
    assert decision.predicted_gain >= 0.05
    assert decision.time_saved_s > decision.switch_cost_s > 0


def test_hysteresis_band_prevents_flapping() -> None:
    inp, chosen = _setup()
    policy = ReplanPolicy(min_gain=0.5, horizon_steps=200)
    current = chosen.candidate
    moves = 0
    for slow in (1.3, 0.8, 1.3, 0.8, 1.3, 0.8):  # estimates wobbling around the current operating point
        decision = replan(inp, current, _observe_prediction(inp, current, slow_train=slow), policy)
        if decision.change:
            moves += 1
            current = decision.target.candidate
    assert moves == 0


def test_a_switch_that_does_not_pay_off_within_the_horizon_is_declined() -> None:
    inp, _ = _setup()
    obs = _observe_prediction(inp, POOR)
    expensive = replace(inp, cost=replace(inp.cost, rollout_restart_s=1e7, train_restart_s=1e7))
    decision = replan(expensive, POOR, obs, ReplanPolicy(min_gain=0.01, horizon_steps=5))
    assert not decision.change
    assert "switch" in decision.reason


def test_fixed_training_pool_only_changes_the_rollout_side() -> None:
    inp, _ = _setup()
    obs = _observe_prediction(inp, POOR)
    policy = ReplanPolicy(min_gain=0.0, horizon_steps=1000, allow_train_resize=False,
                          allow_train_layout_change=False)
    decision = replan(inp, POOR, obs, policy)
    assert decision.target.candidate.train_gpus == POOR.train_gpus
    assert decision.target.candidate.layout == POOR.layout


@pytest.mark.parametrize(("step", "total", "interval", "resize", "horizon"), [
    pytest.param(10, 100, 5, True, 90, id="steps-left"),
    pytest.param(99, 100, 3, False, 1, id="last-step-one-step-left"),
    pytest.param(120, 100, 4, True, 1, id="past-the-end-at-least-one"),
])
def test_the_running_jobs_policy(step: int, total: int, interval: int, resize: bool, horizon: int) -> None:
    """A switch pays back within the steps left, the trend is projected one interval ahead, and the training
    layout and the rollout TP are kept (only their own speeds are measured)."""
    policy = ReplanPolicy.of_running_job(step, total, interval, 0.07, allow_train_resize=resize)
    assert (policy.horizon_steps, policy.projection_steps, policy.min_gain) == (horizon, interval, 0.07)
    assert policy.allow_train_resize is resize
    assert not policy.allow_train_layout_change and not policy.allow_rollout_tp_change


def test_a_running_job_keeps_its_rollout_tp() -> None:
    """A rollout pool measured slow at its TP: the search over every TP may prefer another one (whose speed
    the calibration only guesses); the running job's policy changes the split at the measured TP only."""
    inp, _ = _setup()
    obs = _observe_prediction(inp, POOR, slow_rollout=3.0)
    free = replan(inp, POOR, obs, ReplanPolicy(min_gain=0.0, horizon_steps=1000, allow_train_layout_change=False))
    kept = replan(inp, POOR, obs, ReplanPolicy.of_running_job(0, 1000, 10, 0.0, allow_train_resize=True))
    assert free.best is not None and kept.best is not None
    assert free.best.candidate.rollout_tp != POOR.rollout_tp, "the case needs a search that leaves the TP"
    assert kept.best.candidate.rollout_tp == POOR.rollout_tp
    assert kept.best.candidate.layout == POOR.layout


def test_switch_cost_counts_the_slower_pool_change() -> None:
    inp, chosen = _setup()
    c = chosen.candidate
    other = replace(c, rollout_tp=c.rollout_tp * 2 if c.rollout_tp < 8 else 1)
    assert switch_cost_s(inp, c, c) == 0.0
    assert switch_cost_s(inp, c, other) == inp.cost.rollout_restart_s
    moved = replace(c, train_gpus=c.train_gpus + 8, rollout_gpus=c.rollout_gpus - 8)
    assert switch_cost_s(inp, c, moved) == max(inp.cost.rollout_restart_s, inp.cost.train_restart_s)


def test_with_ehp_calibration_reproduces_the_step_trained_on_the_lent_gpus_and_keeps_pricing_them() -> None:
    """In a synchronous job that lends its rollout GPUs to training, the measured training side is the borrowed
    step's: calibration matches it with the borrowed ranks counted, so the speed factor stays the GPUs' own,
    and an alternative split is still priced with the ranks it would borrow."""
    inp = replace(inputs("qwen2.5-7b", nodes=2, allowed_pp=(1,), allocation_granularity_gpus=2),
                  ehp=EhpOptions())
    current = Candidate(train_gpus=8, rollout_gpus=8, layout=TrainLayout(tp=2), rollout_tp=1)
    truth = replace(inp, cost=replace(inp.cost, train_speed_factor=0.5))  # the GPUs run at half the model's speed
    measured = evaluate(truth, current, check_thresholds=False)
    assert measured.train["ehp_borrowed_dp"] == 4  # 8 lent GPUs, replicas of TP 2
    obs = Observation(rollout_tokens_per_s=measured.rollout["tokens_per_s"], train_step_s=measured.train_side_s,
                      mean_response_tokens=inp.workload.response_tokens)
    cal = calibrate(inp, current, obs, horizon_steps=20)
    assert cal.cost.train_speed_factor == pytest.approx(0.5, rel=0.02)
    other = Candidate(train_gpus=4, rollout_gpus=12, layout=TrainLayout(tp=2), rollout_tp=1)
    priced = evaluate(cal, other, check_thresholds=False)
    assert priced.train["ehp_borrowed_dp"] == 6
    assert priced.train_side_s == pytest.approx(evaluate(truth, other, check_thresholds=False).train_side_s, rel=0.02)
