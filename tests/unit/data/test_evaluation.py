"""Held-out evaluation: accuracy and mean reward of what a generate function answers."""

from __future__ import annotations

from typing import Any

import pytest

from libra.data import Prompt, TaskSpec, build_task, evaluate


def _answer(prompt: Prompt, wrong: bool) -> str:
    a, b = int(prompt.metadata["a"]), int(prompt.metadata["b"])
    return str((a + b + (1 if wrong else 0)) % 7)


@pytest.mark.parametrize(
    ("n", "wrong_every", "format_reward", "accuracy", "reward_mean"),
    [
        pytest.param(0, 0, 0.0, 1.0, 1.0, id="all-right"),
        pytest.param(4, 2, 0.0, 0.5, 0.5, id="half-right"),
        pytest.param(4, 2, 0.5, 0.5, 0.75, id="half-right-shaped"),
        pytest.param(5, 1, 0.0, 0.0, 0.0, id="all-wrong"),
    ],
)
def test_evaluate(
    tiny_tokenizer: Any, n: int, wrong_every: int, format_reward: float, accuracy: float, reward_mean: float
) -> None:
    task = build_task(
        TaskSpec(name="mod_add", params={"modulus": 7, "format_reward": format_reward}), tiny_tokenizer
    )
    seen: list[Prompt] = []

    def generate(prompts: list[Prompt]) -> list[tuple[list[int], str]]:
        seen.extend(prompts)
        texts = [_answer(p, bool(wrong_every) and i % wrong_every == 0) for i, p in enumerate(prompts)]
        return [(tiny_tokenizer.encode(t), t) for t in texts]

    result = evaluate(generate, task, n)
    expected_count = len(task.eval_prompts(n))
    assert result == {
        "accuracy": accuracy,
        "reward_mean": pytest.approx(reward_mean),
        "num_prompts": float(expected_count),
    }
    assert [p.text for p in seen] == [p.text for p in task.eval_prompts(n)]


def test_evaluate_rejects_missing_responses(tiny_tokenizer: Any) -> None:
    task = build_task(TaskSpec(name="copy_first"), tiny_tokenizer)
    with pytest.raises(ValueError, match="returned 1 responses for 3 prompts"):
        evaluate(lambda prompts: [([], "")], task, 3)
