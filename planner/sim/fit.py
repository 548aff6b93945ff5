"""Fitting the simulator's measured-cost constants (`planner.sim.costs.MeasuredCosts`) to measured runs, and
predicting other runs with them.

A measured run is replayed on the simulator at the split it ran (`Replayer.replay`; a run that changed split
cannot be replayed from totals, which do not say when it switched). In a synchronous job the simulated phase
totals are linear in the constants: the rollout phase (each batch's start to its last response) in
`decode_fixed_s` and `decode_per_seq_s`, the training phase in `train_step_s` and `train_token_s`, and the
rest of the wall (the rollout pool's pauses for weight syncs) in `sync_s`. So the simulator gives the design
matrix itself: a replay with one constant at 1 and the others at 0 is that constant's column, and the fitted
constants mean exactly what the simulator does with them. Each block of constants is fitted to the measured
totals of its phase by least squares on relative residuals (each run weighs the same whatever its length),
the constants kept >= 0 (`nonnegative_least_squares`).

On metered logical GPUs (each a CPU slice of `cpu_per_gpu` cores) a replay may cap what a phase's busy slices
get together (`SliceCap`, a diagnostic of the calibration: a host that cannot give every slice its quota): the
busy pool's slices run `cores` cores together at most, so each of its n slices runs at
`min(1, cores / (n x cpu_per_gpu))` of its quota, and the replay stretches that pool's constants by the inverse
(the rollout pool's in the rollout phase, the training pool's in the training phase; the totals stay linear in
the constants). Without a cap (the default) every slice runs at its quota.

`holdout` fits on the runs of some splits and predicts the runs of every other split; `alternate_splits`
is the design the benchmark reports (every other split by training GPUs, so the predicted splits lie between
fitted ones); `leave_one_split_out` predicts each split from the runs of all the others (the splits at the
ends are extrapolated).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from planner.layout import TrainLayout
from planner.plan import Candidate
from planner.sim.calibration import MeasuredRun, calibration_errors, split_ranking
from planner.sim.costs import MeasuredCosts, PhaseCosts
from planner.sim.engine import Engine, SimJob, SimOptions, SimResult
from planner.sim.policies import StaticPolicy

# each phase the measured runs record, with the constants its simulated total is linear in
BLOCKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rollout_phase_s", ("decode_fixed_s", "decode_per_seq_s")),
    ("train_phase_s", ("train_step_s", "train_token_s")),
    ("other_s", ("sync_s",)),
)
CONSTANTS: tuple[str, ...] = tuple(name for _, names in BLOCKS for name in names)


@dataclass(frozen=True)
class PhaseTotals:
    """Seconds of a run: rollout phase, training phase, wall."""

    rollout_phase_s: float
    train_phase_s: float
    wall_s: float

    @property
    def other_s(self) -> float:
        return self.wall_s - self.rollout_phase_s - self.train_phase_s

    def phase(self, name: str) -> float:
        return float(getattr(self, name))


def measured_totals(run: MeasuredRun) -> PhaseTotals:
    """A measured run's phase totals; a clear error naming the run when it did not record them."""
    rollout, train = run.rollout_phase_s, run.train_phase_s
    if rollout is None or train is None:
        missing = [k for k, v in (("rollout_phase_s", rollout), ("train_phase_s", train)) if v is None]
        raise ValueError(f"{run.name}: {', '.join(missing)}: not recorded, so the run cannot be fitted")
    if rollout + train > run.wall_s * (1 + 1e-9):
        raise ValueError(f"{run.name}: rollout_phase_s {rollout} + train_phase_s {train} exceed wall_s "
                         f"{run.wall_s:.3f}")
    return PhaseTotals(rollout, train, run.wall_s)


def costs_of(values: Sequence[float]) -> MeasuredCosts:
    return MeasuredCosts(**dict(zip(CONSTANTS, (float(v) for v in values), strict=True)))


