"""The initial allocation of a job: the train/rollout GPU split and the training layout, from the Global
Resource Planner (`initial_allocation_strategy: grp`) or from the pinned configuration (`configured`),
turned into the controller's first desired state and written to `plan.json`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from libra.config import Config
from libra.controller.state import DesiredState, TrainLayout


@dataclass(frozen=True)
class Allocation:
    train_gpus: int
    rollout_gpus: int
    rollout_tp: int
    layout: TrainLayout
    source: str  # "grp" | "configured"
    plan: dict[str, Any]  # what plan.json holds

    @property
    def rollout_instances(self) -> int:
        return self.rollout_gpus // self.rollout_tp

    def desired_state(self, cfg: Config) -> DesiredState:
        gpr = cfg.global_resource_planner
        return DesiredState(
            rollout_instances=self.rollout_instances,
            rollout_tp=self.rollout_tp,
            train_gpus=self.train_gpus,
            train_layout=self.layout,
            reconfigure_strategy="diff",
            drain_before_stop=gpr.runtime_drain_before_reconfigure,
            generation=1,
            reason=f"initial allocation ({self.source})",
            updated_at=time.time(),
        )


def configured_allocation(cfg: Config) -> Allocation:
    layout = TrainLayout(tp=cfg.train_tp_size, pp=cfg.train_pp_size, cp=cfg.train_cp_size, ep=cfg.train_ep_size,
                         vpp=cfg.train_vpp_size)
    plan = {
        "strategy": "configured",
        "train_gpus": cfg.train_gpus,
        "rollout_gpus": cfg.rollout_gpus,
        "rollout_tp": cfg.rollout_tp_size,
        "rollout_instances": cfg.rollout_gpus // cfg.rollout_tp_size,
        "train_layout": dataclasses.asdict(layout) | {"dp": layout.dp(cfg.train_gpus)},
        "why": "global_resource_planner.initial_allocation_strategy is configured: the pinned split is kept",
    }
    return Allocation(cfg.train_gpus, cfg.rollout_gpus, cfg.rollout_tp_size, layout, "configured", plan)


def grp_allocation(cfg: Config) -> Allocation:
    """Ask the planner (libra.planning) for the split and layout."""
    from libra import planning

    result = planning.plan_for_config(cfg)
    plan = planning.plan_to_dict(result) if hasattr(planning, "plan_to_dict") else dict(result.to_dict())
    chosen = plan.get("chosen", plan)
    layout_data = chosen.get("train_layout", {})
    layout = TrainLayout(
        tp=int(layout_data.get("tp", 1)),
        pp=int(layout_data.get("pp", 1)),
        cp=int(layout_data.get("cp", 1)),
        ep=int(layout_data.get("ep", 1)),
        vpp=int(layout_data.get("vpp", 1)),
    )
    plan = {"strategy": "grp", **plan}
    return Allocation(int(chosen["train_gpus"]), int(chosen["rollout_gpus"]),
                      int(chosen.get("rollout_tp", cfg.rollout_tp_size)), layout, "grp", plan)


def initial_allocation(cfg: Config) -> Allocation:
    if cfg.global_resource_planner.initial_allocation_strategy == "configured":
        return configured_allocation(cfg)
    return grp_allocation(cfg)
