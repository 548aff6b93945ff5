"""The training half of the reconciler, as pure functions: when the training pool differs from the desired
GPU count or layout, the next safe step that moves it there (`training_actions`), and when it has arrived
(`training_converged`).

The training pool's members are its ranks; the pool reports each with the layout it runs as the member's
fingerprint (`layout_fingerprint`), so a layout change with the same GPU count is seen as outdated members.
A change is one `ResizeTrainingPool` action (checkpoint path, at a step boundary), never a partial one.

Order in a GPU exchange with the rollout pool (cluster swap): a shrink runs at once; a grow waits until the
rollout pool has released the GPUs it needs (cluster GPUs - rollout GPUs held >= the new size). When the
rollout `cluster_swap` strategy lacks spare GPUs for its green set it asks for `ShrinkTrainingPool(n)`: the
training pool then lends `n` GPUs (it shrinks below its desired size, at a layout that fits) and grows back
once the rollout switch has drained the old instances. No action is planned while a training change is in
flight.
"""

from __future__ import annotations

from libra.controller.actions import Action, ResizeTrainingPool, ShrinkTrainingPool, StartRolloutInstance
from libra.controller.members import Member, MemberState, next_member_ids
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState, RolloutSpec
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec

S = MemberState


def layout_fingerprint(layout: TrainLayout) -> str:
    """How a training member reports the layout its pool runs."""
    return layout.label()


def held_training_members(observed: ObservedState) -> list[Member]:
    """Training members that hold a GPU (every one not yet stopped)."""
    return [m for m in observed.of(TRAIN) if m.state != S.STOPPED]


def training_converged(observed: ObservedState, desired: DesiredState) -> bool:
    """The training pool is the desired one: `train_gpus` READY ranks running `train_layout`, nothing else
    holding a GPU, no action in flight. True when the pool is not created yet or reports no ranks at all
    (nothing to converge)."""
    if not observed.train.created or not observed.of(TRAIN):
        return True
    if observed.train.busy:
        return False
    held = held_training_members(observed)
    want = layout_fingerprint(desired.train_layout)
    return (len(held) == desired.train_gpus
            and all(m.state == S.READY and not m.busy and m.fingerprint in ("", want) for m in held))


def rollout_gpus_held(observed: ObservedState, desired: DesiredState) -> int:
    return sum(m.gpus(desired.rollout_tp) for m in observed.of(ROLLOUT) if m.state != S.STOPPED)


def rollout_needs_new_instances(observed: ObservedState, desired: DesiredState) -> bool:
    """Whether the rollout pool must start instances to reach the desired one, as a switch counts it: live
    instances of another spec, or fewer serving instances of the desired spec than wanted and a green set (the
    desired spec, not serving) short of the wanted count. The serving (blue) instances do not count towards the
    green set: a swap whose green set found GPUs for some of its instances asks for the rest. A strategy that
    asks for training GPUs while this is false reads a passing state (serving instances reloading weights look
    not ready), and is not lent any."""
    live = [m for m in observed.of(ROLLOUT) if m.live]
    outdated = [m for m in live if RolloutSpec(m.tp or desired.rollout_tp, m.fingerprint).differs_from(
        desired.rollout_spec)]
    current = [m for m in live if m not in outdated]
    if not outdated and sum(m.serving for m in current) >= desired.rollout_instances:
        return False  # the target serves already, or a subset of what serves will
    return sum(not m.serving for m in current) < desired.rollout_instances


def rollout_switch_finished(observed: ObservedState, desired: DesiredState) -> bool:
    """The rollout pool holds only what the desired state wants: the desired count live and serving, nothing
    draining and no action in flight. A training pool that lent GPUs to a cluster swap grows back only then:
    a GPU freed earlier (a green instance that failed, waiting out its start back-off) belongs to its
    replacement, and a training pool at its desired size would not lend it again. Looser than the rollout
    strategies' `converged`: a serving instance reloading its weights counts (publishes come every step or
    two, and the grow would wait for a moment without one)."""
    members = observed.of(ROLLOUT)
    if any(m.busy or m.state == S.DRAINING for m in members):
        return False
    live = [m for m in members if m.live]
    return len(live) == desired.rollout_instances and all(m.serving for m in live)


