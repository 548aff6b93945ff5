"""The executor's handlers of training-pool changes: `ResizeTrainingPool` (a new GPU count and/or layout)
and `ShrinkTrainingPool` (lend GPUs to the rollout pool in a cluster swap), both carried out by the training
edge at a step boundary under the weight gate, so no weight publish interleaves.

Bookkeeping: when a resize begins, the pool is busy, its running ranks move to DRAINING and the new ranks
are added as STARTING members (so the next tick sees the change in flight and plans nothing else for the
pool). When it ends, the new members are bound to the ranks the pool reports and the old ones are STOPPED;
when it fails, the old ranks are STOPPED (a failed resize stops the workers) and the new ones FAILED, and
the reconciler asks again after the pool's back-off: the edge then resumes from the resize checkpoint.

With `runtime_training_pool_plan_only` nothing of this runs: `record_plan_only` writes the decision to the
event log (`train_plan_only`) and the trace (`reconfigure.plan`), and the status shows it
(`DesiredState.planned_training`).

A training pool that lost a worker (its process died) is restarted the same way (`TrainingResizer.restart`,
asked by the RL loop, which then resumes from the newest complete checkpoint): every rank replaced at the same
GPU count and layout, recorded as `train_restart`.

Each resize is recorded with its measured cost in the event log (`train_resize`, and
`train_resize_first_step` once the first step at the new layout ran) and in the switch-cost log
(`libra.controller.switch_costs`) the online re-planner reads.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

from libra.controller.actions import ResizeTrainingPool, ShrinkTrainingPool
from libra.controller.events import EventLog
from libra.controller.gate import WeightGate
from libra.controller.members import MemberState, next_member_ids
from libra.controller.state import TRAIN, DesiredState
from libra.controller.switch_costs import FIRST_STEP, RESIZE, SwitchCostLog
from libra.controller.tracker import MemberTracker, MemberView
from libra.controller.train_plan import fit_layout
from libra.observability.phase_trace import get_tracer
from planner.layout import TrainLayout

S = MemberState


class ResizableTrainingEdge(Protocol):
    """The training pool edge as a resize needs it (the real one is `pools.TrainingPoolEdge`)."""

    gpus: int
    layout: TrainLayout

    def resize(self, gpus: int, layout: TrainLayout,
               on_measured: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[MemberView], dict[str, Any]]:
        """Move the pool; returns the new ranks' views and the resize's cost (`ResizeCost.to_dict()`).
        `on_measured` is called with the cost once the first step at the new layout has run."""
        ...

    def restart(self, gpus: int | None = None,
                layout: TrainLayout | None = None) -> tuple[list[MemberView], dict[str, Any]]:
        """Replace every rank after one was lost, at the same GPU count and layout or at `gpus` under
        `layout`; views and cost."""
        ...


class TrainingResizer:
    def __init__(self, tracker: MemberTracker, train: Any, events: EventLog, gate: WeightGate,
                 clock: Callable[[], float] = time.time, costs: SwitchCostLog | None = None) -> None:
        self.tracker = tracker
        self.train = train
        self.events = events
        self.gate = gate
        self.clock = clock
        self.costs = costs or SwitchCostLog.beside(events.path)
        self._replaced: dict[ResizeTrainingPool, tuple[str, ...]] = {}
        self._lent: dict[ShrinkTrainingPool, ResizeTrainingPool | str] = {}
        self._ids = itertools.count(1)

    # ---- ResizeTrainingPool -------------------------------------------------------------------------
    def begin_resize(self, action: ResizeTrainingPool, now: float) -> None:
        t = self.tracker
        t.set_pool(TRAIN, busy=True)
        old = tuple(m.id for m in t.members(TRAIN) if m.live and m.id not in action.member_ids)
        self._replaced[action] = old
        for member_id in old:
            t.set_busy(member_id, True)
            t.move(member_id, S.DRAINING, now, f"replaced: {action.reason}")
        for member_id in action.member_ids:
            t.add_member(member_id, TRAIN, now, action.reason, generation=action.generation)
            t.set_busy(member_id, True)
            t.move(member_id, S.STARTING, now, action.kind)

    def run_resize(self, action: ResizeTrainingPool) -> None:
        resize_id = f"{action.generation}.{next(self._ids)}.{int(self.clock())}"
        cost = self._replace_ranks(action, f"resize the training pool to {action.gpus} GPUs {action.layout.label()}",
                                   lambda: _resize(self.train, action.gpus, action.layout,
                                                   lambda measured: self._measured(resize_id, measured)))
        record = {"resize_id": resize_id, "generation": action.generation, "reason": action.reason, **cost}
        self.costs.append(RESIZE, record)
        self.events.emit("train_resize", str(cost.get("label", "")), **record)
        get_tracer().counter("pool.gpus", {"train": float(action.gpus)})

    def restart(self, reason: str, gpus: int | None = None, layout: TrainLayout | None = None,
                before: Callable[[], Any] | None = None) -> dict[str, Any]:
        """Replace every rank of a training pool that lost one, at the same GPU count and layout or at `gpus`
        GPUs under `layout`, on the caller's thread (the RL loop's, which then loads the newest complete
        checkpoint). The bookkeeping is a resize's: the old ranks are STOPPED, the new ones bound. `before` runs
        once the pool is marked busy (the control loop then plans no training change of its own), e.g. to set
        the desired state the restart reaches. Returns the restart's cost (not a resize's: the switch-cost log
        the re-planner reads is left alone)."""
        t = self.tracker
        used = {m.id for m in t.members()} | {m.key for m in t.members() if m.key}
        live = [m for m in t.members(TRAIN) if m.live]
        generation = max((m.generation for m in live), default=0)
        gpus, layout = gpus or self.train.gpus, layout or self.train.layout
        action = ResizeTrainingPool(reason, gpus, layout, next_member_ids(used, TRAIN, gpus), generation)
        self.begin_resize(action, self.clock())

        def move() -> tuple[list[MemberView], dict[str, Any]]:
            if before is not None:
                before()
            return self.train.restart(gpus, layout)

        cost = self._replace_ranks(action, f"restart the training pool: {reason}", move)
        self.events.emit("train_restart", reason, generation=generation, **cost)
        return cost

    def _replace_ranks(self, action: ResizeTrainingPool, why: str,
                       move: Callable[[], tuple[list[MemberView], dict[str, Any]]]) -> dict[str, Any]:
        """Run `move` (the edge's resize or restart) under the weight gate and move the members begun by
        `begin_resize`: the new ones to what the pool reports, the old ones to STOPPED."""
        t = self.tracker
        old = self._replaced.pop(action, ())
        try:
            with self.gate.hold(why):
                views, cost = move()
        except Exception:
            now = self.clock()
            for member_id in old:
                t.set_busy(member_id, False)
                t.move(member_id, S.STOPPED, now, "stopped by a failed resize")
            for member_id in action.member_ids:
                t.set_busy(member_id, False)
                t.move(member_id, S.FAILED, now, "the resize did not complete")
                t.move(member_id, S.STOPPED, now, "the resize did not complete")
            t.set_pool(TRAIN, busy=False)
            raise
        now = self.clock()
        for member_id, view in zip(action.member_ids, views, strict=False):
            t.bind_view(member_id, view)
            t.set_busy(member_id, False)
            t.move(member_id, view.state, now, "resized")
        for member_id in action.member_ids[len(views):]:
            t.set_busy(member_id, False)
            t.move(member_id, S.FAILED, now, f"the resized pool reports {len(views)} of {action.gpus} ranks")
        for member_id in old:
            t.set_busy(member_id, False)
            t.move(member_id, S.STOPPED, now, "replaced by the resize")
        t.set_pool(TRAIN, busy=False, size=action.gpus, error="")
        return cost

    def _measured(self, resize_id: str, cost: dict[str, Any]) -> None:
        record = {"resize_id": resize_id, "first_step_s": cost.get("first_step_s")}
        self.costs.append(FIRST_STEP, record)
        self.events.emit("train_resize_first_step", str(cost.get("label", "")), **record)

    # ---- ShrinkTrainingPool -------------------------------------------------------------------------
    def begin_shrink(self, action: ShrinkTrainingPool, now: float) -> None:
        """Lend `action.gpus` GPUs: a resize to the running size minus them, at the layout closest to the
        current one that fits."""
        running = [m for m in self.tracker.members(TRAIN) if m.live]
        gpus = len(running) - action.gpus
        if gpus < 1:
            self._lent[action] = (f"cannot lend {action.gpus} GPU(s): the training pool runs {len(running)} and "
                                  "keeps at least one; ask the rollout pool for fewer instances")
            return
        used = {m.id for m in self.tracker.members()} | {m.key for m in self.tracker.members() if m.key}
        layout = fit_layout(self.train.layout, gpus)
        resize = ResizeTrainingPool(action.reason, gpus, layout, next_member_ids(used, TRAIN, gpus))
        self._lent[action] = resize
        self.begin_resize(resize, now)

    def run_shrink(self, action: ShrinkTrainingPool) -> None:
        resize = self._lent.pop(action, None)
        if not isinstance(resize, ResizeTrainingPool):
            raise ValueError(resize or f"ShrinkTrainingPool({action.gpus}) ran without its begin step")
        self.run_resize(resize)


def record_plan_only(events: EventLog, desired: DesiredState, target: Any) -> None:
    """A training-pool decision made in plan-only mode: recorded, not carried out."""
    events.emit("train_plan_only", desired.planned_training, target=str(target.describe()),
                train_gpus=desired.train_gpus, train_layout=desired.train_layout.describe(desired.train_gpus))
    get_tracer().instant("reconfigure.plan", pool="train", plan_only=True, decision=desired.planned_training)


def _resize(edge: ResizableTrainingEdge, gpus: int, layout: TrainLayout,
            on_measured: Callable[[dict[str, Any]], None]) -> tuple[list[MemberView], dict[str, Any]]:
    return edge.resize(gpus, layout, on_measured)
