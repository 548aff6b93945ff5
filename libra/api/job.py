"""What the operator service needs from the running job (`JobControl`): the controller provides it; the
unit tests pass a fake. Nothing else of the controller is reached from the API."""

from __future__ import annotations

from typing import Protocol

from libra.config import Config
from libra.controller.events import EventLog
from libra.controller.reconfigure import ReconfigureLimits, ReconfigureTarget
from libra.controller.signals import StopRequest
from libra.controller.state import DesiredState, ObservedState
from libra.controller.step_gate import StepGate
from libra.run_dir import RunDir


class JobControl(Protocol):
    cfg: Config
    run: RunDir
    events: EventLog
    stop: StopRequest
    step_gate: StepGate

    @property
    def step(self) -> int: ...

    @property
    def desired(self) -> DesiredState | None:
        """The desired state (None while the job is starting)."""

    def observed_state(self) -> ObservedState | None:
        """What the last control tick saw (None while the pools are not started)."""

    def reconfigure_limits(self) -> ReconfigureLimits: ...

    def request_reconfigure(self, target: ReconfigureTarget, strategy: str | None = None) -> DesiredState:
        """Start a reconfiguration; ValueError (ReconfigureRefused) says why not."""
