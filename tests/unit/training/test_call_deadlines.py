"""The hang rule of the training pool's collective calls: how long the next call of a kind may run."""

from __future__ import annotations

import pytest

from libra.training.call_deadlines import CallDeadlines, HangRule


@pytest.mark.parametrize(
    ("rule", "completed", "kind", "deadline"),
    [
        pytest.param(HangRule(300, 10), [], "train_step", 3600, id="first-call-waits-the-first-call-deadline"),
        pytest.param(HangRule(5000, 10), [], "train_step", 5000, id="first-call-never-below-the-timeout"),
        pytest.param(HangRule(300, 10), [("train_step", 2.0)], "train_step", 300, id="fast-calls-keep-the-timeout"),
        pytest.param(HangRule(300, 10), [("train_step", 40.0), ("train_step", 25.0)], "train_step", 400,
                     id="factor-times-the-slowest"),
        pytest.param(HangRule(300, 0), [("train_step", 40.0)], "train_step", 300, id="factor-0-the-timeout-alone"),
        pytest.param(HangRule(30, 10), [("train_step", 40.0)], "export_hf", 3600, id="each-kind-its-own-history"),
        pytest.param(HangRule(30, 10, first_call_s=60), [("export_hf", 1.0)], "export_hf", 30,
                     id="history-of-the-kind"),
    ],
)
def test_deadline(rule: HangRule, completed: list[tuple[str, float]], kind: str, deadline: float) -> None:
    deadlines = CallDeadlines(rule)
    for name, seconds in completed:
        deadlines.completed(name, seconds)
    assert deadlines.deadline(kind) == pytest.approx(deadline)


def test_a_new_size_or_layout_forgets_the_history() -> None:
    deadlines = CallDeadlines(HangRule(30, 10, first_call_s=900))
    deadlines.at((2, "tp2"))
    deadlines.completed("train_step", 12.0)
    deadlines.at((2, "tp2"))  # started again at the same shape (a pool replaced after a lost worker)
    assert deadlines.deadline("train_step") == 120
    deadlines.at((4, "tp2"))
    assert deadlines.deadline("train_step") == 900 and deadlines.history() == {}


@pytest.mark.parametrize("fields", [
    pytest.param({"timeout_s": 0, "factor": 10}, id="timeout-0"),
    pytest.param({"timeout_s": 30, "factor": -1}, id="negative-factor"),
    pytest.param({"timeout_s": 30, "factor": 1, "first_call_s": 0}, id="first-call-0"),
])
def test_a_rule_that_could_never_wait_is_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="hang rule"):
        HangRule(**fields)
