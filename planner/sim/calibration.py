"""Measured runs and how far simulated ones are from them: reading the measured-gain document, the relative
errors of step time and throughput, and whether the splits rank the same.

The measured-gain benchmark (`benchmarks/elastic_gain.py`, metered logical GPUs on a CPU) writes runs of the
form `{"policy", "split", "samples_per_s", "wall_s", "steps", "rollout_phase_s", "train_phase_s",
"splits_over_time", ...}`; the phase totals are sums over the run's steps, step 1 included, as is `wall_s`.
`measured_runs` reads them (the split as `{"train_gpus", "rollout_gpus"}`, `[train, rollout]`, `"T+R"` /
`"T/R"` or the benchmark's own label `"train T | rollout R"`) and says which run and field is wrong when one
is. `calibration_errors` pairs each measured run with its simulated one and reports the relative errors of the
step time (wall / steps) and of samples per second: the median over runs (the headline), the largest, and
every pair. `split_ranking` orders the splits of the static runs by measured and by simulated samples/s.
Fitting the simulator's constants to the runs is `planner.sim.fit`; building the replayed job from the
job's configuration is the caller's part (`benchmarks/elastic_sim.py`), because reading a configuration is
not the planner's.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

REQUIRED = ("policy", "split", "samples_per_s", "wall_s", "steps")
PHASES = ("rollout_phase_s", "train_phase_s")


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: policy, split, step time, throughput and (when recorded) its phase totals."""

    policy: str
    train_gpus: int
    rollout_gpus: int
    step_s: float
    samples_per_s: float
    steps: int
    name: str = ""
    rollout_phase_s: float | None = None
    train_phase_s: float | None = None
    splits_over_time: int = 1  # distinct splits the run went through
    borrowing_steps: int = 0  # steps whose training borrowed rollout GPUs (elastic hybrid parallelism)

    @property
    def split(self) -> tuple[int, int]:
        return self.train_gpus, self.rollout_gpus

    @property
    def split_label(self) -> str:
        return f"{self.train_gpus}+{self.rollout_gpus}"

    @property
    def wall_s(self) -> float:
        return self.step_s * self.steps


def parse_split(value: Any) -> tuple[int, int]:
    """(training GPUs, rollout GPUs) from a dict, a pair or a `T+R` / `T/R` string."""
    if isinstance(value, dict) and {"train_gpus", "rollout_gpus"} <= set(value):
        return int(value["train_gpus"]), int(value["rollout_gpus"])
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, str):
        found = re.fullmatch(r"\s*(\d+)\s*[+/:]\s*(\d+)\s*", value) or \
            re.fullmatch(r"\s*train\s+(\d+)\s*\|\s*rollout\s+(\d+)\s*", value)
        if found:
            return int(found.group(1)), int(found.group(2))
    raise ValueError(f"split: {value!r}: expected {{'train_gpus': T, 'rollout_gpus': R}}, [T, R], 'T+R' or "
                     "'train T | rollout R'")


def _number(where: str, run: dict[str, Any], key: str, positive: bool) -> float:
    value = run[key]
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {key}: {value!r}: expected a number") from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{where}: {key}: {value!r}: must be {'> 0' if positive else '>= 0'}")
    return number


