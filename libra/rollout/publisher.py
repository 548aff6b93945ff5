"""The weight-reload publisher: publish one weight version to a set of instances (in waves, in place or by
restarting the server), collect one ACK per instance, validate the batch, and keep the pool's current
weights (the version new instances load and the serving set must hold).

An instance's `weight_version` changes only from the report of its own reload. A reload first takes the
instance out of routing and waits for its requests in flight, which therefore finish on the old weights and
carry the old version; the server-side pause then only waits for other clients' requests.

With `leave_out_failed`, an instance whose server has failed (FAILED before the publish, or killed or hung
during its reload: the reload broke and /health no longer answers; an in-place reload is watched by the health
rule, so a server that hangs in it is failed within the rule's bound) does not fail the publish: it stays
FAILED on its old weights for the caller to replace, and the publish validates the other instances. When
every server failed (a job with one rollout instance losing it), the weights reached none and still become the
pool's current ones: the replacements start on them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from libra.observability.phase_trace import now_ns
from libra.rollout.client import InstanceFailure
from libra.rollout.health import EngineStalledError, answers_health, unless_hung
from libra.rollout.lifecycle import InstanceManager, worker_report
from libra.rollout.reload import (
    AckExpectation,
    ReloadAck,
    ReloadReport,
    WeightSyncError,
    ack_problem,
    build_report,
    leave_out_failed_servers,
    parallel_waves,
    serial_waves,
    validate_acks,
)
from libra.rollout.router import DRAINING, FAILED, READY, RELOADING, STOPPED, InstanceSlot, Router
from libra.rollout.spec import (
    RELOAD_METHODS,
    RELOAD_STRATEGIES,
    InstanceIdError,
    RolloutError,
    RolloutPoolSpec,
    ServerStalledError,
)
from libra.rollout.tracing import InstanceTracers
from libra.rollout.weights_checksum import CHECKSUM_PREFIX

log = logging.getLogger(__name__)

PAUSE_MODE = "wait"  # drain in-flight requests before a reload: no sequence mixes two weight versions


@dataclass
class CurrentWeights:
    """The last version a publish validated on every instance it targeted (before any: the launch weights)."""

    version: int = 0
    model_path: str = ""
    checksum: str = ""


def publish_problems(
    spec: RolloutPoolSpec,
    current: int,
    version: object,
    hf_dir: str,
    checksum: object,
    method: str,
    strategy: str,
) -> list[str]:
    """Every problem of a publish request, as 'field=value: rule'."""
    problems = []
    if method not in RELOAD_METHODS:
        problems.append(f"method={method!r}: choose one of {RELOAD_METHODS}")
    elif method == "restart" and not spec.manage_processes:
        problems.append("method='restart' needs manage_processes=True; use 'inplace'")
    if strategy not in RELOAD_STRATEGIES:
        problems.append(f"strategy={strategy!r}: choose one of {RELOAD_STRATEGIES}")
    if not isinstance(version, int) or version < current:
        problems.append(f"version={version!r}: must be an int >= the current version {current}")
    if not os.path.isdir(hf_dir):
        problems.append(f"hf_dir={hf_dir!r}: not a directory")
    if not isinstance(checksum, str) or not checksum.startswith(CHECKSUM_PREFIX):
        problems.append(f"expected_checksum={checksum!r}: must come from checksum_hf_weights(hf_dir)")
    return problems


def publish_targets(slots: dict[str, InstanceSlot], instance_ids: Sequence[str] | None) -> list[InstanceSlot]:
    """The instances a publish reloads: the named ones, or every live one (not draining or stopped)."""
    if instance_ids is None:
        return sorted((s for s in slots.values() if s.state not in (STOPPED, DRAINING)), key=lambda s: s.id)
    if not instance_ids:
        raise InstanceIdError(
            "publish to an empty list of instances; name at least one, or None for every live one"
        )
    unknown = sorted(set(instance_ids) - set(slots))
    if unknown:
        raise InstanceIdError(f"publish to unknown instance(s) {unknown}; instances: {sorted(slots)}")
    gone = sorted(i for i in set(instance_ids) if slots[i].state in (STOPPED, DRAINING))
    if gone:
        raise InstanceIdError(f"publish to instance(s) {gone} that are stopping; publish to live ones only")
    return [slots[i] for i in sorted(set(instance_ids))]


class WeightPublisher:
    """Publishes weight versions to the pool's instances; all coroutines run on the pool's loop."""

    def __init__(
        self, spec: RolloutPoolSpec, router: Router, manager: InstanceManager | None, tracers: InstanceTracers,
        current: CurrentWeights,
    ) -> None:  # fmt: skip
        self.spec = spec
        self.router = router
        self.manager = manager
        self.tracers = tracers
        self.current = current

    async def publish(
        self, expect: AckExpectation, hf_dir: str, instance_ids: Sequence[str] | None, leave_out_failed: bool = False
    ) -> ReloadReport:
        router = self.router
        members = publish_targets(router.slots, instance_ids)
        expect.instance_ids = [s.id for s in members]
        pairs = [(s.id, s.hostname or s.host) for s in members]
        waves = serial_waves(pairs) if expect.strategy == "serial" else parallel_waves(pairs)
        start, start_ns = time.monotonic(), now_ns()
        acks: list[ReloadAck] = []
        for wave in waves:
            wave_acks = await asyncio.gather(
                *(self._reload_one(router.slots[iid], expect, hf_dir, start) for iid in wave)
            )
            self.tracers.record_reloads(wave_acks, expect.version, start_ns)
            for ack in wave_acks:
                problem = ack_problem(expect, ack)
                slot = router.slots[ack.instance_id]
                if ack.server_failed:
                    await router.fail_instance(slot, problem)  # requests hanging on it run elsewhere
                else:
                    await router.set_state(slot, FAILED if problem else READY, failure=problem)
            acks.extend(wave_acks)
        total_s = time.monotonic() - start
        left_out: dict[str, str] = {}
        if leave_out_failed:
            expect, acks, left_out = leave_out_failed_servers(expect, acks)
            for iid, why in sorted(left_out.items()):
                log.warning("weights v%d: %s left out, its server failed (%s); it is replaced", expect.version,
                            iid, why)
        failures = validate_acks(expect, acks)
        if not failures:
            self.current.version, self.current.model_path = expect.version, hf_dir
            self.current.checksum = expect.checksum
        if self.manager is not None:
            record = self.manager.record
            record.weight_version, record.model_path = self.current.version, self.current.model_path
            record.checksum = self.current.checksum
            self.manager.save()
        if failures:
            raise WeightSyncError(expect.version, failures, acks)
        report = build_report(expect, acks, total_s, waves, left_out)
        log.info(
            "weights v%d on %d instance(s) by %s/%s in %.2fs; slowest %s (%.2fs)",
            expect.version, len(acks), expect.method, expect.strategy, total_s, report.slowest_instance,
            report.slowest_total_s,
        )  # fmt: skip
        return report

    async def _reload_one(
        self, slot: InstanceSlot, expect: AckExpectation, hf_dir: str, publish_start: float
    ) -> ReloadAck:
        ack = await self._reload_one_timed(slot, expect, hf_dir)
        end = time.monotonic()
        return replace(ack, started_s=end - ack.total_s - publish_start, finished_s=end - publish_start)

    async def _reload_one_timed(self, slot: InstanceSlot, expect: AckExpectation, hf_dir: str) -> ReloadAck:
        router = self.router
        start = time.monotonic()
        async with slot.lock:
            fields: dict[str, Any] = {
                "instance_id": slot.id,
                "host": slot.host,
                "method": expect.method,
                "strategy": expect.strategy,
                "lock_wait_s": time.monotonic() - start,
            }
            unchanged: dict[str, Any] = {
                "weight_version": slot.weight_version, "checksum": slot.checksum, "process_stop_s": 0.0,
                "model_load_s": 0.0, "pid": slot.pid,
            }  # fmt: skip
            if slot.state in (FAILED, STOPPED):
                error = f"instance is {slot.state}" + (f" ({slot.failure})" if slot.failure else "")
                return ReloadAck(**fields, **unchanged, total_s=time.monotonic() - start, error=error,
                                 server_failed=slot.state == FAILED)
            # A hung server would hold the drain below for reload_timeout_s: it has failed, per the health rule.
            rule = self.spec.health
            if not await answers_health(slot.client, rule):
                error = f"its server is hung or gone: {rule.failure_reason(rule.failures_to_fail)}"
                return ReloadAck(**fields, **unchanged, total_s=time.monotonic() - start, error=error,
                                 server_failed=True)
            await router.set_state(slot, RELOADING)
            try:
                # It may hang after that check, its requests still in flight: the drain is watched too.
                drain = router.wait_drained(slot, self.spec.reload_timeout_s)
                if not await unless_hung(drain, slot.client, rule, "the drain of its requests before the reload",
                                         in_flight=lambda: slot.outstanding):
                    raise RolloutError(f"requests still running after {self.spec.reload_timeout_s:.0f}s")
                if expect.method == "inplace":
                    reload = self._reload_inplace(slot, expect.version, hf_dir)
                    report = await unless_hung(reload, slot.client, rule, "its in-place reload")
                    process_stop_s = 0.0
                    model_load_s = report["load_s"]
                else:
                    process_stop_s, model_load_s, report = await self._reload_restart(
                        slot, expect.version, hf_dir
                    )
            except Exception as exc:
                # Killed or hung mid-reload, or a reload the server refused? The reload broke already, so one
                # check decides: a server that does not answer it has failed; one that answers and refused the
                # weights fails the publish. A restart whose new server hung while it started (it used no CPU)
                # has failed too, as has an engine that stalled under the requests of the drain (its front end
                # still answers); a server that crashed loading the weights fails the publish.
                server_failed = isinstance(exc, ServerStalledError | EngineStalledError) or (
                    isinstance(exc, InstanceFailure) and not await slot.client.health(rule.timeout_s))
                return ReloadAck(
                    **fields,
                    **unchanged,
                    total_s=time.monotonic() - start,
                    error=f"{type(exc).__name__}: {exc}",
                    server_failed=server_failed,
                )
            ack = ReloadAck(
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
            # Only a validated ACK moves the instance's version; a wrong one leaves it FAILED (see publish).
            if not ack_problem(expect, ack):
                slot.weight_version, slot.checksum, slot.model_path = ack.weight_version, ack.checksum, hf_dir
            return ack

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
        if slot.handle is None or self.manager is None:
            raise RolloutError(f"{slot.id} is not managed by this pool; it cannot be restarted")
        info = await slot.handle.acall(
            "restart", hf_dir, self.spec.startup_timeout_s, self.spec.stop_timeout_s
        )
        slot.pid, slot.start_ticks = int(info["pid"]), int(info["start_ticks"])
        self.manager.save()
        verify_start = time.monotonic()
        report = await self.manager.verify(slot, version)
        return (
            float(info["process_stop_s"]),
            float(info["startup_s"]) + time.monotonic() - verify_start,
            report,
        )
