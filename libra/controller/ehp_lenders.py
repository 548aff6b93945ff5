"""Rollout nodes held back from lending GPUs to the training step (elastic hybrid parallelism): nodes whose
lent GPUs could not reach the training pool's nodes when borrowed replicas were started on them
(`LendersUnreachableError`, a network partition between worker nodes that Ray still counts alive).

Their instances keep serving and count as serving; they only stop lending, so that a borrowed replica there does
not hang every step that would borrow it until its deadline. A held-back node is checked again from time to time
(`libra.cluster.fence_probe.reaches_again`, as a fenced node is); once it reaches the nodes it could not, its
instances may lend again (`libra.controller.rechecks`, the checks the fence uses too). Each change is an event:
`ehp_held_back` (a warning) and `ehp_lender_back`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from libra.cluster.node_fence import FencedNode
from libra.controller.events import EventLog
from libra.controller.members import Member
from libra.controller.rechecks import NodeRechecks

RECHECK_S = 20.0  # how often a held-back node is checked for whether it reaches the training pool's nodes again


class HeldBackLenders:
    """The held-back nodes, by node id, with the lending instances found on each; thread-safe (the RL loop holds
    back, the recheck thread lets go, the step's decision reads)."""

    def __init__(self, events: EventLog, reaches_again: Callable[[FencedNode], bool] | None = None,
                 recheck_s: float = RECHECK_S) -> None:
        self.events = events
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[FencedNode, tuple[str, ...]]] = {}
        self._stopping = threading.Event()
        self.rechecks = NodeRechecks("libra-ehp-lender-rechecks", recheck_s, self.nodes, reaches_again, self._back,
                                     self._stopping)

    def hold_back(self, nodes: list[FencedNode], instances: dict[str, list[str]], step: int) -> None:
        """Hold back `nodes` (with the lending instances on each) from lending, from the next step on."""
        for node in nodes:
            on_node = tuple(instances.get(node.node_id, ()))
            with self._lock:
                known = self._nodes.get(node.node_id)
                self._nodes[node.node_id] = (node, tuple(sorted({*on_node, *(known[1] if known else ())})))
            if known is None:
                self.events.emit("ehp_held_back", f"rollout node {node.address} no longer lends GPUs to the training "
                                 f"step: {node.reason}; its instances ({', '.join(on_node) or 'none'}) keep serving, "
                                 "and it is checked again until it reaches them", step=step, node_id=node.node_id,
                                 address=node.address, instances=list(on_node), unreachable=list(node.peers),
                                 reason=node.reason)
        self.rechecks.start()

    def held_back(self, member: Member) -> bool:
        """Whether `member` may not lend: it is one of the instances found on a held-back node, or its server's
        host is such a node's address."""
        key, host = member.key or member.id, str(member.info.get("host", ""))
        with self._lock:
            return any(key in on_node or host == node.address for node, on_node in self._nodes.values())

    def nodes(self) -> list[FencedNode]:
        with self._lock:
            return [node for node, _ in self._nodes.values()]

    def close(self) -> None:
        self._stopping.set()

    def _back(self, node: FencedNode) -> None:
        """`node` reaches the training pool's nodes again (`NodeRechecks`): its instances may lend again."""
        with self._lock:
            released = self._nodes.pop(node.node_id, None)
        if released is not None:
            self.events.emit("ehp_lender_back", f"rollout node {node.address} reaches the training pool's nodes "
                             "again: its instances may lend GPUs to the training step again", node_id=node.node_id,
                             address=node.address, instances=list(released[1]))
