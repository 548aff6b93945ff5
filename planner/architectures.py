"""The one list of model architectures Libra knows, and what each part of Libra can do with each of them.

For every Hugging Face `model_type` the table says whether
- `plan`: the planner's memory and cost models cover it (`libra plan`),
- `train`: the training workers have an HF <-> Megatron-Core weight conversion for it
  (`libra/training/convert.py` with the local layer spec of `megatron_setup.py`),
- `rollout`: the rollout pool (vLLM) serves it.
Validation, the planner and the training workers read this table; nothing else keeps a list of model types.

A supported type can still use a feature the conversion does not reproduce (RoPE scaling, sliding windows,
biases on the MLP or the attention output, ...): `training_gaps` names those for one model, field by field,
because a silently different model would train the wrong thing. Pure: stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.model_spec import ModelSpec

PLAN = "plan"
TRAIN = "train"
ROLLOUT = "rollout"
CAPABILITIES = (PLAN, TRAIN, ROLLOUT)
# what a missing capability means, as a user reads it
CAPABILITY_TEXT = {
    PLAN: "the planner has no memory and cost model for it",
    TRAIN: "training has no HF <-> Megatron-Core weight conversion for it",
    ROLLOUT: "the rollout pool (vLLM) cannot serve it",
}
RUN = (TRAIN, ROLLOUT)  # what `libra launch` needs besides a plan


@dataclass(frozen=True)
class Architecture:
    """One `model_type` and what Libra supports for it (`note` says why a capability is missing)."""

    model_type: str
    family: str
    plan: bool
    train: bool
    rollout: bool
    note: str = ""

    def supports(self, capability: str) -> bool:
        return bool(getattr(self, capability))


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "Llama", plan=True, train=True, rollout=True),
    Architecture("qwen2", "Qwen2 (q/k/v bias)", plan=True, train=True, rollout=True),
    Architecture("qwen3", "Qwen3 dense (q/k RMSNorm)", plan=True, train=True, rollout=True),
    Architecture("qwen3_moe", "Qwen3 MoE", plan=True, train=True, rollout=True),
    Architecture("mistral", "Mistral", plan=True, train=False, rollout=True,
                 note="its model type is not mapped to Megatron-Core (sliding-window attention is not reproduced)"),
    Architecture("mixtral", "Mixtral MoE", plan=True, train=False, rollout=True,
                 note="the block_sparse_moe experts (w1/w2/w3) are not mapped to Megatron-Core"),
    Architecture("qwen2_moe", "Qwen2 MoE", plan=True, train=False, rollout=True,
                 note="the shared expert and its gate are not mapped to Megatron-Core"),
)}


def supporting(capability: str) -> tuple[str, ...]:
    """Model types with `capability`, in table order."""
    return tuple(t for t, a in ARCHITECTURES.items() if a.supports(capability))


def missing_capabilities(model_type: str, needed: Iterable[str] = CAPABILITIES) -> tuple[str, ...]:
    """The capabilities of `needed` that Libra lacks for `model_type` (all of them for an unknown type)."""
    arch = ARCHITECTURES.get(model_type)
    return tuple(c for c in needed if arch is None or not arch.supports(c))


def unsupported_message(model_type: str, needed: Iterable[str] = CAPABILITIES) -> str:
    """What is missing for `model_type`, one clause per capability with the types that have it; empty if none."""
    missing = missing_capabilities(model_type, needed)
    if not missing:
        return ""
    arch = ARCHITECTURES.get(model_type)
    name = f"model_type '{model_type}'" + (f" ({arch.family})" if arch else "")
    clauses = [f"{CAPABILITY_TEXT[c]} (supported: {', '.join(supporting(c))})" for c in missing]
    why = f"; {arch.note}" if arch and arch.note else ""
    return f"{name}: " + "; ".join(clauses) + why


def training_gaps(spec: ModelSpec) -> list[str]:
    """Every reason the training workers cannot reproduce `spec` exactly (empty when they can)."""
    gaps: list[str] = []
    message = unsupported_message(spec.model_type, (TRAIN,))
    if message:
        return [message]
    if spec.hidden_act != "silu":
        gaps.append(f"hidden_act '{spec.hidden_act}' is not supported; only 'silu'")
    if spec.mlp_bias:
        gaps.append("mlp_bias=true is not supported")
    if spec.output_bias:
        gaps.append("attention_bias=true (o_proj bias) is not supported")
    if spec.sliding_window:
        gaps.append("use_sliding_window=true is not supported")
    if spec.rope_type != "default":
        gaps.append(f"rope type '{spec.rope_type}' is not supported by the Megatron conversion; use a model with "
                    "default RoPE (no rope_scaling)")
    if spec.num_attention_heads % spec.num_kv_heads:
        gaps.append(f"num_attention_heads={spec.num_attention_heads} is not a multiple of "
                    f"num_key_value_heads={spec.num_kv_heads}")
    if spec.max_position_embeddings < 1:
        gaps.append("max_position_embeddings is missing; the Megatron model needs the maximum sequence length")
    if spec.is_moe:
        if spec.dense_layers or spec.moe_layer_freq != 1:
            gaps.append(f"{spec.model_type} with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not "
                        "supported")
        if spec.shared_expert_intermediate_size:
            gaps.append("shared experts are not supported")
        if spec.num_experts_per_tok < 1:
            gaps.append("num_experts_per_tok is missing; the router needs its top-k")
    return gaps
