"""Built-in tasks: prompt texts and labels, held-out split, seeded streams and the task reward."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from libra.data import Prompt, TaskError, TaskSpec, build_task
from libra.models.tiny import SPECIAL_TOKENS, vocabulary

UNK_ID = vocabulary().index("<unk>")


def _expected_label(task: str, prompt: Prompt, params: dict[str, Any]) -> str:
    words = prompt.text.split()
    if task == "mod_add":
        a, b, m = int(words[0]), int(words[2]), int(words[4])
        assert words[1] == "+" and words[3] == "mod" and words[5] == "=" and m == params.get("modulus", 5)
        return str((a + b) % m)
    values = [int(w) for w in words[:-1] if w != ","]
    assert len(values) == params.get("length", 3)
    return str(values[0] if task == "copy_first" else max(values))


TASK_CASES = [
    pytest.param("mod_add", {"modulus": 5}, 25, id="mod_add-m5"),
    pytest.param("mod_add", {"modulus": 7, "operand_limit": 20}, 400, id="mod_add-m7-operands20"),
    pytest.param("copy_first", {"num_values": 5, "length": 3}, 125, id="copy_first-5x3"),
    pytest.param("copy_first", {"num_values": 10, "length": 2}, 100, id="copy_first-10x2"),
    pytest.param("max_of", {"num_values": 4, "length": 4}, 256, id="max_of-4x4"),
]


@pytest.mark.parametrize(("name", "params", "num_problems"), TASK_CASES)
def test_prompts_have_the_right_label_and_tokens(
    tiny_tokenizer: Any, name: str, params: dict[str, Any], num_problems: int
) -> None:
    task = build_task(TaskSpec(name=name, params=params), tiny_tokenizer)
    prompts = list(itertools.islice(task.train_prompts(seed=3), 50)) + task.eval_prompts(10)
    for prompt in prompts:
        assert prompt.label == _expected_label(name, prompt, params)
        assert prompt.token_ids == tiny_tokenizer.encode(prompt.text)
        assert UNK_ID not in prompt.token_ids, prompt.text
        assert len(prompt.label_token_ids) == 1  # a one-token answer
        assert tiny_tokenizer.decode(prompt.label_token_ids) == prompt.label


@pytest.mark.parametrize(("name", "params", "num_problems"), TASK_CASES)
def test_heldout_prompts_never_appear_in_training(
    tiny_tokenizer: Any, name: str, params: dict[str, Any], num_problems: int
) -> None:
    task = build_task(TaskSpec(name=name, params=params), tiny_tokenizer)
    held_out = {p.text for p in task.eval_prompts(0)}
    assert len(held_out) == round(num_problems * 0.2)
    one_epoch = num_problems - len(held_out)
    train = [p.text for p in itertools.islice(task.train_prompts(seed=0), 2 * one_epoch)]
    assert set(train).isdisjoint(held_out)
    assert len(set(train[:one_epoch])) == one_epoch  # an epoch visits every training problem once
    assert set(train[:one_epoch]) == set(train[one_epoch:])


@pytest.mark.parametrize(
    ("seed_a", "seed_b", "same"),
    [pytest.param(0, 0, True, id="same-seed"), pytest.param(0, 1, False, id="other-seed")],
)
def test_training_stream_is_deterministic_per_seed(
    tiny_tokenizer: Any, seed_a: int, seed_b: int, same: bool
) -> None:
    task = build_task(TaskSpec(name="mod_add", params={"modulus": 7}), tiny_tokenizer)
    first = [p.text for p in itertools.islice(task.train_prompts(seed_a), 30)]
    second = [p.text for p in itertools.islice(task.train_prompts(seed_b), 30)]
    assert (first == second) is same


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        pytest.param(0, 5, id="all"),
        pytest.param(-1, 5, id="negative-all"),
        pytest.param(3, 3, id="three"),
        pytest.param(99, 5, id="more-than-held-out"),
    ],
)
def test_eval_prompts_count(tiny_tokenizer: Any, n: int, expected: int) -> None:
    task = build_task(TaskSpec(name="mod_add", params={"modulus": 5}), tiny_tokenizer)
    prompts = task.eval_prompts(n)
    assert len(prompts) == expected
    assert [p.text for p in prompts] == [p.text for p in task.eval_prompts(0)][:expected]


def test_split_seed_changes_the_held_out_problems(tiny_tokenizer: Any) -> None:
    def held(split_seed: int) -> set[str]:
        spec = TaskSpec(name="mod_add", params={"modulus": 7, "split_seed": split_seed})
        return {p.text for p in build_task(spec, tiny_tokenizer).eval_prompts(0)}

    assert held(0) == held(0)
    assert held(0) != held(1)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


EOS = SPECIAL_TOKENS.index("</s>")


@pytest.mark.parametrize(
    ("response", "format_reward", "expected"),
    [
        pytest.param("3", 0.0, 1.0, id="right"),
        pytest.param("3 </s>", 0.0, 1.0, id="right-then-eos"),
        pytest.param("3 4", 0.1, 1.0, id="right-then-more"),
        pytest.param("4", 0.0, 0.0, id="wrong-in-format-no-shaping"),
        pytest.param("4", 0.1, 0.1, id="wrong-in-format-shaped"),
        pytest.param("17", 0.1, 0.0, id="number-outside-answer-space"),
        pytest.param("mod", 0.1, 0.0, id="not-a-number"),
        pytest.param("", 0.1, 0.0, id="empty"),
        pytest.param("4 3", 0.1, 0.1, id="right-answer-second"),
    ],
)
def test_task_reward(tiny_tokenizer: Any, response: str, format_reward: float, expected: float) -> None:
    spec = TaskSpec(name="mod_add", params={"modulus": 5, "format_reward": format_reward})
    task = build_task(spec, tiny_tokenizer)
    prompt = next(p for p in task.train_prompts(0) if p.label == "3")
    ids = _ids(tiny_tokenizer, response)
    text = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert task.reward(prompt, ids, text) == pytest.approx(expected)


def test_reward_accepts_text_when_ids_differ(tiny_tokenizer: Any) -> None:
    """A tokenizer that splits numbers differently still gets credit through the response text."""
    task = build_task(TaskSpec(name="copy_first"), tiny_tokenizer)
    prompt = next(task.train_prompts(0))
    assert task.reward(prompt, [EOS], f"{prompt.label} ") == 1.0


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        pytest.param("mod_add", {"modulus": 1}, "task.params.modulus: 1", id="modulus-too-small"),
        pytest.param("mod_add", {"modulus": "five"}, "not of type int", id="modulus-not-int"),
        pytest.param("mod_add", {"modulus": 5.0}, "not of type int", id="modulus-float"),
        pytest.param("mod_add", {"holdout_fraction": 1.0}, "holdout_fraction", id="no-training-problems"),
        pytest.param("mod_add", {"holdout_fraction": 0}, "holdout_fraction", id="no-held-out-problems"),
        pytest.param("mod_add", {"operand_limit": -2}, "operand_limit", id="negative-operands"),
        pytest.param("copy_first", {"length": 0}, "task.params.length: 0", id="empty-list"),
        pytest.param("max_of", {"num_values": 200, "length": 4}, "limit", id="too-many-problems"),
        pytest.param("mod_add", {"modulos": 5}, "unknown key(s) modulos", id="misspelt-key"),
        pytest.param("copy_first", {"modulus": 5}, "known keys: format_reward", id="key-of-another-task"),
        pytest.param("mod_sub", {}, "unknown task (task.name) 'mod_sub'", id="unknown-task"),
    ],
)
def test_bad_params_are_clear_errors(
    tiny_tokenizer: Any, name: str, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(TaskError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_task(TaskSpec(name=name, params=params), tiny_tokenizer)
