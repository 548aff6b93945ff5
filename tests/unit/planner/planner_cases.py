"""Planner inputs used across the planner tests: the repository's model files and small synthetic shapes."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from planner.hardware import get_gpu
from planner.model_spec import ModelSpec, load_model_spec, model_spec_from_dict
from planner.workload import ClusterSpec, PlannerInputs, SearchSpace, TrainOptions, Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODELS = os.path.join(ROOT, "configs", "models")


def model(name: str) -> ModelSpec:
    return load_model_spec(os.path.join(MODELS, name))


def dense(**overrides: Any) -> ModelSpec:
    cfg = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
    cfg.update(overrides)
    return model_spec_from_dict(cfg, name="dense-test")


def inputs(spec: ModelSpec | str = "qwen2.5-7b", nodes: int = 1, gpus_per_node: int = 8, gpu: str = "H100",
           **changes: Any) -> PlannerInputs:
    """Inputs with a moderate RL workload; keyword arguments replace fields of workload/train/space."""
    spec = model(spec) if isinstance(spec, str) else spec
    workload = Workload(batch_size=32, n_samples=8, max_model_len=4096, max_new_tokens=2048)
    train = TrainOptions()
    space = SearchSpace(allowed_ep=(1, 2, 4, 8) if spec.is_moe else (1,))
    w_fields, t_fields, s_fields = (set(workload.__dataclass_fields__), set(train.__dataclass_fields__),
                                    set(space.__dataclass_fields__))
    workload = replace(workload, **{k: v for k, v in changes.items() if k in w_fields})
    train = replace(train, **{k: v for k, v in changes.items() if k in t_fields})
    space = replace(space, **{k: v for k, v in changes.items() if k in s_fields})
    unknown = set(changes) - w_fields - t_fields - s_fields
    assert not unknown, unknown
    return PlannerInputs(model=spec, cluster=ClusterSpec(nodes, gpus_per_node, get_gpu(gpu)), workload=workload,
                         train=train, space=space)
