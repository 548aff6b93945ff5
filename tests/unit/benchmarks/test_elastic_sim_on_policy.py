"""The simulator benchmark's on-policy variant: the example made synchronous, its EHP policies started from the
split the planner chooses with EHP on, every policy on the same drawn lengths."""

from __future__ import annotations

from benchmark_modules import load_benchmark_module

elastic_sim = load_benchmark_module("elastic_sim")


def test_the_on_policy_case_plans_its_ehp_policies_with_ehp_on() -> None:
    out = elastic_sim.on_policy_case("qwen2.5-32b", "configs/qwen2.5-32b-32gpu.yaml", 512, 12, "inplace")
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) == set(elastic_sim.POLICIES)
    assert out["comparison"].job.inputs.workload.max_head_offpolicyness == 0
    # the EHP policies start from the planner's split with EHP on, the others from its split without
    assert rows["ehp"]["split"] == rows["elastic_ehp"]["split"] == out["planner_split_with_ehp"]
    assert rows["planner_initial"]["split"] == out["comparison"].start.label() != out["planner_split_with_ehp"]
    with_ehp_train = int(out["planner_split_with_ehp"].split()[1])
    assert with_ehp_train < int(rows["planner_initial"]["split"].split()[1]), "lending favours a rollout-heavy split"
    best = rows["best_static"]["samples_per_s"]
    assert out["gain"]["ehp"] == round(rows["ehp"]["samples_per_s"] / best, 4)
    assert best >= rows["planner_initial"]["samples_per_s"]
    assert {r["reload"] for r in out["rows"]} == {"inplace"}
