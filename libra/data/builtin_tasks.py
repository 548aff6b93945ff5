"""Built-in verifiable tasks with a one-token answer that a tiny random model learns with RL on a CPU:
`mod_add` ("a + b mod m =" -> (a + b) % m), `copy_first` ("7 3 9 ?" -> 7) and `max_of` ("7 , 3 , 9 =" -> 9).

Each task enumerates a finite set of problems, holds out a fixed share of them for evaluation (never
trained on) and streams the rest in a seeded shuffled order, epoch after epoch. The reward is 1.0 for the
right answer (the response starts with the label's tokens, or its first word is the label), an optional
`format_reward` for an answer of the right kind that is wrong, and 0.0 otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from libra.data.prompt import Encode, ParamValue, Prompt, TaskError, first_word, make_prompt, starts_with_ids
from libra.data.registry import TaskSpec, register_task, resolve_params

MAX_PROBLEMS = 10_000_000
_SPLIT_PARAMS: dict[str, ParamValue] = {"holdout_fraction": 0.2, "split_seed": 0, "format_reward": 0.0}


class EnumeratedTask:
    """A task over problems numbered 0..num_problems-1, split once into training and held-out problems."""

    name: str = ""
    PARAMS: ClassVar[dict[str, ParamValue]] = dict(_SPLIT_PARAMS)

    def __init__(self, spec: TaskSpec, encode: Encode) -> None:
        self.params = resolve_params(f"task '{self.name}'", self.PARAMS, spec.params)
        self.encode = encode
        self.check_params()
        count = self.num_problems()
        if count > MAX_PROBLEMS:
            raise TaskError(
                f"task '{self.name}' has {count} problems (limit {MAX_PROBLEMS})",
                field="task.params",
                value=dict(spec.params),
                fix="use smaller size params",
            )
        fraction = float(self.params["holdout_fraction"])
        if not 0.0 < fraction < 1.0:
            raise TaskError(
                f"{fraction} must be between 0 and 1 (exclusive), so that there are both training and held-out "
                "problems",
                field="task.params.holdout_fraction",
                value=fraction,
                fix="use a share such as 0.2",
            )
        if count < 2:
            raise TaskError(
                f"task '{self.name}' has only {count} problem(s)",
                field="task.params",
                value=dict(spec.params),
                fix="increase its size params",
            )
        n_eval = min(count - 1, max(1, round(count * fraction)))
        order = np.random.default_rng(int(self.params["split_seed"])).permutation(count)
        self.eval_ids: np.ndarray = order[:n_eval]
        self.train_ids: np.ndarray = np.sort(order[n_eval:])
        self.answers = frozenset(self.answer_space())
        single = [encode(a) for a in self.answers]
        self.answer_ids = frozenset(ids[0] for ids in single if len(ids) == 1)

    @property
    def num_train_prompts(self) -> int:
        return len(self.train_ids)

    @property
    def num_eval_prompts(self) -> int:
        return len(self.eval_ids)

    # Subclasses define the problems.
    def check_params(self) -> None:
        raise NotImplementedError

    def num_problems(self) -> int:
        raise NotImplementedError

    def problem(self, index: int) -> tuple[str, str, dict[str, Any]]:
        """(prompt text, label, metadata) of problem `index`."""
        raise NotImplementedError

    def answer_space(self) -> list[str]:
        raise NotImplementedError

    def prompt(self, index: int) -> Prompt:
        text, label, metadata = self.problem(index)
        return make_prompt(self.encode, text, label, {"problem": int(index), **metadata})

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = np.random.default_rng(seed)
        while True:
            for index in rng.permutation(self.train_ids):
                yield self.prompt(int(index))

    def eval_prompts(self, n: int) -> list[Prompt]:
        chosen = self.eval_ids if n <= 0 else self.eval_ids[:n]
        return [self.prompt(int(i)) for i in chosen]

    def reward(self, prompt: Prompt, response_token_ids: Sequence[int], response_text: str) -> float:
        word = first_word(response_text)
        if starts_with_ids(response_token_ids, prompt.label_token_ids) or word == prompt.label:
            return 1.0
        in_format = word in self.answers or (
            len(response_token_ids) > 0 and response_token_ids[0] in self.answer_ids
        )
        return float(self.params["format_reward"]) if in_format else 0.0


def _positive(task: str, params: Mapping[str, Any], key: str, minimum: int = 1) -> int:
    value = int(params[key])
    if value < minimum:
        raise TaskError(
            f"{value} for task '{task}' must be at least {minimum}",
            field=f"task.params.{key}",
            value=value,
            fix=f"set it to {minimum} or more",
        )
    return value


@register_task("mod_add")
class ModAdd(EnumeratedTask):
    """ "a + b mod m =" -> (a + b) % m, with operands in 0..operand_limit-1 (operand_limit 0 means m)."""

    name = "mod_add"
    PARAMS: ClassVar[dict[str, ParamValue]] = {"modulus": 5, "operand_limit": 0, **_SPLIT_PARAMS}

    def check_params(self) -> None:
        self.modulus = _positive(self.name, self.params, "modulus", 2)
        self.limit = int(self.params["operand_limit"]) or self.modulus
        if self.limit < 1:
            raise TaskError(
                f"{self.limit} must be at least 1 (or 0 for the modulus)",
                field="task.params.operand_limit",
                value=self.limit,
                fix="set it to 0 (operands below the modulus) or a positive limit",
            )

    def num_problems(self) -> int:
        return self.limit * self.limit

    def problem(self, index: int) -> tuple[str, str, dict[str, Any]]:
        a, b = divmod(index, self.limit)
        return f"{a} + {b} mod {self.modulus} =", str((a + b) % self.modulus), {"a": a, "b": b}

    def answer_space(self) -> list[str]:
        return [str(i) for i in range(self.modulus)]


class _ListTask(EnumeratedTask):
    """Problems are lists of `length` values from 0..num_values-1."""

    PARAMS: ClassVar[dict[str, ParamValue]] = {"num_values": 5, "length": 3, **_SPLIT_PARAMS}

    def check_params(self) -> None:
        self.num_values = _positive(self.name, self.params, "num_values", 2)
        self.length = _positive(self.name, self.params, "length", 1)

    def num_problems(self) -> int:
        return int(self.num_values**self.length)

    def values(self, index: int) -> list[int]:
        digits = []
        for _ in range(self.length):
            index, digit = divmod(index, self.num_values)
            digits.append(digit)
        return digits[::-1]

    def answer_space(self) -> list[str]:
        return [str(i) for i in range(self.num_values)]


@register_task("copy_first")
class CopyFirst(_ListTask):
    """ "7 3 9 ?" -> 7: repeat the first value of the list."""

    name = "copy_first"

    def problem(self, index: int) -> tuple[str, str, dict[str, Any]]:
        values = self.values(index)
        return " ".join(map(str, values)) + " ?", str(values[0]), {"values": values}


@register_task("max_of")
class MaxOf(_ListTask):
    """ "7 , 3 , 9 =" -> 9: the largest value of the list."""

    name = "max_of"

    def problem(self, index: int) -> tuple[str, str, dict[str, Any]]:
        values = self.values(index)
        return " , ".join(map(str, values)) + " =", str(max(values)), {"values": values}
