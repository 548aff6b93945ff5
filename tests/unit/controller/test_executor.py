"""The executor's handler table: one handler per action type, each checked against the fake pool edges."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from libra.controller import actions as action_module
from libra.controller.events import EventLog
from libra.controller.executor import Executor, PublishOutcome
from libra.controller.gate import WeightsRef
from libra.controller.members import MemberState
from libra.controller.reconcile import (
    Action,
    CreateRolloutPool,
    MarkFailed,
    PublishWeights,
    SetServing,
    ShrinkTrainingPool,
    StartRolloutInstance,
    StopRolloutInstance,
    StrategyFallback,
)
from libra.controller.state import ROLLOUT, RolloutSpec
from libra.controller.tracker import MemberTracker

from .fakes import FakeRolloutEdge, FakeTrainingEdge

S = MemberState
SPEC = RolloutSpec(1, "fp-tp1")


@pytest.fixture
def executor(tmp_path: Path):
    events = EventLog(tmp_path / "events.jsonl")
    rollout = FakeRolloutEdge(gpus=4)
    rollout.launch_version = 0
    ex = Executor(MemberTracker(events), rollout, FakeTrainingEdge(), events, clock=lambda: 1000.0)
    ex.submit([CreateRolloutPool("test", 2, ("rollout-0", "rollout-1"), SPEC, 1)])
    assert ex.wait_idle(5)
    yield ex
    ex.shutdown()


def run(ex: Executor, *actions: Action) -> None:
    for future in ex.submit(list(actions)):
        future.result(5)


def kinds(ex: Executor) -> list[str]:
    return [json.loads(line)["kind"] for line in (ex.events.path or Path()).read_text().splitlines()]


def test_every_action_type_has_a_handler(executor: Executor) -> None:
    declared = {cls for cls in vars(action_module).values()
                if isinstance(cls, type) and issubclass(cls, Action) and cls is not Action}
    assert set(executor.handlers) == declared


def test_an_action_without_a_handler_is_named(executor: Executor) -> None:
    @dataclass(frozen=True)
    class Teleport(Action):
        pass

    with pytest.raises(TypeError, match="no handler for Teleport"):
        executor.submit([Teleport("test")])


def test_create_binds_members_to_instances_of_the_same_id(executor: Executor) -> None:
    members = {m.id: m for m in executor.tracker.members(ROLLOUT)}
    assert {k: (m.key, m.state, m.serving, m.tp, m.generation) for k, m in members.items()} == {
        "rollout-0": ("rollout-0", S.READY, True, 1, 1), "rollout-1": ("rollout-1", S.READY, True, 1, 1)}


def test_start_publish_serve_stop(executor: Executor) -> None:
    fake = executor.rollout
    assert isinstance(fake, FakeRolloutEdge)
    run(executor, StartRolloutInstance("test", "rollout-2", RolloutSpec(2, "fp-tp2"), 3))
    member = executor.tracker.member("rollout-2")
    assert (member.state, member.serving, member.tp, len(member.gpu_ids), member.generation) == (S.READY, False, 2, 2, 3)
    executor.publish_weights(WeightsRef(5, "/w/5", "c5"))
    assert all(m.weight_version == 5 for m in executor.tracker.members(ROLLOUT))
    run(executor, SetServing("test", ("rollout-0", "rollout-2")))
    assert fake.serving() == ["rollout-0", "rollout-2"]
    assert [m.id for m in executor.tracker.members(ROLLOUT) if m.serving] == ["rollout-0", "rollout-2"]
    run(executor, StopRolloutInstance("test", "rollout-0", True))
    assert executor.tracker.member("rollout-0").state == S.STOPPED and fake.removed == [("rollout-0", True)]
    assert [t.target for t in executor.tracker.member("rollout-0").history][-2:] == [S.DRAINING, S.STOPPED]


def test_publish_action_records_acks_only(executor: Executor) -> None:
    executor.gate.set_current(WeightsRef(7, "/w/7", "c7"))
    run(executor, PublishWeights("test", 7, ("rollout-1",)))
    versions = {m.id: m.weight_version for m in executor.tracker.members(ROLLOUT)}
    assert versions == {"rollout-0": 0, "rollout-1": 7}
    assert not executor.tracker.member("rollout-1").busy



def test_a_member_left_out_of_a_publish_is_failed_for_replacement(executor: Executor) -> None:
    """The pool left out an instance whose server failed during the publish: its member is FAILED at once (the
    next tick replaces it), keeps its old version, and the event log says why."""
    def publish(weights: WeightsRef, keys: object) -> PublishOutcome:
        return PublishOutcome({"rollout-0": weights.version}, {}, left_out={"rollout-1": "reload failed: gone"})

    executor.rollout.publish = publish  # type: ignore[method-assign]
    executor.publish_weights(WeightsRef(5, "/w/5", "c5"))
    members = {m.id: (m.state, m.weight_version) for m in executor.tracker.members(ROLLOUT)}
    assert members == {"rollout-0": (S.READY, 5), "rollout-1": (S.FAILED, 0)}
    assert "server failed during a publish" in executor.tracker.member("rollout-1").error
    assert "publish_left_out" in kinds(executor)

def test_refused_flip_is_an_error_and_changes_nothing(executor: Executor) -> None:
    executor.gate.set_current(WeightsRef(7, "/w/7", "c7"))
    executor.rollout.published = 7  # type: ignore[attr-defined]  # the pool moved on; rollout-1 still holds v0
    run(executor, SetServing("test", ("rollout-1",)))
    assert "action_error" in kinds(executor)
    assert executor.rollout.serving() == ["rollout-0", "rollout-1"]  # type: ignore[attr-defined]
    assert not executor.tracker.snapshot(1000.0).rollout.busy


def test_failed_start_fails_the_member(executor: Executor) -> None:
    executor.rollout.fail_next.add("start")  # type: ignore[attr-defined]
    run(executor, StartRolloutInstance("test", "rollout-2", SPEC))
    assert executor.tracker.member("rollout-2").state == S.FAILED


def test_inline_actions(executor: Executor) -> None:
    assert executor.submit([MarkFailed("timeout", "rollout-0"), StrategyFallback("no spare", "blue_green", "diff")]) == []
    assert executor.tracker.member("rollout-0").state == S.FAILED
    assert "strategy_fallback" in kinds(executor)


def test_training_shrink_never_lends_the_last_gpu(executor: Executor) -> None:
    """(Lending GPUs of a running training pool: tests/unit/controller/test_train_resize_executor.py.)"""
    run(executor, ShrinkTrainingPool("swap", 2))
    errors = [json.loads(line) for line in (executor.events.path or Path()).read_text().splitlines()
              if json.loads(line)["kind"] == "action_error"]
    assert "cannot lend 2 GPU(s): the training pool runs 0 and keeps at least one" in errors[-1]["message"]
