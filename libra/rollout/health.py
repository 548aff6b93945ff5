"""The health rule of a rollout instance, applied: the pool's monitor checks each serving-ready instance's
/health every `HealthRule.interval_s` and fails it after `failures_to_fail` misses in a row (`monitor`); the
publisher checks an instance the same way before reloading it (`answers_health`), and watches it while its
requests drain and during an in-place reload (`unless_hung`): a server hung there (before the check, or just
after it with requests in flight) would otherwise hold the publish for reload_timeout_s. The rule itself
(`libra.rollout.spec.HealthRule`) comes from the job's `rollout_health_check_*` options; a hung server is
failed within `hang_detection_bound_s`; `Misses` counts the checks in a row that went unanswered.

The monitor also asks each READY instance's host actor for its status in the same round (`host_gone`): a node
whose Ray daemon hangs is declared dead by Ray while its servers still answer /health, and an instance whose host
Ray declared gone no longer holds its GPUs in Ray's books, so it is failed like a silent one.

An instance declared failed has its requests in flight sent to another instance (`Router.fail_instance`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from libra.rollout.client import InstanceFailure, ServerClient
from libra.rollout.router import READY, Router
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


async def until_failed(client: ServerClient, rule: HealthRule) -> str:
    """Check `client` every `rule.interval_s` and return the failure reason once it missed
    `rule.failures_to_fail` checks in a row (runs until cancelled while it answers)."""
    misses = Misses(rule)
    while True:
        await asyncio.sleep(rule.interval_s)
        if misses.record(await client.health(rule.timeout_s)):
            return misses.reason


async def unless_hung(work: Awaitable[T], client: ServerClient, rule: HealthRule, what: str) -> T:
    """`work`, watched by the health rule: a server that stops answering /health while it runs (hung,
    stopped) ends it with an `InstanceFailure` within the rule's bound, instead of after `work`'s own timeout.
    Only for work the server answers /health during (the drain before a reload, an in-place reload; not a
    restart)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_failed(client, rule))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise InstanceFailure(f"hung during {what}: {watch.result()}")
    finally:  # the work of a hung server is cancelled here
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def host_gone(handle: Any, rule: HealthRule) -> str:
    """Why the host actor `handle` (None: an unmanaged endpoint) is gone for good, or '' while it answers or
    cannot tell (a host that does not answer now may be busy; its server's /health decides then)."""
    if handle is None:
        return ""
    try:
        await asyncio.wait_for(handle.acall("status"), rule.timeout_s)
    except HostGoneError as exc:
        return f"its host is gone, as when Ray declares its node dead ({exc})"
    except Exception:  # unreachable now, slow, or a status that failed: not a verdict
        pass
    return ""


async def monitor(router: Router, rule: HealthRule) -> None:
    """Check every READY instance each round; fail the ones that missed `rule.failures_to_fail` in a row, and the
    ones whose host actor is gone."""
    misses: dict[str, Misses] = {}
    while True:
        await asyncio.sleep(rule.interval_s)
        for slot in sorted(router.slots.values(), key=lambda s: s.id):
            if slot.state != READY:
                continue
            missed = misses.setdefault(slot.id, Misses(rule))
            answered, gone = await asyncio.gather(slot.client.health(rule.timeout_s), host_gone(slot.handle, rule))
            failed = missed.record(answered)
            if (failed or gone) and slot.state == READY:
                await router.fail_instance(slot, gone or missed.reason)
