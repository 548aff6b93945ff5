"""The measured-gain picture: the per-step series a run records, the moving-window rate, which runs are drawn,
and the picture written from a result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_modules import load_benchmark_module

fig = load_benchmark_module("elastic_gain_figures")
plot = load_benchmark_module("elastic_gain_plot")


def test_step_series_counts_borrowed_gpus() -> None:
    rows = [{"step": 1, "elapsed_s": 10.0, "samples": 192, "train_gpus": 4, "rollout_gpus": 4},
            {"step": 2, "elapsed_s": 14.5, "samples": 192, "train_gpus": 4, "rollout_gpus": 4,
             "train_ehp_replicas": 4.0}]
    assert fig.step_series(rows) == {"elapsed_s": [10.0, 14.5], "samples": [192.0, 192.0],
                                     "train_gpus": [4.0, 4.0], "rollout_gpus": [4.0, 4.0],
                                     "borrowed_gpus": [0.0, 4.0]}


@pytest.mark.parametrize(("ends", "samples", "window", "rates"), [
    ([1.0, 2.0, 3.0], [10.0, 10.0, 10.0], 2, [10.0, 10.0, 10.0]),
    ([2.0, 3.0, 7.0], [4.0, 4.0, 4.0], 2, [2.0, 8.0 / 3.0, 8.0 / 5.0]),
    ([2.0, 3.0, 7.0], [4.0, 4.0, 4.0], 1, [2.0, 4.0, 1.0]),
], ids=["steady", "slow-last-step", "window-of-one"])
def test_windowed_rate(ends: list[float], samples: list[float], window: int, rates: list[float]) -> None:
    times, got = plot.windowed_rate({"elapsed_s": ends, "samples": samples}, window)
    assert times == ends and got == pytest.approx(rates)


def result() -> dict[str, Any]:
    series = fig.step_series([{"step": s, "elapsed_s": 2.0 * s, "samples": 16, "train_gpus": 2, "rollout_gpus": 2}
                              for s in range(1, 6)])
    runs = [{"policy": "static", "split": "train 1 | rollout 3", "per_step": series},
            {"policy": "static", "split": "train 2 | rollout 2", "per_step": series},
            {"policy": "planner_initial", "split": "train 2 | rollout 2", "per_step": series},
            {"policy": "elastic", "split": "train 2 | rollout 2", "per_step": series}]
    return {"gpus": 4, "config": "configs/drift.yaml", "gain": 1.0, "static_best_split": "train 2 | rollout 2",
            "runs": runs}


def test_chosen_runs_are_elastic_planner_and_best_static() -> None:
    assert [(r["policy"], r["split"]) for r in plot.chosen_runs(result())] == [
        ("elastic", "train 2 | rollout 2"), ("planner_initial", "train 2 | rollout 2"),
        ("static", "train 2 | rollout 2")]


def test_the_picture_is_drawn_from_the_result_file(tmp_path: Path) -> None:
    path = tmp_path / "gain.json"
    path.write_text(json.dumps(result()))
    out = tmp_path / "gain.png"
    assert plot.main([str(path), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_result_without_series_says_how_to_get_them(tmp_path: Path) -> None:
    data = result()
    for run in data["runs"]:
        del run["per_step"]
    with pytest.raises(SystemExit, match="--from-run-dirs"):
        plot.draw(data, tmp_path / "x.png")
