"""Rollout reconfigure strategies: pure planners that move the rollout pool from what runs to the desired
count and spec, one step per control tick, over the member transition table.

Each strategy is `(observed, desired, failing) -> actions` and is called again on every tick until the pool
has converged, so a plan is always "the next safe step from here" (which is also what lets a restarted
controller finish a change: it observes what runs and continues). Common to all:

- a failed member is stopped and replaced (repairs are always `diff`);
- a member whose spec (TP, launch fingerprint) differs from the desired one is outdated;
- a started instance serves only after it holds the current weights (`PublishWeights`, then `SetServing`);
- starts never ask for more GPUs than are spare (cluster - training - rollout GPUs in use) when the
  cluster size is known.

`diff`: stop outdated and surplus members, start the deficit; unchanged members are never touched.
`restart_all`: stop every member of an earlier generation, then start the target set.
`blue_green`: start the green set beside the serving (blue) one on spare GPUs, publish the current weights
to it, flip serving to it atomically, then drain blue; with too few spare GPUs it falls back to `diff`.
`prewarm`: `blue_green` whose flip waits for `DesiredState.switch_now` (the trigger).
`cluster_swap`: `blue_green` that, lacking spare GPUs, first asks the training pool to give some up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from libra.controller.actions import (
    Action,
    PublishWeights,
    SetServing,
    ShrinkTrainingPool,
    StartRolloutInstance,
    StopRolloutInstance,
    StrategyFallback,
)
from libra.controller.members import Member, MemberState, next_member_ids
from libra.controller.state import ROLLOUT, DesiredState, ObservedState
from libra.controller.train_plan import training_gpus_held

S = MemberState

Strategy = Callable[[ObservedState, DesiredState, set[str]], list[Action]]
"""(observed, desired, ids of members this tick already declared failed) -> rollout actions."""


class StrategyRefused(ValueError):
    """The desired state asks for a strategy its settings do not allow."""


@dataclass
class RolloutPicture:
    """The rollout pool as every strategy reads it."""

    desired: DesiredState
    members: list[Member]
    used_ids: set[str]
    live: list[Member]  # live and not failing this tick
    current: list[Member]  # live with the desired spec
    outdated: list[Member]  # live with another spec
    spare_gpus: int | None  # None: the cluster size is unknown
    repairs: list[Action] = field(default_factory=list)
    starts_wait: bool = False  # the pool backs off new starts after members failed soon after becoming READY

    @property
    def target(self) -> int:
        return self.desired.rollout_instances

    def fits(self, count: int) -> int:
        """How many of `count` new instances fit on the spare GPUs."""
        if self.spare_gpus is None:
            return count
        return max(0, min(count, self.spare_gpus // max(1, self.desired.rollout_tp)))

    def start(self, count: int, why: str) -> list[Action]:
        if self.starts_wait:
            return []
        ids = next_member_ids(self.used_ids, ROLLOUT, count)
        self.used_ids.update(ids)
        return [StartRolloutInstance(why, member_id, self.desired.rollout_spec, self.desired.generation)
                for member_id in ids]

    def stop(self, member: Member, why: str) -> StopRolloutInstance:
        """Drain (when the job asks for it) every member that can hold requests: a READY one, and a LOADING one,
        whose requests wait for its reload and then finish on the new weights."""
        return StopRolloutInstance(why, member.id,
                                   self.desired.drain_before_stop and member.state in (S.READY, S.LOADING))


def outdated_by(member: Member, desired: DesiredState) -> list[str]:
    """Why `member` no longer matches the desired spec (empty = it matches)."""
    from libra.controller.state import RolloutSpec

    return RolloutSpec(member.tp or desired.rollout_tp, member.fingerprint).differs_from(desired.rollout_spec)


def picture(observed: ObservedState, desired: DesiredState, failing: set[str]) -> RolloutPicture:
    members = observed.of(ROLLOUT)
    repairs: list[Action] = []
    for member in members:
        if not member.busy and (member.state == S.FAILED or member.id in failing):
            repairs.append(StopRolloutInstance(f"replace failed member: {member.error or 'failed'}", member.id, False))
    live = [m for m in members if m.live and m.id not in failing]
    outdated = [m for m in live if outdated_by(m, desired)]
    current = [m for m in live if m not in outdated]
    spare: int | None = None
    if desired.cluster_gpus > 0:
        in_use = sum(m.gpus(desired.rollout_tp) for m in members if m.state != S.STOPPED)
        spare = max(0, desired.cluster_gpus - training_gpus_held(observed, desired) - in_use)
    # new ids avoid every member id and every instance id a pool reports (an adopted server keeps its own)
    used = {m.id for m in observed.members} | {m.key for m in observed.members if m.key}
    return RolloutPicture(desired, members, used, live, current, outdated, spare, repairs,
                          starts_wait=observed.now < observed.rollout.start_after)


_STOP_ORDER = {S.PENDING: 0, S.STARTING: 1, S.LOADING: 2, S.READY: 3}


def _surplus_order(member: Member) -> tuple[int, int, float]:
    """Stop the least useful first: not serving before serving, not-yet-started before ready; among equals
    the newest first."""
    return (int(member.serving), _STOP_ORDER.get(member.state, 0), -member.since)


def admit(p: RolloutPicture, candidates: Iterable[Member], staying_serving: Iterable[Member]) -> list[Action]:
    """Bring READY, idle, non-serving `candidates` into serving: publish the current weights to those that
    lack them; add the rest to the serving set (which keeps `staying_serving`)."""
    version = p.desired.publish_version
    waiting = [m for m in candidates if m.state == S.READY and not m.busy and not m.serving]
    stale = tuple(sorted(m.id for m in waiting if m.weight_version != version))
    fresh = [m.id for m in waiting if m.weight_version == version]
    actions: list[Action] = []
    if stale:
        actions.append(PublishWeights(f"{len(stale)} new instance(s) must hold weights v{version} before serving",
                                      version, stale))
    if fresh:
        serving = sorted({m.id for m in staying_serving if m.serving} | set(fresh))
        actions.append(SetServing(f"{', '.join(sorted(fresh))} hold weights v{version}", tuple(serving)))
    return actions


def converged(observed: ObservedState, desired: DesiredState) -> bool:
    """The rollout pool is exactly the desired one: the desired count of members with the desired spec, all
    READY and serving, nothing else alive or draining, no action in flight."""
    members = observed.of(ROLLOUT)
    if any(m.busy or m.state == S.DRAINING for m in members):
        return False
    live = [m for m in members if m.live]
    return (len(live) == desired.rollout_instances
            and all(m.state == S.READY and m.serving and not outdated_by(m, desired) for m in live))


def diff_strategy(observed: ObservedState, desired: DesiredState, failing: set[str]) -> list[Action]:
    """Stop outdated and surplus members, start the deficit, admit the new ones; touch nothing else."""
    p = picture(observed, desired, failing)
    return p.repairs + _diff_plan(p)


def _diff_plan(p: RolloutPicture) -> list[Action]:
    actions: list[Action] = []
    stopping: set[str] = set()
    for member in p.outdated:
        if not member.busy:
            actions.append(p.stop(member, f"outdated: {'; '.join(outdated_by(member, p.desired))}"))
            stopping.add(member.id)
    deficit = p.target - len(p.current)
    why = f"{len(p.current)} live of {p.target} desired instances"
    if deficit > 0:
        actions.extend(p.start(p.fits(deficit), why))
    elif deficit < 0:
        idle = sorted((m for m in p.current if not m.busy), key=_surplus_order)
        for member in idle[:-deficit]:
            actions.append(p.stop(member, why))
            stopping.add(member.id)
    kept = [m for m in p.current if m.id not in stopping]
    return actions + admit(p, kept, kept)


def restart_all_strategy(observed: ObservedState, desired: DesiredState, failing: set[str]) -> list[Action]:
    """Stop every member started for an earlier generation, then start the target set."""
    p = picture(observed, desired, failing)
    if converged(observed, desired):
        return p.repairs
    old = [m for m in p.live if m.generation < desired.generation]
    actions = p.repairs + [p.stop(m, f"restart_all to generation {desired.generation}") for m in old if not m.busy]
    if old or any(m.state == S.DRAINING for m in p.members):
        return actions  # the target set starts once every old instance is gone
    new = [m for m in p.current if m.generation >= desired.generation]
    deficit = p.target - len(new)
    if deficit > 0:
        actions.extend(p.start(p.fits(deficit), f"restart_all: {len(new)} of {p.target} started"))
    elif deficit < 0:
        actions.extend(p.stop(m, "restart_all: surplus") for m in sorted(new, key=_surplus_order)[:-deficit])
    return actions + admit(p, new, new)


def _switch_plan(p: RolloutPicture, name: str, hold_flip: bool, no_room: Callable[[int], list[Action]]) -> list[Action]:
    """blue_green / prewarm / cluster_swap: the next step of a switch from the serving set to a new one."""
    blue = [m for m in p.live if m.serving]
    # a serving member reloading its weights in place (LOADING) still serves: counting it out would make the
    # switch start a green set for a pool that already is the target, then drain that green set as surplus
    target_ready = [m for m in p.current if m.serving and m.state in (S.READY, S.LOADING)]
    # done flipping: exactly the target serves; drain everything else
    if len(blue) == p.target and len(target_ready) == p.target:
        return [p.stop(m, f"{name}: drain after the switch") for m in p.live if not m.serving and not m.busy]
    # a pure shrink: serve a subset of what already serves (no new instance needed, so prewarm starts none:
    # its flip to the subset waits for the trigger)
    if len(target_ready) > p.target and not p.outdated:
        if hold_flip:
            return []
        keep = sorted(target_ready, key=_surplus_order, reverse=True)[: p.target]
        return [SetServing(f"{name}: serve {p.target} of {len(target_ready)}", tuple(sorted(m.id for m in keep)))]
    green = [m for m in p.current if not m.serving]
    need = p.target - len(green)
    if need > 0:
        if p.fits(need) < need:
            return no_room(need)
        return p.start(need, f"{name}: green set {len(green)} of {p.target}")
    actions: list[Action] = []
    if need < 0:
        actions = [p.stop(m, f"{name}: surplus green") for m in sorted(green, key=_surplus_order)[:-need]
                   if not m.busy]
        return actions
    if any(m.busy or m.state != S.READY for m in green):
        return []  # wait until every green instance is ready
    version = p.desired.publish_version
    stale = tuple(sorted(m.id for m in green if m.weight_version != version))
    if stale:
        return [PublishWeights(f"{name}: green set must hold weights v{version}", version, stale)]
    if hold_flip:
        return []  # prewarmed: loaded and on current weights, waiting for the trigger
    return [SetServing(f"{name}: flip serving to the green set", tuple(sorted(m.id for m in green)))]


def _fallback_to_diff(p: RolloutPicture, name: str, need: int) -> list[Action]:
    plan = _diff_plan(p)
    if not any(isinstance(a, StartRolloutInstance | StopRolloutInstance) for a in plan):
        return plan  # only admitting members the fallback already started: said once, when it started them
    have = "unknown" if p.spare_gpus is None else str(p.spare_gpus)
    note = StrategyFallback(f"{name} needs {need * p.desired.rollout_tp} spare GPUs for the green set, "
                            f"{have} spare: falling back to diff", name, "diff")
    return [note, *plan]


def blue_green_strategy(observed: ObservedState, desired: DesiredState, failing: set[str]) -> list[Action]:
    p = picture(observed, desired, failing)
    return p.repairs + _switch_plan(p, "blue_green", False, lambda need: _fallback_to_diff(p, "blue_green", need))


def prewarm_strategy(observed: ObservedState, desired: DesiredState, failing: set[str]) -> list[Action]:
    """Start the target set ahead and keep it on current weights; flip once `desired.switch_now` is set
    (without spare GPUs: nothing before the trigger, then `diff`)."""
    p = picture(observed, desired, failing)
    hold = not desired.switch_now

    def no_room(need: int) -> list[Action]:
        return [] if hold else _fallback_to_diff(p, "prewarm", need)

    return p.repairs + _switch_plan(p, "prewarm", hold, no_room)


def cluster_swap_strategy(observed: ObservedState, desired: DesiredState, failing: set[str]) -> list[Action]:
    """`blue_green` where the missing GPUs come from the training pool (shrunk first, at a step boundary)."""
    if not desired.cluster_swap_enabled:
        raise StrategyRefused("the cluster_swap strategy needs global_resource_planner.runtime_cluster_swap_enabled: "
                              "true (and runtime_dynamic_reconfiguration_enabled); or pick blue_green or diff")
    p = picture(observed, desired, failing)

    def shrink_training(need: int) -> list[Action]:
        missing = need * desired.rollout_tp - (p.spare_gpus or 0)
        return [ShrinkTrainingPool(f"cluster_swap: the green set needs {missing} more GPUs", missing)]

    return p.repairs + _switch_plan(p, "cluster_swap", False, shrink_training)


STRATEGIES: dict[str, Strategy] = {
    "diff": diff_strategy,
    "restart_all": restart_all_strategy,
    "blue_green": blue_green_strategy,
    "prewarm": prewarm_strategy,
    "cluster_swap": cluster_swap_strategy,
}
