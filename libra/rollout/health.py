"""The health rule of a rollout instance: how often its server's /health is asked, how long an answer may take,
how many misses in a row make the instance failed, and the bound on detecting a hung server that follows
from them. The pool's monitor applies it to the serving-ready instances (`monitor`); the publisher applies it
before a reload (`answers_health`), where a hung server would hold the reload's drain for reload_timeout_s.

An instance declared failed has its requests in flight sent to another instance (`Router.fail_instance`).
"""

from __future__ import annotations

import asyncio

from libra.rollout.client import ServerClient
from libra.rollout.router import READY, Router

HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 10.0
HEALTH_FAILURES_TO_FAIL = 3
# A server that stops answering (hung, stopped) right after a good check is declared failed within this
# bound: each of the misses takes the pause between rounds plus a check that runs to its timeout.
HANG_DETECTION_BOUND_S = HEALTH_FAILURES_TO_FAIL * (HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S)


def failure_reason(misses: int) -> str:
    return f"/health did not answer {misses} checks in a row ({HEALTH_TIMEOUT_S:.0f}s timeout each)"


async def answers_health(client: ServerClient) -> bool:
    """True at the first answer; False once HEALTH_FAILURES_TO_FAIL checks in a row got none."""
    for attempt in range(HEALTH_FAILURES_TO_FAIL):
        if attempt:
            await asyncio.sleep(HEALTH_INTERVAL_S)
        if await client.health(HEALTH_TIMEOUT_S):
            return True
    return False


async def monitor(router: Router) -> None:
    """Check every READY instance each round; fail the ones that missed HEALTH_FAILURES_TO_FAIL in a row."""
    misses: dict[str, int] = {}
    while True:
        await asyncio.sleep(HEALTH_INTERVAL_S)
        for slot in sorted(router.slots.values(), key=lambda s: s.id):
            if slot.state != READY:
                continue
            if await slot.client.health(HEALTH_TIMEOUT_S):
                misses[slot.id] = 0
                continue
            misses[slot.id] = misses.get(slot.id, 0) + 1
            if misses[slot.id] >= HEALTH_FAILURES_TO_FAIL and slot.state == READY:
                await router.fail_instance(slot, failure_reason(misses[slot.id]))
