"""Task registry: building tasks from the configuration, custom tasks, reward override, tokenizer adapter."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from libra.config import TaskConfig
from libra.data import (
    Prompt,
    Task,
    TaskError,
    TaskSpec,
    as_encode,
    build_task,
    make_prompt,
    register_task,
    task_names,
    task_params,
)
from libra.data.prompt import Encode


def test_builtin_task_names_and_params() -> None:
    assert {"mod_add", "copy_first", "max_of", "dataset"} <= set(task_names())
    assert task_params("mod_add")["modulus"] == 5
    assert set(task_params("copy_first")) == {
        "num_values",
        "length",
        "holdout_fraction",
        "split_seed",
        "format_reward",
    }


def test_spec_from_the_job_configuration(tiny_tokenizer: Any) -> None:
    section = TaskConfig(name="mod_add", params={"modulus": 7}, eval_size=4, input_key="q", label_key="a")
    spec = TaskSpec.from_config(section)
    assert spec == TaskSpec(name="mod_add", params={"modulus": 7}, input_key="q", label_key="a")
    task = build_task(section, tiny_tokenizer)
    assert isinstance(task, Task)
    assert all(p.text.endswith("mod 7 =") for p in task.eval_prompts(4))


@pytest.mark.parametrize(
    ("reward", "params", "response", "expected"),
    [
        pytest.param("", {"format_reward": 0.2}, "wrong", 0.2, id="task-reward-with-shaping"),
        pytest.param("exact_match", {"format_reward": 0.2}, "wrong", 0.0, id="registry-reward-replaces-it"),
        pytest.param("exact_match", {}, "right", 1.0, id="registry-reward-right"),
        pytest.param("contains", {"ignore_case": True}, "RIGHT", 1.0, id="registry-reward-params"),
    ],
)
def test_reward_override(
    tiny_tokenizer: Any, reward: str, params: dict[str, Any], response: str, expected: float
) -> None:
    task = build_task(
        TaskSpec(name="mod_add", params={"modulus": 5, **params}, reward=reward), tiny_tokenizer
    )
    prompt = next(task.train_prompts(0))
    wrong = str((int(prompt.label) + 1) % 5)
    text = {"wrong": wrong, "right": prompt.label, "RIGHT": prompt.label.upper()}[response]
    assert task.reward(prompt, tiny_tokenizer.encode(text), text) == expected


def test_reward_params_are_known_keys(tiny_tokenizer: Any) -> None:
    build_task(TaskSpec(name="mod_add", params={"rel_tol": 0.1}, reward="numeric_match"), tiny_tokenizer)
    with pytest.raises(TaskError, match="unknown key.*rel_tol.*with reward 'exact_match'"):
        build_task(TaskSpec(name="mod_add", params={"rel_tol": 0.1}, reward="exact_match"), tiny_tokenizer)


class _Echo:
    """A custom task: the answer is the prompt's single number."""

    name = "test_echo"
    PARAMS = {"top": 3}

    def __init__(self, spec: TaskSpec, encode: Encode) -> None:
        self.top = int(spec.params.get("top", self.PARAMS["top"]))
        self.encode = encode

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        for i in itertools.count():
            yield make_prompt(self.encode, f"{(i + seed) % self.top} ?", str((i + seed) % self.top))

    def eval_prompts(self, n: int) -> list[Prompt]:
        return [make_prompt(self.encode, f"{self.top} ?", str(self.top))]

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int], response_text: str) -> float:
        return float(response_text.strip() == prompt.label)


def test_custom_task_registration(tiny_tokenizer: Any) -> None:
    register_task("test_echo")(_Echo)
    assert "test_echo" in task_names()
    task = build_task(TaskSpec(name="test_echo", params={"top": 4}), tiny_tokenizer)
    assert [p.text for p in itertools.islice(task.train_prompts(1), 4)] == ["1 ?", "2 ?", "3 ?", "0 ?"]
    with pytest.raises(TaskError, match="unknown key.*colour.*known keys: top"):
        build_task(TaskSpec(name="test_echo", params={"colour": "red"}), tiny_tokenizer)
    with pytest.raises(ValueError, match="already registered"):
        register_task("test_echo")(lambda spec, encode: _Echo(spec, encode))


class _WhitespaceIds:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


@pytest.mark.parametrize(
    "tokenizer",
    [
        pytest.param(_WhitespaceIds(), id="object-with-encode"),
        pytest.param(lambda text: [len(w) for w in text.split()], id="callable"),
    ],
)
def test_as_encode(tokenizer: Any) -> None:
    assert as_encode(tokenizer)("ab c defg") == [2, 1, 4]


def test_as_encode_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="encode"):
        as_encode(42)


def test_hf_tokenizer_ids_travel(tiny_tokenizer: Any) -> None:
    prompt = make_prompt(as_encode(tiny_tokenizer), "3 + 4 mod 5 =", "2")
    assert prompt.token_ids == tiny_tokenizer.encode("3 + 4 mod 5 =")
    assert tiny_tokenizer.decode(prompt.token_ids) == "3 + 4 mod 5 ="
    assert prompt.label_token_ids == tiny_tokenizer.encode("2")


def test_task_modules_from_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, tiny_tokenizer: Any
) -> None:
    (tmp_path / "job_rewards_for_test.py").write_text(
        "from libra.data import register_reward\n\n"
        "@register_reward('test_always_half')\n"
        "def always_half(prompt, response_token_ids, response_text):\n"
        "    return 0.5\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LIBRA_TASK_MODULES", " job_rewards_for_test , ")
    task = build_task(TaskSpec(name="copy_first", reward="test_always_half"), tiny_tokenizer)
    assert task.reward(next(task.train_prompts(0)), [], "") == 0.5
    monkeypatch.setenv("LIBRA_TASK_MODULES", "no_such_module_for_test")
    with pytest.raises(TaskError, match="LIBRA_TASK_MODULES: cannot import 'no_such_module_for_test'"):
        task_names()
