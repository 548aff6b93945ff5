"""The health rule of a rollout instance, applied: the pool's monitor checks each serving-ready instance's
/health every `HealthRule.interval_s` and fails it after `failures_to_fail` misses in a row (`monitor`); the
publisher checks an instance the same way before reloading it (`answers_health`), and watches it while its
requests drain and during an in-place reload (`unless_hung`): a server hung there (before the check, or just
after it with requests in flight) would otherwise hold the publish for reload_timeout_s. The rule itself
(`libra.rollout.spec.HealthRule`) comes from the job's `rollout_health_check_*` options; a hung server is
failed within `hang_detection_bound_s`; `Misses` counts the checks in a row that went unanswered.

The monitor also asks each READY instance's host actor for its status in the same round (`host_gone`): a node
whose Ray daemon hangs is declared dead by Ray while its servers still answer /health, and an instance whose host
Ray declared gone no longer holds its GPUs in Ray's books, so it is failed like a silent one. And it reads the
token counters of each READY instance that has requests in flight (`Progress`): vLLM's /health asks only whether
its engine process reported an error, so an engine that hangs (stopped, stuck in a kernel) behind a front end
that still answers looks healthy; one that counts no token for `HealthRule.stall_s` with requests in flight is
failed.

An instance declared failed has its requests in flight sent to another instance (`Router.fail_instance`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from libra.rollout.client import InstanceFailure, ServerClient
from libra.rollout.router import READY, InstanceSlot, Router
from libra.rollout.spec import HealthRule, HostGoneError

T = TypeVar("T")


async def answers_health(client: ServerClient, rule: HealthRule) -> bool:
    """True at the first answer; False once `rule.failures_to_fail` checks in a row got none."""
    for attempt in range(rule.failures_to_fail):
        if attempt:
            await asyncio.sleep(rule.interval_s)
        if await client.health(rule.timeout_s):
            return True
    return False


@dataclass
class Misses:
    """The checks in a row an instance did not answer, judged by the rule."""

    rule: HealthRule
    count: int = 0

    def record(self, answered: bool) -> bool:
        """Count one check; True once `rule.failures_to_fail` checks in a row went unanswered."""
        self.count = 0 if answered else self.count + 1
        return self.count >= self.rule.failures_to_fail

    @property
    def reason(self) -> str:
        return self.rule.failure_reason(self.count)


@dataclass
class Progress:
    """Whether an instance's engine moves while it has requests in flight, judged by `stall_s`: its last token
    count (`tokens`) and the seconds it had requests in flight since that count last moved (`busy_s`)."""

    stall_s: float
    tokens: float | None = None
    busy_s: float = 0.0
    last_look: float | None = None

    def record(self, in_flight: int, tokens: float | None, now: float) -> bool:
        """Count one look (`tokens` None: not read, or unreadable); True once the instance spent `stall_s`
        seconds with requests in flight while its engine's token count stood still. Only a count that moved
        starts the watch again: requests that come and go on a hung engine (a step ends, its requests there are
        aborted, the next step sends new ones) do not."""
        elapsed = 0.0 if self.last_look is None else now - self.last_look
        self.last_look = now
        if tokens is None:
            return False
        if tokens != self.tokens:
            self.tokens, self.busy_s = tokens, 0.0
            return False
        if in_flight:
            self.busy_s += elapsed
        return self.stall_s > 0 and self.busy_s >= self.stall_s


class EngineStalledError(InstanceFailure):
    """An instance's engine counted no token for the health rule's `stall_s` with requests in flight, its front end
    perhaps still answering /health: the server has failed."""


async def engine_tokens(client: ServerClient, rule: HealthRule, in_flight: int) -> float | None:
    """The token count of `client`'s engine when the rule watches for stalls and the instance has requests in
    flight (else None, and no call is made)."""
    if rule.stall_s <= 0 or in_flight == 0:
        return None
    return await client.engine_tokens(rule.timeout_s)


@dataclass
class Watch:
    """The health rule applied to one instance look after look: /health missed `failures_to_fail` times in a row
    (`Misses`), or its engine stalled with requests in flight (`Progress`)."""

    rule: HealthRule
    misses: Misses
    progress: Progress

    @classmethod
    def of(cls, rule: HealthRule) -> Watch:
        return cls(rule, Misses(rule), Progress(rule.stall_s))

    async def look(self, client: ServerClient, in_flight: Callable[[], int]) -> InstanceFailure | None:
        """One check of /health and, with `in_flight()` requests, of the engine's token count; the failure it
        finds (`EngineStalledError` for a stall), or None."""
        busy = in_flight()
        answered, tokens = await asyncio.gather(client.health(self.rule.timeout_s),
                                                engine_tokens(client, self.rule, busy))
        if self.misses.record(answered):
            return InstanceFailure(self.misses.reason)
        busy = min(busy, in_flight())  # requests that ended meanwhile do not count
        if self.progress.record(busy, tokens, time.monotonic()):
            return EngineStalledError(self.rule.stall_reason(busy))
        return None


async def until_failed(client: ServerClient, rule: HealthRule,
                       in_flight: Callable[[], int] = lambda: 0) -> InstanceFailure:
    """Check `client` every `rule.interval_s` (`Watch`); the failure it finds (runs until cancelled while the
    server answers and its engine moves)."""
    watch = Watch.of(rule)
    while True:
        await asyncio.sleep(rule.interval_s)
        if (failure := await watch.look(client, in_flight)) is not None:
            return failure


async def unless_hung(work: Awaitable[T], client: ServerClient, rule: HealthRule, what: str,
                      in_flight: Callable[[], int] = lambda: 0) -> T:
    """`work`, watched by the health rule: a server that stops answering /health while it runs (hung,
    stopped) ends it with an `InstanceFailure` within the rule's bound, instead of after `work`'s own timeout,
    and so does an engine that stalls while `in_flight()` requests wait on it (`EngineStalledError`: the drain
    before a reload waits for requests that a hung engine never ends). Only for work the server answers
    /health during (the drain before a reload, an in-place reload; not a restart)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_failed(client, rule, in_flight))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        failure = watch.result()
        raise type(failure)(f"hung during {what}: {failure}")
    finally:  # the work of a hung server is cancelled here
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def host_gone(handle: Any, rule: HealthRule) -> str:
    """Why the host actor `handle` (None: an unmanaged endpoint) is gone for good, or '' while it answers or
    cannot tell (a host that does not answer now may be busy; its server's /health decides then). A host on a
    node the job fenced off (`libra.cluster.node_fence`) is gone for the job though it answers."""
    if handle is None:
        return ""
    fenced = getattr(handle, "fenced", None)
    if fenced is not None and (why := await asyncio.to_thread(fenced)):
        return why
    try:
        await asyncio.wait_for(handle.acall("status"), rule.timeout_s)
    except HostGoneError as exc:
        return f"its host is gone, as when Ray declares its node dead ({exc})"
    except Exception:  # unreachable now, slow, or a status that failed: not a verdict
        pass
    return ""


def _in_flight(slot: InstanceSlot) -> int:
    return slot.outstanding


async def monitor(router: Router, rule: HealthRule) -> None:
    """Check every READY instance each round; fail the ones that missed `rule.failures_to_fail` in a row, the
    ones whose host actor is gone, and the ones whose engine stalled with requests in flight."""
    watches: dict[str, Watch] = {}
    while True:
        await asyncio.sleep(rule.interval_s)
        for removed in watches.keys() - router.slots.keys():  # each replacement is a new id: keep what is watched
            del watches[removed]
        for slot in sorted(router.slots.values(), key=lambda s: s.id):
            if slot.state != READY:
                if slot.id in watches:  # a reload or a start pauses the engine: its progress counts anew once it serves
                    watches[slot.id].progress = Progress(rule.stall_s)
                continue
            watch = watches.setdefault(slot.id, Watch.of(rule))
            failure, gone = await asyncio.gather(watch.look(slot.client, functools.partial(_in_flight, slot)),
                                                 host_gone(slot.handle, rule))
            if (failure or gone) and slot.state == READY:
                await router.fail_instance(slot, gone or str(failure))
