"""Policies: the best static split is the best of every static run, drift moves the best split, the planner's
split, online re-planning decisions, EHP and the colocated baseline, and the comparison of all of them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from sim_cases import real_inputs, real_job

from planner.plan import Candidate
from planner.replan import ReplanPolicy, switch_cost_s
from planner.replan_review import OnlineReplanning
from planner.sim.allocation import static_splits
from planner.sim.engine import Engine, SimOptions
from planner.sim.lengths import LengthModel
from planner.sim.policies import (
    ALL_POLICIES,
    ONLINE_REPLANNING,
    POLICIES,
    ElasticPolicy,
    StaticPolicy,
    best_static,
    planner_allocation,
    run_policy,
)
from planner.sim.scenario import build_job, compare, nearest_smooth, scaled_inputs
from planner.workload import EhpOptions


def test_best_static_is_the_max_over_every_static_split() -> None:
    job = real_job(steps=16)
    start = planner_allocation(job.inputs)
    best, runs = best_static(job, start, SimOptions(steps=16))
    splits = static_splits(job.inputs, start.layout, tuple(job.inputs.space.allowed_rollout_tp))
    assert len(runs) == len(splits) > 3
    assert {r.initial for r in runs} == {a.label() for a in splits}
    assert best.samples_per_s == max(r.samples_per_s for r in runs)
    assert best.policy == "best_static"


@pytest.mark.parametrize("early, late", [pytest.param(300, 3000, id="300-to-3000-tokens")])
def test_drift_changes_the_best_static_split(early: int, late: int) -> None:
    """Short responses favour a training-heavy split, long ones a rollout-heavy one."""
    best = {}
    for mean in (early, late):
        job = real_job(steps=16, start=mean, end=mean, drift=False)
        best[mean] = best_static(job, planner_allocation(job.inputs), SimOptions(steps=16))[0]
    train_gpus = {mean: int(r.initial.split()[1]) for mean, r in best.items()}
    assert train_gpus[late] < train_gpus[early], train_gpus


def test_every_policy_runs_on_the_same_draws() -> None:
    job = real_job(steps=30)
    result = compare(job, SimOptions(steps=30, replan_interval_steps=5))
    assert set(result.results) == set(POLICIES)
    for r in result.results.values():
        assert r.steps == 30 and r.samples == int(job.batches.count[:30].sum()) and r.wall_s > 0
        assert 0.0 <= r.gpu_idle_frac < 1.0
    assert result.results["planner_initial"].initial == result.start.label()
    assert result.results["best_static"].samples_per_s >= result.results["planner_initial"].samples_per_s
    elastic = result.results["elastic"]
    assert [d["step"] for d in elastic.decisions] == [5, 10, 15, 20, 25]
    assert elastic.reconfigurations == sum(d["change"] for d in elastic.decisions)
    assert result.results["colocated"].initial.startswith(f"all {job.total_gpus} GPUs")
    oracle = result.phase_oracle()
    assert oracle["gain_over_best_static"] >= 1.0 - 1e-9 and len(oracle["phases"]) == 5


def test_elastic_with_ehp_gives_a_synchronous_job_a_rollout_heavy_split_that_trains_on_every_gpu() -> None:
    """In a synchronous job each pool waits while the other works. With EHP the rollout GPUs join each training
    step, so the re-planner, timing the splits with EHP on, gives the rollout pool most of the GPUs and beats the
    best static split and itself without EHP, which keeps the planner's training-heavy split."""
    job = real_job(steps=30, lag=0)
    result = compare(job, SimOptions(steps=30, replan_interval_steps=5),
                     ("best_static", "elastic", "ehp", "elastic_ehp"))
    start_train = int(result.start.label().split()[1])
    with_ehp = result.results["elastic_ehp"]
    changes = [d for d in with_ehp.decisions if d["change"]]
    assert changes and int(changes[0]["target"].split()[1]) < job.total_gpus // 2 < start_train, changes
    best = result.results["best_static"].samples_per_s
    assert with_ehp.samples_per_s > 1.05 * best
    assert with_ehp.samples_per_s > 1.05 * result.results["elastic"].samples_per_s
    assert with_ehp.samples_per_s > 1.05 * result.results["ehp"].samples_per_s


def test_a_job_that_lends_lends_in_the_policies_that_stand_for_libras_runtime() -> None:
    """A synchronous job with EHP on (`PlannerInputs.ehp`) is planned for lending and runs lending: the planner's
    split and the re-planners lend as the runtime would (so `planner_initial` is `ehp` and `elastic` is
    `elastic_ehp`), while the best static split stays the baseline without elasticity."""
    base = replace(real_inputs(lag=0), ehp=EhpOptions())
    job = build_job(base, LengthModel(400, 3000, base.workload.max_new_tokens), 30, 0)
    result = compare(job, SimOptions(steps=30, replan_interval_steps=5), ALL_POLICIES)
    rate = {name: r.samples_per_s for name, r in result.results.items()}
    assert rate["planner_initial"] == rate["ehp"] and rate["elastic"] == rate["elastic_ehp"]
    assert rate["planner_initial"] > 1.05 * rate["best_static"]
    assert rate["online_replanning"] > 1.05 * rate["best_static"]
    plain = run_policy(job, StaticPolicy(result.start, name="planner_initial"), SimOptions(steps=30))
    assert plain.samples_per_s < rate["planner_initial"], "the split planned for lending runs without it slower"


