"""The one owner of a job's desired state: every change goes through it, is checkpointed to
`desired_state.json` at once, and is atomic with respect to the other writers (the control loop ending a
reconfiguration, the RL loop recording a published weight version, a reconfiguration request)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from libra.controller.state import DesiredState


class DesiredStore:
    def __init__(self, path: Path | None, desired: DesiredState) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._desired = desired
        self._save(desired)

    def get(self) -> DesiredState:
        with self._lock:
            return self._desired

    def set(self, desired: DesiredState) -> DesiredState:
        with self._lock:
            self._save(desired)
            self._desired = desired
            return desired

    def update(self, **changes: Any) -> DesiredState:
        """The current desired state with `changes` (no new generation: bookkeeping such as the weight
        version), checkpointed."""
        return self.change(lambda d: dataclasses.replace(d, **changes))

    def change(self, how: Callable[[DesiredState], DesiredState]) -> DesiredState:
        """Read-modify-write under the lock: `how` sees the current state; an exception leaves it as it was."""
        with self._lock:
            return self.set(how(self._desired))

    def replace_if(self, expected: DesiredState, new: DesiredState) -> bool:
        """Set `new` only if the state is still `expected` (nobody changed it in between)."""
        with self._lock:
            if self._desired is not expected:
                return False
            self.set(new)
            return True

    def _save(self, desired: DesiredState) -> None:
        if self.path is not None:
            desired.save(self.path)
