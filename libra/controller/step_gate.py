"""The RL loop's gate at each step boundary: pause (hold before the next step, the pools and the reconciler
keep running), resume, and drain (end the loop after the step in flight, so the job checkpoints and stops
with outcome `drained`). Operators reach it through the operator API; the loop asks `proceed()` before each
step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class StepGate:
    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.drain_requested = False
        self.holding = False  # the loop is waiting at a step boundary
        self.reason = ""

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self, reason: str = "") -> bool:
        """Hold the loop at the next step boundary; False when it already was paused."""
        with self._lock:
            if self.paused:
                return False
            self.reason = reason
            self._open.clear()
            return True

    def resume(self) -> bool:
        """Let a paused loop go on; False when it was not paused."""
        with self._lock:
            if not self.paused:
                return False
            self._open.set()
            return True

    def drain(self) -> bool:
        """End the loop at the next step boundary (a paused loop ends at once); False when already asked."""
        with self._lock:
            first = not self.drain_requested
            self.drain_requested = True
            self._open.set()
            return first

    def proceed(self, cancelled: threading.Event, on_hold: Callable[[bool], None] | None = None) -> bool:
        """At a step boundary: wait while paused (calling `on_hold(True)` when the wait begins and
        `on_hold(False)` when it ends); False when the loop should end (drain, or `cancelled`)."""
        if self.paused and not self.drain_requested and not cancelled.is_set():
            self.holding = True
            if on_hold is not None:
                on_hold(True)
            try:
                while not self._open.wait(0.2):
                    if cancelled.is_set():
                        break
            finally:
                self.holding = False
            if on_hold is not None:
                on_hold(False)
        return not (self.drain_requested or cancelled.is_set())
