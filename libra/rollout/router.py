"""Request routing over the pool's instances: global admission, least-outstanding-requests choice, retry on
another instance when one fails mid-request, and the per-instance state the reload protocol locks.

Everything here runs on the pool's event loop thread; no locking beyond asyncio is needed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from libra.rollout.client import InstanceFailure, ServerClient
from libra.rollout.spec import NoHealthyInstanceError

STARTING, READY, RELOADING, DRAINING, FAILED, STOPPED = (
    "starting",
    "ready",
    "reloading",
    "draining",
    "failed",
    "stopped",
)
TRANSITIONAL = (STARTING, RELOADING)


@dataclass(eq=False)
class InstanceSlot:
    """The pool's live view of one instance."""

    id: str
    client: ServerClient
    host: str
    port: int
    weight_version: int
    state: str = STARTING
    pid: int = 0
    start_ticks: int = 0
    hostname: str = ""
    gpu_ids: tuple[str, ...] = ()
    model_path: str = ""
    checksum: str = ""
    managed: bool = True
    adopted: bool = False
    failure: str = ""
    outstanding: int = 0
    dispatched: int = 0
    handle: Any = None  # HostHandle of a managed instance
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def routable(self) -> bool:
        return self.state == READY

    @property
    def healthy(self) -> bool:
        return self.state not in (FAILED, STOPPED)


def pick_least_outstanding(slots: Iterable[InstanceSlot], exclude: set[str]) -> InstanceSlot | None:
    """The routable instance with the fewest requests in flight (ties: the one given the fewest so far)."""
    candidates = [s for s in slots if s.routable and s.id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (s.outstanding, s.dispatched, s.id))


class Router:
    """Admits at most `max_concurrent` requests at once and sends each to the least-loaded instance."""

    def __init__(self, max_concurrent: int, request_timeout_s: float, wait_for_instance_s: float) -> None:
        self.slots: dict[str, InstanceSlot] = {}
        self._admission = asyncio.Semaphore(max_concurrent)
        self._changed = asyncio.Condition()
        self._request_timeout_s = request_timeout_s
        self._wait_for_instance_s = wait_for_instance_s
        self.waiting = 0
        self.in_flight = 0
        self.completed = 0
        self.failed = 0
        self.retries = 0
        self.tokens = 0
        self._busy_since = 0.0
        self.busy_s = 0.0

    async def notify(self) -> None:
        """Wake requests waiting for an instance (call after any state change)."""
        async with self._changed:
            self._changed.notify_all()

    async def set_state(self, slot: InstanceSlot, state: str, failure: str = "") -> None:
        slot.state = state
        if failure:
            slot.failure = failure
        await self.notify()

    def busy_seconds(self) -> float:
        return self.busy_s + (time.monotonic() - self._busy_since if self.in_flight else 0.0)

    async def send(self, payload: dict[str, Any]) -> tuple[dict[str, Any], InstanceSlot, int]:
        """Send one completion request; returns (response, instance, weight version it ran on)."""
        self.waiting += 1
        try:
            await self._admission.acquire()
        finally:
            self.waiting -= 1
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        try:
            response, slot, version = await self._send_with_retry(payload)
            self.completed += 1
            return response, slot, version
        except BaseException:
            self.failed += 1
            raise
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_s += time.monotonic() - self._busy_since
            self._admission.release()

    async def _send_with_retry(self, payload: dict[str, Any]) -> tuple[dict[str, Any], InstanceSlot, int]:
        tried: set[str] = set()
        errors: list[str] = []
        while True:
            slot = await self._wait_for_slot(tried, errors)
            slot.outstanding += 1
            slot.dispatched += 1
            version = slot.weight_version
            try:
                response = await slot.client.complete(payload, self._request_timeout_s)
                return response, slot, version
            except InstanceFailure as exc:
                # The server broke mid-request: take it out of rotation and run the request elsewhere.
                errors.append(str(exc))
                tried.add(slot.id)
                self.retries += 1
                if slot.state in (READY, DRAINING):
                    await self.set_state(slot, FAILED, failure=str(exc))
            finally:
                slot.outstanding -= 1
                await self.notify()

    async def _wait_for_slot(self, tried: set[str], errors: list[str]) -> InstanceSlot:
        deadline = time.monotonic() + self._wait_for_instance_s
        async with self._changed:
            while True:
                slot = pick_least_outstanding(self.slots.values(), tried)
                if slot is not None:
                    return slot
                may_recover = [
                    s for s in self.slots.values() if s.state in TRANSITIONAL and s.id not in tried
                ]
                remaining = deadline - time.monotonic()
                if not may_recover or remaining <= 0:
                    states = {s.id: s.state for s in self.slots.values()}
                    raise NoHealthyInstanceError(
                        f"no rollout instance can take the request (states {states}); "
                        + (f"failures: {errors}" if errors else "add or restart instances")
                    )
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                except TimeoutError:
                    pass

    async def wait_drained(self, slot: InstanceSlot, timeout_s: float) -> bool:
        """Wait until `slot` has no request in flight; False on timeout."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while slot.outstanding > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=remaining)
                except TimeoutError:
                    return slot.outstanding == 0
        return True
