"""Online re-planning in the running job (`runtime_online_replanning`).

Every `replan_interval_steps` steps, at the step boundary, the re-planner turns the metric rows the RL loop
recorded since the pools last changed into a `planner.replan.Observation` (rollout tokens/s while generating,
training seconds per step, weight-publish seconds, wall seconds per step, queue depth, response-length mean
and trend, each pool's idle share) and decides through `planner.replan_review.OnlineReplanning`: it first
reviews the last change on what the new split measured (undoing one that did not deliver), then asks
`planner.replan.replan` for the best alternative split (cost model calibrated on those figures, switch cost
as measured for this job when it has switched before, the planner's estimate otherwise, paid back over the
job's remaining steps) and, when the predicted gain passes `replan_min_gain`, requests the reconfiguration
through `Controller.request_reconfigure`, the same path an operator request takes (configured strategy; the
training pool only with `runtime_reconfigure_training`; with `runtime_training_pool_plan_only` the change is
recorded and nothing moves).

It never flaps: the planner's hysteresis band, no decision while a reconfiguration runs, a window that
holds only steps run on the current split (right after a change there is nothing to judge yet), an undo that
is never itself reviewed, a prediction for growing a pool discounted by what the model over-predicted the last
time a change grew it, and an undone change not made again until the workload it was measured on has moved
(`planner.replan_review.Undone`). Every decision, taken or not, is a `replan_decision` event with its numbers
and a `replan.decide` span; the decision that reviewed a change carries the verdict (`review`: the gain
predicted and measured, the seconds per step measured and expected on the old split, undone or not, why).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.config import Config
from libra.controller import replan_state
from libra.controller.events import EventLog
from libra.controller.reconfigure import ReconfigureRefused, ReconfigureTarget
from libra.controller.replan_state import ReplanMemory
from libra.controller.state import DesiredState
from libra.controller.switch_costs import SwitchCostLog, read_switch_costs
from libra.observability.phase_trace import get_tracer
from planner.plan import Candidate, Evaluation
from planner.replan import Observation, ReplanDecision, ReplanPolicy
from planner.replan_review import OnlineReplanning
from planner.workload import PlannerInputs

EVENT = "replan_decision"
TREND_MIN_STEPS = 3  # fewer points give no response-length trend worth projecting


@dataclass(frozen=True)
class WindowFigures:
    """What the job measured over the steps of one re-planning window, all on the same split."""

    first_step: int
    last_step: int
    wall_s: float
    rollout_tokens_per_s: float  # generated tokens over the time a generation was in flight, whole pool
    rollout_tokens_per_s_per_instance: float
    train_step_s: float
    queue_depth: float
    mean_response_tokens: float
    response_tokens_per_step: float
    rollout_idle_share: float
    train_idle_share: float
    weight_sync_s: float | None = None  # mean seconds of one weight publish in the window (None: none ran)

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1

    def observation(self) -> Observation:
        return Observation(rollout_tokens_per_s=self.rollout_tokens_per_s, train_step_s=self.train_step_s,
                           mean_response_tokens=self.mean_response_tokens,
                           response_tokens_per_step=self.response_tokens_per_step, queue_depth=self.queue_depth,
                           rollout_idle_share=self.rollout_idle_share, train_idle_share=self.train_idle_share,
                           weight_sync_s=self.weight_sync_s, step_wall_s=self.wall_s / self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


def same_split(row: dict[str, Any], desired: DesiredState) -> bool:
    return (row.get("rollout_instances"), row.get("rollout_gpus"), row.get("train_gpus")) == (
        desired.rollout_instances, desired.rollout_gpus, desired.train_gpus)


def window_rows(rows: Sequence[dict[str, Any]], desired: DesiredState, size: int) -> list[dict[str, Any]]:
    """The last `size` rows, cut at the newest row run on another split than `desired` (oldest first)."""
    window: list[dict[str, Any]] = []
    for row in reversed(rows[-size:] if size > 0 else []):
        if not same_split(row, desired):
            break
        window.append(row)
    return window[::-1]


def window_figures(rows: Sequence[dict[str, Any]]) -> WindowFigures | None:
    """The figures of a window of metric rows (None for an empty window or one without wall time)."""
    if not rows:
        return None
    wall = sum(float(r.get("interval_s") or r.get("time_step_s") or 0.0) for r in rows)
    if wall <= 0:
        return None
    busy = min(wall, sum(float(r.get("rollout_busy_s") or 0.0) for r in rows))
    generated = sum(float(r.get("rollout_tokens") or 0.0) for r in rows)
    training = min(wall, sum(float(r.get("time_train_s") or 0.0) for r in rows))
    means = [float(r.get("response_len_mean") or 0.0) for r in rows]
    steps = [float(r["step"]) for r in rows]
    trend = statistics.linear_regression(steps, means).slope if len(rows) >= TREND_MIN_STEPS else 0.0
    rate = generated / busy if busy > 0 else 0.0
    instances = max(1, int(rows[-1].get("rollout_instances") or 1))
    syncs = [float(r["sync_total_s"]) for r in rows if isinstance(r.get("sync_total_s"), int | float)]
    return WindowFigures(
        first_step=int(rows[0]["step"]), last_step=int(rows[-1]["step"]), wall_s=wall,
        rollout_tokens_per_s=rate, rollout_tokens_per_s_per_instance=rate / instances,
        train_step_s=training / len(rows),
        queue_depth=statistics.fmean(float(r.get("queue_buffered") or 0.0) for r in rows),
        mean_response_tokens=statistics.fmean(means), response_tokens_per_step=trend,
        rollout_idle_share=1.0 - busy / wall, train_idle_share=1.0 - training / wall,
        weight_sync_s=statistics.fmean(syncs) if syncs else None,
    )


def current_candidate(desired: DesiredState) -> Candidate:
    return Candidate(train_gpus=desired.train_gpus, rollout_gpus=desired.rollout_gpus, layout=desired.train_layout,
                     rollout_tp=desired.rollout_tp)


def target_for(current: Candidate, best: Candidate) -> ReconfigureTarget:
    """The reconfiguration request that moves `current` to `best` (only what changes is named)."""
    rollout = (best.rollout_gpus // best.rollout_tp, best.rollout_tp)
    changes_rollout = rollout != (current.rollout_gpus // current.rollout_tp, current.rollout_tp)
    changes_training = (best.train_gpus, best.layout) != (current.train_gpus, current.layout)
    lay = best.layout
    return ReconfigureTarget(
        rollout_instances=rollout[0] if changes_rollout else None,
        rollout_tp=rollout[1] if changes_rollout else None,
        train_gpus=best.train_gpus if changes_training else None,
        **({"train_tp": lay.tp, "train_pp": lay.pp, "train_ep": lay.ep, "train_cp": lay.cp}
           if changes_training and lay != current.layout else {}),
    )


@dataclass(frozen=True)
class SwitchCosts:
    """Seconds one switch of each pool cost this job when last measured (None: not measured yet)."""

    rollout_s: float | None = None
    train_s: float | None = None

    def apply(self, inputs: PlannerInputs) -> tuple[PlannerInputs, str]:
        """`inputs` with the measured costs in place of the planner's estimates, and where they came from."""
        cost = inputs.cost
        if self.rollout_s is not None:
            cost = dataclasses.replace(cost, rollout_restart_s=self.rollout_s)
        if self.train_s is not None:
            cost = dataclasses.replace(cost, train_restart_s=self.train_s)
        measured = [name for name, v in (("rollout", self.rollout_s), ("training", self.train_s)) if v is not None]
        source = f"measured ({', '.join(measured)})" if measured else "planner estimate"
        return dataclasses.replace(inputs, cost=cost), source


