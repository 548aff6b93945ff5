"""Requests to reconfigure the pools of a running job, as pure functions over the desired state.

`plan_reconfigure` checks a request (rollout count and/or TP, training GPUs and/or layout, strategy) against
the cluster, the model and the job's switches and returns the next desired state: the new target, the
strategy, the next generation, and `reconfiguring` naming the change in progress (checkpointed with the
desired state, so a restarted controller observes what runs and finishes the change).
`finish_if_converged` ends a change once both pools match their target. One reconfiguration runs at a time;
a second request is refused naming the running one.

Training changes need `runtime_reconfigure_training`; the layout is checked by the planner's rules
(`TrainLayout.problems`) and by `ReconfigureLimits.train_problems` (what the platform cannot run, memory).
With `runtime_training_pool_plan_only` a request that changes the training pool changes nothing: the
decision is recorded (`DesiredState.planned_training`, the event log, the trace) and no worker is attached
or detached. A `cluster_swap` moves GPUs between the pools: training takes what rollout leaves (or the
training target named in the request), at the layout closest to the current one that fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from libra.controller.state import DesiredState, ObservedState
from libra.controller.strategies import STRATEGIES, converged
from libra.controller.train_plan import fit_layout, training_converged
from planner.layout import TrainLayout, rollout_rule_violation
from planner.model_spec import ModelSpec

MASTER_SWITCH = "global_resource_planner.runtime_dynamic_reconfiguration_enabled"
SWAP_SWITCH = "global_resource_planner.runtime_cluster_swap_enabled"
TRAINING_SWITCH = "global_resource_planner.runtime_reconfigure_training"
PLAN_ONLY_SWITCH = "global_resource_planner.runtime_training_pool_plan_only"


class ReconfigureRefused(ValueError):
    """A reconfiguration request that cannot run; the message names the field, the value and the fix."""


_TRAIN_DEGREES = ("train_tp", "train_pp", "train_ep", "train_cp")


@dataclass(frozen=True)
class ReconfigureTarget:
    """The pools wanted (None = keep): the rollout pool's instance count and TP, the training pool's GPU
    count and parallel degrees (DP follows from the GPU count)."""

    rollout_instances: int | None = None
    rollout_tp: int | None = None
    train_gpus: int | None = None
    train_tp: int | None = None
    train_pp: int | None = None
    train_ep: int | None = None
    train_cp: int | None = None

    @property
    def changes_training(self) -> bool:
        return self.train_gpus is not None or any(getattr(self, name) is not None for name in _TRAIN_DEGREES)

    def train_layout(self, current: TrainLayout) -> TrainLayout:
        """`current` with the degrees this target names (virtual stages only while PP > 1)."""
        tp, pp, ep, cp = (current.tp if self.train_tp is None else self.train_tp,
                          current.pp if self.train_pp is None else self.train_pp,
                          current.ep if self.train_ep is None else self.train_ep,
                          current.cp if self.train_cp is None else self.train_cp)
        return TrainLayout(tp=tp, pp=pp, cp=cp, ep=ep, vpp=current.vpp if pp > 1 else 1)

    def describe(self) -> str:
        parts = []
        if self.rollout_instances is not None:
            parts.append(f"{self.rollout_instances} instances")
        if self.rollout_tp is not None:
            parts.append(f"TP {self.rollout_tp}")
        if self.train_gpus is not None:
            parts.append(f"training {self.train_gpus} GPUs")
        parts += [f"{name.replace('_', ' ').replace('train', 'training')} {getattr(self, name)}"
                  for name in _TRAIN_DEGREES if getattr(self, name) is not None]
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
    reconfigure_training: bool = False  # runtime_reconfigure_training
    training_plan_only: bool = False  # runtime_training_pool_plan_only
    # (GPUs, layout) -> what the platform or the memory budget refuses beyond the layout rules ([] = fine)
    train_problems: Callable[[int, TrainLayout], list[str]] | None = None


def plan_reconfigure(desired: DesiredState, target: ReconfigureTarget, strategy: str | None,
                     limits: ReconfigureLimits, observed: ObservedState) -> DesiredState:
    """The desired state that carries out `target` by `strategy` (default: the job's configured one), or
    ReconfigureRefused saying why not."""
    if not limits.enabled:
        raise ReconfigureRefused(f"{MASTER_SWITCH} is false: the rollout pool keeps its launch size; set it to "
                                 "true to reconfigure a running job")
    if desired.reconfiguring and not (converged(observed, desired) and training_converged(observed, desired)):
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
    rollout_changes = (instances, tp) != (desired.rollout_instances, desired.rollout_tp)
    swap = name == "cluster_swap" and rollout_changes
    train_gpus, train_layout = _training_target(desired, target, limits, instances * tp if swap else None)
    training_changes = (train_gpus, train_layout) != (desired.train_gpus, desired.train_layout)
    if not rollout_changes and not training_changes:
        raise ReconfigureRefused(f"the rollout pool already is {instances} instances of TP {tp} and the training "
                                 f"pool {desired.train_layout.describe(desired.train_gpus)} on "
                                 f"{desired.train_gpus} GPUs: nothing to change")
    if training_changes and limits.training_plan_only:
        label = _train_label(desired, train_gpus, train_layout)
        return dataclasses.replace(desired, planned_training=f"plan only: {label}" + (
            f" (with rollout {instances} x TP{tp})" if rollout_changes else ""), reason=f"plan only: {label}")
    _check_gpus(desired, instances, tp, train_gpus, name, rollout_changes)
    label = f"generation {desired.generation + 1}: " + "; ".join(
        ([f"rollout {desired.rollout_instances} x TP{desired.rollout_tp} -> {instances} x TP{tp}"]
         if rollout_changes else []) + ([_train_label(desired, train_gpus, train_layout)] if training_changes else [])
    ) + (f" by {name}" if rollout_changes else " by a checkpoint resize")
    return desired.evolve(
        f"reconfigure: {label}",
        rollout_instances=instances,
        rollout_tp=tp,
        rollout_fingerprint=limits.fingerprint_for(tp),
        train_gpus=train_gpus,
        train_layout=train_layout,
        reconfigure_strategy=name,
        drain_before_stop=limits.drain_before_stop,
        cluster_swap_enabled=limits.cluster_swap_enabled,
        switch_now=name != "prewarm",
        reconfiguring=label,
    )


def _train_label(desired: DesiredState, gpus: int, layout: TrainLayout) -> str:
    return (f"training {desired.train_gpus} GPUs {desired.train_layout.describe(desired.train_gpus)} -> "
            f"{gpus} GPUs {layout.describe(gpus)}")


def _training_target(desired: DesiredState, target: ReconfigureTarget, limits: ReconfigureLimits,
                     swap_rollout_gpus: int | None) -> tuple[int, TrainLayout]:
    """The training pool's GPUs and layout after the request (unchanged unless it asks for a change or
    swaps GPUs with the rollout pool), checked by the planner's layout rules and `limits.train_problems`."""
    if not target.changes_training and swap_rollout_gpus is None:
        return desired.train_gpus, desired.train_layout
    if not limits.reconfigure_training:
        what = "a cluster swap changes the training pool" if not target.changes_training else \
            f"the training pool cannot change ({target.describe()})"
        raise ReconfigureRefused(f"{TRAINING_SWITCH} is false: {what}; set it to true to resize or re-lay out the "
                                 "training pool of a running job")
    gpus = target.train_gpus
    if gpus is None:
        gpus = desired.train_gpus
        if swap_rollout_gpus is not None and desired.cluster_gpus > 0:
            gpus = desired.cluster_gpus - swap_rollout_gpus  # training takes what the rollout pool leaves
    if gpus < 1:
        raise ReconfigureRefused(f"train_gpus={gpus}: a running job needs at least one training GPU; ask for fewer "
                                 "rollout GPUs")
    named = any(getattr(target, name) is not None for name in _TRAIN_DEGREES)
    layout = target.train_layout(desired.train_layout) if named else \
        fit_layout(desired.train_layout, gpus, limits.model, limits.gpus_per_node)
    problems = [f"{_field(rule.degree)}={_value(rule.degree, layout, gpus)}: {rule.message} (rule {rule.code})"
                for rule in layout.problems(limits.model, world=gpus, gpus_per_node=limits.gpus_per_node)]
    if not problems and limits.train_problems is not None:
        problems = limits.train_problems(gpus, layout)
    if problems:
        raise ReconfigureRefused("the training target " + layout.describe(gpus) + f" on {gpus} GPUs cannot run: "
                                 + "; ".join(problems) + "; choose other train_gpus / train_tp / train_pp / train_ep")
    return gpus, layout


