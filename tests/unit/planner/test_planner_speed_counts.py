"""The planner-speed benchmark's count of candidates that reached the cost and memory models, read from the
plan's pruning records, equals the number of candidates the search actually sends to those models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import planner.search as search_module
from planner.model_spec import load_model_spec

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "planner_speed_benchmark", REPO / "benchmarks" / "planner_speed.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("model", "gpus", "granularity"),
    [
        ("qwen2.5-32b", 8, 1),
        ("qwen2.5-32b", 64, 8),
        ("qwen3-30b-a3b", 8, 1),
        ("qwen3-30b-a3b", 64, 8),
    ],
    ids=["dense-8", "dense-64", "moe-8", "moe-64"],
)
def test_costed_count_matches_the_cost_model_calls(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, model: str, gpus: int, granularity: int
) -> None:
    calls = {"train": 0, "rollout": 0, "evaluate": 0}
    train_costs, rollout_costs, evaluate = (
        search_module.train_costs,
        search_module.rollout_costs,
        search_module.evaluate,
    )

    def counted_train(inputs: Any, layout: Any, dp: Any) -> Any:
        calls["train"] += int(np.size(dp))
        return train_costs(inputs, layout, dp)

    def counted_rollout(inputs: Any, tp: int, instances: Any, capacity: int) -> Any:
        calls["rollout"] += int(np.size(instances))
        return rollout_costs(inputs, tp, instances, capacity)

    def counted_evaluate(inputs: Any, candidate: Any) -> Any:
        calls["evaluate"] += 1  # the chosen and alternative candidates are costed once more, one by one
        return evaluate(inputs, candidate)

    monkeypatch.setattr(search_module, "train_costs", counted_train)
    monkeypatch.setattr(search_module, "rollout_costs", counted_rollout)
    monkeypatch.setattr(search_module, "evaluate", counted_evaluate)
    plan = search_module.search(
        bench.inputs_for(load_model_spec(str(REPO / "configs" / "models" / model)), gpus, granularity)
    )
    costed = bench.costed_candidates(plan)
    assert 0 < costed < plan.candidates_evaluated
    assert costed == calls["train"] + calls["rollout"] - 2 * calls["evaluate"]
