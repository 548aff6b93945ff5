"""The health rule of a rollout instance, applied: the pool's monitor checks each serving-ready instance's
/health every `HealthRule.interval_s` and fails it after `failures_to_fail` misses in a row (`monitor`); the
publisher checks an instance the same way before reloading it (`answers_health`), where a hung server would
hold the reload's drain for reload_timeout_s, and watches it during an in-place reload (`unless_hung`), where
a server that hangs in the middle would hold the publish for reload_timeout_s. The rule itself (`libra.rollout.spec.HealthRule`) comes from the
job's `rollout_health_check_*` options; a hung server is failed within `hang_detection_bound_s`.

An instance declared failed has its requests in flight sent to another instance (`Router.fail_instance`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from libra.rollout.client import InstanceFailure, ServerClient
from libra.rollout.router import READY, Router
from libra.rollout.spec import HealthRule

T = TypeVar("T")


async def answers_health(client: ServerClient, rule: HealthRule) -> bool:
    """True at the first answer; False once `rule.failures_to_fail` checks in a row got none."""
    for attempt in range(rule.failures_to_fail):
        if attempt:
            await asyncio.sleep(rule.interval_s)
        if await client.health(rule.timeout_s):
            return True
    return False


async def until_failed(client: ServerClient, rule: HealthRule) -> str:
    """Check `client` every `rule.interval_s` and return the failure reason once it missed
    `rule.failures_to_fail` checks in a row (runs until cancelled while it answers)."""
    misses = 0
    while True:
        await asyncio.sleep(rule.interval_s)
        misses = 0 if await client.health(rule.timeout_s) else misses + 1
        if misses >= rule.failures_to_fail:
            return rule.failure_reason(misses)


async def unless_hung(work: Awaitable[T], client: ServerClient, rule: HealthRule, what: str) -> T:
    """`work`, watched by the health rule: a server that stops answering /health while it runs (hung,
    stopped) ends it with an `InstanceFailure` within the rule's bound, instead of after `work`'s own timeout.
    Only for work the server answers /health during (an in-place reload; not a restart)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_failed(client, rule))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        reason = watch.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise InstanceFailure(f"hung during {what}: {reason}")
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def monitor(router: Router, rule: HealthRule) -> None:
    """Check every READY instance each round; fail the ones that missed `rule.failures_to_fail` in a row."""
    misses: dict[str, int] = {}
    while True:
        await asyncio.sleep(rule.interval_s)
        for slot in sorted(router.slots.values(), key=lambda s: s.id):
            if slot.state != READY:
                continue
            if await slot.client.health(rule.timeout_s):
                misses[slot.id] = 0
                continue
            misses[slot.id] = misses.get(slot.id, 0) + 1
            if misses[slot.id] >= rule.failures_to_fail and slot.state == READY:
                await router.fail_instance(slot, rule.failure_reason(misses[slot.id]))
