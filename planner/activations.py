"""Activation bytes saved for backward, per token and per transformer layer, as named parts.

Two implementations and two attention backends are modelled, because the saved tensors differ:

* ``hf``: Hugging Face transformers modules (the code the memory benchmark runs). Derived op by op from
  what autograd saves: the RMSNorm keeps its fp32 input copy, the inverse RMS and the bf16 normalised
  value; every linear keeps its input; SwiGLU keeps gate, up, SiLU output and product; no sequence
  parallelism.
* ``megatron``: Megatron-Core with Transformer Engine layers (fused RMSNorm keeps its input and inverse
  RMS, fused SwiGLU keeps the fc1 output, fc2 keeps its input), sequence parallel when TP > 1, so the parts
  outside attention and MLP are split over TP (Korthikanti et al. 2022, adapted to GQA, SwiGLU and no
  dropout).

Attention: ``flash`` keeps q, k, v, the output and the fp32 log-sum-exp (O(s)); ``eager`` keeps the
(repeated) k and v, the fp32 softmax output and bf16 probabilities (O(s^2)).

Activations are counted in the training dtype (`RankShape.act_bytes`: 2 for bf16/fp16, 4 for fp32); fp32
statistics and copies stay 4 bytes whatever it is. All numbers are bytes per token of one micro-batch on one rank (the token count already divided by CP).
Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.model_spec import ModelSpec

ACT_BYTES = 2  # bf16 activations
FP32 = 4
INDEX = 8  # int64 routing indices


@dataclass(frozen=True)
class RankShape:
    """The slice of the model one rank computes."""

    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    implementation: str = "megatron"
    attention_backend: str = "flash"
    act_bytes: int = ACT_BYTES
    """Bytes of one activation element: the training dtype (bf16/fp16: 2, fp32: 4)."""

    @property
    def sp_divisor(self) -> int:
        """Divisor of the parts outside attention/MLP (LayerNorm inputs, residual) under sequence parallel."""
        return self.tp if (self.sequence_parallel and self.tp > 1 and self.implementation == "megatron") else 1


def _heads(spec: ModelSpec, shape: RankShape) -> tuple[float, float, float]:
    """(query heads, kv heads, head_dim) per rank; kv heads are replicated when TP exceeds them."""
    a = spec.num_attention_heads / shape.tp
    kv = max(1.0, spec.num_kv_heads / shape.tp)
    return a, kv, float(spec.head_dim)


def attention_parts(spec: ModelSpec, shape: RankShape, seq_len: int) -> dict[str, float]:
    """Norm before attention, q/k/v projections, the attention core and the output projection input."""
    h = float(spec.hidden_size)
    a, kv, d = _heads(spec, shape)
    sp = shape.sp_divisor
    parts: dict[str, float] = {}
    if shape.implementation == "hf":
        parts["attn_norm"] = FP32 * h + FP32 + shape.act_bytes * h  # fp32 input copy, inverse RMS, normalised value
        parts["qkv_input"] = shape.act_bytes * h
    else:
        parts["attn_norm"] = (shape.act_bytes * h + FP32) / sp
        parts["qkv_input"] = shape.act_bytes * h / sp
    if spec.qk_norm:
        norm_bytes = (FP32 + shape.act_bytes) if shape.implementation == "hf" else shape.act_bytes
        parts["qk_norm"] = norm_bytes * d * (a + kv) + FP32 * (a + kv)
    if shape.attention_backend == "flash":
        parts["q_k_v"] = shape.act_bytes * d * (a + 2 * kv)
        parts["attn_out"] = shape.act_bytes * a * d
        parts["softmax_stats"] = FP32 * a
    else:
        parts["q_k_v"] = shape.act_bytes * d * 3 * a  # k and v repeated to every query head
        if shape.implementation == "hf":
            parts["attn_scores"] = (FP32 + shape.act_bytes) * a * seq_len  # fp32 softmax output + probabilities
        else:
            parts["attn_scores"] = shape.act_bytes * a * seq_len  # fused scale-mask-softmax output
        parts["attn_out"] = shape.act_bytes * a * d
    return parts


def mlp_parts(spec: ModelSpec, shape: RankShape, moe: bool) -> dict[str, float]:
    """Norm before the MLP and the MLP (dense SwiGLU or routed experts)."""
    h = float(spec.hidden_size)
    sp = shape.sp_divisor
    parts: dict[str, float] = {}
    if shape.implementation == "hf":
        parts["mlp_norm"] = FP32 * h + FP32 + shape.act_bytes * h
        parts["mlp_input"] = shape.act_bytes * h
        swiglu = 4  # gate, up, SiLU output, product
    else:
        parts["mlp_norm"] = (shape.act_bytes * h + FP32) / sp
        parts["mlp_input"] = shape.act_bytes * h / sp
        swiglu = 3  # fc1 output (gate and up), SwiGLU output
    if not moe:
        parts["mlp"] = swiglu * shape.act_bytes * spec.intermediate_size / shape.tp
        return parts
    k = float(spec.num_experts_per_tok)
    e = float(spec.num_experts)
    expert_inter = spec.moe_intermediate_size / shape.tp  # expert tensor parallel = TP (Megatron default)
    if shape.implementation == "hf":
        parts["router"] = FP32 * e + INDEX * k  # fp32 router probabilities, top-k indices
        # dispatched input copy, expert output, routing weight and three permutation indices per routed copy
        parts["moe_dispatch"] = k * (2 * shape.act_bytes * h + shape.act_bytes + 3 * INDEX)
    else:
        parts["router"] = (2 * FP32 * e) / sp  # router logits and probabilities
        parts["moe_dispatch"] = k * 2 * shape.act_bytes * h / sp  # permuted input and the unpermute input
    parts["moe_experts"] = k * swiglu * shape.act_bytes * expert_inter
    if spec.shared_expert_intermediate_size:
        parts["shared_expert"] = swiglu * shape.act_bytes * spec.shared_expert_intermediate_size / shape.tp
    return parts


def layer_parts(spec: ModelSpec, shape: RankShape, seq_len: int, moe: bool) -> dict[str, float]:
    parts = attention_parts(spec, shape, seq_len)
    parts.update(mlp_parts(spec, shape, moe))
    return parts


def full_recompute_layer_bytes(spec: ModelSpec, shape: RankShape) -> float:
    """Full recomputation keeps only each layer's input (the hidden state)."""
    return shape.act_bytes * spec.hidden_size / shape.sp_divisor


