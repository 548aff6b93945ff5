"""Calibration: how far the simulator's step times and throughput are from measured runs.

The measured-gain benchmark (`benchmarks/elastic_gain.py`, metered logical GPUs on a CPU) writes runs of the
form `{"policy", "split", "samples_per_s", "wall_s", "steps", ...}`. `measured_runs` reads them (the split as
`{"train_gpus", "rollout_gpus"}`, `[train, rollout]`, `"T+R"` / `"T/R"` or the benchmark's own label
`"train T | rollout R"`); `calibration_errors` pairs each
measured run with the simulated run of the same policy and split and reports the relative errors of the
step time (wall / steps) and of samples per second: the median over runs (the headline) and every pair.
Replaying a measured job (building its `SimJob` from the job's configuration) is the caller's part
(`benchmarks/elastic_sim.py`), because reading a configuration is not the planner's.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: policy, split, step time and throughput."""

    policy: str
    train_gpus: int
    rollout_gpus: int
    step_s: float
    samples_per_s: float
    steps: int


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


def measured_runs(document: dict[str, Any]) -> list[MeasuredRun]:
    """The runs of a measured-gain result document, each with its step time and throughput."""
    runs = document.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError("runs: the measured-gain document has no runs to calibrate against")
    out = []
    for i, run in enumerate(runs):
        missing = [k for k in ("policy", "split", "samples_per_s", "wall_s", "steps") if k not in run]
        if missing:
            raise ValueError(f"runs[{i}]: missing {', '.join(missing)}")
        steps = int(run["steps"])
        if steps < 1 or float(run["wall_s"]) <= 0:
            raise ValueError(f"runs[{i}]: steps {steps} and wall_s {run['wall_s']} must be positive")
        train, rollout = parse_split(run["split"])
        out.append(MeasuredRun(str(run["policy"]), train, rollout, float(run["wall_s"]) / steps,
                               float(run["samples_per_s"]), steps))
    return out


def calibration_errors(pairs: list[tuple[MeasuredRun, float, float]]) -> dict[str, Any]:
    """Relative errors of (measured run, simulated step seconds, simulated samples/s) pairs: the median over
    runs of |simulated - measured| / measured, and each pair."""
    if not pairs:
        raise ValueError("no measured runs to compare")
    rows: list[dict[str, Any]] = []
    step_errors: list[float] = []
    throughput_errors: list[float] = []
    for run, step_s, samples_per_s in pairs:
        step_errors.append(round(abs(step_s - run.step_s) / run.step_s, 4))
        throughput_errors.append(round(abs(samples_per_s - run.samples_per_s) / run.samples_per_s, 4))
        rows.append({"policy": run.policy, "split": f"{run.train_gpus}+{run.rollout_gpus}",
                     "measured_step_s": round(run.step_s, 4), "simulated_step_s": round(step_s, 4),
                     "measured_samples_per_s": round(run.samples_per_s, 4),
                     "simulated_samples_per_s": round(samples_per_s, 4),
                     "rel_error_step_s": step_errors[-1], "rel_error_throughput": throughput_errors[-1]})
    return {"rel_error_step_s": round(statistics.median(step_errors), 4),
            "rel_error_throughput": round(statistics.median(throughput_errors), 4), "runs": rows}
