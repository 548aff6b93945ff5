"""Reconfiguring the rollout pool of a running job against fake pool edges: requests checked and refused,
each strategy carried out tick by tick through the executor (2 -> 3 -> 1 instances, TP 1 -> 2), the serving
set never empty under blue_green and prewarm, and the weight gate ordering publishes and membership changes."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

from libra.controller.control_loop import ControlLoop
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.gate import WeightGate, WeightsRef
from libra.controller.members import MemberState
from libra.controller.reconcile import SetServing
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureRefused,
    ReconfigureTarget,
    finish_if_converged,
    plan_reconfigure,
    trigger_switch,
)
from libra.controller.state import ROLLOUT, DesiredState, ObservedState, TrainLayout
from libra.controller.tracker import MemberTracker
from planner.model_spec import model_spec_from_dict

from .fakes import FakeRolloutEdge, FakeTrainingEdge

S = MemberState
MODEL = model_spec_from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100})


def limits(enabled: bool = True, swap: bool = False, drain: bool = True, gpus_per_node: int = 4,
           training: bool = False) -> ReconfigureLimits:
    return ReconfigureLimits(enabled=enabled, cluster_swap_enabled=swap, gpus_per_node=gpus_per_node, model=MODEL,
                             drain_before_stop=drain, fingerprint_for=lambda tp: f"fp-tp{tp}",
                             reconfigure_training=training)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Job:
    """Tracker + executor + control loop on fake pools, with the controller's reconfiguration bookkeeping."""

    def __init__(self, tmp_path: Path, cluster: int = 8, train: int = 2, instances: int = 2,
                 strategy: str = "diff") -> None:
        self.clock = Clock()
        self.events = EventLog(tmp_path / "events.jsonl")
        self.tracker = MemberTracker(self.events)
        self.rollout = FakeRolloutEdge(gpus=cluster - train)
        self.gate = WeightGate()
        self.train = FakeTrainingEdge()
        self.executor = Executor(self.tracker, self.rollout, self.train, self.events, clock=self.clock,
                                 gate=self.gate)
        self.want = DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=train,
                                 train_layout=TrainLayout(), rollout_fingerprint="fp-tp1", cluster_gpus=cluster,
                                 reconfigure_strategy=strategy, generation=1)
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout, self.train, lambda: self.want,
                                self.events, clock=self.clock, on_observed=self._on_observed)
        self.serving_history: list[list[str]] = []

    def _on_observed(self, observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None:
            self.want = done
            self.events.emit("reconfigure_done", desired.reconfiguring)

    def request(self, instances: int | None = None, tp: int | None = None, strategy: str | None = None,
                **limit_args: bool) -> DesiredState:
        self.want = plan_reconfigure(self.want, ReconfigureTarget(instances, tp), strategy, limits(**limit_args),
                                     self.tracker.snapshot(self.clock()))
        return self.want

    def settle(self, ticks: int = 25) -> None:
        for _ in range(ticks):
            self.loop.tick()
            assert self.executor.wait_idle(5)
            self.serving_history.append([k for k in self.rollout.serving()
                                         if self.rollout.instances[k].state == S.READY])
            self.clock.t += 1

    def publish(self, version: int) -> None:
        self.executor.publish_weights(WeightsRef(version, f"/weights/{version}", f"sum{version}"))
        self.want = dataclasses.replace(self.want, weight_version=version)

    def layout(self) -> list[tuple[str, int, bool]]:
        return [(k, i.tp, i.serving) for k, i in sorted(self.rollout.instances.items())]

    def event_kinds(self) -> list[str]:
        return [json.loads(line)["kind"] for line in (self.events.path or Path()).read_text().splitlines()]


@pytest.fixture
def job(tmp_path: Path):
    jobs: list[Job] = []

    def make(**kwargs: int | str) -> Job:
        jobs.append(Job(tmp_path, **kwargs))  # type: ignore[arg-type]
        jobs[-1].settle(3)
        return jobs[-1]

    yield make
    for j in jobs:
        j.executor.shutdown()


STRATEGY_NAMES = ["diff", "restart_all", "blue_green", "prewarm"]


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_two_to_three_to_one(job, strategy: str) -> None:
    j = job()
    j.publish(3)
    for count in (3, 1):
        j.request(instances=count, strategy=strategy)
        j.settle()
        if strategy == "prewarm":
            assert j.want.reconfiguring, "prewarm flips only on the trigger"
            j.want = trigger_switch(j.want)
            j.settle()
        assert not j.want.reconfiguring and "reconfigure_done" in j.event_kinds()
        layout = j.layout()
        assert len(layout) == count and all(tp == 1 and serving for _, tp, serving in layout), layout
        assert all(i.weight_version == 3 for i in j.rollout.instances.values())
        assert {m.id for m in j.tracker.members(ROLLOUT) if m.live} == set(j.rollout.instances)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_tp_one_to_two(job, strategy: str) -> None:
    j = job()
    j.request(tp=2, strategy=strategy)
    j.settle()
    if strategy == "prewarm":
        j.want = trigger_switch(j.want)
        j.settle()
    layout = j.layout()
    assert len(layout) == 2 and all(tp == 2 and serving for _, tp, serving in layout), layout
    assert not j.want.reconfiguring


def test_diff_touches_only_the_difference(job) -> None:
    j = job()
    j.request(instances=3, strategy="diff")
    j.settle()
    assert [op for op in j.rollout.ops if op[0] in ("start", "stop")] == [("start", "rollout-2")]
    j.request(instances=2, strategy="diff")
    j.settle()
    assert [op for op in j.rollout.ops if op[0] == "stop"] == [("stop", "rollout-2")]
    assert sorted(j.rollout.instances) == ["rollout-0", "rollout-1"]


@pytest.mark.parametrize("strategy", ["blue_green", "prewarm"])
def test_switch_never_leaves_the_pool_without_a_serving_instance(job, strategy: str) -> None:
    j = job()
    j.publish(2)
    j.request(instances=3, tp=1, strategy=strategy)
    j.settle(10)
    j.publish(3)  # a weight sync while the green set waits: it is kept on current weights
    j.settle(10)
    if strategy == "prewarm":
        assert sorted(j.rollout.serving()) == ["rollout-0", "rollout-1"]  # prewarmed, not switched
        assert all(i.weight_version == 3 for i in j.rollout.instances.values())
        j.want = trigger_switch(j.want)
    j.settle()
    assert all(serving for serving in j.serving_history), j.serving_history
    assert sorted(j.rollout.serving()) == ["rollout-2", "rollout-3", "rollout-4"]
    assert sorted(j.rollout.removed) == [("rollout-0", True), ("rollout-1", True)]
    flips = [op for op in j.rollout.ops if op[0] == "serve"]
    assert flips == [("serve", "rollout-2", "rollout-3", "rollout-4")]  # one atomic flip


def test_blue_green_without_spare_gpus_falls_back_to_diff(job) -> None:
    j = job(cluster=6, train=3)  # 3 rollout GPUs: 2 run, the green set of 3 cannot start beside them
    j.request(instances=3, strategy="blue_green")
    j.settle()
    assert j.event_kinds().count("strategy_fallback") == 1
    assert sorted(j.rollout.instances) == ["rollout-0", "rollout-1", "rollout-2"]
    assert [op for op in j.rollout.ops if op[0] == "stop"] == []


def test_drain_setting_decides_drain_or_abort(job) -> None:
    j = job(instances=3)
    j.request(instances=1, strategy="diff", drain=False)
    j.settle()
    assert [drain for _, drain in j.rollout.removed] == [False, False]


def test_cluster_swap_borrows_training_gpus_for_the_green_set(job) -> None:
    """(More swaps: tests/unit/controller/test_train_resize_swap.py.)"""
    j = job(cluster=6, train=3)
    j.rollout.gpus = 0  # the fake rollout pool has no budget of its own: both pools are counted below
    j.request(instances=3, strategy="cluster_swap", swap=True, training=True)
    held = []
    for _ in range(25):
        j.settle(1)
        held.append(len(j.rollout.instances) + len(j.train.workers))
    assert max(held) <= 6, held
    assert j.train.resizes == [(1, TrainLayout()), (3, TrainLayout())]  # lent 2 GPUs, then took them back
    assert sorted(j.rollout.serving()) == ["rollout-2", "rollout-3", "rollout-4"]
    assert all(serving for serving in j.serving_history)
    assert not j.want.reconfiguring


def test_restarted_controller_finishes_the_change(tmp_path: Path, job) -> None:
    """The desired state (checkpointed mid-switch) and what runs are all a new controller needs."""
    j = job()
    j.request(instances=3, tp=2, strategy="blue_green")
    j.settle(2)  # part of the green set is up
    path = tmp_path / "desired_state.json"
    j.want.save(path)
    restored = DesiredState.load(path)
    assert restored is not None and restored.reconfiguring == j.want.reconfiguring
    (tmp_path / "second").mkdir()
    fresh = Job(tmp_path / "second", cluster=8, train=2)
    try:
        fresh.rollout = j.rollout  # the same servers, seen by a new tracker
        fresh.executor.rollout = j.rollout
        fresh.loop.rollout = j.rollout
        fresh.want = restored
        fresh.settle(30)
        layout = fresh.layout()
        assert len(layout) == 3 and all(tp == 2 and serving for _, tp, serving in layout), layout
        assert not fresh.want.reconfiguring
        assert "member_adopted" in fresh.event_kinds()
    finally:
        fresh.executor.shutdown()


# ---- requests --------------------------------------------------------------------------------------------
BASE = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout(), cluster_gpus=8,
                    rollout_fingerprint="fp-tp1", generation=4)
