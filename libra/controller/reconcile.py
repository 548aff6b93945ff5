"""The pure reconciler: `reconcile(observed, desired) -> list[Action]`.

No I/O, no clock, no randomness: the same observation and desired state always give the same actions, so
every decision is unit-tested from tables. Side effects are the executor's job.

How the rollout pool moves from its observed size to the desired one is a *strategy*: a function of the
same signature that plans actions over the same transition table. `diff` (start or stop only the
difference; failed members are replaced) is the strategy of a static job and of repairs; the resizing
strategies of the elastic runtime (restart_all, blue_green, prewarm, cluster_swap) register here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from libra.controller.members import Member, MemberState, StateTimeouts
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState, TrainLayout

S = MemberState


@dataclass(frozen=True)
class Action:
    """Base of all actions; `reason` is what the event log shows."""

    reason: str

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class CreateRolloutPool(Action):
    """Create the rollout pool with `num_instances` (live servers in the registry are adopted)."""

    num_instances: int
    member_ids: tuple[str, ...]


@dataclass(frozen=True)
class AddRolloutInstance(Action):
    member_id: str


@dataclass(frozen=True)
class StopRolloutInstance(Action):
    member_id: str
    drain: bool


@dataclass(frozen=True)
class CreateTrainingPool(Action):
    gpus: int
    layout: TrainLayout
    member_ids: tuple[str, ...]


@dataclass(frozen=True)
class MarkFailed(Action):
    member_id: str


Strategy = Callable[[ObservedState, DesiredState, set[str]], list[Action]]
"""(observed, desired, ids of members this tick already declared failed) -> rollout actions."""


def _next_ids(observed: ObservedState, pool: str, count: int) -> tuple[str, ...]:
    used = {m.id for m in observed.members}
    ids: list[str] = []
    index = 0
    while len(ids) < count:
        candidate = f"{pool}-{index}"
        if candidate not in used:
            ids.append(candidate)
        index += 1
    return tuple(ids)


_STOP_ORDER = {S.PENDING: 0, S.STARTING: 1, S.LOADING: 2, S.READY: 3}


def _surplus_order(member: Member) -> tuple[int, float]:
    """Stop the least useful first: not-yet-started before serving; among equals the newest first."""
    return (_STOP_ORDER.get(member.state, 0), -member.since)


def diff_strategy(observed: ObservedState, desired: DesiredState, failing: set[str]) -> list[Action]:
    """Replace failed instances and start or stop only the difference to the desired count."""
    actions: list[Action] = []
    members = observed.of(ROLLOUT)
    for member in members:
        if member.busy:
            continue
        if member.state == S.FAILED or member.id in failing:
            actions.append(StopRolloutInstance(f"replace failed member: {member.error or 'failed'}", member.id, False))
    live = [m for m in members if m.live and m.id not in failing]
    deficit = desired.rollout_instances - len(live)
    if deficit > 0:
        for member_id in _next_ids(observed, ROLLOUT, deficit):
            actions.append(
                AddRolloutInstance(f"{len(live)} live of {desired.rollout_instances} desired instances", member_id)
            )
    elif deficit < 0:
        idle = sorted((m for m in live if not m.busy), key=_surplus_order)
        for member in idle[: -deficit]:
            actions.append(
                StopRolloutInstance(
                    f"{len(live)} live of {desired.rollout_instances} desired instances",
                    member.id,
                    desired.drain_before_stop and member.state == S.READY,
                )
            )
    return actions


STRATEGIES: dict[str, Strategy] = {"diff": diff_strategy}


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
            ids = _next_ids(observed, ROLLOUT, desired.rollout_instances)
            actions.append(CreateRolloutPool("rollout pool not created", desired.rollout_instances, ids))
    elif not rollout_waits:
        strategy = STRATEGIES.get(desired.reconfigure_strategy)
        if strategy is None:
            raise KeyError(
                f"unknown rollout reconfigure strategy {desired.reconfigure_strategy!r}; "
                f"known: {sorted(STRATEGIES)}"
            )
        actions.extend(strategy(observed, desired, failing))

    train_waits = observed.train.busy or observed.now < observed.train.retry_at
    if not observed.train.created and not train_waits and desired.train_gpus > 0:
        ids = _next_ids(observed, TRAIN, desired.train_gpus)
        actions.append(CreateTrainingPool("training pool not created", desired.train_gpus, desired.train_layout, ids))
    return actions
