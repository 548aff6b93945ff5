"""The rollout reconfigure strategies as pure planners: one tick's plan from tables of (members, desired)."""

from __future__ import annotations

import dataclasses

import pytest

from libra.controller.members import Member, MemberState
from libra.controller.reconcile import (
    STRATEGIES,
    PublishWeights,
    SetServing,
    ShrinkTrainingPool,
    StartRolloutInstance,
    StopRolloutInstance,
    StrategyFallback,
    StrategyRefused,
    converged,
    reconcile,
)
from libra.controller.state import DesiredState, ObservedState, PoolObservation, TrainLayout

S = MemberState
NOW = 1000.0
UP = PoolObservation(created=True)


def member(index: int, state: MemberState = S.READY, *, tp: int = 1, serving: bool | None = None, version: int = 0,
           generation: int = 1, busy: bool = False) -> Member:
    return Member(id=f"rollout-{index}", pool="rollout", state=state, since=NOW - 100 + index, key=f"rollout-{index}",
                  busy=busy, tp=tp, fingerprint=f"fp-tp{tp}", generation=generation, weight_version=version,
                  serving=state == S.READY if serving is None else serving)


def want(instances: int, strategy: str = "diff", *, tp: int = 1, cluster: int = 8, train: int = 2,
         version: int = 0, switch_now: bool = True, swap: bool = False, drain: bool = True) -> DesiredState:
    return DesiredState(rollout_instances=instances, rollout_tp=tp, train_gpus=train, train_layout=TrainLayout(),
                        weight_version=version, reconfigure_strategy=strategy, drain_before_stop=drain,
                        rollout_fingerprint=f"fp-tp{tp}", cluster_gpus=cluster, cluster_swap_enabled=swap,
                        switch_now=switch_now, generation=2, reconfiguring=f"test {strategy}")


def observed(*members: Member) -> ObservedState:
    return ObservedState(now=NOW, rollout=UP, train=UP, members=members)


def plan(members: tuple[Member, ...], desired: DesiredState) -> list[tuple]:
    out: list[tuple] = []
    for a in reconcile(observed(*members), desired):
        if isinstance(a, StartRolloutInstance):
            out.append(("start", a.member_id, a.spec.tp))
        elif isinstance(a, StopRolloutInstance):
            out.append(("stop", a.member_id, a.drain))
        elif isinstance(a, PublishWeights):
            out.append(("publish", a.version, *a.member_ids))
        elif isinstance(a, SetServing):
            out.append(("serve", *a.member_ids))
        elif isinstance(a, ShrinkTrainingPool):
            out.append(("shrink_training", a.gpus))
        elif isinstance(a, StrategyFallback):
            out.append(("fallback", a.strategy, a.used))
        else:
            out.append((a.kind,))
    return out


TWO = (member(0), member(1))
THREE = (member(0), member(1), member(2))

