"""The executor's training-pool handlers against the fake edges: a resize replaces every rank (old members
STOPPED, new ones READY with the new layout), runs under the weight gate, records its cost in the event log and
the switch-cost log; a failed resize leaves no member live and the next one resumes; ShrinkTrainingPool lends
GPUs at the layout closest to the current one that fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.cluster.training_workers import NodesUnreachableError
from libra.controller.actions import CreateTrainingPool, ResizeTrainingPool, ShrinkTrainingPool
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.members import MemberState
from libra.controller.state import TRAIN
from libra.controller.switch_costs import read_switch_costs
from libra.controller.tracker import MemberTracker
from planner.layout import TrainLayout

from .fakes import FakeRolloutEdge, FakeTrainingEdge

S = MemberState


@pytest.fixture
def executor(tmp_path: Path):
    events = EventLog(tmp_path / "events.jsonl")
    ex = Executor(MemberTracker(events), FakeRolloutEdge(gpus=4), FakeTrainingEdge(), events, clock=lambda: 1000.0)
    run(ex, CreateTrainingPool("test", 2, TrainLayout(), ("train-0", "train-1")))
    yield ex
    ex.shutdown()


def run(ex: Executor, *actions) -> None:  # type: ignore[no-untyped-def]
    for future in ex.submit(list(actions)):
        future.result(5)


def events(ex: Executor, kind: str) -> list[dict]:
    lines = (ex.events.path or Path()).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def states(ex: Executor) -> dict[str, str]:
    return {m.id: m.state.value for m in ex.tracker.members(TRAIN)}


def test_resize_replaces_every_rank_and_records_its_cost(executor: Executor) -> None:
    run(executor, ResizeTrainingPool("grow", 3, TrainLayout(), ("train-2", "train-3", "train-4"), 5))
    assert states(executor) == {"train-0": "STOPPED", "train-1": "STOPPED", "train-2": "READY", "train-3": "READY",
                                "train-4": "READY"}
    members = executor.tracker.members(TRAIN)
    assert {m.key for m in members if m.live} == {"rank-0@1", "rank-1@1", "rank-2@1"}
    assert all(m.fingerprint == TrainLayout().label() for m in members if m.live)
    observed = executor.tracker.snapshot(1000.0)
    assert observed.train.size == 3 and not observed.train.busy
    (resize,) = events(executor, "train_resize")
    assert (resize["from_gpus"], resize["to_gpus"], resize["generation"]) == (2, 3, 5)
    assert {"save_s", "stop_s", "start_s", "load_s", "switch_s"} <= set(resize)
    (cost,) = read_switch_costs(Path(executor.events.path or "").parent / "switch_costs.jsonl")
    assert cost["to_gpus"] == 3 and cost["first_step_s"] == 0.3 and cost["resize_id"] == resize["resize_id"]


def test_relayout_with_the_same_gpus(executor: Executor) -> None:
    run(executor, ResizeTrainingPool("tp2", 2, TrainLayout(tp=2), ("train-2", "train-3")))
    live = [m for m in executor.tracker.members(TRAIN) if m.live]
    assert [m.id for m in live] == ["train-2", "train-3"]
    assert all(m.fingerprint == TrainLayout(tp=2).label() for m in live)


def test_resize_waits_for_the_weight_gate(executor: Executor) -> None:
    with executor.gate.hold("publish v3 (the RL loop's step boundary)"):
        futures = executor.submit([ResizeTrainingPool("grow", 3, TrainLayout(), ("train-2", "train-3", "train-4"))])
        assert not futures[0].done()
        assert executor.train.resizes == []  # type: ignore[attr-defined]
        assert executor.tracker.snapshot(1000.0).train.busy  # the next tick sees the change in flight
    futures[0].result(5)
    assert executor.train.resizes == [(3, TrainLayout())]  # type: ignore[attr-defined]


def test_failed_resize_leaves_no_live_rank_and_the_next_one_resumes(executor: Executor) -> None:
    executor.train.fail_resize = True  # type: ignore[attr-defined]
    run(executor, ResizeTrainingPool("grow", 3, TrainLayout(), ("train-2", "train-3", "train-4")))
    assert set(states(executor).values()) == {"STOPPED"}
    (error,) = events(executor, "action_error")
    assert error["action"] == "ResizeTrainingPool" and "fake training resize failure" in error["message"]
    observed = executor.tracker.snapshot(1000.0)
    assert not observed.train.busy and observed.train.created and observed.train.retry_at > 1000.0
    run(executor, ResizeTrainingPool("retry", 3, TrainLayout(), ("train-5", "train-6", "train-7")))
    assert [m.id for m in executor.tracker.members(TRAIN) if m.live] == ["train-5", "train-6", "train-7"]


@pytest.mark.parametrize(("gpus", "layout", "lend", "expected"), [
    (3, TrainLayout(), 2, (1, TrainLayout())),
    (4, TrainLayout(tp=2), 1, (3, TrainLayout())),  # TP 2 does not divide 3 GPUs: TP 1
    (4, TrainLayout(tp=2), 2, (2, TrainLayout(tp=2))),
], ids=["dp", "tp-lowered", "tp-kept"])
def test_shrink_lends_gpus_at_a_layout_that_fits(executor: Executor, gpus: int, layout: TrainLayout, lend: int,
                                                 expected: tuple[int, TrainLayout]) -> None:
    ids = tuple(f"train-{i}" for i in range(2, 2 + gpus))
    run(executor, ResizeTrainingPool("setup", gpus, layout, ids))
    run(executor, ShrinkTrainingPool("cluster_swap: the green set needs more GPUs", lend))
    assert executor.train.resizes[-1] == expected  # type: ignore[attr-defined]
    assert len([m for m in executor.tracker.members(TRAIN) if m.live]) == expected[0]


def test_restart_after_a_lost_worker_replaces_every_rank_at_the_same_layout(executor: Executor) -> None:
    cost = executor.training.restart("a training worker died: rank 0")
    assert cost["switch_s"] == 0.3
    assert states(executor) == {"train-0": "STOPPED", "train-1": "STOPPED", "train-2": "READY", "train-3": "READY"}
    assert {m.key for m in executor.tracker.members(TRAIN) if m.live} == {"rank-0@1", "rank-1@1"}
    observed = executor.tracker.snapshot(1000.0)
    assert observed.train.size == 2 and not observed.train.busy
    (restart,) = events(executor, "train_restart")
    assert restart["message"] == "a training worker died: rank 0" and restart["to_gpus"] == 2
    assert events(executor, "train_resize") == []  # not a resize: the re-planner's switch costs stay as they were
    assert read_switch_costs(Path(executor.events.path or "").parent / "switch_costs.jsonl") == []


def test_a_failed_create_leaves_no_rank_and_its_retry_is_converged(tmp_path: Path) -> None:
    """A training pool whose start failed (e.g. its rendezvous port was taken) and then started on the retry
    is the desired pool: the failed start's ranks hold no GPU (STOPPED), so no resize is planned. They stayed
    FAILED, counted as held, and the job resized a pool that had not taken its first step."""
    from libra.controller.reconcile import reconcile
    from libra.controller.state import DesiredState

    event_log = EventLog(tmp_path / "events.jsonl")
    train = FakeTrainingEdge()
    train.fail_next = True
    ex = Executor(MemberTracker(event_log), FakeRolloutEdge(gpus=4), train, event_log, clock=lambda: 1000.0)
    try:
        run(ex, CreateTrainingPool("test", 2, TrainLayout(), ("train-0", "train-1")))
        assert "fake training start failure" in events(ex, "action_error")[0]["message"]
        assert states(ex) == {"train-0": "STOPPED", "train-1": "STOPPED"}
        run(ex, CreateTrainingPool("retry", 2, TrainLayout(), ("train-2", "train-3")))
        assert states(ex) == {"train-0": "STOPPED", "train-1": "STOPPED", "train-2": "READY", "train-3": "READY"}
        want = DesiredState(rollout_instances=0, rollout_tp=1, train_gpus=2, train_layout=TrainLayout())
        observed = ex.tracker.snapshot(2000.0)
        assert [a for a in reconcile(observed, want) if "Training" in type(a).__name__] == []
    finally:
        ex.shutdown()


@pytest.mark.parametrize(("failure", "recorded"), [
    (lambda: RuntimeError("start failed"), False),
    (lambda: NodesUnreachableError("libra-train: the nodes of its ranks cannot all reach each other",
                                   [("a", "b")], ["b"], {"a": "10.0.0.2", "b": "10.0.0.3"}), True),
], ids=["other-failure-retried", "unreachable-nodes-recorded-for-the-launch"])
def test_a_first_start_on_nodes_that_cannot_reach_each_other_is_recorded(tmp_path: Path, failure, recorded) -> None:
    """A retry would place the pool on the same nodes, so the launch stops on it (`Controller._start_pools`)."""
    event_log = EventLog(tmp_path / "events.jsonl")
    train = FakeTrainingEdge()

    def create(gpus: int, layout: TrainLayout):  # type: ignore[no-untyped-def]
        raise RuntimeError("training pool start failed") from failure()

    train.create = create  # type: ignore[method-assign]
    ex = Executor(MemberTracker(event_log), FakeRolloutEdge(gpus=4), train, event_log, clock=lambda: 1000.0)
    try:
        run(ex, CreateTrainingPool("test", 2, TrainLayout(), ("train-0", "train-1")))
        found = ex.training_nodes_unreachable
        assert (found is not None) is recorded
        assert found is None or (isinstance(found, NodesUnreachableError) and found.fence == ["b"])
    finally:
        ex.shutdown()
