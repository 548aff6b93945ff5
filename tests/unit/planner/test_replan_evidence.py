"""The measured idle shares as a check on the calibrated model: a move that grows the pool that idled clearly
more than the other is declined; shares that are unknown or close say nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_cases import inputs

from planner.layout import TrainLayout
from planner.plan import Candidate
from planner.replan import Observation, ReplanPolicy, calibrate, idle_contradiction, replan
from planner.search import evaluate, search

CURRENT = Candidate(train_gpus=8, rollout_gpus=24, layout=TrainLayout(tp=1, pp=2), rollout_tp=2)
MORE_TRAINING = replace(CURRENT, train_gpus=16, rollout_gpus=16)
MORE_ROLLOUT = replace(CURRENT, train_gpus=4, rollout_gpus=28)

CASES = [
    ("unknown shares", None, None, MORE_TRAINING, ""),
    ("training idles more: no GPUs to training", 0.1, 0.7, MORE_TRAINING, "growing the training pool"),
    ("rollout idles more: no GPUs to rollout", 0.7, 0.1, MORE_ROLLOUT, "growing the rollout pool"),
    ("rollout idles more: GPUs to training agree", 0.7, 0.1, MORE_TRAINING, ""),
    ("shares within the margin", 0.35, 0.3, MORE_ROLLOUT, ""),
    ("nothing grows", 0.9, 0.0, CURRENT, ""),
]


@pytest.mark.parametrize(("rollout_idle", "train_idle", "target", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_idle_contradiction(rollout_idle: float | None, train_idle: float | None, target: Candidate,
                            expected: str) -> None:
    obs = Observation(1e4, 50.0, 1000.0, rollout_idle_share=rollout_idle, train_idle_share=train_idle)
    reason = idle_contradiction(obs, CURRENT, target)
    assert (expected in reason) if expected else reason == ""


def test_a_move_the_idle_shares_contradict_is_declined() -> None:
    inp = inputs("qwen2.5-7b", nodes=4, allocation_granularity_gpus=8, max_head_offpolicyness=1,
                 expected_response_tokens=1024, max_new_tokens=2048, batch_size=48)
    inp = replace(inp, rollout=replace(inp.rollout, reload_method="inplace"))
    assert search(inp).chosen is not None
    ev = evaluate(inp, CURRENT, check_thresholds=False)
    rates = {"rollout_tokens_per_s": ev.rollout["generation_tokens_per_s"], "train_step_s": ev.train_side_s,
             "mean_response_tokens": 1024.0}
    policy = ReplanPolicy(min_gain=0.05, horizon_steps=200)
    agreeing = replan(inp, CURRENT, Observation(**rates, rollout_idle_share=0.6, train_idle_share=0.0), policy)
    assert agreeing.change and agreeing.target.candidate.train_gpus > CURRENT.train_gpus, agreeing.reason
    contradicted = replan(inp, CURRENT, Observation(**rates, rollout_idle_share=0.0, train_idle_share=0.6), policy)
    assert not contradicted.change and "contradicts the measurement" in contradicted.reason
    assert contradicted.best is not None and contradicted.best.candidate == agreeing.target.candidate


def _tiny_setup():  # type: ignore[no-untyped-def]
    inp = inputs("qwen2.5-7b", nodes=4, allocation_granularity_gpus=8, max_head_offpolicyness=1,
                 expected_response_tokens=1024, max_new_tokens=2048, batch_size=48)
    return replace(inp, rollout=replace(inp.rollout, reload_method="inplace"))


@pytest.mark.parametrize("measured_s", [0.05, 3.0, 40.0], ids=["faster", "slower", "much-slower"])
def test_calibration_reproduces_the_measured_weight_sync(measured_s: float) -> None:
    inp = _tiny_setup()
    ev = evaluate(inp, CURRENT, check_thresholds=False)
    obs = Observation(ev.rollout["generation_tokens_per_s"], ev.train_side_s, 1024.0, weight_sync_s=measured_s)
    cal = calibrate(inp, CURRENT, obs, horizon_steps=50)
    synced = evaluate(cal, CURRENT, check_thresholds=False).rollout["weight_sync_s"] * cal.workload.sync_interval
    predicted = ev.rollout["weight_sync_s"] * inp.workload.sync_interval
    transfer = predicted - inp.cost.weight_reload_inplace_s  # what the reload constant cannot take away
    assert synced == pytest.approx(max(measured_s, transfer), rel=1e-6)


@pytest.mark.parametrize(("projection", "expected"), [(0, 1200), (4, 1040)], ids=["half-horizon", "one-interval"])
def test_the_trend_is_projected_as_far_as_asked(projection: int, expected: int) -> None:
    inp = _tiny_setup()
    obs = Observation(1e4, 50.0, mean_response_tokens=1000.0, response_tokens_per_step=10.0)
    assert calibrate(inp, CURRENT, obs, 40, projection).workload.expected_response_tokens == expected