EMPTY = ObservedState(now=0.0)


@pytest.mark.parametrize(
    ("desired", "target", "strategy", "limit_args", "message"),
    [
        pytest.param(BASE, ReconfigureTarget(3), "diff", {"enabled": False}, "runtime_dynamic_reconfiguration_enabled",
                     id="master-switch-off"),
        pytest.param(BASE, ReconfigureTarget(3), "warp", {}, "strategy 'warp' is unknown", id="unknown-strategy"),
        pytest.param(BASE, ReconfigureTarget(3), "cluster_swap", {}, "runtime_cluster_swap_enabled",
                     id="cluster-swap-switch-off"),
        pytest.param(BASE, ReconfigureTarget(0), "diff", {}, "at least one rollout instance", id="zero-instances"),
        pytest.param(BASE, ReconfigureTarget(rollout_tp=3), "diff", {}, "does not divide the 4 attention heads",
                     id="tp-not-dividing-heads"),
        pytest.param(BASE, ReconfigureTarget(1, 4), "diff", {"gpus_per_node": 2}, "would span nodes",
                     id="tp-across-nodes"),
        pytest.param(BASE, ReconfigureTarget(7), "diff", {}, "ask for at most 6 instances", id="not-enough-gpus"),
        pytest.param(BASE, ReconfigureTarget(2, 1), "diff", {}, "nothing to change", id="no-change"),
        pytest.param(dataclasses.replace(BASE, reconfiguring="generation 4: rollout 1 x TP1 -> 2 x TP1 by diff"),
                     ReconfigureTarget(3), "diff", {}, r"another reconfiguration is running \(generation 4: rollout 1",
                     id="concurrent-request"),
    ],
)
def test_refused_requests(desired: DesiredState, target: ReconfigureTarget, strategy: str,
                          limit_args: dict[str, bool | int], message: str) -> None:
    with pytest.raises(ReconfigureRefused, match=message):
        plan_reconfigure(desired, target, strategy, limits(**limit_args), EMPTY)  # type: ignore[arg-type]


