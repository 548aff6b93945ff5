"""The active half of the reconciler: performs actions through the pool edges, on worker threads so that a
slow action (a vLLM server takes tens of seconds to start) never blocks the control tick.

Each action type has one handler in a table (`Executor.handlers`): what to book synchronously before it
runs (`begin`: members added, marked busy, moved along the transition table, so the next tick already sees
it), what to do on a worker thread (`run`), and which pool its errors count against. An exception becomes
observed state: the members it started become FAILED, the pool records the error and a back-off, and the
event log says why. Nothing raised by an edge escapes the executor.

Publishing weights and changing who serves take the weight gate (`libra.controller.gate`), so a publish
of the RL loop and a membership change never interleave; the weight version of a member changes only from
the ACKs of a publish.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from libra.controller.actions import (
    Action,
    CreateRolloutPool,
    CreateTrainingPool,
    MarkFailed,
    PublishWeights,
    ResizeTrainingPool,
    SetServing,
    ShrinkTrainingPool,
    StartRolloutInstance,
    StopRolloutInstance,
    StrategyFallback,
)
from libra.controller.events import EventLog
from libra.controller.gate import WeightGate, WeightsRef
from libra.controller.members import MemberState
from libra.controller.state import ROLLOUT, TRAIN, RolloutSpec, TrainLayout
from libra.controller.tracker import MemberTracker, MemberView
from libra.controller.train_actions import TrainingResizer

if TYPE_CHECKING:
    from libra.cluster.training_workers import NodesUnreachableError

log = logging.getLogger(__name__)
S = MemberState


@dataclass(frozen=True)
class PublishOutcome:
    """What a publish reports: the version each instance ACKed (instance id -> version) and the pool's
    summary fields for the metrics row."""

    acks: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)  # instance id -> why: its server failed, to replace


class RolloutEdge(Protocol):
    """The rollout pool as the executor sees it (the real one wraps `libra.rollout.RolloutPool`). Instance
    ids are the reconciler's member ids."""

    def create(self, member_ids: Sequence[str], spec: RolloutSpec) -> list[MemberView]: ...
    def start(self, member_id: str, spec: RolloutSpec) -> MemberView: ...
    def stop(self, key: str, drain: bool) -> None: ...
    def publish(self, weights: WeightsRef, keys: Sequence[str] | None) -> PublishOutcome: ...
    def set_serving(self, keys: Sequence[str]) -> None: ...
    def views(self) -> list[MemberView]: ...


class TrainingEdge(Protocol):
    """The training pool as the executor sees it (the real one wraps `libra.training.TrainingPool`)."""

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]: ...
    def views(self) -> list[MemberView]: ...


@dataclass(frozen=True)
class Handler:
    """How the executor performs one action type."""

    pool: str  # the pool whose back-off its errors count against ("" = none)
    run: Callable[[Any], None]  # on a worker thread
    begin: Callable[[Any, float], None] | None = None  # synchronous bookkeeping before `run`
    inline: bool = False  # `begin` is all there is (no worker thread)
    started: Callable[[Any], tuple[str, ...]] = lambda action: ()  # members that become FAILED on an error


