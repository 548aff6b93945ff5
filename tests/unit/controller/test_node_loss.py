"""The cluster loses GPUs while the job runs (fake pools, a real control loop): the split of what remains
(`fit_to_capacity`, a table), the control loop keeping `cluster_gpus` at the GPUs alive so no replacement is
started on GPUs that are gone, and the RL loop's re-plan: survivors keep their places, a lost training rank
restarts the training pool at its new size after the rollout pool gave up its surplus, and pools that do not
fit stop the job with a clear error."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from libra.cluster.node_fence import FencedNode, NodeFence
from libra.cluster.training_workers import NodesUnreachableError
from libra.config import load_dict
from libra.controller import node_loss
from libra.controller.capacity import CapacityFit, CapacityLost, fit_to_capacity, shrink_to_capacity
from libra.controller.control_loop import ControlLoop
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.gate import WeightGate
from libra.controller.node_loss import CAPACITY_CHECK_S, NodeLossRecovery
from libra.controller.state import ROLLOUT, DesiredState
from libra.controller.tracker import MemberTracker
from planner.layout import TrainLayout
from planner.model_spec import model_spec_from_dict

from .fakes import FakeRolloutEdge, FakeTrainingEdge

MODEL = model_spec_from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 100})


def desired(train: int, instances: int, tp: int = 1, layout: TrainLayout = TrainLayout()) -> DesiredState:
    return DesiredState(rollout_instances=instances, rollout_tp=tp, train_gpus=train, train_layout=layout,
                        cluster_gpus=train + instances * tp, generation=3)


def refuse(*sizes: int):  # type: ignore[no-untyped-def]
    return lambda gpus, layout: [f"train_gpus={gpus}: the batch does not divide"] if gpus in sizes else []


# (id, desired, live GPUs, training lost, minimums (train, rollout), refused training sizes,
#  expected (train GPUs, layout, rollout instances) or None)
FITS = [
    ("rollout-node-lost-training-kept", desired(2, 6), 6, False, (0, 0), (), (2, TrainLayout(), 4)),
    ("training-lost-share-kept", desired(1, 3), 2, True, (0, 0), (), (1, TrainLayout(), 1)),
    ("half-the-cluster-lost", desired(4, 4), 4, True, (0, 0), (), (2, TrainLayout(), 2)),
    ("rollout-tp2-whole-instances", desired(2, 3, tp=2), 4, False, (0, 0), (), (2, TrainLayout(), 1)),
    ("minimum-rollout-takes-training-gpus", desired(3, 1), 3, False, (0, 0), (), (2, TrainLayout(), 1)),
    ("minimums-do-not-fit", desired(2, 2), 3, True, (2, 2), (), None),
    ("batch-refuses-a-size", desired(4, 4), 5, True, (0, 0), (3,), (2, TrainLayout(), 3)),
    ("layout-lowered-to-fit", desired(4, 4, layout=TrainLayout(tp=4)), 6, True, (0, 0), (),
     (3, TrainLayout(), 3)),
    ("tp-kept-where-it-divides", desired(4, 4, layout=TrainLayout(tp=2)), 4, True, (0, 0), (),
     (2, TrainLayout(tp=2), 2)),
    ("minimum-training-gpus-kept", desired(2, 6), 4, True, (2, 0), (), (2, TrainLayout(), 2)),
]


@pytest.mark.parametrize(("want", "live", "lost", "minimums", "refused", "expected"),
                         [case[1:] for case in FITS], ids=[case[0] for case in FITS])
def test_fit_to_capacity(want: DesiredState, live: int, lost: bool, minimums: tuple[int, int],
                         refused: tuple[int, ...], expected: tuple[int, TrainLayout, int] | None) -> None:
    fit = fit_to_capacity(want, live, training_lost=lost, min_train_gpus=minimums[0], min_rollout_gpus=minimums[1],
                          model=MODEL, gpus_per_node=8, train_problems=refuse(*refused))
    if expected is None:
        assert fit is None
        return
    assert fit is not None
    assert (fit.train_gpus, fit.train_layout, fit.rollout_instances) == expected
    assert fit.train_gpus + fit.rollout_instances * want.rollout_tp <= live


def test_shrink_to_capacity_is_a_diff_generation_switched_at_once() -> None:
    before = desired(2, 6)
    after = shrink_to_capacity(before, CapacityFit(6, 2, TrainLayout(), 4), "fp")
    assert (after.cluster_gpus, after.rollout_instances, after.train_gpus, after.rollout_fingerprint) == (6, 4, 2, "fp")
    assert after.generation == before.generation + 1 and after.reconfigure_strategy == "diff" and after.switch_now
    assert "the cluster lost GPUs" in after.reconfiguring and "8 -> 6 GPUs" in after.reconfiguring


class Cluster:
    """The GPUs Ray counts alive, as the test sets them, less one per node the job fenced off (nodes of 1 GPU)."""

    def __init__(self, gpus: int, fence: NodeFence) -> None:
        self.gpus = gpus
        self.fence = fence

    def __call__(self) -> int:
        return self.gpus - len(self.fence.node_ids())


class LossJob:
    """Fake pools driven by a real control loop in the background, a desired store and the recovery."""

    def __init__(self, tmp_path: Path, train: int, instances: int, min_train: int = 0, min_rollout: int = 0,
                 policy: str = "replan", wait_s: float = 0.0,
                 reaches_again: Callable[[FencedNode], bool] | None = None) -> None:
        gpus = train + instances
        self.cfg = load_dict({
            "model_path": str(tmp_path / "m"), "rollout_kv_cache_bytes": 2**26,
            "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": gpus},
            "train_gpus": train, "rollout_gpus": instances, "megatron_params_dtype": "fp32", "max_model_len": 256,
            "max_new_tokens": 2, "batch_size": 4, "n_samples": 3, "total_steps": 4,
            "megatron_use_cpu_initialization": True, "optimizer": {"clip_grad": 0},
            "global_resource_planner": {"min_train_gpus": min_train, "min_rollout_gpus": min_rollout,
                                        "runtime_node_loss_policy": policy, "runtime_node_loss_wait_s": wait_s},
            "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1}})
        self.events = EventLog(tmp_path / "events.jsonl")
        self.tracker = MemberTracker(self.events)
        self.rollout = FakeRolloutEdge()
        self.train = FakeTrainingEdge()
        self.executor = Executor(self.tracker, self.rollout, self.train, self.events, gate=WeightGate())
        self.store = DesiredStore(None, DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=train,
                                                     train_layout=TrainLayout(), rollout_fingerprint="fp",
                                                     cluster_gpus=gpus, generation=1))
        self.fence = NodeFence()
        self.stopping = threading.Event()
        self.cluster = Cluster(gpus, self.fence)
        self.training_answers = True
        self.recovery = NodeLossRecovery(
            self.cfg, self.cluster, self.store, self.tracker, self.executor, self.events,
            fingerprint_for=lambda tp: "fp", train_problems=None, wake=lambda: None,
            rollout_failed_within_s=1.0, training_answers=lambda: self.training_answers, fence=self.fence,
            reaches_again=reaches_again, stopping=self.stopping)
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout, self.train, self.store.get, self.events,
                                interval_s=0.02, on_observed=lambda o, d: self.recovery.observe_capacity(
                                    force=any(m.state.value == "FAILED" for m in o.members)))
        self.loop.start()
        assert self.wait(lambda: len(self.serving()) == instances and len(self.train.workers) == train)
        self.started = set(self.rollout.instances)

    def serving(self) -> list[str]:
        return [k for k, i in self.rollout.instances.items() if i.serving]

    def lose(self, gpus: int, rollout_keys: int) -> None:
        """A node of `gpus` GPUs goes, with `rollout_keys` of the rollout instances on it (their loss shows in
        the next observation, as a health check would find it)."""
        self.cluster.gpus -= gpus
        for key in sorted(self.rollout.instances)[:rollout_keys]:
            del self.rollout.instances[key]

    def wait(self, predicate, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return bool(predicate())

    def kinds(self) -> list[dict]:
        return [json.loads(line) for line in (self.events.path or Path()).read_text().splitlines()]

    def close(self) -> None:
        self.stopping.set()
        self.loop.stop()
        self.executor.shutdown()


@pytest.fixture
def make_job(tmp_path: Path):
    jobs: list[LossJob] = []

    def make(**kwargs) -> LossJob:  # type: ignore[no-untyped-def]
        folder = tmp_path / f"job{len(jobs)}"
        folder.mkdir()
        jobs.append(LossJob(folder, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def test_the_control_loop_keeps_cluster_gpus_at_what_is_alive_and_starts_no_replacement(make_job) -> None:
    job = make_job(train=1, instances=3)
    job.lose(gpus=2, rollout_keys=2)
    assert job.wait(lambda: job.store.get().cluster_gpus == 2)
    assert job.wait(lambda: sum(m.live for m in job.tracker.members(ROLLOUT)) == 1)
    time.sleep(0.3)  # ticks that could start a replacement
    assert set(job.rollout.instances) <= job.started, "a replacement was started on GPUs that are gone"
    changed = [e for e in job.kinds() if e["kind"] == "capacity_changed"]
    assert changed and (changed[0]["live_gpus"], changed[0]["was_gpus"]) == (2, 4)


@pytest.mark.parametrize("first", ["control-loop", "rl-loop-re-plan"])
def test_a_loss_is_recorded_once_by_whichever_loop_reads_it_first(make_job, monkeypatch, first: str) -> None:
    """The RL loop's re-plan after a failed step may read the cluster before the control loop's throttled
    reading does; the change of `cluster_gpus` is recorded (`capacity_changed`) either way, and only once."""
    job = make_job(train=2, instances=4)
    reading = job.recovery.observe_capacity
    if first == "rl-loop-re-plan":  # the control loop's reading comes late (a busy tick on a loaded machine)
        monkeypatch.setattr(job.recovery, "observe_capacity", lambda *args, **kwargs: None)
    job.lose(gpus=1, rollout_keys=1)
    if first == "control-loop":
        assert job.wait(lambda: job.store.get().cluster_gpus == 5)
    outcome = job.recovery.replan(training_lost=False)
    assert outcome is not None and not outcome["training_restarted"]
    monkeypatch.setattr(job.recovery, "observe_capacity", reading)
    reading(force=True)
    time.sleep(0.1)  # control-loop ticks that could record the same change again
    changed = [(e["live_gpus"], e["was_gpus"]) for e in job.kinds() if e["kind"] == "capacity_changed"]
    assert changed == [(5, 6)]
    assert job.store.get().cluster_gpus == 5


def test_rollout_node_lost_survivors_keep_their_places(make_job) -> None:
    job = make_job(train=2, instances=4)
    kept = set(job.rollout.instances) - {sorted(job.rollout.instances)[0]}
    job.lose(gpus=1, rollout_keys=1)
    outcome = job.recovery.replan(training_lost=False)
    assert outcome is not None and not outcome["training_restarted"]
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (2, 3, 5)
    assert job.wait(lambda: not job.store.get().reconfiguring or set(job.serving()) == kept)
    assert set(job.serving()) == kept and job.train.resizes == [] and len(job.train.workers) == 2
    assert job.recovery.replan(training_lost=False) is None  # nothing more to do


@pytest.mark.parametrize("stop_s", [0.0, 1.0], ids=["quick-stops", "stops-that-take-a-while"])
def test_training_rank_lost_restarts_training_at_its_new_size_after_the_rollout_surplus_stopped(
        make_job, stop_s: float) -> None:
    """The restart waits until the surplus stops have ended, not just begun: a stop in flight still holds its
    GPUs (and, on Ray, waits for the weight gate the restart holds while its placement group cannot be placed)."""
    job = make_job(train=1, instances=3)
    job.rollout.stop_gate = threading.Event() if stop_s else None
    opened = threading.Timer(stop_s, job.rollout.stop_gate.set) if job.rollout.stop_gate else None
    job.lose(gpus=2, rollout_keys=1)  # the node held the training rank and one rollout instance
    job.training_answers = False
    held: list[tuple[int, int]] = []
    original = job.executor.training.restart

    def restart(*args, **kwargs):  # type: ignore[no-untyped-def]
        # before the restart takes the weight gate: a stop still in flight would then wait behind it
        held.append((sum(1 for i in job.rollout.instances.values() if i.state.value != "STOPPED"),
                     sum(1 for m in job.tracker.members(ROLLOUT) if m.state.value != "STOPPED")))
        return original(*args, **kwargs)

    job.executor.training.restart = restart  # type: ignore[method-assign]
    if opened is not None:
        opened.start()
    try:
        outcome = job.recovery.restart_training("a training worker died")
    finally:
        if opened is not None:
            opened.join()
    assert outcome["training_restarted"] and outcome["to_gpus"] == 1
    assert held == [(1, 1)], "the training pool restarted before the rollout pool gave up its surplus"
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (1, 1, 2)
    assert job.wait(lambda: len(job.serving()) == 1 and len(job.train.workers) == 1)
    kinds = [e["kind"] for e in job.kinds()]
    assert kinds.count("capacity_lost") == 1 and kinds.count("capacity_replan") == 1 and "train_restart" in kinds
    assert "4 -> 2 GPUs" in want.reconfiguring and "rollout 3 -> 1" in want.reconfiguring, want.reconfiguring


def test_a_lost_rank_without_lost_gpus_restarts_at_the_same_size(make_job) -> None:
    job = make_job(train=2, instances=2)
    job.training_answers = False
    cost = job.recovery.restart_training("a training worker died")
    assert cost["to_gpus"] == 2 and "training_restarted" not in cost
    assert job.store.get().train_gpus == 2 and "capacity_lost" not in [e["kind"] for e in job.kinds()]


def test_pools_that_do_not_fit_stop_the_job_with_what_is_left(make_job) -> None:
    job = make_job(train=2, instances=2, min_train=2, min_rollout=2, wait_s=0.3)
    job.lose(gpus=1, rollout_keys=1)
    with pytest.raises(CapacityLost, match=r"3 GPUs alive of the 4 .*min_train_gpus=2, min_rollout_gpus=2.*"
                                           r"Launch it again on this run directory"):
        job.recovery.replan(training_lost=False)
    assert job.store.get().rollout_instances == 2  # nothing was changed
    waited = [e for e in job.kinds() if e["kind"] == "capacity_wait"]
    assert waited and waited[0]["need_gpus"] == 4 and waited[0]["wait_s"] == 0.3


def back_after(job: LossJob, seconds: float, gpus: int) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: setattr(job.cluster, "gpus", gpus))
    timer.start()
    return timer


def test_pools_that_do_not_fit_wait_for_the_gpus_of_the_smallest_pools(make_job) -> None:
    job = make_job(train=2, instances=2, min_train=2, min_rollout=1, wait_s=10.0)
    job.lose(gpus=2, rollout_keys=2)  # 2 left, the training pool's: training 2 + rollout 1 do not fit
    assert job.wait(lambda: not any(m.live for m in job.tracker.members(ROLLOUT)))
    back_after(job, 1.0, 3)  # a node of 1 GPU joins
    outcome = job.recovery.replan(training_lost=False)
    assert outcome is not None
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (2, 1, 3)
    over = [e for e in job.kinds() if e["kind"] == "capacity_wait_over"]
    assert over and over[0]["live_gpus"] == 3


@pytest.mark.parametrize(("comes_back", "changed"), [(True, False), (False, True)],
                         ids=["gpus-back-nothing-changes", "gpus-not-back-re-planned"])
def test_the_wait_policy_waits_for_every_gpu_before_it_re_plans(make_job, comes_back: bool, changed: bool) -> None:
    job = make_job(train=1, instances=3, policy="wait", wait_s=1.0)
    job.lose(gpus=1, rollout_keys=1)
    if comes_back:
        back_after(job, 0.3, 4)
    outcome = job.recovery.replan(training_lost=False)
    assert (outcome is not None) is changed
    assert job.store.get().rollout_instances == (2 if changed else 3)
    assert [e["kind"] for e in job.kinds()].count("capacity_wait") == 1


def test_the_control_loop_reads_the_cluster_at_most_every_few_seconds(make_job) -> None:
    job = make_job(train=1, instances=1)
    job.loop.stop()
    calls: list[int] = []

    def live() -> int:
        calls.append(1)
        return 2

    job.recovery.live_gpus = live  # type: ignore[method-assign]
    now = time.monotonic()
    job.recovery._checked_at = now
    for _ in range(20):
        job.recovery.observe_capacity(now + CAPACITY_CHECK_S / 2)
    assert calls == []
    job.recovery.observe_capacity(now + CAPACITY_CHECK_S)
    job.recovery.observe_capacity(now + CAPACITY_CHECK_S + 0.1)
    assert calls == [1]


def test_a_restart_that_cannot_be_placed_waits_for_the_loss_to_show(make_job) -> None:
    """A rank died with its node before Ray marked the node dead: the restart at the same size is not placed,
    and the recovery re-plans once the loss shows."""
    job = make_job(train=1, instances=3)
    job.training_answers = False
    original = job.train.restart
    calls: list[int] = []

    def restart(gpus=None, layout=None):  # type: ignore[no-untyped-def]
        calls.append(gpus)
        if len(calls) == 1:
            job.lose(gpus=2, rollout_keys=1)  # Ray now shows the node gone
            raise TimeoutError("placement group 'libra-train-pg' (1 bundles {'GPU': 1}, PACK) was not placed "
                               "within 60s")
        return original(gpus, layout)

    job.train.restart = restart  # type: ignore[method-assign]
    outcome = job.recovery.restart_training("a training worker died")
    assert calls == [1, 1] and outcome["training_restarted"]
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (1, 1, 2)


def test_the_restart_at_the_same_size_is_guarded_by_the_jobs_gpus(make_job) -> None:
    """The check a restart's placement wait is guarded by: nothing while the cluster has the job's GPUs, the
    shortfall once Ray shows the loss (the wait then gives up instead of waiting out its timeout)."""
    job = make_job(train=1, instances=3)
    job.training_answers = False
    said: list[str] = []

    @contextlib.contextmanager
    def guard(check):  # type: ignore[no-untyped-def]
        said.append(check())
        job.lose(gpus=2, rollout_keys=1)  # declared dead while the restart waits to be placed
        said.append(check())
        yield

    job.recovery.placement_guard = guard
    original = job.train.restart
    calls: list[int] = []

    def restart(gpus=None, layout=None):  # type: ignore[no-untyped-def]
        calls.append(gpus)
        if len(calls) == 1:
            raise TimeoutError(f"placement group 'libra-train-pg' was not placed within 1s ({said[-1]})")
        return original(gpus, layout)

    job.train.restart = restart  # type: ignore[method-assign]
    outcome = job.recovery.restart_training("a training worker died")
    assert said[:2] == ["", "the cluster has 2 of the 4 GPUs this job holds"]
    assert calls == [1, 1] and outcome["training_restarted"]


def test_another_restart_error_is_raised_unchanged(make_job) -> None:
    job = make_job(train=1, instances=1)

    def restart(gpus=None, layout=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("megatron init failed")

    job.train.restart = restart  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="megatron init failed"):
        job.recovery.restart_training("a training worker died")


def test_a_node_lost_while_a_rollout_change_is_in_flight_ends_on_what_fits(make_job) -> None:
    """A `diff` 2 -> 3 change is starting its new instance when a node of 2 GPUs goes (with one instance): the
    re-plan replaces the change's target with what fits (training 1, rollout 1 on the 2 GPUs left); once the
    start in flight ends, the instance it started is stopped again and the pools settle on that target."""
    job = make_job(train=1, instances=2)
    job.cluster.gpus = 4  # a fourth GPU to grow onto
    job.rollout.gate = threading.Event()
    job.store.change(lambda d: dataclasses.replace(d, rollout_instances=3, cluster_gpus=4, generation=d.generation + 1,
                                                   reconfiguring="rollout 2 -> 3 instances by diff"))
    assert job.wait(lambda: ("start", "rollout-2") in job.rollout.ops), "the new instance's start never began"
    job.lose(gpus=2, rollout_keys=1)
    opened = threading.Timer(1.5, job.rollout.gate.set)  # the start in flight ends while the re-plan runs
    opened.start()
    try:
        outcome = job.recovery.replan(training_lost=False)
    finally:
        opened.join()
    assert outcome is not None and not outcome["training_restarted"]
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (1, 1, 2)
    # (this rig has no controller to mark the change done: what counts is that the pools reach its target)
    assert job.wait(lambda: len(job.serving()) == 1 and sum(
        i.state.value != "STOPPED" for i in job.rollout.instances.values()) == 1), (job.serving(), job.rollout.ops)
    live = [k for k, i in job.rollout.instances.items() if i.state.value != "STOPPED"]
    assert len(live) == 1 and len(job.train.workers) == 1, (live, job.rollout.ops)
    assert job.recovery.replan(training_lost=False) is None


def test_a_step_boundary_reads_the_cluster_only_when_the_control_loop_saw_gpus_go(make_job) -> None:
    """`replan(observed=True)` (each step boundary) trusts the control loop's reading of the cluster while it
    shows every GPU the pools hold; once it shows a loss, the re-plan reads the cluster itself and acts."""
    job = make_job(train=2, instances=4)
    main = threading.get_ident()
    reads: list[int] = []
    cluster = job.recovery.live_gpus

    def counted() -> int:
        if threading.get_ident() == main:
            reads.append(1)
        return cluster()

    job.recovery.live_gpus = counted  # type: ignore[method-assign]
    for _ in range(5):
        assert job.recovery.replan(training_lost=False, observed=True) is None
    assert reads == [], "a step boundary asked Ray while nothing was lost"
    job.lose(gpus=1, rollout_keys=1)
    assert job.wait(lambda: job.store.get().cluster_gpus == 5)  # the control loop saw it
    outcome = job.recovery.replan(training_lost=False, observed=True)
    assert outcome is not None and not outcome["training_restarted"] and reads
    assert job.store.get().rollout_instances == 3


def restart_meeting_a_partition(job: LossJob) -> list[int | None]:
    """The job's training restarts: the first finds node-a and node-b (1 GPU each) unable to reach each other and
    names node-b to fence off; the GPU counts each restart was asked for."""
    job.training_answers = False
    original = job.train.restart
    calls: list[int | None] = []

    def restart(gpus=None, layout=None):  # type: ignore[no-untyped-def]
        calls.append(gpus)
        if len(calls) == 1:
            raise RuntimeError("training pool start failed") from NodesUnreachableError(
                "libra-train: the nodes of its ranks cannot all reach each other", [("node-a", "node-b")],
                ["node-b"], {"node-a": "10.0.0.2", "node-b": "10.0.0.3"})
        return original(gpus, layout)

    job.train.restart = restart  # type: ignore[method-assign]
    return calls


def test_a_restart_whose_nodes_cannot_reach_each_other_fences_one_off_and_re_plans(make_job) -> None:
    """A partition between the two nodes of the training ranks (1 GPU each, both alive to Ray): the restart at
    the same size finds it before forming its process group; the node the check chose is fenced off (its GPU no
    longer counts) and the job re-plans onto the rest, restarting the training pool on the node left."""
    job = make_job(train=2, instances=2)
    calls = restart_meeting_a_partition(job)
    outcome = job.recovery.restart_training("a training worker hung")
    assert calls == [2, 1] and outcome["training_restarted"]
    assert job.fence.node_ids() == {"node-b"}
    assert job.fence.reason_for("node-b") == ("its node 10.0.0.3 is fenced off: training ranks there could not "
                                              "reach 10.0.0.2")
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (1, 2, 3)
    log = job.kinds()
    (fenced,) = [e for e in log if e["kind"] == "node_fenced"]
    assert (fenced["node_id"], fenced["address"], fenced["unreachable"]) == ("node-b", "10.0.0.3", ["10.0.0.2"])
    (lost,) = [e for e in log if e["kind"] == "capacity_lost"]
    assert (lost["live_gpus"], lost["was_gpus"]) == (3, 4) and "nodes fenced off: 10.0.0.3" in lost["reason"]


def partition_at_start() -> NodesUnreachableError:
    """What the training pool's first start raises when its ranks on node-a and node-b cannot connect."""
    return NodesUnreachableError("libra-train: the nodes of its ranks cannot all reach each other",
                                 [("node-a", "node-b")], ["node-b"], {"node-a": "10.0.0.2", "node-b": "10.0.0.3"})