@dataclass(frozen=True)
class SliceCap:
    """What the host gives the busy slices of metered logical GPUs together: `cores` cores at most, each slice
    `cpu_per_gpu` cores by quota."""

    cpu_per_gpu: float
    cores: float

    def __post_init__(self) -> None:
        for name in ("cpu_per_gpu", "cores"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"slice cap: {name}: {value!r}: expected cores > 0")

    def stretch(self, gpus: int) -> float:
        """How much longer a pool of `gpus` slices takes than at its quotas (1 while they fit in the cap)."""
        return max(1.0, gpus * self.cpu_per_gpu / self.cores)

    def costs_for(self, costs: MeasuredCosts, train_gpus: int, rollout_gpus: int) -> MeasuredCosts:
        rollout, train = self.stretch(rollout_gpus), self.stretch(train_gpus)
        return replace(costs, decode_fixed_s=costs.decode_fixed_s * rollout,
                       decode_per_seq_s=costs.decode_per_seq_s * rollout, train_step_s=costs.train_step_s * train,
                       train_token_s=costs.train_token_s * train)


@dataclass(frozen=True)
class Replayer:
    """Replays measured runs on one job (its lengths drawn for at least the runs' steps) with a training
    layout and a rollout instance TP for every split, and optionally what the host gives metered slices
    (`slice_cap`)."""

    job: SimJob
    layout: TrainLayout = field(default_factory=TrainLayout)
    rollout_tp: int = 1
    slice_cap: SliceCap | None = None

    def __post_init__(self) -> None:
        if self.job.inputs.workload.max_head_offpolicyness != 0:
            raise ValueError(f"max_head_offpolicyness: {self.job.inputs.workload.max_head_offpolicyness}: the fit "
                             "needs a synchronous job (with a policy lag the pools overlap, so the phase totals "
                             "are not linear in the constants)")

    def replay(self, run: MeasuredRun, costs: MeasuredCosts) -> SimResult:
        """The simulated run of `run`'s split and steps with `costs`."""
        if run.splits_over_time > 1:
            raise ValueError(f"{run.name}: ran {run.splits_over_time} splits: a run that changed split cannot be "
                             "replayed from its totals (they do not say when it switched)")
        if run.steps > self.job.batches.steps:
            raise ValueError(f"{run.name}: steps: {run.steps}: the job drew lengths for {self.job.batches.steps} "
                             "steps only")
        if self.slice_cap is not None:
            costs = self.slice_cap.costs_for(costs, run.train_gpus, run.rollout_gpus)
        job = SimJob(self.job.inputs, self.job.batches,
                     PhaseCosts(self.job.inputs, self.job.costs.reload_strategy, measured=costs))
        split = Candidate(run.train_gpus, run.rollout_gpus, self.layout, self.rollout_tp)
        if split.dp < 1 or split.rollout_instances < 1:
            raise ValueError(f"{run.name}: split {run.split_label} leaves no training replica of "
                             f"{self.layout.label()} or no rollout instance of TP {self.rollout_tp}")
        return Engine(job, StaticPolicy(split, name=run.policy), SimOptions(steps=run.steps)).run()

    def totals(self, run: MeasuredRun, costs: MeasuredCosts) -> PhaseTotals:
        result = self.replay(run, costs)
        return PhaseTotals(float(result.rollout_s.sum()), float(result.train_s.sum()), result.wall_s)

    def design(self, runs: Sequence[MeasuredRun]) -> dict[str, np.ndarray]:
        """Per constant, the simulated phase totals of each run with that constant at 1 and the others at 0:
        rows = runs, columns = (rollout phase, training phase, rest of the wall)."""
        out = {}
        for i, name in enumerate(CONSTANTS):
            unit = costs_of([1.0 if j == i else 0.0 for j in range(len(CONSTANTS))])
            rows = [self.totals(run, unit) for run in runs]
            out[name] = np.array([[t.rollout_phase_s, t.train_phase_s, t.other_s] for t in rows])
        return out


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0: the best unconstrained least-squares solution over every set of free
    constants whose solution is non-negative (exact; a block has at most a few constants)."""
    columns = a.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(b**2))
    for size in range(1, columns + 1):
        for free in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(columns)
            x[list(free)] = solution
            residual = float(np.sum((a @ x - b) ** 2))
            if residual < best_residual - 1e-15:
                best, best_residual = x, residual
    return best


def fit_costs(replayer: Replayer, runs: Sequence[MeasuredRun]) -> MeasuredCosts:
    """The constants whose replays come closest to the runs' measured phase totals (relative residuals)."""
    if not runs:
        raise ValueError("fit: no runs to fit the constants to")
    measured = [measured_totals(run) for run in runs]
    design = replayer.design(runs)
    values: dict[str, float] = {}
    for column, (phase, names) in enumerate(BLOCKS):
        target = np.array([m.phase(phase) for m in measured])
        if np.any(target <= 0):
            bad = [run.name for run, t in zip(runs, target, strict=True) if t <= 0]
            raise ValueError(f"{', '.join(bad)}: {phase} {'is' if len(bad) == 1 else 'are'} not > 0: nothing to "
                             f"fit {', '.join(names)} to")
        a = np.column_stack([design[name][:, column] for name in names]) / target[:, None]
        if np.linalg.matrix_rank(a) < len(names):
            splits = sorted({run.split_label for run in runs})
            raise ValueError(f"fit: the runs of split(s) {', '.join(splits)} cannot tell {' and '.join(names)} "
                             "apart: fit on runs whose pools differ in size")
        values.update(zip(names, nonnegative_least_squares(a, np.ones(len(runs))).tolist(), strict=True))
    return costs_of([values[name] for name in CONSTANTS])


