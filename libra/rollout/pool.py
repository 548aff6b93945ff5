"""RolloutPool: the public face of the rollout side. Owns an event loop thread on which all HTTP traffic,
routing and the weight reload protocol run; its blocking methods hand work to that loop.

Managed pools (`manage_processes=True`) start, adopt and stop vLLM servers (see `lifecycle.py`); unmanaged
pools use the servers listed in `endpoints` as they are.

Phase traces: generation batches (`rollout.generate`) and publishes (`weight_sync.publish`, the flow source)
go to the calling process's tracer (`get_tracer()`, the controller's rank 0 in a job); each instance's
reloads go to the instance's own rank file (`tracing.py`, enabled by `spec.trace`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import aiohttp

from libra.observability.phase_trace import get_tracer, now_ns
from libra.rollout.client import ServerClient
from libra.rollout.lifecycle import InstanceManager, next_instance_id, worker_report
from libra.rollout.registry import InstanceRegistry
from libra.rollout.reload import (
    AckExpectation,
    ReloadAck,
    ReloadReport,
    WeightSyncError,
    ack_problem,
    build_report,
    parallel_waves,
    serial_waves,
    validate_acks,
)
from libra.rollout.router import DRAINING, FAILED, READY, RELOADING, STOPPED, InstanceSlot, Router
from libra.rollout.server import pid_alive
from libra.rollout.spec import (
    RELOAD_METHODS,
    RELOAD_STRATEGIES,
    Completion,
    GenerationAborted,
    InstanceInfo,
    PoolStats,
    RolloutError,
    RolloutPoolSpec,
    ServerStartError,
)
from libra.rollout.tracing import InstanceTracers
from libra.rollout.weights_checksum import CHECKSUM_PREFIX, checksum_hf_weights

log = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 10.0
HEALTH_FAILURES_TO_FAIL = 3  # ~30 s without /health before an idle-looking instance is declared failed
ABORT_WAIT_S = 30.0
PAUSE_MODE = "wait"  # drain in-flight requests before a reload: no sequence mixes two weight versions


class _LoopThread:
    """An asyncio loop running in a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("a blocking RolloutPool method was called from the pool's own event loop")
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        if not self.thread.is_alive():
            self.loop.close()


