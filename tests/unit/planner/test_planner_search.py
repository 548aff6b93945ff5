"""Search: same optimum as brute force, a reason for every pruned candidate, determinism, configured mode,
infeasible jobs with advice."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from planner_cases import dense, inputs, model

from planner.grp import plan as plan_with_advice
from planner.layout import TrainLayout, enumerate_layouts, layout_rule_violation
from planner.model_spec import model_spec_from_dict
from planner.plan import Candidate, rank
from planner.report import plan_dict
from planner.search import SPLIT_CODES, brute_force, evaluate, search, split_sizes
from planner.workload import PinnedLayout, PlannerInputs

BRUTE_FORCE_CASES: dict[str, dict[str, Any]] = {
    "7b-8gpu-sync": dict(spec="qwen2.5-7b", nodes=1, allowed_pp=(1, 2, 4)),
    "7b-16gpu-async": dict(spec="qwen2.5-7b", nodes=2, allocation_granularity_gpus=2, max_head_offpolicyness=2,
                           allowed_pp=(1, 2, 4)),
    "32b-16gpu-recompute": dict(spec="qwen2.5-32b", nodes=2, allocation_granularity_gpus=4,
                                recompute_granularity="full", allowed_pp=(1, 2, 4), max_head_offpolicyness=1),
    "moe-16gpu-ep": dict(spec="qwen3-30b-a3b", nodes=4, gpus_per_node=4, allocation_granularity_gpus=4,
                         allowed_pp=(1, 2), allowed_tp=(1, 2, 4), max_head_offpolicyness=1,
                         ep_comm_compute_ratio_threshold=5.0),
    "tight-thresholds": dict(spec="qwen2.5-7b", nodes=1, bubble_ratio_threshold=0.01,
                             comm_compute_ratio_threshold=0.05, allowed_pp=(1, 2, 4)),
    "cp-l40s": dict(spec="qwen2.5-7b", nodes=2, gpu="L40S", allowed_cp=(1, 2), allocation_granularity_gpus=4,
                    allowed_pp=(1, 2, 4), max_model_len=8192, max_new_tokens=4096),
}


@pytest.mark.parametrize("case", BRUTE_FORCE_CASES, ids=list(BRUTE_FORCE_CASES))
def test_search_finds_the_brute_force_optimum(case: str) -> None:
    inp = inputs(**BRUTE_FORCE_CASES[case])
    plan = search(inp)
    best, count = brute_force(inp)
    assert count == len(plan.splits) * len(enumerate_layouts(
        inp.space.allowed_tp, inp.space.allowed_pp, inp.space.allowed_cp, inp.space.allowed_ep, 1)) * len(
        inp.space.allowed_rollout_tp)
    if best is None:
        assert not plan.feasible
        return
    assert plan.feasible and plan.chosen is not None
    assert plan.chosen.samples_per_s == pytest.approx(best.samples_per_s, rel=1e-9)
    assert plan.chosen.candidate == best.candidate
    assert plan.chosen.feasible


def test_alternatives_are_feasible_distinct_and_ranked() -> None:
    plan = search(inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=4))
    assert plan.chosen is not None and len(plan.alternatives) >= 3
    ranked = [plan.chosen] + plan.alternatives
    assert all(e.feasible for e in ranked)
    assert len({e.candidate for e in ranked}) == len(ranked)
    assert rank(ranked) == ranked


def test_every_pruned_split_records_the_first_rule_it_breaks() -> None:
    inp = inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=2, bubble_ratio_threshold=0.01,
                 allowed_pp=(1, 2, 4, 7), train_micro_batch_size=4)
    plan = search(inp)
    recorded: dict[tuple[TrainLayout | None, int], str] = {}
    for p in plan.pruned:
        if p.kind == "train_layout":
            for t in plan.splits:
                recorded[(p.layout, t)] = p.code
        elif p.kind == "train_split":
            for t in p.train_gpus or plan.splits:
                recorded[(p.layout, t)] = p.code
    s = inp.space
    for layout in enumerate_layouts(s.allowed_tp, s.allowed_pp, s.allowed_cp, s.allowed_ep, 1):
        for t in plan.splits:
            ev = evaluate(inp, Candidate(t, inp.cluster.total_gpus - t, layout, 1))
            train_codes = [v.code for v in ev.violations if not v.code.startswith("rollout")]
            assert recorded.get((layout, t)) == (train_codes[0] if train_codes else None), (layout, t)
    assert set(plan.pruned_counts()) >= {"bubble_ratio", "tp_heads", "split_divisibility", "train_memory",
                                         "batch_divisibility"}


def test_search_is_deterministic() -> None:
    inp = inputs("qwen3-30b-a3b", nodes=2, allocation_granularity_gpus=4, max_head_offpolicyness=1)
    first, second = plan_dict(search(inp), explain=True), plan_dict(search(inp), explain=True)
    first.pop("search_s")
    second.pop("search_s")
    assert first == second


def test_async_runs_are_at_least_as_fast_as_sync() -> None:
    sync = search(inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=4))
    asyn = search(inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=4, max_head_offpolicyness=1))
    assert asyn.chosen is not None and sync.chosen is not None
    assert asyn.chosen.samples_per_s >= sync.chosen.samples_per_s
    assert asyn.mode == "async" and sync.mode == "sync"


def test_split_sizes_follow_granularity_and_minimums() -> None:
    inp = inputs(nodes=4, allocation_granularity_gpus=8, min_train_gpus=9, min_rollout_gpus=8)
    assert split_sizes(inp).tolist() == [16, 24]


def _pinned(inp: PlannerInputs, **pin: int) -> PlannerInputs:
    return replace(inp, space=replace(inp.space, strategy="configured", pinned=PinnedLayout(**pin)))


def test_configured_keeps_the_pinned_split_and_reports_memory() -> None:
    inp = _pinned(inputs("qwen2.5-7b"), train_gpus=4, rollout_gpus=4, tp=2, rollout_tp=1)
    plan = search(inp)
    assert plan.strategy == "configured" and plan.feasible
    assert plan.chosen is not None
    c = plan.chosen.candidate
    assert (c.train_gpus, c.rollout_gpus, c.layout.tp, c.rollout_tp) == (4, 4, 2, 1)
    assert plan.chosen.train_memory.peak_bytes > 0 and plan.candidates_evaluated == 1


def test_configured_threshold_breaches_are_warnings_not_errors() -> None:
    inp = _pinned(inputs("qwen2.5-7b", bubble_ratio_threshold=0.001), train_gpus=4, rollout_gpus=4, pp=4)
    plan = plan_with_advice(inp)
    assert plan.feasible
    assert any(w.startswith("bubble_ratio") for w in plan.warnings)


def test_configured_split_that_does_not_fit_says_what_to_change() -> None:
    inp = _pinned(inputs("qwen2.5-7b", train_micro_batch_size=2), train_gpus=4, rollout_gpus=4, tp=1)
    plan = plan_with_advice(inp)
    assert not plan.feasible and plan.chosen is not None
    assert not plan.chosen.train_memory.fits
    text = "\n".join(plan.suggestions)
    assert text.startswith("train_memory: training peak")
    assert "initial_allocation_strategy: grp would choose" in text


def test_single_option_fixes_are_verified_by_a_search() -> None:
    inp = _pinned(inputs("qwen2.5-7b", use_distributed_optimizer=False), train_gpus=4, rollout_gpus=4, tp=2)
    plan = plan_with_advice(inp)
    assert not plan.feasible
    fix = "megatron_optimizer_cpu_offload: true with megatron_optimizer_offload_fraction: 1.0 makes it plan"
    assert any(s.startswith(fix) for s in plan.suggestions)
    offloaded = replace(inp, train=replace(inp.train, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0))
    assert search(offloaded).feasible


def test_configured_structural_error_is_reported() -> None:
    plan = plan_with_advice(_pinned(inputs("qwen2.5-7b"), train_gpus=3, rollout_gpus=5, tp=3))
    assert not plan.feasible
    assert any(s.startswith("tp_heads") for s in plan.suggestions)


LLAMA_405B = {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
              "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256}


def test_405b_on_one_node_is_infeasible_with_a_memory_explanation() -> None:
    spec = model_spec_from_dict(LLAMA_405B, name="llama-405b")
    plan = plan_with_advice(inputs(spec, allowed_pp=(1, 2, 3, 6, 7, 9, 14, 18, 21)))
    assert not plan.feasible and plan.chosen is None
    text = "\n".join(plan.suggestions)
    assert "training state alone" in text and "per GPU" in text
    assert "rollout TP 8" in text  # the bf16 weights do not fit one 8-GPU instance either


def test_infeasible_advice_finds_a_cluster_that_works() -> None:
    plan = plan_with_advice(inputs("qwen2.5-32b", nodes=1, gpus_per_node=2, gpu="A100", allowed_tp=(1, 2)))
    assert not plan.feasible
    assert any(s.startswith("cluster.num_nodes:") for s in plan.suggestions)


@pytest.mark.parametrize(("layout", "gpn", "backend", "code"), [
    (TrainLayout(tp=3), 8, "flash", "tp_heads"),
    (TrainLayout(pp=4), 8, "flash", "pp_layers"),
    (TrainLayout(ep=2), 8, "flash", "ep_dense"),
    (TrainLayout(tp=16), 16, "flash", "tp_kv_heads"),
    (TrainLayout(tp=4), 2, "flash", "tp_node"),
    (TrainLayout(pp=2, vpp=2), 8, "flash", "pp_layers"),
    (TrainLayout(cp=2), 8, "eager", "cp_backend"),
    (TrainLayout(tp=2), 8, "flash", None),
])
def test_layout_rules_name_the_broken_divisibility(layout: TrainLayout, gpn: int, backend: str,
                                                   code: str | None) -> None:
    rule = layout_rule_violation(dense(num_hidden_layers=6), layout, gpn, 4096, backend)
    assert (rule.code if rule else None) == code


def test_expert_count_must_divide_by_ep() -> None:
    rule = layout_rule_violation(model("qwen3-30b-a3b"), TrainLayout(ep=3), 8, 4096, "flash")
    assert rule is not None and rule.code == "ep_experts"
    assert set(SPLIT_CODES) >= {"train_memory", "bubble_ratio", "batch_divisibility"}
