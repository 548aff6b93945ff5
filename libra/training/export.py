"""Megatron -> HF export: gather TP (and EP) shards, convert to HF names, write safetensors + config/tokenizer.

Every rank takes part in the TP all-gathers of its stage's parameters. The first rank of each pipeline
stage's data-parallel replica 0 (TP rank 0) converts and writes its stage's tensors: `model.safetensors` at
PP 1, else `model-0000s-of-0000p.safetensors` per stage plus `model.safetensors.index.json` (written by global
rank 0 from the gathered names). Rank 0 also copies `config.json`, the generation config and tokenizer files
from the model directory and removes stale weight files, so the directory is exactly one checkpoint that
vLLM's safetensors loader (and the rollout pool's checksum) reads.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from libra.training.convert import ParamMapping, hf_from_shards
from planner.model_spec import ModelSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX = "model.safetensors.index.json"


def _gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_stage_tensors(
    chunk_params: list[tuple[torch.nn.Module, list[ParamMapping]]], arch: ModelSpec
) -> dict[str, torch.Tensor]:
    """Collective over TP (and EP for experts): HF-named full tensors of this rank's chunks (on CPU)."""
    from megatron.core import parallel_state as ps

    tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for chunk, mappings in chunk_params:
        params = dict(chunk.named_parameters())
        for mp in mappings:
            if mp.megatron not in params:
                continue  # tied output layer living in the embedding
            if mp.megatron == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # written once, as model.embed_tokens.weight
            tensor = params[mp.megatron].detach()
            if mp.expert:
                etp_group = ps.get_expert_tensor_parallel_group()
                shards = _gather(tensor, etp_group, ps.get_expert_tensor_parallel_world_size())
            else:
                shards = _gather(tensor, tp_group, tp_size) if mp.kind != "replicated" else [tensor]
            for name, value in zip(mp.hf, hf_from_shards(mp.kind, shards, arch), strict=True):
                out[name] = value.to("cpu").contiguous()
    return out


def _gather_experts(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective over EP: every EP rank's expert tensors (names are already global)."""
    from megatron.core import parallel_state as ps

    ep_size = ps.get_expert_model_parallel_world_size()
    if ep_size == 1:
        return local
    gathered: list[dict[str, torch.Tensor] | None] = [None] * ep_size
    dist.all_gather_object(gathered, local, group=ps.get_expert_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def _copy_model_files(model_path: str, out_dir: str) -> None:
    for name in os.listdir(model_path):
        src = os.path.join(model_path, name)
        if name == INDEX or name.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(src):
            continue
        shutil.copy2(src, os.path.join(out_dir, name))


def export(
    out_dir: str,
    chunk_params: list[tuple[torch.nn.Module, list[ParamMapping]]],
    arch: ModelSpec,
    model_path: str,
    dtype: torch.dtype,
) -> None:
    """Collective: write the HF checkpoint of the current weights to `out_dir`."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):
            if name == INDEX or name.endswith(WEIGHT_SUFFIXES):
                os.remove(os.path.join(out_dir, name))
        _copy_model_files(model_path, out_dir)
    dist.barrier()
    tensors = gather_stage_tensors(chunk_params, arch)
    experts = {k: v for k, v in tensors.items() if ".mlp.experts." in k}
    if experts:
        tensors.update(_gather_experts(experts))
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    writer = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_expert_model_parallel_rank() == 0
    )
    fname = "model.safetensors" if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    names: list[str] = []
    if writer:
        save_file({k: v.to(dtype) for k, v in sorted(tensors.items())}, os.path.join(out_dir, fname), {"format": "pt"})
        names = sorted(tensors)
    if pp_size > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (fname, names) if writer else None)
        if rank == 0:
            weight_map = {n: f for item in everyone if item for f, ns in [item] for n in ns}
            with open(os.path.join(out_dir, INDEX), "w", encoding="utf-8") as fh:
                json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
    dist.barrier()
