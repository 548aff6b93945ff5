"""HF <-> Megatron-Core weight mapping for Llama / Qwen2 / Qwen3 (dense and MoE), sharded for TP/PP/EP.

These are the model types `planner.architectures` marks as trainable; a new family gets its mapping here and
its `train=True` there, together.

Each Megatron parameter of a `GPTModel` chunk (local layer index j, global index i = offset + j) maps to one
or more HF tensors and has a *kind* that says how it is split across tensor-parallel ranks:

| Megatron parameter                          | HF tensor(s)                                  | kind      |
|---------------------------------------------|-----------------------------------------------|-----------|
| embedding.word_embeddings.weight            | model.embed_tokens.weight                     | vocab     |
| decoder.layers.j.input_layernorm.weight     | model.layers.i.input_layernorm.weight         | replicated|
| decoder.layers.j.self_attention.linear_qkv.weight | q_proj, k_proj, v_proj .weight          | qkv       |
| decoder.layers.j.self_attention.linear_qkv.bias   | q_proj, k_proj, v_proj .bias (Qwen2)    | qkv       |
| decoder.layers.j.self_attention.q_layernorm.weight| self_attn.q_norm.weight (Qwen3)         | replicated|
| decoder.layers.j.self_attention.k_layernorm.weight| self_attn.k_norm.weight (Qwen3)         | replicated|
| decoder.layers.j.self_attention.linear_proj.weight| self_attn.o_proj.weight                 | row       |
| decoder.layers.j.pre_mlp_layernorm.weight   | model.layers.i.post_attention_layernorm.weight| replicated|
| decoder.layers.j.mlp.linear_fc1.weight      | mlp.gate_proj, mlp.up_proj .weight            | gated     |
| decoder.layers.j.mlp.linear_fc2.weight      | mlp.down_proj.weight                          | row       |
| decoder.layers.j.mlp.router.weight          | mlp.gate.weight (MoE)                         | replicated|
| ...mlp.experts.local_experts.k.linear_fc1/2 | mlp.experts.e.gate/up/down_proj (MoE)         | gated/row |
| decoder.final_layernorm.weight              | model.norm.weight                             | replicated|
| output_layer.weight                         | lm_head.weight (embed_tokens when tied)       | vocab     |

Kinds: `vocab` rows are split after padding the vocabulary to a multiple of TP with zero rows; `row` splits
dim 1; `qkv` fuses q/k/v per query group, [g0: q heads of g0, k_g0, v_g0][g1: ...], and TP ranks take
contiguous groups; `gated` puts rank r's slice of gate_proj above its slice of up_proj.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from libra.training.hf_arch import padded_vocab_size
from planner.model_spec import ModelSpec

KINDS = ("replicated", "vocab", "row", "qkv", "gated")


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter of a chunk and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: bool = False


def _layer_mappings(arch: ModelSpec, j: int, i: int, local_expert_ids: Iterable[int]) -> list[ParamMapping]:
    m = f"decoder.layers.{j}."
    h = f"model.layers.{i}."
    out = [
        ParamMapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated"),
        ParamMapping(
            m + "self_attention.linear_qkv.weight",
            tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
        ),
        ParamMapping(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"),
        ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"),
    ]
    if arch.attention_bias:
        out.append(
            ParamMapping(
                m + "self_attention.linear_qkv.bias", tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"
            )
        )
    if arch.qk_norm:
        out.append(ParamMapping(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "replicated"))
        out.append(ParamMapping(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "replicated"))
    if arch.is_moe:
        out.append(ParamMapping(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated"))
        for k, e in enumerate(local_expert_ids):
            me = m + f"mlp.experts.local_experts.{k}."
            he = h + f"mlp.experts.{e}."
            out.append(
                ParamMapping(me + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"), "gated", True)
            )
            out.append(ParamMapping(me + "linear_fc2.weight", (he + "down_proj.weight",), "row", True))
    else:
        out.append(
            ParamMapping(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gated")
        )
        out.append(ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"))
    return out


def chunk_mappings(
    arch: ModelSpec,
    layer_offset: int,
    num_local_layers: int,
    pre_process: bool,
    post_process: bool,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[ParamMapping]:
    """Every parameter mapping of one model chunk (the chunk holds layers offset .. offset+n-1)."""
    experts_per_rank = arch.num_experts // ep_size if arch.is_moe else 0
    local_experts = range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)
    out: list[ParamMapping] = []
    if pre_process:
        out.append(ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for j in range(num_local_layers):
        out += _layer_mappings(arch, j, layer_offset + j, local_experts)
    if post_process:
        out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        out.append(ParamMapping("output_layer.weight", (head,), "vocab"))
    return out


def _split_qkv_full(arch: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's group-interleaved fused layout."""
    g, qpg, d = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    tail = q.shape[1:]
    fused = torch.cat(
        [q.reshape(g, qpg * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1
    )
    return fused.reshape(g * (qpg + 2) * d, *tail)


def shard_from_hf(kind: str, hf: list[torch.Tensor], arch: ModelSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The TP shard `tp_rank` of a Megatron parameter built from its full HF tensors."""
    if kind == "replicated":
        return hf[0]
    if kind == "vocab":
        full = hf[0]
        padded = padded_vocab_size(full.shape[0], tp_size)
        if padded != full.shape[0]:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "qkv":
        return _split_qkv_full(arch, *hf).chunk(tp_size, dim=0)[tp_rank]
    if kind == "gated":
        gate, up = hf
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown parameter kind '{kind}'")


def hf_from_shards(kind: str, shards: list[torch.Tensor], arch: ModelSpec) -> list[torch.Tensor]:
    """The full HF tensors of a Megatron parameter from its TP shards (in TP-rank order)."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "qkv":
        g, qpg, d = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
        fused = torch.cat(shards, dim=0)
        tail = fused.shape[1:]
        grouped = fused.reshape(g, (qpg + 2) * d, *tail)
        q, k, v = grouped.split([qpg * d, d, d], dim=1)
        return [q.reshape(g * qpg * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)]
    if kind == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown parameter kind '{kind}'")


class HFWeightReader:
    """Reads named tensors from the safetensors files of an HF model directory (index-aware)."""

    def __init__(self, model_path: str) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self.model_path = model_path
        index = os.path.join(model_path, "model.safetensors.index.json")
        self._files: dict[str, str] = {}
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                for name, fname in json.load(fh)["weight_map"].items():
                    self._files[name] = os.path.join(model_path, fname)
        else:
            files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in '{model_path}'")
            for fname in files:
                path = os.path.join(model_path, fname)
                with safe_open(path, framework="pt") as fh:
                    for name in fh.keys():
                        self._files[name] = path
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self._files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"tensor '{name}' is not in the weights of '{self.model_path}'")
        path = self._files[name]
        if path not in self._handles:
            self._handles[path] = self._safe_open(path, framework="pt")
        return self._handles[path].get_tensor(name)  # type: ignore[attr-defined]


_EXTRA_STATE = re.compile(r"\._extra_state$")


def load_chunk_from_hf(
    chunk: torch.nn.Module,
    mappings: list[ParamMapping],
    reader: HFWeightReader,
    arch: ModelSpec,
    tp_rank: int,
    tp_size: int,
) -> None:
    """Copy this rank's shards of the HF weights into `chunk`; every parameter must be covered."""
    params = dict(chunk.named_parameters())
    covered: set[str] = set()
    for mp in mappings:
        if mp.megatron not in params:
            # output_layer of a tied model lives in the embedding when both are on this stage
            if mp.megatron == "output_layer.weight" and arch.tie_word_embeddings:
                continue
            raise KeyError(f"Megatron chunk has no parameter '{mp.megatron}' (conversion table out of date?)")
        param = params[mp.megatron]
        shard = shard_from_hf(mp.kind, [reader.get(n) for n in mp.hf], arch, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"shape mismatch for '{mp.megatron}': HF {list(mp.hf)} give {tuple(shard.shape)}, "
                f"Megatron expects {tuple(param.shape)} (tp={tp_size})"
            )
        with torch.no_grad():
            param.copy_(shard.to(param.dtype))
        covered.add(mp.megatron)
    missing = [n for n in params if n not in covered]
    if missing:
        raise KeyError(f"no HF source for Megatron parameters {missing[:5]} (+{max(0, len(missing) - 5)} more)")
