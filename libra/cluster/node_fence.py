"""The Ray nodes this process's job no longer uses: nodes fenced off because training ranks on them could not
reach their peers (a network partition between worker nodes that both still reach the head, so Ray keeps them
alive).

A fenced node is out of the job as a lost node is, while Ray still counts it: `RayRuntime.live_gpus` leaves its
GPUs out (so the job re-plans onto the rest), every placement group the job creates from then on avoids it
(`label_selector`, Ray's node-id label), and the rollout pool's health monitor fails an instance whose host runs
on it (`reason_for`). The fence is process-wide, as the process's Ray connection is: the controller is one job.
A fenced node is checked again from time to time (`libra.cluster.fence_probe`): once it reaches the peers it
could not, the fence on it is lifted (`lift`) and its GPUs count again. A relaunch checks the nodes again at
the training pool's start.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id


@dataclass(frozen=True)
class FencedNode:
    node_id: str
    address: str  # the node's address as Ray knows it, for messages
    reason: str
    peers: tuple[str, ...] = ()  # the node ids it could not reach: what a later check tries again


class NodeFence:
    """The fenced nodes, by node id; thread-safe (the RL loop fences, the control loop and the rollout monitor
    read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, FencedNode] = {}

    def add(self, node_id: str, address: str, reason: str, peers: tuple[str, ...] = ()) -> bool:
        """Fence `node_id` (it could not reach the nodes `peers`); False when it already was."""
        with self._lock:
            if node_id in self._nodes:
                return False
            self._nodes[node_id] = FencedNode(node_id, address, reason, tuple(peers))
            return True

    def lift(self, node_id: str) -> FencedNode | None:
        """The node is the job's again; what was fenced (None when it was not)."""
        with self._lock:
            return self._nodes.pop(node_id, None)

    def fenced(self) -> list[FencedNode]:
        with self._lock:
            return list(self._nodes.values())

    def node_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._nodes)

    def reason_for(self, node_id: str) -> str:
        """Why `node_id` is fenced, or '' when it is not."""
        with self._lock:
            fenced = self._nodes.get(node_id)
        return f"its node {fenced.address} is fenced off: {fenced.reason}" if fenced else ""

    def label_selector(self) -> dict[str, str]:
        """A bundle's label selector that keeps it off every fenced node ({} when none is)."""
        ids = sorted(self.node_ids())
        return {NODE_ID_LABEL: f"!in({','.join(ids)})"} if ids else {}

    def clear(self) -> None:
        with self._lock:
            self._nodes.clear()


FENCE = NodeFence()


def avoid_fenced(bundles: int, fence: NodeFence = FENCE) -> list[dict[str, str]] | None:
    """The `bundle_label_selector` of a placement group of `bundles` bundles that keeps each off the fenced
    nodes; None (no selector) while none is."""
    selector = fence.label_selector()
    return [dict(selector) for _ in range(bundles)] if selector else None