def _field(degree: str) -> str:
    return "train_gpus" if degree in ("world", "") else f"train_{degree}"


def _value(degree: str, layout: TrainLayout, gpus: int) -> int:
    return gpus if degree in ("world", "") else int(getattr(layout, degree))


def _check_gpus(desired: DesiredState, instances: int, tp: int, train_gpus: int, strategy: str,
                rollout_changes: bool) -> None:
    """Both pools must fit the cluster after the change; a cluster swap must also fit while its new rollout
    instances start beside the serving ones (training lends GPUs for that, keeping at least one)."""
    cluster = desired.cluster_gpus
    if not cluster:
        return
    free = cluster - train_gpus
    if instances * tp > free:
        raise ReconfigureRefused(
            f"{instances} instances of TP {tp} need {instances * tp} GPUs; the cluster has {cluster} "
            f"and training uses {train_gpus}, leaving {free}: ask for at most {free // tp} instances"
            + ("" if strategy == "cluster_swap" else ", or use cluster_swap to take GPUs from training")
        )
    grows = instances * tp > desired.rollout_gpus
    if strategy == "cluster_swap" and rollout_changes and grows:
        peak = desired.rollout_gpus + instances * tp
        if cluster - peak < 1:
            raise ReconfigureRefused(
                f"cluster_swap starts the {instances * tp} GPUs of the new rollout instances beside the "
                f"{desired.rollout_gpus} serving ones ({peak} of {cluster} GPUs), leaving no GPU to training; "
                "ask for fewer instances, or use diff"
            )


def trigger_switch(desired: DesiredState) -> DesiredState:
    """The prewarm trigger: let the prewarmed instances take over serving."""
    if not desired.reconfiguring or desired.switch_now:
        raise ReconfigureRefused("no prewarmed reconfiguration is waiting for its switch "
                                 f"(running: {desired.reconfiguring or 'none'})")
    return dataclasses.replace(desired, switch_now=True, reason=f"switch: {desired.reconfiguring}")


def finish_if_converged(observed: ObservedState, desired: DesiredState) -> DesiredState | None:
    """The desired state with the running reconfiguration finished, once both pools match it (else None)."""
    if desired.reconfiguring and converged(observed, desired) and training_converged(observed, desired):
        return dataclasses.replace(desired, reconfiguring="", reason=f"done: {desired.reconfiguring}")
    return None
