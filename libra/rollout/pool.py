"""RolloutPool: the public face of the rollout side, a small facade over its parts. It owns an event loop
thread on which all HTTP traffic, routing and the weight reload protocol run; its blocking methods hand
work to that loop.

The pool is an actuator: the caller decides which instances run (ids and specs), which serve and when
weights are published; the pool carries that out and reports what it observed:

- `open()` connects to the registry in run_dir and starts nothing; `live_servers()` lists the servers a
  previous controller left running, `start_instance(id, spec)` adopts (same id and spec fingerprint) or
  starts one, `stop_instance(id, drain)` stops one, `set_serving(ids)` replaces the serving set in one
  step, `publish_weights(..., instance_ids=)` reloads a set of instances; `instances()` is the view.
- `start()`, `add_instance()` and `remove_instance()` are the older pool-decides path over the same parts:
  `start()` adopts what it can, trims to `spec.num_instances`, names new instances itself and serves them all.

Parts: `membership.py` (start/adopt/stop/serving set), `generation.py` (requests, abort), `publisher.py`
(weight reloads and ACKs), `lifecycle.py` (server processes and the registry), `router.py` (routing),
`health.py` (the health rule and its monitor).
Managed pools (`manage_processes=True`) run their own vLLM servers; unmanaged pools serve the `endpoints`.

Phase traces: generation batches (`rollout.generate`) and publishes (`weight_sync.publish`, the flow source)
go to the calling process's tracer (`get_tracer()`, the controller's rank 0 in a job); each instance's
reloads go to the instance's own rank file (`tracing.py`, enabled by `spec.trace`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import aiohttp

from libra.cluster.ehp_workers import LentGpu, lent_by_instance
from libra.observability.phase_trace import get_tracer
from libra.rollout import health, lending
from libra.rollout.client import client_session
from libra.rollout.endpoints import connect_endpoints
from libra.rollout.generation import Generation, check_request, check_sampling_options
from libra.rollout.lending import LendingError
from libra.rollout.lifecycle import InstanceManager, stop_registered_servers
from libra.rollout.loop_thread import LoopThread
from libra.rollout.membership import Membership
from libra.rollout.publisher import CurrentWeights, WeightPublisher, publish_problems
from libra.rollout.reload import AckExpectation, ReloadReport, WeightSyncError
from libra.rollout.router import STOPPED, Router
from libra.rollout.spec import (
    Completion,
    GenerationAborted,
    InstanceIdError,
    InstanceInfo,
    InstanceSpec,
    InstanceStoppedError,
    LiveServer,
    PoolStats,
    RolloutError,
    RolloutPoolSpec,
    ServingSetError,
    is_requeueable,
)
from libra.rollout.tracing import InstanceTracers
from libra.rollout.weights_checksum import checksum_hf_weights

# The controller's edge imports the pool's types from here (its one allowed import of the rollout side).
__all__ = [
    "GenerationAborted", "InstanceIdError", "InstanceInfo", "InstanceSpec", "InstanceStoppedError", "LendingError",
    "LiveServer", "ReloadReport", "RolloutPool", "ServingSetError", "WeightSyncError", "is_requeueable",
    "stop_registered_servers",
]  # fmt: skip

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Parts:
    """What an open pool holds on its loop."""

    def __init__(
        self, session: aiohttp.ClientSession, router: Router, manager: InstanceManager | None,
        membership: Membership, generation: Generation, publisher: WeightPublisher,
    ) -> None:  # fmt: skip
        self.session = session
        self.router = router
        self.manager = manager
        self.membership = membership
        self.generation = generation
        self.publisher = publisher
        self.monitor: asyncio.Task[None] | None = None


class RolloutPool:
    """vLLM rollout instances behind one generate / publish_weights interface (see INTERFACES.md)."""

    def __init__(self, runtime: Any, spec: RolloutPoolSpec) -> None:
        spec.validate()
        self.spec = spec
        self.runtime = runtime
        self.run_dir = spec.run_dir or tempfile.mkdtemp(prefix="libra-rollout-")
        self._loop: LoopThread | None = None
        self._parts: _Parts | None = None
        self._publish_lock = threading.Lock()
        self._current = CurrentWeights(model_path=spec.model_path)
        self._instance_tracers = InstanceTracers(spec.trace)

    # ---- open / start / shutdown -----------------------------------------------------------------------

    def open(self) -> None:
        """Start the pool's loop and read the registry; starts, adopts and stops nothing (managed pools).
        Unmanaged pools connect to their endpoints, which all serve."""
        if self._loop is not None:
            return
        self._loop = LoopThread("libra-rollout")
        try:
            self._loop.run(self._open())
        except BaseException:
            self.shutdown(keep_servers=True)
            raise

    def start(self) -> None:
        """Open, then adopt every compatible live server, trim to spec.num_instances, start the missing ones
        and serve them all; returns when every one is ready (the pool-decides path). Does nothing on a pool
        that is already open."""
        if self._loop is not None:
            return
        self.open()
        try:
            if self.spec.manage_processes:
                count, spec = self.spec.num_instances, self.spec.instance_spec()
                self._run(self._call_async(lambda p: p.membership.populate(count, spec)))
        except BaseException:
            # Adopted servers stay up; servers started by this call were already stopped.
            self.shutdown(keep_servers=True)
            raise

    async def _open(self) -> None:
        session = client_session()
        router = Router(
            self.spec.max_concurrent_requests,
            self.spec.request_timeout_s,
            wait_for_instance_s=self.spec.reload_timeout_s,
        )
        manager = None
        if self.spec.manage_processes:
            manager = InstanceManager(self.spec, self.runtime, self.run_dir, session)
        publisher = WeightPublisher(self.spec, router, manager, self._instance_tracers, self._current)
        membership = Membership(self.spec, router, manager, self._current)
        parts = self._parts = _Parts(
            session, router, manager, membership, Generation(self.spec, router), publisher
        )
        if manager is not None:
            await manager.survey()
            record = manager.record
            if not record.model_path:
                record.model_path, record.weight_version = self.spec.model_path, 0
            if not record.checksum:
                record.checksum = await asyncio.to_thread(checksum_hf_weights, record.model_path)
            manager.save()
            self._current.version, self._current.model_path = record.weight_version, record.model_path
            self._current.checksum = record.checksum
        else:
            self._current.version = await connect_endpoints(self.spec, session, router)
        parts.monitor = asyncio.get_running_loop().create_task(health.monitor(router, self.spec.health))

    def shutdown(self, keep_servers: bool = False) -> None:
        """Abort in-flight requests and stop the pool. keep_servers=True leaves managed servers running (and
        registered) for a later pool on the same run_dir to adopt; otherwise they are stopped, including
        live servers of the registry nobody adopted."""
        if self._loop is None:
            return
        try:
            if self._parts is not None:
                self._loop.run(
                    self._shutdown(self._parts, keep_servers), timeout=self.spec.stop_timeout_s * 4 + 60
                )
        finally:
            self._loop.stop()
            self._loop = None
            self._parts = None
            self._instance_tracers.close()

    async def _shutdown(self, parts: _Parts, keep_servers: bool) -> None:
        if parts.monitor is not None:
            parts.monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await parts.monitor
        await parts.generation.abort_all(notify_servers=False)
        manager = parts.manager
        if manager is not None and not keep_servers:
            slots = list(manager.tracked.values())
            await asyncio.gather(*(manager.stop(s) for s in slots), return_exceptions=True)
            for slot in slots:
                slot.state = STOPPED
            for iid in list(manager.unclaimed):
                await manager.stop_unclaimed(iid)
        await parts.session.close()

    def __enter__(self) -> RolloutPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- membership (the actuator API) -----------------------------------------------------------------

    def instances(self) -> list[InstanceInfo]:
        """Every instance of the pool: id, state, health, TP, GPUs, fingerprint, weight version, serving,
        requests in flight."""
        return self._run(self._call(lambda p: p.membership.instances()))

    def live_servers(self) -> list[LiveServer]:
        """The live servers of the registry: the ones a previous controller left (in_pool=False, adopt them
        with start_instance or stop them with stop_instance) and this pool's own."""
        return self._run(self._call(lambda p: p.membership.live_servers()))

    def start_instance(self, instance_id: str, spec: InstanceSpec) -> InstanceInfo:
        """Start the instance `instance_id` with `spec` on the pool's current weights, or adopt the live
        server of that id if it was started with a spec of the same fingerprint; returns once it is READY.
        It does not serve until `set_serving` includes it. A duplicate id raises InstanceIdError."""
        return self._run(self._start_instance(instance_id, spec))

    async def _start_instance(self, instance_id: str, spec: InstanceSpec) -> InstanceInfo:
        membership = self._require_parts().membership
        await membership.start_instance(instance_id, spec)
        return next(i for i in membership.instances() if i.id == instance_id)

    def stop_instance(self, instance_id: str, drain: bool) -> None:
        """Stop routing to the instance, then drain=True: let its requests finish; drain=False: abort them
        (each raises InstanceStoppedError, a GenerationAborted: requeue the prompt); then stop its server.
        Also stops an unclaimed live server of the registry."""
        self._run(self._call_async(lambda p: p.membership.stop_instance(instance_id, drain)))

    def set_serving(self, instance_ids: Iterable[str]) -> None:
        """Replace the set of instances that receive new requests in one step. Refused (ServingSetError,
        nothing changed) for an instance that is not READY or does not hold the current weight version."""
        ids = list(instance_ids)
        self._run(self._call_async(lambda p: p.membership.set_serving(ids)))

    @property
    def weight_version(self) -> int:
        """The pool's current weight version: the last one a publish validated on every instance it targeted
        (what new instances load and what the serving set must hold)."""
        return self._current.version

    def add_instance(self) -> str:
        """Start one more instance on the current weights under the next free name and serve it."""
        if not self.spec.manage_processes:
            raise RolloutError(
                "add_instance needs manage_processes=True (unmanaged pools use the configured endpoints)"
            )
        spec = self.spec.instance_spec()
        return self._run(self._call_async(lambda p: p.membership.add_next(spec)))

    def remove_instance(self, instance_id: str, drain: bool = True) -> None:
        """Take an instance out of rotation, let its requests finish (drain) or abort them, and stop it."""
        self.stop_instance(instance_id, drain)

    # ---- lending GPUs to the training step (`lending.py`) ----------------------------------------------

    def lend_instances(self, instance_ids: Sequence[str], sleep: bool) -> list[lending.LendReport]:
        """Take READY serving instances out of serving, drain them and (`sleep`) put their servers to sleep, so
        their GPUs can hold borrowed training ranks; refused whole (LendingError) when one may not lend."""
        ids = list(instance_ids)
        return self._run(self._call_async(
            lambda p: lending.lend(p.router, ids, sleep, self.spec.request_timeout_s)))

    def return_instances(self, instance_ids: Sequence[str]) -> list[lending.ReturnReport]:
        """Wake the lent instances, reload the current weights where they hold older ones, and serve them."""
        ids = list(instance_ids)
        with self._publish_lock:
            return self._run(self._call_async(lambda p: lending.give_back(
                p.router, p.publisher, self._current, ids, self.spec.reload_method)))

    def lendable_gpus(self, instance_id: str) -> list[LentGpu]:
        """The GPUs of instance `instance_id` as borrowed training ranks join them: in the instance's placement
        group, beside its server (managed pools only)."""
        parts = self._require_parts()
        slot = parts.router.slots.get(instance_id)
        if parts.manager is None or slot is None:
            raise InstanceIdError(f"no managed rollout instance {instance_id!r}; instances: "
                                  f"{sorted(parts.router.slots)}")
        return lent_by_instance(parts.manager.actor_name(instance_id), slot.gpu_ids)

    # ---- generation ------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[Completion]:
        """n completions of one prompt (one group), from one instance. Raises InstanceStoppedError when its
        instance is stopped without draining (requeue the prompt: see `is_requeueable`)."""
        check_request(self.spec, prompt_ids, n, max_new_tokens, temperature, top_p)
        loop = self._require_loop()
        generation = self._require_parts().generation
        epoch = generation.abort_epoch
        future = loop.submit(
            generation.generate(list(prompt_ids), n, max_new_tokens, temperature, top_p, seed, epoch)
        )
        return await asyncio.wrap_future(future)

    def generate_batch(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, **sampling: Any
    ) -> list[list[Completion]]:
        """Generate every group concurrently (bounded by max_concurrent_requests); same order as `prompts`."""
        for prompt in prompts:
            check_request(
                self.spec,
                prompt,
                n,
                max_new_tokens,
                sampling.get("temperature", 1.0),
                sampling.get("top_p", 1.0),
            )
        check_sampling_options(sampling)
        generation = self._require_parts().generation
        with get_tracer().span("rollout.generate", groups=len(prompts), n=n):
            return self._run(
                generation.generate_batch(prompts, n, max_new_tokens, sampling, generation.abort_epoch)
            )

    def abort_all(self) -> None:
        """Abort every in-flight and queued request (at a step boundary); their callers get GenerationAborted."""
        self._run(self._call_async(lambda p: p.generation.abort_all(notify_servers=True)))

    def stats(self) -> PoolStats:
        return self._run(self._call(lambda p: p.generation.stats()))

    # ---- weight reload protocol ------------------------------------------------------------------------

    def publish_weights(
        self,
        version: int,
        hf_dir: str,
        expected_checksum: str,
        instance_ids: Sequence[str] | None = None,
        *,
        method: str | None = None,
        strategy: str | None = None,
        leave_out_failed: bool = False,
    ) -> ReloadReport:
        """Reload the instances `instance_ids` (default: every live one) with the HF weights in `hf_dir`, wait
        for one ACK per instance and validate the batch; raises WeightSyncError naming each instance whose
        ACK is missing or wrong. An instance's weight_version changes only from its validated ACK; a publish
        that validates makes `version` the pool's current one. Publishing the current version to a newly
        started instance brings it up to date. `method` / `strategy` override the spec's reload_method /
        reload_strategy for this publish. `leave_out_failed`: instances whose server failed (before or during
        the publish) stay FAILED on their old weights, named in the report's `left_out`, instead of failing
        the publish; when every server failed, all are left out and `version` still becomes the current one,
        which their replacements start on."""
        method = method or self.spec.reload_method
        strategy = strategy or self.spec.reload_strategy
        problems = publish_problems(
            self.spec, self._current.version, version, hf_dir, expected_checksum, method, strategy
        )
        if problems:
            raise ValueError("invalid weight publish: " + "; ".join(problems))
        targets = None if instance_ids is None else list(instance_ids)
        with (
            self._publish_lock,
            get_tracer().span(
                "weight_sync.publish", step=version, flow_id=version, method=method, strategy=strategy
            ),
        ):
            expect = AckExpectation(version, expected_checksum, method, strategy)
            hf_dir = os.path.abspath(hf_dir)
            return self._run(self._call_async(
                lambda p: p.publisher.publish(expect, hf_dir, targets, leave_out_failed)))

    # ---- helpers ---------------------------------------------------------------------------------------

    def _require_loop(self) -> LoopThread:
        if self._loop is None:
            raise RolloutError("the rollout pool is not started; call open() or start() first")
        return self._loop

    def _require_parts(self) -> _Parts:
        if self._parts is None:
            raise RolloutError("the rollout pool is not started; call open() or start() first")
        return self._parts

    async def _call(self, fn: Callable[[_Parts], T]) -> T:
        return fn(self._require_parts())

    async def _call_async(self, fn: Callable[[_Parts], Awaitable[T]]) -> T:
        return await fn(self._require_parts())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            loop = self._require_loop()
        except RolloutError:
            coro.close()
            raise
        return loop.run(coro)
