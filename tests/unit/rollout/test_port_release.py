"""A server start on a fixed port waits, bounded, for that port to be released: the server of a leftover host
that a restarted controller just killed takes seconds to exit, and its instance's port is fixed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from libra.rollout import host
from libra.rollout.host import ServerHost
from libra.rollout.server import ServerLaunch


@pytest.fixture
def held_port() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("release_after_s", "timeout_s", "expected"),
    [(None, 0.0, True), (0.4, 5.0, True), (None, 0.5, False)],
    ids=["free-at-once", "released-while-waiting", "never-released"],
)
def test_wait_for_port(held_port: socket.socket, release_after_s: float | None, timeout_s: float,
                       expected: bool) -> None:
    port = held_port.getsockname()[1]
    if release_after_s is None and expected:
        held_port.close()
    elif release_after_s is not None:
        threading.Timer(release_after_s, held_port.close).start()
    started = time.monotonic()
    assert host._wait_for_port("127.0.0.1", port, timeout_s, poll_s=0.05) is expected
    if not expected:
        assert time.monotonic() - started >= timeout_s


def test_start_on_a_port_that_stays_taken_names_port_and_wait(monkeypatch: pytest.MonkeyPatch,
                                                                held_port: socket.socket) -> None:
    monkeypatch.setattr(host, "PORT_RELEASE_WAIT_S", 0.3)
    port = held_port.getsockname()[1]
    launch = ServerLaunch(model_path="/nonexistent", port=port, host="127.0.0.1", max_model_len=64,
                          kv_cache_bytes=1 << 20)
    with pytest.raises(RuntimeError, match=rf"port {port} on 127.0.0.1 is still in use after 0s"):
        ServerHost("rollout-0").start(launch, timeout_s=1.0)