def predict(replayer: Replayer, runs: Iterable[MeasuredRun],
            costs: MeasuredCosts) -> list[tuple[MeasuredRun, float, float, PhaseTotals]]:
    """(run, simulated step seconds, simulated samples/s, simulated phase totals) of each run."""
    out = []
    for run in runs:
        result = replayer.replay(run, costs)
        totals = PhaseTotals(float(result.rollout_s.sum()), float(result.train_s.sum()), result.wall_s)
        out.append((run, result.wall_s / run.steps, result.samples_per_s, totals))
    return out


def _report(predicted: list[tuple[MeasuredRun, float, float, PhaseTotals]]) -> dict[str, Any]:
    errors = calibration_errors([(run, step, rate) for run, step, rate, _ in predicted])
    for row, (run, _, _, totals) in zip(errors["runs"], predicted, strict=True):
        for phase in ("rollout_phase_s", "train_phase_s"):
            measured = getattr(run, phase)
            row[f"measured_{phase}"] = None if measured is None else round(measured, 3)
            row[f"simulated_{phase}"] = round(totals.phase(phase), 3)
    return errors


def rounded(costs: MeasuredCosts) -> dict[str, float]:
    return {name: float(f"{value:.4g}") for name, value in costs.as_dict().items()}


def holdout(replayer: Replayer, runs: Sequence[MeasuredRun], fitted_splits: Iterable[tuple[int, int]],
            costs: MeasuredCosts | None = None) -> dict[str, Any]:
    """Fit on every run of `fitted_splits` (or take `costs` already fitted to them) and predict every run of the
    other splits: the held-out errors, the fitted and predicted runs, the constants, and the ranking of the
    static runs' splits by the fitted constants (in-sample for the fitted splits)."""
    chosen = set(fitted_splits)
    fitted = [run for run in runs if run.split in chosen]
    held_out = [run for run in runs if run.split not in chosen]
    if not held_out:
        raise ValueError(f"holdout: every run is of a fitted split ({', '.join(f'{t}+{r}' for t, r in sorted(chosen))})"
                         ": nothing is held out")
    if costs is None:
        costs = fit_costs(replayer, fitted)
    every = predict(replayer, runs, costs)
    predicted = [p for p in every if p[0].split not in chosen]
    return {**_report(predicted), "fitted_runs": [r.name for r in fitted], "predicted_runs": [r.name for r in held_out],
            "constants": rounded(costs),
            "ranking": split_ranking([(run, step, rate) for run, step, rate, _ in every])}


