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
