"""libra.planning: Config -> planner inputs (with the documented derivations) and the recompute-probe check."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from libra.config import load
from libra.planning import (
    RecomputeProbe,
    compare_recompute_probe,
    derived_ep,
    derived_pp,
    derived_tp,
    plan_job,
    planner_inputs,
    recompute_estimate,
)
from planner.layout import TrainLayout
from planner.model_spec import load_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONFIGS = os.path.join(ROOT, "configs")


def test_gpu_job_maps_every_planner_option() -> None:
    cfg = load(os.path.join(CONFIGS, "qwen2.5-7b-8gpu.yaml"))
    inp = planner_inputs(cfg)
    w, t, s, b = inp.workload, inp.train, inp.space, inp.budget
    assert (w.batch_size, w.n_samples, w.max_model_len, w.max_new_tokens) == (32, 8, 4096, 3072)
    assert (w.train_micro_batch_size, w.recompute_micro_batch_size, w.max_head_offpolicyness) == (1, 2, 1)
    assert t.use_distributed_optimizer and t.recompute_granularity == "selective"
    assert (t.implementation, t.attention_backend, t.fused_optimizer) == ("megatron", "flash", True)
    assert b.safety_margin_bytes == cfg.global_resource_planner.memory_budget_safety_margin_bytes
    assert b.workspace_factor == cfg.global_resource_planner.memory_budget_workspace_factor
    assert s.allowed_tp == (1, 2, 4)
    assert s.allowed_pp == (1, 2, 4, 7, 14, 28)  # divisors of 28 layers
    assert s.allocation_granularity_gpus == 1  # 0 on a single node: every GPU
    assert s.pinned is not None and (s.pinned.train_gpus, s.pinned.tp) == (4, 2)
    assert inp.cluster.gpu.name == "H100-SXM-80GB" and inp.rollout.reload_method == "inplace"


def test_cpu_dev_job_uses_eager_attention_fp32_and_the_explicit_kv_cache() -> None:
    inp = planner_inputs(load(os.path.join(CONFIGS, "dev.yaml")))
    assert inp.train.attention_backend == "eager" and not inp.train.fused_optimizer
    assert inp.train.params_dtype_bytes == 4 and inp.train.main_params_bytes == 0
    assert inp.rollout.kv_cache_bytes == 64 * 2**20
    assert inp.model.num_layers == 2 and inp.model.hidden_size == 64  # from build_tiny_model
    assert inp.space.allowed_tp == (1,)  # TP must divide the single KV head


def test_overrides_reach_the_planner() -> None:
    cfg = load(os.path.join(CONFIGS, "qwen2.5-32b-32gpu.yaml"),
               ["global_resource_planner.allowed_train_tp=[8]", "global_resource_planner.min_train_gpus=16"])
    plan = plan_job(cfg)
    assert plan.feasible and plan.chosen is not None
    assert plan.chosen.candidate.layout.tp == 8 and plan.chosen.candidate.train_gpus >= 16


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_derived_degrees_respect_the_model(name: str) -> None:
    spec = load_model_spec(os.path.join(CONFIGS, "models", name))
    assert all(spec.num_attention_heads % t == 0 and spec.num_kv_heads % t == 0 for t in derived_tp(spec, 8))
    assert all(spec.num_layers % p == 0 for p in derived_pp(spec))
    assert all(not spec.is_moe and e == 1 or spec.num_experts % e == 0 for e in derived_ep(spec))


def _probe_setup():  # type: ignore[no-untyped-def]
    inp = planner_inputs(load(os.path.join(CONFIGS, "qwen2.5-7b-8gpu.yaml")))
    layout = TrainLayout(tp=2)
    est = recompute_estimate(inp, layout, 2, micro_batch=1, seq_len=2048)
    resident = est.phase_bytes("static")
    transient = max(est.phase_bytes("logprob_recompute"), est.phase_bytes("logprob_forward"))
    return inp, layout, resident, transient


def test_probe_that_matches_the_estimate_is_ok_and_projects_to_full_context() -> None:
    inp, layout, resident, transient = _probe_setup()
    result = compare_recompute_probe(inp, layout, 2, RecomputeProbe(resident, resident + transient, 1, 2048))
    assert result.ok and abs(result.rel_error) < 1e-9
    full = recompute_estimate(inp, layout, 2, inp.workload.recompute_micro_batch_size, inp.workload.max_model_len)
    expected = resident + max(full.phase_bytes("logprob_recompute"), full.phase_bytes("logprob_forward"))
    assert result.projected_peak_bytes == pytest.approx(expected + inp.budget.safety_margin_bytes, rel=1e-6)


def test_probe_far_above_the_estimate_names_the_workspace_factor() -> None:
    inp, layout, resident, transient = _probe_setup()
    result = compare_recompute_probe(inp, layout, 2, RecomputeProbe(resident, resident + 2 * transient, 1, 2048))
    assert not result.ok and result.rel_error == pytest.approx(-0.5, rel=1e-6)
    # the implied factor is the one whose estimate reproduces the measurement
    implied = replace(inp, budget=replace(inp.budget, workspace_factor=result.implied_workspace_factor))
    again = recompute_estimate(implied, layout, 2, micro_batch=1, seq_len=2048)
    assert again.phase_bytes("logprob_recompute") == pytest.approx(2 * transient, rel=1e-6)
    assert "memory_budget_workspace_factor" in result.message
