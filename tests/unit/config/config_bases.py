"""Valid base configurations for the config tests, and helpers to mutate them by dotted path.

Each base is valid on its own; a test changes a few options and checks the exact errors that result.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "configs" / "models"
DELETE = object()
# Mixtral-8x7B's config.json: planned, served by vLLM, no HF <-> Megatron-Core conversion in Libra
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
}


def gpu_base() -> dict[str, Any]:
    """Qwen2.5-7B (28 heads, 4 KV heads, 28 layers) on 2 x 8 H100, pinned split 8 + 8, TP2 -> DP4."""
    return {
        "model_path": str(MODELS / "qwen2.5-7b"),
        "cluster": {"num_nodes": 2, "gpus_per_node": 8, "gpu_type": "H100"},
        "train_gpus": 8,
        "rollout_gpus": 8,
        "train_tp_size": 2,
        "batch_size": 16,
        "n_samples": 8,
        "global_resource_planner": {"initial_allocation_strategy": "configured"},
    }


def moe_base() -> dict[str, Any]:
    """Qwen3-30B-A3B (128 experts, 32 heads, 4 KV heads) on 2 x 8 H100, TP2 x EP4 -> DP4."""
    return {
        "model_path": str(MODELS / "qwen3-30b-a3b"),
        "cluster": {"num_nodes": 2, "gpus_per_node": 8, "gpu_type": "H100"},
        "train_gpus": 8,
        "rollout_gpus": 8,
        "train_tp_size": 2,
        "train_ep_size": 4,
        "batch_size": 24,
        "n_samples": 8,
        "global_resource_planner": {"initial_allocation_strategy": "configured"},
    }


def cpu_base(tmp: Path) -> dict[str, Any]:
    """The CPU development shape: tiny built model, 1 x 4 logical GPUs, split 2 + 2, DP2."""
    return {
        "model_path": str(tmp / "tiny-model"),
        "build_tiny_model": {"enabled": True},
        "cluster": {"num_nodes": 1, "gpus_per_node": 4, "gpu_type": "cpu-logical", "logical_gpus": True},
        "train_gpus": 2,
        "rollout_gpus": 2,
        "batch_size": 8,
        "n_samples": 4,
        "max_model_len": 512,
        "max_new_tokens": 16,
        "rollout_kv_cache_bytes": 64 * 1024 * 1024,
        "megatron_use_cpu_initialization": True,
        "optimizer": {"clip_grad": 0.0},
        "global_resource_planner": {"memory_budget_safety_margin_bytes": 256 * 1024 * 1024},
    }


def make_files(tmp: Path) -> None:
    """Files some cases point at via "{tmp}": a dataset (32 prompts), an unsupported model, a model the planner
    plans but training cannot run (Mixtral), a non-model directory."""
    (tmp / "train.jsonl").write_text("".join(f'{{"prompt": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(32)))
    (tmp / "gpt2").mkdir(exist_ok=True)
    (tmp / "gpt2" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
        "intermediate_size": 3072, "vocab_size": 50257, "max_position_embeddings": 32768,
    }))
    (tmp / "mixtral").mkdir(exist_ok=True)
    (tmp / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL))
    (tmp / "notamodel").mkdir(exist_ok=True)
    (tmp / "notamodel" / "README.txt").write_text("not a model\n")


def _substitute(value: Any, tmp: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, list):
        return [_substitute(v, tmp) for v in value]
    return value


def with_changes(base: dict[str, Any], changes: dict[str, Any], tmp: Path | None = None) -> dict[str, Any]:
    """A deep copy of `base` with dotted-path changes applied (value DELETE removes the key)."""
    data = copy.deepcopy(base)
    for dotted, value in changes.items():
        parts = dotted.split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = _substitute(value, tmp) if tmp is not None else value
    return data


def base_for(name: str, tmp: Path) -> dict[str, Any]:
    return {"dense": gpu_base, "moe": moe_base}[name]() if name != "cpu" else cpu_base(tmp)


def relpath(path: str) -> str:
    return os.path.relpath(path, REPO)
