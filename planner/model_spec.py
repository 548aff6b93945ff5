"""Model architecture facts, read from a Hugging Face `config.json`: the one parser of that file.

Owns `ModelSpec` (dense, GQA, MoE with shared experts, tied embeddings, and the numerics the training
workers build the Megatron-Core model from: RMSNorm epsilon, RoPE, router normalisation) and
`load_model_spec`. Which model types each layer supports is `planner.architectures`; this module records
facts, it refuses only a file that lacks a needed field. Pure: stdlib only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


class ModelSpecError(ValueError):
    """A `config.json` that is missing, unreadable or lacks a needed field."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as far as memory and cost models need it."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layer_freq: int = 1
    dense_layers: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections
    output_bias: bool = False  # bias on the attention output projection (o_proj)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    sliding_window: bool = False
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_kv_heads

    @cached_property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return sum(1 for i in range(self.num_layers) if self.layer_is_moe(i))

    def layer_is_moe(self, layer: int) -> bool:
        if not self.is_moe or layer in self.dense_layers:
            return False
        return (layer + 1) % max(1, self.moe_layer_freq) == 0

    @property
    def attention_params_per_layer(self) -> int:
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * self.hidden_size
        bias = (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        bias += self.hidden_size if self.output_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return q + kv + o + bias + norms + 2 * self.hidden_size  # + input/post-attention RMSNorm

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down (SwiGLU)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def moe_mlp_params(self) -> int:
        router = self.hidden_size * self.num_experts
        shared = 3 * self.hidden_size * self.shared_expert_intermediate_size * max(1, self.num_shared_experts) \
            if self.shared_expert_intermediate_size else 0
        return self.num_experts * self.expert_params + router + shared

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @cached_property
    def total_params(self) -> int:
        layers = 0
        for i in range(self.num_layers):
            layers += self.attention_params_per_layer
            layers += self.moe_mlp_params if self.layer_is_moe(i) else self.dense_mlp_params
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return layers + self.embedding_params + head + self.hidden_size  # + final norm

    @cached_property
    def active_params(self) -> int:
        """Parameters touched per token (MoE: only the routed top-k and shared experts)."""
        if not self.is_moe:
            return self.total_params
        inactive_per_moe_layer = (self.num_experts - self.num_experts_per_tok) * self.expert_params
        return self.total_params - self.num_moe_layers * inactive_per_moe_layer


def _require(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg:
        raise ModelSpecError(f"{source}: field '{key}' is missing; a decoder-only HF config.json must set it")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[str, float]:
    """RoPE type and base: `rope_parameters` (transformers >= 5) or `rope_scaling` + top-level `rope_theta`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return str(rope_type), float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def model_spec_from_dict(cfg: dict[str, Any], name: str = "model", source: str = "config.json") -> ModelSpec:
    """Build a `ModelSpec` from the parsed contents of an HF `config.json`."""
    cfg = dict(cfg.get("text_config", cfg))
    model_type = str(cfg.get("model_type", "unknown"))
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts", 0))) or 0)
    mlp_only = tuple(int(x) for x in cfg.get("mlp_only_layers", []) or [])
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    shared_inter = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
    n_shared = int(cfg.get("n_shared_experts", 1 if shared_inter else 0) or 0)
    if n_shared and not shared_inter:
        shared_inter = int(cfg.get("moe_intermediate_size", 0)) * n_shared
        n_shared = 1
    rope_type, rope_theta = _rope(cfg)
    # Qwen2 always has q/k/v biases and no o_proj bias; elsewhere attention_bias puts a bias on q, k, v and o.
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        name=name,
        model_type=model_type,
        num_layers=int(_require(cfg, "num_hidden_layers", source)),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads) or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        vocab_size=int(_require(cfg, "vocab_size", source)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 0) or 0),
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 0)) or 0)
        if num_experts else 0,
        num_shared_experts=n_shared,
        shared_expert_intermediate_size=shared_inter,
        moe_layer_freq=int(cfg.get("decoder_sparse_step", cfg.get("moe_layer_freq", 1)) or 1),
        dense_layers=tuple(sorted(set(mlp_only) | set(range(first_dense)))),
        qk_norm=model_type.startswith("qwen3"),
        attention_bias=model_type == "qwen2" or attention_bias,
        output_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_type=rope_type,
        sliding_window=bool(cfg.get("use_sliding_window", False)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )


def load_model_spec(path: str) -> ModelSpec:
    """Read `path` (a directory holding `config.json`, or the file itself) into a `ModelSpec`."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ModelSpecError(f"no HF config.json at '{file}': point model_path at a directory that holds one")
    try:
        with open(file, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"cannot read '{file}': {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelSpecError(f"'{file}' must hold a JSON object")
    name = os.path.basename(os.path.dirname(os.path.abspath(file))) or "model"
    return model_spec_from_dict(cfg, name=name, source=file)
