"""The weight gate: serializes weight publishes with rollout membership changes.

The RL loop publishes new weights at its step boundary; the executor changes who serves (starts serving,
flips, stops). Both take the gate, so a publish never runs while the serving set changes, and a change
waits for a publish in progress. The gate also holds the weights last published (`current`), which the
executor loads into a new instance before it may serve.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightsRef:
    """Exported weights: the publish version, the HF directory and its checksum."""

    version: int
    path: str
    checksum: str


class WeightGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = threading.Lock()
        self._current: WeightsRef | None = None
        self.holder = ""  # what holds the gate now ("" = free), for the event log and tests

    @contextmanager
    def hold(self, what: str) -> Iterator[None]:
        """Hold the gate for `what` (a publish or a membership change); waits while another holds it."""
        with self._lock:
            self.holder = what
            try:
                yield
            finally:
                self.holder = ""

    def current(self) -> WeightsRef | None:
        with self._state:
            return self._current

    def set_current(self, weights: WeightsRef) -> None:
        with self._state:
            self._current = weights

    def weights_for(self, version: int) -> WeightsRef:
        """The weights to load for a publish planned at `version`: the gate's current weights when they are
        that version or newer. The RL loop may publish again while the action waits for the gate; loading
        the newer weights is what the planned publish was for (the instance then holds the current weights)."""
        current = self.current()
        if current is None or current.version < version:
            have = "none" if current is None else f"v{current.version}"
            raise LookupError(f"no exported weights of publish version {version} to load (the gate holds {have}); "
                              "the RL loop publishes them at its next step boundary")
        return current
