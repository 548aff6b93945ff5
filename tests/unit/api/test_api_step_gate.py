"""The RL loop's step gate behind Pause / Resume / Drain: holding at a boundary, waking on resume, ending on
drain or stop."""

from __future__ import annotations

import threading
import time

from libra.controller.step_gate import StepGate


def run_proceed(gate: StepGate, cancelled: threading.Event, calls: list[bool]) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(gate.proceed(cancelled, calls.append)), daemon=True)
    thread.start()
    return thread, result


def test_open_gate_proceeds_without_holding() -> None:
    calls: list[bool] = []
    assert StepGate().proceed(threading.Event(), calls.append) is True and calls == []


def test_pause_holds_until_resume() -> None:
    gate, cancelled, calls = StepGate(), threading.Event(), []
    assert gate.pause("maintenance") and not gate.pause()
    thread, result = run_proceed(gate, cancelled, calls)
    time.sleep(0.5)
    assert thread.is_alive() and gate.holding and calls == [True]
    assert gate.resume() and not gate.resume()
    thread.join(5)
    assert result == [True] and calls == [True, False] and not gate.holding


def test_drain_ends_a_paused_loop() -> None:
    gate, cancelled, calls = StepGate(), threading.Event(), []
    gate.pause()
    thread, result = run_proceed(gate, cancelled, calls)
    time.sleep(0.3)
    assert gate.drain() and not gate.drain()
    thread.join(5)
    assert result == [False]


def test_stop_ends_a_paused_loop() -> None:
    gate, cancelled, calls = StepGate(), threading.Event(), []
    gate.pause()
    thread, result = run_proceed(gate, cancelled, calls)
    time.sleep(0.3)
    cancelled.set()
    thread.join(5)
    assert result == [False]


def test_drain_without_pause_ends_at_the_next_boundary() -> None:
    gate = StepGate()
    gate.drain()
    assert gate.proceed(threading.Event()) is False
