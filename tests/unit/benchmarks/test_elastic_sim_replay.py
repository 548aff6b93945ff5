"""The simulator benchmark replays the measured-gain runs as the job they ran: the overrides the result
records, and a clear reason instead of a guess for a result that records none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_modules import load_benchmark_module

elastic_sim = load_benchmark_module("elastic_sim")


@pytest.mark.parametrize(("document", "expected"), [
    pytest.param({"overrides": ["total_steps=40", "cluster.num_nodes=2"]}, ["total_steps=40", "cluster.num_nodes=2"],
                 id="recorded"),
    pytest.param({"overrides": []}, [], id="recorded-none-shared"),
    pytest.param({"form": "full"}, None, id="not-recorded"),
    pytest.param({"overrides": "total_steps=40"}, None, id="not-a-list"),
])
def test_replayed_overrides(document: dict[str, Any], expected: list[str] | None) -> None:
    assert elastic_sim.replayed_overrides(document) == expected


def test_a_result_without_overrides_is_not_calibrated_on(tmp_path: Path) -> None:
    result = tmp_path / "elastic_gain.json"
    result.write_text(json.dumps({"form": "quick", "runs": []}))
    out = elastic_sim.calibration(str(result), "configs/drift.yaml")
    assert out["rel_error_step_s"] is None and out["rel_error_throughput"] is None
    assert "does not record the overrides" in out["reason"] and "elastic_gain.py" in out["reason"]


def test_the_slices_cores_are_summed_per_sampled_phase() -> None:
    document = {"runs": [
        {"policy": "static", "split": "train 1 | rollout 7", "slice_cpu": {
            "rollout": {"sampled_s": 10.0, "cores": {"rollout_slices": {"server": 1.1}, "train_slices": {"training_worker": 0.05}}},
            "train": {"sampled_s": 20.0, "cores": {"rollout_slices": {"server": 0.2}, "train_slices": {"training_worker": 0.18},
                                                   "left_slices": {"borrowed_worker": 0.1},
                                                   "moving": {"borrowed_worker": 0.3}}}}},
        {"policy": "static", "split": "train 4 | rollout 4", "slice_cpu": None},
        {"policy": "static", "split": "train 2 | rollout 6"},
    ]}
    assert elastic_sim.slice_cores_measured(document) == [
        {"run": "static train 1 | rollout 7", "phase": "rollout", "cores": 1.15},
        {"run": "static train 1 | rollout 7", "phase": "train", "cores": 0.38},
    ]