class RolloutPool:
    """vLLM rollout instances behind one generate / publish_weights interface (see INTERFACES.md)."""

    def __init__(self, runtime: Any, spec: RolloutPoolSpec) -> None:
        spec.validate()
        self.spec = spec
        self.runtime = runtime
        self.run_dir = spec.run_dir or tempfile.mkdtemp(prefix="libra-rollout-")
        self._loop: _LoopThread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._router: Router | None = None
        self._manager: InstanceManager | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._monitor: asyncio.Task[None] | None = None
        self._publish_lock = threading.Lock()
        self._weight_version = 0
        self._model_path = spec.model_path
        self._checksum = ""
        self._abort_epoch = 0
        self._reserved_ids: set[str] = set()
        self._instance_tracers = InstanceTracers(spec.trace)

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or adopt, through the registry in run_dir) all instances; returns when every one is ready."""
        if self._loop is not None:
            return
        self._loop = _LoopThread("libra-rollout")
        try:
            self._loop.run(self._start())
        except BaseException:
            # Adopted servers stay up; servers started by this call were already stopped.
            self.shutdown(keep_servers=True)
            raise

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._router = Router(
            self.spec.max_concurrent_requests,
            self.spec.request_timeout_s,
            wait_for_instance_s=self.spec.reload_timeout_s,
        )
        if self.spec.manage_processes:
            await self._start_managed()
        else:
            await self._start_external()
        self._monitor = asyncio.get_running_loop().create_task(self._health_monitor())

    async def _start_managed(self) -> None:
        assert self._session is not None and self._router is not None
        manager = self._manager = InstanceManager(self.spec, self.runtime, self.run_dir, self._session)
        adopted = await manager.adopt_all()
        record = manager.record
        if not record.model_path:
            record.model_path = self.spec.model_path
            record.weight_version = 0
        if not record.checksum:
            record.checksum = await asyncio.to_thread(checksum_hf_weights, record.model_path)
        self._model_path, self._weight_version, self._checksum = (
            record.model_path,
            record.weight_version,
            record.checksum,
        )
        adopted.sort(key=lambda s: s.id)
        for extra in adopted[self.spec.num_instances :]:
            await manager.stop(extra)
        keep = adopted[: self.spec.num_instances]
        for slot in keep:
            self._router.slots[slot.id] = slot
        ids: list[str] = [s.id for s in keep]
        new_ids = []
        for _ in range(self.spec.num_instances - len(keep)):
            ids.append(next_instance_id(ids))
            new_ids.append(ids[-1])
        results = await asyncio.gather(*(manager.launch(i) for i in new_ids), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        started = [r for r in results if isinstance(r, InstanceSlot)]
        if errors:
            for slot in started:
                await manager.stop(slot)
            raise errors[0]
        for slot in started:
            self._router.slots[slot.id] = slot

    async def _start_external(self) -> None:
        assert self._session is not None and self._router is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for index, url in enumerate(self.spec.endpoints):
            parsed = urllib.parse.urlparse(url)
            iid = f"endpoint-{index}"
            slot = InstanceSlot(
                id=iid,
                client=ServerClient(self._session, url, iid),
                host=parsed.hostname or "",
                port=parsed.port or 80,
                weight_version=0,
                managed=False,
                model_path=self.spec.model_path,
            )
            while not await slot.client.health():
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"endpoint {url} did not answer /health within {self.spec.startup_timeout_s:.0f}s"
                    )
                await asyncio.sleep(1.0)
            try:
                results = await slot.client.rpc("libra_state", {}, 30.0)
                if not all(r.get("checksum") for r in results):
                    results = await slot.client.rpc(
                        "libra_verify", {"weight_version": "0"}, self.spec.startup_timeout_s
                    )
            except RolloutError as exc:
                raise RolloutError(
                    f"endpoint {url} does not serve the Libra weight extension ({exc}); start it with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls libra.rollout.worker_extension.LibraWorkerExtension"
                ) from exc
            report = worker_report(results, iid)
            slot.weight_version, slot.checksum = report["weight_version"], report["checksum"]
            slot.model_path = report["model_path"]
            slot.state = READY
            self._router.slots[iid] = slot
        versions = {s.weight_version for s in self._slots()}
        self._weight_version = max(versions) if versions else 0

    def shutdown(self, keep_servers: bool = False) -> None:
        """Abort in-flight requests and stop the pool. keep_servers=True leaves managed servers running (and
        registered) for a later pool on the same run_dir to adopt; otherwise they are stopped."""
        if self._loop is None:
            return
        try:
            self._loop.run(self._shutdown(keep_servers), timeout=self.spec.stop_timeout_s * 4 + 60)
        finally:
            self._loop.stop()
            self._loop = None
            self._instance_tracers.close()

    async def _shutdown(self, keep_servers: bool) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self._abort_all(notify_servers=False)
        if self._manager is not None and not keep_servers:
            slots = list(self._manager.tracked.values())
            await asyncio.gather(*(self._manager.stop(s) for s in slots), return_exceptions=True)
            for slot in slots:
                slot.state = STOPPED
        if self._session is not None:
            await self._session.close()

    def __enter__(self) -> RolloutPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- membership ------------------------------------------------------------------------------------

    def instances(self) -> list[InstanceInfo]:
        return self._run(self._instances())

    async def _instances(self) -> list[InstanceInfo]:
        return [
            InstanceInfo(
                id=s.id,
                host=s.host,
                port=s.port,
                pid=s.pid,
                gpu_ids=s.gpu_ids,
                weight_version=s.weight_version,
                state=s.state,
                healthy=s.healthy,
                model_path=s.model_path,
                outstanding=s.outstanding,
                managed=s.managed,
                adopted=s.adopted,
            )
            for s in self._slots()
        ]

    def add_instance(self) -> str:
        """Start one more instance on the current weights; returns its id once it is ready."""
        if not self.spec.manage_processes:
            raise RolloutError(
                "add_instance needs manage_processes=True (unmanaged pools use the configured endpoints)"
            )
        return self._run(self._add_instance())

    async def _add_instance(self) -> str:
        assert self._manager is not None and self._router is not None
        manager = self._manager
        # Reserved before the first await, so concurrent adds never pick the same id.
        iid = next_instance_id(
            [*self._router.slots, *manager.tracked, *manager.record.entries, *self._reserved_ids]
        )
        self._reserved_ids.add(iid)
        try:
            slot = await manager.launch(iid)
        finally:
            self._reserved_ids.discard(iid)
        self._router.slots[iid] = slot
        await self._router.notify()
        return iid

    def remove_instance(self, instance_id: str, drain: bool = True) -> None:
        """Take an instance out of rotation, let its requests finish (drain) and stop it."""
        self._run(self._remove_instance(instance_id, drain))

    async def _remove_instance(self, instance_id: str, drain: bool) -> None:
        router = self._require_router()
        slot = router.slots.get(instance_id)
        if slot is None:
            raise KeyError(f"unknown rollout instance '{instance_id}'; instances: {sorted(router.slots)}")
        async with slot.lock:
            await router.set_state(slot, DRAINING)
            if drain and not await router.wait_drained(slot, self.spec.request_timeout_s):
                log.warning(
                    "%s still had %d requests after draining; they retry elsewhere", slot.id, slot.outstanding
                )
            if self._manager is not None:
                await self._manager.stop(slot)
            await router.set_state(slot, STOPPED)
            router.slots.pop(instance_id, None)

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
        """n completions of one prompt (one group), from one instance."""
        self._check_request(prompt_ids, n, max_new_tokens, temperature, top_p)
        loop = self._require_loop()
        epoch = self._abort_epoch
        future = loop.submit(
            self._generate(list(prompt_ids), n, max_new_tokens, temperature, top_p, seed, epoch)
        )
        return await asyncio.wrap_future(future)

    def generate_batch(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, **sampling: Any
    ) -> list[list[Completion]]:
        """Generate every group concurrently (bounded by max_concurrent_requests); same order as `prompts`."""
        for prompt in prompts:
            self._check_request(
                prompt, n, max_new_tokens, sampling.get("temperature", 1.0), sampling.get("top_p", 1.0)
            )
        unknown = set(sampling) - {"temperature", "top_p", "seed"}
        if unknown:
            raise TypeError(
                f"generate_batch got unknown sampling options {sorted(unknown)}; use temperature, top_p, seed"
            )
        with get_tracer().span("rollout.generate", groups=len(prompts), n=n):
            return self._run(self._generate_batch(prompts, n, max_new_tokens, sampling, self._abort_epoch))

    async def _generate_batch(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, sampling: dict[str, Any], epoch: int
    ) -> list[list[Completion]]:
        results = await asyncio.gather(
            *(
                self._generate(
                    list(p), n, max_new_tokens, sampling.get("temperature", 1.0), sampling.get("top_p", 1.0),
                    sampling.get("seed"),
                    epoch,
                )
                for p in prompts
            ),
            return_exceptions=True,
        )  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]

    async def _generate(
        self,
        prompt: list[int],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        epoch: int,
    ) -> list[Completion]:
        router = self._require_router()
        if epoch != self._abort_epoch:  # submitted before an abort_all that ran before this task did
            raise GenerationAborted("generation aborted at a step boundary (abort_all) or by shutdown")
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        # vLLM refuses n > 1 for greedy sampling; greedy samples are identical, so one is sampled and copied.
        greedy = temperature == 0.0
        payload: dict[str, Any] = {
            "model": self.spec.served_model_name,
            "prompt": prompt,
            "n": 1 if greedy else n,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if seed is not None:
            payload["seed"] = seed
        try:
            response, slot, version = await router.send(payload)
        except asyncio.CancelledError:
            raise GenerationAborted(
                "generation aborted at a step boundary (abort_all) or by shutdown"
            ) from None
        finally:
            self._tasks.discard(task)
        completions = [
            self._completion(prompt, choice, slot.id, version) for choice in _sorted_choices(response)
        ]
        if greedy and completions:
            first = completions[0]
            completions = [
                replace(
                    first,
                    prompt_ids=list(prompt),
                    token_ids=list(first.token_ids),
                    logprobs=list(first.logprobs),
                )
                for _ in range(n)
            ]
        if len(completions) != n:
            raise RolloutError(f"{slot.id} returned {len(completions)} completions, {n} were asked for")
        router.tokens += sum(len(c.token_ids) for c in completions)
        return completions

    @staticmethod
    def _completion(prompt: list[int], choice: dict[str, Any], instance_id: str, version: int) -> Completion:
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs_block = choice.get("logprobs") or {}
        logprobs = [
            float(x) if x is not None else float("nan") for x in logprobs_block.get("token_logprobs") or []
        ]
        if len(logprobs) != len(token_ids):
            raise RolloutError(
                f"{instance_id} returned {len(token_ids)} token ids but {len(logprobs)} log-probs; "
                "the server must support return_token_ids with logprobs"
            )
        return Completion(
            prompt, token_ids, logprobs, str(choice.get("finish_reason") or ""), instance_id, version
        )

    def _check_request(
        self, prompt: Sequence[int], n: int, max_new_tokens: int, temperature: float, top_p: float
    ) -> None:
        problems = []
        if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            problems.append("prompt_ids must be a non-empty list of token ids >= 0")
        if n < 1:
            problems.append(f"n={n}: must be >= 1")
        if max_new_tokens < 1:
            problems.append(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if len(prompt) + max_new_tokens > self.spec.max_model_len:
            problems.append(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
                f"max_model_len={self.spec.max_model_len}; shorten the prompt or raise max_model_len"
            )
        if temperature < 0:
            problems.append(f"temperature={temperature}: must be >= 0")
        if not 0 < top_p <= 1:
            problems.append(f"top_p={top_p}: must be in (0, 1]")
        if problems:
            raise ValueError("invalid generation request: " + "; ".join(problems))

    def abort_all(self) -> None:
        """Abort every in-flight and queued request (at a step boundary); their callers get GenerationAborted."""
        self._run(self._abort_all(notify_servers=True))

    async def _abort_all(self, notify_servers: bool) -> None:
        self._abort_epoch += 1
        for task in list(self._tasks):
            task.cancel()
        if notify_servers:
            await asyncio.gather(
                *(s.client.abort_requests() for s in self._slots() if s.state in (READY, DRAINING)),
                return_exceptions=True,
            )
        deadline = time.monotonic() + ABORT_WAIT_S
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def stats(self) -> PoolStats:
        return self._run(self._stats())

    async def _stats(self) -> PoolStats:
        router = self._require_router()
        busy = router.busy_seconds()
        return PoolStats(
            tokens_generated=router.tokens,
            tokens_per_s=router.tokens / busy if busy > 0 else 0.0,
            busy_s=busy,
            requests_completed=router.completed,
            requests_failed=router.failed,
            retries=router.retries,
            in_flight=router.in_flight,
            queue_depth=router.waiting,
            outstanding_by_instance={s.id: s.outstanding for s in self._slots()},
        )

    # ---- weight reload protocol ------------------------------------------------------------------------

    def publish_weights(
        self,
        version: int,
        hf_dir: str,
        expected_checksum: str,
        *,
        method: str | None = None,
        strategy: str | None = None,
    ) -> ReloadReport:
        """Reload every instance with the HF weights in `hf_dir` (one request for the whole set), wait for the
        ACK batch and validate it; raises WeightSyncError naming each instance whose ACK is missing or wrong.
        `method` / `strategy` override the spec's reload_method / reload_strategy for this publish."""
        method = method or self.spec.reload_method
        strategy = strategy or self.spec.reload_strategy
        problems = []
        if method not in RELOAD_METHODS:
            problems.append(f"method={method!r}: choose one of {RELOAD_METHODS}")
        elif method == "restart" and not self.spec.manage_processes:
            problems.append("method='restart' needs manage_processes=True; use 'inplace'")
        if strategy not in RELOAD_STRATEGIES:
            problems.append(f"strategy={strategy!r}: choose one of {RELOAD_STRATEGIES}")
        if not isinstance(version, int) or version < self._weight_version:
            problems.append(
                f"version={version!r}: must be an int >= the current version {self._weight_version}"
            )
        if not os.path.isdir(hf_dir):
            problems.append(f"hf_dir={hf_dir!r}: not a directory")
        if not isinstance(expected_checksum, str) or not expected_checksum.startswith(CHECKSUM_PREFIX):
            problems.append(
                f"expected_checksum={expected_checksum!r}: must come from checksum_hf_weights(hf_dir)"
            )
        if problems:
            raise ValueError("invalid weight publish: " + "; ".join(problems))
        with (
            self._publish_lock,
            get_tracer().span(
                "weight_sync.publish", step=version, flow_id=version, method=method, strategy=strategy
            ),
        ):
            expect = AckExpectation(version, expected_checksum, method, strategy)
            return self._run(self._publish(expect, os.path.abspath(hf_dir)))

    async def _publish(self, expect: AckExpectation, hf_dir: str) -> ReloadReport:
        router = self._require_router()
        version, checksum = expect.version, expect.checksum
        members = [s for s in self._slots() if s.state not in (STOPPED, DRAINING)]
        expect.instance_ids = [s.id for s in members]
        pairs = [(s.id, s.hostname or s.host) for s in members]
        waves = serial_waves(pairs) if expect.strategy == "serial" else parallel_waves(pairs)
        start, start_ns = time.monotonic(), now_ns()
        acks: list[ReloadAck] = []
        for wave in waves:
            wave_acks = await asyncio.gather(
                *(self._reload_one(router.slots[iid], expect, hf_dir, start) for iid in wave)
            )
            self._instance_tracers.record_reloads(wave_acks, version, start_ns)
            for ack in wave_acks:
                problem = ack_problem(expect, ack)
                await router.set_state(
                    router.slots[ack.instance_id], FAILED if problem else READY, failure=problem
                )
            acks.extend(wave_acks)
        total_s = time.monotonic() - start
        failures = validate_acks(expect, acks)
        if self._manager is not None:
            if not failures:
                self._manager.record.weight_version = version
                self._manager.record.model_path = hf_dir
                self._manager.record.checksum = checksum
            self._manager.save()
        if failures:
            raise WeightSyncError(version, failures, acks)
        self._weight_version, self._model_path, self._checksum = version, hf_dir, checksum
        report = build_report(expect, acks, total_s, waves)
        log.info(
            "weights v%d on %d instance(s) by %s/%s in %.2fs; slowest %s (%.2fs)",
            version, len(acks), expect.method, expect.strategy, total_s, report.slowest_instance, report.slowest_total_s,
        )  # fmt: skip
        return report

    async def _reload_one(
        self, slot: InstanceSlot, expect: AckExpectation, hf_dir: str, publish_start: float
    ) -> ReloadAck:
        ack = await self._reload_one_timed(slot, expect, hf_dir)
        end = time.monotonic()
        return replace(ack, started_s=end - ack.total_s - publish_start, finished_s=end - publish_start)

    async def _reload_one_timed(self, slot: InstanceSlot, expect: AckExpectation, hf_dir: str) -> ReloadAck:
        router = self._require_router()
        start = time.monotonic()
        async with slot.lock:
            lock_wait_s = time.monotonic() - start
            fields: dict[str, Any] = {
                "instance_id": slot.id,
                "host": slot.host,
                "method": expect.method,
                "strategy": expect.strategy,
                "lock_wait_s": lock_wait_s,
            }
            if slot.state in (FAILED, STOPPED):
                return ReloadAck(
                    **fields, weight_version=slot.weight_version, checksum=slot.checksum, process_stop_s=0.0,
                    model_load_s=0.0, total_s=time.monotonic() - start, pid=slot.pid,
                    error=f"instance is {slot.state}" + (f" ({slot.failure})" if slot.failure else ""),
                )  # fmt: skip
            await router.set_state(slot, RELOADING)
            try:
                # Requests this pool already sent finish on the old weights (and carry the old version);
                # the server-side pause below then only waits for other clients' requests.
                if not await router.wait_drained(slot, self.spec.reload_timeout_s):
                    raise RolloutError(f"requests still running after {self.spec.reload_timeout_s:.0f}s")
                if expect.method == "inplace":
                    process_stop_s, report = 0.0, await self._reload_inplace(slot, expect.version, hf_dir)
                    model_load_s = report["load_s"]
                else:
                    process_stop_s, model_load_s, report = await self._reload_restart(
                        slot, expect.version, hf_dir
                    )
            except Exception as exc:
                return ReloadAck(
                    **fields, weight_version=slot.weight_version, checksum=slot.checksum, process_stop_s=0.0,
                    model_load_s=0.0, total_s=time.monotonic() - start, pid=slot.pid,
                    error=f"{type(exc).__name__}: {exc}",
                )  # fmt: skip
            slot.weight_version, slot.checksum, slot.model_path = (
                report["weight_version"],
                report["checksum"],
                hf_dir,
            )
            return ReloadAck(
                **fields,
                weight_version=report["weight_version"],
                checksum=report["checksum"],
                process_stop_s=process_stop_s,
                model_load_s=model_load_s,
                total_s=time.monotonic() - start,
                workers=report["workers"],
                worker_checksums=report["worker_checksums"],
                params_not_loaded=report["params_not_loaded"],
                param_value_mismatches=report["param_value_mismatches"],
                params_value_checked=report["params_value_checked"],
                pid=slot.pid,
            )

    async def _reload_inplace(self, slot: InstanceSlot, version: int, hf_dir: str) -> dict[str, Any]:
        timeout = self.spec.reload_timeout_s
        await slot.client.pause(PAUSE_MODE, timeout)
        results = await slot.client.rpc(
            "libra_reload", {"weights_path": hf_dir, "weight_version": str(version)}, timeout
        )
        # The reset is refused while cache blocks are held; the drain above releases them within moments.
        for _ in range(20):
            if await slot.client.reset_prefix_cache(timeout):
                break
            await asyncio.sleep(0.05)
        else:
            raise RolloutError(f"{slot.id}: the prefix cache could not be reset after the reload")
        await slot.client.resume(timeout)
        return worker_report(results, slot.id)

    async def _reload_restart(
        self, slot: InstanceSlot, version: int, hf_dir: str
    ) -> tuple[float, float, dict[str, Any]]:
        if slot.handle is None or self._manager is None:
            raise RolloutError(f"{slot.id} is not managed by this pool; it cannot be restarted")
        info = await slot.handle.acall(
            "restart", hf_dir, self.spec.startup_timeout_s, self.spec.stop_timeout_s
        )
        slot.pid, slot.start_ticks = int(info["pid"]), int(info["start_ticks"])
        self._manager.save()
        verify_start = time.monotonic()
        report = await self._manager.verify(slot, version)
        return (
            float(info["process_stop_s"]),
            float(info["startup_s"]) + time.monotonic() - verify_start,
            report,
        )

    # ---- health ----------------------------------------------------------------------------------------

    async def _health_monitor(self) -> None:
        router = self._require_router()
        misses: dict[str, int] = {}
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            for slot in self._slots():
                if slot.state != READY:
                    continue
                if await slot.client.health(HEALTH_TIMEOUT_S):
                    misses[slot.id] = 0
                    continue
                misses[slot.id] = misses.get(slot.id, 0) + 1
                if misses[slot.id] >= HEALTH_FAILURES_TO_FAIL and slot.state == READY:
                    await router.set_state(slot, FAILED, failure="/health stopped answering")

    # ---- helpers ---------------------------------------------------------------------------------------

    def _slots(self) -> list[InstanceSlot]:
        return sorted(self._router.slots.values(), key=lambda s: s.id) if self._router else []

    def _require_loop(self) -> _LoopThread:
        if self._loop is None:
            raise RolloutError("the rollout pool is not started; call start() first")
        return self._loop

    def _require_router(self) -> Router:
        if self._router is None:
            raise RolloutError("the rollout pool is not started; call start() first")
        return self._router

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            loop = self._require_loop()
        except RolloutError:
            coro.close()
            raise
        return loop.run(coro)


def _sorted_choices(response: dict[str, Any]) -> list[dict[str, Any]]:
    choices = response.get("choices")
    if not isinstance(choices, list):
        raise RolloutError(f"completion response without choices: {str(response)[:300]}")
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def stop_registered_servers(run_dir: str, timeout_s: float = 10.0) -> list[int]:
    """Last-resort cleanup: kill the process group of every server in run_dir's registry that still runs on
    this host (verified by pid start time). Returns the pids signalled."""
    try:
        record = InstanceRegistry(run_dir).load()
    except Exception:
        return []
    killed = []
    for entry in record.entries.values():
        if entry.hostname == socket.gethostname() and pid_alive(entry.pid, entry.start_ticks):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(entry.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                deadline = time.monotonic() + timeout_s
                while pid_alive(entry.pid, entry.start_ticks) and time.monotonic() < deadline:
                    time.sleep(0.1)
            killed.append(entry.pid)
    return killed
