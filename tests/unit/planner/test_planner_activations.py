"""Per-token activation formulas: hand-computed values for a small shape, and how backends differ."""

from __future__ import annotations

import pytest
from planner_cases import dense, model

from planner import activations as act


def test_hf_flash_dense_layer_matches_hand_count() -> None:
    spec = dense(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2)
    parts = act.layer_parts(spec, act.RankShape(implementation="hf", attention_backend="flash"), 1024, moe=False)
    h, inter, a, kv, d = 512, 2048, 8, 2, 64
    assert parts == {
        "attn_norm": 4 * h + 4 + 2 * h, "qkv_input": 2 * h, "q_k_v": 2 * d * (a + 2 * kv), "attn_out": 2 * a * d,
        "softmax_stats": 4 * a, "mlp_norm": 4 * h + 4 + 2 * h, "mlp_input": 2 * h, "mlp": 8 * inter,
    }


def test_eager_attention_keeps_scores_that_grow_with_the_sequence() -> None:
    spec = dense()
    flash = act.RankShape(implementation="hf", attention_backend="flash")
    eager = act.RankShape(implementation="hf", attention_backend="eager")
    short, long = (sum(act.layer_parts(spec, eager, s, moe=False).values()) for s in (1024, 2048))
    assert long - short == (4 + 2) * spec.num_attention_heads * 1024
    f1, f2 = (sum(act.layer_parts(spec, flash, s, moe=False).values()) for s in (1024, 2048))
    assert f1 == f2 < short


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_sequence_parallel_splits_everything_by_tp(tp: int) -> None:
    spec = dense(num_key_value_heads=8)
    one = sum(act.layer_parts(spec, act.RankShape(tp=1, sequence_parallel=True), 4096, moe=False).values())
    many = sum(act.layer_parts(spec, act.RankShape(tp=tp, sequence_parallel=True), 4096, moe=False).values())
    assert many == pytest.approx(one / tp)


def test_hf_without_sequence_parallel_keeps_norms_whole() -> None:
    spec = dense()
    parts = act.layer_parts(spec, act.RankShape(tp=4, implementation="hf"), 4096, moe=False)
    assert parts["attn_norm"] == 6 * spec.hidden_size + 4
    assert parts["mlp"] == 8 * spec.intermediate_size / 4


def test_moe_layer_counts_routed_copies_and_router() -> None:
    spec = model("qwen3-30b-a3b")
    parts = act.layer_parts(spec, act.RankShape(implementation="hf"), 2048, moe=True)
    k, e, h, inter = 8, 128, 2048, 768
    assert parts["router"] == 4 * e + 8 * k
    assert parts["moe_experts"] == k * 4 * 2 * inter
    assert parts["moe_dispatch"] == k * (4 * h + 2 + 24)
    assert "qk_norm" in parts and "mlp" not in parts


def test_full_recompute_keeps_only_the_layer_input() -> None:
    spec = dense()
    assert act.full_recompute_layer_bytes(spec, act.RankShape(tp=4, sequence_parallel=True)) == 2 * 1024 / 4


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    spec = dense(num_key_value_heads=2)
    parts = act.layer_parts(spec, act.RankShape(tp=8, sequence_parallel=True), 4096, moe=False)
    assert parts["q_k_v"] == 2 * 64 * (16 / 8 + 2 * 1)


@pytest.mark.parametrize(
    ("implementation", "backend"),
    [pytest.param("megatron", "flash", id="megatron-flash"), pytest.param("megatron", "eager", id="megatron-eager"),
     pytest.param("hf", "flash", id="hf-flash"), pytest.param("hf", "eager", id="hf-eager")],
)
def test_fp32_training_doubles_the_activation_tensors_but_not_fp32_statistics(implementation: str,
                                                                             backend: str) -> None:
    spec = dense(num_key_value_heads=2)
    bf16 = act.RankShape(implementation=implementation, attention_backend=backend, act_bytes=2)
    fp32 = act.RankShape(implementation=implementation, attention_backend=backend, act_bytes=4)
    half, full = (act.layer_parts(spec, shape, 1024, moe=False) for shape in (bf16, fp32))
    norm, first = ("norms", "q_k_v") if act.is_megatron_local(bf16) else ("attn_norm", "qkv_input")
    assert full[first] == 2 * half[first] and full["mlp"] == 2 * half["mlp"]
    assert full[norm] < 2 * half[norm]  # the inverse RMS (and hf's input copy) are fp32 anyway
    if backend == "flash":
        assert full["softmax_stats"] == half["softmax_stats"]


@pytest.mark.parametrize(
    ("act_bytes", "per_score"),
    [pytest.param(4, 12, id="fp32-buffer-scores-probs"), pytest.param(2, 14, id="bf16-plus-fp32-softmax-and-cast")],
)
def test_megatron_local_attention_peak_hand_count(act_bytes: int, per_score: int) -> None:
    spec = dense(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    shape = act.RankShape(attention_backend="eager", act_bytes=act_bytes)
    h, a, kv, d, s = 128, 4, 2, 32, 128
    assert act.megatron_eager_scores_bytes(shape) == per_score
    # layer input, norm output, embedding output; qkv output, query copy, rotated q and k, repeated k and v,
    # context and its contiguous copy; then the scores
    hidden = 3 * h + (a + 2 * kv) * d + a * d + (a + kv) * d + 2 * a * d + 2 * a * d
    assert act.forward_workspace_per_token(spec, shape, s) == act_bytes * hidden + per_score * a * s


def test_megatron_local_mlp_peak_hand_count_and_the_larger_phase_wins() -> None:
    spec = dense(hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    shape = act.RankShape(attention_backend="eager", act_bytes=4)
    h, a, inter = 128, 4, 512
    mlp = 4 * (4 * h + a * 64 + 5 * inter)  # hidden states, baddbmm buffer, fc1 (2I) + SiLU, add, product
    assert act.forward_workspace_per_token(spec, shape, 64) == mlp  # short sequence: the MLP peaks
    assert act.forward_workspace_per_token(spec, shape, 256) > 4 * (4 * h + a * 256 + 5 * inter)


@pytest.mark.parametrize(
    ("kv_heads", "query_copy"),
    [pytest.param(1, 0, id="one-group-reshape-is-a-view"), pytest.param(2, 1, id="two-groups-copy"),
     pytest.param(4, 0, id="mha-no-copy")],
)
def test_megatron_local_query_copy_only_with_several_groups(kv_heads: int, query_copy: int) -> None:
    spec = dense(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv_heads)
    shape = act.RankShape(attention_backend="eager", act_bytes=4)
    a, d, s = 4, 32, 512
    repeated = 2 * a * d if kv_heads < a else 0
    hidden = 3 * 128 + (a + 2 * kv_heads) * d + query_copy * a * d + (a + kv_heads) * d + repeated + 2 * a * d
    assert act.forward_workspace_per_token(spec, shape, s) == 4 * hidden + 12 * a * s
