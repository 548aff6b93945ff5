"""The reward registry: built-in rewards, parameters bound from task.params, custom registration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from libra.data import Prompt, TaskError, make_reward, register_reward, reward_names, reward_params
from libra.data.rewards import last_number


def _prompt(label: str, label_ids: Sequence[int] = ()) -> Prompt:
    return Prompt(text="q", token_ids=[1], label=label, label_token_ids=list(label_ids))


@pytest.mark.parametrize(
    ("name", "label", "response", "params", "expected"),
    [
        pytest.param("exact_match", "42", "42", {}, 1.0, id="exact-same"),
        pytest.param("exact_match", "42", "  42\n", {}, 1.0, id="exact-whitespace"),
        pytest.param("exact_match", "a  b", "a b", {}, 1.0, id="exact-inner-whitespace"),
        pytest.param("exact_match", "42", "42 apples", {}, 0.0, id="exact-extra-words"),
        pytest.param("exact_match", "42", "42 apples", {"first_word_only": True}, 1.0, id="exact-first-word"),
        pytest.param("exact_match", "Paris", "paris", {}, 0.0, id="exact-case"),
        pytest.param("exact_match", "Paris", "paris", {"ignore_case": 1}, 1.0, id="exact-ignore-case"),
        pytest.param("numeric_match", "12", "so the answer is 12", {}, 1.0, id="numeric-last-number"),
        pytest.param("numeric_match", "12", "12 or maybe 13", {}, 0.0, id="numeric-last-wins"),
        pytest.param("numeric_match", "1000", "it is 1,000.", {}, 1.0, id="numeric-thousands"),
        pytest.param("numeric_match", "0.5", "about .5", {}, 1.0, id="numeric-leading-dot"),
        pytest.param("numeric_match", "-3", "x = -3", {}, 1.0, id="numeric-negative"),
        pytest.param("numeric_match", "#### 7", "7.0", {}, 1.0, id="numeric-label-with-text"),
        pytest.param("numeric_match", "1", "1.05", {"rel_tol": 0.1}, 1.0, id="numeric-tolerance"),
        pytest.param("numeric_match", "1", "no number", {}, 0.0, id="numeric-none"),
        pytest.param("numeric_match", "n/a", "1", {}, 0.0, id="numeric-label-without-number"),
        pytest.param("contains", "blue", "the sky is blue today", {}, 1.0, id="contains-yes"),
        pytest.param("contains", "Blue", "the sky is blue", {}, 0.0, id="contains-case"),
        pytest.param(
            "contains", "Blue", "the sky is blue", {"ignore_case": True}, 1.0, id="contains-ignore-case"
        ),
        pytest.param("contains", "", "anything", {}, 0.0, id="contains-empty-label"),
    ],
)
def test_text_rewards(name: str, label: str, response: str, params: dict[str, Any], expected: float) -> None:
    assert make_reward(name, params)(_prompt(label), [], response) == expected


@pytest.mark.parametrize(
    ("label_ids", "response_ids", "text", "expected"),
    [
        pytest.param([7], [7, 2], "", 1.0, id="ids-prefix"),
        pytest.param([7, 8], [7, 8], "", 1.0, id="two-token-label"),
        pytest.param([7, 8], [7], "", 0.0, id="response-too-short"),
        pytest.param([7], [8, 7], "", 0.0, id="label-not-first"),
        pytest.param([], [], "", 0.0, id="empty-label"),
        pytest.param([7], [99], "5 and more", 1.0, id="text-first-word"),
    ],
)
def test_first_tokens_match(
    label_ids: list[int], response_ids: list[int], text: str, expected: float
) -> None:
    label = "5" if label_ids else ""
    assert make_reward("first_tokens_match")(_prompt(label, label_ids), response_ids, text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("none here", None, id="none"),
        pytest.param("3 then 4", 4.0, id="last"),
        pytest.param("1e3", 1000.0, id="exponent"),
        pytest.param("-2.5", -2.5, id="negative-decimal"),
        pytest.param("12,345 items", 12345.0, id="thousands"),
    ],
)
def test_last_number(text: str, expected: float | None) -> None:
    assert last_number(text) == expected


def test_builtin_reward_names_and_params() -> None:
    assert {"exact_match", "numeric_match", "contains", "first_tokens_match"} <= set(reward_names())
    assert reward_params("numeric_match") == {"rel_tol": 1e-6, "abs_tol": 1e-9}
    assert reward_params("first_tokens_match") == {}


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        pytest.param("exact", {}, "unknown reward", id="unknown-name"),
        pytest.param("numeric_match", {"rel_tol": "small"}, "task.params.rel_tol", id="wrong-type"),
        pytest.param("contains", {"ignore_case": 2}, "task.params.ignore_case", id="bool-out-of-range"),
    ],
)
def test_reward_errors(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(TaskError, match=message):
        make_reward(name, params)


def test_custom_reward_is_registered_with_its_params() -> None:
    @register_reward("test_length_penalty")
    def length_penalty(
        prompt: Prompt, response_token_ids: Sequence[int], response_text: str, *, max_tokens: int = 4
    ) -> float:
        return 1.0 if len(response_token_ids) <= max_tokens else 0.0

    assert "test_length_penalty" in reward_names()
    assert reward_params("test_length_penalty") == {"max_tokens": 4}
    fn = make_reward("test_length_penalty", {"max_tokens": 2, "unrelated": "ignored"})
    assert fn(_prompt("x"), [1, 2], "") == 1.0
    assert fn(_prompt("x"), [1, 2, 3], "") == 0.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length_penalty")(lambda p, ids, text: 0.0)
