"""Whether elastic hybrid parallelism (EHP) acts in a job: one decision from the configuration, asked by the
launch (`libra.controller.ehp_borrow`) and by the validation rules (`checks_runtime`).

EHP lends idle rollout GPUs to the training step as extra data-parallel replicas of
`elastic_hybrid_replica_size_gpus` GPUs each (0 = one complete TPxEPxPPxCP replica of the training layout).
It is a training-side runtime change, so it acts when the job may change its training pool
(`runtime_reconfigure_training` under `runtime_dynamic_reconfiguration_enabled`), and only in a synchronous
job, `max_head_offpolicyness: 0`: the next rollout phase starts only once the step's weights are published,
so the rollout pool idles while the step trains. `elastic_hybrid_min_rollout_gpus` equal to a pinned
`rollout_gpus` (or, when the planner chooses the split, to the cluster's GPUs) keeps every rollout GPU serving,
which turns it off while other training-side changes stay on. With `runtime_training_pool_plan_only`
each borrow is planned and recorded, and nothing is lent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from libra.config.schema import Config

EhpMode = Literal["off", "plan_only", "on"]
GRP = "global_resource_planner"


@dataclass(frozen=True)
class EhpSwitch:
    """The mode and, when it is off, the option that keeps it off."""

    mode: EhpMode
    reason: str

    @property
    def acts(self) -> bool:
        """Borrows are planned (and, unless plan-only, carried out)."""
        return self.mode != "off"


def replica_size(cfg: Config) -> int:
    """GPUs in one borrowed replica: the configured size, or one complete replica of the training layout."""
    size = cfg.global_resource_planner.elastic_hybrid_replica_size_gpus
    return size or cfg.train_tp_size * cfg.train_ep_size * cfg.train_pp_size * cfg.train_cp_size


def ehp_switch(cfg: Config) -> EhpSwitch:
    """EHP's mode for `cfg` (see the module docstring)."""
    p = cfg.global_resource_planner
    if not p.runtime_dynamic_reconfiguration_enabled:
        return EhpSwitch("off", f"{GRP}.runtime_dynamic_reconfiguration_enabled is false")
    if cfg.max_head_offpolicyness > 0:
        return EhpSwitch("off", f"the job is asynchronous (max_head_offpolicyness {cfg.max_head_offpolicyness}): "
                         "the rollout pool generates the next batch while a step trains")
    if not (p.runtime_reconfigure_training or p.runtime_training_pool_plan_only):
        return EhpSwitch("off", f"{GRP}.runtime_reconfigure_training is false")
    pinned = p.initial_allocation_strategy == "configured"
    most_rollout, what = (cfg.rollout_gpus, "rollout GPUs") if pinned else (cfg.total_gpus, "GPUs of the cluster")
    if most_rollout - p.elastic_hybrid_min_rollout_gpus < replica_size(cfg):
        return EhpSwitch("off", f"{GRP}.elastic_hybrid_min_rollout_gpus ({p.elastic_hybrid_min_rollout_gpus}) "
                         f"leaves fewer than one replica ({replica_size(cfg)} GPUs) of the {most_rollout} {what} "
                         "to lend")
    if p.runtime_training_pool_plan_only:
        return EhpSwitch("plan_only", "runtime_training_pool_plan_only: borrows are recorded, nothing is lent")
    return EhpSwitch("on", f"replicas of {replica_size(cfg)} GPUs in a synchronous job")
