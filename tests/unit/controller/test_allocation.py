"""Initial allocation: the planner's choice (grp) or the pinned split (configured), and the first desired
state made from it."""

from __future__ import annotations

from typing import Any

import pytest

from libra.config import load_dict
from libra.controller.allocation import initial_allocation
from libra.planning import plan_job


def job(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model_path": "/tmp/libra-unit-tiny-model",
        "build_tiny_model": {"enabled": True, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2},
        "cluster": {"num_nodes": 1, "gpus_per_node": 4, "gpu_type": "cpu-logical", "logical_gpus": True},
        "train_gpus": 2, "rollout_gpus": 2, "batch_size": 4, "n_samples": 4, "max_model_len": 64,
        "max_new_tokens": 4, "rollout_kv_cache_bytes": 2**26, "megatron_use_cpu_initialization": True, "megatron_params_dtype": "fp32",
        "optimizer": {"clip_grad": 0},
        "global_resource_planner": {"memory_budget_safety_margin_bytes": 2**28},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            data.setdefault(section, {})[name] = value
        else:
            data[key] = value
    return data


def test_grp_takes_the_planner_choice() -> None:
    cfg = load_dict(job())
    allocation = initial_allocation(cfg)
    chosen = plan_job(cfg).chosen.candidate  # type: ignore[union-attr]
    assert allocation.source == "grp"
    assert (allocation.train_gpus, allocation.rollout_gpus, allocation.rollout_tp) == (
        chosen.train_gpus, chosen.rollout_gpus, chosen.rollout_tp)
    assert allocation.plan["strategy"] == "grp" and allocation.plan["planner"]["feasible"] is True
    assert allocation.train_gpus + allocation.rollout_gpus <= 4


@pytest.mark.parametrize(("train", "rollout", "tp"), [(2, 2, 1), (1, 3, 1), (2, 2, 2)])
def test_configured_keeps_the_pinned_split(train: int, rollout: int, tp: int) -> None:
    cfg = load_dict(job(train_gpus=train, rollout_gpus=rollout, train_tp_size=tp,
                        global_resource_planner__initial_allocation_strategy="configured"))
    allocation = initial_allocation(cfg)
    desired = allocation.desired_state(cfg)
    assert allocation.source == "configured"
    assert (desired.train_gpus, desired.rollout_instances, desired.train_layout.tp) == (train, rollout, tp)
    assert desired.train_layout.dp(train) == train // tp
    assert desired.generation == 1 and "configured" in desired.reason
    assert allocation.plan["train_layout"]["dp"] == train // tp
