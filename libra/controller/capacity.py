"""The pools after the cluster lost GPUs while the job runs (a Ray node died or was removed).

`fit_to_capacity` is the pure decision. What survived keeps its place where it can: a training pool whose
ranks all live keeps its size when the rollout instances that still fit leave it room; otherwise (a rank was
on the lost node, or the minimum rollout pool needs its GPUs) the split uses the most of the GPUs that
remain and, among those, keeps the running training share best, with at least `min_train_gpus` / `min_rollout_gpus` (and one GPU
for each pool), a training layout the model and the batch allow (`fit_layout` and the job's own training
checks) and whole rollout instances of the running TP. None when even the minimums do not fit: the job then
stops with one line saying what is left and how to resume (`CapacityLost`).

`shrink_to_capacity` turns a fit into the desired state (strategy `diff`, which needs no spare GPU): the
control loop stops rollout instances beyond the new count and starts none on the lost node's behalf; the
training pool is restarted at its new size by the RL loop (`Controller.replan_onto_capacity`). A node loss is
not an elective change: the operator's reconfiguration switches do not gate it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from libra.controller.state import DesiredState
from libra.controller.train_plan import fit_layout
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec

STRATEGY = "diff"


class CapacityLost(RuntimeError):
    """The GPUs left in the cluster cannot hold the job's minimum pools."""


@dataclass(frozen=True)
class CapacityFit:
    """The pools on the `live_gpus` GPUs the cluster has now."""

    live_gpus: int
    train_gpus: int
    train_layout: TrainLayout
    rollout_instances: int

    def training_changes(self, desired: DesiredState) -> bool:
        return (self.train_gpus, self.train_layout) != (desired.train_gpus, desired.train_layout)

    def describe(self, desired: DesiredState) -> str:
        return (f"{gpus_in_use(desired)} -> {self.live_gpus} GPUs: training {desired.train_gpus} -> "
                f"{self.train_gpus} GPUs {self.train_layout.describe(self.train_gpus)}, rollout "
                f"{desired.rollout_instances} -> {self.rollout_instances} x TP{desired.rollout_tp}")


def gpus_in_use(desired: DesiredState) -> int:
    """The GPUs the desired pools hold."""
    return desired.train_gpus + desired.rollout_instances * max(1, desired.rollout_tp)


def fit_to_capacity(desired: DesiredState, live_gpus: int, *, training_lost: bool, min_train_gpus: int = 0,
                    min_rollout_gpus: int = 0, model: ModelSpec | None = None, gpus_per_node: int | None = None,
                    train_problems: Callable[[int, TrainLayout], list[str]] | None = None) -> CapacityFit | None:
    """The pools on `live_gpus` GPUs (see the module), or None when no split keeps both minimums."""
    tp = max(1, desired.rollout_tp)
    share = desired.train_gpus / max(1, gpus_in_use(desired))
    min_rollout = max(1, min_rollout_gpus)
    options: list[tuple[tuple[int, int, float], CapacityFit]] = []
    for instances in range(min(desired.rollout_instances, live_gpus // tp), 0, -1):
        rollout = instances * tp
        if rollout < min_rollout:
            break
        for train in range(min(desired.train_gpus, live_gpus - rollout), max(1, min_train_gpus) - 1, -1):
            kept = not training_lost and train == desired.train_gpus
            layout = desired.train_layout if kept else fit_layout(desired.train_layout, train, model, gpus_per_node)
            if not kept and (layout.problems(model, world=train, gpus_per_node=gpus_per_node)
                             or (train_problems is not None and train_problems(train, layout))):
                continue
            # a running training pool kept beats any other split; then the most GPUs used; then the share
            key = (0 if kept else 1, -(train + rollout), round(abs(train / (train + rollout) - share), 9))
            options.append((key, CapacityFit(live_gpus, train, layout, instances)))
    return min(options, key=lambda option: option[0])[1] if options else None


def shrink_to_capacity(desired: DesiredState, fit: CapacityFit, fingerprint: str,
                       before_loss: DesiredState | None = None) -> DesiredState:
    """The desired state that carries out `fit`: a new generation, strategy `diff`, switched at once; its label
    describes the change from `before_loss` (default `desired`: a part of it may already have been applied)."""
    label = (f"generation {desired.generation + 1}: the cluster lost GPUs, {fit.describe(before_loss or desired)} "
             f"by {STRATEGY}")
    return desired.evolve(
        f"capacity: {label}",
        cluster_gpus=fit.live_gpus,
        rollout_instances=fit.rollout_instances,
        rollout_fingerprint=fingerprint,
        train_gpus=fit.train_gpus,
        train_layout=fit.train_layout,
        reconfigure_strategy=STRATEGY,
        switch_now=True,
        reconfiguring=label,
    )
