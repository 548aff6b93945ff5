"""Whether the nodes of a training pool can reach each other, checked before its ranks form a process group.

A network partition between two worker nodes that both still reach the head leaves Ray's view whole: every
node alive, every actor answering. Only the collectives between the two sides hang (gloo gives up after its
timeout, NCCL's watchdog after its own), and a restarted pool placed on the same nodes hangs again in its
rendezvous. So a pool spread over several nodes first checks, per pair of its nodes, that a TCP connection
opens: one rank per node listens on its node's address (`Listener`), the same ranks connect to each other's
(`unreachable`), and a pair that cannot connect within `REACH_TIMEOUT_S` names the partition before any
collective waits on it. `nodes_to_fence` picks the fewest nodes to leave out so that every pair left connects.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping, Sequence

REACH_TIMEOUT_S = 5.0  # a connection within the cluster opens in milliseconds; a partition drops it silently


class Listener:
    """A TCP listener on `host` (port chosen by the kernel) that accepts and closes connections until closed."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.address = (host, int(self.sock.getsockname()[1]))
        self._thread = threading.Thread(target=self._accept, name="libra-reach-listener", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=1.0)


def unreachable(peers: Sequence[tuple[str, int]], timeout_s: float = REACH_TIMEOUT_S) -> list[str]:
    """For each of `peers` (host, port) in order: '' when a TCP connection opened within `timeout_s`, else why
    not (the checks run at once, so a partition costs one timeout, not one per peer)."""
    results = [""] * len(peers)

    def connect(index: int, host: str, port: int) -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except TimeoutError:
            results[index] = f"no TCP connection to {host}:{port} within {timeout_s:g} s"
        except OSError as exc:
            results[index] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    threads = [threading.Thread(target=connect, args=(i, h, p), daemon=True) for i, (h, p) in enumerate(peers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 5.0)
    return results


def nodes_to_fence(pairs: Sequence[tuple[str, str]], ranks_by_node: Mapping[str, int], keep: str = "") -> list[str]:
    """The fewest nodes to leave out so that no pair of `pairs` (nodes that cannot reach each other) is left,
    chosen greedily: the node in the most broken pairs first; among equals the one holding fewer of the pool's
    ranks (`ranks_by_node`), then not `keep` (rank 0's node), then by node id, so the choice is repeatable."""
    left = {tuple(sorted(pair)) for pair in pairs if pair[0] != pair[1]}
    fenced: list[str] = []
    while left:
        count: dict[str, int] = {}
        for a, b in left:
            count[a] = count.get(a, 0) + 1
            count[b] = count.get(b, 0) + 1
        node = min(count, key=lambda n: (-count[n], ranks_by_node.get(n, 0), n == keep, n))
        fenced.append(node)
        left = {pair for pair in left if node not in pair}
    return fenced
