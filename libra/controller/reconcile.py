"""The pure reconciler: `reconcile(observed, desired) -> list[Action]`.

No I/O, no clock, no randomness: the same observation and desired state always give the same actions, so
every decision is unit-tested from tables. Side effects are the executor's job.

How the rollout pool moves from what runs to the desired count and spec is a *strategy*
(`libra.controller.strategies`): a planner of the same signature over the same transition table. While no
reconfiguration is in progress (`DesiredState.reconfiguring` empty) the rollout pool is kept as it is by
`diff` (failed members are replaced); a reconfiguration runs under `DesiredState.reconfigure_strategy`.
"""

from __future__ import annotations

from libra.controller.actions import (
    Action,
    CreateRolloutPool,
    CreateTrainingPool,
    MarkFailed,
    PublishWeights,
    SetServing,
    ShrinkTrainingPool,
    StartRolloutInstance,
    StopRolloutInstance,
    StrategyFallback,
)
from libra.controller.members import Member, MemberState, StateTimeouts, next_member_ids
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState
from libra.controller.strategies import STRATEGIES, Strategy, StrategyRefused, converged, diff_strategy
from libra.controller.train_plan import training_actions

S = MemberState

__all__ = [
    "STRATEGIES",
    "Action",
    "CreateRolloutPool",
    "CreateTrainingPool",
    "MarkFailed",
    "PublishWeights",
    "SetServing",
    "ShrinkTrainingPool",
    "StartRolloutInstance",
    "StopRolloutInstance",
    "Strategy",
    "StrategyFallback",
    "StrategyRefused",
    "converged",
    "diff_strategy",
    "reconcile",
    "strategy_for",
    "timed_out_members",
]


def strategy_for(desired: DesiredState) -> Strategy:
    """The planner of the rollout pool for this desired state (an unknown strategy name is an error)."""
    strategy = STRATEGIES.get(desired.reconfigure_strategy)
    if strategy is None:
        raise KeyError(
            f"unknown rollout reconfigure strategy {desired.reconfigure_strategy!r}; known: {sorted(STRATEGIES)}"
        )
    return strategy if desired.reconfiguring else diff_strategy


def timed_out_members(observed: ObservedState, timeouts: StateTimeouts) -> list[Member]:
    return [
        m for m in observed.members if m.state not in (S.FAILED, S.STOPPED) and m.timed_out(observed.now, timeouts)
    ]


def reconcile(
    observed: ObservedState, desired: DesiredState, timeouts: StateTimeouts | None = None
) -> list[Action]:
    """The actions that move `observed` towards `desired` (empty when they already agree)."""
    timeouts = timeouts or StateTimeouts()
    actions: list[Action] = []
    failing: set[str] = set()
    for member in timed_out_members(observed, timeouts):
        failing.add(member.id)
        actions.append(MarkFailed(f"{member.state.value} for {member.age(observed.now):.0f}s exceeds its timeout", member.id))

    rollout_waits = observed.rollout.busy or observed.now < observed.rollout.retry_at
    if not observed.rollout.created:
        if not rollout_waits and desired.rollout_instances > 0:
            ids = next_member_ids({m.id for m in observed.members}, ROLLOUT, desired.rollout_instances)
            actions.append(CreateRolloutPool("rollout pool not created", desired.rollout_instances, ids,
                                             desired.rollout_spec, desired.generation))
    elif not rollout_waits:
        actions.extend(strategy_for(desired)(observed, desired, failing))

    train_waits = observed.train.busy or observed.now < observed.train.retry_at
    if not observed.train.created and not train_waits and desired.train_gpus > 0:
        ids = next_member_ids({m.id for m in observed.members}, TRAIN, desired.train_gpus)
        actions.append(CreateTrainingPool("training pool not created", desired.train_gpus, desired.train_layout, ids))
    return training_actions(observed, desired, actions)
