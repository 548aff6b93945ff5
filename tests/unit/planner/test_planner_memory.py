"""Memory model: named terms, sharding, offload, recomputation, budget gating, pipeline stages, rollout KV."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from planner_cases import dense, inputs, model

from planner.layout import TrainLayout
from planner.memory import (
    MOMENTS,
    kv_bytes_per_token,
    kv_capacity_sequences,
    rollout_memory,
    stage_params,
    train_memory,
    train_peak_bytes,
)
from planner.workload import MemoryBudget

GB = 1e9


def test_every_term_is_named_and_the_peak_is_static_plus_the_largest_moment() -> None:
    est = train_memory(inputs(), TrainLayout(tp=2), dp=2)
    names = {t.name for t in est.terms}
    assert {"weights", "gradients", "optimizer_state", "activations", "loss_logits", "loss_logits_grad",
            "logprob_recompute_logits", "logprob_forward_workspace", "layer_backward_workspace",
            "safety_margin"} <= names
    moments = {m: est.phase_bytes(m) for m in MOMENTS}
    assert est.peak_phase == max(moments, key=lambda m: moments[m])
    assert est.peak_bytes == est.phase_bytes("static") + est.phase_bytes("reserve") + max(moments.values())


def test_mixed_precision_state_is_18_bytes_per_parameter_without_sharding() -> None:
    inp = inputs(use_distributed_optimizer=False)
    est = train_memory(inp, TrainLayout(), dp=4)
    params = stage_params(inp.model, TrainLayout(), "megatron", True, True).total
    assert est.term("weights").bytes == pytest.approx(2 * params, rel=1e-9)
    assert est.term("gradients").bytes == pytest.approx(4 * params, rel=1e-9)
    assert est.term("optimizer_state").bytes == pytest.approx(12 * params, rel=1e-9)


def test_distributed_optimizer_shards_the_optimizer_over_data_parallel() -> None:
    inp = inputs()
    one = train_memory(inp, TrainLayout(), dp=1).term("optimizer_state").bytes
    four = train_memory(inp, TrainLayout(), dp=4).term("optimizer_state").bytes
    assert four == pytest.approx(one / 4, rel=1e-6)


def test_precision_aware_optimizer_keeps_bf16_moments() -> None:
    plain = train_memory(inputs(), TrainLayout(), dp=1).term("optimizer_state").bytes
    aware = train_memory(inputs(precision_aware_optimizer=True), TrainLayout(), dp=1).term("optimizer_state").bytes
    assert aware == pytest.approx(plain * 8 / 12, rel=1e-6)


def test_offload_moves_the_fraction_to_host_memory() -> None:
    base = train_memory(inputs(), TrainLayout(), dp=2)
    half = train_memory(inputs(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5), TrainLayout(), dp=2)
    assert half.term("optimizer_state").bytes == pytest.approx(base.term("optimizer_state").bytes / 2, rel=1e-6)
    assert half.host_bytes == pytest.approx(base.term("optimizer_state").bytes / 2, rel=1e-6)
    assert half.peak_bytes < base.peak_bytes


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recomputation_lowers_kept_activations(granularity: str) -> None:
    spec = dense(num_hidden_layers=16)
    none = train_memory(inputs(spec, attention_backend="eager"), TrainLayout(), dp=1)
    less = train_memory(inputs(spec, attention_backend="eager", recompute_granularity=granularity), TrainLayout(), dp=1)
    assert less.term("activations").bytes < none.term("activations").bytes
    if granularity == "full":
        assert less.term("recompute_layer_workspace").bytes > 0


def test_recompute_logits_follow_the_configured_formula_and_gate() -> None:
    inp = inputs(recompute_micro_batch_size=2)
    inp = replace(inp, budget=MemoryBudget(logits_dtype_bytes=4, workspace_factor=3.0))
    est = train_memory(inp, TrainLayout(tp=4), dp=1)
    vocab = inp.model.vocab_size  # 152064 is a multiple of 128 * 4: no padding
    # fp32 temporaries x workspace factor, plus the model's bf16 logits beside their fp32 copy
    assert est.term("logprob_recompute_logits").bytes == 2 * 4096 * vocab / 4 * (4 * 3 + 2)
    off = train_memory(replace(inp, budget=MemoryBudget(check_enabled=False)), TrainLayout(tp=4), dp=1)
    term = off.term("logprob_recompute_logits")
    assert not term.counted and term.bytes > 0
    assert off.phase_bytes("logprob_recompute") == 0


def test_no_recompute_logprobs_no_recompute_terms() -> None:
    est = train_memory(inputs(recompute_logprobs=False), TrainLayout(), dp=1)
    assert not [t for t in est.terms if t.phase.startswith("logprob")]


def test_safety_margin_is_reserved() -> None:
    inp = replace(inputs(), budget=MemoryBudget(safety_margin_bytes=3 * 2**30))
    est = train_memory(inp, TrainLayout(), dp=1)
    assert est.term("safety_margin").bytes == 3 * 2**30
    assert est.phase_bytes("reserve") == 3 * 2**30


def test_pipeline_first_stage_holds_more_micro_batches_last_stage_the_logits() -> None:
    inp = inputs()
    est = train_memory(inp, TrainLayout(pp=4), dp=1)
    assert est.where in ("the first pipeline stage", "the last pipeline stage")
    first = train_peak_bytes(inp, TrainLayout(pp=4), 1)
    assert est.peak_bytes == pytest.approx(float(first), rel=1e-9)


def test_interleaving_adds_in_flight_activations() -> None:
    inp = inputs("qwen2.5-32b")
    plain = train_memory(inp, TrainLayout(pp=4), dp=2).term("activations").bytes
    inter = train_memory(replace(inp, train=replace(inp.train, vpp=2)), TrainLayout(pp=4, vpp=2), dp=2)
    # Korthikanti et al.: the first stage holds (1 + (p - 1) / (p v)) times the 1F1B activations
    assert inter.term("activations").bytes == pytest.approx(plain * (1 + 3 / 8), rel=1e-9)


def test_vectorized_peak_equals_scalar_peak() -> None:
    inp = inputs("qwen3-30b-a3b")
    layout = TrainLayout(tp=2, pp=2, ep=4)
    dps = np.array([1, 2, 4, 8, 16])
    vector = train_peak_bytes(inp, layout, dps)
    scalar = [train_memory(inp, layout, int(d)).peak_bytes for d in dps]
    assert vector == pytest.approx(scalar, rel=1e-9)


def test_moe_experts_are_sharded_by_expert_parallelism() -> None:
    spec = model("qwen3-30b-a3b")
    one = stage_params(spec, TrainLayout(ep=1), "megatron", True, True)
    eight = stage_params(spec, TrainLayout(ep=8), "megatron", True, True)
    assert eight.expert == pytest.approx(one.expert / 8)
    assert eight.dense == one.dense


def test_tied_embeddings_are_counted_once_without_pipeline() -> None:
    tied, untied = dense(tie_word_embeddings=True), dense()
    diff = stage_params(untied, TrainLayout(), "hf", True, True).total - stage_params(tied, TrainLayout(), "hf",
                                                                                     True, True).total
    assert diff == 32000 * 1024


def test_rollout_kv_cache_per_token_and_capacity() -> None:
    spec = model("qwen2.5-7b")
    assert kv_bytes_per_token(spec, 1, 2) == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(spec, 8, 2) == 2 * 28 * 1 * 128 * 2  # 4 KV heads replicated over TP 8
    inp = inputs(spec)
    cap = kv_capacity_sequences(inp, 2)
    est = rollout_memory(inp, 2, cap)
    assert est.fits and cap > 0
    assert not rollout_memory(inp, 2, cap + 50).fits


def test_explicit_kv_cache_bytes_bound_the_admitted_sequences() -> None:
    inp = inputs("qwen2.5-7b", max_model_len=1024)
    inp = replace(inp, rollout=replace(inp.rollout, kv_cache_bytes=2**30))
    per_seq = kv_bytes_per_token(inp.model, 1, 2) * 1024
    assert kv_capacity_sequences(inp, 1) == int(2**30 // per_seq)
