"""Tracker + executor + control tick against fake pool edges: creation, adoption, failure and repair,
action errors as observed state, and a tick that survives anything."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from libra.controller.control_loop import ControlLoop
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.members import MemberState
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, TrainLayout
from libra.controller.tracker import EARLY_FAILURE_BACKOFF_S, EARLY_FAILURE_S, MemberTracker, MemberView

from .fakes import FakeRolloutEdge, FakeTrainingEdge

S = MemberState


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Harness:
    def __init__(self, tmp_path: Path, instances: int = 2, preexisting: int = 0) -> None:
        self.clock = Clock()
        self.events = EventLog(tmp_path / "events.jsonl")
        self.tracker = MemberTracker(self.events)
        self.rollout = FakeRolloutEdge(preexisting)
        self.train = FakeTrainingEdge()
        self.executor = Executor(self.tracker, self.rollout, self.train, self.events, clock=self.clock)
        self.want = DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=2, train_layout=TrainLayout())
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout, self.train, lambda: self.want,
                                self.events, clock=self.clock)

    def settle(self, ticks: int = 5) -> None:
        for _ in range(ticks):
            self.loop.tick()
            assert self.executor.wait_idle(5)

    def states(self, pool: str = ROLLOUT) -> dict[str, str]:
        return {m.id: m.state.value for m in self.tracker.members(pool)}

    def event_kinds(self) -> list[str]:
        return [json.loads(line)["kind"] for line in (self.events.path or Path()).read_text().splitlines()]


@pytest.fixture
def harness(tmp_path: Path):
    h = Harness(tmp_path)
    yield h
    h.executor.shutdown()


def test_fresh_job_reaches_ready(harness: Harness) -> None:
    harness.settle()
    assert harness.states() == {"rollout-0": "READY", "rollout-1": "READY"}
    assert harness.states(TRAIN) == {"train-0": "READY", "train-1": "READY"}
    member = harness.tracker.member("rollout-0")
    assert [t.target.value for t in member.history] == ["PENDING", "STARTING", "LOADING", "READY"]
    assert harness.loop.tick() == []


def test_vanished_instance_is_failed_and_replaced(harness: Harness) -> None:
    harness.settle()
    harness.clock.t += EARLY_FAILURE_S  # it served a while: replaced at once
    harness.rollout.instances.pop("rollout-0")
    harness.settle()
    states = harness.states()
    assert states["rollout-0"] == "STOPPED"
    assert states["rollout-2"] == "READY" and list(states.values()).count("READY") == 2
    history = [t.target.value for t in harness.tracker.member("rollout-0").history]
    assert history[-2:] == ["FAILED", "STOPPED"]
    assert "member_failed" in harness.event_kinds()


@pytest.mark.parametrize("lost_after_it_started", [False, True], ids=["still-running", "lost-after-it-started"])
def test_a_report_asked_before_a_start_ended_does_not_fail_the_started_instance(
        harness: Harness, lost_after_it_started: bool) -> None:
    """A pool busy with a publish answers its report late; a start that ends meanwhile is missing from it. Such
    an instance was failed at once ("no longer reported by the pool") and stopped, which left a cluster swap
    short of its green set. The next report decides: one the pool really lost is failed then."""
    harness.settle()
    harness.clock.t += EARLY_FAILURE_S
    start_may_end = harness.rollout.gate = threading.Event()  # the start of the third instance waits
    harness.want = dataclasses.replace(harness.want, rollout_instances=3)
    harness.loop.tick()
    assert harness.states()["rollout-2"] == "STARTING"
    asked = harness.rollout.views

    def report_then_the_start_ends() -> list[MemberView]:
        report = asked()  # while rollout-2 still starts
        start_may_end.set()
        assert harness.executor.wait_idle(5)
        if lost_after_it_started:
            harness.rollout.instances.pop("rollout-2")
        return report

    harness.rollout.views = report_then_the_start_ends  # type: ignore[method-assign]
    harness.loop.observe()
    assert harness.states()["rollout-2"] == "READY", "a report older than the start fails nothing"
    harness.rollout.views = asked  # type: ignore[method-assign]
    harness.loop.observe()
    assert harness.states()["rollout-2"] == ("FAILED" if lost_after_it_started else "READY")


def test_an_instance_lost_right_after_it_became_ready_is_replaced_after_a_back_off(harness: Harness) -> None:
    harness.settle()
    harness.rollout.instances.pop("rollout-0")
    harness.settle()
    assert "rollout-2" not in harness.states() and "start_backoff" in harness.event_kinds()
    harness.clock.t += EARLY_FAILURE_BACKOFF_S
    harness.settle()
    assert harness.states()["rollout-2"] == "READY"


def test_failed_create_backs_off_then_retries(harness: Harness) -> None:
    harness.rollout.fail_next.add("create")
    harness.loop.tick()
    harness.executor.wait_idle(5)
    observed = harness.tracker.snapshot(harness.clock())
    assert not observed.rollout.created and "fake create failure" in observed.rollout.error
    assert any("fake create failure" in e for e in observed.errors)
    assert observed.rollout.retry_at > harness.clock()
    harness.loop.tick()  # still backing off: no second create
    harness.executor.wait_idle(5)
    assert harness.rollout.instances == {}
    harness.clock.t += 60
    harness.settle()
    assert list(harness.states().values()).count("READY") == 2
    assert "action_error" in harness.event_kinds()


def test_tick_survives_a_broken_pool_query(harness: Harness) -> None:
    harness.settle()

    def broken() -> list:
        raise ConnectionError("pool unreachable")

    harness.rollout.views = broken  # type: ignore[method-assign]
    assert harness.loop.tick() == []
    assert harness.loop.tick_errors == 1
    assert "tick_error" in harness.event_kinds()


def test_scale_down_drains_then_stops(harness: Harness) -> None:
    harness.settle()
    harness.want = harness.want.evolve("test", rollout_instances=1)
    harness.settle()
    assert sorted(harness.states().values()) == ["READY", "STOPPED"]
    stopped = next(m for m in harness.tracker.members(ROLLOUT) if m.state == S.STOPPED)
    assert [t.target.value for t in stopped.history][-2:] == ["DRAINING", "STOPPED"]
    assert harness.rollout.removed == [(stopped.key, True)]


def test_restarted_controller_adopts_live_servers(tmp_path: Path) -> None:
    """A new controller sees 3 servers left by its predecessor; it wants 2: it binds two, adopts the
    third, and stops the surplus."""
    h = Harness(tmp_path, instances=2, preexisting=3)
    try:
        h.settle()
        assert h.tracker.adopted == 1
        assert sorted(h.states().values()) == ["READY", "READY", "STOPPED"]
        assert len(h.rollout.instances) == 2
        assert "member_adopted" in h.event_kinds()
    finally:
        h.executor.shutdown()


def test_add_in_flight_is_not_adopted_twice(harness: Harness) -> None:
    import threading

    harness.settle()
    harness.want = harness.want.evolve("test", rollout_instances=3)
    gate = threading.Event()
    harness.rollout.gate = gate
    harness.loop.tick()  # add starts and blocks
    harness.rollout._new("rollout-2")  # the server shows up in the pool before start() returns ...
    harness.loop.tick()  # ... and must not be adopted as a fourth member
    gate.set()
    harness.executor.wait_idle(5)
    assert len(harness.tracker.members(ROLLOUT)) == 3


def test_failed_stop_still_leaves_the_pool(harness: Harness) -> None:
    harness.settle()
    harness.want = harness.want.evolve("test", rollout_instances=1)
    harness.rollout.fail_next.add("stop")
    harness.settle()
    states = sorted(harness.states().values())
    assert states == ["READY", "STOPPED"]


@pytest.mark.parametrize(("before", "now", "judged"), [
    (3, 3, 3),
    (3, 4, 3),  # the RL loop published v4 while the tick observed: the observation may still show v3
    (0, 1, 0),
], ids=["unchanged", "published-during-observation", "first-publish"])
def test_a_tick_judges_weights_by_the_version_before_it_observed(before: int, now: int, judged: int) -> None:
    from libra.controller.control_loop import observed_weights

    desired = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout(),
                           weight_version=now, generation=7)
    out = observed_weights(desired, before)
    assert out.weight_version == judged
    assert out.generation == 7 and out.rollout_instances == 2


def test_a_publish_during_observation_plans_no_publish_of_the_newer_version(harness: Harness) -> None:
    """An instance waits outside serving on the current weights (given back after a lend) while the RL loop
    publishes: the tick's observation predates the publish, so it must not plan a publish of its own."""
    harness.settle()
    harness.rollout.instances["rollout-1"].serving = False
    harness.tracker.set_serving(["rollout-0"])
    observe = harness.rollout.views

    def views_while_the_loop_publishes():  # the RL loop raises the version while the tick observes
        views = observe()
        harness.want = dataclasses.replace(harness.want, weight_version=harness.want.weight_version + 1)
        return views

    harness.rollout.views = views_while_the_loop_publishes  # type: ignore[method-assign]
    planned = harness.loop.tick()
    assert [type(a).__name__ for a in planned] == ["SetServing"]
