"""A member being stopped is no longer counted as live, whether its requests drain or are aborted: while the
stop runs, the next reconcile tick must not see one member too many and stop another one."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.members import MemberState
from libra.controller.reconcile import CreateRolloutPool, StopRolloutInstance
from libra.controller.state import ROLLOUT, DesiredState, RolloutSpec, TrainLayout
from libra.controller.strategies import diff_strategy
from libra.controller.tracker import MemberTracker

from .fakes import FakeRolloutEdge, FakeTrainingEdge

S = MemberState
SPEC = RolloutSpec(1, "fp-tp1")


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "abort"])
def test_a_stop_in_flight_leaves_the_surplus_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   drain: bool) -> None:
    events = EventLog(tmp_path / "events.jsonl")
    rollout = FakeRolloutEdge(gpus=4)
    ex = Executor(MemberTracker(events), rollout, FakeTrainingEdge(), events, clock=lambda: 1000.0)
    release = threading.Event()
    try:
        ex.submit([CreateRolloutPool("test", 3, ("rollout-0", "rollout-1", "rollout-2"), SPEC, 1)])
        assert ex.wait_idle(5)
        real_stop = rollout.stop

        def slow_stop(key: str, drain: bool) -> None:
            assert release.wait(5)
            real_stop(key, drain)

        monkeypatch.setattr(rollout, "stop", slow_stop)
        # 3 -> 2: the diff strategy stops one member; ask it again while that stop is still running
        desired = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=0, train_layout=TrainLayout(),
                               generation=2, rollout_fingerprint="fp-tp1", drain_before_stop=drain)
        first = diff_strategy(ex.tracker.snapshot(1000.0, take_errors=False), desired, set())
        stops = [a for a in first if isinstance(a, StopRolloutInstance)]
        assert len(stops) == 1 and stops[0].drain is drain
        futures = ex.submit(stops)
        again = diff_strategy(ex.tracker.snapshot(1000.0, take_errors=False), desired, set())
        assert [a for a in again if isinstance(a, StopRolloutInstance)] == []
        release.set()
        futures[0].result(5)
        assert [m.id for m in ex.tracker.members(ROLLOUT) if m.live] == sorted(
            {"rollout-0", "rollout-1", "rollout-2"} - {stops[0].member_id})
        assert [t.target for t in ex.tracker.member(stops[0].member_id).history][-2:] == [S.DRAINING, S.STOPPED]
    finally:
        release.set()
        ex.shutdown()
