"""Online re-planning in the running job: the window's figures from metric rows, the decision (hysteresis, switch
cost measured or estimated, refused and plan-only requests), no request while a reconfiguration runs, and the
event every decision leaves. The planner and the reconfiguration checks are the real ones; only the
controller's request path is replaced by `plan_reconfigure` over a local desired state."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from libra.config import load
from libra.controller.events import EventLog
from libra.controller.reconfigure import ReconfigureLimits, ReconfigureTarget, plan_reconfigure
from libra.controller.replan_state import FILE_NAME as STATE_FILE
from libra.controller.replanner import (
    EVENT,
    Replanner,
    ReplanSettings,
    SwitchCosts,
    target_for,
    window_figures,
    window_rows,
)
from libra.controller.state import DesiredState, ObservedState, TrainLayout
from libra.controller.switch_costs import FILE_NAME, RESIZE
from libra.planning import planner_inputs
from planner.plan import Candidate

REPO = Path(__file__).resolve().parents[3]
# 4 logical GPUs, training 2, one rollout instance: one GPU left over; no rollout GPU lent to training (the rows
# below are steps of the training pool alone)
OVERRIDES = ["global_resource_planner.initial_allocation_strategy=configured", "train_gpus=2", "rollout_gpus=1",
             "global_resource_planner.elastic_hybrid_min_rollout_gpus=4"]


def row(step: int, instances: int = 1, train_gpus: int = 2, tokens: float = 5120.0, busy: float = 5.0,
        train: float = 1.0, interval: float = 6.0, length: float = 40.0, queue: float = 0.0) -> dict[str, Any]:
    return {"step": step, "rollout_instances": instances, "rollout_gpus": instances, "train_gpus": train_gpus,
            "rollout_tokens": tokens, "rollout_busy_s": busy, "time_train_s": train, "interval_s": interval,
            "response_len_mean": length, "queue_buffered": queue}


def desired_state(instances: int = 1, train_gpus: int = 2, reconfiguring: str = "") -> DesiredState:
    return DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=train_gpus, train_layout=TrainLayout(),
                        cluster_gpus=4, generation=1, reconfiguring=reconfiguring)


# ---- figures of a window --------------------------------------------------------------------------------------
FIGURES = [
    ("rollout-bound", [row(s) for s in (1, 2, 3)],
     {"rollout_tokens_per_s": 1024.0, "train_step_s": 1.0, "rollout_idle_share": 1 / 6, "train_idle_share": 5 / 6,
      "response_tokens_per_step": 0.0, "steps": 3}),
    ("train-bound", [row(s, busy=1.0, train=5.0, tokens=1000.0) for s in (4, 5)],
     {"rollout_tokens_per_s": 1000.0, "train_step_s": 5.0, "rollout_idle_share": 5 / 6, "train_idle_share": 1 / 6,
      "steps": 2}),
    ("growing responses", [row(s, length=10.0 + 2 * s) for s in range(1, 6)],
     {"response_tokens_per_step": 2.0, "mean_response_tokens": 16.0}),
    ("queue waiting", [row(1, queue=4.0), row(2, queue=8.0)], {"queue_depth": 6.0}),
    ("busy longer than the interval is capped", [row(1, busy=9.0, tokens=600.0)],
     {"rollout_idle_share": 0.0, "rollout_tokens_per_s": 100.0}),
    ("two instances share the rate", [row(1, instances=2)], {"rollout_tokens_per_s_per_instance": 512.0}),
    ("weight publishes", [row(1) | {"sync_total_s": 0.2}, row(2), row(3) | {"sync_total_s": 0.4}],
     {"weight_sync_s": 0.3}),
]


@pytest.mark.parametrize(("rows", "expected"), [c[1:] for c in FIGURES], ids=[c[0] for c in FIGURES])
def test_window_figures(rows: list[dict[str, Any]], expected: dict[str, float]) -> None:
    figures = window_figures(rows)
    assert figures is not None
    for name, value in expected.items():
        assert getattr(figures, name) == pytest.approx(value), name


def test_empty_window_has_no_figures() -> None:
    assert window_figures([]) is None
    assert window_figures([row(1, interval=0.0) | {"time_step_s": 0.0}]) is None


WINDOWS = [
    ("all on the current split", [row(s) for s in range(1, 6)], 3, [3, 4, 5]),
    ("cut at the last change", [row(1, instances=2), row(2, instances=2), row(3), row(4)], 4, [3, 4]),
    ("nothing since the change", [row(1), row(2, instances=2)], 4, []),
]


@pytest.mark.parametrize(("rows", "size", "steps"), [c[1:] for c in WINDOWS], ids=[c[0] for c in WINDOWS])
def test_window_rows(rows: list[dict[str, Any]], size: int, steps: list[int]) -> None:
    assert [r["step"] for r in window_rows(rows, desired_state(), size)] == steps


TARGETS = [
    ("rollout grows", Candidate(2, 1, TrainLayout(), 1), Candidate(2, 2, TrainLayout(), 1),
     ReconfigureTarget(rollout_instances=2, rollout_tp=1)),
    ("GPU moves to training", Candidate(1, 3, TrainLayout(), 1), Candidate(2, 2, TrainLayout(), 1),
     ReconfigureTarget(rollout_instances=2, rollout_tp=1, train_gpus=2)),
    ("training layout changes", Candidate(2, 2, TrainLayout(), 1), Candidate(2, 2, TrainLayout(pp=2), 1),
     ReconfigureTarget(train_gpus=2, train_tp=1, train_pp=2, train_ep=1, train_cp=1)),
]


@pytest.mark.parametrize(("current", "best", "target"), [c[1:] for c in TARGETS], ids=[c[0] for c in TARGETS])
def test_target_names_only_what_changes(current: Candidate, best: Candidate, target: ReconfigureTarget) -> None:
    assert target_for(current, best) == target


# ---- decisions ------------------------------------------------------------------------------------------------
class Job:
    """The re-planner of a 4-GPU drift job with the controller's request path as pure functions."""

    def __init__(self, tmp_path: Path, min_gain: float = 0.05, training: bool = False, plan_only: bool = False,
                 interval: int = 3, desired: DesiredState | None = None) -> None:
        cfg = load(str(REPO / "configs" / "drift.yaml"), OVERRIDES)
        self.events = EventLog(tmp_path / "events.jsonl")
        self.desired = desired or desired_state()
        self.requests: list[ReconfigureTarget] = []
        self.limits = ReconfigureLimits(enabled=True, cluster_swap_enabled=False, gpus_per_node=4,
                                        model=cfg.model_spec(), drain_before_stop=True,
                                        fingerprint_for=lambda tp: f"fp-tp{tp}", reconfigure_training=training,
                                        training_plan_only=plan_only)
        settings = ReplanSettings(interval_steps=interval, min_gain=min_gain, total_steps=60,
                                  reconfigure_training=training)
        self.make = lambda: Replanner(settings, planner_inputs(cfg), lambda: self.desired, self.request,
                                      self.events, tmp_path / FILE_NAME, tmp_path / STATE_FILE)
        self.replanner = self.make()

    def restart(self) -> None:
        """A new controller on the same run directory: its re-planner starts from the files alone."""
        self.replanner.close()
        self.replanner = self.make()

    def request(self, target: ReconfigureTarget) -> DesiredState:
        self.requests.append(target)
        self.desired = plan_reconfigure(self.desired, target, None, self.limits, ObservedState(now=0.0))
        return self.desired

    def run(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every row in turn, as the RL loop calls after each step; the decisions made."""
        decisions = []
        for i in range(len(rows)):
            record = self.replanner.after_step(rows[: i + 1])
            if record is not None:
                decisions.append(record)
        return decisions

    def logged(self, kind: str = EVENT) -> list[dict[str, Any]]:
        path = self.events.path
        assert path is not None
        if not path.exists():
            return []
        return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


# generation 20 s of a 22 s step: the lone rollout instance holds the step back
ROLLOUT_BOUND = [row(s, busy=20.0, interval=22.0) for s in (1, 2, 3)]
TRAIN_BOUND = [row(s, busy=0.3, tokens=5120.0, train=5.5) for s in (1, 2, 3)]


def test_a_starved_rollout_pool_gets_the_spare_gpu(tmp_path: Path) -> None:
    job = Job(tmp_path)
    [decision] = job.run(ROLLOUT_BOUND)
    assert decision["action"] == "requested", decision["reason"]
    assert job.requests == [ReconfigureTarget(rollout_instances=2, rollout_tp=1)]
    assert job.desired.rollout_instances == 2 and job.desired.reconfiguring
    assert decision["best_samples_per_s"] > decision["current_samples_per_s"] * 1.05
    assert decision["gain"] >= 0.05 and decision["time_saved_s"] > decision["switch_cost_s"] > 0
    assert decision["switch_cost_source"] == "planner estimate"
    assert decision["window"]["first_step"] == 1 and decision["window"]["last_step"] == 3
    assert job.logged()[0]["action"] == "requested" and "requested 2 instances" in job.logged()[0]["message"]


DECLINED = [
    ("training holds the step back: inside the band", {}, TRAIN_BOUND, "kept", "hysteresis band"),
    ("a wide band keeps a real gain", {"min_gain": 5.0}, ROLLOUT_BOUND, "kept", "hysteresis band"),
    ("too few steps to judge", {"interval": 4}, [row(1), row(2, instances=2), row(3), row(4, instances=2)],
     "skipped", "needed to judge"),
]


@pytest.mark.parametrize(("options", "rows", "action", "reason"), [c[1:] for c in DECLINED],
                         ids=[c[0] for c in DECLINED])
def test_declined_decisions_request_nothing(tmp_path: Path, options: dict[str, Any], rows: list[dict[str, Any]],
                                            action: str, reason: str) -> None:
    job = Job(tmp_path, **options)
    decisions = job.run(rows)
    assert [d["action"] for d in decisions] == [action]
    assert reason in decisions[0]["reason"]
    assert job.requests == [] and job.desired.rollout_instances == 1
    assert job.logged()[0]["action"] == action  # a decision not taken is an event too


def test_a_measured_switch_cost_that_does_not_pay_is_declined(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.events.emit("reconfigure_done", "an earlier change", seconds=1.0e6)
    [decision] = job.run(ROLLOUT_BOUND)
    assert decision["action"] == "kept" and "switch" in decision["reason"]
    assert decision["switch_cost_s"] == pytest.approx(1.0e6)
    assert decision["switch_cost_source"] == "measured (rollout)"
    assert job.requests == []


def test_measured_training_switch_cost_comes_from_the_switch_cost_log(tmp_path: Path) -> None:
    job = Job(tmp_path)
    (tmp_path / FILE_NAME).write_text(json.dumps({"kind": RESIZE, "resize_id": "1", "switch_s": 42.5}) + "\n")
    assert job.replanner.switch_costs() == SwitchCosts(rollout_s=None, train_s=42.5)


def test_no_request_while_a_reconfiguration_runs(tmp_path: Path) -> None:
    job = Job(tmp_path, desired=desired_state(reconfiguring="generation 2: rollout 1 x TP1 -> 2 x TP1 by diff"))
    [decision] = job.run(ROLLOUT_BOUND)
    assert decision["action"] == "skipped" and "reconfiguration is running" in decision["reason"]
    assert job.requests == []


def test_steps_run_during_a_change_are_not_judged(tmp_path: Path) -> None:
    """After the change the window starts with the first step that ran entirely on the new split."""
    job = Job(tmp_path)
    rows = ROLLOUT_BOUND + [row(s, instances=2, busy=10.0, interval=12.0) for s in range(4, 10)]
    decided = []
    for i in range(1, len(rows) + 1):
        if i == 6:  # reconfigure_done arrives while step 6 runs
            job.desired = dataclasses.replace(job.desired, reconfiguring="")
        record = job.replanner.after_step(rows[:i])
        if record is not None:
            decided.append(record)
    assert [(d["step"], d["action"]) for d in decided] == [(3, "requested"), (6, "skipped"), (9, "kept")]
    assert decided[2]["window"]["first_step"] == 7
    assert len(job.requests) == 1


@pytest.mark.parametrize(("restart_before", "restored"), [
    pytest.param((), [], id="one-controller"),
    pytest.param((5, 11), [(True, False), (False, True)], id="restarted-after-the-change-and-after-the-undo"),
])
def test_a_change_that_did_not_deliver_is_undone_and_not_tried_again(
        tmp_path: Path, restart_before: tuple[int, ...], restored: list[tuple[bool, bool]]) -> None:
    """The second instance was predicted to speed the step up; on its second window the steps measured longer
    (30 s against 22 s at the same lengths): the change is undone through the same request path, and growing
    the rollout pool again is declined on the workload the undo measured (and its predicted gain, less what
    the model over-predicted at step 3, is remembered for a later one). A controller restarted after the
    request and again after the undo (its re-planner started from `replan_state.json` alone) decides the same,
    and each restart says what it restored."""
    job = Job(tmp_path)
    slower = [row(s, instances=2, busy=25.0, interval=30.0) for s in range(4, 10)]
    back = [row(s, busy=20.0, interval=22.0) for s in range(10, 16)]
    rows = ROLLOUT_BOUND + slower + back
    decided = []
    for i in range(1, len(rows) + 1):
        if i in (4, 10):  # each change is done while the step after its request runs
            job.desired = dataclasses.replace(job.desired, reconfiguring="")
        if i in restart_before:
            job.restart()
        record = job.replanner.after_step(rows[:i])
        if record is not None:
            decided.append(record)
    assert [(d["step"], d["action"]) for d in decided] == [
        (3, "requested"), (6, "kept"), (9, "requested"), (12, "kept"), (15, "kept")], [d["reason"] for d in decided]
    undo = decided[2]
    assert undo.get("undo") is True and "undo the change at step 3" in undo["reason"], undo["reason"]
    assert job.requests == [ReconfigureTarget(rollout_instances=2, rollout_tp=1),
                            ReconfigureTarget(rollout_instances=1, rollout_tp=1)]
    assert all("the change at step 3 was undone at step 9" in d["reason"] for d in decided[3:]), [
        d["reason"] for d in decided[3:]]
    assert [(d["undone"] or {}).get("change_step") for d in decided] == [None, None, 3, 3, 3]
    assert [e.get("undo") for e in job.logged() if e["action"] == "requested"] == [None, True]
    assert [(d["reviewing_change_at"], sorted(d["over_predictions"])) for d in decided] == [
        (3, []), (3, []), (None, ["rollout"]), (None, ["rollout"]), (None, ["rollout"])]
    assert decided[2]["over_predictions"]["rollout"]["step"] == 3
    assert [d.get("review", {}).get("change_step") for d in decided] == [None, None, 3, None, None]  # the undo's
    verdict = decided[2]["review"]
    assert verdict["undo"] is True and verdict["measured_gain"] < 0 < verdict["predicted_gain"] == decided[0]["gain"]
    assert undo["reason"].startswith(verdict["reason"]), (verdict, undo["reason"])
    events = job.logged("replan_state_restored")
    assert [("step 3 under review" in e["message"], "undone at step 9" in e["message"]) for e in events] == restored, [
        e["message"] for e in events]


def _set(path: str, value: Any) -> Any:
    """A change to a memory file's JSON: `value` at the dotted `path` (None: the key removed)."""
    def change(data: dict[str, Any]) -> dict[str, Any]:
        *parents, key = path.split(".")
        node = data
        for name in parents:
            node = node.setdefault(name, {})
        if value is None:
            del node[key]
        else:
            node[key] = value
        return data
    return change


UNREADABLE = [
    ("not JSON", None, "not JSON"),
    ("another version", _set("version", 99), "version 99"),
    ("a layout degree of 0", _set("online.last_change.source.layout.tp", 0), "last_change.source.layout"),
    ("a cost constant missing", _set("online.last_change.cost.train_mfu", None), "differ from the cost model's"),
    ("a step that is not whole", _set("online.last_change.step", 3.5), "last_change.step: 3.5"),
    ("a speed factor of 0", _set("online.last_change.cost.rollout_speed_factor", 0), "must be above 0"),
    ("an infinite wall time", _set("online.last_change.source_step_wall_s", float("inf")), "not a number"),
    ("an unknown pool", _set("online.over_predictions.gpu", {"step": 1, "share": 0.1}), "'gpu': not a pool"),
    ("a negative switch", _set("rollout_switch_s", -1), "rollout_switch_s: -1"),
    ("an endless switch", _set("rollout_switch_s", float("inf")), "rollout_switch_s: inf"),
]


@pytest.mark.parametrize(("change", "problem"), [c[1:] for c in UNREADABLE], ids=[c[0] for c in UNREADABLE])
def test_an_unreadable_memory_is_reported_and_not_used(tmp_path: Path, change: Any, problem: str) -> None:
    """A memory file damaged in one place (written by a real decision first) is reported, naming the file and
    the field, kept aside and not used: the restarted re-planner decides afresh and writes a new one."""
    job = Job(tmp_path)
    job.run(ROLLOUT_BOUND)
    state = tmp_path / STATE_FILE
    written = json.loads(state.read_text())
    assert written["online"]["last_change"]["step"] == 3
    damaged = "{" if change is None else json.dumps(change(written))
    state.write_text(damaged)
    job.desired = desired_state()
    job.restart()
    [event] = job.logged("replan_state_unreadable")
    assert str(state) in event["message"] and problem in event["message"], event["message"]
    assert Path(event["kept_as"]).read_text() == damaged  # kept for a look, not lost
    assert job.replanner.online.last_change is None
    [decision] = job.run(ROLLOUT_BOUND)
    assert decision["action"] == "requested", decision["reason"]
    assert json.loads(state.read_text())["online"]["last_change"]["step"] == 3


def test_training_changes_need_runtime_reconfigure_training(tmp_path: Path) -> None:
    """With a training pool that may change, the search may move GPUs to training (here the model wants
    the spare GPU for the rollout side either way); the target is one plan_reconfigure accepts."""
    job = Job(tmp_path, training=True)
    [decision] = job.run(ROLLOUT_BOUND)
    assert decision["action"] == "requested", decision["reason"]
    assert job.desired.rollout_gpus + job.desired.train_gpus <= 4


def test_plan_only_records_and_applies_nothing(tmp_path: Path) -> None:
    """runtime_training_pool_plan_only: a decision that moves training GPUs is recorded, nothing changes."""
    start = desired_state(instances=1, train_gpus=3)
    job = Job(tmp_path, training=True, plan_only=True, desired=start)
    rows = [row(s, train_gpus=3, busy=20.0, interval=22.0) for s in (1, 2, 3)]
    [decision] = job.run(rows)
    assert decision["action"] == "plan_only", decision["reason"]
    assert decision["reviewing_change_at"] is None and job.replanner.online.last_change is None  # not run
    assert job.desired.reconfiguring == "" and job.desired.planned_training.startswith("plan only:")
    assert (job.desired.rollout_instances, job.desired.train_gpus) == (1, 3)


def test_a_refused_request_is_recorded(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.limits = dataclasses.replace(job.limits, enabled=False)
    [decision] = job.run(ROLLOUT_BOUND)
    assert decision["action"] == "refused" and "runtime_dynamic_reconfiguration_enabled" in decision["reason"]
    assert decision["reviewing_change_at"] is None and job.replanner.online.last_change is None  # not run
    assert job.desired.rollout_instances == 1


def test_off_the_interval_nothing_is_decided(tmp_path: Path) -> None:
    job = Job(tmp_path, interval=5)
    assert job.run(ROLLOUT_BOUND) == [] and job.logged() == []