def _run(i: int, run: Any) -> MeasuredRun:
    if not isinstance(run, dict):
        raise ValueError(f"runs[{i}]: expected an object, got {type(run).__name__}")
    where = f"runs[{i}] ({run.get('policy', '?')}, split {run.get('split', '?')!r})"
    missing = [k for k in REQUIRED if k not in run]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    steps = run["steps"]
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps != int(steps) or steps < 1:
        raise ValueError(f"{where}: steps: {steps!r}: must be a whole number >= 1")
    try:
        train, rollout = parse_split(run["split"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if train < 1 or rollout < 1:
        raise ValueError(f"{where}: split: {run['split']!r}: both pools need at least one GPU")
    wall = _number(where, run, "wall_s", positive=True)
    samples_per_s = _number(where, run, "samples_per_s", positive=True)
    phases = {k: _number(where, run, k, positive=False) if k in run else None for k in PHASES}
    over_time = run.get("splits_over_time") or [run["split"]]
    if not isinstance(over_time, list):
        raise ValueError(f"{where}: splits_over_time: {over_time!r}: expected a list of splits")
    try:
        distinct = {parse_split(s) for s in over_time}
    except ValueError as err:
        raise ValueError(f"{where}: splits_over_time: {err}") from None
    borrowing = run.get("ehp_borrowing_steps", 0)
    if isinstance(borrowing, bool) or not isinstance(borrowing, int) or borrowing < 0:
        raise ValueError(f"{where}: ehp_borrowing_steps: {borrowing!r}: must be a whole number >= 0")
    return MeasuredRun(str(run["policy"]), train, rollout, wall / int(steps), samples_per_s, int(steps),
                       f"{run['policy']} {train}+{rollout}", phases["rollout_phase_s"], phases["train_phase_s"],
                       len(distinct), borrowing)


def measured_runs(document: dict[str, Any]) -> list[MeasuredRun]:
    """The runs of a measured-gain result document, each with its step time and throughput; runs of the same
    policy and split are told apart by a `#n` suffix of their name."""
    runs = document.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError("runs: the measured-gain document has no runs to calibrate against")
    out = [_run(i, run) for i, run in enumerate(runs)]
    seen: dict[str, int] = {}
    named = []
    for run in out:
        seen[run.name] = seen.get(run.name, 0) + 1
        named.append(run if seen[run.name] == 1 else replace(run, name=f"{run.name} #{seen[run.name]}"))
    return named


def calibration_errors(pairs: Sequence[tuple[MeasuredRun, float, float]]) -> dict[str, Any]:
    """Relative errors of (measured run, simulated step seconds, simulated samples/s) pairs: the median and
    the largest over runs of |simulated - measured| / measured, and each pair."""
    if not pairs:
        raise ValueError("no measured runs to compare")
    rows: list[dict[str, Any]] = []
    step_errors: list[float] = []
    throughput_errors: list[float] = []
    for run, step_s, samples_per_s in pairs:
        step_errors.append(round(abs(step_s - run.step_s) / run.step_s, 4))
        throughput_errors.append(round(abs(samples_per_s - run.samples_per_s) / run.samples_per_s, 4))
        rows.append({"run": run.name, "policy": run.policy, "split": run.split_label,
                     "measured_step_s": round(run.step_s, 4), "simulated_step_s": round(step_s, 4),
                     "measured_samples_per_s": round(run.samples_per_s, 4),
                     "simulated_samples_per_s": round(samples_per_s, 4),
                     "rel_error_step_s": step_errors[-1], "rel_error_throughput": throughput_errors[-1]})
    return {"rel_error_step_s": round(statistics.median(step_errors), 4),
            "rel_error_throughput": round(statistics.median(throughput_errors), 4),
            "max_rel_error_step_s": max(step_errors), "max_rel_error_throughput": max(throughput_errors),
            "runs": rows}


def split_ranking(pairs: Sequence[tuple[MeasuredRun, float, float]]) -> dict[str, Any]:
    """The splits of the static runs, fastest first, by measured and by simulated samples/s (several static
    runs of one split: their mean), and whether the two orders are the same."""
    measured: dict[str, list[float]] = {}
    simulated: dict[str, list[float]] = {}
    for run, _, samples_per_s in pairs:
        if run.policy == "static":
            measured.setdefault(run.split_label, []).append(run.samples_per_s)
            simulated.setdefault(run.split_label, []).append(samples_per_s)
    if len(measured) < 2:
        raise ValueError(f"ranking: {len(measured)} static split(s): at least two are needed to rank")
    by_measured = sorted(measured, key=lambda s: -statistics.fmean(measured[s]))
    by_simulated = sorted(simulated, key=lambda s: -statistics.fmean(simulated[s]))
    return {"measured": by_measured, "simulated": by_simulated, "matches": by_measured == by_simulated,
            "best_matches": by_measured[0] == by_simulated[0]}