def selective_recompute_dropped(parts: dict[str, float]) -> float:
    """Selective recomputation recomputes the attention core: its scores/statistics are not kept."""
    return parts.get("attn_scores", 0.0) + parts.get("softmax_stats", 0.0)


def embedding_stage_parts(spec: ModelSpec, shape: RankShape) -> dict[str, float]:
    """Per-token tensors kept once per micro-batch on the first stage (token ids, rotary tables)."""
    if shape.implementation == "hf":
        return {"token_ids": float(INDEX), "rotary_tables": 2.0 * shape.act_bytes * spec.head_dim}
    return {"token_ids": float(INDEX)}


def output_stage_parts(spec: ModelSpec, shape: RankShape) -> dict[str, float]:
    """Per-token tensors kept on the last stage before the loss: final norm and output-layer input."""
    h = float(spec.hidden_size)
    if shape.implementation == "hf":
        return {"final_norm": FP32 * h + FP32 + shape.act_bytes * h, "lm_head_input": shape.act_bytes * h}
    sp = shape.sp_divisor
    return {"final_norm": (shape.act_bytes * h + FP32) / sp, "lm_head_input": shape.act_bytes * h / sp}


def forward_workspace_per_token(spec: ModelSpec, shape: RankShape, seq_len: int) -> float:
    """Largest transient of one layer's forward without autograd (log-prob recomputation): the residual
    stream plus the larger of the MLP intermediates and the attention working set."""
    if shape.implementation == "megatron" and shape.attention_backend == "eager":
        return megatron_local_forward_workspace(spec, shape, seq_len)
    h = float(spec.hidden_size)
    a, kv, d = _heads(spec, shape)
    mlp = 3 * shape.act_bytes * _mlp_width(spec) / shape.tp
    if shape.attention_backend == "flash":
        attn = shape.act_bytes * d * (2 * a + 2 * kv) + FP32 * a
    else:
        attn = (FP32 + 2 * shape.act_bytes) * a * seq_len
    return 2 * shape.act_bytes * h + max(mlp, attn)


def _mlp_width(spec: ModelSpec) -> int:
    return spec.intermediate_size if not spec.is_moe else spec.moe_intermediate_size * spec.num_experts_per_tok


def megatron_eager_scores_bytes(shape: RankShape) -> int:
    """Bytes per score element live at once in Megatron-Core's unfused attention (`DotProductAttention`,
    `FusedScaleMaskSoftmax` on its torch path): the baddbmm input buffer and its result, and the softmax
    output; with 16-bit activations the softmax runs on an fp32 copy and its output is cast back."""
    if shape.act_bytes >= FP32:
        return 3 * shape.act_bytes
    return 3 * shape.act_bytes + 2 * FP32


def megatron_local_forward_workspace(spec: ModelSpec, shape: RankShape, seq_len: int) -> float:
    """Peak per token of one layer's forward without autograd in Megatron-Core's local (non-Transformer
    Engine) layers with the unfused attention, what a CPU runs; read off the tensors live at the peak.

    Always live: the layer input, the norm output and the embedding output (`GPTModel` holds it through the
    decoder). At the end of the attention core: the fused q/k/v output, the reshaped query copy (grouped
    query attention with more than one group per rank), the rotated query and key, k and v repeated to every
    query head, the context and its contiguous copy, and the scores (`megatron_eager_scores_bytes`). In the
    MLP: also the attention output, the persistent baddbmm buffer, fc1's output (gate and up, 2I) and the
    SwiGLU's SiLU, offset-add and product (3I).
    """
    b = shape.act_bytes
    h = float(spec.hidden_size) / shape.sp_divisor
    a, kv, d = _heads(spec, shape)
    query_copy = a * d if 1 < kv < a else 0.0
    repeated_kv = 2 * a * d if kv < a else 0.0
    projections = (a + 2 * kv) * d + query_copy + (a + kv) * d + repeated_kv + 2 * a * d
    attention = b * (3 * h + projections) + megatron_eager_scores_bytes(shape) * a * seq_len
    mlp = b * (4 * h + a * seq_len + 5 * _mlp_width(spec) / shape.tp)
    return max(attention, mlp)
