"""Whether a fenced node reaches the peers it could not reach when it was fenced off (Ray glue of
`libra.cluster.reachability`): a small listener actor on each peer node still alive, and one task on the fenced
node that connects to them. Neither takes a CPU or GPU of the job (`num_cpus=0`), so a check never waits for the
pools' resources."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from libra.cluster.node_fence import FencedNode
from libra.cluster.reachability import REACH_TIMEOUT_S, Listener, unreachable

log = logging.getLogger(__name__)

PROBE_START_S = 120.0  # a probe actor or task starts a Ray worker on its node first (seconds on a loaded node)


class PeerListener:
    """A reachability listener on the node its actor runs on."""

    def __init__(self) -> None:
        from libra.cluster.rollout_hosts import node_ip_address

        self.listener = Listener(node_ip_address())

    def address(self) -> tuple[str, int]:
        return self.listener.address

    def close(self) -> None:
        self.listener.close()


def _connect(peers: list[tuple[str, int]], timeout_s: float) -> list[str]:
    return unreachable(peers, timeout_s)


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def reaches_again(fenced: FencedNode, timeout_s: float = REACH_TIMEOUT_S) -> bool:
    """True when `fenced`'s node is alive and opens a TCP connection to every one of its peers still alive (no
    such peer left: nothing it could not reach remains); False otherwise, or when the check could not run."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if fenced.node_id not in alive:
        return False
    peers = [peer for peer in fenced.peers if peer in alive]
    if not peers:
        return True
    listeners: list[Any] = [ray.remote(PeerListener).options(num_cpus=0, scheduling_strategy=_on(peer)).remote()
                            for peer in peers]
    try:
        addresses = ray.get([listener.address.remote() for listener in listeners], timeout=PROBE_START_S)
        connect = ray.remote(_connect).options(num_cpus=0, scheduling_strategy=_on(fenced.node_id))
        results = ray.get(connect.remote(addresses, timeout_s), timeout=PROBE_START_S + timeout_s)
    except Exception as exc:  # a probe that could not run is no evidence either way
        log.info("the check of fenced node %s did not run: %s", fenced.address, exc)
        return False
    finally:
        for listener in listeners:
            with contextlib.suppress(Exception):
                ray.kill(listener)
    return not any(results)
