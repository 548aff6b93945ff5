"""Routing decisions: least-outstanding choice among the serving set, waiting for instances that may come back,
giving up, serving-set flips, and aborting the requests of one stopped instance."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from libra.rollout.client import ServerClient
from libra.rollout.router import FAILED, READY, RELOADING, InstanceSlot, Router, pick_least_outstanding
from libra.rollout.spec import GenerationAborted, InstanceStoppedError, NoHealthyInstanceError


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
        await router.set_serving(["a", "b"])
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


def router_with(*slots: InstanceSlot, serving: tuple[str, ...] = ()) -> Router:
    router = Router(max_concurrent=8, request_timeout_s=5, wait_for_instance_s=0.2)
    router.slots = {s.id: s for s in slots}
    router.serving = frozenset(serving)
    return router


@pytest.mark.parametrize(
    ("slots", "serving", "chosen"),
    [
        ([slot("a"), slot("b", outstanding=3)], ("b",), "b"),
        ([slot("a", outstanding=3), slot("b")], ("a",), "a"),
        ([slot("a"), slot("b")], ("a", "b"), "a"),
        ([slot("a"), slot("b", state=FAILED)], ("b",), None),
    ],
    ids=["only-serving-even-if-busier", "other-side", "both-serving", "serving-one-failed"],
)
def test_only_the_serving_set_receives_requests(
    slots: list[InstanceSlot], serving: tuple[str, ...], chosen: str | None
) -> None:
    async def scenario() -> str | None:
        router = router_with(*slots, serving=serving)
        try:
            return (await router._wait_for_slot(set(), [])).id
        except NoHealthyInstanceError:
            return None

    assert asyncio.run(scenario()) == chosen


def test_a_serving_flip_is_one_step_and_wakes_waiting_requests() -> None:
    async def scenario() -> tuple[str, str]:
        router = router_with(slot("blue"), slot("green"), serving=("blue",))
        before = (await router._wait_for_slot(set(), [])).id
        await router.set_serving([])  # between two sets: requests wait for the next one
        waiter = asyncio.create_task(router._wait_for_slot(set(), []))
        await asyncio.sleep(0.05)
        assert not waiter.done(), "an empty serving set waits for the next one"
        await router.set_serving(["green"])
        return before, (await asyncio.wait_for(waiter, 1)).id

    assert asyncio.run(scenario()) == ("blue", "green")


class _HangingClient:
    """A server that answers only when released (or never): requests stay in flight."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.release = asyncio.Event()

    async def complete(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        await self.release.wait()
        return {"choices": [], "from": self.instance_id}


def test_abort_of_one_instance_raises_the_requeue_error_only_for_its_requests() -> None:
    async def scenario() -> tuple[list[object], int, int]:
        doomed, kept = slot("doomed"), slot("kept")
        doomed.client, kept.client = _HangingClient("doomed"), _HangingClient("kept")  # type: ignore[assignment]
        router = router_with(doomed, kept, serving=("doomed", "kept"))
        requests = [asyncio.create_task(router.send({"i": i})) for i in range(4)]
        await asyncio.sleep(0.05)
        assert (doomed.outstanding, kept.outstanding) == (2, 2)
        await router.set_serving(["kept"])
        aborted = router.abort_requests_of(doomed, "stop_instance(drain=False)")
        kept.client.release.set()  # type: ignore[attr-defined]
        results: list[object] = list(await asyncio.gather(*requests, return_exceptions=True))
        return results, aborted, router.aborted

    results, aborted, counted = asyncio.run(scenario())
    stopped = [r for r in results if isinstance(r, BaseException)]
    answered = [r for r in results if not isinstance(r, BaseException)]
    assert aborted == counted == 2
    assert len(stopped) == 2 and all(isinstance(e, InstanceStoppedError) for e in stopped)
    assert all(isinstance(e, GenerationAborted) and "requeue" in str(e) for e in stopped)
    assert [r[1].id for r in answered] == ["kept", "kept"]  # type: ignore[index]


def test_cancelling_the_caller_is_not_an_instance_stop() -> None:
    async def scenario() -> BaseException | None:
        only = slot("only")
        only.client = _HangingClient("only")  # type: ignore[assignment]
        router = router_with(only, serving=("only",))
        request = asyncio.create_task(router.send({}))
        await asyncio.sleep(0.02)
        only.stopped_reason = "stop_instance(drain=False)"  # even while a stop is under way
        request.cancel()
        try:
            await request
        except BaseException as exc:
            return exc
        return None

    assert isinstance(asyncio.run(scenario()), asyncio.CancelledError)


def test_a_failed_instance_s_hanging_requests_run_on_another_instance() -> None:
    async def scenario() -> tuple[list[object], int, int, str]:
        hung, kept = slot("hung"), slot("kept")
        hung.client, kept.client = _HangingClient("hung"), _HangingClient("kept")  # type: ignore[assignment]
        router = router_with(hung, kept, serving=("hung", "kept"))
        requests = [asyncio.create_task(router.send({"i": i})) for i in range(4)]
        await asyncio.sleep(0.05)
        assert (hung.outstanding, kept.outstanding) == (2, 2)
        resent = await router.fail_instance(hung, "/health did not answer")
        await asyncio.sleep(0.05)
        assert (hung.outstanding, kept.outstanding) == (0, 4), "re-sent at once, not at the request timeout"
        kept.client.release.set()  # type: ignore[attr-defined]
        results: list[object] = list(await asyncio.gather(*requests, return_exceptions=True))
        return results, resent, router.retries, hung.state

    results, resent, retries, state = asyncio.run(scenario())
    assert resent == retries == 2 and state == FAILED
    assert [r[1].id for r in results] == ["kept"] * 4  # type: ignore[index]


def test_a_failed_instance_with_no_other_instance_fails_its_requests() -> None:
    async def scenario() -> BaseException | None:
        hung = slot("hung")
        hung.client = _HangingClient("hung")  # type: ignore[assignment]
        router = router_with(hung, serving=("hung",))
        request = asyncio.create_task(router.send({}))
        await asyncio.sleep(0.02)
        await router.fail_instance(hung, "/health did not answer")
        try:
            await asyncio.wait_for(request, 2)
        except BaseException as exc:
            return exc
        return None

    error = asyncio.run(scenario())
    assert isinstance(error, NoHealthyInstanceError) and "/health did not answer" in str(error)
