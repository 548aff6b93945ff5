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
            reconfigure_strategy=gpr.runtime_rollout_reconfigure_strategy,
            drain_before_stop=gpr.runtime_drain_before_reconfigure,
            cluster_gpus=cfg.total_gpus,
            cluster_swap_enabled=gpr.runtime_cluster_swap_enabled,
            generation=1,
            reason=f"initial allocation ({self.source})",
            updated_at=time.time(),
        )


class InfeasiblePlanError(RuntimeError):
    """The planner found no split and layout that fits; the message says what to change."""


def _planner_document(cfg: Config) -> tuple[Any, dict[str, Any]]:
    from libra.planning import plan_job
    from planner.report import plan_dict

    plan = plan_job(cfg)
    return plan, plan_dict(plan)


def configured_allocation(cfg: Config) -> Allocation:
    """The pinned split; the planner's evaluation of it (memory, predicted times) is recorded alongside."""
    layout = TrainLayout(tp=cfg.train_tp_size, pp=cfg.train_pp_size, cp=cfg.train_cp_size, ep=cfg.train_ep_size,
                         vpp=cfg.train_vpp_size)
    plan: dict[str, Any] = {
        "strategy": "configured",
        "train_gpus": cfg.train_gpus,
        "rollout_gpus": cfg.rollout_gpus,
        "rollout_tp": cfg.rollout_tp_size,
        "rollout_instances": cfg.rollout_gpus // cfg.rollout_tp_size,
        "train_layout": dataclasses.asdict(layout) | {"dp": layout.dp(cfg.train_gpus)},
        "why": "global_resource_planner.initial_allocation_strategy is configured: the pinned split is kept",
    }
    try:
        _, plan["planner"] = _planner_document(cfg)
    except Exception as exc:  # the evaluation is informative only; the pinned split runs regardless
        plan["planner_error"] = f"{type(exc).__name__}: {exc}"
    return Allocation(cfg.train_gpus, cfg.rollout_gpus, cfg.rollout_tp_size, layout, "configured", plan)


def grp_allocation(cfg: Config) -> Allocation:
    """The planner's choice of split and layout (`libra plan` shows the same)."""
    plan, document = _planner_document(cfg)
    if not plan.feasible or plan.chosen is None:
        hints = "; ".join(plan.suggestions) or "run `libra plan CONFIG --explain` for the pruned candidates"
        raise InfeasiblePlanError(
            f"the planner found no feasible train/rollout split for {cfg.total_gpus} GPUs: {hints}"
        )
    chosen = plan.chosen.candidate
    layout = TrainLayout(tp=chosen.layout.tp, pp=chosen.layout.pp, cp=chosen.layout.cp, ep=chosen.layout.ep,
                         vpp=chosen.layout.vpp)
    document = {"strategy": "grp", "train_gpus": chosen.train_gpus, "rollout_gpus": chosen.rollout_gpus,
                "rollout_tp": chosen.rollout_tp, "rollout_instances": chosen.rollout_instances,
                "train_layout": dataclasses.asdict(layout) | {"dp": layout.dp(chosen.train_gpus)},
                "why": f"planner choice: {chosen.label()}", "planner": document}
    return Allocation(chosen.train_gpus, chosen.rollout_gpus, chosen.rollout_tp, layout, "grp", document)


def initial_allocation(cfg: Config) -> Allocation:
    if cfg.global_resource_planner.initial_allocation_strategy == "configured":
        return configured_allocation(cfg)
    return grp_allocation(cfg)
