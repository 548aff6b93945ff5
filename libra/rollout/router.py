"""Request routing over the pool's instances: global admission, the serving set (the instances that receive
new requests, replaced in one step), least-outstanding-requests choice among them, retry on another instance
when one fails mid-request or is declared failed while its requests hang (`fail_instance`), aborting one
instance's requests, and the per-instance state the reload protocol locks.

Everything here runs on the pool's event loop thread; no locking beyond asyncio is needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from libra.rollout.client import InstanceFailure, ServerClient
from libra.rollout.spec import InstanceSpec, InstanceStoppedError, NoHealthyInstanceError

STARTING, READY, RELOADING, DRAINING, FAILED, STOPPED = (
    "starting",
    "ready",
    "reloading",
    "draining",
    "failed",
    "stopped",
)
TRANSITIONAL = (STARTING, RELOADING)

log = logging.getLogger(__name__)


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
    spec: InstanceSpec | None = None  # its launch spec (None for unmanaged endpoints)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requests: set[asyncio.Task[Any]] = field(default_factory=set)  # its HTTP requests in flight
    stopped_reason: str = ""  # set when its requests are aborted by a stop without drain
    lent: bool = False  # its GPUs are lent to the training step (`lending.py`): it may not serve
    asleep: bool = False  # its server sleeps (KV cache released) while lent

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
    """Admits at most `max_concurrent` requests at once and sends each to the least-loaded serving instance.

    `slots` holds every instance the pool knows; only those in `serving` receive new requests. An empty
    serving set means "between two sets" (a restart), so requests wait for the next one."""

    def __init__(self, max_concurrent: int, request_timeout_s: float, wait_for_instance_s: float) -> None:
        self.slots: dict[str, InstanceSlot] = {}
        self.serving: frozenset[str] = frozenset()
        self._admission = asyncio.Semaphore(max_concurrent)
        self._changed = asyncio.Condition()
        self._request_timeout_s = request_timeout_s
        self._wait_for_instance_s = wait_for_instance_s
        self.waiting = 0
        self.in_flight = 0
        self.completed = 0
        self.failed = 0
        self.aborted = 0
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

    async def set_serving(self, instance_ids: Iterable[str]) -> None:
        """Replace the serving set in one step (no await between reading and writing it)."""
        self.serving = frozenset(instance_ids)
        await self.notify()

    async def fail_instance(self, slot: InstanceSlot, failure: str) -> int:
        """Declare `slot` FAILED and send its requests in flight to another instance: a hung server (stopped,
        deadlocked) keeps their connections open and would answer none of them before the request timeout.
        Returns how many were re-sent."""
        await self.set_state(slot, FAILED, failure=failure)
        requests = [r for r in slot.requests if not r.done()]
        for request in requests:
            request.cancel()  # `_send_with_retry` sees its instance FAILED and sends the request elsewhere
        if requests:
            log.warning("%s failed (%s); its %d request(s) in flight are sent to another instance",
                        slot.id, failure, len(requests))
        return len(requests)

    def abort_requests_of(self, slot: InstanceSlot, reason: str) -> int:
        """Cancel `slot`'s requests in flight; each one's caller gets InstanceStoppedError. Returns how many."""
        slot.stopped_reason = reason
        requests = [r for r in slot.requests if not r.done()]
        for request in requests:
            request.cancel()
        return len(requests)

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
        except InstanceStoppedError:
            self.aborted += 1
            raise
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
            request = asyncio.ensure_future(slot.client.complete(payload, self._request_timeout_s))
            slot.requests.add(request)
            try:
                response = await request
                return response, slot, version
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not request.cancelled() or (current and current.cancelling()):
                    raise  # cancelled by its caller (abort_all, shutdown)
                if slot.stopped_reason:
                    raise InstanceStoppedError(
                        f"{slot.id} was stopped without draining ({slot.stopped_reason}); the request was "
                        "aborted and produced nothing: requeue its prompt"
                    ) from None
                if slot.state != FAILED:
                    raise
                # `fail_instance`: its server hangs; the request produced nothing there, so it runs elsewhere.
                errors.append(f"{slot.id}: {slot.failure}")
                tried.add(slot.id)
                self.retries += 1
            except InstanceFailure as exc:
                # The server broke mid-request: take it out of rotation and run the request elsewhere.
                errors.append(str(exc))
                tried.add(slot.id)
                self.retries += 1
                if slot.state in (READY, DRAINING):
                    await self.set_state(slot, FAILED, failure=str(exc))
                    log.warning("%s failed mid-request (%s); the request is sent to another instance", slot.id, exc)
            finally:
                slot.requests.discard(request)
                slot.outstanding -= 1
                await self.notify()

    async def _wait_for_slot(self, tried: set[str], errors: list[str]) -> InstanceSlot:
        deadline = time.monotonic() + self._wait_for_instance_s
        async with self._changed:
            while True:
                serving = [s for s in self.slots.values() if s.id in self.serving]
                slot = pick_least_outstanding(serving, tried)
                if slot is not None:
                    return slot
                may_recover = not self.serving or any(
                    s.state in TRANSITIONAL and s.id not in tried for s in serving
                )
                remaining = deadline - time.monotonic()
                if not may_recover or remaining <= 0:
                    states = {s.id: s.state for s in self.slots.values()}
                    raise NoHealthyInstanceError(
                        f"no rollout instance can take the request (states {states}, serving "
                        f"{sorted(self.serving)}); "
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
