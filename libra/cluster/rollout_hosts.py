"""Ray side of the rollout pool: one placement group and one small host actor per vLLM instance.

Each instance gets a single-bundle placement group of `tp_size` GPUs and a named actor (the instance's
`ServerHost`) that owns the server process there. Managed servers are meant to outlive a controller crash,
so both are created detached when asked: a restarted controller finds them again by name.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from libra.cluster.node_fence import FENCE, avoid_fenced
from libra.cluster.ray_runtime import RayRuntime
from libra.rollout.spec import HostGoneError, HostUnreachableError

log = logging.getLogger(__name__)

HOST_MAX_CONCURRENCY = 8  # status calls must be answered while a start or restart runs


def node_ip_address() -> str:
    """The address of the Ray node this process runs on."""
    return str(ray.util.get_node_ip_address())


class RayHostHandle:
    """A host actor and its placement group, with the call interface the rollout pool uses."""

    def __init__(self, actor: Any, pg: PlacementGroup | None, name: str) -> None:
        self.name = name
        self.actor = actor
        self.pg = pg

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from exc

    async def acall(self, method: str, *args: Any) -> Any:
        """The host method's result; what it raised is raised here as itself (class and message, the host's
        traceback chained), as a `LocalHostHandle` raises it."""
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await asyncio.wrap_future(ref.future())
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from exc
        except ray.exceptions.ActorDiedError as exc:
            raise HostGoneError(f"the host actor {self.name} is gone ({type(exc).__name__})") from exc
        except ray.exceptions.ActorUnavailableError as exc:
            raise HostUnreachableError(f"the host actor {self.name} does not answer ({type(exc).__name__})") from exc

    def fenced(self) -> str:
        """Why the node of this host's bundle is fenced off by the job (`node_fence`), or '' when it is not (or
        the group cannot be read now)."""
        if self.pg is None or not FENCE.node_ids():
            return ""
        try:
            node = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {}).get(0)
        except Exception:  # the cluster cannot tell now: not a verdict
            return ""
        return FENCE.reason_for(str(node)) if node else ""

    def kill(self) -> None:
        """Kill the actor and release its GPUs (stop the server first: a killed actor does not)."""
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # already gone is what we wanted
            log.debug("kill host actor %s: %s", self.name, exc)
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception as exc:
                log.debug("remove placement group of %s: %s", self.name, exc)


def group_name(actor_name: str) -> str:
    return f"{actor_name}-pg"


def spawn_host(
    host_cls: type,
    *args: Any,
    name: str,
    namespace: str,
    tp_size: int,
    detached: bool,
    runtime: RayRuntime,
) -> RayHostHandle:
    """Reserve `tp_size` GPUs in one bundle and start `host_cls(*args)` there as the named actor `name`. The
    bundle's wait is `runtime`'s (`RayRuntime.wait_placed`): it gives up early when the cluster loses GPUs
    meanwhile, as a training pool's does."""
    lifetime = "detached" if detached else None
    pg = placement_group(
        [{"GPU": tp_size, "CPU": 1}], strategy="STRICT_PACK", name=group_name(name), lifetime=lifetime,
        bundle_label_selector=avoid_fenced(1),
    )
    runtime.wait_placed(pg, f"rollout instance {name}: {tp_size} GPU(s) in one bundle")
    options: dict[str, Any] = {
        "num_gpus": tp_size,
        "num_cpus": 1,
        "name": name,
        "namespace": namespace,
        "max_concurrency": HOST_MAX_CONCURRENCY,
        "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0
        ),
    }
    if lifetime:
        options["lifetime"] = lifetime
    actor: Any = ray.remote(host_cls).options(**options).remote(*args)
    return RayHostHandle(actor, pg, name)


def find_host(name: str, namespace: str) -> RayHostHandle | None:
    """The live host actor called `name` (with its placement group), or None."""
    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    return RayHostHandle(actor, find_group(name), name)


def find_group(actor_name: str) -> PlacementGroup | None:
    try:
        return get_placement_group(group_name(actor_name))
    except ValueError:
        return None


def remove_group(actor_name: str) -> None:
    """Release the placement group of a host whose actor is gone."""
    pg = find_group(actor_name)
    if pg is not None:
        remove_placement_group(pg)