def test_accepted_request_bumps_generation_and_names_the_change() -> None:
    new = plan_reconfigure(BASE, ReconfigureTarget(3, 2), None, limits(drain=False), EMPTY)
    assert (new.rollout_instances, new.rollout_tp, new.rollout_fingerprint) == (3, 2, "fp-tp2")
    assert new.generation == 5 and new.reconfigure_strategy == "diff" and not new.drain_before_stop
    assert new.reconfiguring == "generation 5: rollout 2 x TP1 -> 3 x TP2 by diff"
    assert plan_reconfigure(BASE, ReconfigureTarget(3), "prewarm", limits(), EMPTY).switch_now is False


def test_second_request_refused_while_the_first_runs(job) -> None:
    j = job()
    j.rollout.gate = threading.Event()  # starts block: the first change stays in flight
    first = j.request(instances=3, strategy="diff")
    j.loop.tick()
    with pytest.raises(ReconfigureRefused, match=f"another reconfiguration is running \\({first.reconfiguring}\\)"):
        j.request(instances=1, strategy="diff")
    j.rollout.gate.set()
    j.settle()
    assert j.request(instances=1, strategy="diff").rollout_instances == 1


# ---- the weight gate -------------------------------------------------------------------------------------
def test_membership_change_waits_for_a_publish_in_progress(job) -> None:
    j = job()
    ids = tuple(sorted(j.rollout.instances))
    with j.gate.hold("publish v1 (the RL loop's step boundary)"):
        futures = j.executor.submit([SetServing("test", ids[:1])])
        assert not futures[0].done()
        assert [op for op in j.rollout.ops if op[0] == "serve"] == []
        j.rollout.ops.append(("publish-finished",))
    futures[0].result(5)
    assert j.rollout.ops[-2:] == [("publish-finished",), ("serve", ids[0])]


