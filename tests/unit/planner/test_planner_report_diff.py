"""The JSON plan document (schema v1) and plan diffs."""

from __future__ import annotations

import json
from dataclasses import replace

from planner_cases import inputs

from planner.diff import diff_plans, format_diff
from planner.report import SCHEMA_VERSION, plan_dict
from planner.search import search


def test_plan_json_has_the_documented_top_level_keys() -> None:
    doc = plan_dict(search(inputs("qwen3-30b-a3b", nodes=2, allocation_granularity_gpus=4)), explain=True)
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    assert set(doc) >= {"schema_version", "feasible", "strategy", "mode", "model", "cluster", "workload",
                        "activation_model", "chosen", "alternatives", "baseline", "candidates_evaluated",
                        "pruned_counts", "pruned", "warnings", "suggestions", "search_s"}
    chosen = doc["chosen"]
    assert set(chosen) == {"train", "rollout", "memory", "times", "ratios", "throughput", "violations"}
    assert set(chosen["train"]) >= {"gpus", "dp", "tp", "pp", "cp", "ep", "vpp"}
    assert set(chosen["rollout"]) >= {"gpus", "tp", "instances", "batch_per_instance"}
    term = chosen["memory"]["train"]["terms"][0]
    assert set(term) == {"name", "phase", "bytes", "counted", "formula"}
    assert {p["kind"] for p in doc["pruned"]} <= {"train_layout", "train_split", "rollout"}
    json.dumps(doc)  # only JSON types


def test_pruned_list_only_with_explain() -> None:
    plan = search(inputs())
    assert "pruned" not in plan_dict(plan)
    assert plan_dict(plan)["pruned_counts"] == plan.pruned_counts()


def test_diff_lists_decision_changes_first() -> None:
    a = search(inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=4))
    b = search(inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=4, max_head_offpolicyness=2))
    assert diff_plans(a, a) == []
    changes = diff_plans(a, b)
    assert changes
    paths = [c.path for c in changes]
    decisions = [c.decision for c in changes]
    assert decisions == sorted(decisions, reverse=True)
    assert "times.step_s" in paths
    assert format_diff(changes).count("\n") == len(changes) - 1


def test_diff_against_an_infeasible_plan() -> None:
    ok = search(inputs())
    bad = search(replace(inputs(), workload=replace(inputs().workload, max_model_len=2**20, max_new_tokens=1024)))
    assert not bad.feasible
    changes = diff_plans(ok, bad)
    assert any(c.path == "train.gpus" and c.after is None for c in changes)


def test_pruned_split_ranges_are_compact_and_exact() -> None:
    from planner.plan import format_ranges

    assert format_ranges((8, 16, 24, 40)) == "8-24 (step 8), 40"
    assert format_ranges((1, 2, 3, 4)) == "1-4"
    assert format_ranges((5, 7)) == "5, 7"
    assert format_ranges(()) == ""
