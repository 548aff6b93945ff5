"""Calibration against measured runs: reading the measured-gain document (and refusing a bad one with the run
and field named), the relative errors, and the ranking of the splits."""

from __future__ import annotations

from typing import Any

import pytest

from planner.sim.calibration import MeasuredRun, calibration_errors, measured_runs, parse_split, split_ranking

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


def run(**changes: Any) -> dict[str, Any]:
    return {"policy": "static", "split": "train 2 | rollout 6", "samples_per_s": 1.0, "wall_s": 10.0, "steps": 4,
            "rollout_phase_s": 5.0, "train_phase_s": 4.0, **changes}


@pytest.mark.parametrize("document, message", [
    pytest.param({}, "runs: the measured-gain document has no runs", id="no-runs"),
    pytest.param({"runs": [{"policy": "static"}]}, r"runs\[0\] \(static.*missing split", id="missing"),
    pytest.param({"runs": [run(), run(split="x")]}, r"runs\[1\] \(static, split 'x'\): split: 'x': expected",
                 id="unparsable-split"),
    pytest.param({"runs": [run(split="0+8")]}, r"runs\[0\] .*split: '0\+8': both pools need", id="empty-pool"),
    pytest.param({"runs": [run(), run(), run(steps=0)]}, r"runs\[2\] .*: steps: 0: must be a whole number >= 1",
                 id="zero-steps"),
    pytest.param({"runs": [run(steps=2.5)]}, r"runs\[0\] .*steps: 2.5", id="fractional-steps"),
    pytest.param({"runs": [run(wall_s=0)]}, r"runs\[0\] .*wall_s: 0: must be > 0", id="zero-wall"),
    pytest.param({"runs": [run(samples_per_s="fast")]}, r"runs\[0\] .*samples_per_s: 'fast': expected a number",
                 id="not-a-number"),
    pytest.param({"runs": [run(train_phase_s=-1.0)]}, r"runs\[0\] .*train_phase_s: -1.0: must be >= 0",
                 id="negative-phase"),
    pytest.param({"runs": [run(splits_over_time=["2+6", "??"])]}, r"runs\[0\] .*splits_over_time: split: '\?\?'",
                 id="bad-split-over-time"),
    pytest.param({"runs": [run(ehp_borrowing_steps=-2)]}, r"runs\[0\] .*ehp_borrowing_steps: -2: must be a whole",
                 id="negative-borrowing-steps"),
])
def test_bad_documents_say_which_run_and_field(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        measured_runs(document)


def test_phase_totals_and_switches_are_read() -> None:
    runs = measured_runs({"runs": [run(), run(policy="elastic", splits_over_time=["2+6", "train 4 | rollout 4"],
                                              ehp_borrowing_steps=3), run()]})
    assert [(r.name, r.rollout_phase_s, r.train_phase_s, r.splits_over_time, r.borrowing_steps) for r in runs] == [
        ("static 2+6", 5.0, 4.0, 1, 0), ("elastic 2+6", 5.0, 4.0, 2, 3), ("static 2+6 #2", 5.0, 4.0, 1, 0)]


def measured(split: tuple[int, int], samples_per_s: float, policy: str = "static") -> MeasuredRun:
    return MeasuredRun(policy, split[0], split[1], 1.0, samples_per_s, 1, f"{policy} {split[0]}+{split[1]}")


@pytest.mark.parametrize("pairs, simulated_order, matches", [
    pytest.param([((2, 6), 40.0, 30.0), ((4, 4), 50.0, 35.0), ((6, 2), 30.0, 20.0)], ["4+4", "2+6", "6+2"], True,
                 id="same-order-different-scale"),
    pytest.param([((2, 6), 40.0, 36.0), ((4, 4), 50.0, 35.0), ((6, 2), 30.0, 20.0)], ["2+6", "4+4", "6+2"], False,
                 id="top-two-swapped"),
])
def test_split_ranking(pairs: list[tuple[tuple[int, int], float, float]], simulated_order: list[str],
                       matches: bool) -> None:
    ranking = split_ranking([(measured(split, rate), 1.0, simulated) for split, rate, simulated in pairs])
    assert ranking["measured"] == ["4+4", "2+6", "6+2"]
    assert ranking["simulated"] == simulated_order
    assert ranking["matches"] is matches and ranking["best_matches"] is matches


def test_split_ranking_averages_repeated_static_runs_and_ignores_other_policies() -> None:
    pairs = [(measured((4, 4), 50.0), 1.0, 30.0), (measured((4, 4), 60.0), 1.0, 50.0),
             (measured((2, 6), 52.0), 1.0, 45.0), (measured((2, 6), 99.0, "elastic"), 1.0, 99.0)]
    ranking = split_ranking(pairs)
    assert ranking["measured"] == ["4+4", "2+6"]  # 55 vs 52
    assert ranking["simulated"] == ["2+6", "4+4"]  # 45 vs 40


def test_ranking_needs_two_static_splits() -> None:
    with pytest.raises(ValueError, match="at least two are needed"):
        split_ranking([(measured((4, 4), 50.0), 1.0, 30.0)])