def alternate_splits(runs: Sequence[MeasuredRun]) -> list[tuple[int, int]]:
    """Every other split of the runs, ordered by training GPUs, starting with the fewest: with an odd number
    of splits the fitted ones include both ends and every predicted split lies between two fitted ones."""
    splits = sorted({run.split for run in runs})
    if len(splits) < 3:
        raise ValueError(f"alternate splits: the runs have {len(splits)} split(s): fitting on every other one "
                         "needs at least three")
    return splits[::2]


def leave_one_split_out(replayer: Replayer, runs: Sequence[MeasuredRun]) -> dict[str, Any]:
    """Each split's runs predicted by constants fitted on the runs of every other split: the errors over all
    runs, each fold's constants, and the ranking of the static runs' splits by those predictions."""
    splits = sorted({run.split for run in runs})
    if len(splits) < 3:
        raise ValueError(f"leave one split out: the runs have {len(splits)} split(s): at least three are needed")
    predicted: list[tuple[MeasuredRun, float, float, PhaseTotals]] = []
    folds = []
    for split in splits:
        costs = fit_costs(replayer, [run for run in runs if run.split != split])
        predicted += predict(replayer, [run for run in runs if run.split == split], costs)
        folds.append({"held_out": f"{split[0]}+{split[1]}", "constants": rounded(costs)})
    order = {run.name: i for i, run in enumerate(runs)}
    predicted.sort(key=lambda p: order[p[0].name])
    return {**_report(predicted), "folds": folds,
            "ranking": split_ranking([(run, step, rate) for run, step, rate, _ in predicted])}


def fit_residual(replayer: Replayer, runs: Sequence[MeasuredRun], costs: MeasuredCosts | None = None) -> float:
    """What the fit leaves on `runs` themselves: the sum of squared relative residuals of their phase totals
    (rollout, training, rest of the wall) under the constants fitted to them (`costs`, when already fitted)."""
    if costs is None:
        costs = fit_costs(replayer, runs)
    residuals = []
    for run, _, _, totals in predict(replayer, runs, costs):
        measured = measured_totals(run)
        residuals += [totals.phase(name) / measured.phase(name) - 1.0 for name, _ in BLOCKS]
    return float(np.sum(np.square(residuals)))


def slice_cap_sweep(replayer: Replayer, runs: Sequence[MeasuredRun], fitted_splits: Iterable[tuple[int, int]],
                    cpu_per_gpu: float, caps: Iterable[float | None]) -> list[dict[str, Any]]:
    """For each cap on what the host gives the busy slices (None = none): the held-out errors of `holdout`, what
    the fit leaves on the fitted splits' runs (the only residual a calibration may choose a cap by) and on every
    run, and the constants."""
    chosen = list(fitted_splits)
    fitted = [run for run in runs if run.split in set(chosen)]
    rows = []
    for cores in caps:
        capped = replace(replayer, slice_cap=None if cores is None else SliceCap(cpu_per_gpu, cores))
        costs = fit_costs(capped, fitted)
        result = holdout(capped, runs, chosen, costs)
        rows.append({"cap_cores": cores,
                     **{k: result[k] for k in ("rel_error_step_s", "rel_error_throughput", "max_rel_error_step_s",
                                               "max_rel_error_throughput")},
                     "fitted_runs_residual": round(fit_residual(capped, fitted, costs), 4),
                     "all_runs_residual": round(fit_residual(capped, runs), 4),
                     "constants": result["constants"]})
    return rows
