"""Routing decisions: least-outstanding choice, waiting for instances that may come back, giving up."""

from __future__ import annotations

import asyncio

import pytest

from libra.rollout.client import ServerClient
from libra.rollout.router import FAILED, READY, RELOADING, InstanceSlot, Router, pick_least_outstanding
from libra.rollout.spec import NoHealthyInstanceError


def slot(iid: str, state: str = READY, outstanding: int = 0, dispatched: int = 0) -> InstanceSlot:
    client = ServerClient(None, f"http://127.0.0.1/{iid}", iid)  # type: ignore[arg-type]  # never called here
    return InstanceSlot(
        id=iid, client=client, host="h", port=1, weight_version=0, state=state, outstanding=outstanding,
        dispatched=dispatched,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("slots", "exclude", "chosen"),
    [
        ([slot("a", outstanding=2), slot("b", outstanding=1)], set(), "b"),
        ([slot("a", outstanding=1, dispatched=9), slot("b", outstanding=1, dispatched=3)], set(), "b"),
        ([slot("a"), slot("b")], set(), "a"),
        ([slot("a"), slot("b", outstanding=5)], {"a"}, "b"),
        ([slot("a", state=FAILED), slot("b", outstanding=5)], set(), "b"),
        ([slot("a", state=RELOADING), slot("b", state=FAILED)], set(), None),
    ],
    ids=[
        "fewest-outstanding",
        "tie-fewest-dispatched",
        "tie-by-id",
        "excluded",
        "skips-failed",
        "none-routable",
    ],
)
def test_pick_least_outstanding(slots: list[InstanceSlot], exclude: set[str], chosen: str | None) -> None:
    picked = pick_least_outstanding(slots, exclude)
    assert (picked.id if picked else None) == chosen


def test_requests_wait_for_a_reloading_instance_and_fail_when_none_can_recover() -> None:
    async def scenario() -> tuple[str, str]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=5)
        reloading = slot("a", state=RELOADING)
        router.slots = {"a": reloading, "b": slot("b", state=FAILED)}
        waiter = asyncio.create_task(router._wait_for_slot(set(), []))
        await asyncio.sleep(0.05)
        assert not waiter.done(), "a reloading instance may come back: wait for it"
        await router.set_state(reloading, READY)
        got = (await asyncio.wait_for(waiter, 1)).id
        await router.set_state(reloading, FAILED, failure="gone")
        try:
            await router._wait_for_slot(set(), ["a: connection reset"])
        except NoHealthyInstanceError as exc:
            return got, str(exc)
        return got, ""

    got, error = asyncio.run(scenario())
    assert got == "a"
    assert "no rollout instance can take the request" in error and "connection reset" in error


def test_drain_wait_returns_when_outstanding_reaches_zero() -> None:
    async def scenario() -> tuple[bool, bool]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=5)
        busy = slot("a", outstanding=1)
        timed_out = await router.wait_drained(busy, 0.05)

        async def finish() -> None:
            await asyncio.sleep(0.05)
            busy.outstanding = 0
            await router.notify()

        asyncio.create_task(finish())
        return timed_out, await router.wait_drained(busy, 2)

    assert asyncio.run(scenario()) == (False, True)
