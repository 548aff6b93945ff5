"""Requests to reconfigure the rollout pool of a running job, as pure functions over the desired state.

`plan_reconfigure` checks a request (count and/or TP, strategy) against the cluster and the model and
returns the next desired state: the new target, the strategy, the next generation, and `reconfiguring`
naming the change in progress (checkpointed with the desired state, so a restarted controller observes
what runs and finishes the change). `finish_if_converged` ends a change once the pool matches its target.
One reconfiguration runs at a time; a second request is refused naming the running one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from libra.controller.state import DesiredState, ObservedState
from libra.controller.strategies import STRATEGIES, converged
from planner.layout import rollout_rule_violation
from planner.model_spec import ModelSpec

MASTER_SWITCH = "global_resource_planner.runtime_dynamic_reconfiguration_enabled"
SWAP_SWITCH = "global_resource_planner.runtime_cluster_swap_enabled"


class ReconfigureRefused(ValueError):
    """A reconfiguration request that cannot run; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class ReconfigureTarget:
    """The rollout pool wanted: a new instance count and/or a new TP (None = keep)."""

    rollout_instances: int | None = None
    rollout_tp: int | None = None

    def describe(self) -> str:
        parts = []
        if self.rollout_instances is not None:
            parts.append(f"{self.rollout_instances} instances")
        if self.rollout_tp is not None:
            parts.append(f"TP {self.rollout_tp}")
        return ", ".join(parts) or "no change"


@dataclass(frozen=True)
class ReconfigureLimits:
    """What a request is checked against: the job's switches, the cluster and the model."""

    enabled: bool  # runtime_dynamic_reconfiguration_enabled
    cluster_swap_enabled: bool
    gpus_per_node: int
    model: ModelSpec
    drain_before_stop: bool  # runtime_drain_before_reconfigure
    fingerprint_for: Callable[[int], str]  # rollout TP -> launch fingerprint


def plan_reconfigure(desired: DesiredState, target: ReconfigureTarget, strategy: str | None,
                     limits: ReconfigureLimits, observed: ObservedState) -> DesiredState:
    """The desired state that carries out `target` by `strategy` (default: the job's configured one), or
    ReconfigureRefused saying why not."""
    if not limits.enabled:
        raise ReconfigureRefused(f"{MASTER_SWITCH} is false: the rollout pool keeps its launch size; set it to "
                                 "true to reconfigure a running job")
    if desired.reconfiguring and not converged(observed, desired):
        raise ReconfigureRefused(f"another reconfiguration is running ({desired.reconfiguring}); wait until it "
                                 "finishes (event reconfigure_done) and ask again")
    name = strategy or desired.reconfigure_strategy
    if name not in STRATEGIES:
        raise ReconfigureRefused(f"strategy {name!r} is unknown; choose one of {sorted(STRATEGIES)}")
    if name == "cluster_swap" and not limits.cluster_swap_enabled:
        raise ReconfigureRefused(f"strategy 'cluster_swap' needs {SWAP_SWITCH}: true; or use blue_green or diff")
    instances = desired.rollout_instances if target.rollout_instances is None else target.rollout_instances
    tp = desired.rollout_tp if target.rollout_tp is None else target.rollout_tp
    if instances < 1:
        raise ReconfigureRefused(f"rollout_instances={instances}: a running job needs at least one rollout instance")
    if tp < 1:
        raise ReconfigureRefused(f"rollout_tp={tp}: must be at least 1")
    rule = rollout_rule_violation(limits.model, tp, limits.gpus_per_node)
    if rule is not None:
        raise ReconfigureRefused(f"rollout_tp={tp}: {rule.message} (rule {rule.code}); choose another TP")
    if instances == desired.rollout_instances and tp == desired.rollout_tp:
        raise ReconfigureRefused(f"the rollout pool already is {instances} instances of TP {tp}: nothing to change")
    free = desired.cluster_gpus - desired.train_gpus
    if desired.cluster_gpus and instances * tp > free and name != "cluster_swap":
        raise ReconfigureRefused(
            f"{instances} instances of TP {tp} need {instances * tp} GPUs; the cluster has {desired.cluster_gpus} "
            f"and training uses {desired.train_gpus}, leaving {free}: ask for at most {free // tp} instances"
        )
    label = (f"generation {desired.generation + 1}: rollout {desired.rollout_instances} x TP{desired.rollout_tp} "
             f"-> {instances} x TP{tp} by {name}")
    return desired.evolve(
        f"reconfigure: {label}",
        rollout_instances=instances,
        rollout_tp=tp,
        rollout_fingerprint=limits.fingerprint_for(tp),
        reconfigure_strategy=name,
        drain_before_stop=limits.drain_before_stop,
        cluster_swap_enabled=limits.cluster_swap_enabled,
        switch_now=name != "prewarm",
        reconfiguring=label,
    )


def trigger_switch(desired: DesiredState) -> DesiredState:
    """The prewarm trigger: let the prewarmed instances take over serving."""
    if not desired.reconfiguring or desired.switch_now:
        raise ReconfigureRefused("no prewarmed reconfiguration is waiting for its switch "
                                 f"(running: {desired.reconfiguring or 'none'})")
    return dataclasses.replace(desired, switch_now=True, reason=f"switch: {desired.reconfiguring}")


def finish_if_converged(observed: ObservedState, desired: DesiredState) -> DesiredState | None:
    """The desired state with the running reconfiguration finished, once the pool matches it (else None)."""
    if desired.reconfiguring and converged(observed, desired):
        return dataclasses.replace(desired, reconfiguring="", reason=f"done: {desired.reconfiguring}")
    return None
