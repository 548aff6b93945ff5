"""Dry run of a reconfiguration request: the action plan the reconciler would execute, and what it buys.

The request's next desired state comes from the same `plan_reconfigure` the controller uses (so a request the
controller would refuse is refused here too). The plan is the reconciler itself (`reconcile`, with the
request's strategy) run tick by tick on a copy of the observed state, each action applied to the copy as if
it succeeded at once (a start yields a READY instance, a stop a STOPPED one, a publish sets its weight version,
a serving flip moves traffic), until the pool converges. Nothing of the running job is touched.

Throughput before and after is the planner's cost model (`planner.search.evaluate`) for the split before and
after; the expected switch cost is computed from the plan: each control tick that starts instances costs
the cost model's rollout start-up time, each weight publish its reload time, and the time during which fewer
instances serve than before is the serving gap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from libra.config import Config
from libra.controller.actions import (
    Action,
    PublishWeights,
    ResizeTrainingPool,
    SetServing,
    ShrinkTrainingPool,
    StartRolloutInstance,
    StopRolloutInstance,
    StrategyFallback,
)
from libra.controller.members import Member, MemberState, StateTimeouts
from libra.controller.reconcile import converged, reconcile
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState, PoolObservation
from libra.controller.train_plan import layout_fingerprint, training_converged
from planner.layout import TrainLayout

MAX_TICKS = 64
_NO_TIMEOUTS = StateTimeouts(pending_s=1e12, starting_s=1e12, loading_s=1e12, draining_s=1e12)


@dataclass(frozen=True)
class PlannedStep:
    tick: int
    kind: str
    member: str
    detail: str
    reason: str


@dataclass
class DryRunResult:
    """The plan of one request and its predicted effect."""

    actions: list[PlannedStep]
    rollout_before: str
    rollout_after: str
    train_layout_before: str
    train_layout_after: str
    step_s_before: float = 0.0
    step_s_after: float = 0.0
    samples_per_s_before: float = 0.0
    samples_per_s_after: float = 0.0
    switch_cost_s: float = 0.0
    serving_gap_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for step in self.actions if step.kind == kind)


def _describe(action: Action) -> tuple[str, str]:
    """(member ids, detail) of one action."""
    if isinstance(action, StartRolloutInstance):
        return action.member_id, f"TP {action.spec.tp}, generation {action.generation}"
    if isinstance(action, StopRolloutInstance):
        return action.member_id, "drain" if action.drain else "abort in-flight requests (requeued)"
    if isinstance(action, PublishWeights):
        return ",".join(action.member_ids), f"weights v{action.version}"
    if isinstance(action, SetServing):
        return ",".join(action.member_ids), "serving set"
    if isinstance(action, ShrinkTrainingPool):
        return "", f"{action.gpus} GPUs"
    if isinstance(action, ResizeTrainingPool):
        return ",".join(action.member_ids), f"{action.gpus} GPUs {action.layout.describe(action.gpus)}"
    if isinstance(action, StrategyFallback):
        return "", f"{action.strategy} -> {action.used}"
    return getattr(action, "member_id", ""), ""


def _apply(members: dict[str, Member], action: Action, now: float) -> None:
    """The effect of `action` on the members' copy, as if it succeeded at once."""
    if isinstance(action, StartRolloutInstance):
        members[action.member_id] = Member(action.member_id, ROLLOUT, MemberState.READY, now, key=action.member_id,
                                           tp=action.spec.tp, fingerprint=action.spec.fingerprint,
                                           generation=action.generation)
    elif isinstance(action, StopRolloutInstance) and action.member_id in members:
        # kept as STOPPED, as the tracker keeps it: its id is never given to a new instance
        members[action.member_id] = dataclasses.replace(members[action.member_id], state=MemberState.STOPPED,
                                                        serving=False)
    elif isinstance(action, PublishWeights):
        for member_id in action.member_ids:
            if member_id in members:
                members[member_id].weight_version = action.version
    elif isinstance(action, ResizeTrainingPool):
        for member in list(members.values()):
            if member.pool == TRAIN and member.state != MemberState.STOPPED:
                members[member.id] = dataclasses.replace(member, state=MemberState.STOPPED)
        for member_id in action.member_ids:
            members[member_id] = Member(member_id, TRAIN, MemberState.READY, now, key=member_id,
                                        fingerprint=layout_fingerprint(action.layout),
                                        generation=action.generation)
    elif isinstance(action, SetServing):
        for member in members.values():
            if member.pool == ROLLOUT:
                member.serving = member.id in action.member_ids


