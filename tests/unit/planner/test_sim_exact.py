"""The per-request reference pipeline (`planner.sim.exact`): runs computed by hand, and the engine's per-batch
aggregate checked against it over a table of jobs (one rollout instance or a pool of 2 to 4, policy lag 0 to 3,
prompt groups of 1 to 16, rollout- and training-bound, fixed and drifting long-tailed lengths, two shapes of
decode cost)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from planner_cases import model

from planner.sim.exact import exact_pipeline_run
from planner.sim.fidelity import PipelineCase

QWEN_7B = model("qwen2.5-7b")


def one_second(_: int) -> float:
    return 1.0


def test_synchronous_steps_by_hand() -> None:
    # one group of [3, 1] per step: 3 decode steps, train 1 s, reload 1 s before the next group is admitted
    ends = exact_pipeline_run([np.array([3, 1]), np.array([3, 1])], group_size=2, lag=0, slots=2,
                              max_concurrent=2, step_s=one_second, train_s=1.0, sync_s=1.0)
    assert list(ends) == [4.0, 9.0]


def test_a_lag_of_one_admits_the_next_group_at_once_and_the_reload_pauses_it() -> None:
    # one slot: group 0 decodes 0-2 and trains 2-3; group 1 (admitted at 0) decodes 2-3, waits for the
    # reload 3-4, decodes its last token 4-5 and trains 5-6
    ends = exact_pipeline_run([np.array([2]), np.array([2])], group_size=1, lag=1, slots=1,
                              max_concurrent=2, step_s=one_second, train_s=1.0, sync_s=1.0)
    assert list(ends) == [3.0, 6.0]


def test_a_group_counts_once_its_longest_response_has_finished() -> None:
    # two groups of [1, 4] on 4 slots, lag 0: both decode together, neither is finished before step 4
    ends = exact_pipeline_run([np.array([1, 4, 1, 4])], group_size=2, lag=0, slots=4, max_concurrent=4,
                              step_s=one_second, train_s=1.0, sync_s=0.0)
    assert list(ends) == [5.0]


def test_a_response_admitted_mid_step_joins_at_the_next_step_boundary() -> None:
    # lag 1, two slots, one response per step of lengths 1, 3, 1: responses 0 and 1 start at 0; step 0 trains
    # 1-1.5 (no reload pause), so response 2 is admitted at 1.5, inside the decode step 1-2, and joins at 2;
    # response 1 ends at 3 (the step in progress was not lost), response 2 at 3; steps 1 and 2 train 3-4
    ends = exact_pipeline_run([np.array([1]), np.array([3]), np.array([1])], group_size=1, lag=1, slots=2,
                              max_concurrent=2, step_s=one_second, train_s=0.5, sync_s=0.0)
    assert list(ends) == [1.5, 3.5, 4.0]


@pytest.mark.parametrize("instances, ends", [
    pytest.param(1, [5.0], id="one-instance-decodes-them-in-turn"),
    pytest.param(2, [4.0], id="two-instances-decode-them-side-by-side"),
])
def test_groups_spread_over_the_instances(instances: int, ends: list[float]) -> None:
    # two groups of one response (3 and 1 tokens), one slot per instance; training takes 1 s
    got = exact_pipeline_run([np.array([3, 1])], group_size=1, lag=0, slots=1, max_concurrent=2,
                             step_s=one_second, train_s=1.0, sync_s=0.0, instances=instances)
    assert list(got) == ends


def test_a_group_goes_to_the_instance_with_the_fewest_in_flight() -> None:
    # responses of 4, 1 and 1 tokens, a window of two: the third is admitted when the second ends (t = 1) and
    # goes to the idle instance (1-2), not behind the first (which would end it at 5); training 4-5
    ends = exact_pipeline_run([np.array([4, 1, 1])], group_size=1, lag=0, slots=1, max_concurrent=2,
                              step_s=one_second, train_s=1.0, sync_s=0.0, instances=2)
    assert list(ends) == [5.0]


@pytest.mark.parametrize("kwargs, problem", [
    pytest.param({"group_size": 3, "max_concurrent": 6}, "a multiple of group_size 3", id="groups-do-not-divide-a-step"),
    pytest.param({"slots": 0}, "slots 0: must be >= 1", id="no-slot"),
    pytest.param({"max_concurrent": 1}, "max_concurrent 1: must be >= group_size 2", id="window-below-a-group"),
    pytest.param({"instances": 0}, "instances 0: must be >= 1", id="no-instance"),
])
def test_bad_arguments_are_named(kwargs: dict[str, int], problem: str) -> None:
    arguments = {"group_size": 2, "lag": 0, "slots": 2, "max_concurrent": 2, **kwargs}
    with pytest.raises(ValueError, match=problem):
        exact_pipeline_run([np.array([1, 2])], step_s=one_second, train_s=1.0, sync_s=0.0, **arguments)


CASES = [
    pytest.param(PipelineCase(0, 64, 8, 200, 200, 2.0, 0.5), id="sync-queued-long-tail"),
    pytest.param(PipelineCase(0, 64, 8, 100, 800, 40.0, 5.0), id="sync-drift-train-bound"),
    pytest.param(PipelineCase(0, 16, 4, 100, 800, 10.0, 2.0), id="sync-all-fit"),
    pytest.param(PipelineCase(1, 128, 1, 200, 200, 2.0, 0.5), id="lag1-groups-of-1"),
    pytest.param(PipelineCase(1, 32, 8, 200, 200, 2.0, 0.5, seed=1), id="lag1-rollout-bound"),
    pytest.param(PipelineCase(1, 16, 4, 100, 800, 2.0, 0.5), id="lag1-window-bound-drift"),
    pytest.param(PipelineCase(1, 64, 8, 100, 800, 40.0, 5.0), id="lag1-train-bound"),
    pytest.param(PipelineCase(1, 8, 8, 200, 200, 10.0, 2.0), id="lag1-small-batch"),
    pytest.param(PipelineCase(2, 16, 4, 200, 200, 2.0, 0.5, seed=1), id="lag2-window-bound"),
    pytest.param(PipelineCase(2, 16, 8, 100, 800, 10.0, 2.0), id="lag2-groups-of-8"),
    pytest.param(PipelineCase(2, 64, 8, 400, 1500, 10.0, 2.0), id="lag2-cap-bound-long"),
    pytest.param(PipelineCase(3, 16, 4, 100, 800, 10.0, 2.0, seed=1), id="lag3-window-bound"),
    pytest.param(PipelineCase(3, 32, 8, 200, 200, 2.0, 0.5), id="lag3-cap-bound"),
    pytest.param(PipelineCase(1, 48, 4, 300, 300, 25.0, 3.0, sigma=1.1, decode_fixed_s=0.005,
                              decode_per_seq_s=0.001, seed=5), id="lag1-heavy-tail-per-sequence-cost"),
    pytest.param(PipelineCase(1, 24, 2, 150, 1200, 6.0, 1.0, sigma=1.1, decode_fixed_s=0.005,
                              decode_per_seq_s=0.001, seed=5), id="lag1-pairs-drift"),
    pytest.param(PipelineCase(1, 4, 16, 300, 300, 6.0, 1.0, sigma=1.1, decode_fixed_s=0.005,
                              decode_per_seq_s=0.001, seed=5), id="lag1-groups-of-16"),
    pytest.param(PipelineCase(2, 4, 16, 300, 300, 1.0, 0.2, sigma=1.1, decode_fixed_s=0.03,
                              decode_per_seq_s=0.0001, seed=5), id="lag2-groups-of-16-fixed-cost"),
    pytest.param(PipelineCase(2, 12, 16, 150, 1200, 25.0, 3.0, sigma=0.5, seed=5), id="lag2-narrow-tail"),
    pytest.param(PipelineCase(0, 128, 8, 100, 800, 2.0, 0.5, instances=2), id="pool-2-sync-drift"),
    pytest.param(PipelineCase(0, 16, 4, 200, 200, 10.0, 2.0, instances=4), id="pool-4-sync-few-groups"),
    pytest.param(PipelineCase(1, 128, 8, 200, 200, 2.0, 0.5, instances=4), id="pool-4-lag1-rollout-bound"),
    pytest.param(PipelineCase(1, 64, 8, 100, 800, 40.0, 5.0, instances=2), id="pool-2-lag1-train-bound"),
    pytest.param(PipelineCase(2, 64, 8, 100, 800, 2.0, 0.5, instances=4), id="pool-4-lag2-drift"),
    pytest.param(PipelineCase(1, 24, 2, 150, 1200, 6.0, 1.0, sigma=1.1, decode_fixed_s=0.005,
                              decode_per_seq_s=0.001, seed=5, instances=3), id="pool-3-lag1-pairs-drift"),
]
TOLERANCE = 0.25  # benchmarks/results/sim_fidelity.json: the worst error over its grid, with some room


@functools.cache
def step_seconds(case: PipelineCase) -> tuple[float, float]:
    """Each case run once for both tests below."""
    return case.step_seconds(QWEN_7B)


@pytest.mark.parametrize("case", CASES)
def test_the_engine_steps_as_the_per_request_pipeline(case: PipelineCase) -> None:
    engine_s, reference_s = step_seconds(case)
    assert engine_s == pytest.approx(reference_s, rel=TOLERANCE)


def test_the_engine_is_close_to_the_per_request_pipeline_on_average() -> None:
    errors = []
    for param in CASES:
        engine_s, reference_s = step_seconds(param.values[0])
        errors.append(abs(engine_s / reference_s - 1.0))
    assert float(np.mean(errors)) < 0.08, [round(e, 3) for e in errors]