@dataclass(frozen=True)
class ReplanSettings:
    interval_steps: int
    min_gain: float
    total_steps: int
    reconfigure_training: bool  # runtime_reconfigure_training: the training pool may be resized

    @classmethod
    def from_config(cls, cfg: Config) -> ReplanSettings:
        gpr = cfg.global_resource_planner
        return cls(gpr.replan_interval_steps, gpr.replan_min_gain, cfg.total_steps, gpr.runtime_reconfigure_training)

    def policy(self, step: int) -> ReplanPolicy:
        """`planner.replan.ReplanPolicy.of_running_job` for this job after `step`."""
        return ReplanPolicy.of_running_job(step, self.total_steps, self.interval_steps, self.min_gain,
                                           allow_train_resize=self.reconfigure_training)


class Replanner:
    """Called by the RL loop after every step with the metric rows so far; decides every interval."""

    def __init__(self, settings: ReplanSettings, inputs: PlannerInputs, desired: Callable[[], DesiredState],
                 request: Callable[[ReconfigureTarget], DesiredState], events: EventLog,
                 switch_costs_path: Path | None = None, state_path: Path | None = None) -> None:
        self.settings = settings
        self.inputs = inputs
        self.desired = desired
        self.request = request
        self.events = events
        self.switch_costs_path = switch_costs_path
        self.state_path = state_path
        self.last_decision: dict[str, Any] | None = None
        self.memory = self._recall()
        self._changing = False
        self._unsubscribe = events.subscribe(self._on_event)

    @property
    def online(self) -> OnlineReplanning:
        """The last change, to review, and the model's over-predictions."""
        return self.memory.online

    def _recall(self) -> ReplanMemory:
        """The memory a controller before this one left (`replan_state.json`), or a fresh one."""
        if self.state_path is None:
            return ReplanMemory(OnlineReplanning(self.inputs))
        try:
            memory = replan_state.load(self.state_path, self.inputs)
        except ValueError as exc:
            kept = replan_state.set_aside(self.state_path)
            self.events.emit("replan_state_unreadable", f"{self.state_path}: {exc}; the re-planner starts without "
                             "its memory (the change under review and what the model over-predicted)"
                             + (f"; the file is kept as {kept}" if kept else ""),
                             path=str(self.state_path), kept_as=str(kept) if kept else None)
            return ReplanMemory(OnlineReplanning(self.inputs))
        online = memory.online
        if online.last_change is not None or online.over_predictions or online.undone is not None:
            change, undone = online.last_change, online.undone
            self.events.emit("replan_state_restored", "the re-planner goes on from its memory: "
                             + (f"the change at step {change.step} under review" if change else "no change under review")
                             + f", over-predictions for {sorted(online.over_predictions) or 'no pool'}"
                             + (f", the change at step {undone.change_step} undone at step {undone.step}"
                                if undone else ""),
                             path=str(self.state_path))
        return memory

    def _remember(self) -> None:
        if self.state_path is not None:
            replan_state.save(self.state_path, self.memory)

    def close(self) -> None:
        self._unsubscribe()

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") == "reconfigure_done" and isinstance(event.get("seconds"), int | float):
            self.memory.rollout_switch_s = float(event["seconds"])
            self._remember()

    def switch_costs(self) -> SwitchCosts:
        train_s = None
        if self.switch_costs_path is not None:
            resizes = read_switch_costs(self.switch_costs_path)
            if resizes and isinstance(resizes[-1].get("switch_s"), int | float):
                train_s = float(resizes[-1]["switch_s"])
        return SwitchCosts(rollout_s=self.memory.rollout_switch_s, train_s=train_s)

    def after_step(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
        """At the step boundary: decide when the last row's step closes an interval; the decision's record."""
        if not rows:
            return None
        step = int(rows[-1]["step"])
        changing = bool(self.desired().reconfiguring)
        if changing or self._changing:  # this step ran (partly) while the pools changed
            self.memory.settled_after = step
        self._changing = changing
        if step % self.settings.interval_steps:
            return None
        with get_tracer().span("replan.decide", step=step) as span:
            record = self._decide(step, [r for r in rows if int(r["step"]) > self.memory.settled_after])
            self._remember()
            span.set(**{k: record[k] for k in ("action", "gain", "current", "best") if record.get(k) is not None})
        self.last_decision = record
        self.events.emit(EVENT, record["reason"], **{k: v for k, v in record.items() if k != "reason"})
        return record

    def _decide(self, step: int, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        desired = self.desired()
        current = current_candidate(desired)
        record: dict[str, Any] = {"step": step, "current": current.label()}
        if desired.reconfiguring:
            return record | {"action": "skipped", "reason": f"a reconfiguration is running ({desired.reconfiguring}); "
                             "no new request until it is done"}
        window = window_rows(rows, desired, self.settings.interval_steps)
        figures = window_figures(window)
        needed = max(1, self.settings.interval_steps // 2)
        if figures is None or figures.steps < needed:
            have = 0 if figures is None else figures.steps
            return record | {"action": "skipped", "reason": f"{have} step(s) on the current split since the last "
                             f"change, {needed} needed to judge it"}
        inputs, cost_source = self.switch_costs().apply(self.inputs)
        policy = self.settings.policy(step)
        decision = self.online.decide(step, current, figures.observation(), policy, inputs)
        record |= _numbers(decision) | {"horizon_steps": policy.horizon_steps, "switch_cost_source": cost_source,
                                        "window": figures.to_dict()} | _memory(self.online)
        verdict = self.online.last_review
        if verdict is not None:  # this window reviewed the last change: the verdict, in full
            record["review"] = verdict.to_dict() | {"reason": verdict.reason}
        if decision.undo:
            record["undo"] = True
        if not decision.change:
            return record | {"action": "kept", "reason": decision.reason}
        target = target_for(current, decision.target.candidate)
        try:
            after = self.request(target)
        except ReconfigureRefused as exc:
            return record | self._not_carried_out() | {
                "action": "refused", "reason": f"{decision.reason}; the request was refused: {exc}"}
        if not after.reconfiguring and after.reason.startswith("plan only:"):
            return record | self._not_carried_out() | {
                "action": "plan_only",
                "reason": f"{decision.reason}; recorded only (runtime_training_pool_plan_only): {after.reason}"}
        return record | {"action": "requested", "reason": f"{decision.reason}; requested {target.describe()}",
                         "generation": after.generation}

    def _not_carried_out(self) -> dict[str, Any]:
        """A change that will not run is not under review (the memory, and the record's fields of it)."""
        self.online.drop_change()
        return _memory(self.online)


def _memory(online: OnlineReplanning) -> dict[str, Any]:
    """What the decision leaves for the next one: the step of the change under review (None: none), the
    model's over-prediction per pool (the step of the change it was measured on, the share) and the undo that
    bars its change from being made again (None: none)."""
    change = online.last_change
    return {"reviewing_change_at": change.step if change is not None else None,
            "over_predictions": online.over_predictions_dict(), "undone": online.undone_dict()}


def _numbers(decision: ReplanDecision) -> dict[str, Any]:
    best: Evaluation | None = decision.best
    return {
        "best": best.candidate.label() if best is not None else None,
        "current_samples_per_s": round(decision.current.samples_per_s, 4),
        "best_samples_per_s": round(best.samples_per_s, 4) if best is not None else None,
        "gain": round(decision.predicted_gain, 4),
        "switch_cost_s": round(decision.switch_cost_s, 3),
        "time_saved_s": round(decision.time_saved_s, 3),
        "expected_response_tokens": decision.calibrated.workload.expected_response_tokens,
    }


def build_replanner(cfg: Config, desired: Callable[[], DesiredState],
                    request: Callable[[ReconfigureTarget], DesiredState], events: EventLog) -> Replanner | None:
    """The job's re-planner (None unless `runtime_online_replanning`)."""
    if not cfg.global_resource_planner.runtime_online_replanning:
        return None
    from libra.planning import planner_inputs

    replanner = Replanner(ReplanSettings.from_config(cfg), planner_inputs(cfg), desired, request, events,
                          SwitchCostLog.beside(events.path).path, replan_state.beside(events.path))
    events.emit("replan_enabled", f"re-planning every {cfg.global_resource_planner.replan_interval_steps} steps, "
                f"replan_min_gain {cfg.global_resource_planner.replan_min_gain:.1%}")
    return replanner
