"""`MemberTracker.wait_changed`: a waiter wakes on the tracker's next change, from any of its changing calls, and
not before; a look (snapshot, members) is no change."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from libra.controller.events import EventLog
from libra.controller.state import ROLLOUT
from libra.controller.tracker import MemberTracker


def tracker_with_member() -> MemberTracker:
    tracker = MemberTracker(EventLog(None))
    tracker.add_member("rollout-0", ROLLOUT, time.time(), "test")
    return tracker


@pytest.mark.parametrize("change", [
    pytest.param(lambda t: t.set_busy("rollout-0", True), id="set_busy"),
    pytest.param(lambda t: t.set_pool(ROLLOUT, busy=True), id="set_pool"),
    pytest.param(lambda t: t.set_serving(["rollout-0"]), id="set_serving"),
    pytest.param(lambda t: t.record_acks({"rollout-0": 3}), id="record_acks"),
    pytest.param(lambda t: t.action_result(ROLLOUT, time.time(), error="boom"), id="action_result"),
    pytest.param(lambda t: t.add_member("rollout-1", ROLLOUT, time.time(), "test"), id="add_member"),
    pytest.param(lambda t: t.observe(ROLLOUT, [], time.time()), id="observe"),
])
def test_a_waiter_wakes_on_the_next_change(change: Callable[[MemberTracker], object]) -> None:
    tracker = tracker_with_member()
    seen = tracker.version
    timer = threading.Timer(0.1, change, (tracker,))
    timer.start()
    started = time.monotonic()
    assert tracker.wait_changed(seen, 5.0)
    assert time.monotonic() - started < 2.0
    timer.join()
    assert tracker.version > seen


def test_a_look_is_no_change() -> None:
    tracker = tracker_with_member()
    seen = tracker.version
    tracker.snapshot(time.time(), take_errors=False)
    tracker.members(ROLLOUT)
    tracker.counts(ROLLOUT)
    started = time.monotonic()
    assert not tracker.wait_changed(seen, 0.2)
    assert time.monotonic() - started >= 0.19


def test_a_change_made_before_the_wait_is_not_missed() -> None:
    tracker = tracker_with_member()
    seen = tracker.version
    tracker.set_busy("rollout-0", True)
    started = time.monotonic()
    assert tracker.wait_changed(seen, 5.0)
    assert time.monotonic() - started < 0.1
