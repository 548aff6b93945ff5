"""The training rendezvous port comes from below the kernel's ephemeral range, where no outgoing connection can
take it between the pick and init_process_group's bind; a taken port is never returned."""

from __future__ import annotations

import socket

import pytest

from libra.training.worker import RENDEZVOUS_PORTS, free_port


def ephemeral_range() -> range:
    try:
        low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    return range(low, high + 1)


def test_the_rendezvous_ports_are_below_the_ephemeral_range() -> None:
    assert RENDEZVOUS_PORTS.stop <= ephemeral_range().start


@pytest.mark.parametrize("attempt", range(5))
def test_a_picked_port_is_in_range_and_can_be_bound(attempt: int) -> None:
    port = free_port()
    assert port in RENDEZVOUS_PORTS
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_returned_and_a_full_range_falls_back_to_an_ephemeral_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        port = free_port(ports=range(taken, taken + 1))
        assert port != taken and port in ephemeral_range()
