"""Whether elastic hybrid parallelism acts (`libra.config.elastic_hybrid.ehp_switch`), from a table of
configurations, and what the configuration summary says about it."""

from __future__ import annotations

from typing import Any

import pytest
from config_bases import gpu_base, with_changes

from libra.config import load_dict
from libra.config.elastic_hybrid import ehp_switch
from libra.config.summary import summarize

GRP = "global_resource_planner"
TRAINING_CHANGES = {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True, f"{GRP}.runtime_reconfigure_training": True}
ON = {**TRAINING_CHANGES, f"{GRP}.elastic_hybrid_replica_size_gpus": 2, f"{GRP}.elastic_hybrid_min_rollout_gpus": 4}


@pytest.mark.parametrize(("changes", "mode", "why"), [
    pytest.param({}, "off", "runtime_dynamic_reconfiguration_enabled is false", id="default-off"),
    pytest.param({f"{GRP}.elastic_hybrid_replica_size_gpus": 2}, "off", "runtime_dynamic_reconfiguration_enabled",
                 id="size-alone-off"),
    pytest.param({f"{GRP}.runtime_dynamic_reconfiguration_enabled": True}, "off",
                 "runtime_reconfigure_training is false", id="rollout-changes-only-off"),
    pytest.param(TRAINING_CHANGES, "on", "replicas of 2 GPUs", id="derived-size-tp2-on"),
    pytest.param(ON, "on", "replicas of 2 GPUs", id="replica-size-on"),
    pytest.param({**ON, f"{GRP}.elastic_hybrid_min_rollout_gpus": 7}, "off", "fewer than one replica",
                 id="min-rollout-keeps-all-off"),
    pytest.param({**ON, "max_head_offpolicyness": 1}, "off", "asynchronous", id="async-job-off"),
    pytest.param({**ON, f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                  f"{GRP}.runtime_reconfigure_training": True, f"{GRP}.runtime_training_pool_plan_only": True},
                 "plan_only", "runtime_training_pool_plan_only", id="plan-only"),
])
def test_ehp_switch(changes: dict[str, Any], mode: str, why: str) -> None:
    switch = ehp_switch(load_dict(with_changes(gpu_base(), changes)))
    assert switch.mode == mode and why in switch.reason
    assert switch.acts == (mode != "off")


def test_summary_says_when_training_steps_borrow_rollout_gpus() -> None:
    on = next(line for line in summarize(load_dict(with_changes(gpu_base(), ON))) if line.startswith("runtime"))
    assert "elastic hybrid parallelism on (training steps borrow idle rollout GPUs in replicas of 2, 4 always " \
           "serving)" in on
    off = next(line for line in summarize(load_dict(gpu_base())) if line.startswith("runtime"))
    assert "elastic hybrid parallelism" not in off
