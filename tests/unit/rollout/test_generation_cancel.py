"""A generation whose caller goes away ends quietly; one ended by `abort_all` tells its caller why.

The caller runs on another event loop than the pool (the rollout producer's loop), as in a job: a cancelled
caller used to leave the pool's task ending with `GenerationAborted` that nobody retrieved, which asyncio
printed as "Task exception was never retrieved" once per aborted request at every Ctrl-C.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import replace
from typing import Any

import pytest

from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout.client import ServerClient
from libra.rollout.generation import Generation
from libra.rollout.loop_thread import LoopThread
from libra.rollout.router import READY, InstanceSlot, Router
from libra.rollout.spec import GenerationAborted


class _HangingClient:
    """A server that never answers until the request is cancelled."""

    async def complete(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def abort_requests(self) -> None:
        return None


def _generation() -> Generation:
    spec = replace(rollout_pool_spec(config_with("/m"), num_instances=1, kv_cache_bytes=64 * 2**20),
                   max_model_len=64)
    router = Router(max_concurrent=8, request_timeout_s=5, wait_for_instance_s=0.2)
    client = ServerClient(None, "http://127.0.0.1/a", "a")  # type: ignore[arg-type]  # replaced below
    slot = InstanceSlot(id="a", client=client, host="h", port=1, weight_version=0, state=READY)
    slot.client = _HangingClient()  # type: ignore[assignment]
    router.slots = {"a": slot}
    router.serving = frozenset({"a"})
    return Generation(spec, router)


@pytest.mark.parametrize(
    ("ender", "caller_sees"),
    [("caller-cancels", asyncio.CancelledError), ("abort-all", GenerationAborted)],
    ids=["caller-cancels", "abort-all"],
)
def test_generation_end_is_reported_once_and_only_to_a_waiting_caller(
    ender: str, caller_sees: type[BaseException]
) -> None:
    pool_loop = LoopThread("test-pool-loop")
    unretrieved: list[dict[str, Any]] = []
    pool_loop.loop.set_exception_handler(lambda loop, context: unretrieved.append(context))
    generation = _generation()

    async def caller() -> type[BaseException] | None:
        future = pool_loop.submit(generation.generate([1, 2], 2, 2, 1.0, 1.0, None, generation.abort_epoch))
        waiter = asyncio.ensure_future(asyncio.wrap_future(future))
        await asyncio.sleep(0.1)
        if ender == "caller-cancels":
            waiter.cancel()
        else:
            pool_loop.run(generation.abort_all(notify_servers=True), timeout=5)
        try:
            await waiter
        except BaseException as exc:  # noqa: BLE001  # the outcome under test
            return type(exc)  # not the exception: its traceback would keep the pool's task alive
        return None

    try:
        seen = asyncio.run(caller())
        pool_loop.run(asyncio.sleep(0.1), timeout=5)  # let the pool's task finish
        gc.collect()  # an unretrieved task exception is reported when the task is collected
        pool_loop.run(asyncio.sleep(0.05), timeout=5)
    finally:
        pool_loop.stop()
    assert seen is caller_sees
    assert [c.get("message") for c in unretrieved] == []
