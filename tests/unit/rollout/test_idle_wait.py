"""TP workers' idle wait (`libra.rollout.idle_wait`) on vLLM's real shared-memory queue condition: a reader that
read a moment ago naps instead of yielding the core in a loop, one idle for longer waits on the notification
socket as vLLM's does, and a writer's notification still wakes it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from libra.rollout import idle_wait

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")


@pytest.fixture
def condition_class(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's condition class with the idle wait installed (restored after the test)."""
    monkeypatch.setattr(shm_broadcast, "SpinCondition", shm_broadcast.SpinCondition)
    assert idle_wait.install()
    yield shm_broadcast.SpinCondition


@pytest.fixture
def pair(condition_class: Any, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A writer and a reader of one notification socket."""
    context = zmq.Context()
    address = f"ipc://{tmp_path / 'notify'}"
    writer = condition_class(is_reader=False, context=context, notify_address=address)
    reader = condition_class(is_reader=True, context=context, notify_address=address)
    try:
        yield writer, reader
    finally:
        context.destroy(linger=0)


def test_install_is_idempotent(condition_class: Any) -> None:
    assert idle_wait.install()
    assert shm_broadcast.SpinCondition is condition_class


@pytest.mark.parametrize(
    ("idle_for_s", "naps", "yields"),
    [
        pytest.param(0.0, True, 0, id="just-read-naps"),
        pytest.param(5.0, False, 0, id="idle-waits-on-the-socket"),
    ],
)
def test_a_reader_never_yields_in_a_loop(pair: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch,
                                         idle_for_s: float, naps: bool, yields: int) -> None:
    calls: list[str] = []
    slept: list[float] = []

    def recorded_sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: calls.append("yield"))
    monkeypatch.setattr(idle_wait, "time", SimpleNamespace(monotonic=time.monotonic, sleep=recorded_sleep))
    _, reader = pair
    reader.last_read = time.monotonic() - idle_for_s
    started = time.monotonic()
    reader.wait(timeout_ms=50)
    waited = time.monotonic() - started
    assert len(calls) == yields
    if naps:
        assert slept == [idle_wait.NAP_S] and waited >= idle_wait.NAP_S
    else:
        assert not slept and waited >= 0.045  # the socket's timeout: nothing was written


def test_a_writers_notification_wakes_an_idle_reader(pair: tuple[Any, Any]) -> None:
    writer, reader = pair
    reader.last_read = time.monotonic() - 5.0
    time.sleep(0.2)  # the subscription reaches the writer's socket
    writer.notify()
    started = time.monotonic()
    reader.wait(timeout_ms=5000)
    assert time.monotonic() - started < 1.0


def test_requested_only_by_the_servers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(idle_wait.IDLE_WAIT_ENV, raising=False)
    assert not idle_wait.requested()
    monkeypatch.setenv(idle_wait.IDLE_WAIT_ENV, "1")
    assert idle_wait.requested()
