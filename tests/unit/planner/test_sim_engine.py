"""The event loop: a run computed by hand, event order under bounded staleness, switch costs per strategy,
failures, EHP, determinism."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
from sim_cases import Scripted, fixed_job, real_job, split

from planner.plan import Candidate
from planner.sim.costs import MeasuredCosts, PhaseCosts
from planner.sim.engine import STRATEGIES, Engine, Policy, SimJob, SimOptions
from planner.sim.policies import StaticPolicy
from planner.workload import CostParams


def run(job: SimJob, allocation: Candidate, **options: object) -> Engine:
    engine = Engine(job, StaticPolicy(allocation), SimOptions(steps=job.batches.steps, **options))  # type: ignore[arg-type]
    engine.run()
    return engine


def test_tiny_synchronous_run_matches_hand_computation() -> None:
    # 8 GPUs: training 2 (DP 2: 2.0 s / 2 = 1 s per step), 6 rollout instances; 8 responses of 100 tokens fit
    # at once: 100 decode steps x 0.01 s = 1 s; reload 1 s. Step 0: generate 0-1, train 1-2, weights serve at
    # 3; step 1: generate 3-4, train 4-5.
    job = fixed_job(steps=2)
    engine = run(job, split(job, 2), record_events=True)
    assert engine.result.wall_s == pytest.approx(5.0)
    assert [(t, kind) for t, kind, _ in engine.result.events] == [
        (0.0, "rollout_start"), (1.0, "rollout_done"), (1.0, "train_start"), (2.0, "train_done"), (3.0, "sync"),
        (3.0, "rollout_start"), (4.0, "rollout_done"), (4.0, "train_start"), (5.0, "train_done")]
    assert engine.result.samples_per_s == pytest.approx(16 / 5.0)


@pytest.mark.parametrize(("window", "expected"), [
    # the run above: generation 0-1 and 3-4, training 1-2 and 4-5, each step's weights serve 1 s after it
    pytest.param(2, dict(rollout_tokens_per_s=800.0, train_step_s=1.0, rollout_idle_share=0.6, train_idle_share=0.6,
                         weight_sync_s=1.0, step_wall_s=2.5), id="both-steps"),
    pytest.param(1, dict(rollout_tokens_per_s=800.0, train_step_s=1.0, rollout_idle_share=2 / 3,
                         train_idle_share=2 / 3, weight_sync_s=1.0, step_wall_s=3.0), id="last-step"),
])
def test_observation_is_what_the_runtime_measures(window: int, expected: dict[str, float]) -> None:
    """The re-planner's inputs over the last `window` steps, as the runtime computes them from its metric
    rows: tokens over the time generating, each pool's idle share of the steps' wall time, publish seconds."""
    engine = run(fixed_job(steps=2), split(fixed_job(steps=2), 2))
    obs = engine.observation(window)
    assert {k: getattr(obs, k) for k in expected} == pytest.approx(expected)
    assert (obs.mean_response_tokens, obs.response_tokens_per_step) == (100.0, 0.0)


@pytest.mark.parametrize(("since", "steps"), [pytest.param(0.0, 2, id="from-the-start"),
                                              pytest.param(2.0, 1, id="the-second-began-at-2"),
                                              pytest.param(2.5, 0, id="none-after")])
def test_steps_begun_since(since: float, steps: int) -> None:
    """The run above: step 0 began at 0, step 1 when step 0 ended (2.0 s)."""
    assert run(fixed_job(steps=2), split(fixed_job(steps=2), 2)).steps_begun_since(since) == steps
    job = fixed_job(steps=2)
    assert Engine(job, StaticPolicy(split(job, 2)), SimOptions(steps=2)).steps_begun_since(since) == 0


def test_observation_of_no_step_is_empty() -> None:
    job = fixed_job(steps=2)
    engine = Engine(job, StaticPolicy(split(job, 2)), SimOptions(steps=2))
    obs = engine.observation(5)
    assert (obs.rollout_tokens_per_s, obs.train_step_s, obs.rollout_idle_share) == (0.0, 0.0, None)


@pytest.mark.parametrize("offpolicy", [pytest.param(0, id="sync"), pytest.param(1, id="lag-1"),
                                       pytest.param(2, id="lag-2")])
def test_event_order_respects_the_staleness_bound(offpolicy: int) -> None:
    job = fixed_job(steps=8, samples=64, offpolicy=offpolicy, train_s_at_dp1=6.0)
    events = run(job, split(job, 2), record_events=True).result.events
    at = {(kind, step): t for t, kind, step in events}
    for k in range(8):
        assert at[("rollout_done", k)] <= at[("train_start", k)] < at[("train_done", k)]
        if k:
            assert at[("train_done", k - 1)] <= at[("train_start", k)]
        if k + 1 < 8:  # the run ends with the last training step
            assert at[("train_done", k)] <= at[("sync", k + 1)]
        if k > offpolicy:  # batch k needs weight version k - offpolicy
            assert at[("rollout_start", k)] >= at[("sync", k - offpolicy)]
    times = [t for t, _, _ in events]
    assert times == sorted(times)


def test_asynchronous_overlaps_generation_with_training() -> None:
    sync_job, async_job = fixed_job(steps=10, samples=64), fixed_job(steps=10, samples=64, offpolicy=1)
    sync_wall = run(sync_job, split(sync_job, 2)).result.wall_s
    async_wall = run(async_job, split(async_job, 2)).result.wall_s
    assert async_wall < sync_wall


FREE = CostParams(rollout_restart_s=0.0, train_restart_s=0.0)
PRICED = CostParams(rollout_restart_s=30.0, train_restart_s=50.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_switch_costs_are_charged(strategy: str) -> None:
    walls = {}
    for name, cost in (("free", FREE), ("priced", PRICED)):
        job = fixed_job(steps=6, samples=64, offpolicy=1, cost=cost)
        policy = Scripted(split(job, 2), {2: split(job, 4)})
        result = Engine(job, policy, SimOptions(steps=6, reconfigure_strategy=strategy)).run()  # type: ignore[arg-type]
        assert result.reconfigurations == 1
        assert result.splits[-1][1:] == (4, 4)
        walls[name] = result.wall_s
    # the training pool re-forms (50 s) from the decision in every strategy; cluster_swap first lends its GPUs
    # to the new rollout set for the 30 s restart; a little may overlap time training would have waited anyway
    extra = 80.0 if strategy == "cluster_swap" else 50.0
    assert extra * 0.9 < walls["priced"] - walls["free"] <= extra + 1e-6
    if strategy in ("blue_green", "prewarm"):  # no spare GPUs: falls back to diff
        job = fixed_job(steps=6, samples=64, offpolicy=1, cost=PRICED)
        result = Engine(job, Scripted(split(job, 2), {2: split(job, 4)}),
                        SimOptions(steps=6, reconfigure_strategy=strategy)).run()  # type: ignore[arg-type]
        assert result.strategy_fallbacks == 1


def test_restart_all_stops_the_rollout_pool_and_diff_does_not() -> None:
    cost = CostParams(rollout_restart_s=40.0, train_restart_s=0.0)
    walls = {}
    for strategy in ("diff", "restart_all"):
        job = fixed_job(steps=6, samples=64, offpolicy=1, cost=cost)
        walls[strategy] = Engine(job, Scripted(split(job, 4), {2: split(job, 2)}),
                                 SimOptions(steps=6, reconfigure_strategy=strategy)).run().wall_s  # type: ignore[arg-type]
    # the pool is down for the 40 s restart; with one step of lag a little of it overlaps work done ahead, and
    # the longer cycle it makes narrows the next batch's window a little (the training share, planner.sim.decode)
    assert 0.9 * 40.0 < walls["restart_all"] - walls["diff"] <= 40.0 * 1.005


@pytest.mark.parametrize("rate", [pytest.param(5.0, id="5-per-node-hour"), pytest.param(8.0, id="8-per-node-hour")])
def test_failures_reduce_capacity(rate: float) -> None:
    # 16 training GPUs: a lost training node slows every later step (a rollout pool whose admission window
    # binds may lose an instance and run as fast: its other instances take the window's requests)
    job = real_job(steps=30, drift=False)
    allocation = split(job, 16, tp=2)
    healthy = run(job, allocation).result
    failing = run(job, allocation, node_failures_per_node_hour=rate, repair_s=1e6).result
    assert failing.failures > 0
    assert failing.samples_per_s < healthy.samples_per_s


def test_failures_are_repaired() -> None:
    """Each failed node rejoins its pool `repair_s` later (a repaired node can fail again: failures hit
    working nodes only)."""
    job = real_job(steps=30, drift=False)
    engine = run(job, split(job, 8, tp=2), node_failures_per_node_hour=4.0, repair_s=60.0, record_events=True)
    failed = [(t, kind.split("_")[1]) for t, kind, _ in engine.result.events if kind.startswith("failure_")]
    rejoined = [(t, kind.split("_")[1]) for t, kind, _ in engine.result.events if kind.startswith("rejoin_")]
    assert len(failed) >= 2
    due = [(t + 60.0, pool) for t, pool in failed if t + 60.0 <= engine.result.wall_s]
    assert [(pytest.approx(t), pool) for t, pool in due] == rejoined


def test_ehp_borrows_idle_rollout_gpus_in_a_synchronous_job() -> None:
    job = fixed_job(steps=4, samples=64, train_s_at_dp1=40.0)
    plain = Engine(job, StaticPolicy(split(job, 2)), SimOptions(steps=4, record_events=True)).run()
    lent = Engine(job, StaticPolicy(split(job, 2), ehp=True), SimOptions(steps=4, ehp_join_s=1.0,
                                                                          record_events=True)).run()
    assert any(kind == "ehp_borrow" for _, kind, _ in lent.events)
    # DP 2 -> 8 (6 rollout GPUs lent): 20 s -> 5 s + 1 s join per step
    assert plain.wall_s - lent.wall_s == pytest.approx(4 * (20.0 - 6.0))


@pytest.mark.parametrize("lag, train_s, sync_s", [
    pytest.param(1, 20.0, 5.0, id="lag-1"),
    pytest.param(2, 5.0, 10.0, id="lag-2-long-reload"),
    pytest.param(2, 10.0, 2.0, id="lag-2-short-reload"),
    pytest.param(2, 20.0, 5.0, id="lag-2-longer-training"),
])
def test_a_detour_leaves_no_lasting_rhythm(lag: int, train_s: float, sync_s: float) -> None:
    # how long a batch drains must depend on when the next batch is admitted, not on whether that happened
    # just before or just after its requests were all admitted: else a pause (a switch, a failure) can move the
    # pipeline into another lasting rhythm, and one split runs at two speeds depending on its history
    base = real_job(steps=80)
    inputs = replace(base.inputs, workload=replace(base.inputs.workload, max_head_offpolicyness=lag))
    costs = MeasuredCosts(decode_fixed_s=0.02, decode_per_seq_s=0.0002, train_step_s=train_s, train_token_s=0.0,
                          sync_s=sync_s)
    job = SimJob(inputs, base.batches, PhaseCosts(inputs, measured=costs))
    home = split(job, 16)

    def late_step_s(policy: Policy) -> float:
        ends = Engine(job, policy, SimOptions(steps=80)).run().step_end_s
        return float(ends[-1] - ends[-21]) / 20

    static = late_step_s(StaticPolicy(home))
    for away, at in ((8, 10), (24, 20), (8, 30)):
        detour = Scripted(home, {at: split(job, away), at + 5: home})
        assert late_step_s(detour) == pytest.approx(static, rel=0.002)


def test_same_seed_same_run() -> None:
    a = run(real_job(steps=20, seed=4), Candidate(8, 24, split(real_job(steps=1), 8, tp=2).layout, 1),
            node_failures_per_node_hour=1.0, seed=4).result
    b = run(real_job(steps=20, seed=4), Candidate(8, 24, split(real_job(steps=1), 8, tp=2).layout, 1),
            node_failures_per_node_hour=1.0, seed=4).result
    c = run(real_job(steps=20, seed=5), Candidate(8, 24, split(real_job(steps=1), 8, tp=2).layout, 1),
            node_failures_per_node_hour=1.0, seed=5).result
    assert a.summary() == b.summary() and list(a.step_end_s) == list(b.step_end_s)
    assert a.wall_s != c.wall_s


@pytest.mark.parametrize("options, field", [
    pytest.param({"steps": 0}, "steps", id="steps"),
    pytest.param({"reconfigure_strategy": "swap"}, "reconfigure_strategy", id="strategy"),
    pytest.param({"node_failures_per_node_hour": -1.0}, "node_failures_per_node_hour", id="failures"),
])
def test_bad_options_name_the_field(options: dict[str, object], field: str) -> None:
    job = fixed_job()
    with pytest.raises(ValueError, match=field):
        Engine(job, StaticPolicy(split(job, 2)), replace(SimOptions(), **options))  # type: ignore[arg-type]


@pytest.mark.parametrize("repair_s, outcome", [
    pytest.param(math.inf, "no_capacity", id="no-repair-ends-when-a-pool-is-gone"),
    pytest.param(3600.0, "completed", id="slow-repair-completes"),
])
def test_failures_faster_than_repair_finish_fast(repair_s: float, outcome: str) -> None:
    """30 failures per node-hour: nodes fail faster than they come back (a job of ~10 minutes loses every node)."""
    job = real_job(steps=30, drift=False)
    began = time.process_time()
    result = run(job, split(job, 8, tp=2), node_failures_per_node_hour=30.0, repair_s=repair_s).result
    assert time.process_time() - began < 10.0
    assert result.outcome == outcome and result.failures > 0
    if outcome == "no_capacity":
        assert 0 <= result.steps < 30 and len(result.step_end_s) == result.steps
        assert result.samples == int(job.batches.count[: result.steps].sum())
        assert "pool lost every GPU" in result.outcome_detail and "repair_s=inf" in result.outcome_detail
    else:
        assert result.steps == 30 and result.outcome_detail == ""


def test_repair_time_must_be_positive() -> None:
    job = fixed_job()
    with pytest.raises(ValueError, match="repair_s: 0"):
        Engine(job, StaticPolicy(split(job, 2)), SimOptions(steps=2, repair_s=0.0))