def test_new_instance_gets_current_weights_before_it_serves(job) -> None:
    j = job()
    j.publish(4)
    j.rollout.launch_version = 0  # new servers come up on the base model
    j.request(instances=3, strategy="diff")
    j.settle()
    ops = [op for op in j.rollout.ops if "rollout-2" in op]
    assert ops == [("start", "rollout-2"), ("publish", "4", "rollout-2"),
                   ("serve", "rollout-0", "rollout-1", "rollout-2")]
    assert j.tracker.member("rollout-2").weight_version == 4  # from its ACK


def test_publish_without_exported_weights_is_an_error_not_a_failed_member(job) -> None:
    j = job()
    j.want = dataclasses.replace(j.want, weight_version=9)  # a version nothing exported through the gate
    j.rollout.launch_version = 0
    j.request(instances=3, strategy="diff")
    j.settle(3)
    assert "no exported weights of publish version 9" in " ".join(
        json.loads(line).get("message", "") for line in (j.events.path or Path()).read_text().splitlines())
    assert j.tracker.member("rollout-2").state == S.READY and not j.tracker.member("rollout-2").serving


@pytest.mark.parametrize(("held", "planned", "loads"), [
    pytest.param(4, 4, 4, id="same-version"),
    pytest.param(6, 4, 6, id="newer-publish-supersedes-the-planned-one"),
    pytest.param(3, 4, None, id="older-is-an-error"),
    pytest.param(None, 4, None, id="nothing-exported-is-an-error"),
])
def test_gate_weights_for_a_planned_publish(held: int | None, planned: int, loads: int | None) -> None:
    gate = WeightGate()
    if held is not None:
        gate.set_current(WeightsRef(held, f"/w/v{held}", "sum"))
    if loads is None:
        with pytest.raises(LookupError, match=f"publish version {planned}"):
            gate.weights_for(planned)
    else:
        assert gate.weights_for(planned).version == loads


# ---- the desired-state store -----------------------------------------------------------------------------
def test_store_checkpoints_every_change_and_refuses_stale_replacements(tmp_path: Path) -> None:
    from libra.controller.desired_store import DesiredStore

    path = tmp_path / "desired_state.json"
    store = DesiredStore(path, BASE)
    requested = store.change(lambda d: plan_reconfigure(d, ReconfigureTarget(3), "diff", limits(), EMPTY))
    assert DesiredState.load(path) == requested
    store.update(weight_version=7)  # the RL loop records a publish meanwhile
    done = dataclasses.replace(requested, reconfiguring="")
    assert not store.replace_if(requested, done)  # judged on a state that is no longer current
    assert store.get().reconfiguring and store.get().weight_version == 7
    with pytest.raises(ReconfigureRefused):
        store.change(lambda d: plan_reconfigure(d, ReconfigureTarget(1), "diff", limits(), EMPTY))
    assert DesiredState.load(path) == store.get()  # a refused change leaves the checkpoint as it was
