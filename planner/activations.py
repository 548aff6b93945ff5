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
    if is_megatron_local(shape):
        return megatron_local_layer_parts(spec, shape, seq_len, moe)
    parts = attention_parts(spec, shape, seq_len)
    parts.update(mlp_parts(spec, shape, moe))
    return parts


def is_megatron_local(shape: RankShape) -> bool:
    """Megatron-Core's local (non-Transformer Engine) layers with the unfused attention: what a CPU runs."""
    return shape.implementation == "megatron" and shape.attention_backend == "eager"


def megatron_local_layer_parts(spec: ModelSpec, shape: RankShape, seq_len: int, moe: bool) -> dict[str, float]:
    """Saved for backward per token by one Megatron-Core local layer, read off the tensors live at the loss.

    Residual stream: the layer input and the sum after attention. Each torch RMSNorm keeps its normalised
    value and its output (and the fp32 inverse RMS). Attention: the rotated query, k and v repeated to every
    query head (or, without grouping, the rotated key and the fused q/k/v output v is a view of), the rotated
    key (with grouping), the cos/sin rotary tables of q and k, the softmax output (s per head) and the
    contiguous context. MLP: fc1's output (gate and up, 2I), SiLU, offset-add and product (3I).
    """
    b = shape.act_bytes
    h = float(spec.hidden_size) / shape.sp_divisor
    a, kv, d = _heads(spec, shape)
    if kv < a:
        qkv = (a + 2 * a + kv) * d  # rotated q, repeated k and v, rotated k
    else:
        qkv = (a + kv + (a + 2 * kv)) * d  # rotated q and k, the fused q/k/v output
    parts: dict[str, float] = {
        "residual": 2 * b * h,
        "norms": 2 * (2 * b * h + FP32),
        "q_k_v": b * qkv,
        "rotary_tables": 4 * b * d,
        "attn_scores": b * a * seq_len,
        "attn_out": b * a * d,
    }
    if not moe:
        parts["mlp"] = 5 * b * spec.intermediate_size / shape.tp
        return parts
    # MoE (the all-gather dispatcher, experts one after the other): the router's fp32 scores (six E-sized
    # tensors: logits, softmax, top-k mask and their copies) and five top-k tensors (values, indices,
    # routing weights); the permuted input and the experts' concatenated output (k routed copies of h) with
    # the combined and the weighted output (h each); per routed token each expert's fc1 output (2 I_e) and
    # four I_e-sized SwiGLU tensors.
    k, e = float(spec.num_experts_per_tok), float(spec.num_experts)
    parts["router"] = FP32 * (6 * e + 5 * k) / shape.sp_divisor
    parts["moe_dispatch"] = b * h * (2 * k + 2)
    parts["moe_experts"] = k * 6 * b * spec.moe_intermediate_size / shape.tp
    if spec.shared_expert_intermediate_size:
        parts["shared_expert"] = 5 * b * spec.shared_expert_intermediate_size / shape.tp
    return parts


MLP_PARTS = ("mlp", "router", "moe_dispatch", "moe_experts", "shared_expert")


def megatron_local_backward_workspace(spec: ModelSpec, shape: RankShape, seq_len: int, moe: bool) -> float:
    """Per token, on top of the kept activations, at the peak of a Megatron-Core local layer's backward.

    A layer's saved tensors are freed as backward consumes them. At the attention core's backward the
    layer's MLP tensors and its softmax output are already gone, and the softmax backward holds four
    s-per-head temporaries (the incoming gradient, its product with the softmax output, the sum-corrected
    copy and the gradient of the scores) with two residual-stream gradients. In the MLP's backward the
    gradients of fc1's output (2I) and of the SwiGLU product (I) are live beside the residual gradients.
    """
    b = shape.act_bytes
    h = float(spec.hidden_size) / shape.sp_divisor
    a, _kv, _d = _heads(spec, shape)
    parts = megatron_local_layer_parts(spec, shape, seq_len, moe)
    mlp_kept = sum(parts.get(name, 0.0) for name in MLP_PARTS)
    attention = b * (4 * a * seq_len + 2 * h) - parts["attn_scores"] - mlp_kept
    width = spec.intermediate_size if not moe else spec.moe_intermediate_size * spec.num_experts_per_tok
    mlp = b * (3 * width / shape.tp + 2 * h)
    return max(attention, mlp)


def megatron_scores_buffer_bytes(spec: ModelSpec, shape: RankShape, rows: int, seq_len: int) -> float:
    """Megatron-Core's unfused attention writes its scores into a persistent global buffer (`baddbmm`'s
    input), sized by the largest micro-batch run so far; it stays allocated between layers and phases."""
    if not is_megatron_local(shape):
        return 0.0
    a, _kv, _d = _heads(spec, shape)
    return float(shape.act_bytes * rows * a * seq_len * seq_len)


def full_recompute_layer_bytes(spec: ModelSpec, shape: RankShape) -> float:
    """Full recomputation keeps only each layer's input (the hidden state)."""
    return shape.act_bytes * spec.hidden_size / shape.sp_divisor


def selective_recompute_dropped(parts: dict[str, float]) -> float:
    """Selective recomputation recomputes the attention core: its scores/statistics are not kept."""
    return parts.get("attn_scores", 0.0) + parts.get("softmax_stats", 0.0)


def megatron_local_selective_dropped(spec: ModelSpec, shape: RankShape, seq_len: int) -> float:
    """Megatron-Core's selective recomputation checkpoints the core attention: it keeps the core's inputs
    (rotated q and k, and v, a view that keeps the fused q/k/v output alive) instead of the softmax output and
    the repeated k and v (the context it returns is kept by the output projection as before)."""
    b = shape.act_bytes
    a, kv, d = _heads(spec, shape)
    if kv < a:
        return b * (a * seq_len + 2 * a * d - (a + 2 * kv) * d)
    return b * a * seq_len


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
    if is_megatron_local(shape):  # the last residual, the torch RMSNorm's normalised value and its output
        return {"final_norm": (2 * shape.act_bytes * h + FP32) / sp, "lm_head_input": shape.act_bytes * h / sp}
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
