"""The HF architecture facts the training pool needs, read from a model directory's `config.json`.

Supported families: Llama (`llama`), Qwen2 (`qwen2`, q/k/v bias), Qwen3 dense (`qwen3`, q/k RMSNorm) and
Qwen3 MoE (`qwen3_moe`). Anything else, or a feature the Megatron model here does not reproduce (rope
scaling, sliding windows, biases on MLP or output projections), is refused with the field that caused it,
because a silently different model would train the wrong thing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


class UnsupportedArchitectureError(ValueError):
    """The HF config describes a model the Megatron conversion does not reproduce exactly."""


@dataclass(frozen=True)
class HFArch:
    """Shape and options of a decoder-only HF model, in HF terms."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_theta(cfg: dict[str, Any], path: str) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedArchitectureError(
            f"{path}: rope type '{rope_type}' is not supported by the Megatron conversion; "
            "use a model with default RoPE (no rope_scaling)"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def arch_from_config(cfg: dict[str, Any], path: str = "config.json") -> HFArch:
    """Validate an HF config dict and return its `HFArch`."""
    model_type = str(cfg.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"{path}: model_type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"{path}: hidden_act '{act}' is not supported; only 'silu'")
    if cfg.get("mlp_bias"):
        raise UnsupportedArchitectureError(f"{path}: mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise UnsupportedArchitectureError(f"{path}: use_sliding_window=true is not supported")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedArchitectureError(
            f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if model_type != "qwen2" and cfg.get("attention_bias"):
        # attention_bias also puts a bias on o_proj, which Megatron's linear_proj does not carry here.
        raise UnsupportedArchitectureError(f"{path}: attention_bias=true (o_proj bias) is not supported")
    qkv_bias = model_type == "qwen2"
    num_experts = 0
    moe_ffn = 0
    topk = 0
    if model_type == "qwen3_moe":
        num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
        moe_ffn = int(cfg["moe_intermediate_size"])
        topk = int(cfg["num_experts_per_tok"])
        if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
            raise UnsupportedArchitectureError(
                f"{path}: qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported"
            )
    return HFArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(cfg.get("intermediate_size") or 0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn,
        moe_topk=topk,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )


def read_hf_arch(model_path: str) -> HFArch:
    """Read `<model_path>/config.json`."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model_path '{model_path}' has no config.json; point it at an HF model directory")
    with open(path, encoding="utf-8") as fh:
        return arch_from_config(json.load(fh), path)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of `tp` >= `vocab_size`: the vocab-parallel embedding needs equal shards.

    The padded rows are zero in the embedding and the output layer and are masked out of every softmax,
    so log-probs equal those of the unpadded HF model.
    """
    return -(-vocab_size // tp) * tp