CASES = [
    # ---- diff: only the difference; unchanged members never touched
    pytest.param(TWO, want(3), [("start", "rollout-2", 1)], id="diff-2-to-3"),
    pytest.param(THREE, want(1), [("stop", "rollout-2", True), ("stop", "rollout-1", True)], id="diff-3-to-1"),
    pytest.param(THREE, want(1, drain=False), [("stop", "rollout-2", False), ("stop", "rollout-1", False)],
                 id="diff-3-to-1-abort"),
    pytest.param((member(0), member(1), member(2, S.LOADING)), want(2), [("stop", "rollout-2", True)],
                 id="diff-drains-a-loading-member"),
    pytest.param((member(0), member(1), member(2, S.STARTING, serving=False)), want(2),
                 [("stop", "rollout-2", False)], id="diff-starting-member-has-nothing-to-drain"),
    pytest.param(TWO, want(2, tp=2), [("stop", "rollout-0", True), ("stop", "rollout-1", True),
                                      ("start", "rollout-2", 2), ("start", "rollout-3", 2)], id="diff-tp-1-to-2"),
    pytest.param(TWO, want(2, tp=2, cluster=4), [("stop", "rollout-0", True), ("stop", "rollout-1", True)],
                 id="diff-tp-starts-wait-for-gpus"),
    pytest.param((member(0), member(1), member(2, S.STOPPED, tp=2), member(3, S.READY, tp=2, serving=False)),
                 want(2, tp=2, cluster=6), [("stop", "rollout-0", True), ("stop", "rollout-1", True),
                                            ("serve", "rollout-3")], id="diff-outdated-replaced-new-admitted"),
    pytest.param((member(0, version=3), member(1, serving=False, version=0)), want(2, version=3),
                 [("publish", 3, "rollout-1")], id="diff-new-member-gets-current-weights-first"),
    pytest.param((member(0, version=3), member(1, serving=False, version=3)), want(2, version=3),
                 [("serve", "rollout-0", "rollout-1")], id="diff-new-member-on-current-weights-serves"),
    pytest.param((member(0), member(1, S.LOADING, serving=False)), want(2), [], id="diff-waits-for-loading"),
    pytest.param(TWO, dataclasses.replace(want(3, "blue_green"), reconfiguring=""), [("start", "rollout-2", 1)],
                 id="no-reconfiguration-runs-diff"),
    # ---- restart_all: stop every earlier-generation member, then start the target set
    pytest.param(TWO, want(3, "restart_all"), [("stop", "rollout-0", True), ("stop", "rollout-1", True)],
                 id="restart-all-stops-first"),
    pytest.param((member(0, S.DRAINING), member(1, S.STOPPED)), want(3, "restart_all"), [],
                 id="restart-all-waits-for-drain"),
    pytest.param((member(0, S.STOPPED), member(1, S.STOPPED)), want(3, "restart_all"),
                 [("start", "rollout-2", 1), ("start", "rollout-3", 1), ("start", "rollout-4", 1)],
                 id="restart-all-starts-target-set"),
    pytest.param((member(2, generation=2, serving=False), member(3, generation=2, serving=False)),
                 want(2, "restart_all"), [("serve", "rollout-2", "rollout-3")], id="restart-all-admits"),
    pytest.param((member(2, generation=2), member(3, generation=2)), want(2, "restart_all"), [],
                 id="restart-all-converged"),
    # ---- blue_green
    pytest.param(TWO, want(3, "blue_green"),
                 [("start", "rollout-2", 1), ("start", "rollout-3", 1), ("start", "rollout-4", 1)],
                 id="blue-green-starts-green-set"),
    pytest.param(TWO, want(3, "blue_green", train=4),
                 [("fallback", "blue_green", "diff"), ("start", "rollout-2", 1)], id="blue-green-no-spare-falls-back"),
    pytest.param(TWO + (member(2, S.LOADING, serving=False), member(3, serving=False), member(4, serving=False)),
                 want(3, "blue_green"), [], id="blue-green-waits-for-green"),
    pytest.param(TWO + (member(2, serving=False), member(3, serving=False), member(4, serving=False)),
                 want(3, "blue_green", version=5), [("publish", 5, "rollout-2", "rollout-3", "rollout-4")],
                 id="blue-green-publishes-to-green"),
    pytest.param(TWO + (member(2, serving=False), member(3, serving=False), member(4, serving=False)),
                 want(3, "blue_green"), [("serve", "rollout-2", "rollout-3", "rollout-4")], id="blue-green-flips"),
    pytest.param((member(0, serving=False), member(1, serving=False), member(2), member(3), member(4)),
                 want(3, "blue_green"), [("stop", "rollout-0", True), ("stop", "rollout-1", True)],
                 id="blue-green-drains-blue"),
    pytest.param(THREE, want(1, "blue_green"), [("serve", "rollout-0")], id="blue-green-shrink-by-flip"),
    pytest.param(TWO, want(2, "blue_green", tp=2), [("start", "rollout-2", 2), ("start", "rollout-3", 2)],
                 id="blue-green-tp-1-to-2"),
    # a serving member reloading weights in place (the RL loop's publish) is still the serving set
    pytest.param((member(0, S.LOADING, serving=True), member(1, S.STOPPED, serving=False)), want(1, "blue_green"),
                 [], id="blue-green-shrunk-set-reloading-is-done"),
    pytest.param((member(0), member(1, S.LOADING, serving=True)), want(1, "blue_green"), [("serve", "rollout-0")],
                 id="blue-green-shrink-by-flip-while-one-reloads"),
    # ---- prewarm: like blue_green, the flip waits for the trigger
    pytest.param(TWO + (member(2, serving=False), member(3, serving=False), member(4, serving=False)),
                 want(3, "prewarm", switch_now=False), [], id="prewarm-holds-until-trigger"),
    pytest.param(TWO + (member(2, serving=False, version=0), member(3, serving=False), member(4, serving=False)),
                 want(3, "prewarm", switch_now=False, version=4), [("publish", 4, "rollout-2", "rollout-3", "rollout-4")],
                 id="prewarm-keeps-standby-on-current-weights"),
    pytest.param(TWO + (member(2, serving=False), member(3, serving=False), member(4, serving=False)),
                 want(3, "prewarm"), [("serve", "rollout-2", "rollout-3", "rollout-4")], id="prewarm-flips-on-trigger"),
    pytest.param(TWO, want(3, "prewarm", switch_now=False, train=4), [], id="prewarm-no-spare-waits-for-trigger"),
    pytest.param(THREE, want(2, "prewarm", switch_now=False), [], id="prewarm-shrink-starts-nothing-before-trigger"),
    pytest.param(THREE, want(1, "prewarm"), [("serve", "rollout-0")], id="prewarm-shrink-by-flip-on-trigger"),
    # ---- cluster_swap: lacking spare GPUs, the training pool gives some up first
    pytest.param(TWO, want(3, "cluster_swap", train=4, swap=True), [("shrink_training", 1)],
                 id="cluster-swap-shrinks-training-first"),
    pytest.param(TWO, want(3, "cluster_swap", swap=True),
                 [("start", "rollout-2", 1), ("start", "rollout-3", 1), ("start", "rollout-4", 1)],
                 id="cluster-swap-with-spare-is-blue-green"),
    pytest.param((member(0, S.LOADING, serving=True), member(1, S.STOPPED, serving=False)),
                 want(1, "cluster_swap", swap=True), [], id="cluster-swap-shrunk-set-reloading-is-done"),
    # ---- every strategy: a failed member is replaced
    pytest.param((member(0), member(1, S.FAILED)), want(2), [("stop", "rollout-1", False), ("start", "rollout-2", 1)],
                 id="diff-replaces-failed"),
    pytest.param((member(0), member(1, S.FAILED)), want(2, "blue_green"),
                 [("stop", "rollout-1", False), ("start", "rollout-2", 1), ("start", "rollout-3", 1)],
                 id="blue-green-failed-blue-still-switches"),
]


