"""The dry run as a pure function: the reconciler's plan on a copy of the observed state for each strategy,
and the switch cost computed from the plan."""

from __future__ import annotations

import time

import pytest

from libra.api.dry_run import simulate, switch_costs
from libra.controller.members import Member, MemberState
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState, PoolObservation, TrainLayout

START_S, RELOAD_S = 60.0, 1.0


def observed(instances: int, tp: int = 1) -> ObservedState:
    members = tuple(Member(f"rollout-{i}", ROLLOUT, MemberState.READY, 0.0, key=f"rollout-{i}", tp=tp,
                           gpu_ids=tuple(str(tp * i + g) for g in range(tp)), weight_version=5, serving=True)
                    for i in range(instances))
    ranks = tuple(Member(f"train-{i}", TRAIN, MemberState.READY, 0.0, key=f"rank-{i}") for i in range(2))
    return ObservedState(time.time(), PoolObservation(created=True), PoolObservation(created=True), members + ranks)


def wanted(instances: int, tp: int, strategy: str, cluster_gpus: int = 8, switch_now: bool = True) -> DesiredState:
    return DesiredState(rollout_instances=instances, rollout_tp=tp, train_gpus=2, train_layout=TrainLayout(),
                        weight_version=5, reconfigure_strategy=strategy, cluster_gpus=cluster_gpus, generation=1,
                        reconfiguring="test change", switch_now=switch_now)


CASES = [
    # id, before, (instances, tp, strategy, cluster), starts, stops, serving gap?
    ("diff-grow", 2, (3, 1, "diff", 8), 1, 0, False),
    ("diff-shrink", 2, (1, 1, "diff", 8), 0, 1, False),
    ("diff-tp-change", 2, (1, 2, "diff", 8), 1, 2, True),
    ("restart-all", 2, (2, 2, "restart_all", 8), 2, 2, True),
    ("blue-green-tp-change", 2, (1, 2, "blue_green", 8), 1, 2, False),
    ("blue-green-no-room-falls-back", 2, (1, 2, "blue_green", 4), 1, 2, True),
    ("prewarm", 2, (2, 2, "prewarm", 8), 2, 2, False),
]


@pytest.mark.parametrize(("before", "target", "starts", "stops", "gap"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_plan_per_strategy(before: int, target: tuple[int, int, str, int], starts: int, stops: int,
                           gap: bool) -> None:
    now = observed(before)
    desired = wanted(*target, switch_now=target[2] != "prewarm")
    plan, notes = simulate(now, desired)
    kinds = [a.kind for _, a in plan]
    assert kinds.count("StartRolloutInstance") == starts, (kinds, notes)
    assert kinds.count("StopRolloutInstance") == stops, (kinds, notes)
    assert not any("did not converge" in n or "plans nothing" in n for n in notes), notes
    total, serving_gap = switch_costs(plan, now, START_S, RELOAD_S)
    assert (serving_gap > 0) == gap, (kinds, serving_gap)
    assert total >= (START_S if starts else 0.0)
    if target[2] == "prewarm":
        assert any("switch trigger" in n for n in notes)


def test_nothing_touched() -> None:
    now = observed(2)
    before = [(m.id, m.state, m.serving) for m in now.members]
    simulate(now, wanted(1, 2, "blue_green"))
    assert [(m.id, m.state, m.serving) for m in now.members] == before


def test_new_ids_skip_stopped_members() -> None:
    plan, _ = simulate(observed(2), wanted(1, 2, "diff"))
    started = [a.member_id for _, a in plan if a.kind == "StartRolloutInstance"]  # type: ignore[attr-defined]
    assert started == ["rollout-2"]


def test_training_resize_is_planned() -> None:
    import dataclasses

    now = observed(2)
    plan, notes = simulate(now, dataclasses.replace(wanted(1, 1, "diff"), train_gpus=1))
    kinds = [a.kind for _, a in plan]
    assert kinds.count("ResizeTrainingPool") == 1 and kinds.count("StopRolloutInstance") == 1, kinds
    assert notes == []
