"""Ray glue of the training pool: one placement group with a `{"GPU": 1, "CPU": 1}` bundle per worker, one
actor per bundle, and collective calls that fail fast.

Every training entry point is collective (all ranks must enter it), so a call goes to every actor at once and
the results are awaited together; if any rank raises, that error is raised immediately instead of waiting for
the other ranks, which would block in a collective forever. When a rank's process has died the error is a
`WorkerLostError` (a rank that raised because its peer died is given a few seconds to be joined by the dead
rank's own error), so the caller can start the pool again rather than fail. A call that outlives its
deadline, or whose rank says its collective timed out waiting for a peer, is a `WorkerHungError` (a kind of lost
worker: the pool is stopped, which kills the hung processes, and started again). Before a group spread over
several nodes forms its process group, `check_reachability` checks that its nodes reach each other
(`libra.cluster.reachability`) and raises `NodesUnreachableError` naming the pairs that do not; `probe_reach`
is the probe itself, also between two groups (elastic hybrid parallelism's borrowed worlds and the core pool).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray

from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.reachability import REACH_TIMEOUT_S, nodes_to_fence
from libra.error_chain import causes

log = logging.getLogger(__name__)

FORWARDED_ENV = ("LIBRA_FORCE_CPU", "RL_TRAIN_PHASE_TRACE", "RL_TRAIN_PHASE_TRACE_DIR")


LOSS_GRACE_S = 5.0  # how long a failed call waits for a dead rank's error behind a survivor's
# what a rank's error says when its collective library gave up waiting for a peer (gloo's recv/send timeout and
# the pair it then closes; NCCL's watchdog): the peer hung
COLLECTIVE_TIMEOUT_MARKERS = ("Timed out waiting", "Application timeout caused pair closure",
                              "Watchdog caught collective operation timeout")


class CollectiveCallError(RuntimeError):
    """A collective call failed on one rank (the message names it) or timed out."""


class WorkerLostError(CollectiveCallError):
    """A collective call failed because the process of a rank died (killed, crashed, its node lost)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class WorkerHungError(WorkerLostError):
    """A collective call outlived its deadline: a rank stopped answering (frozen, or stuck in a collective) and
    the others wait for it. `ranks` are those that had not answered, the hung one and the ranks waiting for it
    alike (from outside they cannot be told apart)."""


class NodesUnreachableError(RuntimeError):
    """Nodes of a training pool cannot reach each other (a network partition between worker nodes that Ray still
    counts alive). `pairs` are the node ids of each pair that could not connect, `fence` the fewest nodes to
    leave out so that the rest connect, `addresses` each node's address."""

    def __init__(self, message: str, pairs: list[tuple[str, str]], fence: list[str],
                 addresses: dict[str, str]) -> None:
        super().__init__(message)
        self.pairs = pairs
        self.fence = fence
        self.addresses = addresses


