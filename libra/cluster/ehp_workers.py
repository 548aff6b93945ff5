"""Ray glue of elastic hybrid parallelism: training workers on GPUs lent by rollout instances, and calls that
hand object references from one worker group to another without fetching them to the driver.

A lent GPU stays reserved by the rollout instance that lends it (its placement group and host actor keep
running, the server asleep or resident): the borrowed worker joins that instance's bundle with no Ray
resources of its own and sees the GPU through `CUDA_VISIBLE_DEVICES`, as a co-located process does. A
`LentGpu` without a placement group is a GPU reserved afresh (one `{"GPU": 1, "CPU": 1}` bundle), for a
server that was stopped rather than put to sleep. `LendersUnreachableError` says that nodes of lent GPUs cannot
reach the training pool's nodes (`EhpSession` checks before a borrowed world forms).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group

from libra.cluster.node_fence import FencedNode
from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.rollout_hosts import group_name
from libra.cluster.training_workers import FORWARDED_ENV, TrainingWorkerGroup


class LendersUnreachableError(RuntimeError):
    """Nodes of lent GPUs cannot reach the training pool's nodes (or, in one borrowed world, each other): a
    network partition that would hang a shared step. `nodes`: each such node, with the peers it could not reach
    (what a later check tries again); `instances`: node id -> the lending instances on it."""

    def __init__(self, message: str, nodes: list[FencedNode], instances: dict[str, list[str]]) -> None:
        super().__init__(message)
        self.nodes = nodes
        self.instances = instances


@dataclass(frozen=True)
class LentGpu:
    """One GPU lent to a borrowed training rank: its id, and the placement group of the rollout instance that
    holds it ("" = reserve a GPU afresh) with the bundle it is in, and that instance's id."""

    gpu_id: str
    placement_group: str = ""
    bundle_index: int = 0
    holder: str = ""  # the lending rollout instance, whose CPU slice the rank joins (metered logical GPUs)


def lent_by_instance(host_actor_name: str, gpu_ids: Sequence[str]) -> list[LentGpu]:
    """The GPUs `gpu_ids` of the rollout instance whose host actor is `host_actor_name` (its single-bundle
    placement group, `rollout_hosts.spawn_host`), lent in place."""
    return [LentGpu(gpu_id=str(g), placement_group=group_name(host_actor_name)) for g in gpu_ids]


class BorrowedWorkerGroup(TrainingWorkerGroup):
    """`len(gpus)` actors of `worker_cls(*args, rank, len(gpus))`, rank r on `gpus[r]`."""

    def __init__(self, runtime: RayRuntime, worker_cls: type, args: tuple[Any, ...], gpus: Sequence[LentGpu],
                 name: str) -> None:
        super().__init__(runtime, worker_cls, args, len(gpus), name)
        self.gpus = list(gpus)
        self._placements: list[tuple[PlacementGroup, int]] = []

    def start(self, strategy: str = "PACK") -> None:
        fresh = [g for g in self.gpus if not g.placement_group]
        if fresh:
            self._pg = self.runtime.placement_group([{"GPU": 1.0, "CPU": 1.0}] * len(fresh), strategy=strategy,
                                                    name=f"{self.name}-pg")
        base_env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        next_fresh = 0
        for rank, gpu in enumerate(self.gpus):
            if gpu.placement_group:
                try:
                    pg = get_placement_group(gpu.placement_group)
                except ValueError as exc:
                    raise RuntimeError(f"{self.name}: GPU {gpu.gpu_id}: no placement group "
                                       f"{gpu.placement_group!r} (the lending instance is gone)") from exc
                placement, num_gpus, num_cpus = (pg, gpu.bundle_index), 0.0, 0.0
                env = {**base_env, "CUDA_VISIBLE_DEVICES": gpu.gpu_id}
            else:
                placement, num_gpus, num_cpus = (self._pg, next_fresh), 1.0, 1.0
                next_fresh += 1
                env = base_env
            self._placements.append(placement)
            self.actors.append(self.runtime.spawn(
                self.worker_cls, *self.args, rank, self.num_workers, pg=placement[0], bundle_index=placement[1],
                num_gpus=num_gpus, num_cpus=num_cpus, env=env or None,
            ))

    def rank_nodes(self) -> list[str]:
        """The node id of each rank's bundle (in the lending instance's placement group or in a fresh one)."""
        return [self._bundle_node(pg, index) for pg, index in self._placements]

    def rendezvous_host(self) -> str:
        nodes = self.rank_nodes()
        if len(set(nodes)) <= 1:
            return "127.0.0.1"
        node_id = nodes[0]
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return str(node["NodeManagerAddress"])
        raise RuntimeError(f"{self.name}: rank 0's node {node_id} is not in the cluster's node list")

    @staticmethod
    def _bundle_node(pg: PlacementGroup, index: int) -> str:
        table = ray.util.placement_group_table(pg)
        return str((table.get("bundles_to_node_id") or {}).get(index, ""))


def call_refs(group: TrainingWorkerGroup, method: str, *args: Any) -> list[Any]:
    """Start `method(*args)` on every rank of `group`; the object references of the results, unfetched."""
    return [getattr(actor, method).remote(*args) for actor in group.actors]


def call_each(group: TrainingWorkerGroup, method: str, per_rank: Sequence[Sequence[Any]],
              num_returns: int = 1) -> list[Any]:
    """Start `method(*per_rank[r])` on rank r; arguments that are object references reach the rank as their
    values (Ray resolves them where the rank runs; a call whose argument's call failed fails without running).
    With `num_returns` > 1 the method returns that many values and each rank's entry is a tuple of as many
    references, one per value."""
    if len(per_rank) != len(group.actors):
        raise ValueError(f"{group.name}.{method}: {len(per_rank)} argument lists for {len(group.actors)} ranks")
    if num_returns == 1:
        return [getattr(actor, method).remote(*args) for actor, args in zip(group.actors, per_rank, strict=True)]
    return [tuple(getattr(actor, method).options(num_returns=num_returns).remote(*args))
            for actor, args in zip(group.actors, per_rank, strict=True)]


def gather(group: TrainingWorkerGroup, method: str, refs: list[Any], timeout: float | None) -> list[Any]:
    """The results of `refs`, failing fast on the first rank that raised (`CollectiveCallError`)."""
    return group._gather(method, refs, timeout)


def wait_done(refs: list[Any], timeout: float | None) -> bool:
    """Wait until every call of `refs` has finished, without fetching the results here; False on timeout (a
    call that raised is found by whoever gathers it)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
    return len(done) == len(refs)


def fetch_within(refs: list[Any], timeout_s: float) -> tuple[list[Any], str]:
    """The values of `refs`, fetched by the calling process within `timeout_s`; with '' or, where they could not
    all be fetched in time, why not (and no values)."""
    try:
        return list(ray.get(refs, timeout=timeout_s)) if refs else [], ""
    except ray.exceptions.GetTimeoutError:
        return [], f"waited {timeout_s:.0f}s for them"
    except ray.exceptions.RayError as exc:
        return [], f"could not fetch them ({type(exc).__name__})"


def share(value: Any) -> Any:
    """An object reference to `value` (put once, passed to many ranks)."""
    return ray.put(value)