def training_gpus_held(observed: ObservedState, desired: DesiredState) -> int:
    """The GPUs the rollout strategies must leave to training: what its ranks hold now (a cluster swap lends
    GPUs below the desired size), or the desired size while the pool is not created or may still grow."""
    held = len(held_training_members(observed))
    if not held:
        return desired.train_gpus
    if desired.reconfigure_strategy == "cluster_swap" and desired.reconfiguring:
        return held
    return max(held, desired.train_gpus)


def fit_layout(layout: TrainLayout, gpus: int, model: ModelSpec | None = None,
               gpus_per_node: int | None = None) -> TrainLayout:
    """The layout closest to `layout` that a pool of `gpus` GPUs can run: the degrees are kept where the
    planner's rules allow, else PP, then TP, then CP, then EP are lowered (to the largest valid divisor)."""
    if not layout.problems(model, world=gpus, gpus_per_node=gpus_per_node):
        return layout
    candidates = []
    for pp in _divisors_down(layout.pp):
        for tp in _divisors_down(layout.tp):
            for cp in _divisors_down(layout.cp):
                for ep in _divisors_down(layout.ep):
                    candidate = TrainLayout(tp=tp, pp=pp, cp=cp, ep=ep, vpp=layout.vpp if pp > 1 else 1)
                    if not candidate.problems(model, world=gpus, gpus_per_node=gpus_per_node):
                        candidates.append(candidate)
    if not candidates:
        return TrainLayout()
    # prefer keeping the larger degrees, in the order PP, TP, CP, EP are given up
    return max(candidates, key=lambda c: (c.ep, c.cp, c.tp, c.pp))


def _divisors_down(value: int) -> list[int]:
    return [d for d in range(max(1, value), 0, -1) if value % d == 0]


def training_actions(observed: ObservedState, desired: DesiredState, planned: list[Action],
                     model: ModelSpec | None = None) -> list[Action]:
    """`planned` (the rollout pool's actions of this tick) with the training pool's next step: a
    `ShrinkTrainingPool` of the rollout strategy becomes one `ResizeTrainingPool` that lends the GPUs (or is
    dropped while a training change is in flight), and a training pool that differs from the desired one is
    resized when the GPUs it needs are free."""
    asks = [a for a in planned if isinstance(a, ShrinkTrainingPool)]
    actions = [a for a in planned if not isinstance(a, ShrinkTrainingPool)]
    train = observed.train
    if not train.created or not observed.of(TRAIN):
        return planned  # no rank known: nothing to resize (the executor refuses to lend what is not there)
    if train.busy or observed.now < train.retry_at:
        return actions
    held = held_training_members(observed)
    if any(m.busy for m in held):
        return actions
    running = [m for m in held if m.live]
    size = len(running)
    used = {m.id for m in observed.members} | {m.key for m in observed.members if m.key}
    if asks and rollout_needs_new_instances(observed, desired):
        lend = max(a.gpus for a in asks)
        gpus = min(desired.train_gpus, size - lend)  # the strategy counted the GPUs the ranks hold now
        if gpus < 1:
            return actions  # refused when the swap was requested; nothing sane to do here
        layout = fit_layout(desired.train_layout, gpus, model)
        ids = next_member_ids(used, TRAIN, gpus)
        return actions + [ResizeTrainingPool(f"cluster_swap: lend {lend} training GPU(s) to the rollout pool's "
                                             f"new instances", gpus, layout, ids, desired.generation)]
    if training_converged(observed, desired):
        return actions
    swapping = desired.reconfigure_strategy == "cluster_swap" and bool(desired.reconfiguring)
    if swapping and size < desired.train_gpus and not rollout_switch_finished(observed, desired):
        return actions  # lent GPUs come back once the switch has drained the old instances
    starting = sum(a.spec.tp for a in actions if isinstance(a, StartRolloutInstance))  # planned this tick
    free = desired.cluster_gpus - rollout_gpus_held(observed, desired) - starting
    if desired.cluster_gpus > 0 and desired.train_gpus > free:
        return actions  # grow once the rollout pool has released the GPUs
    ids = next_member_ids(used, TRAIN, desired.train_gpus)
    was = f"{size} GPUs" if not running else f"{size} GPUs {running[0].fingerprint or 'layout unknown'}"
    why = f"training pool {was} -> {desired.train_gpus} GPUs {desired.train_layout.label()}"
    return actions + [ResizeTrainingPool(why, desired.train_gpus, desired.train_layout, ids, desired.generation)]