def simulate(observed: ObservedState, desired: DesiredState) -> tuple[list[tuple[int, Action]], list[str]]:
    """The reconciler's actions, tick by tick, on an idealised copy of `observed` until it converges."""
    members = {m.id: dataclasses.replace(m, busy=False, history=[]) for m in observed.members}
    planned: list[tuple[int, Action]] = []
    notes: list[str] = []
    for tick in range(MAX_TICKS):
        now = observed.now + tick
        view = ObservedState(now, PoolObservation(created=observed.rollout.created),
                             PoolObservation(created=observed.train.created), tuple(members.values()))
        if converged(view, desired) and training_converged(view, desired):
            return planned, notes
        actions = reconcile(view, desired, _NO_TIMEOUTS)
        if not actions:
            if not desired.switch_now:
                notes.append(f"tick {tick}: the prewarmed set waits for the switch trigger; the plan goes on as if "
                             "it came now")
                desired = dataclasses.replace(desired, switch_now=True)
                continue
            notes.append(f"tick {tick}: the reconciler plans nothing more, but the pool has not converged")
            return planned, notes
        for action in actions:
            planned.append((tick, action))
            _apply(members, action, now)
    notes.append(f"the plan did not converge within {MAX_TICKS} ticks")
    return planned, notes


def _serving(members: list[Member]) -> int:
    return sum(1 for m in members if m.pool == ROLLOUT and m.serving)


def switch_costs(planned: list[tuple[int, Action]], observed: ObservedState, start_s: float,
                 reload_s: float) -> tuple[float, float]:
    """(seconds until the target serves, seconds with fewer instances serving than now), from the plan: ticks
    that start instances take `start_s` (the starts of one tick run in parallel), a publish `reload_s`."""
    serving_now = _serving(list(observed.members))
    members = {m.id: dataclasses.replace(m, history=[]) for m in observed.members}
    total = gap = 0.0
    for tick in sorted({t for t, _ in planned}):
        actions = [a for t, a in planned if t == tick]
        seconds = 0.0
        if any(isinstance(a, StartRolloutInstance) for a in actions):
            seconds += start_s
        if any(isinstance(a, PublishWeights) for a in actions):
            seconds += reload_s
        for action in actions:
            _apply(members, action, 0.0)
        if _serving(list(members.values())) < serving_now:
            gap += seconds
        total += seconds
    return total, gap


def predicted(cfg: Config, train_gpus: int, layout: TrainLayout, rollout_gpus: int, rollout_tp: int) -> tuple[float, float]:
    """The planner's (step seconds, samples per second) for one split of this job."""
    from libra.planning import planner_inputs
    from planner.plan import Candidate
    from planner.search import evaluate

    evaluation = evaluate(planner_inputs(cfg), Candidate(train_gpus, rollout_gpus, layout, rollout_tp),
                          check_thresholds=False)
    return float(evaluation.step_s), float(evaluation.samples_per_s)


def dry_run(cfg: Config, current: DesiredState, target: DesiredState, observed: ObservedState) -> DryRunResult:
    """The plan that moves `observed` (under `current`) to `target` (from `plan_reconfigure`)."""
    planned, notes = simulate(observed, target)
    steps = [PlannedStep(tick, a.kind, *_describe(a), a.reason) for tick, a in planned]
    result = DryRunResult(
        steps,
        rollout_before=f"{current.rollout_instances} x TP{current.rollout_tp} ({current.rollout_gpus} GPUs)",
        rollout_after=f"{target.rollout_instances} x TP{target.rollout_tp} ({target.rollout_gpus} GPUs)",
        train_layout_before=f"{current.train_gpus} GPUs {current.train_layout.describe(current.train_gpus)}",
        train_layout_after=f"{target.train_gpus} GPUs {target.train_layout.describe(target.train_gpus)}",
        notes=notes,
    )
    try:
        from libra.planning import planner_inputs

        inputs = planner_inputs(cfg)
        result.step_s_before, result.samples_per_s_before = predicted(
            cfg, current.train_gpus, current.train_layout, current.rollout_gpus, current.rollout_tp)
        result.step_s_after, result.samples_per_s_after = predicted(
            cfg, target.train_gpus, target.train_layout, target.rollout_gpus, target.rollout_tp)
        reload_s = (inputs.cost.weight_reload_inplace_s if cfg.rollout_weight_reload_method == "inplace"
                    else inputs.cost.weight_reload_restart_s)
        result.switch_cost_s, result.serving_gap_s = switch_costs(planned, observed, inputs.cost.rollout_restart_s,
                                                                  reload_s)
    except Exception as exc:  # a prediction is an extra: the plan stands without it
        result.notes.append(f"no prediction: {type(exc).__name__}: {exc}")
    return result
