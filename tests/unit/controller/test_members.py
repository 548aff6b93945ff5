"""Transition table of pool members: legal and illegal moves, history, timeouts."""

from __future__ import annotations

import pytest

from libra.controller.members import (
    TRANSITIONS,
    InvalidTransition,
    Member,
    MemberState,
    StateTimeouts,
)

S = MemberState


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        pytest.param([S.STARTING, S.LOADING, S.READY, S.DRAINING, S.STOPPED], True, id="main-line"),
        pytest.param([S.STARTING, S.READY, S.LOADING, S.READY], True, id="reload-weights"),
        pytest.param([S.STARTING, S.FAILED, S.STOPPED], True, id="fail-then-stop"),
        pytest.param([S.STOPPED], True, id="cancel-pending"),
        pytest.param([S.READY], False, id="pending-to-ready-directly"),
        pytest.param([S.STARTING, S.STOPPED, S.STARTING], False, id="stopped-is-terminal"),
        pytest.param([S.STARTING, S.FAILED, S.READY], False, id="failed-cannot-recover"),
        pytest.param([S.STARTING, S.READY, S.DRAINING, S.READY], False, id="draining-is-one-way"),
    ],
)
def test_move_follows_table(path: list[MemberState], ok: bool) -> None:
    member = Member.new("m", "rollout", now=0.0)
    if ok:
        for i, state in enumerate(path):
            member.move(state, float(i + 1), "test")
        assert member.state == path[-1]
        assert [t.target for t in member.history[1:]] == path
        assert [t.at for t in member.history[1:]] == [float(i + 1) for i in range(len(path))]
    else:
        with pytest.raises(InvalidTransition, match="not in the transition table"):
            for i, state in enumerate(path):
                member.move(state, float(i + 1), "test")


def test_every_state_has_a_row_and_stopped_is_terminal() -> None:
    assert set(TRANSITIONS) == set(MemberState)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    for state in MemberState:
        if state is not S.STOPPED:
            assert S.STOPPED in TRANSITIONS[state] or state is S.DRAINING and S.STOPPED in TRANSITIONS[state]


@pytest.mark.parametrize(
    ("start", "target", "expected"),
    [
        pytest.param(S.PENDING, S.READY, [S.STARTING, S.LOADING, S.READY], id="pending-ready-fills-gaps"),
        pytest.param(S.STARTING, S.READY, [S.LOADING, S.READY], id="starting-ready"),
        pytest.param(S.READY, S.LOADING, [S.LOADING], id="backwards-is-one-move"),
        pytest.param(S.LOADING, S.FAILED, [S.FAILED], id="off-main-line"),
    ],
)
def test_advance_records_intermediate_states(start: MemberState, target: MemberState,
                                             expected: list[MemberState]) -> None:
    member = Member(id="m", pool="rollout", state=start, since=0.0)
    transitions = member.advance(target, 5.0, "observed")
    assert [t.target for t in transitions] == expected
    assert member.state == target and member.since == 5.0


def test_failed_records_error() -> None:
    member = Member.new("m", "train", now=0.0)
    member.move(S.FAILED, 1.0, "out of memory")
    assert member.error == "out of memory"
    assert member.to_dict()["history"][-1] == {"at": 1.0, "from": "PENDING", "to": "FAILED", "reason": "out of memory"}


@pytest.mark.parametrize(
    ("state", "age", "timed_out"),
    [
        pytest.param(S.STARTING, 599.0, False, id="starting-within"),
        pytest.param(S.STARTING, 601.0, True, id="starting-over"),
        pytest.param(S.LOADING, 901.0, True, id="loading-over"),
        pytest.param(S.DRAINING, 181.0, True, id="draining-over"),
        pytest.param(S.READY, 1e9, False, id="ready-never"),
        pytest.param(S.STOPPED, 1e9, False, id="stopped-never"),
    ],
)
def test_timeouts(state: MemberState, age: float, timed_out: bool) -> None:
    member = Member(id="m", pool="rollout", state=state, since=100.0)
    assert member.timed_out(100.0 + age, StateTimeouts()) is timed_out
