"""The control tick and the thread that runs it forever: observe the pools, reconcile against the desired
state, hand the actions to the executor.

A tick never raises: any error (a pool that cannot be queried, a bug in a strategy) is logged, written to
the event log and counted, and the next tick runs as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from libra.controller.events import EventLog
from libra.controller.executor import Executor, RolloutEdge, TrainingEdge
from libra.controller.members import StateTimeouts
from libra.controller.reconcile import Action, reconcile
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState
from libra.controller.tracker import MemberTracker
from libra.observability.phase_trace import get_tracer

log = logging.getLogger(__name__)


def observed_weights(desired: DesiredState, weights_before: int) -> DesiredState:
    """`desired` with the weight version read before the observation. The RL loop publishes to the instances
    itself and only then raises `weight_version`; an observation taken during that publish still shows the
    older weights, and judged against the newer version it would plan a second publish of weights the
    instances already hold (and keep them busy while it runs)."""
    if desired.weight_version == weights_before:
        return desired
    return dataclasses.replace(desired, weight_version=weights_before)


class ControlLoop:
    def __init__(
        self,
        tracker: MemberTracker,
        executor: Executor,
        rollout: RolloutEdge,
        train: TrainingEdge,
        desired: Callable[[], DesiredState],
        events: EventLog,
        timeouts: StateTimeouts | None = None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        on_observed: Callable[[ObservedState, DesiredState], None] | None = None,
    ) -> None:
        self.tracker = tracker
        self.executor = executor
        self.rollout = rollout
        self.train = train
        self.desired = desired
        self.events = events
        self.timeouts = timeouts or StateTimeouts()
        self.interval_s = interval_s
        self.clock = clock
        self.on_observed = on_observed  # sees every observation first (e.g. to end a finished reconfiguration)
        self.ticks = 0
        self.tick_errors = 0
        self.last_observed: ObservedState | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self) -> ObservedState:
        """Passive step: fold what each created, idle pool reports into the members."""
        now = self.clock()
        pools = self.tracker.snapshot(now)
        for name, edge, obs in ((ROLLOUT, self.rollout, pools.rollout), (TRAIN, self.train, pools.train)):
            if obs.created and not obs.busy:
                asked_at = self.tracker.version
                self.tracker.observe(name, edge.views(), now, asked_at)
        return self.tracker.snapshot(self.clock())

    def tick(self) -> list[Action]:
        """One observe -> reconcile -> execute round. Never raises."""
        self.ticks += 1
        try:
            with get_tracer().span("controller.tick"):
                weights_before = self.desired().weight_version
                observed = self.observe()
                self.last_observed = observed
                for error in observed.errors:
                    log.debug("error since the last tick: %s", error)
                if self.on_observed is not None:
                    self.on_observed(observed, self.desired())
                actions = reconcile(observed, observed_weights(self.desired(), weights_before), self.timeouts)
                if actions:
                    self.executor.submit(actions)
                return actions
        except Exception as exc:
            self.tick_errors += 1
            self.events.emit("tick_error", f"{type(exc).__name__}: {exc}", tick=self.ticks)
            log.debug("tick failed", exc_info=True)
            return []

    # ---- background thread ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="libra-control-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def poke(self) -> None:
        """Run the next tick now (after the desired state changed)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def wait_until(self, predicate: Callable[[], bool], timeout: float,
                   cancelled: threading.Event | None = None) -> bool:
        """Wait (ticking in the background) until `predicate()` holds; False on timeout or cancellation."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if cancelled is not None and cancelled.is_set():
                return False
            time.sleep(0.2)
        return predicate()
