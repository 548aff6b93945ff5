"""Fitting the simulator's measured-cost constants: the simulated totals are linear in them (the fit's premise),
the fit recovers constants from runs the simulator made, held-out predictions are made without the held-out
runs, and bad input is refused with the run and field named."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import nnls
from sim_cases import real_job, runs_made_by_the_simulator, sync_job

from planner.layout import TrainLayout
from planner.sim.calibration import MeasuredRun
from planner.sim.costs import MeasuredCosts, PhaseCosts
from planner.sim.engine import SimJob
from planner.sim.fit import (
    CONSTANTS,
    Replayer,
    SliceCap,
    alternate_splits,
    fit_costs,
    holdout,
    leave_one_split_out,
    nonnegative_least_squares,
    slice_cap_sweep,
)

CPU_LIKE = MeasuredCosts(decode_fixed_s=0.03, decode_per_seq_s=8e-4, train_step_s=0.2, train_token_s=2e-4,
                         sync_s=0.25)
KNOWN = [
    pytest.param(CPU_LIKE, id="cpu-like"),
    pytest.param(replace(CPU_LIKE, decode_fixed_s=0.0), id="no-fixed-decode-cost"),
    pytest.param(replace(CPU_LIKE, train_step_s=0.0, decode_per_seq_s=2e-3), id="no-training-overhead"),
    pytest.param(MeasuredCosts(0.5, 1e-5, 3.0, 1e-6, 0.01), id="overheads-dominate"),
]


@pytest.fixture(scope="module")
def job() -> SimJob:
    return sync_job()


@pytest.mark.parametrize("costs", KNOWN)
def test_simulated_totals_are_linear_in_the_constants(job: SimJob, costs: MeasuredCosts) -> None:
    replayer = Replayer(job)
    runs = runs_made_by_the_simulator(job, costs, ((2, 6), (6, 2)))
    design = replayer.design(runs)
    combined = sum(value * design[name] for name, value in costs.as_dict().items())
    direct = np.array([[r.rollout_phase_s, r.train_phase_s, r.wall_s - r.rollout_phase_s - r.train_phase_s]
                       for r in runs])
    assert np.allclose(combined, direct, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("costs", KNOWN)
def test_fit_recovers_the_constants_the_runs_were_made_with(job: SimJob, costs: MeasuredCosts) -> None:
    fitted = fit_costs(Replayer(job), runs_made_by_the_simulator(job, costs))
    for name in CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(costs, name), rel=1e-6, abs=1e-12), name


def test_fit_follows_the_measured_totals(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE)
    first = runs[0]
    assert first.rollout_phase_s is not None
    extra = 0.2 * first.rollout_phase_s  # the 1+7 run's rollout took 20% longer, its wall as much longer
    runs[0] = replace(first, rollout_phase_s=first.rollout_phase_s + extra,
                      step_s=first.step_s + extra / first.steps)
    fitted = fit_costs(Replayer(job), runs)
    assert fitted.decode_fixed_s > CPU_LIKE.decode_fixed_s * 1.01
    assert fitted.train_step_s == pytest.approx(CPU_LIKE.train_step_s, rel=1e-6)


@pytest.mark.parametrize("costs", KNOWN)
def test_holdout_predicts_splits_the_fit_never_saw(job: SimJob, costs: MeasuredCosts) -> None:
    runs = runs_made_by_the_simulator(job, costs)
    result = holdout(Replayer(job), runs, alternate_splits(runs))
    assert result["fitted_runs"] == ["static 1+7", "static 3+5", "static 6+2"]
    assert result["predicted_runs"] == ["static 2+6", "static 4+4"]
    assert [row["run"] for row in result["runs"]] == result["predicted_runs"]
    assert result["rel_error_step_s"] == pytest.approx(0.0, abs=1e-4)
    assert result["max_rel_error_throughput"] == pytest.approx(0.0, abs=1e-4)
    assert result["ranking"]["matches"]


@pytest.mark.parametrize("factor", [pytest.param(1.3, id="held-out-run-30pct-slower"),
                                    pytest.param(0.8, id="held-out-run-20pct-faster")])
def test_held_out_errors_are_against_runs_the_fit_did_not_use(job: SimJob, factor: float) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE)
    # the 4+4 run took `factor` x as long as the model says; it is held out, so the constants stay exact and
    # its error is the whole discrepancy
    runs = [replace(r, step_s=r.step_s * factor, samples_per_s=r.samples_per_s / factor) if r.split == (4, 4) else r
            for r in runs]
    result = holdout(Replayer(job), runs, alternate_splits(runs))
    assert result["constants"]["sync_s"] == pytest.approx(CPU_LIKE.sync_s, rel=1e-3)
    row = next(row for row in result["runs"] if row["split"] == "4+4")
    assert row["rel_error_step_s"] == pytest.approx(abs(1 - factor) / factor, abs=1e-3)
    assert row["rel_error_throughput"] == pytest.approx(abs(1 - factor), abs=1e-3)


def test_leave_one_split_out_predicts_every_run_out_of_sample(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE)
    result = leave_one_split_out(Replayer(job), runs)
    assert [fold["held_out"] for fold in result["folds"]] == ["1+7", "2+6", "3+5", "4+4", "6+2"]
    assert [row["run"] for row in result["runs"]] == [r.name for r in runs]
    assert result["max_rel_error_step_s"] == pytest.approx(0.0, abs=1e-4)


@pytest.mark.parametrize("splits, fitted", [
    pytest.param([(1, 7), (2, 6), (3, 5), (4, 4), (6, 2)], [(1, 7), (3, 5), (6, 2)], id="five-splits"),
    pytest.param([(4, 4), (2, 6), (3, 5), (1, 7)], [(1, 7), (3, 5)], id="four-unsorted"),
    pytest.param([(2, 6), (2, 6), (5, 3), (6, 2)], [(2, 6), (6, 2)], id="repeated-split"),
])
def test_alternate_splits(splits: list[tuple[int, int]], fitted: list[tuple[int, int]]) -> None:
    runs = [MeasuredRun("static", t, r, 1.0, 1.0, 1) for t, r in splits]
    assert alternate_splits(runs) == fitted


@pytest.mark.parametrize("a, b", [
    pytest.param([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [1.0, 2.0, 3.0], id="unconstrained-is-feasible"),
    pytest.param([[1.0, 2.0], [1.0, 1.0], [1.0, 0.5]], [1.0, 2.0, 3.0], id="slope-would-be-negative"),
    pytest.param([[1.0], [2.0]], [-1.0, -2.0], id="all-negative"),
    pytest.param([[3.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 3.0], [1.0, 1.0, 1.0]], [1.0, -2.0, 4.0, 0.5],
                 id="three-constants"),
])
def test_nonnegative_least_squares_matches_scipy(a: list[list[float]], b: list[float]) -> None:
    mine = nonnegative_least_squares(np.array(a), np.array(b))
    reference, _ = nnls(np.array(a), np.array(b))
    assert np.all(mine >= 0)
    assert np.allclose(mine, reference, atol=1e-9)


def test_measured_costs_drive_the_phase_times(job: SimJob) -> None:
    costs = PhaseCosts(job.inputs, measured=CPU_LIKE)
    w = job.inputs.workload
    assert costs.decode_step(1, 123.0, 10) == pytest.approx(0.03 + 10 * 8e-4)
    assert costs.prefill_s(1, 4) == 0.0
    assert costs.train_side_s(TrainLayout(), 4, 100.0) == pytest.approx(
        0.2 + 2e-4 * w.samples_per_step * (w.prompt_tokens + 100.0) / 4)
    assert costs.sync_timing(1, 4) == (0.25, 0.25)


# ------------------------------------------------------------------------------------------ bad input
def test_a_run_without_phase_totals_cannot_be_fitted(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE)
    runs[2] = replace(runs[2], train_phase_s=None)
    with pytest.raises(ValueError, match=r"static 3\+5: train_phase_s: not recorded"):
        fit_costs(Replayer(job), runs)


def test_phases_longer_than_the_run_are_refused(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE)
    runs[1] = replace(runs[1], rollout_phase_s=runs[1].wall_s)
    with pytest.raises(ValueError, match=r"static 2\+6: rollout_phase_s .* exceed wall_s"):
        fit_costs(Replayer(job), runs)


def test_runs_of_one_split_cannot_separate_the_decode_constants(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE, ((4, 4), (4, 4)))
    with pytest.raises(ValueError, match=r"4\+4 cannot tell decode_fixed_s and decode_per_seq_s apart"):
        fit_costs(Replayer(job), runs)


def test_a_run_that_changed_split_is_not_replayed(job: SimJob) -> None:
    run = replace(runs_made_by_the_simulator(job, CPU_LIKE, ((4, 4),))[0], name="elastic 4+4", splits_over_time=2)
    with pytest.raises(ValueError, match=r"elastic 4\+4: ran 2 splits"):
        Replayer(job).replay(run, CPU_LIKE)


def test_an_asynchronous_job_is_refused() -> None:
    with pytest.raises(ValueError, match="max_head_offpolicyness: 1: the fit needs a synchronous job"):
        Replayer(real_job(steps=4))


def test_holdout_needs_a_held_out_split(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE, ((2, 6), (6, 2)))
    with pytest.raises(ValueError, match="nothing is held out"):
        holdout(Replayer(job), runs, [(2, 6), (6, 2)])


@pytest.mark.parametrize("field, value", [pytest.param("sync_s", -0.1, id="negative"),
                                          pytest.param("decode_per_seq_s", float("nan"), id="nan")])
def test_measured_costs_refuse_bad_constants(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        replace(CPU_LIKE, **{field: value})


@pytest.mark.parametrize(
    ("gpus", "cpu_per_gpu", "cores", "stretch"),
    [(4, 0.2, 1.0, 1.0), (5, 0.2, 1.0, 1.0), (7, 0.2, 1.0, 1.4), (8, 0.25, 1.0, 2.0), (1, 2.0, 1.0, 2.0)],
    ids=["fits", "exactly-at-the-cap", "seven-slices-over-one-core", "eight-quarter-slices", "one-slice-over-it"],
)
def test_a_pool_over_the_cap_is_slower_by_what_it_exceeds(gpus: int, cpu_per_gpu: float, cores: float,
                                                           stretch: float) -> None:
    assert SliceCap(cpu_per_gpu, cores).stretch(gpus) == pytest.approx(stretch)


@pytest.mark.parametrize(("cpu_per_gpu", "cores"), [(0.0, 1.0), (0.2, -1.0), (0.2, float("nan"))],
                         ids=["no-quota", "negative-cap", "nan-cap"])
def test_a_cap_without_cores_is_refused(cpu_per_gpu: float, cores: float) -> None:
    with pytest.raises(ValueError, match="slice cap: .*expected cores > 0"):
        SliceCap(cpu_per_gpu, cores)


def test_a_capped_replay_stretches_only_the_busy_pools_phase(job: SimJob) -> None:
    free, capped = Replayer(job), Replayer(job, slice_cap=SliceCap(0.2, 1.0))
    for train, rollout, rollout_stretch, train_stretch in ((1, 7, 1.4, 1.0), (6, 2, 1.0, 1.2), (4, 4, 1.0, 1.0)):
        run = MeasuredRun("static", train, rollout, 1.0, 1.0, job.batches.steps)
        before, after = free.totals(run, CPU_LIKE), capped.totals(run, CPU_LIKE)
        assert after.rollout_phase_s == pytest.approx(before.rollout_phase_s * rollout_stretch, rel=1e-9)
        assert after.train_phase_s == pytest.approx(before.train_phase_s * train_stretch, rel=1e-9)
        assert after.other_s == pytest.approx(before.other_s, rel=1e-9)


@pytest.mark.parametrize("cores", [1.0, 0.8], ids=["one-core", "0.8-cores"])
def test_the_fit_recovers_constants_from_runs_on_capped_slices(job: SimJob, cores: float) -> None:
    cap = SliceCap(0.2, cores)
    fitted = fit_costs(Replayer(job, slice_cap=cap), runs_made_by_the_simulator(job, CPU_LIKE, slice_cap=cap))
    for name in CONSTANTS:
        assert getattr(fitted, name) == pytest.approx(getattr(CPU_LIKE, name), rel=1e-6, abs=1e-12), name


def test_the_sweep_chooses_the_cap_the_runs_were_made_with_from_the_fitted_runs_alone(job: SimJob) -> None:
    runs = runs_made_by_the_simulator(job, CPU_LIKE, slice_cap=SliceCap(0.2, 1.0))
    rows = slice_cap_sweep(Replayer(job), runs, alternate_splits(runs), 0.2, (None, 1.2, 1.0, 0.8))
    assert [row["cap_cores"] for row in rows] == [None, 1.2, 1.0, 0.8]
    chosen = min(rows, key=lambda row: row["fitted_runs_residual"])
    assert chosen["cap_cores"] == 1.0
    assert chosen["fitted_runs_residual"] == pytest.approx(0.0, abs=1e-12)
    assert chosen["rel_error_step_s"] == pytest.approx(0.0, abs=1e-4)
    assert rows[0]["fitted_runs_residual"] > 1e-6 and rows[0]["rel_error_step_s"] > 0.005  # uncapped misses
