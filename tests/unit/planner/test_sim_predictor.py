"""The elastic policy's tail-aware predictor: the lengths it projects, the engine pace it replays, and that it
chooses better splits than the mean-only predictor of `planner.replan` on drifting long-tailed jobs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from sim_cases import real_job, split

from planner.plan import Candidate
from planner.sim.engine import Engine, SimOptions
from planner.sim.lengths import BatchStats
from planner.sim.policies import ElasticPolicy, StaticPolicy, best_static, planner_allocation
from planner.sim.predictor import MEASURED_STEPS, MIN_MEASURED_STEPS, SETTLE_STEPS, fork_step_s, outlook


def linear_batches(steps: int, first: float, slope: float, samples: int = 100) -> BatchStats:
    """Means `first + slope * k`, E[L^2]/E[L] = 2 x mean, longest = 5 x mean."""
    count = np.full(steps, samples, dtype=np.int64)
    mean = first + slope * np.arange(steps)
    total = count * mean
    return BatchStats(count, total, 5.0 * mean, total * 2.0 * mean)


@pytest.mark.parametrize("cap", [pytest.param(100_000, id="unclipped"),
                                 pytest.param(1_500, id="clipped-at-max-new-tokens")])
def test_outlook_continues_the_trend_and_keeps_the_tail(cap: int) -> None:
    batches = linear_batches(120, 500.0, 10.0)
    lengths = outlook(batches, 30, 40, cap)
    assert lengths.steps == batches.steps
    assert list(lengths.total[:40]) == list(batches.total[:40])  # the steps trained keep their own
    ahead = np.arange(40, 120)
    expected = np.clip(500.0 + 10.0 * ahead, 1, cap)
    means = lengths.total / lengths.count
    assert means[ahead] == pytest.approx(expected)
    assert lengths.longest[ahead] == pytest.approx(np.minimum(5.0 * expected, cap))
    assert (lengths.sum_squares / lengths.total)[ahead] == pytest.approx(np.minimum(2.0 * expected, cap))


def test_outlook_refuses_an_empty_window() -> None:
    with pytest.raises(ValueError, match=r"window \[5, 5\)"):
        outlook(linear_batches(10, 100.0, 0.0), 5, 5, 1000)


@dataclass
class ForkAt:
    """Runs `first`; at step `at` records `fork_step_s` of `candidate` on the job's own lengths, then moves to
    `candidate` itself (or stays, when it is `first`)."""

    first: Candidate
    candidate: Candidate
    at: int
    predicted: list[float | None] = field(default_factory=list)
    changed_by_the_fork: list[list[str]] = field(default_factory=list)
    name: str = "fork-at"
    ehp: bool = False

    def initial(self) -> Candidate:
        return self.first

    def decide(self, engine: Engine) -> Candidate | None:
        if engine.trained != self.at:
            return None
        before = arrays(engine)
        self.predicted.append(fork_step_s(engine, self.candidate, engine.job.batches))
        after = arrays(engine)
        self.changed_by_the_fork.append(sorted(name for name in before
                                               if not np.array_equal(before[name], after[name], equal_nan=True)))
        return self.candidate if self.candidate != self.first else None


def arrays(engine: Engine) -> dict[str, np.ndarray]:
    """Copies of the engine's per-step records (what a fork must not write into)."""
    return {name: value.copy() for name, value in vars(engine).items() if isinstance(value, np.ndarray)}


@pytest.mark.parametrize("lag, first, candidate", [
    pytest.param(1, (8, 2, 1), (8, 2, 1), id="stay"),
    pytest.param(1, (8, 2, 1), (16, 2, 1), id="grow-training"),
    pytest.param(1, (16, 4, 2), (16, 4, 1), id="change-rollout-tp"),
    pytest.param(0, (16, 2, 1), (24, 4, 4), id="synchronous"),
])
def test_a_fork_on_the_jobs_own_lengths_is_what_the_job_then_does(
        lag: int, first: tuple[int, int, int], candidate: tuple[int, int, int]) -> None:
    # the fork starts from the live engine (batches draining, a reload in progress), so on the lengths the job
    # really draws it predicts exactly the steps the job runs after the same switch
    job = real_job(steps=50, start=300, end=2500)
    job = replace(job, inputs=replace(job.inputs, workload=replace(job.inputs.workload, max_head_offpolicyness=lag)))
    a, b = split(job, first[0], tp=first[1], rollout_tp=first[2]), split(job, candidate[0], tp=candidate[1],
                                                                          rollout_tp=candidate[2])
    policy = ForkAt(a, b, at=12)
    ends = Engine(job, policy, SimOptions(steps=50)).run().step_end_s
    start = 12 + SETTLE_STEPS
    assert policy.predicted[0] == pytest.approx(float(ends[start + MEASURED_STEPS - 1] - ends[start - 1])
                                                / MEASURED_STEPS, rel=1e-12)
    assert policy.changed_by_the_fork == [[]], "the fork wrote into the job's own records"


