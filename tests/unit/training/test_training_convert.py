"""HF <-> Megatron conversion: architecture parsing, shard layouts on hand-built tensors, round trips over TP
sizes, and the parameter table of a chunk."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from libra.training.convert import chunk_mappings, hf_from_shards, shard_from_hf
from libra.training.hf_arch import UnsupportedArchitectureError, padded_vocab_size, training_spec_from_config
from planner.model_spec import ModelSpec

ARCH = ModelSpec(
    name="qwen2-tiny", model_type="qwen2", vocab_size=11, hidden_size=4, num_layers=4, num_attention_heads=4,
    num_kv_heads=2, head_dim=1, intermediate_size=4, max_position_embeddings=32, rms_norm_eps=1e-6,
    rope_theta=1e4, attention_bias=True,
)

BASE_CFG = {
    "model_type": "llama", "vocab_size": 219, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "max_position_embeddings": 512,
}
ARCH_CASES = {
    "llama-top-level-theta": ({**BASE_CFG, "rope_theta": 5e5}, dict(rope_theta=5e5, attention_bias=False, head_dim=16)),
    "qwen2-has-qkv-bias": ({**BASE_CFG, "model_type": "qwen2"}, dict(attention_bias=True, qk_norm=False)),
    "qwen3-rope-parameters-head-dim": (
        {**BASE_CFG, "model_type": "qwen3", "head_dim": 32, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
        dict(qk_norm=True, head_dim=32, rope_theta=1e6),
    ),
    "qwen3-moe-local-experts-alias": (
        {**BASE_CFG, "model_type": "qwen3_moe", "num_local_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "norm_topk_prob": False},
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    ),
    "kv-heads-default-to-heads": ({k: v for k, v in BASE_CFG.items() if k != "num_key_value_heads"}, dict(num_kv_heads=4)),
}


@pytest.mark.parametrize("cfg,expected", ARCH_CASES.values(), ids=ARCH_CASES.keys())
def test_training_reads_config_json_with_the_one_parser(cfg: dict, expected: dict) -> None:
    spec = training_spec_from_config(cfg)
    for key, value in expected.items():
        assert getattr(spec, key) == value, key


UNSUPPORTED = {
    "gpt2": ({**BASE_CFG, "model_type": "gpt2"}, "model_type 'gpt2': training has no HF <-> Megatron-Core"),
    "mixtral": ({**BASE_CFG, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
                "model_type 'mixtral' (Mixtral MoE): training has no HF <-> Megatron-Core"),
    "gelu": ({**BASE_CFG, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "rope-scaling": ({**BASE_CFG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    "llama-attention-bias": ({**BASE_CFG, "attention_bias": True}, "attention_bias=true"),
    "sliding-window": ({**BASE_CFG, "use_sliding_window": True}, "use_sliding_window"),
    "uneven-gqa": ({**BASE_CFG, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    "no-max-positions": ({k: v for k, v in BASE_CFG.items() if k != "max_position_embeddings"},
                         "max_position_embeddings is missing"),
    "moe-dense-layers": ({**BASE_CFG, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                          "mlp_only_layers": [0]}, "with dense layers"),
}


@pytest.mark.parametrize("cfg,message", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_architectures(cfg: dict, message: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=message.replace("(", r"\(").replace(")", r"\)")):
        training_spec_from_config(cfg)


def test_every_feature_gap_is_named_at_once() -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        training_spec_from_config({**BASE_CFG, "hidden_act": "gelu", "mlp_bias": True})
    assert "hidden_act 'gelu'" in str(info.value) and "mlp_bias=true" in str(info.value)


@pytest.mark.parametrize("vocab,tp,padded", [(219, 1, 219), (219, 2, 220), (220, 4, 220), (219, 8, 224)])
def test_padded_vocab(vocab: int, tp: int, padded: int) -> None:
    assert padded_vocab_size(vocab, tp) == padded


def test_qkv_layout_groups_query_heads_with_their_kv_head() -> None:
    """4 query heads, 2 KV groups, head_dim 1: rows are [q0 q1 k0 v0 | q2 q3 k1 v1]; TP2 takes one group."""
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    full = shard_from_hf("qkv", [q, k, v], ARCH, 0, 1)
    assert full.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert shard_from_hf("qkv", [q, k, v], ARCH, 1, 2).flatten().tolist() == [12, 13, 21, 31]
    bias = shard_from_hf("qkv", [q.flatten(), k.flatten(), v.flatten()], ARCH, 0, 2)
    assert bias.tolist() == [10, 11, 20, 30]


def test_gated_fc1_puts_gate_slice_above_up_slice() -> None:
    gate = torch.arange(4.0).unsqueeze(1)
    up = torch.arange(10.0, 14.0).unsqueeze(1)
    assert shard_from_hf("gated", [gate, up], ARCH, 1, 2).flatten().tolist() == [2, 3, 12, 13]


def test_vocab_padding_rows_are_zero_and_dropped_on_export() -> None:
    emb = torch.arange(11 * 2, dtype=torch.float32).reshape(11, 2) + 1
    shards = [shard_from_hf("vocab", [emb], ARCH, r, 4) for r in range(4)]
    assert [s.shape[0] for s in shards] == [3, 3, 3, 3]
    assert shards[3][2].abs().sum() == 0
    assert torch.equal(hf_from_shards("vocab", shards, ARCH)[0], emb)


KIND_SHAPES = {
    "replicated": [(4,)],
    "vocab": [(11, 4)],
    "row": [(4, 8)],
    "qkv": [(4, 4), (2, 4), (2, 4)],
    "qkv-bias": [(4,), (2,), (2,)],
    "gated": [(8, 4), (8, 4)],
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind,shapes", KIND_SHAPES.items(), ids=KIND_SHAPES.keys())
def test_round_trip(kind: str, shapes: list[tuple[int, ...]], tp: int) -> None:
    torch.manual_seed(0)
    hf = [torch.randn(*s) for s in shapes]
    kind = kind.removesuffix("-bias")
    shards = [shard_from_hf(kind, hf, ARCH, r, tp) for r in range(tp)]
    back = hf_from_shards(kind, shards, ARCH)
    assert len(back) == len(hf)
    for a, b in zip(back, hf, strict=True):
        assert torch.equal(a, b)


def test_chunk_mappings_of_a_middle_pipeline_stage() -> None:
    maps = chunk_mappings(ARCH, layer_offset=2, num_local_layers=2, pre_process=False, post_process=True)
    names = {m.megatron: m for m in maps}
    assert "embedding.word_embeddings.weight" not in names
    assert names["decoder.layers.0.input_layernorm.weight"].hf == ("model.layers.2.input_layernorm.weight",)
    assert names["decoder.layers.1.self_attention.linear_qkv.bias"].hf[2] == "model.layers.3.self_attn.v_proj.bias"
    assert names["output_layer.weight"].hf == ("lm_head.weight",)


def test_chunk_mappings_tied_and_moe() -> None:
    arch = replace(ARCH, tie_word_embeddings=True, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                   attention_bias=False)
    maps = chunk_mappings(arch, 0, 1, pre_process=True, post_process=True, ep_rank=1, ep_size=2)
    names = {m.megatron: m for m in maps}
    assert names["output_layer.weight"].hf == ("model.embed_tokens.weight",)
    fc1 = names["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.0.mlp.experts.2.gate_proj.weight", "model.layers.0.mlp.experts.2.up_proj.weight")
    assert fc1.expert
    assert names["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)
