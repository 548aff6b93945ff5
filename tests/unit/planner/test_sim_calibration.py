"""Calibration against measured runs: reading the measured-gain document and the relative errors."""

from __future__ import annotations

from typing import Any

import pytest

from planner.sim.calibration import calibration_errors, measured_runs, parse_split

SYNTHETIC = {"metered": True, "gpus": 8, "runs": [
    {"policy": "static", "split": {"train_gpus": 4, "rollout_gpus": 4}, "samples_per_s": 2.0, "wall_s": 100.0,
     "steps": 10},
    {"policy": "static", "split": [2, 6], "samples_per_s": 1.0, "wall_s": 200.0, "steps": 10},
    {"policy": "elastic", "split": "4+4", "samples_per_s": 4.0, "wall_s": 50.0, "steps": 10},
]}


def test_errors_of_a_synthetic_document_match_hand_computation() -> None:
    runs = measured_runs(SYNTHETIC)
    assert [(r.train_gpus, r.rollout_gpus, r.step_s) for r in runs] == [(4, 4, 10.0), (2, 6, 20.0), (4, 4, 5.0)]
    # simulated step seconds 11, 20, 4 -> errors 0.1, 0, 0.2 (median 0.1); samples/s 1.8, 1.1, 4.0 -> 0.1, 0.1, 0
    result = calibration_errors([(runs[0], 11.0, 1.8), (runs[1], 20.0, 1.1), (runs[2], 4.0, 4.0)])
    assert result["rel_error_step_s"] == pytest.approx(0.1)
    assert result["rel_error_throughput"] == pytest.approx(0.1)
    assert [r["rel_error_step_s"] for r in result["runs"]] == [0.1, 0.0, 0.2]


@pytest.mark.parametrize("value, expected", [
    pytest.param({"train_gpus": 3, "rollout_gpus": 5}, (3, 5), id="dict"),
    pytest.param([3, 5], (3, 5), id="pair"),
    pytest.param("3+5", (3, 5), id="plus"),
    pytest.param(" 3 / 5 ", (3, 5), id="slash"),
    pytest.param("train 3 | rollout 5", (3, 5), id="elastic-gain-label"),
])
def test_parse_split(value: Any, expected: tuple[int, int]) -> None:
    assert parse_split(value) == expected


@pytest.mark.parametrize("document, message", [
    pytest.param({}, "runs", id="no-runs"),
    pytest.param({"runs": [{"policy": "static"}]}, "missing split", id="missing"),
    pytest.param({"runs": [{"policy": "s", "split": "x", "samples_per_s": 1, "wall_s": 1, "steps": 1}]}, "split",
                 id="bad-split"),
    pytest.param({"runs": [{"policy": "s", "split": "1+1", "samples_per_s": 1, "wall_s": 0, "steps": 1}]},
                 "wall_s", id="zero-wall"),
])
def test_bad_documents_say_what_is_wrong(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        measured_runs(document)