def test_a_partition_met_at_the_first_start_fences_a_node_and_sizes_the_pools_for_the_rest(make_job) -> None:
    """At the first start there is no pool to restart: the node is fenced off as after a step and the desired
    state takes the sizes the GPUs left allow, for the control loop to create the training pool at; nothing is
    restarted here."""
    job = make_job(train=2, instances=2)
    restarts: list[int | None] = []
    job.train.restart = lambda gpus=None, layout=None: restarts.append(gpus)  # type: ignore[method-assign]
    job.recovery.fence_at_start(partition_at_start())
    assert restarts == [] and job.fence.node_ids() == {"node-b"}
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances, want.cluster_gpus) == (1, 2, 3)
    assert want.reconfigure_strategy == "diff" and "3 GPUs" in want.reconfiguring
    log = job.kinds()
    assert [e["kind"] for e in log if e["kind"].startswith(("node_", "capacity_l", "capacity_r"))] == [
        "node_fenced", "capacity_lost", "capacity_replan"]
    (replanned,) = [e for e in log if e["kind"] == "capacity_replan"]
    assert replanned["training_restarted"] is False
    (lost,) = [e for e in log if e["kind"] == "capacity_lost"]
    assert "the training pool's first start; nodes fenced off: 10.0.0.3" == lost["reason"]


