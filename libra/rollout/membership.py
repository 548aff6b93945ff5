"""Membership as an actuator: start (or adopt) an instance under the id and spec the caller chose, stop one
(draining its requests or aborting them), replace the serving set in one step, and the views the caller
decides from (`instances`, `live_servers`). The caller (the controller's reconciler) owns every decision;
this module carries them out and refuses the ones that would break an invariant:

- an id names at most one instance;
- only READY instances holding the pool's current weight version serve, so a new instance never receives
  traffic on stale weights.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from libra.rollout.lifecycle import InstanceManager, next_instance_id
from libra.rollout.publisher import CurrentWeights
from libra.rollout.router import DRAINING, READY, STOPPED, InstanceSlot, Router
from libra.rollout.spec import (
    InstanceIdError,
    InstanceInfo,
    InstanceSpec,
    LiveServer,
    RolloutPoolSpec,
    RolloutSpecError,
    ServingSetError,
    instance_id_problem,
)

log = logging.getLogger(__name__)


def serving_problems(
    instance_ids: Iterable[str], slots: Mapping[str, InstanceSlot], version: int
) -> list[str]:
    """Why the instances `instance_ids` may not form the serving set, one line each; empty when they may."""
    problems = []
    for iid in sorted(set(instance_ids)):
        slot = slots.get(iid)
        if slot is None:
            problems.append(f"{iid!r}: no such instance (instances: {sorted(slots)})")
        elif slot.state != READY:
            problems.append(f"{iid!r}: is {slot.state}, only ready instances serve")
        elif slot.lent:
            problems.append(f"{iid!r}: its GPUs are lent to the training step; it serves again once given back")
        elif slot.weight_version != version:
            problems.append(
                f"{iid!r}: holds weight version {slot.weight_version}, the pool serves {version}; publish the "
                "current weights to it first"
            )
    return problems


def start_problems(
    instance_id: str, spec: InstanceSpec, known: Iterable[str], manage_processes: bool
) -> list[str]:
    """Why `start_instance(instance_id, spec)` is refused before anything starts; empty when it may run."""
    problems = []
    if not manage_processes:
        problems.append(
            "start_instance needs manage_processes=True (unmanaged pools use the configured endpoints)"
        )
    id_problem = instance_id_problem(instance_id)
    if id_problem:
        problems.append(id_problem)
    elif instance_id in set(known):
        problems.append(f"instance id {instance_id!r} is already in use; stop it first or choose another id")
    problems.extend(spec.problems())
    return problems


def instance_info(slot: InstanceSlot, serving: bool) -> InstanceInfo:
    return InstanceInfo(
        id=slot.id,
        host=slot.host,
        port=slot.port,
        pid=slot.pid,
        gpu_ids=slot.gpu_ids,
        weight_version=slot.weight_version,
        state=slot.state,
        healthy=slot.healthy,
        model_path=slot.model_path,
        outstanding=slot.outstanding,
        managed=slot.managed,
        adopted=slot.adopted,
        tp_size=slot.spec.tp_size if slot.spec else 0,
        fingerprint=slot.spec.fingerprint() if slot.spec else "",
        serving=serving,
        lent=slot.lent,
        failure=slot.failure,
    )


class Membership:
    """Carries out membership changes on the pool's loop (all coroutines run there)."""

    def __init__(
        self, spec: RolloutPoolSpec, router: Router, manager: InstanceManager | None, current: CurrentWeights
    ) -> None:
        self.spec = spec
        self.router = router
        self.manager = manager
        self.current = current
        self.starting: set[str] = set()  # ids reserved by starts in progress

    def instances(self) -> list[InstanceInfo]:
        router = self.router
        return [
            instance_info(s, s.id in router.serving)
            for s in sorted(router.slots.values(), key=lambda s: s.id)
        ]

    def live_servers(self) -> list[LiveServer]:
        """Every live server the registry lists: unclaimed ones (from a previous controller) and this pool's."""
        if self.manager is None:
            return []
        servers = [
            LiveServer(
                instance_id=entry.instance_id, fingerprint=entry.spec_fingerprint,
                tp_size=int(entry.spec.get("tp_size", 0)) if entry.spec else 0, gpu_ids=tuple(entry.gpu_ids),
                weight_version=entry.weight_version, host=entry.host, port=entry.port, pid=entry.pid, in_pool=False,
            )
            for entry, _ in self.manager.unclaimed.values()
        ]  # fmt: skip
        servers += [
            LiveServer(
                instance_id=s.id, fingerprint=s.spec.fingerprint() if s.spec else "",
                tp_size=s.spec.tp_size if s.spec else 0, gpu_ids=s.gpu_ids, weight_version=s.weight_version,
                host=s.host, port=s.port, pid=s.pid, in_pool=True,
            )
            for s in self.manager.tracked.values()
            if s.state != STOPPED
        ]  # fmt: skip
        return sorted(servers, key=lambda s: s.instance_id)

    async def start_instance(self, instance_id: str, spec: InstanceSpec) -> InstanceSlot:
        """Adopt the live server `instance_id` if one of the same spec is unclaimed, else launch one on the
        pool's current weights. The instance does not serve until it is put in the serving set."""
        known = [*self.router.slots, *self.starting]
        problems = start_problems(instance_id, spec, known, self.manager is not None)
        if problems:
            error = InstanceIdError if any("instance id" in p for p in problems) else RolloutSpecError
            raise error(f"cannot start instance {instance_id!r}: " + "; ".join(problems))
        manager = self.manager
        assert manager is not None
        # Reserved before the first await, so two concurrent starts of one id never both run.
        self.starting.add(instance_id)
        try:
            slot = await manager.adopt(instance_id, spec) or await manager.launch(instance_id, spec)
        finally:
            self.starting.discard(instance_id)
        self.router.slots[instance_id] = slot
        await self.router.notify()
        return slot

    async def stop_instance(self, instance_id: str, drain: bool) -> None:
        """Take the instance out of the serving set, then drain (its requests finish) or abort (each of its
        requests raises InstanceStoppedError for the caller to requeue), then stop its server."""
        router = self.router
        slot = router.slots.get(instance_id)
        if slot is None:
            if self.manager is not None and await self.manager.stop_unclaimed(instance_id):
                return
            raise InstanceIdError(
                f"unknown rollout instance {instance_id!r}; instances: {sorted(router.slots)}"
            )
        if instance_id in router.serving:
            await router.set_serving(router.serving - {instance_id})
        async with slot.lock:
            await router.set_state(slot, DRAINING)
            if not drain:
                aborted = router.abort_requests_of(slot, "stop_instance(drain=False)")
                if aborted:
                    log.info(
                        "%s: aborted %d request(s) in flight; their prompts are requeued", slot.id, aborted
                    )
            if not await router.wait_drained(slot, self.spec.request_timeout_s):
                log.warning(
                    "%s still had %d requests after draining; they retry elsewhere", slot.id, slot.outstanding
                )
            if self.manager is not None:
                await self.manager.stop(slot)
            await router.set_state(slot, STOPPED)
            router.slots.pop(instance_id, None)

    async def set_serving(self, instance_ids: Iterable[str]) -> None:
        ids = list(instance_ids)
        problems = serving_problems(ids, self.router.slots, self.current.version)
        if problems:
            raise ServingSetError("serving set refused, nothing changed:\n  " + "\n  ".join(problems))
        await self.router.set_serving(ids)

    # ---- the pool-decides path (RolloutPool.start / add_instance) --------------------------------------

    async def populate(self, count: int, spec: InstanceSpec) -> None:
        """Adopt the live servers started with `spec`, keep `count` of them (stopping the rest), start the
        missing ones under the next free names, and serve them all."""
        manager, router = self.manager, self.router
        assert manager is not None
        adopted = await manager.adopt_all(spec)
        for extra in adopted[count:]:
            await manager.stop(extra)
        keep = adopted[:count]
        ids = [s.id for s in keep]
        new_ids = []
        for _ in range(count - len(keep)):
            ids.append(next_instance_id(ids))
            new_ids.append(ids[-1])
        results = await asyncio.gather(*(manager.launch(i, spec) for i in new_ids), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        started = [r for r in results if isinstance(r, InstanceSlot)]
        if errors:
            for slot in started:
                await manager.stop(slot)
            raise errors[0]
        for slot in [*keep, *started]:
            router.slots[slot.id] = slot
        # Adopted servers keep the version they hold: this path serves what runs, as it always did.
        await router.set_serving(router.slots)

    async def add_next(self, spec: InstanceSpec) -> str:
        """Start one more instance under the next free name and add it to the serving set."""
        manager, router = self.manager, self.router
        assert manager is not None
        # Named and reserved (by start_instance) before the first await, so concurrent adds differ.
        known = [*router.slots, *manager.tracked, *manager.record.entries, *manager.unclaimed, *self.starting]
        iid = next_instance_id(known)
        await self.start_instance(iid, spec)
        await self.set_serving(router.serving | {iid})
        return iid