class Executor:
    def __init__(
        self,
        tracker: MemberTracker,
        rollout: RolloutEdge,
        train: TrainingEdge,
        events: EventLog,
        clock: Callable[[], float] = time.time,
        max_workers: int = 4,
        gate: WeightGate | None = None,
    ) -> None:
        self.tracker = tracker
        self.rollout = rollout
        self.train = train
        self.events = events
        self.clock = clock
        self.gate = gate or WeightGate()
        self._threads = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="libra-action")
        self._inflight: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.training = TrainingResizer(tracker, train, events, self.gate, clock)
        # a training pool start that found nodes of its ranks unable to reach each other (a network partition,
        # `libra.cluster.reachability`): a retry would be placed on the same nodes, so the controller fences
        # nodes off before it (`NodeLossRecovery.fence_at_start`) and clears this
        self.training_nodes_unreachable: NodesUnreachableError | None = None
        self.handlers: dict[type[Action], Handler] = {
            MarkFailed: Handler("", self._nothing, self._begin_mark_failed, inline=True),
            StrategyFallback: Handler("", self._nothing, self._begin_fallback, inline=True),
            CreateRolloutPool: Handler(ROLLOUT, self._run_create_rollout, self._begin_create,
                                       started=lambda a: a.member_ids),
            CreateTrainingPool: Handler(TRAIN, self._run_create_training, self._begin_create,
                                        started=lambda a: a.member_ids),
            StartRolloutInstance: Handler(ROLLOUT, self._run_start, self._begin_start,
                                          started=lambda a: (a.member_id,)),
            StopRolloutInstance: Handler(ROLLOUT, self._run_stop, self._begin_stop),
            PublishWeights: Handler(ROLLOUT, self._run_publish, self._begin_busy_members),
            SetServing: Handler(ROLLOUT, self._run_set_serving, self._begin_set_serving),
            ShrinkTrainingPool: Handler(TRAIN, self.training.run_shrink, self.training.begin_shrink),
            ResizeTrainingPool: Handler(TRAIN, self.training.run_resize, self.training.begin_resize),
        }

    # ---- public ---------------------------------------------------------------------------------------
    def submit(self, actions: list[Action]) -> list[Future[None]]:
        futures = []
        for action in actions:
            handler = self.handlers.get(type(action))
            if handler is None:
                raise TypeError(f"the executor has no handler for {action.kind}; known: "
                                f"{sorted(t.__name__ for t in self.handlers)}")
            self.events.emit("action", action.reason, action=action.kind, **_fields(action))
            if handler.begin is not None:
                handler.begin(action, self.clock())
            if handler.inline:
                continue
            future = self._threads.submit(self._run, action, handler)
            with self._lock:
                self._inflight.add(future)
            future.add_done_callback(self._done)
            futures.append(future)
        return futures

    def publish_weights(self, weights: WeightsRef) -> PublishOutcome:
        """The RL loop's publish at a step boundary: every live rollout member loads `weights` (under the
        gate, so no membership change interleaves); the members' versions come from the ACKs."""
        with self.gate.hold(f"publish v{weights.version}"):
            outcome = self.rollout.publish(weights, None)
            self.gate.set_current(weights)
            self._record_acks(outcome)
        return outcome

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def shutdown(self, wait: bool = True) -> None:
        self._threads.shutdown(wait=wait, cancel_futures=True)

    # ---- running --------------------------------------------------------------------------------------
    def _done(self, future: Future[None]) -> None:
        with self._idle:
            self._inflight.discard(future)
            self._idle.notify_all()

    def _run(self, action: Action, handler: Handler) -> None:
        started = time.monotonic()
        try:
            handler.run(action)
        except Exception as exc:  # an action error becomes observed state, never a crash
            self._failed(action, handler, exc)
        else:
            if handler.pool:
                self.tracker.action_result(handler.pool, self.clock())
            self.events.emit("action_done", action=action.kind, seconds=round(time.monotonic() - started, 3),
                             **_fields(action))

    def _failed(self, action: Action, handler: Handler, exc: Exception) -> None:
        now = self.clock()
        message = f"{action.kind} failed: {type(exc).__name__}: {exc}"
        log.debug("action failed", exc_info=True)
        t = self.tracker
        if isinstance(action, CreateRolloutPool | CreateTrainingPool):
            t.set_pool(handler.pool, busy=False, created=False)
        if isinstance(action, CreateTrainingPool):
            from libra.cluster.training_workers import nodes_unreachable

            self.training_nodes_unreachable = nodes_unreachable(exc)
        for member_id in handler.started(action):
            t.set_busy(member_id, False)
            t.move(member_id, S.FAILED, now, message)
            if isinstance(action, CreateTrainingPool):
                # the failed start shut its workers down: these ranks hold no GPU, and the retry makes new ones
                t.move(member_id, S.STOPPED, now, "the training pool's start failed and was shut down")
        if isinstance(action, StopRolloutInstance):
            # a member we could not stop is out of the pool either way; keep the error for the record
            t.set_busy(action.member_id, False)
            t.move(action.member_id, S.FAILED, now, message)
            t.move(action.member_id, S.STOPPED, now, "given up after a failed stop")
        for member_id in _touched(action):
            t.set_busy(member_id, False)
        if isinstance(action, SetServing):
            t.set_pool(ROLLOUT, busy=False)
        if handler.pool:
            t.action_result(handler.pool, now, message)
        else:
            t.record_error(message)
        self.events.emit("action_error", message, action=action.kind, **_fields(action))

    # ---- handlers -------------------------------------------------------------------------------------
    @staticmethod
    def _nothing(action: Action) -> None:
        return None

    def _begin_mark_failed(self, action: MarkFailed, now: float) -> None:
        self.tracker.move(action.member_id, S.FAILED, now, action.reason)

    def _begin_fallback(self, action: StrategyFallback, now: float) -> None:
        self.events.emit("strategy_fallback", action.reason, strategy=action.strategy, used=action.used)

    def _begin_create(self, action: CreateRolloutPool | CreateTrainingPool, now: float) -> None:
        pool = ROLLOUT if isinstance(action, CreateRolloutPool) else TRAIN
        spec = action.spec if isinstance(action, CreateRolloutPool) else None
        generation = action.generation if isinstance(action, CreateRolloutPool) else 0
        t = self.tracker
        t.set_pool(pool, busy=True)
        for member_id in action.member_ids:
            t.add_member(member_id, pool, now, action.reason, spec, generation)
            t.set_busy(member_id, True)
            t.move(member_id, S.STARTING, now, action.kind)

    def _run_create_rollout(self, action: CreateRolloutPool) -> None:
        self._created(ROLLOUT, action.member_ids, self.rollout.create(action.member_ids, action.spec),
                      action.num_instances)

    def _run_create_training(self, action: CreateTrainingPool) -> None:
        self._created(TRAIN, action.member_ids, self.train.create(action.gpus, action.layout), action.gpus)

    def _created(self, pool: str, member_ids: tuple[str, ...], views: list[MemberView], size: int) -> None:
        """Bind members to what the pool started. A view named by one of our ids (`<pool>-<n>`, also left by
        an earlier controller) binds to that member or is adopted under its id; other views (training ranks,
        configured endpoints) bind in order. Members left without a view are cancelled when the pool runs
        enough instances anyway (adopted ones), else failed."""
        now = self.clock()
        t = self.tracker
        own = {v.key: v for v in views if v.key.startswith(f"{pool}-")}
        foreign = [v for v in views if not v.key.startswith(f"{pool}-")]
        unbound = []
        for member_id in member_ids:
            view = own.pop(member_id, None) or (foreign.pop(0) if foreign else None)
            if view is None:
                unbound.append(member_id)
                continue
            t.bind_view(member_id, view)
            if view.info.get("adopted"):
                self.events.emit("member_adopted", f"{member_id} is the running {view.key} of an earlier controller",
                                 member=member_id, pool=pool, key=view.key)
            t.set_busy(member_id, False)
            t.move(member_id, view.state, now, "pool created" if not view.error else view.error)
        enough = len(views) >= len(member_ids)
        for member_id in unbound:
            t.set_busy(member_id, False)
            if enough:
                t.move(member_id, S.STOPPED, now, "not started: the pool adopted running instances instead")
            else:
                t.move(member_id, S.FAILED, now, f"the pool started {len(views)} of {len(member_ids)} members")
        t.set_pool(pool, created=True, busy=False, error="", size=size)
        if own or foreign:  # servers left by an earlier controller beyond these members: adopted, then trimmed
            t.observe(pool, views, now)

    def _begin_start(self, action: StartRolloutInstance, now: float) -> None:
        t = self.tracker
        t.add_member(action.member_id, ROLLOUT, now, action.reason, action.spec, action.generation)
        t.set_busy(action.member_id, True)
        t.move(action.member_id, S.STARTING, now, action.kind)

    def _run_start(self, action: StartRolloutInstance) -> None:
        view = self.rollout.start(action.member_id, action.spec)
        t = self.tracker
        t.bind_view(action.member_id, view)
        t.set_busy(action.member_id, False)
        t.move(action.member_id, view.state, self.clock(), "instance started")

    def _begin_stop(self, action: StopRolloutInstance, now: float) -> None:
        t = self.tracker
        t.set_busy(action.member_id, True)
        member = t.member(action.member_id)
        # Draining or aborting, a member being stopped no longer counts as live: otherwise the next tick sees
        # one member too many while an abort is in flight and stops another.
        if member.state in (S.STARTING, S.LOADING, S.READY):
            t.move(action.member_id, S.DRAINING, now, action.reason)

    def _run_stop(self, action: StopRolloutInstance) -> None:
        member = self.tracker.member(action.member_id)
        if member.key:
            with self.gate.hold(f"stop {action.member_id}"):
                self.rollout.stop(member.key, action.drain)
        self.tracker.set_busy(action.member_id, False)
        self.tracker.set_serving([m.id for m in self.tracker.members(ROLLOUT) if m.serving and m.id != member.id])
        self.tracker.move(action.member_id, S.STOPPED, self.clock(), action.reason)

    def _begin_busy_members(self, action: PublishWeights, now: float) -> None:
        for member_id in action.member_ids:
            self.tracker.set_busy(member_id, True)

    def _run_publish(self, action: PublishWeights) -> None:
        keys = self._keys(action.member_ids)
        with self.gate.hold(f"publish v{action.version} to {', '.join(action.member_ids)}"):
            outcome = self.rollout.publish(self.gate.weights_for(action.version), keys)
            self._record_acks(outcome)
        for member_id in action.member_ids:
            self.tracker.set_busy(member_id, False)

    def _begin_set_serving(self, action: SetServing, now: float) -> None:
        self.tracker.set_pool(ROLLOUT, busy=True)  # one flip at a time; the next tick sees the result

    def _run_set_serving(self, action: SetServing) -> None:
        with self.gate.hold(f"serve {', '.join(action.member_ids)}"):
            self.rollout.set_serving(self._keys(action.member_ids))
            self.tracker.set_serving(action.member_ids)
        self.tracker.set_pool(ROLLOUT, busy=False)

    # ---- helpers --------------------------------------------------------------------------------------
    def _keys(self, member_ids: Sequence[str]) -> list[str]:
        keys = []
        for member_id in member_ids:
            member = self.tracker.member(member_id)
            if not member.key:
                raise LookupError(f"member {member_id} has no rollout instance yet")
            keys.append(member.key)
        return keys

    def _record_acks(self, outcome: PublishOutcome) -> None:
        by_key = {m.key: m.id for m in self.tracker.members(ROLLOUT) if m.key}
        self.tracker.record_acks({by_key[k]: v for k, v in outcome.acks.items() if k in by_key})
        for key, why in sorted(outcome.left_out.items()):
            # The publish went on without it (its server failed): FAILED now, so the next tick replaces it.
            self.events.emit("publish_left_out", f"{key} did not take the weights: {why}", key=key)
            if key in by_key:
                self.tracker.move(by_key[key], S.FAILED, self.clock(), f"server failed during a publish: {why}")


def _touched(action: Action) -> tuple[str, ...]:
    if isinstance(action, PublishWeights):
        return action.member_ids
    return ()


def _fields(action: Action) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("member_id", "member_ids", "num_instances", "gpus", "drain", "version", "generation"):
        if hasattr(action, name):
            value = getattr(action, name)
            out[name] = list(value) if isinstance(value, tuple) else value
    if isinstance(action, StartRolloutInstance):
        out["tp"], out["fingerprint"] = action.spec.tp, action.spec.fingerprint
    if isinstance(action, CreateTrainingPool | ResizeTrainingPool):
        out["layout"] = action.layout.describe(action.gpus)
    return out