def test_no_prediction_when_too_few_steps_are_left() -> None:
    job = real_job(steps=30, drift=False)
    allocation = split(job, 8, tp=2)
    policy = ForkAt(allocation, allocation, at=30 - SETTLE_STEPS - MIN_MEASURED_STEPS)
    Engine(job, policy, SimOptions(steps=30)).run()
    assert policy.predicted == [None]


@pytest.mark.parametrize("nodes, steps, start, end", [
    pytest.param(4, 60, 300, 3000, id="32-gpus-300-to-3000"),
    pytest.param(4, 80, 150, 3800, id="32-gpus-150-to-3800"),
])
def test_tail_aware_replanning_beats_the_mean_only_predictor(nodes: int, steps: int, start: int, end: int) -> None:
    """From rollout instances too small for the long tail (4 x TP 2 beside 24 training GPUs: the split the
    planner chose while it priced the longest response at a lone sequence's decode step), the tail-aware
    predictor moves to the instances that carry the tail (2 x TP 4) and comes within 10% of the best static
    split; the mean-only predictor, which can resize the pools but prices lengths by their mean, does worse."""
    job = real_job(steps=steps, start=start, end=end, nodes=nodes)
    options = SimOptions(steps=steps, replan_interval_steps=5, replan_horizon_steps=20)
    begin = split(job, 24, tp=4, pp=2, rollout_tp=2)
    runs = {predictor: Engine(job, ElasticPolicy(job.inputs, begin, 5, 0.05, 20, predictor=predictor), options).run()
            for predictor in ("tail", "replan")}
    static = best_static(job, begin, options)[0]
    kept = Engine(job, StaticPolicy(begin), options).run()
    assert runs["tail"].samples_per_s > max(runs["replan"].samples_per_s, kept.samples_per_s)
    assert runs["tail"].samples_per_s >= 0.9 * static.samples_per_s
    changes = [d for d in runs["tail"].decisions if d["change"]]
    assert len(changes) == runs["tail"].reconfigurations and all(d["predicted_gain"] >= 0.05 for d in changes)


# (lag, nodes of 8 GPUs, mean response at the start and the end, share of the best static split the pick reaches)
PICKS = [
    *[pytest.param(1, nodes, start, end, 0.95, id=f"async-{nodes * 8}-gpus-{start}-to-{end}")
      for nodes, start, end in [(4, 300, 3000), (4, 150, 3800), (5, 200, 3500), (6, 200, 3500), (8, 200, 3500),
                                (8, 300, 3000)]],
    *[pytest.param(0, nodes, start, end, 0.97, id=f"sync-{nodes * 8}-gpus-{start}-to-{end}")
      for nodes, start, end in [(2, 300, 3000), (2, 200, 1200), (4, 300, 3000), (4, 200, 1200), (5, 200, 1200),
                                (8, 150, 3800)]],
]


@pytest.mark.parametrize("lag, nodes, start, end, within", PICKS)
def test_the_planner_prices_the_longest_response(lag: int, nodes: int, start: int, end: int, within: float) -> None:
    """A batch ends with its longest response, and more rollout instances do not shorten it, so a planner that
    prices generation by the pool's throughput alone picks rollout instances of TP 2, twice as many as of TP 4
    and each slower on a long response, which the simulator runs clearly slower than the best static split of
    the layout. Asynchronous (a lag of one step): the chain of batch latency, training and weight sync holds
    the pipeline, and each decode step of the longest response runs beside a full batch (the admission window
    keeps the slots full); priced so, the pick runs within 5% of the best static split (without the chain the
    40- to 64-GPU jobs, at a lone sequence's step the 32-GPU ones, ran clearly slower). Synchronous: after the
    bulk the batch drains down to the longest response; priced so, the pick runs within 3% (at the full
    batch's rate throughout, the 16- and 32-GPU jobs ran 4% to 13% slower)."""
    job = real_job(steps=60, start=start, end=end, nodes=nodes, lag=lag)
    options = SimOptions(steps=60)
    begin = planner_allocation(job.inputs)
    picked = Engine(job, StaticPolicy(begin), options).run().samples_per_s
    best = best_static(job, begin, options)[0]
    assert picked >= within * best.samples_per_s, (begin.label(), best.initial)
