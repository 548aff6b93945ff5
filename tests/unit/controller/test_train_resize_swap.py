"""Training-pool changes carried out tick by tick by the control loop on fake pools: a cluster swap 2+2 -> 3+1
-> 2+2 on 4 GPUs (never more than 4 GPUs held, never without a serving rollout instance, ends converged), a
training re-layout, plan-only mode (a decision and no action), and a restarted controller that finishes a
training change from the checkpointed desired state."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from libra.controller.control_loop import ControlLoop
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.gate import WeightGate
from libra.controller.members import MemberState
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureTarget,
    finish_if_converged,
    plan_reconfigure,
)
from libra.controller.state import TRAIN, DesiredState, ObservedState
from libra.controller.tracker import MemberTracker
from planner.layout import TrainLayout
from planner.model_spec import model_spec_from_dict

from .fakes import FakeRolloutEdge, FakeTrainingEdge

MODEL = model_spec_from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100})


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class SwapJob:
    """Tracker + executor + control loop on fake pools sharing `cluster` GPUs (both pools counted by the test)."""

    def __init__(self, tmp_path: Path, cluster: int = 4, train: int = 2, instances: int = 2,
                 train_edge: FakeTrainingEdge | None = None, desired: DesiredState | None = None) -> None:
        self.clock = Clock()
        self.events = EventLog(tmp_path / "events.jsonl")
        self.tracker = MemberTracker(self.events)
        self.rollout = FakeRolloutEdge()
        self.train = train_edge or FakeTrainingEdge()
        self.executor = Executor(self.tracker, self.rollout, self.train, self.events, clock=self.clock,
                                 gate=WeightGate())
        self.cluster = cluster
        self.want = desired or DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=train,
                                            train_layout=TrainLayout(), rollout_fingerprint="fp-tp1",
                                            cluster_gpus=cluster, cluster_swap_enabled=True, generation=1)
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout, self.train, lambda: self.want,
                                self.events, clock=self.clock, on_observed=self._on_observed)
        self.held: list[int] = []
        self.serving: list[list[str]] = []

    def _on_observed(self, observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None:
            self.want = done
            self.events.emit("reconfigure_done", desired.reconfiguring)

    def request(self, target: ReconfigureTarget, strategy: str | None = None, plan_only: bool = False) -> None:
        limits = ReconfigureLimits(enabled=True, cluster_swap_enabled=True, gpus_per_node=4, model=MODEL,
                                   drain_before_stop=True, fingerprint_for=lambda tp: f"fp-tp{tp}",
                                   reconfigure_training=True, training_plan_only=plan_only)
        self.want = plan_reconfigure(self.want, target, strategy, limits, self.tracker.snapshot(self.clock()))

    def settle(self, ticks: int = 30) -> None:
        for _ in range(ticks):
            self.loop.tick()
            assert self.executor.wait_idle(5)
            self.held.append(sum(i.tp for i in self.rollout.instances.values()) + len(self.train.workers))
            self.serving.append(self.rollout.serving())
            self.clock.t += 1

    def kinds(self) -> list[str]:
        return [json.loads(line)["kind"] for line in (self.events.path or Path()).read_text().splitlines()]

    def actions(self, kind: str) -> list[dict]:
        lines = (self.events.path or Path()).read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["kind"] == "action" and e["action"] == kind]


@pytest.fixture
def job(tmp_path: Path):
    jobs: list[SwapJob] = []

    def make(**kwargs) -> SwapJob:  # type: ignore[no-untyped-def]
        folder = tmp_path / f"job{len(jobs)}"
        folder.mkdir()
        jobs.append(SwapJob(folder, **kwargs))
        jobs[-1].settle(3)
        return jobs[-1]

    yield make
    for j in jobs:
        j.executor.shutdown()


def test_cluster_swap_two_two_to_three_one_and_back(job) -> None:
    j = job()
    assert (len(j.train.workers), len(j.rollout.instances)) == (2, 2)
    j.request(ReconfigureTarget(rollout_instances=1), "cluster_swap")
    assert (j.want.train_gpus, j.want.rollout_instances) == (3, 1)
    j.settle()
    assert (len(j.train.workers), len(j.rollout.serving())) == (3, 1) and not j.want.reconfiguring
    assert j.train.resizes == [(3, TrainLayout())]  # the rollout GPU was released first, then training grew
    j.request(ReconfigureTarget(rollout_instances=2), "cluster_swap")
    j.settle()
    assert (len(j.train.workers), len(j.rollout.serving())) == (2, 2) and not j.want.reconfiguring
    # back: training lent 2 GPUs for the green set (3 -> 1), then took back what the old instance freed (1 -> 2)
    assert j.train.resizes == [(3, TrainLayout()), (1, TrainLayout()), (2, TrainLayout())]
    assert max(j.held) <= 4, j.held
    assert all(j.serving), "the rollout pool was left without a serving instance"
    assert j.kinds().count("reconfigure_done") == 2 and j.kinds().count("train_resize") == 3


def test_training_relayout_through_the_control_loop(job) -> None:
    j = job(cluster=8)
    j.request(ReconfigureTarget(train_gpus=4, train_tp=2))
    j.settle(5)
    assert j.train.resizes == [(4, TrainLayout(tp=2))] and not j.want.reconfiguring
    live = [m for m in j.tracker.members(TRAIN) if m.live]
    assert len(live) == 4 and {m.fingerprint for m in live} == {TrainLayout(tp=2).label()}
    assert sorted(j.rollout.instances) == ["rollout-0", "rollout-1"]  # the rollout pool was not touched


def test_plan_only_makes_a_decision_and_no_action(job) -> None:
    j = job(cluster=8)
    before = j.want
    j.request(ReconfigureTarget(train_gpus=4, train_tp=2), plan_only=True)
    j.settle(5)
    assert j.want.planned_training.startswith("plan only: training 2 GPUs") and not j.want.reconfiguring
    assert (j.want.train_gpus, j.want.train_layout, j.want.generation) == (2, TrainLayout(), before.generation)
    assert j.train.resizes == [] and j.actions("ResizeTrainingPool") == []
    assert len(j.train.workers) == 2


def test_restarted_controller_finishes_a_training_change(tmp_path: Path, job) -> None:
    """The desired state checkpointed mid-resize is all a new controller needs: it creates the training pool at
    the target, and the change ends (the job resumes its training state from its checkpoint)."""
    j = job(cluster=8)
    j.train.gate = threading.Event()  # the resize blocks: the controller dies in the middle of it
    j.request(ReconfigureTarget(train_gpus=3))
    j.loop.tick()
    path = tmp_path / "desired_state.json"
    j.want.save(path)
    j.train.gate.set()
    restored = DesiredState.load(path)
    assert restored is not None and restored.train_gpus == 3 and restored.reconfiguring
    (tmp_path / "second").mkdir()
    fresh = SwapJob(tmp_path / "second", desired=restored)
    try:
        fresh.settle(5)
        assert fresh.train.layouts == [(3, TrainLayout())]  # created at the target, no resize needed
        assert not fresh.want.reconfiguring and "reconfigure_done" in fresh.kinds()
    finally:
        fresh.executor.shutdown()


def test_a_green_instance_that_fails_mid_swap_is_replaced_before_training_grows_back(job) -> None:
    """Swapping back to 2 instances, one of the green set fails as it starts: the GPU it frees waits for its
    replacement (after the start back-off), not for the training pool, which grows back only once the switch
    has drained the old instance. Before, training took that GPU back during the back-off, the green set then
    lacked one and the training pool refused to lend it again (the pool counted blue and green together as the
    2 instances wanted): the swap never ended."""
    j = job()
    j.request(ReconfigureTarget(rollout_instances=1), "cluster_swap")
    j.settle()
    j.request(ReconfigureTarget(rollout_instances=2), "cluster_swap")
    for _ in range(30):
        j.loop.tick()
        assert j.executor.wait_idle(5)
        j.clock.t += 1
        green = sorted(k for k, i in j.rollout.instances.items() if not i.serving)
        if len(green) == 2:
            break
    assert len(green) == 2, j.rollout.instances
    j.rollout.instances[green[-1]].state = MemberState.FAILED  # the pool reports it failed
    j.settle(40)
    assert (len(j.train.workers), len(j.rollout.serving())) == (2, 2) and not j.want.reconfiguring
    assert j.train.resizes == [(3, TrainLayout()), (1, TrainLayout()), (2, TrainLayout())], j.train.resizes
    assert max(j.held) <= 4, j.held
    assert all(j.serving), "the rollout pool was left without a serving instance"
