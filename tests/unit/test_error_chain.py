"""The chain of causes of an error: nearest first, through `raise ... from` and errors raised while handling
another, each error once even when a chain loops."""

from __future__ import annotations

import pytest

from libra.error_chain import causes


def raised(make) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        make()
    except BaseException as exc:  # noqa: BLE001 - the error is the test's subject
        return exc
    raise AssertionError("nothing was raised")


def from_cause() -> None:
    raise RuntimeError("outer") from ValueError("inner")


def while_handling() -> None:
    try:
        raise KeyError("first")
    except KeyError:
        raise TimeoutError("second")  # noqa: B904 - the implicit context is the subject


def looped() -> BaseException:
    a, b = RuntimeError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    return a


# (id, error, the messages of its chain in order)
CHAINS = [
    ("none", None, []),
    ("alone", ValueError("only"), ["only"]),
    ("raised-from", raised(from_cause), ["outer", "inner"]),
    ("while-handling", raised(while_handling), ["second", "'first'"]),
    ("a-loop-ends", looped(), ["a", "b"]),
]


@pytest.mark.parametrize(("error", "messages"), [case[1:] for case in CHAINS], ids=[case[0] for case in CHAINS])
def test_causes(error: BaseException | None, messages: list[str]) -> None:
    assert [str(e) for e in causes(error)] == messages
