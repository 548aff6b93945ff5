"""`planner.model_spec` is the one parser of `config.json`: the planner, validation and the training workers
read the same `ModelSpec` from the same file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from planner_cases import MODELS

from libra.config import load_dict
from libra.training.hf_arch import read_training_model
from planner.model_spec import ModelSpecError, load_model_spec, model_spec_from_dict

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 219, "max_position_embeddings": 512}

FIELDS = {
    "defaults": ({}, dict(rms_norm_eps=1e-6, rope_theta=10000.0, rope_type="default", hidden_act="silu",
                          norm_topk_prob=True, attention_bias=False, output_bias=False, heads_per_group=2)),
    "rope-theta-top-level": ({"rope_theta": 5e5, "rms_norm_eps": 1e-5}, dict(rope_theta=5e5, rms_norm_eps=1e-5)),
    "rope-parameters": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, dict(rope_theta=1e6)),
    "rope-scaling-type": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, dict(rope_type="linear")),
    "qwen2-qkv-bias-only": ({"model_type": "qwen2"}, dict(attention_bias=True, output_bias=False)),
    "llama-attention-bias-has-o-proj": ({"attention_bias": True}, dict(attention_bias=True, output_bias=True)),
    "qwen3-qk-norm": ({"model_type": "qwen3", "head_dim": 32}, dict(qk_norm=True, head_dim=32)),
    "moe-router": ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "norm_topk_prob": False},
                   dict(is_moe=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        norm_topk_prob=False)),
    "sliding-window-and-biases": ({"use_sliding_window": True, "mlp_bias": True, "hidden_act": "gelu"},
                                  dict(sliding_window=True, mlp_bias=True, hidden_act="gelu")),
    "text-config-nesting": ({"text_config": {**BASE, "hidden_size": 96, "num_attention_heads": 3,
                                             "num_key_value_heads": 3}}, dict(hidden_size=96, head_dim=32)),
}


@pytest.mark.parametrize(("changes", "expected"), FIELDS.values(), ids=FIELDS.keys())
def test_parser_reads_every_fact(changes: dict, expected: dict) -> None:
    spec = model_spec_from_dict({**BASE, **changes})
    for key, value in expected.items():
        assert getattr(spec, key) == value, key


def test_output_bias_counts_in_the_parameters() -> None:
    plain = model_spec_from_dict(BASE)
    biased = model_spec_from_dict({**BASE, "attention_bias": True})
    qkv = (4 + 2 * 2) * 16
    assert biased.total_params - plain.total_params == 2 * (qkv + 64)  # 2 layers: q/k/v bias + o_proj bias


def test_missing_field_is_named() -> None:
    with pytest.raises(ModelSpecError, match="field 'num_hidden_layers' is missing"):
        model_spec_from_dict({k: v for k, v in BASE.items() if k != "num_hidden_layers"})


@pytest.mark.parametrize("name", sorted(os.listdir(MODELS)))
def test_planner_validation_and_training_read_the_same_spec(name: str) -> None:
    """One parser: the training workers' model is the planner's, field for field."""
    path = os.path.join(MODELS, name)
    planner_spec = load_model_spec(path)
    assert read_training_model(path) == planner_spec
    cfg = load_dict({"model_path": path, "cluster": {"num_nodes": 32, "gpus_per_node": 8, "gpu_type": "H100"}})
    assert cfg.model_spec() == planner_spec


def test_training_refuses_what_the_planner_only_plans(tmp_path: Path) -> None:
    from libra.training.hf_arch import UnsupportedArchitectureError

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "mixtral", "num_local_experts": 8,
                                                      "num_experts_per_tok": 2}))
    assert load_model_spec(str(tmp_path)).num_experts == 8
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'mixtral'"):
        read_training_model(str(tmp_path))
