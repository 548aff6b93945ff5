"""A server start on a fixed port waits, bounded, for that port to be released: the server of a leftover host
that a restarted controller just killed takes seconds to exit, and its instance's port is fixed. And the host of
such a leftover start kills its server at once when asked, while the start still waits for it."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.proc_stat import group_members, pid_alive
from libra.rollout import host, server
from libra.rollout.host import ServerHost
from libra.rollout.server import ServerLaunch
from libra.rollout.spec import ServerStartError


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


# A "server" that ignores SIGTERM and never answers /health, with a child in its group (as vLLM's engine core).
STUBBORN_SERVER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def test_abandon_kills_a_server_mid_start_without_waiting_for_the_start(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    monkeypatch.setattr(server, "server_command",
                        lambda launch, device: [sys.executable, "-c", STUBBORN_SERVER, str(marker)])
    launch = ServerLaunch(model_path="/nonexistent", port=0, host="127.0.0.1", max_model_len=64,
                          kv_cache_bytes=1 << 20, log_path=str(tmp_path / "server.log"),
                          fork_from_forker=False)  # the stand-in command runs in a new interpreter
    subject = ServerHost("rollout-1")
    assert subject.abandon() == 0  # nothing started yet
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            subject.start(launch, timeout_s=120.0)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reads what the start ended with
            outcome.append(exc)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.05)
    guard_pid, child_pid = subject.status()["pid"], int(marker.read_text())
    began = time.monotonic()
    assert subject.abandon() == guard_pid  # answered while start() holds the host's lock
    starter.join(timeout=10)
    assert not starter.is_alive() and time.monotonic() - began < 10
    assert isinstance(outcome[0], ServerStartError) and "before becoming healthy" in str(outcome[0])
    assert not pid_alive(child_pid) and group_members(guard_pid) == []