@dataclass
class Replayed:
    """The replay policy, checked at every decision against the runtime's `OnlineReplanning` fed by the test
    with the window the runtime would judge: steps begun after the last switch was done, at most an interval,
    at least half of one."""

    inner: ElasticPolicy
    own: OnlineReplanning
    interval: int
    name: str = "elastic"
    ehp: bool = False
    seen: list[tuple[int, str, Candidate | None]] = field(default_factory=list)
    windows: list[int] = field(default_factory=list)
    switch_done_s: float = 0.0

    def initial(self) -> Candidate:
        return self.inner.initial()

    def decide(self, engine: Engine) -> Candidate | None:
        before, now = engine.alloc, engine.now
        target = self.inner.decide(engine)
        if engine.trained % self.interval:
            return target
        window = min(self.interval, engine.steps_begun_since(self.switch_done_s))
        self.windows.append(window)
        if window < self.interval // 2:
            self.seen.append((engine.trained, "skipped", None))
            assert target is None
            return target
        policy = ReplanPolicy.of_running_job(engine.trained, engine.steps, self.interval, 0.05, allow_train_resize=True)
        own = self.own.decide(engine.trained, before, engine.observation(window), policy)
        expected = own.target.candidate if own.change else None
        assert target == expected
        self.seen.append((engine.trained, "undo" if own.undo else "change" if own.change else "kept", expected))
        if expected is not None:
            self.switch_done_s = now + switch_cost_s(engine.job.inputs, before, expected)
        return target


def test_the_replan_predictor_decides_as_the_running_job_does() -> None:
    """`predictor="replan"` replays the runtime's re-planner: at every decision, `OnlineReplanning.decide`
    with the running job's policy (`ReplanPolicy.of_running_job`) on the engine's observation of the steps
    begun after the last switch was done (too few: the decision is skipped, as the runtime skips it); a
    change keeps the training layout and the rollout TP (here: a job started with its training pool
    starved)."""
    job = real_job(steps=30)
    options = SimOptions(steps=30, replan_interval_steps=5)
    planned = planner_allocation(job.inputs)
    start = Candidate(8, job.total_gpus - 8, planned.layout, planned.rollout_tp)  # starved training: one change
    replayed = Replayed(ElasticPolicy(job.inputs, start, 5, 0.05, 50, predictor="replan"),
                        OnlineReplanning(job.inputs), 5)
    result = run_policy(job, replayed, options)
    assert [s for s, _, _ in replayed.seen] == [5, 10, 15, 20, 25]
    assert [d["change"] for d in result.decisions] == [a in ("change", "undo") for _, a, _ in replayed.seen]
    assert "change" in [a for _, a, _ in replayed.seen], "the case needs a change to replay"
    assert replayed.windows == [5, 4, 5, 5, 5], "the window after the switch leaves out the step it paused"
    for _, _, target in replayed.seen:
        assert target is None or (target.layout, target.rollout_tp) == (start.layout, start.rollout_tp)
    assert replayed.own.reviews and replayed.inner.reviews == replayed.own.reviews


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy: static_best: choose from .*online_replanning"):
        compare(real_job(steps=2), SimOptions(steps=2), ("static_best",))


def test_online_replanning_is_the_runtimes_re_planner_replayed() -> None:
    """The comparison's `online_replanning` run decides as the replay policy from the planner's split."""
    job = real_job(steps=30)
    options = SimOptions(steps=30, replan_interval_steps=5)
    result = compare(job, options, ("planner_initial", ONLINE_REPLANNING))
    assert set(result.results) == {"planner_initial", ONLINE_REPLANNING}
    direct = run_policy(job, ElasticPolicy(job.inputs, result.start, 5, 0.05, 50, predictor="replan"), options)
    replayed = result.results[ONLINE_REPLANNING]
    assert replayed.policy == ONLINE_REPLANNING
    assert replayed.decisions == direct.decisions and replayed.samples_per_s == direct.samples_per_s
    assert [d["step"] for d in replayed.decisions] == [5, 10, 15, 20, 25]
    assert ONLINE_REPLANNING in ALL_POLICIES and ONLINE_REPLANNING not in POLICIES


@pytest.mark.parametrize("value, expected", [pytest.param(1024, 1152, id="1024"), pytest.param(128, 144, id="128"),
                                             pytest.param(5, 24, id="small"), pytest.param(648, 648, id="exact")])
def test_batch_rounding(value: float, expected: int) -> None:
    assert nearest_smooth(value) == expected


def test_scaling_keeps_the_per_gpu_batch() -> None:
    base = real_job(steps=1).inputs
    scaled = scaled_inputs(base, 512)
    assert scaled.cluster.total_gpus == 512
    assert scaled.workload.batch_size == nearest_smooth(base.workload.batch_size * 512 / base.cluster.total_gpus)
    with pytest.raises(ValueError, match="gpus: 500"):
        scaled_inputs(base, 500)
