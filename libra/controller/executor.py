"""The active half of the reconciler: performs actions through the pool edges, on worker threads so that a
slow action (a vLLM server takes tens of seconds to start) never blocks the control tick.

Every action marks what it touches busy (the reconciler plans around busy members), moves members along
the transition table as it progresses, and turns an exception into observed state: the members it
touched become FAILED, the pool records the error and a back-off, and the event log says why. Nothing
raised by an edge escapes the executor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from libra.controller.events import EventLog
from libra.controller.members import MemberState
from libra.controller.reconcile import (
    Action,
    AddRolloutInstance,
    CreateRolloutPool,
    CreateTrainingPool,
    MarkFailed,
    StopRolloutInstance,
)
from libra.controller.state import ROLLOUT, TRAIN, TrainLayout
from libra.controller.tracker import MemberTracker, MemberView

log = logging.getLogger(__name__)
S = MemberState


class RolloutEdge(Protocol):
    """The rollout pool as the executor sees it (the real one wraps `libra.rollout.RolloutPool`)."""

    def create(self, num_instances: int) -> list[MemberView]: ...
    def add(self) -> MemberView: ...
    def remove(self, key: str, drain: bool) -> None: ...
    def views(self) -> list[MemberView]: ...


class TrainingEdge(Protocol):
    """The training pool as the executor sees it (the real one wraps `libra.training.TrainingPool`)."""

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]: ...
    def views(self) -> list[MemberView]: ...


class Executor:
    def __init__(
        self,
        tracker: MemberTracker,
        rollout: RolloutEdge,
        train: TrainingEdge,
        events: EventLog,
        clock: Callable[[], float] = time.time,
        max_workers: int = 4,
    ) -> None:
        self.tracker = tracker
        self.rollout = rollout
        self.train = train
        self.events = events
        self.clock = clock
        self._threads = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="libra-action")
        self._inflight: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    # ---- public ---------------------------------------------------------------------------------------
    def submit(self, actions: list[Action]) -> list[Future[None]]:
        futures = []
        for action in actions:
            self.events.emit("action", action.reason, action=action.kind, **_fields(action))
            if isinstance(action, MarkFailed):
                self.tracker.move(action.member_id, S.FAILED, self.clock(), action.reason)
                continue
            self._begin(action)
            future = self._threads.submit(self._run, action)
            with self._lock:
                self._inflight.add(future)
            future.add_done_callback(self._done)
            futures.append(future)
        return futures

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

    # ---- internals ------------------------------------------------------------------------------------
    def _done(self, future: Future[None]) -> None:
        with self._idle:
            self._inflight.discard(future)
            self._idle.notify_all()

    def _begin(self, action: Action) -> None:
        """Synchronous bookkeeping before the action runs, so the next tick already sees it."""
        now = self.clock()
        t = self.tracker
        if isinstance(action, CreateRolloutPool | CreateTrainingPool):
            pool = ROLLOUT if isinstance(action, CreateRolloutPool) else TRAIN
            t.set_pool(pool, busy=True)
            for member_id in action.member_ids:
                t.add_member(member_id, pool, now, action.reason)
                t.set_busy(member_id, True)
                t.move(member_id, S.STARTING, now, action.kind)
        elif isinstance(action, AddRolloutInstance):
            t.add_member(action.member_id, ROLLOUT, now, action.reason)
            t.set_busy(action.member_id, True)
            t.move(action.member_id, S.STARTING, now, action.kind)
        elif isinstance(action, StopRolloutInstance):
            t.set_busy(action.member_id, True)
            member = t.member(action.member_id)
            if action.drain and member.state in (S.STARTING, S.LOADING, S.READY):
                t.move(action.member_id, S.DRAINING, now, action.reason)

    def _run(self, action: Action) -> None:
        started = time.monotonic()
        try:
            if isinstance(action, CreateRolloutPool):
                self._create(ROLLOUT, action.member_ids, lambda: self.rollout.create(action.num_instances),
                             action.num_instances)
            elif isinstance(action, CreateTrainingPool):
                self._create(TRAIN, action.member_ids, lambda: self.train.create(action.gpus, action.layout),
                             action.gpus)
            elif isinstance(action, AddRolloutInstance):
                self._add(action)
            elif isinstance(action, StopRolloutInstance):
                self._stop(action)
            else:
                raise TypeError(f"the executor has no handler for {action.kind}")
        except Exception as exc:  # an action error becomes observed state, never a crash
            self._failed(action, exc)
        else:
            pool = _pool_of(action)
            if pool:
                self.tracker.action_result(pool, self.clock())
            self.events.emit("action_done", action=action.kind, seconds=round(time.monotonic() - started, 3),
                             **_fields(action))

    def _create(self, pool: str, member_ids: tuple[str, ...], create: Callable[[], list[MemberView]],
                size: int) -> None:
        views = create()
        now = self.clock()
        t = self.tracker
        for member_id, view in zip(member_ids, views, strict=False):
            t.bind(member_id, view.key, view.info)
            if view.info.get("adopted"):
                self.events.emit("member_adopted", f"{member_id} is the running {view.key} of an earlier controller",
                                 member=member_id, pool=pool, key=view.key)
            t.set_busy(member_id, False)
            t.move(member_id, view.state, now, "pool created" if not view.error else view.error)
        for member_id in member_ids[len(views):]:
            t.set_busy(member_id, False)
            t.move(member_id, S.FAILED, now, f"the pool started {len(views)} of {len(member_ids)} members")
        t.set_pool(pool, created=True, busy=False, error="", size=size)
        if len(views) > len(member_ids):  # adopted servers beyond the desired count: the next tick trims them
            t.observe(pool, views, now)

    def _add(self, action: AddRolloutInstance) -> None:
        view = self.rollout.add()
        t = self.tracker
        t.bind(action.member_id, view.key, view.info)
        t.set_busy(action.member_id, False)
        t.move(action.member_id, view.state, self.clock(), "instance added")

    def _stop(self, action: StopRolloutInstance) -> None:
        member = self.tracker.member(action.member_id)
        if member.key:
            self.rollout.remove(member.key, action.drain)
        self.tracker.set_busy(action.member_id, False)
        self.tracker.move(action.member_id, S.STOPPED, self.clock(), action.reason)

    def _failed(self, action: Action, exc: Exception) -> None:
        now = self.clock()
        message = f"{action.kind} failed: {type(exc).__name__}: {exc}"
        log.debug("action failed", exc_info=True)
        t = self.tracker
        member_ids: tuple[str, ...] = ()
        if isinstance(action, CreateRolloutPool | CreateTrainingPool):
            member_ids = action.member_ids
            t.set_pool(_pool_of(action) or ROLLOUT, busy=False, created=False)
        elif isinstance(action, AddRolloutInstance | StopRolloutInstance):
            member_ids = (action.member_id,)
        for member_id in member_ids:
            t.set_busy(member_id, False)
            if isinstance(action, StopRolloutInstance):
                # a member we could not stop is out of the pool either way; keep the error for the record
                t.move(member_id, S.FAILED, now, message)
                t.move(member_id, S.STOPPED, now, "given up after a failed stop")
            else:
                t.move(member_id, S.FAILED, now, message)
        pool = _pool_of(action)
        if pool:
            t.action_result(pool, now, message)
        else:
            t.record_error(message)
        self.events.emit("action_error", message, action=action.kind, **_fields(action))


def _pool_of(action: Action) -> str:
    if isinstance(action, CreateRolloutPool | AddRolloutInstance | StopRolloutInstance):
        return ROLLOUT
    if isinstance(action, CreateTrainingPool):
        return TRAIN
    return ""


def _fields(action: Action) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("member_id", "num_instances", "gpus", "drain"):
        if hasattr(action, name):
            out[name] = getattr(action, name)
    if isinstance(action, CreateTrainingPool):
        out["layout"] = action.layout.describe(action.gpus)
    return out