def test_a_partition_met_at_the_first_start_that_leaves_too_few_gpus_stops_naming_the_fenced_node(
        make_job) -> None:
    job = make_job(train=2, instances=1, min_train=2)
    with pytest.raises(CapacityLost) as stopped:
        job.recovery.fence_at_start(partition_at_start())
    assert str(stopped.value).startswith(
        "the cluster has 2 GPUs alive (not counting nodes fenced off: 10.0.0.3, training ranks there could not "
        "reach 10.0.0.2) of the 3 this job holds, fewer than its smallest pools need (3: min_train_gpus=2"), \
        stopped.value
    assert job.store.get().train_gpus == 2, "a job that stops keeps the sizes it was launched with"


def test_a_restart_that_fails_for_another_reason_fences_nothing(make_job) -> None:
    job = make_job(train=2, instances=2)
    job.training_answers = False

    def restart(gpus=None, layout=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("the model does not load")

    job.train.restart = restart  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the model does not load"):
        job.recovery.restart_training("a training worker died")
    assert job.fence.node_ids() == frozenset() and "node_fenced" not in [e["kind"] for e in job.kinds()]


def test_a_fenced_node_that_reaches_its_peers_again_counts_again(make_job, monkeypatch) -> None:
    """The fenced node is checked again (here every 0.05 s): a check that fails keeps it fenced, the first that
    passes lifts the fence (`node_unfenced`); its GPU counts again and the pools keep the size they were re-planned
    to, as after a lost node came back."""
    monkeypatch.setattr(node_loss, "FENCE_RECHECK_S", 0.05)
    checks: list[FencedNode] = []

    def reaches_again(fenced: FencedNode) -> bool:
        checks.append(fenced)
        return len(checks) >= 3

    job = make_job(train=2, instances=2, reaches_again=reaches_again)
    restart_meeting_a_partition(job)
    job.recovery.restart_training("a training worker hung")
    assert job.wait(lambda: job.fence.node_ids() == frozenset())
    assert len(checks) == 3 and {(c.node_id, c.peers) for c in checks} == {("node-b", ("node-a",))}
    assert job.wait(lambda: job.store.get().cluster_gpus == 4)
    want = job.store.get()
    assert (want.train_gpus, want.rollout_instances) == (1, 2)
    (unfenced,) = [e for e in job.kinds() if e["kind"] == "node_unfenced"]
    assert (unfenced["node_id"], unfenced["address"]) == ("node-b", "10.0.0.3")
    time.sleep(0.2)
    assert len(checks) == 3, "a node no longer fenced is not checked again"