@pytest.mark.parametrize(("members", "desired", "expected"), CASES)
def test_strategy_plans(members: tuple[Member, ...], desired: DesiredState, expected: list[tuple]) -> None:
    assert plan(members, desired) == expected


def test_cluster_swap_refused_without_its_switch() -> None:
    with pytest.raises(StrategyRefused, match="runtime_cluster_swap_enabled"):
        reconcile(observed(*TWO), want(3, "cluster_swap", swap=False))


def test_every_configurable_strategy_is_registered() -> None:
    from typing import get_args, get_type_hints

    from libra.config.sections import PlannerConfig

    configurable = get_args(get_type_hints(PlannerConfig)["runtime_rollout_reconfigure_strategy"])
    assert set(STRATEGIES) == set(configurable)


@pytest.mark.parametrize(
    ("members", "desired", "done"),
    [
        pytest.param(TWO, want(2), True, id="exact"),
        pytest.param(TWO, want(3), False, id="short"),
        pytest.param(TWO, want(2, tp=2), False, id="outdated"),
        pytest.param((member(0), member(1, serving=False)), want(2), False, id="not-serving"),
        pytest.param((member(0), member(1), member(2, S.DRAINING)), want(2), False, id="draining"),
        pytest.param((member(0), member(1, busy=True)), want(2), False, id="busy"),
    ],
)
def test_converged(members: tuple[Member, ...], desired: DesiredState, done: bool) -> None:
    assert converged(observed(*members), desired) is done
