"""The reachability check of a training pool's nodes: which nodes to fence off for a set of broken pairs (a
table), and the TCP check itself on real sockets (a listener answers, a closed port does not, results keep the
order of the peers)."""

from __future__ import annotations

import socket

import pytest

from libra.cluster.reachability import Listener, nodes_to_fence, unreachable

# (id, broken pairs, ranks by node, rank 0's node, nodes fenced in order)
FENCES = [
    ("nothing-broken", [], {"a": 1, "b": 1}, "a", []),
    ("one-pair-rank-0-node-kept", [("a", "b")], {"a": 1, "b": 1}, "a", ["b"]),
    ("one-pair-rank-0-node-kept-either-order", [("b", "a")], {"a": 1, "b": 1}, "b", ["a"]),
    ("one-pair-fewer-ranks-go", [("a", "b")], {"a": 1, "b": 3}, "b", ["a"]),
    ("one-pair-fewer-ranks-beat-rank-0", [("a", "b")], {"a": 1, "b": 3}, "a", ["a"]),
    ("node-cut-from-all-others", [("a", "c"), ("b", "c"), ("c", "d")], {"a": 2, "b": 2, "c": 2, "d": 2}, "a",
     ["c"]),
    ("two-halves-smaller-half-goes", [("a", "c"), ("a", "d"), ("b", "c"), ("b", "d")],
     {"a": 4, "b": 4, "c": 2, "d": 2}, "a", ["c", "d"]),
    ("two-separate-pairs", [("a", "b"), ("c", "d")], {"a": 2, "b": 1, "c": 1, "d": 2}, "a", ["b", "c"]),
    ("duplicate-and-self-pairs-ignored", [("a", "b"), ("b", "a"), ("c", "c")], {"a": 1, "b": 1, "c": 1}, "a",
     ["b"]),
]


@pytest.mark.parametrize(("pairs", "ranks", "keep", "expected"), [case[1:] for case in FENCES],
                         ids=[case[0] for case in FENCES])
def test_nodes_to_fence(pairs: list[tuple[str, str]], ranks: dict[str, int], keep: str, expected: list[str]) -> None:
    fenced = nodes_to_fence(pairs, ranks, keep)
    assert fenced == expected
    assert all(a in fenced or b in fenced for a, b in pairs if a != b), "a broken pair is left"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_listener_is_reached_and_a_closed_port_is_not_in_the_order_asked() -> None:
    first, second = Listener("127.0.0.1"), Listener("127.0.0.1")
    try:
        results = unreachable([first.address, ("127.0.0.1", closed_port()), second.address], timeout_s=2.0)
    finally:
        first.close()
        second.close()
    assert results[0] == "" and results[2] == ""
    assert results[1].startswith("ConnectionRefusedError"), results


def test_a_closed_listener_is_not_reached() -> None:
    listener = Listener("127.0.0.1")
    address = listener.address
    listener.close()
    assert unreachable([address], timeout_s=2.0)[0].startswith("ConnectionRefusedError")


def test_no_peers_no_results() -> None:
    assert unreachable([]) == []


def test_a_connection_that_never_opens_says_how_long_it_was_waited_for() -> None:
    """A listener whose backlog is full leaves a further connection unanswered, as a partition does."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = ("127.0.0.1", int(full.getsockname()[1]))
        held = []
        try:
            for _ in range(8):  # fill the backlog (the kernel admits backlog + 1, sometimes a little more)
                client = socket.socket()
                client.setblocking(False)
                client.connect_ex(address)
                held.append(client)
            results = unreachable([address], timeout_s=0.5)
        finally:
            for client in held:
                client.close()
    assert results == [f"no TCP connection to 127.0.0.1:{address[1]} within 0.5 s"], results
