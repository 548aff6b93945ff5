"""The pure reconciler, from tables of (observed, desired) -> expected actions."""

from __future__ import annotations

import pytest

from libra.controller.members import Member, MemberState, StateTimeouts
from libra.controller.reconcile import (
    CreateRolloutPool,
    CreateTrainingPool,
    MarkFailed,
    StartRolloutInstance,
    StopRolloutInstance,
    reconcile,
)
from libra.controller.state import DesiredState, ObservedState, PoolObservation, TrainLayout

S = MemberState
NOW = 1000.0


def desired(instances: int = 2, train_gpus: int = 2, drain: bool = True) -> DesiredState:
    return DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=train_gpus,
                        train_layout=TrainLayout(), drain_before_stop=drain)


def rollout(*states: MemberState, since: float = NOW - 10, busy: bool = False) -> tuple[Member, ...]:
    """Serving members on weights v0 (ready ones serve), TP 1."""
    return tuple(
        Member(id=f"rollout-{i}", pool="rollout", state=s, since=since + i, key=f"k{i}", busy=busy, tp=1,
               weight_version=0, serving=s == S.READY)
        for i, s in enumerate(states)
    )


def training(n: int = 2) -> tuple[Member, ...]:
    return tuple(Member(id=f"train-{i}", pool="train", state=S.READY, since=0.0, key=f"r{i}") for i in range(n))


UP = PoolObservation(created=True)


def summary(actions: list) -> list[tuple]:
    out = []
    for a in actions:
        if isinstance(a, CreateRolloutPool):
            out.append(("create_rollout", a.num_instances))
        elif isinstance(a, CreateTrainingPool):
            out.append(("create_train", a.gpus))
        elif isinstance(a, StartRolloutInstance):
            out.append(("add", a.member_id))
        elif isinstance(a, StopRolloutInstance):
            out.append(("stop", a.member_id, a.drain))
        elif isinstance(a, MarkFailed):
            out.append(("fail", a.member_id))
    return out


CASES = [
    pytest.param(ObservedState(now=NOW), desired(), [("create_rollout", 2), ("create_train", 2)], id="fresh-job"),
    pytest.param(ObservedState(now=NOW, rollout=PoolObservation(busy=True), train=PoolObservation(busy=True)),
                 desired(), [], id="both-pools-being-created"),
    pytest.param(ObservedState(now=NOW, rollout=PoolObservation(retry_at=NOW + 5), train=UP, members=training()),
                 desired(), [], id="rollout-create-backing-off"),
    pytest.param(ObservedState(now=NOW, rollout=PoolObservation(retry_at=NOW - 1), train=UP, members=training()),
                 desired(), [("create_rollout", 2)], id="rollout-create-retry-after-backoff"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP, members=rollout(S.READY, S.READY) + training()),
                 desired(), [], id="steady-state"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP, members=rollout(S.READY) + training()),
                 desired(), [("add", "rollout-1")], id="one-missing"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP, members=rollout(S.READY, S.FAILED) + training()),
                 desired(), [("stop", "rollout-1", False), ("add", "rollout-2")], id="replace-failed"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP,
                               members=rollout(S.READY, S.STOPPED, S.STARTING) + training()),
                 desired(), [], id="stopped-ignored-starting-counts"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP,
                               members=rollout(S.READY, S.READY, S.READY, S.STARTING) + training()),
                 desired(2), [("stop", "rollout-3", False), ("stop", "rollout-2", True)], id="surplus-not-ready-first"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP,
                               members=rollout(S.READY, S.READY, S.READY) + training()),
                 desired(2, drain=False), [("stop", "rollout-2", False)], id="surplus-no-drain"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP,
                               members=rollout(S.STARTING, S.READY, since=NOW - 700) + training()),
                 desired(), [("fail", "rollout-0"), ("stop", "rollout-0", False), ("add", "rollout-2")],
                 id="starting-timeout-replaced"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP,
                               members=rollout(S.FAILED, S.READY, busy=True) + training()),
                 desired(), [("add", "rollout-2")], id="busy-failed-member-not-stopped-twice"),
    pytest.param(ObservedState(now=NOW, rollout=UP, train=UP, members=rollout(S.READY) + training()),
                 desired(0, 2), [("stop", "rollout-0", True)], id="scale-to-zero"),
    pytest.param(ObservedState(now=NOW, rollout=UP, members=rollout(S.READY, S.READY)),
                 desired(2, 0), [], id="no-training-wanted"),
]


@pytest.mark.parametrize(("observed", "want", "expected"), CASES)
def test_reconcile_table(observed: ObservedState, want: DesiredState, expected: list[tuple]) -> None:
    assert summary(reconcile(observed, want)) == expected


def test_reconcile_is_pure_and_deterministic() -> None:
    observed = ObservedState(now=NOW, rollout=UP, train=UP, members=rollout(S.READY, S.FAILED) + training())
    before = [m.to_dict() for m in observed.members]
    first = reconcile(observed, desired())
    second = reconcile(observed, desired())
    assert first == second
    assert [m.to_dict() for m in observed.members] == before


def test_create_names_members_and_layout() -> None:
    want = DesiredState(rollout_instances=3, rollout_tp=1, train_gpus=4, train_layout=TrainLayout(tp=2))
    actions = reconcile(ObservedState(now=NOW), want)
    create_rollout, create_train = actions
    assert isinstance(create_rollout, CreateRolloutPool) and create_rollout.member_ids == (
        "rollout-0", "rollout-1", "rollout-2")
    assert isinstance(create_train, CreateTrainingPool)
    assert create_train.layout.tp == 2 and create_train.member_ids == tuple(f"train-{i}" for i in range(4))


def test_unknown_strategy_is_named() -> None:
    observed = ObservedState(now=NOW, rollout=UP, train=UP, members=training())
    with pytest.raises(KeyError, match="unknown rollout reconfigure strategy 'warp'"):
        reconcile(observed, desired().evolve("test", reconfigure_strategy="warp"))


def test_custom_timeouts() -> None:
    observed = ObservedState(now=NOW, rollout=UP, train=UP,
                             members=rollout(S.LOADING, S.READY, since=NOW - 30) + training())
    assert summary(reconcile(observed, desired(), StateTimeouts(loading_s=20)))[0] == ("fail", "rollout-0")
