"""Unmanaged pools: connect to servers someone else runs (the configured `endpoints`), check that each serves
the Libra weight extension, read the weights it holds, and serve them all. Nothing here starts or stops a
process."""

from __future__ import annotations

import asyncio
import time
import urllib.parse

import aiohttp

from libra.rollout.client import ServerClient
from libra.rollout.lifecycle import worker_report
from libra.rollout.router import READY, InstanceSlot, Router
from libra.rollout.spec import RolloutError, RolloutPoolSpec, ServerStartError

EXTENSION_HINT = (
    "start it with VLLM_SERVER_DEV_MODE=1 and "
    "--worker-extension-cls libra.rollout.worker_extension.LibraWorkerExtension"
)


async def connect_endpoints(spec: RolloutPoolSpec, session: aiohttp.ClientSession, router: Router) -> int:
    """Add every endpoint as a READY, serving instance `endpoint-<i>`; returns the newest weight version
    they hold (the pool's current one)."""
    deadline = time.monotonic() + spec.startup_timeout_s
    for index, url in enumerate(spec.endpoints):
        parsed = urllib.parse.urlparse(url)
        iid = f"endpoint-{index}"
        slot = InstanceSlot(
            id=iid, client=ServerClient(session, url, iid), host=parsed.hostname or "", port=parsed.port or 80,
            weight_version=0, managed=False, model_path=spec.model_path,
        )  # fmt: skip
        while not await slot.client.health():
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"endpoint {url} did not answer /health within {spec.startup_timeout_s:.0f}s"
                )
            await asyncio.sleep(1.0)
        try:
            results = await slot.client.rpc("libra_state", {}, 30.0)
            if not all(r.get("checksum") for r in results):
                results = await slot.client.rpc(
                    "libra_verify", {"weight_version": "0"}, spec.startup_timeout_s
                )
        except RolloutError as exc:
            raise RolloutError(
                f"endpoint {url} does not serve the Libra weight extension ({exc}); {EXTENSION_HINT}"
            ) from exc
        report = worker_report(results, iid)
        slot.weight_version, slot.checksum = report["weight_version"], report["checksum"]
        slot.model_path = report["model_path"]
        slot.state = READY
        router.slots[iid] = slot
    await router.set_serving(router.slots)
    return max((s.weight_version for s in router.slots.values()), default=0)
