"""A pool whose members fail soon after becoming READY (a server that crashes on its first request) backs off
new starts, doubling the wait with each such failure in a row, instead of replacing the member every tick;
a member that served for a while resets the count. Failures while starting keep their own back-off."""

from __future__ import annotations

import pytest

from libra.controller.events import EventLog
from libra.controller.members import MemberState
from libra.controller.state import ROLLOUT, DesiredState, ObservedState, PoolObservation, TrainLayout
from libra.controller.strategies import diff_strategy
from libra.controller.tracker import (
    EARLY_FAILURE_BACKOFF_S,
    EARLY_FAILURE_MAX_BACKOFF_S,
    EARLY_FAILURE_S,
    MemberTracker,
)

S = MemberState


def run_member(tracker: MemberTracker, member_id: str, ready_at: float, fails_at: float | None) -> None:
    tracker.add_member(member_id, ROLLOUT, ready_at - 30, "wanted")
    tracker.move(member_id, S.READY, ready_at, "started")
    if fails_at is not None:
        tracker.move(member_id, S.FAILED, fails_at, "crashed")


@pytest.mark.parametrize(
    ("served_s", "expected_waits"),
    [
        ([1, 1, 1], [EARLY_FAILURE_BACKOFF_S, 2 * EARLY_FAILURE_BACKOFF_S, 4 * EARLY_FAILURE_BACKOFF_S]),
        ([1, EARLY_FAILURE_S + 1, 1], [EARLY_FAILURE_BACKOFF_S, None, EARLY_FAILURE_BACKOFF_S]),
        ([1] * 12, [min(EARLY_FAILURE_MAX_BACKOFF_S, EARLY_FAILURE_BACKOFF_S * 2 ** i) for i in range(12)]),
    ],
    ids=["doubles", "a-member-that-served-resets", "capped"],
)
def test_early_failures_back_off_starts(served_s: list[float], expected_waits: list[float | None]) -> None:
    events = EventLog(None, keep=100)
    tracker = MemberTracker(events)
    now = 1000.0
    for index, (served, wait) in enumerate(zip(served_s, expected_waits, strict=True)):
        before = tracker.snapshot(now).rollout.start_after
        run_member(tracker, f"rollout-{index}", now, now + served)
        after = tracker.snapshot(now + served).rollout.start_after
        if wait is None:
            assert after == before
        else:
            assert after == pytest.approx(now + served + wait)
        now += served + 1000.0
    backoffs = [e for e in events.recent(100) if e["kind"] == "start_backoff"]
    assert len(backoffs) == sum(w is not None for w in expected_waits)


@pytest.mark.parametrize(("first_wait_s", "expected_waits"), [(1.0, [1.0, 2.0, 4.0]), (0.0, [0.0, 0.0, 0.0])],
                         ids=["one-second", "off"])
def test_the_first_wait_is_configurable(first_wait_s: float, expected_waits: list[float]) -> None:
    tracker = MemberTracker(EventLog(None), early_failure_backoff_s=first_wait_s)
    now = 1000.0
    for index, wait in enumerate(expected_waits):
        run_member(tracker, f"rollout-{index}", now, now + 1)
        assert tracker.snapshot(now + 1).rollout.start_after == pytest.approx(now + 1 + wait)
        now += 2


def test_a_failure_while_starting_is_not_an_early_failure() -> None:
    tracker = MemberTracker(EventLog(None))
    tracker.add_member("rollout-0", ROLLOUT, 100.0, "wanted")
    tracker.move("rollout-0", S.STARTING, 101.0, "start")
    tracker.move("rollout-0", S.FAILED, 102.0, "start failed")
    assert tracker.snapshot(102.0).rollout.start_after == 0.0


@pytest.mark.parametrize(("now", "starts"), [(103.0, 0), (105.0, 1)], ids=["backing-off", "after-the-wait"])
def test_diff_starts_no_replacement_while_backing_off(now: float, starts: int) -> None:
    desired = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=1, train_layout=TrainLayout())
    members = MemberTracker(EventLog(None))
    run_member(members, "rollout-0", 50.0, None)
    run_member(members, "rollout-1", 98.0, 99.0)  # crashed a second after becoming ready
    snap = members.snapshot(now)
    assert snap.rollout.start_after == pytest.approx(99.0 + EARLY_FAILURE_BACKOFF_S)
    observed = ObservedState(now=now, rollout=PoolObservation(created=True, start_after=snap.rollout.start_after),
                             train=PoolObservation(created=True), members=snap.members)
    actions = diff_strategy(observed, desired, set())
    assert sum(a.kind == "StartRolloutInstance" for a in actions) == starts
    assert any(a.kind == "StopRolloutInstance" and a.member_id == "rollout-1" for a in actions)  # still cleaned up
