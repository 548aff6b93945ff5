"""Graceful stop on SIGINT / SIGTERM: the first signal asks the controller to finish the current step,
checkpoint and stop everything it started; a second SIGINT interrupts at once (KeyboardInterrupt, still
followed by the clean-up of the `finally` blocks). Starting Ray replaces the SIGTERM handler, so the
controller calls `reinstall()` once Ray runs."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class StopRequest:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.signals = 0
        self.reason = ""
        self._previous: dict[int, Any] = {}

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        self.request(signal.Signals(signum).name)
        if self.signals >= 2 and signum == signal.SIGINT:
            raise KeyboardInterrupt

    def install(self) -> bool:
        """Install the handlers (only possible on the main thread); False when not installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    def reinstall(self) -> None:
        """Take SIGINT / SIGTERM back after a library replaced the handlers: `ray.init` installs a native
        SIGTERM handler that dumps a stack and aborts the process, skipping every clean-up. No-op unless
        `install()` succeeded."""
        if self._previous and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            try:
                signal.signal(signum, handler)
            except (ValueError, TypeError):
                pass
        self._previous.clear()
