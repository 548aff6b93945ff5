"""Managed instance lifecycle: launch (placement group + host actor + server + weight check) under the id
and spec the caller chose, the survey of live servers listed in the registry and their adoption, stop, and
the registry bookkeeping that goes with each. Which instances to adopt, start or stop is the caller's
decision; the registry keeps every live server until the caller adopts or stops it. Also the last-resort
cleanup that kills every registered server of a run directory (`stop_registered_servers`).

All coroutines run on the pool's event loop; blocking Ray calls go through threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from libra.proc_stat import pid_alive
from libra.rollout.client import ServerClient
from libra.rollout.host import LocalHostHandle, ServerHost
from libra.rollout.registry import InstanceRegistry, PoolRecord, RegistryEntry
from libra.rollout.router import READY, STARTING, InstanceSlot
from libra.rollout.server import ServerLaunch
from libra.rollout.spec import (
    HostGoneError,
    HostUnreachableError,
    InstanceIdError,
    InstanceSpec,
    RolloutPoolSpec,
    ServerStartError,
)

log = logging.getLogger(__name__)

INSTANCE_PREFIX = "rollout-"
PIN_ATTEMPTS = 5  # tries to copy the current weights for a start while newer publishes prune them
LEFTOVER_ABANDON_S = 15.0  # the leftover host's own kill of its server (an actor call answered mid-start)
UNREACHABLE_HOST_RETRY_S = 1.0  # a stop asks a host that does not answer again after this long
LEFTOVER_RELEASE_S = 30.0  # a killed host actor and its placement group are gone from Ray within seconds


@dataclass(frozen=True)
class PinnedWeights:
    """The weights a starting instance loads: `model_path` (a private copy when `pinned`) of `source`."""

    model_path: str
    source: str
    version: int
    checksum: str
    pinned: bool


def _link_tree(source: str, target: str) -> None:
    """`target` := a hard-linked copy of the folder `source` (a plain copy across file systems)."""

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            if not os.path.exists(src):
                raise
            shutil.copy2(src, dst)

    shutil.rmtree(target, ignore_errors=True)
    try:
        shutil.copytree(source, target, copy_function=link_or_copy)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


def instance_index(instance_id: str) -> int:
    try:
        return int(instance_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def next_instance_id(existing: list[str]) -> str:
    return f"{INSTANCE_PREFIX}{max([instance_index(i) for i in existing] + [-1]) + 1}"


def worker_report(results: list[dict[str, Any]], instance_id: str) -> dict[str, Any]:
    """Merge the per-worker results of a libra_* RPC into one report (checksums of every worker kept)."""
    if not results:
        raise ServerStartError(f"{instance_id}: the server returned no worker results")
    first = results[0]
    return {
        "weight_version": int(first.get("weight_version", -1)),
        "checksum": str(first.get("checksum", "")),
        "worker_checksums": tuple(str(r.get("checksum", "")) for r in results),
        "load_s": max(float(r.get("load_s", 0.0)) for r in results),
        "params_not_loaded": tuple(sorted({p for r in results for p in r.get("params_not_loaded", [])})),
        "param_value_mismatches": tuple(
            sorted({p for r in results for p in r.get("param_value_mismatches", [])})
        ),
        "params_value_checked": min(int(r.get("params_value_checked", 0)) for r in results),
        "model_path": str(first.get("model_path", "")),
        "workers": len(results),
    }


class InstanceManager:
    """Starts, adopts and stops the managed instances of one pool."""

    def __init__(
        self, spec: RolloutPoolSpec, runtime: Any, run_dir: str, session: aiohttp.ClientSession
    ) -> None:
        self.spec = spec
        self.runtime = runtime
        self.run_dir = run_dir
        self.session = session
        self.registry = InstanceRegistry(run_dir)
        self.record = PoolRecord()
        self.tracked: dict[str, InstanceSlot] = {}  # every server this pool runs, routable or not
        # live servers of the registry that nobody has adopted or stopped yet: (entry, host handle)
        self.unclaimed: dict[str, tuple[RegistryEntry, Any]] = {}
        self.log_dir = os.path.join(run_dir, "rollout", "logs")
        # Actor names are cluster-wide: tie them to the run directory so two runs never collide.
        self.run_tag = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:8]

    # ---- naming and launch settings ------------------------------------------------------------------

    def actor_name(self, instance_id: str) -> str:
        return f"libra-{self.run_tag}-{instance_id}"

    def launch_for(self, instance_id: str, model_path: str, spec: InstanceSpec) -> ServerLaunch:
        port_base = self.spec.port_base
        if port_base and instance_index(instance_id) < 0:
            raise InstanceIdError(
                f"instance id {instance_id!r}: with port_base={port_base} the id must end in '-<number>' "
                "(the port is port_base + number), e.g. 'rollout-3'"
            )
        return ServerLaunch(
            model_path=model_path,
            port=port_base + instance_index(instance_id) if port_base else 0,
            host=self.spec.bind_host,
            max_model_len=spec.max_model_len,
            kv_cache_bytes=spec.kv_cache_bytes,
            tp_size=spec.tp_size,
            enforce_eager=spec.enforce_eager,
            seed=spec.seed,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            dtype=spec.dtype,
            served_model_name=spec.served_model_name,
            log_path=os.path.join(self.log_dir, f"{instance_id}.log"),
        )

    def entry_spec(self, entry: RegistryEntry) -> InstanceSpec:
        """The spec a registered server was started with (entries of older registries: the pool's)."""
        return InstanceSpec.from_dict(entry.spec) if entry.spec else self.spec.instance_spec()

    def save(self) -> None:
        """Write the registry: the pool's current weights and every tracked server."""
        entries = {iid: entry for iid, (entry, _) in self.unclaimed.items()}
        entries.update({s.id: self._entry(s) for s in self.tracked.values() if s.managed and s.pid})
        self.record.entries = entries
        self.registry.save(self.record)

    def _entry(self, slot: InstanceSlot) -> RegistryEntry:
        spec = slot.spec or self.spec.instance_spec()
        return RegistryEntry(
            instance_id=slot.id,
            host=slot.host,
            hostname=slot.hostname,
            port=slot.port,
            pid=slot.pid,
            start_ticks=slot.start_ticks,
            gpu_ids=list(slot.gpu_ids),
            weight_version=slot.weight_version,
            checksum=slot.checksum,
            model_path=slot.model_path,
            actor_name=self.actor_name(slot.id),
            fingerprint=self.launch_for(slot.id, slot.model_path, spec).fingerprint(),
            log_path=os.path.join(self.log_dir, f"{slot.id}.log"),
            started_at=time.time(),
            spec=spec.to_dict(),
            spec_fingerprint=spec.fingerprint(),
        )

    # ---- hosts ----------------------------------------------------------------------------------------

    async def _new_host(self, instance_id: str, tp_size: int) -> Any:
        name = self.actor_name(instance_id)
        if self.runtime is None:
            return LocalHostHandle(ServerHost(instance_id, self.spec.bind_host), name)
        from libra.cluster import rollout_hosts

        await self._release_leftover_host(name)
        return await asyncio.to_thread(
            rollout_hosts.spawn_host,
            ServerHost,
            instance_id,
            self.spec.bind_host,
            True,  # tie the server to the actor that holds its GPUs
            self.spec.metering,  # the server runs in a CPU slice of those GPUs (metered logical GPUs)
            name=name,
            namespace=self.runtime.namespace,
            tp_size=tp_size,
            detached=True,  # the server must outlive a controller crash; shutdown() removes it
            runtime=self.runtime,
        )

    async def _release_leftover_host(self, name: str) -> None:
        """Free the name and GPUs of a host actor that outlived a controller killed while its server was
        starting: the start never reached the registry, so nobody adopts it, and a new host of the same name
        cannot be created while it holds the name. The host kills its server first (`abandon`): the server's
        guard would also stop it once the actor is gone, but only after a SIGTERM grace, and a job that ends
        soon after would leave it running past its end."""
        from libra.cluster import rollout_hosts

        namespace = self.runtime.namespace
        leftover = await asyncio.to_thread(rollout_hosts.find_host, name, namespace)
        if leftover is None and await asyncio.to_thread(rollout_hosts.find_group, name) is None:
            return
        log.warning("%s: a host of an unfinished start by an earlier controller is still there; stopping it", name)
        if leftover is not None:
            try:
                await asyncio.wait_for(leftover.acall("abandon"), LEFTOVER_ABANDON_S)
            except Exception as exc:  # a host that cannot answer is killed all the same; its guard stops the server
                log.info("%s: the leftover host did not kill its server (%s); killing the host", name, exc)
            await asyncio.to_thread(leftover.kill)
        else:
            await asyncio.to_thread(rollout_hosts.remove_group, name)
        deadline = time.monotonic() + LEFTOVER_RELEASE_S
        while time.monotonic() < deadline:
            if (await asyncio.to_thread(rollout_hosts.find_host, name, namespace) is None
                    and await asyncio.to_thread(rollout_hosts.find_group, name) is None):
                return
            await asyncio.sleep(0.5)
        raise ServerStartError(f"{name}: the host left by an earlier controller did not go away within "
                               f"{LEFTOVER_RELEASE_S:.0f}s; stop it with `ray kill` and retry")

    async def _find_host(self, entry: RegistryEntry) -> Any:
        if self.runtime is None:
            host = ServerHost(entry.instance_id, self.spec.bind_host)
            launch = self.launch_for(entry.instance_id, entry.model_path, self.entry_spec(entry))
            launch = replace(launch, port=entry.port)
            if entry.hostname == socket.gethostname() and host.adopt(launch, entry.pid, entry.start_ticks):
                return LocalHostHandle(host, entry.actor_name)
            return None
        from libra.cluster import rollout_hosts

        return await asyncio.to_thread(rollout_hosts.find_host, entry.actor_name, self.runtime.namespace)

    # ---- launch ---------------------------------------------------------------------------------------

    async def launch(self, instance_id: str, spec: InstanceSpec) -> InstanceSlot:
        """Start one instance on the pool's current weights and check, inside the server, what it loaded.
        Publishes go on while it starts (each prunes the folders of older versions), so the server loads a
        private hard-linked copy of the weights current at the start, removed once it has loaded them."""
        weights = await self._pin_current_weights(instance_id)
        try:
            return await self._launch(instance_id, spec, weights)
        finally:
            if weights.pinned:
                await asyncio.to_thread(shutil.rmtree, weights.model_path, True)

    async def _pin_current_weights(self, instance_id: str) -> PinnedWeights:
        for _ in range(PIN_ATTEMPTS):
            record = self.record  # read on the loop, where the publisher updates it
            source, version, checksum = record.model_path, record.weight_version, record.checksum
            if os.path.abspath(source) == os.path.abspath(self.spec.model_path):
                return PinnedWeights(source, source, version, checksum, pinned=False)  # the base never changes
            target = os.path.join(self.run_dir, "rollout", "starting", instance_id)
            try:
                await asyncio.to_thread(_link_tree, source, target)
            except (OSError, shutil.Error) as exc:  # pruned by a newer publish while linking: take that one
                log.info("%s: weights %s went away while being pinned (%s); retrying", instance_id, source, exc)
                continue
            return PinnedWeights(target, source, version, checksum, pinned=True)
        raise ServerStartError(f"{instance_id}: the current weights changed {PIN_ATTEMPTS} times while being "
                               "pinned for the start; retry when publishes are less frequent")

    async def _launch(self, instance_id: str, spec: InstanceSpec, weights: PinnedWeights) -> InstanceSlot:
        launch = self.launch_for(instance_id, weights.model_path, spec)
        handle = await self._new_host(instance_id, spec.tp_size)
        slot: InstanceSlot | None = None
        try:
            ident = await handle.acall("identity")
            info = await handle.acall("start", launch, self.spec.startup_timeout_s)
            slot = InstanceSlot(
                id=instance_id,
                client=ServerClient(self.session, f"http://{info['host']}:{info['port']}", instance_id),
                host=info["host"],
                port=int(info["port"]),
                weight_version=weights.version,
                state=STARTING,
                pid=int(info["pid"]),
                start_ticks=int(info["start_ticks"]),
                hostname=ident["hostname"],
                gpu_ids=tuple(ident["gpu_ids"]),
                model_path=weights.source,
                checksum="",
                handle=handle,
                spec=spec,
            )
            self.tracked[instance_id] = slot
            self.save()  # recorded before the check, so a crash now still leaves it findable
            report = await self.verify(slot, weights.version)
            if report["checksum"] != weights.checksum:
                raise ServerStartError(
                    f"{instance_id} loaded {weights.source} with checksum {report['checksum']}, "
                    f"expected {weights.checksum} (the directory changed while it started?)"
                )
            slot.checksum = report["checksum"]
            slot.state = READY
            log.info(
                "rollout instance %s ready on %s:%d (pid %d)", instance_id, slot.host, slot.port, slot.pid
            )
            return slot
        except BaseException:
            await self._discard(handle)
            if self.tracked.pop(instance_id, None) is not None:
                self.save()
            raise

    async def verify(self, slot: InstanceSlot, version: int) -> dict[str, Any]:
        results = await slot.client.rpc(
            "libra_verify", {"weight_version": str(version)}, self.spec.startup_timeout_s
        )
        return worker_report(results, slot.id)

    async def _discard(self, handle: Any) -> None:
        try:
            await handle.acall("stop", self.spec.stop_timeout_s)
        except Exception as exc:
            log.warning("stopping server of %s failed: %s", handle.name, exc)
        await asyncio.to_thread(handle.kill)

    async def stop(self, slot: InstanceSlot) -> float:
        """Stop the server, then release its host actor and GPUs; returns the server stop time. A host that is
        gone (its node died) took the server with it: the stop is done, not failed. A host that does not answer
        is asked again until it answers or Ray declares it gone, for up to `stop_timeout_s`."""
        elapsed = 0.0
        try:
            if slot.handle is not None:
                try:
                    elapsed = await self._stop_server(slot.handle)
                except HostGoneError as exc:
                    log.warning("%s: %s; its server's guard stops the server", slot.id, exc)
                    self._kill_orphan(self._entry(slot))
                finally:
                    await asyncio.to_thread(slot.handle.kill)
        finally:
            self.tracked.pop(slot.id, None)
            self.save()
        return elapsed

    async def _stop_server(self, handle: Any) -> float:
        deadline = time.monotonic() + self.spec.stop_timeout_s
        while True:
            try:
                return float(await handle.acall("stop", self.spec.stop_timeout_s))
            except HostUnreachableError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.info("%s (%s); asking again", handle.name, exc)
                await asyncio.sleep(UNREACHABLE_HOST_RETRY_S)

    # ---- adoption -------------------------------------------------------------------------------------

    async def survey(self) -> None:
        """Read the registry and keep, as unclaimed, every server that still runs and answers; clean up the
        entries whose server is gone (their host actors and GPUs are released)."""
        self.record = self.registry.load()
        self.unclaimed = {}
        for entry in list(self.record.entries.values()):
            handle, reason = await self._live_host(entry)
            if handle is not None:
                self.unclaimed[entry.instance_id] = (entry, handle)
            else:
                log.warning(
                    "rollout instance %s in the registry is gone (%s); cleaned up", entry.instance_id, reason
                )
        self.save()

    async def _live_host(self, entry: RegistryEntry) -> tuple[Any, str]:
        handle = await self._find_host(entry)
        if handle is None:
            self._kill_orphan(entry)
            return None, "its host is gone"
        status = await handle.acall("status")
        if not status["alive"] or int(status["pid"]) != entry.pid:
            await self._discard(handle)
            return None, f"server process {entry.pid} is not running"
        client = ServerClient(self.session, f"http://{entry.host}:{entry.port}", entry.instance_id)
        if not await client.health():
            await self._discard(handle)
            return None, "server does not answer /health"
        return handle, ""

    async def adopt(self, instance_id: str, spec: InstanceSpec) -> InstanceSlot | None:
        """Take over the unclaimed live server `instance_id` if it was started with a spec of the same
        fingerprint; None when there is no such server. A server of that id with another spec is an error:
        the caller stops it first (it decides whether to replace it)."""
        claimed = self.unclaimed.get(instance_id)
        if claimed is None:
            return None
        entry, handle = claimed
        if entry.spec_fingerprint != spec.fingerprint():
            raise InstanceIdError(
                f"a live server named {instance_id!r} runs with another spec (fingerprint "
                f"{entry.spec_fingerprint or 'unknown'}, asked for {spec.fingerprint()}); stop_instance it first"
            )
        slot = InstanceSlot(
            id=entry.instance_id,
            client=ServerClient(self.session, f"http://{entry.host}:{entry.port}", entry.instance_id),
            host=entry.host,
            port=entry.port,
            weight_version=entry.weight_version,
            pid=entry.pid,
            start_ticks=entry.start_ticks,
            hostname=entry.hostname,
            gpu_ids=tuple(entry.gpu_ids),
            model_path=entry.model_path,
            checksum=entry.checksum,
            adopted=True,
            handle=handle,
            spec=spec,
        )
        try:
            report = await self._server_state(slot)
        except Exception as exc:
            raise ServerStartError(
                f"{instance_id}: cannot adopt, its weight state is unreadable: {exc}"
            ) from exc
        slot.weight_version, slot.checksum = report["weight_version"], report["checksum"]
        slot.state = READY
        del self.unclaimed[instance_id]
        self.tracked[instance_id] = slot
        self.save()
        log.info("adopted rollout instance %s (pid %d, version %d)", slot.id, slot.pid, slot.weight_version)
        return slot

    async def stop_unclaimed(self, instance_id: str) -> bool:
        """Stop an unclaimed live server; False when there is none of that id."""
        claimed = self.unclaimed.pop(instance_id, None)
        if claimed is None:
            return False
        try:
            await self._discard(claimed[1])
        finally:
            self.save()
        return True

    async def adopt_all(self, spec: InstanceSpec) -> list[InstanceSlot]:
        """Adopt every unclaimed live server (see `survey`) started with `spec`; stop the others (the
        pool-decides start of `RolloutPool.start`)."""
        adopted: list[InstanceSlot] = []
        for instance_id in sorted(self.unclaimed):
            try:
                slot = await self.adopt(instance_id, spec)
            except Exception as exc:
                log.warning("not adopting rollout instance %s: %s; stopped", instance_id, exc)
                await self.stop_unclaimed(instance_id)
                continue
            if slot is not None:
                adopted.append(slot)
        return adopted

    async def _server_state(self, slot: InstanceSlot) -> dict[str, Any]:
        """The weights the server itself reports (re-verified when it never reported them)."""
        results = await slot.client.rpc("libra_state", {}, 30.0)
        if all(r.get("checksum") for r in results):
            return worker_report(results, slot.id)
        return await self.verify(slot, slot.weight_version)

    def _kill_orphan(self, entry: RegistryEntry) -> None:
        """A server whose host actor died keeps running without a GPU reservation: stop it if it is here."""
        if self.runtime is not None:
            from libra.cluster import rollout_hosts

            rollout_hosts.remove_group(entry.actor_name)
        if entry.hostname == socket.gethostname() and pid_alive(entry.pid, entry.start_ticks):
            try:
                os.killpg(entry.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


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