class TrainingWorkerGroup:
    """`num_workers` actors of `worker_cls(*args, rank, num_workers)` pinned to one placement group."""

    def __init__(self, runtime: RayRuntime, worker_cls: type, args: tuple[Any, ...], num_workers: int, name: str) -> None:
        self.runtime = runtime
        self.worker_cls = worker_cls
        self.args = args
        self.num_workers = num_workers
        self.name = name
        self.actors: list[Any] = []
        self._pg: Any = None

    def start(self, strategy: str = "PACK") -> None:
        bundles = [{"GPU": 1.0, "CPU": 1.0}] * self.num_workers
        self._pg = self.runtime.placement_group(bundles, strategy=strategy, name=f"{self.name}-pg")
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        self.actors = [
            self.runtime.spawn(
                self.worker_cls, *self.args, rank, self.num_workers,
                pg=self._pg, bundle_index=rank, num_gpus=1, num_cpus=1, env=env or None,
            )
            for rank in range(self.num_workers)
        ]

    def rendezvous_host(self) -> str:
        """Where rank 0 listens for the process-group rendezvous: loopback when every worker is on one node,
        else the address Ray knows rank 0's node by."""
        table = ray.util.placement_group_table(self._pg)
        bundle_nodes = table.get("bundles_to_node_id", {})
        if len(set(bundle_nodes.values())) <= 1:
            return "127.0.0.1"
        node_id = bundle_nodes[0]
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return str(node["NodeManagerAddress"])
        raise RuntimeError(f"{self.name}: rank 0's node {node_id} is not in the cluster's node list")

    def rank_nodes(self) -> list[str]:
        """The node id of each rank's bundle, by rank."""
        bundle_nodes = ray.util.placement_group_table(self._pg).get("bundles_to_node_id", {})
        return [str(bundle_nodes[rank]) for rank in range(self.num_workers)]

    def first_rank_per_node(self) -> dict[str, int]:
        """Node id -> the lowest rank on it, in rank order."""
        first_rank: dict[str, int] = {}
        for rank, node in enumerate(self.rank_nodes()):
            first_rank.setdefault(node, rank)
        return first_rank

    def check_reachability(self, timeout: float) -> None:
        """When the ranks are on several nodes: the first rank of each node listens on its node's address and
        connects to every other node's (`libra.cluster.reachability`); raises `NodesUnreachableError` when a
        pair of nodes cannot connect (`timeout`: each round of calls, the actors' start included)."""
        nodes = self.rank_nodes()
        if len(set(nodes)) <= 1:
            return
        broken, hosts = probe_reach(self, self, timeout)
        if not broken:
            return
        pairs: dict[tuple[str, str], str] = {}
        for (a, b), why in broken.items():
            pairs.setdefault((min(a, b), max(a, b)), why)
        counts = {node: nodes.count(node) for node in set(nodes)}
        fence = nodes_to_fence(list(pairs), counts, keep=nodes[0])
        said = "; ".join(f"{hosts[a]} (node {a[:8]}) and {hosts[b]} (node {b[:8]}): {why}"
                         for (a, b), why in sorted(pairs.items()))
        raise NodesUnreachableError(
            f"{self.name}: the nodes of its ranks cannot all reach each other, so its collectives would hang "
            f"(a network partition between nodes that Ray still counts alive): {said}. Leaving out "
            f"{', '.join(hosts[n] for n in fence)} lets the rest connect",
            sorted(pairs), fence, hosts)

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call `method(*args)` on every rank (large arguments travel once through the object store)."""
        shared = [ray.put(a) if _is_large(a) else a for a in args]
        refs = [getattr(actor, method).remote(*shared) for actor in self.actors]
        return self._gather(method, refs, timeout)

    def call_rank(self, rank: int, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self._gather(method, [getattr(self.actors[rank], method).remote(*args)], timeout)[0]

    def _gather(self, method: str, refs: list[Any], timeout: float | None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not done:
                ranks = sorted(index[r] for r in pending)
                raise WorkerHungError(f"{self.name}.{method}: rank(s) {ranks} did not finish within {timeout:.0f}s "
                                      "(a rank stopped answering, or a collective never completed)", ranks)
            for ref in done:
                try:
                    results[index[ref]] = ray.get(ref)
                except Exception as exc:
                    raise self._failure(method, index[ref], exc, pending, index) from exc
        return results

    def _failure(self, method: str, rank: int, exc: Exception, pending: list[Any],
                 index: dict[Any, int]) -> CollectiveCallError:
        """The error of a call that failed on `rank`: a `WorkerLostError` when that rank's process died, or
        when another rank's does within `LOSS_GRACE_S` (the ranks of a collective fail together); a
        `WorkerHungError` when `rank` says its collective timed out waiting for a peer."""
        lost = [rank] if isinstance(exc, ray.exceptions.RayActorError) else []
        unfinished: list[int] = []
        if not lost and pending:
            done, still = ray.wait(pending, num_returns=len(pending), timeout=LOSS_GRACE_S)
            unfinished = sorted(index[ref] for ref in still)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    lost.append(index[ref])
                except Exception as other:  # another survivor's error says nothing more
                    log.debug("%s.%s on rank %d: %s", self.name, method, index[ref], other)
        message = f"{self.name}.{method} failed on rank {rank}: {exc}"
        if lost:
            return WorkerLostError(f"{self.name}.{method}: the process of rank(s) {sorted(lost)} died ({message})",
                                   sorted(lost))
        if collective_timed_out(str(exc)):
            return WorkerHungError(f"{self.name}.{method}: a collective timed out waiting for a peer; rank(s) "
                                   f"{unfinished} had not finished ({message})", unfinished or [rank])
        return CollectiveCallError(message)

    def shutdown(self) -> None:
        for actor in self.actors:
            self.runtime.kill(actor)
        self.actors = []
        if self._pg is not None:
            try:
                self.runtime.release(self._pg)
            except Exception as exc:  # already gone with the cluster
                log.debug("release training placement group: %s", exc)
            self._pg = None


def nodes_unreachable(exc: BaseException) -> NodesUnreachableError | None:
    """The `NodesUnreachableError` that `exc` is or was raised from, or None."""
    return next((seen for seen in causes(exc) if isinstance(seen, NodesUnreachableError)), None)


def collective_timed_out(error: str) -> bool:
    """Whether a rank's error says that its collective library gave up waiting for a peer."""
    return any(marker in error for marker in COLLECTIVE_TIMEOUT_MARKERS)


def _is_large(value: Any) -> bool:
    return isinstance(value, list | tuple | dict) and len(value) > 16


def probe_reach(listening: TrainingWorkerGroup, connecting: TrainingWorkerGroup,
                timeout: float) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """The first rank of each node of `listening` listens on its node's address; the first rank of each node of
    `connecting` connects to every listener on another node (`libra.cluster.reachability`). The pairs that
    could not, (connecting node, listening node) -> why, and the address of every node of either group;
    `timeout` bounds each round of calls."""
    listen_first, connect_first = listening.first_rank_per_node(), connecting.first_rank_per_node()
    order = list(listen_first)
    addresses = listening._gather("reach_listen", [listening.actors[listen_first[n]].reach_listen.remote()
                                                   for n in order], timeout)
    try:
        address_of = {node: (str(host), int(port)) for node, (host, port) in zip(order, addresses, strict=True)}
        targets = {node: [o for o in order if o != node] for node in connect_first}
        checks = connecting._gather(
            "reach_check", [connecting.actors[rank].reach_check.remote([address_of[o] for o in targets[node]])
                            for node, rank in connect_first.items()], timeout + REACH_TIMEOUT_S)
    finally:
        for node in order:
            listening.actors[listen_first[node]].reach_close.remote()
    broken = {(node, other): why for node, results in zip(connect_first, checks, strict=True)
              for other, why in zip(targets[node], results, strict=True) if why}
    hosts = {node: host for node, (host, _) in address_of.items()}
    missing = set(connect_first) - set(hosts)
    if missing:
        hosts.update({str(n["NodeID"]): str(n["NodeManagerAddress"]) for n in ray.nodes() if n["NodeID"] in missing})
    return broken, hosts
